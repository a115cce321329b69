"""Access tables for the memory-order verifier: which buffer and version each LOAD/STORE
touches, which stores overlap a load, and SPMD expansion of compact schedules. Public: the
randomized-order executor (fusec.testing.random_order) keeps its buffers with the same
`BufferMap` and expands schedules with the same `expand_ranks`.

Buffers: a Region names an SSA value. A value that a registry op updates in place
(`OpDef.aliases`) lives in the buffer of the operand it aliases, so a state and its per-step
new values share one buffer; `version` counts in-place updates (the state parameter is version
0 = the previous step's value). Buffers are per rank; a region's `rank` selects a peer's copy.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from fusec.ir.schedule import Event, InstrKind, Region, Schedule, Task
from fusec.ir.types import Kind


def region_str(r: Region | None, rank: int | None = None) -> str:
    if r is None:
        return ""
    box = ", ".join(f"{a}:{b}" for a, b in r.box)
    return f"%{r.tensor}[{box}]" + (f"@rank{rank}" if rank is not None else "")


def expand_ranks(s: Schedule) -> Schedule:
    """Every rank's tasks. A replicated (SPMD) schedule stores rank 0 only; rank r runs the same
    tasks with every rank reference rotated by r (`Schedule.materialize`)."""
    if not getattr(s, "replicated", False) or s.ranks == 1:
        return s
    if hasattr(s, "materialize"):
        return s.materialize()
    R, n = s.ranks, len(s.tasks)
    tasks, queues, events = [], {}, []
    for r in range(R):
        rot = (lambda x, r=r: None if x is None else (x + r) % R)
        for t in s.tasks:
            instrs = [replace(i, peer=rot(i.peer),
                              region=None if i.region is None else replace(i.region, rank=rot(i.region.rank)))
                      for i in t.instrs]
            tasks.append(Task(t.id + r * n, r, t.sm, t.body_kind, t.ops, t.tile, instrs, t.cost_us))
        for (_, sm), ids in s.queues.items():
            queues[(r, sm)] = [i + r * n for i in ids]
        events += [Event(e.id, r, e.name, e.per_step) for e in s.events]
    out = Schedule(s.graph, s.dims, R, s.sms, tasks, events, queues, dict(s.meta))
    out.buffers = dict(getattr(s, "buffers", {}))
    return out


class BufferMap:
    """value name -> (buffer root name, version); buffer -> kind; per task, the version of each
    buffer it reads and writes (regions name the storage, e.g. a state's own name for its
    in-place update, so the version comes from the task's ops)."""

    def __init__(self, graph, buffers=None):
        self.root: dict[str, tuple[str, int]] = {v.name: (v.name, 0) for v in graph.params}
        self.kind = {v.name: v.kind for v in graph.params}
        self.inputs = {v.name for v in graph.params if v.kind is Kind.io}
        self.producer = {}
        for op in graph.ops:
            al = op.opdef.aliases
            for k, v in enumerate(op.outputs):
                self.producer[v.name] = op
                if k in al:
                    b, ver = self.root[op.inputs[al[k]].name]
                    self.root[v.name] = (b, ver + 1)
                else:
                    self.root[v.name] = (v.name, 0)
                    self.kind[v.name] = v.kind
        for name, ty in (buffers or {}).items():
            self.root.setdefault(name, (name, 0))
            self.kind.setdefault(name, ty.kind)
        self._task_versions: dict = {}
        self._by_ops: dict = {}

    def task_versions(self, task) -> tuple[dict, dict]:
        """(buffer -> version the task's ops read, buffer -> version they write)."""
        key = id(task.ops)      # tasks of one family usually share the ops tuple: try identity first
        hit = self._task_versions.get(key)
        if hit is not None and hit[2] is task.ops:
            return hit[0], hit[1]
        hit = self._by_ops.get(task.ops)    # equal tuples built separately (e.g. a parsed schedule)
        if hit is not None:
            self._task_versions[key] = (hit[0], hit[1], task.ops)
            return hit
        if True:
            ops = [self.producer[n] for n in task.ops if n in self.producer]
            made = {v.name for op in ops for v in op.outputs}
            rd, wr = {}, {}
            for op in ops:
                for v in op.inputs:
                    if v.name not in made:
                        b, ver = self.root[v.name]
                        rd[b] = min(rd.get(b, ver), ver)
                for v in op.outputs:
                    b, ver = self.root[v.name]
                    wr[b] = max(wr.get(b, ver), ver)
            self._task_versions[key] = (rd, wr, task.ops)
            self._by_ops[task.ops] = (rd, wr)
        return rd, wr

    def access(self, task, name: str, store: bool) -> tuple[str, int]:
        """(buffer, version) of a region name in a task: an in-place result's own name gives
        its version; a storage name takes the version the task's ops read or write."""
        buf, ver = self.root[name]
        if ver == 0 and buf in self.producer or self.kind.get(buf) is Kind.state:
            rd, wr = self.task_versions(task)
            ver = (wr if store else rd).get(buf, ver)
        return buf, ver


@dataclass(eq=False, slots=True)       # ~10^5-10^6 of them on a full model: slots save time
class Acc:
    task: Task
    idx: int
    region: Region
    rank: int          # whose copy
    buf: str
    version: int
    kind: Kind
    is_input: bool     # an io step input: present before the step
    needs_producer: bool  # must be written in this step (not a state's previous value)
    copy: int = 0      # the rank whose copy of the task runs it (symmetric mode); else task.rank
    memo: tuple | None = None   # loads: the writers entry of (rank, buf, box, version), once looked up
    uid: int = 0       # the task instance: copy * tasks + id (unique in both modes)
    addr: tuple = ()   # loads: the values addressing it (derived from the graph + the annotation; V3)

    @property
    def instr(self):
        return self.task.instrs[self.idx]


def _vol(box) -> int:
    v = 1
    for a, b in box:
        v *= max(0, b - a)
    return v


def _inter(a, b) -> int:
    v = 1
    for (a0, a1), (b0, b1) in zip(a, b):
        v *= max(0, min(a1, b1) - max(a0, b0))
    return v


class Access:
    """Loads and stores of the tasks the step reaches. Symmetric mode (`hb.sym`): loads are rank
    0's (by symmetry every rank's loads are rank 0's rotated); the stores landing on rank t's
    copy of a buffer are, for each rank-0 store with target offset d, the store of copy t - d."""

    def __init__(self, s: Schedule, hb, derived=None):
        self.s, self.hb = s, hb
        self.n = len(s.tasks)
        self.bm = BufferMap(s.graph, getattr(s, "buffers", {}))
        self.loads: list[Acc] = []
        self.stores: dict[tuple[int, str], list[Acc]] = defaultdict(list)   # explicit: (rank, buf)
        self._base: dict[str, list[Acc]] = defaultdict(list)                # symmetric: buf -> rank 0's
        LOAD, STORE, weight = InstrKind.LOAD, InstrKind.STORE, Kind.weight
        root, kinds, inputs, n = self.bm.root, self.bm.kind, self.bm.inputs, self.n
        act, comm, sym = Kind.act, Kind.comm, hb.sym
        # What an access's buffer, version and kind depend on: the task's ops (`BufferMap.access`),
        # the region's tensor and load or store. Tasks of a family share their ops tuple: per ops
        # tuple (by identity), per tensor, for loads and for stores: (buffer, version, kind,
        # is_input, needs_producer), loads also (root buffer, is that a weight).
        fam: dict[int, tuple] = {}
        for t in s.tasks:
            vcs = hb.vc.get(t.id)
            if vcs is None:
                continue
            daddr = None        # the task's derived addressing, looked up at its first load
            got = fam.get(id(t.ops))
            if got is None or got[0] is not t.ops:
                got = fam[id(t.ops)] = (t.ops, {}, {})
            _, linfo, sinfo = got
            rank = t.rank
            uid = rank * n + t.id
            for k, i in enumerate(t.instrs):
                kind_i = i.kind
                if kind_i is LOAD:
                    if vcs[k] is None:
                        continue
                    if daddr is None:
                        daddr = derived.addr(t) if derived is not None else {}
                    r = i.region
                    acc = linfo.get(r.tensor)
                    if acc is None:
                        rb = root[r.tensor][0]
                        buf, ver = self.bm.access(t, r.tensor, False)
                        kind = kinds[buf]
                        acc = linfo[r.tensor] = (rb, kinds.get(rb) is weight, buf, ver, kind,
                                                 buf in inputs and ver == 0, ver > 0 or kind in (act, comm))
                    rb, plain_weight, buf, ver, kind, is_input, needs = acc
                    d, a = daddr.get(rb), i.addressed_by
                    addr = () if not d and not a else (d,) if not a or a == d else (a,) if not d else (d, a)
                    if not addr and plain_weight:
                        continue    # a plain weight read: no rule looks at it (V3 needs the addressed ones)
                    self.loads.append(Acc(t, k, r, rank if r.rank is None else r.rank, buf, ver, kind, is_input,
                                          needs, rank, None, uid, addr))
                elif kind_i is STORE:
                    if vcs[k] is None:
                        continue
                    r = i.region
                    acc = sinfo.get(r.tensor)
                    if acc is None:
                        buf, ver = self.bm.access(t, r.tensor, True)
                        kind = kinds[buf]
                        acc = sinfo[r.tensor] = (buf, ver, kind, buf in inputs and ver == 0,
                                                 ver > 0 or kind in (act, comm))
                    buf, ver, kind, is_input, needs = acc
                    a = Acc(t, k, r, rank if r.rank is None else r.rank, buf, ver, kind, is_input, needs, rank,
                            None, uid, ())
                    if sym:
                        self._base[buf].append(a)
                    else:
                        self.stores[(a.rank, buf)].append(a)
        self._memo: dict = {}
        self._index: dict = {}

    def stores_at(self, rank: int, buf: str) -> list[Acc]:
        """Every store (instance) into rank `rank`'s copy of `buf`."""
        if not self.hb.sym:
            return self.stores.get((rank, buf), [])
        key = (rank, buf)
        got = self.stores.get(key)
        if got is None:
            R = self.s.ranks
            got = self.stores[key] = [replace(a, rank=rank, copy=(rank - a.rank) % R,
                                              uid=(rank - a.rank) % R * self.n + a.task.id)
                                      for a in self._base.get(buf, ())]
        return got

    def store_lists(self):
        """Per buffer copy, the stores into it (symmetric mode: rank 0's copies stand for all)."""
        if self.hb.sym:
            return [self.stores_at(0, b) for b in self._base]
        return list(self.stores.values())

    def tid(self, a: Acc) -> int:
        """The task id of an access's instance as in the materialized schedule (rank * n + id)."""
        return a.copy * self.n + a.task.id if self.hb.sym else a.task.id

    def name(self, a: Acc) -> str:
        return str(self.tid(a))

    @staticmethod
    def inst(a: Acc) -> int:
        return a.uid

    @staticmethod
    def same_instance(a: Acc, b: Acc) -> bool:
        return a.uid == b.uid

    def _overlapping(self, rank: int, buf: str, box) -> list[Acc]:
        """Stores of (rank, buf) whose box overlaps `box`, via an index sorted on the dim the
        stores are tiled along (most distinct starts)."""
        idx = self._index.get((rank, buf))
        if idx is None:
            sts = self.stores_at(rank, buf)
            nd = len(sts[0].region.box) if sts else 0
            d = max(range(nd), key=lambda k: len({a.region.box[k][0] for a in sts})) if nd else None
            if d is not None:
                sts = sorted(sts, key=lambda a: a.region.box[d][0])
            los = [a.region.box[d][0] for a in sts] if d is not None else []
            pmax, m = [], -1
            for a in sts:
                m = max(m, a.region.box[d][1]) if d is not None else m
                pmax.append(m)
            idx = self._index[(rank, buf)] = (d, sts, los, pmax)
        d, sts, los, pmax = idx
        if d is None or not box:
            return [a for a in sts if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a.region.box, box))]
        lo, hi = box[d]
        out = []
        i = bisect.bisect_left(los, hi) - 1
        while i >= 0 and pmax[i] > lo:
            a = sts[i]
            if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a.region.box, box)):
                out.append(a)
            i -= 1
        return out

    def writers(self, ld: Acc):
        """(stores of the version read, stores of later versions) overlapping the load, other
        than the load's own task (its earlier stores of a later version do count)."""
        hit = ld.memo
        if hit is None:
            key = (ld.rank, ld.buf, ld.region.box, ld.version)
            hit = self._memo.get(key)
        if hit is None:
            same, later = [], []
            for st in self._overlapping(ld.rank, ld.buf, ld.region.box):
                (same if st.version == ld.version else later if st.version > ld.version else []).append(st)
            req = np.full(self.hb.R * self.hb.nq, -1, dtype=np.int32)
            for st in same:
                _, p = self.hb.where[st.task.id]
                c = self.hb.cidx(st.task.id, st.copy, ld.copy)
                req[c] = max(req[c], p)
            vol = sum(_inter(st.region.box, ld.region.box) for st in same)
            hit = self._memo[key] = (same, later, {st.uid for st in same + later}, req, vol)
        ld.memo = hit
        same, later, tids, _, _ = hit
        own = ld.uid
        if own not in tids:
            return same, later
        return ([st for st in same if st.uid != own],
                [st for st in later if st.uid != own or st.idx < ld.idx])

    def all_before(self, ld: Acc) -> bool:
        """Fast path: every same-version producer of the load happens before it."""
        _, _, _, req, _ = ld.memo
        return bool((self.hb.vc[ld.task.id][ld.idx] >= req).all())

    def store_before_load(self, st: Acc, ld: Acc) -> bool:
        if self.same_instance(st, ld):
            return st.idx < ld.idx
        return self.hb.before(st.task.id, ld.task.id, ld.idx, st.copy, ld.copy)

    def covered(self, ld: Acc) -> bool:
        """Do the same-version stores (other tasks', or this task's before the load) cover it?"""
        same, _, tids, _, vol = ld.memo
        if ld.uid in tids:
            vol -= sum(_inter(st.region.box, ld.region.box) for st in same
                       if self.same_instance(st, ld) and st.idx > ld.idx)
        return vol >= _vol(ld.region.box)

    def writers_of(self, name: str, rank: int) -> list[Acc]:
        buf, ver = self.bm.root[name]
        return [st for st in self.stores_at(rank, buf) if st.version == ver]

    def after_rank(self, st: Acc, rank: int) -> bool:
        """Does some task of `rank` happen before store `st` (so step k+1's `st` follows step k there)?"""
        rows = self.hb.rank_rows(rank, st.copy)
        return bool((self.hb.vc[st.task.id][st.idx][rows] >= 0).any())

    def overlapping_store_pairs(self):
        """Pairs of stores by different tasks that write overlapping parts of one buffer copy."""
        for sts in self.store_lists():
            if len(sts) < 2:
                continue
            nd = len(sts[0].region.box)
            if nd == 0:
                yield from ((a, b) for i, a in enumerate(sts) for b in sts[i + 1:] if not self.same_instance(a, b))
                continue
            # sweep along the dim with the most distinct starts (tiles are split along it)
            d = max(range(nd), key=lambda k: len({st.region.box[k][0] for st in sts}))
            order = sorted(sts, key=lambda st: st.region.box[d][0])
            active: list[Acc] = []
            for b in order:
                lo = b.region.box[d][0]
                active = [a for a in active if a.region.box[d][1] > lo]
                for a in active:
                    if not self.same_instance(a, b) and a.region.overlaps(b.region):
                        yield a, b
                active.append(b)
