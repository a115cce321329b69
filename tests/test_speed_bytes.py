"""benchmarks/speed.py's byte count against a count by hand from K3 `tiny`'s shapes.

The roofline fraction the benchmark reports is only as honest as this count: the embedding
table is not read whole (one row per distinct token), routed experts count once per distinct
id per layer, the MLA cache is read up to each sequence's position, state is read and written.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import fusec
from fusec.loader import load_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402

MODEL = os.path.join(ROOT, "models", "kimi_k3.py")

# K3 tiny, by hand (models/kimi_k3.py CONFIGS["tiny"]): bf16 = 2 bytes, f32 = 4, MXFP4 = 4.25 bits
H, V = 512, 4096
KDA_LAYERS, MLA_LAYERS = (0, 1, 2, 4, 5, 6), (3, 7, 8)
W_KDA, HEADS_KDA, D_KDA = 256, 4, 64
MXFP4_EXPERT = (128 * 256 + 128 * 256 + 256 * 128) * 4.25 / 8     # w1, w3 [128, 256]; w2 [256, 128]
BF16_EXPERT = (128 * 256 * 3) * 2
CACHE_ROW = (64 + 16) * 2                                          # kv_lora + rope, bf16


def non_expert_weight_bytes() -> float:
    bf, f4 = 2, 4
    total = (H + V * H + 2 * H) * bf                  # norm, lm_head, output AttnRes norm + proj
    for i in range(9):
        total += 2 * H * bf                            # input / post-attention RMSNorm
        total += 2 * H * bf * (2 if i > 0 else 1)      # AttnRes norm + proj before the FFN (and the mixer, i > 0)
        if i in KDA_LAYERS:
            total += (4 * W_KDA * H + 32 * H + W_KDA * 32 + HEADS_KDA * H + H * W_KDA) * bf   # q k v g, f_a, f_b, b, o
            total += (3 * W_KDA * 4 + 8 + W_KDA + D_KDA) * f4                                 # conv1d x3, A_log, dt_bias, o_norm
        else:
            total += (128 * H + 128 + 4 * 48 * 128 + 80 * H + 64 + 4 * 64 * 64 + 4 * 32 * H + H * 4 * 32) * bf
        if i == 0:
            total += 3 * 1024 * H * bf                 # dense FFN gate, up, down
        else:
            total += (32 * H + 256 * H + 256 + H * 256 + 3 * 256 * H) * bf + 32 * f4   # router, latent, shared; bias
    return total


def state_bytes(batch: int, positions: list[int]) -> tuple[float, float]:
    kda = len(KDA_LAYERS) * batch * (HEADS_KDA * D_KDA * D_KDA * 4 + 3 * W_KDA * 3 * 2)   # recurrent f32 + 3 conv bf16
    read = kda + len(MLA_LAYERS) * sum(p + 1 for p in positions) * CACHE_ROW
    write = kda + len(MLA_LAYERS) * batch * CACHE_ROW
    return read, write


def _ids(batch):
    """Router ids per MoE layer: layer 1 routes its 3 tokens to 4 + 4 distinct experts (8 in
    all, token 0 and 1 share all four), every other layer all tokens to experts 0..3."""
    out = {f"l{i}.route_ids": torch.tensor([[0, 1, 2, 3]] * batch, dtype=torch.int32) for i in range(1, 9)}
    out["l1.route_ids"] = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [4, 5, 6, 7]], dtype=torch.int32)
    return out


@pytest.mark.parametrize("overrides,per_expert", [({}, MXFP4_EXPERT), ({"expert_dtype": "bf16"}, BF16_EXPERT)],
                         ids=["mxfp4", "bf16"])
def test_step_bytes_by_hand(overrides, per_expert):
    graph, _ = load_graph(MODEL, "tiny", overrides)
    B, L = 3, 32
    tokens = torch.tensor([5, 9, 5], dtype=torch.int32)             # 2 distinct rows of the table
    positions = torch.tensor([0, 5, 31], dtype=torch.int32)
    got = speed.step_bytes(graph, {"B": B, "L": L}, tokens, positions, _ids(B))
    read, write = state_bytes(B, [0, 5, 31])
    want = dict(weights=non_expert_weight_bytes(), embedding=2 * H * 2, experts=(8 + 7 * 4) * per_expert,
                state_read=read, state_write=write, io=B * 4 * 2 + B * V * 4 + B * 4)
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    assert got["total"] == pytest.approx(sum(want.values()))
    # the embedding table and the expert stacks are not counted whole
    assert got["total"] < sum(v.type.nbytes({"B": B, "L": L}) for v in graph.weights())


def test_missing_route_ids_raise():
    graph, _ = load_graph(MODEL, "tiny", {})
    ids = _ids(1)
    del ids["l5.route_ids"]
    with pytest.raises(ValueError, match="l5.route_ids"):
        speed.step_bytes(graph, {"B": 1, "L": 8}, torch.tensor([1]), torch.tensor([0]), ids)


def test_recorded_routes_feed_the_count():
    """The reference executor's router ids, recorded by the hook speed.py uses, cover every MoE
    layer, and the distinct experts per layer lie between topk and B * topk."""
    step = fusec.compile(MODEL, "tiny", batch=4, max_len=8, precision="fp32")
    rec = speed.RouteRecorder()
    tok, pos = torch.tensor([1, 2, 3, 4], dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    step.runner.run(tok, pos, hook=rec)
    assert sorted(rec.ids) == sorted(f"l{i}.route_ids" for i in range(1, 9))
    got = speed.step_bytes(step.graph, {"B": 4, "L": 8}, tok, pos, rec.ids)
    assert 8 * 4 * MXFP4_EXPERT <= got["experts"] <= 8 * 16 * MXFP4_EXPERT
