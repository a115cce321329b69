"""A CPU interpreter of CuTe megakernel task tables (test helper, no GPU, no cutlass).

It executes a `KernelPlan` whose addresses are byte offsets into a CPU arena (Lowered.plan(base=0)
with `MemoryPlan.bind("cpu")`) the way the kernel's core does: each CTA walks its queue in order,
a row runs only when its wait is satisfied (counter >= WAIT_PER_STEP * step + WAIT_OFFSET), then
release-increments its signal. Which ready CTA goes next is drawn from a seeded RNG, so many
legal interleavings are tried; a step where no CTA can move is a deadlock (reported with the
stuck rows). Each opcode is re-stated here in torch from the `Opcode`/`EwOp` docstrings of
plan.py, independently of the template, to check the *lowering* (addresses, strides, columns,
events) against the registry reference; the CuTe bodies themselves are checked on a GPU.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from fusec.backends.cute.plan import NO_EVENT, EwOp, F32Flag, Opcode


class Deadlock(RuntimeError):
    pass


def _f32_lo(aux: int) -> float:
    import struct
    return struct.unpack("<f", struct.pack("<I", aux & 0xFFFFFFFF))[0]


def _f32_hi(aux: int) -> float:
    import struct
    return struct.unpack("<f", struct.pack("<I", (aux >> 32) & 0xFFFFFFFF))[0]


class Interp:
    def __init__(self, plan, arena: torch.Tensor):
        assert arena.dtype == torch.uint8 and arena.numel() % 8 == 0
        self.plan, self.arena = plan, arena
        self.events = [0] * max(1, plan.num_events)
        self.step = 0
        self.typed = {torch.bfloat16: arena.view(torch.bfloat16), torch.float32: arena.view(torch.float32),
                      torch.int32: arena.view(torch.int32)}

    # -- memory -------------------------------------------------------------------------------
    def t(self, addr: int, dtype, shape, strides):
        size = torch.tensor([], dtype=dtype).element_size()
        assert addr % size == 0, f"misaligned address {addr} for {dtype}"
        return torch.as_strided(self.typed[dtype], shape, strides, addr // size)

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
        if op == Opcode.GEMV_BF16:
            w = self.mat(r.a0, r.n1, r.k, r.k)[r.n0:r.n1].float()
            x = self.mat(r.a1, B, r.k, r.ldx).float()
            f32 = bool(r.p1 & F32Flag.OUT)
            y = self.mat(r.a2, B, r.n1, r.ldy, f32)
            y[:, r.n0:r.n1] = (x @ w.T).to(y.dtype)
        elif op == Opcode.RMSNORM:
            x = self.mat(r.a0, r.n1, r.k, r.ldx)[r.n0:].float()
            g = self.t(r.a1, torch.bfloat16, (r.k,), (1,)).float()
            o = self.mat(r.a2, r.n1, r.k, r.ldy)[r.n0:]
            o.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _f32_lo(r.aux)) * g).to(o.dtype))
        elif op == Opcode.EW:
            self.ew(r, B)
        elif op == Opcode.ATTENTION:
            h, d, grp = r.p0, r.k, r.p2
            kvw = (h // grp) * d
            for item in range(r.n0, r.n1):
                b, hh = divmod(item, h)
                p = int(self.t(r.a4, torch.int32, (B,), (1,))[b])
                q = self.mat(r.a0, B, h * d, r.ldx)[b, hh * d:(hh + 1) * d].float()
                kc = self.t(r.a1 + 2 * b * r.p1, torch.bfloat16, (p + 1, kvw), (kvw, 1))
                vc = self.t(r.a5 + 2 * b * r.p1, torch.bfloat16, (p + 1, kvw), (kvw, 1))
                kv0 = (hh // grp) * d
                s = (kc[:, kv0:kv0 + d].float() @ q) * _f32_lo(r.aux)
                o = torch.softmax(s, 0) @ vc[:, kv0:kv0 + d].float()
                self.mat(r.a2, B, h * d, r.ldy)[b, hh * d:(hh + 1) * d] = o.to(torch.bfloat16)
        elif op == Opcode.ARGMAX:
            x = self.mat(r.a0, r.n1, r.k, r.ldx, bool(r.p1 & F32Flag.A0))[r.n0:].float()
            self.t(r.a2, torch.int32, (r.n1,), (1,))[r.n0:] = x.argmax(-1).to(torch.int32)
        else:
            raise NotImplementedError(f"interp: opcode {op.name}")

    def ew(self, r, B) -> None:
        sub, fl = EwOp(r.sub), r.p1
        cols = slice(r.n0, r.n1)
        if sub == EwOp.APPEND:
            a = self.mat(r.a0, B, r.n1, r.ldx, bool(fl & F32Flag.A0))
            pos = self.t(r.a3, torch.int32, (B,), (1,))
            for b in range(B):
                row = self.t(r.a1 + 2 * (b * r.p0 + int(pos[b]) * r.ldy), torch.bfloat16, (r.n1,), (1,))
                row[cols] = a[b, cols].to(row.dtype)
            return
        if sub == EwOp.GATHER:
            ids = self.t(r.a3, torch.int32, (B,), (1,))
            tab = self.mat(r.a0, int(ids.max()) + 1, r.n1, r.ldx, bool(fl & F32Flag.A0))
            y = tab[ids.long(), cols].float()
        else:
            a = self.mat(r.a0, B, r.n1, r.ldx, bool(fl & F32Flag.A0))[:, :].float()
            if sub == EwOp.ROPE:
                d, half = r.p2, r.p2 // 2
                pos = self.t(r.a3, torch.int32, (B,), (1,)).float()
                inv = self.t(r.a4, torch.float32, (half,), (1,))
                xs = a[:, cols].unflatten(-1, (-1, d))
                ang = pos[:, None] * inv[None, :]
                cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
                rot = torch.cat([-xs[..., half:], xs[..., :half]], -1)
                y = (xs * cos + rot * sin).flatten(-2)
            elif sub == EwOp.COPY:
                y = a[:, cols]
            elif sub == EwOp.SIGMOID:
                y = torch.sigmoid(a[:, cols])
            else:
                bt = self.mat(r.a1, B, r.n1, r.p0, bool(fl & F32Flag.A1)).float()
                x, z = a[:, cols], bt[:, cols]
                if sub == EwOp.ADD:
                    y = x + z
                elif sub == EwOp.SILU_MUL:
                    y = F.silu(x) * z
                elif sub == EwOp.SIGMOID_MUL:
                    y = x * torch.sigmoid(z)
                else:
                    raise NotImplementedError(f"interp: EW {sub.name}")
        o = self.mat(r.a2, B, r.n1, r.ldy, bool(fl & F32Flag.OUT))
        o[:, cols] = y.to(o.dtype)
