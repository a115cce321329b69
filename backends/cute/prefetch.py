"""Weight prefetch across waits: which bytes a waiting CTA may pull into L2, and the proof.

A CTA that waits on an event idles. The weights of the task it waits for (and of the row
after it, `PF_LOOKAHEAD`) are static, so they can be read before the producer signals; anything
else could be stale (DESIGN.md: only static weights may be prefetched across a wait). Which
loads may move above a task's waits is decided by the `prefetch` pass (passes/prefetch.py:
static weight LOADs hoisted above the first WAIT, proven by the verifier); this module lowers
those decisions: a GEMV row whose weight its task loads before its waits names the first
`PREFETCH_BYTES` of its weight tile in the PF_ADDR / PF_BYTES words, and the kernel issues
`cp.async.bulk.prefetch.L2` for them, which moves nothing into registers, only into L2.

`check_prefetch` is the rule's proof on the lowered rows: every range the kernel may touch (the
row's whole tile from PF_ADDR: `prefetch_hull`) lies inside one region of kind `weight`. It runs on every lowering, so a range naming an activation, a cache or scratch
is rejected before a kernel exists.
"""
from __future__ import annotations

import bisect
import dataclasses

from fusec.ir.types import Kind

from .memory import MemoryPlan
from .plan import Opcode, TaskRow

# Bytes per row prefetched: 132 CTAs x PF_LOOKAHEAD rows x 64 KiB = 17 MB, a third of the
# H200's 50 MB L2, so prefetches do not evict each other or the activations.
PREFETCH_BYTES = 64 * 1024


class PrefetchError(ValueError):
    """A prefetch range that is not inside a static weight."""


def weight_row_bytes(row: TaskRow) -> int:
    """Bytes of one weight row of a GEMV task (0: not a streamed-weight body)."""
    if row.opcode == Opcode.GEMV_BF16:
        return row.k * 2
    if row.opcode == Opcode.GEMV_MXFP4:
        return row.k // 2
    return 0


def prefetch_hull(opcode: int, k: int, n0: int, n1: int, pf_bytes: int) -> int:
    """Bytes from PF_ADDR a row's prefetch may touch: its whole tile, (n1 - n0) weight rows
    (the kernel spends its budget as a prefix or as stripes over the first rows,
    KernelPlan.gemv_pf / pf_budget_kb, never past the tile), or PF_BYTES if that is longer.
    0 for a row that streams no weight rows (no prefetch allowed)."""
    wb = weight_row_bytes(TaskRow(Opcode(opcode), 0, k=k))
    return max((n1 - n0) * wb, pf_bytes) if wb else 0


def _region_at(mem: MemoryPlan, offset: int):
    regions = sorted(mem.regions.values(), key=lambda g: g.offset)
    i = bisect.bisect_right([g.offset for g in regions], offset) - 1
    g = regions[i] if i >= 0 else None
    return g if g is not None and offset < g.offset + g.nbytes else None


def add_weight_prefetch(rows, mem: MemoryPlan, hoisted: dict[int, set[str]],
                        nbytes: int = PREFETCH_BYTES) -> list[TaskRow]:
    """Rows with PF words set for the GEMV tiles whose schedule task loads that weight before its
    waits (`hoisted`: task id -> tensors of the LOADs the prefetch pass put above the first
    WAIT). Rows hold arena offsets; PF_ADDR is an offset too and is relocated with A0. Expert
    GEMVs get none: their weight loads are addressed by router ids, so they stay after the wait."""
    out = []
    for r in rows:
        wb = weight_row_bytes(r)
        n = min(nbytes, (r.n1 - r.n0) * wb) // 16 * 16
        g = _region_at(mem, r.a0) if wb and n > 0 else None
        if g is not None and g.name in hoisted.get(r.task_id, ()):
            r = dataclasses.replace(r, pf_addr=r.a0 + r.n0 * wb, pf_bytes=n)
        out.append(r)
    return out


def check_prefetch(rows, mem: MemoryPlan) -> None:
    """Raise PrefetchError unless every PF range of `rows` (arena offsets) is inside a weight."""
    for r in rows:
        if not r.pf_bytes:
            continue
        hull = prefetch_hull(r.opcode, r.k, r.n0, r.n1, r.pf_bytes)
        g = _region_at(mem, r.pf_addr)
        if g is not None and g.kind is not Kind.weight:
            raise PrefetchError(f"task {r.task_id}: prefetch of '{g.name}' ({g.kind.value}) across a wait: "
                                "only static weights may be prefetched")
        if not hull or g is None or r.pf_addr + hull > g.offset + g.nbytes:
            raise PrefetchError(f"task {r.task_id}: prefetch range at arena offset {r.pf_addr} "
                                f"({hull} bytes: the row's tile) is not inside one region")
