"""`fusec compile --emit cute`: the megakernel of a compiled program, as files.

Writes into the output folder (CPU only; CUTE_DSL_ARCH=sm_90a is set for the compile):
  cute/<kernel>.py        the generated CuTe DSL module (what `cute.compile` traced)
  cute/<kernel>.ptx       its PTX for sm_90a (the file the memory-order audit read)
  cute/task_table.txt     rows per CTA queue; addresses as arena byte offsets (no device pointers);
                          a multi-rank schedule writes task_table.rank<r>.txt for every rank r
                          (one kernel serves them all: its source depends on R, not on the rank)
  cute/memory_plan.txt    arena regions and views, and the weight regions the kernel reads as
                          16-row tiles (weight_tiles.tile_options: batch > 1)
  cute/audit.txt          PTX audit (P1-P3) summary and violations, compile time
  cute/<kernel>.h / .o    with aot=True: `export_to_c` header and sm_90a object
"""
from __future__ import annotations

import os
import pathlib
import shutil
import time


def _write_text(path: pathlib.Path, text: str) -> pathlib.Path:
    # Plain writes: `fusec compile` stages the whole output folder and moves it in only once
    # everything is written (fusec.outputs.staged_dir), so a failure leaves no half of it.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def emit_cute(prog, out, *, aot: bool = False) -> tuple[list[pathlib.Path], str]:
    """Lower `prog.schedule`, compile for sm_90a, audit; returns (written files, one-line summary)."""
    from .codegen import DEFAULT_ARCH, compile_plan
    os.environ.setdefault("CUTE_DSL_ARCH", DEFAULT_ARCH)
    from .lower import lower_ranks
    from .ptx_audit import audit_dir

    out = pathlib.Path(out) / "cute"
    from .weight_tiles import expert_mx_regions, expert_weight_regions, gemv_weight_regions, tile_options

    lows = lower_ranks(prog.schedule)
    low = lows[0]
    opts = tile_options(low, None)      # the options CuteRunner builds with: this is the kernel that runs
    plan = low.plan(base=0, **opts)
    tiled = {**(gemv_weight_regions(low)[0] if plan.gemv_tiles else {}),
             **(expert_weight_regions(low) if plan.expert_tiles else {})}
    for other in lows[1:]:
        other.plan(base=0)                    # every rank's packed table through the table verifier
    build = out / "build"
    if build.exists():
        shutil.rmtree(build)
    t0 = time.perf_counter()
    compiled, module, dump = compile_plan(plan, build, keep_ptx=True)
    secs = time.perf_counter() - t0
    rep = audit_dir(dump, expect_signals=any(t.signal_event >= 0 for t in plan.tasks))
    written = []
    stem = plan.name
    written.append(_write_text(out / f"{stem}.py", module.read_text()))
    ptx = sorted(dump.rglob("*.ptx"))
    written.append(_write_text(out / f"{stem}.ptx", "\n".join(p.read_text() for p in ptx)))
    if len(lows) == 1:
        written.append(_write_text(out / "task_table.txt", low.table_text() + "\n"))
    else:
        written += [_write_text(out / f"task_table.rank{lw.rank}.txt", lw.table_text() + "\n") for lw in lows]
    # A binder must repack these regions as weight_tiles.tile does before the kernel runs.
    mx = expert_mx_regions(low) if plan.expert_mx_mma else {}
    tiles = "".join(f"# weight region {n} (K {k}) in 16x32 tiles (weight_tiles.tile)\n" for n, k in sorted(tiled.items()))
    tiles += "".join(f"# weight region {n} and {n}.scale (K {k}) in MXFP4 tiles (weight_tiles.mx_tile)\n"
                     for n, k in sorted(mx.items()))
    written.append(_write_text(out / "memory_plan.txt", low.memory.describe() + "\n" + tiles))
    audit = "\n".join([rep.summary(), *("  " + v for v in rep.violations),
                       f"bodies: {', '.join(o.name for o in plan.opcodes)}",
                       f"cpu compile (sm_90a, ptxas): {secs:.1f} s"])
    written.append(_write_text(out / "audit.txt", audit + "\n"))
    if aot:
        compiled.export_to_c(file_path=str(out), file_name=stem, function_prefix=stem)
        written += sorted(p for p in out.iterdir() if p.suffix in (".h", ".o"))
    shutil.rmtree(build, ignore_errors=True)
    if not rep.ok:
        raise ValueError(f"cute: PTX audit failed for {stem}: {rep.violations[0]}")
    ranks = f" per rank, {len(lows)} ranks" if len(lows) > 1 else ""
    return written, (f"cute: {len(plan.tasks)} task rows on {plan.num_ctas} CTAs{ranks}, bodies "
                     f"{', '.join(o.name for o in plan.opcodes)}; compiled for sm_90a in {secs:.1f} s; "
                     f"{rep.summary()}")
