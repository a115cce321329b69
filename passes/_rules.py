"""The memory-order verifier's vocabulary: its rules (S1-S4, V1-V7) and the Violation it reports.

Below both `memory_order.py` (the checks) and `_derive.py` (S4's derived accesses), which each
report violations, so neither imports the other's module for them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Rule(enum.Enum):
    V1 = "V1"   # every read has a producer that happens before it
    V2 = "V2"   # no non-weight load placed before the wait that orders it
    V3 = "V3"   # run-time-addressed loads after the producer of the address
    V4 = "V4"   # no WAR / WAW race (incl. comm buffers reused next step)
    V5 = "V5"   # no deadlock; thresholds reachable
    V6 = "V6"   # signal after last store, release/acquire, sys scope across GPUs
    V7 = "V7"   # same grid and event layout on every rank
    S1 = "S1"   # structure: task ids, queues name existing tasks on their header's (rank, sm), instr fields
    S2 = "S2"   # events: declared once, on a rank in R, before any wait/signal uses them
    S3 = "S3"   # ranks, SMs, peers and region ranks inside the R x sms grid (never modulo R)
    S4 = "S4"   # LOAD/STORE lines cover exactly the regions the task's ops read and write (derived)


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
