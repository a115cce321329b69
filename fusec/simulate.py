"""Multi-GPU decode-step simulation: compile the graph for R ranks and read the predicted step.

`simulate(model_graph, ranks, gpu="h200"|"gb300", batch)` runs canonicalize, fuse, shard, tile,
overlap and schedule with the GPU's parameters (`fusec.cost.GPUS`: SMs, HBM bandwidth,
NVLink / network bandwidth and latency) and returns the list-scheduled step time of one rank
(all ranks run the same replicated schedule) and tokens/s per user. Nothing is run on a GPU.

The shard pass splits heads (96) and experts (896) evenly, so R must divide both; for another R
(64, 72) the simulation uses the largest R' < R that does (32) and says so in `note`: the
remaining GPUs would need another parallelism (data parallel replicas, or replicated heads),
which fusec does not plan. Inputs and parameters are written down in docs/simulation.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fusec.config import Options
from fusec.cost import gpu_spec, graph_stats
from fusec.ir.graph import Graph

PIPE = ["canonicalize", "fuse", "shard", "tile", "overlap", "schedule"]


@dataclass
class SimResult:
    gpu: str
    ranks: int                # GPUs asked for
    used_ranks: int           # GPUs the sharding plan can use (see module docstring)
    batch: int
    step_us: float            # predicted decode step (one token per sequence)
    roofline_us: float        # bytes one rank must move / HBM bandwidth
    tasks: int
    collectives: int
    note: str = ""

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1e6 / self.step_us

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e6 / self.step_us


def _feasible_ranks(g: Graph, ranks: int) -> int:
    """Largest R' <= ranks dividing every head count and the expert count of the graph."""
    counts = set()
    for op in g.ops:
        for k in ("heads", "experts"):
            if isinstance(op.attrs.get(k), int):
                counts.add(op.attrs[k])
        if op.opname in ("moe_gate_up", "moe_down"):
            counts.add(op.inputs[-1].type.shape[0])
    for r in range(ranks, 0, -1):
        if all(c % r == 0 for c in counts):
            return r
    return 1


def simulate(model_graph: Graph, ranks: int, gpu: str = "h200", batch: int = 1,
             max_len: int = 4096) -> SimResult:
    from fusec.passes.manager import Program, run_pipeline
    spec = gpu_spec(gpu)
    used = _feasible_ranks(model_graph, ranks)
    note = "" if used == ranks else (f"shard splits 96 heads and 896 experts evenly: R={ranks} is not "
                                     f"a divisor, simulated on R={used}")
    opts = Options(ranks=used, batch=batch, max_len=max_len, sms=spec.sms, gpu=gpu, verify_each_pass=False)
    prog = Program(model_graph.copy(), opts)
    run_pipeline(prog, PIPE)
    s = prog.schedule
    st = graph_stats(prog.graph, opts.dims)
    coll = sum(1 for op in prog.graph.ops if op.opname in (
        "all_reduce", "reduce_scatter", "all_gather", "all_to_all_dispatch", "all_to_all_combine"))
    return SimResult(gpu, ranks, used, batch, float(s.meta["predicted_step_us"]), st.roofline_us(spec),
                     len(s.tasks), coll, note)


def main() -> None:
    """Print the table of docs/simulation.md (full K3, batch 1 and 8, R = 8, 16, 64, 72)."""
    from fusec.models import kimi_k3
    g = kimi_k3.build_graph("full")
    print("| GPU | R asked | R used | batch | step (ms) | per-rank roofline (ms) | tok/s per user | tok/s total | collectives |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpu in ("h200", "gb300"):
        for ranks in (1, 8, 16, 64, 72):
            for batch in (1, 8):
                r = simulate(g, ranks, gpu, batch)
                print(f"| {gpu} | {ranks} | {r.used_ranks} | {batch} | {r.step_us / 1e3:.2f} | "
                      f"{r.roofline_us / 1e3:.2f} | {r.tokens_per_s_per_user:.0f} | {r.tokens_per_s:.0f} | "
                      f"{r.collectives} |", flush=True)


if __name__ == "__main__":
    main()
