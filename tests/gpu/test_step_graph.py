"""CompiledStep's one-graph step on the cute backend (marked gpu; skipped without CUDA or
nvidia-cutlass-dsl): K3 tiny through `step()` (one CUDA-graph replay: device range check and
clamps, the megakernel step, the finite check) against the same compile run by the path of
separate launches; deferred errors (range, non-finite logits, a planted missing signal) still
raised naming their step. The bookkeeping without a GPU: tests/test_step_graph.py. Timing lives
in benchmarks/speed.py."""
import dataclasses

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

import fusec  # noqa: E402
from fusec.api import CompiledStep, NonFiniteLogits  # noqa: E402
from fusec.backends.cute.plan import NO_EVENT  # noqa: E402
from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout  # noqa: E402
from fusec.models import kimi_k3, llama  # noqa: E402

B, L, VOCAB = 2, 16, 4096


class SeparateLaunches:
    """A cute runner without its capturable step: CompiledStep takes the path it took before the
    one-graph step (range check, runner.run, finite check as separate launches)."""

    def __init__(self, runner):
        self.runner = runner

    def run(self, tokens, positions):
        return self.runner.run(tokens, positions)

    def reset(self):
        self.runner.reset()

    def check(self, keep=0):
        self.runner.check(keep)


@pytest.fixture(scope="module")
def k3():
    """(one-graph step, the same model by separate launches): two compiles from the same seed."""
    a = fusec.compile(kimi_k3.__file__, "tiny", backend="cute", batch=B, max_len=L, device="cuda")
    b = fusec.compile(kimi_k3.__file__, "tiny", backend="cute", batch=B, max_len=L, device="cuda")
    old = CompiledStep(b.graph, SeparateLaunches(b.runner), B, L, "cuda", deferred=True)
    assert a.graphed and a.guarded and not old.graphed
    return a, old


def _fresh(*steps):
    for s in steps:
        s.reset()


def _same(a, b, what):
    assert torch.equal(a.next_tokens, b.next_tokens), what
    d = float((a.logits - b.logits).abs().max())
    assert torch.equal(a.logits, b.logits), f"{what}: logits differ by up to {d:.3e}"


def test_steps_and_generate_match_the_separate_launches(k3):
    """Same bits as the path of separate launches (the kernel's sums run in a fixed order), with
    CUDA int32 and CPU int64 inputs (graphs read in place and through the staging buffer); outputs of step k survive step k + 1; one step counted per
    replay on the host and on the device."""
    a, old = k3
    _fresh(a, old)
    gen = torch.Generator().manual_seed(3)
    kept = []
    for s in range(6):
        tok = torch.randint(0, VOCAB, (B,), generator=gen)
        pos = torch.full((B,), s)
        if s % 2 == 0:
            tok, pos = tok.to("cuda", torch.int32), pos.to("cuda", torch.int32)
        oa, ob = a.step(tok, pos), old.step(tok, pos)
        _same(oa, ob, f"step {s}")
        kept.append((oa, oa.logits.clone(), oa.next_tokens.clone()))
    a.check()
    old.check()
    assert not torch.equal(kept[0][1], kept[1][1])                 # other tokens, other logits
    for s, (o, logits, nxt) in enumerate(kept):
        assert torch.equal(o.logits, logits) and torch.equal(o.next_tokens, nxt), f"step {s} overwritten"
    k = a.runner.kernel
    assert k.steps_launched == int(k.step_buf.item()), "a replay counted twice or not at all"
    _fresh(a, old)
    first = torch.tensor([11, 4000], device="cuda")
    assert torch.equal(a.generate(first, 8), old.generate(first, 8))
    assert k.steps_launched == int(k.step_buf.item())


@pytest.mark.parametrize("n", [3, 40])
def test_input_guard_kernel(n):
    """backends/cute/step_inputs.py on the device, against torch: int64 tokens (negative, past
    2**31, past 2**32: clamped in 64 bits, not narrowed first) and int32 positions, and the
    reverse; n = 40 rows takes a lane two rows. The flag is 1.0 exactly when a value was clamped;
    the step counter advances by one per launch."""
    from fusec.backends.cute import step_inputs

    gen = torch.Generator().manual_seed(n)
    hi_t, hi_p = 4095, 15
    step = torch.tensor([7], dtype=torch.int32, device="cuda")
    flag = torch.full((1,), -1.0, device="cuda")
    for tdt, pdt in ((torch.int64, torch.int32), (torch.int32, torch.int64)):
        for bad in (False, True):
            tok = torch.randint(0, hi_t + 1, (n,), generator=gen)
            pos = torch.randint(0, hi_p + 1, (n,), generator=gen)
            if bad:
                tok[n - 1] = -3 if tdt == torch.int32 else 2 ** 32 + 5
                pos[0] = 2 ** 31 + 1 if pdt == torch.int64 else hi_p + 1
            tok, pos = tok.to("cuda", tdt), pos.to("cuda", pdt)
            out_t = torch.full((n,), -9, dtype=torch.int32, device="cuda")
            out_p = torch.full((n,), -9, dtype=torch.int32, device="cuda")
            before = int(step.item())
            step_inputs.launch(tok, pos, out_t, out_p, hi_t, hi_p, flag, step)
            torch.cuda.synchronize()
            assert torch.equal(out_t, tok.to(torch.int64).clamp(0, hi_t).to(torch.int32)), (tdt, bad)
            assert torch.equal(out_p, pos.to(torch.int64).clamp(0, hi_p).to(torch.int32)), (pdt, bad)
            assert float(flag.item()) == (1.0 if bad else 0.0) and int(step.item()) == before + 1


def test_out_of_range_inputs_are_clamped_and_raised_later(k3):
    a, old = k3
    _fresh(a, old)
    cuda = lambda *v: torch.tensor(v, device="cuda")  # noqa: E731
    bad = a.step(cuda(3, 10 ** 6), cuda(0, 0))                     # returns: the check is pending
    _same(bad, old.step(cuda(3, VOCAB - 1), cuda(0, 0)), "the step ran on the clamped token")
    a.step(cuda(3, 4), cuda(1, 1))
    old.step(cuda(3, 4), cuda(1, 1))
    with pytest.raises(ValueError, match=r"^step 0: a position outside \[0, 16\) or a token id outside"):
        a.step(cuda(3, 4), cuda(2, 2))
    _same(a.step(cuda(5, 6), cuda(99, 2)), old.step(cuda(5, 6), cuda(L - 1, 2)), "clamped position")
    with pytest.raises(ValueError, match=r"^step 2: "):
        a.check()
    with pytest.raises(ValueError, match=r"token id 4096 is outside the vocabulary"):
        a.step(torch.tensor([1, VOCAB]), torch.tensor([3, 3]))    # CPU inputs: checked at once


def test_nonfinite_logits_are_raised_naming_the_step(k3):
    a, _ = k3
    _fresh(a)
    w = a.runner.mem.tensor("lm_head.weight")
    saved = w.clone()
    try:
        w[5].fill_(float("nan"))
        cuda = lambda *v: torch.tensor(v, device="cuda")  # noqa: E731
        out = a.step(cuda(3, 4), cuda(0, 0))
        a.step(cuda(3, 4), cuda(1, 1))
        with pytest.raises(NonFiniteLogits, match=r"^step 0: non-finite logits in batch row\(s\) \[0, 1\]"):
            a.step(cuda(3, 4), cuda(2, 2))
        assert not torch.isfinite(out.logits).all()
        a.step(cuda(3, 4), cuda(2, 2))
        with pytest.raises(NonFiniteLogits, match=r"^step 2: "):
            a.check()
    finally:
        w.copy_(saved)
        a.reset()


def test_missing_signal_is_a_bounded_error_through_step():
    """A task that never signals (as in tests/gpu/test_cute_model.py), planted in the runner's own
    kernel before the graph is captured: step() does not wait for it; the step after next (or
    check()) raises MegakernelTimeout naming the wait."""
    s = fusec.compile(llama.__file__, "tiny", backend="cute", batch=1, max_len=16, device="cuda")
    run = s.runner
    tasks = list(run.plan.tasks)
    i = next(i for i, t in enumerate(tasks) if t.signal_event == 0)
    tasks[i] = dataclasses.replace(tasks[i], signal_event=NO_EVENT)
    run.kernel = Megakernel(dataclasses.replace(run.plan, tasks=tuple(tasks), spin_timeout_ns=100_000_000))
    tok = torch.tensor([3], device="cuda")
    s.step(tok, torch.tensor([0], device="cuda"))
    s.step(tok, torch.tensor([1], device="cuda"))
    with pytest.raises(MegakernelTimeout, match="waited on event"):
        s.step(tok, torch.tensor([2], device="cuda"))
    s.reset()
    s.step(tok, torch.tensor([0], device="cuda"))
    with pytest.raises(MegakernelTimeout, match="waited on event"):
        s.check()
    assert run.kernel.steps_launched == int(run.kernel.step_buf.item()) == 3
