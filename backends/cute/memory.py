"""Memory plan of the CuTe megakernel: where every tensor of a lowered graph lives.

One device arena holds every tensor the step touches: weights (merged projections built from
their `sources` annotation when bound), state (caches, recurrent and conv states), step inputs,
activations, the lowering's scratch (per-task prologue outputs, `Schedule.buffers`) and the
tables derived from attributes (RoPE inverse frequencies). Each tensor gets its own region at a
deterministic, 256-byte aligned offset (declaration order), so a plan prints the same way every
time and the task table only needs `arena base + offset`.

Values that are pure re-indexings of another value are *views*, not allocations (read off the
registry entry of the op making them):
  a window along the last dim (OpDef.window: slice) -> the parent's region + start, same row stride
  any other `view` op (operand 0's elements in order: reshape) of a contiguous value
                             -> the parent's region, new shape
  an in-place update (OpDef.aliases, e.g. cache_append) -> the updated operand's region
so a task that writes a merged projection writes q, k and v at once, and a body reading a slice
gets its address and row stride from the view.

`MemoryPlan.bind(device)` allocates the arena (torch) and returns `Bound`, whose `tensor(name)`
gives a strided torch view and `addr(name)` the raw device address of element 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fusec.ir.graph import Graph
from fusec.ir.registry import Trait, get_op
from fusec.ir.types import DType, Kind, TensorType

ALIGN = 256  # bytes; every region starts 16-byte aligned for the bodies' vector loads (and more)

# Element sizes of the dtypes the bodies read or write.
_ITEMSIZE = {DType.bf16: 2, DType.f16: 2, DType.f32: 4, DType.i32: 4, DType.i64: 8, DType.u8: 1}


class MemoryPlanError(ValueError):
    """A tensor the megakernel cannot place (unsupported dtype or view)."""


@dataclass(frozen=True)
class Region:
    """One allocation inside the arena."""

    name: str
    offset: int          # bytes from the arena base
    nbytes: int
    dtype: DType
    shape: tuple[int, ...]
    kind: Kind


@dataclass(frozen=True)
class View:
    """A value as (region, element offset, shape, element strides)."""

    region: str
    elem_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: DType

    @property
    def row_stride(self) -> int:
        """Elements between consecutive rows (dim 0) of a 2-D view; 0 for a vector."""
        return self.strides[0] if len(self.shape) >= 2 else 0


def _contig(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def itemsize(dt: DType) -> int:
    if dt not in _ITEMSIZE:
        raise MemoryPlanError(f"dtype {dt.value} has no megakernel layout yet")
    return _ITEMSIZE[dt]


@dataclass
class MemoryPlan:
    regions: dict[str, Region] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    size: int = 0

    # -- building -----------------------------------------------------------------------------
    def alloc(self, name: str, dtype: DType, shape, kind: Kind = Kind.act) -> View:
        """A new region for `name` (a graph value or scratch) and its contiguous view."""
        if name in self.regions:
            raise MemoryPlanError(f"tensor {name} is allocated twice")
        shape = tuple(int(d) for d in shape)
        nbytes = max(1, math.prod(shape)) * itemsize(dtype)
        off = -(-self.size // ALIGN) * ALIGN
        self.regions[name] = Region(name, off, nbytes, dtype, shape, kind)
        self.size = off + nbytes
        v = View(name, 0, shape, _contig(shape), dtype)
        self.views[name] = v
        return v

    def alias(self, name: str, view: View) -> None:
        self.views[name] = view

    def view(self, name: str) -> View:
        if name not in self.views:
            raise MemoryPlanError(f"value %{name} has no place in the memory plan")
        return self.views[name]

    def byte_offset(self, name: str) -> int:
        v = self.view(name)
        return self.regions[v.region].offset + v.elem_offset * itemsize(v.dtype)

    def describe(self) -> str:
        """Deterministic text listing (offsets relative to the arena; no addresses)."""
        lines = [f"arena {self.size} bytes, {len(self.regions)} regions, {len(self.views)} values"]
        for r in self.regions.values():
            lines.append(f"  {r.offset:>10}  {r.nbytes:>9}  {r.kind.value:<6} {r.dtype.value:<4} "
                         f"{list(r.shape)}  {r.name}")
        for n, v in self.views.items():
            if v.region != n:
                lines.append(f"  view {n} = {v.region}+{v.elem_offset} {list(v.shape)} strides {list(v.strides)}")
        return "\n".join(lines)

    def arena_bytes(self) -> int:
        """Bytes of the arena `bind` allocates: rounded up to whole ALIGN blocks so the arena can
        be viewed as any element type."""
        return -(-max(1, self.size) // ALIGN) * ALIGN

    def bind(self, device, arena=None) -> "Bound":
        """The arena allocated (zeroed) on `device`, or `arena`: an allocation made elsewhere
        (e.g. in symmetric memory, backends/cute/dist.py), a contiguous uint8 tensor of at least
        `arena_bytes()` bytes on `device`, zeroed here."""
        import torch

        if arena is None:
            return Bound(self, torch.zeros(self.arena_bytes(), dtype=torch.uint8, device=device))
        if (arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous()
                or arena.numel() < self.arena_bytes() or arena.device.type != torch.device(device).type
                or torch.device(device).index not in (None, arena.device.index)):
            raise MemoryPlanError(f"an external arena must be a contiguous uint8 vector of at least "
                                  f"{self.arena_bytes()} bytes on {device}, got {arena.dtype} {list(arena.shape)} "
                                  f"on {arena.device}")
        if arena.data_ptr() % ALIGN:
            raise MemoryPlanError(f"an external arena must start {ALIGN}-byte aligned")
        arena.zero_()
        return Bound(self, arena)


def build_memory_plan(graph: Graph, dims: dict, scratch: dict[str, TensorType] | None = None) -> MemoryPlan:
    """Place every parameter, op result and scratch tensor of `graph` (see module docstring)."""
    mp = MemoryPlan()
    for v in graph.params:
        shape = v.type.concrete(dims)
        if v.type.dtype is DType.mxfp4:  # packed E2M1 pairs + e8m0 scales per 32 (ir.quant.MXFP4Tensor)
            mp.alloc(v.name, DType.u8, (*shape[:-1], shape[-1] // 2), v.type.kind)
            mp.alloc(v.name + ".scale", DType.u8, (*shape[:-1], shape[-1] // 32), v.type.kind)
            continue
        mp.alloc(v.name, v.type.dtype, shape, v.type.kind)
    for op in graph.ops:
        d = get_op(op.opname)
        for ri, out in enumerate(op.outputs):
            shape = tuple(out.type.concrete(dims))
            if ri in d.aliases:  # updated in place: the result is the operand's storage
                mp.alias(out.name, mp.view(op.inputs[d.aliases[ri]].name))
            elif d.window is not None and d.window(op.attrs)[0] in (-1, len(shape) - 1):
                src = mp.view(op.inputs[0].name)
                mp.alias(out.name, View(src.region, src.elem_offset + int(d.window(op.attrs)[1]) * src.strides[-1],
                                        shape, src.strides, src.dtype))
            elif Trait.view in d.traits and d.window is None and _is_contig(mp.view(op.inputs[0].name)):
                src = mp.view(op.inputs[0].name)
                mp.alias(out.name, View(src.region, src.elem_offset, shape, _contig(shape), src.dtype))
            else:
                mp.alloc(out.name, out.type.dtype, shape, Kind.act)
    for name, ty in (scratch or {}).items():
        mp.alloc(name, ty.dtype, ty.concrete(dims) if hasattr(ty, "concrete") else ty.shape, ty.kind)
    return mp


def _is_contig(v: View) -> bool:
    return v.strides == _contig(v.shape)


class Bound:
    """A memory plan with its arena allocated on a device."""

    def __init__(self, plan: MemoryPlan, arena):
        self.plan, self.arena = plan, arena
        self.base = arena.data_ptr()
        self.tiled: dict[str, int] = {}     # regions repacked into 16-row tiles -> K (weight_tiles.py)

    def addr(self, name: str) -> int:
        return self.base + self.plan.byte_offset(name)

    def tensor(self, name: str):
        import torch

        from fusec.backends.reference.executor import torch_dtype

        v = self.plan.view(name)
        r = self.plan.regions[v.region]
        dt = torch_dtype(v.dtype)
        size = torch.tensor([], dtype=dt).element_size()
        # as_strided's offset counts from the start of the storage (the arena), in elements.
        return torch.as_strided(self.arena.view(dt), v.shape, v.strides, r.offset // size + v.elem_offset)
