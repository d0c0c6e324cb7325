"""Which Grappler passes rewrite a partitioned program, and calls made without Grappler.

TF instantiates the per-partition function once per device, and each instantiation
runs Grappler over the whole body again: N times the graph optimization an
unpartitioned step pays once. By default no pass runs on it (`call_config`);
TF_GSPMD_GRAPPLER brings passes back (a comma-separated list such as 'remapping',
'all' for TF's default pipeline, 'none' for none).
"""

import contextlib
import os

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from tf_gspmd.tf_private import context

DEFAULT_GRAPPLER = ()
GRAPPLER_PASSES = (
  'constant_folding',
  'arithmetic_optimization',
  'layout_optimizer',
  'dependency_optimization',
  'loop_optimization',
  'function_optimization',
  'shape_optimization',
  'remapping',
  'debug_stripper',
  'pin_to_host_optimization',
  'implementation_selector',
  'common_subgraph_elimination',
)


_NO_GRAPPLER_OPTIONS = {}  # (the caller's config, executor type) -> the same, Grappler off


def without_grappler():
  """Runs the tf.function calls inside without Grappler (a context manager).

  For functions that are run a few times or are mostly data movement, where
  Grappler's pipeline costs more than it saves. The outer launch function: it is
  small (splits, N call ops, assembly), but Grappler run on it also specializes the
  per-partition function per call site (each partition's id is a constant, its
  unused outputs differ) and optimizes every copy with the full pipeline: N more
  optimizations of the whole body (measured: a quarter of the instantiation of a
  residual CNN on 8 devices). Each call op carries its own config (`call_config`).
  The eager context's per-thread function call options are TF-private: they are
  what a tf.function call reads its config from.
  """
  ctx = context.context()

  @contextlib.contextmanager
  def options():
    saved = ctx.function_call_options
    key = (saved.config_proto_serialized, saved.executor_type)
    if key not in _NO_GRAPPLER_OPTIONS:  # the user's config (threads, placement), Grappler off
      config = config_pb2.ConfigProto()
      config.ParseFromString(saved.config_proto_serialized)
      config.graph_options.rewrite_options.disable_meta_optimizer = True
      _NO_GRAPPLER_OPTIONS[key] = context.FunctionCallOptions(
        executor_type=saved.executor_type, config_proto=config
      )
    ctx.function_call_options = _NO_GRAPPLER_OPTIONS[key]
    try:
      yield
    finally:
      ctx.function_call_options = saved

  return options()


def call_config() -> bytes:
  """The ConfigProto of each per-partition call op: which Grappler passes rewrite the body.

  By default none runs. Measured with data parallel over 8 (bench/limit.py,
  step_time.py): the remapper alone, the pass that mattered, changed no steady step
  (ResNet50 1672 vs 1648 ms, the 2-layer transformer 141 vs 147 ms, the halo CNN 163
  vs 166 ms) once windowed ops with whole images kept their own padding (TF's oneDNN
  graph rewrite, which is not Grappler and runs anyway, fuses and picks the kernels),
  and it cost ResNet50's first step 5.3 s (instantiation 11.8 -> 6.5 s without it).
  TF_GSPMD_GRAPPLER brings passes back for a program that gains from them.
  """
  given = os.environ.get('TF_GSPMD_GRAPPLER')
  keep = DEFAULT_GRAPPLER if given is None else tuple(p for p in given.split(',') if p)
  config = config_pb2.ConfigProto()
  if keep == ('all',):
    return config.SerializeToString()
  rewrite = config.graph_options.rewrite_options
  if keep in ((), ('none',)):
    rewrite.disable_meta_optimizer = True
    return config.SerializeToString()
  unknown = [p for p in keep if p not in GRAPPLER_PASSES]
  if unknown:
    raise ValueError(
      f'TF_GSPMD_GRAPPLER: unknown Grappler passes {unknown}; use some of '
      f"{GRAPPLER_PASSES}, 'all' or 'none'."
    )
  for name in GRAPPLER_PASSES:
    if name not in keep:
      setattr(rewrite, name, rewriter_config_pb2.RewriterConfig.OFF)
  rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
  return config.SerializeToString()
