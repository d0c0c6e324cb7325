"""What tf_gspmd raises when it refuses its input: `Unsupported`.

A valid TF program with valid shardings that tf_gspmd cannot partition (an op without a
kernel or local computation here, a shape only known at run time, an annotation no P(...)
on the mesh can say, a dtype a collective cannot move) is refused with `Unsupported`, whose
message names the op, tensor and sharding. It is a ValueError, so code catching those keeps
working; any other exception from inside tf_gspmd is a bug or a mistake of the caller (the
fuzzers count it as a crash, `tf_gspmd.testing.fuzz.classify`).
"""


class Unsupported(ValueError):
  """tf_gspmd cannot partition this (valid) program as annotated; the message says what."""

  # Raised inside a tf.function (the partitioner runs in one), an error comes out of TF's
  # autograph as its own type only if that type is built as Exception is; any other type
  # comes out as a StagingError, and the refusal would not read as one.
  __init__ = Exception.__init__
