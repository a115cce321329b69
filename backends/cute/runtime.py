"""Host runtime of the CuTe megakernel: device buffers, compile, launch, error check, graphs.

    rt = Megakernel(plan)          # generates + compiles (once per compile-time plan)
    rt.step()                      # step counter += 1, one launch (one CTA per queue)
    rt.check()                     # synchronizes; raises MegakernelTimeout if a wait timed out
    g = rt.capture_graph()         # CUDA graph of (step += 1, launch); g.replay() per step

Buffers: the task table (int64 [T, ROW_WORDS]), per-CTA queue bounds (int32 [C, 2]), event
counters (int32 [E], zeroed once, never reset: thresholds grow with the step), the error buffer
(int32 [ERR_WORDS], see plan.ErrWord) and the step counter (int32 [1], 1-based at the first
launch). The kernel reads the step from device memory, so a captured graph stays valid.
"""
from __future__ import annotations

import os

from .plan import ERR_WORDS, PROF_FIELDS, PROF_OFFSET_WORDS, ROW_WORDS, ErrWord, KernelPlan


def _on(t, device) -> bool:
    """Whether tensor `t` is on `device` ("cuda" meaning any CUDA device)."""
    return t.device.type == device.type and device.index in (None, t.device.index)


class MegakernelTimeout(RuntimeError):
    """A bounded wait expired: names the task, event, expected and seen counter values."""

    def __init__(self, info: dict):
        self.info = info
        super().__init__(
            (f"rank {info['rank']}: " if "rank" in info else "") +
            "megakernel wait timed out: task {task_id} (CTA {cta}, step {step}) waited on event "
            "{event} for counter >= {expected} but saw {seen}; a producer never signalled "
            "(missing signal, wrong threshold or a dead producer)".format(**info))


class Megakernel:
    """Compiled megakernel plus the device state it walks."""

    def __init__(self, plan: KernelPlan, out_dir: str | os.PathLike | None = None,
                 device: str = "cuda", events=None):
        """`events`: the event counters allocated elsewhere (e.g. in symmetric memory, where the
        peers' kernels signal them: backends/cute/dist.py), a contiguous int32 vector of at least
        `plan.num_events` entries on `device`, zeroed here; default a new zeroed one."""
        import torch

        from .codegen import compile_plan

        self.plan = plan
        self.device = torch.device(device)
        if events is not None and (events.dtype != torch.int32 or events.dim() != 1 or not events.is_contiguous()
                                   or events.numel() < max(1, plan.num_events) or not _on(events, self.device)):
            raise ValueError(f"events must be a contiguous int32 vector of at least {max(1, plan.num_events)} "
                             f"entries on {self.device}, got {events.dtype} {list(events.shape)} on {events.device}")
        self.compiled, self.module_path, _ = compile_plan(plan, out_dir)
        if events is None:
            self.events = torch.zeros(max(1, plan.num_events), dtype=torch.int32, device=device)
        else:
            self.events = events.zero_()
        # Profile mode keeps int64 [tasks, PROF_FIELDS] timestamps after the error words.
        words = PROF_OFFSET_WORDS + 2 * PROF_FIELDS * max(1, len(plan.tasks)) if plan.profile else ERR_WORDS
        self.err = torch.zeros(words, dtype=torch.int32, device=device)
        self.step_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.steps_launched = 0
        # R > 1: int64 [R], entry p = the event counters of rank (rank + p) % R as this process
        # addresses them (set_peers; backends/cute/rank_group.py).
        self.peers = None
        self.set_tasks(plan)

    def sibling(self, plan: KernelPlan) -> "Megakernel":
        """Another instance of this compiled kernel with its own table, events, error buffer and
        step counter (no recompilation): e.g. the same step with a different prefetch table."""
        import torch

        mk = object.__new__(Megakernel)
        mk.plan, mk.device, mk.compiled, mk.module_path = self.plan, self.device, self.compiled, self.module_path
        mk.events = torch.zeros_like(self.events)
        mk.err = torch.zeros_like(self.err)
        mk.step_buf = torch.zeros_like(self.step_buf)
        mk.steps_launched = 0
        mk.peers = None
        mk.set_tasks(plan)
        return mk

    def set_tasks(self, plan: KernelPlan) -> None:
        """Upload a table for the same compiled kernel (new addresses, same shape of work)."""
        import torch

        from .codegen import compile_key

        if compile_key(plan) != compile_key(self.plan):
            raise ValueError("plan needs a different kernel: build a new Megakernel")
        rows, bounds = plan.table_words()
        rows = rows or [[0] * ROW_WORDS]
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.queues = torch.tensor(bounds, dtype=torch.int32, device=self.device)
        self.num_tasks = len(plan.tasks)
        self.plan = plan

    def set_peers(self, peers) -> None:
        """R > 1: the peers table (int64 [R] on the device, entry p = the event counters of rank
        (rank + p) % R; entry 0 this kernel's own `events`)."""
        if self.plan.ranks == 1:
            raise ValueError("a one-rank kernel has no peers")
        if peers.numel() != self.plan.ranks or int(peers[0]) != self.events.data_ptr():
            raise ValueError(f"peers table must have {self.plan.ranks} entries, entry 0 this kernel's events")
        self.peers = peers

    def _args(self):
        return (self.table.data_ptr(), self.queues.data_ptr(), self.events.data_ptr(),
                self.err.data_ptr(), self.step_buf.data_ptr(), max(1, self.num_tasks))

    def launch(self) -> None:
        """One launch on the current torch stream, without touching the step counter."""
        import cuda.bindings.driver as cuda
        import torch
        from cutlass import Int32, Int64

        t, q, e, r, s, n = self._args()
        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        if self.plan.ranks > 1:
            if self.peers is None:
                raise ValueError(f"rank {self.plan.rank} of {self.plan.ranks}: set_peers before launching")
            self.compiled(Int64(t), Int64(q), Int64(e), Int64(r), Int64(s), Int32(n), Int64(self.peers.data_ptr()),
                          stream)
            return
        self.compiled(Int64(t), Int64(q), Int64(e), Int64(r), Int64(s), Int32(n), stream)

    def warm(self) -> None:
        """One launch in which no CTA runs a task (every queue empty), then a sync: CUDA loads a
        kernel's module at its first launch (lazy loading), and a kernel loaded while another
        one spins on its signals can stall them both (CUDA's lazy-loading notes); ranks that
        wait on each other inside their kernels are warmed before their first step."""
        import torch

        queues = self.queues
        self.queues = torch.zeros_like(queues)
        try:
            self.launch()
            torch.cuda.synchronize(self.device)
        finally:
            self.queues = queues

    def step(self) -> None:
        """Advance the step counter on the device and run one decode step."""
        self.step_buf.add_(1)
        self.launch()
        self.steps_launched += 1

    def profile(self):
        """Profile mode: int64 [tasks, 3] (wait start, body start, body end; globaltimer ns) of the
        last step, indexed like plan.tasks."""
        import torch

        if not self.plan.profile:
            raise ValueError("plan was built without profile=True")
        table = self.err[PROF_OFFSET_WORDS:].view(torch.int64).reshape(-1, PROF_FIELDS)[:self.num_tasks]
        # The kernel stamps table rows, which are laid out queue after queue: back to plan order.
        order = torch.tensor([i for q in self.plan.queues for i in q], dtype=torch.long, device=table.device)
        out = torch.empty_like(table)
        out[order] = table
        return out

    def error(self) -> dict | None:
        """The recorded wait timeout (synchronizes), or None."""
        e = self.err[:ERR_WORDS].tolist()
        if e[ErrWord.FLAG] == 0:
            return None
        return {f.name.lower(): e[f] for f in ErrWord if f != ErrWord.FLAG}

    def check(self) -> None:
        """Raise MegakernelTimeout if any wait expired since the last reset_error()."""
        info = self.error()
        if info is not None:
            if self.plan.ranks > 1:
                info["rank"] = self.plan.rank
            raise MegakernelTimeout(info)

    def reset_error(self) -> None:
        self.err[:ERR_WORDS].zero_()

    def capture_graph(self, steps: int = 1):
        """A torch.cuda.CUDAGraph of `steps` x (step counter += 1, launch)."""
        import torch

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            with torch.cuda.graph(g, stream=side):
                for _ in range(steps):
                    self.step_buf.add_(1)
                    self.launch()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return g
