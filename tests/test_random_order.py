"""The randomized executor: legal random orders of a schedule's tasks, NaN/tag poisoning.

Numerics: the hand-written schedules run numerically (every order compares the graph outputs of
two steps with the reference executor). K3 tiny runs 1,000 orders per rank count with the
symbolic poison/dataflow check (every read must see the value its version names, written in
this step — exactly what NaN poisoning detects); one of its orders also runs numerically
against the reference (an order costs seconds on CPU: every task evaluates its whole ops'
references); benchmarks/stress_random_order.py runs more.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusec.backends.reference.random_order import Policy, RandomOrderRunner
from fusec.ir.schedule_text import parse_schedule_file

HERE = Path(__file__).parent / "schedules"


def load(name):
    return parse_schedule_file(HERE / f"{name}.sched")


@pytest.mark.parametrize("name", ["ok_mini", "ok_mini_split"])
def test_good_one_rank_schedules_match_reference_numerically(name):
    run = RandomOrderRunner(load(name), steps=2)
    assert run.numeric
    results = [run.run(seed) for seed in range(300)]
    assert all(r.ok for r in results), next(r.why() for r in results if not r.ok)
    assert {r.policy for r in results} == set(Policy)


@pytest.mark.parametrize("name", ["ok_allreduce", "ok_mini_r2"])
def test_good_two_rank_schedules_have_no_poisoned_read(name):
    run = RandomOrderRunner(load(name), steps=2)
    assert not run.numeric
    assert all(run.run(seed).ok for seed in range(300))


def test_reference_outputs_differ_between_steps():
    # two steps only show cross-step bugs if the steps compute different things
    run = RandomOrderRunner(load("ok_mini"), steps=2)
    assert not torch.equal(run.expected[0][0], run.expected[1][0])


# examples whose bug changes values: some orders must poison, mismatch or deadlock
CAUGHT = ["v1_dropped_wait", "v1_overwritten", "v1_threshold_low", "v2_hoisted_load", "v3_hoisted_weight",
          "v4_comm_reuse", "v4_war_state", "v5_deadlock", "v5_per_step", "v5_threshold_high", "v6_early_signal"]


@pytest.mark.parametrize("name", CAUGHT)
def test_failing_examples_are_caught_by_some_order(name):
    run = RandomOrderRunner(load(name), steps=2)
    bad = [r for r in (run.run(seed) for seed in range(200)) if not r.ok]
    assert bad, f"{name}: no order showed the bug"


def test_hoisted_load_gives_nan_numerically_not_only_symbolically():
    run = RandomOrderRunner(load("v2_hoisted_load"), steps=2)
    results = [run.run(seed) for seed in range(60)]
    poisoned = [r for r in results if r.poisoned]
    assert poisoned and all(r.mismatch and "output %z" in r.mismatch for r in poisoned)
    assert any(r.ok for r in results)    # the race is order-dependent: some orders are lucky


def test_deadlocks_are_reported_with_the_wait():
    r = RandomOrderRunner(load("v5_deadlock")).run(0)
    assert r.deadlock and "task 4" in r.deadlock and "wait e2 >= 2" in r.deadlock
    r = RandomOrderRunner(load("v5_per_step")).run(0)
    assert r.deadlock and r.deadlock.startswith("deadlock in step 1")   # step 0 passes, step 1 waits for 3+2


def test_comm_reuse_reads_the_next_steps_data():
    run = RandomOrderRunner(load("v4_comm_reuse"), steps=2)
    bad = [r for r in (run.run(seed) for seed in range(200)) if not r.ok]
    assert bad and all("%buf" in r.poisoned[0] for r in bad)


@pytest.fixture(scope="module")
def k3_tiny():
    from fusec.config import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    g = kimi_k3.build_graph("tiny")
    return {R: run_pipeline(Program(g.copy(), Options(ranks=R, batch=2, max_len=16, sms=8, verify_each_pass=False)),
                            PIPELINES["default"]).schedule for R in (1, 2)}


@pytest.mark.parametrize("ranks", [1, 2])
def test_k3_tiny_1000_orders_symbolic(k3_tiny, ranks):
    run = RandomOrderRunner(k3_tiny[ranks], steps=2, numeric=False)
    bad = []
    for seed in range(1000):
        r = run.run(seed)
        if not r.ok:
            bad.append(r)
    assert not bad, f"{len(bad)} of 1000 orders failed, e.g. seed {bad[0].seed}: {bad[0].why()}"


def test_k3_tiny_numeric_orders_match_reference(k3_tiny):
    run = RandomOrderRunner(k3_tiny[1], steps=2, numeric=True)
    r = run.run(seed=7)
    assert r.ok, r.why()
    assert r.instrs > 2 * len(k3_tiny[1].tasks)     # both steps ran every task
