"""What the shard pass splits and how far: the linear plan and the parallel degrees.

Each linear's tensor-parallel role is its weight's param attr `tp` (col / row / vocab), which the
model file states (`GraphBuilder.finish(tp_roles=...)`) and the .fir carries; unstated: replicated.
`plan_degrees(graph, R)` picks the tensor-parallel degree tp (the largest divisor of R dividing
every head count and every column-parallel part of a merged projection) and the expert-parallel degree ep = gcd(R, E); docs/passes.md ("shard")
explains the hybrid layout they give. Used by passes/shard.py only.
"""
from __future__ import annotations

import math

from fusec.ir.graph import Graph, Op
from fusec.ir.registry import Trait

COL, ROW, REP, VOCAB = "col", "row", "rep", "vocab"


class ShardError(ValueError):
    pass


def weight_role(g: Graph, name: str) -> str:
    """The tensor-parallel role the model gave weight `name` (its param attr `tp`: col, row or
    vocab; the model file states them, `GraphBuilder.finish(tp_roles=...)`); unstated: whole."""
    return g.param_attrs.get(name, {}).get("tp", REP)


def source_roles(g: Graph, name: str) -> tuple[str, ...]:
    """The roles of the sources of merged weight `name` (canonicalize records them)."""
    a = g.param_attrs.get(name, {})
    return tuple(a.get("source_tp", (REP,) * len(a.get("sources", ()))))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_degrees(g: Graph, R: int, below: int = 0) -> tuple[int, int]:
    """(tp, ep): the largest divisor of R dividing every head count and every column-parallel
    part of a merged projection (they feed the head-split mixers), and gcd(R, E). Plain linears
    whose width tp does not divide use a subgroup of the TP group (`_op_linear`). `below`: the
    largest such tp < below (a retry after a split that only the sharder found impossible)."""
    dims: list[int] = []
    experts: list[int] = []
    users = g.users()
    for op in g.ops:
        for attr in ("heads", "kv_heads"):
            if isinstance(op.attrs.get(attr), int):
                dims.append(op.attrs[attr])
        if Trait.expert in op.opdef.traits:
            experts.append(op.inputs[-1].type.shape[0])
        if Trait.mergeable in op.opdef.traits:     # a merged projection: its parts' roles
            roles = source_roles(g, op.inputs[1].name)
            if roles:
                dims += [n for role, n in zip(roles, source_rows(users, op)) if role == COL]
    tp = max(d for d in divisors(R) if (not below or d < below)
             and all(isinstance(n, int) and n % d == 0 for n in dims))
    ep = math.gcd(R, *experts) if experts else 1
    return tp, ep


def source_rows(users_of: dict, op: Op) -> list[int]:
    """Row counts of a merged weight's sources, read off canonicalize's slices of the output."""
    users = users_of[op.outputs[0].name]
    if not users or any(u.opdef.window is None for u in users):
        raise ShardError(f"shard: merged linear %{op.outputs[0].name} must be read only through slices")
    bounds = sorted({u.opdef.window(u.attrs)[1:] for u in users})
    return [e - s for s, e in bounds]
