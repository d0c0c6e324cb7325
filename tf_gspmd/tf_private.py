"""TensorFlow's private API, imported in this one module, each name with why no public API serves.

Only the symbols the runtime (`tf_gspmd/runtime/`) needs: this is the front helper's
part; the lead merges it with the module the packages helper writes for the rest.
"""

# The eager context: `context().abort_collective_ops` (the watchdog fails every pending
# collective of the process at once; no public API aborts collectives),
# `context().function_call_options` and `FunctionCallOptions` (the per-thread config a
# tf.function call runs with: `without_grappler` turns Grappler off there; tf.config sets
# only process-wide options), and `get_server_def` (where `connect_to_cluster` keeps the
# ClusterDef: the addresses of the tasks, to name a lost one).
from tensorflow.python.eager import context

# `get_read_only_resource_input_indices_graph` and `READ_ONLY_RESOURCE_INPUTS_ATTR`: the
# read-only mark TF's own call ops carry, which the launcher's hand-made call ops need so
# that partitions sharing a variable they only read are not serialized (public call paths
# cost ~7 ms of Python per call op).
from tensorflow.python.framework import auto_control_deps_utils

# Collective V2 ops with ordering tokens (`all_reduce_v2`, `all_gather_v2`, `all_to_all_v2`,
# `broadcast_send_v2`/`broadcast_recv_v2`): the wrappers over the raw ops that fill in the
# communication hint, timeout and ordering token; tf.raw_ops has only the bare ops, every
# input spelled by hand, and tf.distribute hides them behind a strategy the launcher does
# not use.
from tensorflow.python.ops import collective_ops

__all__ = ['auto_control_deps_utils', 'collective_ops', 'context']
