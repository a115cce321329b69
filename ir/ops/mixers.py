"""Sequence mixers: KDA (short conv, gate, delta-rule recurrence), MLA (cache append, absorbed
and unabsorbed latent attention) and the Llama pieces (RoPE, GQA attention over a KV cache)."""
from __future__ import annotations

import math

from .._lazy import LazyModule
from ..registry import Attr, AttrKind, AttrTable, Cost, OpDef, SeqSplit, Tiling, Trait, act, register
from ..types import DType, Kind, TensorType
from ._util import f32, need, need_dim, need_dtype, need_rank

torch = LazyModule("torch")   # imported at the first reference call (ir/_lazy.py)
F = LazyModule("torch.nn.functional")

A = AttrKind


def _state(t: TensorType) -> TensorType:
    return t.with_kind(Kind.state)


def _ctx(dims, t: TensorType, axis: int = 1) -> int:
    """Cache rows an attention reads: the bound context length `ctx` if given, else capacity."""
    cap = t.concrete(dims)[axis]
    return min(cap, dims.get("ctx", cap))


# -- causal depthwise conv update ------------------------------------------------------------
def _conv_infer(ts, at):
    x, state, w = ts
    need_rank(x, 2, "conv_update", "x [B, C]")
    need_rank(state, 3, "conv_update", "state [B, C, W-1]")
    need_rank(w, 3, "conv_update", "weight [C, 1, W]")
    need_dim(x.shape[1], w.shape[0], "conv_update", "channels vs weight")
    need_dim(state.shape[:2], x.shape, "conv_update", "state [B, C] vs x")
    need(isinstance(w.shape[2], int) and state.shape[2] == w.shape[2] - 1, "conv_update",
         "state must hold width-1 past inputs")
    return [act(x.shape, DType.bf16), _state(state)]


def _conv_ref(a, at):
    x, state, w = f32(a[0]), f32(a[1]), f32(a[2])
    window = torch.cat([state, x[..., None]], -1)          # [B, C, W]; the last tap is this token
    y = (window * w[:, 0, :]).sum(-1)
    return [F.silu(y), window[..., 1:]]


def _conv_regions(at, sh, out, full):
    """Channels of the tile: x's box, their window of the state, their weights."""
    return lambda obox: [obox, (obox[0], obox[1], full[1][2]), (obox[1], full[2][1], full[2][2])]


register(OpDef("conv_update", ("x", "state", "w"), ("y", "new_state"), _conv_infer, _conv_ref,
               traits=frozenset({Trait.stateful, Trait.elementwise}), aliases={1: 1},
               state_box=lambda ob, s, at: (ob[0], ob[1], (0, s[2])),   # the tile's channels, whole window
               doc="causal depthwise short conv over [past W-1 inputs, x], then SiLU; shifts the state", regions=_conv_regions))


# -- KDA gate and recurrence -----------------------------------------------------------------
def _kda_gate_infer(ts, at):
    f, a_log, dt_bias = ts
    need_rank(f, 2, "kda_gate", "f [B, H*D]")
    need_dim(f.shape[1], at["heads"] * at["head_dim"], "kda_gate", "width vs heads*head_dim")
    need_dim(dt_bias.shape, (f.shape[1],), "kda_gate", "dt_bias")
    need(at["a_log_broadcast"] in ("head", "channel"), "kda_gate", "a_log_broadcast is head or channel")
    need(isinstance(a_log.shape[0], int) and a_log.shape[0] >= (
        at["heads"] if at["a_log_broadcast"] == "head" else f.shape[1]), "kda_gate", "A_log too short")
    return [act(f.shape, DType.f32)]


def _kda_gate_ref(a, at):
    f, a_log, dt_bias = f32(a[0]), f32(a[1]), f32(a[2])
    h, d = at["heads"], at["head_dim"]
    if at["a_log_broadcast"] == "head":
        a_ch = a_log[:h].repeat_interleave(d)
    else:
        a_ch = a_log[: h * d]
    return [-5.0 * torch.sigmoid(torch.exp(a_ch) * (f + dt_bias))]


register(OpDef("kda_gate", ("f", "a_log", "dt_bias"), ("g",), _kda_gate_infer, _kda_gate_ref,
               attrs={"heads": Attr(A.int), "head_dim": Attr(A.int), "a_log_broadcast": Attr(A.str, "head")},
               traits=frozenset({Trait.elementwise, Trait.headwise}),
               doc="log-space decay g = -5 sigmoid(exp(A_log) (f + dt_bias)), in [-5, 0]"))


def _kda_rec_infer(ts, at):
    q, k, v, g, beta, s = ts
    h, d = at["heads"], at["head_dim"]
    for t, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        need_rank(t, 2, "kda_recurrent", n)
        need_dim(t.shape[1], h * d, "kda_recurrent", f"{n} width")
    need_dim(beta.shape[1:], (h,), "kda_recurrent", "beta [B, H]")
    need_dim(s.shape[1:], (h, d, d), "kda_recurrent", "state [B, H, D, D]")
    need_dtype(s, DType.f32, "kda_recurrent", "state")
    return [act(q.shape, DType.f32), _state(s)]


def _kda_rec_ref(a, at):
    h, d = at["heads"], at["head_dim"]
    q, k, v, g = (f32(t).unflatten(-1, (h, d)) for t in a[:4])  # [B, H, D]
    beta, s = f32(a[4]), f32(a[5])                               # [B, H], [B, H, Dk, Dv]
    s = s * torch.exp(g)[..., None]                              # decay along the key channel
    u = v - torch.einsum("bhk,bhkv->bhv", k, s)                  # delta rule: v - k^T S
    s = s + beta[..., None, None] * k[..., :, None] * u[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q, s)
    return [o.flatten(-2), s]


def _kda_rec_cost(ins, outs, at, dims):
    s = ins[5].nbytes(dims)
    small = sum(t.nbytes(dims) for t in ins[:5])
    return Cost(s + small, s + outs[0].nbytes(dims), 8.0 * ins[5].numel(dims))


def _kda_rec_regions(at, sh, out, full):
    """obox [b0:b1, h0*D:h1*D]: the rows' q, k, v, g columns of the heads, their beta heads and
    whole D x D states."""
    d = at["head_dim"]

    def kda_recurrent(obox):
        h0, h1 = obox[-1][0] // d, obox[-1][1] // d
        return [obox] * 4 + [(obox[0], (h0, h1)), (obox[0], (h0, h1), full[5][2], full[5][3])]
    return kda_recurrent


register(OpDef("kda_recurrent", ("q", "k", "v", "g", "beta", "state"), ("o", "new_state"),
               _kda_rec_infer, _kda_rec_ref, attrs={"heads": Attr(A.int), "head_dim": Attr(A.int)},
               traits=frozenset({Trait.stateful}), aliases={1: 5}, cost_fn=_kda_rec_cost,
               tiling=Tiling.columns, tile_step=lambda at: at["head_dim"],
               streams=(5,), min_tasks=lambda at: at["heads"], split_rows=True,
               # the tile's batch rows and the heads of its columns, each head's whole D x D state
               state_box=lambda ob, s, at: (ob[0], (ob[-1][0] // at["head_dim"], ob[-1][1] // at["head_dim"]),
                                            (0, s[2]), (0, s[3])),
               doc="gated delta rule: S <- diag(exp g) S; u = v - k^T S; S += beta k u^T; o = q^T S", regions=_kda_rec_regions))


# -- caches ----------------------------------------------------------------------------------
def _append_infer(ts, at):
    cache, row, pos = ts
    need_rank(cache, 3, "cache_append", "cache [B, L, W]")
    need_dim((cache.shape[0], cache.shape[2]), tuple(row.shape), "cache_append", "row [B, W] vs cache")
    need_dtype(pos, DType.i32, "cache_append", "pos")
    return [_state(cache)]


def _append_ref(a, at):
    cache, row, pos = a
    out = cache.clone()
    out[torch.arange(cache.shape[0], device=cache.device), pos.long()] = row.to(cache.dtype)
    return [out]


def _append_cost(ins, outs, at, dims):
    return Cost(ins[1].nbytes(dims) + ins[2].nbytes(dims), ins[1].nbytes(dims), 0.0)


def _append_regions(at, sh, out, full):
    """Writes row pos[b]; reads no cache row, the whole new row and pos."""
    return lambda obox: [None, full[1], full[2]]


register(OpDef("cache_append", ("cache", "row", "pos"), ("new_cache",), _append_infer, _append_ref,
               traits=frozenset({Trait.stateful}), aliases={0: 0}, addressed_by={0: 2},
               tile_epilogue=False, cost_fn=_append_cost, doc="cache[b, pos[b]] = row[b]", regions=_append_regions))


def _masked_softmax(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Softmax over cache rows 0..pos[b] (inclusive); scores [B, H, L]."""
    L = scores.shape[-1]
    keep = torch.arange(L, device=scores.device)[None, :] <= pos.long()[:, None]   # [B, L]
    return torch.softmax(scores.masked_fill(~keep[:, None, :], float("-inf")), -1)


def _attn_cost(ins, outs, at, dims, cache_idx: tuple[int, ...]):
    """Attention reads only the used rows of its caches (`ctx` of `L`)."""
    c = ins[cache_idx[0]]
    b, cap, w = c.concrete(dims)
    ctx = _ctx(dims, c)
    caches = sum(ins[i].nbytes(dims) * ctx / cap for i in cache_idx)
    other = sum(t.nbytes(dims) for i, t in enumerate(ins) if i not in cache_idx)
    heads = at.get("heads", 1)
    return Cost(caches + other, sum(t.nbytes(dims) for t in outs), 4.0 * b * heads * ctx * w)


# -- MLA -------------------------------------------------------------------------------------
def _mla_dims(at):
    return at["heads"], at["nope"], at["rope"], at["kv_lora"], at["v_dim"]


def _split_kv_b(kv_b: torch.Tensor, at):
    h, nope, _, lora, vd = _mla_dims(at)
    w = f32(kv_b).reshape(h, nope + vd, lora)
    return w[:, :nope], w[:, nope:]                   # W_UK [H, nope, lora], W_UV [H, v, lora]


def _check_kv_b(kv_b, at, op):
    h, nope, _, lora, vd = _mla_dims(at)
    need_dim(tuple(kv_b.shape), (h * (nope + vd), lora), op, "kv_b [H*(nope+v), kv_lora]")


MLA_ATTRS = {"heads": Attr(A.int), "nope": Attr(A.int), "rope": Attr(A.int), "kv_lora": Attr(A.int),
             "v_dim": Attr(A.int)}


def _mla_naive_infer(ts, at):
    q_nope, q_pe, cache, kv_b, pos = ts
    h, nope, rope, lora, vd = _mla_dims(at)
    need_dim(q_nope.shape[1:], (h, nope), "mla_attention_naive", "q_nope [B, H, nope]")
    need_dim(q_pe.shape[1:], (h, rope), "mla_attention_naive", "q_pe [B, H, rope]")
    need_dim(cache.shape[2], lora + rope, "mla_attention_naive", "cache row width")
    _check_kv_b(kv_b, at, "mla_attention_naive")
    return [act((q_nope.shape[0], h * vd), DType.bf16)]


def _mla_naive_ref(a, at):
    q_nope, q_pe, cache, kv_b, pos = a
    lora = at["kv_lora"]
    w_uk, w_uv = _split_kv_b(kv_b, at)
    c, kpe = f32(cache)[..., :lora], f32(cache)[..., lora:]           # [B, L, lora], [B, L, rope]
    k_nope = torch.einsum("bld,hnd->blhn", c, w_uk)                    # decompressed keys
    v = torch.einsum("bld,hvd->blhv", c, w_uv)
    s = torch.einsum("bhn,blhn->bhl", f32(q_nope), k_nope) + torch.einsum("bhr,blr->bhl", f32(q_pe), kpe)
    p = _masked_softmax(s * at["scale"], pos)
    return [torch.einsum("bhl,blhv->bhv", p, v).flatten(-2)]


def _mla_naive_regions(at, sh, out, full):
    """obox [B, h*vd]: the heads' queries, the whole cache, the heads' rows of kv_b, pos."""
    vd, per = at["v_dim"], at["nope"] + at["v_dim"]

    def mla_attention_naive(obox):
        h0, h1 = obox[-1][0] // vd, obox[-1][1] // vd
        return [(full[0][0], (h0, h1), full[0][2]), (full[1][0], (h0, h1), full[1][2]), full[2],
                ((h0 * per, h1 * per), full[3][1]), full[4]]
    return mla_attention_naive


def _mla_absorb(op, make):
    """canonicalize's rewrite (`OpDef.rewrite`), exact in fp32: at decode the unabsorbed form
    decompresses every cached latent row through kv_b; the absorbed one moves kv_b onto the one
    new query (W_UK) and the attention output (W_UV): mla_q_absorb -> mla_attention -> mla_v_up."""
    q_nope, q_pe, cache, kv_b, pos = op.inputs
    out = op.outputs[0].name
    mla = {k: op.attrs[k] for k in MLA_ATTRS}
    q_lat = make("mla_q_absorb", [q_nope, kv_b], mla, f"{out}.q_lat")
    o_lat = make("mla_attention", [q_lat.outputs[0], q_pe, cache, pos], {**mla, "scale": op.attrs["scale"]},
                 f"{out}.o_lat")
    v_up = make("mla_v_up", [o_lat.outputs[0], kv_b], mla, None)
    return [q_lat, o_lat, v_up]


register(OpDef("mla_attention_naive", ("q_nope", "q_pe", "cache", "kv_b", "pos"), ("o",),
               _mla_naive_infer, _mla_naive_ref, attrs={**MLA_ATTRS, "scale": Attr(A.float)},
               traits=frozenset({Trait.attention}), tiling=Tiling.columns, tile_step=lambda at: at["v_dim"],
               cost_fn=lambda i, o, at, d: _attn_cost(i, o, at, d, (2,)), rewrite=_mla_absorb,
               doc="MLA over the latent cache, keys and values decompressed with kv_b (unabsorbed)", regions=_mla_naive_regions))


def _q_absorb_infer(ts, at):
    q_nope, kv_b = ts
    h, nope, _, lora, _ = _mla_dims(at)
    need_dim(q_nope.shape[1:], (h, nope), "mla_q_absorb", "q_nope [B, H, nope]")
    _check_kv_b(kv_b, at, "mla_q_absorb")
    return [act((q_nope.shape[0], h, lora), DType.bf16)]


def _q_absorb_ref(a, at):
    w_uk, _ = _split_kv_b(a[1], at)
    return [torch.einsum("bhn,hnd->bhd", f32(a[0]), w_uk)]


def _q_absorb_regions(at, sh, out, full):
    """obox [B, h0:h1, lora]: the heads' q_nope and their rows of kv_b."""
    per = at["nope"] + at["v_dim"]
    f0, f1 = full[0], full[1]

    def mla_q_absorb(obox):
        h0, h1 = obox[1]
        return [(f0[0], (h0, h1), f0[2]), ((h0 * per, h1 * per), f1[1])]
    return mla_q_absorb


register(OpDef("mla_q_absorb", ("q_nope", "kv_b"), ("q_lat",), _q_absorb_infer, _q_absorb_ref,
               attrs=MLA_ATTRS, traits=frozenset({Trait.gemv}), tiling=Tiling.heads,
               doc="per head q_lat = q_nope W_UK (W_UK = the key rows of kv_b)", regions=_q_absorb_regions))


# Cache rows per split-sequence chunk at least: one shared-memory stage of the CuTe backend's
# tensor-core partial body (MLA_SR); a shorter chunk only adds partials for the combine to read.
MLA_MIN_CHUNK_ROWS = 32


def _mla_attn_infer(ts, at):
    q_lat, q_pe, cache, pos = ts
    h, _, rope, lora, _ = _mla_dims(at)
    need_dim(q_lat.shape[1:], (h, lora), "mla_attention", "q_lat [B, H, kv_lora]")
    need_dim(q_pe.shape[1:], (h, rope), "mla_attention", "q_pe [B, H, rope]")
    need_dim(cache.shape[2], lora + rope, "mla_attention", "cache row width")
    # bf16 like FlashMLA's output, which the bf16 W_UV GEMM (mla_v_up) then reads.
    return [act((q_lat.shape[0], h, lora), DType.bf16)]


def _mla_attn_ref(a, at):
    q_lat, q_pe, cache, pos = a
    lora = at["kv_lora"]
    c = f32(cache)
    s = torch.einsum("bhd,bld->bhl", f32(q_lat), c[..., :lora]) + \
        torch.einsum("bhr,blr->bhl", f32(q_pe), c[..., lora:])
    p = _masked_softmax(s * at["scale"], pos)
    return [torch.einsum("bhl,bld->bhd", p, c[..., :lora])]


def _mla_attn_regions(at, sh, out, full):
    """obox [B, h0:h1, lora]: the heads' queries, the whole cache, pos."""
    def mla_attention(obox):
        hb = obox[1]
        return [(full[0][0], hb, full[0][2]), (full[1][0], hb, full[1][2]), full[2], full[3]]
    return mla_attention


register(OpDef("mla_attention", ("q_lat", "q_pe", "cache", "pos"), ("o_lat",), _mla_attn_infer,
               _mla_attn_ref, attrs={**MLA_ATTRS, "scale": Attr(A.float)},
               traits=frozenset({Trait.attention}), tiling=Tiling.heads, streams=(2,),
               seq_split=SeqSplit("mla_attention_partial", "attention_combine", cache=2, min_rows=MLA_MIN_CHUNK_ROWS),
               cost_fn=lambda i, o, at, d: _attn_cost(i, o, at, d, (2,)),
               doc="absorbed MLA: softmax([q_lat, q_pe] . cache * scale) over rows 0..pos; P cache[:, :kv_lora]", regions=_mla_attn_regions))


def _v_up_infer(ts, at):
    o_lat, kv_b = ts
    h, _, _, lora, vd = _mla_dims(at)
    need_dim(o_lat.shape[1:], (h, lora), "mla_v_up", "o_lat [B, H, kv_lora]")
    _check_kv_b(kv_b, at, "mla_v_up")
    return [act((o_lat.shape[0], h * vd), DType.bf16)]


def _v_up_ref(a, at):
    _, w_uv = _split_kv_b(a[1], at)
    return [torch.einsum("bhd,hvd->bhv", f32(a[0]), w_uv).flatten(-2)]


def _v_up_regions(at, sh, out, full):
    """obox [B, h0*vd:h1*vd]: the heads' o_lat and their rows of kv_b."""
    vd, per = at["v_dim"], at["nope"] + at["v_dim"]
    f0, f1 = full[0], full[1]

    def mla_v_up(obox):
        h0, h1 = obox[-1][0] // vd, obox[-1][1] // vd
        return [(f0[0], (h0, h1), f0[2]), ((h0 * per, h1 * per), f1[1])]
    return mla_v_up


register(OpDef("mla_v_up", ("o_lat", "kv_b"), ("o",), _v_up_infer, _v_up_ref, attrs=MLA_ATTRS,
               traits=frozenset({Trait.gemv}), tiling=Tiling.columns, tile_step=lambda at: at["v_dim"],
               doc="per head o = o_lat W_UV^T (W_UV = the value rows of kv_b)", regions=_v_up_regions))


# -- Llama: RoPE and GQA attention ----------------------------------------------------------
def _rope_infer(ts, at):
    x, pos = ts
    need_rank(x, 2, "rope", "x [B, H*D]")
    need(isinstance(x.shape[1], int) and x.shape[1] % at["head_dim"] == 0, "rope", "width vs head_dim")
    need_dtype(pos, DType.i32, "rope", "pos")
    return [act(x.shape, x.dtype)]


def rope_inv_freq(at) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 long-context scaling when `scaling_factor` > 1."""
    d = at["head_dim"]
    inv = 1.0 / (at["theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = at["scaling_factor"]
    if f > 1.0:
        lo, hi, orig = at["low_freq_factor"], at["high_freq_factor"], at["original_max_pos"]
        wavelen = 2 * math.pi / inv
        smooth = ((orig / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > orig / lo, inv / f, inv)
        mid = (wavelen <= orig / lo) & (wavelen >= orig / hi)
        inv = torch.where(mid, (1 - smooth) * inv / f + smooth * inv, scaled)
    return inv.to(torch.float32)


def _rope_ref(a, at):
    x, pos = f32(a[0]), a[1]
    d = at["head_dim"]
    inv = rope_inv_freq(at).to(x.device)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]                # [B, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    xh = x.unflatten(-1, (-1, d))
    rot = torch.cat([-xh[..., d // 2:], xh[..., : d // 2]], -1)         # rotate_half (HF layout)
    return [(xh * cos + rot * sin).flatten(-2)]


register(OpDef("rope", ("x", "pos"), ("y",), _rope_infer, _rope_ref,
               attrs={"head_dim": Attr(A.int), "theta": Attr(A.float, 10000.0),
                      "scaling_factor": Attr(A.float, 1.0), "low_freq_factor": Attr(A.float, 1.0),
                      "high_freq_factor": Attr(A.float, 4.0), "original_max_pos": Attr(A.int, 8192)},
               traits=frozenset({Trait.elementwise, Trait.headwise, Trait.whole_vectors}),
               attr_table=AttrTable("rope_inv_freq", lambda at: (at["head_dim"] // 2,), DType.f32, rope_inv_freq),
               doc="rotary embedding, rotate_half layout"))


def _gqa_infer(ts, at):
    q, kc, vc, pos = ts
    h, kvh, d = at["heads"], at["kv_heads"], at["head_dim"]
    need(h % kvh == 0, "attention", "heads must be a multiple of kv_heads")
    need_dim(q.shape[1], h * d, "attention", "q width")
    need_dim(kc.shape, vc.shape, "attention", "k and v caches")
    need_dim(kc.shape[2], kvh * d, "attention", "cache width")
    return [act(q.shape, DType.bf16)]


def _gqa_ref(a, at):
    q, kc, vc, pos = a
    h, kvh, d = at["heads"], at["kv_heads"], at["head_dim"]
    q = f32(q).unflatten(-1, (kvh, h // kvh, d))                       # [B, KVH, G, D]
    k = f32(kc).unflatten(-1, (kvh, d))                                # [B, L, KVH, D]
    v = f32(vc).unflatten(-1, (kvh, d))
    s = torch.einsum("bkgd,blkd->bkgl", q, k).flatten(1, 2) * at["scale"]
    p = _masked_softmax(s, pos).unflatten(1, (kvh, h // kvh))
    return [torch.einsum("bkgl,blkd->bkgd", p, v).flatten(1)]


def _gqa_regions(at, sh, out, full):
    """obox [B, h0*D:h1*D]: the query heads, the kv heads of their groups, pos."""
    d, grp = at["head_dim"], at["heads"] // at["kv_heads"]

    def attention(obox):
        h0, h1 = obox[-1][0] // d, obox[-1][1] // d
        kv = ((h0 // grp) * d, ((h1 - 1) // grp + 1) * d)
        return [obox, (full[1][0], full[1][1], kv), (full[2][0], full[2][1], kv), full[3]]
    return attention


register(OpDef("attention", ("q", "k_cache", "v_cache", "pos"), ("o",), _gqa_infer, _gqa_ref,
               attrs={"heads": Attr(A.int), "kv_heads": Attr(A.int), "head_dim": Attr(A.int),
                      "scale": Attr(A.float)},
               traits=frozenset({Trait.attention}), tiling=Tiling.columns,
               # whole groups of the heads that share one kv head (whole heads with them)
               tile_step=lambda at: at["head_dim"] * at["heads"] // at["kv_heads"],
               cost_fn=lambda i, o, at, d: _attn_cost(i, o, at, d, (1, 2)),
               doc="grouped-query attention of one new token over cache rows 0..pos", regions=_gqa_regions))


# -- split-sequence attention (added by the tile pass for long caches) ----------------------
def chunk_rows(length: int, chunks: int, c: int) -> tuple[int, int]:
    """Cache rows [start, end) of chunk c when `length` rows are cut into `chunks` parts."""
    return c * length // chunks, (c + 1) * length // chunks


def _mla_partial_infer(ts, at):
    q_lat, q_pe, cache, pos = ts
    _mla_attn_infer(ts, at)
    need(at["chunks"] >= 1, "mla_attention_partial", "chunks must be >= 1")
    h, lora = at["heads"], at["kv_lora"]
    return [act((at["chunks"], q_lat.shape[0], h, lora + 2), DType.f32)]


def _mla_partial_ref(a, at):
    """Per chunk: o normalised within the chunk, the running max m and sum l of exp(s - m)."""
    q_lat, q_pe, cache, pos = a
    lora, S = at["kv_lora"], at["chunks"]
    c = f32(cache)
    L = c.shape[1]
    s = (torch.einsum("bhd,bld->bhl", f32(q_lat), c[..., :lora]) +
         torch.einsum("bhr,blr->bhl", f32(q_pe), c[..., lora:])) * at["scale"]
    keep = torch.arange(L, device=s.device)[None, :] <= pos.long()[:, None]          # [B, L]
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    parts = []
    for i in range(S):
        lo, hi = chunk_rows(L, S, i)
        si = s[..., lo:hi]
        m = si.max(-1).values if hi > lo else torch.full(s.shape[:2], float("-inf"), device=s.device)
        safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(si - safe[..., None])                                            # 0 where masked
        l = p.sum(-1)
        o = torch.einsum("bhl,bld->bhd", p, c[:, lo:hi, :lora]) / l.clamp_min(1e-30)[..., None]
        parts.append(torch.cat([o, m[..., None], l[..., None]], -1))
    return [torch.stack(parts, 0)]


def _mla_partial_cost(ins, outs, at, dims):
    c = _attn_cost(ins, outs, at, dims, (2,))
    return Cost(c.bytes_read, outs[0].nbytes(dims), c.flops)


def _mla_partial_regions(at, sh, out, full):
    """obox [c0:c1, B, H, lora+2]: the chunks' cache rows of the tile's batch rows."""
    def mla_attention_partial(obox):
        L, S = sh[2][1], at["chunks"]
        rows = (chunk_rows(L, S, obox[0][0])[0], chunk_rows(L, S, obox[0][1] - 1)[1])
        b = obox[1]                             # the batch rows of q, the cache and pos
        return [(b,) + full[0][1:], (b,) + full[1][1:], (b, rows, full[2][2]), (b,)]
    return mla_attention_partial


register(OpDef("mla_attention_partial", ("q_lat", "q_pe", "cache", "pos"), ("partials",), _mla_partial_infer,
               _mla_partial_ref, attrs={**MLA_ATTRS, "scale": Attr(A.float), "chunks": Attr(A.int)},
               traits=frozenset({Trait.attention}), tiling=Tiling.chunks, cost_fn=_mla_partial_cost,
               doc="absorbed MLA over `chunks` slices of the cache rows (split-sequence): per chunk "
                   "[o (normalised in the chunk), max score m, sum l]; attention_combine merges them", regions=_mla_partial_regions))


def _combine_parts_infer(ts, at):
    (p,) = ts
    need_rank(p, 4, "attention_combine", "partials [S, B, H, D+2]")
    need(isinstance(p.shape[3], int) and p.shape[3] > 2, "attention_combine", "partial rows too narrow")
    # bf16: it replaces the attention op it was split from (split_sequence), whose result is bf16.
    return [act((p.shape[1], p.shape[2], p.shape[3] - 2), DType.bf16)]


def _combine_parts_ref(a, at):
    p = f32(a[0])
    o, m, l = p[..., :-2], p[..., -2], p[..., -1]
    mx = m.max(0).values                                            # chunk 0 always holds row 0
    w = torch.exp(m - mx[None]) * l                                 # exp(-inf) = 0 for empty chunks
    return [(w[..., None] * o).sum(0) / w.sum(0)[..., None]]


def _combine_parts_regions(at, sh, out, full):
    """obox [b0:b1, h0:h1, D]: every chunk's partial rows of those batch rows and heads."""
    return lambda obox: [(full[0][0], obox[0], obox[1], full[0][3])]


# split_rows: a task per (batch row, head range), so its (b, h) items are contiguous; over every
# batch row, one head a task at B = 16, a task was 16 one-item table rows merged one after another
register(OpDef("attention_combine", ("partials",), ("o",), _combine_parts_infer, _combine_parts_ref,
               tiling=Tiling.heads, streams=(0,), split_rows=True,
               doc="merge split-sequence attention partials: softmax-weighted by exp(m_i - max) l_i", regions=_combine_parts_regions))
