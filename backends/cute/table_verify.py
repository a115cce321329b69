"""Verify what runs: the packed task table of the CuTe megakernel against the verified Schedule.

The memory-order verifier (passes/memory_order.py) proves the Schedule's LOAD / WAIT / STORE /
SIGNAL lines race-free; the kernel reads none of them. It walks the int64 rows of the task table
(`KernelPlan.table_words()`, the words uploaded to the GPU). This module decodes those words back,
from the documented row layout (`plan.Word` and the `Opcode` / `EwOp` / `ExpertMode` / `MlaMode` / `ArgmaxMode`
docstrings in plan.py, the same source tests/cute_table_interp.py restates), never from the
lowering's own data structures:

* the rows of each CTA queue and the task each row belongs to;
* per row: its wait (event, per-step count, offset) and its signal;
* per row: the byte ranges of the arena it reads and writes, from its opcode's operands
  (addresses, row strides, column ranges, batch rows, slots; a range picked at run time, an
  expert id, a token id, a cache position, is taken over every value it can have);
* per row: its L2 prefetch range (PF_ADDR / PF_BYTES).

and checks them against the Schedule, mapping each LOAD / STORE region through the memory plan
(the arena layout: a region's box becomes byte ranges of its tensor's view):

T1  CTA c runs the tasks of the Schedule's queue (rank 0, sm c) in that order, each task's rows
    back to back; every task has rows, every row a task.
T2  a task's rows wait on exactly the task's WAITs (event, WAIT_PER_STEP = the event's per_step,
    WAIT_OFFSET = threshold - per_step), each on a row before any row of the task touches memory
    other than static weights (the kernel waits at a row's start).
T3  a task's rows signal exactly the task's SIGNAL events, each on or after the last row that
    writes memory (the kernel signals after the row's stores).
T4  every byte a row writes lies in its task's STOREs, or is private to the task: no other task's
    rows or Schedule lines touch it (per-task scratch, values computed and used inside the task);
    no row writes a weight, a constant or a step input; and the rows write every STORE byte.
T5  every byte a row reads lies in its task's LOADs, or was written by an earlier row of the same
    task, or is a lowering constant (a weight-kind region that is no graph value: RoPE tables,
    transposed MLA weights, ATTN_RES source tables).
T6  a prefetch range (the row's whole tile from PF_ADDR: what the kernel may touch, prefix or
    stripes) lies in one static weight (a weight-kind region no row writes) and inside its
    task's LOADs of that weight; only GEMV rows prefetch.
T7  (multi-rank tables, one rank's table against the replicated schedule: peers by offset) a
    task's rows wait at system scope exactly where its WAITs are at system scope, signal with
    the SIGNALs' scopes and peer offsets (SIGNAL_PEER), and write into each peer's arena
    (COMM PUSH) exactly the bytes of its STOREs to that peer offset, before the signal; a row
    may touch a peer's memory only through those words.

`check_plan(lowered, plan, base)` raises `TableVerifyError` (one line naming the rule, the task,
the CTA and the row) on the first table that breaks a rule; `verify_table` returns every
violation. It runs on every `Lowered.plan()`, i.e. whenever the backend lowers.

Byte ranges are kept symbolic (byte_sets.py): a box or operand over many rows at a few columns
is one strided run, stored as bands of rows with the same columns, so a conservative box
(every row of a 163840-row embedding table, at one column task's slice) costs what one range
does; an EXPERT row's one operand per (batch row, slot) pair is checked as one group. Set
operations are exact, and messages name the same first range and range count as a list of
merged ranges would. benchmarks/table_verify_speed.py times it on slice4 lowerings.
"""
from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass

from fusec.ir.gc_pause import gc_paused
from fusec.ir.registry import Trait
from fusec.ir.schedule import InstrKind, Schedule
from fusec.ir.types import DType, Kind

from .byte_sets import (INTER, MINUS, UNION, ByteSpace, Operand, bands_op, count_ranges, highest, left, meets,
                        merged, set_op, union_all)
from .memory import MemoryPlan, itemsize
from .plan import NO_EVENT, ArgmaxMode, CommOp, EwOp, ExpertMode, F32Flag, MlaMode, Opcode, RankWord, ScopeCode, Word
from .prefetch import prefetch_hull


class TableVerifyError(ValueError):
    """The lowered task table does not do what the verified Schedule says."""


@dataclass(frozen=True)
class TableViolation:
    rule: str
    task: int | None
    message: str
    cta: int | None = None
    row: int | None = None

    def __str__(self) -> str:
        where = "table" if self.task is None else f"task {self.task}"
        if self.cta is not None:
            where += f" (CTA {self.cta}" + (f", row {self.row})" if self.row is not None else ")")
        return f"{self.rule}: {where}: {self.message}"


def _strided(off: int, es: int, shape, strides, box) -> list:
    """Pieces of the elements `box` (per dim [lo, hi)) of a strided view at byte `off`."""
    box = [tuple(x) for x in box]
    if any(hi <= lo for lo, hi in box):
        return []
    n = len(box)
    if n == 0:
        return [(off, off + es)]
    if strides[-1] != 1:                          # element by element
        k, run, first = n, 1, 0
    else:
        # the innermost run: the last dim, grown over outer dims while every dim inside is
        # covered whole and lies contiguously
        k = n - 1
        while k > 0 and box[k] == (0, shape[k]) and strides[k - 1] == shape[k] * strides[k]:
            k -= 1
        run, first = (box[k][1] - box[k][0]) * strides[k], box[k][0] * strides[k]
    if k == 0:
        return [(off + first * es, off + (first + run) * es)]
    starts = [0]
    for d in range(k - 1):                        # outer dims listed; the one inside them a run
        lo, hi = box[d]
        starts = [x + i * strides[d] for x in starts for i in range(lo, hi)]
    lo, hi = box[k - 1]
    first += lo * strides[k - 1]
    return [(off + (x + first) * es, strides[k - 1] * es, hi - lo, run * es) for x in starts]


def _rows(addr, es, rows, ld, c0, c1) -> list:
    """Columns c0..c1 of the given rows of a [*, ld] matrix at byte `addr` (a run for a range)."""
    if c1 <= c0 or not len(rows):
        return []
    if isinstance(rows, range) and rows.step == 1 and len(rows) > 1:
        return [(addr + (rows.start * ld + c0) * es, ld * es, len(rows), (c1 - c0) * es)]
    return [(addr + (r * ld + c0) * es, addr + (r * ld + c1) * es) for r in rows]


# -- the arena -------------------------------------------------------------------------------------
class _Arena(ByteSpace):
    """The memory plan as byte sets' space (each region's rows: its last dim): which region
    holds an offset, which regions are static, constants, step inputs."""

    def __init__(self, mem: MemoryPlan, schedule: Schedule):
        super().__init__(mem.regions.values(),
                         lambda r: r.shape[-1] * itemsize(r.dtype) if len(r.shape) >= 2 else r.nbytes)
        self.mem = mem
        self.regs = sorted(mem.regions.values(), key=lambda r: r.offset)
        self.starts = [r.offset for r in self.regs]
        g = schedule.graph
        graph_regions = {mem.view(v.name).region for v in g.values() if v.name in mem.views}
        graph_regions |= {n + ".scale" for n in list(graph_regions) if n + ".scale" in mem.regions}
        self.kind = {r.name: r.kind for r in self.regs}
        # lowering constants: weight-kind regions no graph value lives in
        self.consts = {r.name for r in self.regs if r.kind is Kind.weight and r.name not in graph_regions}
        self.inputs = {mem.view(v.name).region for v in g.params if v.kind is Kind.io and v.name in mem.views}
        self.static_segs = {k for k, r in enumerate(self.seg_region) if r is not None and r.kind is Kind.weight}
        self.const_segs = {k for k, r in enumerate(self.seg_region) if r is not None and r.name in self.consts}

    def region_at(self, off: int):
        i = bisect.bisect_right(self.starts, off) - 1
        r = self.regs[i] if i >= 0 else None
        return r if r is not None and off < r.offset + r.nbytes else None


def _f32(flag: int, bit) -> int:
    return 4 if flag & bit else 2


class _Static(list):
    """The pieces of an operand that must be a static weight or lowering table."""


class _PeerWrite(list):
    """The pieces of an operand written into the arena of the rank `peer` offsets away (offsets
    in that arena: the arenas share one memory plan)."""

    def __init__(self, peer: int, pieces):
        super().__init__(pieces)
        self.peer = peer


class _Group:
    """Operands of one row, `members()` in order, that the check takes as one, `whole` (the
    pieces of their union): where the union breaks no rule none of them does, and where it
    does the members are checked one by one, so that each message names the operand it did
    before (an EXPERT row has one operand per (batch row, slot) pair: 128 at batch 16)."""

    __slots__ = ("whole", "members")

    def __init__(self, whole, members):
        self.whole, self.members = whole, members


def footprint(w, B: int, base: int, arena: _Arena, consts: dict, peer_bases=None) -> tuple[list, list]:
    """(operands read, operands written) of one row `w` (ROW_WORDS ints): per operand its pieces
    (byte ranges and strided runs, arena offsets; `_Static` for weights and tables). Stated from plan.py's opcode
    docstrings; run-time picks (expert ids, token ids, cache positions) are covered over all the
    values they can take, counted from the operand's region."""
    op = w[Word.OPCODE]
    a = [w[Word.A0], w[Word.A1], w[Word.A2], w[Word.A3], w[Word.A4], w[Word.A5], w[Word.A6], w[Word.A7]]
    n0, n1, K, ldx, ldy, aux = w[Word.N0], w[Word.N1], w[Word.K], w[Word.LDX], w[Word.LDY], w[Word.AUX]
    sub, p0, p1, p2 = w[Word.SUB], w[Word.P0], w[Word.P1], w[Word.P2]

    def at(i):                      # operand i as an arena offset
        return a[i] - base

    R, Wr = [], []

    def RS(iv):                     # an operand the docstrings make a weight or table: static
        R.append(_Static(iv))

    allb = range(B)
    if op == Opcode.NOP:
        return R, Wr
    if op in (Opcode.GEMV_BF16, Opcode.GEMV_MXFP4):
        if op == Opcode.GEMV_BF16:
            # Rows n0 .. n1 of the matrix. With GEMV_TILED the same rows' bytes lie in the 16-row
            # tiles around them, inside the same static weight region (weight_tiles.py tiles only
            # regions of whole tiles with every matrix base on one): the static weight the task
            # LOADs, in another order.
            RS([(at(0) + n0 * K * 2, at(0) + n1 * K * 2)])
        else:
            RS([(at(0) + n0 * K // 2, at(0) + n1 * K // 2)])
            RS([(at(3) + n0 * K // 32, at(3) + n1 * K // 32)])
        R.append(_rows(at(1), 2, allb, ldx, 0, K))
        Wr.append(_rows(at(2), _f32(p1, F32Flag.OUT), allb, ldy, n0, n1))
    elif op == Opcode.RMSNORM:
        R.append(_rows(at(0), 2, range(n0, n1), ldx, 0, K))
        RS([(at(1), at(1) + 2 * K)])
        Wr.append(_rows(at(2), 2, range(n0, n1), ldy, 0, K))
    elif op in (Opcode.EXPERT_BF16, Opcode.EXPERT_MXFP4):
        mx = op == Opcode.EXPERT_MXFP4
        b0, b1, s0, s1, rows_e = p2 >> 16, p2 & 0xFFFF, p0 >> 16, p0 & 0xFFFF, aux
        glu = sub == ExpertMode.GLU
        for b in range(b0, b1):                                   # router ids of the pairs
            R.append([(at(4) + (b * p1 + s0) * 4, at(4) + (b * p1 + s1) * 4)])
        wts = [(0, 3), (5, 6)] if glu else [(0, 3)]
        for wi, si in wts:                                        # rows n0..n1 of every expert
            rb = K // 2 if mx else K * 2
            reg = arena.region_at(at(wi))       # the experts: as many as the weight holds
            E = reg.nbytes // (rows_e * rb) if reg is not None and rows_e else 0
            RS([(at(wi) + n0 * rb, rows_e * rb, E, (n1 - n0) * rb)] if E > 0 else [(-1, 0)])
            if mx:
                sb = K // 32
                RS([(at(si) + n0 * sb, rows_e * sb, E, (n1 - n0) * sb)] if E > 0 else [(-1, 0)])
        # one operand per batch row (GLU) or (batch row, slot) pair, taken as one group: per slot
        # a run over the batch rows
        bs, ss, eo = range(b0, b1), range(s0, s1), 2 if glu else 4
        if glu:
            R.append(_Group(_rows(at(1), 2, bs, ldx, 0, K), lambda: [_rows(at(1), 2, [b], ldx, 0, K) for b in bs]))
        else:
            R.append(_Group([p for s in ss for p in _rows(at(1), 2, bs, ldx, s * K, (s + 1) * K)],
                            lambda: [_rows(at(1), 2, [b], ldx, s * K, (s + 1) * K) for b in bs for s in ss]))
        Wr.append(_Group([p for s in ss for p in _rows(at(2), eo, bs, ldy, s * rows_e + n0, s * rows_e + n1)],
                         lambda: [_rows(at(2), eo, [b], ldy, s * rows_e + n0, s * rows_e + n1) for b in bs for s in ss]))
    elif op == Opcode.EW:
        _ew(w, at, B, arena, R, Wr, RS)
    elif op == Opcode.ROUTER:
        R.append(_rows(at(0), _f32(p1, F32Flag.A0), range(n0, n1), ldx, 0, K))
        RS([(at(1), at(1) + 4 * K)])
        Wr.append(_rows(at(2), 4, range(n0, n1), ldy, 0, p0))
        Wr.append(_rows(at(3), 4, range(n0, n1), ldy, 0, p0))
    elif op == Opcode.KDA:
        H, D = p0, K
        for i in range(n0, n1):
            b, h = divmod(i, H)
            for q in (0, 1, 5):
                R.append(_rows(at(q), 2, [b], ldx, h * D, (h + 1) * D))
            R.append(_rows(at(6), 4, [b], ldx, h * D, (h + 1) * D))
            es = _f32(p1, F32Flag.A0)
            R.append([(at(4) + (b * H + h) * es, at(4) + (b * H + h + 1) * es)])
            st = (at(3) + (b * H + h) * D * D * 4, at(3) + (b * H + h + 1) * D * D * 4)
            R.append([st])
            Wr.append([st])
            Wr.append(_rows(at(2), 4, [b], ldy, h * D, (h + 1) * D))
    elif op == Opcode.ATTN_RES:
        J = p1
        table = arena.region_at(at(0))
        spec = consts.get(table.name) if table is not None and at(0) == table.offset else None
        rel = spec[1] if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "rel_ptrs" else ()
        RS([(at(0), at(0) + 8 * J)])
        for j in range(J):
            if j >= len(rel):
                R.append([(-1, 0)])     # a source the table does not name: no address the check accepts
                continue
            R.append(_rows(at(0) + rel[j], 2, range(n0, n1), ldx, 0, K))
        for q in (1, 5, 6):
            RS([(at(q), at(q) + 2 * K)])
        Wr.append(_rows(at(2), 2, range(n0, n1), ldy, 0, K))
        Wr.append(_rows(at(7), 2, range(n0, n1), ldy, 0, K))
    elif op == Opcode.MLA:
        H, S = ldy, p1
        if sub == MlaMode.PARTIAL:
            Rr, L = p2, ldx
            for i in range(n0, n1):
                c, b = divmod(i, B)
                R.append([(at(0) + b * H * K * 2, at(0) + (b + 1) * H * K * 2)])
                for h in range(H):
                    e0 = b * a[7] + h * a[6]
                    R.append([(at(1) + e0 * 2, at(1) + (e0 + Rr) * 2)])
                lo, hi = c * L // S, (c + 1) * L // S
                row = K + Rr
                R.append([(at(3) + (b * L + lo) * row * 2, at(3) + (b * L + hi) * row * 2)])
                R.append([(at(4) + 4 * b, at(4) + 4 * b + 4)])
                blk = H * (K + 2) * 4
                Wr.append([(at(2) + (c * B + b) * blk, at(2) + (c * B + b + 1) * blk)])
        else:
            for i in range(n0, n1):
                b, h = divmod(i, H)
                for c in range(S):
                    e = ((c * B + b) * H + h) * (K + 2)
                    R.append([(at(0) + e * 4, at(0) + (e + K + 2) * 4)])
                Wr.append([(at(2) + i * K * 2, at(2) + (i + 1) * K * 2)])
    elif op == Opcode.ATTENTION:
        H, D, grp = p0, K, p2
        kvw = (H // grp) * D if grp else 0
        L = p1 // kvw if kvw else 0
        for i in range(n0, n1):
            b, h = divmod(i, H)
            R.append(_rows(at(0), 2, [b], ldx, h * D, (h + 1) * D))
            kv = (h // grp) * D
            for q in (1, 5):
                R.append(_rows(at(q) + b * p1 * 2, 2, range(L), kvw, kv, kv + D))
            R.append([(at(4) + 4 * b, at(4) + 4 * b + 4)])
            Wr.append(_rows(at(2), 2, [b], ldy, h * D, (h + 1) * D))
    elif op == Opcode.ARGMAX:
        if sub == ArgmaxMode.COMBINE:       # K chunks' pairs of rows n0..n1, LDX floats a chunk
            R.append(_rows(at(0), 4, range(K), ldx, 2 * n0, 2 * n1))
            Wr.append([(at(2) + 4 * n0, at(2) + 4 * n1)])
        else:
            R.append(_rows(at(0), _f32(p1, F32Flag.A0), range(n0, n1), ldx, 0, K))
            pair = 8 if sub == ArgmaxMode.PARTIAL else 4
            Wr.append([(at(2) + pair * n0, at(2) + pair * n1)])
    elif op == Opcode.COMM:
        ea, eo, G = _f32(p1, F32Flag.A0), _f32(p1, F32Flag.OUT), p2
        R.append(_rows(at(0), ea, allb, ldx, n0, n1))
        if sub == CommOp.PUSH:
            if p0 and peer_bases is not None and p0 in peer_bases:
                Wr.append(_PeerWrite(p0, _rows(a[2] - peer_bases[p0], ea, allb, ldy, n0, n1)))
            else:           # offset 0 (or no such peer): the row writes this rank's own arena
                Wr.append(_rows(at(2), ea, allb, ldy, n0, n1))
        elif sub in (CommOp.ALL_REDUCE, CommOp.ALL_GATHER):
            for d in range(1, G):       # slots [G, B, N1] contiguous; slot 0 is never written
                R.append(_rows(at(1) + d * B * n1 * ea, ea, allb, n1, n0, n1))
            if sub == CommOp.ALL_REDUCE:
                Wr.append(_rows(at(2), eo, allb, ldy, n0, n1))
            else:
                Wr.append([q for j in range(G) for q in _rows(at(2), eo, allb, ldy, j * n1 + n0, j * n1 + n1)])
        else:
            R.append([(-1, 0)])
    else:
        R.append([(-1, 0)])             # an opcode this decoder does not know: nothing it reads is accepted
    return R, Wr


def _ew(w, at, B, arena, R, Wr, RS) -> None:
    """EW rows: columns N0..N1 of batch rows K >> 16 .. K & 0xFFFF, every row when K = 0 (plan.EwOp)."""
    n0, n1, ldx, ldy = w[Word.N0], w[Word.N1], w[Word.LDX], w[Word.LDY]
    sub, p0, fl, p2 = w[Word.SUB], w[Word.P0], w[Word.P1], w[Word.P2]
    b0, b1 = (w[Word.K] >> 16, w[Word.K] & 0xFFFF) if w[Word.K] else (0, B)
    allb = range(b0, b1)
    ea, eb, eo = _f32(fl, F32Flag.A0), _f32(fl, F32Flag.A1), _f32(fl, F32Flag.OUT)
    e3 = _f32(fl, F32Flag.A3)
    if sub == EwOp.APPEND:                   # cache (A1)[b, pos[b], c] = a[b, c]: every row pos can name
        R.append(_rows(at(0), ea, allb, ldx, n0, n1))
        R.append([(at(3) + 4 * b0, at(3) + 4 * b1)])
        L = p0 // ldy if ldy else 0
        for b in allb:
            Wr.append(_rows(at(1) + b * p0 * eb, eb, range(L), ldy, n0, n1))
        return
    if sub == EwOp.WSUM:                     # sum_j<P2 b[b, j] * a[b, j, c], slot stride P0
        for b in allb:
            for j in range(p2):
                R.append([(at(0) + (b * ldx + j * p0 + n0) * ea, at(0) + (b * ldx + j * p0 + n1) * ea)])
        R.append([(at(1) + 4 * b0 * p2, at(1) + 4 * b1 * p2)])
    elif sub == EwOp.GATHER:                 # table (A0)[ids[b], c]: every row an id can name
        reg = arena.region_at(at(0))       # the ids: as many rows as the table holds
        rows = reg.nbytes // (ldx * ea) if reg is not None and ldx else 0
        RS(_rows(at(0), ea, range(rows), ldx, n0, n1) or [(-1, 0)])
        R.append([(at(3) + 4 * b0, at(3) + 4 * b1)])
    else:
        R.append(_rows(at(0), ea, allb, ldx, n0, n1))
        if sub in (EwOp.ADD, EwOp.SIGMOID_MUL, EwOp.SITU_GLU, EwOp.SILU_MUL, EwOp.GATED_RMS, EwOp.KDA_GATE):
            R.append(_rows(at(1), eb, allb if p0 else [0], p0, n0, n1))
        if sub == EwOp.KDA_GATE:             # A_log per head: element c // P2
            RS([(at(3) + (n0 // p2) * e3, at(3) + ((n1 - 1) // p2 + 1) * e3)])
        elif sub in (EwOp.GATED_RMS, EwOp.RMS):   # norm weight: element c % P2
            if n1 - n0 >= p2:
                RS([(at(3), at(3) + p2 * e3)])
            else:
                lo, hi = n0 % p2, (n1 - 1) % p2 + 1
                RS([(at(3) + lo * e3, at(3) + hi * e3)] if lo < hi else
                         [(at(3) + lo * e3, at(3) + p2 * e3), (at(3), at(3) + hi * e3)])
        elif sub == EwOp.CONV:               # state [B, C, W-1] (batch stride P0) in place, w [C, W]
            Wd = p2
            for b in allb:
                st = (at(1) + (b * p0 + n0 * (Wd - 1)) * eb, at(1) + (b * p0 + n1 * (Wd - 1)) * eb)
                R.append([st])
                Wr.append([st])
            RS([(at(3) + n0 * Wd * e3, at(3) + n1 * Wd * e3)])
        elif sub == EwOp.ROPE:               # pos (A3) and inv_freq (A4, fp32 [P2 / 2])
            R.append([(at(3) + 4 * b0, at(3) + 4 * b1)])
            RS([(at(4), at(4) + 4 * (p2 // 2))])
        elif sub not in (EwOp.ADD, EwOp.SIGMOID_MUL, EwOp.SITU_GLU, EwOp.SILU_MUL, EwOp.SIGMOID, EwOp.COPY,
                         EwOp.L2_NORM):
            R.append([(-1, 0)])                # an EW sub-opcode this decoder does not know
    Wr.append(_rows(at(2), eo, allb, ldy, n0, n1))


# -- the check -------------------------------------------------------------------------------------
def _task_bytes(s: Schedule, mem: MemoryPlan, arena: _Arena):
    """Per task: (LOAD bytes, STORE bytes, STORE bytes its rows must write) through the memory
    plan, as byte sets. A STORE of a view (slice, reshape) whose bytes the task loads is already
    in place."""
    g = s.graph
    mx = {v.name for v in g.params if v.type.dtype is DType.mxfp4}
    # results that are views of their operand's bytes (Trait.view; memory.py): stored by nobody
    views = {o.outputs[0].name for o in g.ops if Trait.view in o.opdef.traits}
    out = {}
    cache: dict = {}
    for t in s.tasks:
        ld, st, must = [], [], []
        for i in t.instrs:
            if i.kind not in (InstrKind.LOAD, InstrKind.STORE) or i.region.rank not in (None, t.rank):
                continue
            key = (i.region.tensor, i.region.box)
            iv = cache.get(key)
            if iv is None:
                iv = cache[key] = arena.bytes_of(_region_bytes(mem, i.region.tensor, i.region.box,
                                                               i.region.tensor in mx))
            (ld if i.kind is InstrKind.LOAD else st).append(iv)
            if i.kind is InstrKind.STORE and i.region.tensor not in views:
                must.append(iv)
        ld, st, must = union_all(ld), union_all(st), union_all(must)
        view_st = set_op(st, must, MINUS)
        out[t.id] = (ld, st, union_all([must, set_op(view_st, ld, MINUS)]))
    return out


def _region_bytes(mem: MemoryPlan, name: str, box, mxfp4: bool) -> list:
    if name not in mem.views:
        return [(-1, 0)]
    if mxfp4:       # packed E2M1 pairs [.., K/2] and e8m0 scales [.., K/32] (memory.build_memory_plan)
        out = []
        for reg, div in ((name, 2), (name + ".scale", 32)):
            v = mem.view(reg)
            b = list(box[:-1]) + [(box[-1][0] // div, -(-box[-1][1] // div))]
            out += _strided(mem.regions[v.region].offset + v.elem_offset, 1, v.shape, v.strides, b)
        return out
    v = mem.view(name)
    return _strided(mem.regions[v.region].offset + v.elem_offset * itemsize(v.dtype), itemsize(v.dtype),
                    v.shape, v.strides, box)


def verify_table(schedule: Schedule, mem: MemoryPlan, words, bounds, num_events: int, batch: int,
                 consts: dict, base: int = 0, peer_bases=None) -> list[TableViolation]:
    """Every violation of T1-T7 by the packed table `words` (rows in queue order) with CTA
    queue `bounds` ([start, end) per CTA). A multi-rank schedule's table is one rank's, with
    `peer_bases[p]` the base its PUSH rows' peer addresses are relative to."""
    # millions of small tuples, many kept (the operand cache): see fusec.ir.gc_pause
    with gc_paused():
        return _verify(schedule, mem, words, bounds, batch, consts, base, peer_bases)


def _verify(schedule: Schedule, mem: MemoryPlan, words, bounds, batch: int, consts: dict, base: int,
            peer_bases=None):
    out: list[TableViolation] = []
    s = schedule
    ranked = s.ranks > 1
    if ranked and peer_bases is None:
        peer_bases = {p: base for p in range(s.ranks)}
    if ranked and any(len(w) <= max(RankWord) for w in words):
        return [TableViolation("T7", None, f"a {s.ranks}-rank table needs rows of {max(RankWord) + 1} words "
                                           "(scopes and signal peers)")]
    B = int(s.dims["B"])
    if batch != B:
        out.append(TableViolation("T1", None, f"the kernel runs batch {batch}, the schedule batch {B}"))
    n = len(s.tasks)
    # -- T1: queues ----------------------------------------------------------------------------
    rows_of: dict[int, list[int]] = defaultdict(list)
    cta_of: dict[int, int] = {}
    for c, (lo, hi) in enumerate(bounds):
        seq = []
        for r in range(lo, hi):
            tid = words[r][Word.TASK_ID]
            if not 0 <= tid < n:
                out.append(TableViolation("T1", tid, "row names no task of the schedule", c, r))
                continue
            if seq and seq[-1] == tid and rows_of[tid][-1] == r - 1:
                rows_of[tid].append(r)
                continue
            if tid in cta_of:
                out.append(TableViolation("T1", tid, "the task's rows are not back to back on one CTA", c, r))
            cta_of[tid] = c
            seq.append(tid)
            rows_of[tid].append(r)
        want = s.queues.get((0, c), [])
        if seq != list(want):
            k = next((i for i, (x, y) in enumerate(zip(seq, want)) if x != y), min(len(seq), len(want)))
            out.append(TableViolation("T1", None, f"CTA {c} runs tasks {seq[k:k + 3]}... from position {k}, the "
                                                  f"schedule's queue (rank 0, sm {c}) has {list(want[k:k + 3])}...", c))
    for (rank, sm) in s.queues:
        if rank == 0 and sm >= len(bounds) and s.queues[(rank, sm)]:
            out.append(TableViolation("T1", None, f"the schedule's queue (rank 0, sm {sm}) has no CTA"))
    for t in s.tasks:
        if t.id not in rows_of:
            out.append(TableViolation("T1", t.id, "the task has no row in the table"))
    if out:
        return out
    # -- per row: decode -------------------------------------------------------------------------
    arena = _Arena(mem, s)
    sched = _task_bytes(s, mem, arena)
    per_step = {e.id: e.per_step for e in s.events if e.rank == 0}
    static = arena.static_segs          # weight regions, whole: a byte set's segments say it
    ops = {}
    peer_w: dict[int, list] = {}        # row -> [(peer offset, byte set)] (T7)
    for r, w in enumerate(words):
        try:
            rd, wr = footprint(w, B, base, arena, consts, peer_bases if ranked else None)
        except Exception as e:      # words no body could run: rejected, never a crash
            rd, wr = [[(-1, 0)]], []
            out.append(TableViolation("T5", w[Word.TASK_ID], f"row cannot be decoded ({type(e).__name__}: {e})",
                                      None, r))
        if any(isinstance(x, _PeerWrite) for x in wr):
            peer_w[r] = [(x.peer, arena.bytes_of(list(x))) for x in wr if isinstance(x, _PeerWrite)]
            wr = [x for x in wr if not isinstance(x, _PeerWrite)]
        # per operand: its bytes (a group's: their union), whether it must be static, its group
        ops[r] = ([(arena.operand(x.whole), False, x) if isinstance(x, _Group) else
                   (arena.operand(x), isinstance(x, _Static), None) for x in rd],
                  [(arena.operand(x.whole), x) if isinstance(x, _Group) else (arena.operand(x), None) for x in wr])
    touched = _Touched(s.tasks, sched, rows_of, ops)
    written_anywhere = None             # built for the first prefetch (T6)
    for t in s.tasks:
        rows = rows_of[t.id]
        c = cta_of[t.id]
        ld, st, must = sched[t.id]
        # -- T2: waits ---------------------------------------------------------------------------
        want = Counter()
        for i in t.instrs:
            if i.kind is InstrKind.WAIT:
                ps = per_step.get(i.event)
                want[(i.event, ps, None if ps is None else i.threshold - ps)] += 1
        got = Counter()
        last_wait, first_touch = -1, None
        for k, r in enumerate(rows):
            w = words[r]
            if w[Word.WAIT_EVENT] != NO_EVENT:
                got[(w[Word.WAIT_EVENT], w[Word.WAIT_PER_STEP], w[Word.WAIT_OFFSET])] += 1
                last_wait = k
            rd, wr = ops[r]
            if first_touch is None and (any(seg not in static for o, _, _ in rd for seg in o.bytes)
                                        or any(o.bytes for o, _ in wr)):
                first_touch = k
        if got != want:
            miss, extra = want - got, got - want
            out.append(TableViolation("T2", t.id, "the rows wait on " + _waits(got) + ", the schedule's task on "
                                      + _waits(want) + (f" (missing {_waits(miss)})" if miss else "")
                                      + (f" (extra {_waits(extra)})" if extra else ""), c))
        elif first_touch is not None and last_wait > first_touch:
            out.append(TableViolation("T2", t.id, f"row {rows[first_touch]} reads or writes produced data before the "
                                                  f"wait on row {rows[last_wait]}", c, rows[first_touch]))
        # -- T3: signals -------------------------------------------------------------------------
        want_s = Counter(i.event for i in t.instrs if i.kind is InstrKind.SIGNAL)
        got_s = Counter()
        first_sig, last_write = None, -1
        for k, r in enumerate(rows):
            e = words[r][Word.SIGNAL_EVENT]
            if e != NO_EVENT:
                got_s[e] += 1
                first_sig = k if first_sig is None else first_sig
            if any(o.bytes for o, _ in ops[r][1]) or r in peer_w:
                last_write = k
        if got_s != want_s:
            out.append(TableViolation("T3", t.id, f"the rows signal {_evs(got_s)}, the schedule's task {_evs(want_s)}", c))
        elif first_sig is not None and first_sig < last_write:
            out.append(TableViolation("T3", t.id, f"row {rows[first_sig]} signals e{words[rows[first_sig]][Word.SIGNAL_EVENT]} "
                                                  f"before row {rows[last_write]} stores", c, rows[first_sig]))
        if ranked:
            _check_ranked(t, s.ranks, rows, words, peer_w, mem, arena, c, out)
        # -- T4 / T5: bytes, operand by operand ---------------------------------------------------
        written: dict = {}                  # what the task's rows before this one wrote
        data = {k: v for k, v in ld.items() if k not in static}       # loaded bytes that are no weight
        read = []
        for r in rows:
            rd_ops, wr_ops = ops[r]

            def read_rule(o, must_static):
                iv, names = o.bytes, o.names
                if len(names) != 1:
                    return TableViolation("T5", t.id, f"an operand read spans {_regions(arena, o)}: one operand is "
                                                      f"one tensor", c, r)
                if must_static and arena.kind.get(next(iter(names))) is not Kind.weight:
                    return TableViolation("T5", t.id, f"reads {_where(arena, iv)} as a weight or table, but it is "
                                                      f"{arena.kind[next(iter(names))].value} data", c, r)
                if left(iv, (ld, written), arena.const_segs):
                    bad = {k: v for k, v in set_op(set_op(iv, ld, MINUS), written, MINUS).items()
                           if k not in arena.const_segs}
                    return TableViolation("T5", t.id, f"reads {_where(arena, bad)}, which none of the task's LOADs "
                                                      f"(nor an earlier row of it) covers", c, r)
                return None

            def write_rule(o):
                iv, names = o.bytes, o.names
                if len(names) != 1:
                    return TableViolation("T4", t.id, f"an operand write spans {_regions(arena, o)}: one operand is "
                                                      f"one tensor", c, r)
                if names & (arena.consts | arena.inputs) or arena.kind.get(next(iter(names))) is Kind.weight:
                    return TableViolation("T4", t.id, f"writes {_where(arena, iv)}, a weight, constant or step "
                                                      f"input", c, r)
                if left(iv, (st,), ()):
                    other = _others(arena, touched, set_op(iv, st, MINUS), t.id)
                    if other:
                        tid, (a, b) = other
                        return TableViolation("T4", t.id, f"writes {_where_range(arena, a, b)} outside its STOREs, "
                                                          f"bytes task {tid} also uses", c, r)
                return None

            for o, must_static, group in rd_ops:
                if not o.bytes:
                    continue
                v = read_rule(o, must_static)
                if v is not None and group is not None:     # which of the group's operands
                    for m in group.members():
                        m = arena.operand(m)
                        v = read_rule(m, must_static) if m.bytes else None
                        if v is not None:
                            out.append(v)
                elif v is not None:
                    out.append(v)
                if data and not data.keys().isdisjoint(o.bytes):
                    read.append(o.bytes)
            row_writes = []
            for o, group in wr_ops:
                if not o.bytes:
                    continue
                v = write_rule(o)
                if v is not None and group is not None:
                    for m in group.members():
                        m = arena.operand(m)
                        v = write_rule(m) if m.bytes else None
                        if v is not None:
                            out.append(v)
                elif v is not None:
                    out.append(v)
                row_writes.append(o.bytes)
            if row_writes:
                written = union_all([written] + row_writes)
        unwritten = set_op(must, written, MINUS)
        if unwritten:
            out.append(TableViolation("T4", t.id, f"the rows never write {_where(arena, unwritten)} of the task's "
                                                  f"STOREs", c))
        # every loaded byte of data that is not a weight is read (an address shifted inside a
        # loaded tensor leaves some unread), except a view's bytes the task stores as they are.
        # Weights are left out: the tile pass may load more of a weight than a body reads (a
        # per-head vector whole, an MLA head's key rows next to the value rows it reads)
        unread = set_op(set_op(data, union_all(read), MINUS), set_op(st, must, MINUS), MINUS) if data else data
        if unread:
            out.append(TableViolation("T5", t.id, f"the rows never read {_where(arena, unread)} of the task's "
                                                  f"LOADs", c))
        # -- T6: prefetch ------------------------------------------------------------------------
        for r in rows:
            w = words[r]
            nb = w[Word.PF_BYTES]
            if not nb:
                continue
            if written_anywhere is None:
                written_anywhere = union_all([o.bytes for r2 in ops for o, _ in ops[r2][1]])
            # What the kernel may touch: the row's tile from PF_ADDR (prefix or stripes of it,
            # KernelPlan.gemv_pf), not only PF_BYTES
            nb = prefetch_hull(w[Word.OPCODE], w[Word.K], w[Word.N0], w[Word.N1], nb)
            a0 = w[Word.PF_ADDR] - base
            iv = arena.bytes_of([(a0, a0 + max(nb, 16))])
            reg = arena.region_at(a0)
            if not nb or reg is None or a0 + nb > reg.offset + reg.nbytes or reg.kind is not Kind.weight \
                    or meets(iv, written_anywhere):
                what = "no region" if reg is None else f"'{reg.name}' ({reg.kind.value})"
                out.append(TableViolation("T6", t.id, f"prefetches {nb} bytes at arena offset {a0} in {what}: only "
                                                      f"static weights may be prefetched across a wait", c, r))
            elif set_op(iv, ld, MINUS):       # the task's LOADs of that weight: its LOADs there
                out.append(TableViolation("T6", t.id, f"prefetches {_where(arena, iv)}, outside the task's LOADs of "
                                                      f"'{reg.name}'", c, r))
    return out


def _check_ranked(t, R: int, rows, words, peer_w, mem: MemoryPlan, arena: _Arena, c: int, out: list) -> None:
    """T7 for one task of a multi-rank table (module docstring)."""
    sysc = int(ScopeCode.SYS)

    def scope(sc) -> int:
        return sysc if sc.value == "sys" else int(ScopeCode.GPU)
    want_w = Counter((i.event, scope(i.scope)) for i in t.instrs if i.kind is InstrKind.WAIT)
    got_w = Counter((words[r][Word.WAIT_EVENT], words[r][RankWord.WAIT_SCOPE]) for r in rows
                    if words[r][Word.WAIT_EVENT] != NO_EVENT)
    if got_w != want_w:
        out.append(TableViolation("T7", t.id, "the rows wait on " + _scoped(got_w) + ", the schedule's task on "
                                  + _scoped(want_w), c))
    want_s = Counter((i.event, scope(i.scope), (i.peer or 0) % R) for i in t.instrs if i.kind is InstrKind.SIGNAL)
    got_s = Counter((words[r][Word.SIGNAL_EVENT], words[r][RankWord.SIGNAL_SCOPE], words[r][RankWord.SIGNAL_PEER])
                    for r in rows if words[r][Word.SIGNAL_EVENT] != NO_EVENT)
    if got_s != want_s:
        out.append(TableViolation("T7", t.id, "the rows signal " + _scoped(got_s) + ", the schedule's task "
                                  + _scoped(want_s), c))
    want_p: dict[int, list] = defaultdict(list)
    for i in t.instrs:
        if i.kind is InstrKind.STORE and i.region.rank not in (None, t.rank):
            want_p[i.region.rank].append(arena.bytes_of(_region_bytes(mem, i.region.tensor, i.region.box, False)))
    got_p: dict[int, list] = defaultdict(list)
    for r in rows:
        for p, iv in peer_w.get(r, ()):
            got_p[p].append(iv)
    for p in sorted(set(want_p) | set(got_p)):
        want, got = union_all(want_p.get(p, [])), union_all(got_p.get(p, []))
        if set_op(want, got, MINUS) or set_op(got, want, MINUS):
            what = f"write {_where(arena, got)}" if got else "write nothing"
            out.append(TableViolation("T7", t.id, f"into the arena of rank offset {p} the rows {what}; the "
                                      + (f"schedule's STOREs there are {_where(arena, want)}" if want else
                                         "schedule's task stores nothing there"), c))


def _scoped(c: Counter) -> str:
    if not c:
        return "nothing"
    names = {int(v): v.name.lower() for v in ScopeCode}
    return ", ".join(f"e{k[0]} at {names.get(k[1], k[1])} scope" + (f" to rank offset {k[2]}" if len(k) > 2 and k[2]
                                                                    else "") + (f" x{n}" if n > 1 else "")
                     for k, n in sorted(c.items()))


class _Touched:
    """The bytes each task touches (its LOADs, STOREs and its rows' operands): per segment the
    tasks that touch it, and, built for a segment when first asked, the bytes of it that two or
    more tasks touch. A task's private write (outside its STOREs) may not meet those: its own
    bytes are the write's, so another task's bytes there are bytes two tasks touch."""

    def __init__(self, tasks, sched, rows_of, ops):
        self.sets: dict = {}
        self.seg_tasks: dict = defaultdict(list)
        for t in tasks:
            ld, st, _ = sched[t.id]
            sets = [ld, st] + [o.bytes for r in rows_of[t.id] for o, _ in ops[r][1]] \
                + [o.bytes for r in rows_of[t.id] for o, _, _ in ops[r][0]]
            self.sets[t.id] = sets
            for k in set().union(*sets):
                self.seg_tasks[k].append(t.id)
        self._shared: dict = {}
        self._task: dict = {}

    def task(self, u) -> dict:
        got = self._task.get(u)
        if got is None:
            got = self._task[u] = union_all(self.sets[u])
        return got

    def shared(self, k) -> list:
        """The bands of segment k that two or more tasks touch."""
        got = self._shared.get(k)
        if got is None:
            acc, got = [], []
            for u in self.seg_tasks[k]:
                mine = union_all([{k: S[k]} for S in self.sets[u] if k in S]).get(k, [])
                got = bands_op(got, bands_op(mine, acc, INTER), UNION)
                acc = bands_op(acc, mine, UNION)
            self._shared[k] = got
        return got


def _others(arena: _Arena, touched: _Touched, private: dict, tid):
    """(task, range) of some other task touching a byte of `private`, or None: the first merged
    range of `private` that another task's bytes meet, and of those tasks' merged ranges meeting
    it the last in (start, end, task) order, cut to it."""
    if not any(bands_op(bands, touched.shared(k), INTER) for k, bands in private.items()):
        return None
    hit = [u for u in sorted({u for k in private for u in touched.seg_tasks[k] if u != tid})
           if meets(private, touched.task(u))]
    for a, b in merged(arena, private):
        best = None
        for u in hit:
            for s, e in merged(arena, touched.task(u), lo=a):
                if s >= b:
                    break
                if e > a and (best is None or (s, e, u) > best):
                    best = (s, e, u)
        if best is not None:
            s, e, u = best
            return u, (max(a, s), min(b, e))
    return None


def _regions(arena: _Arena, o: Operand) -> str:
    if not o.names:
        return f"bytes [{o.lo}, {highest(arena, o.bytes)}) outside every region of the arena"
    return "regions " + ", ".join(f"'{n}'" for n in sorted(o.names))


def _waits(c: Counter) -> str:
    if not c:
        return "nothing"
    return ", ".join(f"e{e} (per_step {p}, offset {o})" + (f" x{k}" if k > 1 else "") for (e, p, o), k in sorted(
        c.items(), key=lambda x: (x[0][0], str(x[0][1:]))))


def _evs(c: Counter) -> str:
    return ", ".join(f"e{e}" + (f" x{k}" if k > 1 else "") for e, k in sorted(c.items())) or "nothing"


def _where(arena: _Arena, S: dict) -> str:
    """The first byte range of byte set S, named in its region, and how many more there are."""
    a, b = next(merged(arena, S))
    return _where_range(arena, a, b, count_ranges(arena, S) - 1)


def _where_range(arena: _Arena, a: int, b: int, more: int = 0) -> str:
    reg = arena.region_at(a) if a >= 0 else None
    if reg is None:
        return f"bytes [{a}, {b}) outside every region of the arena"
    more = f" (+{more} more ranges)" if more else ""
    return f"'{reg.name}' bytes [{a - reg.offset}, {b - reg.offset}){more}"


def check_plan(lowered, plan, base: int = 0, peer_bases=None) -> None:
    """Raise TableVerifyError with the first violation of the packed table of `plan` (addresses
    relative to `base`; a multi-rank table's peer addresses to `peer_bases`), lowered from
    `lowered.schedule`."""
    words, bounds = plan.table_words()
    errs = verify_table(lowered.schedule, lowered.memory, words, bounds, plan.num_events, plan.batch,
                        lowered.consts, base, peer_bases)
    if errs:
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise TableVerifyError(f"cute table verifier: {errs[0]}{more}")
