"""Multi-GPU decode-step simulation: compile the graph for R ranks and read the predicted step.

`simulate(model_graph, ranks, gpu="h200"|"gb300", batch)` runs canonicalize, fuse, shard, tile,
overlap and schedule with the GPU's parameters (`fusec.passes.target.GPUS`: SMs, HBM bandwidth,
NVLink / network bandwidth and latency) and returns the list-scheduled step time of one rank
(all ranks run the same replicated schedule) and tokens/s per user. Nothing is run on a GPU.

Every R is compiled as asked: the shard pass plans hybrid parallelism (passes/shard.py): the
mixers run tp-way tensor parallel in R / tp replica groups (tp = the largest divisor of R
dividing the 96 heads: 8 -> 8, 16 -> 16, 64 -> 32, 72 -> 24) and the experts ep-way expert
parallel (ep = gcd(R, 896): 64 -> 64, 72 -> 8, replicated R / ep times). `tp` and `ep` are
reported. Inputs and parameters are written down in docs/simulation.md.

Exposed communication (`exposed_comm_us`): the time in the predicted step during which some
collective task (a push or a local reduce/gather) runs and no other task does, i.e. what the
collectives add that no compute hides. `split` picks how `split_reduce` runs, so the three can
be compared: "gated" (its default: an all-reduce is cut only where its cost gate predicts a gain),
"forced" (every eligible all-reduce cut) or "off" (the pass left out, every all-reduce whole).
"""
from __future__ import annotations

from dataclasses import dataclass

from fusec.passes.options import Options
from fusec.passes.target import gpu_spec
from fusec.stats import graph_stats
from fusec.ir.graph import Graph
from fusec.ir.registry import Trait

PIPE = ["canonicalize", "fuse", "shard", "tile", "split_reduce", "overlap", "schedule"]


@dataclass
class SimResult:
    gpu: str
    ranks: int                # GPUs (every one is used)
    tp: int                   # tensor-parallel degree of the mixers (R / tp replica groups)
    ep: int                   # expert-parallel degree (experts replicated R / ep times)
    batch: int
    step_us: float            # predicted decode step (one token per sequence)
    roofline_us: float        # bytes one rank must move / HBM bandwidth
    tasks: int
    collectives: int
    note: str = ""
    exposed_comm_us: float = 0.0  # collective tasks running while no other task runs
    split: str = "gated"          # split_reduce: gated, forced or off

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1e6 / self.step_us

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e6 / self.step_us


def simulate(model_graph: Graph, ranks: int, gpu: str = "h200", batch: int = 1,
             max_len: int = 4096, tp: int | None = None, ep: int | None = None,
             split: str | bool = "gated") -> SimResult:
    """`tp` / `ep`: smaller parallel degrees than the shard pass plans (None: the plan's);
    `split`: how `split_reduce` runs (module docstring; True is "gated", False "off")."""
    split = {True: "gated", False: "off"}.get(split, split)
    if split not in ("gated", "forced", "off"):
        raise ValueError(f"split must be gated, forced or off, not {split!r}")
    from fusec.passes.manager import Program, run_pipeline
    spec = gpu_spec(gpu)
    opts = Options(ranks=ranks, batch=batch, max_len=max_len, gpu=gpu, verify_each_pass=False,   # SMs: the gpu's
                   split_reduce="forced" if split == "forced" else "gated")
    prog = Program(model_graph.copy(), opts)
    prog.notes["shard_degrees"] = {k: v for k, v in (("tp", tp), ("ep", ep)) if v is not None}
    run_pipeline(prog, PIPE if split != "off" else [p for p in PIPE if p != "split_reduce"])
    s = prog.schedule
    st = graph_stats(prog.graph, opts.dims)
    coll = sum(1 for op in prog.graph.ops if Trait.collective in op.opdef.traits)
    plan = prog.notes.get("shard", {"tp": 1, "ep": 1})
    note = "" if plan["tp"] == ranks else f"{ranks // plan['tp']} replica groups of tp = {plan['tp']}"
    return SimResult(gpu, ranks, plan["tp"], plan["ep"], batch, float(s.meta["predicted_step_us"]),
                     st.roofline_us(spec), len(s.tasks), coll, note, exposed_comm_us(s), split)


def exposed_comm_us(s) -> float:
    """Time of the predicted step (`fusec.trace.task_times`: the list scheduler's replay) during
    which a collective family's task runs and no other family's task does."""
    from fusec.trace import task_times
    comm = {tid for f in s.families if f.collective for tid in f.task_ids}
    ev = []
    for tid, (a, b) in task_times(s).items():
        if b > a:
            c = tid in comm
            ev += [(a, 1, c), (b, -1, c)]
    ev.sort(key=lambda e: (e[0], e[1]))
    out, n_comm, n_other, last = 0.0, 0, 0, 0.0
    for t, d, c in ev:
        if n_comm and not n_other:
            out += t - last
        last = t
        if c:
            n_comm += d
        else:
            n_other += d
    return out


def format_table(rows: list[SimResult]) -> str:
    """The markdown table of docs/simulation.md."""
    out = ["| GPU | R | tp | ep | batch | split | step (ms) | exposed comm (ms) | per-rank roofline (ms) | "
           "tok/s per user | tok/s total | collectives |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.gpu} | {r.ranks} | {r.tp} | {r.ep} | {r.batch} | {r.split} | "
                   f"{r.step_us / 1e3:.2f} | {r.exposed_comm_us / 1e3:.3f} | "
                   f"{r.roofline_us / 1e3:.2f} | {r.tokens_per_s_per_user:.0f} | {r.tokens_per_s:.0f} | "
                   f"{r.collectives} |")
    return "\n".join(out)


def main() -> None:
    """Print the table of docs/simulation.md (full K3, batch 1 and 8, R = 1, 8, 16, 64, 72)."""
    from fusec.models import kimi_k3
    g = kimi_k3.build_graph("full")
    for gpu in ("h200", "gb300"):
        rows = [simulate(g, ranks, gpu, batch) for ranks in (1, 8, 16, 64, 72) for batch in (1, 8)]
        print(format_table(rows), flush=True)


if __name__ == "__main__":
    main()
