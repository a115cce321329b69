"""tile: cut every task group (a fusion group, or one op alone) into tasks sized for one CTA.

Requires: a verified graph; `Op.group` marks fusion groups (None = the op alone); dims bound
from `prog.opts` (B = batch, L = max_len). Collective ops (all_reduce, reduce_scatter,
all_gather, all_to_all_*) may be present (SPMD graph after `shard`).
Ensures: `prog.schedule` holds a replicated (rank 0) Schedule whose tasks have LOAD, COMPUTE
and STORE instructions with exact, in-bounds regions (no WAIT/SIGNAL yet, sm = -1), and
`prog.schedule.families` lists the task families (`ir.schedule.Family`) in a topological order;
`schedule` adds events, waits and SM queues.

How a group becomes tasks (tile sizes and families in `passes/_lowering.py`, the region rules in
`passes/_regions.py`):
- the anchor is the group's first gemv / expert / attention / recurrence op; the tile is a box
  of its first output; a GEMV splits along output rows, into as many tasks as keep every task
  streaming >= MIN_TASK_BYTES of weights, at most one per SM;
- ops before the anchor that only feed the group (a norm folded into the GEMV prologue) are
  recomputed by every tile; other ops before it become their own unit first;
- ops after the anchor that map the tile elementwise (activation, gate, residual, per-head norms
  when tiles align to heads) are epilogues; the first that cannot (a reduction over the tile axis,
  a reshape) starts a new unit with the rest of the group (logged on FUSEC_LOG=tile);
- expert GEMVs split along output rows only (each task takes every (token, slot) pair, so the
  experts chosen at run time spread over all SMs); their weight loads cover every
  expert and carry `addressed_by` = the router ids (V3);
- absorbed MLA attention over a cache larger than MIN_TASK_BYTES is rewritten in the graph to
  `mla_attention_partial` (one task per (chunk of cache rows [c L / S, (c + 1) L / S), batch
  row), S = SMs / batch chunks of at least the op's `seq_split.min_rows`) and `attention_combine`
  (split over heads, and at B > 1 over batch rows: one task per (batch row, head range), the
  op's `split_rows`); likewise an argmax over logits larger than MIN_TASK_BYTES becomes
  `argmax_partial` (one task per (chunk of the columns, batch row), chunks of at least
  `ARGMAX_MIN_CHUNK` columns) and `argmax_combine` (one task per batch row); other attention and
  the KDA recurrence split over heads; in-place state updates store to the state parameter's own
  name (the region they read);
- an anchor with `OpDef.split_rows` (the KDA recurrence: a state per batch row) whose column tiles
  leave SMs idle is also cut over batch rows: (head, batch rows) tiles, as many row ranges as
  minimise the family's predicted span (`_row_parts`); at batch 1 nothing changes;
- a collective becomes a push unit (one task per peer offset d: write the whole operand into
  slot d of the peer's `comm` buffer, signal the peer at system scope) and a local unit that
  reduces or gathers the slots (`emit_collective` in `passes/_collectives.py`; events and the
  V4 acknowledgement in `passes/schedule.py`).
"""
from __future__ import annotations

from .options import log
from fusec.ir.schedule import Schedule

from ._collectives import split_sequence
from ._lowering import Unit, build_units
from .manager import Program, register_pass


@register_pass("tile")
def run(prog: Program) -> bool:
    g = prog.graph
    dims = dict(prog.opts.dims)
    split_sequence(g, dims, prog.opts.sms, lambda m: log(prog.opts, "tile", m))
    units, tasks, buffers = build_units(g, dims, prog.opts, lambda m: log(prog.opts, "tile", m))
    sched = Schedule(graph=g, dims=dims, ranks=prog.opts.ranks, sms=prog.opts.sms, tasks=tasks,
                     events=[], queues={}, replicated=True, buffers=buffers,
                     families=[u.family() for u in units])
    sched.meta["gpu"] = prog.opts.gpu
    prog.schedule = sched
    prog.notes["scheduled"] = False
    log(prog.opts, "tile", f"{len(units)} units, {len(tasks)} tasks")
    return True


__all__ = ["run", "Unit"]
