"""Compile-time benchmark: the whole default pipeline on full Kimi K3 at R = 1 and R = 64.

Times every pass (canonicalize .. prefetch) and the memory-order verification of the final
schedule separately, and appends (or replaces) the "Compile time" section of
docs/performance.md; other sections of that file are left as they are.
Run: python benchmarks/pipeline_speed.py [--ranks 1 64] [--no-write]
"""
from __future__ import annotations

import argparse
import platform
import re
import time
from pathlib import Path

from fusec.passes.options import Options
from fusec.models import kimi_k3
from fusec.passes.manager import PIPELINES, PassError, Program, run_pipeline

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
HEADING = "## Compile time"


def measure(ranks: int, verify: bool) -> dict:
    t0 = time.perf_counter()
    g = kimi_k3.build_graph("full")
    build = time.perf_counter() - t0
    prog = Program(g, Options.from_env(ranks=ranks, verify_each_pass=False))
    t0 = time.perf_counter()
    try:
        run_pipeline(prog, PIPELINES["default"])
    except PassError as e:
        return {"ranks": ranks, "error": str(e)}
    passes = time.perf_counter() - t0
    res = {"ranks": ranks, "build_s": build, "passes_s": passes, "per_pass": dict(prog.notes["pass_seconds"]),
           "tasks": len(prog.schedule.tasks), "events": len(prog.schedule.events),
           "step_us": float(prog.schedule.meta["predicted_step_us"])}
    if verify:
        from fusec.passes.memory_order import check_schedule
        t0 = time.perf_counter()
        rep = check_schedule(prog.schedule)
        res["verify_s"] = time.perf_counter() - t0
        res["verify_ok"] = rep.ok
    return res


def render(rows: list[dict]) -> str:
    out = [HEADING, "",
           f"Full Kimi K3 (93 layers), default pipeline, batch 1, L = 4096, on this machine "
           f"({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores); "
           "`python benchmarks/pipeline_speed.py`. Verification is the memory-order check of the final "
           "schedule (all ranks expanded), timed separately.", "",
           "| R | graph build (s) | passes (s) | tile (s) | schedule (s) | tasks (rank 0) | events | predicted step (ms) | verify (s) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['ranks']} | - | failed: {r['error']} | | | | | | |")
            continue
        v = f"{r['verify_s']:.1f} ({'ok' if r['verify_ok'] else 'FAILED'})" if "verify_s" in r else "not run"
        p = r["per_pass"]
        out.append(f"| {r['ranks']} | {r['build_s']:.2f} | {r['passes_s']:.2f} | {p.get('tile', 0):.2f} | "
                   f"{p.get('schedule', 0):.2f} | {r['tasks']} | {r['events']} | {r['step_us'] / 1e3:.2f} | {v} |")
    out.append("")
    return "\n".join(out) + "\n"


def write_section(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else "# Performance\n\n"
    pat = re.compile(r"^## Compile time\n.*?(?=^## |\Z)", re.S | re.M)
    doc = pat.sub(lambda m: text, doc) if pat.search(doc) else doc.rstrip("\n") + "\n\n" + text
    DOC.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    rows = []
    for r in a.ranks:
        rows.append(measure(r, not a.no_verify))
        print(rows[-1], flush=True)
    text = render(rows)
    print(text)
    if not a.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
