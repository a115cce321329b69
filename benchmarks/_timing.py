"""Shared timing helper of the benchmark scripts (imported from their own folder)."""
from __future__ import annotations

import time


def median_us(fn, reps: int, cuda: bool = True) -> float:
    """Median time of `fn()` over `reps` calls after one warm-up, in microseconds: CUDA events
    around each call on the current stream with a sync after it (cuda=False: wall clock)."""
    import torch

    fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
    return sorted(ts)[len(ts) // 2]


# Bytes written to evict L2 before a cold replay (H200: 50 MB of L2).
COLD_BYTES = 256 << 20


def graph_step_us(rt, reps: int, steps: int = 10, cold: bool = False) -> float:
    """Median microseconds per step of megakernel `rt` (backends/cute/runtime.Megakernel): a CUDA
    graph of `steps` steps replayed `reps` times after one warm-up replay, CUDA events around each
    replay, so host launch overhead is not counted; the kernel's bounded-wait error is raised.
    cold: one step per replay, with L2 overwritten (COLD_BYTES written) before each, outside
    the timed window: a body's operands then come from HBM as inside a decode step, where the
    weights streamed between two of its layers evict them."""
    import statistics

    import torch

    steps = 1 if cold else steps
    flush = torch.empty(COLD_BYTES, dtype=torch.uint8, device="cuda") if cold else None
    g = rt.capture_graph(steps=steps)
    g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush is not None:
            flush.fill_(1)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / steps)
    rt.check()
    return statistics.median(ts)
