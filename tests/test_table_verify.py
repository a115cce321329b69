"""Verify what runs (backends/cute/table_verify.py): the packed task table of the CuTe backend
against the verified Schedule.

Clean tables of K3 tiny (batch 1 and 4, bf16 experts, split-sequence MLA) and Llama tiny are
accepted; planted lowering bugs in the table (a dropped or weakened wait, a signal moved before
the stores or onto another task, a shifted address, a prefetch of an activation, a queue out of
order, a field left unrelocated) are each rejected with their rule; `Lowered.plan()` runs the
check, so a broken table never reaches a kernel.
"""
from __future__ import annotations

import dataclasses

import pytest

from fusec.backends.cute.plan import NO_EVENT, EwOp, Opcode
from fusec.backends.cute.table_verify import TableVerifyError, verify_table
from fusec.compiler import lower_for_cute
from fusec.models import kimi_k3, llama

L = 16


def _lower(model, batch, max_len=L, **kw):
    return lower_for_cute(model.build_graph("tiny", **kw), batch, max_len)[1]


@pytest.fixture(scope="module")
def k3():
    return _lower(kimi_k3, 2)


@pytest.fixture(scope="module")
def lla():
    return _lower(llama, 3)


def _verdict(low, rows=None, base=0):
    plan = low.plan(base=base)          # the clean table (checked by plan() itself)
    if rows is not None:
        plan = plan.with_tasks(rows)
    words, bounds = plan.table_words()
    return verify_table(low.schedule, low.memory, words, bounds, plan.num_events, plan.batch, low.consts, base)


@pytest.mark.parametrize("model,batch,max_len,kw", [
    (kimi_k3, 1, L, {}), (kimi_k3, 4, L, {}), (kimi_k3, 2, L, {"expert_dtype": "bf16"}),
    (kimi_k3, 4, 512, {}), (llama, 1, L, {}), (llama, 3, L, {})],
    ids=["k3_b1", "k3_b4", "k3_bf16_experts", "k3_split_mla", "llama_b1", "llama_b3"])
def test_clean_tables_are_accepted(model, batch, max_len, kw):
    low = _lower(model, batch, max_len, **kw)
    assert _verdict(low) == []
    assert _verdict(low, base=1 << 40) == []       # real device addresses: relocated words


def _rows(low):
    return list(low.plan(base=0).tasks)


def _first(rows, pred):
    return next(i for i, r in enumerate(rows) if pred(r))


def _rules(errs):
    return {str(e).split(":")[0] for e in errs}


def _by_task(rows):
    out = {}
    for i, r in enumerate(rows):
        out.setdefault(r.task_id, []).append(i)
    return out


@pytest.mark.parametrize("name", ["k3", "lla"])
def test_planted_table_bugs_are_rejected(request, name):
    low = request.getfixturevalue(name)
    T = _rows(low)

    def planted(edit):
        rows = list(T)
        edit(rows)
        return _rules(_verdict(low, rows))

    def drop_wait(rows):
        i = _first(rows, lambda r: r.wait_event != NO_EVENT)
        rows[i] = dataclasses.replace(rows[i], wait_event=NO_EVENT, wait_per_step=0, wait_offset=0)

    def low_threshold(rows):
        i = _first(rows, lambda r: r.wait_event != NO_EVENT)
        rows[i] = dataclasses.replace(rows[i], wait_offset=rows[i].wait_offset - 1)

    def wait_moved_late(rows):      # a task's extra wait moved from its NOP row onto its last row
        ix = next(ix for ix in _by_task(rows).values()
                  if len(ix) > 2 and rows[ix[0]].opcode == Opcode.NOP and rows[ix[-1]].wait_event == NO_EVENT)
        w = {k: getattr(rows[ix[0]], k) for k in ("wait_event", "wait_per_step", "wait_offset")}
        rows[ix[0]] = dataclasses.replace(rows[ix[0]], wait_event=NO_EVENT, wait_per_step=0, wait_offset=0)
        rows[ix[-1]] = dataclasses.replace(rows[ix[-1]], **w)

    def early_signal(rows):         # the signal moved from a task's last row to its first
        ix = next(ix for ix in _by_task(rows).values() if len(ix) > 1 and rows[ix[0]].signal_event == NO_EVENT
                  and rows[ix[-1]].signal_event != NO_EVENT and rows[ix[-1]].opcode != Opcode.NOP)
        e = rows[ix[-1]].signal_event
        rows[ix[-1]] = dataclasses.replace(rows[ix[-1]], signal_event=NO_EVENT)
        rows[ix[0]] = dataclasses.replace(rows[ix[0]], signal_event=e)

    def swap_signals(rows):         # two tasks signal each other's events
        sig = [i for i, r in enumerate(rows) if r.signal_event != NO_EVENT]
        i = sig[0]
        j = next(j for j in sig if rows[j].signal_event != rows[i].signal_event)
        rows[i], rows[j] = (dataclasses.replace(rows[i], signal_event=rows[j].signal_event),
                            dataclasses.replace(rows[j], signal_event=rows[i].signal_event))

    def shift_weight(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16 and r.n0 == 0)
        rows[i] = dataclasses.replace(rows[i], a0=rows[i].a0 + 256)

    def shift_output(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16)
        rows[i] = dataclasses.replace(rows[i], a2=rows[i].a2 + 256)

    def shift_input(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.RMSNORM)
        rows[i] = dataclasses.replace(rows[i], a0=rows[i].a0 + 256)

    def prefetch_activation(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16)
        rows[i] = dataclasses.replace(rows[i], pf_addr=rows[i].a1, pf_bytes=64)

    def narrow_columns(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.EW and r.n1 - r.n0 > 1 and r.sub == EwOp.ADD)
        rows[i] = dataclasses.replace(rows[i], n1=rows[i].n1 - 1)

    def other_task(rows):           # a row relabelled to the next task
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16)
        rows[i] = dataclasses.replace(rows[i], task_id=rows[i].task_id + 1)

    expect = {drop_wait: "T2", low_threshold: "T2", early_signal: "T3", swap_signals: "T3",
              shift_weight: "T5", shift_output: "T4", shift_input: "T5", prefetch_activation: "T6",
              narrow_columns: "T4", other_task: "T1"}
    if name == "lla":
        expect[wait_moved_late] = "T2"
    for edit, rule in expect.items():
        assert rule in planted(edit), edit.__name__


def test_k3_run_time_addressed_and_queue_bugs_are_rejected(k3):
    T = _rows(k3)
    plan = k3.plan(base=0)
    # expert ids read from the wrong place
    i = _first(T, lambda r: r.opcode in (Opcode.EXPERT_MXFP4, Opcode.EXPERT_BF16))
    rows = list(T)
    rows[i] = dataclasses.replace(rows[i], a4=rows[i].a4 + 256)
    assert "T5" in _rules(_verdict(k3, rows))
    # two tasks of one CTA run in the other order
    c = next(c for c, q in enumerate(plan.queues) if len({T[x].task_id for x in q}) > 1)
    q = plan.queues[c]
    first = T[q[0]].task_id
    moved = tuple(x for x in q if T[x].task_id != first) + tuple(x for x in q if T[x].task_id == first)
    swapped = plan.queues[:c] + (moved,) + plan.queues[c + 1:]
    bad = dataclasses.replace(plan, queues=swapped)
    words, bounds = bad.table_words()
    errs = verify_table(k3.schedule, k3.memory, words, bounds, bad.num_events, bad.batch, k3.consts, 0)
    assert "T1" in _rules(errs)


def test_unrelocated_address_is_rejected(lla):
    """plan(base) adds the arena base to every address word; one left as an offset names no
    byte of the arena."""
    base = 1 << 40
    T = list(lla.plan(base=base).tasks)
    i = _first(T, lambda r: r.opcode == Opcode.GEMV_BF16)
    T[i] = dataclasses.replace(T[i], a1=T[i].a1 - base)
    assert "T5" in _rules(_verdict(lla, T, base=base))


def test_address_shifts_over_every_operand(lla):
    """+256 bytes on every address word of every row of Llama tiny: rejected, except a field the
    body does not read (EW APPEND's A2: the body writes the cache through A1) and ROPE's input
    read from the task's own GEMV output at other columns (bytes the task itself wrote: a value
    bug, not an ordering one, which the table interpreter's numerics catch)."""
    T = _rows(lla)
    accepted, tried = set(), 0
    for i, r in enumerate(T):
        if r.opcode == Opcode.NOP:
            continue
        for f in ("a0", "a1", "a2", "a3", "a4", "a5"):
            if not getattr(r, f):
                continue
            rows = list(T)
            rows[i] = dataclasses.replace(r, **{f: getattr(r, f) + 256})
            tried += 1
            if not _verdict(lla, rows):
                accepted.add((r.opcode.name, EwOp(r.sub).name if r.opcode == Opcode.EW else "", f))
    assert tried > 150
    assert accepted <= {("EW", "APPEND", "a2"), ("EW", "ROPE", "a0")}, accepted


def test_plan_runs_the_check(lla):
    """A lowering bug planted before plan(): the kernel plan is refused in one line."""
    rows = list(lla.rows)
    i = _first(rows, lambda r: r.wait_event != NO_EVENT)
    rows[i] = dataclasses.replace(rows[i], wait_event=NO_EVENT, wait_per_step=0, wait_offset=0)
    bad = dataclasses.replace(lla, rows=tuple(rows))
    with pytest.raises(TableVerifyError) as e:
        bad.plan(base=0)
    msg = str(e.value)
    assert msg.startswith("cute table verifier: T2: task ") and "\n" not in msg
    assert isinstance(e.value, ValueError)         # the CLI's one-line `fusec: error:` path
