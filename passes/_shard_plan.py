"""What the shard pass splits and how far: the linear plan and the parallel degrees.

`LINEAR_PLAN` names each linear's tensor-parallel role by fnmatch on its weight's full name (first
match wins; unmatched linears are replicated). `plan_degrees(graph, R)` picks the tensor-parallel
degree tp (the largest divisor of R dividing every head count and every column-parallel part of
a merged projection) and the expert-parallel degree ep = gcd(R, E); docs/passes.md ("shard")
explains the hybrid layout they give. Used by passes/shard.py only.
"""
from __future__ import annotations

import fnmatch
import math

from fusec.ir.graph import Graph, Op
from fusec.ir.registry import Trait

COL, ROW, REP, VOCAB = "col", "row", "rep", "vocab"
LINEAR_PLAN: list[tuple[str, str]] = [
    ("*.routed_expert_up_proj.weight", ROW),   # input is the (normalised) full latent; shares the
    ("*.routed_expert_down_proj.weight", REP),  # shared expert's all_reduce. Latent: every rank
    ("*.q_a_proj.weight", REP), ("*.kv_a_proj_with_mqa.weight", REP), ("*.f_a_proj.weight", REP),
    ("*.q_proj.weight", COL), ("*.k_proj.weight", COL), ("*.v_proj.weight", COL),
    ("*.g_proj.weight", COL), ("*.b_proj.weight", COL), ("*.f_b_proj.weight", COL),
    ("*.q_b_proj.weight", COL), ("*.gate_proj.weight", COL), ("*.up_proj.weight", COL),
    ("*.o_proj.weight", ROW), ("*.down_proj.weight", ROW),
    ("lm_head.weight", VOCAB),    # column-parallel over the largest divisor of R dividing the vocab
]


class ShardError(ValueError):
    pass


def linear_plan(weight_name: str) -> str:
    return next((p for pat, p in LINEAR_PLAN if fnmatch.fnmatchcase(weight_name, pat)), REP)


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
        if op.opname == "linear":
            sources = g.param_attrs.get(op.inputs[1].name, {}).get("sources")
            if sources:
                dims += [n for src, n in zip(sources, source_rows(users, op)) if linear_plan(src) == COL]
    tp = max(d for d in divisors(R) if (not below or d < below)
             and all(isinstance(n, int) and n % d == 0 for n in dims))
    ep = math.gcd(R, *experts) if experts else 1
    return tp, ep


def source_rows(users_of: dict, op: Op) -> list[int]:
    """Row counts of a merged weight's sources, read off canonicalize's slices of the output."""
    users = users_of[op.outputs[0].name]
    if not users or any(u.opname != "slice" for u in users):
        raise ShardError(f"shard: merged linear %{op.outputs[0].name} must be read only through slices")
    bounds = sorted({(u.attrs["start"], u.attrs["end"]) for u in users})
    return [e - s for s, e in bounds]
