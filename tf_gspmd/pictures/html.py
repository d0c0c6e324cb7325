"""The report page: one self-contained HTML file (inline CSS and SVG, a few lines of JS).

Sections: per-device memory (parameters / optimizer state / activations),
collectives per step as a bar chart by (kind, mesh axes), every variable's
tiling as a device grid (blocks drawn to scale, each labelled with its
devices, as `text` would print them), and where each sharding came from.
Nothing is fetched: no URL, no font, no script library. Elements carry their
numbers in data-* attributes (bytes, devices, ranges), so a test can read the
page back exactly.
"""

from __future__ import annotations

import html
import os
from typing import Dict, List, Optional, Sequence, Tuple

from tf_gspmd.pictures import text
from tf_gspmd.pictures.geometry import Tiling, device_label, range_text, shown, tiling_of
from tf_gspmd.pictures.page import MEMORY_PARTS, Page, TensorEntry

GRID_WIDTH = 400  # px of a grid's blocks
MIN_BLOCK = 16  # px: the narrowest block drawn (an empty one gets this)
ELLIPSIS_BLOCK = 22  # px: the band standing for elided blocks
PART_COLORS = {'parameters': '#4e79a7', 'optimizer state': '#f28e2b', 'activations': '#59a14f'}


def write(page: Page, path) -> str:
  """Write `page` as one HTML file at `path`; returns the path written."""
  path = os.fspath(path)
  with open(path, 'w', encoding='utf-8') as out:
    out.write(render(page))
  return path


def render(page: Page) -> str:
  body = [
    f'<h1>{_e(page.title)}</h1>',
    _summary(page),
    _memory(page),
    _collectives(page),
    _variable_shardings(page),
    _provenance(page),
  ]
  return (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
    f'<title>{_e(page.title)}</title><style>{CSS}</style></head>\n<body>\n'
    + '\n'.join(body)
    + f'\n<script>{SCRIPT}</script>\n</body></html>\n'
  )


# --- header ------------------------------------------------------------------------------
def _summary(page: Page) -> str:
  mesh = ' x '.join(f'{a}={n}' for a, n in page.mesh.shape.items())
  per_step = sum(r['bytes'] for r in page.collectives)
  items = [
    f'{page.mesh.size} devices, mesh {mesh}',
    f'{len(page.variables)} variables',
    f'{len(page.collectives)} collectives per step, {_bytes(per_step)} per device',
  ]
  notes = ''.join(f'<p class="note">{_e(n)}</p>' for n in page.notes)
  finder = (
    '<p class="finder">Highlight a device in every grid: <input id="device" '
    f'type="number" min="0" max="{max(page.mesh.devices)}" placeholder="id" '
    'oninput="highlight(this.value)"></p>'
  )
  return '<p class="summary">' + ' &middot; '.join(_e(i) for i in items) + '</p>' + notes + finder


# --- memory ------------------------------------------------------------------------------
def _memory(page: Page) -> str:
  measured = {k: v for k, v in page.memory.items() if v is not None}
  total = sum(measured.values())
  rows = [_memory_row(part, page.memory.get(part)) for part in MEMORY_PARTS]
  rows.append(_row(['total', _num(total)], 'class="total"'))
  return (
    '<section id="memory"><h2>Memory per device</h2>'
    '<p class="note">Shards are padded to one shape, so every device holds the same '
    'bytes.</p>'
    f'{_stacked_bar(measured, total)}{_table("memory", ("part", "bytes"), rows)}'
    f'{_variable_table(page.variables)}</section>'
  )


def _memory_row(part: str, size: Optional[int]) -> str:
  swatch = f'<span class="swatch" style="background:{PART_COLORS[part]}"></span>{_e(part)}'
  value = '<td class="num">not measured</td>' if size is None else _num(size)
  return _row(
    [swatch, value],
    f'class="mem" data-part="{_e(part)}" data-bytes="{"" if size is None else size}"',
  )


def _stacked_bar(parts: Dict[str, int], total: int, width: int = 760) -> str:
  if not total:
    return ''
  x, out = 0.0, []
  for part, size in parts.items():
    w = width * size / total
    out.append(
      f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="26" fill="{PART_COLORS[part]}">'
      f'<title>{_e(part)}: {_bytes(size)}</title></rect>'
    )
    label = f'{part} {_bytes(size, exact=False)}'
    if w >= 7.5 * len(label) + 8:  # named inside the bar when it fits
      out.append(f'<text class="inbar" x="{x + 6:.1f}" y="17">{_e(label)}</text>')
    x += w
  return f'<svg class="stacked" width="{width}" height="26">{"".join(out)}</svg>'


def _variable_table(variables: List[TensorEntry]) -> str:
  rows = [
    _row(
      [
        f'<a href="#grid-{i}">{_e(v.name)}</a>',
        _e(v.shape),
        _e(v.dtype),
        _code(v.sharding),
        _e(v.role),
        _num(v.per_device),
        _num(v.total),
      ],
      f'class="var" data-name="{_e(v.name)}" data-per-device="{v.per_device}" '
      f'data-total="{v.total}" data-trainable="{int(v.trainable)}"',
    )
    for i, v in enumerate(variables)
  ]
  table = _table(
    'variables', ('variable', 'shape', 'dtype', 'sharding', 'part', 'per device', 'global'), rows
  )
  # Open while short; a model's hundred variables would push the charts off the screen.
  opened = ' open' if len(variables) <= 12 else ''
  return f'<details{opened}><summary>per variable ({len(variables)})</summary>{table}</details>'


# --- collectives -------------------------------------------------------------------------
def collective_totals(records: Sequence[dict]) -> List[Tuple[str, tuple, int, int]]:
  """(kind, axes, count, bytes) per kind and mesh axes, the most bytes first."""
  sums: Dict[tuple, List[int]] = {}
  for r in records:
    entry = sums.setdefault((r['kind'], tuple(r['axes'])), [0, 0])
    entry[0] += 1
    entry[1] += int(r['bytes'])
  return sorted(((k, a, n, b) for (k, a), (n, b) in sums.items()), key=lambda t: (-t[3], t[:2]))


def _collectives(page: Page) -> str:
  totals = collective_totals(page.collectives)
  if not totals:
    return (
      '<section id="collectives"><h2>Collectives per step</h2>'
      '<p>None: every op runs on the shards it has.</p></section>'
    )
  return (
    '<section id="collectives"><h2>Collectives per step</h2>'
    '<p class="note">Bytes one device sends into each kind of collective per call '
    '(its local operand), summed over the ops.</p>'
    f'{_bar_chart(totals)}{_collective_table(page.collectives)}</section>'
  )


def _bar_chart(totals, label_width: int = 250, bar_width: int = 380) -> str:
  most = max(b for *_, b in totals) or 1
  bars = []
  for i, (kind, axes, count, size) in enumerate(totals):
    y, w = i * 30, max(2.0, bar_width * size / most)
    label = f'{kind} over {",".join(axes) or "-"}'
    bars.append(
      f'<g class="bar" data-kind="{_e(kind)}" data-axes="{_e(",".join(axes))}" '
      f'data-bytes="{size}" data-count="{count}">'
      f'<text x="{label_width - 8}" y="{y + 18}" text-anchor="end">{_e(label)}</text>'
      f'<rect x="{label_width}" y="{y + 4}" width="{w:.1f}" height="20" fill="#4e79a7"/>'
      f'<text x="{label_width + w + 6:.1f}" y="{y + 18}">{_bytes(size, exact=False)} in '
      f'{count} op{"s" if count != 1 else ""}<title>{size:,} B</title></text></g>'
    )
  height = 30 * len(totals) + 4
  return (
    f'<svg class="chart" width="{label_width + bar_width + 170}" height="{height}">'
    f'{"".join(bars)}</svg>'
  )


def _collective_table(records: Sequence[dict]) -> str:
  rows = [
    _row(
      [
        _e(r.get('op', '')),
        _e(r.get('op_type', '')),
        _e(r['kind']),
        _e(','.join(r['axes'])),
        _e(tuple(r.get('shape', ()))),
        _num(r['bytes']),
        _e(r.get('why', '')),
      ]
    )
    for r in records
  ]
  table = _table('collectives', ('op', 'op type', 'kind', 'axes', 'shape', 'bytes', 'why'), rows)
  return f'<details><summary>every collective ({len(records)})</summary>{table}</details>'


# --- variables' shardings ----------------------------------------------------------------
def _variable_shardings(page: Page) -> str:
  legend = (
    '<p class="note">Each box is one block of the tensor, drawn to scale; its label '
    "lists the devices holding it (',' between copies, '+' between the parts of a "
    "pending sum, '|' between blocks of dims folded into the cell).</p>"
  )
  variables = ''.join(_card(f'grid-{i}', v, page) for i, v in enumerate(page.variables))
  boundary = ''.join(_card(f'tensor-{i}', t, page) for i, t in enumerate(page.boundary))
  if boundary:
    boundary = f'<h2>Arguments and outputs</h2><div class="cards">{boundary}</div>'
  return (
    f'<section id="shardings"><h2>Variable shardings</h2>{legend}'
    f'<div class="cards">{variables}</div>{boundary}</section>'
  )


def _card(anchor: str, v: TensorEntry, page: Page) -> str:
  tiling = tiling_of(v.sharding, v.shape, page.mesh)
  lines = ''.join(f'<li>{_e(line)}</li>' for line in text.header(tiling)[1:])
  prov = f'<p class="prov"><b>provenance:</b> {_e(v.provenance)}</p>' if v.provenance else ''
  return (
    f'<div class="card" id="{anchor}"><h3>{_e(v.name)}</h3>'
    f'<p class="meta">{_e(v.role)} &middot; {_e(v.dtype)} {_e(v.shape)} &middot; '
    f'{_code(v.sharding)} &middot; {_bytes(v.per_device)} per device of '
    f'{_bytes(v.total)}</p>{grid_svg(tiling, v.name, v.role)}'
    f'<ul class="lines">{lines}</ul>{prov}</div>'
  )


def grid_svg(tiling: Tiling, name: str, role: str = '') -> str:
  """The blocks of `tiling` to scale: rows down, columns across, labelled with their devices."""
  rows_dim, cols_dim = tiling.grid_dims
  width, height = _grid_size(tiling)
  cols = _spans(tiling, cols_dim, width)
  rows = _spans(tiling, rows_dim, height)
  left = 70 if rows_dim is not None else 4
  top = 20 if cols_dim is not None else 4
  width, height = cols[-1][1] + cols[-1][2], rows[-1][1] + rows[-1][2]
  out = [_axis_labels(tiling, rows, cols, left, top)]
  for r, (row, y, h) in enumerate(rows):
    for c, (col, x, w) in enumerate(cols):
      out.append(_block(tiling, row, col, left + x, top + y, w, h, r * len(cols) + c))
  return (
    f'<svg class="grid" data-name="{_e(name)}" data-role="{_e(role)}" '
    f'width="{left + width + 2:.0f}" '
    f'height="{top + height + 2:.0f}">{"".join(out)}</svg>'
  )


def _grid_size(tiling: Tiling) -> Tuple[float, float]:
  """(width, height) px of the blocks: the tensor's aspect ratio, within readable bounds."""
  rows_dim, cols_dim = tiling.grid_dims
  if rows_dim is None:
    return (float(GRID_WIDTH) if cols_dim is not None else 160.0), 56.0
  ratio = max(tiling.shape[rows_dim], 1) / max(tiling.shape[cols_dim], 1)
  least = 34 * min(tiling.dims[rows_dim].blocks, 8)  # room for each row's label
  height = float(min(300, max(least, GRID_WIDTH * ratio, 60)))
  widest = max(height / ratio, 40 * min(tiling.dims[cols_dim].blocks, 8), 120)
  width = float(min(GRID_WIDTH, widest))
  return width, height


def _spans(tiling: Tiling, dim: Optional[int], length: float) -> List[tuple]:
  """(block index or None for the elided ones, start px, length px) along one side."""
  if dim is None:
    return [(0, 0.0, length)]
  split = tiling.dims[dim]
  picks = shown(split.blocks)
  sizes = [split.sizes[i] if i is not None else 0 for i in picks]
  fixed = sum(ELLIPSIS_BLOCK if i is None else MIN_BLOCK for i, s in zip(picks, sizes) if not s)
  scale = max(length - fixed, MIN_BLOCK) / max(sum(sizes), 1)
  out, at = [], 0.0
  for i, s in zip(picks, sizes):
    step = ELLIPSIS_BLOCK if i is None else max(MIN_BLOCK, s * scale) if s else MIN_BLOCK
    out.append((i, at, step))
    at += step
  return out


def _axis_labels(tiling: Tiling, rows, cols, left: float, top: float) -> str:
  rows_dim, cols_dim = tiling.grid_dims
  out = []
  for dim, spans, across in ((cols_dim, cols, True), (rows_dim, rows, False)):
    if dim is None:
      continue
    for index, at, size in spans:
      label = '…' if index is None else range_text(tiling.dims[dim].bounds[index])
      if across and size >= 6.5 * len(label) + 4:  # 10px monospace: ~6 px a character
        out.append(
          f'<text class="axis" x="{left + at + size / 2:.1f}" y="{top - 6}" '
          f'text-anchor="middle">{label}</text>'
        )
      elif not across and size >= 12:
        out.append(
          f'<text class="axis" x="{left - 6}" y="{top + at + size / 2 + 4:.1f}" '
          f'text-anchor="end">{label}</text>'
        )
  return ''.join(out)


def _block(tiling: Tiling, row, col, x, y, w, h, ordinal: int) -> str:
  rows_dim, cols_dim = tiling.grid_dims
  if row is None or col is None:
    return (
      f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" class="elided"/>'
      f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle">…</text>'
    )
  blocks = tiling.cell(row, col)
  label = text.cell_text(blocks)
  devices = sorted({d for b in blocks for d in b.devices})
  where = [
    f'dim {d} {range_text(blocks[0].bounds[d])}' for d in (rows_dim, cols_dim) if d is not None
  ]
  holders = ' | '.join(device_label(b.parts) for b in blocks)
  tip = f'{", ".join(where) or "whole tensor"}: devices {holders}'
  empty = all(b.empty for b in blocks)
  fill = '#ffffff' if empty else f'hsl({ordinal * 137.508 % 360:.0f},55%,80%)'
  size = min(13.0, h * 0.5, 1.7 * w / max(len(label), 1))
  shown_label = label if size >= 7 else '…'
  size = max(size, 7.0)
  attrs = ' '.join(
    f'data-{k}="{v}"'
    for k, v in (
      ('devices', ','.join(str(d) for d in devices)),
      ('label', _e(label)),
      ('rows', range_text(blocks[0].bounds[rows_dim]) if rows_dim is not None else ''),
      ('cols', range_text(blocks[0].bounds[cols_dim]) if cols_dim is not None else ''),
    )
  )
  return (
    f'<g class="block{" empty" if empty else ""}" {attrs}><title>{_e(tip)}</title>'
    f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"/>'
    f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + size / 3:.1f}" text-anchor="middle" '
    f'font-size="{size:.1f}">{_e(shown_label)}</text></g>'
  )


# --- provenance --------------------------------------------------------------------------
def _provenance(page: Page) -> str:
  rows = [
    _row(
      [_e(v.name), _code(v.sharding), _e(v.provenance or '-')],
      f'class="why" data-name="{_e(v.name)}" data-why="{_e(v.provenance)}"',
    )
    for v in page.variables
  ]
  table = _table('provenance', ('variable', 'sharding', 'why'), rows)
  return (
    '<section id="provenance"><h2>Where each sharding came from</h2>'
    f'{table}{_records_table(page.records)}</section>'
  )


def _records_table(records: Sequence[dict]) -> str:
  if not records:
    return ''
  rows = [
    _row([_e(r['tensor']), _e(r['op']), _code(r['sharding']), _e(r['detail'])]) for r in records
  ]
  table = _table('records', ('tensor', 'op', 'sharding', 'how'), rows)
  return (
    f'<details><summary>every tensor propagation decided ({len(records)})</summary>'
    f'{table}</details>'
  )


# --- helpers -----------------------------------------------------------------------------
def _e(value) -> str:
  return html.escape(str(value), quote=True)


def _code(value) -> str:
  return f'<code>{_e(value)}</code>'


def _num(n: int) -> str:
  """A byte count for a right-aligned cell."""
  return f'<td class="num">{_bytes(n)}</td>'


def _row(cells: Sequence[str], attrs: str = '') -> str:
  """A table row of already escaped cells (a cell starting with '<td' is kept whole)."""
  tds = ''.join(c if c.startswith('<td') else f'<td>{c}</td>' for c in cells)
  return f'<tr {attrs}>{tds}</tr>' if attrs else f'<tr>{tds}</tr>'


def _table(css_class: str, heads: Sequence[str], rows: Sequence[str]) -> str:
  head = ''.join(f'<th>{_e(h)}</th>' for h in heads)
  return f'<table class="{css_class}"><tr>{head}</tr>{"".join(rows)}</table>'


def _bytes(n: int, exact: bool = True) -> str:
  """'2,048 B', or '1.5 MiB (1,572,864 B)' from a KiB on ('1.5 MiB' unless `exact`)."""
  n = int(n)
  for unit, size in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if n >= size:
      return f'{n / size:.1f} {unit}' + (f' ({n:,} B)' if exact else '')
  return f'{n:,} B'


CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1160px;
 color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:0 0 4px;font-family:ui-monospace,monospace}
.summary{color:#444}.note{color:#666;font-size:12.5px;margin:4px 0}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:600}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
.cards{display:flex;flex-wrap:wrap;gap:14px}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 12px;background:#fcfcfc;flex:0 1 520px}
.meta{margin:0 0 6px;color:#444;font-size:12.5px}
.lines{margin:6px 0 0;padding-left:18px;font-size:12px;color:#444;
 font-family:ui-monospace,monospace}
.prov{font-size:12px;color:#444;margin:6px 0 0}
svg text{font-family:ui-monospace,monospace;font-size:12px;fill:#222}
svg text.axis{font-size:10px;fill:#666}
svg text.inbar{fill:#fff;font-size:12px}
g.block rect{stroke:#555;stroke-width:1}
g.block.empty rect{stroke-dasharray:4 3}
rect.elided{fill:#eee;stroke:#bbb}
g.block:hover rect{stroke:#000;stroke-width:2}
body.picking g.block{opacity:.3}
body.picking g.block.hit{opacity:1}
g.block.hit rect{stroke:#d62728;stroke-width:3}
details{margin:8px 0}summary{cursor:pointer;color:#335}
code{font-size:12px}
"""

SCRIPT = """
function highlight(value) {
  var picking = value !== '';
  document.body.classList.toggle('picking', picking);
  document.querySelectorAll('g.block').forEach(function (g) {
    var devices = g.getAttribute('data-devices').split(',');
    g.classList.toggle('hit', picking && devices.indexOf(value) >= 0);
  });
}
// report.html#device=3 opens with device 3 picked (a link to share, or a screenshot).
var picked = /device=(\\d+)/.exec(location.hash);
if (picked) {
  document.getElementById('device').value = picked[1];
  highlight(picked[1]);
}
"""
