"""Shared timing helper of the GPU benchmark scripts (imported from their own folder)."""
from __future__ import annotations


def median_us(fn, reps: int) -> float:
    """Median wall time of `fn()` on the current CUDA stream over `reps` runs (CUDA events), after
    one warm-up run."""
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[len(ts) // 2]
