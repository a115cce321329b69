"""Exact regions per op: the box of each input an output tile needs, and the boxes of every
output given the first one's. Used by the `tile` pass's lowering (`_lowering.py`); `ctx` is its
`_Ctx` (shapes `ctx.shape`, full boxes `ctx.fb`, both by value name).
"""
from __future__ import annotations

from fusec.ir.graph import Op
from fusec.ir.registry import Trait
from fusec.ir.types import Kind
from fusec.ir.ops.mixers import chunk_rows


def full_box(shape) -> tuple[tuple[int, int], ...]:
    return tuple((0, int(d)) for d in shape)



def box_hull(old, bx):
    """The smallest box holding both (old may be None): one LOAD per value a tile reads, covering
    every box its ops read of it."""
    if old is None or old == bx:
        return bx
    return tuple((min(a0, b0), max(a1, b1)) for (a0, a1), (b0, b1) in zip(old, bx))


def input_boxes(ctx, op: Op, obox, anchor: bool):
    """Boxes of `op`'s inputs needed to compute `obox` of its first output."""
    sh = [ctx.shape[v.name] for v in op.inputs]
    out = ctx.shape[op.outputs[0].name]
    full = [ctx.fb[v.name] for v in op.inputs]
    name = op.opname
    if name == "linear":
        return [full[0], (obox[-1], (0, sh[1][1]))]
    if name == "mla_q_absorb":                      # obox [B, h0:h1, lora]
        h0, h1 = obox[1]
        per = op.attrs["nope"] + op.attrs["v_dim"]
        return [(full[0][0], (h0, h1), full[0][2]), ((h0 * per, h1 * per), full[1][1])]
    if name == "mla_v_up":                          # obox [B, h0*vd:h1*vd]
        vd, per = op.attrs["v_dim"], op.attrs["nope"] + op.attrs["v_dim"]
        h0, h1 = obox[-1][0] // vd, obox[-1][1] // vd
        return [(full[0][0], (h0, h1), full[0][2]), ((h0 * per, h1 * per), full[1][1])]
    if Trait.expert in op.opdef.traits:             # obox [b, k, rows]; weights of every expert
        b, k, rows = obox
        w = [(full[i][0], rows, full[i][2]) for i in range(2, len(sh))]
        # the input: tokens x [B, D] (gate/up), or one row per (token, slot) h [B, K, I] (down)
        x = (b, full[0][1]) if len(sh[0]) == 2 else (b, k, full[0][2])
        return [x, (b, full[1][1])] + w
    if name == "mla_attention_naive":               # obox [B, h*vd]
        vd, per = op.attrs["v_dim"], op.attrs["nope"] + op.attrs["v_dim"]
        h0, h1 = obox[-1][0] // vd, obox[-1][1] // vd
        return [(full[0][0], (h0, h1), full[0][2]), (full[1][0], (h0, h1), full[1][2]), full[2],
                ((h0 * per, h1 * per), full[3][1]), full[4]]
    if name == "mla_attention_partial":             # obox [c0:c1, B, H, lora+2]: cache chunk rows
        L, S = sh[2][1], op.attrs["chunks"]
        rows = (chunk_rows(L, S, obox[0][0])[0], chunk_rows(L, S, obox[0][1] - 1)[1])
        b = obox[1]                                 # the batch rows of q, the cache and pos
        return [(b,) + full[0][1:], (b,) + full[1][1:], (b, rows, full[2][2]), (b,)]
    if name == "moe_combine":                       # obox [b, c0:c1]: every slot's columns c0:c1
        return [(obox[0], full[0][1], obox[1]), (obox[0], full[1][1])]
    if name == "attention_combine":                 # obox [B, h0:h1, D]
        return [(full[0][0], full[0][1], obox[1], full[0][3])]
    if name == "cache_append":                      # writes row pos[b]; reads no cache row
        return [None, full[1], full[2]]
    if name == "mla_attention":                     # obox [B, h0:h1, lora]
        hb = obox[1]
        return [(full[0][0], hb, full[0][2]), (full[1][0], hb, full[1][2]), full[2], full[3]]
    if name == "attention":                         # obox [B, h0*D:h1*D]; kv heads of the group
        d, grp = op.attrs["head_dim"], op.attrs["heads"] // op.attrs["kv_heads"]
        h0, h1 = obox[-1][0] // d, obox[-1][1] // d
        kv = ((h0 // grp) * d, ((h1 - 1) // grp + 1) * d)
        return [obox, (full[1][0], full[1][1], kv), (full[2][0], full[2][1], kv), full[3]]
    if name == "kda_recurrent":                     # obox [B, h0*D:h1*D]
        d = op.attrs["head_dim"]
        h0, h1 = obox[-1][0] // d, obox[-1][1] // d
        return [obox] * 4 + [(obox[0], (h0, h1)), (obox[0], (h0, h1), full[5][2], full[5][3])]
    if name == "conv_update":
        return [obox, (obox[0], obox[1], full[1][2]), (obox[1], full[2][1], full[2][2])]
    if name == "embedding":
        return [(full[0][0], obox[-1]), full[1]]
    if name == "slice":                             # the same box, shifted along the sliced dim
        d = op.attrs["dim"] % len(out)
        st = op.attrs["start"]
        return [tuple((a + st, b + st) if i == d else (a, b) for i, (a, b) in enumerate(obox))]
    if Trait.tokenwise in op.opdef.traits:          # rows of obox: the same rows of batch-major inputs
        return [obox if tuple(s) == tuple(out) else
                f if not s or ctx.kind[v.name] is Kind.weight else ((obox[0],) + tuple(f[1:]))
                for v, s, f in zip(op.inputs, sh, full)]
    # elementwise-like: same-shape operands take the box; vectors along the last dim its range
    res = []
    for s, f in zip(sh, full):
        if tuple(s) == tuple(out):
            res.append(obox)
        elif len(s) == 1 and len(out) >= 1 and s[0] == out[-1] and Trait.whole_vectors not in op.opdef.traits:
            res.append((obox[-1],))
        else:
            res.append(f)
    return res


def out_boxes(ctx, op: Op, obox):
    """Boxes of every output given the box of the first (aliased state outputs included)."""
    res = [obox]
    for v in op.outputs[1:]:
        s = ctx.shape[v.name]
        if op.opname == "kda_recurrent":
            d = op.attrs["head_dim"]
            res.append((obox[0], (obox[-1][0] // d, obox[-1][1] // d), (0, s[2]), (0, s[3])))
        elif op.opname == "conv_update":
            res.append((obox[0], obox[1], (0, s[2])))
        elif tuple(s) == tuple(ctx.shape[op.outputs[0].name]):
            res.append(obox)
        else:
            res.append(full_box(s))
    return res
