"""Shared helpers for op definitions: operand checks and float upcasting for reference math."""
from __future__ import annotations

from .._lazy import LazyModule
from ..quant import MXFP4Tensor
from ..registry import OpError
from ..types import DType, TensorType

torch = LazyModule("torch")   # imported at the first reference call (ir/_lazy.py)


def f32(t) -> torch.Tensor:
    """Any run-time operand as fp32 (MXFP4 weights are dequantised)."""
    if isinstance(t, MXFP4Tensor):
        return t.dequant(torch.float32)
    return t.to(torch.float32)


def need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise OpError(f"{op}: {msg}")


def need_rank(t: TensorType, r: int, op: str, what: str) -> None:
    need(t.rank == r, op, f"{what} must have rank {r}, got {t}")


def need_dtype(t: TensorType, dtypes, op: str, what: str) -> None:
    dtypes = (dtypes,) if isinstance(dtypes, DType) else tuple(dtypes)
    need(t.dtype in dtypes, op, f"{what} must be {'/'.join(d.value for d in dtypes)}, got {t}")


def need_dim(a, b, op: str, what: str) -> None:
    need(a == b, op, f"{what}: {a} != {b}")


def dtype_attr(op: str, s: str) -> DType:
    try:
        return DType(s)
    except ValueError:
        raise OpError(f"{op}: unknown dtype '{s}'") from None
