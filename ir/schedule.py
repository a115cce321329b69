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
for counter >= k * Event.per_step + t, so nothing is reset between steps.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .graph import Graph


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
class Schedule:
    graph: Graph                     # the per-rank SPMD graph the tasks implement
    dims: dict[str, int]             # bound symbolic dims (B, L)
    ranks: int
    sms: int
    tasks: list[Task]
    events: list[Event]
    queues: dict[tuple[int, int], list[int]]   # (rank, sm) -> task ids in issue order
    meta: dict[str, str] = field(default_factory=dict)

    def task(self, tid: int) -> Task:
        return self.tasks[tid]
