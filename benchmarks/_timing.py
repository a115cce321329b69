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


def rotated_rounds(replays: dict, rounds: int, reps: int, before=None, after=None) -> dict[str, list[float]]:
    """Time every `replays[name]()` in `rounds` interleaved rounds, the order rotated by one
    each round (the same order every round would put each build at the same place in it: a
    drift within a round then reads as a difference); a round's time is the median of `reps`
    calls (median_us). `before(name)` / `after(name)` run around each build's timing, untimed."""
    names = list(replays)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            if before is not None:
                before(n)
            times[n].append(median_us(replays[n], reps))
            if after is not None:
                after(n)
    return times


def print_rounds(title: str, times: dict[str, list[float]], checks: dict[str, str]) -> None:
    """The rounds as a markdown table: each build's median round against the first build's."""
    med = {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}
    base = next(iter(med.values()))
    print(f"\n| {title} | step us (median round) | vs default | rounds | check |\n|---|---|---|---|---|")
    for n, ts in times.items():
        print(f"| {n} | {med[n]:.0f} | {med[n] / base - 1:+.1%} | {' '.join(f'{t:.0f}' for t in ts)} | {checks[n]} |")


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
