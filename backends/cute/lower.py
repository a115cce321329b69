"""Lowering: a verified fusec `Schedule` -> one CuTe megakernel task table (`KernelPlan`).

    low = lower_schedule(schedule)          # memory plan + rows with arena offsets
    plan = low.plan(base=arena.data_ptr())  # KernelPlan with real addresses (or base=0 on a CPU)

Rules (the core's protocol, docs/cute_backend.md):
- each Schedule task becomes one or more TaskRows, in its SM's queue, in queue order; rows of
  one task run back to back on one CTA (a CTA barrier separates them), so a fused group
  (rms_norm prologue -> GEMV tile -> rope / add epilogues) is a short row sequence;
- events map 1:1; a WAIT on `threshold` t of an event with `per_step` n becomes
  WAIT_PER_STEP = n, WAIT_OFFSET = t - n (the kernel's step counts from 1);
- a task with several WAITs gets NOP rows in front of it, one per extra wait; its SIGNAL goes on
  its last row (extra SIGNALs on trailing NOP rows), so every counter gets one increment per task;
- a prologue computed by every tile of a group (rms_norm before a GEMV) writes a per-task scratch
  tensor, never the shared value (two CTAs would race on it);
- a merged projection stores fp32 when one of its slices needs fp32; a tile's part inside a
  slice read only by a bf16 cast stores bf16 straight into the cast's output instead (a GEMV row
  of its own, cut at the slice's bounds, its weight base moved to the slice's first row) and the
  cast gets no COPY row there (`_store_cast_from_gemv`);
- an op without a body stops the lowering with one line naming it (never skipped);
- a GEMV row whose task LOADs its weight above its waits (the prefetch pass's decision) names the
  first bytes of its weight tile (PF words) so that a waiting CTA pulls them into L2;
  `check_prefetch` proves every such range is a static weight (prefetch.py).
- a replicated multi-rank schedule (R > 1) lowers to one table per rank (`lower_ranks`), each
  over the same memory plan (so the `comm` slot buffers are symmetric); WAIT / SIGNAL scopes and
  signal peer offsets go to the `RankWord`s, collectives to COMM rows (a push row's output is in
  the peer's arena: `peer_fields`), `rank_slice` to a rank-dependent view (plan.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fusec.ir.graph import Op
from fusec.ir.ops.comm import group_index
from fusec.ir.ops.core import argmax_chunk
from fusec.ir.registry import REGISTRY, Trait
from fusec.ir.schedule import InstrKind, Schedule, Scope, Task
from fusec.ir.types import DType, Kind, TensorType

from .lower_mixers import MixerLowering
from .lowerings import LOWERINGS, OpCtx, lowers, supported
from .memory import MemoryPlan, View, build_memory_plan, itemsize
from .prefetch import add_weight_prefetch, check_prefetch
from .table_verify import check_plan
from .plan import (H200_SMS, MLA_MAX_LORA, MLA_MAX_ROPE, NO_EVENT, ArgmaxMode, CommOp, EwOp, F32Flag, KernelPlan,
                   MlaMode, Opcode, ScopeCode, TaskRow, f32_bits, f32_pair)

# IR op -> EW sub-opcode for the two-operand / one-operand elementwise epilogues.
EW_BINARY = {"add": EwOp.ADD, "sigmoid_mul": EwOp.SIGMOID_MUL, "situ_glu": EwOp.SITU_GLU,
             "silu_mul": EwOp.SILU_MUL}
EW_UNARY = {"sigmoid": EwOp.SIGMOID, "cast": EwOp.COPY}


class LoweringError(ValueError):
    """The schedule needs something the megakernel backend cannot express yet."""


@dataclass(frozen=True)
class Lowered:
    """Rows hold arena byte offsets in the fields named by `addr_fields[i]` (base added by plan())."""

    schedule: Schedule
    memory: MemoryPlan
    rows: tuple[TaskRow, ...]
    addr_fields: tuple[tuple[str, ...], ...]
    queues: tuple[tuple[int, ...], ...]
    num_events: int
    batch: int
    # region name -> (an AttrTable's name, attrs) (OpDef.attr_table: rope_inv_freq) |
    # ("rel_ptrs", distances) | ("mla_uk_t", kv_b, attrs): see fill_consts
    consts: dict
    rank: int = 0                    # whose table (multi-rank: one Lowered per rank, lower_ranks)
    ranks: int = 1
    # per row: ((field, peer rank offset), ...): arena offsets in the peer's arena (COMM PUSH A2)
    peer_fields: tuple = ()
    # value -> ((lo, hi), ...): last-dim columns no row stores (a merged projection's fp32 columns
    # whose tiles store their bf16 cast directly, `_store_cast_from_gemv`); fusec.debug.bisect
    # checks the other columns
    unstored: dict = dataclasses.field(default_factory=dict)

    def plan(self, base: int = 0, peer_bases=None, **kw) -> KernelPlan:
        """The table with addresses: arena offsets + `base` (this rank's arena), offsets in a
        peer's arena (`peer_fields`) + `peer_bases[p]` (rank (rank + p) % ranks's arena as this
        process maps it; default `base`, e.g. base 0 for a table of offsets)."""
        pb = _peer_bases(base, peer_bases, self.ranks)
        pf = self.peer_fields or ((),) * len(self.rows)
        rows = [dataclasses.replace(r, **{f: base + getattr(r, f) for f in fs},
                                    **{f: pb[p] + getattr(r, f) for f, p in ps})
                for r, fs, ps in zip(self.rows, self.addr_fields, pf)]
        if self.ranks > 1:
            kw.setdefault("ranks", self.ranks)
            kw.setdefault("rank", self.rank)
        if kw.get("gemv_tiles"):
            # The rows whose weights tile_gemv_weights repacks (the binder's job) read tiles.
            from .weight_tiles import gemv_weight_regions, tiled_rows
            rows = tiled_rows(self, rows, gemv_weight_regions(self)[0])
        if kw.get("expert_tiles"):
            from .weight_tiles import expert_weight_regions
            expert_weight_regions(self)     # every expert weight tiles, or TileLayoutError
        if kw.get("expert_mx_mma"):
            from .weight_tiles import expert_mx_regions
            expert_mx_regions(self)         # every MXFP4 expert weight tiles, or TileLayoutError
        kw.setdefault("threads", 512)
        # Batch 1 streams on CUDA cores: 8 chunks in flight per lane measured 3.8% faster on the
        # H200 (slice4-e128, 3439 -> 3309 us). At batch 16 over tiled weights (weight_tiles.py) 8
        # is faster too: 7659 against 7758 us, same logits (it was 2.3% slower on row-major
        # weights; docs/results/plan_variants_h200_slice4-e128_b16_tiled_stop19.log). Batch 4
        # keeps 4 (not measured on tiles).
        kw.setdefault("unroll", 8 if self.batch == 1 or self.batch > 8 else 4)
        # MLA partial at batch 1: two m16 head tiles per block (32 heads) measured 3110 against
        # 3156 us with four, logits bit for bit the same
        # (docs/results/plan_variants_h200_slice4-e128_mla_stop20.log). At B > 4 the fewest
        # blocks, evenly filled (_mla_head_tiles), and the unrolled S = Q K^T: with both, K3's
        # MLA partial alone (96 heads, 8 chunks of 512 rows) 217 -> 194 us at B = 16, the
        # slice4-e128 step 7344 -> 7272 us (-1.0%, A/A control +0.2%; tiles alone +0.4%). At
        # B = 4 the body alone gains too (79 -> 70 us) but the step lost 1.9% (control -0.5%),
        # at B = 1 unrolled alone -0.1% (control 0.0%); logits bit for bit in every run
        # (docs/results/plan_variants_h200_slice4-e128_b*_mla_unrolled_stop32.log). In a kernel
        # with MXFP4 expert bodies the same change cost the slice4 step at B = 16 5.7% (5851 ->
        # 6206 us; plan_variants_h200_slice4_b16_mla_unrolled_stop32.log): the kernel is one
        # function, so a body's code moves the register allocation of the others.
        wide = self.batch > 4 and not any(r.opcode == Opcode.EXPERT_MXFP4 for r in rows)
        kw.setdefault("mla_head_tiles", _mla_head_tiles(rows) if wide else 2 if self.batch == 1 else 4)
        kw.setdefault("mla_unrolled", wide)
        # The MLA PARTIAL on wgmma with S split over K between the warpgroups (plan.mla_wgmma,
        # mla_wgmma_ksplit; K3's widths and 512 threads only). The body alone, cold L2 (K3's 96
        # heads, 4096 rows; benchmarks/mla_partial.py --cold): B = 16 219.5 -> 138.3 us, B = 4
        # 79.4 -> 68.7, B = 1 43.0 -> 48.5. slice4-e128 step against the default with an A/A
        # control (3 rounds; logits bit for bit the same at this state): B = 16 -0.8% (control
        # +0.2%), B = 4 -1.5% (control -0.4%), B = 1 +2.1% (control 0.0%), so B > 1 only
        # (docs/results/plan_variants_h200_slice4-e128_mla_wgmma_ksplit_stop34.log,
        # mla_partial_h200_wgmma_stop34.log). In a kernel with MXFP4 expert bodies (slice4,
        # stop 38): B = 16 +0.5%, B = 4 -0.5% (controls -0.0%; plan_variants_h200_slice4_b16_b4_
        # mla_wgmma_stop38.log), within a round's spread: off there.
        wgmma = (self.batch > 1 and kw.get("threads") == 512
                 and not any(r.opcode == Opcode.EXPERT_MXFP4 for r in rows)
                 and all(r.k == MLA_MAX_LORA and r.p2 == MLA_MAX_ROPE for r in rows
                         if r.opcode == Opcode.MLA and r.sub == MlaMode.PARTIAL)
                 and any(r.opcode == Opcode.MLA for r in rows))
        kw.setdefault("mla_wgmma", wgmma)
        kw.setdefault("mla_wgmma_ksplit", kw["mla_wgmma"])
        # Expert weights under an L2 evict_first policy (at B = 1 the GEMV streams on CUDA cores,
        # which it does not cover): slice4-e128 on the H200, side by side with an A/A control (5
        # rounds), same logits: B = 1 3133 -> 3085 us (-1.5%, control -0.3%), B = 4 -0.3%
        # (control -0.1%), B = 16 7618 -> 7466 (-2.0%, control -0.2%). The tensor-core GEMV too
        # ("all"): B = 4 +1.5% (control -0.8%), B = 16 +0.3%
        # (docs/results/plan_variants_h200_slice4-e128_*_evict_first_stop26.log).
        kw.setdefault("weight_evict_first", "experts")
        # The dispatch loop between rows (plan.py: spin_first, spin_err_every, signal_tid,
        # lean_row_smem; they need lean_dispatch): slice4-e128 on the H200, all four against the
        # default with an A/A control (5 rounds, logits bit for bit the same): B = 1 2980 -> 2936
        # us (-1.5%, control +0.0%), B = 4 -1.3% (control +0.6%), B = 16 -1.1% (control +0.6%)
        # (docs/results/plan_variants_h200_slice4-e128_*_dispatch_stop28.log).
        if kw.get("lean_dispatch", True):
            for field, value in (("spin_first", True), ("spin_err_every", 16), ("signal_tid", 32),
                                 ("lean_row_smem", True)):
                kw.setdefault(field, value)
        # Stop 29, timed at batch 1 (slice4 on the H200, A/A control, logits bit for bit the same):
        # the ROUTER's picks' scores loaded after its argmax rounds, MXFP4 DOWN chunks 4 in
        # flight and the EW body at 4 loads per thread (half its code per instance): together
        # 2612 -> 2554 us (-2.2%); alone -0.8%, -0.3% and -2.0%, control -0.0%
        # (docs/results/plan_variants_h200_slice4_b1_*_stop29.log). Stop 30: the ROUTER's score
        # loop compact (router_compact=4): B = 1 2572 -> 2553 us (-0.8%, control +0.1%); at
        # B = 16 ew_unroll=4 -2.7% (6094 -> 5930 us, control +0.8%) and the two ROUTER fields
        # -0.3% (noise: the router is off B = 16's path), logits the same bits
        # (docs/results/plan_variants_h200_slice4_b*_stop30.log); so those three at every batch
        # (B = 4 not timed; its GPU model tests pass), the DOWN unroll at batch 1 only.
        for field, value in (("router_late_scores", True), ("router_compact", 4), ("ew_unroll", 4)):
            kw.setdefault(field, value)
        if self.batch == 1:
            kw.setdefault("expert_mx_down_unroll", 4)
        # Stop 33: the router's picks by the whole CTA, a two-round tournament (router_split), where
        # a row has more than 128 experts (timed there: slice4's 896, on the H200 with an A/A
        # control, the same bits): B = 1 2523 -> 2516 us (-0.3%, every round lower, control +0.1%),
        # B = 16 -0.5% (control -0.2%) (docs/results/plan_variants_h200_slice4_b*_router_split_stop33.log).
        kw.setdefault("router_split", any(r.opcode == Opcode.ROUTER and r.k > 128 for r in rows))
        # Stop 35: the norms' rows at once and the EW RMS path's vector pass (norm_rows_parallel)
        # at B > 4. Side by side with an A/A control (3 rounds, random state): slice4-e128 B = 16
        # 7126 -> 7050 us (-1.1%, control +0.3%; that run's log was lost with its session), slice4
        # B = 16 5970 -> 5919 (-0.9%, control -0.1%; plan_variants_h200_slice4_b16_norm_rows_mla_wgmma_stop35.log);
        # slice4-e128 B = 4 +0.6% (control +0.7%) and slice4 B = 1 +0.3% (control -0.1%,
        # plan_variants_h200_slice4_b1_norm_rows_stop35.log): off there. RMSNORM at B > 1 then sums
        # a row's squares in another order: other logits bits (next tokens the same in these runs).
        kw.setdefault("norm_rows_parallel", self.batch > 4)
        # Stop 37: a half unit of a group of at most 4 pairs as one MMA per k16 step
        # (expert_mx_half_pack) wherever the MXFP4 tensor-core body runs with half units. The
        # body alone (benchmarks/mx_expert_body.py, K3's shapes): GLU 704 -> 664 us at B = 16, 74 ->
        # 71 at B = 1 (DOWN has no half units at K3's cut: unchanged). slice4 step side by side
        # with an A/A control (3 rounds, random state, logits bit for bit the same): B = 16 5872
        # -> 5760 us (-1.9%; control -1.3%, its rounds spread 5769-6006), B = 1 2538 -> 2525
        # (-0.5%, control -0.0%) (docs/results/plan_variants_h200_slice4_b*_half_pack_stop37.log).
        kw.setdefault("expert_mx_half_pack", bool(kw.get("expert_mx_mma")) and kw.get("expert_half_units", True))
        kw.setdefault("name", "megakernel_" + self.schedule.graph.name.replace(".", "_"))
        plan = KernelPlan(tasks=tuple(rows), queues=self.queues, num_events=self.num_events,
                          batch=self.batch, **kw)
        check_plan(self, plan, base, pb)    # verify what runs: the packed table against the schedule
        return plan

    def table_text(self) -> str:
        """The task table with arena offsets (deterministic: no device addresses)."""
        out = [f"# {len(self.rows)} rows, {len(self.queues)} queues, {self.num_events} events, "
               f"batch {self.batch}; addresses are arena byte offsets"]
        if self.ranks > 1:
            out.append(f"# rank {self.rank} of {self.ranks}; COMM PUSH a2 is an offset in the arena of rank "
                       "(rank + p0) % ranks")
        for c, q in enumerate(self.queues):
            for i in q:
                r = self.rows[i]
                fields = {k: v for k, v in dataclasses.asdict(r).items()
                          if k not in ("opcode", "task_id") and (v != 0 or k in ("wait_event", "signal_event"))
                          and v != NO_EVENT}
                out.append(f"cta {c:3d} row {i:4d} task {r.task_id:4d} {r.opcode.name:<10} "
                           + " ".join(f"{k}={int(v)}" for k, v in fields.items()))
        return "\n".join(out)


def _mla_head_tiles(rows) -> int:
    """m16 head tiles per MLA PARTIAL block at B > 1: the fewest blocks of at most 4 tiles (the
    output accumulators' registers) for the widest MLA of the table, its tiles spread evenly
    over them. K3's 96 heads: two blocks of 3 tiles, where 4 + 2 left half the warps idle in
    the second block's S = Q K^T and spilled (64 B at 4 tiles, none at 3)."""
    heads = max((r.ldy for r in rows if r.opcode == Opcode.MLA and r.sub == MlaMode.PARTIAL), default=64)
    tiles = -(-heads // 16)
    blocks = -(-tiles // 4)
    return -(-tiles // blocks)


def _peer_bases(base: int, peer_bases, ranks: int) -> dict[int, int]:
    if peer_bases is None:
        return {p: base for p in range(ranks)}
    pb = {p: peer_bases[p] for p in range(ranks)}
    if pb[0] != base:
        raise LoweringError(f"cute lowering: peer base 0 (this rank's own arena) is {pb[0]}, not base {base}")
    return pb


def unsupported_ops(schedule: Schedule) -> list[str]:
    """IR op kinds of the schedule that have no task body (sorted)."""
    return sorted({op.opname for op in schedule.graph.ops if Trait.view not in op.opdef.traits} - supported())


def lower_ranks(schedule: Schedule) -> tuple[Lowered, ...]:
    """One `Lowered` per rank of a (replicated) multi-rank schedule, over one memory plan: the
    plans are built per rank and must be identical (same offsets: symmetric memory)."""
    lows = tuple(lower_schedule(schedule, r) for r in range(schedule.ranks))
    ref = lows[0].memory.describe()
    for low in lows[1:]:
        if low.memory.describe() != ref:
            raise LoweringError(f"cute lowering: rank {low.rank}'s memory plan differs from rank 0's: the comm "
                                "buffers would not be symmetric")
    return lows


def lower_schedule(schedule: Schedule, rank: int = 0) -> Lowered:
    """Rank `rank`'s table (the only one when the schedule has one rank)."""
    R = schedule.ranks
    if R != 1 and not schedule.replicated:
        raise LoweringError(f"cute lowering: a {R}-rank schedule must be replicated (rank 0's tasks, peers by "
                            "offset) to lower per rank")
    if not 0 <= rank < R:
        raise LoweringError(f"cute lowering: rank {rank} of a {R}-rank schedule")
    missing = unsupported_ops(schedule)
    if missing:
        raise LoweringError(f"cute lowering: no megakernel task body for op '{missing[0]}' "
                            f"(missing: {', '.join(missing)})")
    g, dims = schedule.graph, schedule.dims
    scratch, consts = _scratch_and_consts(schedule)
    mem = build_memory_plan(g, dims, scratch)
    low = _TaskLowering(schedule, mem, consts, rank)
    rows: list[TaskRow] = []
    fields: list[tuple[str, ...]] = []
    first_row: dict[int, list[int]] = {}
    for t in schedule.tasks:
        start = len(rows)
        for r, fs in low.task_rows(t):
            rows.append(r)
            fields.append(fs)
        first_row[t.id] = list(range(start, len(rows)))
    peer = tuple(tuple((f, r.p0) for f in fs if f == "a2") if r.opcode == Opcode.COMM and r.sub == CommOp.PUSH
                 else () for r, fs in zip(rows, fields))
    fields = [tuple(f for f in fs if (f, r.p0) not in p) for r, fs, p in zip(rows, fields, peer)]
    queues = []
    for sm in range(max(schedule.sms, 1)):
        q = schedule.queues.get((0, sm), [])
        queues.append(tuple(i for tid in q for i in first_row[tid]))
    if len(queues) > H200_SMS:
        raise LoweringError(f"cute lowering: {len(queues)} SM queues exceed the {H200_SMS} CTAs of an H200")
    rows = add_weight_prefetch(rows, mem, _hoisted_weight_loads(schedule))
    check_prefetch(rows, mem)
    fields = [fs + ("pf_addr",) if r.pf_bytes else fs for r, fs in zip(rows, fields)]
    return Lowered(schedule, mem, tuple(rows), tuple(fields), tuple(queues),
                   len(schedule.events), int(dims["B"]), consts, rank, R, peer if R > 1 else (),
                   {v: tuple(sorted(c)) for v, c in low.unstored.items()})


def _hoisted_weight_loads(schedule: Schedule) -> dict[int, set[str]]:
    """Task id -> tensors it LOADs before its first WAIT (what the prefetch pass hoisted)."""
    out: dict[int, set[str]] = {}
    for t in schedule.tasks:
        first = next((i for i, x in enumerate(t.instrs) if x.kind is InstrKind.WAIT), None)
        if first is not None:
            out[t.id] = {x.region.tensor for x in t.instrs[:first] if x.kind is InstrKind.LOAD}
    return out


def _scratch_and_consts(schedule: Schedule):
    """Per-task scratch for prologues computed by every tile (a `norm` feeding the task's GEMV
    anchor), and the attribute tables the ops read (`OpDef.attr_table`: RoPE's frequencies)."""
    g = schedule.graph
    ops = {op.outputs[0].name: op for op in g.ops}
    scratch: dict[str, TensorType] = dict(schedule.buffers)
    consts: dict[str, tuple] = {}
    for t in schedule.tasks:
        names = set(t.ops)
        for n in t.ops:
            op = ops[n]
            if Trait.norm in op.opdef.traits and _feeds_anchor_in(op, names, ops):
                scratch[_scratch_name(t, n)] = TensorType(op.outputs[0].type.shape, op.outputs[0].type.dtype, Kind.act)
            table = op.opdef.attr_table
            if table is not None:
                key = _table_key(op)
                consts.setdefault(key, (table.name, dict(op.attrs)))
                scratch.setdefault(key, TensorType(table.shape(op.attrs), table.dtype, Kind.weight))
    return scratch, consts


def _is_anchor(op: Op) -> bool:
    """The GEMV whose output columns are its task's tile (`Trait.mergeable`: y = x @ w^T, every
    column reading x's whole row, so a norm of x is a prologue each task recomputes)."""
    return Trait.mergeable in op.opdef.traits


def _feeds_anchor_in(op: Op, names: set, ops: dict) -> bool:
    out = op.outputs[0].name
    return any(_is_anchor(o) and _memory_of(o.inputs[0].name, ops) == out for n in names for o in [ops[n]])


def _memory_of(name: str, ops: dict) -> str:
    """The value whose memory `name` is: back through views and rank windows (a norm feeding a
    GEMV through this rank's slice of it is still that GEMV's prologue, and its per-task scratch
    is what the slice must address)."""
    while name in ops and ({Trait.view, Trait.rank_window} & ops[name].opdef.traits):
        name = ops[name].inputs[0].name
    return name


def _scratch_name(t: Task, value: str) -> str:
    return f"scratch.t{t.id}.{value}"


def _table_key(op: Op) -> str:
    """The region of `op`'s attribute table: one per table kind and distinct attributes."""
    a = op.attrs
    return f"const.{op.opdef.attr_table.name}." + "_".join(str(a.get(k)) for k in sorted(a))


def fill_consts(low: Lowered, bound, weights: dict) -> None:
    """Write the attribute tables and derived weight layouts into a bound arena.

    `weights`: the lowered graph's weights (reference.ranks.materialize_weights)."""
    import torch

    tables = {d.attr_table.name: d.attr_table for d in REGISTRY.values() if d.attr_table is not None}
    for key, spec in low.consts.items():
        if spec[0] in tables:         # an op's attribute table (OpDef.attr_table)
            bound.tensor(key).copy_(tables[spec[0]].fill(spec[1]))
        elif spec[0] == "rel_ptrs":   # byte distances from the table to each source (ATTN_RES)
            bound.tensor(key).copy_(torch.tensor(spec[1], dtype=torch.int64))
        elif spec[0] == "mla_uk_t":   # W_UK^T per head: [H, kv_lora, nope] from kv_b [H*(nope+v), kv_lora]
            at = spec[2]
            h, nope, vd = int(at["heads"]), int(at["nope"]), int(at["v_dim"])
            w = weights[spec[1]].reshape(h, nope + vd, -1)[:, :nope]
            bound.tensor(key).copy_(w.transpose(1, 2))
        else:
            raise LoweringError(f"cute lowering: unknown constant kind {spec[0]}")


def bind_weights(low: Lowered, bound, weights: dict) -> None:
    """Copy the lowered graph's weights (MXFP4: packed and scale regions) and constants."""
    for name, w in weights.items():
        if hasattr(w, "packed"):
            bound.tensor(name).copy_(w.packed)
            bound.tensor(name + ".scale").copy_(w.scale)
        else:
            bound.tensor(name).copy_(w.to(bound.tensor(name).dtype))
    fill_consts(low, bound, weights)


class _TaskLowering(MixerLowering):
    def __init__(self, schedule: Schedule, mem: MemoryPlan, consts: dict, rank: int = 0):
        self.s, self.mem, self.consts = schedule, mem, consts
        self.rank, self.R = rank, schedule.ranks
        self.rank_views: dict[str, View] = {}    # rank_slice results: this rank's window of the operand
        self.done: set[str] = set()   # values a fused row already produced (rms_norm after attn_res)
        self.unstored: dict[str, list[tuple[int, int]]] = {}    # see Lowered.unstored
        self.ops = {op.outputs[0].name: op for op in schedule.graph.ops}
        self.users: dict[str, list[Op]] = {}
        for op in schedule.graph.ops:
            for v in op.inputs:
                self.users.setdefault(v.name, []).append(op)
        self.outputs = {v.name for v in schedule.graph.outputs}
        self.events = {e.id: e for e in schedule.events}
        self.B = int(schedule.dims["B"])

    # -- one task ---------------------------------------------------------------------------
    def task_rows(self, t: Task):
        waits = [i for i in t.instrs if i.kind is InstrKind.WAIT]
        signals = [i for i in t.instrs if i.kind is InstrKind.SIGNAL]
        for i in waits:
            if i.peer is not None:
                raise self.error(f"task {t.id} waits on rank offset {i.peer}'s counter: waits are on the own rank's")
        body = self._body(t)
        if not body:  # a task of views only still carries its waits and signal
            body = [(TaskRow(Opcode.NOP, t.id), ())]
        rows = [(TaskRow(Opcode.NOP, t.id, **self._wait(w)), ()) for w in waits[:-1]]
        if waits:
            r, fs = body[0]
            body[0] = (dataclasses.replace(r, **self._wait(waits[-1])), fs)
        rows += body
        if signals:
            r, fs = rows[-1]
            rows[-1] = (dataclasses.replace(r, **self._signal(signals[0])), fs)
            rows += [(TaskRow(Opcode.NOP, t.id, **self._signal(e)), ()) for e in signals[1:]]
        return rows

    def _wait(self, w) -> dict:
        n = self.events[w.event].per_step
        d = dict(wait_event=w.event, wait_per_step=n, wait_offset=w.threshold - n)
        if w.scope is Scope.sys:
            d["wait_scope"] = ScopeCode.SYS
        return d

    def _signal(self, s) -> dict:
        d = dict(signal_event=s.event)
        if s.scope is Scope.sys or s.peer is not None:
            if s.scope is not Scope.sys:
                raise self.error(f"signal of e{s.event} to rank offset {s.peer} is not at system scope")
            d["signal_scope"] = ScopeCode.SYS
            if s.peer:
                d["signal_peer"] = s.peer % self.R
        return d

    def _body(self, t: Task):
        names = set(t.ops)
        ordered = [op for op in self.s.graph.ops if op.outputs[0].name in names]
        anchor = next((op for op in ordered if _is_anchor(op)), None)
        cols: dict[str, tuple[int, int]] = {}
        redirect: dict[str, str] = {}
        if anchor is not None:
            cols[anchor.outputs[0].name] = tuple(t.tile[-1])
        rows = []
        gemv = None         # index in rows of the anchor's GEMV row
        for op in ordered:
            out = op.outputs[0].name
            if Trait.view in op.opdef.traits:
                src = op.inputs[0].name
                if src in cols and op.opdef.window is not None:
                    lo, hi = cols[src]
                    _, st, en = (int(x) for x in op.opdef.window(op.attrs))
                    cols[out] = (max(lo, st) - st, max(min(hi, en) - st, max(lo, st) - st))
                elif src in cols:
                    cols[out] = cols[src]
                continue
            c = self._cols(op, cols, t)
            cols[out] = c
            if out in self.done:
                continue
            if gemv is not None and self._store_cast_from_gemv(op, anchor, rows, gemv, cols[anchor.outputs[0].name], redirect):
                continue
            new = self._op_rows(t, op, c, anchor, redirect)
            if op is anchor:
                at = [i for i, (r, _) in enumerate(new) if r.opcode == Opcode.GEMV_BF16]
                gemv = len(rows) + at[0] if len(at) == 1 else None
            rows += new
        return rows

    def _store_cast_from_gemv(self, op: Op, anchor: Op, rows: list, i: int, tile, redirect) -> bool:
        """A merged projection stores fp32 (some of its slices need fp32) and its bf16 slices
        are casts: the part of the task's tile inside a slice whose only reader is a cast to
        bf16, where nothing else reads those fp32 columns, is stored by a GEMV row as bf16
        straight into the cast's output (the same fp32 sums, the same rounding) and the cast
        gets no COPY row. A tile across slice boundaries (rows[i] and the rows after it: the
        anchor's GEMV rows, already cut for earlier casts) has its GEMV row cut at the slice's
        bounds, one row per part: on the B = 1 critical path each such COPY row was ~1.4 us plus
        its dispatch after the GEMV row it follows (stop 26's profile). Returns whether it did."""
        if op.opname != "cast" or anchor.opname != "linear":
            return False
        sl = op.inputs[0].producer
        a_out, o = anchor.outputs[0].name, op.outputs[0].name
        if sl is None or Trait.view not in sl.opdef.traits or sl.opdef.window is None \
                or sl.inputs[0].name != a_out or a_out in self.outputs:
            return False
        if any(n in redirect or n in self.rank_views for n in (a_out, sl.outputs[0].name, o)):
            return False
        if self.mem.view(a_out).dtype is not DType.f32 or self.mem.view(o).dtype is not DType.bf16:
            return False
        (lo, hi), (_, st, en) = tile, (int(x) for x in sl.opdef.window(sl.attrs))
        a, b = max(lo, st), min(hi, en)         # the tile's part inside the slice
        readers = self.users.get(sl.outputs[0].name, [])
        if a >= b or len(readers) != 1 or readers[0] is not op:
            return False
        for u in self.users.get(a_out, []):    # other readers of the fp32 columns of this part
            if Trait.view not in u.opdef.traits or u.opdef.window is None:
                return False
            _, ust, uen = (int(x) for x in u.opdef.window(u.attrs))
            if u is not sl and ust < b and a < uen:
                return False
        # the anchor's GEMV row (or the part of it left by earlier casts) that still stores
        # fp32 into the merged output over [a, b)
        y = self._off(a_out, redirect)
        at = next((j for j in range(i, len(rows)) if rows[j][0].opcode == Opcode.GEMV_BF16
                   and rows[j][0].a2 == y and rows[j][0].n0 <= a and b <= rows[j][0].n1), None)
        if at is None:
            return False
        r, fs = rows[at]
        self.unstored.setdefault(a_out, []).append((a, b))
        self.unstored.setdefault(sl.outputs[0].name, []).append((a - st, b - st))
        # the slice's weight rows start st rows into W (row-major [N, K] bf16)
        mid = dataclasses.replace(r, a0=r.a0 + st * r.k * 2, a2=self._off(o, redirect), n0=a - st, n1=b - st,
                                  ldy=self.mem.view(o).row_stride, p1=r.p1 & ~int(F32Flag.OUT))
        parts = [dataclasses.replace(r, n1=a)] if r.n0 < a else []
        parts.append(mid)
        if b < r.n1:
            parts.append(dataclasses.replace(r, n0=b))
        rows[at:at + 1] = [(p, fs) for p in parts]
        return True

    def _cols(self, op: Op, cols: dict, t: Task) -> tuple[int, int]:
        for v in op.inputs:
            if v.name in cols:
                return cols[v.name]
        return tuple(t.tile[-1])

    # -- one op -------------------------------------------------------------------------------
    def _v(self, name: str, redirect: dict) -> View:
        name = redirect.get(name, name)
        return self.rank_views.get(name) or self.mem.view(name)

    def _off(self, name: str, redirect: dict) -> int:
        name = redirect.get(name, name)
        if name in self.rank_views:
            v = self.rank_views[name]
            return self.mem.regions[v.region].offset + v.elem_offset * itemsize(v.dtype)
        return self.mem.byte_offset(name)

    def _op_rows(self, t: Task, op: Op, cols, anchor, redirect):
        """The op's task rows, from the backend's per-op table (lowerings.py)."""
        fn = LOWERINGS.get(op.opname)
        if fn is None:
            raise self.error(f"no megakernel task body for op '{op.opname}' (%{op.outputs[0].name})")
        rows = fn(self, OpCtx(self, t, op, cols, anchor, redirect))
        b0, b1 = self._rows(t)
        if (b0, b1) == (0, self.B):
            return rows
        # a task over part of the batch (a KDA family cut over batch rows, tokenwise units): its
        # EW rows run only its rows (K word; 0 = every row)
        return [(dataclasses.replace(r, k=(b0 << 16) | b1) if r.opcode == Opcode.EW else r, fs) for r, fs in rows]

    @lowers('rms_norm')
    def _lower_rms_norm(self, c: OpCtx):
        t, op, anchor, redirect, ins, out, view, off = c.t, c.op, c.anchor, c.redirect, c.ins, c.out, c.view, c.off
        b0, b1 = self._rows(c.t)
        if anchor is not None and _memory_of(anchor.inputs[0].name, self.ops) == out:
            redirect[out] = _scratch_name(t, out)
        if view(ins[0]).dtype is DType.f32:   # RMSNORM streams bf16: fp32 input -> EW RMS (one head)
            x, o, gm = view(ins[0]), view(out), view(ins[1])
            k = x.shape[-1]
            return [(TaskRow(Opcode.EW, t.id, a0=off(ins[0]), a2=off(out), a3=off(ins[1]), n0=0, n1=k,
                             ldx=x.row_stride, ldy=o.row_stride, sub=EwOp.RMS, p2=k,
                             p1=self._flags(a=x, o=o) | (int(F32Flag.A3) if gm.dtype is DType.f32 else 0),
                             aux=f32_pair(1.0, float(op.attrs.get("eps", 1e-5)))), ("a0", "a2", "a3"))]
        pre = []
        self._need_bf16(op, [ins[0], ins[1], out], redirect)
        x, o = view(ins[0]), view(out)
        return pre + [(TaskRow(Opcode.RMSNORM, t.id, a0=off(ins[0]), a1=off(ins[1]), a2=off(out),
                         n0=b0, n1=b1, k=x.shape[-1], ldx=x.row_stride, ldy=o.row_stride,
                         aux=f32_bits(float(op.attrs.get("eps", 1e-5)))), ("a0", "a1", "a2"))]

    @lowers('linear')
    def _lower_linear(self, c: OpCtx):
        t, op, cols, redirect, ins, out, view, off = c.t, c.op, c.cols, c.redirect, c.ins, c.out, c.view, c.off
        self._need_bf16(op, [ins[0], ins[1]], redirect)
        x, w, o = view(ins[0]), view(ins[1]), view(out)
        if o.dtype not in (DType.bf16, DType.f32):
            raise LoweringError(f"cute lowering: linear %{out} stores {o.dtype.value}; GEMV stores bf16 or f32")
        flag = int(F32Flag.OUT) if o.dtype is DType.f32 else 0
        return [(TaskRow(Opcode.GEMV_BF16, t.id, a0=off(ins[1]), a1=off(ins[0]), a2=off(out),
                         n0=cols[0], n1=cols[1], k=w.shape[1], ldx=x.row_stride, ldy=o.row_stride,
                         p1=flag), ("a0", "a1", "a2"))]

    @lowers(*EW_BINARY, *EW_UNARY)
    def _lower_elementwise(self, c: OpCtx):
        t, cols, ins, out, view, off = c.t, c.cols, c.ins, c.out, c.view, c.off
        kind = c.op.opname
        if cols[1] <= cols[0]:
            return []
        a, o = view(ins[0]), view(out)
        b = view(ins[1]) if kind in EW_BINARY else None
        flags = self._flags(a=a, b=b, o=o)
        row = TaskRow(Opcode.EW, t.id, a0=off(ins[0]), a1=off(ins[1]) if b else 0, a2=off(out),
                      n0=cols[0], n1=cols[1], ldx=a.row_stride, ldy=o.row_stride,
                      sub=EW_BINARY.get(kind, EW_UNARY.get(kind)), p0=b.row_stride if b else 0,
                      p1=flags, p2=1, aux=f32_pair(1.0, 0.0))
        return [(row, ("a0", "a1", "a2") if b else ("a0", "a2"))]

    @lowers('rope')
    def _lower_rope(self, c: OpCtx):
        t, op, cols, redirect, ins, out, view, off = c.t, c.op, c.cols, c.redirect, c.ins, c.out, c.view, c.off
        if cols[1] <= cols[0]:
            return []
        d = int(op.attrs["head_dim"])
        if cols[0] % d or cols[1] % d:
            raise LoweringError(f"cute lowering: rope %{out} tile {cols} splits a head of {d}")
        if redirect.get(ins[0], ins[0]) == out:
            raise LoweringError(f"cute lowering: rope %{out} in place is not supported")
        a, o = view(ins[0]), view(out)
        return [(TaskRow(Opcode.EW, t.id, a0=off(ins[0]), a2=off(out), a3=off(ins[1]),
                         a4=self.mem.byte_offset(_table_key(op)), n0=cols[0], n1=cols[1],
                         ldx=a.row_stride, ldy=o.row_stride, sub=EwOp.ROPE,
                         p1=self._flags(a=a, o=o), p2=d), ("a0", "a2", "a3", "a4"))]

    @lowers('cache_append')
    def _lower_cache_append(self, c: OpCtx):
        t, ins, view, off = c.t, c.ins, c.view, c.off
        cache, new, pos = ins
        c, a = view(cache), view(new)
        return [(TaskRow(Opcode.EW, t.id, a0=off(new), a1=off(cache), a2=off(cache), a3=off(pos),
                         n0=0, n1=a.shape[-1], ldx=a.row_stride, ldy=c.strides[1], sub=EwOp.APPEND,
                         p0=c.strides[0], p1=self._flags(a=a) | (int(F32Flag.A1) if c.dtype is DType.f32 else 0)),
                 ("a0", "a1", "a2", "a3"))]

    @lowers('attention')
    def _lower_attention(self, c: OpCtx):
        t, op, ins, out, view, off = c.t, c.op, c.ins, c.out, c.view, c.off
        b0, b1 = self._rows(c.t)
        q, kc, vc, pos = ins
        h, kvh, d = (int(op.attrs[k]) for k in ("heads", "kv_heads", "head_dim"))
        if tuple(t.tile[-1]) != (0, h * d):
            raise LoweringError(f"cute lowering: attention %{out} tiled over heads {t.tile[-1]}: "
                                "only whole-row tiles are supported")
        kv = view(kc)
        if kv.strides != (kv.shape[1] * kv.shape[2], kv.shape[2], 1) or view(vc).strides != kv.strides:
            raise LoweringError(f"cute lowering: attention %{out} needs contiguous caches")
        return [(TaskRow(Opcode.ATTENTION, t.id, a0=off(q), a1=off(kc), a5=off(vc), a4=off(pos),
                         a2=off(out), n0=b0 * h, n1=b1 * h, k=d, ldx=view(q).row_stride,
                         ldy=view(out).row_stride, p0=h, p1=kv.strides[0], p2=h // kvh,
                         aux=f32_pair(float(op.attrs["scale"]))), ("a0", "a1", "a2", "a4", "a5"))]

    @lowers('embedding')
    def _lower_embedding(self, c: OpCtx):
        t, cols, ins, out, view, off = c.t, c.cols, c.ins, c.out, c.view, c.off
        table, ids = ins
        tv, o = view(table), view(out)
        return [(TaskRow(Opcode.EW, t.id, a0=off(table), a2=off(out), a3=off(ids), n0=cols[0],
                         n1=cols[1], ldx=tv.row_stride, ldy=o.row_stride, sub=EwOp.GATHER,
                         p1=self._flags(a=tv, o=o)), ("a0", "a2", "a3"))]

    @lowers('rank_slice')
    def _lower_rank_slice(self, c: OpCtx):
        """No row: this rank's slice is a window of the operand at a rank-dependent offset, which
        the consuming rows address (the per-rank table carries the rank)."""
        at, src = c.op.attrs, c.view(c.ins[0])
        dim = int(at.get("dim", -1)) % len(src.shape)
        g = int(at["ranks"])
        n = src.shape[dim] // g
        i = group_index(self.rank, g, int(at.get("stride", 1)))
        shape = tuple(n if k == dim else d for k, d in enumerate(src.shape))
        self.rank_views[c.out] = View(src.region, src.elem_offset + i * n * src.strides[dim], shape, src.strides,
                                      src.dtype)
        return []

    @lowers('all_reduce', 'all_gather')
    def _lower_collective(self, c: OpCtx):
        """COMM rows (plan.py): the push task of slot d writes x into slot d of the peer's slot
        buffer; the local task reduces or gathers x and its own slots in group-index order. A
        collective cut into column windows (passes/split_reduce.py: a push task's tile is its slot
        and then the window, a local task's tile the window of y) moves columns [c0, c1) through
        its own slot buffer [G, B, c1 - c0]: its rows address x and y from column c0 on."""
        t, op, view, off = c.t, c.op, c.view, c.off
        g, st = int(op.attrs["ranks"]), int(op.attrs.get("stride", 1))
        x, y = view(c.ins[0]), view(c.out)
        n = x.shape[-1]
        win = tuple(t.tile[1:]) if t.body_kind == "comm_push" else tuple(t.tile)
        c0, c1 = (win[-1] if len(win) == len(x.shape) and Trait.columnwise in op.opdef.traits else (0, n))
        comm = [i.region.tensor for i in t.instrs if i.kind in (InstrKind.LOAD, InstrKind.STORE)
                and self.s.buffers.get(i.region.tensor) is not None
                and self.s.buffers[i.region.tensor].kind is Kind.comm]
        slots = comm[0] if comm else f"{c.out}.slots"
        sv = self.mem.view(slots)
        w = c1 - c0
        if len(x.shape) != 2 or x.strides[-1] != 1 or sv.shape != (g, x.shape[0], w) or not 0 <= c0 < c1 <= n:
            raise self.error(f"{op.opname} %{c.out}: COMM rows move [B, n] rows with contiguous columns "
                             f"(columns {c0}:{c1} of {n} through %{slots} {list(sv.shape)})")
        if op.opname == "all_gather" and int(op.attrs.get("dim", -1)) % 2 != 1:
            raise self.error(f"all_gather %{c.out} along dim {op.attrs.get('dim')}: only the last dim is supported")
        for v in (x, y):
            if v.dtype not in (DType.bf16, DType.f32):
                raise self.error(f"{op.opname} %{c.out}: COMM rows move bf16 or fp32, not {v.dtype.value}")
        fl = (int(F32Flag.A0) if x.dtype is DType.f32 else 0) | (int(F32Flag.OUT) if y.dtype is DType.f32 else 0)
        es = itemsize(x.dtype)
        a0 = off(c.ins[0]) + c0 * es
        if t.body_kind == "comm_push":
            (store,) = [i for i in t.instrs if i.kind is InstrKind.STORE]
            d, p = store.region.box[0][0], store.region.rank
            if store.region.tensor != slots or not p or not 0 < d < g:
                raise self.error(f"push task {t.id} of %{c.out} stores {store.region.tensor} slot {d} at rank "
                                 f"offset {p}: a peer's slot 1..{g - 1} expected")
            row = TaskRow(Opcode.COMM, t.id, a0=a0, a2=off(slots) + d * sv.strides[0] * es,
                          n0=0, n1=w, ldx=x.row_stride, ldy=w, sub=CommOp.PUSH, p0=p % self.R, p1=fl, p2=g)
            return [(row, ("a0", "a2"))]
        sub = CommOp.ALL_REDUCE if op.opname == "all_reduce" else CommOp.ALL_GATHER
        row = TaskRow(Opcode.COMM, t.id, a0=a0, a1=off(slots), a2=off(c.out) + c0 * itemsize(y.dtype), n0=0, n1=w,
                      ldx=x.row_stride, ldy=y.row_stride, sub=sub, p1=fl, p2=g, aux=group_index(self.rank, g, st))
        return [(row, ("a0", "a1", "a2"))]

    @lowers('argmax')
    def _lower_argmax(self, c: OpCtx):
        t, ins, out, view, off = c.t, c.ins, c.out, c.view, c.off
        b0, b1 = self._rows(c.t)
        x = view(ins[0])
        return [(TaskRow(Opcode.ARGMAX, t.id, a0=off(ins[0]), a2=off(out), n0=b0, n1=b1,
                         k=x.shape[-1], ldx=x.row_stride,
                         p1=int(F32Flag.A0) if x.dtype is DType.f32 else 0), ("a0", "a2"))]

    @lowers('argmax_partial')
    def _lower_argmax_partial(self, c: OpCtx):
        """ARGMAX PARTIAL: the task's chunk of the columns (argmax_chunk) for its batch rows."""
        t, ins, out, view, off = c.t, c.ins, c.out, c.view, c.off
        (c0, c1), (b0, b1) = t.tile[0], t.tile[1]
        x, pv = view(ins[0]), view(out)
        if c1 != c0 + 1:
            raise self.error(f"argmax_partial %{c.out}: a task takes one chunk, not {c0}..{c1}")
        lo, hi = argmax_chunk(x.shape[-1], int(c.at["chunks"]), c0)
        return [(TaskRow(Opcode.ARGMAX, t.id, a0=off(ins[0]) + lo * itemsize(x.dtype),
                         a2=off(out) + c0 * pv.shape[1] * 2 * 4, n0=b0, n1=b1, k=hi - lo, ldx=x.row_stride,
                         p0=lo, p1=int(F32Flag.A0) if x.dtype is DType.f32 else 0, sub=ArgmaxMode.PARTIAL),
                 ("a0", "a2"))]

    @lowers('argmax_combine')
    def _lower_argmax_combine(self, c: OpCtx):
        """ARGMAX COMBINE: the best of the S chunks' pairs of the task's batch rows."""
        t, ins, out, view, off = c.t, c.ins, c.out, c.view, c.off
        b0, b1 = self._rows(c.t)
        S, B, _ = view(ins[0]).shape
        return [(TaskRow(Opcode.ARGMAX, t.id, a0=off(ins[0]), a2=off(out), n0=b0, n1=b1, k=S, ldx=2 * B,
                         p1=int(F32Flag.A0), sub=ArgmaxMode.COMBINE), ("a0", "a2"))]

    # -- helpers shared with lower_mixers -----------------------------------------------------
    def error(self, msg: str) -> LoweringError:
        return LoweringError("cute lowering: " + msg)

    def _scratch(self, name: str, dtype: DType, shape) -> str:
        if name not in self.mem.regions:
            self.mem.alloc(name, dtype, shape, Kind.act)
        return name

    def _const(self, key: str, spec: tuple, dtype: DType, shape) -> str:
        if key not in self.mem.regions:
            self.mem.alloc(key, dtype, shape, Kind.weight)
            self.consts[key] = spec
        return key

    def _copy_rows(self, t: Task, src: int, sv: View, dst: int, width: int, ddt: DType, ldy: int, ldx=None):
        """EW COPY of `width` columns of every batch row from src (view sv) to dst (dtype ddt)."""
        fl = (int(F32Flag.A0) if sv.dtype is DType.f32 else 0) | (int(F32Flag.OUT) if ddt is DType.f32 else 0)
        return [(TaskRow(Opcode.EW, t.id, a0=src, a2=dst, n0=0, n1=width, ldx=sv.row_stride if ldx is None else ldx,
                         ldy=ldy, sub=EwOp.COPY, p1=fl), ("a0", "a2"))]

    def _need_bf16(self, op: Op, names, redirect) -> None:
        for n in names:
            if self._v(n, redirect).dtype is not DType.bf16:
                raise LoweringError(f"cute lowering: {op.opname} %{op.outputs[0].name} reads or writes "
                                    f"%{n} as {self._v(n, redirect).dtype.value}; its body needs bf16")

    @staticmethod
    def _flags(a=None, b=None, o=None) -> int:
        f = 0
        for v, bit in ((a, F32Flag.A0), (b, F32Flag.A1), (o, F32Flag.OUT)):
            if v is not None:
                if v.dtype not in (DType.bf16, DType.f32):
                    raise LoweringError(f"cute lowering: elementwise operand of dtype {v.dtype.value}")
                f |= int(bit) if v.dtype is DType.f32 else 0
        return f
