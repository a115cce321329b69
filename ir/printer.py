"""Canonical `.fir` printer. Printing is deterministic: parse(print(g)) prints identically."""
from __future__ import annotations

import json

from .graph import Graph
from .registry import get_op
from .types import TensorType


def format_type(t: TensorType) -> str:
    return f"{t.dtype.value}[{', '.join(str(d) for d in t.shape)}]"


def format_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        r = repr(v)
        return r if any(c in r for c in ".eEn") else r + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(x if isinstance(x, str) else format_value(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def format_attrs(opname: str, attrs: dict) -> str:
    spec = get_op(opname).attrs
    items = [f"{k} = {format_value(v)}" for k, v in attrs.items() if spec[k].default != v]
    return (" {" + ", ".join(items) + "}") if items else ""


def print_graph(g: Graph) -> str:
    lines = [f"graph {g.name} ({', '.join(g.dims)}) {{"]
    for v in g.params:
        pa = g.param_attrs.get(v.name)
        ann = (" {" + ", ".join(f"{k} = {format_value(x)}" for k, x in pa.items()) + "}") if pa else ""
        lines.append(f"  {v.kind.value} %{v.name} : {format_type(v.type)}{ann}")
    for op in g.ops:
        res = ", ".join(f"%{v.name} : {format_type(v.type)}" for v in op.outputs)
        args = ", ".join(f"%{v.name}" for v in op.inputs)
        grp = f" @{op.group}" if op.group else ""
        lines.append(f"  {res} = {op.opname}({args}){format_attrs(op.opname, op.attrs)}{grp}")
    for name, v in g.updates.items():
        lines.append(f"  update %{name} = %{v.name}")
    lines.append("  return " + ", ".join(f"%{v.name}" for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
