"""KernelPlan: every decision the CuTe megakernel makes, as frozen data.

The scheduler (passes/schedule.py and friends) targets this module and nothing else in the
backend: it builds `TaskRow`s, assigns them to per-CTA queues and wraps them in a `KernelPlan`.
The code generator only renders the plan (templates loop over it); the runtime only encodes it.

Compile-time part (changes the generated kernel): `opcodes` used, `threads`, `batch`,
`unroll`, `rows_per_warp`, `num_ctas`, `spin_timeout_ns`, `relaxed_spin` (planted bug for the PTX audit),
`delay_ns` (delay injection: every task sleeps before its body, so producers write late),
`profile` (per-row timestamps after the error words, see `PROF_OFFSET_WORDS`), `ranks` (R > 1:
29-word rows, per-row system-scope waits and signals, a `peers_addr` launch argument: int64 [R],
entry p the event counters of rank (r + p) % R) and `peer_signal_gpu` (planted bug for the audit).
Run-time part (lives in device memory, never recompiles): the task table and the queues.

Task table: int64 tensor [num_tasks, ROW_WORDS], rows grouped by CTA so that CTA c walks rows
queue[c, 0] .. queue[c, 1] - 1 (queue is int32 [num_ctas, 2]). Word layout of one row (`Word`):

  word  name           meaning
  0     OPCODE         `Opcode` of the task body
  1     TASK_ID        the scheduler's task id (reported by the bounded-wait error)
  2     WAIT_EVENT     event counter index to wait on, -1 = no wait
  3     WAIT_PER_STEP  threshold = WAIT_PER_STEP * step + WAIT_OFFSET (step counts from 1);
  4     WAIT_OFFSET      WAIT_PER_STEP is the number of signals the event gets per step
  5     SIGNAL_EVENT   event counter to release-increment by 1 when done, -1 = none
  6     A0             address (int64) of the first operand (see `Opcode`)
  7     A1             address of the second operand
  8     A2             address of the output
  9     A3             address of a side operand (MXFP4 scales), 0 if unused
  10    N0             first output row (GEMV) or first batch row (RMSNORM) of the tile
  11    N1             one past the last row of the tile
  12    K              reduction length (GEMV) or hidden size (RMSNORM); EW: batch rows b0 << 16 | b1
  13    LDX            row stride of the activation operand, in elements
  14    LDY            row stride of the output, in elements
  15    AUX            opcode-specific scalar (RMSNORM: float32 bits of eps; EW/ROUTER: `f32_pair`)
  16    A4             EXPERT_*: router ids int32 [B, P1]
  17    A5             EXPERT_*: second weight (up, GLU mode)
  18    A6             EXPERT_MXFP4: scales of the second weight; MLA PARTIAL: q_pe head stride
  19    A7             ATTN_RES: rms_norm output; MLA PARTIAL: q_pe batch stride (plain integers)
  20    SUB            sub-opcode (`ExpertMode` for EXPERT_*, `EwOp` for EW)
  21    P0             EXPERT_*: slots s0 << 16 | s1; EW: row stride of operand A1; ROUTER: top-k
  22    P1             EXPERT_*: top-k (row stride of ids/weights); EW: `F32Flag` bits
  23    P2             EW: head_dim (L2_NORM, GATED_RMS, KDA_GATE per head), conv width (CONV), slots (WSUM);
                       EXPERT_*: batch rows b0 << 16 | b1
  24    PF_ADDR        start of a static-weight byte range the task will read (0 = none)
  25    PF_BYTES       its length (a multiple of 16): while a CTA waits at row t, thread 0 prefetches
                       the ranges of rows t .. t + PF_LOOKAHEAD - 1 into L2. Only weights may be
                       named (rule: only static weights are prefetched across a wait); the
                       lowering fills and checks these words, `KernelPlan` checks the alignment.

Events are int32 counters that only grow: nothing is reset between steps, so one launch per
step (or one CUDA-graph replay) is enough. A task that needs several waits is preceded in its
queue by NOP rows that each wait on one event (queues run in order, so the waits add up).

Multi-rank tables (`KernelPlan.ranks` = R > 1; docs/cute_backend.md, "Multi-rank tables"): every
rank runs its own table over its own arena; the arenas share one memory plan, so every region
(the `comm` slot buffers included) is at the same offset on every rank (symmetric memory). Rows
are ROW_WORDS_RANKS words: the 26 above plus (`RankWord`)

  26    WAIT_SCOPE     `ScopeCode` of the wait's acquire (SYS: the counter is released by a peer)
  27    SIGNAL_SCOPE   `ScopeCode` of the signal's release (SYS when a peer waits on it)
  28    SIGNAL_PEER    rank offset p of the counter SIGNAL_EVENT names: rank (r + p) % R's counter
                       (0 = this rank's own; p != 0 needs SIGNAL_SCOPE = SYS)

Peers are addressed by offset, as in the schedule (ir/schedule.py), so rank r's table is rank 0's
with its rank-dependent words changed (COMM AUX, rank_slice addresses). A COMM PUSH row's A2 is
in the peer's arena: `Lowered.plan(base, peer_bases)` relocates it with the base of rank
(r + P0) % R as this process maps it (`peer_fields`), every other address with the own base.
Single-rank tables keep the 26-word rows and never use COMM, scopes or peers.
"""
from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Sequence

from fusec.passes.target import GPUS

ROW_WORDS = 26
ROW_WORDS_RANKS = 29     # multi-rank tables: + RankWord
# Rows ahead (the waiting row included) whose weight ranges a waiting CTA prefetches.
PF_LOOKAHEAD = 2
H200_SMS = GPUS["h200"].sms   # CTAs of the persistent grid: one per SM of the target
NO_EVENT = -1


class Word(enum.IntEnum):
    """Column index of each field in a task-table row (see module docstring)."""

    OPCODE = 0
    TASK_ID = 1
    WAIT_EVENT = 2
    WAIT_PER_STEP = 3
    WAIT_OFFSET = 4
    SIGNAL_EVENT = 5
    A0 = 6
    A1 = 7
    A2 = 8
    A3 = 9
    N0 = 10
    N1 = 11
    K = 12
    LDX = 13
    LDY = 14
    AUX = 15
    A4 = 16
    A5 = 17
    A6 = 18
    A7 = 19
    SUB = 20
    P0 = 21
    P1 = 22
    P2 = 23
    PF_ADDR = 24
    PF_BYTES = 25


class ErrWord(enum.IntEnum):
    """int32 error buffer written by the first wait that times out (FLAG 0 = no error)."""

    FLAG = 0
    TASK_ID = 1
    EVENT = 2
    EXPECTED = 3
    SEEN = 4
    CTA = 5
    STEP = 6


ERR_WORDS = 8
# Profile mode: int64 [num_tasks, 3] (wait start, body start, body end; globaltimer ns) follows
# the error words at this int32 offset (the runtime sizes the buffer; no extra kernel argument).
PROF_OFFSET_WORDS = 16
PROF_FIELDS = 3


class Opcode(enum.IntEnum):
    """Task-body kinds. One body per kind in the generated kernel.

    NOP        wait and/or signal only (joins, extra waits).
    GEMV_BF16  y[b, n] = sum_k x[b, k] * W[n, k]  for n in [N0, N1), b < batch;
               A0 = W bf16 [N, K] row-major, A1 = x bf16 [batch, LDX], A2 = y bf16 [batch, LDY].
               fp32 accumulation.
    GEMV_MXFP4 same with A0 = W packed u8 [N, K/2] (low nibble = even element, E2M1 with
               bit 3 = sign), A3 = e8m0 scales u8 [N, K/32] (value 2^(byte-127)).
    RMSNORM    out[b, :] = x[b, :] * rsqrt(mean(x[b, :]^2) + eps) * gamma for b in [N0, N1);
               A0 = x bf16 [.., LDX], A1 = gamma bf16 [K], A2 = out bf16 [.., LDY], AUX = eps.

    EXPERT_BF16  routed expert GEMVs of every (batch row, slot) pair with batch rows in
               P2 >> 16 .. P2 & 0xFFFF and slots in P0 >> 16 .. P0 & 0xFFFF, output rows N0..N1:
               the pair's expert e = ids[b, s] is read from A4 (int32 [B, P1]) at run time after
               the wait (V3). Weight rows of expert e start at A0 + e * AUX rows (AUX = rows per
               expert, also the slot stride of the output).
               GLU mode: h[b, s, n] = situ_glu(x[b].Wg[e, n], x[b].Wu[e, n]), Wg = A0, Wu = A5,
               x = A1 [B, LDX], h = A2 [B, LDY] bf16 (slot s at column s * AUX).
               DOWN mode: y[b, s, n] = h[b, s].W[e, n] in fp32 (moe_down), h = A1 [B, LDX] bf16
               (slot s at column s * K), y = A2 [B, LDY] fp32 (slot s at column s * AUX).
               Ids < 0 (other EP rank) store 0. Expert parallel (multi-rank tables only): A7 =
               lo << 32 | n, this rank holds experts lo .. lo + n - 1 and the pair's expert is
               ids[b, s] - lo, ids outside store 0 (A7 = 0: every id is this rank's). The bf16 body reads each distinct expert's rows
               once for all the pairs that chose it (grouped after routing, on tensor cores).
    EXPERT_MXFP4 same with MXFP4 weights; A3 / A6 = e8m0 scales of A0 / A5. With
               `expert_mx_mma` the weights and scales are in MXFP4 tiles (weight_tiles.mx_tile)
               and the body groups the pairs by expert on tensor cores as the bf16 one does.
    EW         elementwise / per-head epilogues, sub-opcode `EwOp` in SUB, columns N0..N1 of
               batch rows K >> 16 .. K & 0xFFFF (K = 0: every batch row): A0 = a [B, LDX],
               A1 = b [B, P0] (P0 = 0 broadcasts a vector), A2 = out [B, LDY], A3 = third
               operand (conv weight, A_log, norm weight); operands indexed by batch row (pos,
               ids, routing weights, conv state, cache) are read and written at those rows only;
               P1 = `F32Flag` dtype bits (else bf16), P2 = head_dim / conv width,
               AUX = f32_pair(scale, eps).
    ROUTER     one token per row b in N0..N1: scores = sigmoid(logits A0 [B, LDX] (F32Flag.A0)),
               top-P0 of scores + bias (A1 fp32 [K]), weights = scores[ids] / sum * scale
               (AUX = f32_pair(scale, 0)) -> A2 fp32 [B, LDY], ids -> A3 int32 [B, LDY].
               K = number of experts (<= 32 * ROUTER_PER_LANE), P0 = top-k (<= 32).
    KDA        gated delta rule step (kda_recurrent) for items i in N0..N1, i = b * H + head
               (H = P0, head dim D = K, D divides threads, D <= 128): state S fp32 [B, H, D, D]
               at A3 updated in place, S <- diag(exp g) S; u = v - k^T S; S += beta k u^T;
               o = q^T S. q = A0, k = A1, v = A5 (bf16 [B, LDX]), g = A6 fp32 [B, LDX],
               beta = A4 bf16 [B, H] (fp32 when P1 has F32Flag.A0), o = A2 fp32 [B, LDY].
    ATTN_RES   attn_res mix fused with the next rms_norm, batch rows b in N0..N1 in turn:
               sources j < P1 (<= ATTN_RES_MAX_SOURCES) at A0 + int64 A0[j] bytes (A0 is a table
               of byte distances from itself, so it needs no relocation), rows [B, LDX] bf16 of
               width K; key = norm_w (A1) * proj_w (A5); softmax_j(rms(V_j) . key),
               h = sum_j p_j V_j -> A2 bf16 [B, LDY]; rms_norm(h) * gamma (A6) -> A7 bf16
               [B, LDY]; AUX = f32_pair(attn_res eps, rms_norm eps).
    MLA        absorbed MLA, split sequence (`MlaMode` in SUB). PARTIAL (mla_attention_partial):
               items i in N0..N1 = (chunk i // B, batch i % B); q_lat A0 bf16 [B, H, K],
               q_pe A1 bf16 [B, H, P2] with head / batch strides A6 / A7 (elements, plain
               integers), cache A3 bf16 [B, LDX, K + P2], pos A4 int32 [B],
               partials A2 fp32 [P1, B, H, K + 2] = [o / l, m, l]; LDY = H, P0 = B * H,
               P1 = chunks, AUX = f32_pair(scale). COMBINE (attention_combine): items (b, h) in
               N0..N1, A0 = partials, A2 = o bf16 [B, H, K]. K <= 512, P2 <= 64; all contiguous.
    ATTENTION  grouped-query decode attention (IR op attention), one warp per item i = b * H + h
               in N0..N1: q A0 bf16 [B, LDX] (head h at column h * K), caches A1 (k) and A5 (v)
               bf16 [B, L, KVH * K] with contiguous rows and batch stride P1 elements, P0 = H,
               P2 = H / KVH (query heads per kv head), pos A4 int32 [B] read after the wait
               (rows 0..pos[b] inclusive), out A2 bf16 [B, LDY], AUX = f32_pair(scale),
               K = head dim (a multiple of 32, <= ATTN_MAX_HEAD_DIM).
    ARGMAX     greedy token, the CTA per row b in N0..N1, lowest index wins ties (`ArgmaxMode` in
               SUB). WHOLE (IR op argmax): x A0 fp32 [B, LDX] (bf16 when P1 has no
               F32Flag.A0), K columns -> A2 int32 [B]. PARTIAL (argmax_partial): the same over
               the K columns of one chunk (A0 already at its first column, P0 = that column) ->
               A2 fp32 [B, 2] pairs (largest value, its column P0 + j as fp32; A2 at the chunk's
               slab). COMBINE (argmax_combine): the K = S chunks' pairs of A0 fp32 [S, LDX / 2,
               2] (LDX floats per chunk) -> A2 int32 [B].
    COMM       one side of a collective over a group of G = P2 ranks (multi-rank tables only;
               passes/_collectives.py), `CommOp` in SUB, columns N0..N1 of every batch row,
               P1 = `F32Flag` (A0: operand and slots fp32, OUT: output fp32; else bf16):
               PUSH: the peer's slot row block A2 [B, LDY] (in rank (r + P0) % R's arena,
               P0 = rank offset, 1..R-1) = x A0 [B, LDX];
               ALL_REDUCE: y A2 [B, LDY] = sum over the group in group-index order (fp32) of x
               A0 [B, LDX] (this rank, index AUX) and slot d = (AUX - j) mod G (member j) of
               this rank's slots A1 [G, B, N1] (contiguous, written by the peers' PUSH rows);
               ALL_GATHER: y A2 [B, LDY] with member j's N1 columns at column j * N1
               (x for j = AUX, slot (AUX - j) mod G otherwise).

    GEMV_BF16 rows with F32Flag.OUT in P1 store fp32 (linear {out_dtype = "f32"}, the lm head).
    """

    NOP = 0
    GEMV_BF16 = 1
    GEMV_MXFP4 = 2
    RMSNORM = 3
    EXPERT_BF16 = 4
    EXPERT_MXFP4 = 5
    EW = 6
    ROUTER = 7
    KDA = 8
    ATTN_RES = 9
    MLA = 10
    ATTENTION = 11
    ARGMAX = 12
    COMM = 13


class CommOp(enum.IntEnum):
    """SUB word of COMM rows."""

    PUSH = 0
    ALL_REDUCE = 1
    ALL_GATHER = 2


class RankWord(enum.IntEnum):
    """Words after PF_BYTES in multi-rank tables (module docstring)."""

    WAIT_SCOPE = 26
    SIGNAL_SCOPE = 27
    SIGNAL_PEER = 28


class ScopeCode(enum.IntEnum):
    """WAIT_SCOPE / SIGNAL_SCOPE words: the memory-model scope of an acquire or release."""

    GPU = 0    # this GPU's CTAs (every single-rank event)
    SYS = 1    # across GPUs: a counter a peer releases or acquires (V7)


class ExpertMode(enum.IntEnum):
    """SUB word of EXPERT_* rows."""

    GLU = 0    # fused gate/up + SiTU-GLU of the row's (batch, slot) pairs
    DOWN = 1   # down projection of the row's pairs, fp32 (moe_combine is an EW WSUM row)


class EwOp(enum.IntEnum):
    """SUB word of EW rows (registry op in brackets)."""

    ADD = 0          # a + b                                   [add]
    SIGMOID_MUL = 1  # a * sigmoid(b)                          [sigmoid_mul]
    SITU_GLU = 2     # situ_glu(gate=a, up=b)                  [situ_glu]
    SILU_MUL = 3     # silu(a) * b                             [silu_mul]
    SIGMOID = 4      # sigmoid(a)                              [sigmoid]
    KDA_GATE = 5     # -5 sigmoid(exp(A3[c // P2]) (a + b))    [kda_gate], b = dt_bias (P0 = 0)
    CONV = 6         # silu(sum_i state[i] w[c, i] + a w[c, W-1]), state (A1, [B, C, W-1]) shifted
                     # in place, w = A3 [C, W], P2 = W, P0 = state batch stride   [conv_update]
    L2_NORM = 7      # per head of P2: a * rsqrt(sum a^2 + eps) * scale          [l2_norm]
    GATED_RMS = 8    # per head of P2: rms(a) * A3[c % P2] * sigmoid(b)          [gated_rms_norm]
    APPEND = 9       # cache (A1)[b, pos[b], c] = a[b, c]; pos = A3 int32 [B] read at run time
                     # (V3), P0 = cache batch stride, LDY = cache row stride    [cache_append]
    ROPE = 10        # rotate_half rotary embedding per head of P2 columns; pos = A3 int32 [B],
                     # inv_freq = A4 fp32 [P2 / 2]; out must not alias a            [rope]
    GATHER = 11      # out[b, c] = table (A0)[ids[b], c]; ids = A3 int32 [B], LDX = table row
                     # stride (read after the wait, V3)                          [embedding]
    COPY = 12        # a converted to the out dtype                              [cast]
    RMS = 13         # per head of P2: rms(a) * A3[c % P2] (rms_norm of an fp32 input) [rms_norm]
    WSUM = 14        # sum_j<P2 b[b, j] a[b, j, c]: a = slot rows at stride P0 (elements), b = A1
                     # fp32 [B, P2] routing weights                              [moe_combine]


# P1 bit of GEMV_BF16 rows: the weights are in 16-row tiles (backends/cute/weight_tiles.py), read
# by kernels with KernelPlan.gemv_tiles; distinct from every F32Flag bit.
GEMV_TILED = 16


class F32Flag(enum.IntFlag):
    """P1 bits of EW rows (and bit A0 of ROUTER rows): operand is fp32, else bf16."""

    A0 = 1
    A1 = 2
    OUT = 4
    A3 = 8


# ROUTER: scores each lane keeps in registers (one warp per token: experts <= 32 * ROUTER_PER_LANE).
ROUTER_PER_LANE = 32
ROUTER_MAX_TOPK = 32
ATTN_RES_MAX_SOURCES = 16
# ATTN_RES: 16-byte vectors per thread (the row stays in registers): K <= 8 * threads * this.
ATTN_RES_VECS = 2
KDA_MAX_HEAD_DIM = 128
MLA_MAX_LORA = 512
MLA_MAX_ROPE = 64
MLA_MAX_CHUNKS = 1024  # COMBINE keeps one weight per chunk in shared memory
ATTN_MAX_HEAD_DIM = 128


class ArgmaxMode(enum.IntEnum):
    """SUB word of ARGMAX rows."""

    WHOLE = 0    # per batch row: the whole row's greedy token
    PARTIAL = 1  # per (chunk of columns, batch rows): [largest value, its column] fp32 pairs
    COMBINE = 2  # per batch row: the best of the chunks' pairs


class MlaMode(enum.IntEnum):
    """SUB word of MLA rows."""

    PARTIAL = 0  # per (chunk, batch) task: [o / l, m, l] rows of every head
    COMBINE = 1  # per (batch, head) items: log-sum-exp merge of the chunks


# Elements per 16-byte vector load of bf16 data; GEMV and RMSNORM need K % VEC == 0.
VEC_BF16 = 8
# Elements per 16-byte load of packed MXFP4 (= one e8m0 scale block).
VEC_MXFP4 = 32


def f32_bits(x: float) -> int:
    """float32 bit pattern of x, for the AUX word."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def f32_pair(lo: float, hi: float = 0.0) -> int:
    """AUX word holding two float32: lo in bits 0..31 (e.g. scale), hi in bits 32..63 (eps)."""
    return (f32_bits(hi) << 32) | (f32_bits(lo) & 0xFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class TaskRow:
    """One task. Addresses are raw device pointers (tensor.data_ptr()), 16-byte aligned."""

    opcode: Opcode
    task_id: int
    a0: int = 0
    a1: int = 0
    a2: int = 0
    a3: int = 0
    a4: int = 0
    a5: int = 0
    a6: int = 0
    a7: int = 0
    sub: int = 0
    p0: int = 0
    p1: int = 0
    p2: int = 0
    n0: int = 0
    n1: int = 0
    k: int = 0
    ldx: int = 0
    ldy: int = 0
    aux: int = 0
    wait_event: int = NO_EVENT
    wait_per_step: int = 0
    wait_offset: int = 0
    signal_event: int = NO_EVENT
    pf_addr: int = 0
    pf_bytes: int = 0
    wait_scope: int = ScopeCode.GPU      # multi-rank tables only (RankWord)
    signal_scope: int = ScopeCode.GPU
    signal_peer: int = 0

    def words(self, ranked: bool = False) -> list[int]:
        """The ROW_WORDS int64 words of this row, in `Word` order (ROW_WORDS_RANKS with
        the `RankWord`s when `ranked`)."""
        w = [0] * (ROW_WORDS_RANKS if ranked else ROW_WORDS)
        if ranked:
            w[RankWord.WAIT_SCOPE], w[RankWord.SIGNAL_SCOPE] = int(self.wait_scope), int(self.signal_scope)
            w[RankWord.SIGNAL_PEER] = self.signal_peer
        w[Word.OPCODE] = int(self.opcode)
        w[Word.TASK_ID] = self.task_id
        w[Word.WAIT_EVENT] = self.wait_event
        w[Word.WAIT_PER_STEP] = self.wait_per_step
        w[Word.WAIT_OFFSET] = self.wait_offset
        w[Word.SIGNAL_EVENT] = self.signal_event
        w[Word.A0], w[Word.A1], w[Word.A2], w[Word.A3] = self.a0, self.a1, self.a2, self.a3
        w[Word.N0], w[Word.N1], w[Word.K] = self.n0, self.n1, self.k
        w[Word.LDX], w[Word.LDY], w[Word.AUX] = self.ldx, self.ldy, self.aux
        w[Word.A4], w[Word.A5], w[Word.A6], w[Word.A7] = self.a4, self.a5, self.a6, self.a7
        w[Word.SUB], w[Word.P0], w[Word.P1], w[Word.P2] = int(self.sub), self.p0, self.p1, self.p2
        w[Word.PF_ADDR], w[Word.PF_BYTES] = self.pf_addr, self.pf_bytes
        return w

    def threshold(self, step: int) -> int:
        """Counter value this task waits for at `step` (1-based)."""
        return self.wait_per_step * step + self.wait_offset


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Everything the generated megakernel and its table depend on.

    queues[c] lists indices into `tasks` in the order CTA c runs them; the table is laid out
    queue after queue. `num_events` counters are allocated by the runtime.
    """

    tasks: tuple[TaskRow, ...]
    queues: tuple[tuple[int, ...], ...]
    num_events: int
    batch: int = 1
    threads: int = 512
    unroll: int = 4
    rows_per_warp: int = 1  # GEMV_BF16 on CUDA cores: rows a warp streams together (share x loads)
    mma_tiles_per_unit: int = 2  # GEMV_BF16 on tensor cores: 16-row tiles a warp streams together (share x loads)
    # GEMV_BF16 on tensor cores: warps that share one unit's rows, each taking every gemv_kw-th
    # run of MMA_UNROLL 32-column chunks, so the unit's rows are requested gemv_kw x MMA_UNROLL x
    # 64 bytes at a time (a task with fewer units than warp groups gets more warps per unit).
    # 0: the split-K body (one warp per unit, K parts only for tasks with few units). None: 4 at
    # batch <= 8, 0 above (slice4-e128 step on the H200, one run: B = 4 5122 against 5339 us;
    # B = 16 8880 against 8463, where the activations are as many bytes per chunk as a tile's
    # weights; docs/results/cute_speed_h200_slice4-e128_gemv_grouped_stop13.log).
    gemv_kw: int | None = None
    # GEMV_BF16 body: "mma" (tensor cores, weights on M, batch on N; needs K % 32 == 0 in every
    # GEMV_BF16 row), "simt" (CUDA-core dot products, one warp per row), "auto": mma at batch > 1
    # when it can, simt at batch 1 (slice4-e128 on the H200: 3535 us simt vs 3675 us mma at B=1;
    # 6679 vs 7965 us at B=4, 18500 vs 29216 us at B=16; benchmarks/cute_speed.py --gemv-variants).
    gemv: str = "auto"
    # GEMV / EXPERT_BF16 bodies: bulk-prefetch their weight rows into L2 this many loop
    # iterations ahead of the loads (0 = off), so more bytes are in flight than registers hold.
    # Off: at 2 the slice4-e128 step measured 2-6% slower on the H200 (3728 / 7031 / 15627 us
    # at B = 1 / 4 / 16 against 3637 / 6644 / 15162 in the run before, baselines within 3%).
    l2_ahead: int = 0
    # Streamed weight loads under an L2 evict_first policy (createpolicy + ld.global.L2::cache_hint),
    # stop 26: "experts" (EXPERT_BF16 / EXPERT_MXFP4 tensor-core bodies), "all" (and the
    # GEMV_BF16 bodies, tensor-core and CUDA-core) or "" (plain loads). A step streams 11 GB through the 50 MB
    # L2, so everything else (the kernel's 339 KB of code, the task table, activations, the
    # prefetched weights of the next rows) is evicted every ~12 us of streaming. lower.py picks it
    # per batch from measurements; where the gain comes from is not known (the B = 1 profile
    # build showed no row family but the experts shorter).
    weight_evict_first: str = ""
    # The KDA state's fp32 loads and stores (~24 MB read and 20 MB written a step at B = 1, ~200
    # MB at B = 16) and the MLA PARTIAL's cache copies (4.7 MB a layer at B = 1, 75 MB at B = 16)
    # under the same policy: read once a step, like the weights. Stop 26, off until timed.
    kda_state_evict_first: bool = False
    mla_cache_evict_first: bool = False
    # EXPERT_BF16 weight streaming: "regs" (16-byte register loads, UNROLL chunks in flight) or
    # "ring" (cp.async.bulk into a per-warp shared-memory ring, expert_ring; no registers hold the
    # bytes in flight). Slower so far: slice4-e128 B = 4 on the H200 5501 against 5200 us, the
    # experts 3.50 / 3.29 TB/s (stop 16, commit 8134e7a; docs/results/expert_ring_body_stop16.md),
    # hence the register default. With the activation fragments loaded before the stage's wait
    # (stop 17): B = 16 / 4 / 1 9455 / 5497 / 3317 against 8066 / 5209 / 3220 us, same logits
    # (docs/results/plan_variants_h200_slice4-e128_expert_ring_v3_stop17.log);
    # `benchmarks/plan_variants.py --variants expert_stream=ring` measures it.
    expert_stream: str = "regs"
    # EXPERT_BF16: the most pairs one group (one expert's weights streamed once) takes; an
    # expert chosen by more pairs gets another group, which streams its weights again. 8 (one
    # n8 tile): at B = 16 over 128 experts a group holds ~2.5 pairs, and the 16-column body
    # (two tiles, the second almost always past the count) spent as many activation loads as
    # weight loads and spilled at 128 registers (ptxas: 24 B; 112 registers and none at 8;
    # `benchmarks/ptxas_bodies.py`). 16 is the body before.
    expert_cols: int = 8
    # GEMV_BF16 tensor-core bodies: rows flagged GEMV_TILED (P1) read weights the runner repacked
    # into 16-row tiles at bind time, 512 contiguous bytes per warp load (weight_tiles.py; stop
    # 15's microbenchmark: 3.66-3.80 TB/s against 2.2 for row-major at 512 threads). False here
    # because the plan cannot repack weights: the binder decides (weight_tiles.tile_options, on
    # at B > 1) and builds with it.
    gemv_tiles: bool = False
    # EXPERT_BF16 register body: every expert weight in 16-row tiles per expert (the same layout;
    # the runner repacks them; tile_options turns it on at every batch).
    expert_tiles: bool = False
    # EXPERT_MXFP4 on tensor cores: pairs grouped by expert like EXPERT_BF16's register body,
    # weights in MXFP4 tiles (weight_tiles.mx_tile; the binder repacks them), decoded to bf16 in
    # registers with the block scale applied by one bf16x2 multiply (scale bytes <= 128). False:
    # the CUDA-core body, a warp per output row and (batch row, slot) pair. tile_options turns
    # it on wherever the weights tile.
    expert_mx_mma: bool = False
    # EXPERT_MXFP4 tensor-core body: a unit with at most 8 live rows (GLU's 23-24-row tasks end
    # with one) streams its rows' two K halves as the MMA's two 8-row blocks, so it decodes only
    # live rows and takes half the chunks, and a group's tiles are rotated over the warps so each
    # warp gets its share of short units. slice4 on the H200, side by side: B = 16 -2.4%, B = 1
    # -0.3% (plan_variants_h200_slice4_*_stop23.log). The same in the bf16 body measured +0.7% /
    # +0.1% on slice4-e128 (memory-bound there: the dead rows' loads repeat a live row's
    # addresses), so that body keeps whole units (the code is in commit 14492b8).
    expert_half_units: bool = True
    # EXPERT_MXFP4 tensor-core body: 128-column chunks whose loads are issued together per unit,
    # GLU (64 bytes per lane a chunk: gate and up rows g, g + 8) and DOWN (32). With 1 / 2 the
    # body alone holds 64 B per lane in flight in both; stop 22's ptxas counts (GLU 2 or DOWN
    # 3-4: 40-84 B of spills) kept them there untimed. Stop 24's SASS of the body has those
    # spills at task and unit entry and none in a chunk loop (GLU 2 and DOWN 4 as well), so
    # they are fields for a side-by-side run (benchmarks/plan_variants.py). Stop 29: DOWN 4 at
    # slice4 B = 1 -0.3% (control -0.0%), in lower.py's batch-1 plans.
    # Stop 35 timed DOWN units of 32 rows (two 16-row tiles against one load of the activation
    # fragments, GLU's loop; commit 0a1a318 has it): slice4 B = 16 -0.1% with one chunk in
    # flight, +0.3% with two (control +0.3%), B = 1 -0.0% / +0.5%, the same bits
    # (plan_variants_h200_slice4_b*_mx_down_rows_stop35.log): neither the activation loads nor a
    # unit's fixed costs bound DOWN. Removed.
    expert_mx_glu_unroll: int = 1
    expert_mx_down_unroll: int = 2
    # EXPERT_MXFP4 (expert_mx_mma, expert_half_units): a half unit (at most 8 live rows) of a
    # group of at most 4 pairs packs its two K halves into one MMA per k16 step: A's rows g hold
    # the first half's weights and rows g + 8 the second's, B's columns 0-3 the pairs' first-half
    # activations and 4-7 their second-half ones, so the products wanted are D's blocks
    # (rows 0-7, columns 0-3) and (rows 8-15, columns 4-7), summed across lanes q and q + 2 by
    # one shuffle at the unit's end. Without it a half unit multiplies each K half against its
    # own activations with the other row block zero: twice the MMAs and activation loads of a
    # full unit's chunk for half its chunks (stop 36: a half unit costs ~3/4 of a full one).
    # A group of more than 4 pairs keeps that path. Stop 36's expert_mx_acc_split (the odd
    # blocks into a second accumulator set: two MMA chains of 4 per chunk instead of one of 8)
    # measured GLU +7% / DOWN -0.5% at B = 16 and +5% / +2% at B = 1 on the body alone
    # (mx_expert_body_h200_acc_split_stop37.log): removed.
    expert_mx_half_pack: bool = False
    # Stop 36 timed a prefetch.global.L1 of the weight and scale lines 1-3 chunks ahead of the
    # loads (expert_mx_l1_ahead, commit 908a695): on the body alone at B = 16 its long-scoreboard
    # stalls fell from 38% to 21% of the samples but the time did not move (GLU 716 -> 715 /
    # 726 / 746 us, DOWN 398 -> 401 / 401 / 405): the issue slots and the ALU took the stall
    # (mx_expert_body_h200_l1_ahead_stop36.log, ncu_h200_mx_glu_b16_stalls_stop36.txt). Removed.
    spin_timeout_ns: int = 200_000_000
    extra_opcodes: tuple[Opcode, ...] = ()  # bodies to compile even if no task uses them yet
    relaxed_spin: bool = False  # planted bug: spin with relaxed loads and no fence (audit must fail)
    # Diagnostic, WRONG results (benchmarks/mx_expert_body.py only): the EXPERT_MXFP4 tensor-core
    # body without part of its work, to see what bounds it. "no_decode": the raw words go to the
    # MMAs; "no_mma": decoded words are summed instead of multiplied; "loads_only": neither.
    expert_mx_probe: str = ""
    # Delay injection: before its body, task t sleeps delay_ns * (1 + (t * 7919) % 8) / 8, so
    # producers write late and in a reshuffled order; a missing wait then reads stale data.
    delay_ns: int = 0
    profile: bool = False       # record per-row timestamps (PROF_OFFSET_WORDS)
    # MLA PARTIAL: heads per block in m16 tiles (a block's output accumulators stay in registers
    # over the cache). 4: K3's 64 heads in one block. With P and V fragments by ldmatrix (stop 13)
    # the body alone is 152 against 177 us with 3 tiles at B = 16, 53 against 57 at B = 4, and the
    # slice4-e128 step 8076 against 8134 / 5179 against 5196 us (one H200 run,
    # docs/results/mla_partial_h200_stop13.log, cute_speed_h200_slice4-e128_mla_stop13.log).
    mla_head_tiles: int = 4
    # MLA PARTIAL, stop 32 (off until timed): S = Q K^T's chunk loop unrolled at compile time
    # when the row is the widest the kernel takes (K3's 576 columns: 18 chunks of 32; no clamped
    # addresses, no predicated MMAs, loads free to be scheduled ahead), and P V's rescale factors
    # read once per head tile, not once per (output tile, head tile). The same MMAs in the same
    # order: the same bits. Nsight Compute on the body alone (B = 16, 96 heads): 0.36 issued
    # instructions per scheduler cycle, 41% of the stalls on shared-memory loads.
    mla_unrolled: bool = False
    # MLA PARTIAL, stop 32 (off until timed): S = Q K^T split over K. Warp (mt, kq) computes head
    # tile mt against all the stage's rows over a kq-th of the 32-column chunks (the query
    # fragments read once for the stage's four row tiles: half the shared-memory bytes per MMA
    # of one m16n8 tile per warp over the whole row), its partial scores to plane kq; the softmax
    # sums the planes in kq order. Sums in another order: not the same bits.
    mla_s_split: bool = False
    # MLA PARTIAL, stop 34 (lower.py turns it on at B > 1, measured there): the PARTIAL on
    # warpgroup MMA (wgmma) in place of mma.sync (bodies/mla_wgmma.py.j2;
    # benchmarks/mla_wgmma_proto.py is the same computation alone): blocks of 64 heads, S = Q K^T and P V from one 128-byte-swizzled shared-memory
    # stage, the online softmax in the accumulators' registers, no S / P round trip through
    # shared memory. K3's widths only (kv_lora 512, rope 64) and 512 threads (4 warpgroups, 128
    # latent columns each); the mma.sync PARTIAL is compiled out.
    mla_wgmma: bool = False
    # With mla_wgmma (stop 34; on with it in lower.py): S = Q K^T split over K between the four
    # warpgroups, the partial sums exchanged through shared memory (each otherwise computes all of
    # S, reading Q's 72 KB from shared memory four times a stage).
    mla_wgmma_ksplit: bool = False
    # With mla_wgmma (stop 34, not yet timed): cache stages in the shared-memory ring, 2 (one in
    # flight while one is computed on) or 3 (two in flight: 72 KB an SM, for a stage that waits
    # on HBM's latency; the ring, Q and the k-split exchange then take 213 KB). Stop 35, slice4-e128
    # against the default (A/A control): 3 stages B = 16 +15.3%, B = 4 +9.5% (slower: the shared
    # memory it takes from L1, or its longer waits; not profiled), so 2.
    mla_wgmma_stages: int = 2
    # MLA COMBINE, stop 25 (off until timed): lora / 2 threads per (b, h) item, the chunk weights
    # computed per thread as it goes, no barrier (the template's MLA_COMB_PAIRS). At B = 16 the
    # CTA-per-item combine was ~53 us on the critical path (stop 20 profile) for ~17 MB of
    # partials. Sums in another order: not the same bits.
    mla_combine_pairs: bool = False
    # MLA COMBINE: chunks' partial rows each thread has in flight before its multiply-adds. At
    # B = 1 the combine merges 128 chunks, 16 waited-for L2 round trips at 8 (~12 us of the
    # step's critical path, stop 26's profile); stop 26, off until timed.
    mla_combine_unroll: int = 8
    # EW body: elements (loads) in flight per thread, every loop over them unrolled. 8 by default.
    # A probe of stop 26's question: at B = 1 the EW rows on the critical path run 1.6-7 us for
    # a few thousand elements and their length follows the size of their math's code (SiTU-GLU
    # 6.9 us for 1988 columns, ADD 1.6 us for 56), as if fetching cold code cost more than the
    # loads; 4 or 2 halves or quarters every EW instance's code. Stop 29 timed it on slice4 at
    # B = 1: 4 and 2 both -2.0% (control -0.0%); stop 30 at B = 16: 4 -2.7% (control +0.8%),
    # so lower.py's plans take 4; 8 here.
    ew_unroll: int = 8
    # The norms that GEMV tasks run as their prologue, at B > 1 (stop 35; lower.py's plans at B > 4):
    # RMSNORM takes the task's rows at once, NUM_WARPS // rows warps a row (it took them one after
    # another with the whole CTA: 17.6 us of B = 16's critical path for layer 0's q/kv prologue,
    # stop 31's profile), 8 vectors in flight a lane; EW's fp32 RMS path (the latent norm before
    # latent_up, ~17 us of each MoE layer's path at B = 16) loads 8 vectors a lane a round and its
    # bf16 weights and outputs 4 to a load or store. EW, and RMSNORM at B = 1: the same operations
    # in the same order, the same bits; RMSNORM at B > 1 sums a row's squares in another order.
    norm_rows_parallel: bool = False
    # EW body: an element index's (batch row, column) by a per-row magic multiply and shift
    # instead of an integer division per element (the same values). Stop 26, off until timed:
    # part of the code-size probe (the EW body is 182 of the K3 kernel's 336 KB at B = 1).
    ew_fast_div: bool = False
    # The dispatch loop between rows (stop 26, off until timed): the B = 1 profile, its rows
    # matched to their events, has every wait 1.28 us (median) from its event's release (or from
    # the wait's start when already released) to the body, ~170 us of the 3065-us critical path
    # over its 113 rows. Per row thread 0 reads the row's table line (from HBM: read once a step),
    # the next row's PF words, polls the event and then the error flag (two acquire round
    # trips). lean_dispatch: the error flag once per launch and while spinning only; the next
    # row's header words (OPCODE .. SIGNAL_EVENT) copied into shared memory by cp.async while the
    # current row runs, and the lines of the rows after it prefetched into L2. Stop 27, on at
    # every batch: slice4-e128 3043 -> 2987 us at B = 1 (-1.9%, control +0.0%); off measured
    # +2.0% at B = 1, +0.4% at 4 (control +0.1%), +0.1% at 16 (control -0.2%)
    # (docs/results/plan_variants_h200_slice4-e128_*_stop27.log).
    lean_dispatch: bool = True
    # The wait itself (stop 27; off here, on in every plan lower.py builds since stop 28's timing). Thread 0 issues a row's weight prefetch (the PF
    # words of it and the next row: two dependent table round trips) before its first poll, so a
    # row whose event is already released waits for them too: on B = 1's critical path 78 of the
    # 113 row transitions are on one CTA (127 us, ~1.6 us each, stop 26's walk). spin_first: poll
    # first, prefetch only when the event is short, and (lean_dispatch) the wait's words from the
    # row header in shared memory, not the table: where four dependent global round trips came
    # before the first poll (the two rows' PF words, the wait words, the poll), the poll is the
    # first. spin_err_every: with lean_dispatch the spin
    # reads the error flag after every short poll (two acquire round trips a poll); n > 1 reads it
    # on every n-th poll (a CTA still stops within n polls of another's timeout).
    spin_first: bool = False
    spin_err_every: int = 1
    # The thread that releases a finished row's event (stop 27; off here, 32 in lower.py's plans). Thread 0 did
    # it, and its release (a fence that waits for the CTA's stores to reach L2, then the atomic)
    # came before it could start the next row's header and wait. 32: warp 1's lane 0 signals
    # after the same barrier (which orders every thread's stores before it) while thread 0 goes
    # on; the next row's header copy then waits until after the next barrier, when warp 1 has
    # read the signal word out of the buffer it would overwrite. Needs lean_dispatch.
    signal_tid: int = 0
    # The bodies' table words (stop 27; off here, on in lower.py's plans): every body starts by reading its row's
    # words (addresses, sizes) from the table, one L2 round trip (lean_dispatch prefetched the
    # lines) before its first real load, on each of the critical path's rows. lean_row_smem:
    # the header copy takes the whole row and the bodies read their words from shared memory.
    # Needs lean_dispatch.
    lean_row_smem: bool = False
    # ROUTER (stop 29; off here, on in lower.py's plans): the picks' sigmoid scores loaded after the k rounds of
    # the warp argmax, each lane r < k its own pick's logit in one parallel load, instead of the
    # winner's logit loaded again in every round (k dependent L2 round trips: at 896 experts the
    # router row took 27-31 us of slice4's B = 1 critical path in each MoE layer, stop 29's
    # profile, with no weight streaming beside it). The same sigmoid of the same logit: the same
    # bits. slice4 B = 1 on the H200: -0.8% (control -0.0%); at B = 16 with router_compact -0.3%.
    router_late_scores: bool = False
    # ROUTER (stop 30; 0 = off here, 4 in lower.py's plans): the scores by a loop over passes of this many
    # experts, each pass's loads issued before its sigmoids, the scores parked in the warp's
    # slice of the shared scratch, instead of a loop unrolled over the lane's ROUTER_PER_LANE
    # experts. Why: the 896-expert router row took 27-31 us of slice4's B = 1 step for one token
    # (the 128-expert one ~7), and neither its loads (issued together: +0.6%) nor its argmax
    # rounds' scan (a pairwise tree: -0.1%) were the cost (stop 30, slice4 B = 1, control
    # -0.1%); the unrolled score loop is ~1500 instructions, run once a layer and fetched cold,
    # as the EW rows' code was (ew_unroll, stop 29). Same operations in the same order: same bits.
    # With 4 the row is ~520 instructions (~1600 before); slice4 B = 1: -0.8% (control +0.1%).
    router_compact: int = 0
    # ROUTER (stop 33; off until timed): the whole CTA per token (_router_split): each thread
    # scores 2 of 896 experts, each warp picks its k best (k warp argmax rounds over 2 scores a
    # lane), warp 0 the k best of those NUM_WARPS x k candidates (16 a lane), where the warp per
    # token scanned 28 scores a lane in each of its 16 rounds (~650 cycles a round, stop 31's
    # count: ~5 us of each 896-expert router row on B = 1's critical path). The same picks in
    # the same order and the same weight arithmetic: the same bits.
    router_split: bool = False
    # What a waiting CTA prefetches of a GEMV row's tile (stop 27, off until timed). The B = 1
    # profile has no CTA streaming weights for 363 of the step's 3065 us (33 gaps of 1-57 us:
    # ATTN_RES, KDA, router, MLA, the norms), and the PF words' 64 KiB prefix of a tile is the
    # first 4.5 weight rows of a 7168-wide GEMV: 5 of the CUDA-core body's 32 first rows, so the
    # other warps start from HBM and the tile ends no sooner (stop 14: caps of 128-512 KiB did
    # not help). "stripe": the budget split over the rows the body reads first (the CUDA-core
    # body only; the tensor-core bodies keep the prefix). Measured at B = 1 (stop 27): +0.7%,
    # with pf_budget_kb 128 / 256 +0.9 / +1.4% (control +0.0%): prefetching more in the gaps
    # slows the step, so both stay off; why is not known (the gaps' own loads queue behind it?).
    gemv_pf: str = "prefix"
    # Bytes per row a waiting CTA prefetches, in KiB (0: the row's PF_BYTES, 64 KiB by the
    # lowering); never more than the row's tile.
    pf_budget_kb: int = 0
    # MLA COMBINE (the CTA per item): warp 0 reads the chunks' (m, l) once, 4 chunks per lane in
    # flight, where the loop before read m, then m and l again, one chunk per lane at a time (8
    # waited-for round trips at 128 chunks); the same bits. Stop 26, off until timed.
    mla_combine_weights_once: bool = False
    mxfp4_decode: str = "f16"  # "f16": nibble -> f16 bits (6 int ops / 2 values); "lut": old path
    name: str = "megakernel"
    ranks: int = 1      # R > 1: this is one rank's table of a multi-rank step (module docstring)
    rank: int = 0       # which rank's (the bounded-wait error names it)
    peer_signal_gpu: bool = False   # planted bug: peer signals released at gpu scope (audit must fail)

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= 16:
            raise ValueError(f"batch {self.batch} not in 1..16")
        if self.signal_tid not in (0, 32) or (self.signal_tid and (not self.lean_dispatch or self.threads < 64)):
            raise ValueError(f"signal_tid {self.signal_tid} must be 0, or 32 with lean_dispatch and >= 64 threads")
        if self.lean_row_smem and not self.lean_dispatch:
            raise ValueError("lean_row_smem needs lean_dispatch")
        if not 1 <= self.spin_err_every <= 64:
            raise ValueError(f"spin_err_every {self.spin_err_every} must be 1..64")
        if self.gemv_pf not in ("prefix", "stripe") or not 0 <= self.pf_budget_kb <= 4096:
            raise ValueError(f"gemv_pf {self.gemv_pf!r} must be 'prefix' or 'stripe', pf_budget_kb 0..4096")
        if self.gemv not in ("auto", "mma", "simt"):
            raise ValueError(f"gemv {self.gemv!r} must be 'auto', 'mma' or 'simt'")
        if self.gemv == "mma" and not self._mma_fits():
            raise ValueError("gemv='mma' needs K % 32 == 0 in every GEMV_BF16 row")
        if self.gemv_kw is not None and (self.gemv_kw not in (0, 1, 2, 4, 8, 16) or self.gemv_kw * 32 > self.threads):
            raise ValueError(f"gemv_kw {self.gemv_kw} must be 0 or a power of two up to the warps")
        if self.mma_tiles_per_unit not in (1, 2, 4):
            raise ValueError(f"mma_tiles_per_unit {self.mma_tiles_per_unit} must be 1, 2 or 4")
        if not 1 <= self.mla_combine_unroll <= (16 if self.mla_combine_pairs else 32):
            raise ValueError(f"mla_combine_unroll {self.mla_combine_unroll} must be 1..32 (1..16 with mla_combine_pairs)")
        if self.ew_fast_div:
            big = [t.task_id for t in self.tasks if t.opcode == Opcode.EW and self.batch * max(t.n1 - t.n0, 1) >= 1 << 30]
            if big:
                raise ValueError(f"ew_fast_div: EW rows of tasks {big[:4]} have 2^30 elements or more")
        if self.ew_unroll not in (2, 4, 8):
            raise ValueError(f"ew_unroll {self.ew_unroll} must be 2, 4 or 8")
        if self.router_compact not in (0, 1, 2, 4, 8):
            raise ValueError(f"router_compact {self.router_compact} must be 0 (off), 1, 2, 4 or 8")
        if self.weight_evict_first not in ("", "experts", "all"):
            raise ValueError(f"weight_evict_first {self.weight_evict_first!r} must be '', 'experts' or 'all'")
        if self.mla_wgmma and self.threads != 512:
            raise ValueError(f"mla_wgmma needs 512 threads (4 warpgroups), not {self.threads}")
        if self.mla_wgmma_ksplit and not self.mla_wgmma:
            raise ValueError("mla_wgmma_ksplit needs mla_wgmma")
        if self.mla_wgmma_stages not in (2, 3) or (self.mla_wgmma_stages == 3 and not self.mla_wgmma):
            raise ValueError(f"mla_wgmma_stages {self.mla_wgmma_stages} must be 2, or 3 with mla_wgmma")
        if not 1 <= self.mla_head_tiles <= 4:
            raise ValueError(f"mla_head_tiles {self.mla_head_tiles} must be 1..4")
        if self.expert_stream not in ("regs", "ring"):
            raise ValueError(f"expert_stream {self.expert_stream!r} must be 'regs' or 'ring'")
        if self.gemv_tiles and (not self.gemv_mma or self.l2_ahead or self.ranks > 1):
            raise ValueError("gemv_tiles needs the tensor-core GEMV body (gemv_mma), l2_ahead 0 and one rank")
        if self.expert_tiles and (self.expert_stream != "regs" or self.l2_ahead or self.ranks > 1):
            raise ValueError("expert_tiles needs the register expert body (expert_stream 'regs'), l2_ahead 0 "
                             "and one rank")
        if self.expert_mx_probe not in ("", "no_decode", "no_mma", "loads_only") or (
                self.expert_mx_probe and not self.expert_mx_mma):
            raise ValueError(f"expert_mx_probe {self.expert_mx_probe!r} must be '', 'no_decode', 'no_mma' or "
                             "'loads_only', and needs expert_mx_mma")
        if self.expert_mx_mma and (self.ranks > 1 or any(
                t.k % 128 for t in self.tasks if t.opcode == Opcode.EXPERT_MXFP4)):
            raise ValueError("expert_mx_mma needs K % 128 == 0 in every EXPERT_MXFP4 row and one rank")
        if self.expert_mx_half_pack and not (self.expert_mx_mma and self.expert_half_units):
            raise ValueError("expert_mx_half_pack needs expert_mx_mma and expert_half_units")
        if not (1 <= self.expert_mx_glu_unroll <= 4 and 1 <= self.expert_mx_down_unroll <= 4):
            raise ValueError(f"expert_mx_glu_unroll {self.expert_mx_glu_unroll} and expert_mx_down_unroll "
                             f"{self.expert_mx_down_unroll} must be 1..4")
        if self.expert_cols not in (8, 16):
            raise ValueError(f"expert_cols {self.expert_cols} must be 8 or 16")
        if self.mxfp4_decode not in ("f16", "lut"):
            raise ValueError(f"mxfp4_decode {self.mxfp4_decode!r} must be 'f16' or 'lut'")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads {self.threads} must be a multiple of 32 in 32..1024")
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank {self.rank} not in 0..{self.ranks - 1}")
        seen = sorted(i for q in self.queues for i in q)
        if seen != list(range(len(self.tasks))):
            raise ValueError("queues must hold every task exactly once")
        for t in self.tasks:
            for ev in (t.wait_event, t.signal_event):
                if ev != NO_EVENT and not 0 <= ev < self.num_events:
                    raise ValueError(f"task {t.task_id}: event {ev} out of range")
            if self.ranks == 1 and (t.opcode == Opcode.COMM or t.signal_peer or t.wait_scope or t.signal_scope
                                    or (t.opcode in (Opcode.EXPERT_BF16, Opcode.EXPERT_MXFP4) and t.a7)):
                raise ValueError(f"task {t.task_id}: COMM rows, peers and system scope need a multi-rank plan")
            if t.signal_peer and not (0 < t.signal_peer < self.ranks and t.signal_scope == ScopeCode.SYS):
                raise ValueError(f"task {t.task_id}: signal peer offset {t.signal_peer} needs 0 < p < {self.ranks} "
                                 "and system scope")
            if t.pf_bytes < 0 or t.pf_bytes % 16 or t.pf_addr % 16:
                raise ValueError(f"task {t.task_id}: prefetch range ({t.pf_addr}, {t.pf_bytes} bytes) must be "
                                 "16-byte aligned with a length that is a multiple of 16")
            if t.opcode == Opcode.ROUTER and (t.k > 32 * ROUTER_PER_LANE or not 0 < t.p0 <= ROUTER_MAX_TOPK):
                raise ValueError(f"task {t.task_id}: router needs experts <= "
                                 f"{32 * ROUTER_PER_LANE} and 0 < topk <= {ROUTER_MAX_TOPK}")
            if (t.opcode == Opcode.EXPERT_BF16 or (t.opcode == Opcode.EXPERT_MXFP4 and self.expert_mx_mma)) and (
                    t.k % 32 or ((t.p0 & 0xFFFF) - (t.p0 >> 16)) * ((t.p2 & 0xFFFF) - (t.p2 >> 16))
                    > self.batch * ROUTER_MAX_TOPK):
                raise ValueError(f"task {t.task_id}: {t.opcode.name} needs K % 32 == 0 and at most "
                                 f"batch x {ROUTER_MAX_TOPK} (batch row, slot) pairs")
            if t.opcode == Opcode.KDA and t.k != self.kda_head_dim:
                raise ValueError(f"task {t.task_id}: KDA head dim {t.k}: every KDA row of a kernel needs "
                                 f"one head dim ({self.kda_head_dim})")
            if t.opcode == Opcode.KDA and (t.k > KDA_MAX_HEAD_DIM or self.threads % max(1, t.k)
                                           or t.k * t.k % self.threads):
                raise ValueError(f"task {t.task_id}: KDA head dim {t.k} must be <= {KDA_MAX_HEAD_DIM}, "
                                 f"divide threads={self.threads} and D*D be a multiple of it")
            if t.opcode == Opcode.EW and t.k and not 0 <= (t.k >> 16) < (t.k & 0xFFFF) <= self.batch:
                raise ValueError(f"task {t.task_id}: EW batch rows {t.k >> 16}..{t.k & 0xFFFF} are not a "
                                 f"range within 0..{self.batch}")
            if t.opcode == Opcode.ATTN_RES and not 0 < t.p1 <= ATTN_RES_MAX_SOURCES:
                raise ValueError(f"task {t.task_id}: attn_res needs 1..{ATTN_RES_MAX_SOURCES} sources")
            if t.opcode == Opcode.MLA and (t.k > MLA_MAX_LORA or t.p2 > MLA_MAX_ROPE or t.p1 > MLA_MAX_CHUNKS):
                raise ValueError(f"task {t.task_id}: MLA needs kv_lora <= {MLA_MAX_LORA}, rope <= {MLA_MAX_ROPE}, "
                                 f"chunks <= {MLA_MAX_CHUNKS}")
            if (self.mla_combine_pairs and t.opcode == Opcode.MLA and t.sub == MlaMode.COMBINE
                    and (t.k % 2 or t.k // 2 > self.threads)):
                raise ValueError(f"task {t.task_id}: mla_combine_pairs needs kv_lora even and at most "
                                 f"2 * threads ({2 * self.threads})")
            if (self.mla_wgmma and t.opcode == Opcode.MLA and t.sub == MlaMode.PARTIAL
                    and (t.k != MLA_MAX_LORA or t.p2 != MLA_MAX_ROPE)):
                raise ValueError(f"task {t.task_id}: mla_wgmma needs kv_lora {MLA_MAX_LORA} and rope "
                                 f"{MLA_MAX_ROPE} (K3's widths), not {t.k} and {t.p2}")
            # 16-byte vector loads: MLA PARTIAL (q_lat, q_pe through its strides, cache rows),
            # ATTN_RES (source, weight and output rows), ARGMAX (logit rows).
            if t.opcode == Opcode.MLA and t.sub == MlaMode.PARTIAL and (
                    t.k % 32 or t.p2 % 8 or not t.p2 or t.a6 % 8 or t.a7 % 8 or t.a1 % 16):
                # kv_lora % 32: a 32-column chunk of the tensor-core dot is all latent or all rope
                raise ValueError(f"task {t.task_id}: MLA PARTIAL needs kv_lora a multiple of 32, rope of 8, "
                                 "q_pe 16-byte aligned with strides of 8 elements")
            if t.opcode == Opcode.ATTN_RES and t.k > 8 * ATTN_RES_VECS * self.threads:
                raise ValueError(f"task {t.task_id}: ATTN_RES width {t.k} > {8 * ATTN_RES_VECS * self.threads} "
                                 f"(8 x ATTN_RES_VECS x threads)")
            if t.opcode == Opcode.ATTN_RES and (t.k % 8 or t.ldx % 8 or t.ldy % 8 or t.a0 % 8):
                raise ValueError(f"task {t.task_id}: ATTN_RES needs width and row strides multiples of 8 "
                                 "(16-byte rows) and an 8-byte aligned source table")
            if t.opcode == Opcode.ARGMAX and t.sub != ArgmaxMode.COMBINE and (t.ldx % 8 or t.a0 % 16):
                raise ValueError(f"task {t.task_id}: ARGMAX needs a row stride multiple of 8 and a 16-byte "
                                 "aligned first column (16-byte rows)")
            if t.opcode == Opcode.ATTENTION and not (0 < t.k <= ATTN_MAX_HEAD_DIM and t.k % 32 == 0):
                raise ValueError(f"task {t.task_id}: attention head dim {t.k} must be a multiple of 32 "
                                 f"up to {ATTN_MAX_HEAD_DIM}")
            if t.opcode in (Opcode.EW, Opcode.ROUTER, Opcode.KDA, Opcode.ATTN_RES, Opcode.MLA,
                            Opcode.ATTENTION, Opcode.ARGMAX, Opcode.COMM):
                continue  # scalar loads: no vector alignment rules
            vec = VEC_MXFP4 if t.opcode in (Opcode.GEMV_MXFP4, Opcode.EXPERT_MXFP4) else VEC_BF16
            # GEMV_BF16 stores scalars, so its output rows need no 16-byte stride.
            ldy_vec = t.ldy % 8 if t.opcode != Opcode.GEMV_BF16 else 0
            if t.opcode != Opcode.NOP and (t.k % vec or t.n1 < t.n0 or t.ldx % 8 or ldy_vec):
                raise ValueError(f"task {t.task_id}: K={t.k} must be a multiple of {vec}, "
                                 f"LDX={t.ldx} and LDY={t.ldy} of 8 (16-byte rows), N0 <= N1")

    def _mma_fits(self) -> bool:
        return gemv_mma_fits(self.tasks)

    @property
    def gemv_mma(self) -> bool:
        """GEMV_BF16 rows run on tensor cores (the template's switch)."""
        return gemv_on_tensor_cores(self.gemv, self.batch, self.tasks)

    @property
    def gemv_warps_per_unit(self) -> int:
        """gemv_kw resolved (the template's GEMV_KW): 0 selects the split-K body."""
        if self.gemv_kw is not None:
            return self.gemv_kw
        return min(4, self.threads // 32) if self.batch <= 8 else 0

    @property
    def num_ctas(self) -> int:
        return len(self.queues)

    @property
    def router_per_lane(self) -> int:
        """Expert scores each lane of a ROUTER warp keeps: ceil(experts / 32) of the widest ROUTER
        row, compiled in (with the ROUTER_PER_LANE maximum for every plan, a 128-expert router
        ran 32 clamped loads and 32-register scans per pick: 20 us per token at B = 1 on the H200,
        on the critical path once per MoE layer)."""
        widest = max((t.k for t in self.tasks if t.opcode == Opcode.ROUTER), default=0)
        return min(ROUTER_PER_LANE, max(1, -(-widest // 32)))

    @property
    def expert_ring(self) -> tuple[int, int]:
        """(bytes of a weight row per stage, stages) of the "ring" EXPERT_BF16 body: the widest of
        256 / 128 / 64 bytes dividing every EXPERT_BF16 row's K in bytes, and as many stages (2 to
        8) as fit all warps' rings in 128 KB (with the MLA body's 160 KB of scratch, the kernel's
        shared memory, and so its L1, stays as it was). A load-only microbenchmark on the H200
        streamed 256-byte row copies with two 128 KB stages at 4.31 TB/s, 128-byte ones at 3.60
        (docs/results/tma_stream_microbench_h200_stop16.md)."""
        ks = [t.k for t in self.tasks if t.opcode == Opcode.EXPERT_BF16]
        rb = next(r for r in (256, 128, 64) if all(2 * k % r == 0 for k in ks))
        stages = 128 * 1024 // ((self.threads // 32) * 16 * rb)
        return rb, max(2, min(8, stages))

    @property
    def kda_head_dim(self) -> int:
        """The head dim of the KDA rows (one per kernel: the body's state indexing is compiled
        for it, so its addresses are immediates; KDA_MAX_HEAD_DIM when there are none)."""
        dims = {t.k for t in self.tasks if t.opcode == Opcode.KDA}
        return dims.pop() if len(dims) == 1 else KDA_MAX_HEAD_DIM

    @property
    def opcodes(self) -> tuple[Opcode, ...]:
        """Bodies the kernel needs (NOP always: it is the wait/signal skeleton)."""
        used = {t.opcode for t in self.tasks} | set(self.extra_opcodes) | {Opcode.NOP}
        return tuple(sorted(used))

    def table_words(self) -> tuple[list[list[int]], list[list[int]]]:
        """(table rows in queue order, queue [start, end) per CTA)."""
        rows: list[list[int]] = []
        bounds: list[list[int]] = []
        for q in self.queues:
            start = len(rows)
            rows.extend(self.tasks[i].words(self.ranks > 1) for i in q)
            bounds.append([start, len(rows)])
        return rows, bounds

    def with_tasks(self, tasks: Sequence[TaskRow]) -> "KernelPlan":
        """Same kernel, new table (e.g. new buffer addresses): no recompilation needed."""
        return dataclasses.replace(self, tasks=tuple(tasks))


def round_robin_queues(num_tasks: int, num_ctas: int = H200_SMS) -> tuple[tuple[int, ...], ...]:
    """Task i -> CTA i % num_ctas, in task order (a placeholder for the cost-model scheduler)."""
    return tuple(tuple(range(c, num_tasks, num_ctas)) for c in range(num_ctas))


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, n) into `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def gemv_mma_fits(rows) -> bool:
    """Every GEMV_BF16 row's K splits into the tensor-core body's 32-column chunks."""
    return all(t.k % 32 == 0 for t in rows if t.opcode == Opcode.GEMV_BF16)


def gemv_on_tensor_cores(gemv: str, batch: int, rows) -> bool:
    """KernelPlan.gemv resolved: "auto" takes the tensor-core body at batch > 1 when K fits."""
    return gemv == "mma" or (gemv == "auto" and batch > 1 and gemv_mma_fits(rows))
