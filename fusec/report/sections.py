"""The compile-side sections of `fusec report`: the model, fusion, sharding and the schedule.

Each function returns one section as plain data (`section(...)`): a one-line lead, facts,
tables and plots; `render.py` turns it into HTML and JSON. Everything is read from the
compiled program: the graph's figures (fusec.stats), the fusion groups left on the ops, the
pass log (every refusal with its reason, captured while the pipeline ran: `lower_logged`),
the shard plan and collectives, and the schedule with its predicted timeline (fusec.trace).
"""
from __future__ import annotations

import contextlib
import io
import re
from collections import Counter, defaultdict

from fusec.passes.cost import step_summary
from fusec.passes.target import gpu_spec
from fusec.ir.registry import Trait
from fusec.stats import graph_stats

from . import plots

_LOG = re.compile(r"^\[(\w+)\] (.*)$")
# how the passes phrase a refusal: "X not fused into Y: ...", "stays alone", "is not an epilogue"
_REFUSAL = re.compile(r"\bnot\b|stays alone")


def section(sid: str, title: str, lead: str, *, facts=(), tables=(), images=(), notes=()) -> dict:
    return {"id": sid, "title": title, "lead": lead, "facts": [list(f) for f in facts], "tables": list(tables),
            "images": list(images), "notes": list(notes)}


def table(caption: str, columns: list[str], rows: list[list], limit: int | None = None) -> dict:
    """A table; `limit` keeps the page readable (the JSON holds the full rows)."""
    return {"caption": caption, "columns": columns, "rows": rows, "shown": limit}


def lower_logged(graph, opts):
    """Run the default pipeline with every log channel on; (program, [(channel, message)]).
    The passes say each refusal and decision on their log channels (FUSEC_LOG): capturing them
    here is the same text a person gets with FUSEC_LOG=all."""
    from fusec.compiler import lower
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        prog = lower(graph, opts.replace(log=frozenset({"all"})))
    lines = []
    for line in buf.getvalue().splitlines():
        m = _LOG.match(line)
        if m:
            lines.append((m.group(1), m.group(2)))
    return prog, lines


def _mb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def model_section(graph, batch: int, max_len: int) -> dict:
    st1 = graph_stats(graph, {"B": 1, "L": max_len})
    stb = st1 if batch == 1 else graph_stats(graph, {"B": batch, "L": max_len})
    facts = [("graph", graph.name), ("ops", len(graph.ops)), ("weights", len(graph.weights())),
             ("state tensors", len(graph.states())),
             ("parameters", f"{_count(st1.params)} ({_mb(st1.weight_bytes)} of weights)"),
             ("active parameters per token (batch 1)", _count(st1.active_params)),
             (f"bytes a step reads (batch {batch}, context {max_len})",
              f"{_mb(stb.bytes_read)} (weights {_mb(stb.weight_bytes_read)}, state {_mb(stb.state_bytes)})"),
             (f"bytes a step writes (batch {batch})", _mb(stb.bytes_written)),
             (f"FLOPs per step (batch {batch})", f"{stb.flops / 1e9:,.2f} G")]
    layers = table("layers by kind (mixer + feed-forward)", ["kind", "layers"], [[k, n] for k, n in st1.layers.items()])
    ops = table(f"ops by kind (bytes and FLOPs per step at batch {batch})", ["op", "count", "bytes", "GFLOP"],
                [[k, int(v["count"]), _mb(v["bytes"]), round(v["flops"] / 1e9, 3)]
                 for k, v in sorted(stb.by_kind.items(), key=lambda kv: -kv[1]["bytes"])])
    img = plots.bar_chart({k: v["bytes"] / 1e6 for k, v in stb.by_kind.items()}, "MB per step",
                          f"bytes each op kind moves per step (batch {batch})")
    lead = (f"{graph.name}: {sum(st1.layers.values())} layers, {len(graph.ops)} ops, {_count(st1.params)} parameters; "
            f"a step at batch {batch} reads {_mb(stb.bytes_read)}.")
    data = {"params": st1.params, "active_params": st1.active_params, "weight_bytes": st1.weight_bytes,
            "bytes_read": stb.bytes_read, "weight_bytes_read": stb.weight_bytes_read, "bytes_written": stb.bytes_written,
            "flops": stb.flops, "layers": st1.layers, "ops": st1.ops}
    s = section("model", "Model", lead, facts=facts, tables=[layers, ops], images=[img])
    s["data"] = data
    return s


def fusion_section(prog, log_lines) -> dict:
    from fusec.passes.fuse import group_anchor
    groups: dict[str, list] = defaultdict(list)
    for op in prog.graph.ops:
        if op.group:
            groups[op.group].append(op)
    info = prog.notes.get("fusion_groups", {})
    rows = []
    for name, ops in groups.items():
        a = group_anchor(ops)
        gi = info.get(name, {})
        rows.append([name, f"{a.opname} %{a.outputs[0].name}", " ".join(o.opname for o in ops), len(ops),
                     ", ".join(gi.get("prologue", [])) or "-", ", ".join(gi.get("epilogue", [])) or "-",
                     gi.get("align", 1), ", ".join(gi.get("whole_row", [])) or "-"])
    refusals, decisions, cut = [], [], []
    for ch, m in log_lines:
        if ch not in ("fusion", "tile"):
            continue
        if m.startswith("shard: group "):
            cut.append(m.removeprefix("shard: "))
        elif m.startswith("shard:") or re.match(r"\d+ units, \d+ tasks$", m):
            continue                       # the shard plan is the next section; the unit count is a tally
        elif _REFUSAL.search(m):
            refusals.append(f"[{ch}] {m}")
        else:
            decisions.append(f"[{ch}] {m}")
    alone = Counter(op.opname for op in prog.graph.ops if not op.group)
    fused_ops = sum(len(v) for v in groups.values())
    lead = (f"{len(groups)} fusion groups hold {fused_ops} of {len(prog.graph.ops)} ops; "
            f"{len(refusals)} refusals with their reason; {len(cut)} groups split by a collective; "
            f"{len(decisions)} other fusion decisions (merged projections, cloned norms, split sequences).")
    tables = [table("every fusion group after the pipeline (anchor decides the tiling)",
                    ["group", "anchor", "ops", "n", "prologue", "epilogue", "align", "whole row"], rows),
              table("refusals: ops kept out of a group or out of a tile body, with the pass's reason "
                    "(as FUSEC_LOG=fusion,tile prints them)", ["refusal"],
                    [[m] for m in refusals] or [["none: every candidate the fuse and tile passes considered joined"]]),
              table("other fusion decisions: merged projections (canonicalize), cloned norms (fuse), split sequences "
                    "(tile)", ["decision"], [[m] for m in decisions] or [["none"]], 40),
              table("ops left in no group, by kind", ["op", "count"], [[k, n] for k, n in alone.most_common()])]
    if cut:
        tables.insert(2, table("groups the shard pass split at a collective", ["split"], [[m] for m in cut]))
    s = section("fusion", "Fusion", lead, tables=tables)
    s["data"] = {"groups": len(groups), "fused_ops": fused_ops, "refusals": refusals, "decisions": decisions,
                 "split_by_collective": cut}
    return s


def sharding_section(prog, log_lines=()) -> dict:
    R = prog.opts.ranks
    plan = prog.notes.get("shard", {"ranks": R, "tp": 1, "ep": 1})
    coll = [op for op in prog.graph.ops if Trait.collective in op.opdef.traits]
    dims = prog.opts.dims
    rows = [[op.opname, f"%{op.outputs[0].name}", op.attrs.get("ranks", "-"), op.attrs.get("stride", 1),
             _mb(op.outputs[0].type.nbytes(dims))] for op in coll]
    split = [v.name for v in prog.graph.params if "split" in prog.graph.param_attrs.get(v.name, {})]
    push = sum(1 for t in (prog.schedule.tasks if prog.schedule else []) if t.body_kind == "comm_push")
    by_kind = Counter(op.opname for op in coll)
    if R == 1:
        lead = "1 rank: nothing is sharded and the step has no collectives."
    else:
        groups = R // plan["tp"]
        lead = (f"{R} ranks: tensor parallel tp = {plan['tp']} ({groups} replica group{'s' if groups > 1 else ''}), expert parallel "
                f"ep = {plan['ep']}; {len(coll)} collectives (" + ", ".join(f"{n} {k}" for k, n in by_kind.items())
                + f"), {push} push tasks per rank.")
    facts = [("ranks", R), ("tp", plan.get("tp", 1)), ("ep", plan.get("ep", 1)), ("collectives", len(coll)),
             ("push tasks per rank", push), ("parameters split over ranks", f"{len(split)} of {len(prog.graph.params)}")]
    said = [m.removeprefix("shard: ") for ch, m in log_lines
            if ch == "fusion" and m.startswith("shard:") and not m.startswith("shard: group ")]
    tables = []
    if rows:
        tables.append(table(f"collectives in program order (bytes of each result, batch {dims['B']})",
                            ["op", "result", "group size", "stride", "bytes"], rows))
    if said:
        tables.append(table("the shard pass's decisions (degrees, ops run replicated, splits narrower than tp)",
                            ["decision"], [[m] for m in said], 40))
    s = section("sharding", "Sharding and collectives", lead, facts=facts, tables=tables,
                notes=[] if R > 1 else ["compile with --ranks R > 1 to see the shard plan"])
    s["data"] = {"ranks": R, "plan": plan, "collectives": [r[:4] for r in rows], "split_params": len(split)}
    return s


def schedule_section(prog, log_lines, gpu: str = "h200") -> dict:
    from fusec.trace import task_times
    s = prog.schedule
    summ = step_summary(s)
    times = task_times(s)
    rank0 = [t for t in s.tasks if t.rank == 0]
    load = defaultdict(float)
    for t in rank0:
        load[t.sm] += t.cost_us
    loads = [load.get(sm, 0.0) for sm in range(s.sms)]
    step_us = summ["step_us"]
    st = graph_stats(prog.graph, prog.opts.dims)
    roof = st.roofline_us(gpu_spec(gpu))
    busy = sum(loads) / (s.sms * step_us) if step_us else 0.0
    waits = sum(1 for t in s.tasks for i in t.instrs if i.kind.value == "wait")
    lead = (f"{len(s.tasks)} tasks ({len(rank0)} on rank 0), {len(s.events)} events, {s.ranks} rank(s) x {s.sms} SMs; "
            f"predicted step {step_us:.1f} us at batch {s.dims['B']} on {gpu} (per-rank roofline {roof:.1f} us); "
            f"SMs busy {busy:.0%} of the step.")
    facts = [("tasks", len(s.tasks)), ("events", len(s.events)), ("queues", len(s.queues)), ("waits", waits),
             ("predicted step", f"{step_us:.1f} us"), ("per-rank HBM roofline", f"{roof:.1f} us"),
             ("SM load (rank 0): min / mean / max", f"{min(loads):.1f} / {sum(loads) / len(loads):.1f} / {max(loads):.1f} us"),
             ("pass times", ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in prog.notes.get("pass_seconds", {}).items()))]
    body_rows = [[k, v["tasks"], round(v["sum_us"], 1)] for k, v in summ["by_body"].items()]
    decisions = [[ch, m] for ch, m in log_lines if ch in ("tile", "overlap", "schedule", "prefetch")]
    images = [plots.timeline(rank0, times, s.sms, step_us, f"predicted timeline, rank 0 (batch {s.dims['B']})"),
              plots.sm_load(loads, step_us, "predicted busy time per SM, rank 0")]
    sec = section("schedule", "Schedule", lead, facts=facts,
                  tables=[table("tasks by body kind (predicted busy time summed over tasks)",
                                ["body", "tasks", "busy us"], body_rows),
                          table("what the tile, overlap, schedule and prefetch passes said", ["pass", "message"],
                                decisions or [["-", "nothing logged"]], 40)],
                  images=images)
    sec["data"] = {"tasks": len(s.tasks), "events": len(s.events), "step_us": step_us, "roofline_us": roof,
                   "sm_load_us": [round(x, 3) for x in loads], "by_body": summ["by_body"]}
    return sec
