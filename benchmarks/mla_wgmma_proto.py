"""A prototype of the MLA PARTIAL on Hopper's warpgroup MMA (wgmma), alone: a small test bed
for the megakernel's wgmma MLA body (backends/cute/templates/bodies/mla_wgmma.py.j2, which adds
the split of S over K between the warpgroups and the task table's addressing; stop 34). Checked
against torch on the H200 in stop 34 (o within 9.5e-4), 5.4 us a 64-head stage.

    python benchmarks/mla_wgmma_proto.py [--rows 512] [--ctas 132] [--reps 50]   # H200: check, time
    python benchmarks/mla_wgmma_proto.py --compile-only [--ptx-dir D]            # CPU: sm_90a PTX

Each CTA (512 threads, 4 warpgroups) computes one 64-head block of the absorbed MLA over one
chunk of `--rows` cache rows (K3's widths: 512 latent + 64 rope columns): S = Q K^T, the online
softmax, O = P V; it writes [O / l] fp32 [64, 512] and (m, l) [64, 2] like the registry's
partial rows. The operands come from one shared-memory layout, the 128-byte swizzle of wgmma
(16-byte chunk c of row r at chunk c ^ (r % 8) of the row's 128 bytes, 64 columns a block,
blocks one after another), written by cp.async:
- S: wgmma m64n32k16, A = Q [64 heads, 576] and B = the stage's 32 rows [32, 576], both K-major
  descriptors (SBO 1024 B: 8 rows of 128 B), 36 k-steps; each warpgroup computes all of S (its
  own copy of the softmax state: no barrier between warpgroups);
- O: wgmma m64n128k16 with P from registers (the S accumulator converted to bf16 is the A
  fragment, as FlashAttention 3 does) and B = the same stage read MN-major (the latent columns
  128 q .. 128 q + 127 of warpgroup q; LBO 4096 B between 64-column blocks, SBO 1024 B between
  8-row groups), 2 k-steps a stage.
The stages are double-buffered (cp.async of stage s + 1 while s is computed), with
`fence.proxy.async` between the cp.async writes and the wgmma reads. The check compares with
torch in fp32; the timing is a CUDA graph of one launch over `--ctas` chunks (one per SM).
"""

import argparse
import os
import sys

H, LORA, ROPE = 64, 512, 64
W = LORA + ROPE                 # 576 columns: 9 blocks of 64
SR = 32                         # cache rows a stage
THREADS = 512
Q_BYTES = H * W * 2
STAGE_BYTES = SR * W * 2
SMEM_BYTES = Q_BYTES + 2 * STAGE_BYTES + 1024     # + alignment slack for the 1024 B atoms
SW128 = 1 << 62                 # the descriptor's layout type: 128-byte swizzle


def build(arch: str = "sm_90a", ptx_dir: str | None = None):
    """Compile the prototype; returns the launcher `(q, c, rows, o, ml, scale, ctas, stream)`."""
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    gmem = cute.AddressSpace.gmem

    def asm(text, constraints="", operands=(), res=None):
        return llvm.inline_asm(res, [o.ir_value() for o in operands], text, constraints, has_side_effects=True,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

    def cp_async16(dst, src, nbytes):
        asm("cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", (Int32(dst), Int64(src), Int32(nbytes)))

    def desc(addr, lbo: int, sbo: int):
        """A wgmma shared-memory descriptor: start address, leading and stride byte offsets (all
        in 16-byte units), the 128-byte swizzle."""
        return (Int64((addr & 0x3FFFF) >> 4) | (Int64(lbo >> 4) << 16) | (Int64(sbo >> 4) << 32)
                | Int64(SW128))

    def wgmma(acc, n: int, a_desc=None, a_regs=None, b_desc=None, trans_b: int = 0):
        """acc (n / 2 fp32 a thread) += A B, one wgmma m64nNk16 (bf16, fp32 accumulate): A by
        descriptor (K-major) or as 4 registers of bf16 pairs; B by descriptor."""
        nd = n // 2
        d = ",".join(f"${i}" for i in range(nd))
        if a_regs is None:
            ins = [a_desc, b_desc, Int32(1)]
            a_txt, b_txt, p_txt = f"${nd}", f"${nd + 1}", f"${nd + 2}"
            tail = f"p, 1, 1, 0, {trans_b}"
            cons = "l,l,r"
        else:
            ins = [Int32(r) for r in a_regs] + [b_desc, Int32(1)]
            a_txt = "{" + ",".join(f"${nd + i}" for i in range(4)) + "}"
            b_txt, p_txt = f"${nd + 4}", f"${nd + 5}"
            tail = f"p, 1, 1, {trans_b}"
            cons = "r,r,r,r,l,r"
        text = ("{\n.reg .pred p;\nsetp.ne.b32 p, " + p_txt + ", 0;\n"
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {a_txt}, {b_txt}, {tail};\n}}")
        cons = ",".join(["=f"] * nd) + "," + cons + "," + ",".join(str(i) for i in range(nd))
        res = asm(text, cons, ins + [Float32(acc[i]) for i in range(nd)],
                  ir.Type.parse("!llvm.struct<(" + ",".join(["f32"] * nd) + ")>"))
        for i in range(nd):
            acc[i] = Float32(llvm.extractvalue(T.f32(), res, [i]))

    def fence_operands(acc, n: int):
        """Pass each accumulator through an empty volatile asm after a wgmma wait: the values the
        wgmma asm returned are only valid after the wait, and nothing else ties their uses to it
        (CUTLASS's warpgroup_fence_operand)."""
        for i in range(n):
            acc[i] = Float32(asm("", "=f,0", (Float32(acc[i]),), T.f32()))

    def pack_bf16(lo, hi):
        """Two fp32 as a bf16 pair (lo in the low half), as an A fragment register holds them."""
        return Int32(asm("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", (Float32(hi), Float32(lo)), T.i32()))

    def scalar(dtype, addr, align):
        return cute.make_tensor(cute.make_ptr(dtype, addr, gmem, assumed_align=align), cute.make_layout(1))

    @cute.jit
    def load_tile(base: Int32, src: Int64, rows: cutlass.Constexpr, valid: Int32, tidx: Int32):
        """rows x W bf16 (row-major at src, rows past `valid` zero-filled) into the swizzled
        K-major blocks at shared address base."""
        i = tidx
        while i < rows * (W // 8):
            r = i // (W // 8)
            c = i - r * (W // 8)
            dst = base + (c // 8) * (rows * 128) + r * 128 + ((c % 8) ^ (r % 8)) * 16
            nb = Int32(16)
            rs = r
            if r >= valid:
                nb = Int32(0)
                rs = Int32(0)
            cp_async16(dst, src + (Int64(rs) * W + Int64(c) * 8) * 2, nb)
            i = i + THREADS

    @cute.kernel
    def mla_wgmma_kernel(q_addr: Int64, c_addr: Int64, rows: Int32, o_addr: Int64, ml_addr: Int64, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        wg = tidx // 128
        wq = (tidx - wg * 128) // 32          # the warp within its warpgroup: rows 16 wq ..
        g = lane // 4
        t = lane - 4 * g
        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(Q_BYTES + 2 * STAGE_BYTES), byte_alignment=1024)
        base = Int32(buf.iterator.toint())
        qs = base
        st0 = base + Q_BYTES
        crow = c_addr + Int64(cta) * Int64(rows) * W * 2
        load_tile(qs, q_addr, H, Int32(H), tidx)
        load_tile(st0, crow, SR, cutlass.min(rows, SR), tidx)
        asm("cp.async.commit_group;")
        sacc = cute.make_rmem_tensor((16,), Float32)
        oacc = cute.make_rmem_tensor((64,), Float32)
        for i in cutlass.range_constexpr(64):
            oacc[i] = Float32(0.0)
        m = cute.make_rmem_tensor((2,), Float32)      # running max of rows 16 wq + g, + 8
        lsum = cute.make_rmem_tensor((2,), Float32)   # this thread's part of their sums
        for h in cutlass.range_constexpr(2):
            m[h] = Float32(float("-inf"))
            lsum[h] = Float32(0.0)
        nst = (rows + SR - 1) // SR
        s = Int32(0)
        while s < nst:
            cur = st0 + (s % 2) * STAGE_BYTES
            if s + 1 < nst:
                nr1 = cutlass.min(rows - (s + 1) * SR, SR)
                load_tile(st0 + ((s + 1) % 2) * STAGE_BYTES, crow + Int64((s + 1) * SR) * W * 2, SR, nr1, tidx)
                asm("cp.async.commit_group;")
                asm("cp.async.wait_group 1;")
            else:
                asm("cp.async.wait_group 0;")
            # cp.async wrote through the generic proxy; wgmma reads through the async one
            asm("fence.proxy.async.shared::cta;")
            cute.arch.sync_threads()
            nr = cutlass.min(rows - s * SR, SR)
            for i in cutlass.range_constexpr(16):
                sacc[i] = Float32(0.0)
            asm("wgmma.fence.sync.aligned;")
            for kk in cutlass.range_constexpr(W // 16):
                off = (kk % 4) * 32            # k16 steps within a 64-column block: +32 B
                wgmma(sacc, 32, a_desc=desc(qs + (kk // 4) * (H * 128) + off, 16, 1024),
                      b_desc=desc(cur + (kk // 4) * (SR * 128) + off, 16, 1024))
            asm("wgmma.commit_group.sync.aligned;")
            asm("wgmma.wait_group.sync.aligned 0;")
            fence_operands(sacc, 16)
            # online softmax; element i of the accumulator: column 8 (i // 4) + 2 t + i % 2 of
            # row 16 wq + g (i % 4 < 2) or + 8
            mx = [Float32(float("-inf")), Float32(float("-inf"))]
            for i in cutlass.range_constexpr(16):
                col = 8 * (i // 4) + 2 * t + i % 2
                v = sacc[i] * scale
                if col >= nr:
                    v = Float32(float("-inf"))
                sacc[i] = v
                mx[(i % 4) // 2] = cutlass.max(mx[(i % 4) // 2], v)
            corr = []
            for h in cutlass.range_constexpr(2):
                for sh in cutlass.range_constexpr(1, 3):
                    mx[h] = cutlass.max(mx[h], cute.arch.shuffle_sync_bfly(mx[h], offset=sh))
                mn = cutlass.max(m[h], mx[h])
                corr.append(cute.math.exp(m[h] - mn))
                m[h] = mn
            for i in cutlass.range_constexpr(16):
                p = cute.math.exp(sacc[i] - m[(i % 4) // 2])
                sacc[i] = p
            for h in cutlass.range_constexpr(2):
                part = Float32(0.0)
                for i in cutlass.range_constexpr(16):
                    if (i % 4) // 2 == h:
                        part = part + sacc[i]
                lsum[h] = lsum[h] * corr[h] + part
            for i in cutlass.range_constexpr(64):
                oacc[i] = oacc[i] * corr[(i % 4) // 2]
            # P's A fragments before the fence (a register written after it makes ptxas insert
            # a wait: C7519)
            pa = [pack_bf16(sacc[2 * e], sacc[2 * e + 1]) for e in range(SR // 4)]
            asm("wgmma.fence.sync.aligned;")
            for k2 in cutlass.range_constexpr(SR // 16):
                wgmma(oacc, 128, a_regs=pa[4 * k2:4 * k2 + 4],
                      b_desc=desc(cur + (2 * wg) * (SR * 128) + k2 * (16 * 128), SR * 128, 1024), trans_b=1)
            asm("wgmma.commit_group.sync.aligned;")
            asm("wgmma.wait_group.sync.aligned 0;")
            fence_operands(oacc, 64)
            # every warpgroup is done with this buffer before the next stage's copy refills it
            cute.arch.sync_threads()
            s = s + 1
        ltot = []
        for h in cutlass.range_constexpr(2):
            v = lsum[h]
            for sh in cutlass.range_constexpr(1, 3):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=sh)
            ltot.append(v)
        ob = o_addr + Int64(cta) * H * LORA * 4
        for i in cutlass.range_constexpr(64):
            row = 16 * wq + g + 8 * ((i % 4) // 2)
            col = 128 * wg + 8 * (i // 4) + 2 * t + i % 2
            scalar(Float32, ob + (Int64(row) * LORA + Int64(col)) * 4, 4)[0] = oacc[i] / ltot[(i % 4) // 2]
        if wg == 0 and t == 0:
            mb = ml_addr + Int64(cta) * H * 8
            for h in cutlass.range_constexpr(2):
                row = 16 * wq + g + 8 * h
                scalar(Float32, mb + Int64(row) * 8, 4)[0] = m[h]
                scalar(Float32, mb + Int64(row) * 8 + 4, 4)[0] = ltot[h]

    @cute.jit
    def launch(q_addr: Int64, c_addr: Int64, rows: Int32, o_addr: Int64, ml_addr: Int64, scale: Float32,
               ctas: Int32, stream: cuda.CUstream):
        mla_wgmma_kernel(q_addr, c_addr, rows, o_addr, ml_addr, scale).launch(
            grid=(ctas, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES, stream=stream)

    z = Int64(0)
    options = f"--gpu-arch {arch}"
    if ptx_dir:
        options += f" --keep-ptx --dump-dir {ptx_dir}"
    return cute.compile(launch, z, z, Int32(SR), z, z, Float32(1.0), Int32(1), cuda.CUstream(0), options=options)


def reference(q, cache, scale):
    """torch fp32: per chunk, o / l [64, 512], m, l [64] of softmax(scale Q K^T) V (V = the
    latent columns of the same rows)."""
    import torch

    s = torch.einsum("hd,crd->chr", q.float(), cache.float()) * scale
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    lsum = p.sum(-1)
    o = torch.einsum("chr,crd->chd", p, cache[..., :LORA].float()) / lsum[..., None]
    return o, m, lsum


def run_case(launcher, rows: int, ctas: int, seed: int = 0):
    """Random Q and cache (bf16) on the GPU, one launch: (relative error of o / l, absolute
    error of m, relative error of l against `reference`, and `run()` that launches again)."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass import Float32, Int32, Int64

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(H, W, device="cuda", generator=gen).to(torch.bfloat16)
    cache = torch.randn(ctas, rows, W, device="cuda", generator=gen).to(torch.bfloat16)
    o = torch.full((ctas, H, LORA), float("nan"), device="cuda")
    ml = torch.full((ctas, H, 2), float("nan"), device="cuda")
    scale = W ** -0.5

    def run():
        launcher(Int64(q.data_ptr()), Int64(cache.data_ptr()), Int32(rows), Int64(o.data_ptr()),
                 Int64(ml.data_ptr()), Float32(scale), Int32(ctas),
                 cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    run()
    torch.cuda.synchronize()
    ro, rm, rl = reference(q, cache, scale)
    err_o = float((o - ro).abs().max() / ro.abs().max())
    err_m = float((ml[..., 0] - rm).abs().max())
    err_l = float(((ml[..., 1] - rl).abs() / rl).max())
    return err_o, err_m, err_l, run


def close_enough(err_o: float, err_m: float, err_l: float) -> bool:
    """P is rounded to bf16 for P V (as the mma.sync body does): o within 2e-2 relative."""
    return err_o < 2e-2 and err_m < 1e-3 and err_l < 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="cache rows a chunk (a CTA)")
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ptx-dir", default=None)
    args = ap.parse_args()
    launcher = build(ptx_dir=args.ptx_dir)
    if args.compile_only:
        print("mla_wgmma_proto: compiled for sm_90a")
        return
    import torch

    err_o, err_m, err_l, run = run_case(launcher, args.rows, args.ctas)
    ok = close_enough(err_o, err_m, err_l)
    print(f"check: o rel err {err_o:.2e}, m abs err {err_m:.2e}, l rel err {err_l:.2e}: {'ok' if ok else 'WRONG'}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(args.reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    us = sorted(times)[len(times) // 2]
    stages = -(-args.rows // SR)
    print(f"| rows a CTA | CTAs | us (median of {args.reps}) | us a 64-head stage | check |\n|---|---|---|---|---|\n"
          f"| {args.rows} | {args.ctas} | {us:.1f} | {us / stages:.2f} | {'ok' if ok else 'WRONG'} |")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
