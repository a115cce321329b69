"""The cost model: GPU and interconnect parameters, predicted time per task and per step, and
whole-graph figures (parameters, active parameters, bytes per token) from `OpDef.cost`.

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

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

from fusec.ir.graph import Graph
from fusec.ir.types import Kind

TASK_OVERHEAD_US = 1.5


@dataclass(frozen=True)
class GpuSpec:
    name: str
    sms: int
    hbm_bw: float          # bytes/s, achievable (H200: measured copy); GB300: datasheet, assumed
    flops: float           # dense bf16 FLOP/s
    nvlink_bw: float       # bytes/s one direction per GPU inside the NVLink domain
    nvlink_lat_us: float   # one remote store + signal visible to the peer
    nvlink_domain: int     # GPUs in one NVLink domain (H200 HGX: 8; GB300 NVL72: 72)
    net_bw: float          # bytes/s per GPU between domains (InfiniBand / RoCE)
    net_lat_us: float


GPUS: dict[str, GpuSpec] = {
    # H200: 4.16 TB/s measured device copy (DESIGN.md); NVLink 4: 900 GB/s bidirectional per GPU;
    # 8 GPUs per HGX node; ConnectX-7 400 Gb/s per GPU between nodes.
    "h200": GpuSpec("h200", 132, 4.16e12, 790e12, 450e9, 1.5, 8, 50e9, 5.0),
    # GB300 (Blackwell Ultra): HBM3e ~8 TB/s datasheet (assumed achievable: not measured here);
    # NVLink 5: 1.8 TB/s bidirectional per GPU; 72 GPUs in one NVL72 domain.
    "gb300": GpuSpec("gb300", 160, 8.0e12, 2500e12, 900e9, 1.5, 72, 100e9, 5.0),
}


def gpu_spec(name: str) -> GpuSpec:
    if name not in GPUS:
        raise ValueError(f"unknown gpu '{name}' (known: {', '.join(GPUS)})")
    return GPUS[name]


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


@dataclass
class GraphStats:
    params: float = 0.0               # parameter count (elements of weight tensors)
    active_params: float = 0.0        # parameters read per token at batch 1
    weight_bytes: float = 0.0         # bytes of all weights
    bytes_read: float = 0.0           # bytes read per step (weights + state + activations)
    bytes_written: float = 0.0
    flops: float = 0.0
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)   # op name -> figures

    def roofline_us(self, spec: GpuSpec) -> float:
        return (self.bytes_read + self.bytes_written) / spec.hbm_bw * 1e6


def graph_stats(graph: Graph, dims: Mapping[str, int]) -> GraphStats:
    """Figures of one decode step from each op's registry cost (active = what batch `B` reads)."""
    st = GraphStats()
    for w in graph.weights():
        st.params += w.type.numel(dims)
        st.weight_bytes += w.type.nbytes(dims)
    by = defaultdict(lambda: defaultdict(float))
    active_w: dict[str, float] = {}
    for op in graph.ops:
        c = op.opdef.cost([v.type for v in op.inputs], [v.type for v in op.outputs], op.attrs, dims)
        st.bytes_read += c.bytes_read
        st.bytes_written += c.bytes_written
        st.flops += c.flops
        k = by[op.opname]
        k["count"] += 1
        k["bytes"] += c.bytes_read + c.bytes_written
        k["flops"] += c.flops
        # active parameters: a weight operand counts fully, unless the op reads it through a
        # run-time address (experts): then the fraction its cost model charges
        full = sum(v.type.nbytes(dims) for v in op.inputs if v.kind is Kind.weight)
        frac = 1.0
        if op.opdef.addressed_by and full:
            other = sum(v.type.nbytes(dims) for v in op.inputs if v.kind is not Kind.weight)
            frac = min(1.0, max(0.0, (c.bytes_read - other) / full))
        for v in op.inputs:
            if v.kind is Kind.weight:
                active_w[v.name] = max(active_w.get(v.name, 0.0), frac * v.type.numel(dims))
    st.active_params = sum(active_w.values())
    st.by_kind = {k: dict(v) for k, v in sorted(by.items())}
    return st


def step_summary(schedule) -> dict:
    """Predicted step time (max SM finish, from the scheduler) and per body-kind totals."""
    per_kind = defaultdict(lambda: [0, 0.0])
    for t in schedule.tasks:
        per_kind[t.body_kind][0] += 1
        per_kind[t.body_kind][1] += t.cost_us
    return {"step_us": float(schedule.meta.get("predicted_step_us", 0.0)),
            "tasks": len(schedule.tasks),
            "by_body": {k: {"tasks": n, "sum_us": round(us, 3)} for k, (n, us) in sorted(per_kind.items())}}
