"""Mixture of experts: the sigmoid router with bias-corrected top-k, routed expert GEMVs over
the selected ids (SiTU-GLU inside; bf16 or MXFP4 weights) and the weighted combine."""
from __future__ import annotations

from .._lazy import LazyModule
from ..registry import Attr, AttrKind, Cost, OpDef, Route, Tiling, Trait, act, register
from ..types import DType
from ._util import f32, need, need_dim, need_dtype, need_rank
from .comm import CURRENT_RANK, group_index
from .core import situ_glu_math

torch = LazyModule("torch")   # imported at the first reference call (ir/_lazy.py)

A = AttrKind


def _router_infer(ts, at):
    logits, bias = ts
    need_rank(logits, 2, "router", "logits [B, E]")
    need_dim(bias.shape, (logits.shape[1],), "router", "bias [E]")
    need(0 < at["topk"] <= logits.shape[1], "router", "topk out of range")
    b = logits.shape[0]
    return [act((b, at["topk"]), DType.f32), act((b, at["topk"]), DType.i32)]


def _router_select(a, at):
    """The scores the router's top-k is taken of: sigmoid(logits) + bias (fp32)."""
    return torch.sigmoid(f32(a[0])) + f32(a[1])


def _router_mix(a, at, ids):
    """The weights of picks `ids`: the raw sigmoid scores (no bias), normalised, times scale."""
    w = torch.sigmoid(f32(a[0])).gather(-1, ids.long())
    return w / w.sum(-1, keepdim=True) * at["scale"]


def _router_ref(a, at):
    _, ids = torch.topk(_router_select(a, at), at["topk"], dim=-1)   # choose on corrected scores
    return [_router_mix(a, at, ids), ids.to(torch.int32)]


register(OpDef("router", ("logits", "bias"), ("weights", "ids"), _router_infer, _router_ref,
               attrs={"topk": Attr(A.int), "scale": Attr(A.float, 1.0)},
               traits=frozenset({Trait.tokenwise, Trait.whole_row}), tile_epilogue=False,
               route=Route(ids=1, weights=0, k=lambda at: int(at["topk"]), scores=_router_select, mix=_router_mix),
               doc="sigmoid scores; top-k of scores + bias; weights = scores[ids] / sum * scale"))


def _experts_touched(b: int, k: int, e: int) -> int:
    """Distinct experts a batch reads at most (the cost model assumes no overlap)."""
    return min(e, b * k)


def _expert_cost(ins, outs, at, dims, w_idx):
    b, k = ins[1].concrete(dims)
    e = ins[w_idx[0]].concrete(dims)[0]
    frac = _experts_touched(b, k, e) / e
    wbytes = sum(ins[i].nbytes(dims) for i in w_idx) * frac
    other = sum(t.nbytes(dims) for i, t in enumerate(ins) if i not in w_idx)
    flops = sum(2.0 * b * k * ins[i].numel(dims) / e for i in w_idx)
    return Cost(wbytes + other, sum(t.nbytes(dims) for t in outs), flops)


def _gate_up_infer(ts, at):
    x, ids, w1, w3 = ts
    need_rank(x, 2, "moe_gate_up", "x [B, D]")
    need_dtype(ids, DType.i32, "moe_gate_up", "ids")
    need_rank(w1, 3, "moe_gate_up", "w1 [E, I, D]")
    need_dim(w1.shape, w3.shape, "moe_gate_up", "w1 vs w3")
    need_dim(w1.shape[2], x.shape[1], "moe_gate_up", "expert input width")
    return [act((x.shape[0], ids.shape[1], w1.shape[1]), DType.bf16)]


def _local_ids(ids, n_local: int, at):
    """Expert parallel (`ep_ranks` > 1): this rank holds experts [i*n_local, (i+1)*n_local), i its
    index in its expert group (`ep_stride`, see ops/comm.py); global ids map to local rows, ids
    owned by other ranks to -1 (their rows stay zero here)."""
    ids = ids.long()
    if at["ep_ranks"] == 1:
        return ids
    local = ids - group_index(CURRENT_RANK.get(), at["ep_ranks"], at.get("ep_stride", 1)) * n_local
    return torch.where((local >= 0) & (local < n_local), local, torch.full_like(local, -1))


EP = {"ep_ranks": Attr(A.int, 1), "ep_stride": Attr(A.int, 1)}


def _gate_up_ref(a, at):
    x, ids, w1, w3 = a
    ids = _local_ids(ids, w1.shape[0], at)
    out = []
    for e in ids.unique().tolist():   # each selected expert's weights, read once
        if e < 0:
            continue
        sel = ids == e
        b = sel.nonzero()[:, 0]
        xe = f32(x)[b]
        out.append((sel, situ_glu_math(xe @ f32(w1[e]).T, xe @ f32(w3[e]).T)))
    h = torch.zeros((*ids.shape, w1.shape[1]), device=ids.device)
    for sel, v in out:
        h[sel] = v
    return [h]


register(OpDef("moe_gate_up", ("x", "ids", "w1", "w3"), ("h",), _gate_up_infer, _gate_up_ref, attrs=EP,
               traits=frozenset({Trait.gemv, Trait.expert}), tiling=Tiling.experts, addressed_by={2: 1, 3: 1},
               cost_fn=lambda i, o, at, d: _expert_cost(i, o, at, d, (2, 3)),
               doc="per selected expert: SiTU-GLU(x W1[e]^T, x W3[e]^T)"))


def _down_infer(ts, at):
    h, ids, w2 = ts
    need_rank(h, 3, "moe_down", "h [B, K, I]")
    need_dim(tuple(h.shape[:2]), tuple(ids.shape), "moe_down", "h vs ids")
    need_rank(w2, 3, "moe_down", "w2 [E, D, I]")
    need_dim(w2.shape[2], h.shape[2], "moe_down", "expert intermediate width")
    return [act((*h.shape[:2], w2.shape[1]), DType.f32)]


def _down_ref(a, at):
    h, ids, w2 = a
    ids = _local_ids(ids, w2.shape[0], at)
    y = torch.zeros((*ids.shape, w2.shape[1]), device=ids.device)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        sel = ids == e
        y[sel] = f32(h)[sel] @ f32(w2[e]).T
    return [y]


register(OpDef("moe_down", ("h", "ids", "w2"), ("y",), _down_infer, _down_ref, attrs=EP,
               traits=frozenset({Trait.gemv, Trait.expert}), tiling=Tiling.experts, addressed_by={2: 1},
               cost_fn=lambda i, o, at, d: _expert_cost(i, o, at, d, (2,)),
               doc="per selected expert: y = h W2[e]^T (fp32 out)"))


def _combine_infer(ts, at):
    y, w = ts
    need_rank(y, 3, "moe_combine", "y [B, K, D]")
    need_dim(tuple(y.shape[:2]), tuple(w.shape), "moe_combine", "y vs weights")
    return [act((y.shape[0], y.shape[2]), DType.f32)]


def _moe_combine_regions(at, sh, out, full):
    """obox [b, c0:c1]: every slot's columns c0:c1 of those rows, their weights."""
    return lambda obox: [(obox[0], full[0][1], obox[1]), (obox[0], full[1][1])]


register(OpDef("moe_combine", ("y", "weights"), ("out",), _combine_infer,
               lambda a, at: [(f32(a[0]) * f32(a[1])[..., None]).sum(1)],
               traits=frozenset({Trait.columnwise, Trait.slot_sum}), tile_epilogue=False, doc="sum_j w_j y_j in fp32", regions=_moe_combine_regions))
