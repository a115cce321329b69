"""The reference executor on CUDA agrees with itself on the CPU (K3 tiny, fp32, 4 steps)."""
import pytest
import torch

import fusec


@pytest.mark.gpu
def test_reference_executor_on_cuda_matches_cpu():
    kw = dict(batch=2, max_len=8, precision="fp32", seed=3)
    cpu = fusec.compile("kimi_k3", "tiny", device="cpu", **kw)
    gpu = fusec.compile("kimi_k3", "tiny", device="cuda", **kw)
    toks = torch.tensor([11, 42], dtype=torch.int32)
    for s in range(4):
        pos = torch.full((2,), s, dtype=torch.int32)
        a, b = cpu(toks, pos), gpu(toks, pos)
        err = (a.logits - b.logits.cpu()).abs().max() / a.logits.abs().max()
        assert err < 1e-4, f"step {s}: rel err {err:.2e}"
        assert torch.equal(a.next_tokens, b.next_tokens.cpu())
        toks = a.next_tokens
