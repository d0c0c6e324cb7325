"""Readable tables of a propagation result: per op, its result shardings and their origin."""

from __future__ import annotations

from typing import List

COLUMNS = ('node', 'op', 'out', 'sharding', 'how', 'via', 'origin', 'steps')


def _row(rec) -> List[str]:
  graph_prefix = '' if rec['graph'] == rec.get('_main') else rec['graph'] + '::'
  kind = rec['kind']
  how = rec['direction'] if kind in ('forward', 'backward') else kind
  return [
    graph_prefix + rec['node'],
    rec['op'],
    rec['tensor'].rpartition(':')[2],
    rec['sharding'],
    how,
    rec['via'] or '',
    rec['origin'] or '',
    str(len(rec['path'])) if rec['path'] else '',
  ]


def format_table(result, max_rows: int = None) -> str:
  """One line per op result, aligned in columns, preceded by a one-line summary."""
  records = result.records()
  main = result.program.main.name
  rows = []
  for rec in records:
    rec['_main'] = main
    rows.append(_row(rec))
  if max_rows is not None:
    rows = rows[:max_rows]
  widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(COLUMNS)]

  def line(cells):
    return '  '.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

  counts = {}
  for rec in records:
    counts[rec['kind']] = counts.get(rec['kind'], 0) + 1
  summary = ', '.join(f'{k}={v}' for k, v in sorted(counts.items()))
  out = [
    f'Sharding propagation on {result.mesh}: {len(records)} tensors ({summary})',
    line(COLUMNS),
    line(['-' * w for w in widths]),
  ]
  out += [line(r) for r in rows]
  if result.warnings:
    out.append('')
    out += ['warning: ' + w for w in result.warnings]
  return '\n'.join(out)
