"""Whole decode steps through fusec.compile(backend="cute") against the reference executor on the
GPU (marked gpu; skipped without CUDA or nvidia-cutlass-dsl). Timing lives in
benchmarks/cute_model.py."""
import dataclasses

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

import fusec  # noqa: E402
from fusec.backends.cute.plan import NO_EVENT  # noqa: E402
from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout  # noqa: E402
from fusec.models import kimi_k3, llama  # noqa: E402

MODEL = llama.__file__


@pytest.mark.parametrize("model,batch,steps", [(llama, 1, 6), (llama, 4, 6), (kimi_k3, 1, 2)],
                         ids=["llama-b1", "llama-b4", "k3-b1"])
def test_tiny_steps_match_reference(model, batch, steps):
    cute = fusec.compile(model.__file__, "tiny", backend="cute", batch=batch, max_len=16, device="cuda")
    ref = fusec.compile(model.__file__, "tiny", backend="reference", batch=batch, max_len=16, device="cuda")
    gen = torch.Generator().manual_seed(batch)
    vocab = ref.graph.outputs[0].type.shape[-1]
    for s in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=gen, dtype=torch.int32).cuda()
        pos = torch.full((batch,), s, dtype=torch.int32, device="cuda")
        a, b = cute(tok, pos), ref(tok, pos)
        err = float((a.logits - b.logits).norm() / b.logits.norm())
        assert err < 2e-2, f"step {s}: logits rel err {err}"
        assert torch.equal(a.next_tokens.cpu(), b.next_tokens.cpu())


def test_missing_signal_is_a_bounded_error():
    run = fusec.compile(MODEL, "tiny", backend="cute", batch=1, max_len=16, device="cuda").runner
    tasks = list(run.plan.tasks)
    i = next(i for i, t in enumerate(tasks) if t.signal_event == 0)
    tasks[i] = dataclasses.replace(tasks[i], signal_event=NO_EVENT)
    mk = Megakernel(dataclasses.replace(run.plan, tasks=tuple(tasks), spin_timeout_ns=100_000_000))
    mk.step()  # returns (bounded spin); the time it takes is reported by benchmarks/cute_model.py
    with pytest.raises(MegakernelTimeout, match="waited on event"):
        mk.check()
