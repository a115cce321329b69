"""The static plan: tasks on per-SM queues of every rank, with events, waits and signals.

A `Schedule` is what the CuTe backend consumes and what the memory-order verifier proves.
All ranks run the same SPMD `graph` (the sharded, tiled graph); tensors are per rank unless
their kind is `comm` (symmetric buffers that peers write).

Each task is a straight-line body of `Instr`s, in the order the generated code issues them:
    LOAD   region      (read of a tensor region into the CTA; weights may be prefetched early)
    WAIT   event >= threshold   (acquire; threshold counts signals *within one step*)
    COMPUTE            (the task's ops on what was loaded)
    STORE  region      (write of a tensor region)
    SIGNAL event       (release increment; `peer` names another rank's counter: system scope)
The verifier's rules V1-V7 (see `fusec.passes.memory_order`) are stated over exactly these
instructions, so a hoisted activation load is visible as a LOAD placed before its WAIT.

Events are monotonic across steps: on step k (0-based) a WAIT for `threshold` t really waits
for counter >= k * Event.per_step + t, so nothing is reset between steps. A threshold of 0
therefore means "every signal of the *previous* step has arrived" (used for comm-buffer acks).

Replicated (SPMD) schedules: when every rank runs the same tasks, `replicated` is True and
`tasks`, `events` and `queues` hold rank 0 only. Rank r's copy is the same list with `rank = r`
and every peer reference rotated: `Region.rank` and `Instr.peer` p become (p + r) % ranks
(peers are addressed by offset, so the collectives are rank-symmetric; boxes never depend on
the rank). `materialize()` expands a replicated schedule to explicit tasks for every rank
(task ids rank * n + i); the randomized executor and small tests use it.

`buffers` holds scratch tensors the lowering introduces that are not graph values (comm slot
buffers of collectives, kind `comm`), with their concrete types.

`families` is the stage between the `tile` and `schedule` passes, kept in the plan after it: the
task families (one fusion group or part of one, or one side of a collective) in a topological
order, each with its tasks and the families whose every task it must wait for (`deps`), plus a
collective's named events and its per-task system-scope waits and signals (`pre`, `post`).
`overlap` reorders them; `schedule` turns `deps`, `pre` and `post` into WAIT/SIGNAL lines and
events. `check_families` states what a well-formed list is (the pass manager runs it).
"""
from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields

from .graph import Graph
from .types import TensorType


class InstrKind(enum.Enum):
    LOAD = "load"
    WAIT = "wait"
    COMPUTE = "compute"
    STORE = "store"
    SIGNAL = "signal"


class Scope(enum.Enum):
    cta = "cta"
    gpu = "gpu"
    sys = "sys"     # cross-GPU


class Sem(enum.Enum):
    relaxed = "relaxed"
    acquire = "acquire"
    release = "release"


@dataclass(frozen=True)
class Region:
    """A box of one tensor: half-open [lo, hi) per dim, with concrete ints (dims are bound)."""

    tensor: str
    box: tuple[tuple[int, int], ...]
    rank: int | None = None     # the rank whose copy is accessed; None = the task's own rank

    def overlaps(self, other: "Region") -> bool:
        if self.tensor != other.tensor or len(self.box) != len(other.box):
            return False
        return all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(self.box, other.box))

    def contains(self, other: "Region") -> bool:
        return self.tensor == other.tensor and all(
            a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(self.box, other.box))


@dataclass(frozen=True)
class Instr:
    kind: InstrKind
    region: Region | None = None
    event: int | None = None
    threshold: int | None = None
    sem: Sem = Sem.relaxed
    scope: Scope = Scope.gpu
    peer: int | None = None          # SIGNAL/WAIT on another rank's counter (then scope is sys)
    # LOAD only: the tensor whose run-time value gives this load's address (V3), e.g. router ids
    addressed_by: str | None = None


# Every field of an Instr at its default (read from the dataclass, so a new field is never
# missed): `mem_instr` starts from these.
_INSTR_DEFAULTS = {f.name: None if f.default is MISSING else f.default for f in fields(Instr)}


def mem_instr(kind: InstrKind, region: Region, addressed_by: str | None = None) -> Instr:
    """`Instr(kind, region, addressed_by=addressed_by)` (a LOAD or STORE), the same object field
    for field, made in half the time: the frozen dataclass's `__init__` sets each of the eight
    fields through `object.__setattr__`, and the tile pass makes ~3.4 * 10^5 of them on the
    full K3. The fields are written straight into the new instance's `__dict__`, which is where
    that `__init__` puts them too (tests/test_mem_instr.py compares the two)."""
    i = object.__new__(Instr)
    d = i.__dict__
    d.update(_INSTR_DEFAULTS)
    d["kind"] = kind
    d["region"] = region
    d["addressed_by"] = addressed_by
    return i


@dataclass
class Task:
    id: int
    rank: int
    sm: int
    body_kind: str                   # which data-driven task body runs it (e.g. "gemv", "norm")
    ops: tuple[str, ...]             # the IR ops (by first result name) this task computes
    tile: tuple[tuple[int, int], ...]  # the output box this task computes (of its primary output)
    instrs: list[Instr] = field(default_factory=list)
    cost_us: float = 0.0             # predicted duration

    def loads(self):
        return [i for i in self.instrs if i.kind is InstrKind.LOAD]

    def stores(self):
        return [i for i in self.instrs if i.kind is InstrKind.STORE]


@dataclass
class Event:
    id: int
    rank: int
    name: str
    per_step: int                    # signals this counter receives per step


@dataclass
class Family:
    """One task family of the tile pass (see the module docstring)."""

    name: str
    body: str                        # the tasks' body kind ("gemv", "comm_push", ...)
    ops: tuple[str, ...]             # op results the family computes (as Task.ops)
    task_ids: list[int]
    deps: tuple[str, ...] = ()       # families that finish before any of its tasks starts (sorted)
    collective: bool = False
    signals_local: bool = True       # its tasks signal the family's own event (someone waits on it)
    # per task index i: system-scope waits (event name, threshold, peer offset or None) and
    # signals (event name, peer offset or None) of a collective's tasks
    pre: dict[int, list[tuple[str, int, int | None]]] = field(default_factory=dict)
    post: dict[int, list[tuple[str, int | None]]] = field(default_factory=dict)
    named_events: dict[str, int] = field(default_factory=dict)   # event name -> signals per step


def check_families(s: "Schedule") -> None:
    """Raise ValueError naming the first defect of `s.families`: a task in no family or in two,
    an unknown task id, a dependency on a family that is not earlier in the list (the order
    must be topological), a pre/post entry for a task index the family does not have, or a
    family op the graph does not define. An empty list (a schedule read from a file written
    without its families) is accepted."""
    if not s.families:
        return
    owner: dict[int, str] = {}
    seen: set[str] = set()
    n = len(s.tasks)
    for f in s.families:
        if f.name in seen:
            raise ValueError(f"family '{f.name}' listed twice")
        for d in f.deps:
            if d not in seen:
                raise ValueError(f"family '{f.name}' depends on '{d}', which is not an earlier family")
        for tid in f.task_ids:
            if not 0 <= tid < n:
                raise ValueError(f"family '{f.name}' lists task {tid}, not a task of the schedule")
            if tid in owner:
                raise ValueError(f"task {tid} is in families '{owner[tid]}' and '{f.name}'")
            owner[tid] = f.name
        for i in (*f.pre, *f.post):
            if not 0 <= i < len(f.task_ids):
                raise ValueError(f"family '{f.name}' has a pre/post entry for task index {i} of {len(f.task_ids)}")
        for o in f.ops:
            if not s.graph.has_value(o):
                raise ValueError(f"family '{f.name}' computes unknown value %{o}")
        seen.add(f.name)
    missing = n - len(owner)
    if missing:
        tid = next(t.id for t in s.tasks if t.id not in owner)
        raise ValueError(f"{missing} task(s) in no family, the first task {tid}")


@dataclass
class Schedule:
    graph: Graph                     # the per-rank SPMD graph the tasks implement
    dims: dict[str, int]             # bound symbolic dims (B, L)
    ranks: int
    sms: int
    tasks: list[Task]
    events: list[Event]
    queues: dict[tuple[int, int], list[int]]   # (rank, sm) -> task ids in issue order
    meta: dict[str, str] = field(default_factory=dict)
    replicated: bool = False         # tasks/events/queues are rank 0's; see the module docstring
    buffers: dict[str, TensorType] = field(default_factory=dict)   # lowering scratch (comm slots)
    families: list[Family] = field(default_factory=list)          # the tile stage (module docstring)

    def task(self, tid: int) -> Task:
        return self.tasks[tid]

    def materialize(self) -> "Schedule":
        """An explicit schedule with every rank's tasks (a copy; identity when not replicated).
        The copy has no families: they name rank 0's task ids."""
        if not self.replicated:
            return self
        n, R = len(self.tasks), self.ranks

        def rot(p, r):
            return None if p is None else (p + r) % R

        tasks, events, queues = [], [], {}
        for r in range(R):
            for t in self.tasks:
                ins = [Instr(i.kind, None if i.region is None else
                             Region(i.region.tensor, i.region.box, rot(i.region.rank, r)),
                             i.event, i.threshold, i.sem, i.scope, rot(i.peer, r), i.addressed_by)
                       for i in t.instrs]
                tasks.append(Task(r * n + t.id, r, t.sm, t.body_kind, t.ops, t.tile, ins, t.cost_us))
            events.extend(Event(e.id, r, e.name, e.per_step) for e in self.events)
            for (_, sm), q in self.queues.items():
                queues[(r, sm)] = [r * n + i for i in q]
        return Schedule(self.graph, dict(self.dims), R, self.sms, tasks, events, queues,
                        dict(self.meta), False, dict(self.buffers))
