"""GPU tests of the Kimi K3 task bodies (EXPERT_BF16/MXFP4, EW sub-opcodes, ROUTER) against the
fusec op registry's reference (marked gpu; skipped without CUDA or nvidia-cutlass-dsl).

Small shapes, one kernel per batch size; the expected values come from
`get_op(name).ref(...)`, never from the kernel. Timing lives in benchmarks/cute_bodies.py.
"""
import dataclasses

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

from fusec.testing import cute_workloads as wl  # noqa: E402
from fusec.backends.cute.plan import (ArgmaxMode, EwOp, F32Flag, KernelPlan, Opcode, TaskRow,  # noqa: E402
                                      round_robin_queues)
from fusec.ir.ops.core import argmax_chunk  # noqa: E402
from fusec.backends.cute.runtime import Megakernel  # noqa: E402
from fusec.ir.quant import MXFP4Tensor  # noqa: E402
from fusec.ir.registry import get_op  # noqa: E402

BF = torch.bfloat16


def ref(name, args, **attrs):
    return get_op(name).ref(list(args), attrs)


@pytest.mark.parametrize("batch,stream,cols,tiles,cut", [
    (1, "regs", 8, False, False), (4, "regs", 8, False, False), (16, "regs", 8, False, False),
    (16, "regs", 16, False, False), (1, "regs", 8, True, False), (4, "regs", 8, True, False),
    (16, "regs", 8, True, False), (1, "regs", 8, True, True), (16, "regs", 8, True, True),
    (16, "regs", 16, True, True), (16, "regs", 8, True, "whole"), (1, "regs", 8, True, "pack"),
    (4, "regs", 8, True, "pack"), (16, "regs", 8, True, "pack"),
    (1, "ring", 8, False, False), (4, "ring", 8, False, False), (16, "ring", 8, False, False)])
def test_k3_bodies_match_registry(batch, stream, cols, tiles, cut):
    """`stream`: EXPERT_BF16's weight streaming (KernelPlan.expert_stream); `cols`: its group
    width (KernelPlan.expert_cols); `tiles`: its weights in 16-row tiles (expert_tiles; the
    references use the row-major weights) and EXPERT_MXFP4 on tensor cores over MXFP4 tiles
    (expert_mx_mma; its scale bytes capped at 128, the body's domain). `cut`: the expert rows
    cut into tasks whose last 16-row unit has at most 8 live rows (6 GLU tasks of 21-22 rows,
    5 DOWN tasks of 51-52), where the MXFP4 tensor-core body runs the short last units as two K
    halves (expert_half_units, on by default), or "whole": that cut without it, or "pack": that
    cut with expert_mx_half_pack (a half unit of a group of at most 4 pairs as one MMA per k16
    step: every group at B = 1, most at B = 4, few at B = 16), at twice the intermediate width
    so that the DOWN rows have half units too (12 GLU tasks of 21-22 rows, DOWN K = 256). 64 pairs over 8
    experts at B = 16: experts chosen by more pairs than a group holds take several groups. With
    tiles the expert weights load under the L2 evict_first policy, as the runner builds them
    (KernelPlan.weight_evict_first); without, plainly. The cut cases (cut is True) run the
    ROUTER with its stop-29/30 fields on (KernelPlan.router_late_scores, router_compact)."""
    from fusec.backends.cute.weight_tiles import mx_tile, tile

    gen = torch.Generator(device="cuda").manual_seed(batch)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    e, d, inter, k = 8, 256, 256 if cut == "pack" else 128, 4
    # Router: 40 experts, top 4, one expert forced to the top by its bias.
    logits, bias = r(batch, 40), (0.1 * r(40)).float()
    bias[7] = 10.0
    rw, rid = torch.full((batch, k), float("nan"), device="cuda"), torch.full((batch, k), -7, device="cuda",
                                                                              dtype=torch.int32)
    tasks = wl.router_tasks(logits, bias, rw, rid, 1.5, 0)
    # Experts; the last batch row routes slot 1 to "another rank" (-1): its h row must be zero.
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(batch)]).int()
    ids[-1, 1] = -1
    x, cw = r(batch, d).to(BF), torch.rand(batch, k, device="cuda", generator=gen)
    w1, w3, w2 = ((r(*s) * 0.05).to(BF) for s in ((e, inter, d), (e, inter, d), (e, d, inter)))
    q = [MXFP4Tensor(*(t.view(e, n, -1) for t in wl.random_mxfp4(e * n, kk, "cuda", gen)))
         for n, kk in ((inter, d), (inter, d), (d, inter))]
    if tiles:
        for t in q:
            t.scale.clamp_(max=128)
    qt = [MXFP4Tensor(*(a.view(t.packed.shape if i == 0 else t.scale.shape) for i, a in enumerate(
        mx_tile(t.packed.reshape(-1, t.packed.shape[-1]), t.scale.reshape(-1, t.scale.shape[-1])))))
          for t in q] if tiles else q
    hin = r(batch, k, inter).to(BF)
    outs = []
    wt = [tile(w.reshape(-1, w.shape[-1])).view(w.shape) if tiles else w for w in (w1, w3, w2)]
    for i, ((a1, a3, a2), (t1, t3, t2)) in enumerate(zip(((w1, w3, w2), q), (wt, qt))):
        h = torch.full((batch, k, inter), float("nan"), device="cuda", dtype=BF)
        y = torch.full((batch, k, d), float("nan"), device="cuda")
        tasks += wl.expert_glu_tasks(x, ids, t1, t3, h, 12 if cut == "pack" else 6 if cut else 3, 100 + 100 * i)
        tasks += wl.expert_down_tasks(hin, ids, t2, y, 5 if cut else 2, 150 + 100 * i)
        outs.append((h, y, a1, a3, a2))
    # moe_combine (EW WSUM) on its own input: the 16-byte path (fp32 slots, aligned) and an
    # unaligned view of the same slots (the scalar path).
    yin, comb = r(batch, k, d), torch.full((batch, d), float("nan"), device="cuda")
    comb_u = torch.full((batch, d), float("nan"), device="cuda")
    tasks += [wl.wsum_task(yin, cw, comb, 390), wl.wsum_task(yin[:, :, 1:], cw, comb_u[:, 1:], 391)]
    # EW: residual add, a per-head L2 norm and the in-place conv update.
    a, b = r(batch, 256).to(BF), r(batch, 256).to(BF)
    add_o, l2_o, cy = (torch.full((batch, 256), float("nan"), device="cuda", dtype=BF) for _ in range(3))
    cst = r(batch, 256, 3).to(BF)
    cst0, cwt = cst.clone(), r(256, 1, 4).float()
    tasks += [wl.ew_task(EwOp.ADD, a, add_o, 400, b=b),
              wl.ew_task(EwOp.L2_NORM, a, l2_o, 401, head_dim=64, scale=0.125, eps=1e-6),
              wl.ew_task(EwOp.CONV, a, cy, 402, b=cst, c=cwt)]
    # KDA gate (A_log per head of 64, dt_bias per channel) and a wide conv whose elements take
    # several rounds of the CTA's threads (the unrolled paths' tails).
    a_log, dt_bias = (0.5 * r(4)).float(), (0.5 * r(256)).float()
    gate_o = torch.full((batch, 256), float("nan"), device="cuda")
    wa = r(batch, 1200).to(BF)
    wst, wcw = r(batch, 1200, 3).to(BF), r(1200, 1, 4).float()
    wst0, wy = wst.clone(), torch.full((batch, 1200), float("nan"), device="cuda", dtype=BF)
    tasks += [wl.ew_task(EwOp.KDA_GATE, a, gate_o, 405, b=dt_bias, c=a_log, head_dim=64),
              wl.ew_task(EwOp.CONV, wa, wy, 406, b=wst, c=wcw)]
    # EW RMS of a long fp32 row (K3's latent rms_norm, 3584 wide): the vectorised all-warps path,
    # and an unaligned 3583-wide view of the same rows (the CTA-per-row fallback).
    xl, gl = r(batch, 3584) * 3.0, (1 + 0.1 * r(3584)).to(BF)
    rms_o, rms_u = (torch.full((batch, 3584), float("nan"), device="cuda", dtype=BF) for _ in range(2))
    tasks += [wl.ew_task(EwOp.RMS, xl, rms_o, 403, c=gl, head_dim=3584, eps=1e-6),
              wl.ew_task(EwOp.RMS, xl[:, 1:], rms_u[:, 1:], 404, c=gl[1:], head_dim=3583, eps=1e-6)]
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 16), num_events=1,
                      batch=batch, threads=256, expert_stream=stream, expert_cols=cols,
                      expert_tiles=tiles, expert_mx_mma=tiles, expert_half_units=cut != "whole",
                      weight_evict_first="experts" if tiles else "",    # the runner's default on tiles
                      router_late_scores=cut is True, router_compact=4 if cut is True else 0,
                      expert_mx_half_pack=cut == "pack",
                      name=f"k3b_b{batch}_{stream}_{cols}{'_tiles' if tiles else ''}{'_cut' if cut else ''}"
                           f"{'_' + cut if isinstance(cut, str) else ''}")
    rt = Megakernel(plan)
    rt.step()
    rt.check()
    w_ref, id_ref = ref("router", (logits, bias), topk=k, scale=1.5)
    assert torch.equal(rid, id_ref) and (rid[:, 0] == 7).all()
    assert wl.rel_err(rw, w_ref) < 1e-4
    for h, y, a1, a3, a2 in outs:
        assert wl.rel_err(h, ref("moe_gate_up", (x, ids, a1, a3), ep_ranks=1)[0]) < 2e-2
        assert bool((h[-1, 1] == 0).all())
        y_ref = ref("moe_down", (hin, ids, a2), ep_ranks=1)[0]
        assert wl.rel_err(y, y_ref) < 2e-2
        assert bool((y[-1, 1] == 0).all())                    # the other rank's expert: zero
    assert wl.rel_err(comb, ref("moe_combine", (yin, cw))[0]) < 1e-5
    assert wl.rel_err(comb_u[:, 1:], ref("moe_combine", (yin[:, :, 1:], cw))[0]) < 1e-5
    assert wl.rel_err(add_o, ref("add", (a, b), out_dtype="")[0]) < 2e-2
    assert wl.rel_err(l2_o, ref("l2_norm", (a,), head_dim=64, scale=0.125, eps=1e-6)[0]) < 2e-2
    c_y, c_state = ref("conv_update", (a, cst0, cwt))
    assert wl.rel_err(cy, c_y) < 2e-2
    assert torch.equal(cst.float(), c_state)  # the shifted window is exact
    g_ref = ref("kda_gate", (a, a_log, dt_bias), heads=4, head_dim=64, a_log_broadcast="head")[0]
    assert wl.rel_err(gate_o, g_ref) < 1e-4
    w_y, w_state = ref("conv_update", (wa, wst0, wcw))
    assert wl.rel_err(wy, w_y) < 2e-2
    assert torch.equal(wst.float(), w_state)
    assert wl.rel_err(rms_o, ref("rms_norm", (xl, gl), eps=1e-6, out_dtype="bf16")[0]) < 1e-2
    assert wl.rel_err(rms_u[:, 1:], ref("rms_norm", (xl[:, 1:], gl[1:]), eps=1e-6, out_dtype="bf16")[0]) < 1e-2
    assert Opcode.ROUTER in plan.opcodes


@pytest.mark.parametrize("state_ef", [False, True])   # KernelPlan.kda_state_evict_first
def test_kda_attn_res_append_match_registry(state_ef):
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    batch, heads, hd, hid = 2, 3, 64, 320
    q, k = (torch.nn.functional.normalize(r(batch, heads, hd), dim=-1).flatten(1).to(BF) for _ in range(2))
    v, g = r(batch, heads * hd).to(BF), -torch.rand(batch, heads * hd, device="cuda", generator=gen)
    beta = torch.rand(batch, heads, device="cuda", generator=gen).to(BF)
    st = 0.1 * r(batch, heads, hd, hd)
    st0, o = st.clone(), torch.full((batch, heads * hd), float("nan"), device="cuda")
    srcs = r(5, batch, hid).to(BF)
    nw, pw, gam = (1 + 0.1 * r(hid)).to(BF), (0.05 * r(1, hid)).to(BF), (1 + 0.1 * r(hid)).to(BF)
    h, y = (torch.full((batch, hid), float("nan"), device="cuda", dtype=BF) for _ in range(2))
    cache = r(batch, 16, 64).to(BF)
    cache0, row = cache.clone(), r(batch, 64).to(BF)
    pos = torch.tensor([5, 15][:batch], device="cuda", dtype=torch.int32)
    tasks = wl.kda_tasks(q, k, v, g, beta, st, o, 2, 0)
    # The sources as separate allocations (the body reads them in place through its table).
    srcs = [s.clone() for s in srcs]
    ptrs = torch.zeros(len(srcs), dtype=torch.int64, device="cuda")
    tasks += wl.attn_res_tasks(srcs, nw, pw, gam, h, y, 1e-5, 1e-6, 10, ptrs=ptrs)
    tasks.append(wl.ew_task(EwOp.APPEND, row, cache, 20, b=cache, c=pos))
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 8), num_events=1,
                      batch=batch, threads=256, kda_state_evict_first=state_ef, name=f"k3b_kda{'_ef' * state_ef}")
    rt = Megakernel(plan)
    rt.step()
    rt.check()
    o_ref, st_ref = ref("kda_recurrent", (q, k, v, g, beta, st0), heads=heads, head_dim=hd)
    assert wl.rel_err(o, o_ref) < 2e-2 and wl.rel_err(st, st_ref) < 1e-4
    h_ref = ref("attn_res", (nw, pw, *srcs), eps=1e-5)[0]
    assert wl.rel_err(h, h_ref) < 2e-2
    assert wl.rel_err(y, ref("rms_norm", (h_ref.to(BF), gam), eps=1e-6, out_dtype="")[0]) < 2e-2
    assert torch.equal(cache, ref("cache_append", (cache0, row, pos))[0])


# KernelPlan.ew_unroll (8: the default) and ew_fast_div (the rows' element indices divided by a
# magic multiply: the batch-row ranges here exercise it)
@pytest.mark.parametrize("ew_unroll,fast_div", [(8, False), (4, False), (2, False), (8, True)])
def test_kda_family_over_batch_rows_matches_registry(ew_unroll, fast_div):
    """A KDA family cut over (head, batch rows), as the tile pass cuts it at batch > 1
    (OpDef.split_rows): per task, on one CTA, one KDA row per batch row of its range (item
    b * H + h), then the gated norm of that head over those rows only (EW GATED_RMS, batch rows
    in K). Also EW ADD and long fp32 EW RMS rows (the vectorised and the CTA-per-row paths) over
    part of the batch. One (head, rows) task is left out (its KDA output holds 1.0, which a gated
    norm run on every row would turn into numbers) and rows outside each EW row's range are never
    written: they stay NaN (state: as it was), so every path honours the K word."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    nan = lambda *s, dtype=torch.float32: torch.full(s, float("nan"), device="cuda", dtype=dtype)  # noqa: E731
    batch, heads, hd = 4, 3, 128
    q, k = (torch.nn.functional.normalize(r(batch, heads, hd), dim=-1).flatten(1).to(BF) for _ in range(2))
    v, g = r(batch, heads * hd).to(BF), -torch.rand(batch, heads * hd, device="cuda", generator=gen)
    beta = torch.rand(batch, heads, device="cuda", generator=gen).to(BF)
    st = 0.1 * r(batch, heads, hd, hd)
    st0, o, y = st.clone(), nan(batch, heads * hd), nan(batch, heads * hd, dtype=BF)
    gate, w = r(batch, heads * hd).to(BF), 1 + 0.1 * r(hd)
    kda = wl.kda_tasks(q, k, v, g, beta, st, o, 1)              # row b * heads + h: item (b, h)
    left_out = (0, (3, 4))                                      # head 0, batch row 3: no task
    o[3, :hd] = 1.0
    tasks, queues = [], []
    for h in range(heads):
        for b0, b1 in ((0, 1), (1, 3), (3, 4)):
            if (h, (b0, b1)) == left_out:
                continue
            first = len(tasks)
            tasks += [kda[b * heads + h] for b in range(b0, b1)]
            tasks.append(wl.ew_task(EwOp.GATED_RMS, o, y, 100 + h, b=gate, c=w, head_dim=hd, eps=1e-5,
                                    cols=(h * hd, (h + 1) * hd), rows=(b0, b1)))
            queues.append(tuple(range(first, len(tasks))))
    a, b = r(batch, 256).to(BF), r(batch, 256).to(BF)
    xl, gl = r(batch, 3584) * 3.0, (1 + 0.1 * r(3584)).to(BF)
    add_o, rms_o, rms_u = nan(batch, 256, dtype=BF), nan(batch, 3584, dtype=BF), nan(batch, 3584, dtype=BF)
    tasks += [wl.ew_task(EwOp.ADD, a, add_o, 200, b=b, rows=(1, 3)),
              wl.ew_task(EwOp.RMS, xl, rms_o, 201, c=gl, head_dim=3584, eps=1e-6, rows=(2, 4)),
              wl.ew_task(EwOp.RMS, xl[:, 1:], rms_u[:, 1:], 202, c=gl[1:], head_dim=3583, eps=1e-6, rows=(0, 2))]
    queues += [(len(tasks) - 3,), (len(tasks) - 2,), (len(tasks) - 1,)]
    plan = KernelPlan(tasks=tuple(tasks), queues=tuple(queues), num_events=1, batch=batch, threads=256,
                      ew_unroll=ew_unroll, ew_fast_div=fast_div, name=f"k3b_kda_rows_ew{ew_unroll}{'f' * fast_div}")
    rt = Megakernel(plan)
    rt.step()
    rt.check()
    o_ref, st_ref = ref("kda_recurrent", (q, k, v, g, beta, st0), heads=heads, head_dim=hd)
    y_ref = ref("gated_rms_norm", (o_ref, gate, w), head_dim=hd, eps=1e-5)[0]
    done = torch.ones(batch, heads, dtype=torch.bool, device="cuda")
    done[3, 0] = False
    cols = done.repeat_interleave(hd, 1)
    assert wl.rel_err(o[cols], o_ref[cols]) < 2e-2 and wl.rel_err(st[done], st_ref[done]) < 1e-4
    assert wl.rel_err(y[cols], y_ref[cols]) < 2e-2
    assert (o[~cols] == 1.0).all() and y[~cols].isnan().all() and torch.equal(st[~done], st0[~done])
    assert wl.rel_err(add_o[1:3], ref("add", (a[1:3], b[1:3]), out_dtype="")[0]) < 2e-2
    assert add_o[0].isnan().all() and add_o[3].isnan().all()
    rms_ref = ref("rms_norm", (xl, gl), eps=1e-6, out_dtype="bf16")[0]
    assert wl.rel_err(rms_o[2:], rms_ref[2:]) < 1e-2 and rms_o[:2].isnan().all()
    rms_uref = ref("rms_norm", (xl[:, 1:], gl[1:]), eps=1e-6, out_dtype="bf16")[0]
    assert wl.rel_err(rms_u[:2, 1:], rms_uref[:2]) < 1e-2 and rms_u[2:].isnan().all()



@pytest.mark.parametrize("batch", [1, 3, 16])
def test_norm_rows_parallel_matches_registry(batch):
    """KernelPlan.norm_rows_parallel: the RMSNORM body's rows at once (NUM_WARPS // rows warps a
    row; 7168, 1536 and an odd 520 wide, every row and a subset) and the EW fp32 RMS path's
    unrolled passes with their 8-byte bf16 weight loads and output stores (3584 wide, 2 heads of
    1024 over part of the rows, and an fp32 output: the scalar store loop). Each output against
    the registry's rms_norm; with the field off and on the same plan gives the same bits for EW,
    and for RMSNORM at batch 1 (the same order of sums); rows outside a task stay NaN."""
    gen = torch.Generator(device="cuda").manual_seed(35 + batch)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    nan = lambda *s, dtype=BF: torch.full(s, float("nan"), device="cuda", dtype=dtype)  # noqa: E731
    sub = (1, batch) if batch > 1 else (0, 1)
    cases, outs = [], []
    for i, k in enumerate((7168, 1536, 520)):
        x, g = (r(batch, k) * 2).to(BF), (1 + 0.1 * r(k)).to(BF)
        o, o_sub = nan(batch, k), nan(batch, k)
        cases += [("rmsnorm", x, g, o, None, (0, batch)), ("rmsnorm", x, g, o_sub, None, sub)]
        outs += [wl.rmsnorm_task(x, g, o, 1e-6, 10 + 2 * i),
                 dataclasses.replace(wl.rmsnorm_task(x, g, o_sub, 1e-6, 11 + 2 * i), n0=sub[0], n1=sub[1])]
    xl, gl, g2 = r(batch, 3584) * 3.0, (1 + 0.1 * r(3584)).to(BF), (1 + 0.1 * r(1024)).to(BF)
    x2 = r(batch, 2048) * 3.0
    rms_o, rms_f, rms_2 = nan(batch, 3584), nan(batch, 3584, dtype=torch.float32), nan(batch, 2048)
    cases += [("ew", xl, gl, rms_o, 3584, (0, batch)), ("ew", xl, gl, rms_f, 3584, (0, batch)),
              ("ew", x2, g2, rms_2, 1024, sub)]
    outs += [wl.ew_task(EwOp.RMS, xl, rms_o, 20, c=gl, head_dim=3584, eps=1e-6),
             wl.ew_task(EwOp.RMS, xl, rms_f, 21, c=gl, head_dim=3584, eps=1e-6),
             wl.ew_task(EwOp.RMS, x2, rms_2, 22, c=g2, head_dim=1024, eps=1e-6, rows=sub)]
    got = {}
    for on in (False, True):
        for _, _, _, o, _, _ in cases:
            o.fill_(float("nan"))
        plan = KernelPlan(tasks=tuple(outs), queues=round_robin_queues(len(outs), 16), num_events=1,
                          batch=batch, threads=512, norm_rows_parallel=on, ew_unroll=4,
                          name=f"k3b_norm_rows_b{batch}{'_par' if on else ''}")
        rt = Megakernel(plan)
        rt.step()
        rt.check()
        got[on] = [o.clone() for _, _, _, o, _, _ in cases]
    for (kind, x, g, _, hd, (b0, b1)), off, o in zip(cases, got[False], got[True]):
        if kind == "rmsnorm":
            want = ref("rms_norm", (x[b0:b1], g), eps=1e-6, out_dtype="")[0]
        else:
            want = ref("rms_norm", (x[b0:b1].view(b1 - b0, -1, hd), g), eps=1e-6,
                       out_dtype="bf16")[0].view(b1 - b0, -1)
        assert wl.rel_err(o[b0:b1].float(), want.float()) < 1e-2, (kind, x.shape, o.dtype)
        assert o[:b0].isnan().all() and o[b1:].isnan().all()
        if kind == "ew" or batch == 1:
            assert torch.equal(o[b0:b1], off[b0:b1]), (kind, x.shape, o.dtype)
        else:
            assert wl.rel_err(o[b0:b1].float(), off[b0:b1].float()) < 1e-2

# (batch, heads, cache rows, chunks): chunks past pos stay empty; 52 and 96 heads take two
# blocks of the tensor-core body (one partly padded); 50-row chunks take two shared-memory stages.
# 40 chunks: more than a warp's lanes (the combine's weights per chunk); 200: more than one
# round of mla_combine_weights_once's 4 chunks per lane. combine: the COMBINE's plan fields, "cta"
# the default, "pairs" KernelPlan.mla_combine_pairs (its online weights meet empty chunks after
# a full one at 40), "once" mla_combine_weights_once with 16 rows in flight per thread;
# "cache_ef": the default combine, the partials' cache copies under mla_cache_evict_first;
# "unrolled": the default combine, the PARTIAL with mla_unrolled and blocks of 3 head tiles;
# "ssplit": with mla_s_split too (5 planes of partial scores; 8 at 2 tiles); "wgmma": the PARTIAL on
# wgmma (KernelPlan.mla_wgmma, 512 threads: 8 heads and 52 take one padded 64-head block); "wgmma_k":
# with S split over K between the warpgroups (mla_wgmma_ksplit); "wgmma_k3": and a three-stage ring
# (mla_wgmma_stages; 70 rows: 3 stages, the last partial).
COMBINES = {"cta": {}, "pairs": {"mla_combine_pairs": True},
            "once": {"mla_combine_weights_once": True, "mla_combine_unroll": 16},
            "cache_ef": {"mla_cache_evict_first": True},
            "unrolled": {"mla_unrolled": True, "mla_head_tiles": 3},
            "ssplit": {"mla_unrolled": True, "mla_head_tiles": 3, "mla_s_split": True},
            "ssplit2": {"mla_head_tiles": 2, "mla_s_split": True},
            "wgmma": {"mla_wgmma": True}, "wgmma_k": {"mla_wgmma": True, "mla_wgmma_ksplit": True},
            "wgmma_k3": {"mla_wgmma": True, "mla_wgmma_ksplit": True, "mla_wgmma_stages": 3}}


@pytest.mark.parametrize("combine", list(COMBINES))
@pytest.mark.parametrize("batch,h,length,chunks", [(1, 8, 40, 4), (4, 52, 100, 2), (16, 96, 70, 3), (1, 8, 1400, 40),
                                                   (1, 8, 6400, 200)])
def test_mla_split_sequence_matches_registry(batch, h, length, chunks, combine):
    """Partials per chunk, then the combine waits on them."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    lora, rope = 512, 64
    q_lat, q_pe = (r(batch, h, lora) * 0.05).to(BF), (r(batch, h, rope) * 0.1).to(BF)
    cache = r(batch, length, lora + rope).to(BF)
    pos = torch.tensor([25, 3, 39, 0], device="cuda", dtype=torch.int32).repeat(4)[:batch] * length // 40
    parts = torch.full((chunks, batch, h, lora + 2), float("nan"), device="cuda")
    out = torch.full((batch, h, lora), float("nan"), device="cuda", dtype=BF)   # bf16 like the IR's o_lat
    at = dict(heads=h, nope=128, rope=rope, kv_lora=lora, v_dim=128, scale=0.07)
    part, comb = wl.mla_tasks(q_lat, q_pe, cache, pos, parts, out, 0.07, 0, signal=0)
    import dataclasses
    comb = [dataclasses.replace(t, wait_event=0, wait_per_step=len(part)) for t in comb]
    tasks = part + comb
    plan = KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), len(tasks)), num_events=1,
                      batch=batch, threads=512 if combine.startswith("wgmma") else 256, name=f"k3b_mla{batch}_{combine}",
                      **COMBINES[combine])
    rt = Megakernel(plan)
    rt.step()
    rt.check()
    p_ref = ref("mla_attention_partial", (q_lat, q_pe, cache, pos), chunks=chunks, **at)[0]
    assert torch.equal(torch.isinf(parts[..., lora]), torch.isinf(p_ref[..., lora]))  # empty chunks
    fin = torch.isfinite(p_ref[..., lora])
    assert wl.rel_err(parts[fin], p_ref[fin]) < 2e-2
    o_ref = ref("attention_combine", (p_ref,))[0]
    assert wl.rel_err(out, o_ref) < 2e-2
    assert wl.rel_err(out, ref("mla_attention", (q_lat, q_pe, cache, pos), **at)[0]) < 2e-2


@pytest.mark.parametrize("batch,dtype,vocab,chunks", [(1, "f32", 163840, 132), (16, "f32", 163840, 8),
                                                      (4, "bf16", 5000, 7)])
def test_argmax_split_matches_registry(batch, dtype, vocab, chunks):
    """ARGMAX PARTIAL over argmax_chunk's column ranges (one row per (chunk, batch rows)), then
    COMBINE per batch row, against the registry's argmax_partial (bit for bit: a max is exact)
    and the whole row's argmax; row 0 holds the max twice, in chunk 0 and the last chunk, and
    the lower column wins. (The combine runs as a second launch: the rows here have no events.)"""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, vocab, device="cuda", generator=gen).to(torch.float32 if dtype == "f32" else BF)
    x[0, 17] = x[0, vocab - 3] = 100.0
    parts = torch.full((chunks, batch, 2), float("nan"), device="cuda")
    out = torch.full((batch,), -1, dtype=torch.int32, device="cuda")
    es, fl = x.element_size(), int(F32Flag.A0) if dtype == "f32" else 0
    rows = []
    for c in range(chunks):
        lo, hi = argmax_chunk(vocab, chunks, c)
        rows.append(TaskRow(Opcode.ARGMAX, c, a0=x.data_ptr() + lo * es, a2=parts.data_ptr() + c * batch * 8,
                            n0=0, n1=batch, k=hi - lo, ldx=vocab, p0=lo, p1=fl, sub=ArgmaxMode.PARTIAL))
    comb = [TaskRow(Opcode.ARGMAX, chunks + b, a0=parts.data_ptr(), a2=out.data_ptr(), n0=b, n1=b + 1, k=chunks,
                    ldx=2 * batch, p1=int(F32Flag.A0), sub=ArgmaxMode.COMBINE) for b in range(batch)]
    for tasks in (rows, comb):
        rt = Megakernel(KernelPlan(tasks=tuple(tasks), queues=round_robin_queues(len(tasks), 16), num_events=1,
                                   batch=batch, threads=256, name="argmax_split"))
        rt.step()
        rt.check()
    assert torch.equal(parts, ref("argmax_partial", (x,), chunks=chunks)[0])
    assert torch.equal(out, x.float().argmax(-1).to(torch.int32)) and int(out[0]) == 17


@pytest.mark.parametrize("experts,topk,batch,bf16", [(896, 16, 1, False), (896, 16, 16, True), (128, 16, 4, False),
                                                      (40, 4, 3, True)])
def test_router_split_matches_registry(experts, topk, batch, bf16):
    """KernelPlan.router_split (the CTA per token, a two-round tournament) against the
    registry's router, and bit for bit against the warp-per-token body (with router_compact
    and router_late_scores, lower.py's defaults) in a second kernel: the same ids in the same
    order, the same weights. Ties: experts 3 and E / 2 with equal scores among the certain
    picks (3 must come first), and experts 1 and E - 1 with equal scores set midway between
    the (k-1)-th and k-th best of the others (1 must take the k-th pick, E - 1 none). One task
    per token, and a second set of outputs from one task over every token (the CTA takes its
    tokens one after another)."""
    gen = torch.Generator(device="cuda").manual_seed(experts + batch)
    logits = torch.randn(batch, experts, device="cuda", generator=gen)
    bias = (0.1 * torch.randn(experts, device="cuda", generator=gen)).float()
    lo, hi = 1, experts - 1
    bias[5] = 10.0                                           # a certain pick
    logits[:, experts // 2] = logits[:, 3]
    bias[3] = bias[experts // 2] = 5.0                       # two certain picks, equal scores
    bias[lo] = bias[hi] = 0.5
    s = torch.sigmoid(logits) + bias
    s[:, lo] = s[:, hi] = float("-inf")
    top = s.topk(topk, dim=1).values
    q = ((top[:, topk - 2] + top[:, topk - 1]) / 2 - 0.5).clamp(1e-3, 1 - 1e-3)
    logits[:, lo] = logits[:, hi] = torch.log(q / (1 - q))
    logits = logits.to(BF) if bf16 else logits
    outs = {}
    for split in (False, True):
        got = [(torch.full((batch, topk), float("nan"), device="cuda"),
                torch.full((batch, topk), -7, device="cuda", dtype=torch.int32)) for _ in range(2)]
        tasks = wl.router_tasks(logits, bias, *got[0], 1.5, 0)
        whole = dataclasses.replace(wl.router_tasks(logits, bias, *got[1], 1.5, batch)[0], n0=0, n1=batch)
        plan = KernelPlan(tasks=tuple(tasks) + (whole,), queues=(tuple(range(batch)), (batch,)),
                          num_events=1, batch=batch, router_split=split, router_compact=0 if split else 4,
                          router_late_scores=not split, name=f"router_b{batch}_{experts}_{int(split)}")
        rt = Megakernel(plan)
        rt.step()
        rt.check()
        outs[split] = got
    # the registry's scores and mix; the order of equal scores by the lower index (the kernel's
    # documented rule: torch.topk does not promise one), so a stable sort
    route, at = get_op("router").route, {"topk": topk, "scale": 1.5}
    sel = route.scores([logits, bias], at)
    id_ref = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk].to(torch.int32)
    w_ref = route.mix([logits, bias], at, id_ref.long())
    assert (id_ref[:, :3] == torch.tensor([5, 3, experts // 2], device="cuda", dtype=torch.int32)).all()
    for (w, ids) in outs[True]:
        assert torch.equal(ids, id_ref), (ids, id_ref)
        assert wl.rel_err(w, w_ref) < 1e-4
    for (w0, i0), (w1, i1) in zip(outs[False], outs[True]):
        assert torch.equal(i0, i1) and torch.equal(w0, w1)
    print(f"router E={experts} k={topk} B={batch}: k-th pick tie at expert {lo} in "
          f"{int((id_ref[:, topk - 1] == lo).sum())}/{batch} rows, expert {hi} picked in {int((id_ref == hi).sum())}")
