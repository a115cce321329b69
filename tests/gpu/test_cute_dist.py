"""One rank per GPU, one process per rank (backends/cute/dist.py; marked gpu, skipped below two
CUDA GPUs or without nvidia-cutlass-dsl): `fusec.compile(..., backend="cute", ranks=2)` in a
2-process NCCL group, arenas and event counters in PyTorch symmetric memory, NVLink multicast
off. Written on a machine without a GPU: NOT yet run.

- Llama tiny, R = 2, B = 1 and 4, 4 steps: both ranks' logits and tokens bit-identical; the
  logits within 2e-2 (relative, norm; as tests/gpu/test_cute_rank_group.py) of the multi-rank
  bf16 reference (`run_step_ranks`, weights sliced from the same full checkpoint).
- A planted missing remote signal (rank 1's first system-scope peer signal dropped) ends rank
  0's step with a bounded-wait error naming rank, task and event within 1 s.
"""
import dataclasses
import os
import time

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (one process per rank)", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import fusec  # noqa: E402
from fusec.backends.reference.executor import init_state  # noqa: E402
from fusec.backends.reference.ranks import run_step_ranks  # noqa: E402
from fusec.compiler import lower  # noqa: E402
from fusec.models import llama  # noqa: E402
from fusec.passes.options import Options  # noqa: E402
from fusec.weights import random_weights  # noqa: E402

R, L, STEPS, SEED = 2, 16, 4, 0


def _inputs(vocab, batch):
    g = torch.Generator().manual_seed(batch)
    return [(torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32),
             torch.full((batch,), s, dtype=torch.int32)) for s in range(STEPS)]


def _join(rank, init):
    import torch.distributed as dist

    from fusec.backends.multicast import multicast_off
    multicast_off()                       # before NCCL initialises
    os.environ["LOCAL_RANK"] = str(rank)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=R, device_id=dev)


def _steps_worker(rank, init, out, batch):
    import torch.distributed as dist
    _join(rank, init)
    step = fusec.compile("models/llama.py", "tiny", backend="cute", device="cuda", batch=batch, max_len=L,
                         seed=SEED, ranks=R)
    assert step.device == f"cuda:{rank}" and step.rank == rank
    res = [(o.logits.cpu(), o.next_tokens.cpu()) for o in (step(t, p) for t, p in _inputs(step.vocab, batch))]
    step.check()
    torch.save(res, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _spawn(fn, tmp_path, *args):
    mp.spawn(fn, args=(f"file://{tmp_path}/pg", str(tmp_path / "out"), *args), nprocs=R, join=True)
    return [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(R)]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("batch", [1, 4])
def test_two_processes_match_the_multi_rank_reference(tmp_path, batch):
    outs = _spawn(_steps_worker, tmp_path, batch)
    g = llama.build_graph("tiny")
    pg = lower(g, Options(ranks=R, batch=batch, max_len=L)).graph
    full = random_weights(g, SEED, llama.WEIGHT_INIT)
    dims = {"B": batch, "L": L}
    state, errs = init_state(g, dims, precision="bf16"), []
    for s, (tok, pos) in enumerate(_inputs(g.outputs[0].type.shape[-1], batch)):
        ref, state = run_step_ranks(pg, full, R, state, {"tokens": tok, "pos": pos}, dims, "bf16")
        for r in range(1, R):
            assert torch.equal(outs[r][s][0], outs[0][s][0]) and torch.equal(outs[r][s][1], outs[0][s][1]), \
                f"step {s}: rank {r} differs from rank 0"
        errs.append(_rel(outs[0][s][0], ref[0][0]))
    print(f"llama B={batch}: logits rel err per step", [f"{e:.1e}" for e in errs])
    assert max(errs) < 2e-2, errs


def _missing_signal_worker(rank, init, out):
    import torch.distributed as dist

    from fusec.backends.cute.plan import NO_EVENT, ScopeCode
    from fusec.backends.cute.runtime import MegakernelTimeout
    _join(rank, init)
    step = fusec.compile("models/llama.py", "tiny", backend="cute", device="cuda", batch=1, max_len=L,
                         seed=SEED, ranks=R)
    run, k = step.runner, step.runner.kernel
    tok, pos = _inputs(step.vocab, 1)[0]
    run.run(tok.cuda(), pos.cuda(), kernel=k)          # a direct launch, checked at once: warm
    if rank == 1:
        rows = list(k.plan.tasks)
        i = next(i for i, t in enumerate(rows) if t.signal_scope == ScopeCode.SYS and t.signal_peer != 0)
        rows[i] = dataclasses.replace(rows[i], signal_event=NO_EVENT, signal_peer=0, signal_scope=0)
        k.set_tasks(k.plan.with_tasks(rows))
    dist.barrier()
    t0, err = time.perf_counter(), None
    try:
        run.run(tok.cuda(), pos.cuda(), kernel=k)
    except MegakernelTimeout as e:
        err = str(e)
    torch.save((err, time.perf_counter() - t0), f"{out}.{rank}")
    dist.destroy_process_group()


def test_missing_remote_signal_names_rank_task_and_event_within_a_second(tmp_path):
    outs = _spawn(_missing_signal_worker, tmp_path)
    err, took = outs[0]
    assert err is not None, "rank 0 finished a step whose peer signal was dropped"
    assert __import__("re").match(r"rank 0: megakernel wait timed out: task \d+ .* event \d+", err), err
    assert took < 1.0, took
