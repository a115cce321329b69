"""Render a KernelPlan into a real .py module holding the CuTe DSL megakernel, and compile it.

The template (templates/megakernel.py.j2) only loops over plan data: which opcodes exist,
threads, batch, unroll, event/timeout constants. The CuTe DSL rejects source given to exec, so
the module is written to disk and imported from its path.

cutlass is imported lazily (inside functions) so that `import fusec` never needs it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile
import types

import jinja2

from fusec.passes.target import GPUS

from .plan import (ATTN_MAX_HEAD_DIM, ATTN_RES_MAX_SOURCES, ATTN_RES_VECS, ERR_WORDS, MLA_MAX_CHUNKS,
                   MLA_MAX_LORA, MLA_MAX_ROPE, ArgmaxMode, MlaMode, PROF_FIELDS, PROF_OFFSET_WORDS,
                   PF_LOOKAHEAD, ROUTER_MAX_TOPK, ROW_WORDS, ROW_WORDS_RANKS, CommOp, ErrWord, EwOp, ExpertMode,
                   F32Flag, KernelPlan, Opcode, RankWord, ScopeCode, Word)
from .weight_tiles import MX_DECODE_PTX, MX_FACTOR

_TEMPLATES = pathlib.Path(__file__).parent / "templates"
DEFAULT_ARCH = GPUS["h200"].arch   # sm_90a: the kernels use Hopper-only features


def render(plan: KernelPlan) -> str:
    """The generated module's source text (deterministic for a given compile-time plan)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env.get_template("megakernel.py.j2").render(
        plan=plan,
        opcodes=plan.opcodes,
        words=list(Word),
        err_fields=list(ErrWord),
        row_words=ROW_WORDS_RANKS if plan.ranks > 1 else ROW_WORDS,
        rank_words=list(RankWord),
        scope_sys=int(ScopeCode.SYS),
        comm_ops=list(CommOp),
        pf_lookahead=PF_LOOKAHEAD,
        op_gemv_bf16=int(Opcode.GEMV_BF16),
        err_words=ERR_WORDS,
        ew_ops=list(EwOp),
        expert_modes=list(ExpertMode),
        f32_flags=list(F32Flag),
        router_per_lane=plan.router_per_lane,
        router_max_topk=ROUTER_MAX_TOPK,
        attn_res_max_sources=ATTN_RES_MAX_SOURCES,
        attn_res_vecs=ATTN_RES_VECS,
        kda_d=plan.kda_head_dim,
        mla_max_lora=MLA_MAX_LORA,
        mla_max_rope=MLA_MAX_ROPE,
        mla_max_chunks=MLA_MAX_CHUNKS,
        mx_decode_ptx=MX_DECODE_PTX,
        mx_factor=[hex(v) for v in MX_FACTOR],
        attn_max_d=ATTN_MAX_HEAD_DIM,
        mla_modes=list(MlaMode),
        argmax_modes=list(ArgmaxMode),
        prof_offset_words=PROF_OFFSET_WORDS,
        prof_fields=PROF_FIELDS,
    )


def compile_key(plan: KernelPlan) -> str:
    """Hash of the generated source: plans that differ only in their table share a kernel."""
    return hashlib.sha256(render(plan).encode()).hexdigest()[:16]


def write_module(plan: KernelPlan, out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Write the generated module to out_dir (a temp dir by default) and return its path."""
    out = pathlib.Path(out_dir or tempfile.mkdtemp(prefix="fusec_cute_"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{plan.name}_{compile_key(plan)}.py"
    path.write_text(render(plan))
    return path


def load_module(path: pathlib.Path) -> types.ModuleType:
    """Import a generated module from its file (the DSL needs real source files)."""
    name = f"fusec_generated_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_plan(plan: KernelPlan, out_dir: str | os.PathLike | None = None, *,
                 keep_ptx: bool = False, arch: str = DEFAULT_ARCH, extra_options: str = ""):
    """Generate, import and `cute.compile` the launcher. Works without a GPU.

    Returns (compiled launcher, module path, dump dir). With keep_ptx the PTX lands in
    `<out_dir>/dump/<module stem>/`. CUTE_DSL_ARCH must name the target when no GPU is present, else the
    DSL silently targets sm_100a; we set it unless the caller already did.
    """
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    path = write_module(plan, out_dir)
    mod = load_module(path)
    dump = path.parent / "dump" / path.stem
    options = f"--gpu-arch {arch}"
    if keep_ptx:
        dump.mkdir(parents=True, exist_ok=True)
        options += f" --keep-ptx --dump-dir {dump}"
    if extra_options:
        options += " " + extra_options
    # The launcher takes raw addresses, so tracing needs no device memory at all.
    z = Int64(0)
    peers = (z,) if plan.ranks > 1 else ()     # multi-rank: the peer counter table (template)
    compiled = cute.compile(mod.launch, z, z, z, z, z, Int32(max(1, len(plan.tasks))), *peers,
                            cuda.CUstream(0), options=options)
    return compiled, path, dump
