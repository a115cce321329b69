"""Where `step()`'s time over the kernel's own graph replay goes (issue 10's `step()` bar).

    python benchmarks/step_overhead.py --config tiny --batches 1,16 [--reps 50]

For each batch: the kernel's CUDA-graph replay (what speed.py calls "graph"), the public
`step()` alone (sync after each, as speed.py times it) and in a loop, the same for the path
steps took before stop 33 (inputs staged, the guard as torch ops: "staged"), all in interleaved
rounds (medians), the host time of one
`step()` call up to its return, and the CUDA kernels and copies of one `step()` from
torch.profiler (device microseconds, largest first). On a small config the kernel is short, so
what `step()` adds around it is most of what is printed; it is the same host code and about the
same tail of small kernels at any size (the logits scale with the vocabulary).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_us  # noqa: E402


def main() -> None:
    import torch

    import fusec
    import fusec.models as m
    from fusec.api import CompiledStep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--pos", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        fstep = fusec.compile(path, args.config, backend="cute", device="cuda", batch=batch, max_len=args.pos + 1)
        # The path steps took before stop 33, side by side on the same runner: inputs copied into
        # the staging buffer, the clamps and range flag as torch ops in the graph.
        staged = CompiledStep(fstep.graph, fstep.runner, batch, args.pos + 1, "cuda", deferred=True)
        staged.guarded = False
        staged._input_key = lambda t, p: None
        tok = torch.zeros(batch, dtype=torch.int32, device="cuda")
        pos = torch.full((batch,), args.pos, dtype=torch.int32, device="cuda")
        for s in (fstep, staged):
            for _ in range(3):
                s.step(tok, pos)
        torch.cuda.synchronize()
        graph = fstep.runner.kernel.capture_graph()
        loop = 20
        # the step's whole graph (guard, kernel, logits check) replayed with no host code around
        # it: step_alone - step_graph is the host's part, step_graph - graph the graph's other
        # kernels
        replay = fstep._graphs[fstep._input_key(tok, pos)]
        timers = {"graph": graph.replay, "step_graph": replay,
                  "step_alone": lambda: fstep.step(tok, pos),
                  "step_loop": lambda: [fstep.step(tok, pos) for _ in range(loop)],
                  "staged_alone": lambda: staged.step(tok, pos),
                  "staged_loop": lambda: [staged.step(tok, pos) for _ in range(loop)]}
        runs = {k: [] for k in timers}
        for _ in range(args.rounds):             # interleaved rounds, medians
            for k, f in timers.items():
                runs[k].append(median_us(f, args.reps) / (loop if k.endswith("_loop") else 1))
        t = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
        host = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fstep.step(tok, pos)
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        t["step_host"] = sorted(host)[len(host) // 2]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fstep.step(tok, pos)
            torch.cuda.synchronize()
        fstep.check()
        staged.check()
        ev = [(e.key, e.device_time_total / 5, e.count // 5) for e in prof.key_averages()
              if e.device_time_total > 0]
        ev.sort(key=lambda x: -x[1])
        print(f"\n{args.config} B={batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()), flush=True)
        print("| device op in one step() | us | calls |\n|---|---|---|")
        for k, us, n in ev[:25]:
            print(f"| {k[:90]} | {us:.1f} | {n} |")
        # the host side: CPU time of one step() by op (self time, so nested ops are not counted twice)
        cpu = [(e.key, e.self_cpu_time_total / 5, e.count // 5) for e in prof.key_averages()
               if e.self_cpu_time_total > 0]
        cpu.sort(key=lambda x: -x[1])
        print("| host op in one step() (self) | us | calls |\n|---|---|---|")
        for k, us, n in cpu[:20]:
            print(f"| {k[:90]} | {us:.1f} | {n} |")
        rows.append((batch, t))
    print("\n| B | graph us | step's graph | step() alone | in a loop | staged alone | staged in a loop | "
          "step() host us | alone over graph | loop over graph |\n|---|---|---|---|---|---|---|---|---|---|")
    for batch, t in rows:
        g = t["graph"]
        print(f"| {batch} | {g:.1f} | {t['step_graph']:.1f} | {t['step_alone']:.1f} | {t['step_loop']:.1f} | "
              f"{t['staged_alone']:.1f} | {t['staged_loop']:.1f} | {t['step_host']:.1f} | "
              f"{100 * (t['step_alone'] / g - 1):.1f}% (staged {100 * (t['staged_alone'] / g - 1):.1f}%) | "
              f"{100 * (t['step_loop'] / g - 1):.1f}% (staged {100 * (t['staged_loop'] / g - 1):.1f}%) |")


if __name__ == "__main__":
    main()
