"""Hybrid parallelism: TP replica groups + expert parallelism over rank groups (passes/shard.py).

A collective over groups of g ranks spaced s apart (attrs `ranks` = g, `stride` = s, R = g s)
reduces or gathers within rank r's coset {r mod s + k s}. These tests check the group semantics
against hand-written values, the sharded K3 tiny against the unsharded graph on R = 8 (tp = 4,
ep = 8) and R = 6 (tp = 2, ep = 2), the lowering's peers (only group members are written) and
verification at R = 8, and the full K3 plan at R = 64 and 72 (structure only).
"""
from __future__ import annotations

import re

import pytest
import torch

from fusec.backends.reference.executor import ExecError
from fusec.backends.reference.ranks import _collective, param_for_rank
from fusec.passes.options import Options
from fusec.ir.ops.comm import as_rank
from fusec.ir.parser import parse_fir
from fusec.ir.printer import print_graph
from fusec.ir.registry import get_op
from fusec.ir.schedule import InstrKind
from fusec.passes.manager import PIPELINES, Program, run_pipeline
from fusec.passes.memory_order import check_schedule
from test_passes_graph import K3_DIMS, check_same_numerics, reference_run

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


# -- group semantics, by hand -------------------------------------------------------------------------
def test_all_reduce_sums_within_cosets():
    # R = 6, groups of 2 ranks spaced 3 apart: {0, 3}, {1, 4}, {2, 5}
    xs = [torch.tensor([float(10 ** r)]) for r in range(6)]
    got = [y.item() for y in _collective("all_reduce", xs, {"ranks": 2, "stride": 3})]
    assert got == [1001.0, 10010.0, 100100.0, 1001.0, 10010.0, 100100.0]


def test_all_gather_and_reduce_scatter_follow_group_index():
    xs = [torch.tensor([float(r)]) for r in range(4)]        # groups {0, 2}, {1, 3}
    gathered = _collective("all_gather", xs, {"ranks": 2, "stride": 2, "dim": 0})
    assert [y.tolist() for y in gathered] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    xs = [torch.tensor([1.0, 2.0]) * (r + 1) for r in range(4)]
    scattered = _collective("reduce_scatter", xs, {"ranks": 2, "stride": 2, "dim": 0})
    # group {0, 2}: sum = 4 * [1, 2]; rank 0 (index 0) keeps 4, rank 2 (index 1) keeps 8
    assert [y.tolist() for y in scattered] == [[4.0], [6.0], [8.0], [12.0]]


def test_collective_groups_must_cover_the_ranks():
    with pytest.raises(ExecError, match="groups of 2 ranks 2 apart but the executor runs 6"):
        _collective("all_reduce", [torch.zeros(1)] * 6, {"ranks": 2, "stride": 2})


def test_rank_slice_takes_the_group_index():
    ref = get_op("rank_slice").ref
    x = torch.arange(4.0)
    got = []
    for r in range(6):          # groups of 2 spaced 3 apart: ranks 0-2 index 0, ranks 3-5 index 1
        with as_rank(r):
            got.append(ref([x], {"ranks": 2, "stride": 3, "dim": 0})[0].tolist())
    assert got == [[0.0, 1.0]] * 3 + [[2.0, 3.0]] * 3


def test_param_annotation_stride_slices_per_group_index():
    g = parse_fir("graph t (B) {\n  io %x : bf16[B, 4]\n"
                  "  weight %w : bf16[2, 4] {split = [0], ranks = 2, stride = 3}\n"
                  "  %y : bf16[B, 2] = linear(%x, %w)\n  return %y\n}\n")
    full = {"w": torch.arange(16.0).reshape(4, 4)}
    assert param_for_rank(g, "w", full, 4)[:, 0].tolist() == [8.0, 12.0]     # 4 // 3 = index 1
    assert param_for_rank(g, "w", full, 2)[:, 0].tolist() == [0.0, 4.0]


def test_group_attrs_print_and_parse_exactly():
    text = ("graph t (B) {\n  io %x : f32[B, 8]\n"
            "  %y : f32[B, 8] = all_reduce(%x) {ranks = 4, stride = 2}\n"
            "  %z : f32[B, 2] = rank_slice(%y) {ranks = 4, stride = 2, dim = 1}\n"
            "  %w : f32[B, 8] = all_gather(%z) {ranks = 4, stride = 2, dim = 1}\n  return %w\n}\n")
    assert print_graph(parse_fir(text)) == text
    # stride 1 is the default and is not printed (R = ranks graphs print as before)
    assert "stride" not in print_graph(parse_fir(text.replace(", stride = 2", "")))


# -- K3 tiny: hybrid sharding preserves the step ------------------------------------------------------
@pytest.fixture(scope="module")
def k3_tiny():
    from fusec.models import kimi_k3
    g = kimi_k3.build_graph("tiny")
    return g, reference_run(g, K3_DIMS, rules=kimi_k3.WEIGHT_INIT)


def _shard(g, ranks: int) -> Program:
    prog = Program(g.copy(), Options(ranks=ranks))
    return run_pipeline(prog, ["canonicalize", "fuse", "shard"])


@pytest.mark.parametrize("ranks,tp,ep", [(8, 4, 8), (6, 2, 2)])
def test_k3_tiny_hybrid_equals_unsharded(k3_tiny, ranks, tp, ep):
    g, ref = k3_tiny
    prog = _shard(g, ranks)
    assert prog.notes["shard"] == {"ranks": ranks, "tp": tp, "ep": ep}
    after = prog.graph
    kda = [op for op in after.ops if op.opname == "kda_recurrent"]
    assert kda and all(op.attrs["heads"] == 4 // tp for op in kda)
    moe = [op for op in after.ops if op.opname == "moe_gate_up"]
    assert moe and all((op.attrs["ep_ranks"], op.attrs["ep_stride"]) == (ep, ranks // ep) for op in moe)
    for op in after.ops:
        if op.opname in COLLECTIVES:
            assert op.attrs["ranks"] * op.attrs["stride"] == ranks
    text = print_graph(after)
    assert print_graph(parse_fir(text)) == text
    check_same_numerics(g, parse_fir(text), ranks, K3_DIMS, ref=ref)


def test_requested_smaller_ep_shares_the_tp_groups(k3_tiny):
    """ep = tp = 4 at R = 8: the expert sums live on the TP groups, so the latent all-reduce is
    over 4 ranks spaced 2 apart, and the step still equals the unsharded one."""
    g, ref = k3_tiny
    prog = Program(g.copy(), Options(ranks=8), notes={"shard_degrees": {"ep": 4}})
    run_pipeline(prog, ["canonicalize", "fuse", "shard"])
    assert prog.notes["shard"] == {"ranks": 8, "tp": 4, "ep": 4}
    red = {op.outputs[0].name: op for op in prog.graph.ops}["l1.latent_norm"].inputs[0].producer
    assert (red.opname, red.attrs["ranks"], red.attrs["stride"]) == ("all_reduce", 4, 2)
    check_same_numerics(g, parse_fir(print_graph(prog.graph)), 8, K3_DIMS, ref=ref)
    bad = Program(g.copy(), Options(ranks=8), notes={"shard_degrees": {"ep": 3}})
    with pytest.raises(Exception, match="ep = 3 must divide R = 8 and the planned ep = 8"):
        run_pipeline(bad, ["canonicalize", "fuse", "shard"])


def test_numerics_check_catches_a_wrong_group(k3_tiny):
    """The check can fail: the latent slice taken by stride-1 groups (index r % 4) instead of the
    TP cosets (index r // 2) feeds each rank another rank's slice."""
    g, ref = k3_tiny
    text = print_graph(_shard(g, 8).graph)
    assert "rank_slice(%l1.latent_norm) {ranks = 4, stride = 2, dim = 1}" in text
    broken = text.replace("rank_slice(%l1.latent_norm) {ranks = 4, stride = 2, dim = 1}",
                          "rank_slice(%l1.latent_norm) {ranks = 4, dim = 1}")
    with pytest.raises((AssertionError, ExecError), match="replicas disagree|rel err|differs"):
        check_same_numerics(g, parse_fir(broken), 8, K3_DIMS, ref=ref)


# -- lowering and verification ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k3_tiny_r8_schedule(k3_tiny):
    g, _ = k3_tiny
    opts = Options(ranks=8, batch=2, max_len=16, sms=16, verify_each_pass=False)
    return run_pipeline(Program(g.copy(), opts), PIPELINES["default"]).schedule


def test_k3_tiny_r8_schedule_verifies(k3_tiny_r8_schedule):
    s = k3_tiny_r8_schedule
    assert s.replicated
    rep = check_schedule(s)
    assert rep.ok, rep.first_error()
    rep = check_schedule(s.materialize())          # the ground truth: every rank's tasks
    assert rep.ok, rep.first_error()


def test_collective_pushes_reach_only_the_group(k3_tiny_r8_schedule):
    s = k3_tiny_r8_schedule
    stride = {op.outputs[0].name: op.attrs["stride"] for op in s.graph.ops if op.opname in COLLECTIVES}
    size = {op.outputs[0].name: op.attrs["ranks"] for op in s.graph.ops if op.opname in COLLECTIVES}
    assert {4, 8} <= set(size.values())            # TP groups of 4 and the EP group of 8 both occur
    m = s.materialize()
    writers: dict[tuple, list[int]] = {}
    parts: dict[str, set] = {}
    for t in m.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.STORE and i.region.tensor.endswith(".slots"):
                # `<y>.slots`, or `<y>.part<k>.slots` for part k of an all-reduce split_reduce cut
                y, part = re.fullmatch(r"(.*?)(\.part\d+)?\.slots", i.region.tensor).groups()
                peer = i.region.rank
                assert peer % stride[y] == t.rank % stride[y], f"{y}: rank {t.rank} writes rank {peer}"
                assert s.buffers[i.region.tensor].shape[0] == size[y]
                parts.setdefault(y, set()).add(part)
                writers.setdefault((y, part, peer, i.region.box[0]), []).append(t.rank)
            if i.kind is InstrKind.SIGNAL and i.peer is not None:
                assert i.peer != t.rank
    # every peer's slot d (1..g-1) is written by exactly one rank: the member d places behind
    assert any(p is not None for ps in parts.values() for p in ps)     # split_reduce cut some
    for y, g in size.items():
        for part in parts[y]:
            for peer in range(8):
                for d in range(1, g):
                    assert writers.get((y, part, peer, (d, d + 1))) == [(peer - d * stride[y]) % 8], (y, part, peer, d)


def _group_allreduce(ranks: int, stride: int):
    from fusec.ir.builder import GraphBuilder
    from fusec.ir.types import DType
    b = GraphBuilder("ar", dims=("B",))
    x = b.io("x", ["B", 256], DType.bf16)
    h = b.op("linear", x, b.weight("w1", [256, 256]), name="h")
    return b.finish([b.op("all_reduce", h, ranks=ranks, stride=stride, name="r")])


def test_subgroup_all_reduce_lowering():
    """R = 6, groups of 2 spaced 3 apart: one push to rank offset 3, a 2-row slot buffer, one
    arrival awaited, one ack back to offset 3 (= -3 mod 6)."""
    from test_lowering import lower
    s = lower(_group_allreduce(2, 3), ranks=6).schedule
    (push,) = [t for t in s.tasks if t.body_kind == "comm_push"]
    (st,) = push.stores()
    assert st.region.rank == 3 and push.instrs[-1].peer == 3
    assert s.buffers["r.slots"].shape == (2, 1, 256)
    (red,) = [t for t in s.tasks if t.body_kind == "comm_all_reduce"]
    waits = [i for i in red.instrs if i.kind is InstrKind.WAIT and i.peer is None and i.threshold]
    assert [i.threshold for i in waits if "arrive" in s.events[i.event].name] == [1]
    assert [i.peer for i in red.instrs if i.kind is InstrKind.SIGNAL and i.peer is not None] == [3]
    assert check_schedule(s.materialize()).ok


def test_subgroup_lowering_refuses_groups_that_miss_ranks():
    from test_lowering import lower
    with pytest.raises(Exception, match="groups of 2 ranks 3 apart, which do not cover the program's 4 ranks"):
        lower(_group_allreduce(2, 3), ranks=4)


# -- full K3 at R = 64 and 72: structure only ---------------------------------------------------------
@pytest.mark.parametrize("ranks,tp,ep", [(64, 32, 64), (72, 24, 8)])
def test_k3_full_hybrid_plan(ranks, tp, ep):
    from fusec.models import kimi_k3
    prog = _shard(kimi_k3.build_graph("full"), ranks)
    assert prog.notes["shard"] == {"ranks": ranks, "tp": tp, "ep": ep}
    g = prog.graph
    by_name = {op.outputs[0].name: op for op in g.ops}
    assert g.value("layers.1.block_sparse_moe.experts.w1").type.shape[0] == 896 // ep
    assert g.value("layers.0.kda.recurrent_state").type.shape == ("B", 96 // tp, 128, 128)
    assert g.param_attrs["layers.0.self_attn.o_proj.weight"]["stride"] == ranks // tp
    for i in range(1, 93):
        red = by_name[f"l{i}.latent_norm"].inputs[0].producer
        assert red.opname == "all_reduce" and (red.attrs["ranks"], red.attrs["stride"]) == (ep, ranks // ep)
    for op in g.ops:
        if op.opname in COLLECTIVES:
            assert op.attrs["ranks"] * op.attrs["stride"] == ranks
