"""Whole decode steps on the CuTe megakernel vs the reference executor (GPU; not a test).

For each model (Llama tiny, Kimi K3 tiny when its lowering is complete) and batch 1 and 4:
  - fusec.compile(..., backend="cute", device="cuda") and backend="reference" on the GPU, bf16;
  - 8 consecutive decode steps, both fed the same fresh random tokens each step (teacher forcing:
    greedy feedback of random tiny weights tends to repeat one token, which would hide attention
    errors), so caches evolve identically; logits relative error per step and greedy-token agreement;
  - step wall time (run(): input copy + launch + error check, synchronizing) and the kernel
    alone replayed from a CUDA graph.
Then a planted missing signal (the embedding task's signal dropped) must raise
MegakernelTimeout within 1 s. Prints a table last.

    python benchmarks/cute_model.py [--steps 8] [--models llama,kimi_k3]
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
from fusec.backends.cute.workloads import rel_err

MODELS = {"llama": "llama.py", "kimi_k3": "kimi_k3.py"}


def model_path(name: str) -> str:
    import fusec.models as m
    return os.path.join(os.path.dirname(m.__file__), MODELS[name])


def compare(name: str, batch: int, steps: int, max_len: int = 16) -> dict:
    path = model_path(name)
    t0 = time.perf_counter()
    cute = fusec.compile(path, "tiny", backend="cute", batch=batch, max_len=max_len, device="cuda")
    t_compile = time.perf_counter() - t0
    ref = fusec.compile(path, "tiny", backend="reference", batch=batch, max_len=max_len, device="cuda")
    vocab = ref.graph.outputs[0].type.shape[-1]
    g = torch.Generator().manual_seed(1234 + batch)
    tok = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32).cuda()
    errs, agree = [], 0
    for s in range(steps):
        pos = torch.full((batch,), s, dtype=torch.int32, device="cuda")
        o_ref = ref(tok, pos)
        o_cu = cute(tok, pos)
        e = rel_err(o_cu.logits, o_ref.logits)
        errs.append(e)
        agree += int((o_cu.next_tokens.cpu() == o_ref.next_tokens.cpu()).sum())
        print(f"  {name} B={batch} step {s}: logits rel err {e:.2e}, tokens ref "
              f"{o_ref.next_tokens.tolist()} cute {o_cu.next_tokens.tolist()}", flush=True)
        tok = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32).cuda()
    run = cute.runner
    # Step wall time through the API (synchronizing error check included).
    pos = torch.full((batch,), steps - 1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        run.run(tok, pos)
    torch.cuda.synchronize()
    t_api = (time.perf_counter() - t0) / n * 1e6
    # Kernel alone: CUDA-graph replay.
    gr = run.kernel.capture_graph()
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(n):
        gr.replay()
    ev1.record()
    torch.cuda.synchronize()
    run.kernel.check()
    t_graph = ev0.elapsed_time(ev1) / n * 1e3
    # Reference step time for context.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        ref(tok, pos)
    torch.cuda.synchronize()
    t_ref = (time.perf_counter() - t0) / 5 * 1e6
    return dict(model=name, batch=batch, rows=len(run.plan.tasks), max_err=max(errs),
                agree=f"{agree}/{steps * batch}", compile_s=t_compile, api_us=t_api, graph_us=t_graph,
                ref_us=t_ref, ok=max(errs) < 2e-2)


def planted_missing_signal() -> dict:
    """Drop the embedding task's signal: every waiter on that event must time out, boundedly."""
    from fusec.backends.cute.plan import NO_EVENT
    from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout

    cute = fusec.compile(model_path("llama"), "tiny", backend="cute", batch=1, max_len=16, device="cuda")
    run = cute.runner
    tasks = list(run.plan.tasks)
    victim = next(i for i, t in enumerate(tasks) if t.signal_event == 0)
    tasks[victim] = dataclasses.replace(tasks[victim], signal_event=NO_EVENT)
    plan = dataclasses.replace(run.plan, tasks=tuple(tasks), spin_timeout_ns=100_000_000)
    mk = Megakernel(plan)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mk.step()
    msg = ""
    try:
        mk.check()
    except MegakernelTimeout as e:
        msg = str(e)
    dt = time.perf_counter() - t0
    print(f"  planted missing signal: {msg or 'NO ERROR'} ({dt * 1e3:.0f} ms)", flush=True)
    return dict(raised=bool(msg), seconds=dt, message=msg.split(";")[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", default="llama,kimi_k3")
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows, failures = [], []
    for name in args.models.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            try:
                rows.append(compare(name, b, args.steps))
            except Exception as e:  # report and go on: one table at the end
                traceback.print_exc()
                failures.append(f"{name} B={b}: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        planted = planted_missing_signal()
    except Exception as e:
        traceback.print_exc()
        planted = dict(raised=False, seconds=float("nan"), message=f"{type(e).__name__}: {e}")
    print("\n| model | B | rows | max logits rel err (8 steps) | greedy tokens equal | compile s | "
          "step via API us | kernel (graph replay) us | reference us | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} tiny | {r['batch']} | {r['rows']} | {r['max_err']:.2e} | {r['agree']} | "
              f"{r['compile_s']:.1f} | {r['api_us']:.0f} | {r['graph_us']:.1f} | {r['ref_us']:.0f} | "
              f"{'yes' if r['ok'] else 'NO'} |")
    for f in failures:
        print(f"| FAILED {f} |")
    print(f"\nplanted missing signal: raised={planted['raised']} after {planted['seconds'] * 1e3:.0f} ms: "
          f"{planted['message']}")
    ok = all(r["ok"] for r in rows) and not failures and planted["raised"] and planted["seconds"] < 1.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
