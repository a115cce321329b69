"""Run a graph's decode step in torch: the semantic oracle for every pass and backend.

Each op runs its registry reference (`OpDef.ref`, fp32 math) and the result is stored in the
value's dtype (bf16 stays bf16 unless `precision="fp32"`, which stores every float as fp32).
State updates are written back after the step, so the next step reads them.
"""
from __future__ import annotations

from typing import Mapping

import torch

from fusec.ir.graph import Graph
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import DType, Kind, TensorType

_TORCH = {DType.bf16: torch.bfloat16, DType.f16: torch.float16, DType.f32: torch.float32,
          DType.i32: torch.int32, DType.i64: torch.int64, DType.u8: torch.uint8}


class ExecError(RuntimeError):
    """A graph could not be executed with the given weights, state or inputs."""


def torch_dtype(dt: DType, precision: str = "bf16") -> torch.dtype:
    if precision == "fp32" and dt.is_float and dt is not DType.mxfp4:
        return torch.float32
    if dt not in _TORCH:
        raise ExecError(f"no torch storage dtype for {dt.value}")
    return _TORCH[dt]


def store(t: torch.Tensor, ty: TensorType, precision: str) -> torch.Tensor:
    return t.to(torch_dtype(ty.dtype, precision))


def init_state(graph: Graph, dims: Mapping[str, int], device="cpu", precision: str = "bf16") -> dict:
    """Zero state for every state parameter (fresh sequences)."""
    return {v.name: torch.zeros(v.type.concrete(dims), dtype=torch_dtype(v.type.dtype, precision), device=device)
            for v in graph.states()}


def prepare_weights(graph: Graph, weights: Mapping, precision: str = "bf16", device=None) -> dict:
    """Check every weight is present with the declared shape; cast floats for `precision`."""
    out = {}
    for v in graph.weights():
        if v.name not in weights:
            raise ExecError(f"missing weight {v.name}")
        w = weights[v.name]
        shape = v.type.concrete({})
        if tuple(w.shape) != shape:
            raise ExecError(f"weight {v.name} has shape {tuple(w.shape)}, expected {list(shape)}")
        if isinstance(w, MXFP4Tensor):
            out[v.name] = w.to(device) if device is not None else w
        else:
            w = w.to(device) if device is not None else w
            out[v.name] = w.to(torch_dtype(v.type.dtype, precision))
    return out


def execute(graph: Graph, weights: Mapping, state: Mapping, inputs: Mapping[str, torch.Tensor],
            dims: Mapping[str, int], precision: str = "bf16", hook=None) -> dict[str, object]:
    """Evaluate every op; returns the environment of all values by name. Nothing is mutated.

    `hook(op, inputs, outputs) -> outputs`, if given, sees (and may replace) each op's results,
    e.g. to follow another executor's expert choices at router near-ties (fusec/debug/bisect.py)."""
    env: dict[str, object] = {}
    for v in graph.params:
        if v.kind is Kind.weight:
            env[v.name] = weights[v.name]
        elif v.kind is Kind.state:
            env[v.name] = state[v.name]
        elif v.kind is Kind.io:
            if v.name not in inputs:
                raise ExecError(f"missing input {v.name}")
            t = inputs[v.name]
            if tuple(t.shape) != v.type.concrete(dims):
                raise ExecError(f"input {v.name} has shape {tuple(t.shape)}, expected {list(v.type.concrete(dims))}")
            env[v.name] = t.to(torch_dtype(v.type.dtype, precision))
    for op in graph.ops:
        ins = [env[v.name] for v in op.inputs]
        outs = op.opdef.ref(ins, op.attrs)
        if hook is not None:
            outs = hook(op, ins, outs)
        for v, t in zip(op.outputs, outs):
            env[v.name] = store(t, v.type, precision)
    return env


def run_step(graph: Graph, weights: Mapping, state: dict, inputs: Mapping[str, torch.Tensor],
             dims: Mapping[str, int], precision: str = "bf16", hook=None, env_out: dict | None = None
             ) -> list[torch.Tensor]:
    """One decode step. Mutates `state` to the post-step values; returns the graph outputs.
    `env_out`, if given, receives every value of the step by name (see `first_nonfinite_op`)."""
    env = execute(graph, weights, state, inputs, dims, precision, hook)
    if env_out is not None:
        env_out.update(env)
    for name, v in graph.updates.items():
        state[name] = env[v.name]
    return [env[v.name] for v in graph.outputs]


def first_nonfinite_op(graph: Graph, env: Mapping[str, object]):
    """(op, value name) of the first op, in graph order, whose result holds NaN or Inf in `env`
    (as `execute` returns it), or None. Inputs that were already non-finite (a poisoned weight or
    state) show up as the first op that reads them."""
    for op in graph.ops:
        for v in op.outputs:
            t = env.get(v.name)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return op, v.name
    return None
