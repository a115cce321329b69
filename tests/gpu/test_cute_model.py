"""Whole decode steps through fusec.compile(backend="cute") against the reference executor over
the same lowered graph on the GPU (marked gpu; skipped without CUDA or nvidia-cutlass-dsl), op by
op, with delay injection, and a planted missing signal. Timing lives in benchmarks/."""
import dataclasses

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

import fusec  # noqa: E402
from fusec.debug.bisect import RouteAlign, logits_run_ok, sync_state  # noqa: E402
from fusec.backends.cute.plan import NO_EVENT  # noqa: E402
from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout  # noqa: E402
from fusec.models import kimi_k3, llama  # noqa: E402

MODEL = llama.__file__
# States after a step: a wrong update is an O(1e-1..1) error; a one-ulp bf16 flip upstream (another
# summation order) moves a small state of these random models by up to ~2e-2 (benchmarks/cute_model.py).
STATE_TOL = 5e-2


def _steps(step_fn, run, ref, batch, steps, seed, align=None, exact=None):
    """Teacher-forced steps of the kernel; each step the reference starts from the kernel's own
    state (so a random model's chaotic drift does not accumulate, see benchmarks/cute_model.py)
    and follows its near-tied expert choices (`align`). `exact`: the same step in fp32 from the
    same state on the kernel's experts. Yields (step, logits rel err, worst state rel err after
    the step, kernel vs fp32, bf16 reference vs fp32) (the last two None without `exact`)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = ref.graph.outputs[0].type.shape[-1]
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))  # noqa: E731
    for s in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=gen, dtype=torch.int32).cuda()
        pos = torch.full((batch,), s, dtype=torch.int32, device="cuda")
        for n in run.state_names:
            ref.state[n] = run.mem.tensor(n).clone()
        if exact is not None:
            sync_state(exact, run.mem, run.state_names)
        la, na = step_fn(tok, pos)
        lb, _ = ref.run(tok, pos, hook=align)
        # ARGMAX body: the kernel's greedy tokens are the first maximum of its own logits
        assert torch.equal(na.long().cpu(), la.float().argmax(-1).cpu()), f"step {s}: argmax"
        e32 = r32 = None
        if exact is not None:
            le, _ = exact.run(tok, pos, hook=RouteAlign(run.mem, tol=float("inf")))
            e32, r32 = rel(la, le), rel(lb, le)
        yield s, rel(la, lb), max(rel(run.mem.tensor(n), ref.state[n]) for n in run.state_names), e32, r32


@pytest.mark.parametrize("model,batch", [pytest.param(llama, 1, id="llama-b1"), pytest.param(llama, 4, id="llama-b4"),
                                         pytest.param(kimi_k3, 1, id="k3-b1"), pytest.param(kimi_k3, 4, id="k3-b4")])
def test_tiny_steps_match_reference(model, batch):
    """8 steps against the reference over the same lowered graph (bf16, GPU), each from the
    kernel's state; logits and state after each step. For K3 the reference follows the kernel's
    expert choice where the two differ by a near-tie (RouteAlign: within 1e-2 of the k-th score);
    any other difference is a violation.

    Logits (bisect.logits_run_ok): every step within the issue's 2e-2 of the bf16 reference, or,
    where two bf16 runs differ by more, every step under 5e-2 and the kernel on average no
    farther from the exact fp32 step (same state, the kernel's experts) than the bf16 reference.
    The random tiny K3 carries the bf16 rounding of ~60 ops in a row without the damping of a
    trained residual stream: its bf16 reference is itself 1e-2 .. 4e-2 from the fp32 step
    (benchmarks/k3_sensitivity.py), so two bf16 runs that differ only in fp32 summation order
    (every op of the kernel matches its reference within ~5e-5 locally) land up to ~3e-2 apart
    at single steps. That noise also hides a small real error at the logits (one layer's o_proj
    off by 10% fails, off by 3% sits at the margin: tests/test_cute_bisect.py), which is why the
    op-by-op check below is the sharp one."""
    run = fusec.compile(model.__file__, "tiny", backend="cute", batch=batch, max_len=16, device="cuda").runner
    ref = run.lowered_reference()
    exact = run.lowered_reference(precision="fp32")
    align = RouteAlign(run.mem) if model is kimi_k3 else None
    rows = list(_steps(run.run, run, ref, batch, 8, batch, align, exact))
    table = "\n".join(f"step {s}: vs bf16 reference {e:.2e}, state {st:.2e}, vs the fp32 step: kernel {k:.2e}, "
                      f"bf16 reference {r:.2e}" for s, e, st, k, r in rows)
    print(table)   # shown with -rP; the numbers in the closing note come from here
    assert all(st < STATE_TOL for _, _, st, _, _ in rows), table
    assert logits_run_ok(*[[r[i] for r in rows] for i in (1, 3, 4)]), table
    assert align is None or not align.violations, align.violations


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_k3_every_op_matches_its_reference_locally_at_every_step(batch):
    """8 steps op by op: at each step every body's output, on its own inputs, within bf16
    rounding of the op's registry reference (bisect.py), and integer results exact. This is the
    check that does not depend on how much the random tiny model amplifies one rounding flip
    (see test_tiny_steps_match_reference)."""
    from fusec.debug.bisect import bisect_step, format_report
    run = fusec.compile(kimi_k3.__file__, "tiny", backend="cute", batch=batch, max_len=16, device="cuda").runner
    gen = torch.Generator().manual_seed(batch)
    for s in range(8):
        ins = {"tokens": torch.randint(0, 4096, (batch,), generator=gen, dtype=torch.int32).cuda(),
               "pos": torch.full((batch,), s, dtype=torch.int32, device="cuda")}
        rows = bisect_step(run.program.graph, run.mem, lambda: (run.kernel.step(), run.kernel.check()), ins,
                           run.dims, run.lowered.unstored)
        floats = [r for r in rows if r.status == "ok" and r.op not in ("router", "argmax")]
        assert not [r for r in rows if r.status == "partial"], f"step {s}\n" + format_report(rows)
        assert floats and all(r.local < 1e-2 for r in floats), f"step {s}\n" + format_report(rows)
        # integer results on the kernel's own inputs: exact (no near-tie at these scores)
        assert all(r.local == 0 for r in rows if r.op == "argmax"), f"step {s}\n" + format_report(rows)


def test_delay_injection_still_matches():
    """Producers sleep before they write (plan.delay_ns): 4 steps op by op, activations poisoned
    before each step, so a read that is not ordered after its producer sees NaN or stale data
    and fails its op's local check (robust to the random model's amplification, unlike logits)."""
    from fusec.debug.bisect import bisect_step, format_report
    run = fusec.compile(kimi_k3.__file__, "tiny", backend="cute", batch=4, max_len=16, device="cuda").runner
    mk = Megakernel(dataclasses.replace(run.plan, delay_ns=20_000))
    gen = torch.Generator().manual_seed(9)
    for s in range(4):
        ins = {"tokens": torch.randint(0, 4096, (4,), generator=gen, dtype=torch.int32).cuda(),
               "pos": torch.full((4,), s, dtype=torch.int32, device="cuda")}
        rows = bisect_step(run.program.graph, run.mem, lambda: (mk.step(), mk.check()), ins, run.dims,
                           run.lowered.unstored)
        floats = [r for r in rows if r.status == "ok" and r.op not in ("router", "argmax")]
        assert not [r for r in rows if r.status == "partial"], f"step {s}\n" + format_report(rows)
        assert floats and all(r.local < 1e-2 for r in floats), f"step {s}\n" + format_report(rows)


def test_missing_signal_is_a_bounded_error():
    run = fusec.compile(MODEL, "tiny", backend="cute", batch=1, max_len=16, device="cuda").runner
    tasks = list(run.plan.tasks)
    i = next(i for i, t in enumerate(tasks) if t.signal_event == 0)
    tasks[i] = dataclasses.replace(tasks[i], signal_event=NO_EVENT)
    mk = Megakernel(dataclasses.replace(run.plan, tasks=tuple(tasks), spin_timeout_ns=100_000_000))
    mk.step()  # returns (bounded spin); the time it takes is reported by benchmarks/cute_model.py
    with pytest.raises(MegakernelTimeout, match="waited on event"):
        mk.check()
