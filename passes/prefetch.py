"""prefetch: hoist static weight LOADs above a task's WAITs.

Requires: `schedule` ran (task bodies are WAIT* LOAD* COMPUTE STORE* SIGNAL*).
Ensures: every LOAD of a `weight` tensor whose address is static (no `addressed_by`) comes
before the task's first WAIT, so its bytes stream while the task waits for its producers
(and, on a persistent CTA, while the previous task in the queue finishes). Nothing else moves:
activation, state, io and comm loads stay after the waits (V2), and addressed loads (expert
weights selected by router ids, cache rows selected by positions) stay after the wait on the
producer of their address (V3).
"""
from __future__ import annotations

from .options import log
from fusec.ir.schedule import InstrKind
from fusec.ir.types import Kind

from .manager import Program, register_pass


@register_pass("prefetch")
def run(prog: Program) -> bool:
    sched = prog.schedule
    if sched is None or not prog.notes.get("scheduled"):
        raise ValueError("prefetch needs a scheduled program (run schedule first)")
    weights = {v.name for v in sched.graph.params if v.kind is Kind.weight}
    moved = kept = 0
    for t in sched.tasks:
        first_wait = next((i for i, x in enumerate(t.instrs) if x.kind is InstrKind.WAIT), None)
        if first_wait is None:
            continue
        hoist = [x for x in t.instrs[first_wait:] if x.kind is InstrKind.LOAD
                 and x.region.tensor in weights and x.addressed_by is None]
        if not hoist:
            continue
        kept += sum(1 for x in t.instrs if x.kind is InstrKind.LOAD and x.addressed_by is not None)
        hs = {id(x) for x in hoist}
        rest = [x for x in t.instrs[first_wait:] if id(x) not in hs]
        t.instrs = t.instrs[:first_wait] + hoist + rest
        moved += len(hoist)
    prog.notes["prefetched_loads"] = moved
    log(prog.opts, "prefetch", f"hoisted {moved} weight loads above waits; {kept} addressed loads stay after")
    return moved > 0
