"""Time compile-time KernelPlan variants of one config's whole step against the default build.

    python benchmarks/plan_variants.py --config slice4-e128 --batch 16 \
        --variants "mma_tiles_per_unit=4;gemv_kw=2,mma_tiles_per_unit=4" [--reps 20] [--rounds 3]

The default build is `fusec.compile(..., backend="cute", device="cuda")` at position max_len - 1
(one step first, so the arena holds real routing). Each variant is a new compile of the same task
table over the same arena: first its logits are checked against the default build's from the
same state (the state is saved and restored around each step), then every build is timed as
CUDA-graph replays in interleaved rounds, the order rotated by one build each round (the same
order every round put each variant at the same place in it: a drift within a round then reads
as a difference); each round is the median of `reps` replays, and the row shows the median
round. `--control` adds the default plan built again as a variant: its row is the run's own
noise floor (build-to-build and order effects). The same thing as benchmarks/cute_speed.py's --plan-variants, but
without the profile build and the per-kind table, for one batch at a time when device time is
short. `--random-state` checks the logits from random state (MLA cache, KDA state) instead of the
fresh arena's zeros.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

import fusec
from _plan_args import plan_fields, timed_builds_parser  # benchmarks/_plan_args.py
from _timing import print_rounds, rotated_rounds  # benchmarks/_timing.py (this script's folder)


def main() -> None:
    ap = timed_builds_parser(__doc__, rounds=3)
    ap.add_argument("--variants", default="", help="';'-separated 'field=value[,field=value]' plan settings")
    ap.add_argument("--random-state", action="store_true",
                    help="fill the floating state (MLA latent cache, KDA state, conv windows) with random "
                         "values before the logits check: from a fresh arena the cache rows before the "
                         "position are zeros, so the check cannot see how a variant computes attention")
    args = ap.parse_args()
    from fusec.backends.cute.runtime import Megakernel
    from fusec.backends.cute.weight_tiles import (expert_mx_regions, expert_weight_regions, gemv_weight_regions,
                                                  set_tiled, tiled_rows)
    import fusec.models as m

    t0 = time.perf_counter()
    model = os.path.join(os.path.dirname(m.__file__), "kimi_k3.py")
    cute = fusec.compile(model, args.config, backend="cute", batch=args.batch, max_len=args.max_len, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {args.config} B={args.batch} built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    run = cute.runner
    g = torch.Generator().manual_seed(args.batch)
    tok = torch.randint(0, run.program.graph.outputs[0].type.shape[-1], (args.batch,), generator=g,
                        dtype=torch.int32).cuda()
    pos = torch.full((args.batch,), args.max_len - 1, dtype=torch.int32, device="cuda")
    run.run(tok, pos)
    run.check()
    if args.random_state:
        gs = torch.Generator(device="cuda").manual_seed(17)
        for n in run.state_names:
            st = run.mem.tensor(n)
            if st.is_floating_point():
                st.copy_(torch.randn(st.shape, device="cuda", generator=gs) * 0.5)
        print("  state: random (std 0.5)", flush=True)
    saved = {n: run.mem.tensor(n).clone() for n in run.state_names}

    def one_step(kernel):
        """Logits and next tokens of one step of `kernel` from the saved state (restored after)."""
        out = run.run(tok, pos, kernel=kernel)
        for n, t in saved.items():
            run.mem.tensor(n).copy_(t)
        return out

    # gemv_tiles / expert_tiles / expert_mx_mma variants read weights repacked into tiles (weight_tiles.py):
    # their GEMV rows carry GEMV_TILED, and the arena's weights are permuted in place to the
    # layout of the build about to run (a few tens of ms per switch, outside the timed replays).
    # The default build's own layout is weight_tiles.tile_options' choice (tiled at batch > 1).
    gemv_regions = gemv_weight_regions(run.lowered)[0]
    tiled_now: dict[str, int] = dict(run.mem.tiled)

    def regions_of(plan) -> dict[str, int]:
        out = dict(gemv_regions) if plan.gemv_tiles else {}
        if plan.expert_tiles:
            out.update(expert_weight_regions(run.lowered))
        if plan.expert_mx_mma:
            out.update(expert_mx_regions(run.lowered))
        return out

    def use_layout(want: dict[str, int]) -> None:
        for name in set(tiled_now) | set(want):
            if (name in tiled_now) != (name in want):
                set_tiled(run.lowered, run.mem, name, want.get(name, tiled_now.get(name)), name in want)
        torch.cuda.synchronize()
        tiled_now.clear()
        tiled_now.update(want)

    ref_logits, ref_next = one_step(run.kernel)[:2]
    builds = {"default": run.kernel}
    checks = {"default": ""}
    tiles_of = {"default": dict(run.mem.tiled)}
    wanted = [x for x in args.variants.split(";") if x] + (["default (rebuilt)"] if args.control else [])
    for v in wanted:
        kv = plan_fields(run.plan, v, "plan_variants") if v != "default (rebuilt)" else {}
        t1 = time.perf_counter()
        plan = dataclasses.replace(run.plan, **kv)
        plan = plan.with_tasks(tiled_rows(run.lowered, list(plan.tasks), gemv_regions if plan.gemv_tiles else {}))
        tiles_of[v] = regions_of(plan)
        mk = Megakernel(plan)
        use_layout(tiles_of[v])
        logits, nxt = one_step(mk)[:2]
        err = float((logits.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max())
        agree = int((nxt.flatten() == ref_next.flatten()).sum())
        checks[v] = f"logits rel err {err:.1e} vs default, next tokens {agree}/{nxt.numel()}"
        print(f"  {v}: built in {time.perf_counter() - t1:.1f} s, {checks[v]}", flush=True)
        builds[v] = mk
    graphs = {v: mk.capture_graph().replay for v, mk in builds.items()}
    times = rotated_rounds(graphs, args.rounds, args.reps, before=lambda v: use_layout(tiles_of[v]),
                           after=lambda v: builds[v].check())
    use_layout(tiles_of["default"])
    print_rounds(f"{args.config} B={args.batch}", times, checks)


if __name__ == "__main__":
    main()
