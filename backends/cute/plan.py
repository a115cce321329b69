"""KernelPlan: every decision the CuTe megakernel makes, as frozen data.

The scheduler (passes/schedule.py and friends) targets this module and nothing else in the
backend: it builds `TaskRow`s, assigns them to per-CTA queues and wraps them in a `KernelPlan`.
The code generator only renders the plan (templates loop over it); the runtime only encodes it.

Compile-time part (changes the generated kernel): `opcodes` used, `threads`, `batch`,
`unroll`, `rows_per_warp`, `num_ctas`, `spin_timeout_ns`, `relaxed_spin` (planted bug for the PTX audit).
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
  12    K              reduction length (GEMV) or hidden size (RMSNORM)
  13    LDX            row stride of the activation operand, in elements
  14    LDY            row stride of the output, in elements
  15    AUX            opcode-specific scalar (RMSNORM: float32 bits of eps)

Events are int32 counters that only grow: nothing is reset between steps, so one launch per
step (or one CUDA-graph replay) is enough. A task that needs several waits is preceded in its
queue by NOP rows that each wait on one event (queues run in order, so the waits add up).
"""
from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Sequence

ROW_WORDS = 16
H200_SMS = 132
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
    """

    NOP = 0
    GEMV_BF16 = 1
    GEMV_MXFP4 = 2
    RMSNORM = 3


# Elements per 16-byte vector load of bf16 data; GEMV and RMSNORM need K % VEC == 0.
VEC_BF16 = 8
# Elements per 16-byte load of packed MXFP4 (= one e8m0 scale block).
VEC_MXFP4 = 32


def f32_bits(x: float) -> int:
    """float32 bit pattern of x, for the AUX word."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclasses.dataclass(frozen=True)
class TaskRow:
    """One task. Addresses are raw device pointers (tensor.data_ptr()), 16-byte aligned."""

    opcode: Opcode
    task_id: int
    a0: int = 0
    a1: int = 0
    a2: int = 0
    a3: int = 0
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

    def words(self) -> list[int]:
        """The ROW_WORDS int64 words of this row, in `Word` order."""
        w = [0] * ROW_WORDS
        w[Word.OPCODE] = int(self.opcode)
        w[Word.TASK_ID] = self.task_id
        w[Word.WAIT_EVENT] = self.wait_event
        w[Word.WAIT_PER_STEP] = self.wait_per_step
        w[Word.WAIT_OFFSET] = self.wait_offset
        w[Word.SIGNAL_EVENT] = self.signal_event
        w[Word.A0], w[Word.A1], w[Word.A2], w[Word.A3] = self.a0, self.a1, self.a2, self.a3
        w[Word.N0], w[Word.N1], w[Word.K] = self.n0, self.n1, self.k
        w[Word.LDX], w[Word.LDY], w[Word.AUX] = self.ldx, self.ldy, self.aux
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
    rows_per_warp: int = 1  # GEMV_BF16: rows a warp streams together (share x loads)
    spin_timeout_ns: int = 200_000_000
    extra_opcodes: tuple[Opcode, ...] = ()  # bodies to compile even if no task uses them yet
    relaxed_spin: bool = False  # planted bug: spin with relaxed loads and no fence (audit must fail)
    name: str = "megakernel"

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= 16:
            raise ValueError(f"batch {self.batch} not in 1..16")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads {self.threads} must be a multiple of 32 in 32..1024")
        seen = sorted(i for q in self.queues for i in q)
        if seen != list(range(len(self.tasks))):
            raise ValueError("queues must hold every task exactly once")
        for t in self.tasks:
            for ev in (t.wait_event, t.signal_event):
                if ev != NO_EVENT and not 0 <= ev < self.num_events:
                    raise ValueError(f"task {t.task_id}: event {ev} out of range")
            vec = VEC_MXFP4 if t.opcode == Opcode.GEMV_MXFP4 else VEC_BF16
            if t.opcode != Opcode.NOP and (t.k % vec or t.n1 < t.n0 or t.ldx % 8 or t.ldy % 8):
                raise ValueError(f"task {t.task_id}: K={t.k} must be a multiple of {vec}, "
                                 f"LDX={t.ldx} and LDY={t.ldy} of 8 (16-byte rows), N0 <= N1")

    @property
    def num_ctas(self) -> int:
        return len(self.queues)

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
            rows.extend(self.tasks[i].words() for i in q)
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
