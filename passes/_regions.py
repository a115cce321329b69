"""Exact regions per op: the box of each input an output tile needs, and the boxes of every
output given the first one's. An op with its own rule states it in its registry entry
(`OpDef.regions`, `OpDef.state_box`); the rules here are the generic ones, by trait. Used by the `tile` pass's lowering (`_lowering.py`) and the
verifier's derivation (`_derive.py`); `ctx` is either's context (shapes `ctx.shape`, full boxes
`ctx.fb`, kinds `ctx.kind`, all by value name).

Each op's rule is built once per context (`input_rule`, `out_rule`): what does not depend on
the tile (shapes, full boxes, attrs, which case applies) is read then, and the returned function
only computes the boxes of one tile. A full K3 lowers ~2 * 10^5 (op, tile) pairs, and the
verifier derives them all again. `input_boxes` / `out_boxes` are the same rules called once.
"""
from __future__ import annotations

from fusec.ir.graph import Op
from fusec.ir.registry import Trait
from fusec.ir.types import Kind


def full_box(shape) -> tuple[tuple[int, int], ...]:
    return tuple((0, int(d)) for d in shape)



def box_hull(old, bx):
    """The smallest box holding both (old may be None): one LOAD per value a tile reads, covering
    every box its ops read of it."""
    if old is None or old == bx:
        return bx
    return tuple((min(a0, b0), max(a1, b1)) for (a0, a1), (b0, b1) in zip(old, bx))


def _rules(ctx) -> dict:
    got = getattr(ctx, "_region_rules", None)
    if got is None:
        got = ctx._region_rules = {}
    return got


def input_rule(ctx, op: Op):
    """f(obox) -> boxes of `op`'s inputs needed to compute `obox` of its first output (None for
    an input it does not read), built once per (ctx, op)."""
    memo = _rules(ctx)
    hit = memo.get(("in", id(op)))
    if hit is None:
        hit = memo[("in", id(op))] = (op, _input_rule(ctx, op))    # the op kept: its id stays its own
    return hit[1]


def out_rule(ctx, op: Op):
    """f(obox) -> boxes of every output of `op` given the box of the first (aliased state
    outputs included), built once per (ctx, op)."""
    memo = _rules(ctx)
    hit = memo.get(("out", id(op)))
    if hit is None:
        hit = memo[("out", id(op))] = (op, _out_rule(ctx, op))
    return hit[1]


def input_boxes(ctx, op: Op, obox, anchor: bool = False):
    """Boxes of `op`'s inputs needed to compute `obox` of its first output."""
    return input_rule(ctx, op)(obox)


def out_boxes(ctx, op: Op, obox):
    """Boxes of every output given the box of the first (aliased state outputs included)."""
    return out_rule(ctx, op)(obox)


def _input_rule(ctx, op: Op):
    # Reads in the order the rules always did, so a malformed op fails with the same error.
    sh = [ctx.shape[v.name] for v in op.inputs]
    out = ctx.shape[op.outputs[0].name]
    full = [ctx.fb[v.name] for v in op.inputs]
    if op.opdef.regions is not None:                # the op's own rule (its registry entry)
        return op.opdef.regions(op.attrs, sh, out, full)
    if Trait.expert in op.opdef.traits:             # obox [b, k, rows]; weights of every expert
        n, two_d = len(sh), len(sh[0]) == 2

        def expert(obox):
            b, k, rows = obox
            w = [(full[i][0], rows, full[i][2]) for i in range(2, n)]
            # the input: tokens x [B, D] (gate/up), or one row per (token, slot) h [B, K, I] (down)
            x = (b, full[0][1]) if two_d else (b, k, full[0][2])
            return [x, (b, full[1][1])] + w
        return expert
    same = [tuple(s) == tuple(out) for s in sh]
    if Trait.tokenwise in op.opdef.traits:          # rows of obox: the same rows of batch-major inputs
        # per input: the tile's box, the whole value, or the tile's rows of it
        mode = [(0, None) if eq else (1, f) if not s or ctx.kind[v.name] is Kind.weight else (2, tuple(f[1:]))
                for v, s, f, eq in zip(op.inputs, sh, full, same)]
        return lambda obox: [obox if m == 0 else f if m == 1 else (obox[0],) + f for m, f in mode]
    # elementwise-like: same-shape operands take the box; vectors along the last dim its range
    whole = Trait.whole_vectors in op.opdef.traits
    mode = [(0, None) if eq else
            (1, None) if len(s) == 1 and len(out) >= 1 and s[0] == out[-1] and not whole else (2, f)
            for s, f, eq in zip(sh, full, same)]
    return lambda obox: [obox if m == 0 else (obox[-1],) if m == 1 else f for m, f in mode]


def _out_rule(ctx, op: Op):
    if len(op.outputs) == 1:
        return lambda obox: [obox]
    rest = []               # per further output: (kind of rule, its shape)
    for v in op.outputs[1:]:
        s = ctx.shape[v.name]
        if op.opdef.state_box is not None:     # the op's own rule (its registry entry)
            rest.append((0, s, op.opdef.state_box))
        elif tuple(s) == tuple(ctx.shape[op.outputs[0].name]):
            rest.append((2, s, None))
        else:
            rest.append((3, full_box(s), None))

    def rule(obox):
        res = [obox]
        for m, s, d in rest:
            if m == 0:
                res.append(d(obox, s, op.attrs))
            elif m == 2:
                res.append(obox)
            else:
                res.append(s)
        return res
    return rule
