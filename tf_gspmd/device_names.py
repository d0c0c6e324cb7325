"""TF device names in one spelling, so names from different sources compare equal."""

import tensorflow as tf


def full_name(device: str) -> str:
  """`device` with job, replica and task spelled out ('/cpu:0' -> '/job:localhost/replica:0/...').

  The names `tf.config.list_logical_devices()` gives are full; a user's or an export's may
  leave the job, replica or task out. A device index left out stays out.
  """
  spec = tf.DeviceSpec.from_string(device)
  return tf.DeviceSpec(
    job=spec.job or 'localhost',
    replica=spec.replica or 0,
    task=spec.task or 0,
    device_type=spec.device_type,
    device_index=spec.device_index,
  ).to_string()
