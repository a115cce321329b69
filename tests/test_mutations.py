"""Planted bugs (fusec.testing.mutate): each must be rejected by the verifier with its rule and, when it
changes values, caught by the randomized executor (poisoned read, mismatch or deadlock)."""
from __future__ import annotations

from pathlib import Path

import pytest

from fusec.testing.random_order import RandomOrderRunner
from fusec.ir.schedule_text import parse_schedule_file
from fusec.testing.mutate import EXPECT, Mutation, MutationSkipped, plant
from fusec.passes.memory_order import check_schedule

HERE = Path(__file__).parent / "schedules"
ORDERS = 60
PLANTED, VALUES = 35, 32    # bugs planted (one seed per kind and schedule) / those that change values


def executor_catches(s, orders=ORDERS) -> bool:
    run = RandomOrderRunner(s, steps=2, numeric=False)
    return any(not run.run(seed).ok for seed in range(orders))


@pytest.fixture(scope="module")
def schedules():
    from fusec.passes.options import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    g = kimi_k3.build_graph("tiny")
    out = {n: parse_schedule_file(HERE / f"{n}.sched") for n in ("ok_mini", "ok_allreduce", "ok_mini_r2")}
    for R in (1, 2):
        out[f"k3_tiny_r{R}"] = run_pipeline(
            Program(g.copy(), Options(ranks=R, batch=2, max_len=16, sms=8, verify_each_pass=False)),
            PIPELINES["default"]).schedule
    return out


def test_every_planted_bug_is_caught(schedules):
    planted = by_verifier = by_executor = needs_executor = 0
    skipped = []
    for name, s in schedules.items():
        assert check_schedule(s).ok
        for kind in Mutation:
            try:
                bad, why = plant(s, kind, seed=1)
            except MutationSkipped as e:
                skipped.append((name, kind.value, str(e)))
                continue
            planted += 1
            rep = check_schedule(bad)
            assert EXPECT[kind].rule in rep.rules(), f"{name} {kind.value}: {why}: verifier says {rep.rules()}"
            by_verifier += 1
            if EXPECT[kind].changes_values:
                needs_executor += 1
                assert executor_catches(bad), f"{name} {kind.value}: {why}: no order showed it"
                by_executor += 1
            assert check_schedule(s).ok      # plant copies: the original is untouched
    # K3 schedules have a site for every kind except what one rank lacks, and comm_reuse at
    # R = 2: with several collectives per step every ack is redundant (the readers reach the
    # writer's rank through the next collective), so it is planted in ok_allreduce instead
    assert {(n, k) for n, k, _ in skipped if n.startswith("k3")} == {
        ("k3_tiny_r1", "comm_reuse"), ("k3_tiny_r1", "grid_differs"), ("k3_tiny_r2", "comm_reuse")}
    assert ("ok_allreduce", "comm_reuse") not in {(n, k) for n, k, _ in skipped}
    assert (planted, by_verifier, needs_executor, by_executor) == (PLANTED, PLANTED, VALUES, VALUES), \
        (planted, by_verifier, needs_executor, by_executor, skipped)


@pytest.mark.parametrize("kind", list(Mutation))
def test_plant_is_deterministic_and_describes_the_bug(schedules, kind):
    s = schedules["ok_allreduce" if kind is Mutation.comm_reuse else "k3_tiny_r2"]
    a, da = plant(s, kind, seed=3)
    b, db = plant(s, kind, seed=3)
    assert da == db and "task" in da


def test_unknown_site_is_a_skip_with_reason(schedules):
    with pytest.raises(MutationSkipped, match="one rank"):
        plant(schedules["ok_mini"], Mutation.comm_reuse, 0)
