"""The one-graph deferred step of fusec.api.CompiledStep, on the CPU: which runners get it, and
its bookkeeping (input copies, clamps and range flag, finite flag, pinned slots, copies of the
outputs, error order) with the CUDA graph, the pinned copies and the events faked. A CPU runner
with the capturable-step interface wraps the reference runner. The real capture and replay on
the cute backend: tests/gpu/test_step_graph.py."""
from __future__ import annotations

import math

import pytest
import torch

import fusec
from fusec import api
from fusec.api import CompiledStep, NonFiniteLogits
from fusec.models import kimi_k3
from fusec.weights import random_weights

from cuda_fakes import fake_events_and_pinning

K3 = "models/kimi_k3.py"
B, L, VOCAB = 2, 4, 4096


class RunnerTimeout(RuntimeError):
    pass


class GraphableRef:
    """The reference runner behind the interface CompiledStep captures (as CuteRunner offers it):
    `device_step` computes into static outputs (the cute arena's role) and records what it was
    given; `launched` and `check` keep the runner's own pending steps (a step in `fail` is
    reported as a timeout, like the cute runner's error words)."""

    def __init__(self, ref, fail=()):
        self.ref, self.fail = ref, set(fail)
        self.static = [torch.zeros((B, VOCAB)), torch.zeros(B, dtype=torch.int32)]
        self.seen, self.launches, self.pending = [], 0, []

    def outputs(self):
        return self.static

    def device_step(self, tokens, positions):
        self.seen.append((tokens.tolist(), positions.tolist()))
        for s, o in zip(self.static, self.ref.run(tokens.to(torch.int32), positions.to(torch.int32))):
            s.copy_(o)
        return self.static

    def launched(self):
        self.pending.append(self.launches)
        self.launches += 1

    def check(self, keep=0):
        while len(self.pending) > keep:
            k = self.pending.pop(0)
            if k in self.fail:
                self.pending.clear()
                raise RunnerTimeout(f"runner step {k} timed out")

    def run(self, tokens, positions):
        raise AssertionError("the one-graph step does not call run")

    def reset(self):
        self.ref.reset()


@pytest.fixture
def fake_cuda(monkeypatch):
    """No GPU: pinned copies and events as plain CPU ones; the graph replays `body` eagerly into
    the tensors its first replay returned (a real replay rewrites the same static outputs)."""
    fake_events_and_pinning(monkeypatch)
    captures = []

    def cuda_graph(body, device, keep=()):
        captures.append(device)
        outs = []

        def replay():
            new = body()
            if not outs:
                outs.extend(new)
            for o, n in zip(outs, new):
                if o is not n:
                    o.copy_(n)
            return tuple(outs)
        replay.keep = keep
        return replay
    monkeypatch.setattr(api, "_cuda_graph", cuda_graph)
    return captures


@pytest.fixture(scope="module")
def weights():
    return random_weights(kimi_k3.build_graph("tiny"), 5, kimi_k3.WEIGHT_INIT)


def _steps(weights, fail=(), deferred=True, **kw):
    """(one-graph step over a fresh reference, its runner, the path of separate launches)."""
    w = dict(weights)
    a, b = (fusec.compile(K3, "tiny", batch=B, max_len=L, weights=w, allow_nonfinite=True) for _ in range(2))
    run = GraphableRef(a.runner, fail)
    return (CompiledStep(a.graph, run, B, L, "cpu", deferred=deferred, **kw), run,
            CompiledStep(b.graph, b.runner, B, L, "cpu", deferred=deferred, **kw))


def test_which_runners_get_the_graph(weights, fake_cuda):
    from fusec.backends.cute.runner import CuteRunner
    ref = fusec.compile(K3, "tiny", batch=B, max_len=L, weights=dict(weights))
    assert not ref.graphed and not ref.deferred                  # reference backend: as it was
    assert not CompiledStep(ref.graph, ref.runner, B, L, "cpu", deferred=True).graphed   # no capturable step
    assert not _steps(weights, deferred=False)[0].graphed          # not deferred: checks sync, no graph
    graphed, run, plain = _steps(weights)
    assert graphed.graphed and not plain.graphed
    cute = object.__new__(CuteRunner)                              # the interface, without a GPU
    assert CompiledStep(ref.graph, cute, B, L, "cuda", deferred=True).graphed
    plain.step(torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert fake_cuda == []                                         # the separate launches capture nothing


def test_graph_step_matches_the_separate_launches(weights, fake_cuda):
    graphed, run, plain = _steps(weights)
    gen = torch.Generator().manual_seed(0)
    kept = []
    for s in range(3):
        tok = torch.randint(0, VOCAB, (B,), generator=gen)
        pos = torch.full((B,), s, dtype=torch.int32)
        a, b = graphed.step(tok, pos), plain.step(tok, pos)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.next_tokens, b.next_tokens), f"step {s}"
        assert a.logits.dtype == torch.float32 and a.next_tokens.dtype == torch.int32
        kept.append((a, b.logits.clone(), b.next_tokens.clone()))
    # every step's outputs are the caller's: later replays do not overwrite them
    assert all(torch.equal(a.logits, lb) and torch.equal(a.next_tokens, nb) for a, lb, nb in kept)
    assert len(fake_cuda) == 1 and run.launches == 3 and graphed.steps_run == 3
    graphed.check()
    plain.check()
    graphed.reset()
    plain.reset()
    assert torch.equal(graphed.generate(torch.tensor([7, 9]), L), plain.generate(torch.tensor([7, 9]), L))
    assert len(fake_cuda) == 1 and run.launches == 3 + L and graphed.steps_run == L


def test_device_range_check_is_deferred_and_clamps(weights, fake_cuda, monkeypatch):
    """CUDA-resident inputs are range-checked inside the graph: the step runs on clamped values
    and the step after next (or check()) raises naming it; CPU inputs keep the immediate check."""
    graphed, run, _ = _steps(weights)
    with pytest.raises(ValueError, match=r"token id 4096 is outside the vocabulary \[0, 4096\)"):
        graphed.step(torch.tensor([1, 4096]), torch.tensor([0, 0]))
    assert run.seen == []                                          # the host check ran first
    monkeypatch.setattr(graphed, "_checks_on_device", lambda t, p: True)   # as CUDA tensors would
    graphed.step(torch.tensor([1, 2 ** 40]), torch.tensor([0, 9]))
    assert run.seen[-1] == ([1, VOCAB - 1], [0, L - 1])           # 2**40 is clamped, not narrowed
    graphed.step(torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"^step 0: a position outside \[0, 4\) or a token id outside"):
        graphed.step(torch.tensor([1, 2]), torch.tensor([2, 2]))
    graphed.step(torch.tensor([-3, 2], dtype=torch.int16), torch.tensor([3, 3], dtype=torch.uint8))
    assert run.seen[-1] == ([0, 2], [3, 3])
    with pytest.raises(ValueError, match=r"^step 2: "):
        graphed.check()
    graphed.step(torch.tensor([5, 6]), torch.tensor([0, 1]))
    graphed.check()                                                # in range: nothing pending raises


def test_errors_in_order_and_nonfinite(weights, fake_cuda, monkeypatch):
    """The runner's own error of step k first, then the range error; a poisoned lm_head raises
    NonFiniteLogits naming the step, two steps later or at check()."""
    w = dict(weights)
    w["lm_head.weight"] = w["lm_head.weight"].clone()
    w["lm_head.weight"][5, 0] = float("nan")
    graphed, run, _ = _steps(w, fail={0})
    monkeypatch.setattr(graphed, "_checks_on_device", lambda t, p: True)
    graphed.step(torch.tensor([3, 4096]), torch.tensor([0, 0]))    # runner error, range error, NaN
    graphed.step(torch.tensor([3, 3]), torch.tensor([1, 1]))
    with pytest.raises(RunnerTimeout, match="runner step 0"):
        graphed.step(torch.tensor([3, 3]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"^step 0: a position outside"):
        graphed.step(torch.tensor([3, 3]), torch.tensor([2, 2]))
    graphed.reset()
    out = graphed.step(torch.tensor([3, 3]), torch.tensor([0, 0]))
    assert not torch.isfinite(out.logits).all()                    # returned: the check is pending
    graphed.step(torch.tensor([3, 3]), torch.tensor([1, 1]))
    with pytest.raises(NonFiniteLogits, match=r"^step 0: non-finite logits in batch row\(s\) \[0, 1\]"):
        graphed.step(torch.tensor([3, 3]), torch.tensor([2, 2]))
    graphed.reset()
    graphed.step(torch.tensor([3, 3]), torch.tensor([0, 0]))
    with pytest.raises(NonFiniteLogits, match=r"^step 0: "):
        graphed.check()
    off, _, _ = _steps(w, check_finite=False)
    off.generate(torch.tensor([3, 3]), L)                          # check_finite=False: no flag raised


class GuardedRef(GraphableRef):
    """GraphableRef with the cute runner's guarded step: the inputs' clamps, range flag and step
    counter in the runner (the cute one does them in one small kernel); records the tensors it
    was handed, to show the graph reads the caller's own."""

    def __init__(self, ref, fail=()):
        super().__init__(ref, fail)
        self.prepared, self.handed = 0, []

    def prepare_guard(self):
        self.prepared += 1

    def device_step_guarded(self, tokens, positions, tok_hi, pos_hi, flag):
        self.handed.append((tokens, positions))
        t, p = tokens.to(torch.int64), positions.to(torch.int64)
        ct, cp = t.clamp(0, tok_hi), p.clamp(0, pos_hi)
        flag.fill_(float(bool((ct != t).any() or (cp != p).any())))
        return self.device_step(ct, cp)


def _guarded(weights):
    (a, b) = (fusec.compile(K3, "tiny", batch=B, max_len=L, weights=dict(weights)) for _ in range(2))
    run = GuardedRef(a.runner)
    return CompiledStep(a.graph, run, B, L, "cpu", deferred=True), run, CompiledStep(b.graph, b.runner, B, L, "cpu",
                                                                                       deferred=True)


def test_graphs_keyed_by_the_callers_inputs(weights, fake_cuda, monkeypatch):
    """Device-resident int32/int64 contiguous inputs are read in place: one graph per (tokens,
    positions) pair, reused while the caller passes the same tensors (an engine's persistent
    buffers), holding them; past MAX_KEYED_GRAPHS pairs and for other inputs, the one staging
    buffer and its graph. Every step matches the path of separate launches."""
    graphed, run, plain = _steps(weights)
    monkeypatch.setattr(graphed, "_checks_on_device", lambda t, p: True)   # as CUDA tensors would
    tok, pos = torch.tensor([5, 9]), torch.tensor([0, 0], dtype=torch.int32)

    def both(t, p, what):
        a, b = graphed.step(t, p), plain.step(t, p)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.next_tokens, b.next_tokens), what

    for s in range(3):
        pos.fill_(s)                          # the same buffers, new values: the same graph
        tok[0] = 5 + s
        both(tok, pos, f"step {s}")
    assert len(fake_cuda) == 1 and list(graphed._graphs) == [(tok.data_ptr(), torch.int64, pos.data_ptr(), torch.int32)]
    kept = graphed._graphs[next(iter(graphed._graphs))].keep
    assert kept[0] is tok and kept[1] is pos
    graphed.reset()
    plain.reset()
    pairs = [(torch.tensor([s, s + 1]), torch.tensor([s % L, s % L])) for s in range(api.MAX_KEYED_GRAPHS + 2)]
    for s, (t, p) in enumerate(pairs):
        both(t, p, f"pair {s}")
    # the pair above and MAX_KEYED_GRAPHS - 1 new ones got their own graphs; the rest the staging one
    assert len(fake_cuda) == api.MAX_KEYED_GRAPHS + 1 and None in graphed._graphs
    both(pairs[-1][0][::1].to(torch.int16), pairs[-1][1], "an int16 pair, staged")
    both(torch.tensor([[3], [4]]).reshape(-1), torch.tensor([0, 1]), "a reshaped pair, still contiguous")
    assert len(fake_cuda) == api.MAX_KEYED_GRAPHS + 1
    graphed.check()


def test_guarded_runner_gets_the_callers_tensors_and_flags_clamps(weights, fake_cuda, monkeypatch):
    """A runner with the guard on the device (`device_step_guarded`) is handed the caller's own
    tensors with the inclusive bounds, once prepared; its flag is the step's range check,
    raised naming the step two steps later; the staging buffer's int64 rows reach it too."""
    graphed, run, plain = _guarded(weights)
    assert graphed.guarded
    monkeypatch.setattr(graphed, "_checks_on_device", lambda t, p: True)
    tok, pos = torch.tensor([1, 2 ** 40]), torch.tensor([0, 9])
    a = graphed.step(tok, pos)
    assert run.prepared == 1 and run.handed[-1][0] is tok and run.handed[-1][1] is pos
    b = plain.step(torch.tensor([1, VOCAB - 1]), torch.tensor([0, L - 1]))
    assert torch.equal(a.logits, b.logits), "the step ran on the clamped inputs"
    graphed.step(torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"^step 0: a position outside \[0, 4\) or a token id outside"):
        graphed.step(torch.tensor([1, 2]), torch.tensor([2, 2]))
    graphed.step(torch.tensor([3, 4], dtype=torch.int16), torch.tensor([3, 3], dtype=torch.uint8))
    staged = run.handed[-1]
    assert staged[0].dtype == torch.int64 and staged[0].data_ptr() == graphed._inp[0].data_ptr()
    assert run.seen[-1] == ([3, 4], [3, 3])
    graphed.check()
    assert run.prepared == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_measure_flags_inf_and_nan_only(dtype):
    """The graph's finite check (fusec.api.finite_measure, finite exactly when every element is)
    against torch.isfinite: each of +Inf, -Inf and NaN anywhere in a row is caught, also with
    larger finite values around it, and the largest finite values (whose plain sum would overflow
    to Inf) are not; written into a 0-d view as the graph does."""
    big = torch.finfo(dtype).max
    x = torch.full((3, 1000), big, dtype=dtype)
    x[1] = -big
    out = torch.zeros(2)
    assert math.isfinite(float(api.finite_measure(x, out=out[0]))) and bool(torch.isfinite(x).all())
    assert float(out[0]) == float(big) and float(out[1]) == 0.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        for where in ((0, 0), (2, 999), (1, 517)):
            y = x.clone()
            y[where] = bad
            assert not math.isfinite(float(api.finite_measure(y))), (bad, where)
