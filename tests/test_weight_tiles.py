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
