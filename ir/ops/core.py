"""Dense ops: embedding, linear (bf16 and MXFP4 weights), norms, elementwise math, AttnRes,
shape plumbing and greedy sampling."""
from __future__ import annotations

from .._lazy import LazyModule
from ..registry import Attr, AttrKind, Cost, OpDef, SeqSplit, Tiling, Trait, act, register, default_cost
from ..types import DType
from ._util import dtype_attr, f32, need, need_dim, need_dtype, need_rank

torch = LazyModule("torch")   # imported at the first reference call (ir/_lazy.py)
F = LazyModule("torch.nn.functional")

A = AttrKind


def situ_glu_math(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU: (4 tanh(g/4) sigmoid(g)) * (25 tanh(u/25)), in fp32."""
    g, u = g.float(), u.float()
    return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)) * (25.0 * torch.tanh(u / 25.0))


def rms_norm_math(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


# -- embedding -------------------------------------------------------------------------------
def _embedding_infer(ts, at):
    table, ids = ts
    need_rank(table, 2, "embedding", "table")
    need_dtype(ids, (DType.i32, DType.i64), "embedding", "ids")
    return [act((*ids.shape, table.shape[1]), table.dtype)]


def _embedding_cost(ins, outs, at, dims):
    row = ins[0].nbytes(dims) / ins[0].concrete(dims)[0]
    n = ins[1].numel(dims)
    return Cost(n * row + ins[1].nbytes(dims), outs[0].nbytes(dims), 0.0)


def _embedding_regions(at, sh, out, full):
    """Columns c0:c1 of every row of the table (which rows is known at run time), all ids."""
    return lambda obox: [(full[0][0], obox[-1]), full[1]]


register(OpDef("embedding", ("table", "ids"), ("out",), _embedding_infer,
               lambda a, at: [f32(a[0])[a[1].long()]], cost_fn=_embedding_cost,
               addressed_by={0: 1}, tile_epilogue=False, doc="rows of a table selected by token ids", regions=_embedding_regions))


# -- linear ----------------------------------------------------------------------------------
def _linear_infer(ts, at):
    x, w = ts
    need_rank(w, 2, "linear", "weight [N, K]")
    need_dtype(w, (DType.bf16, DType.f16, DType.f32, DType.mxfp4, DType.fp8e4m3), "linear", "weight")
    need(x.rank >= 1, "linear", "input must have rank >= 1")
    need_dim(x.shape[-1], w.shape[1], "linear", "input width vs weight [N, K]")
    return [act((*x.shape[:-1], w.shape[0]), dtype_attr("linear", at["out_dtype"]))]


def _linear_cost(ins, outs, at, dims):
    c = default_cost(ins, outs, dims)
    n, k = ins[1].concrete(dims)
    m = ins[0].numel(dims) // k
    return Cost(c.bytes_read, c.bytes_written, 2.0 * m * n * k)


def _linear_regions(at, sh, out, full):
    """Output columns c0:c1 read all of x and weight rows c0:c1."""
    f0, rows = full[0], (0, sh[1][1])
    return lambda obox: [f0, (obox[-1], rows)]


register(OpDef("linear", ("x", "w"), ("y",), _linear_infer,
               lambda a, at: [f32(a[0]) @ f32(a[1]).T],
               attrs={"out_dtype": Attr(A.str, "bf16")}, traits=frozenset({Trait.gemv, Trait.mergeable}),
               tiling=Tiling.columns, cost_fn=_linear_cost, doc="y = x @ w^T, w [N, K] in bf16 or mxfp4; fp32 accumulate", regions=_linear_regions))


# -- norms -----------------------------------------------------------------------------------
def _rms_infer(ts, at):
    x, w = ts
    need_rank(w, 1, "rms_norm", "weight")
    need_dim(x.shape[-1], w.shape[0], "rms_norm", "width vs weight")
    return [act(x.shape, dtype_attr("rms_norm", at["out_dtype"]) if at["out_dtype"] else x.dtype)]


register(OpDef("rms_norm", ("x", "w"), ("y",), _rms_infer,
               lambda a, at: [rms_norm_math(a[0], a[1], at["eps"])],
               attrs={"eps": Attr(A.float, 1e-5), "out_dtype": Attr(A.str, "")},
               traits=frozenset({Trait.rowwise, Trait.tokenwise, Trait.norm}), tile_epilogue=False))


def _grms_infer(ts, at):
    x, g, w = ts
    need_dim(x.shape, g.shape, "gated_rms_norm", "x vs gate shape")
    need_rank(w, 1, "gated_rms_norm", "weight")
    need_dim(w.shape[0], at["head_dim"], "gated_rms_norm", "weight vs head_dim")
    need(isinstance(x.shape[-1], int) and x.shape[-1] % at["head_dim"] == 0, "gated_rms_norm",
         "width must be a multiple of head_dim")
    return [act(x.shape, DType.bf16)]


def _grms_ref(a, at):
    x, g, w = f32(a[0]), f32(a[1]), f32(a[2])
    d = at["head_dim"]
    y = rms_norm_math(x.unflatten(-1, (-1, d)), w, at["eps"]).flatten(-2)
    return [y * torch.sigmoid(g)]


register(OpDef("gated_rms_norm", ("x", "gate", "w"), ("y",), _grms_infer, _grms_ref,
               attrs={"head_dim": Attr(A.int), "eps": Attr(A.float, 1e-5)},
               traits=frozenset({Trait.rowwise, Trait.headwise, Trait.whole_vectors}),
               doc="per-head RMSNorm(head_dim) * w * sigmoid(gate) (KDA output norm)"))


def _l2_infer(ts, at):
    (x,) = ts
    need(isinstance(x.shape[-1], int) and x.shape[-1] % at["head_dim"] == 0, "l2_norm",
         "width must be a multiple of head_dim")
    return [act(x.shape, x.dtype)]


def _l2_ref(a, at):
    x = f32(a[0]).unflatten(-1, (-1, at["head_dim"]))
    y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + at["eps"])
    return [(y * at["scale"]).flatten(-2)]


register(OpDef("l2_norm", ("x",), ("y",), _l2_infer, _l2_ref,
               attrs={"head_dim": Attr(A.int), "scale": Attr(A.float, 1.0), "eps": Attr(A.float, 1e-6)},
               traits=frozenset({Trait.rowwise, Trait.headwise})))


# -- elementwise -----------------------------------------------------------------------------
def _binary_infer(name):
    def infer(ts, at):
        a, b = ts
        need_dim(a.shape, b.shape, name, "operand shapes")
        out = dtype_attr(name, at["out_dtype"]) if at.get("out_dtype") else a.dtype
        return [act(a.shape, out)]
    return infer


def _unary_infer(name):
    def infer(ts, at):
        out = dtype_attr(name, at["out_dtype"]) if at.get("out_dtype") else ts[0].dtype
        return [act(ts[0].shape, out)]
    return infer


EW = frozenset({Trait.elementwise})
register(OpDef("add", ("a", "b"), ("y",), _binary_infer("add"), lambda a, at: [f32(a[0]) + f32(a[1])],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW, doc="residual add"))
register(OpDef("mul", ("a", "b"), ("y",), _binary_infer("mul"), lambda a, at: [f32(a[0]) * f32(a[1])],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW))
register(OpDef("sigmoid_mul", ("x", "gate"), ("y",), _binary_infer("sigmoid_mul"),
               lambda a, at: [f32(a[0]) * torch.sigmoid(f32(a[1]))],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW, doc="x * sigmoid(gate) (output gates)"))
register(OpDef("situ_glu", ("gate", "up"), ("y",), _binary_infer("situ_glu"),
               lambda a, at: [situ_glu_math(a[0], a[1])],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW, doc="SiTU-GLU of gate and up"))
register(OpDef("silu_mul", ("gate", "up"), ("y",), _binary_infer("silu_mul"),
               lambda a, at: [F.silu(f32(a[0])) * f32(a[1])],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW, doc="SwiGLU"))
register(OpDef("sigmoid", ("x",), ("y",), _unary_infer("sigmoid"), lambda a, at: [torch.sigmoid(f32(a[0]))],
               attrs={"out_dtype": Attr(A.str, "")}, traits=EW))
register(OpDef("cast", ("x",), ("y",), _unary_infer("cast"), lambda a, at: [f32(a[0])],
               attrs={"out_dtype": Attr(A.str)}, traits=EW))


# -- shape plumbing --------------------------------------------------------------------------
def _numel_sig(shape):
    n, syms = 1, []
    for d in shape:
        if isinstance(d, str):
            syms.append(d)
        else:
            n *= d
    return n, sorted(syms)


def _reshape_infer(ts, at):
    (x,) = ts
    need(sum(isinstance(d, str) for d in at["shape"]) <= 1, "reshape", "at most one symbolic dim")
    need(_numel_sig(x.shape) == _numel_sig(at["shape"]), "reshape",
         f"cannot reshape {x} to [{', '.join(map(str, at['shape']))}]")
    return [act(at["shape"], x.dtype)]


def _reshape_ref(a, at):
    # at most one symbolic dim (checked by infer), so it can be left to torch as -1
    return [a[0].reshape([-1 if isinstance(d, str) else d for d in at["shape"]])]


register(OpDef("reshape", ("x",), ("y",), _reshape_infer, _reshape_ref, attrs={"shape": Attr(A.dims)},
               traits=frozenset({Trait.view}), tile_epilogue=False))


def _slice_infer(ts, at):
    (x,) = ts
    d, s, e = at["dim"], at["start"], at["end"]
    need(-x.rank <= d < x.rank, "slice", f"dim {d} out of range for {x}")
    size = x.shape[d]
    need(isinstance(size, int) and 0 <= s < e <= size, "slice", f"[{s}:{e}] out of range for dim of size {size}")
    shape = list(x.shape)
    shape[d] = e - s
    return [act(shape, x.dtype)]


def _slice_regions(at, sh, out, full):
    """The same box, shifted along the sliced dim."""
    d = at["dim"] % len(out)
    st = at["start"]
    return lambda obox: [tuple((a + st, b + st) if i == d else (a, b) for i, (a, b) in enumerate(obox))]


register(OpDef("slice", ("x",), ("y",), _slice_infer,
               lambda a, at: [a[0].narrow(at["dim"], at["start"], at["end"] - at["start"])],
               attrs={"dim": Attr(A.int), "start": Attr(A.int), "end": Attr(A.int)},
               traits=frozenset({Trait.elementwise, Trait.view}), regions=_slice_regions,
               window=lambda at: (at["dim"], at["start"], at["end"])))


def _concat_infer(ts, at):
    d = at["dim"]
    a = ts[0]
    for t in ts[1:]:
        need(t.rank == a.rank and t.dtype == a.dtype, "concat", f"{t} does not match {a}")
        for i in range(a.rank):
            if i != d % a.rank:
                need_dim(t.shape[i], a.shape[i], "concat", f"dim {i}")
    need(all(isinstance(t.shape[d], int) for t in ts), "concat", "concat dim must be static")
    shape = list(a.shape)
    shape[d] = sum(t.shape[d] for t in ts)
    return [act(shape, a.dtype)]


register(OpDef("concat", ("*parts",), ("y",), _concat_infer,
               lambda a, at: [torch.cat([f32(t) for t in a], at["dim"])], attrs={"dim": Attr(A.int, -1)},
               tile_epilogue=False))


# -- AttnRes (Block Attention Residuals) -----------------------------------------------------
def _attn_res_infer(ts, at):
    norm_w, proj_w, *src = ts
    need_rank(norm_w, 1, "attn_res", "norm weight")
    need(proj_w.rank == 2 and proj_w.shape[0] == 1, "attn_res", f"proj weight must be [1, H], got {proj_w}")
    for s in src:
        need_dim(s.shape, src[-1].shape, "attn_res", "source shapes")
        need_dim(s.shape[-1], norm_w.shape[0], "attn_res", "source width vs norm weight")
    return [act(src[-1].shape, DType.bf16)]


def _attn_res_ref(a, at):
    norm_w, proj_w, *src = a
    v = torch.stack([f32(s) for s in src], 0)                       # [J, B, H]
    key = f32(norm_w) * f32(proj_w)[0]                              # [H]
    s = (rms_norm_math(v, None, at["eps"]) * key).sum(-1)           # [J, B]
    p = torch.softmax(s, 0)
    return [(p[..., None] * v).sum(0)]


register(OpDef("attn_res", ("norm_w", "proj_w", "*sources"), ("h",), _attn_res_infer, _attn_res_ref,
               attrs={"eps": Attr(A.float, 1e-5)}, traits=frozenset({Trait.tokenwise, Trait.mix}), tile_epilogue=False,
               doc="Block Attention Residual mix: softmax over sources of rms(V_j).(norm_w*proj_w), "
                   "sum of P_j V_j; the last source is the running partial"))


# -- sampling --------------------------------------------------------------------------------
def _argmax_infer(ts, at):
    return [act(ts[0].shape[:-1], DType.i32)]


# Columns per argmax chunk at least (split over the vocabulary by the tile pass): a few KB of
# logits per task, so a chunk is one or two rounds of a CTA's 16-byte loads.
ARGMAX_MIN_CHUNK = 1024


def argmax_chunk(n: int, chunks: int, c: int) -> tuple[int, int]:
    """Columns [start, end) of chunk c of a row of n cut into `chunks` parts of whole 8-column
    groups (16-byte aligned starts for fp32 and bf16 rows; the last chunk takes the tail)."""
    g = -(-n // 8)
    return min(n, 8 * (c * g // chunks)), min(n, 8 * ((c + 1) * g // chunks))


register(OpDef("argmax", ("x",), ("idx",), _argmax_infer,
               lambda a, at: [f32(a[0]).argmax(-1).to(torch.int32)], traits=frozenset({Trait.tokenwise}),
               tile_epilogue=False,
               seq_split=SeqSplit("argmax_partial", "argmax_combine", cache=0, min_rows=ARGMAX_MIN_CHUNK),
               doc="greedy next token"))


def _argmax_partial_infer(ts, at):
    (x,) = ts
    need_rank(x, 2, "argmax_partial", "x [B, N]")
    need(at["chunks"] >= 1, "argmax_partial", "chunks must be >= 1")
    if isinstance(x.shape[1], int):
        # every chunk holds a column; a column's index is exact in fp32 below 2**24
        need(at["chunks"] <= -(-x.shape[1] // 8), "argmax_partial", "more chunks than 8-column groups")
        need(x.shape[1] <= 1 << 24, "argmax_partial", "columns past 2**24 (indices are fp32)")
    return [act((at["chunks"], x.shape[0], 2), DType.f32)]


def _argmax_partial_ref(a, at):
    """Per chunk of columns (argmax_chunk): the largest value and its lowest column, as fp32."""
    x = f32(a[0])
    parts = []
    for c in range(at["chunks"]):
        lo, hi = argmax_chunk(x.shape[-1], at["chunks"], c)
        i = x[:, lo:hi].argmax(-1, keepdim=True)
        parts.append(torch.cat([x[:, lo:hi].gather(-1, i), (i + lo).float()], -1))
    return [torch.stack(parts, 0)]


def _argmax_partial_regions(at, sh, out, full):
    """obox [c0:c1, b0:b1, 2]: those batch rows' columns of the chunks."""
    def argmax_partial(obox):
        n, s = sh[0][1], at["chunks"]
        cols = (argmax_chunk(n, s, obox[0][0])[0], argmax_chunk(n, s, obox[0][1] - 1)[1])
        return [(obox[1], cols)]
    return argmax_partial


register(OpDef("argmax_partial", ("x",), ("partials",), _argmax_partial_infer, _argmax_partial_ref,
               attrs={"chunks": Attr(A.int)}, tiling=Tiling.chunks, tile_epilogue=False,
               regions=_argmax_partial_regions,
               doc="argmax over `chunks` slices of the columns (split by the tile pass): per chunk and "
                   "row [largest value, its lowest column]; argmax_combine picks among them"))


def _argmax_combine_infer(ts, at):
    (p,) = ts
    need_rank(p, 3, "argmax_combine", "partials [S, B, 2]")
    need_dim(p.shape[2], 2, "argmax_combine", "partial pairs")
    return [act((p.shape[1],), DType.i32)]


def _argmax_combine_ref(a, at):
    """The best pair per row: the largest value, on ties the lowest column (chunks are in column
    order, so this is the whole row's argmax)."""
    p = f32(a[0])
    best = p[..., 0].argmax(0, keepdim=True)                     # [1, B]: the first chunk holding the max
    return [p[..., 1].gather(0, best)[0].to(torch.int32)]


register(OpDef("argmax_combine", ("partials",), ("idx",), _argmax_combine_infer, _argmax_combine_ref,
               traits=frozenset({Trait.tokenwise}), tile_epilogue=False,
               regions=lambda at, sh, out, full: lambda obox: [(full[0][0], obox[0], full[0][2])],
               doc="merge argmax_partial's pairs: the row's greedy token"))
