"""Registers and spills per task body of a K3 megakernel, from ptxas on the CPU build.

    CUTE_DSL_ARCH=sm_90a python benchmarks/ptxas_bodies.py [--config slice4-e128] [--batch 16]
        [--variant field=value,...] [--only EXPERT_BF16,GEMV_BF16]

The megakernel is one function, so ptxas reports one register count and one spill figure for
all of its bodies together. This script compiles the whole kernel and then, for each opcode
the table uses, a kernel holding only that opcode's rows (the same plan fields, so the same
compile-time constants), and runs `ptxas -v` on each PTX: which body needs the registers, and
which one spills at the 512-thread cap of 128; and each kernel's machine code in KB (a body
alone: its kernel's code less the few KB of the dispatch loop; stop 26 found the EW body ~180 KB
of the K3 kernel's ~340, code fetched cold whenever a CTA runs a body it has not run lately). The plan is the one CuteRunner builds (the
default weight tiles, weight_tiles.tile_options) with --variant's fields. Needs ptxas (CUDA toolkit) on PATH or in
/usr/local/cuda*/bin; no GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fusec.backends.cute.codegen import compile_plan  # noqa: E402
from fusec.backends.cute.plan import Opcode  # noqa: E402
from fusec.backends.cute.ptxas_resources import find_ptxas, ptxas_code_bytes, ptxas_resources  # noqa: E402
from fusec.backends.cute.weight_tiles import tile_options  # noqa: E402
from fusec.compiler import lower_for_cute  # noqa: E402
from fusec.models import kimi_k3  # noqa: E402

from _plan_args import plan_config_args, plan_fields  # noqa: E402  (benchmarks/_plan_args.py)


def resources(plan) -> str:
    """ptxas -v of the plan's kernel, compiled on the CPU, and its machine code's size."""
    with tempfile.TemporaryDirectory() as d:
        _, _, dump = compile_plan(plan, d, keep_ptx=True)
        ptx = sorted(glob.glob(str(dump / "*.ptx")))[0]
        return f"{ptxas_resources(ptx)}, code {ptxas_code_bytes(ptx) / 1024:.0f} KB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plan_config_args(ap)
    ap.add_argument("--variant", default="", help="KernelPlan fields, 'field=value,...'")
    ap.add_argument("--only", default="", help="comma list of opcodes (default: every one the table uses)")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole kernel")
    args = ap.parse_args()
    if find_ptxas() is None:
        sys.exit("ptxas_bodies: error: no ptxas on PATH or in /usr/local/cuda*/bin")
    low = lower_for_cute(kimi_k3.build_graph(args.config), args.batch, args.max_len)[1]
    plan = low.plan(base=0, **tile_options(low, None))       # the options CuteRunner builds with
    plan = dataclasses.replace(plan, **plan_fields(plan, args.variant, "ptxas_bodies"))
    wanted = [Opcode[o] for o in args.only.split(",") if o] or [o for o in plan.opcodes if o != Opcode.NOP]
    rows = []
    if not args.no_whole:
        t0 = time.perf_counter()
        rows.append(("whole kernel", resources(plan), time.perf_counter() - t0))
        print(rows[-1], flush=True)
    for op in wanted:
        idx = [i for i, t in enumerate(plan.tasks) if t.opcode == op]
        if not idx:
            continue
        sub = dataclasses.replace(plan, tasks=tuple(plan.tasks[i] for i in idx), queues=(tuple(range(len(idx))),),
                                  extra_opcodes=())
        t0 = time.perf_counter()
        rows.append((op.name, resources(sub), time.perf_counter() - t0))
        print(rows[-1], flush=True)
    print(f"\n{args.config} B={args.batch} {args.variant or 'default plan'}, {plan.threads} threads\n")
    print("| kernel | ptxas -v (sm_90a) | compile s |\n|---|---|---|")
    for name, stats, secs in rows:
        print(f"| {name} | {stats} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
