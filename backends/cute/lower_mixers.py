"""Lowering of the mixer and MoE ops (KDA, MLA, AttnRes, the router and experts, their per-head
norms and gates) onto the task bodies: a mixin of lower._TaskLowering, each `@lowers` method an
entry of the backend's per-op table (lowerings.py). Nothing here is model-specific: any model
built from these ops lowers through it (Kimi K3 is the one that uses them all today).

Each method returns [(TaskRow, address fields)] for one op of one task.
Layout adaptations the bodies need are made here with per-task scratch (never shared values):
  attn_res        ATTN_RES (fused with the task's rms_norm) over the task's batch rows, reading the
                  sources in place through a table of byte distances (const rel_ptrs); sources of
                  mixed dtype or row stride are first copied (EW COPY) into a bf16 stack
  kda_recurrent   one KDA row per batch row of the task (items b * H + h are contiguous only
                  within a row); fp32 beta flagged in P1
  moe_gate_up / moe_down  one EXPERT row (GLU / DOWN) per slot of the task's (batch rows, slots,
                  rows) tile: each task streams only its own tokens' experts
  moe_combine     EW WSUM over the slots (fp32 routing weights); as the prologue of a GEMV group
                  (combine -> rms_norm -> linear) each task sums the whole row into its scratch
  rms_norm of fp32  (lower.py) EW RMS, one head of the full width (RMSNORM streams bf16)
  mla_q_absorb    per-head GEMV over W_UK^T, a transposed copy of kv_b's key rows built at bind
                  time (const "mla_uk_t")
  mla_v_up        one GEMV per head over kv_b's value rows (o_lat is bf16, as FlashMLA writes it)
  mla_attention   MLA PARTIAL (one chunk, q_pe read in place through its strides) then COMBINE
  mla_attention_partial / attention_combine (split sequence, passes/tile.py): MLA PARTIAL over
                  the task's chunks into the partials value; COMBINE of the task's heads, per batch row
  concat          EW COPY of each part at its column offset
"""
from __future__ import annotations

from fusec.ir.types import DType

from .lowerings import OpCtx, lowers
from .plan import EwOp, ExpertMode, F32Flag, MlaMode, Opcode, TaskRow, f32_pair


def _ew(t, sub, a=0, b=0, out=0, c=0, **kw):
    return TaskRow(Opcode.EW, t.id, a0=a, a1=b, a2=out, a3=c, sub=sub, **kw)


class MixerLowering:
    """Needs from the host class: s, mem, B, _v, _off, _flags, _scratch, _copy_rows, error."""

    @lowers('conv_update')
    def _lower_conv_update(self, c: OpCtx):
        t, cols, ins, out, view, off = c.t, c.cols, c.ins, c.out, c.view, c.off
        if cols[1] <= cols[0]:
            return []
        a, o = view(ins[0]), view(out)
        st, w = view(ins[1]), view(ins[2])
        fl = self._flags(a=a, b=st, o=o) | (int(F32Flag.A3) if w.dtype is DType.f32 else 0)
        return [(_ew(t, EwOp.CONV, off(ins[0]), off(ins[1]), off(out), off(ins[2]), n0=cols[0],
                     n1=cols[1], ldx=a.row_stride, ldy=o.row_stride, p0=st.strides[0], p1=fl,
                     p2=w.shape[-1]), ("a0", "a1", "a2", "a3"))]

    @lowers('l2_norm')
    def _lower_l2_norm(self, c: OpCtx):
        t, cols, ins, out, at, off = c.t, c.cols, c.ins, c.out, c.at, c.off
        if cols[1] <= cols[0]:
            return []
        a, o = self._per_head_views(c)
        return [(_ew(t, EwOp.L2_NORM, off(ins[0]), 0, off(out), n0=cols[0], n1=cols[1],
                     ldx=a.row_stride, ldy=o.row_stride, p1=self._flags(a=a, o=o),
                     p2=int(at["head_dim"]), aux=f32_pair(float(at.get("scale", 1.0)),
                                                          float(at.get("eps", 1e-6)))), ("a0", "a2"))]

    @lowers('kda_gate')
    def _lower_kda_gate(self, c: OpCtx):
        t, cols, ins, out, at, view, off = c.t, c.cols, c.ins, c.out, c.at, c.view, c.off
        if cols[1] <= cols[0]:
            return []
        a, o = view(ins[0]), view(out)
        if at.get("a_log_broadcast", "head") != "head":
            raise self.error(f"kda_gate %{out}: only a per-head A_log is supported")
        alog, dtb = view(ins[1]), view(ins[2])
        fl = (self._flags(a=a, b=dtb, o=o) | (int(F32Flag.A3) if alog.dtype is DType.f32 else 0))
        return [(_ew(t, EwOp.KDA_GATE, off(ins[0]), off(ins[2]), off(out), off(ins[1]), n0=cols[0],
                     n1=cols[1], ldx=a.row_stride, ldy=o.row_stride, p0=0, p1=fl,
                     p2=int(at["head_dim"])), ("a0", "a1", "a2", "a3"))]

    @lowers('gated_rms_norm')
    def _lower_gated_rms_norm(self, c: OpCtx):
        t, cols, ins, out, at, view, off = c.t, c.cols, c.ins, c.out, c.at, c.view, c.off
        if cols[1] <= cols[0]:
            return []
        a, o = self._per_head_views(c)
        g, w = view(ins[1]), view(ins[2])
        fl = self._flags(a=a, b=g, o=o) | (int(F32Flag.A3) if w.dtype is DType.f32 else 0)
        return [(_ew(t, EwOp.GATED_RMS, off(ins[0]), off(ins[1]), off(out), off(ins[2]), n0=cols[0],
                     n1=cols[1], ldx=a.row_stride, ldy=o.row_stride, p0=g.row_stride, p1=fl,
                     p2=int(at["head_dim"]), aux=f32_pair(1.0, float(at.get("eps", 1e-5)))),
                 ("a0", "a1", "a2", "a3"))]

    @lowers('router')
    def _lower_router(self, c: OpCtx):
        t, op, ins, out, at, view, off = c.t, c.op, c.ins, c.out, c.at, c.view, c.off
        lg, w, ids = view(ins[0]), view(out), view(op.outputs[1].name)
        if w.row_stride != ids.row_stride:
            raise self.error(f"router %{out}: weights and ids need one row stride")
        return [(TaskRow(Opcode.ROUTER, t.id, a0=off(ins[0]), a1=off(ins[1]), a2=off(out),
                         a3=off(op.outputs[1].name), n0=b, n1=b + 1, k=lg.shape[-1], ldx=lg.row_stride,
                         ldy=ids.row_stride, p0=int(at["topk"]),
                         p1=int(F32Flag.A0) if lg.dtype is DType.f32 else 0,
                         aux=f32_pair(float(at.get("scale", 1.0)))), ("a0", "a1", "a2", "a3"))
                for b in range(*self._rows(t))]

    @lowers('kda_recurrent')
    def _lower_kda_recurrent(self, c: OpCtx):
        t, cols, ins, out, at, view, off = c.t, c.cols, c.ins, c.out, c.at, c.view, c.off
        q, k, v, g, beta, state = ins
        h, d = int(at["heads"]), int(at["head_dim"])
        h0, h1 = cols[0] // d, -(-cols[1] // d)
        rows = []
        bv = view(beta)
        if bv.row_stride != h:
            raise self.error(f"kda_recurrent %{out}: beta rows must be contiguous [B, H]")
        for vv in (q, k, v, g):
            if view(vv).row_stride != view(q).row_stride:
                raise self.error(f"kda_recurrent %{out}: q, k, v, g need one row stride")
        for b in range(*self._rows(t)):        # the task's batch rows (a tile may hold part of them)
            rows.append((TaskRow(Opcode.KDA, t.id, a0=off(q), a1=off(k), a5=off(v), a6=off(g),
                                 a4=off(beta), a3=off(state), a2=off(out),
                                 n0=b * h + h0, n1=b * h + h1, k=d, ldx=view(q).row_stride,
                                 ldy=view(out).row_stride, p0=h,
                                 p1=int(F32Flag.A0) if bv.dtype is DType.f32 else 0),
                         ("a0", "a1", "a2", "a3", "a4", "a5", "a6")))
        return rows

    @lowers('attn_res')
    def _lower_attn_res(self, c: OpCtx):
        t, op, redirect = c.t, c.op, c.redirect
        return self._attn_res(t, op, redirect)

    @lowers('moe_gate_up')
    def _lower_gate_up(self, c: OpCtx):
        return self._expert(c.t, c.op, c.redirect, glu=True)

    @lowers('moe_down')
    def _lower_down(self, c: OpCtx):
        return self._expert(c.t, c.op, c.redirect, glu=False)

    @lowers('moe_combine')
    def _lower_moe_combine(self, c: OpCtx):
        t, op, cols, anchor, redirect, ins, out, view, off = c.t, c.op, c.cols, c.anchor, c.redirect, c.ins, c.out, c.view, c.off
        y, rw = ins
        yv, rv, o = view(y), view(rw), view(out)
        if yv.dtype is not DType.f32 or rv.dtype is not DType.f32 or rv.strides != (yv.shape[1], 1):
            raise self.error(f"moe_combine %{out}: needs fp32 slot rows and contiguous fp32 weights")
        if anchor is not None and anchor is not op:
            # a prologue of a GEMV group (-> rms_norm -> linear): every tile needs the whole
            # row, so each task sums all columns into its own scratch (never the shared value)
            dst = self._scratch(f"scratch.t{t.id}.{out}", DType.f32, (self.B, o.shape[-1]))
            redirect[out] = dst
            o, cols = self.mem.view(dst), (0, o.shape[-1])
        if cols[1] <= cols[0]:
            return []
        return [(_ew(t, EwOp.WSUM, off(y), off(rw), off(out), n0=cols[0], n1=cols[1], ldx=yv.strides[0],
                     ldy=o.row_stride, p0=yv.strides[1], p1=self._flags(a=yv, o=o), p2=yv.shape[1]),
                 ("a0", "a1", "a2"))]

    @lowers('concat')
    def _lower_concat(self, c: OpCtx):
        t, ins, out, at, view, off = c.t, c.ins, c.out, c.at, c.view, c.off
        if int(at.get("dim", -1)) not in (-1, len(view(out).shape) - 1):
            raise self.error(f"concat %{out}: only the last dim")
        rows, col = [], 0
        o = view(out)
        for n in ins:
            a = view(n)
            w = a.shape[-1]
            rows.append((_ew(t, EwOp.COPY, off(n), 0, off(out) + col * _isz(o.dtype), n0=0, n1=w,
                             ldx=a.row_stride, ldy=o.row_stride, p1=self._flags(a=a, o=o)), ("a0", "a2")))
            col += w
        return rows

    @lowers('mla_q_absorb')
    def _lower_mla_q_absorb(self, c: OpCtx):
        t, ins, out, at, view, off = c.t, c.ins, c.out, c.at, c.view, c.off
        qn, kvb = ins
        h, nope, lora = int(at["heads"]), int(at["nope"]), int(at["kv_lora"])
        key = f"const.mla_uk_t.{kvb}"
        self._const(key, ("mla_uk_t", kvb, dict(at)), DType.bf16, (h, lora, nope))
        qv, o = view(qn), view(out)
        h0, h1 = t.tile[1]          # this task's heads (tile [B, heads, kv_lora])
        return [(TaskRow(Opcode.GEMV_BF16, t.id, a0=self.mem.byte_offset(key) + 2 * hh * lora * nope,
                         a1=off(qn) + 2 * hh * qv.strides[1], a2=off(out) + 2 * hh * o.strides[1],
                         n0=0, n1=lora, k=nope, ldx=qv.strides[0], ldy=o.strides[0]), ("a0", "a1", "a2"))
                for hh in range(h0, h1)]

    @lowers('mla_v_up')
    def _lower_mla_v_up(self, c: OpCtx):
        t, cols, ins, out, at, view, off = c.t, c.cols, c.ins, c.out, c.at, c.view, c.off
        ol, kvb = ins
        h, nope, lora, vd = (int(at[k]) for k in ("heads", "nope", "kv_lora", "v_dim"))
        olv, o = view(ol), view(out)
        if olv.dtype is not DType.bf16 or olv.strides[1:] != (lora, 1):
            raise self.error(f"mla_v_up %{out}: o_lat must be bf16 with contiguous heads")
        c0, c1 = cols                # this task's columns: whole heads of v_dim (tile rule)
        if c0 % vd or c1 % vd:
            raise self.error(f"mla_v_up %{out}: tile {cols} splits a head of {vd}")
        return [(TaskRow(Opcode.GEMV_BF16, t.id, a0=off(kvb) + 2 * (hh * (nope + vd) + nope) * lora,
                         a1=off(ol) + 2 * hh * lora, a2=off(out) + 2 * hh * vd, n0=0, n1=vd, k=lora,
                         ldx=olv.strides[0], ldy=o.row_stride), ("a0", "a1", "a2"))
                for hh in range(c0 // vd, c1 // vd)]

    @lowers('mla_attention')
    def _lower_mla_attention(self, c: OpCtx):
        t, op, redirect = c.t, c.op, c.redirect
        return self._mla(t, op, redirect)

    @lowers('mla_attention_partial')
    def _lower_mla_attention_partial(self, c: OpCtx):
        t, op, redirect, at = c.t, c.op, c.redirect, c.at
        return self._mla(t, op, redirect, chunks=(t.tile[0][0], t.tile[0][1], int(at["chunks"])),
                         brows=tuple(t.tile[1]))

    @lowers('attention_combine')
    def _lower_attention_combine(self, c: OpCtx):
        t, ins, out, view, off = c.t, c.ins, c.out, c.view, c.off
        pv = view(ins[0])
        S, B, H, W = pv.shape
        h0, h1 = t.tile[1]
        b0, b1 = t.tile[0]                  # one batch row a task at B > 1 (split_rows)
        return [(TaskRow(Opcode.MLA, t.id, a0=off(ins[0]), a2=off(out), n0=b * H + h0, n1=b * H + h1,
                         k=W - 2, ldy=H, p0=B * H, p1=S, sub=MlaMode.COMBINE), ("a0", "a2"))
                for b in range(b0, b1)]

    # -- helpers ------------------------------------------------------------------------------
    def _rows(self, t) -> tuple[int, int]:
        """The task's batch rows (the tile's first range; a 1-D tile is over the batch)."""
        return tuple(t.tile[0]) if t.tile else (0, self.B)

    def _per_head_views(self, c):
        """(input, output) views of a per-head EW op (l2_norm, gated_rms_norm) whose tile must
        hold whole heads of attr head_dim."""
        self._heads_aligned(c.op, c.cols, int(c.at["head_dim"]))
        return c.view(c.ins[0]), c.view(c.out)

    def _heads_aligned(self, op, cols, d):
        if cols[0] % d or cols[1] % d:
            raise self.error(f"{op.opname} %{op.outputs[0].name}: tile {cols} splits a head of {d}")

    def _attn_res(self, t, op, redirect):
        """ATTN_RES rows for the task's batch rows. The body reads each source where it was
        written, through a per-task table of byte distances (const `rel_ptrs`); only when the
        sources differ in dtype or row stride are they first copied into a bf16 stack."""
        off = lambda n: self._off(n, redirect)  # noqa: E731
        names = set(t.ops)
        # The ATTN_RES body computes rms_norm's own math (weight, eps) after the mix: it folds
        # that one op, so it is named here, as the lowering table names the ops it implements.
        norm = next((o for o in self.s.graph.ops if o.opname == "rms_norm" and o.outputs[0].name in names
                     and o.inputs[0].name == op.outputs[0].name), None)
        if norm is None:
            raise self.error(f"attn_res %{op.outputs[0].name}: ATTN_RES needs the following rms_norm in its task")
        srcs = [v.name for v in op.inputs[2:]]
        hv = self._v(op.outputs[0].name, redirect)
        H = hv.shape[-1]
        b0, b1 = self._rows(t)
        views = [self._v(n, redirect) for n in srcs]
        rows = []
        if all(v.dtype is DType.bf16 and v.row_stride == views[0].row_stride for v in views):
            addrs, ldx = [off(n) for n in srcs], views[0].row_stride
        else:
            stack = self._scratch(f"scratch.t{t.id}.{op.outputs[0].name}.stack", DType.bf16, (len(srcs), self.B, H))
            base = self.mem.byte_offset(stack)
            addrs, ldx = [base + 2 * j * self.B * H for j in range(len(srcs))], H
            for j, n in enumerate(srcs):
                rows += self._copy_rows(t, off(n), views[j], addrs[j], H, DType.bf16, H)
        table = self._const(f"const.attn_res_ptrs.t{t.id}.{op.outputs[0].name}", ("rel_ptrs", ()),
                            DType.i64, (len(srcs),))
        ta = self.mem.byte_offset(table)
        self.consts[table] = ("rel_ptrs", tuple(a - ta for a in addrs))
        y = norm.outputs[0].name
        self.done.add(y)
        if self._v(y, redirect).row_stride != hv.row_stride:
            raise self.error(f"attn_res %{op.outputs[0].name}: mix and norm outputs need one row stride")
        aux = f32_pair(float(op.attrs.get("eps", 1e-5)), float(norm.attrs.get("eps", 1e-5)))
        rows.append((TaskRow(Opcode.ATTN_RES, t.id, a0=ta, a1=off(op.inputs[0].name),
                             a5=off(op.inputs[1].name), a6=off(norm.inputs[1].name),
                             a2=off(op.outputs[0].name), a7=off(y), n0=b0, n1=b1, k=H, ldx=ldx,
                             ldy=hv.row_stride, p1=len(srcs), aux=aux),
                     ("a0", "a1", "a2", "a5", "a6", "a7")))
        return rows

    def _expert(self, t, op, redirect, glu: bool):
        """moe_gate_up (`glu`: GLU mode) / moe_down (DOWN): one EXPERT row for the task's (batch
        rows, slots, output rows) tile; the body groups the tile's pairs by expert after routing."""
        x, ids, w = (v.name for v in op.inputs[:3])
        out = op.outputs[0].name
        off = lambda n: self._off(n, redirect)  # noqa: E731
        xv, ov, wr = self._v(x, redirect), self._v(out, redirect), self.mem.regions[w]
        mx = wr.dtype is DType.u8
        (b0, b1), (j0, j1), (c0, c1) = t.tile[0], t.tile[1], t.tile[2]
        topk, rows_e = ov.shape[1], ov.shape[2]
        k = xv.shape[-1]
        if ov.strides[1:] != (rows_e, 1) or xv.strides[-1] != 1 or (not glu and xv.strides[1] != k):
            raise self.error(f"{op.opname} %{out}: needs contiguous slot rows")
        fields = ["a0", "a1", "a2", "a4"] + (["a3"] if mx else []) + (["a5"] + (["a6"] if mx else []) if glu else [])
        w3 = op.inputs[3].name if glu else None
        ep = 0
        if int(op.attrs.get("ep_ranks", 1)) > 1:    # expert parallel: this rank's experts (A7, plan.py)
            from fusec.ir.ops.comm import group_index
            n_local = wr.shape[0] if len(wr.shape) == 3 else wr.shape[0] // rows_e   # [E, rows, K] weights
            ep = (group_index(self.rank, int(op.attrs["ep_ranks"]), int(op.attrs.get("ep_stride", 1)))
                  * n_local << 32) | n_local
        return [(TaskRow(Opcode.EXPERT_MXFP4 if mx else Opcode.EXPERT_BF16, t.id, a0=off(w), a1=off(x), a7=ep,
                         a2=off(out), a3=self.mem.byte_offset(w + ".scale") if mx else 0, a4=off(ids),
                         a5=off(w3) if glu else 0,
                         a6=self.mem.byte_offset(w3 + ".scale") if glu and mx else 0,
                         n0=c0, n1=c1, k=k, ldx=xv.strides[0], ldy=ov.strides[0], aux=rows_e,
                         sub=ExpertMode.GLU if glu else ExpertMode.DOWN, p0=(j0 << 16) | j1, p1=topk,
                         p2=(b0 << 16) | b1), tuple(fields))]

    def _mla(self, t, op, redirect, chunks=None, brows=None):
        """MLA PARTIAL rows (+ COMBINE for an unsplit mla_attention). `chunks` = (c0, c1, S) for
        a split-sequence partial task: chunks c0..c1 of S, written to the partials value;
        `brows` = the task's batch rows (all when None; a part of them needs one chunk)."""
        ql, qpe, cache, pos = (v.name for v in op.inputs)
        at = op.attrs
        h, rope, lora = int(at["heads"]), int(at["rope"]), int(at["kv_lora"])
        if tuple(t.tile[1]) != (0, h) and chunks is None:   # the PARTIAL body covers every head
            raise self.error(f"mla_attention %{op.outputs[0].name} tiled over heads {t.tile[1]}: "
                             "only whole-head tiles are supported")
        off = lambda n: self._off(n, redirect)  # noqa: E731
        b0, b1 = brows or (0, self.B)
        rows = []
        qv = self._v(qpe, redirect)
        if qv.dtype is not DType.bf16 or qv.strides[-1] != 1:
            raise self.error(f"{op.opname} %{op.outputs[0].name}: q_pe must be bf16 with contiguous rope dims")
        c0, c1, S = chunks or (0, 1, 1)
        if (b0, b1) != (0, self.B) and c1 != c0 + 1:
            raise self.error(f"{op.opname} %{op.outputs[0].name}: a task over part of the batch takes one chunk")
        if chunks is None:
            part = self.mem.byte_offset(self._scratch(f"scratch.t{t.id}.mla_partials", DType.f32,
                                                      (S, self.B, h, lora + 2)))
        else:
            part = off(op.outputs[0].name)
        cv = self._v(cache, redirect)
        common = dict(k=lora, ldx=cv.shape[1], ldy=h, p0=self.B * h, p1=S, p2=rope,
                      aux=f32_pair(float(at["scale"])))
        rows.append((TaskRow(Opcode.MLA, t.id, a0=off(ql), a1=off(qpe), a3=off(cache), a4=off(pos),
                             a6=qv.strides[1], a7=qv.strides[0], a2=part, n0=c0 * self.B + b0, n1=(c1 - 1) * self.B + b1,
                             sub=MlaMode.PARTIAL, **common), ("a0", "a1", "a2", "a3", "a4")))
        if chunks is not None:
            return rows
        rows.append((TaskRow(Opcode.MLA, t.id, a0=part, a2=off(op.outputs[0].name), n0=0,
                             n1=self.B * h, sub=MlaMode.COMBINE, **common), ("a0", "a2")))
        return rows


def _isz(dt: DType) -> int:
    return {DType.bf16: 2, DType.f32: 4, DType.i32: 4}[dt]
