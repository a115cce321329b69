"""The CuTe backend's per-op lowering table: which task rows each IR op becomes.

An entry is a method of the task lowering (`lower._TaskLowering` and its mixin in
`lower_mixers.py`) registered with `@lowers(op name, ...)`; it takes the `OpCtx` of one op in one
task and returns [(TaskRow, address fields)]. The ops the backend can run are the table's keys
(`supported()`), so adding an op to the backend is one decorated method. The table is the
backend's knowledge of its task bodies, not the op's meaning (that is the op's registry entry in
fusec.ir): another backend lowers the same op its own way.
"""
from __future__ import annotations

from typing import Callable

LOWERINGS: dict[str, Callable] = {}


def lowers(*names: str):
    """Register the decorated method as the lowering of ops `names`."""
    def deco(fn):
        for n in names:
            if n in LOWERINGS:
                raise ValueError(f"cute lowering: two lowerings for op {n!r}")
            LOWERINGS[n] = fn
        return fn
    return deco


def supported() -> frozenset[str]:
    return frozenset(LOWERINGS)


class OpCtx:
    """One op of one task, as a lowering method sees it: the task, the op, its output columns in
    the task's tile (`cols`), the task's GEMV anchor if any (an op of trait `mergeable`: its
    columns are the task's tile; lower._is_anchor), and `redirect` (values a lowering
    moved to per-task scratch); `view` / `off` resolve a value name through `redirect`."""

    def __init__(self, low, t, op, cols, anchor, redirect: dict):
        self.low, self.t, self.op, self.cols, self.anchor, self.redirect = low, t, op, cols, anchor, redirect
        self.ins = [v.name for v in op.inputs]
        self.out = op.outputs[0].name
        self.at = op.attrs

    def view(self, name: str):
        return self.low._v(name, self.redirect)

    def off(self, name: str) -> int:
        return self.low._off(name, self.redirect)
