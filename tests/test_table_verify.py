"""Verify what runs (backends/cute/table_verify.py): the packed task table of the CuTe backend
against the verified Schedule.

Clean tables of K3 tiny (batch 1 and 4, bf16 experts, split-sequence MLA) and Llama tiny are
accepted; planted lowering bugs in the table (a dropped or weakened wait, a signal moved before
the stores or onto another task, a shifted address, a prefetch of an activation, a queue out of
order, a field left unrelocated, an EW or KDA row of a task over part of the batch run on other
batch rows) are each rejected with their rule; `Lowered.plan()` runs the
check, so a broken table never reaches a kernel. An embedding cut into column tasks, each
loading all 163840 vocabulary rows at its columns, verifies in a fraction of a second and a read
one byte past its slice is still caught; the symbolic byte sets the check runs on give the same
bytes as explicit ones.
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from types import SimpleNamespace

import pytest

from fusec.backends.cute import byte_sets
from fusec.backends.cute.lower import lower_schedule
from fusec.backends.cute.plan import NO_EVENT, EwOp, Opcode, Word
from fusec.backends.cute.table_verify import TableVerifyError, verify_table
from fusec.compiler import lower_for_cute
from fusec.models import kimi_k3, llama
from fusec.passes.memory_order import check_schedule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from table_verify_speed import column_split  # noqa: E402

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


def test_split_argmax_table_is_accepted(monkeypatch):
    """The ARGMAX PARTIAL / COMBINE rows' footprints (the chunk's columns, the pairs' slab) match
    the Schedule's regions of argmax_partial / argmax_combine."""
    from fusec.passes import _units
    monkeypatch.setattr(_units, "MIN_TASK_BYTES", 8192)
    low = _lower(kimi_k3, 2)
    assert any(t.body_kind == "argmax_partial" for t in low.schedule.tasks)
    assert _verdict(low) == []
    assert _verdict(low, base=1 << 40) == []


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

    def prefetch_next_tile(rows):   # PF_BYTES within the tile, but PF_ADDR one row into it: the
        # tile from PF_ADDR (what KernelPlan.gemv_pf="stripe" may touch) ends in the next tile
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16 and r.pf_bytes and r.n1 - r.n0 > 1)
        rows[i] = dataclasses.replace(rows[i], pf_addr=rows[i].pf_addr + rows[i].k * 2, pf_bytes=64)

    def narrow_columns(rows):
        i = _first(rows, lambda r: r.opcode == Opcode.EW and r.n1 - r.n0 > 1 and r.sub == EwOp.ADD)
        rows[i] = dataclasses.replace(rows[i], n1=rows[i].n1 - 1)

    def other_task(rows):           # a row relabelled to the next task
        i = _first(rows, lambda r: r.opcode == Opcode.GEMV_BF16)
        rows[i] = dataclasses.replace(rows[i], task_id=rows[i].task_id + 1)

    def ew_every_row(rows):         # a KDA task's gated norm (over its batch rows) run on every row
        i = _first(rows, lambda r: r.opcode == Opcode.EW and r.sub == EwOp.GATED_RMS and r.k)
        rows[i] = dataclasses.replace(rows[i], k=0)

    def ew_other_rows(rows):        # ... on the next task's rows
        i = _first(rows, lambda r: r.opcode == Opcode.EW and r.sub == EwOp.GATED_RMS and r.k == 1)
        rows[i] = dataclasses.replace(rows[i], k=(1 << 16) | 2)

    def kda_other_row(rows):        # a KDA row of a (head, batch row) task on the next batch row
        i = _first(rows, lambda r: r.opcode == Opcode.KDA and r.n0 < r.p0)
        rows[i] = dataclasses.replace(rows[i], n0=rows[i].n0 + rows[i].p0, n1=rows[i].n1 + rows[i].p0)

    expect = {drop_wait: "T2", low_threshold: "T2", early_signal: "T3", swap_signals: "T3",
              shift_weight: "T5", shift_output: "T4", shift_input: "T5", prefetch_activation: "T6", prefetch_next_tile: "T6",
              narrow_columns: "T4", other_task: "T1"}
    if name == "lla":
        expect[wait_moved_late] = "T2"
    else:                           # batch 2: K3 tiny's KDA families are cut over batch rows
        expect.update({ew_every_row: "T4", ew_other_rows: "T4", kda_other_row: "T5"})
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


def test_column_split_wide_boxes_verify_quickly_and_exactly():
    """An embedding cut along columns (benchmarks/table_verify_speed.column_split): 32 tasks each
    load a box of all 163840 table rows at 8 columns and read it through a GATHER row (the ids pick
    rows at run time). As byte ranges that is 32 x 163840 ranges, which the verifier once expanded
    one by one (114 s on this table; a slice4-e128 lowering with such a split did not finish in
    11 min); as strided runs it is a few bands. A read shifted by one byte, one byte past its
    slice in every table row, is still rejected, its bad bytes counted exactly."""
    prog, low = lower_for_cute(llama.build_graph("tiny", vocab=163840), 2, L)
    s = low.schedule
    emb = next(t for t in s.tasks if t.body_kind == "embedding")
    split = column_split(s, emb, 32)
    assert check_schedule(split).ok
    wide = lower_schedule(split)
    plan = wide.plan(base=0)                       # the hook in plan() accepts the clean table
    words, bounds = plan.table_words()
    gathers = [r for r, w in enumerate(words) if w[Word.OPCODE] == Opcode.EW and w[Word.SUB] == EwOp.GATHER]
    assert len(gathers) == 32 and len({words[r][Word.N0] for r in gathers}) == 32

    def verdict(words):
        t0 = time.perf_counter()
        errs = verify_table(wide.schedule, wide.memory, words, bounds, plan.num_events, plan.batch, wide.consts, 0)
        return [str(e) for e in errs], time.perf_counter() - t0

    errs, took = verdict(words)
    assert errs == [] and took < 10, took          # ~0.05 s here
    r = next(r for r in gathers if words[r][Word.N0] == 0)
    n1 = words[r][Word.N1]
    bad = [list(w) for w in words]
    bad[r][Word.A0] += 1                            # columns [0, n1) of every row, one byte late
    errs, took = verdict(bad)
    assert took < 10, took
    assert errs == [f"T5: task {words[r][Word.TASK_ID]} (CTA {emb.sm}, row {r}): reads 'embed_tokens.weight' "
                    f"bytes [{2 * n1}, {2 * n1 + 1}) (+163839 more ranges), which none of the task's LOADs (nor an "
                    f"earlier row of it) covers"], errs


def test_byte_sets_match_explicit_bytes():
    """The verifier's symbolic byte sets (backends/cute/byte_sets.py) against plain Python sets
    of bytes, on random small arenas and random pieces: ranges, and runs whose stride is the
    region's row, a multiple or a divisor of it, anything else, negative, or crossing regions.
    Every result is the same bytes, its merged ranges and their count are what a list of merged
    ranges gives, and a band list stays canonical."""
    rng = random.Random(0)

    def explicit(pieces):
        out = set()
        for p in pieces:
            s, st, n, w = p if len(p) == 4 else (p[0], 0, 1, p[1] - p[0])
            for i in range(max(n, 0)):
                out.update(range(s + i * st, s + i * st + w))
        return out

    def ranges(b):
        out = []
        for x in sorted(b):
            if out and out[-1][1] == x:
                out[-1][1] += 1
            else:
                out.append([x, x + 1])
        return [tuple(x) for x in out]

    def same(space, S, want):
        assert list(byte_sets.merged(space, S)) == ranges(want)
        assert byte_sets.count_ranges(space, S) == len(ranges(want))
        if want:
            lo = rng.choice(sorted(want))           # ranges reaching past `lo` are exact from there
            assert [r for r in byte_sets.merged(space, S, lo=lo) if r[1] > lo] == [r for r in ranges(want) if r[1] > lo]
            assert (byte_sets.lowest(space, S), byte_sets.highest(space, S)) == (min(want), max(want) + 1)
        for bands in S.values():
            assert all(a[1] <= b[0] and (a[1] < b[0] or a[2] != b[2]) for a, b in zip(bands, bands[1:]))

    for _ in range(400):
        regions, off = [], rng.randrange(16)
        for i in range(rng.randrange(1, 5)):
            row, rows = rng.choice([1, 2, 3, 4, 6, 8, 12, 16]), rng.randrange(1, 8)
            regions.append(SimpleNamespace(offset=off, nbytes=row * rows, row=row, name=f"r{i}"))
            off += row * rows + rng.choice([0, 0, 1, 5])
        space = byte_sets.ByteSpace(regions, lambda r: r.row)

        def pieces():
            out = []
            for _ in range(rng.randrange(1, 4)):
                if rng.random() < 0.4:
                    a = rng.randrange(-3, off + 3)
                    out.append((a, a + rng.randrange(12)))
                else:
                    row = rng.choice(regions).row
                    st = rng.choice([row, 2 * row, 3 * row, max(1, row // 2), max(1, row // 3), rng.randrange(1, 20), -row])
                    out.append((rng.randrange(-2, off + 2), st, rng.randrange(8), rng.randrange(max(2, abs(st) + 2))))
            return out

        pa, pb, pc = pieces(), pieces(), pieces()
        A, B, C = space.bytes_of(pa), space.bytes_of(pb), space.bytes_of(pc)
        a, b, c = explicit(pa), explicit(pb), explicit(pc)
        same(space, A, a)
        same(space, byte_sets.set_op(A, B, byte_sets.MINUS), a - b)
        same(space, byte_sets.set_op(A, B, byte_sets.INTER), a & b)
        same(space, byte_sets.union_all([A, B]), a | b)
        same(space, byte_sets.union_all([A, B, C]), a | b | c)
        assert byte_sets.meets(A, B) == bool(a & b)
        assert byte_sets.left(A, (B, C), ()) == bool(a - b - c)
