"""The plain-PyTorch TP = 2 K3 baseline (benchmarks/baseline_tp.py) over two gloo processes.

K3 `tiny` in fp32 on the CPU (MXFP4 experts with the EP "gather" path; bf16-layout experts with
"grouped", "dense" and "gather"), batch 4, several steps from fresh state with per-sequence
positions: both ranks' logits are bit-identical, and agree with the single-process reference
(fusec's reference executor, `fusec.compile(..., precision="fp32")`, whose weight dict both are
bound from) to 1e-4 of the largest logit, greedy tokens equal (tests/test_baseline_torch.py's
tolerance). The check can fail: a rank holding one expert slice scaled by 1.01 moves the logits
past it. Rank weights are fusec's cuts: rank r's q_proj rows are the r-th half of the full
tensor's. A 2-layer variant traces into one graph per rank with the functional collectives
(torch.compile fullgraph, aot_eager: what the GPU benchmark compiles with Inductor).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from rank_spawn import spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import baseline_tp as btp  # noqa: E402
import baseline_torch as bt  # noqa: E402

MODEL = os.path.join(ROOT, "models", "kimi_k3.py")
R, B, STEPS = 2, 4, 3
TOL = 1e-4
BF16_EXPERTS = {"expert_dtype": "bf16"}
CASES = [({}, "gather"), (BF16_EXPERTS, "grouped"), (BF16_EXPERTS, "dense"), (BF16_EXPERTS, "gather")]
SMALL = {"layers": 2, "mla_layers": (1,), "attn_res_block": 1}


def _ids(overrides, moe):
    return f"{'bf16' if overrides.get('expert_dtype') == 'bf16' else 'mxfp4'}-{moe}"


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (B,), generator=g, dtype=torch.int32),
             torch.arange(B, dtype=torch.int32) * 3 + s) for s in range(STEPS)]


def _spmd(graph, batch, max_len):
    from fusec.compiler import lower
    from fusec.passes.options import Options
    return lower(graph, Options(ranks=R, batch=batch, max_len=max_len)).graph


def _worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    import fusec
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=R)
    res = {}
    max_len = STEPS + 3 * B
    for overrides, moe in CASES:
        ref = fusec.compile(MODEL, "tiny", batch=B, max_len=max_len, precision="fp32", overrides=overrides)
        cfg = bt.k3_config("tiny", overrides)
        full = dict(ref.runner.weights)
        spmd = _spmd(ref.graph, B, max_len)
        for tag, w in (("ok", full), ("perturbed", None)):
            if tag == "perturbed":
                if moe != "gather" or overrides:
                    continue
                # rank 1's half of one layer's routed experts (w2) scaled by 1.01
                w = dict(full)
                name = "layers.2.block_sparse_moe.experts.w2"
                t = w[name]
                from fusec.ir.quant import MXFP4Tensor
                assert isinstance(t, MXFP4Tensor) or t.dtype == torch.float32
                if isinstance(t, MXFP4Tensor):       # the reference runner keeps MXFP4 as is
                    sc = t.scale.clone()
                    sc[t.scale.shape[0] // 2:] += 1  # x2 on rank 1's experts: far from a rounding
                    w[name] = MXFP4Tensor(t.packed, sc)
                else:
                    w[name] = torch.cat([t[:t.shape[0] // 2], t[t.shape[0] // 2:] * 1.01])
            step = btp.from_full(cfg, spmd, w, B, max_len, rank=rank, ranks=R, moe=moe, model_graph=ref.graph)
            ref.reset()
            got = []
            with torch.no_grad():
                for tok, pos in _inputs(cfg.vocab):
                    r = ref(tok, pos)
                    lb, nb = step(tok, pos)
                    got.append((lb.clone(), nb.clone(), r.logits.clone(), r.next_tokens.clone()))
            res[_ids(overrides, moe), tag] = got
        if overrides == {} and moe == "gather":
            rw = btp.rank_weights(spmd, full, rank)
            q = full["layers.0.self_attn.q_proj.weight"]
            h = q.shape[0] // R
            res["q_slice_ok"] = torch.equal(rw["layers.0.self_attn.q_proj.weight"], q[rank * h:(rank + 1) * h])
            res["f_a_whole"] = torch.equal(rw["layers.0.self_attn.f_a_proj.weight"],
                                           full["layers.0.self_attn.f_a_proj.weight"])
    # fullgraph trace with the collectives, bf16 weights, 2-layer variant
    for overrides, moe in ((SMALL, "gather"), ({**SMALL, **BF16_EXPERTS}, "grouped")):
        ref = fusec.compile(MODEL, "tiny", batch=2, max_len=8, overrides=overrides)
        cfg = bt.k3_config("tiny", overrides)
        spmd = _spmd(ref.graph, 2, 8)
        eager = btp.from_full(cfg, spmd, dict(ref.runner.weights), 2, 8, rank=rank, ranks=R, moe=moe)
        traced = btp.from_full(cfg, spmd, dict(ref.runner.weights), 2, 8, rank=rank, ranks=R, moe=moe)
        traced.mark_static()
        cfn = torch.compile(traced, backend="aot_eager", fullgraph=True, dynamic=False)
        tok = torch.tensor([3, 5], dtype=torch.int32)
        trace = []
        with torch.no_grad():
            for s in range(2):
                pos = torch.tensor([s, s + 2], dtype=torch.int32)
                le, ne = eager(tok, pos)
                lc, nc = cfn(tok, pos)
                trace.append((le.clone(), ne.clone(), lc.clone(), nc.clone()))
        res["trace", _ids(overrides, moe)] = trace
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_out(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    return spawn_ranks(_worker, d, R)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("overrides,moe", CASES, ids=[_ids(o, m) for o, m in CASES])
def test_tp2_matches_single_process_reference(tp_out, overrides, moe):
    for s in range(STEPS):
        for r in range(R):
            lb, nb, lr, nr = tp_out[r][_ids(overrides, moe), "ok"][s]
            assert torch.equal(lb, tp_out[0][_ids(overrides, moe), "ok"][s][0]), f"step {s}: rank {r} != rank 0"
            assert lb.shape == lr.shape
            assert _rel(lb, lr) < TOL, f"step {s} rank {r}: rel err {_rel(lb, lr):.1e}"
            assert torch.equal(nb, nr), f"step {s} rank {r}: greedy tokens differ"


def test_a_perturbed_rank_slice_is_caught(tp_out):
    errs = [_rel(lb, lr) for lb, _, lr, _ in tp_out[0]["mxfp4-gather", "perturbed"]]
    assert min(errs) > 10 * TOL, errs


def test_rank_weights_are_fusec_cuts(tp_out):
    for r in range(R):
        assert tp_out[r]["q_slice_ok"] and tp_out[r]["f_a_whole"]


@pytest.mark.parametrize("case", ["mxfp4-gather", "bf16-grouped"])
def test_fullgraph_trace_with_collectives(tp_out, case):
    for r in range(R):
        for le, ne, lc, nc in tp_out[r]["trace", case]:
            assert torch.equal(ne, nc)
            assert _rel(lc, le) < 1e-2


def test_local_config_and_candidates():
    cfg = bt.k3_config("slice4-e128")
    lc = btp.local_config(cfg, 2)
    assert (lc.kda_heads, lc.mla_heads, lc.experts, lc.shared_inter) == (48, 48, 64, 3072)
    assert "dequant" not in btp.moe_candidates("mxfp4", 1, 16, 448)
    with pytest.raises(ValueError, match="does not split"):
        btp.local_config(bt.k3_config("tiny"), 3)


def test_exposed_comm_from_synthetic_stamps():
    """benchmarks/ranks.py's measure on hand-made stamps (ns): CTA 0 runs rows 0 (body 0..1000)
    and 1 (remote wait 1000..3000, body 3000..4000); CTA 1 runs row 2 (body 0..1500) and row 3
    (remote wait 1500..2500, body 2500..4000). Remote waits pending 1000..3000; bodies run
    0..1500 and 2500..4000: exposed 1500..2500 = 1000 ns of a 4000 ns wall. CTA remote waits
    2000 + 1000 ns over 2 CTAs = 1500 ns each."""
    import ranks as rb
    prof = torch.tensor([[0, 0, 1000], [1000, 3000, 4000], [0, 0, 1500], [1500, 2500, 4000]])
    got = rb.exposed_comm(prof, [1, 3], ((0, 1), (2, 3)))
    assert got["wall_us"] == 4.0 and got["exposed_us"] == 1.0 and got["exposed_fraction"] == 0.25
    assert got["sys_wait_cta_us"] == 1.5
    # the same waits fully hidden: another CTA runs a body over 1000..3000
    prof2 = torch.cat([prof, torch.tensor([[0, 1000, 3000]])])
    assert rb.exposed_comm(prof2, [1, 3], ((0, 1), (2, 3), (4,)))["exposed_us"] == 0.0
    # a row not run (zeros) is ignored; no remote rows: nothing exposed
    prof3 = torch.cat([prof, torch.zeros(1, 3, dtype=torch.int64)])
    assert rb.exposed_comm(prof3, [], ((0, 1), (2, 3), (4,)))["exposed_us"] == 0.0
