"""Helpers that turn torch tensors into TaskRows, plus torch references for each body.

Used by the GPU tests and benchmarks/gemv_megakernel.py; also a worked example of how a
scheduler fills TaskRow fields (addresses from data_ptr(), element strides, tiles).
"""
from __future__ import annotations

from fusec.backends.cute.plan import (NO_EVENT, EwOp, ExpertMode, F32Flag, MlaMode, Opcode, TaskRow, f32_bits, f32_pair,
                   split_rows)

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


def _wait_kw(wait, signal) -> dict:
    ev, per_step, off = wait
    return dict(wait_event=ev, wait_per_step=per_step, wait_offset=off, signal_event=signal)


def _mx(w):
    """(weight data, scales) of a bf16 tensor or an MXFP4Tensor (scales None for bf16)."""
    return (w.packed, w.scale) if hasattr(w, "packed") else (w, None)


def expert_glu_tasks(x, ids, w1, w3, h, tiles: int, first_id: int = 0, *,
                     wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """moe_gate_up: h[b, j, :] = situ_glu(x[b] W1[ids[b, j]]^T, x[b] W3[ids[b, j]]^T).

    x bf16 [B, D]; ids int32 [B, k]; w1, w3 bf16 [E, I, D] or MXFP4Tensor; h bf16 [B, k, I]
    (slot rows contiguous). One task per row tile, each over every (batch row, slot) pair: the
    rows stream the experts chosen at run time.
    """
    (d1, s1), (d3, s3) = _mx(w1), _mx(w3)
    op = Opcode.EXPERT_MXFP4 if s1 is not None else Opcode.EXPERT_BF16
    e, inter = d1.shape[0], d1.shape[1]
    topk = ids.shape[1]
    assert h.stride(2) == 1 and h.stride(1) == inter, "slot rows must be contiguous"
    rows = [TaskRow(op, first_id + i, a0=d1.data_ptr(), a1=x.data_ptr(), a2=h.data_ptr(),
                    a3=s1.data_ptr() if s1 is not None else 0, a4=ids.data_ptr(),
                    a5=d3.data_ptr(), a6=s3.data_ptr() if s3 is not None else 0,
                    n0=n0, n1=n1, k=x.shape[1], ldx=x.stride(0), ldy=h.stride(0),
                    aux=inter, sub=ExpertMode.GLU, p0=topk, p1=topk, p2=x.shape[0],
                    **_wait_kw(wait, signal))
            for i, (n0, n1) in enumerate(split_rows(inter, tiles))]
    assert e == d3.shape[0]
    return rows


def expert_down_tasks(h, ids, w2, y, tiles: int, first_id: int = 0, *,
                      wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """moe_down: y[b, j] = h[b, j] W2[ids[b, j]]^T in fp32, one task per row tile over every
    (batch row, slot) pair.

    h bf16 [B, k, I] and y fp32 [B, k, D], contiguous per slot; w2 bf16 [E, D, I] or MXFP4Tensor.
    """
    d2, s2 = _mx(w2)
    op = Opcode.EXPERT_MXFP4 if s2 is not None else Opcode.EXPERT_BF16
    assert h.stride(2) == 1 and h.stride(1) == h.shape[2] and y.stride(1) == y.shape[2], "slot rows must be contiguous"
    return [TaskRow(op, first_id + i, a0=d2.data_ptr(), a1=h.data_ptr(), a2=y.data_ptr(),
                    a3=s2.data_ptr() if s2 is not None else 0, a4=ids.data_ptr(),
                    n0=n0, n1=n1, k=h.shape[2], ldx=h.stride(0), ldy=y.stride(0),
                    aux=d2.shape[1], sub=ExpertMode.DOWN, p0=ids.shape[1], p1=ids.shape[1],
                    p2=h.shape[0], **_wait_kw(wait, signal))
            for i, (n0, n1) in enumerate(split_rows(d2.shape[1], tiles))]


def wsum_task(y, weights, out, task_id: int, *, wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> TaskRow:
    """moe_combine: out[b] = sum_j weights[b, j] y[b, j] (y fp32 [B, k, D], weights fp32 [B, k])."""
    import torch

    assert y.dtype == torch.float32 and weights.dtype == torch.float32 and weights.is_contiguous()
    return TaskRow(Opcode.EW, task_id, a0=y.data_ptr(), a1=weights.data_ptr(), a2=out.data_ptr(), n0=0,
                   n1=y.shape[2], ldx=y.stride(0), ldy=out.stride(0), sub=EwOp.WSUM, p0=y.stride(1),
                   p1=_f32_flag(y, F32Flag.A0) | _f32_flag(out, F32Flag.OUT), p2=y.shape[1],
                   **_wait_kw(wait, signal))


def _f32_flag(t, flag) -> int:
    import torch

    if t is None:
        return 0
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"EW operands are bf16 or fp32, got {t.dtype}")
    return int(flag) if t.dtype == torch.float32 else 0


def ew_task(sub: EwOp, a, out, task_id: int, *, b=None, c=None, head_dim: int = 1, scale: float = 1.0,
            eps: float = 0.0, cols=None, rows=None, wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> TaskRow:
    """One EW task over columns `cols` (default all) of batch rows `rows` = (b0, b1) (default
    every row) of a [B, C] and out [B, C].

    b: second operand [B, C] or a vector [C] (broadcast); for CONV the state [B, C, W-1] (updated
    in place) and c the weight [C, 1, W]; for KDA_GATE c = A_log (head_dim = per-head broadcast,
    1 = per channel); for GATED_RMS c = the norm weight [head_dim].
    """
    n0, n1 = cols if cols is not None else (0, a.shape[-1])
    k = (rows[0] << 16) | rows[1] if rows is not None else 0
    ldy = out.stride(0)
    if sub == EwOp.APPEND:  # b = cache [B, L, W] (updated in place), c = pos int32 [B]
        return TaskRow(Opcode.EW, task_id, a0=a.data_ptr(), a1=b.data_ptr(), a2=b.data_ptr(),
                       a3=c.data_ptr(), n0=n0, n1=n1, k=k, ldx=a.stride(0), ldy=b.stride(1), sub=sub,
                       p0=b.stride(0), p1=_f32_flag(a, F32Flag.A0) | _f32_flag(b, F32Flag.A1),
                       **_wait_kw(wait, signal))
    if sub == EwOp.CONV:
        p2, ldb = c.shape[-1], b.stride(0)
    else:
        p2 = head_dim
        ldb = 0 if (b is None or b.dim() == 1) else b.stride(0)
    flags = (_f32_flag(a, F32Flag.A0) | _f32_flag(b, F32Flag.A1) | _f32_flag(out, F32Flag.OUT)
             | _f32_flag(c, F32Flag.A3))
    return TaskRow(Opcode.EW, task_id, a0=a.data_ptr(), a1=b.data_ptr() if b is not None else 0,
                   a2=out.data_ptr(), a3=c.data_ptr() if c is not None else 0, n0=n0, n1=n1, k=k,
                   ldx=a.stride(0), ldy=ldy, sub=sub, p0=ldb, p1=flags, p2=p2,
                   aux=f32_pair(scale, eps), **_wait_kw(wait, signal))


def router_tasks(logits, bias, weights, ids, scale: float, first_id: int = 0, *,
                 wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """router: one task (one CTA) per token; logits [B, E] fp32 or bf16, bias fp32 [E]."""
    topk = ids.shape[1]
    assert weights.stride(0) == ids.stride(0), "weights and ids share a row stride"
    return [TaskRow(Opcode.ROUTER, first_id + b, a0=logits.data_ptr(), a1=bias.data_ptr(),
                    a2=weights.data_ptr(), a3=ids.data_ptr(), n0=b, n1=b + 1, k=logits.shape[1],
                    ldx=logits.stride(0), ldy=ids.stride(0), p0=topk,
                    p1=_f32_flag(logits, F32Flag.A0), aux=f32_pair(scale), **_wait_kw(wait, signal))
            for b in range(logits.shape[0])]


def kda_tasks(q, k, v, g, beta, state, o, heads_per_task: int, first_id: int = 0, *,
              wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """kda_recurrent: q, k, v bf16 [B, H*D], g fp32 [B, H*D], beta bf16 [B, H], state fp32
    [B, H, D, D] (updated in place), o fp32 [B, H*D]; one task per `heads_per_task` items."""
    b, h, d = state.shape[0], state.shape[1], state.shape[2]
    assert q.stride(0) == k.stride(0) == v.stride(0) == g.stride(0) and beta.stride(0) == h
    rows = []
    for i, n0 in enumerate(range(0, b * h, heads_per_task)):
        rows.append(TaskRow(Opcode.KDA, first_id + i, a0=q.data_ptr(), a1=k.data_ptr(), a5=v.data_ptr(),
                            a6=g.data_ptr(), a4=beta.data_ptr(), a3=state.data_ptr(), a2=o.data_ptr(),
                            n0=n0, n1=min(b * h, n0 + heads_per_task), k=d, ldx=q.stride(0),
                            ldy=o.stride(0), p0=h, **_wait_kw(wait, signal)))
    return rows


def attn_res_tasks(sources, norm_w, proj_w, gamma, h, y, eps_mix: float, eps_out: float,
                   first_id: int = 0, *, ptrs=None, wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> list[TaskRow]:
    """attn_res + rms_norm, one task (CTA) per batch row: sources bf16 [B, H] each (a list, or a
    stacked [J, B, H]) with one row stride, norm_w, proj_w [H] (or [1, H]), gamma [H] bf16; h =
    the mix, y = rms_norm(h) * gamma, both bf16 [B, H]. `ptrs`: an int64 [J] tensor on the
    device that receives the body's source table (byte distances from itself); the caller keeps
    it alive while the plan runs."""
    import torch

    srcs = list(sources)
    j, (b, hw) = len(srcs), srcs[0].shape
    if ptrs is None or ptrs.dtype != torch.int64 or ptrs.numel() < j:
        raise ValueError("attn_res_tasks: pass ptrs, an int64 tensor of at least len(sources) entries")
    ptrs[:j].copy_(torch.tensor([s.data_ptr() - ptrs.data_ptr() for s in srcs], dtype=torch.int64))
    return [TaskRow(Opcode.ATTN_RES, first_id + r, a0=ptrs.data_ptr(), a1=norm_w.data_ptr(),
                    a5=proj_w.data_ptr(), a6=gamma.data_ptr(), a2=h.data_ptr(), a7=y.data_ptr(),
                    n0=r, n1=r + 1, k=hw, ldx=srcs[0].stride(0), ldy=h.stride(0),
                    p1=j, aux=f32_pair(eps_mix, eps_out), **_wait_kw(wait, signal))
            for r in range(b)]


def mla_tasks(q_lat, q_pe, cache, pos, partials, out, scale: float, first_id: int = 0, *,
              combine_items: int = 32, wait=(NO_EVENT, 0, 0), signal=NO_EVENT) -> tuple[list, list]:
    """mla_attention_partial (one task per (chunk, batch)) and attention_combine (tasks of
    `combine_items` (b, h) items). q_lat bf16 [B, H, lora], q_pe bf16 [B, H, rope], cache bf16
    [B, L, lora + rope], pos int32 [B], partials fp32 [S, B, H, lora + 2], out bf16 [B, H, lora].
    Returns (partial rows, combine rows): combine must wait for every partial row."""
    b, h, lora = q_lat.shape
    s, rope = partials.shape[0], q_pe.shape[2]
    for t in (q_lat, q_pe, cache, partials, out):
        assert t.is_contiguous(), "MLA operands must be contiguous"
    common = dict(k=lora, ldx=cache.shape[1], ldy=h, p0=b * h, p1=s, p2=rope, aux=f32_pair(scale))
    part = [TaskRow(Opcode.MLA, first_id + i, a0=q_lat.data_ptr(), a1=q_pe.data_ptr(), a3=cache.data_ptr(),
                    a4=pos.data_ptr(), a6=q_pe.stride(1), a7=q_pe.stride(0), a2=partials.data_ptr(), n0=i,
                    n1=i + 1, sub=MlaMode.PARTIAL, **common, **_wait_kw(wait, signal))
            for i in range(s * b)]
    comb = [TaskRow(Opcode.MLA, first_id + s * b + i, a0=partials.data_ptr(), a2=out.data_ptr(), n0=n0,
                    n1=min(b * h, n0 + combine_items), sub=MlaMode.COMBINE, **common)
            for i, n0 in enumerate(range(0, b * h, combine_items))]
    return part, comb


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
