"""The schedule fuzzer's oracle: is an edited schedule unsafe? Decided by running it, without
the memory-order verifier's code.

The fuzzer (`fusec.testing.schedule_fuzz`) edits a compiled schedule and asks two judges: the
verifier (`check_schedule`) and this oracle. The oracle shares no code with the verifier (it
imports neither `passes/memory_order.py`, `passes/_derive.py` nor `passes/memory_access.py`,
nor `fusec/testing/random_order.py`, which uses the latter): its buffer model, its notion
of what a task reads and writes, its structural checks and its executor are written here.

What the oracle calls unsafe, with a witness:

* **cannot run** (structurally malformed): task ids not 0..n-1, a queue naming a task that does
  not exist or a task on no queue / two queues, a task header whose (rank, sm) is not the queue
  it sits on, a rank, SM, peer or region rank outside the R x sms grid (a replicated schedule's
  lists are rank 0's), an event (rank, id) declared twice or on a rank that does not exist, a
  WAIT/SIGNAL on a counter nobody declared, a LOAD/STORE region naming no tensor or outside it,
  a task without exactly one COMPUTE. The executor below could not build its task table,
  counters or buffers for such a schedule.
* **read-only store**: a STORE into a weight or an io input (memory the host owns).
* **missing load**: a task whose LOADs before its COMPUTE do not cover what its body reads.
  What a task body reads and writes is taken from the *unedited* compiled schedule: the LOAD and
  STORE footprint the lowering gave the same task (same ops, same tile). That footprint passes
  the numeric random-order tests (tests/test_random_order.py), and the edits never change a
  task's ops or tile, so it is what the kernel's body for that task reads and computes.
* **race** (a poisoned read): the executor runs the schedule for two steps. Every element of
  every per-rank buffer carries a tag (step, version) of the write that made it; a LOAD of
  version v in step k needs tag (k, v) on every element the task's body reads; a store of a
  task whose COMPUTE has not run, or outside what the task computes, writes garbage; a run-time
  addressed load (expert weights by router ids, from the graph's `OpDef.addressed_by`, not from
  the schedule's annotation) needs its address value written at the moment of the load; graph
  outputs and state must hold the step's final versions when the rank finishes the step. A read
  of a wrong tag is what NaN poisoning of the numeric executor would turn into wrong logits.
* **deadlock**: the run cannot finish (the same run is the happens-before simulation: waits and
  signals are monotone counters, so if one maximal run gets stuck, every run does).
* **contract**: no run goes wrong, but the schedule breaks a rule of the format that no run of
  this executor can witness (DESIGN.md): a SIGNAL before its task's last STORE (V6), an event
  whose declared per_step is not the number of signals its counter receives. Reported apart.

Which orders: one random interleaving, with vector clocks along it (`_Clocks`); then every
ordering the data needs (`pairs_of`: the stores of what a LOAD reads before it, the LOAD before
later versions and next step's stores of the same elements, the address value's stores before
an addressed LOAD) that the clocks do not prove gets a *freeze run*: its first instruction is
held back while everything else runs as far as it can, then released. A freeze run is exact for
its pair (if the second instruction can run first, it does, and reads a wrong tag). The clocks
only choose which freeze runs to make; they use orderings every execution obeys (queue order,
the rank's step boundary, a WAIT after a SIGNAL that it cannot pass without, by counting every
signal of that counter over both steps), so a pair they call ordered is ordered, and every
unproven pair gets its freeze run (up to `max_witness` distinct ones per edit; more are
counted as `undecided`). A last random order runs the edited tasks' queues first.

What it cannot see: memory-model effects (relaxed signals, scopes: sequentially consistent
execution), values (a symbolic run; wrong numbers computed from the right data are the
numeric tests' job), races that need more than two steps to show.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, replace

import numpy as np

from fusec.ir.schedule import Event, InstrKind, Schedule, Scope, Sem, Task
from fusec.ir.types import Kind

from .schedule_fuzz_clocks import _Clocks, pairs_of

VMAX = 1 << 16          # tag = step * VMAX + version
NEVER = -1              # never written
GARBAGE = -2            # written by a store that did not compute it


@dataclass
class Verdict:
    unsafe: bool
    kind: str = "safe"      # safe | malformed | read-only store | missing load | race | deadlock | output
    why: str = ""
    runs: int = 0           # executor runs it took
    unproven: int = 0       # orderings the clocks did not prove (each got a freeze run, or was left)
    undecided: int = 0      # of those, left without a freeze run (over max_witness): a safe verdict is weaker

    def __str__(self) -> str:
        return f"{self.kind}: {self.why}" if self.unsafe else "safe"


class _Stop(Exception):
    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# -- buffers ------------------------------------------------------------------------------------
class Buffers:
    """value name -> (buffer, version): a value an op updates in place (`OpDef.aliases`) lives in
    its operand's buffer, one version later; kinds and concrete shapes per buffer."""

    def __init__(self, graph, dims, scratch):
        self.root: dict[str, tuple[str, int]] = {}
        self.kind: dict[str, Kind] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.producer = {}
        for v in graph.params:
            self.root[v.name] = (v.name, 0)
            self.kind[v.name] = v.kind
            self.shape[v.name] = tuple(v.type.concrete(dims))
        for op in graph.ops:
            al = op.opdef.aliases
            for ri, v in enumerate(op.outputs):
                self.producer[v.name] = op
                if ri in al:
                    b, ver = self.root[op.inputs[al[ri]].name]
                    self.root[v.name] = (b, ver + 1)
                else:
                    self.root[v.name] = (v.name, 0)
                    self.kind[v.name] = Kind.act if v.kind in (Kind.weight, Kind.state) else v.kind
                    self.shape[v.name] = tuple(v.type.concrete(dims))
        for name, ty in scratch.items():
            self.root[name] = (name, 0)
            self.kind[name] = ty.kind
            self.shape[name] = tuple(ty.concrete(dims))
        self.readonly = {b for b, k in self.kind.items() if k is Kind.weight} | {v.name for v in graph.inputs()}
        self.scratch = set(scratch)       # the lowering's comm slot buffers: no op makes them
        self.states = [v.name for v in graph.states()]
        self.outputs = [self.root[v.name] for v in graph.outputs]
        self._task = {}

    def task_access(self, ops: tuple):
        """(reads, writes, addressing) of a task computing `ops`: buffer -> version read (the
        operands made outside the task), buffer -> version written (the last one), and loaded
        buffer -> [(address buffer, version)] from the graph's `addressed_by`."""
        got = self._task.get(ops)
        if got is not None:
            return got
        prod = [self.producer[n] for n in ops]
        made = {v.name for op in prod for v in op.outputs}
        reads, writes, addr = {}, {}, {}
        for op in prod:
            for j, v in enumerate(op.inputs):
                if v.name in made:
                    continue
                b, ver = self.root[v.name]
                reads.setdefault(b, ver)
            for j, a in op.opdef.addressed_by.items():
                va = op.inputs[a]
                if va.name in made:
                    continue
                ab, aver = self.root[va.name]
                if ab in self.readonly:
                    continue
                addr.setdefault(self.root[op.inputs[j].name][0], []).append((ab, aver))
            for v in op.outputs:
                b, ver = self.root[v.name]
                writes[b] = max(ver, writes.get(b, -1))
        got = self._task[ops] = (reads, writes, addr)
        return got

    def load_version(self, name, reads):
        b, ver = self.root[name]
        if name == b and b in reads:
            return b, reads[b]
        return b, ver


# -- structure ----------------------------------------------------------------------------------
def structure(s: Schedule, bufs: Buffers) -> str | None:
    """Why the executor cannot build this schedule's task table, counters or buffers (None: it can)."""
    R, S = s.ranks, s.sms
    if not _is_int(R) or R < 1 or not _is_int(S) or S < 1:
        return f"grid {R!r} x {S!r}"
    rep = bool(s.replicated)
    ranks_ok = range(1) if rep else range(R)
    n = len(s.tasks)
    for i, t in enumerate(s.tasks):
        if t.id != i:
            return f"task at position {i} has id {t.id!r}"
        if not _is_int(t.rank) or t.rank not in ranks_ok:
            return f"task {i} on rank {t.rank!r}"
        if not _is_int(t.sm) or not 0 <= t.sm < S:
            return f"task {i} on sm {t.sm!r}"
    where = {}
    for key, ids in s.queues.items():
        if not (isinstance(key, tuple) and len(key) == 2 and _is_int(key[0]) and key[0] in ranks_ok
                and _is_int(key[1]) and 0 <= key[1] < S):
            return f"queue {key!r}"
        for tid in ids:
            if not _is_int(tid) or not 0 <= tid < n:
                return f"queue {key} lists task {tid!r}, which does not exist"
            if tid in where:
                return f"task {tid} is on queues {where[tid]} and {key}"
            where[tid] = key
            t = s.tasks[tid]
            if (t.rank, t.sm) != key:
                return f"task {tid}'s header names rank {t.rank} sm {t.sm}, but it sits on queue {key}"
    if len(where) != n:
        missing = next(i for i in range(n) if i not in where)
        return f"task {missing} is on no queue"
    declared = set()
    for e in s.events:
        if not _is_int(e.id) or e.id < 0 or not _is_int(e.rank) or e.rank not in ranks_ok:
            return f"event {e.id!r} declared on rank {e.rank!r}"
        if not _is_int(e.per_step) or e.per_step < 0:
            return f"event {e.id} per_step {e.per_step!r}"
        if (e.rank, e.id) in declared:
            return f"event {e.id} on rank {e.rank} declared twice"
        declared.add((e.rank, e.id))
    for t in s.tasks:
        computes = 0
        for i in t.instrs:
            k = i.kind
            if k is InstrKind.COMPUTE:
                computes += 1
                continue
            if k in (InstrKind.LOAD, InstrKind.STORE):
                r = i.region
                if r is None or r.tensor not in bufs.root:
                    return f"task {t.id}: {k.value} of no known tensor"
                if r.rank is not None and (not _is_int(r.rank) or r.rank not in range(R)):
                    return f"task {t.id}: {k.value} of %{r.tensor} on rank {r.rank!r}"
                shape = bufs.shape[bufs.root[r.tensor][0]]
                if len(r.box) != len(shape) or not all(
                        _is_int(a) and _is_int(b) and 0 <= a <= b <= d for (a, b), d in zip(r.box, shape)):
                    return f"task {t.id}: {k.value} box {r.box} outside %{r.tensor} {list(shape)}"
                continue
            if k not in (InstrKind.WAIT, InstrKind.SIGNAL):
                return f"task {t.id}: instruction {k!r}"
            if i.peer is not None and (not _is_int(i.peer) or i.peer not in range(R)):
                return f"task {t.id}: {k.value} on peer {i.peer!r}"
            if not _is_int(i.event):
                return f"task {t.id}: {k.value} on event {i.event!r}"
            target = 0 if rep else (t.rank if i.peer is None else i.peer)
            if (target, i.event) not in declared:
                return f"task {t.id}: {k.value} on e{i.event} of rank {target}, which is not declared"
            if k is InstrKind.WAIT and (not _is_int(i.threshold) or i.threshold < 0):
                return f"task {t.id}: wait threshold {i.threshold!r}"
        if computes != 1:
            return f"task {t.id} has {computes} compute lines"
    if not rep and R > 1:
        return _spmd(s)
    return None


def _spmd(s: Schedule) -> str | None:
    """The megakernel is one task table that every rank runs (DESIGN.md): an explicit schedule
    must be rank 0's queues, tasks and events on every rank, with ranks relative to the task's."""
    R = s.ranks

    def rel(t):
        def r(x):
            return None if x is None else (x - t.rank) % R
        return (t.body_kind, t.ops, t.tile, tuple(
            (i.kind, i.region and (i.region.tensor, i.region.box, r(i.region.rank)), i.event, i.threshold,
             i.sem, i.scope, r(i.peer), i.addressed_by) for i in t.instrs))

    layout = {}
    for e in s.events:
        layout.setdefault(e.rank, set()).add((e.id, e.name, e.per_step))
    grid = {}
    for (r, sm), ids in s.queues.items():
        grid.setdefault(r, {})[sm] = [rel(s.tasks[t]) for t in ids]
    for r in range(1, R):
        if layout.get(r, set()) != layout.get(0, set()):
            return f"rank {r} declares other events than rank 0 (one task table runs on every rank)"
        a, b = grid.get(0, {}), grid.get(r, {})
        if {k for k, v in a.items() if v} != {k for k, v in b.items() if v}:
            return f"rank {r} uses other SMs than rank 0 (one task table runs on every rank)"
        for sm, q in a.items():
            if q != b.get(sm, []):
                return f"rank {r} sm {sm} runs other tasks than rank 0's (one task table runs on every rank)"
    return None


# -- footprints ---------------------------------------------------------------------------------
def _slices(box):
    return tuple(slice(a, b) for a, b in box)


def _inter(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) else None


def _footprint(task, bufs, R):
    """What the unedited task reads (LOADs before its COMPUTE, of buffers its ops read) and
    writes (its STOREs): [(rank offset, buffer, version, box)]."""
    reads, writes, _ = bufs.task_access(task.ops)
    rd, wr, seen_compute = [], [], False
    for i in task.instrs:
        if i.kind is InstrKind.COMPUTE:
            seen_compute = True
        elif i.kind is InstrKind.LOAD and not seen_compute:
            b, ver = bufs.load_version(i.region.tensor, reads)
            if b in reads or b in bufs.scratch:
                off = 0 if i.region.rank is None else (i.region.rank - task.rank) % R
                rd.append((off, b, ver, i.region.box))
        elif i.kind is InstrKind.STORE:
            b, _ = bufs.root[i.region.tensor]
            off = 0 if i.region.rank is None else (i.region.rank - task.rank) % R
            wr.append((off, b, writes.get(b, 0), i.region.box))
    return rd, wr


class Oracle:
    """Prepared once per compiled (unedited) schedule; `classify(edited)` judges one edit."""

    def __init__(self, base: Schedule, steps: int = 2, seed: int = 0):
        self.base = base
        self.steps = steps
        self.seed = seed
        self.bufs = Buffers(base.graph, base.dims, dict(getattr(base, "buffers", {})))
        why = structure(base, self.bufs)
        if why:
            raise ValueError(f"the unedited schedule is malformed: {why}")
        self.R = base.ranks
        self.mat = base.materialize()
        self.n0 = len(base.tasks)
        self._rank_of = [t.rank for t in self.mat.tasks]
        # every tracked buffer of every rank is a view into one array, reset at each run's start
        keys = [((r, b), shape) for r in range(self.R) for b, shape in self.bufs.shape.items()
                if b not in self.bufs.readonly]
        self._flat = np.empty(sum(int(np.prod(sh)) for _, sh in keys), dtype=np.int64)
        self._tags, at = {}, 0
        for key, shape in keys:
            size = int(np.prod(shape))
            self._tags[key] = self._flat[at:at + size].reshape(shape)
            at += size
        self.fp = [_footprint(t, self.bufs, self.R) for t in self.mat.tasks]
        self._plans = {}
        self.base_prog = self._program(self.mat, set())
        # writers / readers of each (rank, buffer), for the freeze runs' partners
        self.writers, self.readers = {}, {}
        for t in self.mat.tasks:
            rd, wr = self.fp[t.id]
            for off, b, ver, box in rd:
                self.readers.setdefault(((t.rank + off) % self.R, b), []).append((t.id, ver, box))
            for off, b, ver, box in wr:
                self.writers.setdefault(((t.rank + off) % self.R, b), []).append((t.id, ver, box))
        self.base_pairs = pairs_of(self.base_prog[0], self._rank_of, steps)
        self.passes = 3         # clock passes before freeze runs (K3 tiny at R = 8 needs 3 to prove itself)
        # the state each rank holds after one clean step (relative tags): what every step must leave
        self.final = {}
        v = self._run(self.base_prog, "random", random.Random(seed), steps=1, record_final=True)
        if v is None:
            v = self._run(self.base_prog, "random", random.Random(seed + 1))
        if v is not None:
            raise ValueError(f"the unedited schedule fails the oracle's own run: {v.kind}: {v.why}")
        self._sync_tables(seed)

    # -- the synchronization skeleton ------------------------------------------------------------
    @staticmethod
    def _skeleton(plan):
        return tuple(op[:3] for op in plan[0] if op[0] in ("W", "G"))

    def _sync_tables(self, seed):
        """The unedited schedule's clocks at every sync point (each WAIT, SIGNAL and step end of
        every queue), in sync-point units. An edit that keeps every queue's sequence of WAITs and
        SIGNALs (and the events, and the queues' tasks) keeps the happens-before relation between
        sync points, so these clocks still hold for it: a LOAD or STORE is ordered by the last
        WAIT before it and publishes at the first SIGNAL after it."""
        plans, qkeys, queues, per_step = self.base_prog
        c = _Clocks(self.base_prog, self.steps)
        c.reset()
        v = self._run(self.base_prog, "random", random.Random(seed + 2), clocks=c)
        if v is not None:
            raise ValueError(f"the unedited schedule fails the oracle's own run: {v.kind}: {v.why}")
        for j in range(self.passes - 1):
            if j == self.passes - 2:
                c.record = True
            c = c.again()
        self.base_unproven = len(c.unproven(self.base_pairs))
        self.skeleton = [self._skeleton(p) for p in plans]
        conv = []                   # per queue: base gidx of a sync point -> its sync index
        for q, ids in enumerate(queues):
            d, idx, g = {}, 0, 0
            for k in range(self.steps):
                for t in ids:
                    for op in plans[t][0]:
                        if op[0] in ("W", "G"):
                            d[2 * g] = idx
                            idx += 1
                        g += 1
                d[2 * (g - 1) + 1] = idx    # the step's end
                idx += 1
            conv.append(d)
        self.sync_clock = {}            # (queue, sync index) -> clock in sync units
        for q, ids in enumerate(queues):
            idx, g = 0, 0
            for k in range(self.steps):
                for t in ids:
                    for op in plans[t][0]:
                        if op[0] == "W":
                            self.sync_clock[(q, idx)] = self._conv(c.rec[(q, g)], conv)
                        if op[0] in ("W", "G"):
                            idx += 1
                        g += 1
                if (q, "end", k) in c.rec:
                    self.sync_clock[(q, idx)] = self._conv(c.rec[(q, "end", k)], conv)
                idx += 1

    @staticmethod
    def _conv(v, conv):
        return np.array([-1 if x < 0 else conv[j][int(x)] for j, x in enumerate(v)], dtype=np.int64)

    def _fast_pairs(self, prog, changed):
        """For an edit that keeps the synchronization skeleton and the changed tasks' STOREs:
        the pairs with a changed task that the unedited schedule's sync clocks do not prove."""
        plans, qkeys, queues, per_step = prog
        pairs = pairs_of(plans, self._rank_of, self.steps, only=set(changed))
        if not len(pairs[0]):
            return pairs, np.zeros(0, dtype=np.int64)
        involved = set(pairs[0].tolist()) | set(pairs[3].tolist())
        # per (task, instr, step): (queue, position, last WAIT / step start before, first SIGNAL / step end after)
        where = {}
        for q, ids in enumerate(queues):
            if not involved.intersection(ids):
                continue
            idx, g, last = 0, 0, -1
            for k in range(self.steps):
                pending = []
                for t in ids:
                    for i, op in enumerate(plans[t][0]):
                        if op[0] == "W":
                            last = idx
                        if op[0] == "G":        # publishes what its queue did before it
                            for key in pending:
                                where[key] = where[key][:3] + (idx,)
                            pending = []
                        if op[0] in ("W", "G"):
                            idx += 1
                        elif t in involved and op[0] in ("L", "S"):
                            where[(t, i, k)] = (q, g, last, None)
                            pending.append((t, i, k))
                        g += 1
                for key in pending:         # published by the step's end
                    where[key] = where[key][:3] + (idx,)
                last = idx
                idx += 1
        ok = np.ones(len(pairs[0]), dtype=bool)
        for x in range(len(pairs[0])):
            qa, ga, _, nxt = where[(int(pairs[0][x]), int(pairs[1][x]), int(pairs[2][x]))]
            qb, gb, lastw, _ = where[(int(pairs[3][x]), int(pairs[4][x]), int(pairs[5][x]))]
            if qa == qb:
                ok[x] = ga < gb
            else:
                ok[x] = lastw >= 0 and self.sync_clock[(qb, lastw)][qa] >= nxt
        return pairs, np.nonzero(~ok)[0]

    def _keeps_skeleton(self, prog, changed, per_step) -> bool:
        plans, _, queues, _ = prog
        if queues != self.base_prog[2] or per_step != self.base_prog[3]:
            return False
        for t in changed:
            if self._skeleton(plans[t]) != self.skeleton[t]:
                return False
            # the same STOREs, all of them of what the task computes, after its COMPUTE
            if any(op[0] == "RO" or (op[0] == "S" and (op[4] is not True or op[6])) for op in plans[t][0]):
                return False
            mine = sorted((op[1], op[2], op[7]) for op in plans[t][0] if op[0] == "S")
            if mine != sorted((op[1], op[2], op[7]) for op in self.base_prog[0][t][0] if op[0] == "S"):
                return False
        return True

    # -- compile a schedule into per-task plans --------------------------------------------------
    def _program(self, m: Schedule, changed: set):
        plans = []
        for t in m.tasks:
            if t.id not in changed and t.id < len(self.mat.tasks) and t.id in self._plans:
                plans.append(self._plans[t.id])
                continue
            p = self._plan(t, m)
            if t.id not in changed:
                self._plans[t.id] = p
            plans.append(p)
        qkeys = sorted(k for k, v in m.queues.items() if v)
        queues = [list(m.queues[k]) for k in qkeys]
        per_step = {(e.rank, e.id): e.per_step for e in m.events}
        return plans, qkeys, queues, per_step

    def _plan(self, t, m):
        """The task's instructions as the executor runs them, with what each LOAD must find."""
        bufs, R = self.bufs, self.R
        reads, writes, addr = bufs.task_access(t.ops)
        need, made = self.fp[t.id]
        plan = []
        compute_at = next(k for k, i in enumerate(t.instrs) if i.kind is InstrKind.COMPUTE)
        covered = {}
        for k, i in enumerate(t.instrs):
            kind = i.kind
            if kind is InstrKind.WAIT:
                plan.append(("W", (t.rank if i.peer is None else i.peer, i.event), i.threshold))
            elif kind is InstrKind.SIGNAL:
                plan.append(("G", (t.rank if i.peer is None else i.peer, i.event)))
            elif kind is InstrKind.COMPUTE:
                plan.append(("C",))
            elif kind is InstrKind.LOAD:
                reg = i.region
                b, ver = bufs.load_version(reg.tensor, reads)
                off = 0 if reg.rank is None else (reg.rank - t.rank) % R
                trank = (t.rank + off) % R
                boxes = []      # the parts of what the body reads that this load brings
                if bufs.kind[b] is not Kind.weight and b not in bufs.readonly and k < compute_at:
                    for noff, nb, nver, nbox in need:
                        if (noff, nb, nver) == (off, b, ver):
                            x = _inter(nbox, reg.box)
                            if x is not None:
                                boxes.append(x)
                if k < compute_at:
                    covered.setdefault((off, b, ver), []).append(reg.box)
                adds = [(ab, aver) for ab, aver in addr.get(b, [])] if k < compute_at else []
                plan.append(("L", (trank, b), ver, [_slices(x) for x in boxes], adds, reg.tensor, boxes))
            else:
                reg = i.region
                b, _ = bufs.root[reg.tensor]
                off = 0 if reg.rank is None else (reg.rank - t.rank) % R
                trank = (t.rank + off) % R
                if b in bufs.readonly:
                    plan.append(("RO", b))
                    continue
                ver = writes.get(b, 0)
                valid = None
                mine = [mbox for moff, mb, _, mbox in made if (moff, mb) == (off, b)]
                if mine:
                    if any(all(a0 <= x0 and x1 <= a1 for (a0, a1), (x0, x1) in zip(mb_, reg.box)) for mb_ in mine):
                        valid = True
                    else:
                        mask = np.zeros(tuple(x1 - x0 for x0, x1 in reg.box), dtype=bool)
                        for mb_ in mine:
                            x = _inter(mb_, reg.box)
                            if x is not None:
                                mask[tuple(slice(a - o0, c - o0) for (a, c), (o0, _) in zip(x, reg.box))] = True
                        valid = mask if mask.any() else None
                plan.append(("S", (trank, b), ver, _slices(reg.box), valid, ver > 0, k < compute_at, reg.box))
        # static: does what the task loads before its compute cover what its body reads?
        missing = None
        for noff, nb, nver, nbox in need:
            boxes = covered.get((noff, nb, nver), [])
            if any(all(a0 <= x0 and x1 <= a1 for (a0, a1), (x0, x1) in zip(cb, nbox)) for cb in boxes):
                continue
            mask = np.zeros(tuple(x1 - x0 for x0, x1 in nbox), dtype=bool)
            for cb in boxes:
                x = _inter(cb, nbox)
                if x is not None:
                    mask[tuple(slice(a - o0, c - o0) for (a, c), (o0, _) in zip(x, nbox))] = True
            if not mask.all():
                missing = (f"task {t.id} reads %{nb} {list(nbox)} (v{nver}) but loads only "
                           f"{int(mask.sum())} of its {mask.size} elements before its compute")
                break
        return plan, missing

    # -- one run ---------------------------------------------------------------------------------
    def _run(self, prog, policy, rng, freeze=None, focus_queues=(), record_final=False, steps=None, clocks=None):
        """One order. `policy`: random (a random runnable queue, for a burst of 1-8
        instructions) | first (the focus queues run whenever they can) | last (only when nothing
        else can); `freeze` = (task id, instruction index, step): that instruction waits until
        nothing else can run, then its queue alone goes on until its task ends or blocks, and the
        run stops. `clocks` (a `_Clocks`) records happens-before along the run. Returns a
        Verdict for an unsafe run, else None."""
        plans, qkeys, queues, per_step = prog
        R, bufs = self.R, self.bufs
        steps = steps or self.steps
        nq = len(qkeys)
        body = [p[0] for p in plans]
        rank_of_task = self._rank_of
        self._flat.fill(NEVER)
        tags = self._tags
        counter = {}
        step = [0] * nq
        pos = [0] * nq
        idx = [0] * nq
        computed = [False] * nq
        rank_of = [k[0] for k in qkeys]
        nqr = [0] * R
        for q in range(nq):
            nqr[rank_of[q]] += 1
        left = list(nqr)
        rstep = [0] * R
        blocked = {}
        parked = [[] for _ in range(R)]
        active = []
        frozen = [None]
        fz_q = fz_pos = finstr = fstep = None
        if freeze is not None:
            ftask, finstr, fstep = freeze
            for q in range(nq):
                if ftask in queues[q]:
                    fz_q, fz_pos = q, queues[q].index(ftask)
        prio = None
        if policy in ("first", "last"):
            hi = 1 if policy == "first" else 0
            prio = [hi if q in focus_queues else 1 - hi for q in range(nq)]

        def start_step(r, k):
            for b in bufs.states:
                t = tags[(r, b)]
                if k == 0:
                    t[...] = 0
                else:
                    ok = t == (k - 1) * VMAX + self.final[(r, b)]
                    t[ok] = k * VMAX
                    t[~ok] = GARBAGE

        def finish_step(r, k):
            if clocks is not None:
                clocks.barrier([q for q in range(nq) if rank_of[q] == r], k)
            for b, ver in bufs.outputs:
                if not (tags[(r, b)] == k * VMAX + ver).all():
                    raise _Stop("output", f"rank {r} step {k}: output %{b} does not hold the step's "
                                          f"v{ver} everywhere at the end of the step")
            for b in bufs.states:
                t = tags[(r, b)]
                if record_final:
                    self.final[(r, b)] = t.copy()
                elif not (t == k * VMAX + self.final[(r, b)]).all():
                    raise _Stop("output", f"rank {r} step {k}: state %{b} is not the step's final "
                                          f"version everywhere at the end of the step")

        def can_go(q):
            """Whether q's next instruction can run now; if not, q is filed as blocked, parked
            at its rank's step boundary, frozen, or done."""
            if step[q] >= steps:
                return False
            if step[q] != rstep[rank_of[q]]:
                parked[rank_of[q]].append(q)
                return False
            if q == fz_q and step[q] == fstep and pos[q] == fz_pos and idx[q] == finstr and frozen[0] is None:
                frozen[0] = q
                return False
            op = body[queues[q][pos[q]]]
            i = idx[q]
            if i < len(op) and op[i][0] == "W":
                key, th = op[i][1], op[i][2]
                need = step[q] * per_step.get(key, 0) + th
                if counter.get(key, 0) < need:
                    blocked.setdefault(key, []).append((q, need))
                    return False
            return True

        try:
            for r in range(R):
                start_step(r, 0)
            for q in range(nq):
                if can_go(q):
                    active.append(q)
            solo = None
            while True:
                if solo is not None:
                    q, burst = solo, 1 << 30
                elif not active:
                    if frozen[0] is None or frozen[0] == -1:
                        break
                    solo = q = frozen[0]
                    frozen[0] = -1              # released: never freezes again
                    burst = 1 << 30
                elif prio is not None:
                    cands = [j for j, x in enumerate(active) if prio[x]] or range(len(active))
                    j = cands[int(rng.random() * len(cands))]
                    q = active[j]
                    active[j] = active[-1]
                    active.pop()
                    burst = 1 << 30
                else:
                    j = int(rng.random() * len(active))
                    q = active[j]
                    active[j] = active[-1]
                    active.pop()
                    burst = 1 + int(rng.random() * 8)
                while True:
                    k = step[q]
                    tid = queues[q][pos[q]]
                    ins = body[tid]
                    i = idx[q]
                    c = None
                    if i < len(ins):
                        op = ins[i]
                        c = op[0]
                        if c == "L":
                            checks, adds = op[3], op[4]
                            if checks:
                                t = tags[op[1]]
                                want = k * VMAX + op[2]
                                for sl in checks:
                                    if (t[sl] != want).any():
                                        raise _Stop("race", f"step {k} task {tid}: load of %{op[5]} reads "
                                                            f"elements not holding v{op[2]} of step {k} "
                                                            f"({_tagdesc(t[sl], want)})")
                            for ab, aver in adds:
                                if not (tags[(rank_of_task[tid], ab)] == k * VMAX + aver).all():
                                    raise _Stop("race", f"step {k} task {tid}: load of %{op[5]}, addressed "
                                                        f"by %{ab}, before that address is written")
                        elif c == "S":
                            _, key, ver, sl, valid, inplace, _pre, _box = op
                            t = tags[key]
                            if not computed[q] or valid is None:
                                t[sl] = GARBAGE
                            else:
                                new = k * VMAX + ver
                                if inplace:
                                    old = t[sl]
                                    ok = (old >= k * VMAX) & (old < new)
                                    if valid is not True:
                                        ok &= valid
                                    t[sl] = np.where(ok, new, GARBAGE)
                                elif valid is True:
                                    t[sl] = new
                                else:
                                    t[sl] = np.where(valid, new, GARBAGE)
                        elif c == "G":
                            key = op[1]
                            if clocks is not None:
                                clocks.signal(q, tid, i, k, key)
                            cnt = counter[key] = counter.get(key, 0) + 1
                            waiters = blocked.pop(key, None)
                            if waiters:
                                still = []
                                for w, nd in waiters:
                                    (active.append(w) if cnt >= nd else still.append((w, nd)))
                                if still:
                                    blocked[key] = still
                        elif c == "C":
                            computed[q] = True
                        elif c == "W":
                            if clocks is not None:
                                clocks.wait(q, tid, i, k, op[1], k * per_step.get(op[1], 0) + op[2])
                        elif c == "RO":
                            raise _Stop("read-only store", f"task {tid} stores into %{op[1]}")
                        if clocks is not None:
                            clocks.gq[q] += 1
                            if c == "L" or c == "S":
                                row = clocks.rowbase[q] + clocks.gq[q] - 1
                                clocks.snap[row] = clocks.cur[q]
                                clocks.log.append((0, q, row))
                        idx[q] = i = i + 1
                        burst -= 1
                        if burst > 0 and i < len(ins) and ins[i][0] != "W" and q != fz_q \
                                and not (c == "G" and prio is not None):
                            continue
                        burst += 1
                    else:                       # the task is done
                        computed[q] = False
                        if solo is not None:
                            return None
                        idx[q], pos[q] = 0, pos[q] + 1
                        if pos[q] == len(queues[q]):
                            pos[q], step[q] = 0, k + 1
                            r = rank_of[q]
                            left[r] -= 1
                            if left[r] == 0:
                                finish_step(r, k)
                                rstep[r] = k + 1
                                left[r] = nqr[r]
                                if k + 1 < steps:
                                    start_step(r, k + 1)
                                waiting, parked[r] = parked[r], []
                                for w in waiting:
                                    if can_go(w):
                                        active.append(w)
                    burst -= 1
                    if not can_go(q):
                        if solo is not None:
                            return None
                        break
                    if burst <= 0 or (c == "G" and prio is not None):
                        active.append(q)
                        break
        except _Stop as e:
            return Verdict(True, e.kind, e.why)
        if freeze is not None:
            return None
        stuck = [q for q in range(nq) if step[q] < steps]
        if stuck:
            q = stuck[0]
            tid = queues[q][pos[q]]
            ins = body[tid]
            what = (f"wait e{ins[idx[q]][1][1]} >= {ins[idx[q]][2]}" if idx[q] < len(ins) and ins[idx[q]][0] == "W"
                    else "the end of its rank's step")
            return Verdict(True, "deadlock", f"step {step[q]}: {len(stuck)} queues stuck, e.g. rank {qkeys[q][0]} "
                                             f"sm {qkeys[q][1]} at task {tid} on {what}")
        return None

    # -- one edit --------------------------------------------------------------------------------
    def classify(self, s: Schedule, max_witness: int = 40, fast: bool = True) -> Verdict:
        """Judge one edited schedule (the same model, grid and tasks as the unedited one).
        `fast`: reuse the unedited schedule's clocks when the edit keeps every queue's waits
        and signals (tests compare it with the full analysis)."""
        self.last_fast = False
        why = structure(s, self.bufs)
        if why:
            return Verdict(True, "malformed", why)
        ref = self.base if s.replicated else self.mat
        if s.ranks != self.R or len(s.tasks) != len(ref.tasks) or any(
                (t.ops, t.tile) != (b.ops, b.tile) for t, b in zip(s.tasks, ref.tasks)):
            return Verdict(True, "malformed", "the edit changed the grid or a task's ops or tile")
        m, changed = self._materialize(s)
        prog = self._program(m, changed)
        plans, qkeys, queues, per_step = prog
        for tid in sorted(changed):
            if plans[tid][1]:
                return Verdict(True, "missing load", plans[tid][1])
            for op in plans[tid][0]:
                if op[0] == "RO":
                    return Verdict(True, "read-only store", f"task {tid} stores into %{op[1]}")
        # which tasks the edit touched: changed bodies, changed queue neighbours, changed events
        base_prev = self._prev(self.base_prog)
        prev = self._prev(prog)
        focus = set(changed) | {t for t, p in prev.items() if base_prev.get(t) != p}
        base_ps = self.base_prog[3]
        moved = {key for key in set(per_step) | set(base_ps) if per_step.get(key) != base_ps.get(key)}
        if moved:
            for t in m.tasks:
                for op in plans[t.id][0]:
                    if op[0] in ("W", "G") and op[1] in moved:
                        focus.add(t.id)
        if self.R > 1:     # the ranks' copies are symmetric (checked above): rank 0's stand for all
            focus = {t for t in focus if m.tasks[t].rank == 0} or focus
        fq = {q for q, ids in enumerate(queues) for t in ids if t in focus}
        rng = random.Random(self.seed * 7919 + len(changed))
        n = 0
        fast = fast and self._keeps_skeleton(prog, changed, per_step)
        self.last_fast = fast       # for tests
        if fast:
            # the same waits and signals in the same queues: the unedited schedule's clocks hold
            pairs, todo = self._fast_pairs(prog, changed)
        else:
            # 1. one random order, recording happens-before; a deadlock or a poisoned read ends it
            clocks = _Clocks(prog, self.steps)
            clocks.reset()
            n += 1
            v = self._run(prog, "random", rng, clocks=clocks)
            if v is not None:
                v.runs = n
                return v
            pairs = self._pairs_for(prog, changed)
            todo = clocks.unproven(pairs)
        for _ in range(0 if fast else self.passes - 1):
            if not len(todo):
                break
            # 2. more passes over the same run, each counting signals with the previous pass's clocks
            pairs = tuple(p[todo] for p in pairs)
            clocks = clocks.again()
            todo = clocks.unproven(pairs)
        # 3. every ordering the clocks do not prove: hold its first instruction back
        firsts = []
        for x in todo:
            a = (int(pairs[0][x]), int(pairs[1][x]), int(pairs[2][x]))
            if a not in firsts:
                firsts.append(a)
        undecided = 0
        if len(firsts) > max_witness:
            undecided = len(firsts) - max_witness
            firsts = rng.sample(firsts, max_witness)
        for target in firsts:
            n += 1
            v = self._run(prog, "random", rng, freeze=target)
            if v is not None:
                v.runs = n
                v.why += f" (freeze run on task {target[0]} instruction {target[1]}, step {target[2]})"
                return v
        # 4. an order with the edited tasks first (a check of the above)
        if focus and not fast:
            n += 1
            v = self._run(prog, "first", rng, focus_queues=fq)
            if v is not None:
                v.runs = n
                return v
        why = _contract(m, plans)
        if why:
            return Verdict(True, "contract", why, n)
        return Verdict(False, runs=n, unproven=len(firsts) + undecided, undecided=undecided)

    def _pairs_for(self, prog, changed):
        """pairs_of(prog), reusing the unedited schedule's pairs between unchanged tasks."""
        plans = prog[0]
        if not changed:
            return self.base_pairs
        ch = np.array(sorted(changed), dtype=np.int64)
        keep = ~(np.isin(self.base_pairs[0], ch) | np.isin(self.base_pairs[3], ch))
        new = pairs_of(plans, self._rank_of, self.steps, only=set(changed))
        return tuple(np.concatenate([b[keep], x]) for b, x in zip(self.base_pairs, new))

    def _materialize(self, s):
        """Every rank's tasks (rank r runs rank 0's with peers rotated by r, as
        `Schedule.materialize`), and the ids of the tasks that differ from the unedited ones.
        Only the changed tasks are rotated anew; the others are the unedited materialization's."""
        if not s.replicated:
            changed = {t.id for t, b in zip(s.tasks, self.mat.tasks)
                       if t.instrs != b.instrs or (t.rank, t.sm) != (b.rank, b.sm)}
            return s, changed
        n, R = self.n0, self.R
        diff = [t.id for t, b in zip(s.tasks, self.base.tasks) if t.instrs != b.instrs or t.sm != b.sm]
        tasks = list(self.mat.tasks)
        if diff:
            for r in range(R):
                for j, i in enumerate(diff):
                    t = s.tasks[i]
                    ins = t.instrs if R == 1 else [
                        replace(x, peer=None if x.peer is None else (x.peer + r) % R,
                                region=x.region if x.region is None or x.region.rank is None
                                else replace(x.region, rank=(x.region.rank + r) % R)) for x in t.instrs]
                    tasks[r * n + i] = Task(r * n + i, r, t.sm, t.body_kind, t.ops, t.tile, ins, t.cost_us)
        m = copy.copy(self.mat)
        m.tasks = tasks
        m.queues = {(r, sm): [r * n + i for i in q] for r in range(R) for (_, sm), q in s.queues.items()}
        m.events = [Event(e.id, r, e.name, e.per_step) for r in range(R) for e in s.events]
        m.replicated = False
        return m, {r * n + i for r in range(R) for i in diff}

    @staticmethod
    def _prev(prog):
        out = {}
        for ids in prog[2]:
            for a, b in zip([None] + ids[:-1], ids):
                out[b] = a
        return out


def _contract(m: Schedule, plans) -> str | None:
    """Rules of the schedule format (DESIGN.md) that no run of the executor can witness: a
    SIGNAL comes after its task's last STORE (V6: a release publishes what precedes it; the
    kernel's task row signals at the end of the body), and an event's declared per_step is the
    number of signals its counter receives per step (the kernel's waits count with it); and
    the PTX memory model's side, which an executor that runs instructions one at a time cannot
    see: a SIGNAL is a release and a WAIT an acquire (without them a wait orders no data), and
    both ends of a synchronisation between two GPUs use system scope (a gpu-scope release or
    acquire synchronises only within its GPU)."""
    signallers: dict = {}
    for t in m.tasks:
        for i in t.instrs:
            if i.kind is InstrKind.SIGNAL:
                tgt = t.rank if i.peer is None else i.peer
                signallers.setdefault((tgt, i.event), set()).add(t.rank)
    for t in m.tasks:
        for i in t.instrs:
            if i.kind not in (InstrKind.SIGNAL, InstrKind.WAIT):
                continue
            if i.kind is InstrKind.SIGNAL and i.sem is not Sem.release:
                return f"task {t.id} signals e{i.event} with {i.sem.value} semantics, not release"
            if i.kind is InstrKind.WAIT and i.sem is not Sem.acquire:
                return f"task {t.id} waits on e{i.event} with {i.sem.value} semantics, not acquire"
            tgt = t.rank if i.peer is None else i.peer
            cross = tgt != t.rank or (i.kind is InstrKind.WAIT and bool(signallers.get((tgt, i.event), set()) - {tgt}))
            if cross and i.scope is not Scope.sys:
                return (f"task {t.id}: {i.kind.value} e{i.event} synchronises across GPUs with "
                        f"{i.scope.value} scope, not sys")
    for t in m.tasks:
        body = plans[t.id][0]
        last_store = max((k for k, op in enumerate(body) if op[0] in ("S", "RO")), default=-1)
        if any(op[0] == "G" for op in body[:last_store]):
            return f"task {t.id} signals before its last STORE (DESIGN.md V6)"
    got = {}
    for t in m.tasks:
        for op in plans[t.id][0]:
            if op[0] == "G":
                got[op[1]] = got.get(op[1], 0) + 1
    for e in m.events:
        if got.get((e.rank, e.id), 0) != e.per_step:
            return (f"event e{e.id} on rank {e.rank} declares per_step {e.per_step}, its counter receives "
                    f"{got.get((e.rank, e.id), 0)} signals per step")
    return None


def _tagdesc(t, want) -> str:
    bad = t[t != want]
    v = int(bad.flat[0])
    if v == NEVER:
        return "never written"
    if v == GARBAGE:
        return "garbage"
    return f"{bad.size} elements, e.g. step {v // VMAX} v{v % VMAX}"
