"""The plain-PyTorch K3 baseline (benchmarks/baseline_torch.py) against the reference executor.

In fp32 on the CPU at K3 `tiny` (MXFP4 experts) and `tiny` with bf16 experts, batch 1 and 4,
several steps from fresh state with per-sequence positions: the logits agree to 1e-4 of their
largest magnitude and the greedy tokens are equal, for every MoE path the baseline has. A
perturbed weight must break the agreement (the check can fail), and each MoE path must trace
into one graph (fullgraph=True) -- what the GPU benchmark compiles with Inductor.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import fusec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import baseline_torch as bt  # noqa: E402

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "kimi_k3.py")
TOL = 1e-4     # max |baseline - reference| / max |reference| over the logits, fp32
STEPS = 4
BF16_EXPERTS = {"expert_dtype": "bf16"}

CASES = [({}, moe) for moe in ("gather", "dequant")] + [(BF16_EXPERTS, moe) for moe in ("grouped", "dense", "gather")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _drive(ref, base, batch: int, vocab: int, steps: int = STEPS, seed: int = 1):
    """`steps` teacher-forced steps on both from fresh state; per step (rel err, tokens equal)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32)
        pos = (torch.arange(batch, dtype=torch.int32) * 3 + s)      # sequences at different positions
        r = ref(tok, pos)
        with torch.no_grad():
            lb, nb = base(tok, pos)
        out.append((_rel(lb, r.logits), torch.equal(nb, r.next_tokens)))
    return out


@pytest.fixture(scope="module")
def refs():
    """fp32 reference steps, one per (overrides, batch)."""
    cache = {}

    def get(overrides: dict, batch: int):
        key = (tuple(sorted(overrides.items())), batch)
        if key not in cache:
            cache[key] = fusec.compile(MODEL, "tiny", batch=batch, max_len=STEPS + 3 * batch, precision="fp32",
                                       overrides=overrides)
        step = cache[key]
        step.reset()
        return step
    return get


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("overrides,moe", CASES, ids=[f"{'bf16' if o else 'mxfp4'}-{m}" for o, m in CASES])
def test_matches_reference_fp32(refs, overrides, moe, batch):
    ref = refs(overrides, batch)
    cfg = bt.k3_config("tiny", overrides)
    base = bt.from_reference(ref.runner, cfg, moe=moe)
    assert base.w.dtype == torch.float32
    res = _drive(ref, base, batch, cfg.vocab)
    errs = [e for e, _ in res]
    assert max(errs) < TOL, f"logits rel err per step {errs}"
    assert all(ok for _, ok in res), "greedy tokens differ"


def test_default_paths():
    assert bt.default_moe("mxfp4", 1, 16, 896) == "gather"
    assert bt.default_moe("bf16", 16, 16, 128) in ("grouped", "gather")
    assert "dense" in bt.moe_candidates("bf16", 16, 16, 128)          # batch 16, top-16 of 128: compared
    assert "dense" not in bt.moe_candidates("bf16", 4, 16, 128)
    assert bt.moe_candidates("mxfp4", 16, 16, 896) == ["gather"]       # no 17 GB dequant buffer at 256 slots


def test_perturbed_weight_is_caught(refs):
    """The comparison can fail: one KDA layer's output projection scaled by 1.01 in the
    baseline's copy of the weights moves the logits far past the tolerance."""
    ref = refs({}, 4)
    cfg = bt.k3_config("tiny")
    weights = dict(ref.runner.weights)
    weights["layers.1.self_attn.o_proj.weight"] = weights["layers.1.self_attn.o_proj.weight"] * 1.01
    base = bt.from_weights(cfg, weights, 4, int(ref.runner.dims["L"]), moe="gather", graph=ref.runner.graph)
    errs = [e for e, _ in _drive(ref, base, 4, cfg.vocab, steps=2)]
    assert min(errs) > 10 * TOL, errs


def test_state_is_in_place_and_reset(refs):
    """Steps mutate the module's own state buffers in place (what a captured CUDA graph
    needs); reset() zeroes them."""
    ref = refs({}, 1)
    base = bt.from_reference(ref.runner, bt.k3_config("tiny"), moe="gather")
    bufs = {n: t for n, t in base.st.named_buffers() if n.startswith(("cache", "conv", "rec"))}
    ptrs = {n: t.data_ptr() for n, t in bufs.items()}
    with torch.no_grad():
        base(torch.tensor([7], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    assert {n: t.data_ptr() for n, t in base.st.named_buffers() if n in ptrs} == ptrs
    assert all(bool(t.abs().sum() > 0) for t in bufs.values())
    base.reset()
    assert all(bool(t.abs().sum() == 0) for t in bufs.values())


def test_missing_weight_and_unused_graph_weight():
    """Binding fails loudly if a weight the baseline needs is missing, or if the graph has a
    weight the baseline would not read (the two drifted apart)."""
    step = fusec.compile(MODEL, "tiny", batch=1, max_len=4, precision="fp32")
    w = dict(step.runner.weights)
    del w["layers.2.self_attn.b_proj.weight"]
    with pytest.raises(KeyError, match="b_proj"):
        bt.K3Weights(bt.k3_config("tiny"), w)
    with pytest.raises(ValueError, match="layers.8."):          # a config one layer short of the graph
        bt.K3Weights(bt.k3_config("tiny", {"layers": 8}), dict(step.runner.weights), graph=step.graph)


def test_share_replaces_by_views():
    """share=True: the dict's fused projections become views of the baseline's buffers (one copy
    in memory), with unchanged values."""
    step = fusec.compile(MODEL, "tiny", batch=1, max_len=4, precision="fp32")
    w = dict(step.runner.weights)
    before = w["layers.0.self_attn.k_proj.weight"].clone()
    wm = bt.K3Weights(bt.k3_config("tiny"), w, share=True, graph=step.graph)
    k = w["layers.0.self_attn.k_proj.weight"]
    assert torch.equal(k, before)
    assert k.untyped_storage().data_ptr() == wm.layers[0].w_in.untyped_storage().data_ptr()


# fullgraph tracing: a 2-layer variant of tiny (KDA + dense FFN, MLA + LatentMoE; AttnRes block
# 1, so three sources by the output) keeps this quick; aot_eager runs Dynamo and AOT
# functionalization (where a graph break or an unsupported in-place state update shows) without
# Inductor's code generation (CPU Inductor takes minutes here; benchmarks/speed.py compiles with
# Inductor on the GPU and exits non-zero if that fails).
SMALL = {"layers": 2, "mla_layers": (1,), "attn_res_block": 1}


@pytest.mark.parametrize("overrides,moe", [(SMALL, "gather"), (SMALL, "dequant"),
                                           ({**SMALL, **BF16_EXPERTS}, "grouped"),
                                           ({**SMALL, **BF16_EXPERTS}, "dense")],
                         ids=["mxfp4-gather", "mxfp4-dequant", "bf16-grouped", "bf16-dense"])
def test_fullgraph_trace(overrides, moe):
    step = fusec.compile(MODEL, "tiny", batch=2, max_len=8, overrides=overrides)      # bf16 weights
    cfg = bt.k3_config("tiny", overrides)
    wm = bt.K3Weights(cfg, dict(step.runner.weights), graph=step.graph)
    eager, traced = bt.K3TorchStep(wm, 2, 8, moe=moe), bt.K3TorchStep(wm, 2, 8, moe=moe)
    traced.mark_static()
    cfn = torch.compile(traced, backend="aot_eager", fullgraph=True, dynamic=False)
    tok = torch.tensor([3, 3], dtype=torch.int32)
    with torch.no_grad():
        for s in range(2):
            pos = torch.tensor([s, s + 2], dtype=torch.int32)
            le, ne = eager(tok, pos)
            lc, nc = cfn(tok, pos)
            assert le.dtype == torch.float32
            assert torch.equal(ne, nc)
            assert _rel(lc, le) < 1e-2
    for n, t in eager.st.named_buffers():          # the traced step updated its own state the same way
        assert torch.allclose(t.float(), dict(traced.st.named_buffers())[n].float(), rtol=1e-2, atol=1e-3), n
