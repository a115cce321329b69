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

Numeric mode (one rank: collective pushes are data movement the per-op references do not
model, so R > 1 runs symbolically): each task evaluates its ops' registry references
(`Op.opdef.ref`) on what its LOADs saw, then writes only its STORE regions; graph outputs of
every step are compared with `fusec.backends.reference.executor.run_step`.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from fusec.ir.schedule import InstrKind, Schedule
from fusec.ir.types import DType, Kind
from fusec.passes._memory_access import BufferMap, expand_ranks

from .executor import init_state, prepare_weights, run_step, store, torch_dtype

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
                 weights: dict | None = None, data_seed: int = 0):
        self.s = expand_ranks(schedule)
        s = self.s
        self.steps = steps
        self.numeric = (s.ranks == 1) if numeric is None else numeric
        if self.numeric and s.ranks != 1:
            raise ValueError("numeric random-order execution supports one rank; use numeric=False")
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
            from fusec.weights import random_weights
            if weights is None:
                weights = random_weights(s.graph, data_seed)
            self.W = prepare_weights(s.graph, weights, "fp32")
            st = init_state(s.graph, s.dims, precision="fp32")
            self.state0 = {k: v.clone() for k, v in st.items()}
            self.expected = [run_step(s.graph, self.W, st, self.inputs[k], s.dims, "fp32") for k in range(steps)]

    # -- one order ---------------------------------------------------------------------------
    def run(self, seed: int, policy: Policy | None = None, max_poison: int = 3) -> OrderResult:
        rng = random.Random(seed)
        policy = policy or rng.choice(list(Policy))
        res = OrderResult(seed, policy)
        s, R = self.s, self.s.ranks
        tags = {(r, b): np.full(shape, NEVER, dtype=np.int64) for r in range(R) for b, shape in self.shapes.items()}
        vals = {}
        if self.numeric:
            for b, shape in self.shapes.items():
                ty = self.dtypes.get(b)
                dt = torch_dtype(ty.dtype, "fp32") if ty is not None else torch.float32
                vals[(0, b)] = (self.state0[b].clone() if b in self.state0 else
                                torch.full(shape, float("nan")) .to(dt) if dt.is_floating_point else
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
        self.last_buffers = vals          # rank 0's buffers after the last step (numeric), for diagnosis
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
                for n, exp in zip(self.outputs, self.expected[k]):
                    got = captured[0][k].get(n)
                    if got is None:
                        continue
                    if not torch.allclose(got.float(), exp.float(), rtol=1e-4, atol=1e-5):
                        bad = (~torch.isclose(got.float(), exp.float(), rtol=1e-4, atol=1e-5)).sum().item()
                        res.mismatch = f"step {k}: output %{n} differs from the reference in {bad} elements"
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
        """Evaluate the task's ops on what its loads saw; returns buffer -> full-size result."""
        g = self.s.graph
        env, poison = {}, c["poison"]
        ops = [self.bm.producer[n] for n in task.ops]
        made = {v.name for op in ops for v in op.outputs}
        for op in ops:
            args = []
            for v in op.inputs:
                if v.name in env:
                    args.append(env[v.name])
                    continue
                b, _ = self.bm.root[v.name]
                kb = self.bm.kind.get(b)
                if kb is Kind.weight:
                    args.append(self.W[v.name])
                elif b in self.bm.inputs:
                    args.append(self.inputs[k][v.name])
                else:
                    shape = v.type.concrete(self.s.dims)
                    dt = torch_dtype(v.type.dtype, "fp32")
                    full = torch.full(shape, float("nan")).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
                    seen = torch.zeros(shape, dtype=torch.bool)
                    for buf, box, data, valid in c["loads"]:
                        if buf == b:
                            full[box] = data
                            seen[box] = valid
                    if op.inputs.index(v) in op.opdef.aliases.values() and (0, b) in vals:
                        # updated in place: elements the op does not touch (cache rows other than
                        # `pos`) keep the buffer's contents, whether or not the task loaded them
                        full[~seen] = vals[(0, b)].to(dt)[~seen]
                        seen[...] = True
                    if dt.is_floating_point:
                        full[~seen] = float("nan")
                    elif any(buf == b and not bool(valid.all()) for buf, _, _, valid in c["loads"]):
                        poison = True    # stale ids/positions: anything computed from them is garbage
                    args.append(full)
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
