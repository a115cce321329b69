"""Tensor types of the IR: dtype, kind and a shape of ints and named symbolic dims.

Symbolic dims are names such as `B` (batch) and `L` (cache capacity); they are bound to ints
when a graph is executed or costed (`TensorType.concrete`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Union

Dim = Union[int, str]


class DType(enum.Enum):
    """Element types. `mxfp4` is e2m1 values with one e8m0 scale per 32 along the last dim."""

    bf16 = "bf16"
    f16 = "f16"
    f32 = "f32"
    fp8e4m3 = "fp8e4m3"
    mxfp4 = "mxfp4"
    i32 = "i32"
    i64 = "i64"
    u8 = "u8"

    @property
    def bits(self) -> float:
        """Storage bits per element, scales included (mxfp4: 4 + 8/32)."""
        return {"bf16": 16, "f16": 16, "f32": 32, "fp8e4m3": 8, "mxfp4": 4.25,
                "i32": 32, "i64": 64, "u8": 8}[self.value]

    @property
    def is_float(self) -> bool:
        return self not in (DType.i32, DType.i64, DType.u8)


class Kind(enum.Enum):
    """What a tensor is for; decides what may be prefetched, persisted or written by peers."""

    weight = "weight"  # immutable for the model's life: the only kind prefetchable across a wait
    state = "state"    # persists across steps, updated in place (KV cache, KDA state)
    act = "act"        # produced and consumed inside one step
    io = "io"          # step inputs and outputs
    comm = "comm"      # symmetric buffers that peer GPUs write


MXFP4_GROUP = 32


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: DType
    kind: Kind = Kind.act

    def __post_init__(self):
        for d in self.shape:
            if not (isinstance(d, str) or (isinstance(d, int) and d >= 0)):
                raise ValueError(f"bad dim {d!r} in shape {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_kind(self, kind: Kind) -> "TensorType":
        return TensorType(self.shape, self.dtype, kind)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype, self.kind)

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(self.shape, dtype, self.kind)

    def concrete(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with symbolic dims bound; an unbound name is an error."""
        out = []
        for d in self.shape:
            if isinstance(d, str):
                if d not in dims:
                    raise KeyError(f"symbolic dim {d!r} is not bound")
                out.append(int(dims[d]))
            else:
                out.append(d)
        return tuple(out)

    def numel(self, dims: Mapping[str, int]) -> int:
        n = 1
        for d in self.concrete(dims):
            n *= d
        return n

    def nbytes(self, dims: Mapping[str, int]) -> float:
        return self.numel(dims) * self.dtype.bits / 8

    def __str__(self) -> str:
        return f"{self.dtype.value}[{', '.join(str(d) for d in self.shape)}]"
