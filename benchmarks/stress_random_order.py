"""Stress the memory-order verifier and the randomized executor; write the counts to docs.

    python benchmarks/stress_random_order.py [--orders 5000] [--numeric 3] [--seeds 3] [--write-docs]
                                             [--full [--full-ranks 1 2 8]]

1. K3 tiny schedules (R = 1, 2; default pipeline): `--orders` random orders each with the
   symbolic poison check, `--numeric` orders per rank count numerically against the reference
   (R = 1: run_step; R = 2: run_step_ranks from the full checkpoint, every rank compared).
2. Every mutation kind x `--seeds` seeds on the hand-written and K3 tiny schedules: planted /
   rejected by the verifier with the expected rule / caught by the executor.
3. With --full: verifier time (wall and CPU) on full K3 at each of --full-ranks (replicated
   schedules at R > 1 take the symmetric check).
With --write-docs the table replaces the block between the STRESS markers in docs/verifier.md.
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from fusec.backends.reference.executor import init_state
from fusec.testing.random_order import RandomOrderRunner
from fusec.passes.options import Options
from fusec.ir.schedule_text import parse_schedule_file
from fusec.models import kimi_k3
from fusec.testing.mutate import EXPECT, Mutation, MutationSkipped, plant
from fusec.passes.manager import PIPELINES, Program, run_pipeline
from fusec.passes.memory_order import check_schedule
from fusec.weights import random_weights

ROOT = Path(__file__).resolve().parents[1]


def k3(config: str, ranks: int, sms: int, batch: int = 2, max_len: int = 16):
    g = kimi_k3.build_graph(config)
    opts = Options(ranks=ranks, batch=batch, max_len=max_len, sms=sms, verify_each_pass=False)
    return run_pipeline(Program(g, opts), PIPELINES["default"]).schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--orders", type=int, default=5000)
    ap.add_argument("--numeric", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sms", type=int, default=8)
    ap.add_argument("--full", action="store_true", help="also time the verifier on full K3")
    ap.add_argument("--full-ranks", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args()
    lines = []
    scheds = {n: parse_schedule_file(ROOT / "tests/schedules" / f"{n}.sched")
              for n in ("ok_mini", "ok_mini_split", "ok_allreduce", "ok_mini_r2")}
    for R in (1, 2):
        s = scheds[f"k3_tiny_r{R}"] = k3("tiny", R, a.sms)
        run = RandomOrderRunner(s, numeric=False)
        t = time.perf_counter()
        bad = sum(not run.run(i).ok for i in range(a.orders))
        lines.append(f"| K3 tiny R={R}, {len(s.tasks)} tasks, symbolic | {a.orders} orders | {bad} failed | "
                     f"{time.perf_counter() - t:.0f} s |")
        print(lines[-1], flush=True)
    for R in (1, 2) if a.numeric else ():
        t = time.perf_counter()
        if R == 1:
            run = RandomOrderRunner(scheds["k3_tiny_r1"], numeric=True)
        else:
            g = kimi_k3.build_graph("tiny")
            run = RandomOrderRunner(scheds["k3_tiny_r2"], numeric=True,
                                    weights=random_weights(g, 0, kimi_k3.WEIGHT_INIT),
                                    full_state=init_state(g, {"B": 2, "L": 16}, precision="fp32"))
        res = [run.run(i) for i in range(a.numeric)]
        bad = [r.why() for r in res if not r.ok]
        ref = "run_step" if R == 1 else "run_step_ranks"
        lines.append(f"| K3 tiny R={R}, numeric vs {ref} | {a.numeric} orders | {len(bad)} failed"
                     f"{' (' + bad[0] + ')' if bad else ''} | {time.perf_counter() - t:.0f} s |")
        print(lines[-1], flush=True)
    rows = []
    tot = [0, 0, 0, 0]
    for kind in Mutation:
        c = [0, 0, 0, 0]     # planted, verifier, executor-needed, executor
        skips = set()
        for name, s in scheds.items():
            for seed in range(a.seeds):
                try:
                    bad, _ = plant(s, kind, seed)
                except MutationSkipped as e:
                    skips.add(f"{name}: {e}")
                    break
                c[0] += 1
                c[1] += EXPECT[kind].rule in check_schedule(bad).rules()
                if EXPECT[kind].changes_values:
                    c[2] += 1
                    run = RandomOrderRunner(bad, numeric=False)
                    c[3] += any(not run.run(i).ok for i in range(200))
        tot = [x + y for x, y in zip(tot, c)]
        ex = f"{c[3]} / {c[2]}" if EXPECT[kind].changes_values else "n/a (no value change)"
        rows.append(f"| {kind.value} | {EXPECT[kind].rule} | {c[0]} | {c[1]} | {ex} | {len(skips)} |")
        print(rows[-1], flush=True)
    rows.append(f"| **total** | | {tot[0]} | {tot[1]} | {tot[3]} / {tot[2]} | |")
    for R in a.full_ranks if a.full else ():
        s = k3("full", R, 132, batch=1, max_len=4096)
        t, c = time.perf_counter(), time.process_time()
        rep = check_schedule(s)
        how = "symmetric" if rep.stats.get("symmetric") else "explicit"
        lines.append(f"| verifier, full K3 R={R} ({how}), {len(s.tasks)} tasks per rank | "
                     f"{'ok' if rep.ok else rep.first_error()} | | {time.perf_counter() - t:.1f} s wall, "
                     f"{time.process_time() - c:.1f} s CPU |")
        print(lines[-1], flush=True)
    table = ("| run | orders / result | failures | time |\n|---|---|---|---|\n" + "\n".join(lines) +
             "\n\n| mutation | rule | planted | rejected by verifier | caught by executor | schedules skipped |\n"
             "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(table)
    if a.write_docs:
        doc = ROOT / "docs/verifier.md"
        text = doc.read_text()
        text = re.sub(r"(<!-- STRESS -->\n).*?(<!-- /STRESS -->)", lambda m: m.group(1) + table + m.group(2),
                      text, flags=re.S)
        doc.write_text(text)


if __name__ == "__main__":
    main()
