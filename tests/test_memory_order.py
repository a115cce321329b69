"""The memory-order verifier (V1-V7) and the schedule text form.

tests/schedules/*.sched are hand-written: `ok_*` must verify clean, every `v<N>_*` file names the
one rule it breaks in its first line (`# expect V<N>: why`) and must produce exactly that rule.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusec.ir.schedule import InstrKind
from fusec.ir.schedule_text import ScheduleSyntaxError, parse_schedule, parse_schedule_file, print_schedule
from fusec.passes.memory_order import Rule, check_schedule

HERE = Path(__file__).parent / "schedules"
BAD = sorted(HERE.glob("v*.sched")) + sorted(HERE.glob("s[0-9]*.sched"))
GOOD = sorted(HERE.glob("ok_*.sched"))


def expected_rule(path: Path) -> str:
    m = re.match(r"# expect ([VS]\d):", path.read_text().splitlines()[0])
    assert m, f"{path.name} lacks its '# expect V<N>:' (or S<N>) header"
    return m.group(1)


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_good_schedules_verify(path):
    rep = check_schedule(parse_schedule_file(path))
    assert rep.ok, rep.first_error()


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_each_failing_example_gives_exactly_its_rule(path):
    rep = check_schedule(parse_schedule_file(path))
    assert not rep.ok
    if path.name.startswith("s"):       # a structural rule comes first; the V rules may add to it
        assert expected_rule(path) in rep.rules(), [str(e) for e in rep.errors]
    else:
        assert rep.rules() == {expected_rule(path)}, [str(e) for e in rep.errors]
    assert rep.first_error().startswith(expected_rule(path) + ":")


def test_every_rule_has_a_failing_example():
    # the structural rules S1-S4 have their examples in tests/test_verifier_derive.py
    assert {expected_rule(p) for p in BAD if p.name.startswith("v")} == {
        r.value for r in Rule if r.value.startswith("V")}


def test_messages_name_task_region_and_wait():
    rep = check_schedule(parse_schedule_file(HERE / "v2_hoisted_load.sched"))
    (e,) = rep.errors
    assert (e.rule, e.task) == (Rule.V2, 2)
    assert e.region.startswith("%c[0:2, 0:8]") and e.wait == "e1@rank0 >= 1"
    assert "task 2" in str(e) and "producer task 1" in str(e)
    rep = check_schedule(parse_schedule_file(HERE / "v5_deadlock.sched"))
    assert rep.errors[0].task == 4 and "e2@rank0 >= 2" in str(rep.errors[0])


def test_v1_names_the_unordered_producer():
    (e,) = check_schedule(parse_schedule_file(HERE / "v1_threshold_low.sched")).errors
    assert e.task == 4 and "producer task 3" in e.message      # task 2 is ordered by sm 0's queue


@pytest.mark.parametrize("path", GOOD + BAD[:3], ids=lambda p: p.stem)
def test_text_round_trip(path):
    text = print_schedule(parse_schedule_file(path))
    assert print_schedule(parse_schedule(text, "again")) == text


def test_text_form_keeps_every_field():
    s = parse_schedule_file(HERE / "ok_allreduce.sched")
    assert s.replicated and s.ranks == 2 and s.dims == {"B": 2}
    send = s.tasks[1]
    wait, load, st, sig = send.instrs
    assert (wait.kind, wait.event, wait.threshold, wait.scope.value) == (InstrKind.WAIT, 2, 0, "sys")
    assert (st.region.tensor, st.region.box, st.region.rank) == ("buf", ((1, 2), (0, 2), (0, 8)), 1)
    assert (sig.peer, sig.sem.value) == (1, "release")
    t0 = parse_schedule_file(HERE / "ok_mini.sched").tasks[0]
    assert t0.instrs[1].addressed_by == "tokens" and t0.cost_us == 1.0 and t0.body_kind == "gather"


def test_parse_errors_name_file_line_col():
    text = (HERE / "ok_mini.sched").read_text().replace("wait e0 >= 1 acquire gpu", "wait e0 >= acquire gpu")
    with pytest.raises(ScheduleSyntaxError, match=r"^bad\.sched:\d+:\d+: expected"):
        parse_schedule(text, "bad.sched")
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "wait e0 >= acquire" in l)
    with pytest.raises(ScheduleSyntaxError, match=rf"^bad\.sched:{line}:"):
        parse_schedule(text, "bad.sched")
    with pytest.raises(ScheduleSyntaxError, match="unknown tensor %nope"):
        parse_schedule(text.replace("wait e0 >= acquire gpu", "wait e0 >= 1 acquire gpu")
                       .replace("load %x [0:2, 0:8]", "load %nope [0:2, 0:8]"), "bad.sched")


def test_pass_manager_names_the_rule():
    from fusec.passes.options import Options
    from fusec.passes.manager import Program, verify_program
    s = parse_schedule_file(HERE / "v3_hoisted_weight.sched")
    prog = Program(s.graph, Options(), s, {"scheduled": True})
    with pytest.raises(ValueError, match=r"^V3: task 5"):
        verify_program(prog)


@pytest.fixture(scope="module")
def k3_tiny():
    from fusec.passes.options import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    g = kimi_k3.build_graph("tiny")
    return {R: run_pipeline(Program(g.copy(), Options(ranks=R, batch=2, max_len=16, sms=16, verify_each_pass=False)),
                            PIPELINES["default"]).schedule for R in (1, 2)}


@pytest.mark.parametrize("ranks", [1, 2])
def test_k3_tiny_schedule_verifies_and_round_trips(k3_tiny, ranks):
    s = k3_tiny[ranks]
    rep = check_schedule(s)
    assert rep.ok, rep.first_error()
    text = print_schedule(s)
    again = parse_schedule(text, "k3.sched")
    assert print_schedule(again) == text
    assert check_schedule(again).ok


@pytest.fixture(scope="module")
def k3_tiny_r4():
    from fusec.passes.options import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    return run_pipeline(Program(kimi_k3.build_graph("tiny"), Options(ranks=4, batch=2, max_len=16, sms=8,
                                                                     verify_each_pass=False)),
                        PIPELINES["default"]).schedule


def test_symmetric_check_agrees_with_the_materialized_one(k3_tiny, k3_tiny_r4):
    """A replicated schedule is checked on rank 0 only (clocks over rank x queue); the explicit
    check of its materialized form (every rank's tasks) must find the same rules, and rank 0's
    violations among its own. R = 4 so that a peer offset's sign matters (+1 != -1)."""
    from fusec.testing.mutate import Mutation, MutationSkipped, plant
    bases = [k3_tiny[2], k3_tiny_r4] + [parse_schedule_file(p) for p in GOOD + BAD]
    bases = [s for s in bases if s.replicated and s.ranks > 1]
    compared = 0
    for base in bases:
        variants = [base]
        for kind in Mutation:
            if kind is not Mutation.grid_differs:      # that one materializes: explicit by design
                try:
                    variants.append(plant(base, kind, seed=1)[0])
                except MutationSkipped:
                    pass
        for s in variants:
            sym, mat = check_schedule(s), check_schedule(s.materialize())
            assert sym.stats["symmetric"] and not mat.stats["symmetric"]
            assert sym.rules() == mat.rules(), (sym.rules(), mat.rules())
            assert {str(e) for e in sym.errors} <= {str(e) for e in mat.errors}
            compared += 1
    assert compared >= 20 and any(s.ranks == 4 for s in bases)


def test_grid_differs_on_a_materialized_rank_is_v7(k3_tiny_r4):
    from fusec.testing.mutate import Mutation, plant
    bad, why = plant(k3_tiny_r4, Mutation.grid_differs, seed=0)
    rep = check_schedule(bad)
    assert not bad.replicated and not rep.stats["symmetric"] and "V7" in rep.rules(), why
