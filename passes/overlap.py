"""overlap: order task families so that independent compute covers collective transfers.

Requires: `tile` ran (`prog.schedule.families`, a topological order; collectives already chunked
per peer offset into a push family, one task per peer, and a local reduce/gather family).
Ensures: the same families in another topological order in which
- every push family is issued as soon as its operand is ready (transfers start early);
- every local reduce/gather family is issued only when no ordinary family is ready, so families
  that do not depend on the collective (the shared expert beside the routed experts' combine,
  the next mixer's independent GEMVs) take the SMs while the bytes are in flight.
A collective whose result is needed by the very next family has nothing to hide behind: that
refusal is logged with its reason (FUSEC_LOG=overlap). Weight streaming of later families is
covered by `prefetch` (weight loads above waits), not here.
"""
from __future__ import annotations

import heapq

from .options import log
from .manager import Program, register_pass


@register_pass("overlap")
def run(prog: Program) -> bool:
    units = prog.schedule.families if prog.schedule is not None else None
    if not units:
        raise ValueError("overlap needs the tile pass first (no task families)")
    if not any(u.collective for u in units):
        log(prog.opts, "overlap", "no collectives: nothing to overlap")
        return False
    pos = {u.name: i for i, u in enumerate(units)}
    # Kahn's order with priorities: pushes first, then ordinary families, and a collective's
    # local reduce/gather only when no ordinary family is ready (it waits on the wire anyway)
    key: dict[str, tuple] = {}
    for u in units:
        i = pos[u.name]
        if u.body == "comm_push":
            key[u.name] = (0, i)
        elif u.collective:
            key[u.name] = (2, i)
        else:
            key[u.name] = (1, i)
    indeg = {u.name: len(u.deps) for u in units}
    succ: dict[str, list[str]] = {u.name: [] for u in units}
    for u in units:
        for d in u.deps:
            succ[d].append(u.name)
    by = {u.name: u for u in units}
    heap = [(key[u.name], u.name) for u in units if indeg[u.name] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, n = heapq.heappop(heap)
        out.append(by[n])
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (key[s], s))
    new_pos = {u.name: i for i, u in enumerate(out)}
    for u in units:
        if u.collective and u.body != "comm_push":
            push = by.get(u.name + ".push")
            gap = new_pos[u.name] - (new_pos[push.name] if push else new_pos[u.name]) - 1
            if gap <= 0:
                log(prog.opts, "overlap", f"refused to overlap {u.name}: no family independent of it "
                    f"can run between its push and its reduce (its first consumer needs it at once)")
            else:
                log(prog.opts, "overlap", f"{u.name}: {gap} families issued while its transfers fly")
    changed = [u.name for u in out] != [u.name for u in units]
    prog.schedule.families = out
    return changed
