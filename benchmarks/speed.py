"""fusec against a careful torch.compile decode step of Kimi K3, side by side (issue 10; not a test).

    python benchmarks/speed.py [--config slice4-e128] [--batches 1,4,16] [--pos 4095]
    python benchmarks/speed.py --device cpu --backend reference      # smoke run, K3 tiny, no GPU

Per batch B, in one process and on the same random weights (one dict, shared):
  - fusec: `fusec.compile(model, config, backend="cute", device="cuda", batch=B,
    max_len=pos+1, weights=...)`; timed two ways: the kernel's CUDA-graph replay (when the
    runner exposes one: CuteRunner.kernel.capture_graph) and the public `step()` call;
  - the baseline: benchmarks/baseline_torch.py bound from the same weight dict, under
    `torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)`. Its MoE path is
    picked per batch by timing the candidates (`--moe auto`; see baseline_torch.moe_candidates).
    A compile failure, a graph break or a CUDA-graph skip ends the run with a non-zero exit:
    a baseline that silently fell back to eager would make fusec look fast;
  - the logits of one step from fresh state (same tokens, position `pos`) compared (max |diff|
    / max |fusec logits|; reported, not asserted: routing near-ties may pick other experts);
  - the ratio of the graph replay (`ratio`), and of the public calls: `step()` against the
    compiled baseline call, each alone (`ratio_step`) and in a decode loop (`ratio_loop`);
  - `rounds` interleaved rounds, the timers' order rotated by one each round; in each, every
    timer gives the median of `reps` calls (CUDA events, a sync after each call); the row
    reports the median over rounds;
  - the bytes a step must move (`step_bytes`): every non-expert weight except the embedding
    table, the embedding rows of the distinct tokens, per MoE layer the distinct experts fusec's
    router picked in the checked step times the bytes of one expert, every state read and
    written (KDA recurrent and conv state both ways; the MLA latent cache rows 0..pos read and
    one row written per sequence), the logits and tokens written; fraction of the roofline =
    bytes / time / 4.16 TB/s, for fusec's graph replay and for the baseline.
Writes `docs/results/speed.json` (on CUDA; `--json PATH` elsewhere), rows merged by (config,
batch) with the rows already there, and the same document to $OUT/speed.json when OUT is set.
Prints a markdown table last. Exit status: 0 when every batch ran, 1 when one failed, 2 when
the baseline could not be compiled as one CUDA graph.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_torch as bt  # noqa: E402  (benchmarks/baseline_torch.py)
from _step_args import add_step_args, banner, cpu_name, free_batch_memory, resolve_step_args  # noqa: E402
from _timing import median_us  # noqa: E402  (benchmarks/_timing.py)

import fusec  # noqa: E402
from fusec.loader import load_graph, parse_overrides  # noqa: E402
from fusec.weights import random_weights  # noqa: E402

HBM_TBPS = 4.16
LOOP = 8               # calls per timed decode loop (the *_loop timers)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(ROOT, "docs", "results", "speed.json")


def model_path() -> str:
    import fusec.models as m
    return os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")


# -- bytes a step must move ------------------------------------------------------------------
def moe_layers(graph) -> list[tuple[str, list]]:
    """(router ids value name, [expert weight Values]) per MoE layer, in graph order."""
    out: dict[str, list] = {}
    for op in graph.ops:
        if op.opname in ("moe_gate_up", "moe_down"):
            ws = out.setdefault(op.inputs[1].name, [])
            ws += [v for v in op.inputs[2:] if v not in ws]
    return list(out.items())


def step_bytes(graph, dims, tokens, positions, route_ids: dict) -> dict:
    """Bytes one decode step must move, by part (and "total").

    `graph`: the model graph (models/kimi_k3.py names); `dims`: {"B", "L"}; `tokens`,
    `positions`: the step's inputs [B]; `route_ids`: {ids value name: [B, topk] expert ids} for
    every MoE layer (what the router chose in this step). Parts:
      weights    every weight except the embedding tables and the routed expert stacks
      embedding  one table row per distinct token
      experts    per MoE layer: distinct experts in its ids x the bytes of one expert (w1+w3+w2)
      state_read / state_write
                 a state appended at `pos` (cache_append): rows 0..pos[b] read per sequence
                 and one row written; any other state (KDA recurrent, conv windows): read whole
                 and written whole
      io         tokens and positions read, the outputs (fp32 logits, tokens) written
    MXFP4 tensors count 4.25 bits per value (nibbles and E8M0 scales)."""
    tokens, positions = torch.as_tensor(tokens).reshape(-1), torch.as_tensor(positions).reshape(-1)
    experts = moe_layers(graph)
    stacked = {v.name for _, ws in experts for v in ws}
    tables = [op for op in graph.ops if op.opname == "embedding"]
    table_names = {op.inputs[0].name for op in tables}
    out = dict(weights=0.0, embedding=0.0, experts=0.0, state_read=0.0, state_write=0.0, io=0.0)
    for v in graph.weights():
        if v.name not in stacked and v.name not in table_names:
            out["weights"] += v.type.nbytes(dims)
    n_tok = int(torch.unique(tokens).numel())
    for op in tables:
        t = op.inputs[0].type
        out["embedding"] += n_tok * t.nbytes(dims) / t.concrete(dims)[0]
    missing = [n for n, _ in experts if n not in route_ids]
    if missing:
        raise ValueError(f"route ids missing for {missing}")
    for ids_name, ws in experts:
        n_exp = ws[0].type.concrete(dims)[0]
        per_expert = sum(w.type.nbytes(dims) for w in ws) / n_exp
        out["experts"] += per_expert * int(torch.unique(torch.as_tensor(route_ids[ids_name])).numel())
    producer = {o.name: op for op in graph.ops for o in op.outputs}
    for v in graph.states():
        full = v.type.nbytes(dims)
        op = producer.get(graph.updates[v.name].name) if v.name in graph.updates else None
        if op is not None and op.opname == "cache_append":
            b, cap = v.type.concrete(dims)[:2]
            row = full / (b * cap)
            out["state_read"] += row * float((positions.long() + 1).clamp(max=cap).sum())
            out["state_write"] += row * b
        else:
            out["state_read"] += full
            out["state_write"] += full if v.name in graph.updates else 0.0
    out["io"] = sum(v.type.nbytes(dims) for v in graph.params if v.kind.value == "io") + \
        sum(v.type.nbytes(dims) for v in graph.outputs)
    out["total"] = sum(out.values())
    return out


# -- fusec's router ids of the last step --------------------------------------------------------
class RouteRecorder:
    """Reference-executor hook: keeps each router's ids (by value name)."""

    def __init__(self):
        self.ids: dict[str, torch.Tensor] = {}

    def __call__(self, op, ins, outs):
        if op.opname == "router":
            self.ids[op.outputs[1].name] = outs[1].detach().clone()
        return outs


def cute_route_ids(run, graph) -> dict:
    """The ids each MoE layer's router wrote into the megakernel's arena in the last step, keyed
    by the model graph's ids names (matched by name, else by MoE-layer order)."""
    want = [n for n, _ in moe_layers(graph)]
    have = [n for n, _ in moe_layers(run.program.graph)]
    if set(want) <= set(have):
        pairs = [(n, n) for n in want]
    elif len(want) == len(have):
        pairs = list(zip(want, have))
    else:
        raise ValueError(f"cannot match the kernel's MoE layers {have} to the model's {want}")
    return {w: run.mem.tensor(h).detach().clone() for w, h in pairs}


# -- timing ------------------------------------------------------------------------------------
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


class BaselineCompileError(RuntimeError):
    """The baseline did not compile into one graph (or its CUDA graphs were skipped)."""


def baseline_fn(step, compile_: bool, cuda: bool):
    """A callable (tokens, positions) -> (logits, next) that keeps no reference to CUDA-graph
    memory between calls (outputs are cloned only by callers that keep them)."""
    if not compile_:
        return bt.step_call(step)
    try:
        cfn = bt.compile_step(step, mode="reduce-overhead" if cuda else "default")
    except Exception as e:
        raise BaselineCompileError(f"torch.compile setup failed: {type(e).__name__}: {e}") from e
    return bt.step_call(step, cfn, cuda)


def warm_baseline(fn, tok, pos, cuda: bool) -> float:
    """First calls (compile, CUDA-graph warm-up and recording); raises BaselineCompileError on a
    compile error or if Inductor skipped CUDA graphs. Returns seconds spent."""
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    t0 = time.perf_counter()
    try:
        for _ in range(3):
            fn(tok, pos)
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:
        raise BaselineCompileError(f"torch.compile(fullgraph=True) failed: {type(e).__name__}: {e}") from e
    if cuda and counters["inductor"]["cudagraph_skips"] != skips:
        raise BaselineCompileError("Inductor skipped CUDA graphs for the baseline (mode='reduce-overhead' "
                                   "ran without them); run with TORCH_LOGS=perf_hints for the reason")
    return time.perf_counter() - t0


# -- one batch ---------------------------------------------------------------------------------
def bench_batch(args, graph, cfg, weights, wmod, batch: int) -> dict:
    cuda = args.device.startswith("cuda")
    max_len = args.pos + 1
    dims = {"B": batch, "L": max_len}
    vocab = cfg.vocab
    g = torch.Generator().manual_seed(1000 + batch)
    tok = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32).to(args.device)
    posv = torch.full((batch,), args.pos, dtype=torch.int32, device=args.device)

    t0 = time.perf_counter()
    fstep = fusec.compile(model_path(), args.config, backend=args.backend, batch=batch, max_len=max_len,
                          device=args.device, weights=weights, overrides=args.overrides)
    build_s = time.perf_counter() - t0
    run = fstep.runner
    print(f"  B={batch}: fusec built in {build_s:.1f} s", flush=True)

    # baseline: the MoE candidates, each compiled and timed; the fastest is kept
    cands = bt.moe_candidates(cfg.expert_dtype, batch, cfg.topk, cfg.experts, args.device) if args.moe == "auto" \
        else [args.moe]
    tried = {}
    best = None
    for m in cands:
        step = bt.K3TorchStep(wmod, batch, max_len, moe=m)
        fn = baseline_fn(step, args.compile, cuda)
        secs = warm_baseline(fn, tok, posv, cuda)
        us = median_us(lambda: fn(tok, posv), args.reps, cuda)
        tried[m] = round(us, 1)
        print(f"    baseline moe={m}: first calls {secs:.1f} s, {us:.0f} us", flush=True)
        if best is None or us < best[2]:
            best = (m, step, us, fn, secs)
        else:
            step = fn = None   # drop the slower candidate's graphs before the next one compiles
    moe, step, _, fn, compile_s = best
    gc.collect()

    # one step from fresh state on both: logits, tokens, and fusec's router ids for the bytes
    fstep.reset()
    step.reset()
    if args.backend == "cute":
        out = fstep.step(tok, posv)
        lf, nf = out.logits, out.next_tokens
        ids = cute_route_ids(run, graph)
    else:
        rec = RouteRecorder()
        lf, nf = run.run(tok, posv, hook=rec)
        lf = lf.float()
        ids = rec.ids
    lb, nb = (t.clone() for t in fn(tok, posv))
    err = float((lb.float() - lf.float()).abs().max() / lf.float().abs().max().clamp_min(1e-30))
    agree = int((nb.cpu() == nf.cpu()).sum())
    nbytes = step_bytes(graph, dims, tok.cpu(), posv.cpu(), {k: v.cpu() for k, v in ids.items()})

    timers = {}
    kernel = getattr(run, "kernel", None)
    if kernel is not None and hasattr(kernel, "capture_graph"):
        cg = kernel.capture_graph()
        timers["fusec"] = cg.replay
    timers["fusec_step"] = lambda: fstep.step(tok, posv)
    timers["baseline"] = lambda: fn(tok, posv)
    # An engine's decode loop: LOOP calls back to back, one sync at the end (step() keeps one
    # step in flight, so its host work overlaps the GPU); reported per call.
    timers["fusec_step_loop"] = lambda: [fstep.step(tok, posv) for _ in range(LOOP)]
    timers["baseline_loop"] = lambda: [fn(tok, posv) for _ in range(LOOP)]
    ts = {k: [] for k in timers}
    order = list(timers)
    for r in range(args.rounds):
        # the order rotated by one timer a round: a drift within a round is not always charged
        # to the same side (benchmarks/plan_variants.py measured that bias, stop 25)
        for k in order[r % len(order):] + order[:r % len(order)]:
            ts[k].append(median_us(timers[k], args.reps, cuda) / (LOOP if k.endswith("_loop") else 1))
    if kernel is not None and hasattr(kernel, "check"):
        kernel.check()
    t = {k: median(v) for k, v in ts.items()}
    fusec_us = t.get("fusec", t["fusec_step"])
    total = nbytes["total"]
    row = dict(config=args.config_label, batch=batch, pos=args.pos, backend=args.backend,
               fusec_us=round(fusec_us, 1), fusec_step_us=round(t["fusec_step"], 1),
               fusec_step_loop_us=round(t["fusec_step_loop"], 1), baseline_loop_us=round(t["baseline_loop"], 1),
               fusec_graph=("fusec" in t), baseline_us=round(t["baseline"], 1),
               ratio=round(t["baseline"] / fusec_us, 3),
               # the public calls against each other: alone (a sync after each) and in a loop
               ratio_step=round(t["baseline"] / t["fusec_step"], 3),
               ratio_loop=round(t["baseline_loop"] / t["fusec_step_loop"], 3), bytes=int(total),
               roofline_fraction=round(total / (fusec_us * 1e-6) / (HBM_TBPS * 1e12), 4),
               fusec_step_roofline_fraction=round(total / (t["fusec_step"] * 1e-6) / (HBM_TBPS * 1e12), 4),
               baseline_roofline_fraction=round(total / (t["baseline"] * 1e-6) / (HBM_TBPS * 1e12), 4),
               bytes_by_part={k: int(v) for k, v in nbytes.items() if k != "total"},
               baseline_moe=moe, baseline_moe_us=tried, baseline_compiled=bool(args.compile),
               baseline_fp32_out_mm=bool(wmod.fp32_out), logits_max_rel_err=round(err, 6),
               next_tokens_agree=f"{agree}/{batch}", rounds_us={k: [round(x, 1) for x in v] for k, v in ts.items()},
               fusec_build_s=round(build_s, 1), baseline_first_calls_s=round(compile_s, 1),
               device=args.device_name, torch=torch.__version__, date=args.date)
    print(f"  B={batch}: fusec {fusec_us:.0f} us (step() {t['fusec_step']:.0f} us, in a loop "
          f"{t['fusec_step_loop']:.0f} us; baseline in a loop {t['baseline_loop']:.0f} us), baseline [{moe}] "
          f"{t['baseline']:.0f} us, baseline/fusec {row['ratio']:.2f}x; {total / 1e9:.3f} GB -> fusec "
          f"{row['roofline_fraction'] * 100:.0f}%, baseline {row['baseline_roofline_fraction'] * 100:.0f}% of "
          f"{HBM_TBPS} TB/s; logits rel err {err:.2e}, next tokens agree {agree}/{batch}", flush=True)
    timers = fstep = run = kernel = step = fn = None   # free both sides' GPU memory before the next batch
    return row


# -- output ------------------------------------------------------------------------------------
def write_json(path: str, header: dict, rows: list[dict], merge: bool) -> dict:
    """Write {"header", "rows"}; with `merge`, rows of other (config, batch) pairs already in the
    file are kept. Returns the document written."""
    old = []
    if merge and os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("rows", [])
        except (OSError, ValueError, AttributeError):
            old = []
    keys = {(r["config"], r["batch"]) for r in rows}
    merged = [r for r in old if (r.get("config"), r.get("batch")) not in keys] + rows
    merged.sort(key=lambda r: (str(r.get("config")), int(r.get("batch", 0))))
    doc = {"header": header, "rows": merged}
    dump_json(path, doc)
    return doc


def dump_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(doc['rows'])} rows)", flush=True)


def table(rows: list[dict]) -> str:
    lines = ["| config | B | fusec graph us | fusec step() us | step() in a loop | baseline us (MoE path) | "
             "baseline in a loop | baseline / fusec graph | baseline / step() | in a loop | GB moved | "
             "fusec % of 4.16 TB/s | baseline % | logits rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        graph_us = f"{r['fusec_us']:.0f}" if r["fusec_graph"] else "-"
        loop = lambda k: f"{r[k]:.0f}" if k in r else "-"  # noqa: E731
        ratio = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731  (rows from older runs lack it)
        lines.append(f"| {r['config']} | {r['batch']} | {graph_us} | {r['fusec_step_us']:.0f} | "
                     f"{loop('fusec_step_loop_us')} | {r['baseline_us']:.0f} ({r['baseline_moe']}) | "
                     f"{loop('baseline_loop_us')} | {r['ratio']:.2f}x | {ratio('ratio_step')} | {ratio('ratio_loop')} | "
                     f"{r['bytes'] / 1e9:.3f} | "
                     f"{r['roofline_fraction'] * 100:.0f}% | {r['baseline_roofline_fraction'] * 100:.0f}% | "
                     f"{r['logits_max_rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap, cpu_batches="1,4", cpu_pos=31, cpu_rounds=3, cpu_reps=5, moe_choices=bt.MOE_IMPLS,
                  compile_help="compile the baseline (default on CUDA; on the CPU: Inductor, no CUDA graphs)")
    ap.add_argument("--cdt", action="store_true", help="Inductor coordinate-descent tuning of the baseline's "
                    "Triton kernels (the GEMV reductions: what gpt-fast enables); longer compiles")
    ap.add_argument("--json", default=None, help=f"result file (default {os.path.relpath(DEFAULT_JSON, ROOT)} "
                    "on CUDA, none on the CPU)")
    ap.add_argument("--no-merge", action="store_true", help="overwrite the result file instead of merging rows")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --backend reference for the smoke run", file=sys.stderr)
        return 1
    resolve_step_args(args, cuda, parse_overrides)
    args.device_name = torch.cuda.get_device_name() if cuda else cpu_name()
    json_path = args.json or (DEFAULT_JSON if cuda else None)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64       # one compile per batch and MoE candidate
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 1024

    if args.cdt:
        import torch._inductor.config as inductor_config
        inductor_config.coordinate_descent_tuning = True
    cfg = bt.k3_config(args.config, args.overrides)
    graph, module = load_graph(model_path(), args.config, args.overrides)
    weights = random_weights(graph, args.seed, getattr(module, "WEIGHT_INIT", ()), device=args.device)
    wmod = bt.K3Weights(cfg, weights, share=True, graph=graph)
    header = dict(device=args.device_name, torch=torch.__version__, date=args.date,
                  command="python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                                               + (sys.argv[1:] if argv is None else list(argv))),
                  hbm_tbps=HBM_TBPS, rounds=args.rounds, reps=args.reps, pos=args.pos, backend=args.backend,
                  baseline=(f"benchmarks/baseline_torch.py under torch.compile(mode="
                            f"'{'reduce-overhead' if cuda else 'default'}', fullgraph=True, dynamic=False)")
                  if args.compile else "benchmarks/baseline_torch.py eager",
                  inductor_cdt=bool(args.cdt), fp32_out_mm=bool(wmod.fp32_out), grouped_mm=bt.grouped_mm_available(args.device))
    print(f"device {banner(args, torch.__version__)} "
          f"(fp32-out matmul: {wmod.fp32_out}, torch._grouped_mm: {bt.grouped_mm_available(args.device)})", flush=True)

    rows, status = [], 0
    for b in args.batches:
        try:
            rows.append(bench_batch(args, graph, cfg, weights, wmod, b))
        except BaselineCompileError as e:
            traceback.print_exc()
            print(f"ERROR: the baseline did not compile as one CUDA graph at B={b}: {e}", file=sys.stderr, flush=True)
            status = 2
            break
        except Exception:
            traceback.print_exc()
            status = max(status, 1)
        finally:
            free_batch_memory(cuda)
    if rows:
        doc = write_json(json_path, header, rows, not args.no_merge) if json_path else {"header": header, "rows": rows}
        if os.environ.get("OUT"):   # the GPU machine returns only files under $OUT
            dump_json(os.path.join(os.environ["OUT"], "speed.json"), doc)
        print()
        print(table(rows))
    return status if rows or status else 1


if __name__ == "__main__":
    sys.exit(main())
