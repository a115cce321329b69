"""Check and time the CuTe megakernel's task bodies on one GPU (one call of the device machine).

    python benchmarks/gemv_megakernel.py [--quick] [--json OUT.json]

1. correctness vs torch (fresh random data, outputs poisoned with NaN first) at batch 1/4/16 of
   GEMV_BF16 tiles, GEMV_MXFP4 tiles and a dependent chain GEMV -> RMSNORM -> GEMV whose
   consumers wait on their producers' events, over 3 consecutive steps (counters never reset);
2. bounded wait: a task waiting on an event nobody signals must raise within ~1 s;
3. speed: a megakernel of GEMV_BF16 tiles alone over a 7168 -> 49280 bf16 weight at batch 1,
   CUDA-graph replay, weights rotated between 2 copies (1.4 GB, far over the 50 MB L2),
   median of many runs, against the 4.16 TB/s device-to-device copy ceiling; cuBLAS alongside.
The table printed last is what goes into docs/performance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from fusec.testing import cute_workloads as wl
from fusec.backends.cute.plan import KernelPlan, round_robin_queues
from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout

CEILING_TBPS = 4.16
TOL = 2e-2  # bf16 output rounding is ~4e-3 relative; fp32 accumulation order differs from torch
rows: list[tuple[str, str, str]] = []


def record(what: str, value: str, ok: bool | None = None) -> None:
    status = "" if ok is None else ("PASS" if ok else "FAIL")
    rows.append((what, value, status))
    print(f"{what:48s} {value:28s} {status}", flush=True)


def _gemv_spec(spec: str) -> tuple[str, dict]:
    """'mma+gemv_kw=4+mma_tiles_per_unit=1' -> ('mma', {'gemv_kw': 4, 'mma_tiles_per_unit': 1})."""
    body, *extra = spec.split("+")
    return body, {k: int(v) for k, v in (e.split("=") for e in extra)}


def correctness(batch: int, gen: torch.Generator, steps: int = 3, gemv: str = "auto") -> Megakernel:
    dev = "cuda"
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    # Independent tiles: bf16 GEMV with a K that leaves an unroll tail, MXFP4 GEMV.
    k1, n1 = 7424, 1000
    w1, x1 = (r(n1, k1) * 0.05).to(bf), r(batch, k1).to(bf)
    y1 = torch.empty(batch, n1, device=dev, dtype=bf)
    k2, n2 = 7168, 768
    wq, sc = wl.random_mxfp4(n2, k2, dev, gen)
    x2, y2 = r(batch, k2).to(bf), torch.empty(batch, n2, device=dev, dtype=bf)
    # Chain: h = x @ Wa^T (event 0, 64 tiles) -> hn = rmsnorm(h) (event 1) -> y = hn @ Wc^T.
    ka, na, nc = 7168, 2048, 1536
    wa, xa = (r(na, ka) * 0.05).to(bf), r(batch, ka).to(bf)
    h, hn = torch.empty(batch, na, device=dev, dtype=bf), torch.empty(batch, na, device=dev, dtype=bf)
    gamma = (1 + 0.1 * r(na)).to(bf)
    wc, yc = (r(nc, na) * 0.05).to(bf), torch.empty(batch, nc, device=dev, dtype=bf)
    a_tiles = 64
    tasks = wl.gemv_tasks(w1, x1, y1, 132, 0)
    tasks += wl.gemv_tasks(wq, x2, y2, 96, 1000, opcode=wl.Opcode.GEMV_MXFP4, scales=sc)
    tasks += wl.gemv_tasks(wa, xa, h, a_tiles, 2000, signal=0)
    tasks.append(wl.rmsnorm_task(h, gamma, hn, 1e-5, 3000, wait=(0, a_tiles, 0), signal=1))
    tasks += wl.gemv_tasks(wc, hn, yc, 132, 4000, wait=(1, 1, 0))
    # Tasks are listed in a topological order, so round robin keeps every queue consistent.
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks)), num_events=4,
                      batch=batch, spin_timeout_ns=100_000_000, name=f"check_b{batch}_" + "".join(ch if ch.isalnum() else "_" for ch in gemv),
                      rows_per_warp=2 if batch <= 4 else 1, gemv=_gemv_spec(gemv)[0], **_gemv_spec(gemv)[1])
    rt = Megakernel(plan)
    ok_all = True
    for step in range(1, steps + 1):
        for t in (x1, x2, xa):
            t.copy_(r(*t.shape).to(bf))
        for t in (y1, y2, h, hn, yc):
            t.fill_(float("nan"))
        rt.step()
        torch.cuda.synchronize()
        rt.check()
        e1 = wl.rel_err(y1, x1.float() @ w1.float().T)
        e2 = wl.rel_err(y2, x2.float() @ wl.dequant_mxfp4(wq, sc).T)
        h_ref = (xa.float() @ wa.float().T).to(bf)
        hn_ref = wl.rmsnorm_ref(h_ref, gamma, 1e-5).to(bf)
        ea = wl.rel_err(h, h_ref)
        en = wl.rel_err(hn, hn_ref)
        ec = wl.rel_err(yc, hn_ref.float() @ wc.float().T)
        ev = rt.events.tolist()[:2]
        ev_ok = ev == [a_tiles * step, step]
        ok = max(e1, e2, ea, en, ec) < TOL and ev_ok
        ok_all &= ok
        if step in (1, steps):
            record(f"B={batch} {gemv} step {step} gemv_bf16 rel err", f"{e1:.2e}", e1 < TOL)
            record(f"B={batch} {gemv} step {step} gemv_mxfp4 rel err", f"{e2:.2e}", e2 < TOL)
            record(f"B={batch} {gemv} step {step} chain gemv/rmsnorm/gemv", f"{ea:.1e}/{en:.1e}/{ec:.1e}",
                   max(ea, en, ec) < TOL)
            record(f"B={batch} {gemv} step {step} event counters", str(ev), ev_ok)
    if not ok_all:
        record(f"B={batch} some step failed", "see log", False)
    return rt


def bounded_wait(rt: Megakernel) -> None:
    """Re-point the compiled B=1 kernel at a table whose only task waits on a dead event."""
    x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    y = torch.empty(1, 8, device="cuda", dtype=torch.bfloat16)
    tasks = wl.gemv_tasks(w, x, y, 1, 77, wait=(3, 1, 0))  # event 3: nobody signals it
    rt.set_tasks(dataclasses.replace(rt.plan, tasks=tuple(tasks), queues=((0,),) + ((),) * 131,
                                     extra_opcodes=rt.plan.opcodes))
    t0 = time.perf_counter()
    rt.step()
    try:
        rt.check()
        record("missing signal raises", "no error raised", False)
    except MegakernelTimeout as exc:
        dt = time.perf_counter() - t0
        i = exc.info
        ok = i["task_id"] == 77 and i["event"] == 3 and dt < 1.5
        record("missing signal raises", f"{dt * 1e3:.0f} ms task {i['task_id']} ev {i['event']}", ok)
        print("   ", exc)


def timing(threads: int, unroll: int, tiles: int, rows_per_warp: int, reps: int, gemv: str = "auto",
           batch: int = 1, n: int = 49280, k: int = 7168) -> None:
    dev, bf = "cuda", torch.bfloat16
    ws = [torch.randn(n, k, device=dev).to(bf) for _ in range(max(2, 2_000_000_000 // (n * k * 2)))]
    x = torch.randn(batch, k, device=dev).to(bf)
    y = torch.empty(batch, n, device=dev, dtype=bf)
    body, extra = _gemv_spec(gemv)
    plans = [KernelPlan(tasks=tuple(wl.gemv_tasks(w, x, y, tiles)), queues=round_robin_queues(tiles),
                        num_events=1, threads=threads, unroll=unroll, batch=batch, gemv=body,
                        rows_per_warp=rows_per_warp, name=f"gemv_time_b{batch}", **extra)
             for w in ws]
    rt = Megakernel(plans[0])
    tables = []
    for p in plans:
        rt.set_tasks(p)
        tables.append(rt.table.clone())
    g = rt.capture_graph()
    y.fill_(float("nan"))
    rt.table.copy_(tables[0])
    g.replay()
    torch.cuda.synchronize()
    rt.check()
    err = wl.rel_err(y, x.float() @ ws[0].float().T)
    times = []
    for i in range(reps + 5):
        rt.table.copy_(tables[i % len(tables)])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b) * 1e-3)
    rt.check()
    t = statistics.median(times)
    tbps = (n * k * 2 + batch * (k * 2 + n * 2)) / t / 1e12
    record(f"gemv {k}->{n} B={batch} {gemv} thr={threads} u={unroll} rows/warp={rows_per_warp} tiles={tiles}",
           f"{t * 1e6:.1f} us {tbps:.2f} TB/s {100 * tbps / CEILING_TBPS:.0f}%", err < TOL)


def cublas_reference(reps: int, batch: int = 1, n: int = 49280, k: int = 7168) -> None:
    bf = torch.bfloat16
    ws = [torch.randn(n, k, device="cuda").to(bf) for _ in range(max(2, 2_000_000_000 // (n * k * 2)))]
    x = torch.randn(batch, k, device="cuda").to(bf)
    times = []
    for i in range(reps + 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.nn.functional.linear(x, ws[i % len(ws)])
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b) * 1e-3)
    t = statistics.median(times)
    record(f"cuBLAS (torch linear) {k}->{n} B={batch}", f"{t * 1e6:.1f} us {n * k * 2 / t / 1e12:.2f} TB/s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 only, one timing variant")
    ap.add_argument("--json", default=os.environ.get("OUT", ".") + "/gemv_megakernel.json")
    ap.add_argument("--variants", help="threads:unroll:tiles:rows_per_warp:gemv:batch[:n:k],... where gemv is "
                                       "simt, mma or mma+FIELD=VALUE+... (KernelPlan fields, e.g. gemv_kw=4)",
                    # first (the one --quick times): the step's batch-1 GEMV (lower.py: 512
                    # threads, 8 chunks in flight, CUDA cores, row-major weights at batch 1)
                    default="512:8:132:1:simt:1,512:4:132:1:simt:1,512:4:132:1:mma:1,512:8:132:1:mma:1,"
                            "512:4:132:1:simt:16,"
                            "512:4:132:1:mma:16,512:4:132:1:mma:4,512:4:132:1:mma:16:2112:7168")
    ap.add_argument("--gemv", default="simt,mma", help="GEMV_BF16 bodies to check for correctness "
                                                       "(as in --variants, e.g. mma+gemv_kw=4)")
    ap.add_argument("--batches", default="1,4,16", help="batches of the correctness checks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    rt1 = None
    for batch in ([1] if args.quick else [int(b) for b in args.batches.split(",")]):
        for gemv in args.gemv.split(","):
            rt = correctness(batch, gen, gemv=gemv)
            rt1 = rt1 or rt
    bounded_wait(rt1)
    reps = 100
    for b in (1, 16):
        cublas_reference(reps, b)
    for v in args.variants.split(",")[: 1 if args.quick else None]:
        f = v.split(":")
        shape = dict(n=int(f[6]), k=int(f[7])) if len(f) > 6 else {}
        timing(int(f[0]), int(f[1]), int(f[2]), int(f[3]), reps, f[4], int(f[5]), **shape)
    print("\n| what | result | check |\n|---|---|---|")
    for what, value, status in rows:
        print(f"| {what} | {value} | {status} |")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(s != "FAIL" for _, _, s in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
