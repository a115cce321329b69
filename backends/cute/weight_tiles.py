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

from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import DType

from .plan import Opcode

ROWS, COLS = 16, 32      # a tile: 16 rows x one 32-column chunk (1 KB of bf16)
MX_COLS = 128            # an MXFP4 tile: 16 rows x 128 columns (1 KB of nibbles, 64 B of scales)
# Where value i (column 8 q + i of the lane's 8 in a 32-column block) of an MXFP4 tile word keeps
# its 3 magnitude bits (lowest bit) and its sign bit. The body decodes a word into the bf16 pairs
# (0, 1), (2, 3), (4, 5), (6, 7) as w & M, (w << 3) & M, (w << 6) & E | (w << 1) & S and
# (w >> 3) & E | (w << 2) & S (M = E | S, E = 0x01C001C0, S = 0x80008000): magnitude bits at bf16
# bits 6..8 of each half and the sign at bit 15 make every E2M1 value exact times 2^-126 (the
# zero exponent is the bf16 subnormal 0.5 * 2^-126), folded into the block scale. No placement
# gives all four pairs one shift and one mask (the 3-bit fields and their signs do not tile 32
# bits that way), so two pairs take their sign bits separately. The third pair's two left shifts
# are one multiply: (w & 0x40074007) * 66 = (x << 6) + (x << 1) adds two copies of the pair's
# source bits whose set bits never meet (no carry), and the mask keeps exactly the magnitude
# bits of the first and the signs of the second (10 integer ops a word, not 11; an exhaustive
# search over shift, mask and multiply forms of this placement finds none shorter). With the
# factor's prmt (bodies/expert.py.j2 _mx_factor), stop 36 timed it against the shifts form side
# by side (same bits): slice4 B = 16 -1.0%, B = 1 -0.3%, A/A control -0.1%
# (plan_variants_h200_slice4_b*_lean_decode_stop36.log). It moves work from the ALU pipe to the
# FMA pipe more than it removes ALU work (7 ALU ops a word either way): the body is bound by
# its issue and latency per 16-row unit, not by one pipe.
MX_EM = (6, 22, 3, 19, 0, 16, 9, 25)
MX_SIGN = (15, 31, 12, 28, 14, 30, 13, 29)
# The body's block factor 2^(s - 1) is a bf16, so every scale byte must be <= 128 (block values
# up to 12 x 2^0; `mx_scales_fit`).
MX_MAX_SCALE = 128
# The body's decode of one word, as PTX (inline asm of _mx_decode in bodies/expert.py.j2; $4 the
# word, $5 the bf16x2 block factor, $0..$3 the pairs (0, 1) .. (6, 7)). Kept here, next to the
# layout it inverts, so a CPU test runs these very instructions (tests/test_weight_tiles.py).
MX_DECODE_PTX = (
    "{ .reg .b32 a, b, c, d, t, u;\n"
    "and.b32 a, $4, 0x81C081C0;\n"
    "shl.b32 t, $4, 3; and.b32 b, t, 0x81C081C0;\n"
    "and.b32 t, $4, 0x40074007; mul.lo.u32 t, t, 66; and.b32 c, t, 0x81C081C0;\n"
    "shr.u32 t, $4, 3; and.b32 t, t, 0x01C001C0; shl.b32 u, $4, 2; and.b32 u, u, 0x80008000; or.b32 d, t, u;\n"
    "mul.rn.bf16x2 $0, a, $5; mul.rn.bf16x2 $1, b, $5; mul.rn.bf16x2 $2, c, $5; mul.rn.bf16x2 $3, d, $5; }")


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


def _mx_words(n):
    """Nibbles [..., 8] (int32) -> tile words [...] (int32 bits)."""
    import torch

    em = torch.tensor(MX_EM, dtype=torch.int32, device=n.device)
    sg = torch.tensor(MX_SIGN, dtype=torch.int32, device=n.device)
    return (((n & 7) << em) | ((n >> 3) << sg)).sum(-1, dtype=torch.int32)   # disjoint bits: sum is or


def _by_rows(fn, packed, scale, rows: int = 2048):
    """fn over `rows` rows at a time (a multiple of 16): its int32 temporaries are ~40x the
    bytes, and one slice4 expert weight is 4.9 GB."""
    import torch

    if packed.shape[0] <= rows:
        return fn(packed, scale)
    out_p, out_s = torch.empty_like(packed), torch.empty_like(scale)
    for i in range(0, packed.shape[0], rows):
        out_p[i:i + rows], out_s[i:i + rows] = fn(packed[i:i + rows], scale[i:i + rows])
    return out_p, out_s


def mx_tile(packed, scale):
    """MXFP4 packed [R, K/2] u8 (low nibble = even column) and scales [R, K/32] u8, R % 16 == 0,
    K % 128 == 0 -> the same values in MXFP4 tiles (module docstring), as (packed, scale) of the
    same shapes. Word b of lane (g, q) in tile t, chunk c holds columns 128 c + 32 b + 8 q + i of
    row 16 t + g (first 512 bytes) or + 8 (last 512)."""
    return _by_rows(_mx_tile, packed, scale)


def mx_untile(packed, scale):
    """Inverse of `mx_tile`."""
    return _by_rows(_mx_untile, packed, scale)


def _mx_tile(packed, scale):
    import torch

    r, kb = packed.shape
    k = 2 * kb
    p = packed.to(torch.int32)
    nib = torch.stack([p & 0xF, p >> 4], -1).reshape(r // ROWS, 2, 8, k // MX_COLS, 4, 4, 8)
    w = _mx_words(nib.permute(0, 3, 1, 2, 5, 4, 6))          # [tile, chunk, half, g, q, block]
    out = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], -1).to(torch.uint8).reshape(r, kb)
    sc = scale.reshape(r // ROWS, ROWS, k // MX_COLS, 4).permute(0, 2, 1, 3).contiguous().reshape(r, k // 32)
    return out, sc


def _mx_untile(packed, scale):
    import torch

    r, kb = packed.shape
    k = 2 * kb
    b = packed.to(torch.int32).reshape(r // ROWS, k // MX_COLS, 2, 8, 4, 4, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    em = torch.tensor(MX_EM, dtype=torch.int32, device=packed.device)
    sg = torch.tensor(MX_SIGN, dtype=torch.int32, device=packed.device)
    n = ((w[..., None] >> em) & 7) | (((w[..., None] >> sg) & 1) << 3)   # [tile, chunk, half, g, q, block, 8]
    n = n.permute(0, 2, 3, 1, 5, 4, 6).reshape(r, kb, 2)
    out = (n[..., 0] | (n[..., 1] << 4)).to(torch.uint8)
    sc = scale.reshape(r // ROWS, k // MX_COLS, ROWS, 4).permute(0, 2, 1, 3).contiguous().reshape(r, k // 32)
    return out, sc


def mx_decode(packed, scale):
    """fp32 [R, K] of MXFP4 tiles, computed the way the tensor-core body does (bit for bit: the
    shifts and masks of the MX_EM / MX_SIGN comment, the bf16 factor 2^(s - 1) built as
    (s + 126) << 7, one bf16 product), in the tiles' own order, then put back in row-major
    order. A CPU test holds it against MXFP4Tensor.dequant."""
    import torch

    r, kb = packed.shape
    k = 2 * kb
    b = packed.to(torch.int64).reshape(r // ROWS, k // MX_COLS, 2, 8, 4, 4, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)   # uint32 bits in int64
    m = 0xFFFFFFFF
    E, S = 0x01C001C0, 0x80008000
    words = [w & (E | S), (w << 3) & (E | S), ((w << 6) & E) | ((w << 1) & S), ((w >> 3) & E) | ((w << 2) & S)]
    halves = torch.stack([torch.stack([x & 0xFFFF, (x >> 16) & 0xFFFF], -1) for x in words], -2).flatten(-2)
    bits = halves.to(torch.int32).to(torch.int16)     # wraps 0x8000.. to negative int16: bf16 bit patterns
    vals = bits.view(torch.bfloat16)                  # [tile, chunk, half, g, q, block, 8]
    s = scale.to(torch.int32).reshape(r // ROWS, k // MX_COLS, ROWS, 4)
    s = s.reshape(r // ROWS, k // MX_COLS, 2, 8, 1, 4)
    fac = (((s + 126) << 7) & m).to(torch.int16).view(torch.bfloat16)[..., None]
    y = (vals * fac).float()                          # one bf16 multiply, rounded as mul.rn.bf16x2
    return y.permute(0, 2, 3, 1, 5, 4, 6).reshape(r, k)


class MXFP4Tiles(MXFP4Tensor):
    """An MXFP4 weight [..., N, K] whose packed / scale storage is in MXFP4 tiles (over its rows
    flattened), as the binder left the arena: what `runner.arena_weights` hands the reference
    executor. Indexing an expert untiles that expert's rows only (with N % 16 == 0 they are
    whole tiles), so the arena's experts are never copied whole; `dequant` of the whole weight
    untiles it whole."""

    def to(self, device) -> "MXFP4Tiles":
        return MXFP4Tiles(self.packed.to(device), self.scale.to(device))

    def untiled(self) -> MXFP4Tensor:
        p, s = self.packed, self.scale
        up, us = mx_untile(p.reshape(-1, p.shape[-1]), s.reshape(-1, s.shape[-1]))
        return MXFP4Tensor(up.reshape(p.shape), us.reshape(s.shape))

    def __getitem__(self, idx) -> MXFP4Tensor:
        if isinstance(idx, int) and self.packed.dim() == 3 and self.packed.shape[1] % ROWS == 0:
            return MXFP4Tiles(self.packed[idx], self.scale[idx]).untiled()
        return self.untiled()[idx]

    def dequant(self, dtype=None):
        return self.untiled().dequant(dtype)


# The body's bf16x2 block factor from a scale byte s: s * MX_FACTOR[0] + MX_FACTOR[1] =
# (s + 126) << 7 in both halves, the bf16 2^(s - 1).
MX_FACTOR = (0x00800080, 0x3F003F00)


def mx_scales_fit(scale) -> bool:
    """Whether every e8m0 byte of `scale` suits the tensor-core MXFP4 body (MX_MAX_SCALE)."""
    return bool(scale.numel() == 0 or int(scale.max()) <= MX_MAX_SCALE)


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
    for r, f, lo, hi, name in _expert_matrices(low, Opcode.EXPERT_BF16, region):
        if ks.setdefault(name, r.k) != r.k or mem.regions[name].dtype is not DType.bf16 or r.k % COLS \
                or r.aux % ROWS or (hi - lo) % (ROWS * r.k * 2) or (getattr(r, f) - lo) % (ROWS * r.k * 2):
            raise TileLayoutError(f"expert weight {name} (K {r.k}, {r.aux} rows per expert) is not whole "
                                  f"{ROWS}-row tiles per expert")
    _read_only_by(low, region, set(ks), Opcode.EXPERT_BF16, ("a0", "a5"), "expert weight")
    return ks


def _expert_matrices(low, opcode, region):
    """(row, field, region start, end, name) of each gate / DOWN (A0) and up (A5) weight matrix
    an `opcode` row reads (DOWN rows have no up matrix)."""
    for r, fields in zip(low.rows, low.addr_fields):
        if r.opcode == opcode:
            for f in ("a0", "a5"):
                if f in fields:
                    yield (r, f, *region(getattr(r, f)))


def _read_only_by(low, region, names: set, opcode, own: tuple, what: str) -> None:
    """TileLayoutError if a row other than `opcode`'s fields `own` (a PF_ADDR hint aside) reads
    one of the regions `names`: tiles are read right by their own body only."""
    for r, fields in zip(low.rows, low.addr_fields):
        for f in fields:
            if (r.opcode == opcode and f in own) or f == "pf_addr":
                continue
            hit = region(getattr(r, f))
            if hit and hit[2] in names:
                raise TileLayoutError(f"{r.opcode.name} row {r.task_id} reads {what} {hit[2]} ({f})")


def expert_mx_regions(low) -> dict[str, int]:
    """Region -> K of every EXPERT_MXFP4 packed weight region (gate / DOWN at A0, up at A5; the
    scales, A3 / A6, are region name + ".scale"), for `KernelPlan.expert_mx_mma`, which reads all
    of them as MXFP4 tiles: each must have K % 128 == 0 and whole 16-row tiles with every matrix
    base on a tile, and nothing else may read it (TileLayoutError otherwise)."""
    mem = low.memory
    region = _region_of(mem)

    ks: dict[str, int] = {}
    for r, f, lo, hi, name in _expert_matrices(low, Opcode.EXPERT_MXFP4, region):
        tile_bytes = ROWS * r.k // 2
        if ks.setdefault(name, r.k) != r.k or r.k % MX_COLS or (hi - lo) % tile_bytes \
                or (getattr(r, f) - lo) % tile_bytes or name + ".scale" not in mem.regions:
            raise TileLayoutError(f"MXFP4 expert weight {name} (K {r.k}) is not whole {ROWS}-row x "
                                  f"{MX_COLS}-column tiles")
    _read_only_by(low, region, set(ks) | {n + ".scale" for n in ks}, Opcode.EXPERT_MXFP4,
                  ("a0", "a3", "a5", "a6"), "MXFP4 expert weight")
    return ks


def set_tiled(low, bound, name: str, k: int, tiled: bool) -> None:
    """Permute region `name` (read with K `k`) of the bound arena in place into its tiles
    (`tiled`) or back to row-major: bf16 regions as `tile`, MXFP4 ones (u8, with name + ".scale")
    as `mx_tile`, a few thousand rows at a time (slice4's experts are GBs). Records it in
    `bound.tiled` (region -> K)."""
    import torch

    reg = low.memory.regions[name]
    view = bound.arena[reg.offset:reg.offset + reg.nbytes]
    if reg.dtype is DType.bf16:
        flat = view.view(torch.bfloat16).view(-1, k)
        flat.copy_(tile(flat) if tiled else untile(flat))
    else:
        sreg = low.memory.regions[name + ".scale"]
        packed = view.view(-1, k // 2)
        scale = bound.arena[sreg.offset:sreg.offset + sreg.nbytes].view(-1, k // 32)
        if tiled and not mx_scales_fit(scale):
            raise TileLayoutError(f"MXFP4 expert weight {name} has e8m0 scale bytes above {MX_MAX_SCALE} "
                                  "(blocks beyond 12): build with plan option expert_mx_mma=False")
        step = 4096     # rows, a multiple of 16
        for i in range(0, packed.shape[0], step):
            p, sc = (mx_tile if tiled else mx_untile)(packed[i:i + step], scale[i:i + step])
            packed[i:i + step].copy_(p)
            scale[i:i + step].copy_(sc)
    if tiled:
        bound.tiled[name] = k
    else:
        bound.tiled.pop(name, None)


def tile_regions(low, bound, regions: dict[str, int]) -> dict[str, int]:
    """Permute the bound arena's `regions` (name -> K) into tiles, in place; records them in
    `bound.tiled` (region -> K) and returns it."""
    for name, k in regions.items():
        if name not in bound.tiled:
            set_tiled(low, bound, name, k, True)
    return bound.tiled


def tile_gemv_weights(low, bound) -> dict[str, int]:
    """Tile every GEMV_BF16 weight region that can tile (`gemv_weight_regions`)."""
    return tile_regions(low, bound, gemv_weight_regions(low)[0])


def tile_options(low, plan_options: dict | None, weights: dict | None = None) -> dict:
    """`plan_options` with gemv_tiles, expert_tiles and expert_mx_mma decided where the caller
    left them out: on wherever the other options and the weights' layout allow it (and, for
    expert_mx_mma with `weights` given, their scales: `mx_scales_fit`). The binder (CuteRunner) and
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
                                    and _fits(expert_weight_regions, low))
    if "expert_mx_mma" not in opts:
        has = any(r.opcode == Opcode.EXPERT_MXFP4 for r in low.rows)
        opts["expert_mx_mma"] = bool(simple and has and _fits(expert_mx_regions, low) and (
            weights is None or all(mx_scales_fit(weights[n].scale) for n in expert_mx_regions(low) if n in weights)))
    return opts


def _fits(regions, low) -> bool:
    try:
        regions(low)
    except TileLayoutError:
        return False
    return True


def tile_weights(low, bound, plan_options: dict | None) -> None:
    """What a binder does after `bind_weights` for the plan options it will build with
    (`tile_options`): gemv_tiles, expert_tiles and expert_mx_mma repack their regions."""
    opts = plan_options or {}
    if opts.get("gemv_tiles"):
        tile_gemv_weights(low, bound)
    if opts.get("expert_tiles"):
        tile_regions(low, bound, expert_weight_regions(low))
    if opts.get("expert_mx_mma"):
        tile_regions(low, bound, expert_mx_regions(low))
