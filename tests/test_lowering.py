"""Lowering (tile, overlap, schedule, prefetch), the cost model and the trace, on tiny K3.

The checks are independent of the code under test: bounds come from the graph's types, the
happens-before relation is rebuilt here from WAIT/SIGNAL instructions, coverage is box algebra.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from fusec.passes.options import Options
from fusec.passes.target import GPUS
from fusec.stats import graph_stats
from fusec.ir.builder import GraphBuilder
from fusec.ir.schedule import InstrKind, Scope
from fusec.ir.types import DType, Kind
from fusec.models import kimi_k3
from fusec.passes.manager import Program, run_pipeline
from fusec.trace import SM_GROUP, chrome_trace, task_graph_dot

LOWER = ["tile", "overlap", "schedule", "prefetch"]


def lower(g, **kw):
    prog = Program(g, Options(verify_each_pass=False, **kw))
    run_pipeline(prog, LOWER)
    return prog


@pytest.fixture(scope="module")
def tiny():
    return lower(kimi_k3.build_graph("tiny"), batch=2, max_len=32)


def _types(s):
    t = {v.name: v.type for v in s.graph.values()}
    t.update(s.buffers)
    return t


def _subtract(box, cut):
    """box minus cut, as a list of disjoint boxes."""
    if any(b1 <= c0 or c1 <= b0 for (b0, b1), (c0, c1) in zip(box, cut)):
        return [box]
    out, cur = [], list(box)
    for d, ((b0, b1), (c0, c1)) in enumerate(zip(box, cut)):
        if b0 < c0:
            out.append(tuple(cur[:d] + [(b0, c0)] + cur[d + 1:]))
        if c1 < b1:
            out.append(tuple(cur[:d] + [(c1, b1)] + cur[d + 1:]))
        cur[d] = (max(b0, c0), min(b1, c1))
    return out


def covered(box, cuts) -> bool:
    rest = [box]
    for c in cuts:
        rest = [p for r in rest for p in _subtract(r, c)]
    return not rest


def happens_before(s):
    """task id -> set of task ids ordered before it by waits (transitively), rank 0 view."""
    sig = defaultdict(set)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and i.peer is None:
                sig[i.event].add(t.id)
    before = {}
    pending = sorted(tid for q in s.queues.values() for tid in q)
    while pending:                                     # any order in which waits are satisfied
        rest = []
        for tid in pending:
            t = s.tasks[tid]
            srcs = [p for i in t.instrs if i.kind is InstrKind.WAIT and i.threshold for p in sig[i.event]]
            if any(p not in before for p in srcs):
                rest.append(tid)
                continue
            acc = set()
            for p in srcs:
                acc.add(p)
                acc |= before[p]
            before[tid] = acc
        assert len(rest) < len(pending), "waits can never be satisfied"
        pending = rest
    return before


def test_regions_in_bounds(tiny):
    s = tiny.schedule
    types = _types(s)
    for t in s.tasks:
        for i in t.instrs:
            if i.region is None:
                continue
            shape = types[i.region.tensor].concrete(s.dims)
            assert len(shape) == len(i.region.box), (t.id, i.region)
            for (a, b), n in zip(i.region.box, shape):
                assert 0 <= a < b <= n, (t.id, i.region, shape)


def test_every_activation_load_is_produced_first(tiny):
    s = tiny.schedule
    kinds = {v.name: v.kind for v in s.graph.values()}
    params = {v.name for v in s.graph.params}
    stores = defaultdict(list)
    for t in s.tasks:
        for i in t.stores():
            stores[i.region.tensor].append((t.id, i.region.box))
    before = happens_before(s)
    for t in s.tasks:
        for i in t.loads():
            name = i.region.tensor
            if kinds.get(name) is Kind.weight:
                continue
            mine = [b for p, b in stores[name] if p in before[t.id]]
            if covered(i.region.box, mine):
                continue
            # otherwise: the previous step's value of a parameter, and nobody overwrites it first
            assert name in params and kinds[name] in (Kind.state, Kind.io), (t.id, i.region)
            for p, b in stores[name]:
                if p != t.id:   # two boxes overlap only if they overlap in every dimension
                    assert t.id in before[p] or not all(
                        b0 < a1 and a0 < b1 for (a0, a1), (b0, b1) in zip(i.region.box, b)), (t.id, p, name)


def test_loads_come_after_waits_except_static_weights(tiny):
    s = tiny.schedule
    weights = {v.name for v in s.graph.weights()}
    for t in s.tasks:
        kinds = [i.kind for i in t.instrs]
        last_wait = max((k for k, x in enumerate(kinds) if x is InstrKind.WAIT), default=-1)
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and k < last_wait:
                assert i.region.tensor in weights and i.addressed_by is None, (t.id, i)
        stores = [k for k, x in enumerate(kinds) if x is InstrKind.STORE]
        sigs = [k for k, x in enumerate(kinds) if x is InstrKind.SIGNAL]
        assert not stores or not sigs or max(stores) < min(sigs)


def test_expert_weight_loads_are_addressed_by_router_ids(tiny):
    s = tiny.schedule
    n = 0
    for t in s.tasks:
        if t.body_kind in ("moe_gate_up", "moe_down"):
            for i in t.loads():
                if ".experts.w" in i.region.tensor:
                    assert i.addressed_by and i.addressed_by.endswith("route_ids")
                    n += 1
    assert n > 0


def test_queues_follow_one_topological_order(tiny):
    s = tiny.schedule
    seen = sorted(tid for q in s.queues.values() for tid in q)
    assert seen == list(range(len(s.tasks)))
    sig = defaultdict(list)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and i.peer is None:
                sig[i.event].append(t.id)
    edges = defaultdict(set)
    for q in s.queues.values():
        for a, b in zip(q, q[1:]):
            edges[a].add(b)
    per_step = {e.id: e.per_step for e in s.events}
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.WAIT and i.threshold:
                assert i.threshold <= per_step[i.event] == len(sig[i.event])
                for p in sig[i.event]:
                    edges[p].add(t.id)
    # Kahn: the union of queue order and wait edges must be acyclic (no deadlock)
    indeg = defaultdict(int)
    for a in edges:
        for b in edges[a]:
            indeg[b] += 1
    ready = [t.id for t in s.tasks if indeg[t.id] == 0]
    done = 0
    while ready:
        a = ready.pop()
        done += 1
        for b in edges[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    assert done == len(s.tasks)


def test_predicted_step_time_consistent_with_bandwidth(tiny):
    s = tiny.schedule
    step = float(s.meta["predicted_step_us"])
    spec = GPUS["h200"]
    types = _types(s)
    total = 0.0
    for t in s.tasks:
        for i in t.loads() + t.stores():
            n = math.prod(b - a for a, b in i.region.box) * types[i.region.tensor].dtype.bits / 8
            if i.addressed_by and types[i.region.tensor].kind is Kind.weight:
                n /= types[i.region.tensor].concrete(s.dims)[0]
            total += n
    assert step > 0
    assert step >= total / spec.hbm_bw * 1e6             # never faster than the memory system
    assert step <= sum(t.cost_us for t in s.tasks)       # never slower than one SM doing it all
    st = graph_stats(s.graph, s.dims)
    assert st.active_params < st.params


def test_expert_tasks_are_charged_their_distinct_experts(tiny):
    """A routed-expert task streams its rows of every distinct expert its (token, slot) pairs
    chose: with ids uniform over E experts, 1 - (1 - 1/E)^pairs of the region's rows. Its
    predicted time must cover at least those bytes at its SM's share of HBM (charging one
    expert's rows, as the cost model did until stop 14, fails this by ~3.8x on tiny K3)."""
    from fusec.passes.cost import TASK_OVERHEAD_US
    s = tiny.schedule
    spec = GPUS["h200"]
    types = _types(s)
    n = 0
    for t in s.tasks:
        if t.body_kind not in ("moe_gate_up", "moe_down"):
            continue
        pairs = (t.tile[0][1] - t.tile[0][0]) * (t.tile[1][1] - t.tile[1][0])   # tile: (batch rows, slots, rows)
        need = 0.0
        for i in t.loads():
            ty = types[i.region.tensor]
            if i.addressed_by and ty.kind is Kind.weight:
                e = ty.concrete(s.dims)[0]
                need += math.prod(b - a for a, b in i.region.box) * ty.dtype.bits / 8 * (1 - (1 - 1 / e) ** pairs)
        assert need > 0
        assert t.cost_us >= TASK_OVERHEAD_US + need / (spec.hbm_bw / s.sms) * 1e6 * (1 - 1e-9), (t.id, t.cost_us)
        n += 1
    assert n > 0


def test_big_gemv_uses_every_sm():
    b = GraphBuilder("g", dims=("B",))
    x = b.io("x", ["B", 7168], DType.bf16)
    y = b.op("linear", x, b.weight("w", [12288, 7168]), name="y")
    g = b.finish([y])
    s = lower(g).schedule
    assert len(s.tasks) == 132 and len(s.queues) == 132
    rows = sorted(t.tile[-1] for t in s.tasks)
    assert rows[0][0] == 0 and rows[-1][1] == 12288
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    for t in s.tasks:
        (wl,) = [i for i in t.loads() if i.region.tensor == "w"]
        assert wl.region.box == (t.tile[-1], (0, 7168))
        (xl,) = [i for i in t.loads() if i.region.tensor == "x"]
        assert xl.region.box == ((0, 1), (0, 7168))


def _allreduce_graph(R):
    b = GraphBuilder("ar", dims=("B",))
    x = b.io("x", ["B", 1024], DType.bf16)
    h = b.op("linear", x, b.weight("w1", [1024, 1024]), name="h")
    r = b.op("all_reduce", h, ranks=R, name="r")
    side = b.op("linear", x, b.weight("w2", [1024, 1024]), name="side")   # independent work
    y = b.op("add", r, side, name="y")
    return b.finish([y])


def test_collective_is_pushed_per_peer_with_system_scope():
    R = 4
    prog = lower(_allreduce_graph(R), ranks=R)
    s = prog.schedule
    assert s.replicated
    pushes = [t for t in s.tasks if t.body_kind == "comm_push"]
    assert sorted(t.instrs[-1].peer for t in pushes) == [1, 2, 3]
    for t in pushes:
        (st,) = t.stores()
        assert st.region.rank == t.instrs[-1].peer and s.buffers[st.region.tensor].kind is Kind.comm
        assert t.instrs[-1].scope is Scope.sys
        ack = [i for i in t.instrs if i.kind is InstrKind.WAIT and i.scope is Scope.sys]
        assert ack and ack[0].threshold == 0          # previous step's acks: slot is free (V4)
    (red,) = [t for t in s.tasks if t.body_kind == "comm_all_reduce"]
    waits = [i for i in red.instrs if i.kind is InstrKind.WAIT and i.scope is Scope.sys]
    assert waits and waits[0].threshold == R - 1
    acks = sorted(i.peer for i in red.instrs if i.kind is InstrKind.SIGNAL and i.peer is not None)
    assert acks == [1, 2, 3]
    # overlap: the independent GEMV is issued between the pushes and the reduce
    names = [u.name for u in s.families]
    assert names.index("r.push") < names.index("side") < names.index("r")
    # materialize: every rank, peers rotated
    m = s.materialize()
    assert len(m.tasks) == R * len(s.tasks)
    r2 = [t for t in m.tasks if t.rank == 2 and t.body_kind == "comm_push"]
    assert sorted(t.instrs[-1].peer for t in r2) == [0, 1, 3]


def test_compact_trace_groups_sms_and_families(tiny):
    s = tiny.schedule
    tr = json.loads(json.dumps(chrome_trace(s)))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) < len(s.tasks)                                # families, not tasks
    assert sum(e["args"]["tasks"] for e in xs) == len(s.tasks)   # every task counted once
    assert {e["tid"] for e in xs} == {sm // SM_GROUP for (_, sm) in s.queues}
    end = max(e["ts"] + e["dur"] for e in xs)
    assert end == pytest.approx(float(s.meta["predicted_step_us"]), rel=1e-6)
    busy = [e["args"]["busy"] for e in tr["traceEvents"] if e["ph"] == "C"]
    assert busy and 0 < max(busy) <= len(s.queues)


def test_trace_has_one_track_per_sm(tiny):
    s = tiny.schedule
    tr = json.loads(json.dumps(chrome_trace(s, full=True)))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(s.tasks)
    assert {(e["pid"], e["tid"]) for e in xs} == {(0, sm) for (_, sm) in s.queues}
    end = max(e["ts"] + e["dur"] for e in xs)
    assert end == pytest.approx(float(s.meta["predicted_step_us"]), rel=1e-6)
    dot = task_graph_dot(s)
    assert dot.startswith("digraph") and dot.count("->") > 0


def test_split_sequence_attention_keeps_the_step_numerics(monkeypatch):
    """tile rewrites long-cache MLA attention into chunk partials + combine: same outputs."""
    import torch
    from fusec.passes import _lowering, _units
    monkeypatch.setattr(_units, "MIN_TASK_BYTES", 4096)      # tiny caches count as long (_collectives)
    monkeypatch.setattr(_lowering, "MIN_TASK_BYTES", 4096)   # and the other families are cut as finely
    from fusec.backends.reference.executor import init_state, prepare_weights, run_step
    from fusec.weights import random_weights
    g = kimi_k3.build_graph("tiny")
    dims = {"B": 2, "L": 64}
    prog = Program(g.copy(), Options(verify_each_pass=False, batch=2, max_len=64))
    run_pipeline(prog, ["canonicalize"])
    before = prog.graph.copy()
    run_pipeline(prog, LOWER)
    parts = [op for op in prog.graph.ops if op.opname == "mla_attention_partial"]
    assert parts and all(op.attrs["chunks"] > 1 for op in parts)
    chunk_tasks = [t for t in prog.schedule.tasks if t.body_kind == "mla_attention_partial"]
    for t in chunk_tasks:      # each chunk task reads only its rows of the cache
        (c,) = [i for i in t.loads() if "latent_cache" in i.region.tensor]
        assert c.region.box[1][1] - c.region.box[1][0] < 64
    outs = []
    for graph in (before, prog.graph):
        W = prepare_weights(graph, random_weights(graph, 0, kimi_k3.WEIGHT_INIT), "fp32")
        st = init_state(graph, dims, precision="fp32")
        for step in range(2):
            tok = torch.tensor([5 + step, 9], dtype=torch.int32)
            logits, _ = run_step(graph, W, st, {"tokens": tok, "pos": torch.tensor([step, step], dtype=torch.int32)},
                                 dims, "fp32")
        outs.append(logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_tiny_r2_default_pipeline_passes_the_memory_order_verifier():
    from fusec.passes.manager import PIPELINES
    from fusec.passes.memory_order import check_schedule
    prog = Program(kimi_k3.build_graph("tiny"), Options(verify_each_pass=False, ranks=2, batch=2, max_len=32))
    run_pipeline(prog, PIPELINES["default"])
    s = prog.schedule
    assert s.replicated and any(t.body_kind == "comm_push" for t in s.tasks)
    rep = check_schedule(s)
    assert rep.ok, rep.first_error()
    m = s.materialize()
    assert {t.rank for t in m.tasks} == {0, 1} and len(m.queues) == 2 * len(s.queues)


def test_families_are_the_tile_stage(tiny):
    """The task families are part of the schedule IR: every task in exactly one family, in a
    topological order, printed and read back; check_families names each defect."""
    import copy
    from fusec.ir.schedule import check_families
    from fusec.ir.schedule_text import parse_schedule, print_schedule
    s = tiny.schedule
    check_families(s)
    assert sorted(t for f in s.families for t in f.task_ids) == list(range(len(s.tasks)))
    back = parse_schedule(print_schedule(s))
    assert back.families == s.families
    broken = copy.deepcopy(s)
    broken.families[1].task_ids.append(broken.families[0].task_ids[0])
    with pytest.raises(ValueError, match=r"task \d+ is in families"):
        check_families(broken)
    broken = copy.deepcopy(s)
    later = next(f for f in broken.families if f.deps)
    broken.families.remove(later)
    broken.families.insert(0, later)
    with pytest.raises(ValueError, match="not an earlier family"):
        check_families(broken)
    broken = copy.deepcopy(s)
    broken.families[-1].task_ids.pop()
    with pytest.raises(ValueError, match=r"1 task\(s\) in no family"):
        check_families(broken)
    broken = copy.deepcopy(s)
    broken.families[0].task_ids.append(len(s.tasks))
    with pytest.raises(ValueError, match="not a task of the schedule"):
        check_families(broken)
