"""schedule: put the tasks on per-SM queues with a list-scheduling cost model; add events.

Requires: `tile` ran (`prog.schedule` holds tasks without waits, `prog.schedule.families` the task
families in a topological order, possibly reordered by `overlap`).
Ensures: every task has its SM; queues (rank 0; the schedule is replicated) hold task ids in
issue order; each task body is
    WAIT* (acquire) -> LOAD* -> COMPUTE -> STORE* -> SIGNAL* (release)
so `prefetch` can later hoist weight LOADs above the WAITs; `prog.notes["scheduled"] = True`.

Events: one counter per unit (task family) that someone waits on, `per_step` = its number of
tasks (each signals once per step); a consumer waits for the whole family (threshold =
per_step): tiles of a producer are not told apart, so waiting for all of them is the only
threshold a monotonic counter makes safe. Collectives add two named events per collective,
both signalled by peers at system scope: `<y>.arrive` (R - 1 pushes land per step; the local
reduce waits for all of them) and `<y>.ack` (each receiver acknowledges each sender once per
step after loading its slot; a push waits for threshold 0 of it, i.e. every ack of the previous
step, before overwriting the peer's slot: V4 without double buffers).

List scheduling: tasks are issued in unit order (a global topological order, so every queue is
consistent with it: V5); each goes to the SM that frees first; it starts when that SM is free
and every family it waits on has finished (the peers of a collective are assumed to run the
same schedule in lockstep: the arrive wait is ready when our own push family is). Task times
come from `fusec.passes.cost.task_time_us`; the predicted step time is the last finish.
"""
from __future__ import annotations

from .options import log
from fusec.ir.schedule import Event, Instr, InstrKind, Scope, Sem

from .cost import list_schedule
from .manager import Program, register_pass


@register_pass("schedule")
def run(prog: Program) -> bool:
    sched = prog.schedule
    units = sched.families if sched is not None else None
    if not units:
        raise ValueError("schedule needs the tile pass first (no task families)")
    by_name = {u.name: u for u in units}
    waited = set()
    for u in units:
        waited |= set(u.deps)
    events: list[Event] = []
    ev_id: dict[str, int] = {}

    def event(name: str, per_step: int) -> int:
        if name not in ev_id:
            ev_id[name] = len(events)
            events.append(Event(len(events), 0, name, per_step))
        return ev_id[name]

    for u in units:
        if u.name in waited:
            event(u.name, len(u.task_ids))
        for n, ps in u.named_events.items():
            event(n, ps)

    # -- instructions ------------------------------------------------------------------------
    for u in units:
        waits = [Instr(InstrKind.WAIT, event=ev_id[d], threshold=len(by_name[d].task_ids), sem=Sem.acquire)
                 for d in sorted(u.deps, key=lambda n: ev_id[n])]
        own = [Instr(InstrKind.SIGNAL, event=ev_id[u.name], sem=Sem.release)] if u.name in ev_id else []
        for i, tid in enumerate(u.task_ids):
            t = sched.tasks[tid]
            pre = [Instr(InstrKind.WAIT, event=ev_id[e], threshold=th, sem=Sem.acquire, scope=Scope.sys)
                   for e, th, _ in u.pre.get(i, [])]
            post = [Instr(InstrKind.SIGNAL, event=ev_id[e], sem=Sem.release,
                          scope=Scope.sys, peer=p) for e, p in u.post.get(i, [])]
            body = [x for x in t.instrs if x.kind not in (InstrKind.WAIT, InstrKind.SIGNAL)]
            t.instrs = pre + waits + body + post + own

    # -- list scheduling ---------------------------------------------------------------------
    plan = []
    for u in units:
        deps = list(u.deps)
        if u.pre and u.body != "comm_push" and u.name + ".push" in by_name:
            deps.append(u.name + ".push")    # a local reduce also waits for its pushes' arrivals
        plan.append((u.name, deps, [sched.tasks[tid].cost_us for tid in u.task_ids]))
    finish, placed = list_schedule(plan, sched.sms)
    queues: dict[tuple[int, int], list[int]] = {(0, sm): [] for sm in range(sched.sms)}
    for u, at in zip(units, placed):
        for tid, (sm, _) in zip(u.task_ids, at):
            sched.tasks[tid].sm = sm
            queues[(0, sm)].append(tid)
    sched.events = events
    sched.queues = {k: v for k, v in queues.items() if v}
    step = max(finish.values(), default=0.0)
    sched.meta["predicted_step_us"] = f"{step:.3f}"
    prog.notes["unit_finish_us"] = finish
    prog.notes["scheduled"] = True
    log(prog.opts, "schedule", f"{len(sched.tasks)} tasks on {len(sched.queues)} SMs, "
        f"{len(events)} events, predicted step {step:.1f} us")
    return True
