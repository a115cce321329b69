"""The weight layouts the binder repacks for the tensor-core bodies (backends/cute/weight_tiles.py):
each is a permutation that `untile` / `mx_untile` inverts, and the MXFP4 tiles decoded the way
the EXPERT_MXFP4 body decodes them (`mx_decode`: its shifts, masks and bf16 factor) give the
values of the OCP definition (`MXFP4Tensor.dequant`, table lookup times 2^(s - 127)) exactly."""
import pytest
import torch

from fusec.backends.cute.weight_tiles import MX_EM, MX_SIGN, mx_decode, mx_tile, mx_untile, tile, untile
from fusec.ir.quant import MXFP4Tensor


def test_bf16_tiles_round_trip_and_place_chunks():
    w = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).bfloat16()
    t = tile(w)
    assert torch.equal(untile(t), w)
    # chunk 1 of tile 0 is the second KB: rows 0..15, columns 32..63
    assert torch.equal(t.flatten()[512:1024].reshape(16, 32), w[:16, 32:64])


def test_mx_bit_placement_uses_every_bit_once():
    bits = sorted([b + i for b in MX_EM for i in range(3)] + list(MX_SIGN))
    assert bits == list(range(32))


@pytest.mark.parametrize("lo,hi", [(100, 129), (0, 129)])
def test_mx_tiles_round_trip_and_decode_exactly(lo, hi):
    g = torch.Generator().manual_seed(lo)
    r, k = 48, 384
    packed = torch.randint(0, 256, (r, k // 2), generator=g, dtype=torch.uint8)
    packed[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8)     # every nibble value, both signs
    packed[1, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) + 0x11
    scale = torch.randint(lo, hi, (r, k // 32), generator=g, dtype=torch.uint8)
    scale[0, 0], scale[1, 0] = 128, lo       # the largest scale the body takes, and the smallest drawn
    tp, ts = mx_tile(packed, scale)
    assert not torch.equal(tp, packed)
    assert torch.equal(torch.sort(ts.flatten()).values, torch.sort(scale.flatten()).values)
    up, us = mx_untile(tp, ts)
    assert torch.equal(up, packed) and torch.equal(us, scale)
    assert torch.equal(mx_decode(tp, ts), MXFP4Tensor(packed, scale).dequant())


def test_mx_tile_lane_words():
    """Lane (g, q)'s 16 bytes of row g sit at byte 16 (4 g + q) of the 1 KB chunk, row g + 8's at
    512 more, word b holding columns 32 b + 8 q .. + 8."""
    r, k = 16, 128
    packed = torch.zeros(r, k // 2, dtype=torch.uint8)
    row, col = 9, 32 * 2 + 8 * 3 + 5          # g = 1, half 1; block 2, q = 3, value 5
    packed[row, col // 2] = 0x7 << (4 * (col % 2))          # magnitude 6, positive
    tp, _ = mx_tile(packed, torch.full((r, k // 32), 127, dtype=torch.uint8))
    word_at = 512 + 16 * (4 * 1 + 3) + 4 * 2
    w = int.from_bytes(bytes(tp.flatten()[word_at:word_at + 4].tolist()), "little")
    assert w == 0x7 << MX_EM[5] and int(tp.flatten().count_nonzero()) == 1


def test_mx_tiles_read_back_one_expert_at_a_time():
    """runner.arena_weights hands the reference the arena's tiled MXFP4 experts as MXFP4Tiles:
    an expert's index untiles its rows only (a whole copy of slice4's experts did not fit beside
    the arena on the H200), and equals the weight before tiling; so does the whole dequant.
    More than 2048 rows also takes the by-rows path of mx_tile / mx_untile."""
    from fusec.backends.cute.weight_tiles import MXFP4Tiles

    g = torch.Generator().manual_seed(7)
    e, n, k = 3, 1376, 128                 # 4128 rows
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(110, 129, (e, n, k // 32), generator=g, dtype=torch.uint8)
    tp, ts = mx_tile(packed.reshape(-1, k // 2), scale.reshape(-1, k // 32))
    tiles = MXFP4Tiles(tp.reshape(packed.shape), ts.reshape(scale.shape))
    for i in range(e):
        one = tiles[i]
        assert type(one) is MXFP4Tensor
        assert torch.equal(one.packed, packed[i]) and torch.equal(one.scale, scale[i])
    assert torch.equal(tiles.dequant(), MXFP4Tensor(packed, scale).dequant())
    assert type(tiles.to("cpu")) is MXFP4Tiles


def _run_ptx(text: str, regs: dict) -> dict:
    """A few PTX instructions (and / or / shl .b32, shr / mul.lo .u32, mul.rn.bf16x2) on Python ints:
    enough for the MXFP4 decode, and independent of the code it checks."""
    def val(x):
        x = x.strip()
        return regs[x] if x in regs else int(x, 0)

    def bf16x2_mul(a, b):
        def halves(v):
            return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        p = (halves(a).float() * halves(b).float()).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(p[0]) | int(p[1]) << 16

    body = text.strip().strip("{}")
    for ins in (i.strip() for i in body.replace("\n", ";").split(";") if i.strip()):
        if ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = (a.strip() for a in args.split(","))
        a, b = val(src[0]), val(src[1])
        regs[d] = {"and.b32": lambda: a & b, "or.b32": lambda: a | b, "shl.b32": lambda: (a << b) & 0xFFFFFFFF,
                   "shr.u32": lambda: a >> b, "mul.lo.u32": lambda: (a * b) & 0xFFFFFFFF,
                   "mul.rn.bf16x2": lambda: bf16x2_mul(a, b)}[op]()
    return regs


def test_kernel_decode_ptx_gives_the_ocp_values():
    """The EXPERT_MXFP4 body's own decode instructions (weight_tiles.MX_DECODE_PTX, pasted into
    the kernel as its inline asm) and block factor (MX_FACTOR), run on tile words of known
    nibbles: the four bf16x2 results are the E2M1 values times 2^(s - 127), pairs (0, 1) ..
    (6, 7), for every nibble and scale bytes 0..128."""
    from fusec.backends.cute.weight_tiles import MX_DECODE_PTX, MX_FACTOR, _mx_words
    from fusec.ir.quant import E2M1_VALUES

    g = torch.Generator().manual_seed(11)
    nibs = torch.cat([torch.arange(16, dtype=torch.int32).reshape(2, 8),
                      torch.randint(0, 16, (30, 8), generator=g, dtype=torch.int32)])
    words = _mx_words(nibs)
    for i, (w, n) in enumerate(zip(words.tolist(), nibs.tolist())):
        s = [0, 1, 2, 100, 126, 127, 128][i % 7]
        f = s * MX_FACTOR[0] + MX_FACTOR[1]
        out = _run_ptx(MX_DECODE_PTX, {"$4": w & 0xFFFFFFFF, "$5": f})
        got = torch.tensor([out[f"${j}"] for j in range(4)], dtype=torch.int64)
        got = torch.stack([got & 0xFFFF, got >> 16], -1).flatten().to(torch.int32).to(torch.int16).view(torch.bfloat16)
        want = [(-1.0 if v & 8 else 1.0) * E2M1_VALUES[v & 7] * 2.0 ** (s - 127) for v in n]
        assert got.float().tolist() == want, (n, s)
