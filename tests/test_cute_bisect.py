"""The per-op bisection of a megakernel step (fusec/debug/bisect.py), driven on the CPU by the
task-table interpreter (tests/cute_table_interp.py) in place of the GPU kernel.

- a correct table: every value the table writes equals the registry reference on its own inputs
  (local) and a whole reference step (end to end); the values it never writes (fused into
  per-task scratch) are reported as such and stand in from the reference;
- a planted wrong address in one row is reported at exactly the op that row computes, while the
  ops after it still check clean locally (they are fed the kernel's own, wrong, inputs).
"""
import dataclasses

import pytest

from cute_table_interp import interp_on_arena
from fusec.debug.bisect import bisect_step, format_report
from fusec.backends.cute.plan import EwOp, Opcode
from fusec.compiler import lower_for_cute
from fusec.backends.reference.ranks import materialize_weights
from fusec.models import kimi_k3
from fusec.weights import random_weights

import torch

B, L = 2, 16


@pytest.fixture(scope="module")
def k3():
    g = kimi_k3.build_graph("tiny")
    prog, low = lower_for_cute(g, B, L)
    W = materialize_weights(prog.graph, random_weights(g, 0, kimi_k3.WEIGHT_INIT), 0, "bf16")
    return prog, low, W


def _bisect(prog, low, W, mutate=None, steps=2):
    bound, it = interp_on_arena(low, W, mutate)
    gen = torch.Generator().manual_seed(3)
    for s in range(steps):
        ins = {"tokens": torch.randint(0, 4096, (B,), generator=gen, dtype=torch.int32),
               "pos": torch.full((B,), s, dtype=torch.int32)}
        rows = bisect_step(prog.graph, bound, lambda: it.run_step(seed=s), ins, {"B": B, "L": L},
                           low.unstored)
    return rows


def test_correct_table_checks_clean(k3):
    prog, low, W = k3
    rows = _bisect(*k3)
    written = [r for r in rows if r.status == "ok"]
    assert len(rows) == sum(len(op.outputs) for op in prog.graph.ops)
    assert not [r for r in rows if r.status == "partial"]
    assert all(r.local < 1e-6 and r.e2e < 1e-6 for r in written), format_report(rows, 1e-6)
    unwritten = {r.value for r in rows if r.status == "unwritten"}
    assert unwritten and prog.graph.outputs[0].name not in unwritten
    assert "nowhere" in format_report(rows, 1e-6).splitlines()[-1]


def test_planted_wrong_address_is_located(k3):
    prog, low, W = k3
    # (Not the beta sigmoid any more: its input is an fp32 slice of a merged projection whose
    # neighbours are bf16-cast slices, stored as bf16 elsewhere, so a shifted read meets
    # columns no row writes and the report is "partial" from there on, not a located error.)
    target = next(r for r in low.rows if r.opcode == Opcode.EW and r.sub == EwOp.ADD)

    def shift(rows):   # the first residual add reads its first operand 2 elements late
        i = rows.index(target)
        rows[i] = dataclasses.replace(rows[i], a0=rows[i].a0 + 4)
        return rows
    rows = _bisect(prog, low, W, shift, steps=1)
    bad = [r for r in rows if r.status == "ok" and r.local > 1e-3]
    assert len(bad) == 1 and bad[0].op == "add", format_report(rows, 1e-3)
    # downstream values drift end to end, but check clean locally
    after = [r for r in rows if r.index > bad[0].index and r.status == "ok"]
    assert any(r.e2e > 1e-3 for r in after)
    assert "BAD" in format_report(rows, 1e-3)


class _Arena:
    """Stands in for the kernel's arena: the router ids the 'kernel' chose."""

    def __init__(self, ids):
        self.ids = ids

    def tensor(self, name):
        return self.ids


def _router_case():
    from fusec.ir.graph import Op, Value
    from fusec.ir.registry import get_op
    from fusec.ir.types import DType, Kind, TensorType

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.999]])   # sigmoid(1.0) vs sigmoid(0.999): a near-tie
    bias = torch.zeros(5)
    t = TensorType((1, 2), DType.i32, Kind.act)
    op = Op("router", [], [Value("w", t, None), Value("ids", t, None)], {"topk": 2, "scale": 1.0}, None)
    return op, [logits, bias], get_op("router").ref([logits, bias], op.attrs)


def test_route_align_follows_near_ties_and_flags_real_errors():
    from fusec.debug.bisect import RouteAlign

    op, ins, ref_outs = _router_case()
    assert sorted(ref_outs[1][0].tolist()) == [0, 1]
    near = RouteAlign(_Arena(torch.tensor([[0, 4]], dtype=torch.int32)))   # expert 4 instead of 1
    w, ids = near(op, ins, ref_outs)
    assert ids.tolist() == [[0, 4]] and near.flips == 1 and not near.violations and 0 < near.max_gap < 1e-3
    s = torch.sigmoid(ins[0][0, [0, 4]])
    assert torch.allclose(w[0], s / s.sum())
    far = RouteAlign(_Arena(torch.tensor([[0, 3]], dtype=torch.int32)))    # expert 3 is far below
    w, ids = far(op, ins, ref_outs)
    assert far.violations and sorted(ids[0].tolist()) == [0, 1]            # the reference keeps its own
    dup = RouteAlign(_Arena(torch.tensor([[0, 0]], dtype=torch.int32)))
    dup(op, ins, ref_outs)
    assert dup.violations


def test_rel_err_matches_infinities_exactly():
    from fusec.debug.bisect import rel_err

    ref = torch.tensor([1.0, float("-inf"), 2.0])
    assert rel_err(torch.tensor([1.0, float("-inf"), 2.0]), ref) == 0.0     # empty chunk: m = -inf both
    assert rel_err(torch.tensor([1.0, 0.0, 2.0]), ref) == float("inf")
    assert rel_err(torch.tensor([1.0, float("-inf"), float("nan")]), ref) == float("inf")
    assert 0 < rel_err(torch.tensor([1.0, float("-inf"), 2.2]), ref) < 0.1


def test_fp32_oracle_from_the_kernel_state(k3):
    """The fp32 oracle harness (arena_reference + sync_state + RouteAlign without tolerance),
    with the interpreter as the kernel: the bf16 reference from the kernel's state matches it bit
    for bit, so both are equally far from the fp32 step, that distance is bf16 rounding (small,
    not zero), and the oracle starts from the pre-step state even for the arena's fp32 state
    (KDA), which `.float()` would alias (the oracle then starts from the kernel's post-step
    state: 0.39 here), and never writes the arena."""
    from fusec.backends.cute.runner import arena_reference
    from fusec.debug.bisect import RouteAlign, sync_state
    prog, low, W = k3
    pg = prog.graph
    bound, it = interp_on_arena(low, W)
    dims = {"B": B, "L": L}
    ref = arena_reference(pg, bound, dims, "cpu")
    exact = arena_reference(pg, bound, dims, "cpu", "fp32")
    names = [v.name for v in pg.params if v.type.kind.value == "state"]
    assert any(bound.tensor(n).dtype == torch.float32 for n in names)   # the aliasing case exists
    gen = torch.Generator().manual_seed(5)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    for s in range(4):
        tok = torch.randint(0, 4096, (B,), generator=gen, dtype=torch.int32)
        pos = torch.full((B,), s, dtype=torch.int32)
        sync_state(ref, bound, names)
        sync_state(exact, bound, names)
        bound.tensor("tokens").copy_(tok)
        bound.tensor("pos").copy_(pos)
        it.run_step(seed=s)
        lk = bound.tensor(pg.outputs[0].name).clone()
        after = {n: bound.tensor(n).clone() for n in names}
        lr = ref.run(tok, pos, hook=RouteAlign(bound))[0]
        le = exact.run(tok, pos, hook=RouteAlign(bound, tol=float("inf")))[0]
        assert all(torch.equal(bound.tensor(n), after[n]) for n in names), f"step {s}: oracle wrote the arena"
        assert rel(lk, lr) == 0.0
        assert rel(lk, le) == rel(lr, le)
        assert 1e-4 < rel(lr, le) < 5e-2, f"step {s}: bf16 vs fp32 {rel(lr, le)}"


def _gate_run(pg, W, kernel_hook, steps=8, batch=1):
    """Per step (kernel vs bf16 reference, kernel vs fp32, bf16 reference vs fp32) where the
    'kernel' is the bf16 reference with `kernel_hook` applied to its op outputs, and the other
    two start each step from its state on its experts, as the GPU checks do."""
    from fusec.backends.reference.runner import ReferenceRunner
    from fusec.debug.bisect import RouteReplay

    dims = {"B": batch, "L": L}
    K, R, X = (ReferenceRunner(pg, W, dims, "cpu", p) for p in ("bf16", "bf16", "fp32"))
    gen = torch.Generator().manual_seed(11)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    out = []
    for s in range(steps):
        tok = torch.randint(0, 4096, (batch,), generator=gen, dtype=torch.int32)
        pos = torch.full((batch,), s, dtype=torch.int32)
        for n in K.state:
            R.state[n] = K.state[n].clone()
            X.state[n] = K.state[n].float()       # a copy: the bf16 state converts
        replay = RouteReplay(kernel_hook)
        lk = K.run(tok, pos, hook=replay.record)[0]
        lr = R.run(tok, pos, hook=replay.follow)[0]
        le = X.run(tok, pos, hook=replay.follow)[0]
        out.append((rel(lk, lr), rel(lk, le), rel(lr, le)))
    return [list(c) for c in zip(*out)]


def test_logits_gate_tells_rounding_from_a_bug():
    """bisect.logits_run_ok on K3 tiny at batch 1 (the CPU reference, the weights fusec.compile
    draws): a 'kernel' whose linear outputs carry 1e-4 relative noise (twice the local error the
    real kernel shows; a different fp32 summation order) is past the issue's 2e-2 at several
    steps, up to ~4e-2, and the gate accepts it on its fp32 distance; one layer's o_proj 10% low
    (a real bug) is rejected although some of its steps are under 2e-2 and others under the 5e-2
    ceiling (mean fp32 distance 2.5x the reference's). Not asserted: 3% low sits at the margin
    (1.24x), inside this model's noise; the per-op local check is the sharp test for that."""
    from fusec.debug.bisect import LOGITS_TOL, logits_run_ok

    g = kimi_k3.build_graph("tiny")
    prog, _ = lower_for_cute(g, 1, L)
    pg = prog.graph
    W = materialize_weights(pg, random_weights(g, 0, kimi_k3.WEIGHT_INIT), 0, "bf16")

    def noisy(op, ins, outs):
        if op.opname != "linear":
            return outs
        gen = torch.Generator().manual_seed(len(op.outputs[0].name))
        return [o * (1 + 1e-4 * torch.randn(o.shape, generator=gen).to(o.dtype)) for o in outs]

    def o_proj_low(op, ins, outs):
        return [outs[0] * 0.9] if op.outputs[0].name == "l3.o_proj" else outs
    errs, k32, r32 = _gate_run(pg, W, noisy)
    assert sum(e >= LOGITS_TOL for e in errs) >= 3 and not logits_run_ok(errs), errs
    assert logits_run_ok(errs, k32, r32), (errs, k32, r32)
    errs, k32, r32 = _gate_run(pg, W, o_proj_low)
    assert min(errs) < LOGITS_TOL and not logits_run_ok(errs, k32, r32), (errs, k32, r32)
    assert not logits_run_ok([min(e, 4.9e-2) for e in errs], k32, r32)   # the fp32 arm itself rejects it
