"""Check and time the Kimi K3 task bodies of the CuTe megakernel against the fusec op registry.

    python benchmarks/cute_bodies.py [--quick] [--json OUT.json]

For batch 1 and 4: one megakernel holding every body (EXPERT_BF16, EXPERT_MXFP4, EW with each
sub-opcode, ROUTER) runs one step over fresh random data whose outputs were poisoned with NaN;
each output is compared with `fusec.ir.registry.get_op(name).ref(args, attrs)` (the oracle):
relative error ||out - ref|| / ||ref|| < 2e-2, router ids exactly equal. Then each body's tasks
alone are timed (same compiled kernel, new table; median of launches, CUDA events).
Last, GEMV_MXFP4 bandwidth at an expert-sized shape (16 experts' gate+up rows, 3072 x 7168 each)
with the f16 decode and the older nibble-LUT decode. The table printed last goes into
docs/performance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from fusec.testing import cute_workloads as wl
from fusec.backends.cute.plan import EwOp, KernelPlan, Opcode, round_robin_queues
from fusec.backends.cute.runtime import Megakernel
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.registry import get_op

from _timing import graph_step_us  # benchmarks/_timing.py (this script's folder)

TOL = 2e-2
BF, F32 = torch.bfloat16, torch.float32
ALL_OPS = tuple(Opcode)
table: list[tuple] = []


def ref(name, args, **attrs):
    return get_op(name).ref(list(args), attrs)


def timed(rt: Megakernel, tasks, reps: int) -> float:
    """Median microseconds per step running only `tasks` (table swap, no recompile): CUDA graph
    of 10 steps, replayed `reps` times, so host launch overhead is not counted."""
    rt.set_tasks(dataclasses.replace(rt.plan, tasks=tuple(tasks),
                                     queues=round_robin_queues(len(tasks), rt.plan.num_ctas)))
    return graph_step_us(rt, reps)


def bodies(batch: int, gen: torch.Generator, quick: bool, reps: int) -> None:
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    hid, inter, topk = (7168, 3072, 16) if not quick else (1024, 512, 8)
    n_exp = 32 if not quick else 16
    heads, hd = 96, 128
    kda_w = heads * hd
    checks = []  # (label, body, out tensor getter, ref tensor getter, kind)
    tasks: dict[str, list] = {}
    # -- router: sigmoid, top-16 of 896 on score + bias, renormalised
    logits, bias = r(batch, 896), (0.1 * r(896)).float()
    rw, rid = torch.empty(batch, topk, device=dev), torch.empty(batch, topk, device=dev, dtype=torch.int32)
    tasks["ROUTER"] = wl.router_tasks(logits, bias, rw, rid, 2.5, 0)
    # -- experts: ids distinct per token, routing weights fp32
    ids = torch.stack([torch.randperm(n_exp, device=dev, generator=gen)[:topk] for _ in range(batch)]).int()
    x = r(batch, hid).to(BF)
    w1, w3 = (r(n_exp, inter, hid) * 0.03).to(BF), (r(n_exp, inter, hid) * 0.03).to(BF)
    w2 = (r(n_exp, hid, inter) * 0.03).to(BF)
    q1, q3, q2 = (MXFP4Tensor(*wl.random_mxfp4(n_exp * s[0], s[1], dev, gen)) for s in
                  ((inter, hid), (inter, hid), (hid, inter)))
    q1, q3 = (MXFP4Tensor(q.packed.view(n_exp, inter, -1), q.scale.view(n_exp, inter, -1)) for q in (q1, q3))
    q2 = MXFP4Tensor(q2.packed.view(n_exp, hid, -1), q2.scale.view(n_exp, hid, -1))
    hin = (r(batch, topk, inter) * 0.5).to(BF)  # down input (independent of the GLU output here)
    outs = {}
    for fmt, (a1, a3, a2) in (("BF16", (w1, w3, w2)), ("MXFP4", (q1, q3, q2))):
        h = torch.empty(batch, topk, inter, device=dev, dtype=BF)
        y = torch.empty(batch, topk, hid, device=dev)
        outs[fmt] = (h, y)
        tasks[f"EXPERT_{fmt} glu"] = wl.expert_glu_tasks(x, ids, a1, a3, h, 132, 100)
        tasks[f"EXPERT_{fmt} down"] = wl.expert_down_tasks(hin, ids, a2, y, 132, 200)
        checks.append((f"EXPERT_{fmt} glu", h, lambda a1=a1, a3=a3: ref("moe_gate_up", (x, ids, a1, a3), ep_ranks=1)[0]))
        checks.append((f"EXPERT_{fmt} down", y, lambda a2=a2: ref("moe_down", (hin, ids, a2), ep_ranks=1)[0]))
    # -- EW sub-opcodes, K3 widths
    ea, eb = r(batch, hid).to(BF), r(batch, hid).to(BF)
    ew = []
    for sub, name in ((EwOp.ADD, "add"), (EwOp.SIGMOID_MUL, "sigmoid_mul"), (EwOp.SITU_GLU, "situ_glu"),
                      (EwOp.SILU_MUL, "silu_mul"), (EwOp.SIGMOID, "sigmoid")):
        o = torch.empty(batch, hid, device=dev, dtype=BF)
        args = (ea,) if sub == EwOp.SIGMOID else (ea, eb)
        ew.append((f"EW {name}", o, [wl.ew_task(sub, ea, o, 300 + sub, b=None if sub == EwOp.SIGMOID else eb)],
                   lambda name=name, args=args: ref(name, args, out_dtype="")[0]))
    fa, a_log, dt_bias = r(batch, kda_w).to(BF), (0.5 * r(128)).float(), (0.5 * r(kda_w)).float()
    g = torch.empty(batch, kda_w, device=dev)
    ew.append(("EW kda_gate", g, [wl.ew_task(EwOp.KDA_GATE, fa, g, 310, b=dt_bias, c=a_log, head_dim=hd)],
               lambda: ref("kda_gate", (fa, a_log, dt_bias), heads=heads, head_dim=hd, a_log_broadcast="head")[0]))
    cx, cst, cw = r(batch, kda_w).to(BF), r(batch, kda_w, 3).to(BF), (0.5 * r(kda_w, 1, 4)).float()
    cst0 = cst.clone()
    cy = torch.empty(batch, kda_w, device=dev, dtype=BF)
    ew.append(("EW conv_update", cy, [wl.ew_task(EwOp.CONV, cx, cy, 311, b=cst, c=cw)],
               lambda: ref("conv_update", (cx, cst0, cw))[0]))
    ly = torch.empty(batch, kda_w, device=dev, dtype=BF)
    ew.append(("EW l2_norm", ly, [wl.ew_task(EwOp.L2_NORM, cx, ly, 312, head_dim=hd, scale=hd ** -0.5, eps=1e-6)],
               lambda: ref("l2_norm", (cx,), head_dim=hd, scale=hd ** -0.5, eps=1e-6)[0]))
    go, gg, gw = r(batch, kda_w).float(), r(batch, kda_w).to(BF), (1 + 0.1 * r(hd)).to(BF)
    gy = torch.empty(batch, kda_w, device=dev, dtype=BF)
    ew.append(("EW gated_rms_norm", gy, [wl.ew_task(EwOp.GATED_RMS, go, gy, 313, b=gg, c=gw, head_dim=hd, eps=1e-5)],
               lambda: ref("gated_rms_norm", (go, gg, gw), head_dim=hd, eps=1e-5)[0]))
    # cache_append (EW APPEND): MLA latent row [B, 576] into cache [B, L, 576] at pos[b]
    cache = r(batch, 64, 576).to(BF)
    cache0, crow = cache.clone(), r(batch, 576).to(BF)
    pos = torch.randint(0, 64, (batch,), device=dev, generator=gen, dtype=torch.int32)
    ew.append(("EW cache_append", cache, [wl.ew_task(EwOp.APPEND, crow, cache, 314, b=cache, c=pos)],
               lambda: ref("cache_append", (cache0, crow, pos))[0]))
    for label, o, ts, fn in ew:
        tasks[label] = ts
        checks.append((label, o, fn))
    # KDA recurrent step: 96 heads of 128, fp32 state updated in place; one task per head
    kq, kk = (torch.nn.functional.normalize(r(batch, heads, hd), dim=-1).flatten(1).to(BF) for _ in range(2))
    kv, kg = r(batch, kda_w).to(BF), -torch.rand(batch, kda_w, device=dev, generator=gen)
    kb = torch.rand(batch, heads, device=dev, generator=gen).to(BF)
    kst = (0.1 * r(batch, heads, hd, hd)).contiguous()
    kst0, ko = kst.clone(), torch.empty(batch, kda_w, device=dev)
    tasks["KDA"] = wl.kda_tasks(kq, kk, kv, kg, kb, kst, ko, 1, 500)
    kda_at = dict(heads=heads, head_dim=hd)
    checks.append(("KDA o", ko, lambda: ref("kda_recurrent", (kq, kk, kv, kg, kb, kst0), **kda_at)[0]))
    # AttnRes mix over 9 sources + the following RMSNorm
    srcs = r(9, batch, hid).to(BF)
    nw, pw, gam = (1 + 0.1 * r(hid)).to(BF), (0.05 * r(1, hid)).to(BF), (1 + 0.1 * r(hid)).to(BF)
    ah, ay = torch.empty(batch, hid, device=dev, dtype=BF), torch.empty(batch, hid, device=dev, dtype=BF)
    ptrs = torch.zeros(len(srcs), dtype=torch.int64, device=dev)   # kept alive with the plan
    tasks["ATTN_RES+rms_norm"] = wl.attn_res_tasks(srcs, nw, pw, gam, ah, ay, 1e-5, 1e-5, 600, ptrs=ptrs)
    ah_ref = lambda: ref("attn_res", (nw, pw, *srcs), eps=1e-5)[0]  # noqa: E731
    checks.append(("ATTN_RES h", ah, ah_ref))
    checks.append(("ATTN_RES+rms_norm", ay, lambda: ref("rms_norm", (ah_ref().to(BF), gam), eps=1e-5,
                                                        out_dtype="")[0]))
    all_tasks = [t for ts in tasks.values() for t in ts]
    plan = KernelPlan(tasks=tuple(all_tasks), queues=round_robin_queues(len(all_tasks)), num_events=1,
                      batch=batch, threads=1024, extra_opcodes=ALL_OPS, name=f"bodies_b{batch}")
    t0 = time.time()
    rt = Megakernel(plan)
    print(f"batch {batch}: compile {time.time() - t0:.1f} s ({len(all_tasks)} tasks)", flush=True)
    for t in [rw, rid] + [o for label, o, _ in checks if label != "EW cache_append"]:
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
    rt.step()
    torch.cuda.synchronize()
    rt.check()
    rw_ref, rid_ref = ref("router", (logits, bias), topk=topk, scale=2.5)
    ok = bool((rid == rid_ref).all())
    t_us = timed(rt, tasks["ROUTER"], reps)
    table.append(("ROUTER", batch, "ids exact" if ok else "IDS DIFFER", wl.rel_err(rw, rw_ref), t_us))
    conv_state_err = wl.rel_err(cst, ref("conv_update", (cx, cst0, cw))[1])
    kda_state_err = wl.rel_err(kst, ref("kda_recurrent", (kq, kk, kv, kg, kb, kst0), **kda_at)[1])
    for label, o, fn in checks:
        e = wl.rel_err(o, fn())
        note = ""
        if label == "EW conv_update":
            e = max(e, conv_state_err)
        if label == "EW cache_append":  # a copy: must be exact, the whole cache compared
            e, note = (0.0, "exact") if torch.equal(o, fn()) else (float("inf"), "DIFFERS")
        if label == "KDA o":
            note = f"state {kda_state_err:.1e}"
            e = max(e, kda_state_err)
        key = {"KDA o": "KDA", "ATTN_RES h": None}.get(label, label)
        us = timed(rt, tasks[key], reps) if key else float("nan")
        table.append((label, batch, note, e, us))
    rt.set_tasks(plan)


def mxfp4_bandwidth(batch: int, gen: torch.Generator, quick: bool, reps: int) -> None:
    """GEMV_MXFP4 over 16 experts' stacked gate+up rows (2 x 3072 x 7168 each): 352 MB + scales."""
    n, k = (16 * 2 * 3072, 7168) if not quick else (4096, 2048)
    wq, sc = wl.random_mxfp4(n, k, "cuda", gen)
    x = torch.randn(batch, k, device="cuda", generator=gen).to(BF)
    y = torch.empty(batch, n, device="cuda", dtype=BF)
    tasks = wl.gemv_tasks(wq, x, y, 132, 0, opcode=Opcode.GEMV_MXFP4, scales=sc)
    nbytes = wq.numel() + sc.numel() + x.numel() * 2 + y.numel() * 2
    yref = x.float() @ wl.dequant_mxfp4(wq, sc).T
    for dec in ("f16", "lut"):
        plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks)), num_events=1,
                          batch=batch, threads=1024, mxfp4_decode=dec, name=f"mx_{dec}_b{batch}")
        rt = Megakernel(plan)
        y.fill_(float("nan"))
        us = timed(rt, tasks, reps)
        table.append((f"GEMV_MXFP4 {n}x{k} decode={dec}", batch,
                      f"{nbytes / us / 1e6:.2f} TB/s", wl.rel_err(y, yref), us))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--json", help="write the table as JSON here")
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    reps = 5 if args.quick else 20
    for b in (int(v) for v in args.batches.split(",")):
        bodies(b, gen, args.quick, reps)
        mxfp4_bandwidth(b, gen, args.quick, reps)
    print(f"\n{'body':44s} {'B':>2s} {'note':14s} {'rel err':>9s} {'time us':>9s}  status")
    bad = 0
    for label, b, note, err, us in table:
        ok = err < TOL and note != "IDS DIFFER"
        bad += not ok
        print(f"{label:44s} {b:2d} {note:14s} {err:9.2e} {us:9.1f}  {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
