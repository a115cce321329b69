"""The memory-order verifier: proves a Schedule's loads, stores, waits and signals race-free.

Rules V1-V7 (DESIGN.md, docs/verifier.md) are each one function below. All of them are stated
over happens-before (HB) between instructions, which this module computes once per schedule:

* a task starts after the previous task of its (rank, sm) queue has finished (persistent CTA);
* a WAIT on event e with threshold t orders the instructions after it after *every* signaler
  of e only when t >= the signals e receives per step (fewer than all signals prove nothing
  about any particular signaler); HB is transitive.

HB is computed by simulating one step of the schedule (the same walk proves deadlock freedom,
V5) with a vector clock per instruction: `vc[q]` is the highest position in queue q whose task
has signalled something that reached this point. Queues are chains, so "task P at (q, p)
happens before instruction X" is `vc_X[q] >= p`: one array lookup, and the checks vectorize.
A schedule stored SPMD-compactly (rank 0's tasks only) is expanded to every rank first.
"""
from __future__ import annotations

import enum
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from fusec.ir.schedule import Instr, InstrKind, Region, Schedule, Scope, Sem
from fusec.ir.types import Kind

from ._memory_access import Access, BufferMap, expand_ranks, region_str


class Rule(enum.Enum):
    V1 = "V1"   # every read has a producer that happens before it
    V2 = "V2"   # no non-weight load placed before the wait that orders it
    V3 = "V3"   # run-time-addressed loads after the producer of the address
    V4 = "V4"   # no WAR / WAW race (incl. comm buffers reused next step)
    V5 = "V5"   # no deadlock; thresholds reachable
    V6 = "V6"   # signal after last store, release/acquire, sys scope across GPUs
    V7 = "V7"   # same grid and event layout on every rank


@dataclass(frozen=True)
class Violation:
    rule: Rule
    task: int | None
    region: str = ""
    wait: str = ""          # the wait that is missing or wrong
    message: str = ""

    def __str__(self) -> str:
        where = f"task {self.task}" if self.task is not None else "schedule"
        extra = (f" [region {self.region}]" if self.region else "") + (f" [wait {self.wait}]" if self.wait else "")
        return f"{self.rule.value}: {where}: {self.message}{extra}"


@dataclass
class Report:
    errors: list[Violation] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def first_error(self) -> str:
        return str(self.errors[0]) if self.errors else ""

    def rules(self) -> set[str]:
        return {e.rule.value for e in self.errors}


def check_schedule(schedule: Schedule) -> Report:
    """Check V1-V7; returns every violation found (V1-V4 only for tasks the step reaches)."""
    s = expand_ranks(schedule)
    rep = Report()
    rep.errors += v7_same_grid(s)
    rep.errors += v6_signal_semantics(s)
    hb = HappensBefore(s)
    rep.errors += v5_deadlock(s, hb)
    acc = Access(s, hb)
    rep.errors += v1_v2_producers(s, hb, acc)
    rep.errors += v3_addressed_loads(s, hb, acc)
    rep.errors += v4_races(s, hb, acc)
    rep.stats = {"tasks": len(s.tasks), "ranks": s.ranks, "queues": len(hb.qkeys)}
    return rep


# -- happens-before ------------------------------------------------------------------------------
class HappensBefore:
    """One simulated step: completion order, blocked waits, and a vector clock per instruction."""

    def __init__(self, s: Schedule):
        self.s = s
        self.qkeys = sorted(s.queues)
        nq = len(self.qkeys)
        self.where: dict[int, tuple[int, int]] = {}          # task id -> (queue index, position)
        self.dup: list[int] = []
        for qi, key in enumerate(self.qkeys):
            for p, tid in enumerate(s.queues[key]):
                if tid in self.where:
                    self.dup.append(tid)
                self.where[tid] = (qi, p)
        self.signals: dict[tuple[int, int], int] = defaultdict(int)   # (rank, event) -> count
        self.signalers: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # -> (task, instr)
        for t in s.tasks:
            for k, i in enumerate(t.instrs):
                if i.kind is InstrKind.SIGNAL:
                    self.signals[(target(t, i), i.event)] += 1
                    self.signalers[(target(t, i), i.event)].append((t.id, k))
        self.per_step = {(e.rank, e.id): e.per_step for e in s.events}
        self.vc: dict[int, list] = {}        # task id -> vc array before each instr (shared refs)
        self.done: set[int] = set()
        self.blocked: list[tuple[int, Instr, int]] = []   # (task, wait, counter reached)
        self._run(nq)

    def full(self, key: tuple[int, int], thr: int) -> bool:
        n = self.signals.get(key, 0)
        return n > 0 and thr >= n

    def _run(self, nq: int) -> None:
        s = self.s
        counter: dict[tuple[int, int], int] = defaultdict(int)
        evc: dict[tuple[int, int], np.ndarray] = {}
        waiting: dict[tuple[int, int], list[int]] = defaultdict(list)
        ptr = [[0, 0] for _ in range(nq)]                 # (position in queue, instr index)
        cur: list[np.ndarray | None] = [None] * nq
        ready = deque(range(nq))
        self.end = np.full((nq, nq), -1, dtype=np.int32)  # per queue: vc after its last task
        while ready:
            q = ready.popleft()
            queue = s.queues[self.qkeys[q]]
            while ptr[q][0] < len(queue):
                p, ii = ptr[q]
                task = s.tasks[queue[p]]
                if ii == 0:
                    v = np.full(nq, -1, dtype=np.int32) if cur[q] is None else cur[q].copy()
                    v[q] = p - 1
                    cur[q] = v
                    self.vc[task.id] = [None] * len(task.instrs)
                if ii == len(task.instrs):
                    self.done.add(task.id)
                    ptr[q] = [p + 1, 0]
                    continue
                ins = task.instrs[ii]
                if ins.kind is InstrKind.WAIT:
                    key = (target(task, ins), ins.event)
                    if counter[key] < ins.threshold:
                        waiting[key].append(q)
                        break
                    if self.full(key, ins.threshold):
                        cur[q] = np.maximum(cur[q], evc[key])
                elif ins.kind is InstrKind.SIGNAL:
                    key = (target(task, ins), ins.event)
                    counter[key] += 1
                    e = evc.get(key)
                    e = cur[q].copy() if e is None else np.maximum(e, cur[q])
                    e[q] = max(e[q], p)
                    evc[key] = e
                    ready.extend(waiting.pop(key, []))
                self.vc[task.id][ii] = cur[q]
                ptr[q][1] += 1
            else:
                if cur[q] is not None:
                    self.end[q] = cur[q]
                    self.end[q][q] = len(queue) - 1
                continue
        for q in range(nq):
            queue = s.queues[self.qkeys[q]]
            if ptr[q][0] < len(queue):
                task = s.tasks[queue[ptr[q][0]]]
                w = task.instrs[ptr[q][1]]
                self.blocked.append((task.id, w, counter[(target(task, w), w.event)]))

    def before(self, tid: int, other: int, idx: int) -> bool:
        """Does task `tid` (all of it) happen before instruction `idx` of task `other`?"""
        if tid == other:
            return False
        q, p = self.where[tid]
        return bool(self.vc[other][idx][q] >= p)

    def rank_reaches(self, tid: int, rank: int) -> bool:
        """Does task `tid` happen before some task of `rank` (so before that rank's next step)?"""
        q, p = self.where[tid]
        rows = [qi for qi, k in enumerate(self.qkeys) if k[0] == rank]
        return bool((self.end[rows, q] >= p).any())


def target(task, ins: Instr) -> int:
    return ins.peer if ins.peer is not None else task.rank


def wait_str(key, thr) -> str:
    return f"e{key[1]}@rank{key[0]} >= {thr}"


# -- the rules -----------------------------------------------------------------------------------
def v1_v2_producers(s: Schedule, hb: HappensBefore, acc: Access) -> list[Violation]:
    """V1: every read of act/state/comm/io-output data has its producers (all stores of the
    version it reads, covering the region) happening before it, and nothing in this step wrote
    a later version of that region first.  V2: a producer that is ordered only by a WAIT placed
    after the LOAD means the load was hoisted above its wait."""
    out = []
    for ld in acc.loads:
        if ld.kind in (Kind.weight,) or ld.is_input:
            continue
        same, later = acc.writers(ld)
        missing = [] if acc.all_before(ld) else [st for st in same if not acc.store_before_load(st, ld)]
        for st in missing:
            later_wait = next((j for j in range(ld.idx + 1, len(ld.task.instrs))
                               if ld.task.instrs[j].kind is InstrKind.WAIT
                               and hb.vc[ld.task.id][j] is not None and hb.before(st.task.id, ld.task.id, j)), None)
            if later_wait is not None:
                w = ld.task.instrs[later_wait]
                out.append(Violation(Rule.V2, ld.task.id, region_str(ld.region, ld.rank),
                                     wait_str((target(ld.task, w), w.event), w.threshold),
                                     f"load placed before the wait that orders it after producer task {st.task.id}"))
            else:
                out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank),
                                     f"a wait ordering it after task {st.task.id}",
                                     f"read does not happen after producer task {st.task.id}"))
            break
        if not missing and ld.needs_producer and not acc.covered(ld):
            out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank), "",
                                 "part of the region read has no producer in this step"))
        for st in later:
            if acc.store_before_load(st, ld):
                out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank), "",
                                     f"reads %{ld.region.tensor} but task {st.task.id} already wrote "
                                     f"%{st.region.tensor} over it in this step"))
                break
    return out


def v3_addressed_loads(s: Schedule, hb: HappensBefore, acc: Access) -> list[Violation]:
    """V3: a LOAD addressed by a run-time value (Instr.addressed_by) happens after every store
    of that value, even when it loads a weight."""
    out = []
    for ld in acc.loads:
        a = ld.region and ld.instr.addressed_by
        if not a:
            continue
        for st in acc.writers_of(a, ld.task.rank):
            if not acc.store_before_load(st, ld):
                out.append(Violation(Rule.V3, ld.task.id, region_str(ld.region, ld.rank),
                                     f"a wait ordering it after task {st.task.id}",
                                     f"load addressed by %{a} is not ordered after its producer task {st.task.id}"))
                break
    return out


def v4_races(s: Schedule, hb: HappensBefore, acc: Access) -> list[Violation]:
    """V4: no WAR/WAW race between unordered tasks, and no peer write into a comm buffer that
    the next step could issue before this step's reader consumed it (counters are monotonic,
    ranks drift by up to a step; a rank's next step starts after all its own tasks)."""
    out = []
    for ld in acc.loads:
        if ld.kind is Kind.weight or ld.is_input:
            continue
        same, later = acc.writers(ld)
        for st in later:
            if not acc.store_before_load(st, ld) and st.task.id != ld.task.id \
                    and not hb.before(ld.task.id, st.task.id, st.idx):
                out.append(Violation(Rule.V4, st.task.id, region_str(st.region, st.rank),
                                     f"a wait ordering it after reader task {ld.task.id}",
                                     f"write-after-read race: overwrites what task {ld.task.id} reads"))
                break
        for st in same:
            if st.task.rank != st.rank and st.task.rank != ld.task.rank:
                # peer write into this rank's buffer: step k+1's write must follow step k's read
                if not hb.rank_reaches(ld.task.id, st.task.rank) and not acc.after_rank(st, ld.task.rank) \
                        and not _acked_last_step(s, hb, st, ld):
                    out.append(Violation(Rule.V4, st.task.id, region_str(st.region, st.rank),
                                         f"a wait on rank {ld.task.rank} after reader task {ld.task.id}",
                                         f"comm buffer reused next step before reader task {ld.task.id} consumed it"))
                    break
    for a, b in acc.overlapping_store_pairs():
        if hb.before(a.task.id, b.task.id, b.idx) or hb.before(b.task.id, a.task.id, a.idx):
            continue
        out.append(Violation(Rule.V4, b.task.id, region_str(b.region, b.rank),
                             f"a wait ordering it after task {a.task.id}",
                             f"write-after-write race with task {a.task.id}"))
    return out


def _acked_last_step(s: Schedule, hb: HappensBefore, st, ld) -> bool:
    """Is step k+1's store `st` ordered after step k's load `ld` through a wait (any threshold,
    e.g. 0 = "all of the previous step's signals") whose signaler follows the read? A wait in
    step k+1 for counter >= (k+1) * per_step + t has seen every step-k signal."""
    q, p = hb.where[st.task.id]
    queue = s.queues[hb.qkeys[q]]
    for tid in queue[:p + 1]:
        t = s.tasks[tid]
        for k, w in enumerate(t.instrs):
            if tid == st.task.id and k >= st.idx:
                break
            if w.kind is not InstrKind.WAIT:
                continue
            for sig, si in hb.signalers.get((target(t, w), w.event), ()):
                if sig == ld.task.id or (hb.vc.get(sig) and hb.vc[sig][si] is not None
                                         and hb.before(ld.task.id, sig, si)):
                    return True
    return False


def v5_deadlock(s: Schedule, hb: HappensBefore) -> list[Violation]:
    """V5: every threshold is reachable (<= signals per step, declared per_step = actual),
    every task is on exactly one queue, and the queues run to completion (no deadlock)."""
    out = []
    queued = set(hb.where)
    for t in s.tasks:
        if t.id not in queued:
            out.append(Violation(Rule.V5, t.id, message="task is on no queue: it never runs"))
    for tid in hb.dup:
        out.append(Violation(Rule.V5, tid, message="task is on two queues"))
    for key, n in sorted(hb.signals.items()):
        if key in hb.per_step and hb.per_step[key] != n:
            out.append(Violation(Rule.V5, None, wait=f"e{key[1]}@rank{key[0]}",
                                 message=f"event declares per_step {hb.per_step[key]} but receives {n} "
                                         f"signals per step: later steps' thresholds are wrong"))
    unreachable = set()
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.WAIT:
                key = (target(t, i), i.event)
                if i.threshold > hb.signals.get(key, 0):
                    unreachable.add(t.id)
                    out.append(Violation(Rule.V5, t.id, wait=wait_str(key, i.threshold),
                                         message=f"threshold unreachable: only {hb.signals.get(key, 0)} signals per step"))
    for tid, w, reached in hb.blocked:
        if tid not in unreachable:
            t = s.tasks[tid]
            out.append(Violation(Rule.V5, tid, wait=wait_str((target(t, w), w.event), w.threshold),
                                 message=f"deadlock: queue (rank {t.rank}, sm {t.sm}) blocks here with the "
                                         f"counter at {reached}; queue order is not a topological order"))
    return out


def v6_signal_semantics(s: Schedule) -> list[Violation]:
    """V6: a SIGNAL follows the task's last STORE and is a release; a WAIT is an acquire;
    signals and waits on another rank's counter use system scope."""
    out = []
    remote_sig = set()      # counters some other rank signals
    for t in s.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL and target(t, i) != t.rank:
                remote_sig.add((target(t, i), i.event))
    for t in s.tasks:
        last_store = max((k for k, i in enumerate(t.instrs) if i.kind is InstrKind.STORE), default=-1)
        for k, i in enumerate(t.instrs):
            if i.kind is InstrKind.SIGNAL:
                if k < last_store:
                    r = t.instrs[last_store].region
                    out.append(Violation(Rule.V6, t.id, region_str(r, r.rank), "",
                                         f"signal e{i.event} issued before the task's last store"))
                if i.sem is not Sem.release:
                    out.append(Violation(Rule.V6, t.id, "", "",
                                         f"signal e{i.event} uses {i.sem.value} semantics, needs release"))
            if i.kind is InstrKind.WAIT and i.sem is not Sem.acquire:
                out.append(Violation(Rule.V6, t.id, "", f"e{i.event} >= {i.threshold}",
                                     f"wait uses {i.sem.value} semantics, needs acquire"))
            remote = i.peer is not None and i.peer != t.rank
            if i.kind is InstrKind.WAIT and not remote:   # a local counter that peers signal
                remote = (t.rank, i.event) in remote_sig
            if i.kind in (InstrKind.WAIT, InstrKind.SIGNAL) and remote and i.scope is not Scope.sys:
                out.append(Violation(Rule.V6, t.id, "", f"e{i.event} >= {i.threshold}" if i.kind is InstrKind.WAIT else "",
                                     f"cross-GPU {i.kind.value} e{i.event} uses {i.scope.value} scope, needs sys"))
    return out


def v7_same_grid(s: Schedule) -> list[Violation]:
    """V7: every rank runs the same grid (same SMs, same queue of equivalent tasks, with ranks
    taken relative to the task's own) and declares the same event layout."""
    out = []
    R = s.ranks
    if R == 1:
        return [Violation(Rule.V7, None, message=f"queue (rank {k[0]}, sm {k[1]}) outside the 1-rank x "
                                                 f"{s.sms}-SM grid") for k in s.queues
                if not (k[0] == 0 and 0 <= k[1] < s.sms)]
    for key in s.queues:
        if not (0 <= key[0] < R and 0 <= key[1] < s.sms):
            out.append(Violation(Rule.V7, None, message=f"queue (rank {key[0]}, sm {key[1]}) outside the "
                                                       f"{R}-rank x {s.sms}-SM grid"))
    layout = {r: {} for r in range(R)}
    for e in s.events:
        layout.setdefault(e.rank, {})[e.id] = (e.name, e.per_step)
    grids = {r: {k[1]: [_shape(s, s.tasks[t]) for t in ids] for k, ids in s.queues.items() if k[0] == r}
             for r in range(R)}
    for r in range(1, R):
        if layout[r] != layout[0]:
            out.append(Violation(Rule.V7, None, message=f"rank {r} declares a different event layout than rank 0"))
        if set(grids[r]) != set(grids[0]):
            out.append(Violation(Rule.V7, None, message=f"rank {r} uses SMs {sorted(grids[r])}, rank 0 uses "
                                                        f"{sorted(grids[0])}"))
            continue
        for sm, q in grids[0].items():
            if grids[r][sm] != q:
                bad = next((i for i, (a, b) in enumerate(zip(q, grids[r][sm])) if a != b), min(len(q), len(grids[r][sm])))
                tid = s.queues[(r, sm)][bad] if bad < len(s.queues[(r, sm)]) else None
                out.append(Violation(Rule.V7, tid, message=f"rank {r} sm {sm} queue differs from rank 0's at "
                                                           f"position {bad}"))
    return out


def _shape(s: Schedule, t) -> tuple:
    """A task with ranks made relative to its own (what SPMD symmetry must preserve)."""
    R = s.ranks

    def rel(r):
        return None if r is None else (r - t.rank) % R
    ins = tuple((i.kind, i.region and (i.region.tensor, i.region.box, rel(i.region.rank)), i.event, i.threshold,
                 i.sem, i.scope, rel(i.peer), i.addressed_by) for i in t.instrs)
    return (t.body_kind, t.ops, t.tile, ins)
