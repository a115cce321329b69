"""The reference executor on CUDA agrees with itself on the CPU (K3 tiny, fp32, 4 steps).

Each step starts both from the CPU's state: this random model amplifies the ~1e-7 difference
of another summation order over steps (benchmarks/cute_model.py measures that drift), which is
not what this test is about."""
import pytest
import torch

import fusec


@pytest.mark.gpu
def test_reference_executor_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fusec.models import kimi_k3
    from fusec.weights import random_weights

    # One set of weights for both: torch's CPU and CUDA generators give different streams.
    w = random_weights(kimi_k3.build_graph("tiny"), 3, kimi_k3.WEIGHT_INIT)
    kw = dict(batch=2, max_len=8, precision="fp32", weights=w)
    cpu = fusec.compile("kimi_k3", "tiny", device="cpu", **kw)
    gpu = fusec.compile("kimi_k3", "tiny", device="cuda", **kw)
    toks = torch.tensor([11, 42], dtype=torch.int32)
    for s in range(4):
        gpu.runner.state = {k: v.cuda() for k, v in cpu.runner.state.items()}
        pos = torch.full((2,), s, dtype=torch.int32)
        a, b = cpu(toks, pos), gpu(toks, pos)
        err = float((a.logits - b.logits.cpu()).abs().max() / a.logits.abs().max())
        assert err < 1e-4, f"step {s}: rel err {err:.2e}"
        for k, v in cpu.runner.state.items():
            e = float((v - gpu.runner.state[k].cpu()).norm() / v.norm().clamp_min(1e-30))
            assert e < 1e-4, f"step {s}: state {k} rel err {e:.2e}"
        # greedy choice: the GPU's token is a maximum of the CPU's logits up to the error above
        top = a.logits.gather(-1, b.next_tokens.cpu().long()[:, None])[:, 0]
        assert bool((top >= a.logits.max(-1).values - 1e-4 * a.logits.abs().max()).all())
        toks = a.next_tokens
