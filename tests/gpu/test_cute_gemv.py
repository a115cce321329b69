"""GPU tests of the CuTe megakernel (marked gpu; skipped without CUDA or nvidia-cutlass-dsl).

Small shapes: correctness of each body vs torch, a dependent chain over consecutive steps with
monotonic counters, and the bounded wait. Timing lives in benchmarks/gemv_megakernel.py.
"""
import dataclasses

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

from fusec.testing import cute_workloads as wl  # noqa: E402
from fusec.backends.cute.plan import F32Flag, KernelPlan, Opcode, round_robin_queues  # noqa: E402
from fusec.backends.cute.runtime import Megakernel, MegakernelTimeout  # noqa: E402

BF = torch.bfloat16


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(BF)


# Dispatch-loop fields over the default (lean_dispatch on since stop 27): the loop before it, and
# stop 27's spin_first (poll, then prefetch) / spin_err_every (error flag on every n-th poll) /
# signal_tid (warp 1 releases the row's event) / lean_row_smem (the bodies' words from shared memory).
DISPATCH = {"default": {}, "not_lean": {"lean_dispatch": False},
            "spin_first": {"spin_first": True, "spin_err_every": 16},
            "spin_first_not_lean": {"spin_first": True, "lean_dispatch": False},
            "signal_warp1": {"signal_tid": 32}, "row_smem": {"lean_row_smem": True},
            "all": {"spin_first": True, "spin_err_every": 16, "signal_tid": 32, "lean_row_smem": True}}


@pytest.mark.parametrize("batch,dispatch", [(1, "default"), (4, "default"), (16, "default"), (1, "not_lean"),
                                            (16, "not_lean"), (1, "spin_first"), (16, "spin_first"),
                                            (4, "spin_first_not_lean"), (1, "signal_warp1"), (16, "row_smem"), (4, "all"),
                                            (16, "all")])
def test_gemv_bodies_and_chain(batch, dispatch):
    """(dispatch: the KernelPlan fields of the loop between rows, DISPATCH.)"""
    w, x, y = _rand(300, 1280, scale=0.05), _rand(batch, 1280), torch.empty(batch, 304, device="cuda", dtype=BF)
    wq, sc = wl.random_mxfp4(200, 1024, "cuda")
    x2, y2 = _rand(batch, 1024), torch.empty(batch, 200, device="cuda", dtype=BF)
    wa, h, hn = _rand(512, 1024, scale=0.05), torch.empty(batch, 512, device="cuda", dtype=BF), \
        torch.empty(batch, 512, device="cuda", dtype=BF)
    gamma, wc = _rand(512), _rand(256, 512, scale=0.05)
    yc = torch.empty(batch, 256, device="cuda", dtype=BF)
    tasks = wl.gemv_tasks(w, x, y[:, :300], 7, 0)
    tasks += wl.gemv_tasks(wq, x2, y2, 5, 100, opcode=Opcode.GEMV_MXFP4, scales=sc)
    tasks += wl.gemv_tasks(wa, x2, h, 8, 200, signal=0)
    tasks.append(wl.rmsnorm_task(h, gamma, hn, 1e-6, 300, wait=(0, 8, 0), signal=1))
    tasks += wl.gemv_tasks(wc, hn, yc, 6, 400, wait=(1, 1, 0))
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 16), num_events=2,
                      batch=batch, threads=256, rows_per_warp=2, **DISPATCH[dispatch],
                      name=f"t_b{batch}_{dispatch}")
    rt = Megakernel(plan)
    for step in (1, 2):
        x.copy_(_rand(batch, 1280))
        x2.copy_(_rand(batch, 1024))
        for t in (y, y2, h, hn, yc):
            t.fill_(float("nan"))
        rt.step()
        rt.check()
        assert wl.rel_err(y[:, :300], x.float() @ w.float().T) < 2e-2
        assert wl.rel_err(y2, x2.float() @ wl.dequant_mxfp4(wq, sc).T) < 2e-2
        h_ref = (x2.float() @ wa.float().T).to(BF)
        hn_ref = wl.rmsnorm_ref(h_ref, gamma, 1e-6).to(BF)
        assert wl.rel_err(hn, hn_ref) < 2e-2
        assert wl.rel_err(yc, hn_ref.float() @ wc.float().T) < 2e-2
        assert rt.events.tolist() == [8 * step, step]


@pytest.mark.parametrize("dispatch", ["default", "not_lean", "spin_first", "all"])
def test_missing_signal_raises(dispatch):
    x, w = _rand(1, 256), _rand(8, 256)
    y = torch.empty(1, 8, device="cuda", dtype=BF)
    tasks = wl.gemv_tasks(w, x, y, 1, 7, wait=(1, 1, 0))
    plan = KernelPlan(tasks=tuple(tasks), queues=((0,), ()), num_events=2, threads=128,
                      spin_timeout_ns=50_000_000, **DISPATCH[dispatch], name=f"t_dead_{dispatch}")
    rt = Megakernel(plan)
    rt.step()
    with pytest.raises(MegakernelTimeout, match="task 7 .* event 1 for counter >= 1 but saw 0"):
        rt.check()
    # A launch after the unreset error runs nothing.
    y.fill_(7.0)
    rt.step()
    torch.cuda.synchronize()
    assert (y == 7.0).all()


def test_graph_replay_advances_steps():
    x, w = _rand(1, 512), _rand(64, 512, scale=0.05)
    y = torch.empty(1, 64, device="cuda", dtype=BF)
    tasks = wl.gemv_tasks(w, x, y, 4, 0, signal=0)
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(4, 4), num_events=1,
                      threads=128, name="t_graph")
    rt = Megakernel(plan)
    g = rt.capture_graph()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    rt.check()
    assert rt.step_buf.item() == 3 and rt.events.item() == 12
    assert wl.rel_err(y, x.float() @ w.float().T) < 2e-2
    assert dataclasses.replace(plan).num_ctas == 4



def _gemv_cases(batch, cases, f32_case):
    """Weights, inputs, NaN-filled outputs and GEMV_BF16 rows of `cases` [(rows, K, tasks)];
    case `f32_case` writes fp32 (F32Flag.OUT), the others bf16."""
    ws = [_rand(n, k, scale=0.05) for n, k, _ in cases]
    xs = [_rand(batch, k) for _, k, _ in cases]
    ys = [torch.full((batch, n), float("nan"), device="cuda", dtype=torch.float32 if i == f32_case else BF)
          for i, (n, _, _) in enumerate(cases)]
    tasks, tid = [], 0
    for (n, k, parts), w, x, y in zip(cases, ws, xs, ys):
        rows = wl.gemv_tasks(w, x, y, parts, tid)
        if y.dtype == torch.float32:
            rows = [dataclasses.replace(r, p1=int(F32Flag.OUT)) for r in rows]
        tasks += rows
        tid += parts
    return ws, xs, ys, tasks


def _step_and_check(plan, ws, xs, ys):
    rt = Megakernel(plan)
    rt.step()
    rt.check()
    for w, x, y in zip(ws, xs, ys):
        assert wl.rel_err(y, x.float() @ w.float().T) < 2e-2, (y.shape, y.dtype)


@pytest.mark.parametrize("batch", [2, 9, 16])
def test_gemv_mma_shapes(batch):
    """The tensor-core GEMV_BF16 body on awkward shapes: long K split inside the CTA (7168), K of
    three 32-column chunks (96), row counts that leave partial tiles, many units per task, one
    empty task; bf16 and fp32 outputs."""
    # (1240, 512, 1): one task of 39 32-row units, more than one round of the warps (split-K
    # body, B > 8); (376, 1024, 1): 12 units on 16 warps (the K3 step's 7168-column shapes).
    ws, xs, ys, tasks = _gemv_cases(batch, [(200, 7168, 3), (37, 96, 2), (129, 1280, 5), (1240, 512, 1),
                                            (376, 1024, 1)], 1)
    tasks.append(dataclasses.replace(tasks[0], task_id=len(tasks), n0=5, n1=5))   # empty: stores nothing
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 6), num_events=1,
                      batch=batch, gemv="mma", name=f"t_mma_b{batch}")
    _step_and_check(plan, ws, xs, ys)


@pytest.mark.parametrize("batch", [4, 16])
def test_gemv_mma_tiled_weights(batch):
    """KernelPlan.gemv_tiles: weights repacked into 16-row tiles (weight_tiles.tile) and rows
    flagged GEMV_TILED, on the grouped (B = 4) and split-K (B = 16) bodies; unaligned row cuts
    (tiles shared by two tasks), one task of many units, and one row-major weight among tiled
    ones in the same kernel."""
    from fusec.backends.cute.plan import GEMV_TILED
    from fusec.backends.cute.weight_tiles import tile

    cases = [(208, 7168, 3), (48, 96, 2), (1248, 512, 1), (384, 1024, 5), (40, 256, 2)]
    ws, xs, ys, tasks = _gemv_cases(batch, cases, 1)
    tiled = [n % 16 == 0 for n, _, _ in cases]
    tiled[-1] = False                     # (40, 256): whole tiles would need 48 rows; stays row-major
    refs = [w.clone() for w in ws]
    for w, t in zip(ws, tiled):
        if t:
            w.copy_(tile(w))
    flag = {w.data_ptr(): t for w, t in zip(ws, tiled)}
    tasks = [dataclasses.replace(r, p1=r.p1 | GEMV_TILED) if flag[r.a0] else r for r in tasks]
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 6), num_events=1,
                      batch=batch, gemv="mma", gemv_tiles=True, name=f"t_tiles_b{batch}")
    _step_and_check(plan, refs, xs, ys)


@pytest.mark.parametrize("batch,rows_per_warp", [(1, 1), (1, 2), (4, 1)])
def test_gemv_simt_shapes(batch, rows_per_warp):
    """The CUDA-core GEMV_BF16 body on K of fewer than 32 vectors per row (8, 40, 128: several
    rows per warp load, shuffles inside a row's lanes), K with a rest past the unrolled loop
    (512, 1544), row counts that leave partial groups; bf16 and fp32 outputs."""
    ws, xs, ys, tasks = _gemv_cases(batch, [(70, 8, 2), (33, 40, 1), (1300, 128, 3), (150, 512, 2), (90, 1544, 3)], 2)
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 5), num_events=1, batch=batch,
                      threads=256, gemv="simt", rows_per_warp=rows_per_warp, name=f"t_simt_b{batch}_r{rows_per_warp}")
    _step_and_check(plan, ws, xs, ys)
