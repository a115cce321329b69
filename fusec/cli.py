"""The `fusec` command line: compile, run, verify, simulate, configs, ops.

Every expected failure (a flag out of range, missing file, bad model, malformed .fir, bad or
poisoned checkpoint, non-finite logits, a pass or verifier error) prints one line
`fusec: error: ...` on stderr and exits 2; an unexpected one
prints `fusec: internal error: ...` and exits 70 (FUSEC_DEBUG=1 shows the traceback).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from fusec import version   # defined in fusec: the tools the CLI runs read it without importing the CLI


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `fusec: error: ...` and exit 2, no usage block."""

    def error(self, message):
        self.exit(2, f"fusec: error: {message} (`{self.prog} -h` lists the flags)\n")


def _int_at_least(minimum: int, what: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    conv.__name__ = what
    return conv


positive_int = _int_at_least(1, "an integer >= 1")
nonneg_int = _int_at_least(0, "an integer >= 0")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (models/kimi_k3.py), .fir file, or model name")
    p.add_argument("--config", help="named config of the model file (e.g. tiny, slice4; `fusec configs MODEL` "
                                    "lists them)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="fusec", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"fusec {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                            help="what to do (`fusec COMMAND -h` lists its flags)")

    c = sub.add_parser("compile", help="build, verify and lower a model; write .fir, schedule, report, trace")
    _add_model_args(c)
    c.add_argument("-o", "--out", default=None, help="output folder (default: out/<graph name>)")
    c.add_argument("--emit", default="all", choices=["fir", "all", "cute"],
                   help="fir: the canonical graph and summary only; all: also the lowered graph, "
                        "schedule, verifier report, trace and task graph; cute: all plus the CuTe "
                        "megakernel (.py, PTX, task table, audit) in <out>/cute")
    c.add_argument("--aot", action="store_true",
                   help="with --emit cute: also the sm_90a object and C header (export_to_c)")
    c.add_argument("--ranks", type=positive_int, default=1, help="GPUs to shard over (tensor + expert parallel; default 1)")
    c.add_argument("--batch", type=positive_int, default=1,
                   help="sequences per decode step (binds B) for the schedule and the summary (default 1)")
    c.add_argument("--max-len", type=positive_int, default=4096, help="cache capacity (binds L; default 4096)")
    c.add_argument("--passes", default="default", help="pipeline (default: all passes; graph: up to shard; none), a comma list of passes, "
                   "or -name,...: the default without those (-split_reduce: all-reduces whole)")
    c.add_argument("--print-ir-after-all", action="store_true", help="print the program after every pass")
    c.add_argument("--dump-dir", help="write every stage as re-parsable text here")
    c.add_argument("--schedule", default="gz", choices=["gz", "text"],
                   help="schedule file: gz (schedule.fsched.gz, default: 4 MB for the full K3) or text "
                        "(schedule.fsched, 55 MB); fusec verify reads both")
    c.add_argument("--trace", default="compact", choices=["compact", "full"],
                   help="trace.json: compact (one track per 16 SMs, one event per task family, a busy-SMs "
                        "counter) or full (one track per SM, one event per task; large for full K3)")

    r = sub.add_parser("run", help="generate tokens greedily")
    _add_model_args(r)
    r.add_argument("--steps", type=positive_int, default=8, help="decode steps to run (default 8)")
    r.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (default 1)")
    r.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random weights and prompt tokens (default 0)")
    r.add_argument("--backend", default="reference", choices=["reference", "cute"],
                   help="reference: torch executor; cute: the megakernel (needs the cute extra and an sm_90 GPU)")
    r.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="arithmetic of the step: bf16 as the kernel runs it, or fp32 (default bf16)")
    r.add_argument("--device", default=None,
                   help="torch device to run on: cpu, cuda or cuda:N (default cpu; cuda for --backend cute)")
    r.add_argument("--weights", help="checkpoint folder (default: random weights from --seed)")
    r.add_argument("--allow-nonfinite", action="store_true",
                   help="load a checkpoint holding NaN/Inf or 0xFF (NaN) mxfp4 scales instead of refusing it")
    r.add_argument("--ranks", type=positive_int, default=1,
                   help="processes to shard the step over, one rank each, started by torchrun (gloo on the CPU; "
                        "with cuda or --backend cute one GPU per rank, NCCL); default 1")

    v = sub.add_parser("verify", help="re-check a written schedule; exit 1 on any violation")
    v.add_argument("path", help="a schedule file (.fsched or .fsched.gz) or a `fusec compile` output folder")

    s = sub.add_parser("simulate", help="predict decode step time and tokens/s on many GPUs")
    _add_model_args(s)
    s.add_argument("--ranks", type=positive_int, action="append", help="rank counts (repeatable; default 8,16,64,72)")
    s.add_argument("--gpu", default="h200", choices=["h200", "gb300"], help="GPU to model (default h200)")
    s.add_argument("--batch", type=positive_int, action="append", help="batch sizes (repeatable; default 1, 8)")
    s.add_argument("--split", default="gated", choices=["gated", "on", "forced", "off", "both", "all"],
                   help="split_reduce (all-reduces cut into column parts): gated (default: where its cost gate "
                        "predicts a gain; `on` is the same), forced (every eligible one), off; both: gated and off rows; "
                        "all: gated, forced and off rows")

    k = sub.add_parser("configs", help="list the named configs of a model file")
    k.add_argument("model", help="model file (models/kimi_k3.py) or model name")

    sub.add_parser("ops", help="list the op registry")
    _add_report_parser(sub)
    _add_golden_parser(sub)
    return ap


def _add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page (and JSON) of evidence for a reviewer")
    _add_model_args(p)
    p.add_argument("-o", "--out", required=True, help="output folder (report.html, report.json)")
    p.add_argument("--ranks", type=positive_int, default=1, help="GPUs to shard over (default 1)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch of the schedule and figures (default 1)")
    p.add_argument("--max-len", type=positive_int, default=4096, help="cache capacity (binds L; default 4096)")
    p.add_argument("--weights", help="checkpoint folder for the numerics (default: random weights, seed 0)")
    p.add_argument("--device", default="cpu",
                   help="cpu (numerics: reference bf16 vs fp32; speed not measured) or cuda (the megakernel)")
    p.add_argument("--orders", type=positive_int, default=8,
                   help="randomized legal orders to run (default 8; stops early past a 6 s budget, at least 1)")
    p.add_argument("--ptx-audit", action="store_true",
                   help="compile the megakernel for sm_90a and audit its PTX (needs the cute extra; ~30 s)")


def _add_golden_parser(sub) -> None:
    g = sub.add_parser("golden", help="record a model's golden outputs, or check a compiled step against them")
    gs = g.add_subparsers(dest="golden_cmd", required=True, metavar="ACTION", help="record or check")
    r = gs.add_parser("record", help="fixed prompts, greedy tokens, fp32 reference logits and routing margins")
    _add_model_args(r)
    r.add_argument("-o", "--out", required=True, help="golden folder to write")
    r.add_argument("--update", action="store_true", help="replace an existing golden record (never done otherwise)")
    r.add_argument("--weights", help="checkpoint folder (default: random weights from --seed)")
    r.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random weights (default 0)")
    r.add_argument("--batch", type=positive_int, action="append", help="batch sizes (repeatable; default 1 and 4)")
    r.add_argument("--steps", type=positive_int, default=8, help="decode steps per batch (default 8)")
    r.add_argument("--device", default="cpu", help="device of the fp32 reference (default cpu)")
    c = gs.add_parser("check", help="compare a compiled step with a golden record; exit 1 on a difference")
    c.add_argument("golden", help="golden folder written by `fusec golden record`")
    c.add_argument("model", nargs="?", help="model to check (default: the one recorded); another model or "
                                            "config is refused")
    c.add_argument("--config", help="named config of MODEL")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field of MODEL (repeatable)")
    c.add_argument("--backend", default="reference", choices=["reference", "cute"],
                   help="reference: torch executor (fp32 unless --precision); cute: the megakernel (bf16)")
    c.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cpu; cuda for --backend cute)")
    c.add_argument("--precision", choices=["fp32", "bf16"], help="candidate arithmetic (default fp32; cute: bf16)")
    c.add_argument("--weights", help="check other weights (checkpoint folder) against the record")
    c.add_argument("--batch", type=positive_int, action="append", help="check only these recorded batch sizes")
    c.add_argument("--json", help="also write the verdict as JSON to this file")


def cmd_ops(args) -> int:
    from fusec.ir import REGISTRY
    for name in sorted(REGISTRY):
        d = REGISTRY[name]
        attrs = ", ".join(f"{k}:{a.kind.value}" for k, a in d.attrs.items())
        traits = ",".join(sorted(t.value for t in d.traits))
        # how the tile pass treats it: the family it anchors (tiling) and whether it may ride
        # on another op's tile as an epilogue
        tiling = f"tiling={d.tiling.value}" if d.tiling is not None else ""
        # and the rewrites the passes apply to it (canonicalize, split-sequence)
        rewrite = "rewritten by canonicalize" if d.rewrite is not None else ""
        split = f"seq-split={d.seq_split.partial}+{d.seq_split.combine}" if d.seq_split is not None else ""
        lower = ", ".join(x for x in (tiling, "" if d.tile_epilogue else "no-epilogue", rewrite, split) if x)
        print(f"{name}({', '.join(d.operands)}) -> {', '.join(d.results)}"
              f"{'  {' + attrs + '}' if attrs else ''}{'  [' + traits + ']' if traits else ''}"
              f"{'  <' + lower + '>' if lower else ''}")
        if d.doc:
            print(f"    {d.doc}")
    return 0


def cmd_compile(args) -> int:
    from fusec.compiler import compile_to_dir
    from fusec.loader import parse_overrides
    t0 = time.perf_counter()
    res = compile_to_dir(args.model, args.config, parse_overrides(args.set), out=args.out, emit=args.emit,
                         ranks=args.ranks, batch=args.batch, max_len=args.max_len, passes=args.passes,
                         print_ir_after_all=args.print_ir_after_all, dump_dir=args.dump_dir,
                         aot=args.aot, trace=args.trace, schedule=args.schedule)
    print(res.summary)
    for p in res.written:
        print(f"wrote {p}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_run(args) -> int:
    from fusec import launch
    if args.ranks > 1 and not launch.worker():    # the parent: torchrun starts the ranks (fusec/launch.py)
        return launch.launch(args.argv, args.ranks, args.backend, args.device)
    device = args.device or ("cuda" if args.backend == "cute" else "cpu")
    if args.ranks == 1:
        return _generate(args, device)
    device = launch.rank_device(args.ranks, args.backend, args.device)
    import torch.distributed as dist
    launch.init_worker(device)
    try:
        return _generate(args, device)
    finally:
        dist.destroy_process_group()


def _generate(args, device: str) -> int:
    import torch
    import fusec
    from fusec.loader import parse_overrides
    step = fusec.compile(args.model, args.config, backend=args.backend, batch=args.batch, seed=args.seed,
                         max_len=args.steps, device=device, precision=args.precision,
                         weights=args.weights, overrides=parse_overrides(args.set),
                         allow_nonfinite=args.allow_nonfinite, ranks=args.ranks)
    g = torch.Generator().manual_seed(args.seed)
    vocab = step.graph.outputs[0].type.shape[-1]
    tokens = torch.randint(0, vocab, (args.batch,), generator=g, dtype=torch.int32)
    out = step.generate(tokens, args.steps)
    if step.ranks > 1:
        from fusec.launch import check_same_tokens
        check_same_tokens(out, step.ranks)
        if step.rank:
            return 0      # rank 0 prints
    print(f"prompt tokens: {tokens.tolist()}")
    for s in range(args.steps):
        print(f"step {s}: {out[s].tolist()}")
    return 0


def cmd_configs(args) -> int:
    from fusec.loader import list_configs
    configs, default = list_configs(args.model)
    base = configs[default] if default in configs else None
    for name, cfg in configs.items():
        diff = _fields_unlike(cfg, base) if base is not None and name != default else ""
        print(f"{name}{' (default)' if name == default else ''}{': ' + diff if diff else ''}")
    return 0


def _fields_unlike(cfg, base) -> str:
    """`field=value` for each dataclass field of `cfg` that differs from `base` (the name aside)."""
    import dataclasses
    if not (dataclasses.is_dataclass(cfg) and type(cfg) is type(base)):
        return ""
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if f.name != "name" and getattr(cfg, f.name) != getattr(base, f.name))


def cmd_verify(args) -> int:
    from fusec.compiler import verify_file
    ok, text = verify_file(args.path)
    print(text)
    return 0 if ok else 1


def cmd_simulate(args) -> int:
    from fusec.loader import load_graph, parse_overrides
    from fusec.simulate import format_table, simulate
    g, _ = load_graph(args.model, args.config, parse_overrides(args.set))
    splits = {"on": ["gated"], "both": ["gated", "off"], "all": ["gated", "forced", "off"]}.get(args.split, [args.split])
    rows = [simulate(g, ranks=r, gpu=args.gpu, batch=b, split=sp) for r in (args.ranks or [8, 16, 64, 72])
            for b in (args.batch or [1, 8]) for sp in splits]
    print(format_table(rows))
    return 0


def cmd_report(args) -> int:
    from fusec.loader import parse_overrides
    from fusec.report import build_report
    t0 = time.perf_counter()
    paths = build_report(args.model, args.config, parse_overrides(args.set), out=args.out, ranks=args.ranks,
                         batch=args.batch, max_len=args.max_len, weights=args.weights, device=args.device,
                         orders=args.orders, ptx_audit=args.ptx_audit, argv=args.argv)
    for p in paths:
        print(f"wrote {p}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_golden(args) -> int:
    from fusec.loader import parse_overrides
    from fusec.testing import golden
    overrides = parse_overrides(args.set)
    if args.golden_cmd == "record":
        import shlex
        golden.refuse_overwrite(args.out, args.update)     # before minutes of work, not after
        rec = golden.record(args.model, args.config, overrides=overrides, weights=args.weights, seed=args.seed,
                            batches=args.batch or golden.DEFAULT_BATCHES, steps=args.steps, device=args.device,
                            command=shlex.join(["fusec", *args.argv]))
        for p in rec.save(args.out, update=args.update):
            print(f"wrote {p}")
        return 0
    device = args.device or ("cuda" if args.backend == "cute" else "cpu")
    if args.model is None and (args.config or overrides):
        raise ValueError("--config and --set name a model: give MODEL too (or leave all three out)")
    v = golden.check(golden.Golden.load(args.golden), backend=args.backend, device=device, precision=args.precision,
                     model=args.model, config=args.config, overrides=overrides, weights=args.weights,
                     batches=args.batch)
    print(v.text())
    if args.json:
        import json
        from fusec.outputs import write_text
        write_text(args.json, json.dumps(v.to_dict(), indent=1) + "\n")
    return 0 if v.ok else 1


COMMANDS = {"compile": cmd_compile, "run": cmd_run, "verify": cmd_verify, "simulate": cmd_simulate,
            "configs": cmd_configs, "ops": cmd_ops, "report": cmd_report, "golden": cmd_golden}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # the exact command, for what it records
    try:
        rc = COMMANDS[args.cmd](args)
        sys.stdout.flush()    # a closed pipe shows up here, not at exit
        return rc
    except BrokenPipeError:   # `fusec ops | head -1`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141            # 128 + SIGPIPE, as a tool killed by the signal would
    except KeyboardInterrupt:
        print("fusec: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, never a traceback (FUSEC_DEBUG=1 for the traceback)
        if os.environ.get("FUSEC_DEBUG"):
            raise
        expected = _expected_errors()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if _rank_worker():        # one of `fusec run --ranks`'s processes: say which (fusec/launch.py)
            msg = f"rank {os.environ['RANK']}: {msg}"
        if isinstance(e, expected):
            print(f"fusec: error: {msg}", file=sys.stderr)
            return 2
        print(f"fusec: internal error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 70


def _rank_worker() -> bool:
    from fusec.launch import worker
    return worker()


def _expected_errors() -> tuple[type, ...]:
    from fusec.ir.graph import GraphError
    from fusec.ir.parser import FirSyntaxError
    from fusec.ir.registry import OpError
    from fusec.loader import ModelError
    from fusec.extras import MissingExtraError
    from fusec.api import NonFiniteLogits
    errs = [OSError, FirSyntaxError, GraphError, OpError, ModelError, ValueError, MissingExtraError,
            NonFiniteLogits]
    try:
        from fusec.passes.manager import PassError
        errs.append(PassError)
    except ImportError:
        pass
    return tuple(errs)


if __name__ == "__main__":
    sys.exit(main())
