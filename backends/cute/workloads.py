"""Helpers that turn torch tensors into TaskRows, plus torch references for each body.

Used by the GPU tests and benchmarks/gemv_megakernel.py; also a worked example of how a
scheduler fills TaskRow fields (addresses from data_ptr(), element strides, tiles).
"""
from __future__ import annotations

from .plan import NO_EVENT, Opcode, TaskRow, f32_bits, split_rows

# E2M1 magnitudes by the low 3 bits of a nibble; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def gemv_tasks(w, x, y, tiles: int, first_id: int = 0, *, opcode=Opcode.GEMV_BF16, scales=None,
               wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """Tiles of y[:, n0:n1] = x @ W[n0:n1].T; `wait` = (event, per_step, offset) for every tile.

    For MXFP4, w is packed u8 [N, K/2] and K is taken from x.
    """
    n, k = w.shape[0], x.shape[1]
    ev, per_step, off = wait
    rows = []
    for i, (n0, n1) in enumerate(split_rows(n, tiles)):
        rows.append(TaskRow(opcode, first_id + i, a0=w.data_ptr(), a1=x.data_ptr(), a2=y.data_ptr(),
                            a3=scales.data_ptr() if scales is not None else 0, n0=n0, n1=n1, k=k,
                            ldx=x.stride(0), ldy=y.stride(0), wait_event=ev, wait_per_step=per_step,
                            wait_offset=off, signal_event=signal))
    return rows


def rmsnorm_task(x, gamma, out, eps: float, task_id: int, *, wait=(NO_EVENT, 0, 0),
                 signal=NO_EVENT) -> TaskRow:
    """One task normalizing every row of x [B, H]."""
    ev, per_step, off = wait
    return TaskRow(Opcode.RMSNORM, task_id, a0=x.data_ptr(), a1=gamma.data_ptr(), a2=out.data_ptr(),
                   n0=0, n1=x.shape[0], k=x.shape[1], ldx=x.stride(0), ldy=out.stride(0),
                   aux=f32_bits(eps), wait_event=ev, wait_per_step=per_step, wait_offset=off,
                   signal_event=signal)


def random_mxfp4(n: int, k: int, device, generator=None):
    """Random packed E2M1 weights u8 [n, k/2] and e8m0 scales u8 [n, k/32] near 2^0."""
    import torch

    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=generator)
    scales = torch.randint(120, 131, (n, k // 32), dtype=torch.uint8, device=device, generator=generator)
    return packed, scales


def dequant_mxfp4(packed, scales):
    """float32 [n, k] from packed E2M1 (low nibble = even element) and e8m0 scales."""
    import torch

    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    lo = table[(packed & 0xF).long()]
    hi = table[(packed >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=1)
    return vals * scale


def rmsnorm_ref(x, gamma, eps: float):
    """fp32 RMSNorm of bf16 x with bf16 gamma."""
    xf = x.float()
    return xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * gamma.float()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    o, r = out.double(), ref.double()
    if not bool(o.isfinite().all()):
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
