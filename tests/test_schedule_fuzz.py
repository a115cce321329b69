"""The schedule fuzzer (issue 11's independent cross-check of the verifier): its oracle on edits
whose answer is known by construction, the oracle's independence from the verifier's code, and
a quick subset of the fuzz run (the full table is in docs/verifier.md, "Fuzzer")."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fusec.ir.schedule import InstrKind
from fusec.testing import schedule_fuzz as F

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama1():
    return F.base("llama", 1)


def test_the_oracle_imports_none_of_the_verifier():
    code = ("import sys\n"
            "from fusec.ir.schedule_text import parse_schedule\n"
            "from fusec.testing.schedule_fuzz_oracle import Oracle\n"
            f"s = parse_schedule(open({str(ROOT / 'tests/schedules/ok_mini.sched')!r}).read())\n"
            "o = Oracle(s)\n"
            "assert not o.classify(s).unsafe\n"
            "bad = [m for m in sys.modules if m.rsplit('.', 1)[-1] in "
            "('memory_order', '_derive', '_rules', 'memory_access', 'random_order', 'mutate')]\n"
            "print(bad)\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout


# -- the oracle on edits whose answer is known without it --------------------------------------
def _task_with(s, pred):
    return next(t for t in s.tasks if pred(t))


def test_oracle_unedited_is_safe(llama1):
    s, o = llama1
    assert not o.classify(F.copy_schedule(s)).unsafe


def test_oracle_dropped_wait_of_a_direct_consumer_is_a_race(llama1):
    # llama task 11 (silu_mul) waits for the four gate/up tiles and has no other ordering path
    s, o = llama1
    e = F.copy_schedule(s)
    t = _task_with(e, lambda t: t.body_kind == "silu_mul")
    t.instrs = [i for i in t.instrs if i.kind is not InstrKind.WAIT]
    v = o.classify(e)
    assert v.unsafe and v.kind == "race", v


def test_oracle_load_hoisted_above_its_wait_is_a_race(llama1):
    s, o = llama1
    e = F.copy_schedule(s)
    t = _task_with(e, lambda t: t.body_kind == "attention")
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.LOAD)
    t.instrs.insert(0, t.instrs.pop(k))
    v = o.classify(e)
    assert v.unsafe and v.kind == "race", v


def test_oracle_consumer_queued_before_its_producer_deadlocks(llama1):
    s, o = llama1
    e = F.copy_schedule(s)
    # put the embedding task (the first producer) behind the last task on its queue's end
    q = next(q for q in e.queues.values() if 0 in q)
    q.remove(0)
    q.append(0)
    v = o.classify(e)
    assert v.unsafe and v.kind == "deadlock", v


def test_oracle_structure_and_read_only(llama1):
    s, o = llama1
    e = F.copy_schedule(s)
    e.queues[(0, 0)].append(len(e.tasks))
    assert o.classify(e).kind == "malformed"
    e = F.copy_schedule(s)
    t = e.tasks[5]
    w = next(i for i in e.tasks[1].instrs if i.kind is InstrKind.LOAD)      # a weight load
    t.instrs.append(replace(w, kind=InstrKind.STORE))
    assert o.classify(e).kind == "read-only store"


def test_oracle_split_load_and_duplicate_wait_are_safe(llama1):
    s, o = llama1
    e = F.copy_schedule(s)
    t = _task_with(e, lambda t: t.body_kind == "attention")
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT)
    t.instrs.insert(k, t.instrs[k])
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.LOAD)
    ld = t.instrs[k]
    (a, b), rest = ld.region.box[0], ld.region.box[1:]
    t.instrs[k:k + 1] = [replace(ld, region=replace(ld.region, box=((a, a + 1),) + rest)),
                         replace(ld, region=replace(ld.region, box=((a + 1, b),) + rest))]
    assert not o.classify(e).unsafe


def test_oracle_push_signalling_its_peer_before_storing_is_a_race():
    # two ranks: the peer's reader may run between the push's signal and its store
    s, o = F.base("llama", 2)
    e = F.copy_schedule(s)
    t = _task_with(e, lambda t: t.body_kind == "comm_push")
    k = max(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    g = next(j for j, i in enumerate(t.instrs) if i.kind is InstrKind.SIGNAL)
    t.instrs.insert(k, t.instrs.pop(g))         # the push signals its peer before it stores
    v = o.classify(e)
    assert v.unsafe and v.kind == "race", v


def test_oracle_early_ack_is_a_contract_breach_not_a_race():
    # an all-reduce's ack to its peer moved before its own STORE: nothing the peer does after
    # the ack reads that store, so no run goes wrong; DESIGN.md's V6 still forbids it
    s, o = F.base("llama", 2)
    e = F.copy_schedule(s)
    t = _task_with(e, lambda t: t.body_kind == "comm_all_reduce")
    g = next(j for j, i in enumerate(t.instrs) if i.kind is InstrKind.SIGNAL and i.peer is not None)
    st = next(j for j, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    t.instrs.insert(st, t.instrs.pop(g))
    v = o.classify(e)
    assert v.unsafe and v.kind == "contract" and "V6" in v.why, v


@pytest.mark.parametrize("kind", ["signal_before_store", "prefetch_nonstatic", "wait_after_load", "split_load",
                                  "hoist_addressed_unannotated", "weight_prefetch_earlier"])
def test_oracle_shortcut_agrees_with_the_full_analysis(kind):
    # edits that keep every queue's waits and signals reuse the unedited schedule's clocks; the
    # verdict must be the one the full analysis (a run, clocks, freeze runs) gives
    import random
    seen = 0
    for cfg in (("llama", 2), ("kimi_k3", 1)):
        s, o = F.base(*cfg)
        for seed in range(3):
            e = F.copy_schedule(s)
            try:
                F.KINDS[kind].fn(F.Ctx.of(e), random.Random(seed))
            except F.Skip:
                continue
            a, fast = o.classify(e), o.last_fast
            b = o.classify(e, fast=False)
            assert (a.unsafe, a.kind) == (b.unsafe, b.kind), (cfg, seed, str(a), str(b))
            seen += fast
    assert seen


# -- the fuzzer ----------------------------------------------------------------------------------
def test_quick_fuzz_subset_agrees():
    """A few hundred edits over Llama at R = 1, 2, 8 and K3 at R = 1, 2: every kind, 0 false
    accepts, 0 false rejects, 0 crashes (the full run: python -m fusec.testing.schedule_fuzz)."""
    summ = F.run(400, workers=1, configs=[("llama", 1), ("llama", 2), ("llama", 8), ("kimi_k3", 1), ("kimi_k3", 2)])
    t = summ["total"]
    bad = summ["disagreements"][:5]
    assert t["crashes"] == 0 and t["internal_errors"] == 0, bad
    assert t["false_accepts"] == 0, bad
    assert t["false_rejects"] == 0, bad
    per = summ["per_kind"]
    issue = [k for k, c in F.KINDS.items() if c.group == "issue"]
    assert all(per[k]["unsafe"] > 0 for k in issue), {k: per.get(k) for k in issue}
    assert len(per) >= 10
    # both verdicts occur: the oracle is not a constant
    assert 0 < t["unsafe"] < t["edits"]
