"""A small convenience layer for writing model graphs in Python.

`b.op("linear", x, w, out_dtype="f32", name="logits")` appends one op and returns its result
(or a tuple of results); `b.scope("layers.3")` prefixes the names made inside it.
"""
from __future__ import annotations

import fnmatch

import contextlib

from .graph import Graph, Value
from .registry import get_op
from .types import DType, Kind, TensorType


class GraphBuilder:
    def __init__(self, name: str, dims=("B",)):
        self.g = Graph(name, dims)
        self._prefix: list[str] = []
        self._used: set[str] = set()

    def _name(self, n: str) -> str:
        return ".".join([*self._prefix, n])

    @contextlib.contextmanager
    def scope(self, prefix: str):
        self._prefix.append(prefix)
        try:
            yield
        finally:
            self._prefix.pop()

    def param(self, kind: Kind, name: str, shape, dtype: DType, *, absolute: bool = False) -> Value:
        return self.g.param(name if absolute else self._name(name), TensorType(tuple(shape), dtype, kind))

    def weight(self, name: str, shape, dtype: DType = DType.bf16) -> Value:
        """Weights are named by their checkpoint path, not by the builder scope."""
        return self.param(Kind.weight, name, shape, dtype, absolute=True)

    def state(self, name: str, shape, dtype: DType) -> Value:
        return self.param(Kind.state, name, shape, dtype, absolute=True)

    def io(self, name: str, shape, dtype: DType) -> Value:
        return self.param(Kind.io, name, shape, dtype, absolute=True)

    def op(self, opname: str, *inputs: Value, name: str | None = None, names=None, **attrs):
        """Append `opname(inputs){attrs}`; one result is returned bare, several as a tuple.

        Results are named `<scope>.<name>` (several results: `<scope>.<name>.<result>`); without a
        name the op's own name is used, made unique with a counter.
        """
        results = get_op(opname).results
        if names is None:
            base = self._unique(self._name(name or opname))
            names = [base] if len(results) == 1 else [f"{base}.{r}" for r in results]
        else:
            names = [self._name(n) for n in names]
        outs = self.g.add_op(opname, list(inputs), attrs, names=names)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _unique(self, base: str) -> str:
        if not self.g.has_value(base) and base not in self._used:
            self._used.add(base)
            return base
        i = 1
        while self.g.has_value(f"{base}.{i}") or f"{base}.{i}" in self._used:
            i += 1
        self._used.add(f"{base}.{i}")
        return f"{base}.{i}"

    def finish(self, outputs: list[Value], tp_roles: list[tuple[str, str]] = ()) -> Graph:
        """Set the outputs; `tp_roles` [(fnmatch pattern, role)]: each weight matching a pattern
        (first match wins) gets param attr `tp = role`, how the shard pass splits the linear that
        reads it ("col", "row", "vocab"; "rep" and unmatched weights stay whole). The model states it, the
        graph carries it (printed in .fir), no pass knows weight names."""
        self.g.set_outputs(outputs)
        for v in self.g.weights():
            role = next((r for pat, r in tp_roles if fnmatch.fnmatchcase(v.name, pat)), None)
            if role not in (None, "rep"):        # "rep": stated whole (stops a later pattern)
                self.g.param_attrs.setdefault(v.name, {})["tp"] = role
        return self.g
