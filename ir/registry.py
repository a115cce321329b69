"""The op registry: the one place an op is defined.

An `OpDef` holds the op's signature (operand, result and attribute names), its shape/dtype
rule, its torch reference implementation, its cost (bytes read and written, flops), its traits,
how the tile pass lowers it (`tiling`, `tile_step`, `tile_epilogue`, ...), the rewrites it takes
(`rewrite`, `seq_split`) and the constant tables it reads (`attr_table`). The printer and parser
take operand and attribute names from here, the verifier calls `infer`, the reference executor
calls `ref`, the cost model calls `cost`, canonicalization, fusion, sharding, tiling and the
backends read the traits and fields. What an op is lives here only: the passes test a trait or a field,
never a list of op names, so adding an op is one `register(OpDef(...))`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .types import DType, Kind, TensorType


class Trait(enum.Enum):
    """What the passes may assume about an op; they read these, never lists of op names."""
    elementwise = "elementwise"      # out[i] depends on in[i] only
    rowwise = "rowwise"              # reduces over the last dim of one row (norms); with headwise, of one head
    gemv = "gemv"                    # streams a weight matrix: the decode hot spot
    # a gemv over the experts the router chose: weights [E, ...] read through the ids operand
    expert = "expert"
    # computes each head (attr `head_dim` columns of the last dim) on its own: a tile of its
    # output holds whole heads
    headwise = "headwise"
    # its 1-D operands are not one value per output column (a weight per position in a head,
    # RoPE's positions): a column tile reads them whole, not its own columns
    whole_vectors = "whole_vectors"
    collective = "collective"        # moves data between ranks
    stateful = "stateful"            # updates a state parameter in place
    attention = "attention"          # reads a cache over the sequence
    # batch row b of every output depends only on row b of the batch-major operands (weights
    # whole): the tile pass may cut such a unit along the batch, one task per token
    tokenwise = "tokenwise"
    # column c of the last dim of its output reads only column c of the last dim of its batch-
    # major operands (a reduction over the middle dims is fine; the other operands whole): the
    # tile pass may cut a unit of such ops along the last dim, like an elementwise one
    columnwise = "columnwise"
    # its result may be a view of its operand in memory (no data moves): with a `window`, that
    # window of operand 0 (slice); without one, operand 0's elements in the same order under a
    # new shape (reshape). The backends give it no task body of its own
    view = "view"
    # its result is this rank's window of operand 0 (a rank-dependent offset, no data moves):
    # a backend addresses it as operand 0's memory at the rank's offset (rank_slice)
    rank_window = "rank_window"
    # fusion roles (read by passes/fuse.py):
    # a row normalisation with a weight: a GEMV may recompute it in every tile as its prologue
    # (its input is small at decode), and a `mix` takes it as its one epilogue
    norm = "norm"
    # mixes several source rows into one (AttnRes): anchors a group with the `norm` that reads
    # it and grows no other epilogue
    mix = "mix"
    # sums per-slot rows with weights (the MoE combine): joins the prologue of the `norm` that
    # reads it when its inputs are small (cost.PROLOGUE_MAX_BYTES)
    slot_sum = "slot_sum"
    # an epilogue that needs its anchor's whole output row (router scoring over all experts)
    whole_row = "whole_row"
    # y = x @ w^T over a weight w [N, K] (operand 1): output column n reads the whole row of x
    # (operand 0) and row n of w, and the op has an `out_dtype` attribute. Siblings reading the
    # same x with weights of one dtype are one such op over their weights stacked along dim 0,
    # outputs side by side: canonicalize merges them (a window per original output gives it
    # back; the shard plan reads a merged weight's parts from those windows), the tile pass runs
    # a sibling in its anchor's own tile, and the CuTe lowering takes it as a task's GEMV anchor
    # (a `norm` feeding it is recomputed by each task into its own scratch)
    mergeable = "mergeable"


class Tiling(enum.Enum):
    """How the tile pass cuts an op's output when the op anchors a task family (`OpDef.tiling`;
    None: the op never anchors one, it joins an anchor's tile or runs alone)."""
    columns = "columns"   # ranges of the last dim (GEMV output rows; per-head outputs on `tile_step`)
    heads = "heads"       # ranges of dim 1, the heads of a [B, H, ...] output
    experts = "experts"   # ranges of the rows of every routed expert, each task all (token, slot) pairs
    chunks = "chunks"     # one task per (chunk of cache rows, batch row): split-sequence partials


@dataclass(frozen=True)
class SeqSplit:
    """How the tile pass splits an op over a long operand along its dim 1 (`OpDef.seq_split`):
    an attention along its cache's sequence, the argmax along the vocabulary. Op `partial` (the
    op's operands and attributes plus `chunks`) computes one partial result per chunk of dim 1
    of operand `cache` ([B, L, ...]), op `combine` merges the partials into the op's result. A
    chunk has at least `min_rows` entries of that dim."""
    partial: str
    combine: str
    cache: int
    min_rows: int


@dataclass(frozen=True)
class Route:
    """A routing op (`OpDef.route`): per row it picks the `k(attrs)` best of its selection
    scores, `scores(operands, attrs)` (fp32 [rows, choices]), and reports the picks in result
    `ids` and their mixing weights, `mix(operands, attrs, ids)`, in result `weights`. Tools that
    compare two runs' routing (golden checks, kernel-vs-reference bisection) read the choice and
    its margin from here: a pick whose score gap to the next is within rounding is a near-tie,
    not an error, and one run may be made to follow the other's picks."""
    ids: int
    weights: int
    k: Callable[[Mapping], int]
    scores: Callable[[list, Mapping], Any]
    mix: Callable[[list, Mapping, Any], Any]


@dataclass(frozen=True)
class AttrTable:
    """A constant table the op's computation reads, made from its attributes alone
    (`OpDef.attr_table`; RoPE's inverse frequencies): a backend builds it once per distinct
    attributes when it binds a program, never per step. `name` names the kind of table (the
    backend keys its copies by it and the attributes), `fill(attrs)` gives its values (a torch
    tensor of `shape(attrs)`), stored as `dtype`."""
    name: str
    shape: Callable[[Mapping], tuple]
    dtype: DType
    fill: Callable[[Mapping], Any]


class AttrKind(enum.Enum):
    int = "int"
    float = "float"
    str = "str"
    bool = "bool"
    ints = "ints"      # tuple of ints
    dims = "dims"      # tuple of ints and symbolic dim names


REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    kind: AttrKind
    default: Any = REQUIRED


class OpError(ValueError):
    """An op applied to operands or attributes it does not accept."""


@dataclass(frozen=True)
class Cost:
    bytes_read: float
    bytes_written: float
    flops: float


@dataclass
class OpDef:
    name: str
    operands: tuple[str, ...]           # a trailing "*name" is variadic (one or more)
    results: tuple[str, ...]
    infer: Callable[[list[TensorType], dict], list[TensorType]]
    ref: Callable[..., list]             # ref(args, attrs) -> list of torch tensors
    attrs: Mapping[str, Attr] = field(default_factory=dict)
    traits: frozenset = frozenset()
    aliases: Mapping[int, int] = field(default_factory=dict)  # result index -> operand index it updates in place
    # operand index -> operand index whose run-time value selects what is loaded (V3): e.g. the
    # expert weights of a MoE op are addressed through the router's ids.
    addressed_by: Mapping[int, int] = field(default_factory=dict)
    # cost_fn(in_types, out_types, attrs, dims) -> Cost; None: `default_cost` (every byte once)
    cost_fn: Callable | None = None
    # lowering (the tile pass): how the op's output is cut when it anchors a task family; for
    # `Tiling.columns`, `tile_step(attrs)` is the column step every cut falls on (whole heads)
    tiling: Tiling | None = None
    tile_step: Callable[[Mapping], int] | None = None
    # False: never joins an anchor's tile as an epilogue (a reduction over the tiled axis or a
    # change of shape); the tile pass starts a new task family at it
    tile_epilogue: bool = True
    # operands (by index) besides weights whose bytes the op streams once per step (a cache, a
    # recurrent state, attention partials): the tile pass sizes a family it anchors by weights
    # plus these bytes
    streams: tuple[int, ...] = ()
    # at least this many tasks when it anchors a family, SMs permitting (latency-bound work, e.g.
    # one KDA head per task); None: sized by bytes alone
    min_tasks: Callable[[Mapping], int] | None = None
    # its result rows (dim 0, the batch) are independent work (one recurrent state per row): a
    # family it anchors may cut them too, with `Tiling.columns` when its column tiles leave SMs
    # idle, with `Tiling.heads` always (one task per (batch row, head range): a task's heads are
    # one row's, contiguous)
    split_rows: bool = False
    # the exact regions a tile reads: `regions(attrs, input shapes, output shape, input full
    # boxes)` returns f(obox) -> the box of each input (None: not read) needed to compute box
    # `obox` of result 0; built once per op, called per tile. None: the generic rules of
    # passes/_regions.py (the op's trait: expert, tokenwise, elementwise-like)
    regions: Callable[[Mapping, list, tuple, list], Callable] | None = None
    # a window of operand 0 along one dim: `window(attrs) -> (dim, start, end)`, the elements
    # [start, end) it keeps (a slice); its result is operand 0's memory from `start` on (a view)
    window: Callable[[Mapping], tuple[int, int, int]] | None = None
    # an op updating a state in place (result 1 aliases a state operand): the box of that
    # result a task writes when it computes the box `obox` of result 0, given the state's shape,
    # `state_box(obox, shape, attrs)`; None: result 1 is written whole (or has result 0's box
    # when the shapes agree)
    state_box: Callable[[tuple, tuple, Mapping], tuple] | None = None
    # collectives: every member's result from every member's operand (fp32, in group index
    # order) within one group, `group_ref(xs, attrs) -> ys`; what `ref` computes for one rank
    # alone is the identity of R = 1. The multi-rank reference executor runs it per group.
    group_ref: Callable[[list, Mapping], list] | None = None
    # canonicalize replaces the op by the ops `rewrite(op, make)` returns: an exact rewrite into
    # the form the later passes expect (the unabsorbed MLA -> absorb, attend, up-project).
    # `make(opname, operands, attrs, name)` builds one op (name None: any fresh name); the last
    # op's result 0 takes over the op's result; the ops returned have no `rewrite` themselves
    rewrite: Callable[[Any, Callable], list] | None = None
    # an op over a long operand (an attention's cache, the argmax's logits) that the tile pass
    # may split along it into partials and a combine (`SeqSplit`); None: it runs whole
    seq_split: SeqSplit | None = None
    # a constant table made from the attributes (`AttrTable`) that the op reads; None: none
    attr_table: AttrTable | None = None
    # a routing op: which results hold its picks and weights, and the scores it picks from
    # (`Route`); None: not a router
    route: Route | None = None
    doc: str = ""

    @property
    def variadic(self) -> bool:
        return bool(self.operands) and self.operands[-1].startswith("*")

    def normalize_attrs(self, attrs: dict) -> dict:
        """Fill defaults, reject unknown or missing attributes, coerce types; canonical order."""
        out = {}
        for k in attrs:
            if k not in self.attrs:
                raise OpError(f"{self.name} has no attribute '{k}' (it has: {', '.join(self.attrs) or 'none'})")
        for k, spec in self.attrs.items():
            if k in attrs:
                out[k] = _coerce(self.name, k, spec.kind, attrs[k])
            elif spec.default is REQUIRED:
                raise OpError(f"{self.name} needs attribute '{k}'")
            else:
                out[k] = spec.default
        return out

    def check_arity(self, n: int) -> None:
        fixed = len(self.operands) - (1 if self.variadic else 0)
        if (self.variadic and n < fixed + 1) or (not self.variadic and n != fixed):
            want = f"at least {fixed + 1}" if self.variadic else str(fixed)
            raise OpError(f"{self.name} takes {want} operands ({', '.join(self.operands)}), got {n}")

    def cost(self, in_types: Sequence[TensorType], out_types: Sequence[TensorType], attrs: dict,
             dims: Mapping[str, int]) -> Cost:
        if self.cost_fn is not None:
            return self.cost_fn(in_types, out_types, attrs, dims)
        return default_cost(in_types, out_types, dims)


def default_cost(in_types, out_types, dims, flops_per_out: float = 1.0) -> Cost:
    rd = sum(t.nbytes(dims) for t in in_types)
    wr = sum(t.nbytes(dims) for t, in zip(out_types))
    fl = sum(t.numel(dims) for t in out_types) * flops_per_out
    return Cost(rd, wr, fl)


def _coerce(op: str, name: str, kind: AttrKind, v):
    try:
        if kind is AttrKind.int:
            if isinstance(v, bool) or int(v) != v:
                raise TypeError
            return int(v)
        if kind is AttrKind.float:
            if isinstance(v, bool):
                raise TypeError
            return float(v)
        if kind is AttrKind.str:
            if not isinstance(v, str):
                raise TypeError
            return v
        if kind is AttrKind.bool:
            if not isinstance(v, bool):
                raise TypeError
            return v
        if kind is AttrKind.ints:
            return tuple(_coerce(op, name, AttrKind.int, x) for x in v)
        if kind is AttrKind.dims:
            return tuple(x if isinstance(x, str) else _coerce(op, name, AttrKind.int, x) for x in v)
    except (TypeError, ValueError):
        pass
    raise OpError(f"{op}: attribute '{name}' must be {kind.value}, got {v!r}")


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in REGISTRY:
        raise RuntimeError(f"op {opdef.name} registered twice")
    REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise OpError(f"unknown op '{name}'") from None


def act(shape, dtype: DType) -> TensorType:
    """Result type helper: an activation of this shape and dtype."""
    return TensorType(tuple(shape), dtype, Kind.act)


def expect(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise OpError(f"{op}: {msg}")
