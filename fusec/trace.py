"""Timeline and graph pictures of a schedule.

`chrome_trace(schedule, full=True)` -> a Chrome trace-event JSON object that Perfetto
(ui.perfetto.dev) and chrome://tracing open: one "X" (complete) event per task at its predicted
start, with pid = rank, tid = SM (one track per SM per rank), ts / dur in microseconds. The
default (`full=False`) is compact, for a file a person opens (full K3: tens of MB -> ~1 MB):
one track per group of SM_GROUP SMs with one event per task family there (first start to last
end, task count and busy time in args), and a "busy SMs" counter sampled over the step. Start times are
replayed from the queues and the waits with the same rules as the list scheduler (a task starts
when its SM is free and every family it waits on has finished), so the picture shows exactly
the prediction. Replicated schedules are drawn for every rank (`ranks` caps how many).

`task_graph_dot(schedule)` -> Graphviz DOT of the task families: one node per family (its ops,
task count, body), one edge per event wait.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

from fusec.ir.schedule import InstrKind, Schedule


def task_times(s: Schedule) -> dict[int, tuple[float, float]]:
    """Predicted (start, end) of every rank-0 task, replaying queues and waits (see above)."""
    SIGNAL, WAIT = InstrKind.SIGNAL, InstrKind.WAIT
    signallers: dict[int, list[int]] = defaultdict(list)
    # an event signalled by peers (collectives) is ready when our own copy of the signalling
    # family is: ranks run the same schedule
    peer_sig: dict[int, list[int]] = defaultdict(list)
    waits: list[list[int]] = []          # per task (by position): the events it waits on (threshold > 0)
    for t in s.tasks:
        mine = []
        for i in [i for i in t.instrs if (kind := i.kind) is SIGNAL or kind is WAIT]:
            if i.kind is SIGNAL:
                (signallers if i.peer is None else peer_sig)[i.event].append(t.id)
            elif i.threshold:
                mine.append(i.event)
        waits.append(mine)
    # per event: how many of its signalling tasks have finished, and the latest finish
    src_of = {e: (signallers.get(e) or peer_sig.get(e, [])) for e in set(signallers) | set(peer_sig)}
    need = {e: len(src) for e, src in src_of.items()}
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
    tasks = s.tasks
    while remaining:
        progressed = False
        for k, q in s.queues.items():
            p, n = pos[k], len(q)
            while p < n:
                tid = q[p]
                t = tasks[tid]
                ready = free[k]
                ok = True
                for e in waits[tid]:
                    if done_n[e] < need.get(e, 0):
                        ok = False
                        break
                    ready = max(ready, done_at[e])
                if not ok:
                    break
                end = ready + t.cost_us
                out[t.id] = (ready, end)
                for e in feeds.get(t.id, ()):
                    done_n[e] += 1
                    done_at[e] = max(done_at[e], end)
                free[k] = end
                p += 1
                remaining -= 1
                progressed = True
            pos[k] = p
        if not progressed:
            raise ValueError("trace: the queues deadlock (a wait's signallers never run)")
    return out


SM_GROUP = 16          # compact trace: SMs per track
COUNTER_SAMPLES = 400  # compact trace: points of the busy-SMs counter


def chrome_trace(s: Schedule, ranks: int | None = None, full: bool = False) -> dict:
    times = task_times(s)
    if not full:
        return _compact_trace(s, times, ranks)
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


def _compact_trace(s: Schedule, times: dict, ranks: int | None) -> dict:
    """One track per (rank, SM group); one event per task family on it; a busy-SMs counter."""
    shown = min(s.ranks, ranks or s.ranks) if s.replicated else s.ranks
    fam: dict[tuple, list] = {}
    rep = s.replicated
    for t in s.tasks:
        st, en = times[t.id]
        key = (0 if rep else t.rank, t.sm // SM_GROUP, t.body_kind, tuple(t.ops))
        f = fam.get(key)
        if f is None:
            f = fam[key] = [st, en, 0, 0.0]
        if st < f[0]:               # min / max, as written out
            f[0] = st
        if en > f[1]:
            f[1] = en
        f[2] += 1
        f[3] += en - st
    groups = sorted({sm // SM_GROUP for (_, sm) in s.queues})
    end = max((e for _, e in times.values()), default=0.0)
    ev = []
    for r in range(shown):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for gi in groups:
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": gi,
                       "args": {"name": f"SMs {gi * SM_GROUP}-{gi * SM_GROUP + SM_GROUP - 1}"}})
        for (rank, gi, body, ops), (st, en, n, busy) in fam.items():
            if s.replicated or rank == r:
                ev.append({"ph": "X", "name": body, "cat": body, "pid": r, "tid": gi, "ts": round(st, 3),
                           "dur": round(en - st, 3), "args": {"tasks": n, "busy_us": round(busy, 3),
                                                             "ops": list(ops)[:8]}})
        # busy SMs over the step (every rank of a replicated schedule runs the same timeline:
        # sorted once)
        if not rep or r == 0:
            mine = [times[t.id] for t in s.tasks if rep or t.rank == r]
            starts, ends = sorted(a for a, _ in mine), sorted(b for _, b in mine)
        for i in range(COUNTER_SAMPLES + 1):
            ts = end * i / COUNTER_SAMPLES
            busy = bisect.bisect_right(starts, ts) - bisect.bisect_right(ends, ts)
            ev.append({"ph": "C", "name": "busy SMs", "pid": r, "ts": round(ts, 3), "args": {"busy": busy}})
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "otherData": {"predicted_step_us": s.meta.get("predicted_step_us", ""),
                          "compact": f"one track per {SM_GROUP} SMs, one event per task family; --trace full "
                                     "for one event per task"}}


def task_graph_dot(s: Schedule) -> str:
    """DOT of the schedule's task families (`s.families`: names, bodies, op kinds, deps)."""
    if not s.families:
        raise ValueError("task_graph_dot needs the task families of the tile pass (schedule.families)")
    kind = {o.outputs[0].name: o.opname for o in s.graph.ops}
    lines = ["digraph tasks {", "  rankdir=TB; node [shape=box, fontsize=9];"]
    for u in s.families:
        label = f"{u.name}\\n{u.body} x{len(u.task_ids)}\\n" + "\\n".join(kind.get(o, o) for o in u.ops[:6])
        lines.append(f'  "{u.name}" [label="{label}"];')
    for u in s.families:
        for d in sorted(u.deps):
            lines.append(f'  "{d}" -> "{u.name}";')
        if u.body == "comm_push":
            lines.append(f'  "{u.name}" -> "{u.name[:-len(".push")]}" [style=dashed, label="peers"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
