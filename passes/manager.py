"""The pass manager: pipelines are data (lists of registered pass names).

A pass is a function `run(prog: Program) -> bool` (True when it changed something), registered
with `@register_pass(name)` in its own module `passes/<name>.py`; its docstring states what it
requires and ensures. With `verify_each_pass` the manager verifies the program after every pass
(IR rules, and the memory-order rules once a schedule exists) and checks the pass's "changed"
claim against the printed graph and schedule, naming the pass that broke either.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .options import Options, log
from fusec.ir.gc_pause import gc_paused
from fusec.ir.graph import Graph
from fusec.ir.schedule import Schedule


@dataclass
class Program:
    """What passes transform: the graph, then (from `tile` on) the schedule being built."""

    graph: Graph
    opts: Options
    schedule: Schedule | None = None
    notes: dict = field(default_factory=dict)   # facts passes leave for later passes and the report


PassFn = Callable[[Program], bool]
PASSES: dict[str, PassFn] = {}

PIPELINES: dict[str, list[str]] = {
    "default": ["canonicalize", "fuse", "shard", "tile", "split_reduce", "overlap", "schedule", "prefetch"],
    "graph": ["canonicalize", "fuse", "shard"],
    "none": [],
}


class PassError(RuntimeError):
    """A pass failed or left the program breaking a rule; the message names the pass."""


def register_pass(name: str):
    def deco(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise RuntimeError(f"pass {name} registered twice")
        PASSES[name] = fn
        fn.pass_name = name
        return fn
    return deco


def get_pass(name: str) -> PassFn:
    if name not in PASSES:
        try:
            importlib.import_module(f"fusec.passes.{name}")
        except ModuleNotFoundError:
            pass
    if name not in PASSES:
        raise PassError(f"unknown pass '{name}' (known: {', '.join(sorted(_all_pass_names()))})")
    return PASSES[name]


def _all_pass_names() -> list[str]:
    here = Path(__file__).parent
    return [p.stem for p in here.glob("*.py") if p.stem not in ("__init__", "manager") and not p.stem.startswith("_")]


def parse_pipeline(spec: str) -> list[str]:
    """`default`, a pipeline name, a comma list of pass names, or a comma list of `-name`s: the
    default pipeline without those passes (`-split_reduce`: every all-reduce whole)."""
    if spec in PIPELINES:
        return list(PIPELINES[spec])
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names and all(n.startswith("-") for n in names):
        drop = {n[1:] for n in names}
        for n in drop:
            get_pass(n)
        return [n for n in PIPELINES["default"] if n not in drop]
    for n in names:
        get_pass(n)
    return names


def verify_program(prog: Program) -> None:
    """Raise ValueError naming the broken rule (IR verifier; the task families from `tile` on;
    memory order once scheduled)."""
    from fusec.ir.schedule import check_families
    from fusec.ir.verify import verify_graph
    verify_graph(prog.graph)
    if prog.schedule is not None:
        check_families(prog.schedule)
    if prog.schedule is not None and prog.notes.get("scheduled"):
        from fusec.passes.memory_order import check_schedule
        report = check_schedule(prog.schedule)
        prog.notes["memory_order"] = report      # the report of the last stage, for the outputs
        if not report.ok:
            raise ValueError(report.first_error())


def _fingerprint(prog: Program) -> tuple[str, str]:
    """The printed graph and schedule: what a pass's "changed" claim is about (notes are not)."""
    from fusec.ir.printer import print_graph
    sched = ""
    if prog.schedule is not None:
        from fusec.ir.schedule_text import print_schedule
        sched = print_schedule(prog.schedule)
    return print_graph(prog.graph), sched


def run_pipeline(prog: Program, names: list[str], on_stage: Callable[[str, Program], None] | None = None) -> Program:
    with gc_paused():
        return _run_pipeline(prog, names, on_stage)


def _run_pipeline(prog: Program, names: list[str], on_stage) -> Program:
    timings = prog.notes.setdefault("pass_seconds", {})
    for name in names:
        fn = get_pass(name)
        before = _fingerprint(prog) if prog.opts.verify_each_pass else None
        t = time.perf_counter()
        try:
            changed = fn(prog)
        except PassError:
            raise
        except ValueError as e:
            raise PassError(f"pass {name} failed: {e}") from None
        timings[name] = time.perf_counter() - t
        log(prog.opts, "pass", f"{name}: {'changed' if changed else 'no change'} in {timings[name]:.3f}s")
        if prog.opts.verify_each_pass:
            try:
                verify_program(prog)
            except ValueError as e:
                raise PassError(f"after pass {name}: {e}") from None
            # the pass's own claim is checked too: "no change" must leave the printed graph and
            # schedule as they were, "changed" must have changed one of them
            if (_fingerprint(prog) != before) != bool(changed):
                raise PassError(f"pass {name} returned changed={bool(changed)}, but the printed graph and "
                                f"schedule {'changed' if not changed else 'did not change'}")
        if on_stage is not None:
            on_stage(name, prog)
    return prog
