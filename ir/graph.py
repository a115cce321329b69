"""The graph: SSA values, ops in program order, declared parameters, outputs, state updates.

Parameters are the values that exist before the step runs: weights, persistent state and
io inputs. Ops only create new values. A state parameter is updated by an op whose registry
entry says an output aliases it (`OpDef.aliases`); `Graph.updates` records the final value of
each state, which the executor writes back and the next step reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .types import Kind, TensorType


class Value:
    """One SSA tensor value; `producer` is None for graph parameters."""

    __slots__ = ("name", "type", "producer")

    def __init__(self, name: str, type: TensorType, producer: "Op | None" = None):
        self.name = name
        self.type = type
        self.producer = producer

    @property
    def kind(self) -> Kind:
        return self.type.kind

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass
class Op:
    opname: str
    inputs: list[Value]
    outputs: list[Value] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    # Fusion group: ops sharing a group run as one task body (printed `@group`); None = alone.
    group: str | None = None

    @property
    def opdef(self):
        from .registry import get_op
        return get_op(self.opname)

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join(f"%{v.name}" for v in self.inputs)
        return f"{outs} = {self.opname}({ins}) {self.attrs}"


class GraphError(ValueError):
    """A structural error in a graph (raised by construction and by the IR verifier)."""


class Graph:
    def __init__(self, name: str, dims: tuple[str, ...] = ("B",)):
        self.name = name
        self.dims: tuple[str, ...] = tuple(dims)
        self.params: list[Value] = []
        self.ops: list[Op] = []
        self.outputs: list[Value] = []
        self.updates: dict[str, Value] = {}  # state parameter name -> value holding its new content
        # Optional per-parameter annotations, printed after the param's type (`{split = [0], ranks = 2}`):
        # how a loader builds this parameter from the full checkpoint (sources, per-rank slicing).
        # Their meaning is documented in docs/passes.md (fusec.backends.reference.ranks applies them).
        self.param_attrs: dict[str, dict[str, Any]] = {}
        self._names: dict[str, Value] = {}

    # -- construction -------------------------------------------------------------------------
    def _claim(self, name: str, v: Value) -> None:
        if name in self._names:
            raise GraphError(f"value %{name} is defined twice")
        self._names[name] = v

    def param(self, name: str, type: TensorType) -> Value:
        if type.kind not in (Kind.weight, Kind.state, Kind.io, Kind.comm):
            raise GraphError(f"parameter %{name} must be weight, state, io or comm, not {type.kind.value}")
        v = Value(name, type)
        self._claim(name, v)
        self.params.append(v)
        return v

    def add_op(self, opname: str, inputs: list[Value], attrs: dict[str, Any] | None = None,
               names: list[str] | None = None, types: list[TensorType] | None = None,
               group: str | None = None) -> list[Value]:
        """Append an op; output types come from the registry's shape rule unless given."""
        from .registry import get_op
        opdef = get_op(opname)
        opdef.check_arity(len(inputs))
        attrs = opdef.normalize_attrs(dict(attrs or {}))
        inferred = opdef.infer([v.type for v in inputs], attrs)
        if types is not None and list(types) != list(inferred):
            raise GraphError(
                f"{opname}: declared result types {', '.join(map(str, types))} "
                f"but the op gives {', '.join(map(str, inferred))}")
        if names is None:
            names = [self.fresh(opname) for _ in inferred]
        if len(names) != len(inferred):
            raise GraphError(f"{opname} has {len(inferred)} results, {len(names)} names given")
        op = Op(opname, list(inputs), [], attrs, group)
        for n, t in zip(names, inferred):
            v = Value(n, t, op)
            self._claim(n, v)
            op.outputs.append(v)
        self.ops.append(op)
        return op.outputs

    def fresh(self, hint: str) -> str:
        i = len(self._names)
        while f"{hint}.{i}" in self._names:
            i += 1
        return f"{hint}.{i}"

    def set_outputs(self, values: list[Value]) -> None:
        self.outputs = list(values)

    def update(self, state: Value, new: Value) -> None:
        if state.kind is not Kind.state or state.producer is not None:
            raise GraphError(f"update target %{state.name} is not a state parameter")
        if state.name in self.updates:
            raise GraphError(f"state %{state.name} is updated twice")
        self.updates[state.name] = new

    # -- queries ------------------------------------------------------------------------------
    def value(self, name: str) -> Value:
        return self._names[name]

    def has_value(self, name: str) -> bool:
        return name in self._names

    def values(self) -> Iterator[Value]:
        yield from self.params
        for op in self.ops:
            yield from op.outputs

    def weights(self) -> list[Value]:
        return [v for v in self.params if v.kind is Kind.weight]

    def states(self) -> list[Value]:
        return [v for v in self.params if v.kind is Kind.state]

    def inputs(self) -> list[Value]:
        return [v for v in self.params if v.kind is Kind.io]

    def users(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {v.name: [] for v in self.values()}
        for op in self.ops:
            for v in op.inputs:
                out[v.name].append(op)
        return out

    def rebuild_index(self) -> None:
        """Recompute the name table after a pass edited `ops` in place."""
        self._names = {}
        for v in self.params:
            self._claim(v.name, v)
        for op in self.ops:
            for v in op.outputs:
                v.producer = op
                self._claim(v.name, v)

    def copy(self) -> "Graph":
        """A deep structural copy (values are new objects; attrs are shallow-copied)."""
        g = Graph(self.name, self.dims)
        m: dict[str, Value] = {}
        for v in self.params:
            m[v.name] = g.param(v.name, v.type)
        for op in self.ops:
            new = Op(op.opname, [m[v.name] for v in op.inputs], [], dict(op.attrs), op.group)
            for v in op.outputs:
                nv = Value(v.name, v.type, new)
                g._claim(v.name, nv)
                new.outputs.append(nv)
                m[v.name] = nv
            g.ops.append(new)
        g.outputs = [m[v.name] for v in self.outputs]
        g.updates = {k: m[v.name] for k, v in self.updates.items()}
        g.param_attrs = {k: dict(v) for k, v in self.param_attrs.items()}
        return g
