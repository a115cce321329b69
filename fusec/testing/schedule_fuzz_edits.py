"""The schedule fuzzer's edits: each kind takes a copy of a compiled schedule (wrapped in a
`Ctx` that knows its tensors' kinds and the graph's run-time addressing) and a seeded
`random.Random`, edits the copy in place and returns a one-line description, or raises `Skip`
when the schedule has no site for it. Sites are picked from the schedule's lines and the graph,
never by asking the verifier or the oracle. Groups: "issue" (the seven holes of issue 11),
"unsafe" (other synchronization and structure bugs), "safe" (edits meant to keep the schedule
correct; the oracle still judges each one).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from fusec.ir.schedule import Event, Instr, InstrKind, Region, Schedule, Scope, Sem
from fusec.ir.types import Kind


class Skip(Exception):
    """This schedule has no site for this kind of edit."""


# -- schedule helpers ----------------------------------------------------------------------------
def copy_schedule(s: Schedule) -> Schedule:
    return Schedule(s.graph, dict(s.dims), s.ranks, s.sms, [replace(t, instrs=list(t.instrs)) for t in s.tasks],
                    [replace(e) for e in s.events], {k: list(v) for k, v in s.queues.items()}, dict(s.meta),
                    s.replicated, dict(s.buffers))


@dataclass
class Ctx:
    """What the generators know about a schedule: tensor kinds and where things are."""
    s: Schedule
    kinds: dict = field(default_factory=dict)
    addressing: dict = field(default_factory=dict)   # loaded value -> addressing value (graph)

    @classmethod
    def of(cls, s: Schedule) -> "Ctx":
        c = cls(s)
        for v in s.graph.values():
            c.kinds[v.name] = v.kind
        for name, ty in s.buffers.items():
            c.kinds[name] = ty.kind
        made = {v.name for op in s.graph.ops for v in op.outputs}
        for op in s.graph.ops:
            for j, a in op.opdef.addressed_by.items():
                if op.inputs[a].name in made:
                    c.addressing[op.inputs[j].name] = op.inputs[a].name
        return c

    def kind(self, name):
        return self.kinds.get(name)

    def produced(self, name) -> bool:
        """Data some task writes (act, state, comm, graph outputs), not weights or io inputs."""
        if self.kind(name) in (Kind.act, Kind.state, Kind.comm):
            return True
        return self.s.graph.has_value(name) and self.s.graph.value(name).producer is not None


def _compute_at(t) -> int:
    return next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.COMPUTE)


def _pick(rng, xs, what="site"):
    xs = list(xs)
    if not xs:
        raise Skip(f"no {what}")
    return xs[rng.randrange(len(xs))]


def _produced_loads(c: Ctx, before_compute=True):
    for t in c.s.tasks:
        ca = _compute_at(t)
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and c.produced(i.region.tensor) and (k < ca or not before_compute):
                yield t, k


def _waits(c: Ctx):
    for t in c.s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.WAIT:
                yield t, k


def _signals(c: Ctx):
    for t in c.s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.SIGNAL:
                yield t, k


def _queue_of(s: Schedule) -> dict:
    return {tid: key for key, ids in s.queues.items() for tid in ids}


def _per_step(s: Schedule, rank, e):
    return next((ev.per_step for ev in s.events if ev.id == e and ev.rank == rank), 0)


def _target(s, t, i):
    return 0 if s.replicated else (t.rank if i.peer is None else i.peer)


# -- edit kinds ----------------------------------------------------------------------------------
# each takes (ctx on a copy of the schedule, rng), edits the copy and returns a description
def delete_load_and_wait(c, rng):
    t, k = _pick(rng, _produced_loads(c), "produced-data load")
    name = t.instrs[k].region.tensor
    keep_waits = rng.random() < 0.3
    t.instrs = [i for j, i in enumerate(t.instrs) if j != k and (keep_waits or i.kind is not InstrKind.WAIT)]
    return f"task {t.id}: LOAD of %{name} deleted" + (" (waits kept)" if keep_waits else " with its waits")


def empty_load_box(c, rng):
    t, k = _pick(rng, ((t, k) for t in c.s.tasks for k, i in enumerate(t.instrs[:_compute_at(t)])
                       if i.kind is InstrKind.LOAD), "load")
    r = t.instrs[k].region
    d = rng.randrange(len(r.box))
    box = list(r.box)
    box[d] = (box[d][0], box[d][0])
    t.instrs[k] = replace(t.instrs[k], region=replace(r, box=tuple(box)))
    return f"task {t.id}: LOAD %{r.tensor} box emptied along dim {d}"


def hoist_addressed_unannotated(c, rng):
    """An addressed load (its address from a value computed in the step) above every wait of its
    task, its `addressed_by` annotation removed."""
    sites = [(t, k) for t in c.s.tasks for k, i in enumerate(t.instrs)
             if i.kind is InstrKind.LOAD and (i.addressed_by or i.region.tensor in c.addressing)
             and any(x.kind is InstrKind.WAIT for x in t.instrs[:k])]
    t, k = _pick(rng, sites, "addressed load after a wait")
    ld = replace(t.instrs.pop(k), addressed_by=None)
    t.instrs.insert(0, ld)
    return f"task {t.id}: LOAD %{ld.region.tensor} hoisted to the top, addressed_by removed"


def store_into_input_or_weight(c, rng):
    """A STORE into a region of an io input or a weight that another task loads."""
    sites = [(t, i.region) for t in c.s.tasks for i in t.instrs
             if i.kind is InstrKind.LOAD and c.kind(i.region.tensor) in (Kind.weight, Kind.io)
             and not c.produced(i.region.tensor)]
    other, reg = _pick(rng, sites, "input or weight load")
    t = _pick(rng, [t for t in c.s.tasks if t.id != other.id and t.rank == other.rank], "other task")
    at = max((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE), default=_compute_at(t)) + 1
    t.instrs.insert(at, Instr(InstrKind.STORE, Region(reg.tensor, reg.box, None)))
    return f"task {t.id}: STORE into %{reg.tensor} {list(reg.box)}, which task {other.id} loads"


def bad_event_decl(c, rng):
    s = c.s
    v = rng.choice(["duplicate", "undeclared", "rank_outside", "removed"])
    if v == "duplicate":
        e = _pick(rng, s.events, "event")
        ps = e.per_step if rng.random() < 0.5 else e.per_step + 1
        s.events.insert(rng.randrange(len(s.events) + 1), Event(e.id, e.rank, e.name + "#dup", ps))
        return f"event e{e.id} on rank {e.rank} declared twice (per_step {e.per_step}, {ps})"
    if v == "undeclared":
        t, k = _pick(rng, list(_waits(c)) + list(_signals(c)), "wait or signal")
        new = max(e.id for e in s.events) + 1 + rng.randrange(3)
        t.instrs[k] = replace(t.instrs[k], event=new)
        return f"task {t.id}: {t.instrs[k].kind.value} on e{new}, which is not declared"
    if v == "rank_outside":
        e = _pick(rng, s.events, "event")
        bad = rng.choice([s.ranks, s.ranks + 1, -1] + ([1] if s.replicated and s.ranks > 1 else []))
        j = s.events.index(e)
        s.events[j] = replace(e, rank=bad)
        return f"event e{e.id} declared on rank {bad} (R = {s.ranks}{', replicated' if s.replicated else ''})"
    used = {(_target(s, t, i), i.event) for t in s.tasks for i in t.instrs if i.kind in (InstrKind.WAIT, InstrKind.SIGNAL)}
    e = _pick(rng, [e for e in s.events if (e.rank, e.id) in used], "used event")
    s.events.remove(e)
    return f"event e{e.id} on rank {e.rank} no longer declared, still used"


def rank_out_of_range(c, rng):
    s = c.s
    R = s.ranks
    v = rng.choice(["peer", "region", "task"])
    bad = rng.choice([R, R + 1, R + 2, -1])
    if v == "peer":
        t, k = _pick(rng, list(_waits(c)) + list(_signals(c)), "wait or signal")
        t.instrs[k] = replace(t.instrs[k], peer=bad)
        return f"task {t.id}: {t.instrs[k].kind.value} on peer {bad} (R = {R})"
    if v == "region":
        t, k = _pick(rng, ((t, k) for t in s.tasks for k, i in enumerate(t.instrs) if i.region is not None), "region")
        r = t.instrs[k].region
        t.instrs[k] = replace(t.instrs[k], region=replace(r, rank=bad))
        return f"task {t.id}: {t.instrs[k].kind.value} %{r.tensor} @{bad} (R = {R})"
    t = _pick(rng, s.tasks, "task")
    key = _queue_of(s)[t.id]
    bad = max(bad, 1) if s.replicated else abs(bad) + R - 1 if bad < R else bad
    s.queues[key].remove(t.id)
    s.queues.setdefault((bad, t.sm), []).append(t.id)
    t.rank = bad
    return f"task {t.id} (header and queue) moved to rank {bad} (R = {R})"


def header_sm_mismatch(c, rng):
    s = c.s
    if s.sms < 2:
        raise Skip("one SM")
    t = _pick(rng, s.tasks, "task")
    old = t.sm
    t.sm = rng.choice([x for x in range(s.sms) if x != old])
    return f"task {t.id}: header names sm {t.sm}, the task sits on sm {old}'s queue"


def queue_bad_task_id(c, rng):
    s = c.s
    n = len(s.tasks)
    key = _pick(rng, [k for k, v in s.queues.items() if v], "queue")
    v = rng.choice(["nonexistent", "negative", "twice", "dropped"])
    q = s.queues[key]
    if v == "nonexistent":
        bad = n + rng.choice([0, 1, 99999])
        q.insert(rng.randrange(len(q) + 1), bad)
        return f"queue {key} lists task {bad} (there are {n})"
    if v == "negative":
        q.insert(rng.randrange(len(q) + 1), -1)
        return f"queue {key} lists task -1"
    if v == "twice":
        tid = rng.choice(q)
        q.insert(rng.randrange(len(q) + 1), tid)
        return f"queue {key} lists task {tid} twice"
    tid = q.pop(rng.randrange(len(q)))
    return f"task {tid} removed from queue {key} (on no queue)"


def wait_after_load(c, rng):
    """A WAIT moved below the first produced-data load after it."""
    sites = []
    for t in c.s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.WAIT:
                j = next((j for j in range(k + 1, _compute_at(t)) if t.instrs[j].kind is InstrKind.LOAD
                          and c.produced(t.instrs[j].region.tensor)), None)
                if j is not None:
                    sites.append((t, k, j))
    t, k, j = _pick(rng, sites, "wait before a produced-data load")
    w = t.instrs.pop(k)
    t.instrs.insert(j, w)
    return f"task {t.id}: wait e{w.event} >= {w.threshold} moved after LOAD %{t.instrs[j - 1].region.tensor}"


def wait_threshold_lowered(c, rng):
    t, k = _pick(rng, ((t, k) for t, k in _waits(c) if t.instrs[k].threshold > 0), "wait with threshold > 0")
    w = t.instrs[k]
    new = rng.randrange(w.threshold)
    t.instrs[k] = replace(w, threshold=new)
    return f"task {t.id}: wait e{w.event} >= {w.threshold} lowered to {new}"


def wait_threshold_raised(c, rng):
    t, k = _pick(rng, _waits(c), "wait")
    w = t.instrs[k]
    new = w.threshold + rng.choice([1, 1, 2])
    t.instrs[k] = replace(w, threshold=new)
    return f"task {t.id}: wait e{w.event} >= {w.threshold} raised to {new}"


def wait_removed(c, rng):
    t, k = _pick(rng, _waits(c), "wait")
    w = t.instrs.pop(k)
    return f"task {t.id}: wait e{w.event} >= {w.threshold} removed"


def signal_removed(c, rng):
    s = c.s
    t, k = _pick(rng, _signals(c), "signal")
    g = t.instrs.pop(k)
    if rng.random() < 0.5:
        return f"task {t.id}: signal e{g.event} removed"
    target = _target(s, t, g)
    for j, e in enumerate(s.events):
        if e.id == g.event and (e.rank == target or s.replicated):
            s.events[j] = replace(e, per_step=max(0, e.per_step - 1))
    for u in s.tasks:      # waits that counted every signal now count one fewer
        for j, i in enumerate(u.instrs):
            if i.kind is InstrKind.WAIT and i.event == g.event and _target(s, u, i) == target \
                    and i.threshold > 0 and i.threshold >= _per_step(s, target, g.event) + 1:
                u.instrs[j] = replace(i, threshold=i.threshold - 1)
    return f"task {t.id}: signal e{g.event} removed, per_step and full waits lowered by one"


def signal_before_store(c, rng):
    sites = [(t, k) for t, k in _signals(c) if any(i.kind is InstrKind.STORE for i in t.instrs[:k])]
    t, k = _pick(rng, sites, "signal after a store")
    g = t.instrs.pop(k)
    first_store = next(j for j, i in enumerate(t.instrs) if i.kind is InstrKind.STORE)
    at = rng.choice([first_store, _compute_at(t)])
    t.instrs.insert(at, g)
    return f"task {t.id}: signal e{g.event} moved before its {'STOREs' if at == first_store else 'COMPUTE'}"


def queue_reorder(c, rng):
    """A task moved up its queue, above 1-3 tasks (maybe a producer it depends on)."""
    key = _pick(rng, [k for k, v in c.s.queues.items() if len(v) >= 2], "queue of two tasks")
    q = c.s.queues[key]
    j = rng.randrange(1, len(q))
    up = min(j, rng.choice([1, 1, 2, 3]))
    tid = q.pop(j)
    q.insert(j - up, tid)
    return f"queue {key}: task {tid} moved up {up} place(s)"


def prefetch_nonstatic(c, rng):
    sites = [(t, k) for t, k in _produced_loads(c) if any(i.kind is InstrKind.WAIT for i in t.instrs[:k])]
    t, k = _pick(rng, sites, "produced-data load after a wait")
    ld = t.instrs.pop(k)
    t.instrs.insert(0, ld)
    return f"task {t.id}: LOAD %{ld.region.tensor} prefetched above every wait"


def store_removed(c, rng):
    t, k = _pick(rng, ((t, k) for t in c.s.tasks for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE), "store")
    st = t.instrs.pop(k)
    return f"task {t.id}: STORE %{st.region.tensor} {list(st.region.box)} removed"


def load_after_compute(c, rng):
    t, k = _pick(rng, _produced_loads(c), "produced-data load")
    ld = t.instrs.pop(k)
    t.instrs.insert(_compute_at(t) + 1, ld)
    return f"task {t.id}: LOAD %{ld.region.tensor} moved after the COMPUTE"


def task_to_other_sm(c, rng):
    """A task moved to another SM's queue (header updated with it)."""
    s = c.s
    if s.sms < 2:
        raise Skip("one SM")
    t = _pick(rng, s.tasks, "task")
    old = _queue_of(s)[t.id]
    s.queues[old].remove(t.id)
    sm = rng.choice([x for x in range(s.sms) if x != t.sm])
    q = s.queues.setdefault((t.rank, sm), [])
    q.insert(rng.randrange(len(q) + 1), t.id)
    t.sm = sm
    return f"task {t.id} moved from sm {old[1]} to sm {sm} (position {q.index(t.id)})"


def per_step_changed(c, rng):
    s = c.s
    e = _pick(rng, [e for e in s.events], "event")
    new = max(0, e.per_step + rng.choice([-1, 1]))
    if new == e.per_step:
        new = e.per_step + 1
    s.events[s.events.index(e)] = replace(e, per_step=new)
    return f"event e{e.id} on rank {e.rank}: per_step {e.per_step} -> {new}"


# -- edits meant to be safe ------------------------------------------------------------------------
def weight_prefetch_earlier(c, rng):
    sites = [(t, k) for t in c.s.tasks for k, i in enumerate(t.instrs)
             if k > 0 and i.kind is InstrKind.LOAD and c.kind(i.region.tensor) is Kind.weight
             and i.region.tensor not in c.addressing and not i.addressed_by]
    t, k = _pick(rng, sites, "static weight load")
    ld = t.instrs.pop(k)
    t.instrs.insert(0, ld)
    return f"task {t.id}: static weight LOAD %{ld.region.tensor} prefetched to the top"


def _waits_on(s: Schedule, b) -> set:
    """The tasks that task b's waits (threshold > 0) reach, through signals and queue order."""
    signalers = defaultdict(list)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL:
                signalers[(_target(s, t, i), i.event)].append(t.id)
    where = {tid: (key, j) for key, ids in s.queues.items() for j, tid in enumerate(ids)}
    seen, todo = set(), [b.id]
    first = True
    while todo:
        t = s.tasks[todo.pop()]
        if not first:
            key, j = where[t.id]
            todo += [x for x in s.queues[key][:j] if x not in seen and not seen.add(x)]
        first = False
        for i in t.instrs:
            if i.kind is InstrKind.WAIT and i.threshold > 0:
                todo += [x for x in signalers[(_target(s, t, i), i.event)] if x not in seen and not seen.add(x)]
    return seen


def swap_independent_tasks(c, rng):
    """Two adjacent tasks of a queue swapped where the second's waits do not reach the first
    (through signals and queue order) and it loads no tensor the first stores (judged from
    their lines, not by the verifier)."""
    s = c.s
    sites = []
    for key, q in s.queues.items():
        for j in range(len(q) - 1):
            a, b = s.tasks[q[j]], s.tasks[q[j + 1]]
            stored = {i.region.tensor for i in a.instrs if i.kind is InstrKind.STORE}
            loaded = {i.region.tensor for i in b.instrs if i.kind is InstrKind.LOAD}
            if not (stored & loaded):
                sites.append((key, j))
    rng.shuffle(sites)
    for key, j in sites[:20]:
        q = s.queues[key]
        if q[j] not in _waits_on(s, s.tasks[q[j + 1]]):
            break
    else:
        raise Skip("no independent adjacent pair")
    q[j], q[j + 1] = q[j + 1], q[j]
    return f"queue {key}: tasks {q[j + 1]} and {q[j]} swapped"


def duplicate_wait(c, rng):
    t, k = _pick(rng, _waits(c), "wait")
    t.instrs.insert(k + 1, t.instrs[k])
    return f"task {t.id}: wait e{t.instrs[k].event} >= {t.instrs[k].threshold} repeated"


def split_load(c, rng):
    sites = [(t, k) for t in c.s.tasks for k, i in enumerate(t.instrs)
             if i.kind is InstrKind.LOAD and any(b - a >= 2 for a, b in i.region.box)]
    t, k = _pick(rng, sites, "load of extent >= 2")
    ld = t.instrs[k]
    d = rng.choice([d for d, (a, b) in enumerate(ld.region.box) if b - a >= 2])
    a, b = ld.region.box[d]
    m = rng.randrange(a + 1, b)
    lo = list(ld.region.box)
    hi = list(ld.region.box)
    lo[d], hi[d] = (a, m), (m, b)
    t.instrs[k:k + 1] = [replace(ld, region=replace(ld.region, box=tuple(lo))),
                         replace(ld, region=replace(ld.region, box=tuple(hi)))]
    return f"task {t.id}: LOAD %{ld.region.tensor} split along dim {d} at {m}"


def swap_loads_after_waits(c, rng):
    sites = []
    for t in c.s.tasks:
        last_wait = max((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT), default=-1)
        for k in range(last_wait + 1, _compute_at(t) - 1):
            if t.instrs[k].kind is InstrKind.LOAD and t.instrs[k + 1].kind is InstrKind.LOAD:
                sites.append((t, k))
    t, k = _pick(rng, sites, "two loads after the waits")
    t.instrs[k], t.instrs[k + 1] = t.instrs[k + 1], t.instrs[k]
    return f"task {t.id}: loads {k} and {k + 1} swapped"


def wait_earlier(c, rng):
    t, k = _pick(rng, ((t, k) for t, k in _waits(c) if k > 0), "wait not first")
    w = t.instrs.pop(k)
    t.instrs.insert(0, w)
    return f"task {t.id}: wait e{w.event} >= {w.threshold} moved to the top"


def drop_annotation_in_place(c, rng):
    t, k = _pick(rng, ((t, k) for t in c.s.tasks for k, i in enumerate(t.instrs)
                       if i.kind is InstrKind.LOAD and i.addressed_by), "annotated load")
    t.instrs[k] = replace(t.instrs[k], addressed_by=None)
    return f"task {t.id}: addressed_by of LOAD %{t.instrs[k].region.tensor} removed (load not moved)"


def extend_weight_load(c, rng):
    sites = []
    for t in c.s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.LOAD and c.kind(i.region.tensor) is Kind.weight:
                shape = c.s.graph.value(i.region.tensor).type.concrete({})
                if any(b - a < n for (a, b), n in zip(i.region.box, shape)):
                    sites.append((t, k, shape))
    t, k, shape = _pick(rng, sites, "partial weight load")
    ld = t.instrs[k]
    d = rng.choice([d for d, ((a, b), n) in enumerate(zip(ld.region.box, shape)) if b - a < n])
    box = list(ld.region.box)
    box[d] = (0, shape[d])
    t.instrs[k] = replace(ld, region=replace(ld.region, box=tuple(box)))
    return f"task {t.id}: weight LOAD %{ld.region.tensor} grown to the whole of dim {d}"


def duplicate_load(c, rng):
    t, k = _pick(rng, ((t, k) for t in c.s.tasks for k, i in enumerate(t.instrs) if i.kind is InstrKind.LOAD), "load")
    t.instrs.insert(k + 1, t.instrs[k])
    return f"task {t.id}: LOAD %{t.instrs[k].region.tensor} repeated"


def unused_event(c, rng):
    s = c.s
    new = max(e.id for e in s.events) + 1 + rng.randrange(4)
    s.events.append(Event(new, 0 if s.replicated else rng.randrange(s.ranks), "unused", 0))
    return f"event e{new} declared, per_step 0, never used"


def swap_signals(c, rng):
    sites = [(t, k) for t in c.s.tasks for k in range(len(t.instrs) - 1)
             if t.instrs[k].kind is InstrKind.SIGNAL and t.instrs[k + 1].kind is InstrKind.SIGNAL]
    t, k = _pick(rng, sites, "two adjacent signals")
    t.instrs[k], t.instrs[k + 1] = t.instrs[k + 1], t.instrs[k]
    return f"task {t.id}: signals e{t.instrs[k + 1].event} and e{t.instrs[k].event} swapped"


def _cross_gpu_syncs(s: Schedule):
    """(task, index) of the SIGNALs and WAITs on a counter that another rank signals or reads."""
    def remote(t, i):
        return i.peer is not None and i.peer != t.rank
    # A replicated schedule lists rank 0's tasks only and every rank's counter e is alike: a
    # wait is cross-GPU when any signal to its event names a peer.
    sym = s.replicated and s.ranks > 1
    from_ranks = defaultdict(set)
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL:
                from_ranks[i.event if sym else (i.peer if remote(t, i) else t.rank, i.event)].add(
                    "peer" if sym and remote(t, i) else t.rank)
    for t in s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.SIGNAL and remote(t, i):
                yield t, k
            elif i.kind is InstrKind.WAIT:
                senders = from_ranks[i.event if sym else (t.rank, i.event)]
                if remote(t, i) or ("peer" in senders if sym else bool(senders - {t.rank})):
                    yield t, k


def wait_relaxed(c, rng):
    t, k = _pick(rng, _waits(c), "wait")
    t.instrs[k] = replace(t.instrs[k], sem=Sem.relaxed)
    return f"task {t.id}: wait e{t.instrs[k].event} made relaxed (no acquire)"


def signal_relaxed(c, rng):
    t, k = _pick(rng, _signals(c), "signal")
    t.instrs[k] = replace(t.instrs[k], sem=Sem.relaxed)
    return f"task {t.id}: signal e{t.instrs[k].event} made relaxed (no release)"


def scope_narrowed(c, rng):
    t, k = _pick(rng, [(t, k) for t, k in _cross_gpu_syncs(c.s) if t.instrs[k].scope is Scope.sys],
                 "cross-GPU signal or wait")
    t.instrs[k] = replace(t.instrs[k], scope=Scope.gpu)
    return f"task {t.id}: cross-GPU {t.instrs[k].kind.value} e{t.instrs[k].event} narrowed to gpu scope"


def scope_widened(c, rng):
    sites = [(t, k) for t in c.s.tasks for k, i in enumerate(t.instrs)
             if i.kind in (InstrKind.SIGNAL, InstrKind.WAIT) and i.scope is Scope.gpu]
    t, k = _pick(rng, sites, "gpu-scope signal or wait")
    t.instrs[k] = replace(t.instrs[k], scope=Scope.sys)
    return f"task {t.id}: {t.instrs[k].kind.value} e{t.instrs[k].event} widened to sys scope"


@dataclass(frozen=True)
class Kind_:
    fn: object
    group: str          # issue (the 7 holes of issue 11) | unsafe (other bugs) | safe (meant to be safe)
    what: str


KINDS = {
    "delete_load_and_wait": Kind_(delete_load_and_wait, "issue", "1. LOAD (and its waits) deleted, the ops still read it"),
    "empty_load_box": Kind_(empty_load_box, "issue", "1. a LOAD's box emptied"),
    "hoist_addressed_unannotated": Kind_(hoist_addressed_unannotated, "issue",
                                         "2. addressed load hoisted above the waits, addressed_by removed"),
    "store_into_input_or_weight": Kind_(store_into_input_or_weight, "issue", "3. STORE into an io input / weight others read"),
    "bad_event_decl": Kind_(bad_event_decl, "issue", "4. duplicate / undeclared / out-of-range / removed event"),
    "rank_out_of_range": Kind_(rank_out_of_range, "issue", "5. peer, region rank or task rank outside R"),
    "header_sm_mismatch": Kind_(header_sm_mismatch, "issue", "6. task header names another SM than its queue"),
    "queue_bad_task_id": Kind_(queue_bad_task_id, "issue", "7. queue lists a missing / negative / repeated id, or drops one"),
    "wait_after_load": Kind_(wait_after_load, "unsafe", "WAIT moved below the load it orders"),
    "wait_threshold_lowered": Kind_(wait_threshold_lowered, "unsafe", "WAIT threshold lowered"),
    "wait_threshold_raised": Kind_(wait_threshold_raised, "unsafe", "WAIT threshold raised"),
    "wait_removed": Kind_(wait_removed, "unsafe", "a WAIT deleted"),
    "signal_removed": Kind_(signal_removed, "unsafe", "a SIGNAL deleted (half: per_step and full waits lowered)"),
    "signal_before_store": Kind_(signal_before_store, "unsafe", "SIGNAL moved before the STOREs / COMPUTE"),
    "queue_reorder": Kind_(queue_reorder, "unsafe", "a task moved up its queue by 1-3 places"),
    "prefetch_nonstatic": Kind_(prefetch_nonstatic, "unsafe", "produced-data LOAD prefetched above every wait"),
    "store_removed": Kind_(store_removed, "unsafe", "a STORE deleted"),
    "load_after_compute": Kind_(load_after_compute, "unsafe", "a produced-data LOAD moved after the COMPUTE"),
    "task_to_other_sm": Kind_(task_to_other_sm, "unsafe", "a task moved to another SM's queue (header too)"),
    "per_step_changed": Kind_(per_step_changed, "unsafe", "an event's per_step +-1"),
    "wait_relaxed": Kind_(wait_relaxed, "unsafe", "a WAIT made relaxed (no acquire)"),
    "signal_relaxed": Kind_(signal_relaxed, "unsafe", "a SIGNAL made relaxed (no release)"),
    "scope_narrowed": Kind_(scope_narrowed, "unsafe", "a cross-GPU SIGNAL / WAIT narrowed to gpu scope"),
    "scope_widened": Kind_(scope_widened, "safe", "a SIGNAL / WAIT widened to sys scope"),
    "weight_prefetch_earlier": Kind_(weight_prefetch_earlier, "safe", "static weight LOAD prefetched to the top"),
    "swap_independent_tasks": Kind_(swap_independent_tasks, "safe", "adjacent tasks with no direct dependency swapped"),
    "duplicate_wait": Kind_(duplicate_wait, "safe", "a WAIT repeated"),
    "split_load": Kind_(split_load, "safe", "a LOAD split in two boxes"),
    "swap_loads_after_waits": Kind_(swap_loads_after_waits, "safe", "two LOADs after the last WAIT swapped"),
    "wait_earlier": Kind_(wait_earlier, "safe", "a WAIT moved to the top of its task"),
    "drop_annotation_in_place": Kind_(drop_annotation_in_place, "safe", "addressed_by removed, load not moved"),
    "extend_weight_load": Kind_(extend_weight_load, "safe", "a weight LOAD grown to the whole dim"),
    "duplicate_load": Kind_(duplicate_load, "safe", "a LOAD repeated"),
    "unused_event": Kind_(unused_event, "safe", "an unused event declared (per_step 0)"),
    "swap_signals": Kind_(swap_signals, "safe", "two adjacent SIGNALs swapped"),
}


def one_rank_differs(c, rng):
    """Materialized, and one rank's copy of one task changed (a LOAD repeated there only)."""
    s = c.s
    if s.ranks == 1:
        raise Skip("one rank")
    m = s.materialize()
    r = rng.randrange(1, s.ranks)
    t = _pick(rng, [t for t in m.tasks if t.rank == r and t.loads()], "task with a load")
    t.instrs = list(t.instrs)
    k = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.LOAD)
    t.instrs.insert(k + 1, t.instrs[k])
    s.tasks, s.events, s.queues, s.replicated = m.tasks, m.events, m.queues, False
    return f"materialized; rank {r}'s copy of task {t.id} repeats a LOAD, the other ranks' do not"


KINDS["one_rank_differs"] = Kind_(one_rank_differs, "unsafe", "rank r's copy of a task differs (not one task table)")
