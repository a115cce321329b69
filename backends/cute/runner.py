"""CuteRunner: a whole decode step as one CuTe megakernel launch (fusec.api backend "cute").

    program (after the pipeline: fuse, tile, schedule, verify; run by the driver, fusec.compiler)
    -> Schedule -> lower_schedule -> memory plan + task table -> Megakernel (one persistent
    launch per step)

Weights of the lowered graph (merged projections from their `sources`) are copied into the
arena once; state (caches) lives in the arena and is zeroed by `reset()`. Every `run` writes the
step inputs into the arena, bumps the device step counter, launches, checks the bounded-wait
error buffer (MegakernelTimeout names the stuck task and event) and returns copies of the
outputs. The kernel computes in bf16 (fp32 accumulation): precision "fp32" is refused.

A caller that captures more of a step into one CUDA graph (fusec.api's CompiledStep: its input
checks and logits check around the launch) uses the two halves of `run` instead:
`device_step` (the capturable device work, no copy, no check) and `launched` (the host
bookkeeping after each execution of it).
"""
from __future__ import annotations

import collections
import ctypes

from fusec.ir.graph import Graph
from fusec.ir.types import DType

from .plan import ERR_WORDS, ErrWord


def arena_weights(graph: Graph, bound) -> dict:
    """The weights exactly as the kernel reads them (MXFP4 rebuilt from its packed/scale regions)."""
    from fusec.ir.quant import MXFP4Tensor

    from .weight_tiles import MXFP4Tiles, untile

    out = {}
    for v in graph.weights():
        if v.type.dtype is DType.mxfp4 and v.name in bound.tiled:    # MXFP4 tiles (expert_mx_mma)
            # read back an expert at a time: a whole row-major copy of slice4's experts (44 GB)
            # did not fit beside the arena on the H200
            out[v.name] = MXFP4Tiles(bound.tensor(v.name), bound.tensor(v.name + ".scale"))
        elif v.type.dtype is DType.mxfp4:
            out[v.name] = MXFP4Tensor(bound.tensor(v.name), bound.tensor(v.name + ".scale"))
        elif v.name in bound.tiled:     # repacked for plan.gemv_tiles: a row-major copy
            w = bound.tensor(v.name)
            out[v.name] = untile(w.reshape(-1, bound.tiled[v.name])).reshape(w.shape)
        else:
            out[v.name] = bound.tensor(v.name)
    return out


def arena_reference(graph: Graph, bound, dims, device, precision: str = "bf16"):
    """A ReferenceRunner over `graph` reading the arena's own weights: the oracle with the
    kernel's rounding points (bf16), or the same step computed in fp32 (how far each bf16 run is
    from the exact step). Its state is set per step with `fusec.debug.bisect.sync_state`."""
    from fusec.backends.reference.runner import ReferenceRunner

    return ReferenceRunner(graph, arena_weights(graph, bound), dims, device, precision)


def check_cute_args(program, device, precision: str) -> None:
    """The cute backend's refusals: bf16 only, a CUDA device, a program with a schedule."""
    if precision != "bf16":
        raise ValueError("backend 'cute' computes in bf16 (fp32 accumulation); use precision='bf16'")
    if not str(device).startswith("cuda"):
        raise ValueError("backend 'cute' needs device='cuda'")
    if program.schedule is None:
        raise ValueError("the pipeline produced no schedule for the cute backend")


class CuteRunner:
    """fusec.api Runner: `run(tokens, positions) -> [logits, next_tokens]`, `reset()`."""

    def __init__(self, program, weights: dict, dims: dict, device: str, precision: str, *,
                 plan_options: dict | None = None, out_dir=None):
        """`program`: a `fusec.passes.manager.Program` after the default pipeline (its schedule
        is lowered here), e.g. from `fusec.compiler.lower`; `weights`: of the model's graph."""
        import torch

        from fusec.backends.reference.ranks import materialize_weights
        from .lower import bind_weights, lower_schedule
        from .runtime import Megakernel
        from .weight_tiles import tile_options, tile_weights

        check_cute_args(program, device, precision)
        self.dims, self.device = dims, device
        self.program, self.lowered = program, lower_schedule(program.schedule)
        g = self.program.graph
        self.mem = self.lowered.memory.bind(device)
        with torch.no_grad():
            ws = materialize_weights(g, weights, 0, "bf16")
            plan_options = tile_options(self.lowered, plan_options, ws)
            bind_weights(self.lowered, self.mem, ws)
            del ws
            tile_weights(self.lowered, self.mem, plan_options)
        self.plan = self.lowered.plan(base=self.mem.base, **plan_options)
        self.kernel = Megakernel(self.plan, out_dir=out_dir, device=device)
        self._init_host()

    def _init_host(self) -> None:
        """The host side around `self.kernel` over `self.mem` (both set): output and state
        names, the asynchronous error read-back, fresh state."""
        import torch

        g = self.program.graph
        self.state_names = [v.name for v in g.params if v.type.kind.value == "state"]
        self.out_names = [v.name for v in g.outputs]
        # run(): graph replay, error words read back without a sync (see run and check).
        self._graph = None
        # Two pinned slots: step k's words land in slot k % 2 while step k - 1 may still run.
        self._err_host = torch.zeros((2, ERR_WORDS), dtype=torch.int32).pin_memory()
        # the same pinned bytes, read per step without a torch op (a few us each on the host)
        self._err_view = (ctypes.c_int32 * (2 * ERR_WORDS)).from_address(self._err_host.data_ptr())
        self._err_ready = [torch.cuda.Event(), torch.cuda.Event()]
        self._pending: collections.deque = collections.deque()   # slots launched, not read back
        self.reset()

    def lowered_reference(self, device=None, precision: str = "bf16"):
        """A ReferenceRunner over the graph this kernel runs (after canonicalize, fuse and tile),
        reading the arena's own weights (no copy on the kernel's device): the oracle with the
        kernel's rounding points. That those passes preserve the model is tested separately, in
        fp32 (tests/test_mla_absorb.py, tests/test_passes_graph.py). precision="fp32": the same
        graph and weights computed in fp32 (sync its state with `fusec.debug.bisect.sync_state`)."""
        return arena_reference(self.program.graph, self.mem, self.dims, device or self.device, precision)

    def reset(self) -> None:
        for n in self.state_names:
            self.mem.tensor(n).zero_()

    def run(self, tokens, positions, kernel=None):
        """One step; `kernel`: another Megakernel over this arena's table (e.g. the same plan with
        delay injection or profiling) instead of the runner's own, launched and checked at once.

        The runner's own kernel runs as a CUDA-graph replay with no host sync: the bounded-wait
        error of a step is read back asynchronously and raised by the next `run` or by `check()`
        (a timed-out kernel stops walking its queues, so the step's outputs are garbage but the
        launch ends within the timeout)."""
        if kernel is not None:
            self._write_inputs(tokens, positions)
            kernel.step()
            kernel.check()
            return [t.clone() for t in self.outputs()]
        self.check(keep=1)
        self._write_inputs(tokens, positions)
        if self._graph is None:
            self._graph = self.kernel.capture_graph()
        self._graph.replay()
        self.launched()
        return [t.clone() for t in self.outputs()]

    def outputs(self) -> list:
        """The arena's output tensors (logits, next tokens): overwritten by every step."""
        return [self.mem.tensor(n) for n in self.out_names]

    def device_step(self, tokens, positions) -> list:
        """The device work of one step of the runner's own kernel, capturable into a CUDA graph
        (no host sync, no host state): write the inputs (device tensors, any integer dtype) into
        the arena, step counter += 1, launch. Returns `outputs()` (not copies). Every execution,
        eager or a replay of a graph holding it, must be followed by one `launched()`: Python
        code inside a capture runs once, at capture."""
        self._write_inputs(tokens, positions)
        self.kernel.step_buf.add_(1)
        self.kernel.launch()
        return self.outputs()

    def device_step_guarded(self, tokens, positions, tok_hi: int, pos_hi: int, flag) -> list:
        """`device_step` with the inputs' guard on the device (backends/cute/step_inputs.py), two
        launches in all: `tokens`, `positions` (contiguous int32 or int64 device vectors, read
        where they are) clamped to [0, tok_hi] and [0, pos_hi] into the arena, `flag` (an fp32
        device word) set to 1.0 if a value was out of range (else 0.0), the step counter += 1 by
        the same kernel, then the megakernel. Call `prepare_guard` once before capturing it."""
        from . import step_inputs

        step_inputs.launch(tokens, positions, self.mem.tensor("tokens"), self.mem.tensor("pos"), tok_hi, pos_hi,
                           flag, self.kernel.step_buf)
        self.kernel.launch()
        return self.outputs()

    def prepare_guard(self) -> None:
        """Compile the input guard and load it on the device outside any capture (CUDA loads a
        module at its first launch): one launch over no rows on scratch words, then a sync."""
        import torch

        from . import step_inputs

        for n in ("tokens", "pos"):     # the guard writes int32 rows
            t = self.mem.tensor(n)
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"the arena's {n} must be a contiguous int32 vector for the guard, got {t.dtype}")
        scratch = torch.zeros(2, dtype=torch.int32, device=self.device)
        none = scratch[:0]
        step_inputs.launch(none, none, none, none, 0, 0, scratch[0:1].view(torch.float32), scratch[1:2])
        torch.cuda.synchronize(self.device)

    def launched(self) -> None:
        """Host bookkeeping of one step just enqueued (by `run` or a `device_step`): count it
        and queue the copy of its error words to a pinned slot, read back by `check`."""
        slot = self.kernel.steps_launched % 2
        self.kernel.steps_launched += 1
        self._err_host[slot].copy_(self.kernel.err[:ERR_WORDS], non_blocking=True)
        self._err_ready[slot].record()
        self._pending.append(slot)

    def check(self, keep: int = 0) -> None:
        """Raise MegakernelTimeout if a step launched by `run` timed out; waits for every pending
        step but the newest `keep` (run keeps one in flight: it never waits for the GPU)."""
        while len(self._pending) > keep:
            slot = self._pending.popleft()
            self._err_ready[slot].synchronize()
            if not self._err_view[slot * ERR_WORDS + ErrWord.FLAG]:
                continue
            self._pending.clear()
            from .runtime import MegakernelTimeout
            e = self._err_host[slot].tolist()
            info = {f.name.lower(): e[f] for f in ErrWord if f != ErrWord.FLAG}
            if self.kernel.plan.ranks > 1:
                info["rank"] = self.kernel.plan.rank
            raise MegakernelTimeout(info)

    def _write_inputs(self, tokens, positions) -> None:
        # copy_ casts to the arena's dtype in the same kernel (one launch or graph node each)
        self.mem.tensor("tokens").copy_(tokens, non_blocking=True)
        self.mem.tensor("pos").copy_(positions, non_blocking=True)
