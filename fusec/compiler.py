"""`fusec compile`: model -> verified graph -> pipeline -> schedule, and the files it writes.

Outputs (staged in a folder next to <out>, moved there once the whole compile succeeded):
  <name>.fir            the canonical graph as declared
  summary.txt           layers, ops, parameters, active parameters, bytes per step (at --batch)
  lowered.fir           the graph after the graph passes (fused, sharded)   [--emit all]
  schedule.fsched.gz    the static plan (tasks, families, events, queues), gzip; `fusec verify`
                        and `parse_schedule_file` read it as is; --schedule text: plain
                        schedule.fsched (55 MB for the full K3 instead of 4 MB)  [--emit all]
  verify.txt            the memory-order verifier report                     [--emit all]
  trace.json            predicted timeline (Perfetto / chrome://tracing): one track per 16 SMs
                        and one event per task family; --trace full: one event per task  [--emit all]
  tasks.dot             the fused task graph (Graphviz)                      [--emit all]
  cute/                 megakernel .py, its PTX, task table, memory plan, audit  [--emit cute]
                        (+ sm_90a .o/.h with --aot; fusec.backends.cute.emit)
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


from fusec.passes.options import Options
from fusec.ir.printer import print_graph
from fusec.ir.verify import verify_graph
from fusec.loader import load_graph
from fusec.extras import require_cute
from fusec.outputs import background, staged_dir, write_text
from fusec.stats import format_summary, graph_stats


TRACE_RANKS = 8


@dataclass
class CompileResult:
    summary: str
    written: list[Path] = field(default_factory=list)
    program: object = None


def compile_to_dir(model, config=None, overrides=None, *, out=None, emit="all", ranks=1, batch=1,
                   max_len=4096, passes="default", print_ir_after_all=False, dump_dir=None,
                   aot=False, trace="compact", schedule="gz") -> CompileResult:
    """Compile and write the outputs into `out` (default out/<graph name>).

    Everything is written into a staging folder next to `out` and moved there only once the
    whole compile succeeded: a failure leaves no empty or half-written folder, and an existing
    `out` is left as it was.
    """
    if emit == "cute":
        require_cute()                   # before minutes of lowering, not after
    graph, _ = load_graph(model, config, overrides)
    verify_graph(graph)
    out = Path(out) if out else Path("out") / graph.name
    with staged_dir(out) as stage:
        res = _compile_into(graph, stage, emit=emit, ranks=ranks, batch=batch, max_len=max_len,
                            passes=passes, print_ir_after_all=print_ir_after_all, dump_dir=dump_dir, aot=aot,
                            trace=trace, schedule=schedule)
    res.written = [out / p.relative_to(stage) for p in res.written]
    return res


def _compile_into(graph, out: Path, *, emit, ranks, batch, max_len, passes, print_ir_after_all, dump_dir,
                  aot, trace, schedule="gz") -> CompileResult:
    st = graph_stats(graph, {"B": 1, "L": max_len})
    st_batch = st if batch == 1 else graph_stats(graph, {"B": batch, "L": max_len})
    res = CompileResult(format_summary(graph, st, st_batch, batch, max_len))
    res.written.append(write_text(out / f"{graph.name}.fir", print_graph(graph)))
    res.written.append(write_text(out / "summary.txt", res.summary + "\n"))
    if emit == "fir":
        return res
    from fusec.passes.manager import gc_paused, parse_pipeline
    # Progress on stderr for a person at a terminal: a full-K3 compile spends seconds in the
    # tile, schedule and verify stages. The collector is paused while the schedule is built,
    # checked and written (see gc_paused).
    with gc_paused(), _progress(len(parse_pipeline(passes)) + 2) as bar:
        opts = Options.from_env(ranks=ranks, batch=batch, max_len=max_len,
                                print_ir_after_all=print_ir_after_all, dump_dir=dump_dir)
        prog = lower(graph, opts, passes, progress=bar, verify=False)
        res.program = prog
        # The outputs are printed from the program as the pipeline left it, which verification
        # only reads: a forked child writes them (about 2 s for the full K3) while this process
        # verifies (about 5 s), on the second core. verify.txt needs the verdict: written here.
        with background(lambda: write_schedule_files(prog, out, full_trace=trace == "full",
                                                     schedule=schedule)) as writer:
            final_verify(prog, opts)
            bar.update(1)
            bar.set_description("fusec: write outputs")
            res.written += writer.result()
        res.written += write_verify_report(prog, out)
        bar.update(1)
    res.summary += "\n" + schedule_summary(prog)
    if emit == "cute":
        if prog.schedule is None:
            raise ValueError("--emit cute needs a pipeline that ends with a schedule")
        from fusec.backends.cute.emit import emit_cute
        files, line = emit_cute(prog, out, aot=aot)
        res.written += files
        res.summary += "\n" + line
    return res


class _NoProgress:
    """What tqdm(disable=True) does: nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_description(self, desc):
        pass

    def update(self, n=1):
        pass


def _progress(total: int):
    """A tqdm bar on stderr when it is a terminal (tqdm's own disable=None test), else nothing:
    then tqdm, which a non-interactive compile does not need, is not imported (~30 ms)."""
    if hasattr(sys.stderr, "isatty") and not sys.stderr.isatty():
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, unit="stage", file=sys.stderr, disable=None, leave=False,
                bar_format="{desc:<24} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]")


def lower(graph, opts: Options, passes: str = "default", progress=None, verify: bool = True):
    """Run the pipeline on a copy of `graph`, then verify it (once at the end unless
    `opts.verify_each_pass`, which checks after every pass; `verify=False` leaves the final
    check to the caller: `final_verify`); dumps every stage when asked.
    `progress`: a tqdm bar advanced once per pass and once for the final verification."""
    from fusec.passes.manager import Program, parse_pipeline, run_pipeline
    names = parse_pipeline(passes)
    prog = Program(graph.copy(), opts)

    def on_stage(name, p):
        if progress is not None:
            i = names.index(name)
            progress.set_description(f"fusec: {names[i + 1] if i + 1 < len(names) else 'verify'}")
            progress.update(1)
        if not (opts.print_ir_after_all or opts.dump_dir):
            return                       # printing a full-K3 schedule costs seconds: only when asked
        text = stage_text(p)
        if opts.print_ir_after_all:
            print(f"// ----- after {name} -----\n{text}")
        if opts.dump_dir:
            idx = names.index(name)
            ext = "fsched" if p.schedule is not None else "fir"
            write_text(Path(opts.dump_dir) / f"{idx:02d}-{name}.{ext}", text)

    if progress is not None and names:
        progress.set_description(f"fusec: {names[0]}")
    run_pipeline(prog, names, on_stage)
    if verify:
        final_verify(prog, opts)
        if progress is not None:
            progress.update(1)
    return prog


def final_verify(prog, opts: Options) -> None:
    """The check after the pipeline (IR, task families, memory order), unless every pass was
    already checked (`opts.verify_each_pass`); PassError names the broken rule."""
    from fusec.passes.manager import PassError, verify_program
    if opts.verify_each_pass:
        return
    try:
        verify_program(prog)
    except ValueError as e:
        raise PassError(f"after the pipeline: {e}") from None


def lower_for_cute(graph, batch: int, max_len: int, sms: int | None = None):
    """Graph -> (program after the default pipeline, the cute backend's `Lowered`: memory plan and
    task table). The program is what `CuteRunner` receives; tests and benchmarks read both."""
    from fusec.backends.cute.lower import lower_schedule
    prog = lower(graph, Options.from_env(batch=batch, max_len=max_len, sms=sms))
    if prog.schedule is None:
        raise ValueError("the pipeline produced no schedule for the cute backend")
    return prog, lower_schedule(prog.schedule)


def stage_text(prog) -> str:
    """The printed stage: the graph, or from `tile` on the schedule (graph, tasks, families;
    events and queues once scheduled), which `--dump-dir` writes and `parse_schedule` re-reads."""
    if prog.schedule is not None:
        from fusec.ir.schedule_text import print_schedule
        return print_schedule(prog.schedule)
    return print_graph(prog.graph)


SCHEDULE_FILES = {"gz": "schedule.fsched.gz", "text": "schedule.fsched"}


def write_schedule_outputs(prog, out: Path, full_trace: bool = False, schedule: str = "gz") -> list[Path]:
    """Every [--emit all] output of a lowered program (verifying the schedule if that was not done)."""
    return write_schedule_files(prog, out, full_trace, schedule) + write_verify_report(prog, out)


def write_schedule_files(prog, out: Path, full_trace: bool = False, schedule: str = "gz") -> list[Path]:
    """lowered.fir, and once there is a schedule: the schedule, trace.json, tasks.dot."""
    written = [write_text(out / "lowered.fir", print_graph(prog.graph))]
    if prog.schedule is None:
        return written
    from fusec.ir.schedule_text import print_schedule
    from fusec.trace import chrome_trace, task_graph_dot
    written.append(write_text(out / SCHEDULE_FILES[schedule], print_schedule(prog.schedule)))
    # ranks of a replicated schedule run the same timeline: draw a few, not all 64
    trace = chrome_trace(prog.schedule, ranks=TRACE_RANKS, full=full_trace)
    written.append(write_text(out / "trace.json", json.dumps(trace, separators=(",", ":"))))
    written.append(write_text(out / "tasks.dot", task_graph_dot(prog.schedule)))
    return written


def write_verify_report(prog, out: Path) -> list[Path]:
    """verify.txt: the memory-order report of the final check (run here if it was not)."""
    if prog.schedule is None:
        return []
    from fusec.passes.memory_order import check_schedule
    report = prog.notes.get("memory_order") or check_schedule(prog.schedule)
    return [write_text(out / "verify.txt", format_report(report) + "\n")]


def format_report(report) -> str:
    head = (f"memory-order verifier (rules V1-V7): {'OK' if report.ok else 'FAILED'}; "
            + ", ".join(f"{k} {v}" for k, v in sorted(report.stats.items())))
    return "\n".join([head, *(str(e) for e in report.errors)])


def schedule_summary(prog) -> str:
    s = prog.schedule
    if s is None:
        return "no schedule (pipeline stopped before `schedule`)"
    from fusec.passes.cost import step_summary
    t = step_summary(s)["step_us"]
    return (f"schedule: {len(s.tasks)} tasks, {len(s.events)} events, {s.ranks} rank(s) x {s.sms} SMs; "
            f"predicted step {t:.1f} us at batch {s.dims['B']} ({1e6 / t:.1f} tok/s per sequence)")


def verify_file(path) -> tuple[bool, str]:
    """Re-check a schedule file, or the schedule of a `fusec compile` output folder."""
    from fusec.ir.schedule_text import parse_schedule_file
    from fusec.passes.memory_order import check_schedule
    rep = check_schedule(parse_schedule_file(schedule_path(path)))
    return rep.ok, format_report(rep)


def schedule_path(path) -> Path:
    """`path` itself if it is a file; <path>/schedule.fsched.gz or <path>/schedule.fsched if it
    is a folder (FileNotFoundError with what was looked for otherwise)."""
    p = Path(path)
    if p.is_dir():
        for name in SCHEDULE_FILES.values():
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p}: folder has no schedule.fsched(.gz) (it is written by "
                                f"`fusec compile` with --emit all or cute)")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such schedule file or output folder")
    return p
