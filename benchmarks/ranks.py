"""fusec at R = 2 against R = 1 and a plain-PyTorch TP = 2 baseline, in one torchrun run (issue 13).

    torchrun --standalone --nproc-per-node 2 benchmarks/ranks.py [--config slice4-e128] [--batches 1,4,16]
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ranks.py \\
        --device cpu --backend reference --config tiny --batches 1,2 --rounds 1 --json /tmp/ranks.json  # smoke
    python benchmarks/ranks.py --merge b1/ranks.json b4/ranks.json b16/ranks.json   # rows of several runs

One process per GPU (cuda:LOCAL_RANK; NCCL for the collectives, a gloo group for the host-side
barriers and result exchange); NVLink multicast off before the process group starts
(backends/multicast.py). Per batch B, at position pos = max_len - 1 (speed.py's `--pos`), on the
same random weights (one full dict per process, the same seed on every rank):

  fusec_r2_gated     `fusec.compile(..., ranks=2)`: the default pipeline (split_reduce's cost gate)
  fusec_r2_split_off the same with the pipeline `-split_reduce` (every all-reduce whole: no
                     producer/all-reduce overlap); built through the same pieces as
                     fusec.compile's ranks path (fusec.compile has no pass option)
  tp_baseline        benchmarks/baseline_tp.py: baseline_torch.py's step tensor/expert-parallel,
                     bound from the same per-rank slices as fusec's rank, NCCL through functional
                     collectives, under torch.compile(fullgraph=True, dynamic=False) with mode
                     "reduce-overhead" where that works with the collectives, else "default"
                     (`--baseline-mode auto`; the header and rows say which); MoE path picked per
                     batch by timing the EP candidates (slowest rank decides, so both agree)
  fusec_r1           `fusec.compile(..., ranks=1)` on rank 0's GPU alone; the other ranks wait at a
                     host barrier meanwhile (nothing of theirs runs)

Timing: `--rounds` interleaved rounds; in each, every variant is timed after a host barrier by
every rank that runs it (`--reps` calls, CUDA events, a sync after each call; the median), so the
ranks time the same steps; a variant's round time is the slowest rank's; the row has the median
over rounds. fusec is timed as its kernel's CUDA-graph replay where the runner has one (cute),
else its `step()`; the baseline as its compiled call (`timer` in the row).

Logits (one step from fresh state, same tokens): every rank's logits of a multi-rank variant
must be bit-identical (`ranks_identical`); each variant's max |diff| / max |reference| against the
single-process step (fusec R = 1 on rank 0; reported, not asserted: routing near-ties in bf16
may pick other experts, and the per-rank partial sums round to bf16 before each all-reduce;
LOGITS_TOL flags larger errors); with `--rank-ref` (default on the CPU) fusec's R = 2 logits also
against `run_step_ranks`, the one-process multi-rank reference that rounds where fusec's ranks do
(`logits_rel_err_vs_rank_ref`; 0 on the reference backend, which computes the same bits).

Exposed communication (cute backend): a profile build of each rank's multi-rank table (per-row
globaltimer stamps: wait start, body start, body end; new symmetric event counters, both ranks
step it twice), then on the second step: the time at least one row of the rank waits on a
system-scope (remote) event while no row of that rank runs a body, over the rank's step wall
(`exposed_comm_fraction`, the larger over the ranks); `sys_wait_cta_fraction` is the mean over
CTAs of their time in such waits (whether or not other CTAs had work). None on the reference
backend (no profile).

Rows (`docs/results/ranks.json` on CUDA, `--json PATH` elsewhere; merged by (config, batch, ranks,
variant)): config, batch, ranks, variant, us, ratio_vs_r1 (fusec_r1 us / us: above 1 = faster
than one GPU), ratio_vs_tp_baseline (tp_baseline us / us: above 1 = faster than the baseline),
exposed_comm_fraction, logits_rel_err, and detail fields. Rank 0 writes; a markdown table last.
Exit status: 0 when every batch ran every variant, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_torch as bt  # noqa: E402  (benchmarks/baseline_torch.py)
import baseline_tp as btp  # noqa: E402  (benchmarks/baseline_tp.py)
from _step_args import add_step_args, banner, cpu_name, free_batch_memory, resolve_step_args  # noqa: E402
from _timing import median_us  # noqa: E402

import fusec  # noqa: E402
from fusec.backends.multicast import multicast_off  # noqa: E402
from fusec.loader import load_graph, parse_overrides  # noqa: E402
from fusec.weights import random_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(ROOT, "docs", "results", "ranks.json")
VARIANTS = ("fusec_r2_gated", "fusec_r2_split_off", "tp_baseline", "fusec_r1")
LOGITS_TOL = 5e-2          # flagged above this (bf16 steps; speed.py reports the same measure)


def model_path() -> str:
    import fusec.models as m
    return os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


# -- exposed communication from a profile ------------------------------------------------------
def _union(iv):
    """Merged, sorted, non-empty intervals."""
    out = []
    for a, b in sorted((a, b) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _minus_len(a, b) -> float:
    """Total length of union(a) minus union(b) (both lists of merged intervals)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def exposed_comm(prof, remote_rows, queues) -> dict:
    """From one rank's profile `prof` (int64 [rows, 3]: wait start, body start, body end, ns; 0 =
    row not run), the rows whose wait is on a remote (system-scope) event and the CTA queues:
    wall (first wait start to last body end), `exposed` (time some remote wait is pending while
    no row of the rank runs a body), `sys_wait_cta` (the mean over CTAs of their remote-wait
    time), in microseconds, and the fractions of the wall."""
    p = [tuple(int(x) for x in r) for r in prof.tolist()]
    ran = [i for i, r in enumerate(p) if r[2] > 0]
    if not ran:
        raise ValueError("the profile has no stamped row")
    t0, t1 = min(p[i][0] for i in ran), max(p[i][2] for i in ran)
    busy = _union([(p[i][1], p[i][2]) for i in ran])
    remote = set(remote_rows)
    waits = [(p[i][0], p[i][1]) for i in ran if i in remote]
    exposed = _minus_len(_union(waits), busy)
    wall = float(t1 - t0)
    per_cta = sum(b - a for a, b in waits if b > a) / max(1, len([q for q in queues if q]))
    return dict(wall_us=wall / 1e3, exposed_us=exposed / 1e3, sys_wait_cta_us=per_cta / 1e3,
                exposed_fraction=exposed / wall if wall else 0.0, sys_wait_cta_fraction=per_cta / wall if wall else 0.0,
                remote_wait_rows=len(remote))


def profile_ranks(run, group=None, steps: int = 2) -> dict:
    """Profile build of this rank's multi-rank table (DistCuteRunner `run`), stepped `steps`
    times on every rank together over new symmetric event counters (collective: every rank
    calls it); `exposed_comm` of the last step."""
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm

    from fusec.backends.cute.dist import peer_pointers
    from fusec.backends.cute.plan import NO_EVENT, ScopeCode
    from fusec.backends.cute.runtime import Megakernel

    plan = dataclasses.replace(run.plan, profile=True)
    R, rank, dev = run.ranks, run.rank, run.device
    grp = group if group is not None else dist.group.WORLD
    events = symm.empty(run.kernel.events.numel(), dtype=torch.int32, device=dev)
    handle = symm.rendezvous(events, grp)
    counters = peer_pointers(handle, events, R)
    mk = Megakernel(plan, device=dev, events=events)
    mk.set_peers(torch.tensor([counters[(rank + p) % R] for p in range(R)], dtype=torch.int64, device=dev))
    mk.warm()
    torch.cuda.synchronize(dev)
    dist.barrier(grp)
    for _ in range(steps):
        mk.step()
    torch.cuda.synchronize(dev)
    mk.check()
    remote = [i for i, t in enumerate(plan.tasks) if t.wait_event != NO_EVENT and t.wait_scope == ScopeCode.SYS]
    out = exposed_comm(mk.profile().cpu(), remote, plan.queues)
    dist.barrier(grp)             # no rank frees its counters while a peer may still signal them
    del mk, handle, events
    return out


# -- builds ----------------------------------------------------------------------------------
def compile_ranks(args, batch: int, weights: dict, passes: str):
    """This process's rank of the R-rank fusec step with pipeline `passes` ("default" is
    exactly `fusec.compile(..., ranks=R)`; another spec goes through the same pieces)."""
    max_len = args.pos + 1
    if passes == "default":
        return fusec.compile(model_path(), args.config, backend=args.backend, batch=batch, max_len=max_len,
                             device=args.fusec_device, weights=weights, overrides=args.overrides, ranks=args.ranks)
    from fusec.api import RANK_BACKENDS, CompiledStep, join_group
    from fusec.compiler import lower
    from fusec.ir.verify import verify_graph
    from fusec.passes.options import Options

    rank, device = join_group(args.ranks, None, args.backend, args.fusec_device)
    graph, _ = load_graph(model_path(), args.config, args.overrides)
    verify_graph(graph)
    program = lower(graph, Options.from_env(ranks=args.ranks, batch=batch, max_len=max_len), passes)
    runner = RANK_BACKENDS[args.backend](program, weights, {"B": batch, "L": max_len}, device, "bf16", rank, None)
    return CompiledStep(program.graph, runner, batch, max_len, device,
                        deferred=args.backend != "reference" and device.startswith("cuda"))


def fusec_timer(step):
    """(callable, timer name): the kernel's CUDA-graph replay where the runner has one, else step()."""
    kernel = getattr(step.runner, "kernel", None)
    if kernel is not None and hasattr(kernel, "capture_graph"):
        return kernel.capture_graph().replay, "graph_replay"
    return None, "step"


def baseline_call(step, mode: str | None, cuda: bool):
    """(tokens, positions) -> (logits, next) of the TP step: compiled with `mode` (None: eager)."""
    return bt.step_call(step, None if mode is None else bt.compile_step(step, mode=mode), cuda)


def warm(fn, tok, pos, cuda: bool, mode: str | None) -> float:
    """First calls (compile, CUDA-graph recording); raises on a compile error or, in
    reduce-overhead mode, when Inductor skipped CUDA graphs. Seconds spent."""
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    t0 = time.perf_counter()
    for _ in range(3):
        fn(tok, pos)
    if cuda:
        torch.cuda.synchronize()
    if mode == "reduce-overhead" and counters["inductor"]["cudagraph_skips"] != skips:
        raise RuntimeError("Inductor skipped CUDA graphs for the TP baseline (TORCH_LOGS=perf_hints says why)")
    return time.perf_counter() - t0


class Ctl:
    """Host-side coordination over a gloo group: barriers, agreement, gathering results."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.group)

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_ok(self, ok: bool) -> bool:
        return all(self.gather(bool(ok)))


def build_baseline(args, ctl, cfg, spmd_graph, model_graph, full, batch, tok, posv):
    """The TP baseline of this rank: every EP MoE candidate built and timed, the one whose slowest
    rank is fastest kept. Returns (fn, step, moe, mode, {moe: us}, first-calls seconds)."""
    cuda = args.device.startswith("cuda")
    lcfg = btp.local_config(cfg, args.ranks)
    w = bt.K3Weights(lcfg, btp.rank_weights(spmd_graph, full, ctl.rank), share=False, graph=model_graph)
    cands = btp.moe_candidates(cfg.expert_dtype, batch, cfg.topk, lcfg.experts, args.device) if args.moe == "auto" \
        else [args.moe]
    modes = [None] if not args.compile else (["reduce-overhead", "default"] if args.baseline_mode == "auto"
                                             else [args.baseline_mode])
    if not cuda and args.compile:
        modes = ["default"]           # no CUDA graphs on the CPU
    tried, best = {}, None
    for m in cands:
        for mode in list(modes):
            step = btp.K3TPStep(w, cfg, batch, args.pos + 1, rank=ctl.rank, ranks=args.ranks, moe=m)
            err = None
            try:
                fn = baseline_call(step, mode, cuda)
                secs = warm(fn, tok, posv, cuda, mode)
            except Exception as e:          # same code and shapes on every rank: they fail alike
                err = f"{type(e).__name__}: {e}"
            if not ctl.all_ok(err is None):
                print(f"  [rank {ctl.rank}] baseline moe={m} mode={mode} failed: {err}", flush=True)
                modes.remove(mode)       # (a mode that cannot compile is not tried again)
                torch._dynamo.reset()
                continue
            ctl.barrier()
            us = max(ctl.gather(median_us(lambda: fn(tok, posv), args.reps, cuda)))
            tried[m] = round(us, 1)
            if ctl.rank == 0:
                print(f"    baseline moe={m} mode={mode}: first calls {secs:.1f} s, {us:.0f} us", flush=True)
            if best is None or us < best[4]:
                best = (fn, step, m, mode, us, secs)
            break
    if best is None:
        raise RuntimeError("no TP baseline candidate compiled")
    fn, step, m, mode, _, secs = best
    return fn, step, m, mode, tried, secs


# -- one batch ---------------------------------------------------------------------------------
def bench_batch(args, ctl, cfg, model_graph, full, batch: int) -> list[dict]:
    cuda = args.device.startswith("cuda")
    rank = ctl.rank
    g = torch.Generator().manual_seed(1000 + batch)          # speed.py's tokens
    tok = torch.randint(0, cfg.vocab, (batch,), generator=g, dtype=torch.int32).to(args.local_device)
    posv = torch.full((batch,), args.pos, dtype=torch.int32, device=args.local_device)
    steps, errors, info = {}, {}, {}

    def build(name, make, only_rank0=False):
        if only_rank0 and rank != 0:
            ctl.barrier()
            return
        t0 = time.perf_counter()
        try:
            steps[name] = make()
            info.setdefault(name, {})["build_s"] = round(time.perf_counter() - t0, 1)
            if rank == 0:
                print(f"  B={batch}: {name} built in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"
        if only_rank0:
            ctl.barrier()
        elif not ctl.all_ok(name in steps):   # every rank keeps a variant or none does
            steps.pop(name, None)
            errors.setdefault(name, "failed on another rank")

    if "fusec_r2_gated" in args.variants:
        build("fusec_r2_gated", lambda: compile_ranks(args, batch, full, "default"))
    if "fusec_r2_split_off" in args.variants:
        build("fusec_r2_split_off", lambda: compile_ranks(args, batch, full, "-split_reduce"))
    if "tp_baseline" in args.variants:
        from fusec.compiler import lower
        from fusec.passes.options import Options
        spmd = lower(model_graph, Options(ranks=args.ranks, batch=batch, max_len=args.pos + 1, verify_each_pass=False)
                     ).graph
        t0 = time.perf_counter()
        try:
            fn, bstep, moe, mode, tried, secs = build_baseline(args, ctl, cfg, spmd, model_graph, full, batch, tok, posv)
            steps["tp_baseline"] = bstep
            info["tp_baseline"] = dict(build_s=round(time.perf_counter() - t0, 1), moe=moe, mode=mode or "eager",
                                       moe_us=tried, first_calls_s=round(secs, 1))
        except Exception as e:
            traceback.print_exc()
            errors["tp_baseline"] = f"{type(e).__name__}: {e}"
    if "fusec_r1" in args.variants:
        build("fusec_r1", lambda: fusec.compile(model_path(), args.config, backend=args.backend, batch=batch,
                                                max_len=args.pos + 1, device=args.local_device, weights=full,
                                                overrides=args.overrides), only_rank0=True)

    # -- logits: one step from fresh state on every variant ----------------------------------
    logits = {}
    for name, s in steps.items():
        s.reset()
        if name == "tp_baseline":
            lb, _ = fn(tok, posv)
            logits[name] = lb.float().cpu().clone()
        else:
            out = s.step(tok, posv)
            s.check()
            logits[name] = out.logits.float().cpu()
        if name != "fusec_r1":
            ctl.barrier()
    # the single-process reference on rank 0, its logits sent to every rank (ranks > 0 get None)
    ref = ctl.gather(logits.get("fusec_r1"))[0]
    errs, same = {}, {}
    for name in VARIANTS:
        if name not in steps or name == "fusec_r1":
            continue
        mine = logits[name]
        allr = ctl.gather(mine)
        same[name] = all(torch.equal(x, allr[0]) for x in allr)
        if ref is not None:
            errs[name] = float((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    # the one-process multi-rank reference (run_step_ranks: every rank's ops in this process, the
    # collectives exact) on rank 0: fusec's R = 2 steps round where it does (--rank-ref)
    rerrs = {}
    if args.rank_ref and "fusec_r2_gated" in steps:
        if rank == 0:
            from fusec.backends.reference.executor import init_state
            from fusec.backends.reference.ranks import run_step_ranks
            dims = {"B": batch, "L": args.pos + 1}
            outs, _ = run_step_ranks(steps["fusec_r2_gated"].graph, full, args.ranks,
                                     init_state(model_graph, dims, args.local_device, "bf16"),
                                     {"tokens": tok, "pos": posv}, dims, "bf16")
            want = outs[0][0].float().cpu()
            for name in ("fusec_r2_gated", "fusec_r2_split_off"):
                if name in logits:
                    rerrs[name] = float((logits[name] - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    print(f"  B={batch}: {name} logits rel err vs run_step_ranks {rerrs[name]:.2e}", flush=True)
        ctl.barrier()
    if rank == 0:
        for name, e in errs.items():
            print(f"  B={batch}: {name} logits rel err vs fusec R=1 {e:.2e}"
                  f"{'' if e <= LOGITS_TOL else f'  (over {LOGITS_TOL})'}; ranks identical: {same[name]}", flush=True)

    # -- exposed communication (profile builds; collective) ------------------------------------
    exposed = {}
    for name in ("fusec_r2_gated", "fusec_r2_split_off"):
        if name not in steps or args.backend != "cute" or args.no_profile:
            continue
        try:
            res = profile_ranks(steps[name].runner)
            ok = True
        except Exception as e:
            traceback.print_exc()
            res, ok = {"error": f"{type(e).__name__}: {e}"}, False
        allr = ctl.gather(res)
        if ok and ctl.all_ok(ok):
            exposed[name] = dict(max(allr, key=lambda r: r["exposed_fraction"]), per_rank=allr)
            if rank == 0:
                print(f"  B={batch}: {name} exposed communication "
                      + ", ".join(f"rank {i}: {r['exposed_us']:.1f} of {r['wall_us']:.0f} us "
                                  f"({r['exposed_fraction'] * 100:.1f}%)" for i, r in enumerate(allr)), flush=True)
        else:
            errors[f"{name}_profile"] = str(allr)

    # -- timing: interleaved rounds, host barrier before each timer ---------------------------
    timers = {}
    for name, s in steps.items():
        if name == "tp_baseline":
            timers[name] = (lambda: fn(tok, posv)), "compiled_call" if info[name]["mode"] != "eager" else "eager_call"
        else:
            s.reset()
            f, kind = fusec_timer(s)
            timers[name] = (f or (lambda s=s: s.step(tok, posv))), kind
    # every rank knows the multi-rank variants; fusec_r1 exists on rank 0 alone (ref says whether)
    order = [n for n in VARIANTS if n in timers or (n == "fusec_r1" and ref is not None)]
    ts = {n: [] for n in order}
    for _ in range(args.rounds):
        for name in order:
            ctl.barrier()
            mine = median_us(timers[name][0], args.reps, cuda) if name in timers else None
            if name == "fusec_r1":
                ts[name].append(ctl.gather(mine)[0])
            else:
                ts[name].append(max(ctl.gather(mine)))
    for name, s in steps.items():
        if name != "tp_baseline":
            kernel = getattr(s.runner, "kernel", None)
            if kernel is not None and hasattr(kernel, "check"):
                kernel.check()
    t = {n: median(v) for n, v in ts.items()}
    kinds = ctl.gather({n: k for n, (_, k) in timers.items()})[0]

    rows = []
    for name in order:
        us = t[name]
        rows.append(dict(config=args.config_label, batch=batch, ranks=1 if name == "fusec_r1" else args.ranks,
                         variant=name, us=round(us, 1),
                         ratio_vs_r1=round(t["fusec_r1"] / us, 3) if "fusec_r1" in t else None,
                         ratio_vs_tp_baseline=round(t["tp_baseline"] / us, 3) if "tp_baseline" in t else None,
                         exposed_comm_fraction=round(exposed[name]["exposed_fraction"], 4) if name in exposed else None,
                         logits_rel_err=round(errs[name], 6) if name in errs else None,
                         ranks_identical=same.get(name), logits_rel_err_vs_rank_ref=rerrs.get(name), timer=kinds.get(name, "step"),
                         rounds_us=[round(x, 1) for x in ts[name]], pos=args.pos, backend=args.backend,
                         exposed=exposed.get(name), **({"detail": info[name]} if name in info else {}),
                         device=args.device_name, torch=torch.__version__, date=args.date))
    for name, e in errors.items():
        rows.append(dict(config=args.config_label, batch=batch, ranks=1 if name == "fusec_r1" else args.ranks,
                         variant=name, us=None, error=e, date=args.date))
    if rank == 0:
        print(f"  B={batch}: " + ", ".join(f"{n} {t[n]:.0f} us" for n in order), flush=True)
    timers.clear()
    steps.clear()        # frees the arenas and the baseline before the next batch
    return rows


# -- output ------------------------------------------------------------------------------------
def write_json(path: str, header: dict, rows: list[dict]) -> dict:
    """{"header", "rows"}, rows of other (config, batch, ranks, variant) already in the file kept."""
    old = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("rows", [])
        except (OSError, ValueError, AttributeError):
            old = []
    key = lambda r: (r.get("config"), r.get("batch"), r.get("ranks"), r.get("variant"))  # noqa: E731
    keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in keys] + rows
    merged.sort(key=lambda r: (str(r.get("config")), int(r.get("batch", 0)), VARIANTS.index(r["variant"])
                               if r.get("variant") in VARIANTS else 99))
    doc = {"header": header, "rows": merged}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(merged)} rows)", flush=True)
    return doc


def table(rows: list[dict]) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| config | B | variant | R | us | R=1 / this | TP baseline / this | exposed comm | logits rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("us") is None:
            lines.append(f"| {r['config']} | {r['batch']} | {r['variant']} | {r['ranks']} | failed: "
                         f"{str(r.get('error'))[:60]} | | | | |")
            continue
        ex = r.get("exposed_comm_fraction")
        lines.append(f"| {r['config']} | {r['batch']} | {r['variant']} | {r['ranks']} | {r['us']:.0f} | "
                     f"{f(r['ratio_vs_r1'], '.2f')}x | {f(r['ratio_vs_tp_baseline'], '.2f')}x | "
                     f"{'-' if ex is None else f'{ex * 100:.1f}%'} | {f(r['logits_rel_err'], '.1e')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap, cpu_batches="1,2", cpu_pos=15, cpu_rounds=1, cpu_reps=2,
                  moe_choices=("grouped", "dense", "gather"),
                  compile_help="compile the baseline (default on CUDA; the CPU default is eager: Inductor takes "
                               "minutes there)")
    ap.add_argument("--baseline-mode", default="auto", choices=("auto", "reduce-overhead", "default"),
                    help="torch.compile mode of the baseline (auto: reduce-overhead, else default)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--rank-ref", dest="rank_ref", action="store_true", default=None,
                    help="also compare fusec's R = 2 logits with run_step_ranks (the one-process multi-rank "
                         "reference) on rank 0 (default on the CPU; on CUDA it holds every rank's merged "
                         "weights once more on rank 0's GPU)")
    ap.add_argument("--no-rank-ref", dest="rank_ref", action="store_false")
    ap.add_argument("--no-profile", action="store_true", help="skip the exposed-communication profile builds")
    ap.add_argument("--json", default=None, help="result file (default docs/results/ranks.json on CUDA, none on the CPU)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: merge the rows of these result files (e.g. one device call per batch) into "
                         "--json (default docs/results/ranks.json); the last file's header is kept")
    args = ap.parse_args(argv)
    if args.merge:
        docs = []
        for path in args.merge:
            with open(path) as f:
                docs.append(json.load(f))
        rows = {}
        for d in docs:
            for r in d["rows"]:
                rows[(r.get("config"), r.get("batch"), r.get("ranks"), r.get("variant"))] = r
        doc = write_json(args.json or DEFAULT_JSON, docs[-1]["header"], list(rows.values()))
        print()
        print(table(doc["rows"]))
        return 0

    import torch.distributed as dist
    multicast_off()                                    # before NCCL or symmetric memory initialise
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --backend reference for the smoke run", file=sys.stderr)
        return 1
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    ctl = Ctl(dist.new_group(backend="gloo") if cuda else dist.group.WORLD, rank, size)
    args.ranks = size
    args.local_device = f"cuda:{local}" if cuda else "cpu"
    args.fusec_device = "cuda" if cuda else "cpu"     # fusec.compile(ranks=R) maps "cuda" to cuda:LOCAL_RANK
    resolve_step_args(args, cuda, parse_overrides)
    args.rank_ref = (not cuda) if args.rank_ref is None else args.rank_ref
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad} (have {', '.join(VARIANTS)})")
    args.device_name = (f"{size} x {torch.cuda.get_device_name(dev)}" if cuda
                        else f"{size} processes on {cpu_name()}")
    json_path = args.json or (DEFAULT_JSON if cuda else None)
    for k, v in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, k):
            setattr(torch._dynamo.config, k, v)

    cfg = bt.k3_config(args.config, args.overrides)
    graph, module = load_graph(model_path(), args.config, args.overrides)
    full = random_weights(graph, args.seed, getattr(module, "WEIGHT_INIT", ()), device=args.local_device)
    if rank == 0:
        print(f"{banner(args, torch.__version__)}, R = {size}; "
              f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
    rows, status = [], 0
    for b in args.batches:
        try:
            got = bench_batch(args, ctl, cfg, graph, full, b)
            rows += got
            if any(r.get("us") is None for r in got) or len(got) < len(args.variants):
                status = 1
        except Exception:
            traceback.print_exc()
            status = 1
        finally:
            free_batch_memory(cuda)
    if rank == 0 and rows:
        header = dict(device=args.device_name, torch=torch.__version__, date=args.date, ranks=size,
                      command="torchrun --nproc-per-node %d " % size + " ".join(
                          shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                          + (sys.argv[1:] if argv is None else list(argv))),
                      rounds=args.rounds, reps=args.reps, pos=args.pos, backend=args.backend,
                      baseline="benchmarks/baseline_tp.py (TP heads / EP experts / vocab-parallel lm_head, "
                               "functional collectives) " + ("under torch.compile(fullgraph=True, dynamic=False), "
                                                             "mode per row (detail.mode)" if args.compile else "eager"),
                      ratios="ratio_vs_r1 = fusec_r1 us / us, ratio_vs_tp_baseline = tp_baseline us / us "
                             "(above 1: this variant is faster)",
                      exposed_comm="profile build, second step: time a remote (system-scope) wait is pending while "
                                   "no row of the rank runs a body / the rank's step wall; the larger rank",
                      multicast={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                 "NVSHMEM_DISABLE_NVLS")})
        doc = write_json(json_path, header, rows) if json_path else {"header": header, "rows": rows}
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "ranks.json"), "w") as f:
                json.dump(doc, f, indent=1)
        print()
        print(table(rows))
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
