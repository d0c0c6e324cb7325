"""A tensor's tiling as a terminal grid: which devices hold which block.

One cell per block (rank 1: one row; rank 2: rows x columns; rank > 2: the two
dims cut into the most blocks, the other dims folded into each cell), headed
by each block's [start:stop) range. A cell lists its devices: ',' joins
replicas (runs as 'a-b'), '+' the parts of a pending reduction, ' | ' the
blocks of the folded dims. Lines above the grid say how every dim is cut and
what the devices of a block share.
"""

from __future__ import annotations

from typing import List, Optional

from tf_gspmd.pictures.geometry import Block, DimSplit, Tiling, device_label, range_text, shown

ELLIPSIS = '…'


def render(tiling: Tiling, name: Optional[str] = None) -> str:
  """The header lines and the grid of `tiling`, as one string (no trailing newline)."""
  return '\n'.join(header(tiling, name) + grid(tiling))


# --- the lines above the grid ----------------------------------------------------------
def header(tiling: Tiling, name: Optional[str] = None) -> List[str]:
  title = f'{tuple(tiling.shape)} {describe(tiling)}'
  if tiling.kind == 'tiled':
    title += f'; each device holds {tuple(tiling.shard_shape)}'
  lines = [f'{name}: {title}' if name else title]
  roles = _roles(tiling)
  lines += [dim_line(d, split, roles.get(d, '')) for d, split in enumerate(tiling.dims)]
  return lines + state_lines(tiling)


def describe(tiling: Tiling) -> str:
  """The sharding as written, and the mesh it is written on."""
  mesh = tiling.mesh
  if mesh is None:
    return str(tiling.sharding)
  axes = ' x '.join(f'{a}={n}' for a, n in mesh.shape.items())
  order = ''
  if list(mesh.devices) != sorted(mesh.devices):  # a hand-ordered mesh: the order is the tiling
    order = (
      f' (devices in order {",".join(str(d) for d in mesh.devices)})'
      if mesh.size <= 16
      else ' (devices in another order)'
    )
  return f'{tiling.sharding} on mesh {axes}{order}'


def dim_line(dim: int, split: DimSplit, role: str = '') -> str:
  """'dim 0 (10): 4 blocks of 3, 3, 3, 1 over 'x'', and which blocks are empty."""
  line = f'dim {dim} ({split.size}): '
  sizes = split.sizes
  if split.blocks == 1:
    line += 'not split'
  elif len(set(sizes)) == 1:
    line += f'{split.blocks} blocks of {sizes[0]}'
  else:
    line += f'{split.blocks} blocks of ' + ', '.join(str(s) for s in sizes)
  line += _over(split.axes)
  empty = [i for i, s in enumerate(sizes) if s == 0]
  if empty:
    line += f'; {_plural(len(empty), "block")} ' + ', '.join(str(i) for i in empty) + ' empty'
  return line + (f' -> {role}' if role else '')


def state_lines(tiling: Tiling) -> List[str]:
  """What the devices of one block share: copies, a pending reduction, nothing at all."""
  if tiling.kind == 'maximal':
    return [f'maximal: the whole tensor on device {tiling.sharding.devices[0]} only']
  if tiling.kind == 'manual':
    return ['manual: each device holds a value of its own (no global tiling)']
  lines = []
  if tiling.kind == 'replicated':
    lines.append('replicated: every device holds the whole tensor')
  elif tiling.copies > 1:
    lines.append(f'each block on {tiling.copies} devices: replicated{_over(tiling.replica_axes)}')
  if tiling.partial:
    reduction = tiling.partial
    lines.append(
      f'pending {reduction}{_over(tiling.partial_axes)}: a block is the {reduction} '
      "of the values its '+'-joined devices hold"
    )
  if 'manual' in tiling.sharding.subgroups:
    lines.append('manual subgroup: the devices of a block hold values of their own')
  return lines


def _roles(tiling: Tiling) -> dict:
  """For rank > 2, what each dim is in the picture (rows, columns, or folded into cells)."""
  if len(tiling.shape) <= 2:
    return {}
  rows, cols = tiling.grid_dims
  roles = {rows: 'rows', cols: 'columns'}
  for d in tiling.other_dims:
    split = tiling.dims[d].blocks > 1
    roles[d] = 'folded into each cell' + (", '|' between its blocks" if split else '')
  return roles


def _over(axes) -> str:
  """The words naming mesh axes, as " over 'x','y'" (major first); '' for none."""
  return ' over ' + ','.join(repr(a) for a in axes) if axes else ''


def _plural(n: int, word: str) -> str:
  return word if n == 1 else word + 's'


# --- the grid -----------------------------------------------------------------------
def cell_text(blocks: List[Block]) -> str:
  """The devices of one cell: one entry per folded block, an empty block marked."""
  return ' | '.join(device_label(b.parts) + (' (empty)' if b.empty else '') for b in blocks)


def grid(tiling: Tiling) -> List[str]:
  rows_dim, cols_dim = tiling.grid_dims
  rows = shown(tiling.dims[rows_dim].blocks) if rows_dim is not None else [0]
  cols = shown(tiling.dims[cols_dim].blocks) if cols_dim is not None else [0]
  cells = [
    [ELLIPSIS if r is None or c is None else cell_text(tiling.cell(r, c)) for c in cols]
    for r in rows
  ]
  col_heads = [_head(tiling.dims[cols_dim], c) if cols_dim is not None else '' for c in cols]
  row_heads = [_head(tiling.dims[rows_dim], r) if rows_dim is not None else '' for r in rows]
  # One width for every column: a grid of equal cells reads as a grid; the heads give sizes.
  width = max(len(t) for t in col_heads + [t for row in cells for t in row]) + 2
  widths = [width] * len(cols)
  margin = max(len(h) for h in row_heads)
  indent = ' ' * (margin + 1) if margin else ''
  lines = [indent + ' ' + ' '.join(h.center(w) for h, w in zip(col_heads, widths))]
  lines = [line.rstrip() for line in lines if line.strip()]
  lines.append(indent + _rule('┌', '┬', '┐', widths))
  for i, (head, row) in enumerate(zip(row_heads, cells)):
    if i:
      lines.append(indent + _rule('├', '┼', '┤', widths))
    lead = head.rjust(margin) + ' ' if margin else ''
    lines.append(lead + '│' + '│'.join(text.center(w) for text, w in zip(row, widths)) + '│')
  lines.append(indent + _rule('└', '┴', '┘', widths))
  return lines


def _head(split: DimSplit, index: Optional[int]) -> str:
  return ELLIPSIS if index is None else range_text(split.bounds[index])


def _rule(left: str, middle: str, right: str, widths: List[int]) -> str:
  return left + middle.join('─' * w for w in widths) + right
