"""Drive the reference executor and an independent oracle through the same decode steps.

Shared by tests/test_numerics_k3.py and tests/test_numerics_llama.py: build the graph of a model
module's config, draw random weights, hand the oracle the same tensors under their checkpoint
names, feed both the same random tokens at per-sequence positions, and call `check` each step.
"""
from __future__ import annotations

import torch

from fusec.backends.reference.executor import init_state, prepare_weights, run_step
from fusec.weights import random_weights

BATCH, STEPS, CACHE = 3, 8, 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (b is the oracle)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def decode_against(model, oracle_cls, *, seed: int, token_seed: int, precision: str, offsets, check,
                   **overrides) -> None:
    """`check(step, logits, next_tokens, oracle_logits)` after each of STEPS steps."""
    g = model.build_graph("tiny", **overrides)
    cfg = model.get_config("tiny", **overrides)
    raw = random_weights(g, seed, model.WEIGHT_INIT)
    weights = prepare_weights(g, raw, precision)
    dims = {"B": BATCH, "L": CACHE}
    state = init_state(g, dims, precision=precision)
    oracle = oracle_cls(cfg, {model.checkpoint_name(n): t for n, t in raw.items()}, BATCH, CACHE)
    gen = torch.Generator().manual_seed(token_seed)
    off = torch.tensor(offsets, dtype=torch.int32)
    for t in range(STEPS):
        tokens = torch.randint(0, cfg.vocab, (BATCH,), generator=gen, dtype=torch.int32)
        pos = off + t
        logits, nxt = run_step(g, weights, state, {"tokens": tokens, "pos": pos}, dims, precision)
        check(t, logits, nxt, oracle.step(tokens, pos))
