"""The Python API that inference engines embed.

    step = fusec.compile("models/kimi_k3.py", config="tiny", batch=4)
    out = step(tokens, positions)          # torch int tensors [B]
    out.logits, out.next_tokens

`compile` picks a backend by name; every backend returns a runner with the same interface, so
`CompiledStep` (which owns the state and checks inputs) does not change when the GPU backend
plugs in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fusec.backends.reference.executor import init_state, prepare_weights, run_step
from fusec.extras import require_cute
from fusec.ir.graph import Graph
from fusec.ir.verify import verify_graph
from fusec.loader import load_graph
from fusec.weights import random_weights


@dataclass
class StepOutput:
    logits: torch.Tensor       # [B, vocab] fp32
    next_tokens: torch.Tensor  # [B] int32, greedy


class Runner(Protocol):
    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]: ...
    def reset(self) -> None: ...


class ReferenceRunner:
    """Runs the graph op by op in torch (CPU or CUDA)."""

    def __init__(self, graph: Graph, weights: dict, dims: dict, device: str, precision: str):
        self.graph, self.dims, self.device, self.precision = graph, dims, device, precision
        self.weights = prepare_weights(graph, weights, precision, device)
        self.reset()

    def reset(self) -> None:
        self.state = init_state(self.graph, self.dims, self.device, self.precision)

    def run(self, tokens, positions, hook=None):
        return run_step(self.graph, self.weights, self.state, {"tokens": tokens, "pos": positions},
                        self.dims, self.precision, hook)


def _cute_runner(graph, weights, dims, device, precision):
    # Imported on use: cutlass is only needed when the cute backend is picked.
    from fusec.backends.cute.runner import CuteRunner
    return CuteRunner(graph, weights, dims, device, precision)


BACKENDS = {"reference": ReferenceRunner, "cute": _cute_runner}


class CompiledStep:
    """One compiled decode step with its own state (KV caches, recurrent and conv states)."""

    def __init__(self, graph: Graph, runner, batch: int, max_len: int, device: str):
        self.graph, self.runner, self.batch, self.max_len, self.device = graph, runner, batch, max_len, device

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> StepOutput:
        return self.step(tokens, positions)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> StepOutput:
        tokens = torch.as_tensor(tokens, device=self.device).to(torch.int32).reshape(-1)
        positions = torch.as_tensor(positions, device=self.device).to(torch.int32).reshape(-1)
        if tokens.shape != (self.batch,) or positions.shape != (self.batch,):
            raise ValueError(f"expected tokens and positions of shape [{self.batch}], got "
                             f"{list(tokens.shape)} and {list(positions.shape)}")
        if int(positions.max()) >= self.max_len or int(positions.min()) < 0:
            raise ValueError(f"positions must be in [0, {self.max_len})")
        logits, nxt = self.runner.run(tokens, positions)
        return StepOutput(logits.float(), nxt)

    def reset(self) -> None:
        """Forget every sequence (zero all state)."""
        self.runner.reset()

    def generate(self, tokens: torch.Tensor, steps: int, start_pos: int = 0) -> torch.Tensor:
        """Greedy decoding: feed `tokens` [B], then each step's next token; returns [steps, B]."""
        out, cur = [], torch.as_tensor(tokens)
        for s in range(steps):
            o = self.step(cur, torch.full((self.batch,), start_pos + s, dtype=torch.int32))
            cur = o.next_tokens
            out.append(cur.cpu())
        return torch.stack(out)


def compile(model, config: str | None = None, *, backend: str = "reference", batch: int = 1,
            max_len: int = 256, device: str = "cpu", precision: str = "bf16", weights=None,
            seed: int = 0, overrides: dict | None = None) -> CompiledStep:
    """Build (or parse) the graph, verify it, bind weights and return a `CompiledStep`.

    `weights`: None (deterministic random weights from `seed`), a dict of tensors, or a path to a
    checkpoint folder (sharded safetensors with an index).
    """
    graph, module = load_graph(model, config, overrides)
    verify_graph(graph)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (have: {', '.join(BACKENDS)})")
    if precision not in ("bf16", "fp32"):
        raise ValueError("precision must be bf16 or fp32")
    if backend == "cute":
        require_cute()                   # say what to install before binding weights
    if weights is None:
        rules = getattr(module, "WEIGHT_INIT", ()) if module else ()
        weights = random_weights(graph, seed, rules, device=device)
    elif not isinstance(weights, dict):
        from fusec.checkpoint import load_checkpoint
        if module is None:
            raise ValueError("loading a checkpoint needs the model file (for its tensor names), not a .fir")
        weights = load_checkpoint(graph, weights, module, device=device)
    dims = {"B": batch, "L": max_len}
    runner = BACKENDS[backend](graph, weights, dims, device, precision)
    return CompiledStep(graph, runner, batch, max_len, device)
