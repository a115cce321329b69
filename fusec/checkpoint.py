"""Real checkpoints: load (and write) HF-style safetensors checkpoints for a graph's weights.

Format: a directory with `model.safetensors.index.json` (`{"metadata": {"total_size": N},
"weight_map": {tensor name: shard file}}`) and its shards, or a single `model.safetensors`.
A graph weight `w` is the checkpoint tensor `model.checkpoint_name(w)`, except stacked expert
weights (`....experts.wN`, N = 1, 2, 3, shape [E, out, in]), which gather one tensor per expert:
`<prefix>experts.{e}.wN.weight_packed` (u8 [out, in/2]) and `.weight_scale` (u8 [out, in/32])
when the weight is mxfp4, `.weight` ([out, in]) otherwise. A rank-2 mxfp4 weight `x.weight`
reads `x.weight_packed` / `x.weight_scale` (compressed-tensors naming).

Loading validates everything from the shard headers before reading a byte of data, and reads
tensor by tensor through `safe_open` (memory-mapped), so a 1.5 TB checkpoint is never held
whole. Every problem is a `CheckpointError` with one line naming the tensor (and how many more
problems there are). Data is checked as it is read: NaN/Inf in a float tensor or a 0xFF (NaN)
E8M0 scale byte is an error unless `allow_nonfinite=True`. See docs/checkpoints.md.
"""
from __future__ import annotations

import contextlib
import enum
import fnmatch
import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fusec.backends.reference.ranks import Cut, RankWeights, build_param
from fusec.ir.graph import Graph
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import MXFP4_GROUP, DType
from fusec.weights import ALLOW_HINT, nonfinite_problem

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"   # the model's published hyperparameters (HF `config.json`)

# safetensors header dtype strings for the IR dtypes a checkpoint can hold (mxfp4 is stored as u8).
ST_DTYPES = {DType.bf16: "BF16", DType.f16: "F16", DType.f32: "F32", DType.fp8e4m3: "F8_E4M3",
             DType.u8: "U8", DType.i32: "I32", DType.i64: "I64"}
TORCH_DTYPES = {DType.bf16: torch.bfloat16, DType.f16: torch.float16, DType.f32: torch.float32,
                DType.fp8e4m3: torch.float8_e4m3fn, DType.u8: torch.uint8, DType.i32: torch.int32,
                DType.i64: torch.int64}

_EXPERT_STACK = re.compile(r"(?P<base>.*\.experts)\.(?P<w>w[123])")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the graph, or is not a readable checkpoint at all."""


class Part(enum.Enum):
    """What one checkpoint tensor is for its graph weight."""

    whole = "whole"    # the weight itself (or one expert's slice of a stacked bf16 weight)
    packed = "packed"  # mxfp4 nibbles
    scale = "scale"    # mxfp4 e8m0 scales


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor feeding graph weight `weight` (expert `expert` of a stack, or None)."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    weight: str
    expert: int | None
    part: Part


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _mx_shapes(out: int, k: int, what: str) -> tuple[tuple[int, int], tuple[int, int]]:
    if k % MXFP4_GROUP:
        raise CheckpointError(f"mxfp4 weight {what} has input dim {k}, not a multiple of {MXFP4_GROUP}")
    return (out, k // 2), (out, k // MXFP4_GROUP)


def sources(graph: Graph, model_module) -> list[Source]:
    """Every checkpoint tensor the graph's weights need, in graph order (experts in index order)."""
    name_of = getattr(model_module, "checkpoint_name", None)
    if name_of is None:
        raise CheckpointError(f"model module {getattr(model_module, '__name__', model_module)} "
                              "has no checkpoint_name(weight) function")
    out: list[Source] = []
    for v in graph.weights():
        shape, dt, ck = v.type.concrete({}), v.type.dtype, name_of(v.name)
        m = _EXPERT_STACK.fullmatch(v.name)
        if m is not None and len(shape) == 3:
            cm = _EXPERT_STACK.fullmatch(ck)
            if cm is None:
                raise CheckpointError(f"checkpoint_name({v.name!r}) = {ck!r} does not end in .experts.wN")
            n_exp, rows, k = shape
            for e in range(n_exp):
                stem = f"{cm['base']}.{e}.{cm['w']}."
                if dt is DType.mxfp4:
                    ps, ss = _mx_shapes(rows, k, v.name)
                    out.append(Source(stem + "weight_packed", ps, DType.u8, v.name, e, Part.packed))
                    out.append(Source(stem + "weight_scale", ss, DType.u8, v.name, e, Part.scale))
                else:
                    out.append(Source(stem + "weight", (rows, k), dt, v.name, e, Part.whole))
        elif dt is DType.mxfp4:
            if len(shape) != 2 or not ck.endswith(".weight"):
                raise CheckpointError(f"mxfp4 weight {v.name} {_fmt(shape)} is neither an expert stack "
                                      "nor a rank-2 '.weight'; no checkpoint layout for it")
            ps, ss = _mx_shapes(shape[0], shape[1], v.name)
            out.append(Source(ck + "_packed", ps, DType.u8, v.name, None, Part.packed))
            out.append(Source(ck + "_scale", ss, DType.u8, v.name, None, Part.scale))
        else:
            out.append(Source(ck, tuple(shape), dt, v.name, None, Part.whole))
    return out


def expected_tensors(graph: Graph, model_module) -> dict[str, tuple[tuple[int, ...], DType]]:
    """Checkpoint tensor name -> (shape, dtype) the graph needs; materialises nothing."""
    return {s.name: (s.shape, s.dtype) for s in sources(graph, model_module)}


# -- reading ------------------------------------------------------------------------------------

def _read_layout(path) -> tuple[str, dict[str, str]]:
    """(directory, weight_map) for a checkpoint directory, its index json, or one safetensors file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            return _read_index(os.path.join(path, INDEX_FILE))
        single = os.path.join(path, SINGLE_FILE)
        if not os.path.exists(single):
            raise CheckpointError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE}")
        path = single
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    if path.endswith(".json"):
        return _read_index(path)
    folder, fname = os.path.split(path)
    try:
        with safe_open(path, framework="pt") as f:
            return folder, {k: fname for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a safetensors file ({str(e).splitlines()[0]})") from None


def _read_index(index_path: str) -> tuple[str, dict[str, str]]:
    try:
        with open(index_path) as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index_path}: malformed index json: {e.msg} at line {e.lineno} col {e.colno}") \
            from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index_path}: malformed index: no 'weight_map' object")
    for k, f in wm.items():
        if not isinstance(f, str) or not f or os.path.isabs(f) or ".." in f.split("/"):
            raise CheckpointError(f"{index_path}: malformed index: tensor {k} maps to {f!r}, not a shard file name")
    return os.path.dirname(index_path) or ".", wm


def _folder(path) -> str:
    path = os.fspath(path)
    return path if os.path.isdir(path) else (os.path.dirname(path) or ".")


def read_config(path) -> dict | None:
    """The checkpoint's `config.json` (next to the index or the single safetensors file) as a
    dict; None when there is none. Malformed JSON is a CheckpointError."""
    fp = os.path.join(_folder(path), CONFIG_FILE)
    if not os.path.isfile(fp):
        return None
    try:
        with open(fp) as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{fp}: malformed json: {e.msg} at line {e.lineno} col {e.colno}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{fp}: not a JSON object")
    return doc


def header_shapes(path):
    """`shape_of(tensor name) -> tuple | None`: a tensor's shape read from its shard's header (no
    data is read); None for a tensor the checkpoint does not hold or a shard that cannot be read
    (loading reports those)."""
    folder, wmap = _read_layout(path)

    def shape_of(name: str):
        shard = wmap.get(name)
        if shard is None:
            return None
        try:
            with safe_open(os.path.join(folder, shard), framework="pt") as f:
                return tuple(f.get_slice(name).get_shape())
        except Exception:   # a missing shard or a bad header: load_checkpoint names it
            return None
    return shape_of


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def load_checkpoint(graph: Graph, path, model_module, device="cpu", *, allow_nonfinite: bool = False) -> dict:
    """Graph weight name -> tensor (or MXFP4Tensor) read from the checkpoint at `path`.

    `path`: a checkpoint directory, its index json, or a single safetensors file. Tensors keep
    their stored dtype (the executor's `prepare_weights` casts for a precision).

    Poison stops here: a NaN or Inf in a float tensor, or an E8M0 scale byte 0xFF (NaN) in an
    mxfp4 tensor, is a CheckpointError naming the tensor, unless `allow_nonfinite`.
    """
    with contextlib.ExitStack() as stack:
        srcs, wmap, handle = _validated(graph, path, model_module, device, stack)
        poison: list[str] = []
        out = _read(graph, srcs, wmap, handle, device, None if allow_nonfinite else poison)
        _raise_poison(path, poison)
        return out


def load_rank_checkpoint(graph: Graph, rank_graph: Graph, rank: int, path, model_module, device="cpu", *,
                         allow_nonfinite: bool = False) -> RankWeights:
    """Rank `rank`'s weights of the SPMD graph `rank_graph` (`graph` sharded by the pipeline with
    `Options(ranks=R)`), reading only what this rank holds from the checkpoint at `path`.

    Equal to `materialize_weights(rank_graph, load_checkpoint(graph, path, ...), rank, p)` for any
    precision p once cast (the returned `RankWeights` keep the stored dtypes), without reading the
    rest: each parameter's cuts (`param_cuts`, the slicing rules of backends/reference/ranks.py)
    are read with `get_slice`; of an expert stack split over its expert dim, only this rank's
    experts' tensors are opened. Validation is `load_checkpoint`'s (every header, every tensor
    the full graph needs, before any data); the poison check covers what is read.
    """
    with contextlib.ExitStack() as stack:
        srcs, wmap, handle = _validated(graph, path, model_module, device, stack)
        by_weight: dict[str, list[Source]] = {}
        for s in srcs:
            by_weight.setdefault(s.weight, []).append(s)
        meta = {v.name: (v.type.concrete({}), v.type.dtype is DType.mxfp4) for v in graph.weights()}
        poison: list[str] | None = None if allow_nonfinite else []

        def read(cut: Cut):
            return _read_cut(cut, by_weight[cut.source], wmap, handle, device, poison)
        out = {v.name: build_param(rank_graph, v.name, rank, meta.get, read) for v in rank_graph.weights()}
        _raise_poison(path, poison or [])
        return RankWeights(rank, out)


def _raise_poison(path, poison: list[str]) -> None:
    if poison:
        more = f" (and {len(poison) - 1} more poisoned tensors)" if len(poison) > 1 else ""
        raise CheckpointError(f"{os.fspath(path)}: {poison[0]}{more}; {ALLOW_HINT}")


def _validated(graph: Graph, path, model_module, device, stack: contextlib.ExitStack):
    """(sources, weight map, `handle(shard)` -> open safe_open) of a checkpoint whose index and
    headers hold every tensor `graph` needs with its shape and dtype; CheckpointError otherwise.
    No tensor data is read. The shards stay open until `stack` closes."""
    folder, wmap = _read_layout(path)
    where = os.fspath(path)
    srcs = sources(graph, model_module)
    need = {s.name: s for s in srcs}

    problems = []
    missing_shards: dict[str, str] = {}
    for tname, shard in wmap.items():
        if shard not in missing_shards and not os.path.isfile(os.path.join(folder, shard)):
            missing_shards[shard] = tname
    problems += [f"{where}: shard file {sh} (holding {t}) does not exist" for sh, t in missing_shards.items()]
    _raise(problems)

    problems += [f"{where}: missing tensor {s.name} needed by graph weight {s.weight}"
                 for s in srcs if s.name not in wmap]
    # Tensors outside the model's namespaces (e.g. a vision tower beside `language_model.`) are
    # not ours to judge; inside them every tensor must be used or declared unused by the model.
    roots = {n.split(".", 1)[0] for n in need}
    unused = list(getattr(model_module, "CHECKPOINT_UNUSED", ()))
    problems += [f"{where}: unexpected tensor {t} (graph {graph.name} does not use it and the model's "
                 "CHECKPOINT_UNUSED does not list it)"
                 for t in wmap if t not in need and t.split(".", 1)[0] in roots
                 and not any(fnmatch.fnmatchcase(t, p) for p in unused)]
    _raise(problems)

    handles: dict[str, object] = {}

    def handle(shard: str):
        if shard not in handles:
            fp = os.path.join(folder, shard)
            try:
                handles[shard] = stack.enter_context(safe_open(fp, framework="pt", device=str(device)))
            except Exception as e:
                raise CheckpointError(f"{fp}: not a safetensors file ({str(e).splitlines()[0]})") from None
        return handles[shard]

    keysets: dict[str, set] = {}
    for s in srcs:   # validate every header first: no data is read from a bad checkpoint
        shard = wmap[s.name]
        f = handle(shard)
        if shard not in keysets:
            keysets[shard] = set(f.keys())
        if s.name not in keysets[shard]:
            problems.append(f"{where}: index puts tensor {s.name} in {shard}, which does not hold it")
            continue
        sl = f.get_slice(s.name)
        shape, dt = tuple(sl.get_shape()), sl.get_dtype()
        if shape != s.shape:
            problems.append(f"{where}: tensor {s.name} has shape {_fmt(shape)}, expected {_fmt(s.shape)} "
                            f"(graph weight {s.weight})")
        elif dt != ST_DTYPES[s.dtype]:
            problems.append(f"{where}: tensor {s.name} has dtype {dt}, expected {ST_DTYPES[s.dtype]} "
                            f"(graph weight {s.weight})")
    _raise(problems)
    return srcs, wmap, handle


def _check_poison(s: Source, t: torch.Tensor, poison: list[str] | None, origin=None) -> None:
    if poison is not None:
        p = nonfinite_problem(s.name, t, scale=s.part is Part.scale, origin=origin)
        if p:
            poison.append(f"{p} (graph weight {s.weight})")


def _read(graph: Graph, srcs: list[Source], wmap, handle, device, poison: list[str] | None = None) -> dict:
    """Read the validated tensors; expert stacks are filled slot by slot (no second full copy).
    `poison`: where to list tensors holding NaN/Inf or 0xFF E8M0 scales (None: do not check)."""
    parts: dict[str, dict[Part, torch.Tensor]] = {}
    n_exp = {v.name: v.type.shape[0] for v in graph.weights()}
    for s in srcs:
        t = handle(wmap[s.name]).get_tensor(s.name)
        _check_poison(s, t, poison)
        slot = parts.setdefault(s.weight, {})
        if s.expert is None:
            slot[s.part] = t
            continue
        if s.part not in slot:
            slot[s.part] = torch.empty((n_exp[s.weight], *s.shape), dtype=TORCH_DTYPES[s.dtype], device=device)
        slot[s.part][s.expert].copy_(t)
    out = {}
    for v in graph.weights():
        out[v.name] = _assemble(parts[v.name])
    return out


def _assemble(parts: dict):
    """One graph weight from its parts: an MXFP4Tensor from packed and scale, else the tensor."""
    return MXFP4Tensor(parts[Part.packed], parts[Part.scale]) if Part.packed in parts else parts[Part.whole]


def _read_cut(cut: Cut, srcs: list[Source], wmap, handle, device, poison: list[str] | None):
    """`cut` of one graph weight read from its checkpoint tensors `srcs` (validated): a tensor's
    rows / columns through `get_slice`; of an expert stack, per expert tensor the cut one dim
    lower, and for a cut of the expert dim itself only the experts in it, read whole."""
    parts: dict[Part, torch.Tensor] = {}
    stacked = srcs[0].expert is not None
    for s in srcs:
        if stacked and cut.dim == 0 and not cut.start <= s.expert < cut.start + cut.length:
            continue    # another rank's expert: not opened
        d = cut.dim - 1 if stacked and cut.dim > 0 else (cut.dim if not stacked else -1)
        f = handle(wmap[s.name])
        if d < 0:
            t, origin = f.get_tensor(s.name), None
        else:
            t = f.get_slice(s.name)[(slice(None),) * d + (slice(cut.start, cut.start + cut.length),)]
            origin = (0,) * d + (cut.start,) + (0,) * (t.dim() - d - 1)
        _check_poison(s, t, poison, origin)     # indices named in the checkpoint tensor
        if not stacked:   # .to: a no-op where safetensors already put the slice on the handle's device
            parts[s.part] = t.to(device)
            continue
        slot = s.expert - cut.start if cut.dim == 0 else s.expert
        if s.part not in parts:
            n = cut.length if cut.dim == 0 else 1 + max(x.expert for x in srcs)
            parts[s.part] = torch.empty((n, *t.shape), dtype=t.dtype, device=device)
        parts[s.part][slot].copy_(t)
    return _assemble(parts)


# -- writing ------------------------------------------------------------------------------------

def _tensor_of(s: Source, w) -> torch.Tensor:
    if isinstance(w, MXFP4Tensor):
        t = w.packed if s.part is Part.packed else w.scale
    else:
        t = w
    t = t.detach().to("cpu")
    if s.expert is not None:   # clone: safetensors refuses tensors sharing storage (slices of one stack do)
        return t[s.expert].clone()
    return t.contiguous()


def _check_weights(weights, graph: Graph) -> None:
    problems = []
    for v in graph.weights():
        shape, dt = v.type.concrete({}), v.type.dtype
        w = weights.get(v.name)
        if w is None:
            problems.append(f"no tensor for graph weight {v.name}")
        elif tuple(w.shape) != shape:
            problems.append(f"graph weight {v.name} has shape {_fmt(w.shape)}, expected {_fmt(shape)}")
        elif (dt is DType.mxfp4) != isinstance(w, MXFP4Tensor) or \
                (dt is not DType.mxfp4 and w.dtype != TORCH_DTYPES.get(dt)):
            got = "mxfp4" if isinstance(w, MXFP4Tensor) else str(w.dtype).removeprefix("torch.")
            problems.append(f"graph weight {v.name} is {got}, expected {dt.value}")
    _raise(problems)


def _split(sizes: list[int], shards: int) -> list[int]:
    """Start index of each shard: contiguous runs of about equal bytes, none empty."""
    total, starts, cum = sum(sizes), [0], 0
    for i, n in enumerate(sizes):
        k = len(starts)
        if k < shards and i > starts[-1] and (cum * shards >= k * total or len(sizes) - i <= shards - k):
            starts.append(i)
        cum += n
    return starts


def _atomic(final: str, write) -> None:
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_checkpoint(weights, graph: Graph, model_module, path, shards: int = 1) -> list[str]:
    """Write `weights` (graph weight name -> tensor / MXFP4Tensor) as a checkpoint directory.

    The inverse of `load_checkpoint`: shards `model-0000i-of-0000N.safetensors` plus the index
    (or one `model.safetensors` when shards == 1). Each file is written under a temporary name
    and renamed; the index last, so a reader never sees an index naming unfinished shards.
    Returns the file names written.
    """
    _check_weights(weights, graph)
    srcs = sources(graph, model_module)
    if not 1 <= shards <= len(srcs):
        raise CheckpointError(f"cannot split {len(srcs)} tensors into {shards} shards")
    sizes = []
    for s in srcs:
        n = 1
        for d in s.shape:
            n *= d
        sizes.append(n * torch.empty((), dtype=TORCH_DTYPES[s.dtype]).element_size())
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    starts = _split(sizes, shards) + [len(srcs)]
    files, wmap = [], {}
    for i in range(shards):
        fname = SINGLE_FILE if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {s.name: _tensor_of(s, weights[s.weight]) for s in srcs[starts[i]:starts[i + 1]]}
        _atomic(os.path.join(path, fname), lambda tmp, part=part: save_file(part, tmp, metadata={"format": "pt"}))
        wmap.update({n: fname for n in part})
        files.append(fname)
        del part
    index = os.path.join(path, INDEX_FILE)
    if shards == 1:
        if os.path.exists(index):   # a stale index would shadow the single file when loading
            os.remove(index)
        return files

    def dump(tmp):
        with open(tmp, "w") as fh:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": wmap}, fh, indent=2)
            fh.write("\n")
    _atomic(index, dump)
    return files + [INDEX_FILE]
