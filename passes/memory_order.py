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

from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from fusec.ir.gc_pause import gc_paused
from fusec.ir.schedule import Instr, InstrKind, Schedule, Scope, Sem
from fusec.ir.types import Kind

from ._clean_loads import clear_loads
from ._derive import Derived, structure
from ._rules import Rule, Violation
from .memory_access import Access, expand_ranks, region_str


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
    """Check S1-S4 and V1-V7; returns every violation found (V1-V4 only for tasks the step
    reaches). Structural errors (S1-S3, or an S4 region naming no tensor) stop the check there:
    the rules cannot be stated over such a schedule. Never raises on a malformed schedule."""
    rep = Report()
    # ~10^6 small containers (memo tables, clocks), almost none freed: see fusec.ir.gc_pause
    with gc_paused():
        return _check(schedule, rep)


def _check(schedule: Schedule, rep: Report) -> Report:
    try:
        syncs: list = []
        rep.errors += structure(schedule, syncs)
        if rep.errors:
            rep.stats = {"tasks": len(schedule.tasks), "ranks": schedule.ranks, "structural": True}
            return rep
        der = Derived(schedule)
        errs, fatal = der.check()
        rep.errors += errs
        if fatal:
            rep.stats = {"tasks": len(schedule.tasks), "ranks": schedule.ranks, "structural": True}
            return rep
        _check_rules(schedule, der, rep, syncs)
    except Exception as e:          # a schedule the checks above let through and still breaks a rule's code
        rep.errors.append(Violation(Rule.S1, None, message=f"malformed schedule: the verifier cannot analyse it "
                                                           f"({type(e).__name__}: {e})"))
    return rep


def _check_rules(schedule: Schedule, der: Derived, rep: Report, syncs: list | None = None) -> None:
    sym = bool(getattr(schedule, "replicated", False)) and schedule.ranks > 1
    s = schedule if sym else expand_ranks(schedule)
    rep.errors += v7_same_grid(s)
    if s is not schedule or syncs is None or len(syncs) != len(s.tasks):
        syncs = sync_instrs(s)          # an expanded schedule: other tasks than structure() saw
    rep.errors += v6_signal_semantics(s, syncs)
    hb = HappensBefore(s, symmetric=sym, syncs=syncs)
    rep.errors += v5_deadlock(s, hb)
    acc = Access(s, hb, der)
    rep.errors += v1_v2_producers(s, hb, acc)
    rep.errors += v3_addressed_loads(s, hb, acc)
    rep.errors += v4_races(s, hb, acc)
    rep.stats = {"tasks": len(s.tasks), "ranks": s.ranks, "queues": len(hb.qkeys), "symmetric": sym}


# -- happens-before ------------------------------------------------------------------------------
class HappensBefore:
    """One simulated step: completion order, blocked waits, and a vector clock per instruction.

    Explicit schedules: one clock entry per (rank, sm) queue, a task instance is its task.
    Symmetric mode (a replicated schedule, R > 1): only rank 0's queues are simulated, in the
    lockstep execution where every rank does the same thing at the same time (a legal execution,
    and it completes iff all do: waits are monotone). A task *instance* is (task id, copy):
    the rank-`copy` copy of a rank-0 task. Clocks are indexed by (rank, rank-0 queue), and the
    clock of copy c is rank 0's rolled by c along the rank axis (`vc_c[r] = vc_0[r - c]`). A signal
    to peer offset d is, on rank 0's counter, the signal of copy -d: its clock rolled by -d.
    """

    def __init__(self, s: Schedule, symmetric: bool = False, syncs: list | None = None):
        self.s = s
        self.sym = symmetric and s.ranks > 1
        self.R = s.ranks if self.sym else 1
        self.qkeys = sorted(s.queues)
        nq = len(self.qkeys)
        self.nq = nq
        self.where: dict[int, tuple[int, int]] = {}          # task id -> (queue index, position)
        self.dup: list[int] = []
        for qi, key in enumerate(self.qkeys):
            for p, tid in enumerate(s.queues[key]):
                if tid in self.where:
                    self.dup.append(tid)
                self.where[tid] = (qi, p)
        self.signals: dict[tuple[int, int], int] = defaultdict(int)   # counter key -> count
        # counter key -> (task, instr, signal target relative to the task) of every signaler
        self._signalers: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
        # task id -> [(instr index, instr)] of its WAITs and SIGNALs: the only instructions the
        # simulation and V5 / V6 act on (a full K3 task has ~2 among ~9)
        self.syncs: list[list[tuple[int, Instr]]] = sync_instrs(s) if syncs is None else syncs
        SIGNAL, sym = InstrKind.SIGNAL, self.sym
        signals, signalers = self.signals, self._signalers
        for t, sy in zip(s.tasks, self.syncs):
            for k, i in sy:
                if i.kind is SIGNAL:
                    tg = i.peer if i.peer is not None else t.rank      # target(t, i)
                    key = (0, i.event) if sym else (tg, i.event)         # self.ckey(tg, i.event)
                    signals[key] += 1
                    signalers[key].append((t.id, k, tg - t.rank))
        self.per_step = {self.ckey(e.rank, e.id): e.per_step for e in s.events}
        self.vc: dict[int, list] = {}        # task id -> vc array before each instr (shared refs)
        self.done: set[int] = set()
        self.blocked: list[tuple[int, Instr, int]] = []   # (task, wait, counter reached)
        width = self.R * nq
        longest = max((len(q) for q in s.queues.values()), default=0)
        self.dtype = np.int16 if longest < np.iinfo(np.int16).max else np.int32   # clocks are big at R > 1
        self._run(nq, width)

    def ckey(self, rank: int, event: int) -> tuple[int, int]:
        """The simulated counter that holds (rank, event)'s value: rank 0's in symmetric mode."""
        return (0, event) if self.sym else (rank, event)

    def signalers(self, rank: int, event: int):
        """(task id, instr index, copy) of every signal that counter (rank, event) receives."""
        R = self.s.ranks
        for tid, k, d in self._signalers.get(self.ckey(rank, event), ()):
            yield tid, k, ((rank - d) % R if self.sym else self.s.tasks[tid].rank)

    def roll(self, v: np.ndarray, shift: int) -> np.ndarray:
        """The clock of the copy `shift` ranks on (symmetric mode)."""
        if not self.sym or shift % self.R == 0:
            return v
        return np.roll(v.reshape(self.R, self.nq), shift, axis=0).reshape(-1)

    def full(self, key: tuple[int, int], thr: int) -> bool:
        n = self.signals.get(key, 0)
        return n > 0 and thr >= n

    def _run(self, nq: int, width: int) -> None:
        s = self.s
        counter: dict[tuple[int, int], int] = defaultdict(int)
        evc: dict[tuple[int, int], np.ndarray] = {}
        waiting: dict[tuple[int, int], list[int]] = defaultdict(list)
        # per queue: (position in queue, instr index, index into the task's syncs)
        ptr = [(0, 0, 0) for _ in range(nq)]
        cur: list[np.ndarray | None] = [None] * nq
        # Queues take turns one task at a time: a family spread over all queues has finished
        # by the time any queue reaches the next family's wait, so a queue rarely blocks (run
        # until blocked, nearly every task blocked once). The clocks do not depend on the order:
        # a wait merges only counters all of whose signals have arrived.
        ready = deque(range(nq))
        self.end = np.full((nq, width), -1, dtype=self.dtype)  # per queue: vc after its last task
        WAIT = InstrKind.WAIT
        tasks, vcs_of, syncs, signals, sym, roll = s.tasks, self.vc, self.syncs, self.signals, self.sym, self.roll
        done, maximum, dtype = self.done, np.maximum, self.dtype
        queues = [s.queues[k] for k in self.qkeys]
        while ready:
            q = ready.popleft()
            queue = queues[q]
            p, ii, si = ptr[q]
            if p >= len(queue):                 # an empty queue
                continue
            tid = queue[p]
            task = tasks[tid]
            n = len(task.instrs)
            if ii == 0:
                v = np.full(width, -1, dtype=dtype) if cur[q] is None else cur[q].copy()
                v[q] = p - 1
                cur[q] = v
                vcs = vcs_of[task.id] = [None] * n
                si = 0
            else:
                vcs = vcs_of[task.id]
            c = cur[q]
            sy = syncs[tid]
            rank = task.rank
            blocked = False
            # instructions between syncs see the clock of the last one (vcs[k]: before instr k)
            for si in range(si, len(sy)):
                k, ins = sy[si]
                if k > ii:
                    vcs[ii:k] = [c] * (k - ii)
                tg = ins.peer if ins.peer is not None else rank
                key = (0, ins.event) if sym else (tg, ins.event)
                if ins.kind is WAIT:
                    thr = ins.threshold
                    if counter[key] < thr:
                        waiting[key].append(q)
                        blocked = True
                        ii = k
                        break
                    got = signals.get(key, 0)
                    if got > 0 and thr >= got:      # `full`: a wait for every signaler
                        c = cur[q] = maximum(c, roll(evc[key], tg - rank) if sym else evc[key])
                else:                               # SIGNAL
                    counter[key] += 1
                    mine = c.copy()
                    mine[q] = max(mine[q], p)
                    if sym:
                        mine = roll(mine, rank - tg)
                    e = evc.get(key)
                    evc[key] = mine if e is None else maximum(e, mine)
                    w = waiting.pop(key, None)
                    if w:
                        ready.extend(w)
                vcs[k] = c
                ii = k + 1
            if blocked:
                ptr[q] = (p, ii, si)
                continue
            if ii < n:
                vcs[ii:n] = [c] * (n - ii)
            done.add(task.id)
            p += 1
            ptr[q] = (p, 0, 0)
            if p < len(queue):
                ready.append(q)
            else:
                self.end[q] = c
                self.end[q][q] = len(queue) - 1
        for q in range(nq):
            queue = s.queues[self.qkeys[q]]
            if ptr[q][0] < len(queue):
                task = s.tasks[queue[ptr[q][0]]]
                w = task.instrs[ptr[q][1]]
                self.blocked.append((task.id, w, counter[self.ckey(target(task, w), w.event)]))

    def cidx(self, tid: int, copy: int, rel: int = 0) -> int:
        """Clock index of task instance (tid, copy) as seen from an instance of copy `rel`."""
        q, _ = self.where[tid]
        return ((copy - rel) % self.R) * self.nq + q if self.sym else q

    def before(self, tid: int, other: int, idx: int, copy: int = 0, other_copy: int = 0) -> bool:
        """Does task instance (tid, copy) (all of it) happen before instruction `idx` of
        instance (other, other_copy)? (Copies matter in symmetric mode only.)"""
        if tid == other and (not self.sym or copy == other_copy):
            return False
        _, p = self.where[tid]
        return bool(self.vc[other][idx][self.cidx(tid, copy, other_copy)] >= p)

    def rank_rows(self, rank: int, rel: int = 0) -> slice | list[int]:
        """Clock entries of `rank`'s queues, seen from an instance of copy `rel`."""
        if self.sym:
            r = (rank - rel) % self.R
            return slice(r * self.nq, (r + 1) * self.nq)
        return [qi for qi, k in enumerate(self.qkeys) if k[0] == rank]

    def rank_reaches(self, tid: int, rank: int, copy: int = 0) -> bool:
        """Does instance (tid, copy) happen before some task of `rank` (so before that rank's
        next step)?"""
        _, p = self.where[tid]
        if self.sym:      # rank `rank`'s queue ends are rank 0's rolled by `rank`
            return bool((self.end[:, self.cidx(tid, copy, rank)] >= p).any())
        return bool((self.end[self.rank_rows(rank), self.cidx(tid, copy)] >= p).any())


def sync_instrs(s: Schedule) -> list[list[tuple[int, Instr]]]:
    """Per task (by position in `s.tasks`): [(instr index, instr)] of its WAITs and SIGNALs."""
    WAIT, SIGNAL = InstrKind.WAIT, InstrKind.SIGNAL
    return [[(k, i) for k, i in enumerate(t.instrs) if (kd := i.kind) is WAIT or kd is SIGNAL] for t in s.tasks]


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
    clear, _ = _cleared(hb, acc)
    for ld, ok in zip(acc.loads, clear):
        if ok or ld.kind in (Kind.weight,) or ld.is_input:
            continue
        same, later = acc.writers(ld)
        missing = [] if acc.all_before(ld) else [st for st in same if not acc.store_before_load(st, ld)]
        for st in missing:
            later_wait = next((j for j in range(ld.idx + 1, len(ld.task.instrs))
                               if ld.task.instrs[j].kind is InstrKind.WAIT
                               and hb.vc[ld.task.id][j] is not None
                               and hb.before(st.task.id, ld.task.id, j, st.copy, ld.copy)), None)
            if later_wait is not None:
                w = ld.task.instrs[later_wait]
                out.append(Violation(Rule.V2, ld.task.id, region_str(ld.region, ld.rank),
                                     wait_str((target(ld.task, w), w.event), w.threshold),
                                     f"load placed before the wait that orders it after producer task {acc.name(st)}"))
            else:
                out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank),
                                     f"a wait ordering it after task {acc.name(st)}",
                                     f"read does not happen after producer task {acc.name(st)}"))
            break
        if not missing and ld.needs_producer and not acc.covered(ld):
            out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank), "",
                                 "part of the region read has no producer in this step"))
        for st in later:
            if acc.store_before_load(st, ld):
                out.append(Violation(Rule.V1, ld.task.id, region_str(ld.region, ld.rank), "",
                                     f"reads %{ld.region.tensor} but task {acc.name(st)} already wrote "
                                     f"%{st.region.tensor} over it in this step"))
                break
    return out


def _cleared(hb: HappensBefore, acc: Access):
    """Per load: (cannot break V1/V2, cannot break V4), from the vectorized pre-check
    (`_clean_loads`); the rules' own code runs on the other loads only."""
    got = getattr(acc, "_cleared", None)
    if got is None:
        got = acc._cleared = clear_loads(hb, acc)
    return got


def v3_addressed_loads(s: Schedule, hb: HappensBefore, acc: Access) -> list[Violation]:
    """V3: a LOAD addressed by a run-time value (Instr.addressed_by) happens after every store
    of that value, even when it loads a weight."""
    out = []
    for ld in acc.loads:
        for a in ld.addr:       # derived from the graph, plus the declared annotation
            bad = next((st for st in acc.writers_of(a, ld.copy) if not acc.store_before_load(st, ld)), None)
            if bad is not None:
                how = "" if a == ld.instr.addressed_by else " (the graph's dataflow says so; the load's annotation does not)"
                out.append(Violation(Rule.V3, ld.task.id, region_str(ld.region, ld.rank),
                                     f"a wait ordering it after task {acc.name(bad)}",
                                     f"load addressed by %{a}{how} is not ordered after its producer task {acc.name(bad)}"))
                break
    return out


def v4_races(s: Schedule, hb: HappensBefore, acc: Access) -> list[Violation]:
    """V4: no WAR/WAW race between unordered tasks, and no peer write into a comm buffer that
    the next step could issue before this step's reader consumed it (counters are monotonic,
    ranks drift by up to a step; a rank's next step starts after all its own tasks)."""
    out = []
    _, clear = _cleared(hb, acc)
    for ld, ok in zip(acc.loads, clear):
        if ok or ld.kind is Kind.weight or ld.is_input:
            continue
        same, later = acc.writers(ld)
        for st in later:
            if not acc.store_before_load(st, ld) and not acc.same_instance(st, ld) \
                    and not hb.before(ld.task.id, st.task.id, st.idx, ld.copy, st.copy):
                out.append(Violation(Rule.V4, acc.tid(st), region_str(st.region, st.rank),
                                     f"a wait ordering it after reader task {ld.task.id}",
                                     f"write-after-read race: overwrites what task {ld.task.id} reads"))
                break
        for st in same:
            if st.copy != st.rank and st.copy != ld.copy:
                # peer write into this rank's buffer: step k+1's write must follow step k's read
                if not hb.rank_reaches(ld.task.id, st.copy, ld.copy) and not acc.after_rank(st, ld.copy) \
                        and not _acked_last_step(s, hb, st, ld):
                    out.append(Violation(Rule.V4, acc.tid(st), region_str(st.region, st.rank),
                                         f"a wait on rank {ld.copy} after reader task {ld.task.id}",
                                         f"comm buffer reused next step before reader task {ld.task.id} consumed it"))
                    break
    for a, b in acc.overlapping_store_pairs():
        if hb.before(a.task.id, b.task.id, b.idx, a.copy, b.copy) or hb.before(b.task.id, a.task.id, a.idx, b.copy, a.copy):
            continue
        out.append(Violation(Rule.V4, acc.tid(b), region_str(b.region, b.rank),
                             f"a wait ordering it after task {acc.name(a)}",
                             f"write-after-write race with task {acc.name(a)}"))
    return out


def _acked_last_step(s: Schedule, hb: HappensBefore, st, ld) -> bool:
    """Is step k+1's store `st` ordered after step k's load `ld` through a wait (any threshold,
    e.g. 0 = "all of the previous step's signals") whose signaler follows the read? A wait in
    step k+1 for counter >= (k+1) * per_step + t has seen every step-k signal."""
    q, p = hb.where[st.task.id]
    queue = s.queues[hb.qkeys[q]]
    R = s.ranks
    for tid in queue[:p + 1]:
        t = s.tasks[tid]
        for k, w in enumerate(t.instrs):
            if tid == st.task.id and k >= st.idx:
                break
            if w.kind is not InstrKind.WAIT:
                continue
            # the wait of st's instance (copy st.copy) is on its own copy's view of the counter
            tg = (target(t, w) + st.copy) % R if hb.sym else target(t, w)
            for sig, si, sc in hb.signalers(tg, w.event):
                if (sig == ld.task.id and (not hb.sym or sc == ld.copy)) or (
                        hb.vc.get(sig) and hb.vc[sig][si] is not None
                        and hb.before(ld.task.id, sig, si, ld.copy, sc)):
                    return True
    return False


def v5_deadlock(s: Schedule, hb: HappensBefore) -> list[Violation]:
    """V5: every threshold is reachable (<= signals per step, declared per_step = actual),
    every task is on exactly one queue, and the queues run to completion (no deadlock)."""
    out = []
    where = hb.where
    for t in s.tasks:
        if t.id not in where:
            out.append(Violation(Rule.V5, t.id, message="task is on no queue: it never runs"))
    for tid in hb.dup:
        out.append(Violation(Rule.V5, tid, message="task is on two queues"))
    # every declared counter, also one that no task signals any more (its threshold-0 waits of
    # the next step would wait for a signal that never comes)
    for key in sorted(set(hb.signals) | set(hb.per_step)):
        n = hb.signals.get(key, 0)
        if key in hb.per_step and hb.per_step[key] != n:
            out.append(Violation(Rule.V5, None, wait=f"e{key[1]}@rank{key[0]}",
                                 message=f"event declares per_step {hb.per_step[key]} but receives {n} "
                                         f"signals per step: later steps' thresholds are wrong"))
    unreachable = set()
    WAIT, signals, sym = InstrKind.WAIT, hb.signals, hb.sym
    for t, sy in zip(s.tasks, hb.syncs):
        for _, i in sy:
            if i.kind is WAIT:
                tg = i.peer if i.peer is not None else t.rank          # target(t, i)
                if i.threshold > signals.get((0, i.event) if sym else (tg, i.event), 0):
                    key = (tg, i.event)
                    unreachable.add(t.id)
                    out.append(Violation(Rule.V5, t.id, wait=wait_str(key, i.threshold),
                                         message=f"threshold unreachable: only {hb.signals.get(hb.ckey(*key), 0)} signals per step"))
    for tid, w, reached in hb.blocked:
        if tid not in unreachable:
            t = s.tasks[tid]
            out.append(Violation(Rule.V5, tid, wait=wait_str((target(t, w), w.event), w.threshold),
                                 message=f"deadlock: queue (rank {t.rank}, sm {t.sm}) blocks here with the "
                                         f"counter at {reached}; queue order is not a topological order"))
    return out


def v6_signal_semantics(s: Schedule, syncs: list | None = None) -> list[Violation]:
    """V6: a SIGNAL follows the task's last STORE and is a release; a WAIT is an acquire;
    signals and waits on another rank's counter use system scope. (`syncs`: `sync_instrs(s)`
    when the caller has it.)"""
    out = []
    if syncs is None:
        syncs = sync_instrs(s)
    remote_sig = set()      # counters some other rank signals
    sym = bool(getattr(s, "replicated", False))    # then every rank's counter e is alike: key (0, e)
    for t, sy in zip(s.tasks, syncs):
        for _, i in sy:
            if i.kind is InstrKind.SIGNAL and target(t, i) != t.rank:
                remote_sig.add((0 if sym else target(t, i), i.event))
    SIG, WAIT, STORE = InstrKind.SIGNAL, InstrKind.WAIT, InstrKind.STORE
    # The semantics and scope checks depend only on the instruction and the task's rank, and a
    # family's tasks share their WAIT / SIGNAL instructions: each (instruction, rank) that passes
    # them is remembered (by identity: all stay alive in `s`) and not checked again.
    passed: dict[int, dict[int, Instr]] = {}
    for t, sy in zip(s.tasks, syncs):
        if not sy:
            continue            # a task with only loads, compute and stores
        instrs = t.instrs
        last_store = len(instrs) - 1
        while last_store >= 0 and instrs[last_store].kind is not STORE:
            last_store -= 1
        ok = passed.get(t.rank)
        if ok is None:
            ok = passed[t.rank] = {}
        for k, i in sy:
            if i.kind is SIG and k < last_store:
                r = t.instrs[last_store].region
                out.append(Violation(Rule.V6, t.id, region_str(r, r.rank), "",
                                     f"signal e{i.event} issued before the task's last store"))
            if ok.get(id(i)) is i:
                continue
            n = len(out)
            if i.kind is SIG:
                if i.sem is not Sem.release:
                    out.append(Violation(Rule.V6, t.id, "", "",
                                         f"signal e{i.event} uses {i.sem.value} semantics, needs release"))
            elif i.kind is WAIT:
                if i.sem is not Sem.acquire:
                    out.append(Violation(Rule.V6, t.id, "", f"e{i.event} >= {i.threshold}",
                                         f"wait uses {i.sem.value} semantics, needs acquire"))
            else:
                continue
            remote = i.peer is not None and i.peer != t.rank
            if i.kind is WAIT and not remote:   # a local counter that peers signal
                remote = (0 if sym else t.rank, i.event) in remote_sig
            if remote and i.scope is not Scope.sys:
                out.append(Violation(Rule.V6, t.id, "", f"e{i.event} >= {i.threshold}" if i.kind is WAIT else "",
                                     f"cross-GPU {i.kind.value} e{i.event} uses {i.scope.value} scope, needs sys"))
            if len(out) == n:
                ok[id(i)] = i
    return out


def v7_same_grid(s: Schedule) -> list[Violation]:
    """V7: every rank runs the same grid (same SMs, same queue of equivalent tasks, with ranks
    taken relative to the task's own) and declares the same event layout."""
    out = []
    R = s.ranks
    if R == 1 or getattr(s, "replicated", False):
        # a replicated schedule is rank 0's grid by construction: every rank runs these queues
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
