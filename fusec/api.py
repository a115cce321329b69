"""The Python API that inference engines embed.

    step = fusec.compile("models/kimi_k3.py", config="tiny", batch=4)
    out = step(tokens, positions)          # torch int tensors [B]
    out.logits, out.next_tokens

`compile` picks a backend by name; every backend returns a runner with the same interface, so
`CompiledStep` (which owns the state and checks inputs) does not change when the GPU backend
plugs in.
"""
from __future__ import annotations

import collections
import ctypes
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from fusec.backends.reference.runner import ReferenceRunner
from fusec.extras import require_cute
from fusec.ir.graph import Graph
from fusec.ir.verify import verify_graph
from fusec.loader import load_graph
from fusec.weights import check_finite_weights, random_weights


# Graphs of the one-graph step keyed by the caller's own input tensors (see `_graph_step`); past
# this many distinct pairs, steps go through the one staging buffer instead.
MAX_KEYED_GRAPHS = 4


def finite_measure(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The largest |x| of float tensor x as a 0-d fp32 tensor: NaN if an element is NaN, Inf if
    one is +-Inf, finite exactly when every element is (the reduction propagates NaN; no sum that
    could overflow). One kernel in the step's graph where `(x * 0).sum() == 0` took three."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=out)


class NonFiniteLogits(FloatingPointError):
    """A step produced NaN or Inf logits (the greedy token of such a row would be meaningless)."""


@dataclass
class StepOutput:
    logits: torch.Tensor       # [B, vocab] fp32
    next_tokens: torch.Tensor  # [B] int32, greedy


class Runner(Protocol):
    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]: ...
    def reset(self) -> None: ...


def _cute_runner(graph, weights, dims, device, precision):
    # The backend receives the lowered program: the driver runs the pipeline. Imported on use:
    # cutlass is only needed when the cute backend is picked.
    from fusec.backends.cute.runner import CuteRunner
    from fusec.compiler import lower
    from fusec.passes.options import Options
    prog = lower(graph, Options.from_env(batch=int(dims["B"]), max_len=int(dims["L"])))
    return CuteRunner(prog, weights, dims, device, precision)


BACKENDS = {"reference": ReferenceRunner, "cute": _cute_runner}


def _dist_reference_runner(program, weights, dims, device, precision, rank, group):
    from fusec.backends.reference.dist import DistReferenceRunner
    return DistReferenceRunner(program.graph, weights, dims, device, precision, rank, program.opts.ranks, group)


def _dist_cute_runner(program, weights, dims, device, precision, rank, group):
    from fusec.backends.cute.dist import DistCuteRunner
    return DistCuteRunner(program, weights, dims, device, precision, rank=rank, group=group)


# ranks > 1: runner(program after the pipeline with Options(ranks=R), full weights or this rank's
# RankWeights, dims, device, precision, this process's rank, process group), one rank per process
RANK_BACKENDS = {"reference": _dist_reference_runner, "cute": _dist_cute_runner}


class CompiledStep:
    """One compiled decode step with its own state (KV caches, recurrent and conv states).

    Every step checks its logits are finite (one `isfinite().all()`): a NaN/Inf row raises
    `NonFiniteLogits` naming the step (and, on the reference backend, the first op that produced
    a non-finite value) instead of returning a meaningless greedy token. On a CUDA device with a
    backend other than the reference one (`deferred`) the check does not sync the host: its
    result is copied back asynchronously and raised by the step after next or by `check()` (as
    the cute runner does for its timeout words); so is the range check of CUDA-resident tokens
    and positions, done on the device (the step runs on clamped values). `check_finite=False`
    turns the finite check off.

    Deferred, with a runner that offers a capturable step (`device_step` and `launched`, as the
    cute runner does), all the device work of a step is one CUDA graph, captured at the first
    step with those inputs: the device range check and clamps (on the cute runner one small
    kernel, `device_step_guarded`, that also advances the step counter), the runner's step, the
    logits' finite check (one reduction). The graph reads CUDA int32/int64 inputs in place (a
    graph per pair of input tensors, up to MAX_KEYED_GRAPHS; others go through one staging
    buffer). A step then issues one replay, the asynchronous read-back copies of the flags and
    of the runner's error words, and a copy of each output (outputs are the caller's to keep
    across steps). That graph always range-checks and clamps the tokens, also those `generate`
    feeds back unchecked on the host."""

    def __init__(self, graph: Graph, runner, batch: int, max_len: int, device: str, *,
                 check_finite: bool = True, deferred: bool = False):
        self.graph, self.runner, self.batch, self.max_len, self.device = graph, runner, batch, max_len, device
        self.rank, self.ranks = getattr(runner, "rank", 0), getattr(runner, "ranks", 1)   # this process's rank of R
        last = graph.outputs[0].type.shape[-1] if graph.outputs else None
        self.vocab = last if isinstance(last, int) else None   # token ids must be below it
        self.check_finite, self.deferred = check_finite, deferred
        self.steps_run = 0          # steps since compile or reset; names the step in errors
        # Deferred checks not read back yet: (step index, logits, slot). A step reads back the
        # checks of the step before the previous one only, so the host never waits for the GPU
        # and one step is always in flight; two pinned slots of (finite, inputs in range) flags.
        self._pending: collections.deque = collections.deque()
        if deferred:
            # per slot (finite measure, out-of-range flag): see `finite_measure`; 0.0 = in range
            self._flag_host = torch.zeros((2, 2), dtype=torch.float32).pin_memory()
            # the same pinned bytes, read per step without a torch op (a few us each on the host)
            self._flag_view = (ctypes.c_float * 4).from_address(self._flag_host.data_ptr())
            self._flag_ready = [torch.cuda.Event(), torch.cuda.Event()]
        # The one-graph step (see the class docstring); a runner without a capturable step (the
        # reference one) keeps the path of separate launches.
        self.graphed = deferred and all(callable(getattr(runner, a, None)) for a in ("device_step", "launched"))
        # A runner with the inputs' guard on the device (the cute one: one small kernel for the
        # clamps, the range flag and the step counter) keeps it out of torch ops in the graph.
        self.guarded = self.graphed and all(callable(getattr(runner, a, None))
                                            for a in ("device_step_guarded", "prepare_guard"))
        # Captured graphs by input key (`_graph_step`): (tokens, positions) addresses and dtypes,
        # or None for the staging buffer `_inp`.
        self._graphs: dict = {}
        self._dev = None            # the device with its index (tensors' devices compare to it)
        self._inp = None            # the staging buffer, int64 [2, B] (tokens; positions)
        self._flags = None          # the graphs' fp32 [finite measure, out-of-range flag]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> StepOutput:
        return self.step(tokens, positions)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> StepOutput:
        return self._step(tokens, positions, check_tokens=True)

    def _step(self, tokens, positions, check_tokens: bool) -> StepOutput:
        self._check(keep=1)
        tokens = torch.as_tensor(tokens)
        positions = torch.as_tensor(positions)
        if tokens.is_floating_point() or positions.is_floating_point() or torch.bool in (tokens.dtype, positions.dtype):
            raise ValueError("tokens and positions must be integer tensors")
        if tokens.dim() != 1:
            tokens = tokens.reshape(-1)
        if positions.dim() != 1:
            positions = positions.reshape(-1)
        if tokens.shape != (self.batch,) or positions.shape != (self.batch,):
            raise ValueError(f"expected tokens and positions of shape [{self.batch}], got "
                             f"{list(tokens.shape)} and {list(positions.shape)}")
        in_range = None
        if self.graphed:
            if not self._checks_on_device(tokens, positions):
                self._host_range_check(tokens, positions, check_tokens)
            return self._graph_step(tokens, positions)
        if self._checks_on_device(tokens, positions):
            # Bounds on the device, no host read (which would wait for the step in flight): the
            # flag is read back with the step's other deferred checks, and the kernel runs on
            # clamped values, so it never indexes past the cache or the embedding table.
            hi = self.vocab if (check_tokens and self.vocab is not None) else None
            in_range = ((positions >= 0) & (positions < self.max_len)).all()
            if check_tokens:
                in_range &= (tokens >= 0).all() if hi is None else ((tokens >= 0) & (tokens < hi)).all()
            positions = positions.clamp(0, self.max_len - 1)
            if hi is not None:
                tokens = tokens.clamp(0, hi - 1)
        else:
            self._host_range_check(tokens, positions, check_tokens)
        tokens = tokens.to(device=self.device, dtype=torch.int32)
        positions = positions.to(device=self.device, dtype=torch.int32)
        logits, nxt = self.runner.run(tokens, positions)
        logits = logits.float()
        k, self.steps_run = self.steps_run, self.steps_run + 1
        if self.deferred:
            slot = k % 2
            zero = torch.zeros((), dtype=torch.float32, device=logits.device)
            measure = finite_measure(logits) if self.check_finite else zero
            bad = (~in_range).float() if in_range is not None else zero
            self._flag_host[slot].copy_(torch.stack([measure, bad]), non_blocking=True)
            self._flag_ready[slot].record()
            self._pending.append((k, logits, slot))
        elif self.check_finite and not bool(torch.isfinite(logits).all()):
            self._raise_nonfinite(k, logits)
        return StepOutput(logits, nxt)

    def _checks_on_device(self, tokens: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether the range check of this step's inputs is the deferred one on the device."""
        return self.deferred and tokens.is_cuda and positions.is_cuda

    def _host_range_check(self, tokens, positions, check_tokens: bool) -> None:
        # one host read per tensor for its bounds (tokens fed back by generate are argmax indices)
        ends = torch.stack([positions.min(), positions.max()]).tolist()
        if check_tokens:
            ends += torch.stack([tokens.min(), tokens.max()]).tolist()
        if ends[1] >= self.max_len or ends[0] < 0:
            raise ValueError(f"positions must be in [0, {self.max_len}), got {ends[0]}..{ends[1]}")
        if check_tokens and (ends[2] < 0 or (self.vocab is not None and ends[3] >= self.vocab)):
            bad = ends[2] if ends[2] < 0 else ends[3]
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab})")

    def _graph_step(self, tokens, positions) -> StepOutput:
        """One step as one graph replay (see the class docstring); inputs already checked on the
        host where that needs no sync.

        The graph reads CUDA int32/int64 contiguous inputs where they are: one graph per (tokens,
        positions) pair of such tensors, up to MAX_KEYED_GRAPHS pairs (an engine's persistent
        input buffers), so a step copies nothing in. Each graph keeps its pair alive, so an
        address it was captured on can only be that tensor's again. Other inputs (CPU-resident,
        other dtypes, more pairs) are copied into one staging buffer that its own graph reads."""
        key = self._input_key(tokens, positions)
        if key not in self._graphs and len(self._graphs) - (None in self._graphs) >= MAX_KEYED_GRAPHS:
            key = None
        if key is None:
            self._stage(tokens, positions)
        replay = self._graphs.get(key)
        if replay is None:
            replay = self._graphs[key] = self._capture(*((self._inp[0], self._inp[1]) if key is None
                                                        else (tokens, positions)))
        logits, nxt, flags = replay()
        self.runner.launched()
        k, self.steps_run = self.steps_run, self.steps_run + 1
        slot = k % 2
        self._flag_host[slot].copy_(flags, non_blocking=True)
        self._flag_ready[slot].record()
        # the graph's outputs are overwritten by the next replay: hand out copies
        logits = logits.clone()
        self._pending.append((k, logits, slot))
        return StepOutput(logits, nxt.clone())

    def _input_key(self, tokens, positions):
        """The graph key of inputs a graph can read in place, else None."""
        if self._dev is None:
            d = torch.device(self.device)
            self._dev = torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d
        if self._checks_on_device(tokens, positions) and all(
                t.device == self._dev and t.dtype in (torch.int32, torch.int64) and t.is_contiguous()
                for t in (tokens, positions)):
            return tokens.data_ptr(), tokens.dtype, positions.data_ptr(), positions.dtype
        return None

    def _stage(self, tokens, positions) -> None:
        """Copy the inputs into the staging buffer (int64, so a CUDA int64 token past 2**31 is seen
        out of range before it is narrowed)."""
        if self._inp is None:
            self._inp = torch.zeros((2, self.batch), dtype=torch.int64, device=self.device)
        if tokens.device == positions.device == self._inp.device:
            torch.stack((tokens, positions), out=self._inp)     # one copy (one launch), casting
        else:
            self._inp[0].copy_(tokens, non_blocking=True)       # H2D for CPU-resident inputs
            self._inp[1].copy_(positions, non_blocking=True)

    def _capture(self, tok_src, pos_src):
        """The step's device work reading its inputs from `tok_src`, `pos_src` (device vectors,
        read at each replay) as one graph; returns its `replay() -> (fp32 logits, next tokens,
        fp32 [finite measure, out-of-range flag])`, static tensors overwritten by every replay."""
        dev = torch.device(self.device)
        top = self.vocab - 1 if self.vocab is not None else torch.iinfo(torch.int64).max
        # Every tensor the graph reads must outlive it: the flags and bounds are kept on self (as
        # locals they were freed after the capture, their memory reused, and the replays clamped
        # against whatever was written there: range errors on valid inputs on the H200).
        if self._flags is None:
            self._flags = torch.zeros(2, dtype=torch.float32, device=dev)
            self._bounds = (torch.zeros((2, 1), dtype=torch.int64, device=dev),
                            torch.tensor([[top], [self.max_len - 1]], dtype=torch.int64, device=dev))
            if self.guarded:
                self.runner.prepare_guard()
        flags, (lo, hi) = self._flags, self._bounds

        def inputs():
            if self.guarded:
                return None
            # the kernel runs on clamped values, so it never indexes past the cache or the table
            inp = torch.stack((tok_src.to(torch.int64), pos_src.to(torch.int64)))
            safe = inp.clamp(lo, hi)
            flags[1].copy_((safe != inp).any())
            return safe

        def body():
            if self.guarded:
                logits, nxt = self.runner.device_step_guarded(tok_src, pos_src, top, self.max_len - 1, flags[1:])
            else:
                safe = inputs()
                logits, nxt = self.runner.device_step(safe[0], safe[1])
            logits = logits.float()
            if self.check_finite:
                finite_measure(logits, out=flags[0])
            return logits, nxt, flags

        # Warm-up of the torch ops outside the capture (the kernel itself is not run: a step
        # has effects): lazy initialisation and kernel loading happen here, not in the capture.
        inputs()
        if self.check_finite:
            finite_measure(self.runner.outputs()[0].float(), out=flags[0])
        # the graph's pair stays referenced by its replay (see _graph_step)
        return _cuda_graph(body, dev, keep=(tok_src, pos_src))

    def _raise_nonfinite(self, k: int, logits: torch.Tensor) -> None:
        rows = (~torch.isfinite(logits)).any(dim=-1).nonzero().reshape(-1).tolist()
        explain = getattr(self.runner, "explain_nonfinite", None)
        where = explain() if explain is not None else None
        raise NonFiniteLogits(f"step {k}: non-finite logits in batch row(s) {rows}"
                              f"{'; ' + where if where else ''}")

    def check(self) -> None:
        """Raise the error of an earlier step still pending (deferred non-finite or input-range
        check, or the backend's own asynchronous checks); waits for those steps."""
        self._check(keep=0)

    def _check(self, keep: int) -> None:
        """Read back every pending check but the newest `keep` steps' (oldest first)."""
        backend_check = getattr(self.runner, "check", None)
        if backend_check is not None:
            backend_check(keep=keep)   # first: a timed-out kernel's garbage logits are its symptom
        while len(self._pending) > keep:
            k, logits, slot = self._pending.popleft()
            self._flag_ready[slot].synchronize()
            finite, in_range = math.isfinite(self._flag_view[2 * slot]), self._flag_view[2 * slot + 1] == 0
            if not in_range:
                self._pending.clear()
                raise ValueError(f"step {k}: a position outside [0, {self.max_len}) or a token id outside the "
                                 f"vocabulary [0, {self.vocab}); the step ran on clamped values")
            if not finite:
                self._pending.clear()
                self._raise_nonfinite(k, logits)

    def reset(self) -> None:
        """Forget every sequence (zero all state)."""
        self.runner.reset()
        self.steps_run, self._pending = 0, collections.deque()

    def generate(self, tokens: torch.Tensor, steps: int, start_pos: int = 0) -> torch.Tensor:
        """Greedy decoding: feed `tokens` [B], then each step's next token; returns [steps, B]."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative integer, got {start_pos!r}")
        if start_pos + steps > self.max_len:
            raise ValueError(f"start_pos + steps = {start_pos + steps} exceeds max_len {self.max_len}")
        out, cur = [], torch.as_tensor(tokens)
        for s in range(steps):
            o = self._step(cur, torch.full((self.batch,), start_pos + s, dtype=torch.int32), check_tokens=s == 0)
            cur = o.next_tokens
            out.append(cur.cpu())
        self.check()
        return torch.stack(out)


def _cuda_graph(body, device: torch.device, keep=()):
    """Capture `body` (device work only: no host sync, no per-step host effect) once into a CUDA
    graph on a side stream, as `Megakernel.capture_graph` does; returns `replay()`, which
    re-runs it on the current stream and returns the outputs `body` returned at capture (the
    same tensors each time, overwritten by every replay); `keep`: tensors the replays read that
    must stay allocated as long as the graph."""
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(g, stream=side):
            outs = body()
    cur.wait_stream(side)

    def replay():
        g.replay()
        return outs
    replay.keep = keep
    return replay


def _positive(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def check_device(device) -> str:
    """`device` as a string if it is a CPU or an available CUDA device; ValueError otherwise."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (have: cpu, cuda, cuda:N)") from None
    if d.type == "cpu":
        return str(device)
    if d.type != "cuda":
        raise ValueError(f"unsupported device {device!r} (have: cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise ValueError(f"no CUDA device {d.index} (have {n})")
    return str(device)


def join_group(ranks: int, group, backend: str, device: str) -> tuple[int, str]:
    """(this process's rank, its device) in the torch.distributed group of a `ranks`-rank step;
    ValueError without an initialized group of `ranks` processes. device "cuda" is this
    process's GPU (LOCAL_RANK, as torchrun sets it: one process per GPU)."""
    import os

    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) and group is None:
        raise ValueError(f"ranks={ranks} runs one rank per process: start {ranks} processes (torchrun, or "
                         f"`fusec run --ranks {ranks}`) and call torch.distributed.init_process_group first, "
                         f"or pass group=")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != ranks:
        raise ValueError(f"ranks={ranks} but the process group has {size} process(es)")
    if backend not in RANK_BACKENDS:
        raise ValueError(f"backend '{backend}' does not run multi-rank steps (have: {', '.join(RANK_BACKENDS)})")
    if device == "cuda":
        local, n = int(os.environ.get("LOCAL_RANK", rank)), torch.cuda.device_count()
        if local >= n:
            raise ValueError(f"rank {rank}: local rank {local} has no GPU of its own (have {n})")
        device = f"cuda:{local}"
    comm = str(dist.get_backend(group))
    # the reference backend's collectives run on the group: gloo moves CPU tensors, NCCL CUDA ones
    if backend == "reference" and ("nccl" if device.startswith("cuda") else "gloo") not in comm:
        raise ValueError(f"the reference backend on {device} needs a "
                         f"{'nccl' if device.startswith('cuda') else 'gloo'} process group, not {comm}")
    return rank, device


def compile(model, config: str | None = None, *, backend: str = "reference", batch: int = 1,
            max_len: int = 256, device: str = "cpu", precision: str = "bf16", weights=None,
            seed: int = 0, overrides: dict | None = None, allow_nonfinite: bool = False,
            check_finite: bool = True, ranks: int = 1, group=None) -> CompiledStep:
    """Build (or parse) the graph, verify it, bind weights and return a `CompiledStep`.

    `ranks` > 1: tensor and expert parallel over `ranks` processes, one rank each: this process
    joins the torch.distributed process group (`group`, default the default group, which must
    be initialized and hold `ranks` processes), the graph is sharded by the same pipeline as
    `fusec compile --ranks` and the returned step is THIS process's rank (`step.rank`): every
    process calls `compile` and then steps together (the collectives wait for every rank).
    Random or dict weights are the full ones (the same seed gives the same on every process),
    sliced per rank; a checkpoint is read rank by rank: each process reads only its own slices
    of every tensor (`fusec.checkpoint.load_rank_checkpoint`, docs/checkpoints.md). Reference backend: collectives over the group (gloo on CPU, NCCL on
    CUDA); cute backend: one GPU per process (device "cuda" = cuda:LOCAL_RANK), arenas in
    symmetric memory (backends/cute/dist.py). NVLink multicast is kept off
    (backends/multicast.py).

    `weights`: None (deterministic random weights from `seed`), a dict of tensors, or a path to a
    checkpoint folder (sharded safetensors with an index). A checkpoint's `config.json` sets the
    model's dims (with `config` also named, every disagreement is one ValueError). A NaN/Inf in a float weight or a 0xFF
    (NaN) E8M0 scale byte in an mxfp4 weight is a ValueError naming the tensor unless
    `allow_nonfinite`. `check_finite`: check every step's logits (see `CompiledStep`).
    Out-of-range arguments (batch, max_len < 1, seed < 0, an unknown or absent device) are
    ValueErrors.
    """
    _positive("batch", batch)
    _positive("max_len", max_len)
    _positive("seed", seed, 0)
    _positive("ranks", ranks)
    if seed >= 2 ** 63:
        raise ValueError(f"seed must be < 2**63, got {seed}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (have: {', '.join(BACKENDS)})")
    if precision not in ("bf16", "fp32"):
        raise ValueError("precision must be bf16 or fp32")
    if backend == "cute":
        require_cute()                   # say what to install before anything else
    device = check_device(device)
    if backend == "cute" and not device.startswith("cuda"):
        raise ValueError("backend 'cute' needs device='cuda'")
    rank = 0
    if ranks > 1:
        from fusec.backends.multicast import multicast_off
        multicast_off()
        rank, device = join_group(ranks, group, backend, device)
    ckpt = weights if weights is not None and not isinstance(weights, dict) else None
    graph, module = load_graph(model, config, overrides, checkpoint=ckpt)
    verify_graph(graph)
    program = None
    if ranks > 1:       # sharded first: a checkpoint is read rank by rank (only this rank's slices)
        from fusec.compiler import lower
        from fusec.passes.options import Options
        program = lower(graph, Options.from_env(ranks=ranks, batch=batch, max_len=max_len))
    if weights is None:
        rules = getattr(module, "WEIGHT_INIT", ()) if module else ()
        weights = random_weights(graph, seed, rules, device=device)
    elif not isinstance(weights, dict):
        from fusec.checkpoint import load_checkpoint, load_rank_checkpoint
        if module is None:
            raise ValueError("loading a checkpoint needs the model file (for its tensor names), not a .fir")
        if program is not None:
            weights = load_rank_checkpoint(graph, program.graph, rank, weights, module, device=device,
                                           allow_nonfinite=allow_nonfinite)
        else:
            weights = load_checkpoint(graph, weights, module, device=device, allow_nonfinite=allow_nonfinite)
    elif not allow_nonfinite:
        check_finite_weights(weights, graph)
    dims = {"B": batch, "L": max_len}
    deferred = backend != "reference" and device.startswith("cuda")
    if program is not None:
        runner = RANK_BACKENDS[backend](program, weights, dims, device, precision, rank, group)
        return CompiledStep(program.graph, runner, batch, max_len, device, check_finite=check_finite,
                            deferred=deferred)
    runner = BACKENDS[backend](graph, weights, dims, device, precision)
    return CompiledStep(graph, runner, batch, max_len, device, check_finite=check_finite, deferred=deferred)
