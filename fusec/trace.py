"""Timeline and graph pictures of a schedule.

`chrome_trace(schedule)` -> a Chrome trace-event JSON object that Perfetto (ui.perfetto.dev)
and chrome://tracing open: one "X" (complete) event per task at its predicted start, with
pid = rank, tid = SM (one track per SM per rank), ts / dur in microseconds. Start times are
replayed from the queues and the waits with the same rules as the list scheduler (a task starts
when its SM is free and every family it waits on has finished), so the picture shows exactly
the prediction. Replicated schedules are drawn for every rank (`ranks` caps how many).

`task_graph_dot(schedule)` -> Graphviz DOT of the task families: one node per family (its ops,
task count, body), one edge per event wait.
"""
from __future__ import annotations

import json
from collections import defaultdict

from fusec.ir.schedule import InstrKind, Schedule


def task_times(s: Schedule) -> dict[int, tuple[float, float]]:
    """Predicted (start, end) of every rank-0 task, replaying queues and waits (see above)."""
    signallers: dict[int, list[int]] = defaultdict(list)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and i.peer is None:
                signallers[i.event].append(t.id)
    # an event signalled by peers (collectives) is ready when our own copy of the signalling
    # family is: ranks run the same schedule
    peer_sig: dict[int, list[int]] = defaultdict(list)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and i.peer is not None:
                peer_sig[i.event].append(t.id)
    # per event: how many of its signalling tasks have finished, and the latest finish
    src_of = {e: (signallers.get(e) or peer_sig.get(e, [])) for e in set(signallers) | set(peer_sig)}
    feeds: dict[int, list[int]] = defaultdict(list)
    for e, src in src_of.items():
        for x in src:
            feeds[x].append(e)
    done_n: dict[int, int] = defaultdict(int)
    done_at: dict[int, float] = defaultdict(float)
    out: dict[int, tuple[float, float]] = {}
    pos = {k: 0 for k in s.queues}
    free = {k: 0.0 for k in s.queues}
    remaining = sum(len(q) for q in s.queues.values())
    while remaining:
        progressed = False
        for k, q in s.queues.items():
            while pos[k] < len(q):
                t = s.tasks[q[pos[k]]]
                ready = free[k]
                ok = True
                for i in t.instrs:
                    if i.kind is not InstrKind.WAIT or not i.threshold:
                        continue
                    if done_n[i.event] < len(src_of.get(i.event, ())):
                        ok = False
                        break
                    ready = max(ready, done_at[i.event])
                if not ok:
                    break
                end = ready + t.cost_us
                out[t.id] = (ready, end)
                for e in feeds.get(t.id, ()):
                    done_n[e] += 1
                    done_at[e] = max(done_at[e], end)
                free[k] = end
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("trace: the queues deadlock (a wait's signallers never run)")
    return out


def chrome_trace(s: Schedule, ranks: int | None = None) -> dict:
    times = task_times(s)
    shown = min(s.ranks, ranks or s.ranks) if s.replicated else 1
    ev = []
    for r in range(shown):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for (_, sm) in sorted(s.queues):
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": sm, "args": {"name": f"SM {sm}"}})
        for t in s.tasks:
            st, en = times[t.id]
            ev.append({"ph": "X", "name": t.body_kind, "cat": t.body_kind, "pid": r if s.replicated else t.rank,
                       "tid": t.sm, "ts": round(st, 3), "dur": round(en - st, 3),
                       "args": {"task": t.id, "ops": list(t.ops), "tile": [list(b) for b in t.tile]}})
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "otherData": {"predicted_step_us": s.meta.get("predicted_step_us", "")}}


def write_chrome_trace(s: Schedule, path: str, ranks: int | None = None) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(s, ranks), f)


def task_graph_dot(s: Schedule, units=None) -> str:
    """DOT of task families; `units` (prog.notes["units"]) gives names and op lists."""
    lines = ["digraph tasks {", "  rankdir=TB; node [shape=box, fontsize=9];"]
    if units is None:
        raise ValueError("task_graph_dot needs the units of the tile pass (prog.notes['units'])")
    for u in units:
        label = f"{u.name}\\n{u.body} x{len(u.task_ids)}\\n" + "\\n".join(o.opname for o in u.ops[:6])
        lines.append(f'  "{u.name}" [label="{label}"];')
    for u in units:
        for d in sorted(u.deps):
            lines.append(f'  "{d}" -> "{u.name}";')
        if u.body == "comm_push":
            lines.append(f'  "{u.name}" -> "{u.name[:-len(".push")]}" [style=dashed, label="peers"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
