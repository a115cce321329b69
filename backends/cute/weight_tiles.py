"""GEMV_BF16 and EXPERT_BF16 weights in 16-row tiles (`KernelPlan.gemv_tiles`, `expert_tiles`): the
layout the tensor-core bodies read as 512 contiguous bytes per warp load.

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
regions back through `untile`. `tile_options` decides both options where a caller leaves them
out (on wherever they apply); CuteRunner and `fusec compile --emit cute` build with it.
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


def _region_of(mem):
    """addr (arena offset) -> (start, end, name) of the region holding it, or None."""
    spans = sorted((r.offset, r.offset + r.nbytes, n) for n, r in mem.regions.items())
    starts = [s[0] for s in spans]

    def region(addr):
        i = bisect.bisect_right(starts, addr) - 1
        return spans[i] if i >= 0 and addr < spans[i][1] else None
    return region


def gemv_weight_regions(low) -> tuple[dict[str, int], dict[str, str]]:
    """(tiled, kept): region -> K for every region GEMV_BF16 rows read their weights from (A0)
    that can be tiled, and region -> why not for the others, which stay row-major. A region
    tiles when it is bf16, read with one K, made of whole 16-row tiles with every row's matrix
    base on a tile, and read by nothing else (a row's PF_ADDR prefetch hint aside)."""
    mem = low.memory
    region = _region_of(mem)

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
    weights lie in a tiled region and cleared in the others (a plan variant over another layout)."""
    import dataclasses

    from .plan import GEMV_TILED

    spans = sorted((low.memory.regions[n].offset, low.memory.regions[n].offset + low.memory.regions[n].nbytes)
                   for n in tiled)
    out = []
    for src, r in zip(low.rows, rows):
        if r.opcode != Opcode.GEMV_BF16:        # P1 means other things in other bodies
            out.append(r)
            continue
        hit = any(lo <= src.a0 < hi for lo, hi in spans)
        out.append(dataclasses.replace(r, p1=(r.p1 & ~GEMV_TILED) | (GEMV_TILED if hit else 0)))
    return out


def expert_weight_regions(low) -> dict[str, int]:
    """Region -> K of every EXPERT_BF16 weight region (gate / DOWN at A0, up at A5), for
    `KernelPlan.expert_tiles`, which reads all of them as tiles: each must be bf16 with whole
    16-row tiles per expert (rows per expert, AUX, a multiple of 16) and read by nothing else
    (TileLayoutError otherwise)."""
    mem = low.memory
    region = _region_of(mem)

    ks: dict[str, int] = {}
    for r, fields in zip(low.rows, low.addr_fields):
        if r.opcode != Opcode.EXPERT_BF16:
            continue
        for f in (f for f in ("a0", "a5") if f in fields):     # DOWN rows have no up matrix
            lo, hi, name = region(getattr(r, f))
            if ks.setdefault(name, r.k) != r.k or mem.regions[name].dtype is not DType.bf16 or r.k % COLS \
                    or r.aux % ROWS or (hi - lo) % (ROWS * r.k * 2) or (getattr(r, f) - lo) % (ROWS * r.k * 2):
                raise TileLayoutError(f"expert weight {name} (K {r.k}, {r.aux} rows per expert) is not whole "
                                      f"{ROWS}-row tiles per expert")
    for r, fields in zip(low.rows, low.addr_fields):
        for f in fields:
            if (r.opcode == Opcode.EXPERT_BF16 and f in ("a0", "a5")) or f == "pf_addr":
                continue
            hit = region(getattr(r, f))
            if hit and hit[2] in ks:
                raise TileLayoutError(f"{r.opcode.name} row {r.task_id} reads expert weight {hit[2]} ({f})")
    return ks


def tile_regions(low, bound, regions: dict[str, int]) -> dict[str, int]:
    """Permute the bound arena's `regions` (name -> K) into tiles, in place; records them in
    `bound.tiled` (region -> K) and returns it."""
    import torch

    for name, k in regions.items():
        if name in bound.tiled:
            continue
        reg = low.memory.regions[name]
        flat = bound.arena[reg.offset:reg.offset + reg.nbytes].view(torch.bfloat16).view(-1, k)
        flat.copy_(tile(flat))
        bound.tiled[name] = k
    return bound.tiled


def tile_gemv_weights(low, bound) -> dict[str, int]:
    """Tile every GEMV_BF16 weight region that can tile (`gemv_weight_regions`)."""
    return tile_regions(low, bound, gemv_weight_regions(low)[0])


def tile_options(low, plan_options: dict | None) -> dict:
    """`plan_options` with gemv_tiles and expert_tiles decided where the caller left them out:
    on wherever the other options and the weights' layout allow it. The binder (CuteRunner) and
    `fusec compile --emit cute` both build with this, so the emitted kernel is the one that runs.

    Why on: slice4-e128 on the H200, same build otherwise, same logits bit for bit: B = 16 7813
    against 8388 us (-6.8%), B = 4 4761 against 5233 (-9.0%) with both
    (docs/results/plan_variants_h200_slice4-e128_tiles_stop19.log). Batch 1 streams GEMV rows on
    CUDA cores (KernelPlan.gemv_mma), which read row-major weights; its experts tile: 3119
    against 3194 us (-2.3%; gemv="mma" with both tiles was -1.6%, _b1_tiles_stop19.log)."""
    from .plan import gemv_on_tensor_cores

    opts = dict(plan_options or {})
    simple = low.ranks == 1 and not opts.get("l2_ahead")
    if "gemv_tiles" not in opts:
        opts["gemv_tiles"] = bool(simple and gemv_on_tensor_cores(opts.get("gemv", "auto"), low.batch, low.rows)
                                  and gemv_weight_regions(low)[0])
    if "expert_tiles" not in opts:
        has = any(r.opcode == Opcode.EXPERT_BF16 for r in low.rows)
        opts["expert_tiles"] = bool(simple and has and opts.get("expert_stream", "regs") == "regs"
                                    and _expert_tiles_fit(low))
    return opts


def _expert_tiles_fit(low) -> bool:
    try:
        expert_weight_regions(low)
    except TileLayoutError:
        return False
    return True


def tile_weights(low, bound, plan_options: dict | None) -> None:
    """What a binder does after `bind_weights` for the plan options it will build with
    (`tile_options`): gemv_tiles and expert_tiles repack their regions."""
    opts = plan_options or {}
    if opts.get("gemv_tiles"):
        tile_gemv_weights(low, bound)
    if opts.get("expert_tiles"):
        tile_regions(low, bound, expert_weight_regions(low))
