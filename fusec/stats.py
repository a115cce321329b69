"""Figures of a graph for the compile summary: layers by kind, ops by kind, parameters,
active parameters and bytes read per decode step (all derived from the graph and the registry,
so a model file and its `.fir` give the same figures)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from fusec.ir.graph import Graph
from fusec.ir.registry import Trait
from fusec.ir.types import Kind

_LAYER = re.compile(r"^layers\.(\d+)\.")
# Ops that tell what a layer is (first match per role wins).
_MIXER = (("kda_recurrent", "KDA"), ("mla_attention", "MLA"), ("mla_attention_naive", "MLA"), ("attention", "attention"))
_FFN = (("moe_gate_up", "MoE"), ("situ_glu", "dense"), ("silu_mul", "dense"))


@dataclass(frozen=True)
class GraphStats:
    layers: dict[str, int]          # "KDA + MoE" -> count
    ops: dict[str, int]
    params: int
    active_params: float            # at batch 1: routed experts count top-k / E
    weight_bytes: float
    bytes_read: float               # per step at batch 1 and the given context
    weight_bytes_read: float
    state_bytes: float
    bytes_written: float = 0.0
    flops: float = 0.0
    by_kind: dict = None            # op name -> {"count", "bytes", "flops"}

    def roofline_us(self, spec) -> float:
        """Bytes moved per step over the GPU's HBM bandwidth (`fusec.passes.target.GpuSpec`)."""
        return (self.bytes_read + self.bytes_written) / spec.hbm_bw * 1e6


def _layer_of(op) -> int | None:
    for v in op.inputs:
        if v.kind is Kind.weight:
            m = _LAYER.match(v.name)
            if m:
                return int(m.group(1))
    return None


def _expert_fraction(graph: Graph, dims) -> dict[str, float]:
    """Weights addressed by router ids are read only in part: min(B*k, E) / E."""
    frac = {}
    for op in graph.ops:
        if Trait.gemv not in op.opdef.traits:
            continue
        for wi, ai in op.opdef.addressed_by.items():
            w, ids = op.inputs[wi], op.inputs[ai]
            e = w.type.concrete(dims)[0]
            b, k = ids.type.concrete(dims)
            frac[w.name] = min(e, b * k) / e
    return frac


def graph_stats(graph: Graph, dims: dict[str, int] | None = None) -> GraphStats:
    dims = {"B": 1, "L": 4096, **(dims or {})}
    per_layer: dict[int, set[str]] = {}
    layer_of_value: dict[str, int] = {}
    for op in graph.ops:
        # ops without weights (recurrences, attention) belong to the layer of their inputs
        li = _layer_of(op)
        if li is None:
            li = max((layer_of_value[v.name] for v in op.inputs if v.name in layer_of_value), default=None)
        for v in op.outputs:
            if li is not None:
                layer_of_value[v.name] = li
        if li is not None:
            per_layer.setdefault(li, set()).add(op.opname)
    layers = Counter()
    for li, names in per_layer.items():
        mixer = next((lab for n, lab in _MIXER if n in names), "?")
        ffn = next((lab for n, lab in _FFN if n in names), "?")
        layers[f"{mixer} + {ffn}"] += 1
    frac = _expert_fraction(graph, dims)
    params = active = wbytes = 0.0
    for w in graph.weights():
        n = w.type.numel(dims)
        params += n
        active += n * frac.get(w.name, 1.0)
        wbytes += w.type.nbytes(dims)
    read = wread = written = flops = 0.0
    by_kind: dict[str, dict[str, float]] = {}
    for op in graph.ops:
        c = op.opdef.cost([v.type for v in op.inputs], [v.type for v in op.outputs], op.attrs, dims)
        read += c.bytes_read
        written += c.bytes_written
        flops += c.flops
        k = by_kind.setdefault(op.opname, {"count": 0, "bytes": 0.0, "flops": 0.0})
        k["count"] += 1
        k["bytes"] += c.bytes_read + c.bytes_written
        k["flops"] += c.flops
    # weight bytes actually streamed: every weight once, experts by fraction, tables by row
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            if v.kind is Kind.weight and Trait.gemv in op.opdef.traits:
                wread += v.type.nbytes(dims) * frac.get(v.name, 1.0)
    state = sum(v.type.nbytes(dims) for v in graph.states())
    return GraphStats(dict(sorted(layers.items())), dict(sorted(Counter(o.opname for o in graph.ops).items())),
                      int(params), active, wbytes, read, wread, state, written, flops, dict(sorted(by_kind.items())))


def _count(n: float) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def format_summary(graph: Graph, st: GraphStats, st_batch: GraphStats, batch: int, context: int) -> str:
    """`st` at batch 1 (parameters a token activates), `st_batch` at the batch compiled for (what a
    step reads: more sequences route to more experts); each figure names the batch it is for."""
    lines = [f"graph {graph.name}: {len(graph.ops)} ops, {len(graph.weights())} weights, "
             f"{len(graph.states())} state tensors",
             "layers: " + ", ".join(f"{n} x {k}" for k, n in st.layers.items()),
             "ops: " + ", ".join(f"{k} {n}" for k, n in st.ops.items()),
             f"parameters: {_count(st.params)} ({_bytes(st.weight_bytes)} of weights)",
             f"active parameters per token (batch 1): {_count(st.active_params)}",
             f"bytes read per decode step (batch {batch}, context {context}): {_bytes(st_batch.bytes_read)} "
             f"(weights {_bytes(st_batch.weight_bytes_read)})"]
    return "\n".join(lines)
