"""XLA's own reshards, measured: the reference for tf_gspmd's reshard search (issue #5, section 6).

For every case in `bench/reshard_cases.py` this script asks XLA (through JAX on
8 host CPU devices) to move a tensor from the case's source sharding to its
target sharding, compiles the program, reads the SPMD-partitioned HLO that XLA
will run, and lists every collective in it with the bytes each device
receives. It needs JAX, which lives in its own venv (never in the main one):

  XLA_FLAGS (8 host devices) is set here before JAX is imported, so simply run
  /work/jaxenv/bin/python bench/xla_reference.py [--cases a,b] [--table]

Run with a Python that has no JAX (e.g. `make bench` in the main venv), it
re-executes itself under $TF_GSPMD_JAX_PYTHON or /work/jaxenv/bin/python, and
reports SKIPPED on stderr (printing nothing on stdout) when neither exists.
Stdout is a JSON list, one record per case:

  name            the case name
  xla_bytes       bytes received per device, summed over the program's
                  collectives, maximum over devices
  xla_peak        the largest per-device buffer among: the program's parameter
                  shard, its result shard, and for each collective the larger
                  of its operand bytes and result bytes (all arrays of a tuple
                  collective counted together, as they are live together)
  xla_max_buffer  the largest array any instruction of the entry computation
                  produces (after fusion, so it is a materialized buffer)
  xla_temp_bytes  XLA's own buffer assignment: temporary bytes per device
                  beyond parameters and results (`memory_analysis()`)
  src_shard_bytes / dst_shard_bytes  the program's parameter / result bytes
  xla_collectives one record per collective: op, operand and result shapes,
                  replica groups (or source-target pairs), group size and the
                  bytes each receiving device gets
  checked         'exact' or 'normwise<=1e-05': the numeric check that passed (a pending
                  sum: the oracle's normwise relative error against numpy's float64
                  sum, within its bound for the dtype; tf_gspmd/testing/oracle.py)

Bytes received per device, per collective (identical to the reshard search in
tf_gspmd/graph_rewrite/reshard/moves.py; g is the replica-group size, operand
and result bytes are one device's buffers):
  all-gather          result - operand bytes (the g-1 blocks it gets)
  all-to-all          operand bytes * (g-1)/g (keeps its own 1/g)
  reduce-scatter      operand bytes * (g-1)/g (ring: g-1 pieces of the output)
  all-reduce          2*(g-1) pieces of ceil(E/g) elements per operand of E
                      elements (ring reduce-scatter then ring all-gather);
                      this is 2*(g-1)/g * bytes when g divides E
  collective-permute  operand bytes, on each device that is the target of a
                      pair whose source is another device (self pairs are a
                      local copy and move nothing)
Asynchronous forms (`all-gather-start`/`-done`, ...) count once, at the start;
the result shape comes from the matching `-done`.

Programs. Each case compiles `jax.jit(f, in_shardings=src, out_shardings=dst)`
where f is the identity in meaning:
- Uneven sizes. JAX refuses shardings that do not divide a jit argument, but
  XLA itself lays out an uneven dim as ceil(n/k)-row shards with the tail
  padded, exactly the layout of `tf_gspmd.sharding.shard_bounds`. So the
  argument is the tensor padded to a multiple of the shard count, f slices it
  back to the true shape under the source sharding (a local op: the padded and
  unpadded layouts coincide), constrains it to the target and pads it again to
  a multiple of the target's shard count. A control run of src -> src emits no
  collective (tests/test_xla_reference.py checks it), so every collective
  counted is the reshard.
- Pending sums. XLA has no way to take a "partial" value as a program input,
  so the source is made the way partial values arise: the argument gets an
  extra leading dim of size K (the product of the partial axes' sizes)
  sharded over the partial axes, the rest laid out as `src_spec`, and f sums
  over that dim. Each device then holds exactly one summand of its shard,
  which is the partial state, and the local sum costs no communication, so the
  collectives XLA emits (all-reduce, reduce-scatter, all-to-all, ...) are
  precisely its way from the partial state to the target; nothing has to be
  subtracted. The parameter bytes equal the partial shard's bytes. Measured
  here: XLA's CPU pipeline resolves every pending sum with an all-reduce, even
  when the target is sharded (it then slices locally); its GPU pipeline would
  turn that all-reduce + slice into a reduce-scatter (ReduceScatterCreator).

Sanity. Every program is run on random data and its output compared with
numpy: bitwise equal for plain reshards, float32 relative error <= 1e-5 for
pending sums (XLA may add the summands in another order).

Replica groups. This XLA prints groups in three forms, all parsed here: an
explicit list `{{0,1},{2,3}}`, the iota form `[2,4]<=[4,2]T(1,0)`, and the mesh
form `mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}`
(mesh axes with sizes, optionally an iota device order, then the axes - or
sub-axes `name:(pre_size)size` - that span one group).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8
JAX_PYTHON_ENV = 'TF_GSPMD_JAX_PYTHON'
DEFAULT_JAX_PYTHON = '/work/jaxenv/bin/python'
_REEXEC_MARKER = 'TF_GSPMD_XLA_REFERENCE_REEXEC'


def force_host_devices() -> None:
  """Ask XLA for NUM_DEVICES host CPU devices.

  XLA reads its flags when JAX initializes its backend, so this runs before the
  first `import jax` of the process (main and reference_for_case call it).
  It is not run at import time, so that importing this module for its HLO
  parser (tests, in the TensorFlow venv) leaves the environment alone.
  """
  if 'jax' in sys.modules:
    return
  flags = os.environ.get('XLA_FLAGS', '')
  if '--xla_force_host_platform_device_count' not in flags:
    flag = f'--xla_force_host_platform_device_count={NUM_DEVICES}'
    os.environ['XLA_FLAGS'] = f'{flags} {flag}'.strip()


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_file  # noqa: E402  (sibling: the oracle without tf_gspmd)
import reshard_cases  # noqa: E402  (sibling module, pure Python)

# ---------------------------------------------------------------------------
# HLO text parsing (pure Python; tests can run it without JAX)
# ---------------------------------------------------------------------------


def _dtype_bytes() -> dict:
  """Bytes per HLO element type: tf_gspmd's one table (`_DTYPE_BYTES` of
  tf_gspmd/xla_bridge/reference_partitioner.py), read from that file's source, since this runs
  in the JAX venv, where tf_gspmd (TensorFlow) cannot be imported."""
  path = os.path.join(ROOT, 'tf_gspmd', 'xla_bridge', 'reference_partitioner.py')
  with open(path) as f:
    tree = ast.parse(f.read())
  for node in tree.body:
    if isinstance(node, ast.Assign) and [getattr(t, 'id', '') for t in node.targets] == [
      '_DTYPE_BYTES'
    ]:
      return ast.literal_eval(node.value)
  raise LookupError(f'{path} defines no _DTYPE_BYTES')


DTYPE_BYTES = _dtype_bytes()
COLLECTIVES = ('all-gather', 'all-to-all', 'collective-permute', 'all-reduce', 'reduce-scatter')
# Ops that move data between devices but that no bytes rule here covers: met in
# a program, they would make the count wrong, so they are an error.
UNMEASURED_COMMUNICATION = (
  'send',
  'recv',
  'collective-broadcast',
  'ragged-all-to-all',
  'all-reduce-scatter',
)

_ARRAY_RE = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_INSTR_RE = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$')
_COMPUTATION_RE = re.compile(r'^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')


def shape_arrays(shape_text: str) -> list:
  """[(dtype, dims)] of the arrays in an HLO shape ('f32[2,3]{1,0}' or a tuple of them)."""
  arrays = []
  for dtype, dims in _ARRAY_RE.findall(shape_text):
    if dtype == 'token':
      continue
    if dtype not in DTYPE_BYTES:
      raise ValueError(
        f'HLO shape {shape_text!r}: unknown element type {dtype!r}; add its size to DTYPE_BYTES.'
      )
    arrays.append((dtype, tuple(int(d) for d in dims.split(',') if d)))
  return arrays


def array_bytes(dtype: str, dims) -> int:
  return DTYPE_BYTES[dtype] * math.prod(dims)


def shape_bytes(shape_text: str) -> int:
  """Bytes of all arrays in an HLO shape (a tuple counts all of its elements)."""
  return sum(array_bytes(t, d) for t, d in shape_arrays(shape_text))


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start] ('(' or '{')."""
  pairs = {'(': ')', '{': '}', '[': ']'}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  raise ValueError(f'unbalanced brackets in HLO text: {text[start : start + 200]!r}')


def parse_instruction(line: str):
  """dict(name, shape, opcode, operands, attrs) for an HLO instruction line, else None."""
  m = _INSTR_RE.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2)
  if rest.startswith('('):
    end = _balanced(rest, 0)
  else:
    end = rest.index(' ') if ' ' in rest else len(rest)
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    raise ValueError(f'cannot read the opcode of HLO instruction {line.strip()!r}')
  args_end = _balanced(rest, op.end() - 1)
  operands = re.findall(r'%([\w.\-]+)', rest[op.end() : args_end - 1])
  return dict(
    name=name,
    shape=shape,
    opcode=op.group(1),
    operands=operands,
    attrs=rest[args_end:],
    root=line.lstrip().startswith('ROOT '),
  )


def parse_module(hlo_text: str) -> dict:
  """{'computations': {name: [instr, ...]}, 'entry': name, 'shapes': {instr name: shape}}."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION_RE.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if line.startswith('}'):
      current = None
      continue
    if current is None:
      continue
    instr = parse_instruction(line)
    if instr is not None:
      computations[current].append(instr)
  if entry is None:
    raise ValueError('no ENTRY computation found in the HLO text')
  shapes = {i['name']: i['shape'] for instrs in computations.values() for i in instrs}
  return dict(computations=computations, entry=entry, shapes=shapes)


# --- replica groups ---------------------------------------------------------


def _iota_devices(reshape_dims, perm, out_dims):
  """Device ids 0..N-1 reshaped to `reshape_dims`, transposed by `perm`, laid out as `out_dims`."""
  import numpy as np

  ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
  if perm is not None:
    ids = ids.transpose(perm)
  return ids.reshape(out_dims)


def _ints(text: str) -> list:
  return [int(t) for t in text.split(',') if t.strip()]


def _axis_factors(axis_size: int, refs: list):
  """Split one mesh axis into factor dims for its sub-axis refs.

  refs: [(pre_size, size)] (a full-axis ref is (1, axis_size)). Returns the
  factor sizes (major to minor) and, per ref in the given order, the index of
  its factor. Gaps between refs and the minor remainder get their own factors.
  """
  order = sorted(range(len(refs)), key=lambda k: refs[k][0])
  factors, ref_factor, covered = [], [None] * len(refs), 1
  for k in order:
    pre, size = refs[k]
    if pre % covered:
      raise ValueError(f'sub-axes {refs} of a mesh axis of size {axis_size} overlap')
    if pre > covered:
      factors.append(pre // covered)
    ref_factor[k] = len(factors)
    factors.append(size)
    covered = pre * size
  if axis_size % covered:
    raise ValueError(f'sub-axes {refs} do not divide a mesh axis of size {axis_size}')
  if covered < axis_size:
    factors.append(axis_size // covered)
  return factors, ref_factor


def _mesh_groups(axes_text: str, ids_text, refs_text: str) -> list:
  """Replica groups of the mesh form (see the module docstring)."""
  import numpy as np

  axes = [(n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", axes_text)]
  names = [n for n, _ in axes]
  sizes = [s for _, s in axes]
  if ids_text is None:
    devices = np.arange(math.prod(sizes)).reshape(sizes)
  else:
    iota = re.fullmatch(r'\[([\d,]+)\](?:T\(([\d,]+)\))?', ids_text.strip())
    if not iota:
      raise ValueError(
        f'unsupported mesh device_ids {ids_text!r} in replica groups; only the iota '
        'form [dims]T(perm) is read'
      )
    devices = _iota_devices(
      _ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None, sizes
    )
  refs = []  # (axis index, pre_size, size) in group order
  for ref in re.finditer(r"'([^']+)'(?::\((\d+)\)(\d+))?", refs_text):
    axis = names.index(ref.group(1))
    if ref.group(2) is None:
      refs.append((axis, 1, sizes[axis]))
    else:
      refs.append((axis, int(ref.group(2)), int(ref.group(3))))
  factor_dims, factor_of_ref = [], [None] * len(refs)
  for axis, size in enumerate(sizes):
    mine = [k for k, r in enumerate(refs) if r[0] == axis]
    if not mine:
      factor_dims.append(size)
      continue
    factors, ref_factor = _axis_factors(size, [refs[k][1:] for k in mine])
    for k, f in zip(mine, ref_factor):
      factor_of_ref[k] = len(factor_dims) + f
    factor_dims.extend(factors)
  group_dims = list(factor_of_ref)
  rest = [d for d in range(len(factor_dims)) if d not in group_dims]
  group_size = math.prod(factor_dims[d] for d in group_dims)
  grouped = devices.reshape(factor_dims).transpose(rest + group_dims).reshape(-1, group_size)
  return grouped.tolist()


def parse_replica_groups(attrs: str, num_devices: int) -> list:
  """The replica groups of a collective's attributes, as lists of device ids."""
  mesh = re.search(
    r'replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*(?:\([^)]*\))?)\))?'
    r'\s*\{([^}]*)\}',
    attrs,
  )
  if mesh:
    return _mesh_groups(mesh.group(1), mesh.group(2), mesh.group(3))
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', attrs)
  if iota:
    n_groups, size = int(iota.group(1)), int(iota.group(2))
    perm = _ints(iota.group(4)) if iota.group(4) else None
    return _iota_devices(_ints(iota.group(3)), perm, (n_groups, size)).tolist()
  explicit = re.search(r'replica_groups=\{', attrs)
  if explicit:
    start = explicit.end() - 1
    body = attrs[start + 1 : _balanced(attrs, start) - 1]
    groups = [_ints(g) for g in re.findall(r'\{([\d,\s]*)\}', body)]
    return groups or [list(range(num_devices))]
  raise ValueError(f'cannot read replica groups from collective attributes {attrs[:300]!r}')


def parse_source_target_pairs(attrs: str) -> list:
  m = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', attrs)
  if not m:
    raise ValueError(f'collective-permute without source_target_pairs: {attrs[:300]!r}')
  return [[int(s), int(t)] for s, t in re.findall(r'\{(\d+),(\d+)\}', m.group(1))]


def _check_groups(groups: list, num_devices: int, what: str) -> None:
  flat = sorted(d for g in groups for d in g)
  if flat != list(range(num_devices)) or len({len(g) for g in groups}) != 1:
    raise ValueError(
      f'{what}: replica groups {groups} are not an equal-size partition of '
      f'devices 0..{num_devices - 1}'
    )


# --- bytes ------------------------------------------------------------------


def received_bytes(op: str, operand_shapes: list, result_shapes: list, group_size: int) -> int:
  """Bytes one device of a replica group of `group_size` receives (see the module docstring)."""
  g = group_size
  operand = sum(shape_bytes(s) for s in operand_shapes)
  result = sum(shape_bytes(s) for s in result_shapes)
  if g == 1:
    return 0
  if op == 'all-gather':
    return result - operand
  if op in ('all-to-all', 'reduce-scatter'):
    return operand * (g - 1) // g
  if op == 'all-reduce':
    total = 0
    for s in operand_shapes:
      for dtype, dims in shape_arrays(s):
        total += 2 * (g - 1) * -(-math.prod(dims) // g) * DTYPE_BYTES[dtype]
    return total
  raise ValueError(f'no group bytes rule for collective {op!r}')


def collectives_of(module: dict, num_devices: int) -> list:
  """Every collective of a parsed module, with its groups and bytes received per device."""
  shapes = module['shapes']
  done_shape = {}  # start instruction name -> result shape of its -done
  for instrs in module['computations'].values():
    for i in instrs:
      if i['opcode'].endswith('-done') and i['operands']:
        done_shape[i['operands'][0]] = i['shape']
  found = []
  for comp, instrs in module['computations'].items():
    for i in instrs:
      opcode = i['opcode']
      base = re.sub(r'-(start|done)$', '', opcode)
      if base in UNMEASURED_COMMUNICATION:
        raise ValueError(
          f'{opcode} {i["name"]} in computation {comp}: no bytes rule for this '
          'communicating op; extend collectives_of'
        )
      if base not in COLLECTIVES or opcode.endswith('-done'):
        continue
      operand_shapes = [shapes[o] for o in i['operands']]
      result = done_shape[i['name']] if opcode.endswith('-start') else i['shape']
      result_shapes = [result]
      record = dict(
        op=base,
        instruction=i['name'],
        computation=comp,
        operand_shapes=[_plain(s) for s in operand_shapes],
        result_shapes=[_plain(s) for s in result_shapes],
        operand_bytes=sum(shape_bytes(s) for s in operand_shapes),
        result_bytes=shape_bytes(result),
      )
      per_device = [0] * num_devices
      if base == 'collective-permute':
        pairs = parse_source_target_pairs(i['attrs'])
        record['source_target_pairs'] = pairs
        for s, t in pairs:
          if s != t:
            per_device[t] += record['operand_bytes']
      else:
        groups = parse_replica_groups(i['attrs'], num_devices)
        _check_groups(groups, num_devices, f'{opcode} {i["name"]}')
        record['replica_groups'] = groups
        record['group_size'] = len(groups[0])
        received = received_bytes(base, operand_shapes, result_shapes, len(groups[0]))
        per_device = [received] * num_devices
      record['bytes_received_per_device'] = max(per_device)
      record['_per_device'] = per_device
      found.append(record)
  return found


def _plain(shape_text: str) -> str:
  """'f32[4,8]{1,0}' -> 'f32[4,8]' (tuples kept as tuples, /*index=5*/ comments dropped)."""
  return re.sub(r'/\*.*?\*/', '', re.sub(r'\{[^{}]*\}', '', shape_text))


def analyze_hlo(hlo_text: str, num_devices: int) -> dict:
  """xla_bytes, xla_peak, xla_max_buffer, shard bytes and collectives of partitioned HLO."""
  module = parse_module(hlo_text)
  entry = module['computations'][module['entry']]
  param_bytes = sum(shape_bytes(i['shape']) for i in entry if i['opcode'] == 'parameter')
  roots = [i for i in entry if i['root']]
  if len(roots) != 1:
    raise ValueError(f'entry computation {module["entry"]} has {len(roots)} ROOT instructions')
  result_bytes = shape_bytes(roots[0]['shape'])
  collectives = collectives_of(module, num_devices)
  per_device = [sum(c['_per_device'][d] for c in collectives) for d in range(num_devices)]
  for c in collectives:
    del c['_per_device']
  peak = max(
    [param_bytes, result_bytes] + [max(c['operand_bytes'], c['result_bytes']) for c in collectives]
  )
  max_buffer = max(
    (array_bytes(t, d) for i in entry for t, d in shape_arrays(i['shape'])), default=0
  )
  return dict(
    xla_bytes=max(per_device, default=0),
    xla_peak=peak,
    xla_max_buffer=max_buffer,
    src_shard_bytes=param_bytes,
    dst_shard_bytes=result_bytes,
    xla_collectives=collectives,
  )


# ---------------------------------------------------------------------------
# Programs (needs JAX)
# ---------------------------------------------------------------------------


def _entry_axes(entry) -> tuple:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _spec_entry(axes: tuple):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def _padded(shape, spec, axis_sizes: dict) -> tuple:
  """`shape` with each sharded dim rounded up to a multiple of its shard count."""
  out = []
  for n, entry in zip(shape, spec):
    k = math.prod(axis_sizes[a] for a in _entry_axes(entry))
    out.append(-(-n // k) * k)
  return tuple(out)


def build_program(case: dict, jax_mesh):
  """(jitted fn, argument global shape, argument sharding, expected(x) -> numpy) for a case."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  axis_sizes = dict(zip(case['axis_names'], case['mesh_shape']))
  shape, src, dst = tuple(case['shape']), tuple(case['src_spec']), tuple(case['dst_spec'])
  partial = tuple(case['src_partial'])
  dst_padded = _padded(shape, dst, axis_sizes)
  arg_spec = src
  arg_shape = _padded(shape, src, axis_sizes)
  true_slices = tuple(slice(0, n) for n in shape)
  if partial:
    arg_spec = (_spec_entry(partial),) + src
    arg_shape = (math.prod(axis_sizes[a] for a in partial),) + arg_shape
    true_slices = (slice(None),) + true_slices
  arg_sharding = NamedSharding(jax_mesh, PartitionSpec(*arg_spec))
  dst_sharding = NamedSharding(jax_mesh, PartitionSpec(*dst))
  out_pad = [(0, p - n) for p, n in zip(dst_padded, shape)]

  def reshard(arg):
    # Slice off the padding under the source layout (local: see the docstring).
    x = jax.lax.with_sharding_constraint(arg[true_slices], arg_sharding)
    if partial:
      x = jnp.sum(x, axis=0)  # one summand per device: the pending-sum state
    y = jax.lax.with_sharding_constraint(x, dst_sharding)
    return jnp.pad(y, out_pad) if any(p for _, p in out_pad) else y

  def expected(arg):
    x = arg[true_slices]
    return x.astype(np.float64).sum(axis=0) if partial else x

  fn = jax.jit(reshard, in_shardings=arg_sharding, out_shardings=dst_sharding)
  return fn, arg_shape, arg_sharding, expected


def _check_numerics(case, fn, arg_shape, arg_sharding, expected) -> str:
  import jax
  import numpy as np

  rng = np.random.default_rng(len(case['name']))
  arg = rng.standard_normal(arg_shape).astype(case['dtype'])
  out = np.asarray(fn(jax.device_put(arg, arg_sharding)))
  got = out[tuple(slice(0, n) for n in case['shape'])]
  want = expected(arg)
  if case['src_partial']:
    oracle = oracle_file.load()
    err, bound = oracle.relative_error(got, want), oracle.bound(got.dtype)
    if not err <= bound:
      raise AssertionError(
        f"case {case['name']}: XLA result differs from numpy's float64 sum: "
        f'normwise relative error {err:.3g} > bound {bound:g}'
      )
    return f'normwise<={bound:g}'
  if not np.array_equal(got, want):
    raise AssertionError(f'case {case["name"]}: XLA output differs from its input')
  return 'exact'


def jax_mesh_for(case: dict):
  import jax
  import numpy as np
  from jax.sharding import Mesh

  n = math.prod(case['mesh_shape'])
  if jax.device_count() < n:
    raise RuntimeError(
      f'case {case["name"]} needs {n} devices but JAX has {jax.device_count()}; set '
      f'XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax'
    )
  devices = np.array(jax.devices()[:n]).reshape(case['mesh_shape'])
  return Mesh(devices, tuple(case['axis_names']))


def reference_for_case(case: dict, check: bool = True) -> dict:
  """Compile one case with XLA and measure its collectives (and check its numerics)."""
  reshard_cases.validate_case(case)
  force_host_devices()
  jax_mesh = jax_mesh_for(case)
  fn, arg_shape, arg_sharding, expected = build_program(case, jax_mesh)
  import jax

  compiled = fn.lower(jax.ShapeDtypeStruct(arg_shape, case['dtype'])).compile()
  record = dict(name=case['name'])
  record.update(analyze_hlo(compiled.as_text(), math.prod(case['mesh_shape'])))
  memory = compiled.memory_analysis()
  record['xla_temp_bytes'] = None if memory is None else int(memory.temp_size_in_bytes)
  record['argument_shape'] = list(arg_shape)
  if check:
    record['checked'] = _check_numerics(case, fn, arg_shape, arg_sharding, expected)
  return record


def xla_reference(cases=None, check: bool = True) -> list:
  """One record per case (see the module docstring); needs JAX with enough devices."""
  return [reference_for_case(c, check) for c in (reshard_cases.CASES if cases is None else cases)]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def collective_summary(record: dict) -> str:
  """'all-to-all(g=2) + collective-permute' style summary of a record's collectives."""
  parts = []
  for c in record['xla_collectives']:
    parts.append(f'{c["op"]}(g={c["group_size"]})' if 'group_size' in c else c['op'])
  return ' + '.join(parts) or '-'


def format_table(records: list) -> str:
  rows = [('case', 'xla_bytes', 'xla_peak', 'max_buffer', 'collectives')]
  rows += [
    (
      r['name'],
      str(r['xla_bytes']),
      str(r['xla_peak']),
      str(r['xla_max_buffer']),
      collective_summary(r),
    )
    for r in records
  ]
  widths = [max(len(row[k]) for row in rows) for k in range(4)]
  return '\n'.join(
    '  '.join(
      [row[k].ljust(widths[k]) if k == 0 else row[k].rjust(widths[k]) for k in range(4)] + [row[4]]
    )
    for row in rows
  )


def _jax_python():
  for candidate in (os.environ.get(JAX_PYTHON_ENV), DEFAULT_JAX_PYTHON):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cases', help='comma-separated case names (default: all)')
  parser.add_argument(
    '--cases-json',
    help='read the cases from this JSON file instead '
    '(a list of dicts in the form of bench/reshard_cases.py)',
  )
  parser.add_argument('--table', action='store_true', help='also print a table on stderr')
  parser.add_argument('--no-check', action='store_true', help='skip the numeric check')
  args = parser.parse_args(argv)
  force_host_devices()
  try:
    import jax  # noqa: F401
  except ImportError:
    python = _jax_python()
    # Venv interpreters are symlinks to one base Python, so paths cannot tell
    # whether `python` is this very interpreter; a marker stops a second hop.
    if python is None or os.environ.get(_REEXEC_MARKER):
      print(
        f'xla_reference: SKIPPED: {sys.executable} has no JAX; point ${JAX_PYTHON_ENV} at a '
        f'Python with JAX (default {DEFAULT_JAX_PYTHON})',
        file=sys.stderr,
      )
      return 0
    return subprocess.call(
      [python, os.path.abspath(__file__)] + (sys.argv[1:] if argv is None else list(argv)),
      env=dict(os.environ, **{_REEXEC_MARKER: '1'}),
    )
  cases = reshard_cases.CASES
  if args.cases_json:
    with open(args.cases_json) as f:
      cases = [reshard_cases.normalize_case(c) for c in json.load(f)]
  if args.cases:
    cases = [reshard_cases.case_by_name(n) for n in args.cases.split(',')]
  records = xla_reference(cases, check=not args.no_check)
  json.dump(records, sys.stdout, indent=1)
  print()
  if args.table:
    import jax

    print(
      f'XLA via jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} devices',
      file=sys.stderr,
    )
    print(format_table(records), file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
