"""Op reference implementations (ir/ops) against small cases computed by hand.

Expected values come from arithmetic written out in the test (or the `math` module), never from
the op under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from fusec.ir.quant import MXFP4Tensor
from fusec.ir.registry import get_op


def ref(opname, args, **attrs):
    op = get_op(opname)
    return op.ref(args, op.normalize_attrs(attrs))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def silu(x):
    return x * sigmoid(x)


# -- router ----------------------------------------------------------------------------------
def test_router_chooses_on_corrected_scores_weighs_by_raw_scores():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.5, -0.5, 0.6, 0.0])
    # raw scores 0.5, 0.881, 0.269, 0.731; corrected 1.0, 0.381, 0.869, 0.731 -> experts 0 and 2
    # (by raw scores alone it would be 1 and 3)
    w, ids = ref("router", [logits, bias], topk=2, scale=1.0)
    assert ids.dtype == torch.int32
    assert ids[0].tolist() == [0, 2]
    s0, s2 = 0.5, sigmoid(-1.0)
    assert w[0].tolist() == pytest.approx([s0 / (s0 + s2), s2 / (s0 + s2)], rel=1e-6)


def test_router_scale_multiplies_renormalised_weights():
    logits = torch.tensor([[3.0, 1.0, -2.0], [0.0, 0.0, 5.0]])
    w, ids = ref("router", [logits, torch.zeros(3)], topk=2, scale=2.5)
    assert ids.tolist() == [[0, 1], [2, 0]] or ids.tolist() == [[0, 1], [2, 1]]   # tie of 0 and 1 in row 1
    assert w.sum(-1).tolist() == pytest.approx([2.5, 2.5], rel=1e-6)
    a, b = sigmoid(3.0), sigmoid(1.0)
    assert w[0].tolist() == pytest.approx([2.5 * a / (a + b), 2.5 * b / (a + b)], rel=1e-6)


# -- short conv ------------------------------------------------------------------------------
def test_conv_update_uses_last_tap_for_current_token_and_shifts_state():
    state = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])        # [B=1, C=2, W-1=3], oldest first
    x = torch.tensor([[10.0, 20.0]])
    w = torch.tensor([[[1.0, 0.0, 0.0, 1.0]], [[0.0, 1.0, 0.0, -1.0]]])   # [C, 1, W]
    y, new = ref("conv_update", [x, state, w])
    # channel 0: 1*oldest + 1*current = 1 + 10; channel 1: 1*5 - 1*20
    assert y[0].tolist() == pytest.approx([silu(11.0), silu(-15.0)], rel=1e-6)
    assert new.tolist() == [[[2.0, 3.0, 10.0], [5.0, 6.0, 20.0]]]


# -- KDA -------------------------------------------------------------------------------------
def test_kda_gate_values_and_range():
    a_log = torch.tensor([0.0, math.log(2.0), 0.0])                  # 2 heads used, tail ignored
    dt = torch.zeros(4)
    f = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, -0.5, 0.0, 0.0]])
    (g,) = ref("kda_gate", [f, a_log, dt], heads=2, head_dim=2, a_log_broadcast="head")
    # head 0: A = e^0 = 1; head 1: A = 2 (one A per head, broadcast over its channels)
    want = [[-5 * sigmoid(1.0)] * 2 + [-5 * sigmoid(2.0)] * 2, [-2.5, -5 * sigmoid(-0.5), -2.5, -2.5]]
    assert g[0].tolist() == pytest.approx(want[0], rel=1e-6)
    assert g[1].tolist() == pytest.approx(want[1], rel=1e-6)
    big = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 100
    (g,) = ref("kda_gate", [big, torch.log(torch.full((4,), 8.0)), torch.randn(8)], heads=4, head_dim=2)
    assert g.min() >= -5.0 and g.max() <= 0.0
    assert g.min() < -4.99 and g.max() > -0.01        # both ends are reached


def test_kda_gate_per_channel_broadcast():
    a_log = torch.tensor([0.0, math.log(3.0)])
    (g,) = ref("kda_gate", [torch.ones(1, 2), a_log, torch.zeros(2)], heads=1, head_dim=2,
               a_log_broadcast="channel")
    assert g[0].tolist() == pytest.approx([-5 * sigmoid(1.0), -5 * sigmoid(3.0)], rel=1e-6)


def test_kda_recurrent_delta_rule_two_steps():
    z = torch.zeros
    s = z(1, 1, 2, 2)
    # step 1: empty state, k = e0, v = [2, 3], beta = 0.5 -> S = 0.5 * e0 [2, 3]; o = q^T S
    o, s = ref("kda_recurrent", [torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 3.0]]),
                                 z(1, 2), torch.tensor([[0.5]]), s], heads=1, head_dim=2)
    assert s[0, 0].tolist() == [[1.0, 1.5], [0.0, 0.0]]
    assert o[0].tolist() == [1.0, 1.5]
    # step 2: decay key row 0 by exp(ln 0.5); k = e1 reads nothing (u = v); beta = 1 writes row 1
    o, s = ref("kda_recurrent", [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]]),
                                 torch.tensor([[math.log(0.5), 0.0]]), torch.tensor([[1.0]]), s],
               heads=1, head_dim=2)
    assert s[0, 0].flatten().tolist() == pytest.approx([0.5, 0.75, 1.0, 1.0], rel=1e-6)
    assert o[0].tolist() == pytest.approx([0.5, 0.75], rel=1e-6)
    # step 3: writing k = e0 again with beta = 1 replaces row 0 by v (delta rule, not accumulate)
    o, s = ref("kda_recurrent", [torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[4.0, -1.0]]),
                                 z(1, 2), torch.tensor([[1.0]]), s], heads=1, head_dim=2)
    assert s[0, 0].flatten().tolist() == pytest.approx([4.0, -1.0, 1.0, 1.0], rel=1e-6)


def test_gated_rms_norm_and_l2_norm_per_head():
    x = torch.tensor([[3.0, 4.0, 1.0, 1.0]])
    (y,) = ref("l2_norm", [x], head_dim=2, scale=2.0, eps=0.0)
    assert y[0].tolist() == pytest.approx([1.2, 1.6, 2 / math.sqrt(2), 2 / math.sqrt(2)], rel=1e-6)
    (y,) = ref("gated_rms_norm", [x, torch.tensor([[0.0, 0.0, 100.0, -100.0]]), torch.tensor([1.0, 2.0])],
               head_dim=2, eps=0.0)
    r0 = math.sqrt((9 + 16) / 2)
    assert y[0].tolist() == pytest.approx([0.5 * 3 / r0, 0.5 * 2 * 4 / r0, 1.0, 0.0], rel=1e-6, abs=1e-12)


def test_situ_glu_formula():
    g, u = torch.tensor([4.0, -2.0, 0.0]), torch.tensor([25.0, 3.0, 7.0])
    (y,) = ref("situ_glu", [g, u])
    want = [4 * math.tanh(gi / 4) * sigmoid(gi) * 25 * math.tanh(ui / 25) for gi, ui in zip(g.tolist(), u.tolist())]
    assert y.tolist() == pytest.approx(want, rel=1e-6, abs=1e-12)


# -- MXFP4 -----------------------------------------------------------------------------------
def _mx_row():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x9A    # low nibble 0xA (elem 0): sign, idx 2 -> -1.0; high 0x9 (elem 1): -0.5
    packed[0, 1] = 0x7F    # low 0xF (elem 2): -6.0; high 0x7 (elem 3): +6.0
    packed[0, 2] = 0x30    # low 0x0 (elem 4): 0; high 0x3 (elem 5): 1.5
    packed[0, 15] = 0x54   # elem 30: idx 4 -> 2.0; elem 31: idx 5 -> 3.0
    return packed, [-1.0, -0.5, -6.0, 6.0, 0.0, 1.5] + [0.0] * 24 + [2.0, 3.0]


def test_mxfp4_dequant_known_bytes():
    packed, vals = _mx_row()
    for byte, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        w = MXFP4Tensor(packed, torch.tensor([[byte]], dtype=torch.uint8))
        assert w.shape == (1, 32)
        assert w.dequant().tolist() == [[v * factor for v in vals]]


def test_mxfp4_scale_groups_cover_32_columns_and_linear_uses_them():
    packed, vals = _mx_row()
    packed = torch.cat([packed, packed], 1)                          # K = 64: two scale groups
    w = MXFP4Tensor(packed, torch.tensor([[127, 129]], dtype=torch.uint8))
    want = vals + [4.0 * v for v in vals]
    assert w.dequant()[0].tolist() == want
    x = torch.zeros(1, 64)
    x[0, 3], x[0, 32 + 5] = 1.0, 2.0                                 # picks +6 (scale 1) and 1.5 (scale 4)
    (y,) = ref("linear", [x, w])
    assert y.tolist() == [[6.0 + 2.0 * 4.0 * 1.5]]


# -- RoPE ------------------------------------------------------------------------------------
def _llama3_inv_freq(d, theta, factor, low, high, orig):
    out = []
    for i in range(0, d, 2):
        f = theta ** (-i / d)
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


@pytest.mark.parametrize("scaling", [None, (32.0, 1.0, 4.0, 8192)])
def test_rope_matches_direct_formula(scaling):
    d, heads, theta = 64, 2, 500000.0
    attrs = dict(head_dim=d, theta=theta)
    if scaling:
        f, lo, hi, orig = scaling
        attrs.update(scaling_factor=f, low_freq_factor=lo, high_freq_factor=hi, original_max_pos=orig)
        inv = _llama3_inv_freq(d, theta, f, lo, hi, orig)
    else:
        inv = [theta ** (-i / d) for i in range(0, d, 2)]
    x = torch.randn(3, heads * d, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 37], dtype=torch.int32)
    (y,) = ref("rope", [x, pos], **attrs)
    want = torch.zeros(3, heads * d, dtype=torch.float64)
    for b, p in enumerate(pos.tolist()):
        for h in range(heads):
            for i in range(d // 2):            # rotate_half pairs element i with element i + d/2
                c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
                x1, x2 = x[b, h * d + i].item(), x[b, h * d + i + d // 2].item()
                want[b, h * d + i] = x1 * c - x2 * s
                want[b, h * d + i + d // 2] = x2 * c + x1 * s
    assert torch.allclose(y.double(), want, atol=2e-5, rtol=0)
    assert torch.equal(y[0], x[0])                                  # position 0 is the identity


def test_rope_llama3_scaling_changes_only_low_frequencies():
    d = 64
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([1000], dtype=torch.int32)
    (plain,) = ref("rope", [x, pos], head_dim=d, theta=500000.0)
    (scaled,) = ref("rope", [x, pos], head_dim=d, theta=500000.0, scaling_factor=32.0)
    # highest frequencies (pair 0, wavelength 2 pi < 8192/4) are untouched; the lowest are divided by 32
    assert scaled[0, 0].item() == pytest.approx(plain[0, 0].item(), abs=1e-5)
    assert abs(scaled[0, d // 2 - 1].item() - plain[0, d // 2 - 1].item()) > 1e-4


# -- AttnRes, caches, attention --------------------------------------------------------------
def test_attn_res_single_source_is_identity_and_two_sources_weigh_unnormalised_values():
    v = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 5
    nw, pw = torch.rand(8) + 0.5, torch.randn(1, 8)
    (h,) = ref("attn_res", [nw, pw, v])
    assert torch.allclose(h, v, rtol=1e-6, atol=1e-6)
    a = torch.tensor([[1.0, 1.0]])
    b = torch.tensor([[10.0, -10.0]])
    # key = norm_w * proj_w = [1, 0]: logits rms-normalised: a -> 1, b -> 1 (10 / rms 10); equal -> mean
    (h,) = ref("attn_res", [torch.ones(2), torch.tensor([[1.0, 0.0]]), a, b], eps=0.0)
    assert h[0].tolist() == pytest.approx([5.5, -4.5], rel=1e-6)
    # key = [0, 2] * [3, 1] = [0, 2]: logits a -> 2, b -> -2
    pa = 1 / (1 + math.exp(-4.0))
    want = [pa * 1 + (1 - pa) * 10, pa * 1 - (1 - pa) * 10]
    (h2,) = ref("attn_res", [torch.tensor([0.0, 2.0]), torch.tensor([[3.0, 1.0]]), a, b], eps=0.0)
    assert h2[0].tolist() == pytest.approx(want, rel=1e-6)


def test_cache_append_writes_each_sequence_at_its_position():
    cache = torch.zeros(2, 4, 3)
    row = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    (out,) = ref("cache_append", [cache, row, torch.tensor([2, 0], dtype=torch.int32)])
    assert out[0, 2].tolist() == [1.0, 2.0, 3.0] and out[1, 0].tolist() == [4.0, 5.0, 6.0]
    assert out.abs().sum().item() == 21.0
    assert cache.abs().sum().item() == 0.0                           # the input is not mutated


def test_gqa_attention_masks_by_position_and_shares_kv_heads():
    # 2 query heads share 1 kv head; head_dim 1; keys [0, 0, 5] so row 2 dominates only if unmasked
    q = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    k = torch.tensor([[0.0], [0.0], [5.0]]).expand(2, 3, 1)
    v = torch.tensor([[1.0], [3.0], [100.0]]).expand(2, 3, 1)
    (o,) = ref("attention", [q, k, v, torch.tensor([1, 2], dtype=torch.int32)], heads=2, kv_heads=1,
               head_dim=1, scale=1.0)
    assert o[0].tolist() == pytest.approx([2.0, 2.0], rel=1e-6)      # rows 0..1: equal scores -> mean
    for h, qh in enumerate((1.0, 2.0)):
        e = math.exp(5.0 * qh)
        assert o[1, h].item() == pytest.approx((1 + 3 + 100 * e) / (2 + e), rel=1e-6)
