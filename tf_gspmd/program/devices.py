"""Device names as TF lists them, for comparing a name given by a user with TF's own."""

import tensorflow as tf


def full_device_name(device: str) -> str:
  """`device` with TF's defaults filled in ('/device:CPU:1' ->
  '/job:localhost/replica:0/task:0/device:CPU:1'), the form `tf.config.list_logical_devices`
  names devices in."""
  spec = tf.DeviceSpec.from_string(device)
  full = tf.DeviceSpec(
    job=spec.job or 'localhost',
    replica=spec.replica or 0,
    task=spec.task or 0,
    device_type=spec.device_type,
    device_index=spec.device_index,
  )
  return full.to_string()
