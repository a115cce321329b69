"""Graph passes (canonicalize, fuse, shard): .fir in -> expected .fir out, plus numerics.

Each `tests/passes/<case>.fir` names its passes in a header comment (`# PASSES: fuse`, optional
`# RANKS: 2`, `# DIMS: B=2 L=8`); the expected output is `<case>.expected.fir`, written only with
`pytest --snapshot-update` (syrupy's flag) and reviewed as a diff. Every case also runs the
reference executor on the input graph (one rank, unsharded) and on the output graph (on R
simulated ranks, weights materialised from the same full checkpoint) and compares outputs and
state updates in fp32.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fusec.backends.reference.executor import init_state, prepare_weights, run_step
from fusec.backends.reference.ranks import run_step_ranks
from fusec.passes.options import Options
from fusec.ir.parser import parse_fir, parse_fir_file
from fusec.ir.printer import print_graph
from fusec.ir.types import DType, Kind
from fusec.passes.manager import Program, run_pipeline
from fusec.weights import random_weights

CASES = Path(__file__).parent / "passes"
INPUTS = sorted(p for p in CASES.glob("*.fir") if not p.name.endswith(".expected.fir"))
REL_TOL = 1e-5


def _header(text: str, key: str, default: str) -> str:
    m = re.search(rf"^# {key}: (.*)$", text, re.M)
    return m.group(1).strip() if m else default


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


def _random_io(graph, dims, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for v in graph.inputs():
        shape = v.type.concrete(dims)
        if v.type.dtype is DType.i32:
            # ids and positions: small, in range of every table and cache used here
            out[v.name] = torch.randint(0, min(4, dims.get("L", 4)), shape, generator=g, dtype=torch.int32)
        else:
            out[v.name] = torch.randn(shape, generator=g)
    return out


def _random_state(graph, dims, seed: int) -> dict:
    """Non-zero state so that caches and recurrences have content to read."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in init_state(graph, dims, precision="fp32").items()}


def reference_run(before, dims: dict, seed: int = 0, rules=()):
    """Full checkpoint, inputs and state for `before`, and its one-rank reference step."""
    full = random_weights(before, seed, rules)
    inputs = _random_io(before, dims, seed)
    state0 = _random_state(before, dims, seed)
    state_ref = dict(state0)
    want = run_step(before, prepare_weights(before, full, "fp32"), state_ref, inputs, dims, "fp32")
    return full, inputs, state0, want, state_ref


def check_same_numerics(before, after, ranks: int, dims: dict, seed: int = 0, rules=(), ref=None) -> None:
    """The reference outputs and state updates of `after` (on `ranks` ranks) equal `before`'s."""
    full, inputs, state0, want, state_ref = ref or reference_run(before, dims, seed, rules)
    outs, state_got = run_step_ranks(after, full, ranks, state0, inputs, dims, "fp32")
    for r in range(ranks):
        for v, a, b in zip(before.outputs, want, outs[r]):
            if v.type.dtype is DType.i32:
                assert torch.equal(a, b.to(a.dtype)), f"output %{v.name} differs on rank {r}"
            else:
                assert _rel(a, b) < REL_TOL, f"output %{v.name} on rank {r}: rel err {_rel(a, b):.2e}"
    for name in before.updates:
        assert _rel(state_ref[name], state_got[name]) < REL_TOL, f"state {name} differs"


@pytest.mark.parametrize("case", INPUTS, ids=[p.stem for p in INPUTS])
def test_fir_case(case: Path, request):
    text = case.read_text()
    passes = _header(text, "PASSES", "")
    ranks = int(_header(text, "RANKS", "1"))
    dims = dict((k, int(v)) for k, v in (kv.split("=") for kv in _header(text, "DIMS", "B=3").split()))
    before = parse_fir(text, str(case))
    prog = Program(before.copy(), Options(ranks=ranks))
    run_pipeline(prog, [p for p in passes.split(",") if p])
    got = print_graph(prog.graph)
    assert print_graph(parse_fir(got)) == got, "the pass output does not round-trip through .fir"
    expected = case.with_name(case.stem + ".expected.fir")
    if request.config.getoption("--snapshot-update", default=False):
        expected.write_text(got)
    assert expected.exists(), f"{expected.name} is missing: run pytest --snapshot-update and review the diff"
    assert got == expected.read_text(), f"{case.name}: pass output differs from {expected.name}"
    # the checked-in expected graph (not only the in-memory one) computes what the input computes
    check_same_numerics(before, parse_fir_file(expected), ranks, dims)


# -- behaviour checks beyond the golden text ------------------------------------------------------
def _run(name: str, passes: list[str], ranks: int = 1, log=frozenset()):
    g = parse_fir_file(CASES / f"{name}.fir")
    prog = Program(g, Options(ranks=ranks, log=log))
    return run_pipeline(prog, passes)


def test_fusion_refusals_are_logged(capsys):
    _run("fuse_prologue_epilogue", ["fuse"], log=frozenset({"fusion"}))
    err = capsys.readouterr().err
    assert "[fusion] fuse: RMSNorm %rn not folded into %z" in err and "add %twice" in err
    _run("fuse_attn_res", ["fuse"], log=frozenset({"fusion"}))
    err = capsys.readouterr().err
    assert "add %mixed not fused into %o: operand %late is produced after the anchor starts" in err
    # a refusal that a later anchor resolves is not reported: %gated joins %gt's group
    assert "%gated" not in err


def test_fusion_groups_have_one_anchor_and_are_contiguous():
    from fusec.ir.registry import Trait
    from fusec.models import kimi_k3
    prog = Program(kimi_k3.build_graph("tiny"), Options())
    run_pipeline(prog, ["canonicalize", "fuse"])
    seen, last = set(), None
    for op in prog.graph.ops:
        if op.group and op.group != last:
            assert op.group not in seen, f"group {op.group} is not contiguous"
            seen.add(op.group)
        last = op.group
    groups = {}
    for op in prog.graph.ops:
        if op.group:
            groups.setdefault(op.group, []).append(op)
    for name, ops in groups.items():
        assert sum(Trait.gemv in o.opdef.traits for o in ops) <= 1, f"group {name} has two GEMVs"
    assert groups and set(groups) == set(prog.notes["fusion_groups"])


def test_shard_indivisible_heads_use_replica_groups():
    """4 heads on 6 ranks: tp = 2 (3 replica groups of 2, stride 3), not a refusal."""
    prog = _run("shard_kda", ["shard"], ranks=6)
    assert prog.notes["shard"] == {"ranks": 6, "tp": 2, "ep": 1}
    g = prog.graph
    assert g.param_attrs["l.self_attn.o_proj.weight"] == {"split": (1,), "ranks": 2, "stride": 3}
    assert g.value("l.kda.recurrent_state").type.shape == ("B", 2, 16, 16)
    check_same_numerics(parse_fir_file(CASES / "shard_kda.fir"), parse_fir(print_graph(g)), 6, {"B": 3})


def test_shard_r1_is_identity():
    g = parse_fir_file(CASES / "shard_moe.fir")
    prog = Program(g.copy(), Options(ranks=1))
    run_pipeline(prog, ["shard"])
    assert print_graph(prog.graph) == print_graph(g)


def test_shard_annotations_slice_the_checkpoint():
    """The printed annotation alone tells a loader how to slice: check one weight by hand."""
    prog = _run("shard_kda", ["shard"], ranks=2)
    g = prog.graph
    assert g.param_attrs["l.self_attn.o_proj.weight"] == {"split": (1,), "ranks": 2}
    assert g.param_attrs["l.self_attn.A_log"] == {"split": (0,), "split_len": (4,), "ranks": 2}
    assert g.value("l.kda.recurrent_state").type.shape == ("B", 2, 16, 16)
    assert "l.self_attn.f_a_proj.weight" not in g.param_attrs      # replicated
    from fusec.backends.reference.ranks import param_for_rank
    full = {"l.self_attn.A_log": torch.arange(8.0)}
    assert param_for_rank(g, "l.self_attn.A_log", full, 1).tolist() == [2.0, 3.0]


def test_merged_weight_is_a_prefetchable_parameter():
    prog = _run("canonicalize_merge", ["canonicalize"])
    (mw,) = [v for v in prog.graph.weights() if "merged" in v.name]
    assert mw.kind is Kind.weight and mw.producer is None
    assert prog.graph.param_attrs[mw.name]["sources"] == (
        "attn.q_proj.weight", "attn.k_proj.weight", "attn.b_proj.weight")


# -- Kimi K3 tiny: the whole graph pipeline preserves outputs ---------------------------------------
@pytest.fixture(scope="module")
def k3_tiny():
    """Kimi K3 tiny and its one-rank reference step, computed once for the module."""
    from fusec.models import kimi_k3
    g = kimi_k3.build_graph("tiny")
    return g, reference_run(g, K3_DIMS, rules=kimi_k3.WEIGHT_INIT)


K3_DIMS = {"B": 2, "L": 8}


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_k3_tiny_graph_pipeline(ranks, k3_tiny):
    g, ref = k3_tiny
    prog = Program(g.copy(), Options(ranks=ranks))
    run_pipeline(prog, ["canonicalize", "fuse", "shard"])
    text = print_graph(prog.graph)
    assert print_graph(parse_fir(text)) == text
    assert not any(op.opname == "mla_attention_naive" for op in prog.graph.ops)
    check_same_numerics(g, parse_fir(text), ranks, K3_DIMS, ref=ref)


@pytest.mark.parametrize("ranks", [2, 4])
def test_llama_tiny_graph_pipeline(ranks):
    llama = pytest.importorskip("fusec.models.llama")
    # tiny has 2 KV heads; KV heads are split, not replicated, so R = 4 uses a 4-KV-head variant
    g = llama.build_graph("tiny", **({"kv_heads": 4} if ranks == 4 else {}))
    prog = Program(g.copy(), Options(ranks=ranks))
    run_pipeline(prog, ["canonicalize", "fuse", "shard"])
    # o_proj and down_proj are row-parallel in every layer (the tied lm_head stays replicated)
    assert sum(op.opname == "all_reduce" for op in prog.graph.ops) == 2 * len(
        [op for op in g.ops if op.opname == "attention"])
    check_same_numerics(g, parse_fir(print_graph(prog.graph)), ranks, {"B": 2, "L": 8},
                        rules=getattr(llama, "WEIGHT_INIT", ()))


def test_llama_tiny_more_ranks_than_kv_heads_replicates():
    """2 KV heads on 4 ranks: two replica groups of tp = 2 (KV heads are split, never copied)."""
    llama = pytest.importorskip("fusec.models.llama")
    g = llama.build_graph("tiny")
    prog = Program(g.copy(), Options(ranks=4))
    run_pipeline(prog, ["canonicalize", "fuse", "shard"])
    assert prog.notes["shard"]["tp"] == 2
    assert all(op.attrs["ranks"] == 2 and op.attrs["stride"] == 2
               for op in prog.graph.ops if op.opname in ("all_reduce", "all_gather"))
    check_same_numerics(g, parse_fir(print_graph(prog.graph)), 4, {"B": 2, "L": 8},
                        rules=getattr(llama, "WEIGHT_INIT", ()))


def test_graph_passes_are_idempotent():
    from fusec.models import kimi_k3
    prog = Program(kimi_k3.build_graph("tiny"), Options())
    run_pipeline(prog, ["canonicalize", "fuse"])
    once = print_graph(prog.graph)
    run_pipeline(prog, ["canonicalize", "fuse"])
    assert print_graph(prog.graph) == once


def test_k3_full_shards_over_8_ranks():
    """Structure only (no weights): the full model's plan at R = 8 (96 heads, 896 experts)."""
    from fusec.models import kimi_k3
    prog = Program(kimi_k3.build_graph("full"), Options(ranks=8))
    run_pipeline(prog, ["canonicalize", "fuse", "shard"])
    g = prog.graph
    by_name = {op.outputs[0].name: op for op in g.ops}
    moe_layers = [i for i in range(93) if i != 0]
    for i in moe_layers:
        norm = by_name[f"l{i}.latent_norm"]
        assert norm.inputs[0].producer.opname == "all_reduce", f"layer {i}: latent not reduced before its norm"
        assert by_name[f"l{i}.experts_glu"].attrs["ep_ranks"] == 8
    assert g.value("layers.1.block_sparse_moe.experts.w1").type.shape[0] == 896 // 8
    assert g.value("layers.3.mla.latent_cache").type.shape == ("B", "L", 576)          # replicated
    assert g.value("layers.0.kda.recurrent_state").type.shape == ("B", 12, 128, 128)
    assert by_name["out.next_token"].inputs[0].producer.opname == "all_gather"


def test_numerics_check_catches_a_misplaced_reduction():
    """The checker itself can fail: normalising the per-rank partial latent (all_reduce dropped
    before the latent RMSNorm) must be reported."""
    text = (CASES / "shard_moe.expected.fir").read_text()
    assert "rms_norm(%combine.all_reduce," in text
    broken = parse_fir(text.replace("rms_norm(%combine.all_reduce,", "rms_norm(%combine,"))
    with pytest.raises(AssertionError, match="output %resid"):
        check_same_numerics(parse_fir_file(CASES / "shard_moe.fir"), broken, 2, {"B": 3})


def test_param_annotation_syntax():
    from fusec.ir.parser import FirSyntaxError
    text = ("graph t (B) {\n  io %x : bf16[B, 4]\n"
            "  weight %w : bf16[2, 4] {sources = [a.w, b.w], split = [0, -1], ranks = 2}\n"
            "  %y : bf16[B, 2] = linear(%x, %w)\n  return %y\n}\n")
    g = parse_fir(text)
    assert g.param_attrs["w"] == {"sources": ("a.w", "b.w"), "split": (0, -1), "ranks": 2}
    assert print_graph(g) == text
    with pytest.raises(FirSyntaxError, match=r"<string>:3:\d+: attribute 'ranks' given twice"):
        parse_fir(text.replace("ranks = 2}", "ranks = 2, ranks = 4}"))


def test_pass_changed_claims_are_checked(monkeypatch):
    """With verify_each_pass the manager holds each pass to its "changed" result: a pass that
    edits the graph but says "no change", or says "changed" and edits nothing, is named."""
    from fusec.models import kimi_k3
    from fusec.passes import manager
    from fusec.passes.manager import PassError, Program, run_pipeline

    def rename_graph(prog):               # a real edit of the printed graph, reported as none
        prog.graph.name += "_renamed"
        return False

    monkeypatch.setitem(manager.PASSES, "t_lies_unchanged", rename_graph)
    monkeypatch.setitem(manager.PASSES, "t_lies_changed", lambda prog: True)
    monkeypatch.setitem(manager.PASSES, "t_honest", lambda prog: False)
    g = kimi_k3.build_graph("tiny")
    run_pipeline(Program(g.copy(), Options(verify_each_pass=True)), ["t_honest"])
    with pytest.raises(PassError, match="pass t_lies_changed returned changed=True, but .* did not change"):
        run_pipeline(Program(g.copy(), Options(verify_each_pass=True)), ["t_lies_changed"])
    with pytest.raises(PassError, match="pass t_lies_unchanged returned changed=False, but .* changed"):
        run_pipeline(Program(g.copy(), Options(verify_each_pass=True)), ["t_lies_unchanged"])
