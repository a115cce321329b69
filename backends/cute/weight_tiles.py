"""GEMV_BF16 weights in 16-row tiles (`KernelPlan.gemv_tiles`): the layout the tensor-core body
reads as 512 contiguous bytes per warp load.

The tensor-core GEMV gives lane (g, q) 16 bytes of weight rows g and g + 8 at columns
32 c + 8 q .. + 8 of each 32-column chunk c. On row-major weights one warp load touches 64 bytes
of each of 8 rows; stop 15's streaming microbenchmark at the 7168-column shape and 512 threads
measured that pattern at 2.2 TB/s on the H200 and the same loads on tile-contiguous weights at
3.66-3.80 (docs/results/layout_stream_microbench_h200_stop15.md). Tiled, a [rows, K] matrix is
[rows / 16, K / 32, 16, 32]: chunk c of a 16-row tile is 1 KB, rows 0-7 then 8-15, so each of the
lane group's two loads per chunk reads 512 contiguous bytes.

A tile holds 16 whole rows, so a tiled region keeps every 16-row-aligned matrix base at its byte
offset (a merged projection's parts, kv_b's per-head blocks): `gemv_weight_regions` checks that,
and that nothing but GEMV_BF16 rows reads the region, before `tile_gemv_weights` permutes the
bound arena in place. `arena_weights` (runner.py) and the CPU table interpreter read tiled
regions back through `untile`.
"""
from __future__ import annotations

import bisect

from fusec.ir.types import DType

from .plan import Opcode

ROWS, COLS = 16, 32      # a tile: 16 rows x one 32-column chunk (1 KB of bf16)


class TileLayoutError(ValueError):
    pass


def tile(w):
    """[R, K] row-major (R % 16 == 0, K % 32 == 0) -> the same elements tiled, as [R, K] storage."""
    r, k = w.shape
    return w.reshape(r // ROWS, ROWS, k // COLS, COLS).permute(0, 2, 1, 3).contiguous().reshape(r, k)


def untile(t):
    """Inverse of `tile`."""
    r, k = t.shape
    return t.reshape(r // ROWS, k // COLS, ROWS, COLS).permute(0, 2, 1, 3).contiguous().reshape(r, k)


def gemv_weight_regions(low) -> tuple[dict[str, int], dict[str, str]]:
    """(tiled, kept): region -> K for every region GEMV_BF16 rows read their weights from (A0)
    that can be tiled, and region -> why not for the others, which stay row-major. A region
    tiles when it is bf16, read with one K, made of whole 16-row tiles with every row's matrix
    base on a tile, and read by nothing else (a row's PF_ADDR prefetch hint aside)."""
    mem = low.memory
    spans = sorted((r.offset, r.offset + r.nbytes, n) for n, r in mem.regions.items())
    starts = [s[0] for s in spans]

    def region(addr):
        i = bisect.bisect_right(starts, addr) - 1
        return spans[i] if i >= 0 and addr < spans[i][1] else None

    ks: dict[str, int] = {}
    kept: dict[str, str] = {}
    for r in low.rows:
        if r.opcode == Opcode.GEMV_BF16:
            lo, hi, name = region(r.a0)
            if ks.setdefault(name, r.k) != r.k:
                kept[name] = f"read with K {ks[name]} and {r.k}"
            elif mem.regions[name].dtype is not DType.bf16:
                kept[name] = f"{mem.regions[name].dtype.name}, not bf16"
            elif r.k % COLS or (r.a0 - lo) % (ROWS * r.k * 2) or (hi - lo) % (ROWS * r.k * 2):
                kept[name] = f"K {r.k}, a matrix at byte {r.a0 - lo} of {hi - lo}: not whole {ROWS}-row tiles"
    for r, fields in zip(low.rows, low.addr_fields):
        for f in fields:
            if (r.opcode, f) == (Opcode.GEMV_BF16, "a0") or f == "pf_addr":
                continue
            hit = region(getattr(r, f))
            if hit and hit[2] in ks:
                kept.setdefault(hit[2], f"also read by {r.opcode.name} row {r.task_id} ({f})")
    return {n: k for n, k in ks.items() if n not in kept}, kept


def tiled_rows(low, rows, tiled: dict[str, int]):
    """`rows` (low.rows relocated, in order) with GEMV_TILED set in P1 of the GEMV_BF16 rows whose
    weights lie in a tiled region."""
    import dataclasses

    from .plan import GEMV_TILED

    spans = sorted((low.memory.regions[n].offset, low.memory.regions[n].offset + low.memory.regions[n].nbytes)
                   for n in tiled)
    out = []
    for src, r in zip(low.rows, rows):
        hit = r.opcode == Opcode.GEMV_BF16 and any(lo <= src.a0 < hi for lo, hi in spans)
        out.append(dataclasses.replace(r, p1=r.p1 | GEMV_TILED) if hit else r)
    return out


def tile_gemv_weights(low, bound) -> dict[str, int]:
    """Permute every GEMV_BF16 weight region of the bound arena into tiles (in place); records
    and returns them as `bound.tiled` (region -> K)."""
    import torch

    regions = gemv_weight_regions(low)[0]
    for name, k in regions.items():
        reg = low.memory.regions[name]
        flat = bound.arena[reg.offset:reg.offset + reg.nbytes].view(torch.bfloat16).view(-1, k)
        flat.copy_(tile(flat))
    bound.tiled = dict(regions)
    return bound.tiled
