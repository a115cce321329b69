"""The IR verifier: SSA, shapes and dtypes (re-derived from the registry), kinds, state updates.

`verify_graph` raises `GraphError` with one line naming the value or op and the broken rule.
It runs after every pass (the pass manager names the pass that broke it).
"""
from __future__ import annotations

from .graph import Graph, GraphError
from .registry import OpError, get_op
from .types import Kind


def verify_graph(g: Graph) -> None:
    defined: dict[str, object] = {}
    for v in g.params:
        if v.name in defined:
            raise GraphError(f"SSA: %{v.name} defined twice")
        if v.kind is Kind.act:
            raise GraphError(f"kinds: parameter %{v.name} cannot be an act")
        for d in v.type.shape:
            if isinstance(d, str) and d not in g.dims:
                raise GraphError(f"shape: %{v.name} uses undeclared dim {d}")
        defined[v.name] = v
    written_states: dict[str, str] = {}   # state parameter -> op that updates it in place
    alias_root: dict[str, str] = {v.name: v.name for v in g.states()}
    for op in g.ops:
        where = f"op {op.opname} -> %{op.outputs[0].name}" if op.outputs else f"op {op.opname}"
        try:
            opdef = get_op(op.opname)
            opdef.check_arity(len(op.inputs))
            attrs = opdef.normalize_attrs(dict(op.attrs))
        except OpError as e:
            raise GraphError(f"{where}: {e}") from None
        for v in op.inputs:
            if defined.get(v.name) is not v:
                raise GraphError(f"SSA: {where} uses %{v.name} before it is defined")
        try:
            types = opdef.infer([v.type for v in op.inputs], attrs)
        except OpError as e:
            raise GraphError(f"{where}: {e}") from None
        if len(types) != len(op.outputs):
            raise GraphError(f"{where}: has {len(op.outputs)} results, the op gives {len(types)}")
        for v, t in zip(op.outputs, types):
            if v.type != t:
                raise GraphError(f"types: {where}: %{v.name} is {v.type} ({v.kind.value}) but the op gives {t} ({t.kind.value})")
            if v.name in defined:
                raise GraphError(f"SSA: %{v.name} defined twice")
            defined[v.name] = v
        for ri, oi in opdef.aliases.items():
            src = op.inputs[oi]
            root = alias_root.get(src.name)
            if root is None:
                raise GraphError(f"state: {where} updates %{src.name} in place, which is not a state")
            if root in written_states:
                raise GraphError(f"state: %{root} is updated in place twice ({written_states[root]} and {where})")
            written_states[root] = where
            alias_root[op.outputs[ri].name] = root
    for name, v in g.updates.items():
        st = defined.get(name)
        if st is None or getattr(st, "kind", None) is not Kind.state or st.producer is not None:
            raise GraphError(f"state: update of %{name}, which is not a state parameter")
        if defined.get(v.name) is not v:
            raise GraphError(f"state: update of %{name} with undefined %{v.name}")
        if (v.type.shape, v.type.dtype) != (st.type.shape, st.type.dtype):
            raise GraphError(f"state: update of %{name} ({st.type}) with %{v.name} of type {v.type}")
    for root, where in written_states.items():
        upd = g.updates.get(root)
        if upd is None or alias_root.get(upd.name) != root:
            raise GraphError(f"state: %{root} is updated in place by {where} but the graph's update does not record it")
    if not g.outputs:
        raise GraphError("graph has no outputs")
    for v in g.outputs:
        if defined.get(v.name) is not v:
            raise GraphError(f"SSA: output %{v.name} is not defined")
