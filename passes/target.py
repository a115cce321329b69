"""The hardware target, defined once: each GPU fusec plans for, with its SM count, compute
architecture, memory and interconnect figures.

Everything that needs a property of the GPU reads it from here: `Options` (SMs to schedule
onto, `gpu`), the cost model (`fusec.passes.cost`), the simulator, and the CuTe backend (its
grid bound and the `sm_90a` it compiles for are `GPUS["h200"]`'s).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    arch: str              # the compute architecture kernels are compiled for (CUTE_DSL_ARCH)
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
    "h200": GpuSpec("h200", "sm_90a", 132, 4.16e12, 790e12, 450e9, 1.5, 8, 50e9, 5.0),
    # GB300 (Blackwell Ultra, compute capability 10.3): HBM3e ~8 TB/s datasheet (assumed
    # achievable: not measured here); NVLink 5: 1.8 TB/s bidirectional per GPU; 72 GPUs in one
    # NVL72 domain. Simulated only: no backend compiles for it.
    "gb300": GpuSpec("gb300", "sm_103a", 160, 8.0e12, 2500e12, 900e9, 1.5, 72, 100e9, 5.0),
}
DEFAULT_GPU = "h200"


def gpu_spec(name: str) -> GpuSpec:
    if name not in GPUS:
        raise ValueError(f"unknown gpu '{name}' (known: {', '.join(GPUS)})")
    return GPUS[name]
