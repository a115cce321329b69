"""Decode-step speed of the CuTe megakernel on Kimi K3 `slice4` (H200; not a test).

Per batch size:
  - the megakernel step replayed from a CUDA graph (median of `--reps` replays, CUDA events);
  - bytes the step must read: weights (routed experts counted from the router ids the kernel
    actually produced, distinct per layer) plus state (KDA recurrent/conv states, the MLA cache
    rows up to the position) -> achieved bandwidth and its fraction of the 4.16 TB/s roofline;
  - per op kind (profile build of the same plan: per-row globaltimer stamps): the union of the
    kind's task intervals, its bytes (cost model, experts scaled to the routed count) and the
    bandwidth they imply;
  - the reference executor over the same lowered graph, eager, same weights (under
    torch.compile: benchmarks/reference_compile.py).
With FUSEC_PROFILE_DIR set, each profile is also saved (torch.save) for offline analysis, and
the time with n CTAs inside a weight-streaming body is printed (critical_path.streaming_gaps).
`--profile-plan field=value[,...]` profiles a variant of the plan instead of the default (the
saved file's name then ends in `_variant`): where a variant's time goes inside the step, which a
body's own benchmark does not say.
Writes no docs itself: paste the printed table into docs/performance.md.

    python benchmarks/cute_speed.py [--config slice4] [--batches 1,4,16]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import torch

import fusec
from _plan_args import plan_fields  # benchmarks/_plan_args.py
from critical_path import streaming_gaps  # benchmarks/critical_path.py
from _timing import median_us  # benchmarks/_timing.py (this script's folder)

HBM_TBPS = 4.16
SAVE_DIR = os.environ.get("FUSEC_PROFILE_DIR")   # set: also save each profile (torch.save)
PREFETCH_KB = [0, 16, 64]   # --prefetch-kb
GEMV_VARIANTS: list[str] = []   # --gemv-variants: other GEMV_BF16 bodies timed on the same table
PLAN_VARIANTS: list[str] = []   # --plan-variants: other compile-time plan fields, same table
PROFILE_PLAN = [""]             # --profile-plan: the plan fields of the profile build ("" = default)


def model_path() -> str:
    import fusec.models as m
    return os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")


def _tile_bytes(row) -> int:
    """Bytes of a GEMV row's weight tile from its prefetch start (0: not a streamed GEMV row)."""
    from fusec.backends.cute.prefetch import weight_row_bytes
    return (row.n1 - row.n0) * weight_row_bytes(row)


def routed_expert_bytes(run) -> tuple[float, float]:
    """(bytes of the experts the last step routed to, cost-model expert bytes) over all MoE ops."""
    g = run.program.graph
    actual = model = 0.0
    dims = run.dims
    for op in g.ops:
        if op.opname not in ("moe_gate_up", "moe_down"):
            continue
        ids = run.mem.tensor(op.inputs[1].name)
        ws = op.inputs[2:]
        per_expert = sum(w.type.nbytes(dims) / w.type.concrete(dims)[0] for w in ws)
        actual += per_expert * len(torch.unique(ids))
        model += sum(w.type.nbytes(dims) for w in ws) * min(ws[0].type.concrete(dims)[0], ids.numel()) \
            / ws[0].type.concrete(dims)[0]
    return actual, model


def step_bytes(run, pos: int) -> float:
    """Weights (experts as routed) + state the step reads."""
    g, dims = run.program.graph, run.dims
    total = 0.0
    for v in g.weights():
        if not any(op.opname in ("moe_gate_up", "moe_down") and v in op.inputs[2:] for op in g.ops):
            total += v.type.nbytes(dims)
    total += routed_expert_bytes(run)[0]
    for v in g.states():
        shape = v.type.concrete(dims)
        b = v.type.nbytes(dims)
        if "cache" in v.name:     # [B, L, row]: rows 0..pos are read
            b = b * (pos + 1) / shape[1]
        total += b
    return total


def kind_table(run, prof, expert_scale: float) -> list[tuple[str, float, float]]:
    """(op kind, union of its tasks' body intervals in us, bytes) for the profiled step."""
    s = run.program.schedule
    g = s.graph
    ops = {op.outputs[0].name: op for op in g.ops}
    share: dict[str, int] = {}
    for t in s.tasks:
        for n in t.ops:
            share[n] = share.get(n, 0) + 1
    kind_of, bytes_of = {}, {}
    for t in s.tasks:
        best, tb = None, 0.0
        for n in t.ops:
            op = ops[n]
            c = op.opdef.cost([v.type for v in op.inputs], [v.type for v in op.outputs], op.attrs, s.dims)
            b = c.bytes_read / share[n] * (expert_scale if op.opname in ("moe_gate_up", "moe_down") else 1.0)
            tb += b
            if best is None or b > best[1]:
                best = (op.opname, b)
        if best is not None:
            kind_of[t.id], bytes_of[t.id] = best[0], tb
    spans: dict[str, list] = {}
    for i, row in enumerate(run.plan.tasks):
        k = kind_of.get(row.task_id)
        if k is None or prof[i, 2] <= 0:
            continue
        spans.setdefault(k, []).append((int(prof[i, 1]), int(prof[i, 2])))
    durs = {k: sorted((b - a) / 1e3 for a, b in iv) for k, iv in spans.items()}
    out = []
    for k, iv in spans.items():
        iv.sort()
        busy, cur_s, cur_e = 0, None, None
        for a, b in iv:
            if cur_e is None or a > cur_e:
                busy += (cur_e - cur_s) if cur_e is not None else 0
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        busy += cur_e - cur_s
        kb = sum(bytes_of[t] for t in kind_of if kind_of[t] == k)
        d = durs[k]
        out.append((k, busy / 1e3, kb, len(d), d[len(d) // 2], d[-1]))
    return sorted(out, key=lambda r: -r[2])


def reference_us(run, batch: int, pos: int) -> float:
    """The reference executor over the same lowered graph, eager (torch.compile of the reference:
    benchmarks/reference_compile.py)."""
    ref = run.lowered_reference()
    tok = torch.zeros(batch, dtype=torch.int32, device="cuda")
    p = torch.full((batch,), pos, dtype=torch.int32, device="cuda")
    return median_us(lambda: ref.run(tok, p), 5)


def bench(config: str, batch: int, max_len: int, reps: int) -> dict:
    from fusec.backends.cute.runtime import Megakernel

    t0 = time.perf_counter()
    cute = fusec.compile(model_path(), config, backend="cute", batch=batch, max_len=max_len, device="cuda")
    t_build = time.perf_counter() - t0
    run = cute.runner
    pos = max_len - 1
    g = torch.Generator().manual_seed(batch)
    tok = torch.randint(0, run.program.graph.outputs[0].type.shape[-1], (batch,), generator=g,
                        dtype=torch.int32).cuda()
    run.run(tok, torch.full((batch,), pos, dtype=torch.int32, device="cuda"))  # real routing in the arena
    nbytes = step_bytes(run, pos)
    actual, model = routed_expert_bytes(run)
    # The kernel as built (default prefetch table) and the same kernel with the prefetch ranges
    # capped at each --prefetch-kb size (PF words are run-time data: no recompilation), timed in
    # 3 interleaved rounds of `reps` graph replays each; the median round counts. The first
    # round also warms the clocks: a single first measurement after the build ran up to 8%
    # slower than later ones on the H200.
    pf = {"default": (run.kernel, run.kernel.capture_graph(), [])}
    for cap in PREFETCH_KB:
        # A cap above the built range widens it up to the row's whole weight tile (rows whose
        # task the prefetch pass hoisted only: pf_bytes > 0), still inside the task's LOADs.
        rows = [dataclasses.replace(t, pf_bytes=min(_tile_bytes(t), cap * 1024) // 16 * 16 if t.pf_bytes else 0,
                                    pf_addr=t.pf_addr if cap and t.pf_bytes else 0)
                for t in run.plan.tasks]
        mk = run.kernel.sibling(run.plan.with_tasks(rows))
        pf[cap] = (mk, mk.capture_graph(), [])
    for gv in GEMV_VARIANTS:
        mk = Megakernel(dataclasses.replace(run.plan, gemv=gv))   # a new body: a new compile
        pf[f"gemv={gv}"] = (mk, mk.capture_graph(), [])
    for pv in PLAN_VARIANTS:   # "field=value,field=value": other compile-time plan settings
        mk = Megakernel(dataclasses.replace(run.plan, **plan_fields(run.plan, pv, "cute_speed")))
        pf[pv] = (mk, mk.capture_graph(), [])
    for _ in range(3):
        for cap, (mk, g, ts) in pf.items():
            ts.append(median_us(g.replay, reps))
            mk.check()
    t_kernel = sorted(pf.pop("default")[2])[1]
    pf_us = {cap: sorted(ts)[1] for cap, (_, _, ts) in pf.items()}
    del pf
    prof_plan = dataclasses.replace(run.plan, profile=True, **plan_fields(run.plan, PROFILE_PLAN[0], "cute_speed"))
    mk = Megakernel(prof_plan)
    mk.step()
    mk.check()
    mk.step()      # second step: warm caches as in the replay loop
    mk.check()
    prof = mk.profile().cpu()
    if SAVE_DIR:   # raw stamps + row identities, for offline timeline analysis
        rows = torch.tensor([[t.task_id, int(t.opcode), t.sub, t.n0, t.n1, t.k] for t in run.plan.tasks])
        cta = torch.zeros(len(run.plan.tasks), dtype=torch.int64)
        for c, q in enumerate(run.plan.queues):
            cta[list(q)] = c
        saved = os.path.join(SAVE_DIR, f"profile_{config}_b{batch}{'_variant' if PROFILE_PLAN[0] else ''}.pt")
        torch.save({"prof": prof, "rows": rows, "cta": cta}, saved)
        # How much of the profiled step the weight streams use (critical_path.py --gaps has the
        # stretches one by one).
        hist, gaps = streaming_gaps(saved)
        print(f"  B={batch} profile: us with n CTAs in a weight-streaming body: "
              + ", ".join(f"{lo}-{hi}: {us:.0f}" for lo, hi, us in hist)
              + f"; {len(gaps)} stretches with none ({sum(g[1] for g in gaps):.0f} us)", flush=True)
    kinds = kind_table(run, prof, actual / model if model else 1.0)
    wall = (int(prof[:, 2].max()) - int(prof[:, 0][prof[:, 0] > 0].min())) / 1e3
    body = (prof[:, 2] - prof[:, 1]).double() / 1e3
    wait = (prof[:, 1] - prof[:, 0]).double() / 1e3
    top = [(float(body[i]), run.plan.tasks[i]) for i in body.argsort(descending=True)[:8].tolist()]
    eager = reference_us(run, batch, pos)
    return dict(batch=batch, rows=len(run.plan.tasks), build_s=t_build, kernel_us=t_kernel, bytes=nbytes,
                pf_us=pf_us, tbps=nbytes / t_kernel / 1e6, roof=nbytes / (HBM_TBPS * 1e12) * 1e6, kinds=kinds,
                prof_wall_us=wall, eager_us=eager, top=top,
                body_us=float(body.sum()), wait_us=float(wait.sum()), ctas=len(run.plan.queues))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="slice4")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prefetch-kb", default="0,16,64", help="prefetch caps to time (KiB per row, 0 = none)")
    ap.add_argument("--gemv-variants", default="", help="other GEMV_BF16 bodies to time (simt, mma)")
    ap.add_argument("--plan-variants", default="", help="other plan settings to time, ';'-separated, "
                    "each 'field=value[,field=value]' (e.g. 'l2_ahead=0;l2_ahead=4')")
    ap.add_argument("--profile-plan", default="", help="plan settings of the profile build, "
                    "'field=value[,field=value]' (default: the default plan's)")
    args = ap.parse_args(argv)
    PROFILE_PLAN[0] = args.profile_plan
    PREFETCH_KB[:] = [int(x) for x in args.prefetch_kb.split(",") if x]
    GEMV_VARIANTS[:] = [x for x in args.gemv_variants.split(",") if x]
    PLAN_VARIANTS[:] = [x for x in args.plan_variants.split(";") if x]
    if any("_tiles" in v for v in PLAN_VARIANTS + PROFILE_PLAN):   # their weights must be repacked: a new arena layout
        ap.error("gemv_tiles / expert_tiles change the weights' layout: time them with benchmarks/plan_variants.py")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, config {args.config}, "
          f"position {args.max_len - 1}, GEMV_BF16 body {GEMV_VARIANTS and 'default (' + ','.join(GEMV_VARIANTS) + ' timed too)' or 'default'}", flush=True)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        try:
            r = bench(args.config, b, args.max_len, args.reps)
        except Exception:
            traceback.print_exc()
            continue
        rows.append(r)
        print(f"  B={b}: kernel {r['kernel_us']:.0f} us, {r['bytes'] / 1e9:.2f} GB -> {r['tbps']:.2f} TB/s "
              f"({r['roof'] / r['kernel_us'] * 100:.0f}% of roofline {r['roof']:.0f} us); prefetch cap KiB -> us: "
              + ", ".join(f"{c}: {u:.0f}" for c, u in r['pf_us'].items()) + "; reference eager "
              f"{r['eager_us']:.0f} us", flush=True)
        print(f"  per op kind (profile build, step wall {r['prof_wall_us']:.0f} us):", flush=True)
        for k, us, kb, n, med, mx in r["kinds"]:
            print(f"    {k:<24} busy {us:8.1f} us  {kb / 1e6:9.1f} MB  {kb / max(us, 1e-9) / 1e6:6.2f} TB/s"
                  f"  rows {n:5d}  row median {med:7.1f} us  max {mx:7.1f} us", flush=True)
        print(f"  CTA time: bodies {r['body_us'] / r['ctas']:.0f} us, waits {r['wait_us'] / r['ctas']:.0f} us per CTA "
              f"({r['ctas']} CTAs); longest rows:", flush=True)
        for us, t in r["top"]:
            print(f"    {us:8.1f} us  task {t.task_id} {t.opcode.name} sub {t.sub} rows {t.n0}..{t.n1} k {t.k} "
                  f"p0 {t.p0} p1 {t.p1}", flush=True)
        torch.cuda.empty_cache()
    print("\n| B | rows | kernel us (median) | GB read | TB/s | % of roofline | prefetch cap KiB: us | "
          "reference eager us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['rows']} | {r['kernel_us']:.0f} | {r['bytes'] / 1e9:.2f} | {r['tbps']:.2f} | "
              f"{r['roof'] / r['kernel_us'] * 100:.0f}% | "
              + " ".join(f"{c}: {u:.0f}" for c, u in r['pf_us'].items()) + f" | {r['eager_us']:.0f} |")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
