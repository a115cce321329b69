"""One rank per process (issue 13) on the CPU: `fusec.compile(..., ranks=2)` in a 2-process gloo
group (backends/reference/dist.py) and `fusec run --ranks 2` through torchrun (fusec/launch.py).

- Llama tiny and K3 tiny, B = 2, bf16 and fp32, 3 steps: the two processes' logits and tokens
  are bit-identical, and equal bit for bit to the one-process multi-rank oracle
  (`run_step_ranks`, same weights, state carried over the steps); in fp32 also within the
  shard-pass tolerance (tests/test_passes_graph.py, 1e-5) of the single-rank step.
- The refusals: no process group, a group of another size, multicast switched on.
- `fusec run --ranks 2`: the fp32 tokens equal single-rank `fusec run`'s (in bf16 they need not:
  the per-rank partial sums are rounded to bf16 before the all-reduce, and the random tiny K3 is
  chaotic: seen here, its first step's token differs for seed 0); bad input is one
  `fusec: error:` line, exit 2, no traceback, also when a child fails.
- A checkpoint folder (K3 tiny in the published layout with mxfp4 experts, Llama tiny in HF
  names): `fusec.compile(..., ranks=2, weights=folder)` reads only each rank's slices (counted at
  `safe_open`: less than the whole, the two ranks together at least all of it) and steps to logits
  and tokens bit-identical to the same run given the fully loaded weights (tests/
  test_checkpoint_ranks.py checks the slices themselves).
Nothing here touches a GPU: tests/gpu/test_cute_dist.py is the cute backend's check.
"""
import os
import subprocess
import sys

import pytest
import torch
from rank_spawn import spawn_ranks

import fusec
from fusec.backends.multicast import MULTICAST_OFF
from fusec.backends.reference.executor import init_state
from fusec.backends.reference.ranks import run_step_ranks
from fusec.cli import main
from fusec.compiler import lower
from fusec.launch import token_mismatch
from fusec.models import kimi_k3, llama
from fusec.passes.options import Options
from fusec.weights import random_weights

R, B, L, STEPS, SEED = 2, 2, 8, 3, 3
MODELS = {"llama": llama, "k3": kimi_k3}
REL_TOL = 1e-5      # tests/test_passes_graph.py: the sharded graph vs the one-rank graph, fp32


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, vocab, (B,), generator=g, dtype=torch.int32), torch.full((B,), s, dtype=torch.int32))
            for s in range(STEPS)]


def _worker(rank: int, init: str, out: str) -> None:
    """One rank: every (model, precision)'s per-step (logits, tokens), and the refusals it meets."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=R)
    res = {"errors": {}}
    for name, module in MODELS.items():
        for prec in ("bf16", "fp32"):
            step = fusec.compile(f"models/{module.__name__.split('.')[-1]}.py", "tiny", batch=B, max_len=L,
                                 precision=prec, seed=SEED, ranks=R)
            assert (step.rank, step.ranks) == (rank, R)
            res[name, prec] = [(o.logits.clone(), o.next_tokens.clone()) for o in
                               (step(t, p) for t, p in _inputs(step.vocab))]
    try:
        fusec.compile("models/llama.py", "tiny", batch=B, max_len=L, ranks=3)
    except ValueError as e:
        res["errors"]["size"] = str(e)
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


def _ckpt_worker(rank: int, init: str, out: str, folders: dict) -> None:
    """One rank: per model, the steps from `weights=folder` (and the bytes it read) and from the
    fully loaded checkpoint handed over as a dict (and the bytes that load read)."""
    import torch.distributed as dist

    import fusec.checkpoint
    from checkpoint_reads import install
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=R)
    counter = install(fusec.checkpoint)
    res = {}
    for name, folder in folders.items():
        module = MODELS[name]
        path = f"models/{module.__name__.split('.')[-1]}.py"
        counter.clear()
        step = fusec.compile(path, "tiny", batch=B, max_len=L, ranks=R, weights=folder)
        read = counter.total()
        sliced = [(o.logits.clone(), o.next_tokens.clone()) for o in (step(t, p) for t, p in _inputs(step.vocab))]
        counter.clear()
        full = fusec.checkpoint.load_checkpoint(module.build_graph("tiny"), folder, module)
        whole = counter.total()
        step = fusec.compile(path, "tiny", batch=B, max_len=L, ranks=R, weights=full)
        res[name] = {"sliced": sliced, "read": read, "whole": whole,
                     "full": [(o.logits.clone(), o.next_tokens.clone()) for o in (step(t, p) for t, p in _inputs(step.vocab))]}
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpt_out(tmp_path_factory):
    from checkpoint_writer import write_k3_checkpoint
    from fusec.checkpoint import write_checkpoint
    d = tmp_path_factory.mktemp("distckpt")
    folders = {}
    for name, module in MODELS.items():
        g, folders[name] = module.build_graph("tiny"), str(d / name)
        w = random_weights(g, SEED, module.WEIGHT_INIT)
        if module is kimi_k3:   # the published layout: per-expert mxfp4 tensors, vision tensors, 3 shards
            write_k3_checkpoint(kimi_k3.get_config("tiny"), w, folders[name], shards=3)
        else:
            write_checkpoint(w, g, module, folders[name], shards=2)
    return spawn_ranks(_ckpt_worker, d, R, folders)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_read_per_rank_steps_bit_identical(ckpt_out, name):
    for r in range(R):
        got = ckpt_out[r][name]
        assert len(got["sliced"]) == STEPS
        for s, ((lg, tk), (lf, tf)) in enumerate(zip(got["sliced"], got["full"])):
            assert torch.isfinite(lg).all()
            assert torch.equal(lg, lf) and torch.equal(tk, tf), f"rank {r} step {s}: slices read != full load"
            assert torch.equal(lg, ckpt_out[0][name]["sliced"][s][0]), f"rank {r} step {s} differs from rank 0"
        assert 0 < got["read"] < got["whole"], (got["read"], got["whole"])
    # every byte of the checkpoint the graph needs is read by some rank; the split ones by one only
    assert sum(ckpt_out[r][name]["read"] for r in range(R)) >= ckpt_out[0][name]["whole"]


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    return spawn_ranks(_worker, d, R)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("prec", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(MODELS))
def test_processes_equal_run_step_ranks_bit_for_bit(ranks_out, name, prec):
    module = MODELS[name]
    g = module.build_graph("tiny")
    pg = lower(g, Options(ranks=R, batch=B, max_len=L)).graph
    full = random_weights(g, SEED, module.WEIGHT_INIT)
    dims = {"B": B, "L": L}
    state = init_state(g, dims, precision=prec)
    for s, (tok, pos) in enumerate(_inputs(g.outputs[0].type.shape[-1])):
        want, state = run_step_ranks(pg, full, R, state, {"tokens": tok, "pos": pos}, dims, prec)
        for r in range(R):
            logits, nxt = ranks_out[r][name, prec][s]
            assert torch.equal(logits, ranks_out[0][name, prec][s][0]), f"step {s}: rank {r} differs from rank 0"
            assert torch.equal(logits, want[r][0].float()), f"step {s}: rank {r} differs from run_step_ranks"
            assert torch.equal(nxt, want[r][1]), f"step {s}: rank {r} tokens differ from run_step_ranks"


@pytest.mark.parametrize("name", list(MODELS))
def test_processes_match_the_single_rank_step_in_fp32(ranks_out, name):
    module = MODELS[name]
    one = fusec.compile(f"models/{module.__name__.split('.')[-1]}.py", "tiny", batch=B, max_len=L,
                        precision="fp32", seed=SEED)
    for s, (tok, pos) in enumerate(_inputs(one.vocab)):
        o = one(tok, pos)
        logits, nxt = ranks_out[0][name, "fp32"][s]
        assert _rel(logits, o.logits) < REL_TOL, f"step {s}: rel err {_rel(logits, o.logits):.1e}"
        assert torch.equal(nxt, o.next_tokens)


def test_a_group_of_another_size_is_refused(ranks_out):
    for r in range(R):
        assert ranks_out[r]["errors"]["size"] == "ranks=3 but the process group has 2 process(es)"


def test_no_process_group_is_refused():
    with pytest.raises(ValueError, match="ranks=2 runs one rank per process: start 2 processes"):
        fusec.compile("models/llama.py", "tiny", batch=1, max_len=4, ranks=2)


@pytest.mark.parametrize("var", list(MULTICAST_OFF))
def test_multicast_switched_on_is_refused(monkeypatch, var):
    for v in MULTICAST_OFF:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "0" if MULTICAST_OFF[var] == "1" else "1")
    with pytest.raises(ValueError, match=f"{var}=.* would allow NVLink multicast"):
        fusec.compile("models/llama.py", "tiny", batch=1, max_len=4, ranks=2)


def test_token_mismatch_names_rank_and_step():
    a = torch.tensor([[1, 2], [3, 4]])
    assert token_mismatch([a, a.clone()]) is None
    b = a.clone()
    b[1, 0] = 9
    assert token_mismatch([a, a, b]) == "rank 2 generated other tokens than rank 0 at step 1: [9, 4] vs [3, 4]"


def _fusec(*argv):
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}
    return subprocess.run([sys.executable, "-m", "fusec.cli", *argv], capture_output=True, text=True, env=env)


def test_fusec_run_ranks_2_prints_the_single_rank_tokens():
    args = ["run", "models/kimi_k3.py", "--config", "tiny", "--steps", "4", "--batch", "2", "--precision", "fp32"]
    two, one = _fusec(*args, "--ranks", "2"), _fusec(*args)
    assert two.returncode == 0, two.stderr
    assert one.returncode == 0, one.stderr
    assert [ln.split(":")[0] for ln in two.stdout.splitlines()] == ["prompt tokens"] + [f"step {s}" for s in range(4)]
    assert two.stdout == one.stdout


def test_fusec_run_ranks_child_error_is_one_line():
    p = _fusec("run", "models/llama.py", "--config", "tiny", "--ranks", "2", "--weights", "/nonexistent/ckpt")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("fusec: error: rank ") and "/nonexistent/ckpt" in p.stderr, p.stderr


@pytest.mark.parametrize("argv,msg", [
    (["--device", "cuda:1"], "--ranks 2 gives every rank its own GPU (cuda:LOCAL_RANK): use --device cpu or cuda"),
    (["--backend", "cute"], "--ranks 2 on cuda needs 2 GPUs, one per rank"),
])
def test_fusec_run_ranks_refusals_in_the_parent(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["run", "models/llama.py", "--config", "tiny", "--ranks", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusec: error: ") and msg in err and err.count("\n") == 1, err


def test_fusec_run_ranks_refuses_multicast_on(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    assert main(["run", "models/llama.py", "--config", "tiny", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusec: error: TORCH_SYMM_MEM_DISABLE_MULTICAST=0 would allow NVLink multicast"), err


class _Handle:
    """A symmetric-memory handle's addresses (torch.distributed._symmetric_memory.rendezvous)."""

    def __init__(self, rank, ptrs):
        self.rank, self.world_size, self.buffer_ptrs = rank, len(ptrs), ptrs


class _At:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def test_rank_plans_from_symmetric_addresses():
    """backends/cute/dist.py without a GPU, K3 tiny at 4 ranks (peers at offsets 1, 2 and 3): each rank's table relocated
    with the addresses its process sees (the peers' arenas at other bases in every process; a
    tensor at an offset in its allocation), checked by `Lowered.plan`; every push lands in the
    arena of rank (r + p) % R; one kernel source for every rank (the one tests/test_cute_ranks.py
    compiles and audits for Llama's rank 0); the peers table by rank offset."""
    from fusec.backends.cute.codegen import compile_key
    from fusec.backends.cute.dist import peer_pointers, rank_plan
    from fusec.backends.cute.lower import lower_ranks
    n = 4
    lows = lower_ranks(lower(kimi_k3.build_graph("tiny"), Options(ranks=n, batch=1, max_len=16)).schedule)
    # what process r maps: every rank's allocation, at addresses of its own
    maps = {r: [(0x7000 + 0x100 * r + 0x10 * q) << 32 for q in range(n)] for r in range(n)}
    plans = []
    for r in range(n):
        arenas = peer_pointers(_Handle(r, maps[r]), _At(maps[r][r]), n)
        counters = peer_pointers(_Handle(r, [p + 0x1000 for p in maps[r]]), _At(maps[r][r] + 0x1000 + 512), n)
        assert counters == [p + 0x1000 + 512 for p in maps[r]]
        plan, peers = rank_plan(lows[r], r, n, arenas, counters)
        assert peers == [counters[(r + p) % n] for p in range(n)] and plan.rank == r
        size = lows[r].memory.arena_bytes()
        pushes = [(getattr(t, f), p) for t, ps in zip(plan.tasks, lows[r].peer_fields) for f, p in ps]
        assert {p for _, p in pushes} == set(range(1, n))
        assert all(0 <= a - arenas[(r + p) % n] < size for a, p in pushes)     # in the peer's arena
        plans.append(plan)
    assert len({compile_key(p) for p in plans}) == 1
    with pytest.raises(ValueError, match="over 4 ranks, expected 3"):
        peer_pointers(_Handle(0, maps[0]), _At(maps[0][0]), 3)
