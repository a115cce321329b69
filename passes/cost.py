"""The cost model: predicted time per task and per step on a target GPU (`fusec.passes.target`:
its SMs, HBM bandwidth, FLOP/s and links). Whole-graph figures (parameters, active parameters,
bytes per token, from `OpDef.cost`) are `fusec.stats`.

Task time (one CTA on one SM), used by the list scheduler (`passes/schedule.py`):
    t = TASK_OVERHEAD_US + max(bytes / (hbm_bw / sms), flops / (peak_flops / sms))
          + (pushes only) link latency + remote bytes / (link_bw / concurrent pushes)
A decode step streams weights with every SM busy, so one SM's fair share of HBM bandwidth is
the right rate for a task; a task that runs alone is predicted pessimistically.
TASK_OVERHEAD_US = 1.5 us: the acquire spin on an event written by another SM (an L2 round
trip, ~0.7 us), two CTA barriers and the pipeline fill of the first loads. This is an assumption
until the megakernel measures it (backends/cute benchmarks).
"""
from __future__ import annotations

import heapq
from collections import defaultdict

from .target import GpuSpec

TASK_OVERHEAD_US = 1.5

# A prologue op folded into a GEMV group is recomputed by every tile (every SM), each reading the
# op's whole input from L2. Above this many input bytes per tile a separate task (split over the
# SMs) and one more wait cost less: measured on the H200 (slice4-e128), the folded LatentMoE
# combine read 16 x 3584 fp32 slot rows per batch row in every tile, 3.7 MB at B = 16, and took
# 157 us of each SM per layer (40 us at B = 4), against a wait of a few us.
PROLOGUE_MAX_BYTES = 256 * 1024


def task_time_us(spec: GpuSpec, nbytes: float, flops: float, remote_bytes: float = 0.0,
                 remote_hops: int = 0, sms: int | None = None, off_domain: bool = False,
                 remote_streams: int = 1) -> float:
    """Predicted duration of one task (see the module docstring). A push shares the link with
    `remote_streams` concurrent pushes (the other peers of its collective); a push to a peer
    outside the NVLink domain (`off_domain`) pays the network's bandwidth and latency instead."""
    n = sms or spec.sms
    t = TASK_OVERHEAD_US + max(nbytes / (spec.hbm_bw / n), flops / (spec.flops / n)) * 1e6
    if remote_bytes:
        bw, lat = (spec.net_bw, spec.net_lat_us) if off_domain else (spec.nvlink_bw, spec.nvlink_lat_us)
        t += remote_bytes / (bw / max(1, remote_streams)) * 1e6 + lat * max(1, remote_hops)
    return t


def list_schedule(units, sms: int) -> tuple[dict[str, float], list[list[tuple[int, float]]]]:
    """The step-time model of the `schedule` pass (its list-scheduling rule), on its own so a pass
    can predict a piece of a step (passes/split_reduce.py's gate). `units`: (name, deps, task
    costs) in issue order; a unit's tasks are ready when every unit of `deps` issued before it has
    finished; each task goes to the SM that frees first (ties: the lowest SM) and starts when that
    SM is free and the task is ready. Returns each unit's finish and, per unit, each task's
    (SM, start); every SM starts free at 0."""
    free = [(0.0, sm) for sm in range(sms)]
    heapq.heapify(free)
    finish: dict[str, float] = {}
    placed = []
    for name, deps, costs in units:
        ready = max((finish[d] for d in deps if d in finish), default=0.0)
        end, at = ready, []
        for c in costs:
            f, sm = heapq.heappop(free)
            start = max(f, ready)
            done = start + c
            heapq.heappush(free, (done, sm))
            at.append((sm, start))
            end = max(end, done)
        finish[name] = end
        placed.append(at)
    return finish, placed


def step_summary(schedule) -> dict:
    """Predicted step time (max SM finish, from the scheduler) and per body-kind totals."""
    per_kind = defaultdict(lambda: [0, 0.0])
    for t in schedule.tasks:
        per_kind[t.body_kind][0] += 1
        per_kind[t.body_kind][1] += t.cost_us
    return {"step_us": float(schedule.meta.get("predicted_step_us", 0.0)),
            "tasks": len(schedule.tasks),
            "by_body": {k: {"tasks": n, "sum_us": round(us, 3)} for k, (n, us) in sorted(per_kind.items())}}
