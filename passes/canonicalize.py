"""canonicalize: put the decode graph into the form the later passes expect.

Two rewrites, both exact in fp32 (checked by tests/test_passes_graph.py), both read off the op
registry (no op names here):

(a) Op rewrites. An op whose registry entry has a `rewrite` (`OpDef.rewrite`) is replaced by the
    ops it returns. Today that is MLA weight absorption: `mla_attention_naive(q_nope, q_pe,
    cache, kv_b, pos)` decompresses every cached latent row into per-head keys and values; at
    decode that reads the whole cache through kv_b. The absorbed form moves kv_b onto the one
    new query instead: `mla_q_absorb(q_nope, kv_b) -> mla_attention(q_lat, q_pe, cache, pos) ->
    mla_v_up(o_lat, kv_b)` (ir/ops/mixers.py).

(b) Merged projections. Ops of trait `mergeable` (`linear`) that read the same input with
    weights of the same dtype (so the same K) become one such op over a concatenated weight
    followed by one `slice` per original output (plus a `cast` where the original output dtype
    was narrower than the merged one). The
    merged weight is a new weight *parameter* annotated `{sources = [...]}`: a loader builds it by
    concatenating the named checkpoint tensors along dim 0 (fusec.backends.reference.ranks
    .materialize_weights). So the graph keeps reading only parameters -- the merged weight is
    prefetchable like any weight -- and checkpoint semantics are unchanged: the fold happens at
    load time, not in the step. Why a real merged linear rather than a fusion group of separate
    linears: the tile pass then sees one GEMV with one tiling (small projections such as KDA's
    b_proj 7168 -> 96 or MLA's kv_a 7168 -> 576 stop being tiny under-filled GEMVs), and the
    reference stays exact (concatenating bf16 weights is exact; each output element is the same
    dot product).

Requires: a verified graph; weight parameters without `sources`/`split` annotations (i.e. before
          shard).
Ensures:  no op with a `rewrite` remains; no two `mergeable` ops of one kind with float weights
          of one dtype read the same value unless refused (refusals are logged on
          FUSEC_LOG=fusion); the set of graph outputs and state updates is unchanged and, for
          the same checkpoint, so are their values.
"""
from __future__ import annotations

from .options import log
from fusec.ir.graph import Graph, Op, Value
from fusec.ir.registry import Trait
from fusec.ir.types import DType, Kind
from fusec.passes.manager import Program, register_pass

# Projections over these weight dtypes are not merged: MXFP4 weights carry per-row block scales
# and are expert weights in K3 (never several dense linears over one input).
_MERGEABLE = (DType.bf16, DType.f16, DType.f32, DType.fp8e4m3)
# Wider output dtype wins; narrower outputs get a cast after their slice (exact: the reference
# rounds the same fp32 accumulator once either way).
_WIDTH = {DType.f32: 3, DType.bf16: 2, DType.f16: 2}


@register_pass("canonicalize")
def run(prog: Program) -> bool:
    g = prog.graph
    changed = _rewrite_ops(prog, g)
    changed |= _merge_projections(prog, g)
    if changed:
        _drop_unused_weights(g)
        g.rebuild_index()
    return changed


# -- (a) op rewrites (OpDef.rewrite) ------------------------------------------------------------
def _rewrite_ops(prog: Program, g: Graph) -> bool:
    new_ops: list[Op] = []
    changed = False
    for op in g.ops:
        rewrite = op.opdef.rewrite
        if rewrite is None:
            new_ops.append(op)
            continue
        out = op.outputs[0]
        # the new ops join the op's fusion group (none before fuse)
        made = rewrite(op, lambda opname, inputs, attrs, name: _make(g, opname, inputs, attrs, name, op.group))
        again = [o.opname for o in made if o.opdef.rewrite is not None]
        if again:
            raise ValueError(f"canonicalize: the rewrite of {op.opname} made {', '.join(again)}, "
                             "which have rewrites themselves")
        _rename_into(made[-1], out)
        new_ops += made
        log(prog.opts, "fusion", f"canonicalize: rewrote {op.opname} %{out.name} into "
            f"{' -> '.join(o.opname for o in made)}")
        changed = True
    g.ops = new_ops
    return changed


# -- (b) merged projections -----------------------------------------------------------------------
def _merge_projections(prog: Program, g: Graph) -> bool:
    users = g.users()
    # siblings: one op kind, one input, the same attributes besides the output dtype
    by_input: dict[tuple, list[Op]] = {}
    for op in g.ops:
        if Trait.mergeable in op.opdef.traits:
            rest = tuple((k, v) for k, v in op.attrs.items() if k != "out_dtype")
            by_input.setdefault((op.opname, op.inputs[0].name, rest), []).append(op)
    changed = False
    for lins in by_input.values():
        if len(lins) < 2:
            continue
        ok = [op for op in lins if _mergeable(prog, g, op, users)]
        # one merge per weight dtype (K is the input width, so it is equal already)
        for dt in sorted({op.inputs[1].type.dtype for op in ok}, key=lambda d: d.value):
            group = [op for op in ok if op.inputs[1].type.dtype is dt]
            if len(group) < 2:
                continue
            _merge(prog, g, group)
            changed = True
    return changed


def _mergeable(prog: Program, g: Graph, op: Op, users) -> bool:
    w, y = op.inputs[1], op.outputs[0]
    why = None
    if w.producer is not None or w.kind is not Kind.weight:
        why = "its weight is not a weight parameter"
    elif w.type.dtype not in _MERGEABLE:
        why = f"{w.type.dtype.value} weights are not merged"
    elif len(users[w.name]) != 1:
        why = "its weight is read by another op too"
    elif {"sources", "split"} & set(g.param_attrs.get(w.name, {})):
        why = "its weight is already derived or sharded (merge before shard)"
    elif y.type.dtype not in _WIDTH:
        why = f"output dtype {y.type.dtype.value} is not merged"
    if why:
        log(prog.opts, "fusion", f"canonicalize: not merging {op.opname} %{y.name}: {why}")
        return False
    return True


def _merge(prog: Program, g: Graph, lins: list[Op]) -> None:
    x = lins[0].inputs[0]
    weights = [op.inputs[1] for op in lins]
    out_dt = max((op.outputs[0].type.dtype for op in lins), key=lambda d: _WIDTH[d])
    n_total = sum(w.type.shape[0] for w in weights)
    k = weights[0].type.shape[1]
    wname = _unique(g, _common_prefix([w.name for w in weights]) + "merged_proj.weight")
    mw = g.param(wname, weights[0].type.with_shape((n_total, k)))
    g.params.remove(mw)                               # declare it where its first source was
    g.params.insert(g.params.index(weights[0]), mw)
    g.param_attrs[wname] = {"sources": tuple(w.name for w in weights)}
    roles = tuple(g.param_attrs.get(w.name, {}).get("tp", "rep") for w in weights)
    if any(r != "rep" for r in roles):   # the sources' tensor-parallel roles, for the shard pass
        g.param_attrs[wname]["source_tp"] = roles
    scope = lins[0].outputs[0].name.rsplit(".", 1)[0] if "." in lins[0].outputs[0].name else ""
    yname = _unique(g, (scope + "." if scope else "") + "merged_" + lins[0].outputs[0].name.rsplit(".", 1)[-1])
    merged = _make(g, lins[0].opname, [x, mw], {**lins[0].attrs, "out_dtype": out_dt.value}, yname, None)
    inserted = [merged]
    start = 0
    for op, w in zip(lins, weights):
        y = op.outputs[0]
        end = start + w.type.shape[0]
        sl = _make(g, "slice", [merged.outputs[0]], {"dim": -1, "start": start, "end": end}, None, None)
        if y.type.dtype is out_dt:
            _rename_into(sl, y)
            inserted.append(sl)
        else:
            sl.outputs[0].name = _unique(g, y.name + ".wide")
            g._claim(sl.outputs[0].name, sl.outputs[0])
            cast = _make(g, "cast", [sl.outputs[0]], {"out_dtype": y.type.dtype.value}, None, None)
            _rename_into(cast, y)
            inserted += [sl, cast]
        start = end
    first = g.ops.index(lins[0])
    drop = {id(op) for op in lins}
    rest = [op for op in g.ops if id(op) not in drop]
    at = sum(1 for op in g.ops[:first] if id(op) not in drop)
    g.ops = rest[:at] + inserted + rest[at:]
    log(prog.opts, "fusion", f"canonicalize: merged {len(lins)} {lins[0].opname}s over %{x.name} "
        f"({', '.join('%' + op.outputs[0].name for op in lins)}) into %{merged.outputs[0].name} [{n_total}, {k}]")


# -- helpers --------------------------------------------------------------------------------------
def _make(g: Graph, opname: str, inputs: list[Value], attrs: dict, name: str | None, group) -> Op:
    """A new op whose result types come from the registry; not yet placed in g.ops."""
    from fusec.ir.registry import get_op
    opdef = get_op(opname)
    attrs = opdef.normalize_attrs(attrs)
    types = opdef.infer([v.type for v in inputs], attrs)
    op = Op(opname, list(inputs), [], attrs, group)
    for i, t in enumerate(types):
        if name is None:
            vname = None
        else:
            vname = _unique(g, name if len(types) == 1 else f"{name}.{i}")
            g._claim(vname, None)   # reserve; rebuild_index() fixes the table at the end
        op.outputs.append(Value(vname, t, op))
    return op


def _rename_into(op: Op, old: Value) -> None:
    """Make `op` produce the existing value `old` (same name, so every user keeps reading it)."""
    new = op.outputs[0]
    if new.type != old.type:
        raise ValueError(f"canonicalize: {op.opname} gives {new.type}, but %{old.name} is {old.type}")
    old.producer = op
    op.outputs[0] = old


def _unique(g: Graph, base: str) -> str:
    if not g.has_value(base):
        return base
    i = 1
    while g.has_value(f"{base}.{i}"):
        i += 1
    return f"{base}.{i}"


def _common_prefix(names: list[str]) -> str:
    """The longest common dotted prefix, ending in '.' (or '')."""
    parts = [n.split(".") for n in names]
    out = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        out.append(segs[0])
    out = out[: min(len(p) for p in parts) - 1]
    return ".".join(out) + "." if out else ""


def _drop_unused_weights(g: Graph) -> None:
    used = {v.name for op in g.ops for v in op.inputs}
    g.params = [v for v in g.params if v.kind is not Kind.weight or v.name in used]
