"""Deterministic random weights for a graph (by seed and weight name, independent of order).

Deterministic per device: torch's CPU and CUDA generators give different streams for one seed,
so `random_weights(..., device="cuda")` (what `fusec.compile(device="cuda")` uses, to build a
57 GB slice without a CPU round trip) differs from the CPU draw. Compare devices with one dict.

Models may give init rules (`WEIGHT_INIT`: a list of (fnmatch pattern, rule)); the default
for a matrix is normal / sqrt(fan_in), so activations keep unit scale through deep graphs.
MXFP4 weights are drawn directly as random nibbles and scales of the same magnitude.
"""
from __future__ import annotations

import fnmatch
import math
import zlib

import torch

from fusec.ir.graph import Graph
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import MXFP4_GROUP, DType

RULES = ("linear", "ones", "norm", "small", "alog", "normal", "zeros")


def _gen(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return g


def init_weight(name: str, shape: tuple[int, ...], dtype: DType, rule: str, seed: int, device="cpu"):
    g = _gen(seed, name, device)
    if dtype is DType.mxfp4:
        *lead, n, k = shape
        packed = torch.randint(0, 256, (*lead, n, k // 2), generator=g, device=device, dtype=torch.uint8)
        # E2M1 magnitudes average ~2 (rms ~2.9); aim the product at 1/sqrt(k)
        e = round(math.log2(1.0 / (math.sqrt(k) * 2.9)))
        scale = torch.full((*lead, n, k // MXFP4_GROUP), 127 + e, dtype=torch.uint8, device=device)
        jitter = torch.randint(-1, 2, scale.shape, generator=g, device=device, dtype=torch.int16)
        return MXFP4Tensor(packed, (scale.to(torch.int16) + jitter).to(torch.uint8))
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if rule == "linear":
        t = t / math.sqrt(shape[-1])
    elif rule == "ones":
        t = torch.ones(shape, device=device)
    elif rule == "norm":
        t = 1.0 + 0.1 * t
    elif rule == "small":
        t = 0.1 * t
    elif rule == "alog":
        t = torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g))
    elif rule == "zeros":
        t = torch.zeros(shape, device=device)
    elif rule != "normal":
        raise ValueError(f"unknown init rule {rule!r} (have: {', '.join(RULES)})")
    if dtype is DType.bf16:
        return t.to(torch.bfloat16)
    if dtype is DType.f32:
        return t
    return t.to({DType.f16: torch.float16}.get(dtype, torch.float32))


def random_weights(graph: Graph, seed: int = 0, rules=(), device="cpu") -> dict:
    """One tensor per weight of `graph`; `rules` is a list of (fnmatch pattern, rule), first match wins."""
    out = {}
    for v in graph.weights():
        rule = next((r for pat, r in rules if fnmatch.fnmatchcase(v.name, pat)), None)
        if rule is None:
            rule = "linear" if v.type.rank >= 2 else "norm"
        out[v.name] = init_weight(v.name, v.type.concrete({}), v.type.dtype, rule, seed, device)
    return out


# -- poison checks --------------------------------------------------------------------------------

E8M0_NAN = 0xFF   # the one E8M0 scale byte that is not a power of two: NaN


def _first_index(mask: torch.Tensor, origin=None) -> list[int]:
    flat = int(torch.argmax(mask.reshape(-1).to(torch.uint8)))
    at = [int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape)] if mask.dim() else []
    return [i + o for i, o in zip(at, origin)] if origin is not None else at


def nonfinite_problem(name: str, t: torch.Tensor, *, scale: bool = False, origin=None) -> str | None:
    """One line saying how `t` is poisoned, or None when it is clean.

    `scale`: `t` holds MXFP4 E8M0 scale bytes (u8), where 0xFF means NaN. Otherwise a float
    tensor (bf16, f16, f32, fp8) is checked for NaN and +-Inf; other dtypes are never poisoned.
    `origin`: where `t` starts in tensor `name` when it is a slice of it (one offset per dim), so
    the first index named is the tensor's own.
    """
    if scale:
        bad = t == E8M0_NAN
        n = int(bad.sum())
        if n:
            return (f"tensor {name} has {n} E8M0 scale byte(s) 0xFF (NaN), first at "
                    f"{_first_index(bad, origin)}")
        return None
    if not t.is_floating_point():
        return None
    if t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        t = t.float()     # fp8 and friends: isfinite may not take them directly
    if bool(torch.isfinite(t).all()):
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    bad = ~torch.isfinite(t)
    what = ", ".join(s for s in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if s)
    return f"tensor {name} has non-finite values ({what}), first at {_first_index(bad, origin)}"


ALLOW_HINT = "pass allow_nonfinite=True (--allow-nonfinite) to load it anyway"


def check_finite_weights(weights, graph: Graph | None = None) -> None:
    """Raise ValueError naming the first poisoned weight of `weights` (graph name -> tensor or
    MXFP4Tensor): a NaN/Inf in a float weight or a 0xFF E8M0 scale byte in an MXFP4 weight."""
    names = [v.name for v in graph.weights()] if graph is not None else list(weights)
    problems = []
    for n in names:
        w = weights.get(n)
        if w is None:
            continue
        if isinstance(w, MXFP4Tensor):
            p = nonfinite_problem(f"{n} (scale)", w.scale, scale=True)
        elif isinstance(w, torch.Tensor):
            p = nonfinite_problem(n, w)
        else:
            p = None
        if p:
            problems.append(p)
    if problems:
        more = f" (and {len(problems) - 1} more poisoned weights)" if len(problems) > 1 else ""
        raise ValueError(f"weight {problems[0]}{more}; {ALLOW_HINT}")
