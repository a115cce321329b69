"""MLA weight absorption: the absorbed chain (mla_q_absorb -> mla_attention -> mla_v_up) equals
the unabsorbed op (mla_attention_naive) and an independent textbook MLA, on random caches with a
different position per sequence."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from independent.k3_torch import mla_unabsorbed  # noqa: E402

from fusec.ir.registry import get_op  # noqa: E402

TOL = 1e-5
DIMS = dict(heads=4, nope=32, rope=16, kv_lora=64, v_dim=24)   # v_dim != nope: catches a swapped split


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def ref(opname, args, **attrs):
    op = get_op(opname)
    return op.ref(args, op.normalize_attrs(attrs))


def _inputs(seed, B=3, L=12):
    g = torch.Generator().manual_seed(seed)
    h, n, r, lora, v = (DIMS[k] for k in ("heads", "nope", "rope", "kv_lora", "v_dim"))
    q_nope = torch.randn(B, h, n, generator=g)
    q_pe = torch.randn(B, h, r, generator=g)
    cache = torch.randn(B, L, lora + r, generator=g)
    kv_b = torch.randn(h * (n + v), lora, generator=g) / lora ** 0.5
    pos = torch.tensor([0, 5, L - 1][:B], dtype=torch.int32)
    return q_nope, q_pe, cache, kv_b, pos, (n + r) ** -0.5


def _absorbed(q_nope, q_pe, cache, kv_b, pos, scale):
    (q_lat,) = ref("mla_q_absorb", [q_nope, kv_b], **DIMS)
    (o_lat,) = ref("mla_attention", [q_lat, q_pe, cache, pos], scale=scale, **DIMS)
    (o,) = ref("mla_v_up", [o_lat, kv_b], **DIMS)
    return o


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_absorbed_chain_equals_naive_op(seed):
    q_nope, q_pe, cache, kv_b, pos, scale = _inputs(seed)
    (naive,) = ref("mla_attention_naive", [q_nope, q_pe, cache, kv_b, pos], scale=scale, **DIMS)
    assert naive.shape == (3, DIMS["heads"] * DIMS["v_dim"])
    assert rel_err(_absorbed(q_nope, q_pe, cache, kv_b, pos, scale), naive) < TOL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_absorbed_and_naive_equal_independent_textbook_mla(seed):
    q_nope, q_pe, cache, kv_b, pos, scale = _inputs(seed)
    want = mla_unabsorbed(q_nope, q_pe, cache, kv_b, pos, heads=DIMS["heads"], nope=DIMS["nope"],
                          rope=DIMS["rope"], kv_lora=DIMS["kv_lora"], v_dim=DIMS["v_dim"], scale=scale)
    (naive,) = ref("mla_attention_naive", [q_nope, q_pe, cache, kv_b, pos], scale=scale, **DIMS)
    assert rel_err(naive, want) < TOL
    assert rel_err(_absorbed(q_nope, q_pe, cache, kv_b, pos, scale), want) < TOL


def test_rows_after_pos_are_ignored():
    # garbage after each sequence's position must not change the result (the mask is per sequence)
    q_nope, q_pe, cache, kv_b, pos, scale = _inputs(3)
    base = _absorbed(q_nope, q_pe, cache, kv_b, pos, scale)
    dirty = cache.clone()
    for b, p in enumerate(pos.tolist()):
        dirty[b, p + 1:] = 1e3
    assert rel_err(_absorbed(q_nope, q_pe, dirty, kv_b, pos, scale), base) < TOL
    # ...while a row at or before pos does change it
    dirty = cache.clone()
    dirty[1, 0] += 1.0
    assert rel_err(_absorbed(q_nope, q_pe, dirty, kv_b, pos, scale), base) > 1e-3
