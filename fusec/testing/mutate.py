"""Plant one synchronization bug in a schedule, to prove the verifier and the randomized
executor catch it: `plant(schedule, kind, seed) -> (mutated schedule, description)`.

Candidates are picked structurally (by which queue a producer sits on), never by asking the
verifier, so "every planted bug is rejected" is a real test of the verifier. Replicated
schedules are mutated in rank 0's task list, i.e. on every rank at once, except
`grid_differs`, which materializes the ranks and changes rank 1 only. A kind the schedule has
no site for raises `MutationSkipped` with the reason.
"""
from __future__ import annotations

import copy
import enum
import random
from dataclasses import dataclass, replace

from fusec.ir.schedule import InstrKind, Schedule
from fusec.ir.types import Kind


class Mutation(enum.Enum):
    hoist_act_load = "hoist_act_load"          # a non-weight LOAD moved above its WAIT
    hoist_addressed_load = "hoist_addressed_load"  # a router-addressed weight LOAD above its WAIT
    drop_wait = "drop_wait"                    # a WAIT removed
    early_signal = "early_signal"              # a SIGNAL moved before the task's last STORE
    threshold_low = "threshold_low"            # a full WAIT's threshold - 1
    threshold_high = "threshold_high"          # a WAIT's threshold + 1
    comm_reuse = "comm_reuse"                  # the ack wait guarding a peer's comm slot removed
    deadlock_order = "deadlock_order"          # a signaler queued behind the task that waits for it
    grid_differs = "grid_differs"              # rank 1's queues differ from rank 0's


@dataclass(frozen=True)
class Expect:
    rule: str              # the verifier rule that must reject it
    changes_values: bool   # the randomized executor must see it (poison, mismatch or deadlock)


EXPECT = {
    Mutation.hoist_act_load: Expect("V2", True),
    Mutation.hoist_addressed_load: Expect("V3", True),
    Mutation.drop_wait: Expect("V1", True),
    Mutation.early_signal: Expect("V6", True),
    Mutation.threshold_low: Expect("V1", True),
    Mutation.threshold_high: Expect("V5", True),
    Mutation.comm_reuse: Expect("V4", True),
    Mutation.deadlock_order: Expect("V5", True),
    Mutation.grid_differs: Expect("V7", False),
}


class MutationSkipped(ValueError):
    """The schedule has no site for this kind of bug (the message says why)."""


def plant(schedule: Schedule, kind: Mutation | str, seed: int = 0) -> tuple[Schedule, str]:
    kind = Mutation(kind)
    s = _copy(schedule)
    rng = random.Random(seed)
    return s, _PLANT[kind](s, rng)


# -- helpers -------------------------------------------------------------------------------------
def _copy(s: Schedule) -> Schedule:
    out = copy.copy(s)
    out.tasks = [replace(t, instrs=list(t.instrs)) for t in s.tasks]
    out.queues = {k: list(v) for k, v in s.queues.items()}
    out.events = [replace(e) for e in s.events]
    out.meta = dict(s.meta)
    return out


def _queue_of(s: Schedule) -> dict[int, tuple[int, int]]:
    return {tid: key for key, ids in s.queues.items() for tid in ids}


def _kind(s: Schedule, name: str) -> Kind:
    bufs = getattr(s, "buffers", {})
    if name in bufs:
        return bufs[name].kind
    return s.graph.value(name).kind if s.graph.has_value(name) else Kind.act


def _writers(s: Schedule) -> dict[str, set[int]]:
    w: dict[str, set[int]] = {}
    for t in s.tasks:
        for i in t.stores():
            w.setdefault(i.region.tensor, set()).add(t.id)
    return w


def _signalers(s: Schedule) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and (i.peer is None or i.peer == t.rank):
                out.setdefault(i.event, set()).add(t.id)
    return out


class _Order:
    """A small independent happens-before (task granularity, BFS) to pick sites where a wait
    really is the only thing ordering a load after its producer. Works on rank 0 of the
    materialized schedule (its task ids equal the replicated ones)."""

    def __init__(self, s: Schedule):
        self.m = s.materialize() if getattr(s, "replicated", False) and s.ranks > 1 else s
        self.prev = {}
        for ids in self.m.queues.values():
            for a, b in zip(ids, ids[1:]):
                self.prev[b] = a
        self.sig: dict[tuple[int, int], list[int]] = {}
        for t in self.m.tasks:
            for i in t.instrs:
                if i.kind is InstrKind.SIGNAL:
                    self.sig.setdefault((i.peer if i.peer is not None else t.rank, i.event), []).append(t.id)

    def preds(self, tid: int, skip: set[int] = frozenset()) -> list[int]:
        t = self.m.tasks[tid]
        out = [self.prev[tid]] if tid in self.prev else []
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.WAIT and k not in skip:
                sg = self.sig.get((i.peer if i.peer is not None else t.rank, i.event), [])
                if sg and i.threshold >= len(sg):
                    out += sg
        return out

    def ancestors(self, tid: int, skip: set[int] = frozenset()) -> set[int]:
        seen, todo = set(), self.preds(tid, skip)
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += self.preds(x)
        return seen

    def ordered(self, producer: int, tid: int, skip: set[int]) -> bool:
        """Is `producer` an ancestor of task `tid` when its waits `skip` are ignored?"""
        seen, todo = set(), self.preds(tid, skip)
        while todo:
            x = todo.pop()
            if x == producer:
                return True
            if x not in seen:
                seen.add(x)
                todo += self.preds(x)
        return False


def _pick(rng, items, why: str):
    if not items:
        raise MutationSkipped(why)
    return rng.choice(sorted(items, key=repr))


def _hoist_sites(s: Schedule, want_addressed: bool):
    """(task, load index, first wait index) where the load's data (or address) is produced
    on another queue, so only the task's waits order it."""
    q, writers = _queue_of(s), _writers(s)
    sites = []
    for t in s.tasks:
        waits = [k for k, i in enumerate(t.instrs) if i.kind is InstrKind.WAIT]
        if not waits:
            continue
        for k, i in enumerate(t.instrs):
            if i.kind is not InstrKind.LOAD or k < waits[0]:
                continue
            if want_addressed:
                src = i.addressed_by
                if not src or _kind(s, i.region.tensor) is not Kind.weight:
                    continue
                src = s.graph.value(src).name if s.graph.has_value(src) else src
            else:
                src = i.region.tensor
                if i.addressed_by or _kind(s, src) in (Kind.weight, Kind.io, Kind.state) or i.region.rank is not None:
                    continue
            prods = writers.get(src, set()) - {t.id}
            if prods and any(q.get(p) != q.get(t.id) for p in prods):
                sites.append((t.id, k, waits[0], tuple(sorted(prods))))
    rng = random.Random(len(sites))
    rng.shuffle(sites)
    order = _Order(s)
    keep = []
    for tid, k, w, prods in sites[:64]:   # bounded: the BFS is linear in the schedule
        skip = {j for j, i in enumerate(s.tasks[tid].instrs) if i.kind is InstrKind.WAIT}
        if any(not order.ordered(p, tid, skip) for p in prods):
            keep.append((tid, k, w))
    return keep


def _hoist(s: Schedule, rng, addressed: bool) -> str:
    what = "router-addressed weight" if addressed else "activation"
    tid, k, w = _pick(rng, _hoist_sites(s, addressed), f"no {what} load after a wait whose producer is on another SM")
    t = s.tasks[tid]
    ins = t.instrs.pop(k)
    t.instrs.insert(w, ins)
    return f"task {tid}: {what} load of %{ins.region.tensor} hoisted above its wait e{t.instrs[w + 1].event}"


# -- the kinds -----------------------------------------------------------------------------------
def _hoist_act(s, rng):
    return _hoist(s, rng, False)


def _hoist_addr(s, rng):
    return _hoist(s, rng, True)


def _drop_wait(s, rng):
    writers, order = _writers(s), _Order(s)
    sites = []
    for tid, k, w in _hoist_sites(s, False):
        t = s.tasks[tid]
        prods = writers.get(t.instrs[k].region.tensor, set()) - {tid}
        for j in range(w, k):
            if t.instrs[j].kind is InstrKind.WAIT and any(not order.ordered(p, tid, {j}) for p in prods):
                sites.append((tid, j))
    tid, j = _pick(rng, set(sites), "no wait that alone orders a load after its producer")
    ins = s.tasks[tid].instrs.pop(j)
    return f"task {tid}: wait e{ins.event} >= {ins.threshold} dropped"


def _early_signal(s, rng):
    sites = []
    for t in s.tasks:
        stores = [k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE]
        sigs = [k for k, i in enumerate(t.instrs) if i.kind is InstrKind.SIGNAL]
        if stores and sigs and sigs[0] > stores[-1]:
            sites.append((t.id, sigs[0], stores[0]))
    counts: dict[tuple, int] = {}
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL:
                counts[(i.peer, i.event)] = counts.get((i.peer, i.event), 0) + 1
    # prefer a signal that orders data (a task waiting on its counter loads what the signaler
    # stores: an ack of consumed comm slots does not) on a counter with one signaler (its early
    # signal alone releases the consumer)
    waiters: dict[int, set] = {}
    for t in s.tasks:
        loads = {i.region.tensor for i in t.instrs if i.kind is InstrKind.LOAD}
        for i in t.instrs:
            if i.kind is InstrKind.WAIT:
                waiters.setdefault(i.event, set()).update(loads)

    def orders_data(x):
        t = s.tasks[x[0]]
        stored = {i.region.tensor for i in t.instrs if i.kind is InstrKind.STORE}
        return bool(stored & waiters.get(t.instrs[x[1]].event, set()))

    def alone(x):
        i = s.tasks[x[0]].instrs[x[1]]
        return counts[(i.peer, i.event)] == 1

    # and one whose early move some run can show: a waiter that loads what the task stores is
    # ordered after the task by this wait alone (not by its queue or by other waits on tasks
    # queued behind the signaler, which make the move harmless in every order; V6 rejects it still)
    order = _Order(s)

    def observable(x):
        t = s.tasks[x[0]]
        ev = t.instrs[x[1]].event
        stored = {i.region.tensor for i in t.instrs if i.kind is InstrKind.STORE}
        for w in s.tasks:
            skip = {k for k, i in enumerate(w.instrs) if i.kind is InstrKind.WAIT and i.event == ev}
            if skip and stored & {i.region.tensor for i in w.loads()} and not order.ordered(t.id, w.id, skip):
                return True
        return False

    data = [x for x in sites if orders_data(x)]
    pool = [x for x in data if alone(x)] or data or sites
    tid, k, first = _pick(rng, [x for x in pool if observable(x)] or pool, "no task signals after a store")
    t = s.tasks[tid]
    ins = t.instrs.pop(k)
    t.instrs.insert(first, ins)
    return f"task {tid}: signal e{ins.event} moved before its stores"


def _full_waits(s: Schedule):
    counts: dict[tuple, int] = {}
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL:
                key = ((i.peer - t.rank) % s.ranks if i.peer is not None else 0, i.event)
                counts[key] = counts.get(key, 0) + 1
    out = []
    for t in s.tasks:
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.WAIT and i.threshold > 0:
                key = ((i.peer - t.rank) % s.ranks if i.peer is not None else 0, i.event)
                if i.threshold >= counts.get(key, 0) > 0:
                    out.append((t.id, k))
    return out


def _threshold(s, rng, delta: int):
    sites = _full_waits(s)
    if delta < 0:   # only waits that alone order a load after its producer
        writers, order = _writers(s), _Order(s)
        need = set()
        for tid, k, w in _hoist_sites(s, False):
            prods = writers.get(s.tasks[tid].instrs[k].region.tensor, set()) - {tid}
            for j in range(w, k):
                if any(not order.ordered(p, tid, {j}) for p in prods):
                    need.add((tid, j))
        sites = [x for x in sites if x in need]
    tid, k = _pick(rng, sites, "no wait for all signals of an event")
    t = s.tasks[tid]
    ins = t.instrs[k]
    t.instrs[k] = replace(ins, threshold=ins.threshold + delta)
    return f"task {tid}: wait e{ins.event} threshold {ins.threshold} -> {ins.threshold + delta}"


def _comm_reuse(s, rng):
    if s.ranks < 2:
        raise MutationSkipped("one rank: no comm buffers")
    sites = []
    for t in s.tasks:
        stores_peer = any(i.kind is InstrKind.STORE and i.region.rank not in (None, t.rank) for i in t.instrs)
        for k, i in enumerate(t.instrs):
            if stores_peer and i.kind is InstrKind.WAIT and i.threshold == 0:
                sites.append((t.id, k))
    # keep acks that matter: the slot's readers on the peer do not reach the writer's rank
    # within the step some other way (e.g. through the next collective)
    order = _Order(s)
    m = order.m
    ends = {r: [ids[-1] for (rr, _), ids in m.queues.items() if rr == r and ids] for r in range(s.ranks)}
    keep = []
    for tid, k in sites:
        t = m.tasks[tid]
        for i in t.instrs:
            if i.kind is InstrKind.STORE and i.region.rank not in (None, t.rank):
                readers = [u.id for u in m.tasks if u.rank == i.region.rank and any(
                    j.kind is InstrKind.LOAD and j.region.tensor == i.region.tensor and j.region.rank is None
                    and j.region.overlaps(replace(i.region, rank=None)) for j in u.instrs)]
                # step k+1's write also follows step k's read if the writer already depends on
                # a task of the reader's rank in step k+1 (that rank finished step k first)
                late = any(m.tasks[a].rank == i.region.rank for a in order.ancestors(tid, {k}))
                if not late and any(not any(order.ordered(rd, e, set()) for e in ends[t.rank]) for rd in readers):
                    keep.append((tid, k))
                    break
    tid, k = _pick(rng, keep, "every ack wait is redundant (readers reach the writer's rank, or the writer follows the reader's rank, within the step)")
    ins = s.tasks[tid].instrs.pop(k)
    return f"task {tid}: ack wait e{ins.event} >= 0 before a peer comm write dropped"


def _deadlock(s, rng):
    q, sig = _queue_of(s), _signalers(s)
    sites = []
    for tid, k in _full_waits(s):
        t = s.tasks[tid]
        i = t.instrs[k]
        if i.peer is None:
            for p in sig.get(i.event, ()):
                if q.get(p) != q.get(tid) and q.get(p) is not None:
                    sites.append((tid, p))
    waiter, sgn = _pick(rng, set(sites), "no wait on a signaler of another SM")
    s.queues[q[sgn]].remove(sgn)
    wq = s.queues[q[waiter]]
    wq.insert(wq.index(waiter) + 1, sgn)
    s.tasks[sgn] = replace(s.tasks[sgn], sm=q[waiter][1])
    return f"task {sgn} (signaler) queued behind task {waiter}, which waits for it, on sm {q[waiter][1]}"


def _grid(s, rng):
    if s.ranks < 2:
        raise MutationSkipped("one rank: no other rank's grid to differ")
    m = s.materialize() if getattr(s, "replicated", False) else s
    keys = sorted(k for k in m.queues if k[0] == 1 and m.queues[k])
    if len(keys) < 2:
        raise MutationSkipped("rank 1 uses fewer than two SMs")
    a, b = rng.sample(keys, 2)
    tid = m.queues[a].pop()
    m.queues[b].append(tid)
    m.tasks[tid] = replace(m.tasks[tid], sm=b[1])
    s.__dict__.update(m.__dict__)
    return f"rank 1: task {tid} moved from sm {a[1]} to the end of sm {b[1]}"


_PLANT = {
    Mutation.hoist_act_load: _hoist_act,
    Mutation.hoist_addressed_load: _hoist_addr,
    Mutation.drop_wait: _drop_wait,
    Mutation.early_signal: _early_signal,
    Mutation.threshold_low: lambda s, rng: _threshold(s, rng, -1),
    Mutation.threshold_high: lambda s, rng: _threshold(s, rng, +1),
    Mutation.comm_reuse: _comm_reuse,
    Mutation.deadlock_order: _deadlock,
    Mutation.grid_differs: _grid,
}
