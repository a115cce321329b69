"""MXFP4 storage (OCP microscaling, as in compressed-tensors `mxfp4-pack-quantized`).

Values are E2M1 nibbles packed two per byte along the input dim (low nibble = even element),
with one E8M0 scale byte per 32 inputs (value 2^(byte-127)), no global scale, no zero point.
"""
from __future__ import annotations

from dataclasses import dataclass

from ._lazy import LazyModule
from .types import MXFP4_GROUP

torch = LazyModule("torch")   # imported at the first dequant (ir/_lazy.py)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class MXFP4Tensor:
    """A run-time mxfp4 tensor of logical shape [..., N, K]: packed [..., N, K/2] u8, scale [..., N, K/32] u8."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def to(self, device) -> "MXFP4Tensor":
        return MXFP4Tensor(self.packed.to(device), self.scale.to(device))

    def __getitem__(self, idx) -> "MXFP4Tensor":
        """Index leading dims only (e.g. one expert)."""
        return MXFP4Tensor(self.packed[idx], self.scale[idx])

    def dequant(self, dtype=None) -> torch.Tensor:
        dtype = torch.float32 if dtype is None else dtype
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.packed.device)
        p = self.packed.to(torch.int32)
        nib = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)  # [..., N, K]
        mag = table[nib & 0x7]
        val = torch.where((nib & 0x8) != 0, -mag, mag)
        s = torch.exp2(self.scale.to(torch.float32) - 127.0)
        val = val.unflatten(-1, (-1, MXFP4_GROUP)) * s[..., None]
        return val.flatten(-2).to(dtype)
