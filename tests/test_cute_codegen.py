"""CPU-only tests of the CuTe backend: plan encoding, rendering, compile to sm_90a PTX, audit.

Compiling needs nvidia-cutlass-dsl (no GPU): with CUTE_DSL_ARCH=sm_90a the DSL emits sm_90a PTX.
"""
import dataclasses
import re

import pytest

from fusec.backends.cute.plan import (ROW_WORDS, KernelPlan, Opcode, TaskRow, Word,
                                      round_robin_queues, split_rows)
from fusec.backends.cute.codegen import render
from fusec.backends.cute.ptx_audit import audit_ptx


def small_plan(**kw) -> KernelPlan:
    tasks = (
        TaskRow(Opcode.GEMV_BF16, 0, a0=4096, a1=8192, a2=12288, n0=0, n1=64, k=512, ldx=512,
                ldy=64, signal_event=0),
        TaskRow(Opcode.GEMV_MXFP4, 1, n1=64, k=512, ldx=512, ldy=64, wait_event=0, wait_per_step=1,
                signal_event=1),
        TaskRow(Opcode.RMSNORM, 2, n1=4, k=512, ldx=512, ldy=512, wait_event=1, wait_per_step=1),
    )
    return KernelPlan(tasks=tasks, queues=round_robin_queues(3, 4), num_events=2, **kw)


def test_row_encoding_and_queues():
    plan = small_plan()
    rows, bounds = plan.table_words()
    assert all(len(r) == ROW_WORDS for r in rows)
    assert rows[0][Word.OPCODE] == Opcode.GEMV_BF16 and rows[0][Word.A0] == 4096
    assert rows[1][Word.WAIT_EVENT] == 0 and rows[1][Word.SIGNAL_EVENT] == 1
    assert bounds == [[0, 1], [1, 2], [2, 3], [3, 3]]
    assert plan.tasks[1].threshold(step=3) == 3
    assert plan.opcodes == (Opcode.NOP, Opcode.GEMV_BF16, Opcode.GEMV_MXFP4, Opcode.RMSNORM)


def test_plan_validation():
    with pytest.raises(ValueError, match="exactly once"):
        KernelPlan(tasks=small_plan().tasks, queues=((0, 1),), num_events=2)
    bad = (TaskRow(Opcode.GEMV_BF16, 0, n1=4, k=100, ldx=104, ldy=8),)
    with pytest.raises(ValueError, match="multiple of 8"):
        KernelPlan(tasks=bad, queues=((0,),), num_events=1)
    with pytest.raises(ValueError, match="out of range"):
        KernelPlan(tasks=(TaskRow(Opcode.NOP, 0, wait_event=5),), queues=((0,),), num_events=1)
    with pytest.raises(ValueError, match="gemv_kw 3"):
        small_plan(gemv_kw=3)
    with pytest.raises(ValueError, match="gemv_kw 16"):
        small_plan(gemv_kw=16, threads=256)


def test_grouped_gemv_default_by_batch():
    """The grouped tensor-core GEMV (warps per unit) is the default at batch <= 8 only; an explicit
    gemv_kw (0: the split-K body) wins, and it reaches the template."""
    assert [small_plan(batch=b).gemv_warps_per_unit for b in (1, 4, 8, 9, 16)] == [4, 4, 4, 0, 0]
    assert small_plan(batch=4, gemv_kw=0).gemv_warps_per_unit == 0
    assert small_plan(batch=16, gemv_kw=8).gemv_warps_per_unit == 8
    assert "GEMV_KW = 4" in render(small_plan(batch=4))
    assert "GEMV_KW = 0" in render(small_plan(batch=16))


def test_split_rows_balanced():
    parts = split_rows(49280, 132)
    assert parts[0][0] == 0 and parts[-1][1] == 49280
    assert {b - a for a, b in parts} == {373, 374}


def test_render_is_deterministic_and_names_bodies():
    pytest.importorskip("jinja2")
    from fusec.backends.cute.codegen import compile_key, render

    src = render(small_plan())
    assert src == render(small_plan())
    for op in ("GEMV_BF16", "GEMV_MXFP4", "RMSNORM"):
        assert f"# task body for opcode {op}" in src
    # Same kernel for a different table: no recompilation needed.
    assert compile_key(small_plan()) == compile_key(small_plan().with_tasks(small_plan().tasks))
    assert "relaxed" not in src.split("SPIN_SEM = ")[1].splitlines()[0]


SYNTH_OK = """
.visible .entry k(
{
 ld.acquire.gpu.global.b32 %r1, [%rd1];
 ld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2];
 st.global.b16 [%rd3], %rs1;
 atom.global.release.add.u32 %r6, [%rd1], 1;
}
"""


def test_audit_synthetic_ptx():
    assert audit_ptx(SYNTH_OK).ok
    fenced = SYNTH_OK.replace("ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.b32").replace(
        " ld.global.v4", " fence.acq_rel.gpu;\n ld.global.v4")
    assert audit_ptx(fenced).ok
    relaxed = SYNTH_OK.replace("ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.b32")
    assert any(v.startswith("P1") for v in audit_ptx(relaxed).violations)
    relaxed_signal = SYNTH_OK.replace("atom.global.release.add", "atom.global.add")
    assert any(v.startswith("P2") for v in audit_ptx(relaxed_signal).violations)
    fenced_signal = relaxed_signal.replace(" atom.global.add", " fence.acq_rel.gpu;\n atom.global.add")
    assert audit_ptx(fenced_signal).ok


def test_audit_counts_async_copies_from_global_as_data_loads():
    """cp.async / cp.async.bulk from global memory read data like a load (the expert body's weight
    ring, MLA's cache stages): after a relaxed spin they need the fence; the L2 prefetch does not."""
    load = " ld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2];"
    for copy in (" cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r7], [%rd2], 256, [%r8];",
                 " cp.async.cg.shared.global [%r7], [%rd2], 16;"):
        assert load in SYNTH_OK
        ptx = SYNTH_OK.replace(load, copy)
        assert audit_ptx(ptx).ok
        relaxed = ptx.replace("ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.b32")
        assert any(v.startswith("P1") and "asynchronous copy" in v for v in audit_ptx(relaxed).violations)
    prefetch = SYNTH_OK.replace(load, " cp.async.bulk.prefetch.L2.global [%rd2], 256;").replace(
        "ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.b32")
    assert not any(v.startswith("P1") for v in audit_ptx(prefetch).violations)


def test_audit_sees_cache_hinted_accesses():
    """The evict_first forms (plan.weight_evict_first, kda_state_evict_first,
    mla_cache_evict_first) are data loads, copies and stores to the audit like the plain ones: a
    hinted load or cp.async after an unfenced relaxed spin is a P1 violation, and a hinted
    store between a fence and a plain signal makes that signal a P2 violation."""
    load = " ld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2];"
    relaxed = SYNTH_OK.replace("ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.b32")
    for hinted, what in ((" ld.global.L2::cache_hint.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2], %rd9;", "data load"),
                         (" cp.async.cg.shared.global.L2::cache_hint [%r7], [%rd2], 16, %r6, %rd9;",
                          "asynchronous copy")):
        assert audit_ptx(SYNTH_OK.replace(load, hinted)).ok
        assert any(v.startswith("P1") and what in v for v in audit_ptx(relaxed.replace(load, hinted)).violations)
    signal = SYNTH_OK.replace("atom.global.release.add", "atom.global.add").replace(
        " atom.global.add", " fence.acq_rel.gpu;\n st.global.L2::cache_hint.f32 [%rd3], %f1, %rd9;\n atom.global.add")
    assert "st.global.L2::cache_hint" in signal
    assert any(v.startswith("P2") for v in audit_ptx(signal).violations)


def test_audit_wants_the_async_proxy_fence_before_wgmma():
    """P5: a wgmma reads shared memory through the async proxy; a cp.async (generic proxy) into
    shared memory before it needs a fence.proxy.async between them. A bulk copy (async proxy)
    needs none; a fence before the copy does not cover it."""
    load = " ld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd2];"
    copy = " cp.async.cg.shared.global [%r7], [%rd2], 16, %r6;\n cp.async.wait_group 0;\n"
    mma = " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%f1}, %rd4, %rd5, p, 1, 1, 0, 0;"
    fence = " fence.proxy.async.shared::cta;\n"
    ok = audit_ptx(SYNTH_OK.replace(load, copy + fence + mma))
    assert ok.ok and ok.proxy_fenced_wgmma == 1, ok.violations
    assert any(v.startswith("P5") for v in audit_ptx(SYNTH_OK.replace(load, copy + mma)).violations)
    assert any(v.startswith("P5") for v in audit_ptx(SYNTH_OK.replace(load, fence + copy + mma)).violations)
    bulk = " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r7], [%rd2], 256, [%r8];\n"
    assert audit_ptx(SYNTH_OK.replace(load, bulk + mma)).ok


@pytest.fixture(scope="module")
def cutlass_available():
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl==4.8.1 not installed")


def test_compile_cpu_and_audit_passes(cutlass_available, tmp_path):
    from fusec.backends.cute.ptx_audit import audit_plan

    rep = audit_plan(small_plan(), tmp_path)
    assert rep.ok, rep.violations
    assert rep.acquire_loads >= 1 and rep.release_signals >= 1
    ptx = next(tmp_path.rglob("*.ptx")).read_text()
    assert ".target sm_90a" in ptx
    assert "ld.global.v4" in ptx  # 16-byte weight loads


def test_planted_relaxed_spin_fails_audit(cutlass_available, tmp_path):
    from fusec.backends.cute.ptx_audit import audit_plan

    rep = audit_plan(dataclasses.replace(small_plan(), relaxed_spin=True), tmp_path)
    assert not rep.ok
    assert any(v.startswith("P1") for v in rep.violations)


def test_all_bodies_compile_for_sm90a_and_pass_audit(cutlass_available, tmp_path, capsys):
    """Every opcode in one kernel (the K3 set), CPU compile to sm_90a PTX; prints the compile time."""
    import time

    from fusec.backends.cute.ptx_audit import audit_plan

    plan = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, threads=1024,
                      extra_opcodes=tuple(Opcode), name="all_bodies")
    t0 = time.time()
    rep = audit_plan(plan, tmp_path)
    with capsys.disabled():
        print(f"\n[cute] all {len(plan.opcodes)} bodies, batch 1: compile + audit {time.time() - t0:.1f} s")
    assert rep.ok, rep.violations
    ptx = next(tmp_path.rglob("*.ptx")).read_text()
    assert ".target sm_90a" in ptx
    assert "tanh.approx.f32" in ptx or "ex2.approx" in ptx  # SiTU-GLU / sigmoid math emitted
    assert "shfl.sync.bfly" in ptx  # router argmax and warp reductions
    assert "cvt.f32.f16" in ptx  # MXFP4 f16 decode
    assert "bar.sync" in ptx or "barrier.sync" in ptx  # KDA / ATTN_RES / ROUTER block reductions


def _expert_plan(ks, *, threads=512, batch=16, stream="ring", tiles=False) -> KernelPlan:
    tasks = tuple(TaskRow(Opcode.EXPERT_BF16, i, n1=16, k=k, p0=1, p1=16, p2=1) for i, k in enumerate(ks))
    return KernelPlan(tasks=tasks, queues=(tuple(range(len(ks))),), num_events=1, batch=batch,
                      threads=threads, expert_stream=stream, expert_tiles=tiles, name="experts")


def _expert_mx_plan(ks, *, batch=16) -> KernelPlan:
    """EXPERT_MXFP4 rows on tensor cores (expert_mx_mma), GLU then DOWN, with the unroll the
    runner picks at this batch."""
    tasks = tuple(TaskRow(Opcode.EXPERT_MXFP4, i, n1=16, k=k, p0=1, p1=16, p2=1, sub=i % 2) for i, k in enumerate(ks))
    return KernelPlan(tasks=tasks, queues=(tuple(range(len(ks))),), num_events=1, batch=batch,
                      expert_mx_mma=True, unroll=8 if batch > 8 else 4, name="experts_mx")


def test_expert_mx_mma_needs_whole_128_column_chunks():
    """The MXFP4 tensor-core body reads 128-column chunks of MXFP4 tiles: refused where a row's K
    is not a multiple of 128, and for rank groups (the binder of a rank group does not repack)."""
    _expert_mx_plan((3584, 3072))
    with pytest.raises(ValueError, match="K % 128"):
        _expert_mx_plan((3584, 3072 + 32))
    with pytest.raises(ValueError, match="one rank"):
        dataclasses.replace(_expert_mx_plan((256,)), ranks=2)


def test_expert_mx_probes_drop_only_their_part(cutlass_available, tmp_path):
    """KernelPlan.expert_mx_probe (diagnostic builds of benchmarks/mx_expert_body.py, wrong
    results): each compiles for sm_90a and passes the PTX audit, drops exactly its part (no
    decode multiplies without the decode, no MMA without the MMAs) and keeps every weight and
    scale load of the default build (a probe whose loads were optimized away would time
    nothing). Refused without expert_mx_mma or with an unknown name."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir

    with pytest.raises(ValueError, match="expert_mx_probe"):
        dataclasses.replace(_expert_mx_plan((256,)), expert_mx_probe="no_loads")
    with pytest.raises(ValueError, match="needs expert_mx_mma"):
        dataclasses.replace(_expert_mx_plan((256,)), expert_mx_mma=False, expert_mx_probe="no_mma")
    counts = {}
    for probe in ("", "no_decode", "no_mma", "loads_only"):
        plan = dataclasses.replace(_expert_mx_plan((3584, 3072)), expert_mx_probe=probe)
        _, _, dump = compile_plan(plan, tmp_path / (probe or "default"), keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, probe
        ptx = next(dump.glob("*.ptx")).read_text()
        counts[probe] = {op: ptx.count(op) for op in ("ld.global.v4", "ld.global.b32", "mma.sync", "mul.rn.bf16x2")}
    base = counts[""]
    assert base["mma.sync"] and base["mul.rn.bf16x2"]
    for probe, c in counts.items():
        assert c["ld.global.v4"] >= base["ld.global.v4"] and c["ld.global.b32"] >= base["ld.global.b32"], (probe, c)
        assert (c["mul.rn.bf16x2"] == 0) == (probe in ("no_decode", "loads_only")), (probe, c)
        assert (c["mma.sync"] == 0) == (probe in ("no_mma", "loads_only")), (probe, c)


def test_expert_ring_stage_bytes():
    """The ring body's row bytes per stage divide every EXPERT_BF16 row's K in bytes; its stages
    keep all warps' rings within 128 KB (K3: latent 3584 and expert inter 3072 columns)."""
    assert _expert_plan((3584, 3072)).expert_ring == (256, 2)
    assert _expert_plan((3584, 3072), threads=256).expert_ring == (256, 4)
    assert _expert_plan((3584, 64)).expert_ring == (128, 4)
    assert _expert_plan((3584, 96)).expert_ring == (64, 8)      # 192 bytes: only 64 divides it
    assert _expert_plan((3584, 3072), threads=1024).expert_ring == (256, 2)   # at least two stages
    with pytest.raises(ValueError, match="expert_stream"):
        _expert_plan((3584,), stream="tma")


@pytest.mark.parametrize("batch", [4, 16])
def test_expert_ring_body_compiles_and_fits(cutlass_available, tmp_path, batch):
    """The ring body (expert_stream="ring") for sm_90a: bulk copies completing on mbarriers, the
    PTX audit passes with the copies counted as data loads, and tables + rings fit the 227 KB of
    shared memory a CTA may have."""
    from fusec.backends.cute.codegen import load_module, write_module
    from fusec.backends.cute.ptx_audit import audit_plan

    plan = _expert_plan((3584, 3072), batch=batch)
    mod = load_module(write_module(plan, tmp_path / "src"))
    ring = mod.NUM_WARPS * mod.EXPERT_STAGES * 16 * mod.EXPERT_RB
    assert (mod.EXPERT_RB, mod.EXPERT_STAGES) == plan.expert_ring and ring <= 128 * 1024
    assert 4 * mod.SCRATCH_F32 >= 4 * mod.EXPERT_TAB_F32 + ring and mod.SMEM_BYTES <= 227 * 1024
    rep = audit_plan(plan, tmp_path / "build")
    assert rep.ok, rep.violations
    ptx = next((tmp_path / "build").rglob("*.ptx")).read_text()
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.inval" in ptx
    assert "cp.async.bulk.shared" not in render(_expert_plan((3584, 3072), batch=batch, stream="regs"))


@pytest.mark.parametrize("cols", [8, 16])
def test_expert_tables_fit_the_scratch(cutlass_available, tmp_path, cols):
    """EXPERT_BF16's shared tables at batch 16 without another body raising the scratch: five
    fp32 tables by pair and the Int16 members by (group, column), where a group index can reach
    the pair count (the scratch was sized 6 x pairs + 1 words, too small for that table)."""
    from fusec.backends.cute.codegen import load_module, write_module

    tasks = (TaskRow(Opcode.EXPERT_BF16, 0, n1=16, k=3584, p0=1, p1=16, p2=1),)
    plan = KernelPlan(tasks=tasks, queues=((0,),), num_events=1, batch=16, expert_cols=cols, name="experts")
    mod = load_module(write_module(plan, tmp_path))
    pairs = mod.EXPERT_MAX_PAIRS
    assert pairs == 16 * 32 and mod.EXPERT_COLS == cols and mod.EXPERT_NT == cols // 8
    assert 4 * mod.SCRATCH_F32 >= 4 * 5 * pairs + 2 * pairs * mod.EXPERT_COLS
    with pytest.raises(ValueError, match="expert_cols"):
        dataclasses.replace(plan, expert_cols=12)


def test_expert_and_ew_rows_encode_subops():
    from fusec.backends.cute.plan import EwOp, ExpertMode, f32_pair

    row = TaskRow(Opcode.EXPERT_MXFP4, 3, a4=64, a7=128, sub=ExpertMode.DOWN, p0=2, p1=16, n1=4, k=64,
                  ldx=1024, ldy=8).words()
    assert row[Word.A4] == 64 and row[Word.A7] == 128 and row[Word.SUB] == ExpertMode.DOWN
    assert row[Word.P0] == 2 and row[Word.P1] == 16
    aux = f32_pair(0.5, 1e-6)
    assert aux & 0xFFFFFFFF == 0x3F000000 and (aux >> 32) == 0x358637BD
    assert TaskRow(Opcode.EW, 0, sub=EwOp.CONV).words()[Word.SUB] == 6
    with pytest.raises(ValueError, match="router needs"):
        KernelPlan(tasks=(TaskRow(Opcode.ROUTER, 0, n1=1, k=5000, p0=16),), queues=((0,),), num_events=1,
                   threads=1024)


def test_router_scores_per_lane_follow_the_widest_router():
    """ROUTER keeps ceil(experts / 32) scores per lane, compiled for the plan's widest ROUTER row
    (at the 1024-expert maximum for every plan a 128-expert router took 20 us per token)."""
    def plan(*experts):
        rows = tuple(TaskRow(Opcode.ROUTER, i, n1=1, k=e, ldx=e, ldy=16, p0=8) for i, e in enumerate(experts))
        return KernelPlan(tasks=rows or (TaskRow(Opcode.NOP, 0),), queues=(tuple(range(max(1, len(rows)))),),
                          num_events=1)
    assert plan(128).router_per_lane == 4
    assert plan(128, 896).router_per_lane == 28
    assert plan(33).router_per_lane == 2
    assert plan().router_per_lane == 1
    assert "ROUTER_PER_LANE = 28\n" in render(plan(896, 100))
    with pytest.raises(ValueError, match="experts <= 1024"):
        plan(1025)


@pytest.mark.parametrize("batch", [4, 16])
def test_streaming_bodies_do_not_spill(cutlass_available, tmp_path, batch):
    """The register-streaming bodies alone fit the 128 registers of 512 threads (ptxas -v on the
    sm_90a PTX): a spill inside a streaming loop costs a local-memory round trip per chunk. The
    expert body at B = 16 spilled 24 B before its groups were cut to 8 pairs (KernelPlan.expert_cols)."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptxas_resources import find_ptxas, ptxas_resources

    if find_ptxas() is None:
        pytest.skip("no ptxas (CUDA toolkit) on this machine")
    gemv = tuple(TaskRow(Opcode.GEMV_BF16, i, n0=0, n1=376, k=7168) for i in range(2))
    gemv_plan = KernelPlan(tasks=gemv, queues=((0, 1),), num_events=1, batch=batch, gemv="mma", name="gemv")
    for name, plan in (("experts", _expert_plan((3584, 3072), batch=batch, stream="regs")), ("gemv", gemv_plan),
                       ("gemv_tiles", dataclasses.replace(gemv_plan, gemv_tiles=True)),
                       ("expert_tiles", _expert_plan((3584, 3072), batch=batch, stream="regs", tiles=True)),
                       ("expert_mx", _expert_mx_plan((3584, 3072), batch=batch))):
        _, _, dump = compile_plan(plan, tmp_path / name, keep_ptx=True)
        res = ptxas_resources(next(dump.glob("*.ptx")))
        # The MXFP4 body with its half-unit loops (expert_half_units) spills 12 B at B = 4, 24 B
        # with lean_dispatch (stop 27), 40 B with stop 36's lean decode (timed 1.0% faster at
        # slice4 B = 16): the SASS (nvdisasm) has those stores at task entry and the reloads per
        # task / unit, none in a chunk loop (7 innermost HMMA loops, no STL / LDL in them, B = 4
        # and 16; stop 36: 9 STL / 16 LDL outside them, against 6 / 11); more than 40 B is a new
        # spill.
        allowed = 40 if name == "expert_mx" else 0
        assert res.registers <= 128 and res.spill_store_bytes <= allowed and res.spill_load_bytes <= 2 * allowed, (
            name, str(res))


def test_mla_combine_pairs_needs_two_columns_per_thread():
    """KernelPlan.mla_combine_pairs gives each of lora / 2 threads two columns of an item: a
    COMBINE row whose kv_lora needs more threads than the CTA has (or is odd) is refused, where
    the body would otherwise merge nothing; the default combine takes any width."""
    from fusec.backends.cute.plan import MlaMode

    row = TaskRow(Opcode.MLA, 0, n0=0, n1=4, k=512, p0=4, p1=3, sub=MlaMode.COMBINE)
    KernelPlan(tasks=(row,), queues=((0,),), num_events=1, batch=1, threads=256, mla_combine_pairs=True)
    KernelPlan(tasks=(row,), queues=((0,),), num_events=1, batch=1, threads=128)
    for bad in (dict(threads=128), dict(tasks=(dataclasses.replace(row, k=511),))):
        with pytest.raises(ValueError, match="mla_combine_pairs"):
            KernelPlan(**{**dict(tasks=(row,), queues=((0,),), num_events=1, batch=1, threads=256,
                                 mla_combine_pairs=True), **bad})


def test_mla_combine_fields_compile_and_are_bounded(cutlass_available, tmp_path):
    """mla_combine_unroll (rows in flight per thread) and mla_combine_weights_once (warp 0 reads
    the chunks' (m, l) once): a COMBINE row compiles for sm_90a and passes the PTX audit with
    them and more scalar loads in flight, and an unroll past 32 (16 with pairs) is refused.
    (That they merge like the registry: tests/gpu/test_cute_bodies.py.)"""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.plan import MlaMode
    from fusec.backends.cute.ptx_audit import audit_dir

    row = TaskRow(Opcode.MLA, 0, n0=0, n1=4, k=512, p0=4, p1=3, sub=MlaMode.COMBINE)
    base = KernelPlan(tasks=(row,), queues=((0,),), num_events=1, batch=1, threads=256, name="comb")
    for bad in (dict(mla_combine_unroll=33), dict(mla_combine_unroll=0),
                dict(mla_combine_unroll=32, mla_combine_pairs=True)):
        with pytest.raises(ValueError, match="mla_combine_unroll"):
            dataclasses.replace(base, **bad)
    ptx = {}
    for name, kw in (("default", {}), ("once", dict(mla_combine_weights_once=True, mla_combine_unroll=32))):
        _, _, dump = compile_plan(dataclasses.replace(base, **kw), tmp_path / name, keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, name
        ptx[name] = next(dump.glob("*.ptx")).read_text()
    # 4 x (m, l) per lane and 32 rows per thread against 1 + 2 and 8: +5 and +24 (23 -> 52)
    assert ptx["once"].count("ld.global.b32") >= ptx["default"].count("ld.global.b32") + 5 + 24


def test_gemv_tiles_needs_the_tensor_core_body():
    """KernelPlan.gemv_tiles is read by the tensor-core GEMV bodies only: refused with the CUDA-core
    body (batch 1), with the in-body L2 prefetch (row-major offsets) and for rank groups."""
    rows = (TaskRow(Opcode.GEMV_BF16, 0, n0=0, n1=64, k=256),)
    ok = KernelPlan(tasks=rows, queues=((0,),), num_events=1, batch=4, gemv_tiles=True)
    assert ok.gemv_mma
    for bad in (dict(batch=1), dict(l2_ahead=2), dict(gemv="simt")):
        with pytest.raises(ValueError, match="gemv_tiles"):
            dataclasses.replace(ok, **bad)
    with pytest.raises(ValueError, match="expert_tiles"):       # the ring copies row-major runs
        _expert_plan((3584,), stream="ring", tiles=True)



def test_expert_half_units_add_the_mx_half_loops(cutlass_available, tmp_path):
    """KernelPlan.expert_half_units (on by default): the MXFP4 tensor-core body gets a second
    chunk loop per matrix kind for units of at most 8 live rows (row g's two K halves as the
    MMA's two row blocks: twice the MMAs per decoded word, no extra weight loads), compiles for
    sm_90a and passes the PTX audit; the bf16 body is the same kernel either way. (That the
    half loops compute the registry's values is tests/gpu/test_cute_bodies.py.)"""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir

    assert _expert_mx_plan((256,)).expert_half_units
    for name, plan in (("bf16", _expert_plan((3584, 3072), stream="regs", tiles=True)),
                       ("mx", _expert_mx_plan((3584, 3072)))):
        ptx = {}
        for half in (False, True):
            p = dataclasses.replace(plan, expert_half_units=half)
            _, _, dump = compile_plan(p, tmp_path / f"{name}{half}", keep_ptx=True)
            assert audit_dir(dump, expect_signals=False).ok, (name, half)
            ptx[half] = next(dump.glob("*.ptx")).read_text()
        if name == "bf16":
            assert ptx[True].count("mma.sync") == ptx[False].count("mma.sync") > 0
        else:
            assert ptx[True].count("mma.sync") > ptx[False].count("mma.sync") > 0
            assert ptx[True].count("ld.global.v4") > ptx[False].count("ld.global.v4")


def test_expert_mx_unrolls_are_plan_fields(cutlass_available, tmp_path):
    """KernelPlan.expert_mx_glu_unroll / expert_mx_down_unroll (1 / 2 by default): the MXFP4
    tensor-core body's chunks of loads issued together per unit, for side-by-side runs. Other
    values compile for sm_90a, pass the PTX audit and unroll more loads; 0 or 5 is refused."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir

    plan = _expert_mx_plan((3584, 3072))
    assert (plan.expert_mx_glu_unroll, plan.expert_mx_down_unroll) == (1, 2)
    for bad in ({"expert_mx_glu_unroll": 0}, {"expert_mx_down_unroll": 5}):
        with pytest.raises(ValueError, match="unroll"):
            dataclasses.replace(plan, **bad)
    loads = {}
    for u in ((1, 2), (2, 4)):
        p = dataclasses.replace(plan, expert_mx_glu_unroll=u[0], expert_mx_down_unroll=u[1])
        _, _, dump = compile_plan(p, tmp_path / f"u{u[0]}{u[1]}", keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, u
        loads[u] = next(dump.glob("*.ptx")).read_text().count("ld.global.v4")
    assert loads[(2, 4)] > loads[(1, 2)] > 0


def test_expert_mx_decode_is_the_lean_form(cutlass_available, tmp_path):
    """The MXFP4 tensor-core body's decode in the compiled kernel is weight_tiles.MX_DECODE_PTX
    (the third bf16 pair's two shifts as one multiply by 66) and its block factor takes the
    middle scale bytes with one prmt each (selectors 0x4441 / 0x4442: the byte, then zeros):
    both are in the sm_90a PTX, which passes the audit."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir
    from fusec.backends.cute.weight_tiles import MX_DECODE_PTX

    assert "mul.lo.u32 t, t, 66;" in MX_DECODE_PTX
    _, _, dump = compile_plan(_expert_mx_plan((3584, 3072)), tmp_path, keep_ptx=True)
    assert audit_dir(dump, expect_signals=False).ok
    ptx = next(dump.glob("*.ptx")).read_text()
    assert ptx.count("mul.lo.u32 t, t, 66;") > 0
    for sel in (0x4441, 0x4442):
        assert f", 0, {sel};" in ptx, sel


def test_expert_mx_half_pack_field(cutlass_available, tmp_path):
    """KernelPlan.expert_mx_half_pack (the two K halves of a half unit of a group of at most 4
    pairs in one MMA, summed across lanes by a shuffle): the build compiles for sm_90a, passes
    the PTX audit, adds the packed loops (more MMAs and weight loads in the code, the same
    decode) and the shuffle of the fold, and stays within ptxas' 128 registers with at most 48 B
    of spills (44 B in stop 37, against the default's 40: nvdisasm has none of them in the
    10 innermost HMMA loops, the packed GLU / DOWN loops 310 / 160 SASS instructions a chunk
    where the unpacked half loops take 372 / 191); refused without expert_mx_mma or
    expert_half_units."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir
    from fusec.backends.cute.ptxas_resources import find_ptxas, ptxas_resources

    plan = _expert_mx_plan((3584, 3072))
    assert plan.expert_mx_half_pack is False
    for bad in (dict(expert_mx_mma=False), dict(expert_half_units=False)):
        with pytest.raises(ValueError, match="expert_mx_half_pack"):
            dataclasses.replace(plan, expert_mx_half_pack=True, **bad)
    ptx = {}
    for pack in (False, True):
        _, _, dump = compile_plan(dataclasses.replace(plan, expert_mx_half_pack=pack), tmp_path / str(pack),
                                  keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, pack
        path = next(dump.glob("*.ptx"))
        ptx[pack] = path.read_text()
        if pack and find_ptxas():
            res = ptxas_resources(path)
            assert res.registers <= 128 and res.spill_store_bytes <= 48, str(res)
    for op in ("mma.sync", "ld.global.v4"):
        assert ptx[True].count(op) > ptx[False].count(op) > 0, op
    assert ptx[True].count("shfl.sync.bfly") > ptx[False].count("shfl.sync.bfly")


def test_weight_evict_first_covers_the_expert_loads(cutlass_available, tmp_path):
    """KernelPlan.weight_evict_first: "experts" turns every 16-byte weight load of the bf16 and
    MXFP4 expert tensor-core bodies into an ld.global with an L2 evict_first cache policy, "all"
    the GEMV_BF16 bodies' too, "" leaves the kernel without one; all compile for sm_90a and pass the PTX audit; other values are refused."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir

    with pytest.raises(ValueError, match="weight_evict_first"):
        small_plan(weight_evict_first="weights")
    for name, plan in (("bf16", _expert_plan((3584, 3072), stream="regs", tiles=True)),
                       ("mx", _expert_mx_plan((3584, 3072)))):
        ptx = {}
        for mode in ("", "experts"):
            p = dataclasses.replace(plan, weight_evict_first=mode)
            _, _, dump = compile_plan(p, tmp_path / f"{name}{mode}", keep_ptx=True)
            assert audit_dir(dump, expect_signals=False).ok, (name, mode)
            ptx[mode] = next(dump.glob("*.ptx")).read_text()
        hinted = ptx["experts"].count("ld.global.L2::cache_hint.v4.b32")
        assert "cache_hint" not in ptx[""] and "evict_first" not in ptx[""]
        assert hinted > 0 and ptx["experts"].count("createpolicy.fractional.L2::evict_first") == hinted
        # (not one for one: LLVM merges some plain loads of the tail chunks that it keeps as asm)
        assert ptx["experts"].count("ld.global.v4") < ptx[""].count("ld.global.v4"), name
    # "all": the GEMV_BF16 bodies too, the CUDA-core one (batch 1) and the tensor-core one
    # (batch 4); "experts" leaves a kernel without expert rows plain.
    for batch in (1, 4):
        hints = {}
        for mode in ("experts", "all"):
            p = small_plan(batch=batch, weight_evict_first=mode)
            _, _, dump = compile_plan(p, tmp_path / f"gemv{batch}{mode}", keep_ptx=True)
            assert audit_dir(dump, expect_signals=True).ok, (batch, mode)
            hints[mode] = next(dump.glob("*.ptx")).read_text().count("ld.global.L2::cache_hint.v4.b32")
        assert hints["experts"] == 0 < hints["all"], (batch, hints)


def test_state_and_cache_evict_first_fields(cutlass_available, tmp_path):
    """kda_state_evict_first / mla_cache_evict_first: the KDA body's state loads and stores and
    the MLA PARTIAL's cache copies carry the L2 evict_first policy (and nothing else changes
    kind: the queries' copies stay plain), compile for sm_90a and pass the PTX audit; off, the
    kernel has no cache hint."""
    from fusec.backends.cute.ptx_audit import audit_plan

    base = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, batch=4,
                      extra_opcodes=(Opcode.KDA, Opcode.MLA), name="state_ef")
    ptx = {}
    for name, kw in (("off", {}), ("on", dict(kda_state_evict_first=True, mla_cache_evict_first=True))):
        rep = audit_plan(dataclasses.replace(base, **kw), tmp_path / name)
        assert rep.ok, (name, rep.violations)
        ptx[name] = next((tmp_path / name).rglob("*.ptx")).read_text()
    assert "cache_hint" not in ptx["off"]
    assert ptx["on"].count("ld.global.L2::cache_hint.f32") > 0
    assert ptx["on"].count("st.global.L2::cache_hint.f32") > 0
    hinted = ptx["on"].count("cp.async.cg.shared.global.L2::cache_hint")
    plain = ptx["on"].count("cp.async.cg.shared.global [")
    assert hinted > 0 and plain > 0      # the cache's copies hinted, the queries' not
    assert hinted + plain == ptx["off"].count("cp.async.cg.shared.global [")


def test_mla_unrolled_field(cutlass_available, tmp_path):
    """KernelPlan.mla_unrolled: the MLA PARTIAL's S = Q K^T gains a second, unrolled form for
    rows of the widest width (18 32-column chunks: 36 MMAs in straight-line code, the loop kept
    for narrower rows), compiles for sm_90a and passes the PTX audit; off, the kernel has only
    the loop's MMAs. mla_s_split (S split over K) compiles and passes the audit too."""
    from fusec.backends.cute.ptx_audit import audit_plan

    base = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, batch=16,
                      extra_opcodes=(Opcode.MLA,), mla_head_tiles=3, name="mla_unrolled")
    mmas = {}
    for name, kw in (("off", {}), ("on", dict(mla_unrolled=True)), ("split", dict(mla_s_split=True))):
        rep = audit_plan(dataclasses.replace(base, **kw), tmp_path / name)
        assert rep.ok, (name, rep.violations)
        mmas[name] = next((tmp_path / name).rglob("*.ptx")).read_text().count("mma.sync.aligned.m16n8k16")
    assert mmas["on"] == mmas["off"] + 36, mmas
    # mla_s_split: the split loop's MMAs (2 per row tile a chunk; LLVM unrolls that loop) on top
    # of the loop it bypasses
    assert mmas["split"] >= mmas["off"] + 8, mmas


def test_ew_unroll_is_a_plan_field(cutlass_available, tmp_path):
    """KernelPlan.ew_unroll (8 by default): the EW body's elements in flight per thread, every
    loop over them unrolled, so it sets the size of every EW instance's code. 2 compiles for
    sm_90a, passes the PTX audit and emits fewer instructions than 8; other values are refused.
    (4, lower.py's default, is compiled and audited with every lowered plan's tests, e.g.
    tests/test_cute_lower.py::test_k3_tiny_compiles_for_sm90a_and_passes_audit.)"""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir

    base = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, batch=1,
                      extra_opcodes=(Opcode.EW,), name="ew_unroll")
    assert base.ew_unroll == 8
    for bad in (1, 3, 16):
        with pytest.raises(ValueError, match="ew_unroll"):
            dataclasses.replace(base, ew_unroll=bad)
    lines = {}
    for u in (8, 2):
        _, _, dump = compile_plan(dataclasses.replace(base, ew_unroll=u), tmp_path / f"u{u}", keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, u
        lines[u] = len(next(dump.glob("*.ptx")).read_text().splitlines())
    assert lines[8] > lines[2], lines



def test_norm_rows_parallel_field(cutlass_available, tmp_path):
    """KernelPlan.norm_rows_parallel: the RMSNORM body's rows at once and the EW fp32 RMS path's
    vector second pass compile for sm_90a (B = 16, 512 threads) and pass the PTX audit; the EW
    pass loads its bf16 weights and stores its bf16 outputs 8 bytes at a time (v2.b32), which the
    default plan has none of; ptxas (when present): within 128 registers and no spills."""
    from fusec.backends.cute.codegen import compile_plan
    from fusec.backends.cute.ptx_audit import audit_dir
    from fusec.backends.cute.ptxas_resources import find_ptxas, ptxas_resources

    base = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, batch=16, threads=512,
                      extra_opcodes=(Opcode.RMSNORM, Opcode.EW), ew_unroll=4, name="norm_rows")
    assert not base.norm_rows_parallel
    ptx = {}
    for on in (False, True):
        _, _, dump = compile_plan(dataclasses.replace(base, norm_rows_parallel=on), tmp_path / str(on), keep_ptx=True)
        assert audit_dir(dump, expect_signals=False).ok, on
        path = next(dump.glob("*.ptx"))
        ptx[on] = path.read_text()
        if find_ptxas() is not None:
            res = ptxas_resources(path)
            assert res.registers <= 128 and res.spill_store_bytes == 0 and res.spill_load_bytes == 0, (on, str(res))
    assert ptx[False].count("ld.global.v2.b32") == ptx[False].count("st.global.v2.b32") == 0
    assert ptx[True].count("ld.global.v2.b32") >= 4 and ptx[True].count("st.global.v2.b32") >= 4

def test_text_bytes_reads_the_cubin_sections():
    """ptxas_resources.text_bytes sums the .text sections of an ELF64 file: a hand-built one
    with a .text.k of 96 bytes and a .nv.info of 40 (not code)."""
    import struct

    from fusec.backends.cute.ptxas_resources import text_bytes

    names = b"\0.shstrtab\0.text.k\0.nv.info\0"
    body = names + bytes(96 + 40)
    shoff = 64 + len(body)
    hdr = bytearray(64)
    hdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", hdr, 0x28, shoff)
    struct.pack_into("<HHH", hdr, 0x3a, 64, 4, 1)

    def sh(name, off, size):
        e = bytearray(64)
        struct.pack_into("<I", e, 0, name)
        struct.pack_into("<QQ", e, 0x18, off, size)
        return bytes(e)
    elf = bytes(hdr) + body + sh(0, 0, 0) + sh(1, 64, len(names)) + sh(11, 64 + len(names), 96) \
        + sh(19, 64 + len(names) + 96, 40)
    assert text_bytes(elf) == 96
    with pytest.raises(ValueError, match="ELF64"):
        text_bytes(b"not an elf")


def test_ew_fast_div_magic_is_exact():
    """The EW body's magic division (ew_fast_div, `_div_magic` in ew.py.j2): l = 32 - clz(d - 1),
    s = 32 + l, m = ceil(2^s / d) gives (i * m) >> s == i // d for every index below 2^30 (the
    plan's bound), here for divisors 1..5000, K3's EW widths and powers of two around them, at
    the indices where a quotient steps and at the bound; the product stays below 2^63."""
    def magic(d):
        clz = 32 - (d - 1).bit_length()           # clz.b32 of d - 1
        sh = 64 - clz
        return ((1 << sh) + d - 1) // d, sh

    divisors = list(range(1, 5001)) + [7168, 12288, 3584, 1988, 163840, 33792, (1 << 20) + 1, (1 << 29) - 3]
    for d in divisors:
        m, sh = magic(d)
        top = (1 << 30) - 1
        for i in {0, d - 1, d, 2 * d - 1, 2 * d, top, top - top % d, top - top % d - 1, 12345 % top}:
            if 0 <= i <= top:
                assert (i * m) >> sh == i // d, (d, i)
                assert i * m < 1 << 63
    from fusec.backends.cute.plan import KernelPlan
    with pytest.raises(ValueError, match="ew_fast_div"):
        KernelPlan(tasks=(TaskRow(Opcode.EW, 0, n1=1 << 27),), queues=((0,),), num_events=1, batch=16,
                   ew_fast_div=True)


def test_lean_dispatch_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.lean_dispatch: the dispatch loop reads the error flag once per launch and while
    spinning, copies the next row's header words into shared memory while a row runs and
    prefetches the rows after it into L2 (prefetch.global.L2); it
    compiles for sm_90a and passes the PTX audit (every spin load still an acquire, every
    signal a release), and the kernel without it has no such prefetch. (That a missing signal is
    still a bounded error and a launch after it runs nothing: tests/gpu/test_cute_gemv.py.) On
    by default since stop 27."""
    from fusec.backends.cute.ptx_audit import audit_plan

    ptx = {}
    for lean in (False, True):
        rep = audit_plan(small_plan(lean_dispatch=lean), tmp_path / str(lean))
        assert rep.ok, (lean, rep.violations)
        assert rep.acquire_loads > 0 and rep.release_signals > 0
        ptx[lean] = next((tmp_path / str(lean)).rglob("*.ptx")).read_text()
    assert "prefetch.global.L2 " in ptx[True] and "prefetch.global.L2 " not in ptx[False]
    # the next row's header words by cp.async into shared memory (the first row's before the loop)
    assert ptx[True].count("cp.async.ca.shared.global") == 2 * 6 and "cp.async.ca" not in ptx[False]


def test_gemv_pf_stripe_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.gemv_pf="stripe" (with a pf_budget_kb): a waiting CTA's prefetch of a
    CUDA-core GEMV row is spread over the tile's first rows; the kernel compiles for sm_90a and
    passes the PTX audit, and only it has the row loop's stride (the budget over the rows)."""
    from fusec.backends.cute.ptx_audit import audit_plan

    src = {}
    for pf in ("prefix", "stripe"):
        plan = small_plan(gemv_pf=pf, pf_budget_kb=128)
        assert not plan.gemv_mma            # the stripe is the CUDA-core body's read order
        rep = audit_plan(plan, tmp_path / pf)
        assert rep.ok, (pf, rep.violations)
        assert "cp.async.bulk.prefetch.L2" in next((tmp_path / pf).rglob("*.ptx")).read_text()
        src[pf] = render(plan)
    assert "PF_STRIPE = 1\n" in src["stripe"] and "PF_STRIPE = 0\n" in src["prefix"]
    assert "PF_BUDGET = 131072\n" in src["stripe"]
    with pytest.raises(ValueError, match="gemv_pf"):
        small_plan(gemv_pf="rows")


def test_spin_first_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.spin_first (the weight prefetch only after a first poll finds the event short)
    and spin_err_every (the error flag on every n-th poll): with and without lean_dispatch the
    kernel compiles for sm_90a and passes the PTX audit (every spin load an acquire, every signal
    a release), and the rendered wait calls the prefetch from inside the spin."""
    from fusec.backends.cute.ptx_audit import audit_plan

    for i, kw in enumerate(({"spin_first": True, "spin_err_every": 16}, {"spin_first": True, "lean_dispatch": False})):
        plan = small_plan(**kw)
        rep = audit_plan(plan, tmp_path / str(i))
        assert rep.ok, (kw, rep.violations)
        assert rep.acquire_loads > 0 and rep.release_signals > 0
        src = render(plan)
        wait = src[src.index("def wait_event"):src.index("return ok")]
        assert "prefetch_weights(tab, t, t_end)" in wait
        assert ("polls % 16 == 15" in wait) == (kw.get("spin_err_every", 1) == 16)
    src = render(small_plan())
    assert "prefetch_weights(tab, t, t_end)" not in src[src.index("def wait_event"):src.index("return ok")]
    with pytest.raises(ValueError, match="spin_err_every"):
        small_plan(spin_err_every=0)


def test_signal_tid_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.signal_tid = 32: warp 1's lane 0 releases a finished row's event after the
    barrier and thread 0 copies the next header only after the following barrier. The kernel
    compiles for sm_90a and passes the PTX audit (the release is still a release at gpu scope),
    the signal is guarded by the new thread index, and the field needs lean_dispatch."""
    from fusec.backends.cute.ptx_audit import audit_plan

    plan = small_plan(signal_tid=32, spin_first=True)
    rep = audit_plan(plan, tmp_path / "sig")
    assert rep.ok, rep.violations
    assert rep.release_signals > 0
    src = render(plan)
    assert "SIGNAL_TID = 32\n" in src and "if tidx == SIGNAL_TID:" in src
    assert "if tidx == SIGNAL_TID:" not in render(small_plan())
    with pytest.raises(ValueError, match="signal_tid"):
        small_plan(signal_tid=32, lean_dispatch=False)
    with pytest.raises(ValueError, match="signal_tid"):
        small_plan(signal_tid=1)


@pytest.mark.parametrize("field,value,marker", [
    ("router_late_scores", True, "mw = _i32(mine[1])"),
    ("router_compact", 4, "sm[base + 32 * (g * ROUTER_GROUP + j)] = sv")])
def test_router_fields_compile_and_pass_the_audit(cutlass_available, tmp_path, field, value, marker):
    """The ROUTER body's fields: router_late_scores (stop 29: each pick's logit loaded once, after
    the k rounds of the warp argmax, lane r its own pick's) and router_compact (stop 30: the
    scores by a loop over passes of 4 experts, parked in shared scratch). A kernel with a ROUTER body and the field on compiles for sm_90a and passes
    the PTX audit, and only the field's render has its code. (The GPU body test runs them
    against the registry's router: tests/gpu/test_cute_bodies.py, its cut cases.)"""
    from fusec.backends.cute.ptx_audit import audit_plan

    plan = small_plan(extra_opcodes=(Opcode.ROUTER,), **{field: value})
    rep = audit_plan(plan, tmp_path / field)
    assert rep.ok, rep.violations
    assert marker in render(plan)
    assert marker not in render(small_plan(extra_opcodes=(Opcode.ROUTER,)))


def test_lean_row_smem_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.lean_row_smem: the whole row is copied into shared memory (16-byte cp.async, 13
    per row of 26 words) and the bodies read their words from a stride-0 view of it; the kernel
    compiles for sm_90a and passes the PTX audit, with the row copies in its PTX twice (the first
    row's before the loop, the next row's in it)."""
    from fusec.backends.cute.ptx_audit import audit_plan

    plan = small_plan(lean_row_smem=True)
    rep = audit_plan(plan, tmp_path / "row")
    assert rep.ok, rep.violations
    ptx = next((tmp_path / "row").rglob("*.ptx")).read_text()
    assert ptx.count("cp.async.cg.shared.global") == 2 * (ROW_WORDS // 2)
    assert "trow = cute.make_tensor" in render(plan) and "trow = cute.make_tensor" not in render(small_plan())
    with pytest.raises(ValueError, match="lean_row_smem"):
        small_plan(lean_row_smem=True, lean_dispatch=False)


def test_step_input_guard_compiles_and_clamps_in_64_bits(cutlass_available, tmp_path):
    """The step's input guard (backends/cute/step_inputs.py) compiles for sm_90a on the CPU and
    passes the PTX audit's rules but P3 (no waits); the clamps compare in 64 bits (an int64 token past 2**31 is clamped,
    not narrowed first), both rows are stored as int32, and the step counter is read, added to
    and stored once (its run on the H200: tests/gpu/test_step_graph.py)."""
    from fusec.backends.cute import step_inputs
    from fusec.backends.cute.ptx_audit import audit_dir

    step_inputs.compiled(keep_ptx_dir=str(tmp_path))
    rep = audit_dir(tmp_path, expect_signals=False)
    # P3 asks a megakernel for its synchronizing loads; the guard has none (stream order, not
    # event counters, orders it before the megakernel): every other rule holds
    assert [v for v in rep.violations if not v.startswith("P3")] == [] and rep.acquire_loads == 0
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    assert ptx.count("max.s64") >= 2 and ptx.count("min.s64") >= 2
    assert "ld.global.s32" in ptx and "ld.global.b64" in ptx           # int32 and int64 inputs
    assert ptx.count("shfl.sync.bfly.b32") == 5                         # the range flag's OR


def test_router_split_compiles_and_passes_the_audit(cutlass_available, tmp_path):
    """KernelPlan.router_split (the CTA per token: warps' k best, then warp 0's k best of those)
    compiles for sm_90a at 896 experts a row and passes the PTX audit; its render has the
    tournament and the barrier between its two rounds, the default's does not. (Against the
    registry's router, with ties: tests/gpu/test_cute_bodies.py::test_router_split_matches_registry.)"""
    from fusec.backends.cute.ptx_audit import audit_plan

    row = TaskRow(Opcode.ROUTER, 0, n1=1, k=896, p0=16, ldx=896, ldy=16)
    base = KernelPlan(tasks=(row,), queues=((0,),), num_events=1, batch=1, name="router_split")
    assert base.router_per_lane == 28
    rep = audit_plan(dataclasses.replace(base, router_split=True), tmp_path / "split")
    assert rep.ok, rep.violations
    assert "_router_split(tab, t, warp, lane, tidx, sm)" in render(dataclasses.replace(base, router_split=True))
    assert "_router_split" not in render(base)
    assert "ROUTER_PER_THREAD = -(-(32 * ROUTER_PER_LANE) // THREADS)" in render(dataclasses.replace(base, router_split=True))


def test_mla_wgmma_prototype_compiles_for_sm90a(cutlass_available, tmp_path):
    """benchmarks/mla_wgmma_proto.py (the MLA partial on wgmma alone; the megakernel's body is
    test_mla_wgmma_field's)
    compiles for sm_90a on the CPU: 36 m64n32k16 wgmmas for S = Q K^T (576 = 36 k16 steps, both
    operands by descriptor) and 2 m64n128k16 for P V (P from registers) a stage, the async-proxy
    fence between the cp.async writes and the wgmma reads, every wgmma group committed and
    waited for. (Its numbers against torch: tests/gpu/test_mla_wgmma_proto.py.)"""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import mla_wgmma_proto as proto

    proto.build(ptx_dir=str(tmp_path))
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 36
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 2
    assert "fence.proxy.async.shared::cta" in ptx
    assert ptx.count("wgmma.commit_group.sync.aligned") == ptx.count("wgmma.wait_group.sync.aligned 0") == 2


def test_mla_wgmma_field(cutlass_available, tmp_path):
    """KernelPlan.mla_wgmma: the megakernel's MLA PARTIAL on wgmma (bodies/mla_wgmma.py.j2)
    compiles for sm_90a and passes the PTX audit: 36 m64n32k16 wgmmas (S) and 2 m64n128k16 (P V)
    a stage, the async-proxy fence, every wgmma group committed and waited for, and the
    mma.sync PARTIAL compiled out (the COMBINE has no MMA); with mla_wgmma_ksplit 9 S wgmmas a
    warpgroup and the partial sums' exchange; with mla_wgmma_stages 3 a three-stage ring within
    227 KB of shared memory. ptxas (when present): within 128 registers, and the spills of the
    default MLA kernel or fewer.
    Refused: fewer than 512 threads, or PARTIAL rows of other widths than K3's."""
    from fusec.backends.cute.codegen import compile_plan, load_module
    from fusec.backends.cute.plan import MlaMode
    from fusec.backends.cute.ptx_audit import audit_dir
    from fusec.backends.cute.ptxas_resources import find_ptxas, ptxas_resources

    base = KernelPlan(tasks=(TaskRow(Opcode.NOP, 0),), queues=((0,),), num_events=1, batch=16,
                      extra_opcodes=(Opcode.MLA,), name="mla_wg")
    with pytest.raises(ValueError, match="512 threads"):
        dataclasses.replace(base, mla_wgmma=True, threads=256)
    narrow = TaskRow(Opcode.MLA, 0, n0=0, n1=1, k=256, p2=64, p0=8, ldy=8, p1=1, ldx=64, sub=MlaMode.PARTIAL)
    with pytest.raises(ValueError, match="K3's widths"):
        KernelPlan(tasks=(narrow,), queues=((0,),), num_events=1, batch=1, mla_wgmma=True, name="narrow")
    ptx, res = {}, {}
    with pytest.raises(ValueError, match="needs mla_wgmma"):
        dataclasses.replace(base, mla_wgmma_ksplit=True)
    with pytest.raises(ValueError, match="mla_wgmma_stages"):
        dataclasses.replace(base, mla_wgmma_stages=3)
    smem = {}
    for name, kw in (("off", {}), ("on", dict(mla_wgmma=True)), ("ksplit", dict(mla_wgmma=True, mla_wgmma_ksplit=True)),
                     ("stages3", dict(mla_wgmma=True, mla_wgmma_ksplit=True, mla_wgmma_stages=3))):
        _, path, dump = compile_plan(dataclasses.replace(base, **kw), tmp_path / name, keep_ptx=True)
        smem[name] = load_module(path).SMEM_BYTES
        assert audit_dir(dump, expect_signals=False).ok, name
        path = next(dump.glob("*.ptx"))
        ptx[name] = path.read_text()
        if find_ptxas() is not None:
            res[name] = ptxas_resources(path)
    on, off = ptx["on"], ptx["off"]
    assert "wgmma." not in off and off.count("mma.sync.aligned.m16n8k16") > 0
    assert on.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 36
    assert on.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 2
    assert on.count("mma.sync.aligned.m16n8k16") == 0
    assert "fence.proxy.async.shared::cta" in on
    assert on.count("wgmma.commit_group.sync.aligned") == on.count("wgmma.wait_group.sync.aligned 0") == 2
    # P5 of the audit: every wgmma is preceded by the async-proxy fence after the cp.async
    # writes of its operands; with the fences planted away, each read is a violation
    rep = audit_ptx(on, expect_signals=False)
    assert rep.ok and rep.proxy_fenced_wgmma == 38, rep.summary()
    bad = audit_ptx(on.replace("fence.proxy.async.shared::cta;", ""), expect_signals=False)
    assert [v for v in bad.violations if v.startswith("P5")], bad.violations
    # ksplit: a quarter of S's k16 steps a warpgroup (the same instruction, its address from the
    # warpgroup), the partials through 16-byte shared-memory stores and loads
    ks = ptx["ksplit"]
    assert ks.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 9
    assert ks.count("st.shared.v4") - on.count("st.shared.v4") == 4
    assert ks.count("ld.shared.v4") - on.count("ld.shared.v4") == 16
    # stages3: a third cache stage in the ring (one more cp.async group in flight: wait_group 2),
    # within the H200's 227 KB of shared memory a CTA
    wait2 = re.compile(r"cp\.async\.wait_group\s+2;")
    assert wait2.search(ptx["stages3"]) and not wait2.search(ks)
    assert smem["stages3"] - smem["ksplit"] == 36864 and smem["stages3"] <= 227 * 1024, smem
    if res:
        for name in ("on", "ksplit", "stages3"):
            assert res[name].registers <= 128, str(res[name])
            assert res[name].spill_store_bytes <= res["off"].spill_store_bytes, (name, str(res[name]), str(res["off"]))
