"""The run-side sections of `fusec report`: numerics (logits against the fp32 reference over
batches x steps, routing near-ties apart), speed (GPU only) and versions with the commands.

Numerics reuse the golden machinery (fusec/testing/golden.py): the fp32 reference records every
step, the candidate is compared step by step with the same tolerances and near-tie rule as
`fusec golden check`. On a GPU with the cute extra the candidate is the megakernel; otherwise
it is the reference executor in bf16 (no kernel ran, and the page says so). A model whose
weights do not fit the CPU budget is not run on the CPU: its model file's `tiny` config stands
in, named as such.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import plots
from .sections import section, table

CPU_NUMERICS_BYTES = 1e9          # weights the CPU reference runs in seconds, not minutes


def _gpu(device: str | None) -> bool:
    return bool(device) and str(device).startswith("cuda")


def _have_cute() -> bool:
    from fusec.extras import MissingExtraError, require_cute
    try:
        require_cute()
        return True
    except MissingExtraError:
        return False


def numerics_subject(model, config, weight_bytes: float, device: str, weights) -> tuple[str | None, str]:
    """(config to run numerics on, or None to skip; a sentence saying what and why)."""
    if _gpu(device) or weight_bytes <= CPU_NUMERICS_BYTES:
        return config, ""
    gb = weight_bytes / 1e9
    if weights is not None:
        return None, (f"not run: the model has {gb:.1f} GB of weights and the checkpoint cannot stand in at a "
                      f"smaller size; run the report on a GPU (--device cuda)")
    from fusec.loader import list_configs
    try:
        configs, _ = list_configs(model)
    except ValueError:
        configs = {}
    if "tiny" in configs and config != "tiny":
        return "tiny", (f"config {config or 'default'} has {gb:.1f} GB of weights, more than the CPU reference runs "
                        f"in a report ({CPU_NUMERICS_BYTES / 1e9:.1f} GB): these numerics are for the same model "
                        f"file's `tiny` config, not for {config or 'the default config'}")
    return None, f"not run: {gb:.1f} GB of weights is beyond the CPU budget and the model has no `tiny` config"


def run_numerics(model, config, overrides, weights, *, weight_bytes: float, device: str, batches, steps: int,
                 threads: int | None = None) -> dict:
    """Record with the fp32 reference and check the candidate; plain data back (this runs in a
    second process beside the other sections; `threads`: torch's threads there)."""
    from fusec.testing import golden
    if threads:
        import torch
        torch.set_num_threads(threads)
    subject, why = numerics_subject(model, config, weight_bytes, device, weights)
    if subject is None and why:
        return {"ran": False, "why": why}
    gpu_kernel = _gpu(device) and _have_cute()
    backend = "cute" if gpu_kernel else "reference"
    where = device if _gpu(device) else "cpu"
    ovr = overrides if subject == config else None
    t0 = time.perf_counter()
    rec = golden.record(model, subject, overrides=ovr, weights=weights, batches=batches, steps=steps, device=where)
    v = golden.check(rec, backend=backend, device=where, precision="bf16", model=model, config=subject,
                     overrides=ovr, weights=None)
    what = ("the cute megakernel (bf16) on the GPU against the fp32 reference on the GPU" if gpu_kernel else
            "no GPU kernel ran: the reference executor in bf16 against itself in fp32, on the CPU"
            + ("" if not _gpu(device) else " (the cute extra is not installed)"))
    return {"ran": True, "subject": subject, "why": why, "what": what, "record": rec, "verdict": v,
            "steps": steps, "seconds": time.perf_counter() - t0}


def numerics_section(res: dict) -> dict:
    if not res["ran"]:
        sec = section("numerics", "Numerics", res["why"])
        sec["data"] = {"ran": False, "why": res["why"]}
        return sec
    rec, v, steps, what, why, subject = res["record"], res["verdict"], res["steps"], res["what"], res["why"], res["subject"]
    secs = res["seconds"]
    rows, series = [], {}
    for b in rec.batches:
        steps_x, errs, ties = [], [], []
        for s in range(steps):
            cs = [c for c in v.cells if c.batch == b and c.step == s]
            sharp = [c.err for c in cs if c.status in ("ok", "FAIL")]
            tie = [c for c in cs if c.status == "near-tie"]
            apart = [c for c in cs if c.status == "apart"]
            worst = max(sharp) if sharp else None
            rows.append([b, s, f"{worst:.2e}" if worst is not None else "-", len(sharp), len(tie), len(apart),
                         "FAIL" if any(c.status == "FAIL" for c in cs) else "ok"])
            if worst is not None:
                steps_x.append(s)
                errs.append(worst)
            ties += [(s, c.err) for c in tie]
        series[f"batch {b}"] = (steps_x, errs, ties)
    tie_rows = [[c.batch, c.step, c.row, f"{c.err:.2e}", c.note] for c in v.cells if c.status == "near-tie"]
    fail_rows = [[c.batch, c.step, c.row, f"{c.err:.2e}", c.note] for c in v.cells if c.status == "FAIL"]
    sharp_n = v.count("ok") + v.count("FAIL")
    stand_in = f" (config {subject} standing in: see the note)" if why else ""
    lead = (f"{'PASS' if v.ok else 'FAIL'}{stand_in}: {what}; {len(rec.batches)} batch sizes x {steps} steps; "
            f"{sharp_n} of {len(v.cells)} (step, sequence) pairs compared within {v.tol:g}, "
            f"{v.count('near-tie')} routing near-ties reported apart.")
    notes = [why] if why else []
    notes.append("A routing near-tie: the candidate picked other experts where the fp32 margin between the k-th and "
                 f"(k+1)-th expert was within {v.near_tie:g}; that sequence is reported apart from then on, not "
                 "compared (docs/golden.md).")
    facts = [("subject", f"{rec.meta['graph']} (config {subject or 'default'})"), ("candidate", what),
             ("tolerance", f"logits rel. L2 <= {v.tol:g} per sequence"), ("time", f"{secs:.1f} s")]
    tables = [table("logits against the fp32 reference: worst error per (batch, step) over sequences compared sharply",
                    ["batch", "step", "worst rel. err", "sharp", "near-ties", "apart", "verdict"], rows),
              table("routing near-ties (reported apart, not failures)", ["batch", "step", "sequence", "rel. err", "what"],
                    tie_rows or [["-", "-", "-", "-", "none"]])]
    if fail_rows:
        tables.insert(1, table("differences that are not near-ties (failures)",
                               ["batch", "step", "sequence", "rel. err", "what"], fail_rows))
    img = plots.numerics(series, v.tol, "logits error per step (worst sharp sequence); x: routing near-tie")
    sec = section("numerics", "Numerics", lead, facts=facts, tables=tables, images=[img], notes=notes)
    sec["data"] = {"ran": True, "subject": subject, "candidate": what, "verdict": v.to_dict(), "seconds": secs}
    return sec


def _speed_json() -> Path | None:
    p = Path(__file__).resolve().parents[2] / "docs" / "results" / "speed.json"
    return p if p.is_file() else None


def speed_section(model, config, graph, *, device: str, batch: int) -> dict:
    if not _gpu(device):
        sec = section("speed", "Speed", "not measured: this report ran without a GPU (--device cuda on a machine "
                      "with one measures the step; docs/performance.md holds the H200 numbers).")
        sec["data"] = {"measured": False}
        return sec
    p = _speed_json()
    rows = []
    if p is not None:
        doc = json.loads(p.read_text())
        rows = [r for r in doc.get("rows", []) if r.get("config") == config]
    if rows:
        kinds = [f"B={r['batch']}" for r in rows]
        hbm = float(doc["header"].get("hbm_tbps", 4.16)) * 1e12
        roof = [r["bytes"] / hbm * 1e6 for r in rows]
        img = plots.speed(kinds, [r["fusec_us"] for r in rows], roof, [r["baseline_us"] for r in rows],
                          f"{config}: measured step vs HBM roofline and baseline ({doc['header'].get('device')})")
        t = table(f"measured ({p.name}: {doc['header'].get('command')})",
                  ["batch", "fusec us", "baseline us", "ratio", "roofline fraction"],
                  [[r["batch"], r["fusec_us"], r["baseline_us"], r["ratio"], r["roofline_fraction"]] for r in rows])
        lead = (f"read from {p.name} ({doc['header'].get('device')}, {doc['header'].get('date')}): "
                + ", ".join(f"B={r['batch']} {r['fusec_us']:.0f} us ({r['ratio']:.2f}x the baseline)" for r in rows))
        sec = section("speed", "Speed", lead, tables=[t], images=[img])
        sec["data"] = {"measured": True, "source": str(p), "rows": rows}
        return sec
    return _measure(model, config, graph, device, batch)


def _measure(model, config, graph, device, batch) -> dict:
    """Time the megakernel step (CUDA events over repeated steps) against the HBM roofline."""
    import torch

    import fusec
    from fusec.passes.target import gpu_spec
    from fusec.stats import graph_stats
    if not _have_cute():
        sec = section("speed", "Speed", "not measured: the cute extra is not installed (pip install 'fusec[cute]')")
        sec["data"] = {"measured": False}
        return sec
    step = fusec.compile(model, config, backend="cute", batch=batch, max_len=64, device=device)
    tok = torch.zeros(batch, dtype=torch.int32, device=device)
    pos = torch.zeros(batch, dtype=torch.int32, device=device)
    for _ in range(3):
        step(tok, pos)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    a.record()
    for _ in range(reps):
        step.runner.run(tok, pos)
    b.record()
    torch.cuda.synchronize()
    us = a.elapsed_time(b) * 1e3 / reps
    st = graph_stats(graph, {"B": batch, "L": 64})
    roof = st.roofline_us(gpu_spec("h200"))
    img = plots.speed([f"B={batch}"], [us], [roof], None, "measured step vs HBM roofline (no baseline run)")
    sec = section("speed", "Speed", f"measured {us:.1f} us per step at batch {batch} (roofline {roof:.1f} us, "
                  f"{roof / us:.0%}); no baseline in this run", images=[img],
                  notes=["per-op-kind times need a profiled build; the schedule section has the predicted split"])
    sec["data"] = {"measured": True, "step_us": us, "roofline_us": roof, "batch": batch}
    return sec


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"{head}{' (with uncommitted changes)' if dirty else ''}" if head else "unknown (not a git checkout)"


def versions_section(argv: list[str] | None, model, config, ranks: int, batch: int, seconds: dict) -> dict:
    import torch

    from fusec import version
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    facts = [("fusec", version()), ("fusec source", _git()), ("python", platform.python_version()),
             ("torch", torch.__version__), ("numpy", _dist("numpy")), ("matplotlib", _dist("matplotlib")),
             ("jinja2", _dist("jinja2")), ("nvidia-cutlass-dsl", _dist("nvidia-cutlass-dsl")),
             ("machine", f"{platform.platform()}, {os.cpu_count()} CPUs"), ("GPU", gpu),
             ("generated", time.strftime("%Y-%m-%d %H:%M:%S %z"))]
    cmd = shlex.join(["fusec", *argv]) if argv is not None else shlex.join(sys.argv)
    m = shlex.quote(str(model))
    c = f" --config {shlex.quote(config)}" if config else ""
    commands = [["this report", cmd],
                ["the compile it reads", f"fusec compile {m}{c} --ranks {ranks} --batch {batch} -o out/"],
                ["the verifier alone", "fusec verify out/"],
                ["the pass log (every refusal)", f"FUSEC_LOG=all fusec compile {m}{c} --ranks {ranks} -o out/"],
                ["numerics as a golden test", f"fusec golden record {m}{c} -o golden/ && fusec golden check golden/"]]
    sec = section("versions", "Versions and commands", f"fusec {version()}; generated by `{cmd}`.", facts=facts,
                  tables=[table("reproduce", ["what", "command"], commands),
                          table("time per section", ["section", "s"], [[k, round(v, 2)] for k, v in seconds.items()])])
    sec["data"] = {"versions": dict(facts), "commands": dict(commands), "seconds": seconds}
    return sec
