"""The randomized executor: legal random orders of a schedule's tasks, NaN/tag poisoning.

Numerics: the hand-written one-rank schedules run numerically (every order compares the graph
outputs of two steps with the reference executor). K3 tiny runs 1,000 orders per rank count;
every order has the symbolic poison/dataflow check (every read must see the value its version
names, written in this step), and a fixed subset also runs numerically: seeds divisible by 4 at
R = 1 (250 orders, vs `run_step`), seeds divisible by 20 at R = 2 (50 orders, every rank vs
`run_step_ranks`, collectives modelled as slot pushes + local reduce; ok_allreduce and
v4_comm_reuse also run numerically at R = 2). A numeric order costs
~0.1 s at R = 1 and ~0.25 s at R = 2 on this CPU after the first (memoized task results), so
the subset keeps this file within its CI share; benchmarks/stress_random_order.py runs more.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusec.testing.random_order import Policy, RandomOrderRunner
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
    assert not torch.equal(run.expected[0][0][0], run.expected[1][0][0])     # [step][rank][output]


# examples whose bug changes values: some orders must poison, mismatch or deadlock
CAUGHT = ["v1_dropped_wait", "s4_load_after_compute", "v1_threshold_low", "v2_hoisted_load", "v3_hoisted_weight",
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
    from fusec.passes.options import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    g = kimi_k3.build_graph("tiny")
    out = {R: run_pipeline(Program(g.copy(), Options(ranks=R, batch=2, max_len=16, sms=8, verify_each_pass=False)),
                           PIPELINES["default"]).schedule for R in (1, 2)}
    out["unsharded"] = g
    return out


@pytest.fixture(scope="module")
def k3_runners(k3_tiny):
    """Shared so that the numeric runners' memo (and reference setup) is paid once per module."""
    return {R: runners(k3_tiny, R) for R in (1, 2)}


def runners(k3_tiny, ranks):
    """(symbolic runner, numeric runner) of K3 tiny; at R = 2 the numeric one is compared with
    run_step_ranks from the full checkpoint and full (zero) state."""
    from fusec.backends.reference.executor import init_state
    from fusec.models import kimi_k3
    from fusec.weights import random_weights
    s = k3_tiny[ranks]
    if ranks == 1:
        return RandomOrderRunner(s, steps=2, numeric=False), RandomOrderRunner(s, steps=2, numeric=True)
    g = k3_tiny["unsharded"]
    return (RandomOrderRunner(s, steps=2, numeric=False),
            RandomOrderRunner(s, steps=2, numeric=True, weights=random_weights(g, 0, kimi_k3.WEIGHT_INIT),
                              full_state=init_state(g, {"B": 2, "L": 16}, precision="fp32")))


def thousand_orders(k3_runners, ranks, every):
    """1,000 orders (seeds 0..999): seeds divisible by `every` numeric, the others symbolic."""
    sym, num = k3_runners[ranks]
    bad, numeric = [], 0
    for seed in range(1000):
        r = (num if seed % every == 0 else sym).run(seed)
        numeric += seed % every == 0
        if not r.ok:
            bad.append(r)
    assert not bad, f"{len(bad)} of 1000 orders failed, e.g. seed {bad[0].seed}: {bad[0].why()}"
    assert numeric == 1000 // every and num.memo      # the numeric ones really evaluated tasks


def test_k3_tiny_r1_1000_orders_every_4th_numeric(k3_runners):
    thousand_orders(k3_runners, 1, 4)


def test_k3_tiny_r2_1000_orders_every_20th_numeric_vs_run_step_ranks(k3_runners):
    thousand_orders(k3_runners, 2, 20)


@pytest.mark.parametrize("ranks", [1, 2])
def test_k3_tiny_numeric_order_runs_every_task_of_both_steps(k3_tiny, k3_runners, ranks):
    run = k3_runners[ranks][1]
    assert run.numeric and len(run.expected) == 2 and len(run.expected[0]) == ranks   # [step][rank]
    r = run.run(seed=7)
    assert r.ok, r.why()
    assert r.instrs > 2 * ranks * len(k3_tiny[ranks].tasks)     # both steps ran every task of every rank


def allreduce_runner(s):
    """ok_allreduce's graph has no shard annotations: its weights are the full checkpoint."""
    from fusec.backends.reference.executor import init_state
    from fusec.weights import random_weights
    return RandomOrderRunner(s, steps=2, numeric=True, weights=random_weights(s.graph, 0),
                             full_state=init_state(s.graph, s.dims, precision="fp32"))


def test_two_rank_allreduce_matches_run_step_ranks_numerically():
    run = allreduce_runner(load("ok_allreduce"))
    results = [run.run(seed) for seed in range(300)]
    assert all(r.ok for r in results), next(r.why() for r in results if not r.ok)
    # the steps' tokens differ, so a slot still holding step 0's row would show in step 1
    assert not torch.equal(run.expected[0][0][0], run.expected[1][0][0])


def test_push_feeds_the_reduce_numerically():
    """Drop the push's STORE: the peer's reduce reads a never-written slot, which must surface
    as NaN in the outputs (a numeric mismatch), not only as a poisoned-read tag."""
    from fusec.ir.schedule import InstrKind
    s = load("ok_allreduce")
    push = next(t for t in s.tasks if t.body_kind == "send")
    push.instrs = [i for i in push.instrs if i.kind is not InstrKind.STORE]
    r = allreduce_runner(s).run(seed=0)
    assert r.poisoned and r.mismatch and "differs from the reference" in r.mismatch


def test_comm_reuse_gives_wrong_numbers_at_two_ranks():
    run = allreduce_runner(load("v4_comm_reuse"))
    bad = [r for r in (run.run(seed) for seed in range(200)) if not r.ok]
    assert bad and all(r.mismatch for r in bad)


def test_numeric_at_two_ranks_needs_the_full_checkpoint(k3_tiny):
    with pytest.raises(ValueError, match="full checkpoint"):
        RandomOrderRunner(k3_tiny[2], numeric=True)
