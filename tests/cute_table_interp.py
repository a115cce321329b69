"""A CPU interpreter of CuTe megakernel task tables (test helper, no GPU, no cutlass).

It executes a `KernelPlan` whose addresses are byte offsets into a CPU arena (Lowered.plan(base=0)
with `MemoryPlan.bind("cpu")`) the way the kernel's core does: each CTA walks its queue in order,
a row runs only when its wait is satisfied (counter >= WAIT_PER_STEP * step + WAIT_OFFSET), then
release-increments its signal. Which ready CTA goes next is drawn from a seeded RNG, so many
legal interleavings are tried; a step where no CTA can move is a deadlock (reported with the
stuck rows). Each opcode is re-stated here in torch from the `Opcode`/`EwOp` docstrings of
plan.py, independently of the template, to check the *lowering* (addresses, strides, columns,
events) against the registry reference; the CuTe bodies themselves are checked on a GPU.

`RankInterp` runs the R tables of a multi-rank step in one process: R arenas, each at its own
base of one address space (rank r's at r * RANK_STRIDE), so a COMM PUSH row's relocated peer
address lands in the peer's arena and a SIGNAL_PEER increments the peer's counter. Ranks are not
in lockstep: a rank that finishes its step starts the next one (the host hook writes its inputs)
while others still run, as separate launches on separate GPUs would.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from fusec.backends.cute.plan import GEMV_TILED, NO_EVENT, ArgmaxMode, CommOp, EwOp, ExpertMode, F32Flag, MlaMode, Opcode
from fusec.backends.cute.weight_tiles import mx_untile, tile_weights, untile
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.registry import get_op
from fusec.ir.types import Kind


class Deadlock(RuntimeError):
    pass


def _f32_lo(aux: int) -> float:
    import struct
    return struct.unpack("<f", struct.pack("<I", aux & 0xFFFFFFFF))[0]


def _f32_hi(aux: int) -> float:
    import struct
    return struct.unpack("<f", struct.pack("<I", (aux >> 32) & 0xFFFFFFFF))[0]


RANK_STRIDE = 1 << 40      # RankInterp: rank r's arena starts at address r * RANK_STRIDE


def _typed(arena):
    assert arena.dtype == torch.uint8 and arena.numel() % 8 == 0
    return {torch.bfloat16: arena.view(torch.bfloat16), torch.float32: arena.view(torch.float32),
            torch.int32: arena.view(torch.int32), torch.int64: arena.view(torch.int64), torch.uint8: arena}


class Interp:
    def __init__(self, plan, arena: torch.Tensor, arenas=None, matrices=()):
        """`arenas`: every rank's arena (multi-rank: addresses r * RANK_STRIDE + offset).
        `matrices`: (offset, nbytes) of the weight regions: a GEMV row reading one computes its
        rows from the product with the whole matrix, as the reference does (CPU BLAS sums a
        slice of the rows in another order than the whole for some row counts, while the
        kernel's dot product of a row does not depend on the rows beside it)."""
        self.plan, self.arena = plan, arena
        self.matrices = sorted(matrices)
        self.events = [0] * max(1, plan.num_events)
        self.step = 0
        self.typed = _typed(arena)
        self.spaces = [_typed(a) for a in arenas] if arenas is not None else None

    # -- memory -------------------------------------------------------------------------------
    def t(self, addr: int, dtype, shape, strides):
        size = torch.tensor([], dtype=dtype).element_size()
        assert addr % size == 0, f"misaligned address {addr} for {dtype}"
        if self.spaces is None:
            return torch.as_strided(self.typed[dtype], shape, strides, addr // size)
        k, off = divmod(addr, RANK_STRIDE)
        assert 0 <= k < len(self.spaces), f"address {addr} in no rank's arena"
        return torch.as_strided(self.spaces[k][dtype], shape, strides, off // size)

    def mat(self, addr, rows, cols, ld, f32=False):
        return self.t(addr, torch.float32 if f32 else torch.bfloat16, (rows, cols), (ld, 1))

    # -- scheduling ---------------------------------------------------------------------------
    def run_step(self, seed: int = 0) -> None:
        self.step += 1
        rng = random.Random(seed)
        pos = [0] * len(self.plan.queues)
        while True:
            ready, left = [], []
            for c, q in enumerate(self.plan.queues):
                if pos[c] < len(q):
                    r = self.plan.tasks[q[pos[c]]]
                    left.append((c, r))
                    if r.wait_event == NO_EVENT or self.events[r.wait_event] >= r.threshold(self.step):
                        ready.append(c)
            if not left:
                return
            if not ready:
                raise Deadlock("no CTA can move: " + "; ".join(
                    f"CTA {c} task {r.task_id} waits e{r.wait_event} >= {r.threshold(self.step)} "
                    f"(has {self.events[r.wait_event]})" for c, r in left[:4]))
            c = rng.choice(ready)
            r = self.plan.tasks[self.plan.queues[c][pos[c]]]
            self.exec_row(r)
            if r.signal_event != NO_EVENT:
                self.events[r.signal_event] += 1
            pos[c] += 1

    # -- bodies -------------------------------------------------------------------------------
    def exec_row(self, r) -> None:
        B = self.plan.batch
        op = r.opcode
        if op == Opcode.NOP:
            return
        if op == Opcode.GEMV_BF16 and r.p1 & GEMV_TILED:     # 16-row tiles from the matrix base
            w = untile(self.mat(r.a0, -(-r.n1 // 16) * 16, r.k, r.k))[r.n0:r.n1].float()
            x = self.mat(r.a1, B, r.k, r.ldx).float()
            y = self.mat(r.a2, B, r.n1, r.ldy, bool(r.p1 & F32Flag.OUT))
            y[:, r.n0:r.n1] = (x @ w.T).to(y.dtype)
        elif op == Opcode.GEMV_BF16:
            x = self.mat(r.a1, B, r.k, r.ldx).float()
            f32 = bool(r.p1 & F32Flag.OUT)
            y = self.mat(r.a2, B, r.n1, r.ldy, f32)
            m = next(((o, n) for o, n in self.matrices if o <= r.a0 < o + n), None)
            if m is not None and (r.a0 - m[0]) % (2 * r.k) == 0 and m[1] % (2 * r.k) == 0:
                st = (r.a0 - m[0]) // (2 * r.k)       # the row's base, in rows of the matrix
                w = self.mat(m[0], m[1] // (2 * r.k), r.k, r.k).float()
                y[:, r.n0:r.n1] = (x @ w.T)[:, st + r.n0:st + r.n1].to(y.dtype)
            else:
                w = self.mat(r.a0, r.n1, r.k, r.k)[r.n0:r.n1].float()
                y[:, r.n0:r.n1] = (x @ w.T).to(y.dtype)
        elif op == Opcode.RMSNORM:
            x = self.mat(r.a0, r.n1, r.k, r.ldx)[r.n0:].float()
            g = self.t(r.a1, torch.bfloat16, (r.k,), (1,)).float()
            o = self.mat(r.a2, r.n1, r.k, r.ldy)[r.n0:]
            o.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _f32_lo(r.aux)) * g).to(o.dtype))
        elif op == Opcode.EW:
            self.ew(r, B)
        elif op == Opcode.ATTENTION:
            # The registry's attention over every head of the row's operands (the same fp32
            # operations in the same order as the reference: a per-head re-derivation summed in
            # another order and, at some inputs, rounded a bf16 output one step apart), then the
            # row's (batch row, head) items stored.
            h, d, grp = r.p0, r.k, r.p2
            kvw = (h // grp) * d
            L = r.p1 // kvw
            pos = self.t(r.a4, torch.int32, (B,), (1,))
            q = self.mat(r.a0, B, h * d, r.ldx)
            kc = self.t(r.a1, torch.bfloat16, (B, L, kvw), (r.p1, kvw, 1))
            vc = self.t(r.a5, torch.bfloat16, (B, L, kvw), (r.p1, kvw, 1))
            o = get_op("attention").ref([q, kc, vc, pos], {"heads": h, "kv_heads": h // grp, "head_dim": d,
                                                           "scale": _f32_lo(r.aux)})[0]
            for item in range(r.n0, r.n1):
                b, hh = divmod(item, h)
                self.mat(r.a2, B, h * d, r.ldy)[b, hh * d:(hh + 1) * d] = o[b, hh * d:(hh + 1) * d].to(torch.bfloat16)
        elif op == Opcode.ARGMAX:
            if r.sub == ArgmaxMode.COMBINE:     # K chunks' (value, column) pairs, LDX floats a chunk
                p = self.t(r.a0, torch.float32, (r.k, r.n1, 2), (r.ldx, 2, 1))[:, r.n0:]
                best = p[..., 0].argmax(0, keepdim=True)          # the first chunk holding the max
                self.t(r.a2, torch.int32, (r.n1,), (1,))[r.n0:] = p[..., 1].gather(0, best)[0].to(torch.int32)
            else:
                x = self.mat(r.a0, r.n1, r.k, r.ldx, bool(r.p1 & F32Flag.A0))[r.n0:].float()
                if r.sub == ArgmaxMode.PARTIAL:     # the chunk's best value and its column + P0
                    i = x.argmax(-1, keepdim=True)
                    pair = torch.cat([x.gather(-1, i), (i + r.p0).float()], -1)
                    self.t(r.a2, torch.float32, (r.n1, 2), (2, 1))[r.n0:] = pair
                else:
                    self.t(r.a2, torch.int32, (r.n1,), (1,))[r.n0:] = x.argmax(-1).to(torch.int32)
        elif op == Opcode.ROUTER:
            lg = self.mat(r.a0, r.n1, r.k, r.ldx, bool(r.p1 & F32Flag.A0))[r.n0:]
            bias = self.t(r.a1, torch.float32, (r.k,), (1,))
            w, ids = get_op("router").ref([lg, bias], {"topk": r.p0, "scale": _f32_lo(r.aux)})
            self.t(r.a2, torch.float32, (r.n1, r.p0), (r.ldy, 1))[r.n0:] = w
            self.t(r.a3, torch.int32, (r.n1, r.p0), (r.ldy, 1))[r.n0:] = ids
        elif op == Opcode.KDA:
            h, d = r.p0, r.k
            for item in range(r.n0, r.n1):
                b, hh = divmod(item, h)
                cs = slice(hh * d, (hh + 1) * d)
                q, k, v = (self.mat(a, B, h * d, r.ldx)[b:b + 1, cs] for a in (r.a0, r.a1, r.a5))
                g = self.mat(r.a6, B, h * d, r.ldx, True)[b:b + 1, cs]
                bdt = torch.float32 if r.p1 & F32Flag.A0 else torch.bfloat16
                beta = self.t(r.a4, bdt, (B, h), (h, 1))[b:b + 1, hh:hh + 1]
                st = self.t(r.a3, torch.float32, (B, h, d, d), (h * d * d, d * d, d, 1))[b:b + 1, hh:hh + 1]
                o, ns = get_op("kda_recurrent").ref([q, k, v, g, beta, st], {"heads": 1, "head_dim": d})
                st.copy_(ns)
                self.mat(r.a2, B, h * d, r.ldy, True)[b:b + 1, cs] = o
        elif op == Opcode.ATTN_RES:
            J, H = r.p1, r.k
            for b in range(r.n0, r.n1):
                rel = self.t(r.a0, torch.int64, (J,), (1,)).tolist()   # byte distances from A0
                src = [self.mat(r.a0 + rel[j], B, H, r.ldx)[b:b + 1] for j in range(J)]
                nw = self.t(r.a1, torch.bfloat16, (H,), (1,))
                pw = self.t(r.a5, torch.bfloat16, (1, H), (H, 1))
                hmix = get_op("attn_res").ref([nw, pw, *src], {"eps": _f32_lo(r.aux)})[0].to(torch.bfloat16)
                self.mat(r.a2, B, H, r.ldy)[b:b + 1] = hmix
                gam = self.t(r.a6, torch.bfloat16, (H,), (1,))
                y = get_op("rms_norm").ref([hmix, gam], {"eps": _f32_hi(r.aux), "out_dtype": ""})[0]
                self.mat(r.a7, B, H, r.ldy)[b:b + 1] = y.to(torch.bfloat16)
        elif op in (Opcode.EXPERT_BF16, Opcode.EXPERT_MXFP4):
            self.expert(r, B, op == Opcode.EXPERT_MXFP4)
        elif op == Opcode.MLA:
            self.mla(r, B)
        elif op == Opcode.COMM:
            self.comm(r, B)
        else:
            raise NotImplementedError(f"interp: opcode {op.name}")

    def comm(self, r, B) -> None:
        """COMM rows (plan.py): PUSH copies x into the (peer's) slot A2; ALL_REDUCE sums the
        group's members in group-index order in fp32 (member AUX is x, member j the slot
        (AUX - j) mod G), ALL_GATHER places member j at columns j * N1."""
        f32x, f32o, G, i = bool(r.p1 & F32Flag.A0), bool(r.p1 & F32Flag.OUT), r.p2, r.aux
        cols = slice(r.n0, r.n1)
        x = self.mat(r.a0, B, r.n1, r.ldx, f32x)
        if r.sub == CommOp.PUSH:
            self.mat(r.a2, B, r.n1, r.ldy, f32x)[:, cols] = x[:, cols]
            return
        es = 4 if f32x else 2

        def member(j):
            if j == i:
                return x[:, cols]
            return self.mat(r.a1 + ((i - j) % G) * B * r.n1 * es, B, r.n1, r.n1, f32x)[:, cols]
        if r.sub == CommOp.ALL_REDUCE:
            y = torch.stack([member(j).float() for j in range(G)]).sum(0)
            o = self.mat(r.a2, B, r.n1, r.ldy, f32o)
            o[:, cols] = y.to(o.dtype)
        elif r.sub == CommOp.ALL_GATHER:
            o = self.mat(r.a2, B, G * r.n1, r.ldy, f32o)
            for j in range(G):
                o[:, j * r.n1 + r.n0:j * r.n1 + r.n1] = member(j).to(o.dtype)
        else:
            raise NotImplementedError(f"interp: COMM sub-opcode {r.sub}")

    def weight_rows(self, a, s, mx, e, rows_per_expert, n0, n1, k):
        """fp32 rows n0..n1 of expert e (bf16 [E*R, K] or MXFP4 packed [E*R, K/2] + scales)."""
        r0, r1 = e * rows_per_expert + n0, e * rows_per_expert + n1
        if not mx and self.plan.expert_tiles:     # 16-row tiles of all experts' rows
            return untile(self.mat(a, -(-r1 // 16) * 16, k, k))[r0:r1].float()
        if not mx:
            return self.mat(a, r1, k, k)[r0:r1].float()
        if self.plan.expert_mx_mma:               # MXFP4 tiles of 16 rows x 128 columns
            r16 = -(-r1 // 16) * 16
            packed, scale = mx_untile(self.t(a, torch.uint8, (r16, k // 2), (k // 2, 1)),
                                      self.t(s, torch.uint8, (r16, k // 32), (k // 32, 1)))
            return MXFP4Tensor(packed[r0:r1], scale[r0:r1]).dequant()
        packed = self.t(a, torch.uint8, (r1, k // 2), (k // 2, 1))[r0:r1]
        scale = self.t(s, torch.uint8, (r1, k // 32), (k // 32, 1))[r0:r1]
        return MXFP4Tensor(packed, scale).dequant()

    def expert(self, r, B, mx):
        """Slots P0 >> 16 .. P0 & 0xFFFF of batch rows P2 >> 16 .. P2 & 0xFFFF, output rows N0..N1:
        GLU -> bf16 h, DOWN -> fp32 y (plain dot); slot s of the output at column s * AUX (of
        DOWN's input: s * K). Pairs are grouped by expert, each group one matrix product, as
        the registry computes them (CPU BLAS rounds an M-row product differently from M
        single-row ones) and as the bf16 body streams them."""
        from fusec.ir.ops.core import situ_glu_math
        topk, glu = r.p1, r.sub == ExpertMode.GLU
        ids = self.t(r.a4, torch.int32, (B, topk), (topk, 1))
        rows_e, n0, n1 = r.aux, r.n0, r.n1
        # x rows [B, LDX] (GLU) or [B, slot, K] (DOWN); out [B, LDY] with slot s at s * AUX.
        x = self.mat(r.a1, B, r.ldx, r.ldx).float()
        out = self.mat(r.a2, B, r.ldy, r.ldy, not glu)
        pairs = [(b, s) for b in range(r.p2 >> 16, r.p2 & 0xFFFF) for s in range(r.p0 >> 16, r.p0 & 0xFFFF)]
        lo, n_local = r.a7 >> 32, r.a7 & 0xFFFFFFFF      # expert parallel (A7 = 0: every expert)
        groups: dict[int, list] = {}
        for b, s in pairs:
            e = int(ids[b, s]) - lo
            groups.setdefault(e if not r.a7 or 0 <= e < n_local else -1, []).append((b, s))
        for e, members in groups.items():
            cols = [(s * rows_e + n0, s * rows_e + n1) for _, s in members]
            if e < 0:
                for (b, _), (c0, c1) in zip(members, cols):
                    out[b, c0:c1] = 0
                continue
            xe = torch.stack([x[b, :r.k] if glu else x[b, s * r.k:(s + 1) * r.k] for b, s in members])
            wg = self.weight_rows(r.a0, r.a3, mx, e, rows_e, n0, n1, r.k)
            if glu:
                wu = self.weight_rows(r.a5, r.a6, mx, e, rows_e, n0, n1, r.k)
                y = situ_glu_math(xe @ wg.T, xe @ wu.T).to(torch.bfloat16)
            else:
                y = xe @ wg.T
            for i, ((b, _), (c0, c1)) in enumerate(zip(members, cols)):
                out[b, c0:c1] = y[i]

    def mla(self, r, B):
        """PARTIAL writes [o / l, m, l] per (chunk, batch, head) over the chunk's rows up to pos;
        COMBINE merges the P1 chunks of items n0..n1 (b * H + h) into bf16."""
        H, K, R, S = r.ldy, r.k, r.p2, r.p1
        part = self.t(r.a2 if r.sub == MlaMode.PARTIAL else r.a0, torch.float32, (S, B, H, K + 2),
                      (B * H * (K + 2), H * (K + 2), K + 2, 1))
        if r.sub == MlaMode.PARTIAL:
            for i in range(r.n0, r.n1):
                c, b = divmod(i, B)
                lo, hi = c * r.ldx // S, (c + 1) * r.ldx // S
                end = min(hi, int(self.t(r.a4, torch.int32, (B,), (1,))[b]) + 1)
                if end <= lo:   # nothing of this chunk is visible yet
                    part[c, b, :, :K] = 0.0
                    part[c, b, :, K] = float("-inf")
                    part[c, b, :, K + 1] = 0.0
                    continue
                ql = self.t(r.a0, torch.bfloat16, (B, H, K), (H * K, K, 1))[b].float()
                qp = self.t(r.a1, torch.bfloat16, (B, H, R), (r.a7, r.a6, 1))[b].float()
                cc = self.t(r.a3, torch.bfloat16, (B, r.ldx, K + R), (r.ldx * (K + R), K + R, 1))[b, lo:end].float()
                sc = (ql @ cc[:, :K].T + qp @ cc[:, K:].T) * _f32_lo(r.aux)    # [H, rows]
                m = sc.max(-1).values
                e = torch.exp(sc - m[:, None])
                l_ = e.sum(-1)
                part[c, b, :, :K] = (e @ cc[:, :K]) / l_[:, None]
                part[c, b, :, K] = m
                part[c, b, :, K + 1] = l_
        else:
            out = self.t(r.a2, torch.bfloat16, (B * H, K), (K, 1))
            flat = part.reshape(S, B * H, K + 2)
            for i in range(r.n0, r.n1):
                m = flat[:, i, K]
                wgt = torch.exp(m - m.max()) * flat[:, i, K + 1]
                out[i] = (wgt[:, None] * flat[:, i, :K]).sum(0) / wgt.sum()

    def ew(self, r, B) -> None:
        """Columns N0..N1 of batch rows K >> 16 .. K & 0xFFFF (K = 0: every row); every operand
        indexed by batch row is read and written at those rows only (`rs`)."""
        sub, fl = EwOp(r.sub), r.p1
        cols = slice(r.n0, r.n1)
        b0, b1 = (r.k >> 16, r.k & 0xFFFF) if r.k else (0, B)
        rs = slice(b0, b1)
        if sub == EwOp.APPEND:
            a = self.mat(r.a0, B, r.n1, r.ldx, bool(fl & F32Flag.A0))
            pos = self.t(r.a3, torch.int32, (B,), (1,))
            for b in range(b0, b1):
                row = self.t(r.a1 + 2 * (b * r.p0 + int(pos[b]) * r.ldy), torch.bfloat16, (r.n1,), (1,))
                row[cols] = a[b, cols].to(row.dtype)
            return
        if sub == EwOp.WSUM:   # sum over P2 slots (stride P0) of fp32 weights (A1 [B, P2]) * a[b, j]
            K = r.p2
            a = self.t(r.a0, torch.float32 if fl & F32Flag.A0 else torch.bfloat16, (B, K, r.n1),
                       (r.ldx, r.p0, 1)).float()[rs, :, cols]
            w = self.t(r.a1, torch.float32, (B, K), (K, 1))[rs]
            y = get_op("moe_combine").ref([a, w], {})[0]
        elif sub == EwOp.GATHER:
            ids = self.t(r.a3, torch.int32, (B,), (1,))[rs]
            tab = self.mat(r.a0, int(ids.max()) + 1, r.n1, r.ldx, bool(fl & F32Flag.A0))
            y = tab[ids.long(), cols].float()
        else:
            a = self.mat(r.a0, B, r.n1, r.ldx, bool(fl & F32Flag.A0))[rs].float()
            if sub == EwOp.ROPE:
                d, half = r.p2, r.p2 // 2
                pos = self.t(r.a3, torch.int32, (B,), (1,))[rs].float()
                inv = self.t(r.a4, torch.float32, (half,), (1,))
                xs = a[:, cols].unflatten(-1, (-1, d))
                ang = pos[:, None] * inv[None, :]
                cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
                rot = torch.cat([-xs[..., half:], xs[..., :half]], -1)
                y = (xs * cos + rot * sin).flatten(-2)
            elif sub == EwOp.COPY:
                y = a[:, cols]
            elif sub == EwOp.CONV:
                W = r.p2
                st = self.t(r.a1, torch.bfloat16 if not fl & F32Flag.A1 else torch.float32, (B, r.n1, W - 1),
                            (r.p0, W - 1, 1))[rs, cols]
                w = self.t(r.a3, torch.float32 if fl & F32Flag.A3 else torch.bfloat16, (r.n1, 1, W), (W, W, 1))[cols]
                y, ns = get_op("conv_update").ref([a[:, cols], st, w], {})
                st.copy_(ns.to(st.dtype))
            elif sub == EwOp.L2_NORM:
                y = get_op("l2_norm").ref([a[:, cols]], {"head_dim": r.p2, "scale": _f32_lo(r.aux),
                                                        "eps": _f32_hi(r.aux)})[0]
            elif sub == EwOp.RMS:
                w = self.t(r.a3, torch.float32 if fl & F32Flag.A3 else torch.bfloat16, (r.p2,), (1,))
                y = get_op("rms_norm").ref([a[:, cols], w], {"eps": _f32_hi(r.aux), "out_dtype": ""})[0]
            elif sub == EwOp.GATED_RMS:
                g = self.mat(r.a1, B, r.n1, r.p0, bool(fl & F32Flag.A1))[rs, cols]
                w = self.t(r.a3, torch.float32 if fl & F32Flag.A3 else torch.bfloat16, (r.p2,), (1,))
                y = get_op("gated_rms_norm").ref([a[:, cols], g, w], {"head_dim": r.p2, "eps": _f32_hi(r.aux)})[0]
            elif sub == EwOp.KDA_GATE:
                dtb = self.mat(r.a1, B, r.n1, 0, bool(fl & F32Flag.A1)).float()[rs, cols]
                alog = self.t(r.a3, torch.float32 if fl & F32Flag.A3 else torch.bfloat16, ((r.n1 - 1) // r.p2 + 1,), (1,))
                idx = torch.arange(r.n0, r.n1) // r.p2
                y = -5.0 * torch.sigmoid(torch.exp(alog.float()[idx]) * (a[:, cols] + dtb))
            elif sub == EwOp.SIGMOID:
                y = torch.sigmoid(a[:, cols])
            else:
                bt = self.mat(r.a1, B, r.n1, r.p0, bool(fl & F32Flag.A1)).float()[rs]
                x, z = a[:, cols], bt[:, cols]
                if sub == EwOp.ADD:
                    y = x + z
                elif sub == EwOp.SILU_MUL:
                    y = F.silu(x) * z
                elif sub == EwOp.SIGMOID_MUL:
                    y = x * torch.sigmoid(z)
                elif sub == EwOp.SITU_GLU:
                    from fusec.ir.ops.core import situ_glu_math
                    y = situ_glu_math(x, z)
                else:
                    raise NotImplementedError(f"interp: EW {sub.name}")
        o = self.mat(r.a2, B, r.n1, r.ldy, bool(fl & F32Flag.OUT))
        o[rs, cols] = y.to(o.dtype)


def interp_on_arena(low, weights, mutate=None, plan_options=None):
    """A CPU arena bound with `weights` (the lowered graph's) and an interpreter over its table
    (`mutate(rows) -> rows` plants a bug first; `plan_options` as the runner's: gemv_tiles and
    expert_tiles repack their weights as CuteRunner does). Returns (bound arena, Interp)."""
    from fusec.backends.cute.lower import bind_weights

    bound = low.memory.bind("cpu")
    bind_weights(low, bound, weights)
    tile_weights(low, bound, plan_options)
    plan = low.plan(base=0, **(plan_options or {}))
    if mutate:
        plan = plan.with_tasks(mutate(list(plan.tasks)))
    return bound, Interp(plan, bound.arena, matrices=weight_matrices(low))


def weight_matrices(low, base: int = 0):
    """(address, nbytes) of the lowered table's weight regions in an arena at `base` (Interp's
    `matrices`)."""
    return [(base + r.offset, r.nbytes) for r in low.memory.regions.values() if r.kind is Kind.weight]


class RankInterp:
    """The R tables of a multi-rank step (module docstring). `plans[r]`: rank r's KernelPlan with
    addresses r * RANK_STRIDE + offset (Lowered.plan(base, peer_bases)); `arenas[r]` its arena."""

    def __init__(self, plans, arenas, matrices=None):
        """`matrices[r]`: rank r's weight regions (weight_matrices(low, r * RANK_STRIDE))."""
        self.R = len(plans)
        mats = matrices or [()] * self.R
        self.ranks = [Interp(p, a, arenas, m) for p, a, m in zip(plans, arenas, mats)]

    def run(self, steps: int, before, after, seed: int = 0, ahead: int | None = None) -> None:
        """Run `steps` steps of every rank. `before(rank, k)` (k 1-based) writes rank's inputs of
        step k, `after(rank, k)` reads its outputs. The next row is drawn at random among the
        ready (rank, CTA) pairs; with `ahead` = a rank, that rank moves whenever it can (it runs
        steps ahead of the others as far as the events let it)."""
        rng = random.Random(seed)
        pos = [None] * self.R
        for k, it in enumerate(self.ranks):
            it.step = 1
            before(k, 1)
            pos[k] = [0] * len(it.plan.queues)
        while True:
            ready, left = [], []
            for k, it in enumerate(self.ranks):
                if it.step > steps:
                    continue
                for c, q in enumerate(it.plan.queues):
                    if pos[k][c] < len(q):
                        r = it.plan.tasks[q[pos[k][c]]]
                        left.append((k, c, r))
                        if r.wait_event == NO_EVENT or it.events[r.wait_event] >= r.threshold(it.step):
                            ready.append((k, c))
            if not left:
                return
            if not ready:
                raise Deadlock("no CTA of any rank can move: " + "; ".join(
                    f"rank {k} step {self.ranks[k].step} CTA {c} task {r.task_id} waits e{r.wait_event} >= "
                    f"{r.threshold(self.ranks[k].step)} (has {self.ranks[k].events[r.wait_event]})"
                    for k, c, r in left[:4]))
            mine = [x for x in ready if x[0] == ahead]
            k, c = mine[0] if mine else rng.choice(ready)
            it = self.ranks[k]
            r = it.plan.tasks[it.plan.queues[c][pos[k][c]]]
            it.exec_row(r)
            if r.signal_event != NO_EVENT:
                self.ranks[(k + r.signal_peer) % self.R].events[r.signal_event] += 1
            pos[k][c] += 1
            if all(p == len(q) for p, q in zip(pos[k], it.plan.queues)):
                after(k, it.step)
                it.step += 1
                if it.step <= steps:
                    before(k, it.step)
                    pos[k] = [0] * len(it.plan.queues)
