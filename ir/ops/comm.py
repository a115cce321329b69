"""Collectives between ranks. The sharding pass inserts them; at R = 1 they are identities.

Semantics are per rank (what this rank's output holds); the multi-rank reference executor
(`fusec.backends.reference.ranks`) evaluates them across all ranks at once.
"""
from __future__ import annotations

import contextlib
import contextvars

from ..registry import Attr, AttrKind, OpDef, Trait, act, register
from ..types import DType
from ._util import need

A = AttrKind
COMM = frozenset({Trait.collective})

# The rank whose view a per-rank reference op computes. It is a property of the executor, not of
# the graph (SPMD: every rank runs the same graph); the multi-rank executor sets it around each
# rank's ops, a single-rank run leaves it at 0. Read by `rank_slice` and the expert-parallel MoE ops.
CURRENT_RANK: contextvars.ContextVar[int] = contextvars.ContextVar("fusec_rank", default=0)


@contextlib.contextmanager
def as_rank(rank: int):
    tok = CURRENT_RANK.set(rank)
    try:
        yield
    finally:
        CURRENT_RANK.reset(tok)


def _same(ts, at):
    return [act(ts[0].shape, ts[0].dtype)]


def _scatter_infer(ts, at):
    (x,) = ts
    d, r = at["dim"], at["ranks"]
    need(isinstance(x.shape[d], int) and x.shape[d] % r == 0, "reduce_scatter", f"dim {d} not divisible by {r}")
    shape = list(x.shape)
    shape[d] //= r
    return [act(shape, x.dtype)]


def _gather_infer(ts, at):
    (x,) = ts
    d = at["dim"]
    need(isinstance(x.shape[d], int), "all_gather", "gather dim must be static")
    shape = list(x.shape)
    shape[d] *= at["ranks"]
    return [act(shape, x.dtype)]


RANKS = {"ranks": Attr(A.int)}
register(OpDef("all_reduce", ("x",), ("y",), _same, lambda a, at: [a[0].float()], attrs=RANKS,
               traits=COMM, doc="sum over ranks"))
register(OpDef("reduce_scatter", ("x",), ("y",), _scatter_infer, lambda a, at: [a[0].float()],
               attrs={**RANKS, "dim": Attr(A.int, -1)}, traits=COMM,
               doc="sum over ranks, each rank keeps its slice of dim"))
register(OpDef("all_gather", ("x",), ("y",), _gather_infer, lambda a, at: [a[0].float()],
               attrs={**RANKS, "dim": Attr(A.int, -1)}, traits=COMM, doc="concatenate every rank's slice"))


def _dispatch_infer(ts, at):
    x, ids = ts
    return [act((x.shape[0], ids.shape[1], x.shape[1]), x.dtype)]


def _dispatch_ref(a, at):
    x, ids = a
    return [x.float()[:, None, :].expand(-1, ids.shape[1], -1).contiguous()]


register(OpDef("all_to_all_dispatch", ("x", "ids"), ("recv",), _dispatch_infer, _dispatch_ref,
               attrs={**RANKS, "experts": Attr(A.int)}, traits=COMM, addressed_by={0: 1},
               doc="send each token's row to the rank owning each of its selected experts"))


def _combine_infer(ts, at):
    (y,) = ts[:1]
    return [act(y.shape, DType.f32)]


register(OpDef("all_to_all_combine", ("y", "ids"), ("back",), _combine_infer, lambda a, at: [a[0].float()],
               attrs={**RANKS, "experts": Attr(A.int)}, traits=COMM, addressed_by={0: 1},
               doc="return each expert output row to the rank that owns its token"))


def _rank_slice_ref(a, at):
    x, r = a[0], at["ranks"]
    n = x.shape[at["dim"]] // r
    return [x.float().narrow(at["dim"], CURRENT_RANK.get() * n, n)]


register(OpDef("rank_slice", ("x",), ("y",), _scatter_infer, _rank_slice_ref,
               attrs={**RANKS, "dim": Attr(A.int, -1)}, traits=frozenset({Trait.elementwise}),
               doc="this rank's slice of a replicated value along dim (no data moves)"))
