"""Time one op's split over its long operand (`OpDef.seq_split`, the tile pass) on and off, side by side.

    python benchmarks/ab_seq_split.py --config slice4 --batch 1 --op argmax [--rounds 5] [--control]
    python benchmarks/ab_seq_split.py --config slice4 --batch 1 --op mla_attention --min-rows 64,128
    python benchmarks/ab_seq_split.py --config slice4-e128 --batch 16 --registry attention_combine:split_rows=False

Two (three with --control) builds of the same config through `fusec.compile(..., backend="cute",
device="cuda")`: the default, and one compiled with the op's registry entry lacking its
`seq_split` (the op runs whole, as before the split existed; the entry is restored after that
compile). Same seeded weights, fresh state, the same tokens at position max_len - 1: the first
step's logits and next tokens of the two builds are compared (a split that changes numbers is a
bug). Then each build's megakernel is timed as CUDA-graph replays in interleaved rounds, the
order rotated by one build each round; a round is the median of `reps` replays, the row the
median round. --control builds the default a second time (its row is the run's noise floor).
`--min-rows N,M`: instead of the whole op, builds whose split has chunks of at least N (M, ...)
rows (`SeqSplit.min_rows`: fewer, longer chunks where the SMs would allow more).
`--registry op:field=value`: instead, one build with that field of the op's registry entry
replaced (a Python literal), e.g. the tiling of the split's combine.
The pipeline decision cannot be a KernelPlan field (the split changes the graph and the task
table), which is why plan_variants.py cannot time it.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import time

import torch

import fusec
from _plan_args import timed_builds_parser  # benchmarks/_plan_args.py
from _timing import print_rounds, rotated_rounds  # benchmarks/_timing.py (this script's folder)


def main() -> None:
    ap = timed_builds_parser(__doc__, rounds=5)
    ap.add_argument("--op", default="argmax", help="the op whose seq_split is turned off in the other build")
    ap.add_argument("--min-rows", default="", help="','-separated chunk minimums to build instead of the whole op")
    ap.add_argument("--registry", default="", help="'op:field=value': build with that registry field instead")
    args = ap.parse_args()
    from fusec.ir.registry import REGISTRY
    import fusec.models as m

    if args.op not in REGISTRY or REGISTRY[args.op].seq_split is None:
        raise SystemExit(f"ab_seq_split: error: op {args.op!r} has no seq_split")
    model = os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")

    def build(name: str):
        t0 = time.perf_counter()
        saved = REGISTRY[args.op]
        if name.endswith("whole"):
            REGISTRY[args.op] = dataclasses.replace(saved, seq_split=None)
        elif name.startswith("registry "):
            op, fv = name.split(" ", 1)[1].split(":", 1)
            field, value = fv.split("=", 1)
            saved = REGISTRY[op]
            REGISTRY[op] = dataclasses.replace(saved, **{field: ast.literal_eval(value)})
        elif name.startswith("min_rows="):
            rows = int(name.split("=")[1])
            REGISTRY[args.op] = dataclasses.replace(saved, seq_split=dataclasses.replace(saved.seq_split, min_rows=rows))
        try:
            f = fusec.compile(model, args.config, backend="cute", batch=args.batch, max_len=args.max_len,
                              device="cuda")
        finally:
            REGISTRY[saved.name] = saved
        ops = sum(op.opname == args.op for op in f.runner.program.graph.ops)
        print(f"  {name}: built in {time.perf_counter() - t0:.1f} s, "
              f"{ops} {args.op} op(s) left whole, {len(f.runner.plan.tasks)} rows", flush=True)
        return f

    others = ([f"registry {args.registry}"] if args.registry else
              [f"min_rows={r}" for r in args.min_rows.split(",") if r] or [f"{args.op} whole"])
    names = ["split (default)"] + others + (["split (rebuilt)"] if args.control else [])
    runs = {n: build(n).runner for n in names}
    g = torch.Generator().manual_seed(args.batch)
    vocab = next(iter(runs.values())).program.graph.outputs[0].type.shape[-1]
    tok = torch.randint(0, vocab, (args.batch,), generator=g, dtype=torch.int32).cuda()
    pos = torch.full((args.batch,), args.max_len - 1, dtype=torch.int32, device="cuda")
    outs = {}
    for n, run in runs.items():
        outs[n] = run.run(tok, pos)
        run.check()
    ref_logits, ref_next = outs[names[0]][:2]
    checks = {}
    for n, (logits, nxt) in ((n, o[:2]) for n, o in outs.items()):
        err = float((logits.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max())
        checks[n] = f"logits rel err {err:.1e}, next tokens {int((nxt == ref_next).sum())}/{nxt.numel()}"
    graphs = {n: run.kernel.capture_graph().replay for n, run in runs.items()}
    times = rotated_rounds(graphs, args.rounds, args.reps, after=lambda n: runs[n].kernel.check())
    print_rounds(f"{args.config} B={args.batch}", times, checks)


if __name__ == "__main__":
    main()
