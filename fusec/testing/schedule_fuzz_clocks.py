"""Happens-before for the schedule fuzzer's oracle: which orderings an edited schedule's data
needs (`pairs_of`) and which of them every execution obeys (`_Clocks`, vector clocks along one
run of the oracle's executor). A pair the clocks prove is ordered in every execution; the others
get a freeze run in `schedule_fuzz_oracle.Oracle.classify`, which decides. Like the oracle, this
shares no code with the memory-order verifier.
"""
from __future__ import annotations

import copy

import numpy as np


def _overlap(a, b) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b))


def pairs_of(plans, ranks, steps, only=None):
    """The orderings every execution must respect, as pairs (A before B) of instruction
    instances (task, instr, step): the stores of what a LOAD reads (same version) before it;
    the LOAD before stores of a later version of what it reads in the same step, and before
    any store into it in the next step; the stores of an address value before the LOAD it
    addresses. Returns six int arrays; `only`: just the pairs with a task of that set."""
    stores = {}
    for t, (body, _) in enumerate(plans):
        for i, op in enumerate(body):
            if op[0] == "S" and op[4] is not None:
                stores.setdefault(op[1], []).append((t, i, op[2], op[7]))
    out = []
    for t, (body, _) in enumerate(plans):
        for i, op in enumerate(body):
            if op[0] != "L" or not (op[6] or op[4]):
                continue
            mine = only is None or t in only
            for w, j, vw, bw in stores.get(op[1], ()) if op[6] else ():
                if w == t or not (mine or w in only) or not any(_overlap(bw, b) for b in op[6]):
                    continue
                for k in range(steps):
                    if vw == op[2]:
                        out.append((w, j, k, t, i, k))
                    elif vw > op[2]:
                        out.append((t, i, k, w, j, k))
                    if k + 1 < steps:
                        out.append((t, i, k, w, j, k + 1))
            for ab, aver in op[4]:
                for w, j, vw, bw in stores.get((ranks[t], ab), ()):
                    if vw == aver and w != t and (mine or w in only):
                        out.extend((w, j, k, t, i, k) for k in range(steps))
    a = np.array(out, dtype=np.int64).reshape(-1, 6)
    return tuple(a[:, c] for c in range(6))


class _Clocks:
    """Vector clocks along one run: which instructions every execution must have finished
    before a given LOAD or STORE runs (an under-approximation of that relation: a pair it
    does not prove ordered gets a freeze run, which decides).

    Instruction instances are numbered per queue (gidx: step * instructions per step of the
    queue + position). A clock entry for queue q is 2 * gidx of the last SIGNAL of q known to
    have happened (everything q did before it did too), or 2 * (last gidx of step k) + 1 once
    all of q's step k is known done (the rank's step boundary). Orderings it uses, each one that every execution obeys: queue order;
    the rank's step boundary (rank r's step k+1 starts after all of rank r's step k); and a WAIT
    after a SIGNAL instance s when s is necessary for it: fewer than `need` signals of that
    counter can happen without s (counting every signal instance of the counter over the run's
    steps, minus those known to come after s: later on s's queue, in a later step of s's rank,
    or, in a second pass, after s or after the WAIT by the first pass's clocks)."""

    def __init__(self, prog, steps, prev=None):
        plans, qkeys, queues, per_step = prog
        self.nq = nq = len(qkeys)
        self.steps = steps
        ntask = len(plans)
        self.qof = np.full(ntask, -1, dtype=np.int64)
        self.off = np.zeros(ntask, dtype=np.int64)
        self.qlen = np.zeros(nq, dtype=np.int64)
        for q, ids in enumerate(queues):
            o = 0
            for t in ids:
                self.qof[t], self.off[t] = q, o
                o += len(plans[t][0])
            self.qlen[q] = o
        self.rowbase = np.concatenate([[0], np.cumsum(self.qlen * steps)[:-1]]).astype(np.int64)
        self.rows = int((self.qlen * steps).sum())
        self.sig_all = {}
        for q, ids in enumerate(queues):
            r = qkeys[q][0]
            for t in ids:
                for i, op in enumerate(plans[t][0]):
                    if op[0] == "G":
                        for k in range(steps):
                            self.sig_all.setdefault(op[1], []).append((t, i, k, q, self.g(t, i, k), r))
        self.prev = prev
        self.record = False
        self._count()

    def _count(self):
        """Per signal instance: how many other instances of its counter may happen without it."""
        self.could = {}
        for key, xs in self.sig_all.items():
            for sx in xs:
                self.could[sx[:3]] = sum(1 for x in xs if x is not sx and not self._after(sx, x))

    def g(self, t, i, k) -> int:
        q = self.qof[t]
        return int(k * self.qlen[q] + self.off[t] + i)

    def _after(self, s, x) -> bool:
        """x comes after s in every execution (static reasons, or the first pass's clocks)."""
        if x[3] == s[3] and x[4] > s[4]:
            return True
        if x[5] == s[5] and x[2] > s[2]:
            return True
        if self.prev is not None:
            v = self.prev.get(x[:3])
            return v is not None and v[s[3]] >= 2 * s[4]
        return False

    def reset(self):
        self.cur = np.full((self.nq, self.nq), -1, dtype=np.int32)
        self.snap = np.full((self.rows, self.nq), -1, dtype=np.int32)
        self.gq = [0] * self.nq
        self.done = {}          # counter -> [(instance, clock)] of the signals so far
        self.sigvec = {}        # (task, instr, step) -> the signal's clock
        self.log = []           # the run's clock events, for `again`
        self.rec = {} if self.record else None   # clocks after each WAIT and step boundary

    def again(self) -> "_Clocks":
        """The same run's events once more, counting signals with this pass's clocks (a pass
        that proves more orderings, without running the schedule again)."""
        nxt = copy.copy(self)
        nxt.prev = self.sigvec
        nxt._count()
        nxt.reset()
        for ev in self.log:
            if ev[0] == 0:
                nxt.snap[ev[2]] = nxt.cur[ev[1]]
            elif ev[0] == 1:
                nxt.signal(*ev[1:])
            elif ev[0] == 2:
                nxt.wait(*ev[1:])
            else:
                nxt.barrier(*ev[1:])
        nxt.log = self.log
        return nxt

    def signal(self, q, t, i, k, key, g=None):
        g = self.gq[q] if g is None else g
        self.log.append((1, q, t, i, k, key, g))
        v = self.cur[q].copy()
        v[q] = 2 * g
        inst = (t, i, k)
        self.sigvec[inst] = v
        self.done.setdefault(key, []).append((inst, v))

    def wait(self, q, t, i, k, key, need, g=None):
        gw = self.gq[q] if g is None else g
        self.log.append((2, q, t, i, k, key, need, gw))
        if need <= 0:
            if self.rec is not None:
                self.rec[(q, gw)] = self.cur[q].copy()
            return
        byid = after_w = None
        cur = self.cur[q]
        for inst, v in self.done.get(key, ()):
            n = self.could[inst]
            if n >= need and self.prev is not None:
                if after_w is None:     # instances the previous pass proved to come after this wait
                    xs = self.sig_all.get(key, ())
                    byid = {x[:3]: x for x in xs}
                    after_w = [x[:3] for x in xs if (pv := self.prev.get(x[:3])) is not None and pv[q] >= 2 * gw]
                if after_w:
                    sx = byid[inst]
                    n -= sum(1 for a in after_w if a != inst and not self._after(sx, byid[a]))
            if n < need:
                np.maximum(cur, v, out=cur)
        if self.rec is not None:
            self.rec[(q, gw)] = cur.copy()

    def barrier(self, qs, k):
        self.log.append((3, qs, k))
        bar = np.max(self.cur[qs], axis=0)
        for q in qs:
            bar[q] = 2 * ((k + 1) * self.qlen[q] - 1) + 1
        for q in qs:
            np.maximum(self.cur[q], bar, out=self.cur[q])
            if self.rec is not None:
                self.rec[(q, "end", k)] = self.cur[q].copy()

    def unproven(self, pairs):
        """The pairs (A must precede B) these clocks do not prove; pairs = int arrays tA, iA,
        kA, tB, iB, kB."""
        tA, iA, kA, tB, iB, kB = pairs
        qA, qB = self.qof[tA], self.qof[tB]
        gA = kA * self.qlen[qA] + self.off[tA] + iA
        gB = kB * self.qlen[qB] + self.off[tB] + iB
        same = qA == qB
        ok = np.where(same, gA < gB, self.snap[self.rowbase[qB] + gB, qA] >= 2 * gA)
        return np.nonzero(~ok)[0]
