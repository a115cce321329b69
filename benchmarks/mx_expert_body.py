"""What bounds the EXPERT_MXFP4 tensor-core body: the body alone at K3's latent-MoE shapes, the
default build against the diagnostic probes of `KernelPlan.expert_mx_probe` (which compute
WRONG results: timing only; the body's correctness is tests/gpu/test_cute_bodies.py's).

    python benchmarks/mx_expert_body.py [--batches 16,1] [--experts 256] [--tasks N]
        [--probes no_decode,no_mma,loads_only] [--variants "field=value[,...] ..."] [--no-bf16]

Per batch and phase (GLU: gate + up, K 3584, 3072 rows per expert; DOWN: K 3072, 3584 rows), a
megakernel of that phase's row tasks over every (batch row, slot) pair, as the K3 kernel cuts
them (`--tasks` row tasks per phase, default one per SM as the K3 plans cut them: a task more
than the SMs would run in a second wave and double the phase), with `--experts` random MXFP4
experts repacked as the binder does (weight_tiles.mx_tile) and top-16 distinct random experts per
batch row. Besides the probes, `--variants` builds (space-separated `field=value[,...]` sets of
KernelPlan fields, like plan_variants.py) and, unless `--no-bf16`, the EXPERT_BF16 body on bf16
tiles (expert_tiles) of the same shapes: the yardstick of what the same units stream without
MXFP4 (its bytes are 3.8x as many). Each build is timed as CUDA-graph replays of
10 steps (benchmarks/_timing.graph_step_us), interleaved over `--rounds`, median round. Bytes:
the distinct routed experts' nibbles and scales (the activations are L2-resident). The probes:
"no_decode" feeds the raw words to the MMAs, "no_mma" folds the decoded words with one add
instead of the MMAs, "loads_only" does neither, so the differences say what the decode, the
MMAs and the loads cost. The table printed last goes into docs/performance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _plan_args import plan_fields  # noqa: E402  (benchmarks/_plan_args.py)
from _timing import graph_step_us  # noqa: E402

HID, LATENT, INTER, TOPK = 7168, 3584, 3072, 16
HBM_TBPS = 4.16


def main() -> None:
    import torch

    from fusec.backends.cute.plan import KernelPlan, round_robin_queues
    from fusec.backends.cute.runtime import Megakernel
    from fusec.backends.cute.weight_tiles import mx_tile, tile
    from fusec.ir.quant import MXFP4Tensor
    from fusec.testing import cute_workloads as wl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,1")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tasks", type=int, default=0, help="row tasks per phase (default: the SM count)")
    ap.add_argument("--probes", default="no_decode,no_mma,loads_only")
    ap.add_argument("--variants", default="")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e = args.experts
    ntasks = args.tasks or torch.cuda.get_device_properties(0).multi_processor_count
    probes = [p for p in args.probes.split(",") if p]

    def tiled(n, k):
        packed, scale = wl.random_mxfp4(e * n, k, "cuda", gen)
        scale.clamp_(max=128)                      # the tensor-core body's domain (binder check)
        p, s = mx_tile(packed, scale)
        return MXFP4Tensor(p.view(e, n, -1), s.view(e, n, -1))

    def bf16_tiled(n, k):
        w = torch.randn(e * n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        return tile(w).view(e, n, k)

    w1, w3, w2 = tiled(INTER, LATENT), tiled(INTER, LATENT), tiled(LATENT, INTER)
    b1, b3, b2 = (None, None, None) if args.no_bf16 else (
        bf16_tiled(INTER, LATENT), bf16_tiled(INTER, LATENT), bf16_tiled(LATENT, INTER))
    per_row = {"glu": 2 * (LATENT // 2 + LATENT // 32) * INTER, "down": (INTER // 2 + INTER // 32) * LATENT}
    bf16_bytes = {"glu": 2 * LATENT * 2 * INTER, "down": INTER * 2 * LATENT}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:TOPK] for _ in range(batch)]).int()
        distinct = int(torch.unique(ids).numel())
        x = torch.randn(batch, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
        h = torch.randn(batch, TOPK, INTER, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch.empty(batch, TOPK, LATENT, device="cuda")
        hout = torch.empty(batch, TOPK, INTER, device="cuda", dtype=torch.bfloat16)
        for phase in ("glu", "down"):
            def tasks_of(a, b, c):
                return tuple(wl.expert_glu_tasks(x, ids, a, b, hout, ntasks) if phase == "glu"
                             else wl.expert_down_tasks(h, ids, c, y, ntasks))

            base = KernelPlan(tasks=tasks_of(w1, w3, w2), queues=round_robin_queues(ntasks), num_events=1,
                              batch=batch, expert_mx_mma=True, unroll=8 if batch > 8 else 4,
                              name=f"mx_{phase}_b{batch}")
            builds = {"default": base}
            builds.update({p: dataclasses.replace(base, expert_mx_probe=p) for p in probes})
            builds.update({v: dataclasses.replace(base, **plan_fields(base, v, "mx_expert_body.py"))
                           for v in args.variants.split()})
            if b1 is not None:
                builds["bf16"] = dataclasses.replace(base, tasks=tasks_of(b1, b3, b2), expert_mx_mma=False,
                                                     expert_tiles=True)
            kernels = {k: Megakernel(dataclasses.replace(p, name=f"{base.name}_{i}"))
                       for i, (k, p) in enumerate(builds.items())}
            times = {k: [] for k in kernels}
            for _ in range(args.rounds):
                for k, rt in kernels.items():
                    times[k].append(graph_step_us(rt, args.reps))
            nbytes = distinct * per_row[phase]
            for k, ts in times.items():
                us = statistics.median(ts)
                nb = distinct * bf16_bytes[phase] if k == "bf16" else nbytes
                rows.append((batch, phase, k, us, nb / (us * 1e-6) / 1e12))
            print(f"B={batch} {phase}: {distinct} distinct experts, {nbytes / 1e9:.2f} GB; "
                  + ", ".join(f"{k} {statistics.median(t):.0f} us" for k, t in times.items()), flush=True)
    print(f"\n| B | phase | build | us | TB/s | % of {HBM_TBPS} TB/s |\n|---|---|---|---|---|---|")
    for batch, phase, k, us, tbps in rows:
        print(f"| {batch} | {phase} | {k} | {us:.0f} | {tbps:.2f} | {tbps / HBM_TBPS:.0%} |")


if __name__ == "__main__":
    main()
