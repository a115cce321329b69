"""Task families of the `tile` pass's lowering (not a pass): the `Unit` record and the smallest
task it is worth cutting. Below both `_lowering.py` (fusion groups) and `_collectives.py`
(collectives, split-sequence attention), which each build units.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fusec.ir.graph import Op
from fusec.ir.schedule import Family

MIN_TASK_BYTES = 128 * 1024     # a task streams at least this much (~4 us at its share vs 1.5 us overhead)


@dataclass
class Unit:
    """One task family: the tasks of one (part of a) fusion group, or one side of a collective."""

    name: str
    ops: list[Op]
    body: str
    task_ids: list[int] = field(default_factory=list)
    reads: set[str] = field(default_factory=set)      # values loaded (produced elsewhere)
    writes: set[str] = field(default_factory=set)     # values stored
    after: set[str] = field(default_factory=set)      # units that must finish first (WAR edges)
    deps: set[str] = field(default_factory=set)       # every unit it waits on (set by the toposort)
    # collectives: named events; pre[i] = [(event, threshold, peer offset or None)], post likewise
    pre: dict[int, list[tuple[str, int, int | None]]] = field(default_factory=dict)
    post: dict[int, list[tuple[str, int | None]]] = field(default_factory=dict)
    named_events: dict[str, int] = field(default_factory=dict)   # event name -> signals per step
    signals_local: bool = True       # its tasks signal the unit's own event (someone waits on it)
    collective: bool = False

    def family(self) -> Family:
        """The IR record of this unit (ir.schedule.Family): what later passes and the text see;
        reads, writes and `after` only served to order the units."""
        return Family(self.name, self.body, tuple(o.outputs[0].name for o in self.ops), list(self.task_ids),
                      tuple(sorted(self.deps)), self.collective, self.signals_local,
                      {i: list(v) for i, v in self.pre.items()}, {i: list(v) for i, v in self.post.items()},
                      dict(self.named_events))
