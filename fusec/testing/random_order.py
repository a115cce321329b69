"""Randomized executor: run a Schedule's tasks in random orders that its waits allow.

Every order is one interleaving of all ranks' per-SM queues at instruction granularity: at each
point an SM (of any rank) whose next instruction is not a blocked WAIT is picked at random, so a
LOAD hoisted above its WAIT really reads the buffer as it is at that moment. Two (or more)
consecutive steps run; a rank starts step k+1 when all of its queues finished step k (kernel
boundary), other ranks may still be in step k, and a WAIT of step k waits for
counter >= k * per_step + threshold (monotonic counters).

Poisoning: every element of every non-weight buffer carries a tag = (step, version) of the
write that produced it (-1: never written). A read of version v in step k accepts only tag
(k, v); state buffers are re-tagged (k, 0) when their rank starts step k (they hold the
previous step's value); io inputs are always valid. A read of a wrong-tag element is a
*poisoned read*: symbolically it is reported, numerically the element is NaN (an integer
buffer, e.g. router ids, poisons the task's whole output), which is what NaN poisoning of
unwritten buffers detects. A weight LOAD addressed by a run-time value (V3) reads poisoned
data when the addressing tensor is not valid yet.

Numeric mode: each task evaluates its ops' registry references (`Op.opdef.ref`, under
`as_rank(task.rank)`) on what its LOADs saw, then writes only its STORE regions; graph outputs
of every step (every rank's) are compared with `fusec.backends.reference.executor.run_step`
(R = 1) or `fusec.backends.reference.ranks.run_step_ranks` (R > 1, from the full checkpoint and
full state, sliced per rank by the graph's annotations). Collectives at R > 1 are modelled as
the data movement the lowering emits (`passes/_collectives.emit_collective`; groups of G =
`ranks` members `stride` S apart): the push task of in-group offset d copies this rank's
operand into slot d of the collective's comm buffer `<y>.slots` [G, ...] on rank r + d * S, so
on rank q slot d holds the operand of rank q - d * S (group index i - d); the local task
combines its own operand with the slots it loaded, in group index order (all_reduce: sum,
reduce_scatter: its chunk of the sum, all_gather: concatenation).

Cost: a task's result is a pure function of (its ops, rank, step, the data its ops are given:
its loads and the kept contents of what it updates in place); results are memoized on a digest
of that data, so tiles of one family that load the same data share one evaluation, and an order
in which every task sees the same data as an earlier order re-evaluates nothing (any
difference, e.g. a stale or NaN element, changes the digest and recomputes).
"""
from __future__ import annotations

import enum
import hashlib
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from fusec.ir.ops.comm import as_rank
from fusec.ir.registry import Trait
from fusec.ir.schedule import InstrKind, Schedule
from fusec.ir.types import Kind
from fusec.passes.memory_access import BufferMap, expand_ranks

from fusec.backends.reference.executor import init_state, prepare_weights, run_step, store, torch_dtype

VMAX = 1 << 16          # tag = step * VMAX + version
NEVER = -1


class Policy(enum.Enum):
    uniform = "uniform"      # any runnable SM, uniformly, at every instruction
    priority = "priority"    # a random SM priority per step: extreme but legal orders
    burst = "burst"          # keep running the same SM for a while (long-running producers)


@dataclass
class OrderResult:
    seed: int
    policy: Policy
    deadlock: str | None = None
    poisoned: list[str] = field(default_factory=list)     # first poisoned reads
    mismatch: str | None = None
    instrs: int = 0

    @property
    def ok(self) -> bool:
        return self.deadlock is None and not self.poisoned and self.mismatch is None

    def why(self) -> str:
        return self.deadlock or (self.poisoned[0] if self.poisoned else "") or self.mismatch or "ok"


def step_inputs(graph, dims, step: int, seed: int) -> dict:
    """Deterministic io inputs for a step: `pos` = step, integer ids small, floats normal."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = {}
    for v in graph.inputs():
        shape = v.type.concrete(dims)
        if v.type.dtype.is_float:
            out[v.name] = torch.randn(shape, generator=g)
        elif "pos" in v.name:
            out[v.name] = torch.full(shape, step, dtype=torch.int32)
        else:
            out[v.name] = torch.randint(0, 16, shape, generator=g, dtype=torch.int32)
    return out


class RandomOrderRunner:
    """Prepared once per schedule (buffers, references); `run(seed)` executes one order."""

    def __init__(self, schedule: Schedule, steps: int = 2, numeric: bool | None = None,
                 weights: dict | None = None, data_seed: int = 0, full_state: dict | None = None):
        """`weights`: R = 1, the graph's weights (default: random); R > 1, the full (unsharded)
        checkpoint, required for numeric mode together with `full_state` (unsharded state)."""
        self.s = expand_ranks(schedule)
        s = self.s
        self.steps = steps
        self.numeric = (s.ranks == 1) if numeric is None else numeric
        if self.numeric and s.ranks != 1 and (weights is None or full_state is None):
            raise ValueError("numeric random-order execution at R > 1 needs the full checkpoint (weights=) "
                             "and the full state (full_state=)")
        self.memo: dict = {}          # (ops, body, rank, step, poison, digest of its data) -> result
        self._inplace: dict = {}
        self.memo_hits = 0
        self.bm = BufferMap(s.graph, getattr(s, "buffers", {}))
        self.qkeys = sorted(s.queues)
        self.per_step = {(e.rank, e.id): e.per_step for e in s.events}
        self.shapes = {}
        for v in s.graph.values():
            b, _ = self.bm.root[v.name]
            if self.bm.kind.get(b) is not Kind.weight:
                self.shapes.setdefault(b, v.type.concrete(s.dims))
        for name, ty in getattr(s, "buffers", {}).items():
            self.shapes[name] = ty.concrete(s.dims)
        self.dtypes = {}
        for v in s.graph.values():
            self.dtypes.setdefault(self.bm.root[v.name][0], v.type)
        # per instruction, precomputed: (target rank, buffer, version, slices) for LOAD/STORE
        self.plan = {}
        for t in s.tasks:
            row = []
            for i in t.instrs:
                if i.region is None:
                    row.append(None)
                    continue
                buf, ver = self.bm.access(t, i.region.tensor, i.kind is InstrKind.STORE)
                row.append((t.rank if i.region.rank is None else i.region.rank, buf, ver,
                            tuple(slice(a, b) for a, b in i.region.box)))
            self.plan[t.id] = row
        self.inputs = [step_inputs(s.graph, s.dims, k, data_seed) for k in range(steps)]
        self.outputs = [v.name for v in s.graph.outputs]
        if self.numeric:
            self._reference(weights, full_state, data_seed)

    def _reference(self, weights, full_state, data_seed) -> None:
        """Per-rank weights and initial state; expected[k][rank] = the outputs of step k."""
        s = self.s
        if s.ranks == 1:
            from fusec.weights import random_weights
            if weights is None:
                weights = random_weights(s.graph, data_seed)
            self.W = [prepare_weights(s.graph, weights, "fp32")]
            st = init_state(s.graph, s.dims, precision="fp32")
            self.state0 = [{k: v.clone() for k, v in st.items()}]
            self.expected = [[run_step(s.graph, self.W[0], st, self.inputs[k], s.dims, "fp32")]
                             for k in range(self.steps)]
            return
        from fusec.backends.reference.ranks import materialize_weights, run_step_ranks, shard_state
        R = s.ranks
        self.W = [materialize_weights(s.graph, weights, r, "fp32") for r in range(R)]
        self.state0 = []
        for r in range(R):
            sh = shard_state(s.graph, full_state, r)
            self.state0.append({v.name: sh[v.name].to(torch_dtype(v.type.dtype, "fp32")) for v in s.graph.states()})
        st, self.expected = dict(full_state), []
        for k in range(self.steps):
            outs, st = run_step_ranks(s.graph, weights, R, st, self.inputs[k], s.dims, "fp32")
            self.expected.append(outs)

    # -- one order ---------------------------------------------------------------------------
    def run(self, seed: int, policy: Policy | None = None, max_poison: int = 3) -> OrderResult:
        rng = random.Random(seed)
        policy = policy or rng.choice(list(Policy))
        res = OrderResult(seed, policy)
        s, R = self.s, self.s.ranks
        tags = {(r, b): np.full(shape, NEVER, dtype=np.int64) for r in range(R) for b, shape in self.shapes.items()}
        vals = {}
        if self.numeric:
            for r in range(R):
                for b, shape in self.shapes.items():
                    ty = self.dtypes.get(b)
                    dt = torch_dtype(ty.dtype, "fp32") if ty is not None else torch.float32
                    vals[(r, b)] = (self.state0[r][b].clone() if b in self.state0[r] else
                                    torch.full(shape, float("nan")).to(dt) if dt.is_floating_point else
                                    torch.zeros(shape, dtype=dt))
        counter: dict = {}
        nq = len(self.qkeys)
        step = [0] * nq
        pos = [0] * nq
        idx = [0] * nq
        ctx: list[dict | None] = [None] * nq
        rank_of = [k[0] for k in self.qkeys]
        left = {r: sum(1 for k in self.qkeys if k[0] == r) for r in range(R)}  # queues still in step
        rstep = [0] * R
        prio = [rng.random() for _ in range(nq)]
        captured: list[list[dict]] = [[{} for _ in range(self.steps)] for _ in range(R)]

        def start_step(r: int, k: int) -> None:
            for (rr, b), t in tags.items():
                if rr == r and self.bm.kind.get(b) is Kind.state:
                    t[...] = k * VMAX

        def finish_step(r: int, k: int) -> None:
            for name in self.outputs:
                b, ver = self.bm.root[name]
                box = tuple(slice(0, n) for n in self.shapes[b])
                ok = (tags[(r, b)][box] == k * VMAX + ver).all()
                captured[r][k][name] = vals[(r, b)].clone() if self.numeric and ok else None
                if not ok and len(res.poisoned) < max_poison:
                    res.poisoned.append(f"rank {r} step {k}: output %{name} not fully written")

        for r in range(R):
            start_step(r, 0)
            for q in range(nq):
                if rank_of[q] == r and not s.queues[self.qkeys[q]]:
                    left[r] -= 1
        active: list[int] = []            # queues whose next instruction can run
        blocked: dict = {}                # counter key -> [(queue, needed value)]
        parked: dict = {r: [] for r in range(R)}   # queues done with the step, before the barrier

        def settle(q: int) -> None:
            if step[q] >= self.steps or not s.queues[self.qkeys[q]]:
                return
            if step[q] != rstep[rank_of[q]]:
                parked[rank_of[q]].append(q)
                return
            task = s.tasks[s.queues[self.qkeys[q]][pos[q]]]
            ins = task.instrs[idx[q]] if idx[q] < len(task.instrs) else None
            if ins is not None and ins.kind is InstrKind.WAIT:
                key = (ins.peer if ins.peer is not None else task.rank, ins.event)
                need = step[q] * self.per_step.get(key, 0) + ins.threshold
                if counter.get(key, 0) < need:
                    blocked.setdefault(key, []).append((q, need))
                    return
            active.append(q)

        for q in range(nq):
            settle(q)
        last = None
        while active:
            if policy is Policy.priority:
                j = max(range(len(active)), key=lambda x: prio[active[x]])
            elif policy is Policy.burst and last is not None and last in active and rng.random() < 0.9:
                j = active.index(last)
            else:
                j = rng.randrange(len(active))
            q = active[j]
            active[j] = active[-1]
            active.pop()
            last = q
            queue = s.queues[self.qkeys[q]]
            task = s.tasks[queue[pos[q]]]
            k = step[q]
            if idx[q] == 0:
                ctx[q] = {"loads": [], "out": None, "poison": False}
            if idx[q] < len(task.instrs):
                ins = task.instrs[idx[q]]
                self._exec(task, ins, self.plan[task.id][idx[q]], k, ctx[q], tags, vals, counter, res, max_poison)
                res.instrs += 1
                idx[q] += 1
                if ins.kind is InstrKind.SIGNAL:
                    key = (ins.peer if ins.peer is not None else task.rank, ins.event)
                    waiters = blocked.pop(key, [])
                    still = [(w, n) for w, n in waiters if counter[key] < n]
                    if still:
                        blocked[key] = still
                    for w, n in waiters:
                        if counter[key] >= n:
                            active.append(w)
                settle(q)
                continue
            idx[q], pos[q] = 0, pos[q] + 1
            if pos[q] == len(queue):
                pos[q], step[q] = 0, k + 1
                r = rank_of[q]
                left[r] -= 1
                if left[r] == 0:
                    finish_step(r, k)
                    rstep[r] = k + 1
                    left[r] = sum(1 for x in range(nq) if rank_of[x] == r and s.queues[self.qkeys[x]])
                    if k + 1 < self.steps:
                        start_step(r, k + 1)
                    prio = [rng.random() for _ in range(nq)]
                    settle(q)
                    waiting, parked[r] = parked[r], []
                    for w in waiting:
                        settle(w)
                    continue
            settle(q)
        self.last_buffers = vals          # every rank's buffers after the last step (numeric), for diagnosis
        stuck = [q for q in range(nq) if step[q] < self.steps and s.queues[self.qkeys[q]]]
        if stuck:
            q = stuck[0]
            task = s.tasks[s.queues[self.qkeys[q]][pos[q]]]
            ins = task.instrs[idx[q]] if idx[q] < len(task.instrs) else None
            what = f"wait e{ins.event} >= {ins.threshold}" if ins is not None and ins.kind is InstrKind.WAIT \
                else "the end of its rank's step"
            res.deadlock = (f"deadlock in step {step[q]}: {len(stuck)} queues stuck, e.g. rank {self.qkeys[q][0]} "
                            f"sm {self.qkeys[q][1]} at task {task.id} on {what}")
            return res
        if self.numeric:
            for k in range(self.steps):
                for r in range(R):
                    for n, exp in zip(self.outputs, self.expected[k][r]):
                        got = captured[r][k].get(n)
                        if got is None:
                            continue
                        if not torch.allclose(got.float(), exp.float(), rtol=1e-4, atol=1e-5):
                            bad = (~torch.isclose(got.float(), exp.float(), rtol=1e-4, atol=1e-5)).sum().item()
                            res.mismatch = (f"step {k}: rank {r}'s output %{n} differs from the reference "
                                            f"in {bad} elements")
                            return res
        return res

    # -- one instruction ---------------------------------------------------------------------
    def _exec(self, task, ins, where, k, c, tags, vals, counter, res, max_poison) -> None:
        kind = ins.kind
        if kind is InstrKind.SIGNAL:
            key = (ins.peer if ins.peer is not None else task.rank, ins.event)
            counter[key] = counter.get(key, 0) + 1
            return
        if kind is InstrKind.WAIT:
            return
        if kind is InstrKind.LOAD:
            reg = ins.region
            r, buf, ver, box = where
            if ins.addressed_by:
                ab, av = self.bm.root[ins.addressed_by]
                if ab not in self.bm.inputs and not (tags[(task.rank, ab)] == k * VMAX + av).all():
                    c["poison"] = True
                    if len(res.poisoned) < max_poison:
                        res.poisoned.append(f"step {k} task {task.id}: load of %{reg.tensor} addressed by "
                                            f"%{ins.addressed_by} before it was written")
            kindb = self.bm.kind.get(buf)
            if kindb is Kind.weight or (buf in self.bm.inputs and ver == 0):
                return
            valid = tags[(r, buf)][box] == k * VMAX + ver
            if not valid.all() and len(res.poisoned) < max_poison:
                res.poisoned.append(f"step {k} task {task.id}: load of %{reg.tensor} "
                                    f"[{', '.join(f'{a}:{b}' for a, b in reg.box)}] reads "
                                    f"{int((~valid).sum())} unwritten/stale elements")
            if self.numeric:
                c["loads"].append((buf, box, vals[(r, buf)][box].clone(), torch.from_numpy(valid)))
            return
        if kind is InstrKind.COMPUTE:
            if self.numeric:
                c["out"] = self._compute(task, c, k, vals)
            return
        # STORE
        reg = ins.region
        r, buf, ver, box = where
        tags[(r, buf)][box] = k * VMAX + ver
        if self.numeric:
            if c["out"] is None:
                c["out"] = self._compute(task, c, k, vals)
            src = c["out"].get(buf)
            if src is None:
                raise ValueError(f"task {task.id} stores %{reg.tensor}, which none of its ops computes")
            dst = vals[(r, buf)]
            dst[box] = src[box].to(dst.dtype)

    def _compute(self, task, c, k, vals) -> dict:
        """Evaluate the task's ops on what its loads saw; returns buffer -> full-size result.
        Memoized on a digest of everything the evaluation reads besides weights and step inputs
        (fixed per rank and step): the valid part of each load, and the current contents of its
        STORE regions of buffers the task updates in place."""
        h = hashlib.blake2b(digest_size=16)
        for buf, box, data, valid in c["loads"]:
            h.update(f"{buf}{box}".encode())
            v = valid.numpy()
            if v.all():                 # the usual case: no mask to apply
                h.update(b"all")
                h.update(data.numpy().tobytes())
            else:
                h.update(v.tobytes())
                h.update(torch.where(valid, data, torch.zeros((), dtype=data.dtype)).numpy().tobytes())
        for b, box in self._inplace_stores(task):
            h.update(f"{b}{box}".encode())
            h.update(vals[(task.rank, b)][box].numpy().tobytes())
        # keyed by the ops, not the task: the tiles of one family that see the same data (e.g.
        # every tile of a GEMV loads the whole input) share one evaluation of the family's ops
        key = (task.ops, task.body_kind, task.rank, k, c["poison"], h.digest())
        hit = self.memo.get(key)
        if hit is not None:
            self.memo_hits += 1
            return hit
        ops = [self.bm.producer[n] for n in task.ops]
        made = {v.name for op in ops for v in op.outputs}
        ext: list[dict] = []        # per op: operand index -> what the task's loads give it
        poison = c["poison"]
        for op in ops:
            args = {}
            for j, v in enumerate(op.inputs):
                if v.name in made:
                    continue
                b, _ = self.bm.root[v.name]
                if self.bm.kind.get(b) is Kind.weight or b in self.bm.inputs:
                    continue
                args[j], bad = self._gathered(task, op, j, v, b, c, vals)
                poison |= bad
            ext.append(args)
        out = self._evaluate(task, ops, made, ext, poison, c, k)
        self.memo[key] = out
        return out

    def _inplace_stores(self, task) -> list:
        """(buffer, slices) of the task's own-rank STORE regions of buffers its ops update in place."""
        got = self._inplace.get(task.id)
        if got is None:
            bufs = {self.bm.root[op.inputs[j].name][0] for op in (self.bm.producer[n] for n in task.ops)
                    for j in op.opdef.aliases.values()}
            got = self._inplace[task.id] = [
                (self.bm.root[i.region.tensor][0], tuple(slice(lo, hi) for lo, hi in i.region.box))
                for i in task.instrs if i.kind is InstrKind.STORE and self.bm.root[i.region.tensor][0] in bufs
                and (i.region.rank is None or i.region.rank == task.rank)]
        return got

    def _gathered(self, task, op, j, v, b, c, vals):
        """Operand j of `op` as the task's loads saw it (NaN where not loaded or stale); True when
        stale integer data poisons everything computed from it."""
        shape = v.type.concrete(self.s.dims)
        dt = torch_dtype(v.type.dtype, "fp32")
        full = torch.full(shape, float("nan")).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
        seen = torch.zeros(shape, dtype=torch.bool)
        for buf, box, data, valid in c["loads"]:
            if buf == b:
                full[box] = data
                seen[box] = valid
        if j in op.opdef.aliases.values() and (task.rank, b) in vals:
            # updated in place: elements of the task's STORE regions that the op does not touch
            # (cache rows other than `pos`) keep the buffer's contents, loaded or not. Elements
            # outside them stay NaN: the task neither reads nor writes them (and the memo digest
            # must not depend on other tasks' progress on them)
            keep = torch.zeros(shape, dtype=torch.bool)
            for i in task.instrs:
                if i.kind is InstrKind.STORE and self.bm.root[i.region.tensor][0] == b \
                        and (i.region.rank is None or i.region.rank == task.rank):
                    keep[tuple(slice(lo, hi) for lo, hi in i.region.box)] = True
            keep &= ~seen
            full[keep] = vals[(task.rank, b)].to(dt)[keep]
            seen |= keep
        if dt.is_floating_point:
            full[~seen] = float("nan")
            return full, False
        return full, any(buf == b and not bool(valid.all()) for buf, _, _, valid in c["loads"])

    def _evaluate(self, task, ops, made, ext, poison, c, k) -> dict:
        env = {}
        W = self.W[task.rank]
        for op, args_ext in zip(ops, ext):
            args = []
            for j, v in enumerate(op.inputs):
                if v.name in env:
                    args.append(env[v.name])
                elif j in args_ext:
                    args.append(args_ext[j])
                elif self.bm.kind.get(self.bm.root[v.name][0]) is Kind.weight:
                    args.append(W[v.name])
                else:
                    args.append(self.inputs[k][v.name])
            if self.s.ranks > 1 and Trait.collective in op.opdef.traits:
                res = self._collective_task(task, op, args[0], c)
                if isinstance(res, dict):
                    return res          # a push: its result is the slot buffer's content
                outs = [res]
            else:
                with as_rank(task.rank):
                    outs = op.opdef.ref(args, op.attrs)
            for v, t in zip(op.outputs, outs):
                t = store(t, v.type, "fp32")
                if poison and t.is_floating_point():
                    t = torch.full_like(t, float("nan"))
                env[v.name] = t
        out = {}
        for name in made:
            b, ver = self.bm.root[name]
            if b not in out or ver > out[b][0]:
                out[b] = (ver, env[name])
        return {b: t for b, (ver, t) in out.items()}

    def _collective_task(self, task, op, x, c):
        """One side of a collective as the lowering emits it: a push task stores its operand in
        a peer's slot of a comm buffer [R, *x] (returns {buffer: every slot = x}; the STORE
        region picks slot d), the local task combines its operand with the slots it loaded
        (slot d = rank (q - d)'s operand)."""
        R, q = self.s.ranks, task.rank
        comm = {self.bm.root[i.region.tensor][0] for i in task.instrs
                if i.region is not None and self.bm.kind.get(self.bm.root[i.region.tensor][0]) is Kind.comm}
        pushed = [self.bm.root[i.region.tensor][0] for i in task.instrs
                  if i.kind is InstrKind.STORE and self.bm.root[i.region.tensor][0] in comm]
        # a collective cut into column windows (passes/split_reduce.py) moves only its window
        # through a slot buffer [G, window]: a push task's tile is its slot, then the window; a
        # local task's tile is the window of the result
        buf = pushed[0] if pushed else (next(iter(comm)) if len(comm) == 1 else None)
        win = None
        if buf is not None and tuple(self.shapes[buf][1:]) != tuple(x.shape):
            tile = tuple(task.tile)
            win = tuple(slice(a, b) for a, b in (tile[1:] if len(tile) == x.dim() + 1 else tile))
        xw = x[win] if win is not None else x
        if pushed:          # the lowering's `<y>.slots` (or a hand-written comm buffer)
            return {pushed[0]: xw.float().unsqueeze(0).expand(self.shapes[pushed[0]][0], *xw.shape).clone()}
        if len(comm) != 1:
            raise ValueError(f"task {task.id}: collective %{op.outputs[0].name} reads {len(comm)} comm "
                             f"buffers, expected its slot buffer")
        (slot,) = comm
        slots = torch.full(self.shapes[slot], float("nan"))
        for buf, box, data, valid in c["loads"]:
            if buf == slot:
                slots[box] = torch.where(valid, data.float(), torch.tensor(float("nan")))
        # groups of G ranks S apart (comm.py): slot d holds the member d places behind, rank
        # q - d * S, i.e. group index i - d; operands are combined in group index order
        G, S = op.attrs.get("ranks", R), op.attrs.get("stride", 1)
        i = (q // S) % G
        xs = [None] * G
        xs[i] = xw.float()
        for d in range(1, G):
            xs[(i - d) % G] = slots[d]
        # what the group's members get is the op's registry entry (OpDef.group_ref); this is member i
        if op.opdef.group_ref is None:
            raise ValueError(f"numeric random-order execution does not model collective {op.opname}")
        y = op.opdef.group_ref(xs, op.attrs)[i]
        if win is None:
            return y
        full = torch.full(x.shape, float("nan"))      # outside the window: never stored
        full[win] = y
        return full
