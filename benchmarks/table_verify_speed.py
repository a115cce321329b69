"""Time the CuTe table verifier (backends/cute/table_verify.py) alone on big lowerings (CPU; not a test).

    python benchmarks/table_verify_speed.py [--cases slice4-e128:16,slice4:4,slice4-e128:16:56]
                                            [--max-len 4096] [--reps 3] [--profile 25]

Each case CONFIG:BATCH[:PARTS] lowers a K3 config at a batch through the default pipeline
(`lower_for_cute`); with PARTS, the schedule's embedding task is then cut into PARTS column
tasks (`column_split`: what a columnwise tile pass does, each task loading the whole vocabulary
at its columns) and lowered again. It builds the kernel plan with the verifier switched off,
times `verify_table` on its words (median of --reps, wall clock) and asserts the clean table is
accepted. --profile N prints the N most expensive functions (cProfile, cumulative) of one
verify call per case. The table at the end is the verifier's time per case; the lowering's own
time is printed alongside for scale.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusec.backends.cute import lower as cute_lower          # noqa: E402
from fusec.backends.cute.table_verify import verify_table    # noqa: E402
from fusec.compiler import lower_for_cute                    # noqa: E402
from fusec.ir.schedule import InstrKind                      # noqa: E402
from fusec.models import kimi_k3                             # noqa: E402


def column_split(s, task, parts):
    """Schedule `s` with `task` (an embedding gather) cut into `parts` column tasks, as a
    columnwise tile pass would: each loads the whole vocabulary at its column slice (the
    conservative box: the rows the ids pick are known only at run time) and stores its columns
    of the output; the slices follow the task in its queue and signal its event, whose waiters
    wait for all of them. Its columns must split evenly."""
    (b0, b1), (c0, c1) = task.tile
    width, rest = divmod(c1 - c0, parts)
    if rest:
        raise ValueError(f"{c1 - c0} columns do not split into {parts} equal parts")
    ev = next(i.event for i in task.instrs if i.kind is InstrKind.SIGNAL)

    def sliced(tid, lo, hi):
        instrs = [dataclasses.replace(i, region=dataclasses.replace(i.region, box=i.region.box[:-1] + ((lo, hi),)))
                  if i.kind in (InstrKind.LOAD, InstrKind.STORE) and len(i.region.box) == 2 else i
                  for i in task.instrs]
        return dataclasses.replace(task, id=tid, tile=((b0, b1), (lo, hi)), instrs=instrs)

    ids = [task.id] + list(range(len(s.tasks), len(s.tasks) + parts - 1))
    tasks = list(s.tasks) + [None] * (parts - 1)
    for p, tid in enumerate(ids):
        tasks[tid] = sliced(tid, c0 + p * width, c0 + (p + 1) * width)
    per_step = next(e.per_step for e in s.events if e.id == ev)
    events = [dataclasses.replace(e, per_step=e.per_step * parts) if e.id == ev else e for e in s.events]
    tasks = [dataclasses.replace(t, instrs=[dataclasses.replace(i, threshold=i.threshold // per_step * per_step * parts)
                                            if i.kind is InstrKind.WAIT and i.event == ev else i for i in t.instrs])
             for t in tasks]
    queues = {k: [x for tid in q for x in (ids if tid == task.id else [tid])] for k, q in s.queues.items()}
    return dataclasses.replace(s, tasks=tasks, events=events, queues=queues)


def unchecked_plan(low):
    """`low.plan(base=0)` without its table check (the check is what this script times)."""
    saved = cute_lower.check_plan
    cute_lower.check_plan = lambda *a, **k: None
    try:
        return low.plan(base=0)
    finally:
        cute_lower.check_plan = saved


def run_case(config: str, batch: int, parts: int, max_len: int, reps: int, profile: int) -> dict:
    t0 = time.perf_counter()
    low = lower_for_cute(kimi_k3.build_graph(config), batch, max_len)[1]
    if parts:
        emb = next(t for t in low.schedule.tasks if t.body_kind == "embedding")
        low = cute_lower.lower_schedule(column_split(low.schedule, emb, parts))
    t_lower = time.perf_counter() - t0
    plan = unchecked_plan(low)
    words, bounds = plan.table_words()

    def verify():
        return verify_table(low.schedule, low.memory, words, bounds, plan.num_events, plan.batch, low.consts, 0)

    if profile:
        pr = cProfile.Profile()
        pr.enable()
        verify()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(profile)
    ts, errs = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        errs = verify()
        ts.append(time.perf_counter() - t0)
    assert errs == [], errs[:3]
    return {"case": f"{config} B={batch}" + (f", embedding in {parts} column tasks" if parts else ""), "rows": len(words), "tasks": len(low.schedule.tasks),
            "lower_s": t_lower, "verify_s": sorted(ts)[len(ts) // 2]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="slice4-e128:16,slice4:4,slice4-e128:16:56",
                    help="comma list of CONFIG:BATCH[:PARTS] (PARTS: embedding column tasks)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest functions of one call")
    args = ap.parse_args(argv)
    res = []
    for case in args.cases.split(","):
        config, batch, *parts = case.split(":")
        r = run_case(config, int(batch), int(parts[0]) if parts else 0, args.max_len, args.reps, args.profile)
        print(f"{r['case']}: {r['tasks']} tasks, {r['rows']} rows, lowering {r['lower_s']:.1f} s, "
              f"verify {r['verify_s']:.2f} s", flush=True)
        res.append(r)
    print(f"\n| case (max_len {args.max_len}) | tasks | rows | verify_table (median of {args.reps}) |\n|---|---|---|---|")
    for r in res:
        print(f"| {r['case']} | {r['tasks']} | {r['rows']} | {r['verify_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
