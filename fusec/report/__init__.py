"""`fusec report`: one self-contained HTML page (and its data as JSON) a reviewer can approve from.

    paths = build_report("models/kimi_k3.py", "tiny", out="report/")   # report.html, report.json

Sections, in page order (docs/report.md says how to read each):
  model      layers, ops, parameters, bytes a step reads            (sections.py)
  fusion     every group made and every refusal with its reason      (sections.py)
  sharding   the tp/ep plan and every collective                     (sections.py)
  schedule   tasks, events, per-SM load, the predicted timeline      (sections.py)
  proof      verifier rule by rule, random orders, PTX audit, prefetch (proof.py)
  numerics   logits against the fp32 reference, near-ties apart     (measure.py)
  speed      measured on a GPU only                                  (measure.py)
  versions   versions and the exact commands                         (measure.py)
The page needs no network: CSS is inline and plots are PNGs embedded as base64 (plots.py).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SECTION_IDS = ("model", "fusion", "sharding", "schedule", "proof", "numerics", "speed", "versions")


def build_report(model, config: str | None = None, overrides: dict | None = None, *, out, ranks: int = 1,
                 batch: int = 1, max_len: int = 4096, weights=None, device: str = "cpu", orders: int = 8,
                 orders_budget_s: float = 6.0, ptx_audit: bool = False, numerics_batches=(1, 4),
                 numerics_steps: int = 8, argv: list[str] | None = None) -> list[Path]:
    """Compile `model`, collect every section and write <out>/report.html and <out>/report.json."""
    from fusec.passes.options import Options
    from fusec.ir.verify import verify_graph
    from fusec.loader import load_graph
    from fusec.outputs import staged_dir, write_text
    from fusec.stats import graph_stats

    from . import measure, sections
    from .render import render_html

    seconds: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        seconds[name] = time.perf_counter() - t
        return r

    from fusec.api import check_device
    device = check_device(device)          # a missing GPU is one line now, not after the other sections
    graph, _ = load_graph(model, config, overrides)
    verify_graph(graph)
    opts = Options.from_env(ranks=ranks, batch=batch, max_len=max_len)
    prog, log_lines = timed("compile", sections.lower_logged, graph, opts)
    if prog.schedule is None:
        raise ValueError("the pipeline produced no schedule")
    # The numerics (torch) run in a second process beside the compile-side sections, whose
    # random orders are pure Python: a thread would not do, every torch op of the executor
    # would wait for the GIL the orders hold. Spawned, not forked: torch's thread pools and CUDA.
    nargs = (model, config, overrides, weights)
    nkw = dict(weight_bytes=graph_stats(graph).weight_bytes, device=device, batches=tuple(numerics_batches),
               steps=numerics_steps)
    t = time.perf_counter()
    if (os.cpu_count() or 1) > 1:
        import torch
        threads = torch.get_num_threads()
        # one core for this process's sections (the numeric random orders run torch too), the
        # others for the numerics: more threads than cores slows both several times over
        torch.set_num_threads(1)
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                numerics = pool.submit(measure.run_numerics, *nargs, **nkw, threads=max(1, os.cpu_count() - 1))
                secs = _sections(timed, graph, prog, log_lines, batch, max_len, orders, orders_budget_s, ptx_audit)
                result = numerics.result()
        finally:
            torch.set_num_threads(threads)
    else:
        secs = _sections(timed, graph, prog, log_lines, batch, max_len, orders, orders_budget_s, ptx_audit)
        result = measure.run_numerics(*nargs, **nkw)
    seconds["numerics (beside the sections above)" if (os.cpu_count() or 1) > 1 else "numerics"] = \
        result.get("seconds", time.perf_counter() - t)
    secs.append(measure.numerics_section(result))
    secs.append(timed("speed", measure.speed_section, model, config, graph, device=device, batch=batch))
    secs.append(measure.versions_section(argv, model, config, ranks, batch, seconds))
    assert tuple(s["id"] for s in secs) == SECTION_IDS
    title = f"{graph.name} (config {config or 'default'}, {ranks} rank{'s' if ranks > 1 else ''}, batch {batch})"
    subtitle = " | ".join(s["lead"].split(";")[0] for s in secs[:1]) + f" | device {device}"
    data = {"title": title, "model": str(model), "config": config, "overrides": overrides or {}, "ranks": ranks,
            "batch": batch, "max_len": max_len, "device": device,
            "sections": [{k: v for k, v in s.items() if k != "images"} | {"images": [i["caption"] for i in s["images"]]}
                         for s in secs]}
    out = Path(out)
    with staged_dir(out) as stage:
        write_text(stage / "report.html", render_html(title, subtitle, secs))
        write_text(stage / "report.json", json.dumps(data, indent=1, default=_jsonable) + "\n")
    return [out / "report.html", out / "report.json"]


def _sections(timed, graph, prog, log_lines, batch, max_len, orders, orders_budget_s, ptx_audit) -> list[dict]:
    from . import proof, sections
    return [timed("model", sections.model_section, graph, batch, max_len),
            timed("fusion", sections.fusion_section, prog, log_lines),
            timed("sharding", sections.sharding_section, prog, log_lines),
            timed("schedule", sections.schedule_section, prog, log_lines),
            timed("proof", proof.proof_section, prog, orders=orders, orders_budget_s=orders_budget_s, ptx=ptx_audit)]


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)
