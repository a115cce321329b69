"""Golden outputs of a model: record them once with the fp32 reference, check a compiled step later.

    g = record("models/kimi_k3.py", config="tiny")          # fp32 reference, batches 1 and 4
    g.save("golden/")                                       # golden.json + b<B>.safetensors
    v = check(Golden.load("golden/"), backend="cute", device="cuda")
    print(v.text()); assert v.ok

A record holds, per batch size: the fixed prompts (PROMPT_LEN tokens per sequence, the same
sequences in every batch size), then greedy decoding for the remaining steps; every step's
input tokens, its fp32 logits, its greedy tokens, the top-2 logit gap, and, for every router,
the experts chosen and the routing margin (the k-th minus the (k+1)-th selection score). The
model's identity is the sha256 of its canonical graph text (`fusec compile --emit fir`): a
golden file is refused for any other model or config (`GoldenError`).

The check feeds the recorded inputs (teacher forcing, so one early difference does not change
every later input) and compares each (step, sequence) with the recorded logits:
  * while the candidate picks the same experts as the record, the logits must be within
    `LOGITS_TOL[precision]` (relative L2 per sequence) and the greedy token must agree wherever
    the recorded top-2 gap exceeds twice the largest logit difference;
  * the first step at which it picks other experts is a *routing near-tie* when the record's
    margin at that router and sequence is within `NEAR_TIE[precision]`: the two are different
    but equally valid trajectories, so that sequence is reported apart from then on, not
    compared. A different choice at a clear margin is an error.
Where the candidate's experts cannot be read (a backend without a route tap), a step over the
tolerance counts as a near-tie only if the record has a margin within NEAR_TIE at that step.
The verdict counts how many (step, sequence) pairs were compared sharply, so a check that only
saw near-ties says so.
"""
from __future__ import annotations

import functools
import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1
GOLDEN_FILE = "golden.json"
PROMPT_LEN = 3
DEFAULT_BATCHES = (1, 4)
DEFAULT_STEPS = 8
PROMPT_SEED = 20_240_601
# Relative L2 error of one sequence's logits that rounding explains, by the candidate's precision.
# fp32 against the fp32 record differs by summation order only (~1e-6). bf16 against fp32: the
# random K3 tiny model carries bf16 rounding of ~60 ops without a trained model's damping and
# lands 1e-2 .. 4e-2 from the fp32 step (fusec/debug/bisect.py LOGITS_CEILING, 5e-2).
LOGITS_TOL = {"fp32": 1e-4, "bf16": 5e-2}
# A routing margin (selection-score gap between the k-th and (k+1)-th expert) this small can
# flip under the candidate's rounding: fp32 summation-order noise is ~1e-6 of a score; bf16
# state drift over a few steps moves scores by up to a few 1e-2 (measured on K3 tiny, docs/golden.md).
NEAR_TIE = {"fp32": 1e-4, "bf16": 5e-2}


class GoldenError(ValueError):
    """A golden folder that cannot be used: missing, malformed, or for another model or config."""


def graph_identity(graph) -> str:
    """sha256 of the canonical graph text: equal exactly when the model and its config are."""
    from fusec.ir.printer import print_graph
    return hashlib.sha256(print_graph(graph).encode()).hexdigest()


@dataclass
class Golden:
    meta: dict
    runs: dict = field(default_factory=dict)    # batch -> {tensor name: tensor}

    @property
    def batches(self) -> list[int]:
        return sorted(self.runs)

    def save(self, path, update: bool = False) -> list[Path]:
        """Write golden.json and one safetensors file per batch. An existing record is replaced
        only with `update` (golden files change only on purpose)."""
        from safetensors.torch import save_file

        from fusec.outputs import staged_dir
        path = Path(path)
        refuse_overwrite(path, update)
        with staged_dir(path) as stage:
            for b, tensors in self.runs.items():
                save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(stage / f"b{b}.safetensors"))
            (stage / GOLDEN_FILE).write_text(json.dumps(self.meta, indent=1) + "\n")
        keep = {GOLDEN_FILE, *(f"b{b}.safetensors" for b in self.runs)}
        for p in path.glob("b*.safetensors"):     # batches of the replaced record
            if p.name not in keep:
                p.unlink()
        return [path / n for n in sorted(keep)]

    @staticmethod
    def load(path) -> "Golden":
        from safetensors.torch import load_file
        path = Path(path)
        meta = _read_meta(path)
        runs = {}
        for b in meta["batches"]:
            f = path / f"b{b}.safetensors"
            if not f.is_file():
                raise GoldenError(f"{path}: golden.json lists batch {b} but {f.name} is missing")
            runs[b] = load_file(str(f))
        return Golden(meta, runs)


def refuse_overwrite(path, update: bool) -> None:
    """GoldenError if `path` already holds a record and `update` is not set."""
    path = Path(path)
    if (path / GOLDEN_FILE).exists() and not update:
        raise GoldenError(f"{path}: already holds a golden record ({_describe(_read_meta(path))}); "
                          f"pass --update (fusec.testing: update=True) to replace it")


def _read_meta(path: Path) -> dict:
    f = path / GOLDEN_FILE
    if not f.is_file():
        raise GoldenError(f"{path}: no {GOLDEN_FILE} (record one with `fusec golden record MODEL -o {path}`)")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise GoldenError(f"{f}: malformed json: {e.msg} at line {e.lineno}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise GoldenError(f"{f}: not a fusec golden record of format {FORMAT}")
    return meta


def _describe(meta: dict) -> str:
    return f"{meta.get('graph', '?')}, config {meta.get('config') or 'default'}, graph sha256 {meta.get('graph_sha256', '?')[:12]}"


# -- the model, its weights and a compiled step ---------------------------------------------------
def _device(device) -> str:
    """A usable device, else the API's one-line ValueError (before any weights are drawn on it)."""
    from fusec.api import check_device
    return check_device(device)


def _model_graph(model, config, overrides, weights=None):
    """The graph `fusec.compile` builds for these arguments (a checkpoint's config.json can set
    the dims, so it is passed on), without weights: cheap enough to refuse a record first."""
    from fusec.ir.verify import verify_graph
    from fusec.loader import load_graph
    ckpt = weights if weights is not None and not isinstance(weights, dict) else None
    graph, module = load_graph(model, config, overrides, checkpoint=ckpt)
    verify_graph(graph)
    return graph, module


def _weights(graph, module, weights, seed: int, device: str):
    """(weights for fusec.compile, how the record names them). Random weights are drawn once
    for all batch sizes; they are finite by construction, so `_compiled` skips the poison scan
    meant for weights that come from outside (`trusted`)."""
    if weights is None:
        from fusec.weights import random_weights
        # torch's CPU and CUDA generators draw different numbers for one seed: record where
        draw = "cuda" if str(device).startswith("cuda") else "cpu"
        rules = getattr(module, "WEIGHT_INIT", ()) if module else ()
        w = random_weights(graph, seed, rules, device=device)
        return _Trusted(w), {"seed": seed, "drawn_on": draw}
    if isinstance(weights, dict):
        return weights, {"given": "a dict of tensors"}
    p = Path(weights).resolve()
    return str(p), {"checkpoint": str(p)}


class _Trusted(dict):
    """Weights this module drew itself (random, finite)."""


def _compiled(model, config, overrides, weights, *, backend, batch, steps, device, precision):
    import fusec
    return fusec.compile(model, config, backend=backend, batch=batch, max_len=steps, device=device,
                         precision=precision, weights=weights, overrides=overrides,
                         allow_nonfinite=isinstance(weights, _Trusted))


class _RouteTap:
    """The experts a compiled step chose at each router in its last step: a reference-executor
    hook (reference backend) or a read of the router's ids from the megakernel's arena (cute)."""

    def __init__(self, step, record_margins: bool = False):
        self.step, self.record_margins = step, record_margins
        self.last: dict[str, tuple] = {}
        runner = step.runner
        self.names = [op.outputs[op.opdef.route.ids].name for op in step.graph.ops if op.opdef.route]
        if hasattr(runner, "last_env") and hasattr(runner, "run"):     # the reference executor
            runner.run = functools.partial(runner.run, hook=self._hook)
            self.kind = "hook"
        elif hasattr(runner, "mem") and hasattr(runner, "program"):    # the cute megakernel
            have = {op.outputs[op.opdef.route.ids].name for op in runner.program.graph.ops if op.opdef.route}
            self.names = [n for n in self.names if n in have]
            self.kind = "arena" if self.names else None
        else:
            self.kind = None

    @property
    def observable(self) -> bool:
        return self.kind is not None

    def _hook(self, op, ins, outs):
        route = op.opdef.route
        if route is not None:
            ids = outs[route.ids].long()
            margin = _route_margin(op, ins) if self.record_margins else None
            self.last[op.outputs[route.ids].name] = (ids.sort(-1).values.cpu(), margin)
        return outs

    def take(self) -> dict:
        if self.kind == "arena":
            mem = self.step.runner.mem
            self.last = {n: (mem.tensor(n).long().sort(-1).values.cpu(), None) for n in self.names}
        out, self.last = self.last, {}
        return out


def _route_margin(op, ins) -> torch.Tensor:
    """Per row: k-th minus (k+1)-th selection score of a routing op (`OpDef.route`: the router of
    ir/ops/moe.py picks the top-k of sigmoid(logits) + bias); a small gap is a choice that
    rounding can flip."""
    route = op.opdef.route
    k = route.k(op.attrs)
    corr = route.scores(list(ins), op.attrs).float()
    if corr.shape[-1] <= k:
        return torch.full(corr.shape[:-1], float("inf"))
    top = corr.topk(k + 1, dim=-1).values
    return (top[..., k - 1] - top[..., k]).cpu()


def _prompts(vocab: int, rows: int, length: int) -> torch.Tensor:
    """[length, rows] fixed prompt tokens; row i is the same sequence in every batch size."""
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab, (length, max(rows, 16)), generator=g, dtype=torch.int32)[:, :rows]


# -- record -----------------------------------------------------------------------------------------
def record(model, config: str | None = None, *, overrides: dict | None = None, weights=None, seed: int = 0,
           batches=DEFAULT_BATCHES, steps: int = DEFAULT_STEPS, device: str = "cpu", command: str | None = None) -> Golden:
    """Run the fp32 reference greedily from fixed prompts and keep what `check` compares."""
    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1:
        raise ValueError(f"batch sizes must be integers >= 1, got {batches}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = _device(device)
    graph, module = _model_graph(model, config, overrides, weights)
    w, wmeta = _weights(graph, module, weights, seed, device)
    meta = {"format": FORMAT, "model": _model_ref(model), "config": config, "overrides": overrides or {},
            "graph": graph.name, "graph_sha256": graph_identity(graph), "weights": wmeta,
            "batches": batches, "steps": steps, "prompt_len": min(PROMPT_LEN, steps), "precision": "fp32",
            "routers": [], "recorded": {"device": str(device), "fusec": _fusec_version(), "torch": torch.__version__,
                                        "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "command": command}}
    runs = {}
    for b in batches:
        step = _compiled(model, config, overrides, w, backend="reference", batch=b, steps=steps, device=device,
                         precision="fp32")
        tap = _RouteTap(step, record_margins=True)
        vocab = step.vocab
        prompts = _prompts(vocab, b, meta["prompt_len"])
        tok = prompts[0]
        cols: dict[str, list] = {"inputs": [], "logits": [], "greedy": [], "top2_gap": []}
        routes: dict[str, list] = {}
        for s in range(steps):
            out = step(tok, torch.full((b,), s, dtype=torch.int32))
            logits = out.logits.float().cpu()
            top2 = logits.topk(2, dim=-1).values
            cols["inputs"].append(tok.clone())
            cols["logits"].append(logits)
            cols["greedy"].append(out.next_tokens.cpu().to(torch.int32))
            cols["top2_gap"].append(top2[:, 0] - top2[:, 1])
            for name, (ids, margin) in tap.take().items():
                routes.setdefault(name, []).append((ids.to(torch.int32), margin))
            tok = prompts[s + 1] if s + 1 < meta["prompt_len"] else out.next_tokens.cpu().to(torch.int32)
        run = {k: torch.stack(v) for k, v in cols.items()}
        for name, rows in routes.items():
            run[f"route.{name}.ids"] = torch.stack([r[0] for r in rows])
            run[f"route.{name}.margin"] = torch.stack([r[1] for r in rows]).float()
        meta["routers"] = list(routes)
        runs[b] = run
        del step
    return Golden(meta, runs)


def _model_ref(model) -> str:
    """How the record names the model: a model shipped with fusec by its name (so the record
    checks on another machine), any other model file by its absolute path."""
    import fusec.models
    p = Path(str(model))
    if not p.is_file():
        return str(model)
    p = p.resolve()
    return p.stem if p.parent == Path(fusec.models.__file__).resolve().parent else str(p)


def _fusec_version() -> str:
    from fusec import version
    return version()


# -- check ------------------------------------------------------------------------------------------
@dataclass
class Cell:
    batch: int
    step: int
    row: int
    err: float              # relative L2 error of the row's logits against the record
    status: str             # ok | FAIL | near-tie | apart (a sequence after its near-tie)
    note: str = ""


@dataclass
class Verdict:
    meta: dict
    backend: str
    device: str
    precision: str
    tol: float
    near_tie: float
    cells: list[Cell] = field(default_factory=list)
    routes_observed: bool = True
    weights_note: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.status == "FAIL" for c in self.cells)

    @property
    def first_failure(self) -> Cell | None:
        fails = [c for c in self.cells if c.status == "FAIL"]
        return min(fails, key=lambda c: (c.step, c.batch, c.row)) if fails else None

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.cells)

    def text(self) -> str:
        """The one-screen verdict."""
        m = self.meta
        head = "PASS" if self.ok else "FAIL"
        lines = [f"fusec golden check: {head}: {m['graph']} (config {m.get('config') or 'default'}) against "
                 f"{self.backend} ({self.precision}) on {self.device}",
                 f"  record: fp32 reference, batches {m['batches']}, {m['steps']} steps ({m['prompt_len']} prompt "
                 f"tokens, then greedy), weights {_weights_str(m['weights'])}{self.weights_note}",
                 f"  tolerance: logits rel L2 <= {self.tol:g} per sequence; routing near-tie: margin <= {self.near_tie:g}"
                 + ("" if self.routes_observed else " (candidate's experts not observable: inferred from the record)")]
        for b in sorted({c.batch for c in self.cells}):
            cs = [c for c in self.cells if c.batch == b]
            per_step = []
            for s in range(m["steps"]):
                row = [c for c in cs if c.step == s]
                mark = ("X" if any(c.status == "FAIL" for c in row) else
                        "~" if any(c.status in ("near-tie", "apart") for c in row) else ".")
                sharp = [c.err for c in row if c.status in ("ok", "FAIL")]
                per_step.append(f"{mark}{max(sharp):.0e}" if sharp else mark)
            lines.append(f"  batch {b}: " + " ".join(per_step))
        lines.append(f"  compared sharply: {self.count('ok') + self.count('FAIL')} of {len(self.cells)} (step, sequence) "
                     f"pairs; near-ties: {self.count('near-tie')} (then {self.count('apart')} reported apart)")
        ties = [c for c in self.cells if c.status == "near-tie"]
        for c in ties[:4]:
            lines.append(f"    near-tie: batch {c.batch} step {c.step} sequence {c.row}: {c.note}")
        if len(ties) > 4:
            lines.append(f"    ... and {len(ties) - 4} more")
        f = self.first_failure
        if f is not None:
            lines.append(f"  first diverging step: step {f.step} (batch {f.batch}, sequence {f.row}): {f.note}")
        lines.append(f"  ({self.seconds:.1f} s; '.': within tolerance, '~': near-tie, 'X': failure; numbers: worst "
                     f"sharp error at the step)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "backend": self.backend, "device": self.device, "precision": self.precision,
                "tol": self.tol, "near_tie": self.near_tie, "routes_observed": self.routes_observed,
                "cells": [c.__dict__ for c in self.cells],
                "first_failure": None if self.first_failure is None else self.first_failure.__dict__}


def _weights_str(w: dict) -> str:
    if "seed" in w:
        return f"random, seed {w['seed']} (drawn on {w.get('drawn_on', 'cpu')})"
    if "checkpoint" in w:
        return f"checkpoint {w['checkpoint']}"
    return w.get("given", "?")


def check(golden: Golden, *, backend: str = "reference", device: str = "cpu", precision: str | None = None,
          model=None, config: str | None = None, overrides: dict | None = None, weights=None,
          tol: float | None = None, near_tie: float | None = None, batches=None) -> Verdict:
    """Compile `model` (default: the recorded one) with `backend` and compare it with `golden`.

    Raises GoldenError (before building anything) when the model's graph is not the recorded one.
    `weights`: None takes the recorded ones (same seed and device kind, or the same checkpoint);
    a dict or a checkpoint path checks other weights against the record."""
    t0 = time.perf_counter()
    meta = golden.meta
    precision = precision or ("bf16" if backend == "cute" else "fp32")
    if precision not in LOGITS_TOL:
        raise ValueError(f"precision must be one of {', '.join(LOGITS_TOL)}, got {precision!r}")
    device = _device(device)
    if model is None:
        model, config, overrides = meta["model"], meta.get("config"), meta.get("overrides") or None
    wm = meta["weights"]
    if weights is None and "seed" not in wm and "checkpoint" not in wm:
        raise GoldenError("the record was made from weights given as a dict: pass the same weights to check it")
    spec = wm["checkpoint"] if weights is None and "checkpoint" in wm else weights
    graph, module = _model_graph(model, config, overrides, spec)
    have = graph_identity(graph)
    if have != meta["graph_sha256"]:
        raise GoldenError(f"golden record is for {_describe(meta)}, not {graph.name} (config {config or 'default'}, "
                          f"graph sha256 {have[:12]}): record it for this model with `fusec golden record ... --update`")
    note = ""
    if weights is None and "seed" in wm:
        if wm.get("drawn_on") == "cuda" and not str(device).startswith("cuda"):
            raise GoldenError("the record's random weights were drawn on a CUDA device (its generator differs "
                              "from the CPU's): check it with --device cuda, or pass the weights")
        w, _ = _weights(graph, module, None, int(wm["seed"]), wm.get("drawn_on", "cpu"))
    elif weights is None:
        w = spec
    else:
        w, wmeta = _weights(graph, module, weights, 0, device)
        if wmeta != wm:
            note = f"; checked with other weights: {_weights_str(wmeta)}"
    v = Verdict(meta, backend, str(device), precision, tol if tol is not None else LOGITS_TOL[precision],
                near_tie if near_tie is not None else NEAR_TIE[precision], weights_note=note)
    for b in (batches or golden.batches):
        if b not in golden.runs:
            raise GoldenError(f"the record has no batch {b} (it has {golden.batches})")
        step = _compiled(model, config, overrides, w, backend=backend, batch=b, steps=meta["steps"], device=device,
                         precision=precision)
        _check_batch(golden.runs[b], meta, step, b, v)
        del step
    v.seconds = time.perf_counter() - t0
    return v


def _check_batch(run: dict, meta: dict, step, b: int, v: Verdict) -> None:
    tap = _RouteTap(step)
    v.routes_observed = v.routes_observed and (tap.observable or not meta["routers"])
    apart: dict[int, str] = {}      # row -> why it is reported apart (a near-tie at an earlier step)
    for s in range(meta["steps"]):
        out = step(run["inputs"][s], torch.full((b,), s, dtype=torch.int32))
        step.check()
        got = out.logits.float().cpu()
        ref = run["logits"][s]
        routes = tap.take() if tap.observable else {}
        for i in range(b):
            d = got[i] - ref[i]
            err = float(d.norm() / ref[i].norm().clamp_min(1e-30)) if bool(torch.isfinite(got[i]).all()) else float("inf")
            if i in apart:
                v.cells.append(Cell(b, s, i, err, "apart", apart[i]))
                continue
            tie = _first_flip(run, meta, routes, s, i) if routes else None
            if tie is not None:
                name, margin = tie
                if margin <= v.near_tie:
                    apart[i] = f"after the near-tie at step {s} ({name}, margin {margin:.1e})"
                    v.cells.append(Cell(b, s, i, err, "near-tie", f"{name} picked other experts at margin {margin:.1e}"))
                else:
                    v.cells.append(Cell(b, s, i, err, "FAIL", f"{name} picked other experts than the record at a clear "
                                                               f"margin {margin:.2e} (> {v.near_tie:g}); logits rel err {err:.2e}"))
                continue
            if not err <= v.tol:
                m = _min_margin(run, meta, s, i)
                if not routes and m is not None and m[1] <= v.near_tie:
                    apart[i] = f"after a suspected near-tie at step {s}"
                    v.cells.append(Cell(b, s, i, err, "near-tie", f"logits rel err {err:.2e}; the record has margin "
                                                                   f"{m[1]:.1e} at {m[0]} (experts not observable)"))
                else:
                    v.cells.append(Cell(b, s, i, err, "FAIL", f"logits differ from the record: rel L2 {err:.2e} > "
                                                               f"{v.tol:g}" + ("" if err == err and err != float("inf") else " (non-finite)")))
                continue
            gap = float(run["top2_gap"][s][i])
            tok, want = int(got[i].argmax()), int(run["greedy"][s][i])
            if tok != want and gap > 2 * float(d.abs().max()):
                v.cells.append(Cell(b, s, i, err, "FAIL", f"greedy token {tok}, the record has {want} (top-2 gap {gap:.2e})"))
                continue
            v.cells.append(Cell(b, s, i, err, "ok"))


def _first_flip(run, meta, routes, s, i):
    """(router, recorded margin) of the first router whose experts for row i at step s differ."""
    for name in meta["routers"]:
        if name not in routes:
            continue
        ids = routes[name][0][i]
        want = run[f"route.{name}.ids"][s][i].long().sort().values
        if not torch.equal(ids.long(), want):
            return name, float(run[f"route.{name}.margin"][s][i])
    return None


def _min_margin(run, meta, s, i):
    best = None
    for name in meta["routers"]:
        m = float(run[f"route.{name}.margin"][s][i])
        if best is None or m < best[1]:
            best = (name, m)
    return best

