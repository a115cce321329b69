"""The reference executor's decode step of Kimi K3 `slice4`, eager and under
torch.compile(mode="reduce-overhead") (H200; not a test). Same random weights for both.

    python benchmarks/reference_compile.py [--batch 1] [--max-len 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

import fusec
from _timing import median_us  # benchmarks/_timing.py (this script's folder)
from fusec.backends.reference.executor import execute


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="slice4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args(argv)
    import fusec.models as m
    step = fusec.compile(os.path.join(os.path.dirname(m.__file__), "kimi_k3.py"), args.config,
                         batch=args.batch, max_len=args.max_len, device="cuda")
    ref = step.runner
    g, dims, names = ref.graph, ref.dims, [v.name for v in ref.graph.states()]
    tok = torch.zeros(args.batch, dtype=torch.int32, device="cuda")
    pos = torch.full((args.batch,), args.max_len - 1, dtype=torch.int32, device="cuda")
    eager = median_us(lambda: ref.run(tok, pos), 5)
    print(f"eager: {eager:.0f} us per step", flush=True)

    def fn(tokens, positions, *state):
        env = execute(g, ref.weights, dict(zip(names, state)), {"tokens": tokens, "pos": positions}, dims)
        return [env[v.name] for v in g.outputs]
    try:
        t0 = time.perf_counter()
        cfn = torch.compile(fn, mode="reduce-overhead")
        st = [ref.state[n] for n in names]
        for _ in range(3):
            cfn(tok, pos, *st)
        torch.cuda.synchronize()
        print(f"torch.compile(mode='reduce-overhead'): compile + 3 warm-up steps {time.perf_counter() - t0:.0f} s",
              flush=True)
        print(f"compiled: {median_us(lambda: cfn(tok, pos, *st), 10):.0f} us per step", flush=True)
    except Exception as e:
        traceback.print_exc()
        print(f"compiled: failed ({type(e).__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
