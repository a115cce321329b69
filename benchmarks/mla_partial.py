"""Check and time the MLA PARTIAL body alone at Kimi K3's shapes, for plan variants.

    python benchmarks/mla_partial.py [--batches 1,4,16] [--variants "mla_head_tiles=2;mla_head_tiles=4"]

96 heads (K3's; `--heads`), kv_lora 512, rope 64, a 4096-row latent cache, every sequence at position 4095; the
cache split into the chunks the lowering picks (min(SMs // B, rows / 32)), one task per
(chunk, batch row) on 132 CTAs, as in the megakernel. Each variant (compile-time KernelPlan
fields) is a new compile; its partial rows are compared with the registry's
mla_attention_partial (relative error < 2e-2), then timed: CUDA graph of 10 steps, median of
`--reps` replays (`--cold`: one step a replay, L2 flushed before each: the body's own benchmark
otherwise finds part of the 75 MB cache of B = 16 in L2 from the replay before, which a decode
step never does). The table printed last goes into docs/performance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import torch

from fusec.backends.cute.plan import KernelPlan, round_robin_queues
from fusec.backends.cute.runtime import Megakernel
from fusec.ir.registry import get_op
from fusec.testing import cute_workloads as wl

from _plan_args import plan_fields  # benchmarks/_plan_args.py
from _timing import graph_step_us  # benchmarks/_timing.py (this script's folder)

SMS, LORA, ROPE, LEN = 132, 512, 64, 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--variants", default="", help="';'-separated 'field=value[,field=value]' plan settings")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heads", type=int, default=96, help="query heads (K3: 96; stops 11-25 timed 64)")
    ap.add_argument("--cold", action="store_true", help="one step per replay with L2 flushed before it "
                    "(the cache from HBM, as in a decode step)")
    args = ap.parse_args()
    heads = args.heads
    variants = [""] + [v for v in args.variants.split(";") if v]
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
        chunks = min(SMS // batch, math.ceil(LEN / 32))
        q_lat, q_pe = (r(batch, heads, LORA) * 0.05).bfloat16(), (r(batch, heads, ROPE) * 0.1).bfloat16()
        cache = r(batch, LEN, LORA + ROPE).bfloat16()
        pos = torch.full((batch,), LEN - 1, device="cuda", dtype=torch.int32)
        parts = torch.empty(chunks, batch, heads, LORA + 2, device="cuda")
        out = torch.empty(batch, heads, LORA, device="cuda", dtype=torch.bfloat16)
        at = dict(heads=heads, nope=128, rope=ROPE, kv_lora=LORA, v_dim=128, scale=0.07)
        p_ref = get_op("mla_attention_partial").ref([q_lat, q_pe, cache, pos], dict(at, chunks=chunks))[0]
        part, _ = wl.mla_tasks(q_lat, q_pe, cache, pos, parts, out, 0.07, 0)
        base = KernelPlan(tasks=tuple(part), queues=round_robin_queues(len(part), SMS), num_events=1,
                          batch=batch, name=f"mla_b{batch}")
        for v in variants:
            plan = dataclasses.replace(base, **plan_fields(base, v, "mla_partial"))
            rt = Megakernel(plan)
            parts.fill_(float("nan"))
            rt.step()
            rt.check()
            err = wl.rel_err(parts, p_ref)
            us = graph_step_us(rt, args.reps, cold=args.cold)
            rows.append((batch, chunks, v or "default", us, err))
            print(f"B={batch} chunks={chunks} {v or 'default'}: {us:.1f} us, rel err {err:.2e}", flush=True)
    print("\n| B | chunks | variant | MLA partial us | rel err |\n|---|---|---|---|---|")
    for b, c, v, us, err in rows:
        print(f"| {b} | {c} | {v} | {us:.1f} | {err:.1e}{'' if err < 2e-2 else ' FAIL'} |")


if __name__ == "__main__":
    main()
