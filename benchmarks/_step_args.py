"""The command line the whole-step benchmarks share (speed.py, ranks.py): which K3 config and
batches, at which position, on which device and fusec backend, how many timing rounds, the
baseline's MoE path and compile switch; and their defaults, which differ between a CUDA run and
the CPU smoke run; the run's header line and the cleanup between batches."""
from __future__ import annotations

import datetime
import platform


def add_step_args(ap, *, cpu_batches: str, cpu_pos: int, cpu_rounds: int, cpu_reps: int, moe_choices,
                  compile_help: str) -> None:
    """Add the shared options to the argparse parser `ap` (CPU defaults named in the help)."""
    ap.add_argument("--config", default=None, help="K3 config (default slice4-e128; tiny on the CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config field override")
    ap.add_argument("--batches", default=None, help=f"comma list (default 1,4,16; {cpu_batches} on the CPU)")
    ap.add_argument("--pos", type=int, default=None,
                    help=f"decode position; max_len = pos + 1 (default 4095; {cpu_pos} on the CPU)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (the smoke run)")
    ap.add_argument("--backend", default=None, help="fusec backend (default cute; reference on the CPU)")
    ap.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default 7; {cpu_rounds} on the CPU)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"calls per timer per round (default 20; {cpu_reps} on the CPU)")
    ap.add_argument("--moe", default="auto", choices=("auto",) + tuple(moe_choices), help="baseline MoE path")
    ap.add_argument("--seed", type=int, default=0, help="random weights seed")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help=compile_help)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.set_defaults(_cpu=(cpu_batches, cpu_pos, cpu_rounds, cpu_reps))


def resolve_step_args(args, cuda: bool, parse_overrides) -> None:
    """Fill the defaults of a CUDA or a CPU run into `args`; parse the overrides; add the config
    label and the date for the result header."""
    cpu_batches, cpu_pos, cpu_rounds, cpu_reps = args._cpu
    args.config = args.config or ("slice4-e128" if cuda else "tiny")
    args.batches = [int(b) for b in (args.batches or ("1,4,16" if cuda else cpu_batches)).split(",")]
    args.pos = args.pos if args.pos is not None else (4095 if cuda else cpu_pos)
    args.backend = args.backend or ("cute" if cuda else "reference")
    args.rounds = args.rounds or (7 if cuda else cpu_rounds)
    args.reps = args.reps or (20 if cuda else cpu_reps)
    args.compile = cuda if args.compile is None else args.compile
    args.overrides = parse_overrides(args.set)
    args.config_label = args.config + "".join(f" {k}={v}" for k, v in args.overrides.items())
    args.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def banner(args, torch_version: str) -> str:
    """The first words of a run's header line: device, torch, config, position, fusec backend and
    how the baseline runs (each script appends its own details)."""
    return (f"{args.device_name}, torch {torch_version}, {args.config_label}, position {args.pos}, "
            f"fusec backend {args.backend}, baseline {'compiled' if args.compile else 'eager'}")


def free_batch_memory(cuda: bool) -> None:
    """Between batches: drop Dynamo's compiled graphs and the batch's buffers, so the next batch
    compiles and allocates from a clean slate (one batch's CUDA graphs pin GBs)."""
    import gc

    import torch
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def cpu_name() -> str:
    return platform.processor() or platform.machine()
