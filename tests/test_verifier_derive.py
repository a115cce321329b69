"""Derive, don't trust: hand-written unsafe edits of the compiled K3 tiny and Llama tiny
schedules (R = 1 and 2) that the verifier must reject with the right rule (S1-S4, V3), never a
crash; and safe edits that it must still accept. Edits are made here by hand on the Schedule
objects or on the schedule text, not with fusec.testing.mutate (docs/verifier.md, "Derived accesses
and structural rules")."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fusec.ir.schedule import Event, Instr, InstrKind, Region, Schedule
from fusec.ir.schedule_text import ScheduleSyntaxError, parse_schedule, print_schedule
from fusec.ir.types import Kind
from fusec.passes.memory_order import Rule, check_schedule

NAMES = [f"{m}_r{r}" for m in ("k3", "llama") for r in (1, 2)]


@pytest.fixture(scope="module")
def scheds():
    from fusec.compiler import lower
    from fusec.passes.options import Options
    from fusec.loader import load_graph
    out = {}
    for m, model in (("k3", "kimi_k3"), ("llama", "llama")):
        for r in (1, 2):
            g, _ = load_graph(model, "tiny")
            out[f"{m}_r{r}"] = lower(g, Options(ranks=r, batch=2, max_len=16, sms=8, verify_each_pass=False)).schedule
    return out


def cp(s: Schedule) -> Schedule:
    return Schedule(s.graph, dict(s.dims), s.ranks, s.sms, [replace(t, instrs=list(t.instrs)) for t in s.tasks],
                    [replace(e) for e in s.events], {k: list(v) for k, v in s.queues.items()}, dict(s.meta),
                    s.replicated, dict(s.buffers))


def kind_of(s: Schedule, name: str):
    if name in s.buffers:
        return s.buffers[name].kind
    return s.graph.value(name).kind


def rejected(s: Schedule, rule: str, task: int | None = None, words: str = ""):
    rep = check_schedule(s)           # must not raise
    assert not rep.ok, "unsafe edit accepted"
    assert rule in rep.rules(), [str(e) for e in rep.errors]
    e = next(e for e in rep.errors if e.rule.value == rule)
    assert str(e).startswith(rule + ":")
    if task is not None:
        assert any(x.task == task for x in rep.errors if x.rule.value == rule), [str(x) for x in rep.errors]
    assert words in str([str(x) for x in rep.errors if x.rule.value == rule])
    return rep


def accepted(s: Schedule):
    rep = check_schedule(s)
    assert rep.ok, [str(e) for e in rep.errors][:5]


def act_load_sites(s: Schedule):
    """(task, index) of activation loads after a wait, in tasks that are not collectives."""
    for t in s.tasks:
        if t.body_kind.startswith("comm_") or not any(i.kind is InstrKind.WAIT for i in t.instrs):
            continue
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and kind_of(s, i.region.tensor) is Kind.act:
                yield t, k


def expert_load(s: Schedule):
    """A router-addressed expert weight load (its address has a producer in the step)."""
    produced = {v.name for op in s.graph.ops for v in op.outputs}
    for t in s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and i.addressed_by in produced and kind_of(s, i.region.tensor) is Kind.weight:
                return t, k
    raise AssertionError("no router-addressed load")


def before_signal(t) -> int:
    return next((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.SIGNAL), len(t.instrs))


@pytest.mark.parametrize("name", NAMES)
def test_compiled_schedules_verify(scheds, name):
    accepted(scheds[name])
    accepted(parse_schedule(print_schedule(scheds[name])))


# -- kind 1: LOAD lines that do not cover what the ops read ------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("site", [0, 3, -1])
def test_deleted_load_and_its_waits_is_S4(scheds, name, site):
    s = cp(scheds[name])
    t, k = list(act_load_sites(s))[site]
    tensor = t.instrs[k].region.tensor
    t.instrs = [i for j, i in enumerate(t.instrs) if j != k and i.kind is not InstrKind.WAIT]
    rejected(s, "S4", t.id, f"read %{tensor}")


@pytest.mark.parametrize("name", NAMES)
def test_deleted_load_kept_waits_is_S4(scheds, name):
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    del t.instrs[k]
    rejected(s, "S4", t.id)


@pytest.mark.parametrize("name", NAMES)
def test_emptied_load_box_is_S4_text(scheds, name):
    text = print_schedule(scheds[name])
    lines = text.splitlines()
    j = next(j for j, l in enumerate(lines) if l.strip().startswith("load %") and "[0:2," in l and "wait" not in l)
    lines[j] = lines[j].replace("[0:2,", "[0:0,", 1)
    rejected(parse_schedule("\n".join(lines) + "\n"), "S4", None, "empty")


@pytest.mark.parametrize("name", NAMES)
def test_shrunk_load_box_is_S4(scheds, name):
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    r = t.instrs[k].region
    box = ((r.box[0][0], r.box[0][0] + 1),) + r.box[1:] if r.box[0][1] - r.box[0][0] > 1 else r.box[:-1] + (
        (r.box[-1][0], r.box[-1][1] - 1),)
    t.instrs[k] = replace(t.instrs[k], region=replace(r, box=box))
    rejected(s, "S4", t.id, "no LOAD covers")


@pytest.mark.parametrize("name", NAMES)
def test_load_moved_after_compute_and_store_before_it_are_S4(scheds, name):
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    ld = t.instrs.pop(k)
    c = next(j for j, i in enumerate(t.instrs) if i.kind is InstrKind.COMPUTE)
    t.instrs.insert(c + 1, ld)
    rejected(s, "S4", t.id, "after the compute line")
    s = cp(scheds[name])
    t = next(t for t in s.tasks if t.stores() and not t.body_kind.startswith("comm_"))
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    st = t.instrs.pop(k)
    t.instrs.insert(0, st)
    rejected(s, "S4", t.id, "not computed yet")


@pytest.mark.parametrize("name", NAMES)
def test_tile_header_outside_its_output_is_S4(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if not t.body_kind.startswith("comm_") and len(t.tile) >= 2)
    t.tile = t.tile[:-1] + ((t.tile[-1][0], t.tile[-1][1] + 100000),)
    rejected(s, "S4", t.id)


# -- kind 3: stores no op of the task computes -----------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_store_into_io_input_is_S4(scheds, name):
    s = cp(scheds[name])
    t, _ = next(act_load_sites(s))
    t.instrs.insert(before_signal(t), Instr(InstrKind.STORE, Region("tokens", ((0, 2),))))
    rejected(s, "S4", t.id, "%tokens")


@pytest.mark.parametrize("name", NAMES)
def test_store_into_weight_read_by_others_is_S4(scheds, name):
    s = cp(scheds[name])
    t, _ = list(act_load_sites(s))[2]
    w = next(i.region for u in s.tasks if u.id != t.id for i in u.instrs
             if i.kind is InstrKind.LOAD and kind_of(s, i.region.tensor) is Kind.weight)
    t.instrs.insert(before_signal(t), Instr(InstrKind.STORE, Region(w.tensor, w.box)))
    rejected(s, "S4", t.id, f"%{w.tensor}")


@pytest.mark.parametrize("name", NAMES)
def test_store_line_deleted_is_S4(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if not t.body_kind.startswith("comm_") and t.stores())
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    del t.instrs[k]
    rejected(s, "S4", t.id, "no STORE covers")


@pytest.mark.parametrize("name", NAMES)
def test_load_of_a_tensor_no_op_reads_is_S4(scheds, name):
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    t.instrs.insert(k, Instr(InstrKind.LOAD, Region("tokens", ((0, 2),))) if not any(
        i.kind is InstrKind.LOAD and i.region.tensor == "tokens" for i in t.instrs) else
        Instr(InstrKind.LOAD, Region("logits", s.tasks[-1].tile)))
    rejected(s, "S4", t.id, "none of its ops")


# -- kind 2: addressing derived from the graph -------------------------------------------------
@pytest.mark.parametrize("name", ["k3_r1", "k3_r2"])
def test_expert_load_hoisted_without_addressed_by_is_V3(scheds, name):
    s = cp(scheds[name])
    t, k = expert_load(s)
    ld = replace(t.instrs[k], addressed_by=None)
    del t.instrs[k]
    t.instrs.insert(0, ld)                  # above every wait, the router's included
    rejected(s, "V3", t.id, "graph's dataflow")


@pytest.mark.parametrize("name", ["k3_r1", "k3_r2"])
def test_expert_load_hoisted_with_a_wrong_addressed_by_is_V3(scheds, name):
    s = cp(scheds[name])
    t, k = expert_load(s)
    ld = replace(t.instrs[k], addressed_by="tokens")    # an io input: no producer, so no wait needed
    del t.instrs[k]
    t.instrs.insert(0, ld)
    rejected(s, "V3", t.id)


# -- kinds 4-7: events, peers and ranks, SMs, queues -----------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_duplicate_event_is_S2(scheds, name):
    s = cp(scheds[name])
    s.events.append(replace(s.events[3], per_step=s.events[3].per_step + 1))
    rejected(s, "S2", None, "declared twice")


@pytest.mark.parametrize("name", NAMES)
def test_event_used_but_never_declared_is_S2(scheds, name):
    s = cp(scheds[name])
    new = max(e.id for e in s.events) + 1
    t = next(t for t in s.tasks if any(i.kind is InstrKind.WAIT for i in t.instrs))
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT)
    t.instrs[k] = replace(t.instrs[k], event=new)
    rejected(s, "S2", t.id, "never declared")


@pytest.mark.parametrize("name", NAMES)
def test_event_declared_on_a_rank_outside_R_is_S2(scheds, name):
    s = cp(scheds[name])
    s.events[5] = replace(s.events[5], rank=s.ranks)
    rejected(s, "S2", None, f"rank {s.ranks}")
    s = cp(scheds[name])
    s.events.append(Event(max(e.id for e in s.events) + 1, s.ranks + 3, "extra", 1))
    rejected(s, "S2", None, "outside")


@pytest.mark.parametrize("name", NAMES)
def test_peer_outside_R_is_S3(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if any(i.kind is InstrKind.SIGNAL for i in t.instrs))
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.SIGNAL)
    t.instrs[k] = replace(t.instrs[k], peer=s.ranks + (1 if s.ranks > 1 else 0))   # R+1 (mod R = 1), or 1 at R=1
    rejected(s, "S3", t.id, "peer")


@pytest.mark.parametrize("name", NAMES)
def test_region_rank_outside_R_is_S3(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if t.stores())
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    t.instrs[k] = replace(t.instrs[k], region=replace(t.instrs[k].region, rank=s.ranks))
    rejected(s, "S3", t.id, "never taken modulo R")


@pytest.mark.parametrize("name", NAMES)
def test_negative_peer_and_task_rank_are_S3(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if any(i.kind is InstrKind.WAIT for i in t.instrs))
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT)
    t.instrs[k] = replace(t.instrs[k], peer=-1)
    rejected(s, "S3", t.id)
    s = cp(scheds[name])
    s.tasks[4].rank = s.ranks
    rejected(s, "S3", 4, "rank")


@pytest.mark.parametrize("name", NAMES)
def test_header_sm_differs_from_queue_is_S1(scheds, name):
    s = cp(scheds[name])
    t = s.tasks[7]
    t.sm = (t.sm + 1) % s.sms
    rejected(s, "S1", 7, "sits on the queue")


def test_header_rank_differs_in_a_materialized_schedule_is_S1(scheds):
    s = scheds["k3_r2"].materialize()
    s = cp(s)
    n = len(s.tasks) // 2
    s.tasks[n + 3].rank = 0
    rejected(s, "S1", n + 3, "sits on the queue")


@pytest.mark.parametrize("name", NAMES)
def test_queue_naming_a_missing_task_is_S1(scheds, name):
    s = cp(scheds[name])
    s.queues[(0, 1)].append(len(s.tasks) + 7)
    rejected(s, "S1", None, "does not exist")
    s = cp(scheds[name])
    s.queues[(0, 2)].insert(0, -1)
    rejected(s, "S1", None, "does not exist")


@pytest.mark.parametrize("name", NAMES)
def test_malformed_text_edits_never_crash(scheds, name):
    text = print_schedule(scheds[name])
    last_queue = [l for l in text.splitlines() if l.strip().startswith("queue ")][-1]
    bad_queue = text.replace(last_queue, last_queue + " 99999")
    rejected(parse_schedule(bad_queue), "S1", None, "99999")
    ev = next(l for l in text.splitlines() if l.strip().startswith("event "))
    rejected(parse_schedule(text.replace(ev, ev + "\n" + ev)), "S2", None, "declared twice")
    # the parser may already refuse these (a ScheduleSyntaxError); if it lets them through, the
    # verifier must reject them (the same edits on objects, below)
    for bad, rule, words in ((text.replace("load %", "load %nosuch_", 1), "S4", "no tensor"),
                             (text.replace(" ops(%", " ops(%nosuch_", 1), "S4", "names no op")):
        try:
            parsed = parse_schedule(bad)
        except ScheduleSyntaxError:
            continue
        rejected(parsed, rule, None, words)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_names_on_objects_are_S4(scheds, name):
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    t.instrs[k] = replace(t.instrs[k], region=replace(t.instrs[k].region, tensor="nosuch"))
    rejected(s, "S4", t.id, "no tensor")
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    t.instrs[k] = replace(t.instrs[k], addressed_by="nosuch")
    rejected(s, "S4", t.id, "no tensor")
    s = cp(scheds[name])
    s.tasks[3].ops = ("nosuch",) + s.tasks[3].ops
    rejected(s, "S4", 3, "names no op")
    s = cp(scheds[name])
    t, k = next(act_load_sites(s))
    t.instrs[k] = Instr(InstrKind.LOAD)                 # no region at all
    rejected(s, "S1", t.id, "region")


# -- collectives: the slots the lowering's push and local tasks must touch -------------------
@pytest.mark.parametrize("name", ["k3_r2", "llama_r2"])
def test_push_retargeted_to_its_own_rank_is_S4(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if t.body_kind == "comm_push")
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    t.instrs[k] = replace(t.instrs[k], region=replace(t.instrs[k].region, rank=0))
    rejected(s, "S4", t.id, "must store")


@pytest.mark.parametrize("name", ["k3_r2", "llama_r2"])
def test_reduce_without_its_slot_load_is_S4(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if t.body_kind.startswith("comm_") and t.body_kind != "comm_push"
             and any(i.kind is InstrKind.LOAD and i.region.tensor.endswith(".slots") for i in t.instrs))
    t.instrs = [i for i in t.instrs if not (i.kind is InstrKind.LOAD and i.region.tensor.endswith(".slots"))]
    rejected(s, "S4", t.id, "slots")


@pytest.mark.parametrize("name", ["k3_r2", "llama_r2"])
def test_push_store_into_a_weight_is_S4(scheds, name):
    s = cp(scheds[name])
    t = next(t for t in s.tasks if t.body_kind == "comm_push")
    w = next(v for v in s.graph.params if v.kind is Kind.weight)
    box = tuple((0, d) for d in w.type.concrete(s.dims))
    t.instrs.insert(before_signal(t), Instr(InstrKind.STORE, Region(w.name, box)))
    rejected(s, "S4", t.id, f"%{w.name}")


# -- safe edits: accepted --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["k3_r1", "k3_r2"])
def test_removing_an_annotation_without_hoisting_is_safe(scheds, name):
    s = cp(scheds[name])
    t, k = expert_load(s)
    t.instrs[k] = replace(t.instrs[k], addressed_by=None)
    accepted(s)


@pytest.mark.parametrize("name", NAMES)
def test_redundant_wait_is_safe(scheds, name):
    s = cp(scheds[name])
    for t in s.tasks[::5]:
        k = next((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT), None)
        if k is not None:
            t.instrs.insert(k, t.instrs[k])
    accepted(s)


@pytest.mark.parametrize("name", NAMES)
def test_split_load_box_is_safe(scheds, name):
    s = cp(scheds[name])
    for t, k in list(act_load_sites(s))[:6]:
        r = t.instrs[k].region
        (lo, hi) = r.box[-1]
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        a = replace(t.instrs[k], region=replace(r, box=r.box[:-1] + ((lo, mid),)))
        b = replace(t.instrs[k], region=replace(r, box=r.box[:-1] + ((mid, hi),)))
        t.instrs[k:k + 1] = [a, b]
    accepted(s)


@pytest.mark.parametrize("name", NAMES)
def test_unused_event_and_added_annotation_are_safe(scheds, name):
    s = cp(scheds[name])
    s.events.append(Event(max(e.id for e in s.events) + 1, 0, "unused", 0))
    for t in s.tasks[:20]:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and kind_of(s, i.region.tensor) is Kind.weight and not i.addressed_by:
                t.instrs[k] = replace(i, addressed_by="tokens")     # an added dependency on an io input
    accepted(s)


@pytest.mark.parametrize("name", NAMES)
def test_swapped_loads_after_the_waits_are_safe(scheds, name):
    s = cp(scheds[name])
    for t in s.tasks:
        ks = [k for k, i in enumerate(t.instrs) if i.kind is InstrKind.LOAD]
        w = max((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT), default=-1)
        ks = [k for k in ks if k > w]
        if len(ks) >= 2:
            a, b = ks[0], ks[1]
            t.instrs[a], t.instrs[b] = t.instrs[b], t.instrs[a]
    accepted(s)


def test_rule_enum_has_the_structural_rules():
    assert {"S1", "S2", "S3", "S4"} <= {r.value for r in Rule}


@pytest.mark.parametrize("name", ["llama_r1", "llama_r2"])
def test_random_garbage_fields_never_crash(scheds, name):
    """Fields set to wrong types or out-of-range values: always a report, never an exception;
    a report that cannot analyse something rejects (never accepts) the schedule."""
    import random
    rng = random.Random(1)
    vals = [None, -1, 0, 1, 2, 3, 99, "x", ((0, 0),), (), ((0, 2),), 1.5, True]
    for _ in range(120):
        s = cp(scheds[name])
        t = rng.choice(s.tasks)
        v = rng.choice(vals)
        what = rng.randrange(5)
        if what == 0:
            k = rng.randrange(len(t.instrs))
            f = rng.choice(["event", "threshold", "peer", "addressed_by", "region"])
            t.instrs[k] = replace(t.instrs[k], **{f: v})
        elif what == 1:
            k = next(k for k, i in enumerate(t.instrs) if i.region is not None)
            f = rng.choice(["box", "rank", "tensor"])
            t.instrs[k] = replace(t.instrs[k], region=replace(t.instrs[k].region, **{f: v}))
        elif what == 2:
            setattr(t, rng.choice(["rank", "sm", "tile", "ops"]), v)
        elif what == 3:
            setattr(rng.choice(s.events), rng.choice(["id", "rank", "per_step"]), v)
        else:
            s.queues[rng.choice(list(s.queues))].append(v)
        rep = check_schedule(s)
        assert not any("cannot analyse" in e.message for e in rep.errors), rep.first_error()
