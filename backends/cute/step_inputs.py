"""The step's input guard: one one-warp kernel that clamps a step's tokens and positions into
the arena's int32 inputs, flags any value it had to clamp and advances the step counter.

It replaces the seven small launches a CUDA graph of a step held before the megakernel (stack,
clamp, compare, all, two casting copies, the counter's add): ~2 us of GPU time each plus the
gaps between them, on the path of every step (benchmarks/step_overhead.py). The kernel reads the
caller's tensors where they are (int32 or int64, by address), so the graph that holds it needs no
copy into a staging buffer either; the clamp happens in 64 bits, so an int64 token past 2**31 is
seen out of range before it is narrowed.

Written in the CuTe DSL like the megakernel (imported only here and in the other cute modules);
compiled once per process, for sm_90a without a GPU (CUTE_DSL_ARCH), like codegen.compile_plan.
"""

import functools
import os

from .codegen import DEFAULT_ARCH

LANES = 32


@functools.lru_cache(maxsize=None)
def compiled(arch: str = DEFAULT_ARCH, keep_ptx_dir: str | None = None):
    """The compiled launcher `(tok, tok64, pos, pos64, out_tok, out_pos, tok_hi, pos_hi, n,
    flag, step, stream)`: addresses as Int64, `*64` = 1 where that input is int64 (else int32),
    `*_hi` the largest valid value (inclusive), `n` the rows, `flag` one fp32 word (0.0 when every
    value was in range, else 1.0), `step` the int32 step counter (+= 1)."""
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    gmem = cute.AddressSpace.gmem

    @cute.jit
    def scalar(dtype, addr, align):
        return cute.make_tensor(cute.make_ptr(dtype, addr, gmem, assumed_align=align), cute.make_layout(1))

    @cute.jit
    def read(addr: Int64, is64: Int32, r: Int32) -> Int64:
        v = Int64(0)
        if is64 != 0:
            v = scalar(Int64, addr + Int64(r) * 8, 8)[0]
        else:
            v = Int64(scalar(Int32, addr + Int64(r) * 4, 4)[0])
        return v

    @cute.jit
    def clamp(v: Int64, hi: Int64) -> Int64:
        c = v
        if c < Int64(0):
            c = Int64(0)
        if c > hi:
            c = hi
        return c

    @cute.kernel
    def step_inputs_kernel(tok: Int64, tok64: Int32, pos: Int64, pos64: Int32, out_tok: Int64, out_pos: Int64,
                           tok_hi: Int64, pos_hi: Int64, n: Int32, flag: Int64, step: Int64):
        lane = cute.arch.lane_idx()
        bad = Int32(0)
        r = lane
        while r < n:
            t = read(tok, tok64, r)
            p = read(pos, pos64, r)
            ct = clamp(t, tok_hi)
            cp = clamp(p, pos_hi)
            scalar(Int32, out_tok + Int64(r) * 4, 4)[0] = Int32(ct)
            scalar(Int32, out_pos + Int64(r) * 4, 4)[0] = Int32(cp)
            if ct != t or cp != p:
                bad = Int32(1)
            r = r + LANES
        for s in cutlass.range_constexpr(5):
            bad = bad | cute.arch.shuffle_sync_bfly(bad, offset=16 >> s)
        if lane == 0:
            scalar(Float32, flag, 4)[0] = Float32(bad)
            # stream order makes this visible to the megakernel launched next
            scalar(Int32, step, 4)[0] = scalar(Int32, step, 4)[0] + 1

    @cute.jit
    def launch(tok: Int64, tok64: Int32, pos: Int64, pos64: Int32, out_tok: Int64, out_pos: Int64,
               tok_hi: Int64, pos_hi: Int64, n: Int32, flag: Int64, step: Int64, stream: cuda.CUstream):
        step_inputs_kernel(tok, tok64, pos, pos64, out_tok, out_pos, tok_hi, pos_hi, n, flag, step).launch(
            grid=(1, 1, 1), block=(LANES, 1, 1), stream=stream)

    z, zi = Int64(0), Int32(0)
    options = f"--gpu-arch {arch}"
    if keep_ptx_dir:
        options += f" --keep-ptx --dump-dir {keep_ptx_dir}"
    return cute.compile(launch, z, zi, z, zi, z, z, z, z, zi, z, z, cuda.CUstream(0), options=options)


def launch(tokens, positions, out_tokens, out_positions, tok_hi: int, pos_hi: int, flag, step) -> None:
    """Enqueue the guard on the current torch stream (capturable): `tokens`, `positions` int32 or
    int64 device vectors of n rows (contiguous), written clamped to [0, tok_hi] and [0, pos_hi]
    into the int32 vectors `out_tokens`, `out_positions`; `flag` a float32 device word, `step` the
    int32 step counter."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass import Int32, Int64

    n = tokens.numel()
    stream = cuda.CUstream(torch.cuda.current_stream(tokens.device).cuda_stream)
    compiled()(Int64(tokens.data_ptr()), Int32(tokens.dtype == torch.int64),
               Int64(positions.data_ptr()), Int32(positions.dtype == torch.int64),
               Int64(out_tokens.data_ptr()), Int64(out_positions.data_ptr()),
               Int64(tok_hi), Int64(pos_hi), Int32(n), Int64(flag.data_ptr()), Int64(step.data_ptr()), stream)
