"""One config's whole megakernel step, a few times, for Nsight Compute (what the step's warps stall on).

    ncu --clock-control none --kernel-name regex:megakernel --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/ncu_step.py --config slice4-e128 --batch 1 [--plan weight_evict_first=]

Stage `ncu-step` of h200_session.sh runs it so (NCU_CONFIG, NCU_BATCH, NCU_PLAN). The question it
was written for (stop 26): the short rows of a B = 1 step (an EW row of 2 K elements 7 us, an MLA
partial task of one 32-row stage 35 us) run much longer than their work; whether their warps wait
for instructions (the kernel's 339 KB of code fetched from an L2 that the weight stream keeps
flushing) shows as "Stall No Instruction" in WarpStateStats. Averages over the whole step, so
the streaming bodies' long-scoreboard stalls dominate; read the no-instruction share against
that. `--plan` builds a variant of the default plan (benchmarks/_plan_args.py), e.g. to compare
an evict_first build with one without.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

import fusec
from _plan_args import plan_config_args, plan_fields  # benchmarks/_plan_args.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plan_config_args(ap)
    ap.add_argument("--plan", default="", help="'field=value[,field=value]' settings of the profiled build")
    ap.add_argument("--steps", type=int, default=4, help="kernel launches (profile one with --launch-skip)")
    args = ap.parse_args()
    from fusec.backends.cute.runtime import Megakernel
    import fusec.models as m

    model = os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")
    run = fusec.compile(model, args.config, backend="cute", batch=args.batch, max_len=args.max_len,
                        device="cuda").runner
    kernel = None
    if args.plan:
        kernel = Megakernel(dataclasses.replace(run.plan, **plan_fields(run.plan, args.plan, "ncu_step")))
    tok = torch.zeros(args.batch, dtype=torch.int32, device="cuda")
    pos = torch.full((args.batch,), args.max_len - 1, dtype=torch.int32, device="cuda")
    for _ in range(args.steps):
        run.run(tok, pos, kernel=kernel)
    torch.cuda.synchronize()
    run.check()
    print(f"{args.config} B={args.batch} plan {args.plan or 'default'}: {args.steps} steps run")


if __name__ == "__main__":
    main()
