"""Per-rank checkpoint loading (issue 13): `load_rank_checkpoint` reads only this rank's slices.

- K3 tiny (published layout, mxfp4 experts, 3 shards, vision tensors) and Llama tiny (HF names,
  merged q/k/v and gate/up) at R = 2, and K3 tiny sharded hybrid at R = 6 (tp = 2, ep = 2: groups
  with a stride): for every rank the per-rank weights equal `param_for_rank` of the fully loaded
  checkpoint bit for bit (names, shapes, dtypes, MXFP4 packed/scale, merged `sources`), and so
  do both after `materialize_weights` in bf16 and fp32.
- What is read, counted at `safe_open` (tests/checkpoint_reads.py), not timed: per graph weight
  exactly its share (1/R of a split weight, all of a replicated one, 0 of an unused one); of an
  expert stack split over experts only this rank's expert tensors are opened at all.
- A synthetic graph covers the cuts the model graphs do not make (an expert stack split over its
  rows or columns, mxfp4 and bf16; a rank-2 mxfp4 weight's rows; a merged mxfp4 weight; a
  replicated stack; a stride), and the mxfp4 packed-dim refusal.
- Errors: validation is the whole checkpoint's on every rank (a missing or misshapen tensor that
  only another rank reads is the same one-line CheckpointError), poison is checked on what is
  read (a NaN only rank 1 reads stops rank 1, not rank 0).
The 2-process end-to-end check (`fusec.compile(..., ranks=2, weights=folder)`) is in
tests/test_dist_ranks.py.
"""
from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors import safe_open

import fusec.checkpoint as ckpt_mod
from checkpoint_reads import ReadCounter
from checkpoint_writer import checkpoint_variant, write_k3_checkpoint
from fusec.backends.reference.executor import ExecError
from fusec.backends.reference.ranks import RankWeights, materialize_weights, param_for_rank
from fusec.checkpoint import CheckpointError, load_checkpoint, load_rank_checkpoint, write_checkpoint
from fusec.compiler import lower
from fusec.ir.parser import parse_fir
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import DType
from fusec.models import kimi_k3, llama
from fusec.passes.manager import Program, run_pipeline
from fusec.passes.options import Options
from fusec.weights import random_weights

INDEX = "model.safetensors.index.json"
LM = "language_model.model."


def same(x, y) -> bool:
    if isinstance(y, MXFP4Tensor):
        return isinstance(x, MXFP4Tensor) and torch.equal(x.packed, y.packed) and torch.equal(x.scale, y.scale)
    return not isinstance(x, MXFP4Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def assert_rank_weights_equal_materialized(g, pg, folder, module, rank, full=None):
    full = load_checkpoint(g, folder, module) if full is None else full
    got = load_rank_checkpoint(g, pg, rank, folder, module)
    assert isinstance(got, RankWeights) and got.rank == rank
    names = [v.name for v in pg.weights()]
    assert list(got.tensors) == names
    for n in names:
        assert same(got.tensors[n], param_for_rank(pg, n, full, rank)), f"rank {rank}: {n}"
    for prec in ("bf16", "fp32"):
        a, b = materialize_weights(pg, got, rank, prec), materialize_weights(pg, full, rank, prec)
        assert a.keys() == b.keys()
        assert all(same(a[n], b[n]) for n in a), prec


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    g = kimi_k3.build_graph("tiny")
    folder = tmp_path_factory.mktemp("k3tiny")
    index = write_k3_checkpoint(kimi_k3.get_config("tiny"), random_weights(g, 3, kimi_k3.WEIGHT_INIT), folder, shards=3)
    pg = lower(g, Options(ranks=2, batch=2, max_len=8)).graph
    return g, pg, folder, index


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory):
    g = llama.build_graph("tiny")
    folder = tmp_path_factory.mktemp("llamatiny")
    write_checkpoint(random_weights(g, 4, llama.WEIGHT_INIT), g, llama, folder, shards=2)
    return g, lower(g, Options(ranks=2, batch=2, max_len=8)).graph, folder


# -- bit for bit --------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_k3_rank_weights_equal_materialized(k3, rank):
    g, pg, folder, _ = k3
    assert any(v.type.dtype is DType.mxfp4 and "experts" in v.name for v in pg.weights())
    assert_rank_weights_equal_materialized(g, pg, folder, kimi_k3, rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_llama_rank_weights_equal_materialized(llama_tiny, rank):
    g, pg, folder = llama_tiny
    assert any("sources" in a for a in pg.param_attrs.values())     # merged projections
    assert_rank_weights_equal_materialized(g, pg, folder, llama, rank)


def test_k3_hybrid_six_ranks_equal_materialized(k3):
    g, _, folder, _ = k3
    prog = run_pipeline(Program(g.copy(), Options(ranks=6)), ["canonicalize", "fuse", "shard"])
    assert prog.notes["shard"] == {"ranks": 6, "tp": 2, "ep": 2}
    pg = prog.graph
    assert any(int(a.get("stride", 1)) > 1 for a in pg.param_attrs.values())
    full = load_checkpoint(g, folder, kimi_k3)
    for r in range(6):
        assert_rank_weights_equal_materialized(g, pg, folder, kimi_k3, r, full)


# -- what is read -------------------------------------------------------------------------------

def _tensor_bytes(folder, index) -> dict[str, int]:
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for n in f.keys():
                t = f.get_tensor(n)
                out[n] = t.numel() * t.element_size()
    return out


def _share(g, pg, w: str) -> float:
    """The fraction of full weight `w` one rank holds, from the shard pass's annotations."""
    shape = {v.name: v.type.concrete({}) for v in g.weights()}[w]
    for p, ann in pg.param_attrs.items():
        srcs = list(ann.get("sources", (p,)))
        if w in srcs:
            i = srcs.index(w)
            d = list(ann.get("split", (-1,) * len(srcs)))[i]
            if d < 0:
                return 1.0
            n = (list(ann.get("split_len", (0,) * len(srcs)))[i]) or shape[d]
            return n / int(ann["ranks"]) / shape[d]
    return 1.0 if w in {v.name for v in pg.weights()} else 0.0


@pytest.mark.parametrize("rank", [0, 1])
def test_k3_reads_only_its_share(k3, rank, monkeypatch):
    g, pg, folder, index = k3
    size = _tensor_bytes(folder, index)
    srcs = ckpt_mod.sources(g, kimi_k3)
    counter = ReadCounter()
    monkeypatch.setattr(ckpt_mod, "safe_open", counter.safe_open)
    load_checkpoint(g, folder, kimi_k3)
    whole = dict(counter.counts)
    assert whole == {s.name: size[s.name] for s in srcs}            # the full load reads everything once
    counter.clear()
    load_rank_checkpoint(g, pg, rank, folder, kimi_k3)
    read = counter.counts
    by_weight: dict[str, list] = {}
    for s in srcs:
        by_weight.setdefault(s.weight, []).append(s)
    sharded = split_read = 0
    for w, ss in by_weight.items():
        share = _share(g, pg, w)
        full_b, got_b = sum(size[s.name] for s in ss), sum(read[s.name] for s in ss)
        assert got_b == full_b * share, f"{w}: read {got_b} of {full_b} bytes, its share is {share}"
        if share < 1:
            sharded, split_read = sharded + full_b, split_read + got_b
        if ss[0].expert is not None and share == 0.5:      # split over experts: only its experts opened
            E = 1 + max(s.expert for s in ss)
            mine = range(rank * E // 2, (rank + 1) * E // 2)
            assert {s.name for s in ss if read[s.name]} == {s.name for s in ss if s.expert in mine}, w
            assert all(read[s.name] == size[s.name] for s in ss if s.expert in mine), w
    # the brief's figure: the split tensors' bytes are read half by each rank, the rest whole
    assert sharded > 0.5 * sum(whole.values()) and split_read * 2 <= sharded + 64, (split_read, sharded)
    assert set(read) <= set(whole) and not any(n.startswith("vision_tower.") for n in read)


def test_llama_reads_half_of_every_split_tensor(llama_tiny, monkeypatch):
    g, pg, folder = llama_tiny
    index = json.loads((folder / INDEX).read_text())
    size = _tensor_bytes(folder, index)
    counter = ReadCounter()
    monkeypatch.setattr(ckpt_mod, "safe_open", counter.safe_open)
    per_rank = []
    for r in range(2):
        counter.clear()
        load_rank_checkpoint(g, pg, r, folder, llama)
        per_rank.append(dict(counter.counts))
    for s in ckpt_mod.sources(g, llama):
        share = _share(g, pg, s.weight)
        assert [p.get(s.name, 0) for p in per_rank] == [size[s.name] * share] * 2, s.name
    proj = "model.layers.0.self_attn.q_proj.weight"
    assert per_rank[0][proj] == per_rank[1][proj] == size[proj] // 2


# -- cuts the model graphs do not make ----------------------------------------------------------

SYN_FULL = """graph syn (B) {
  io %x : bf16[B, 4]
  weight %l.experts.w1 : bf16[4, 8, 16]
  weight %l.experts.w2 : mxfp4[4, 8, 64]
  weight %l.experts.w3 : bf16[4, 8, 16]
  weight %k.experts.w1 : mxfp4[4, 8, 64]
  weight %a.weight : mxfp4[8, 64]
  weight %b.weight : bf16[8, 16]
  weight %w : bf16[2, 4]
  %y : bf16[B, 2] = linear(%x, %w)
  return %y
}
"""
SYN_RANKS = """graph syn (B) {
  io %x : bf16[B, 4]
  weight %l.experts.w1 : bf16[4, 4, 16] {split = [1], ranks = 2, stride = 2}
  weight %cols : bf16[4, 8, 4] {sources = [l.experts.w1], split = [2], ranks = 4}
  weight %l.experts.w2 : mxfp4[4, 2, 64] {split = [1], ranks = 4}
  weight %l.experts.w3 : bf16[4, 8, 16]
  weight %k.experts.w1 : mxfp4[2, 8, 64] {split = [0], ranks = 2, stride = 2}
  weight %a.weight : mxfp4[2, 64] {split = [0], ranks = 4}
  weight %m : mxfp4[10, 64] {sources = [a.weight, a.weight], split = [-1, 0], ranks = 4}
  weight %b.weight : bf16[8, 4] {split = [1], ranks = 4}
  weight %w : bf16[2, 4]
  %y : bf16[B, 2] = linear(%x, %w)
  return %y
}
"""
SYN = types.SimpleNamespace(__name__="syn", checkpoint_name=lambda w: w)


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    g = parse_fir(SYN_FULL)
    folder = tmp_path_factory.mktemp("syn")
    write_checkpoint(random_weights(g, 7), g, SYN, folder, shards=2)
    return g, parse_fir(SYN_RANKS), folder


@pytest.mark.parametrize("rank", range(4))
def test_synthetic_cuts_equal_materialized(syn, rank):
    g, pg, folder = syn
    assert_rank_weights_equal_materialized(g, pg, folder, SYN, rank)


def test_synthetic_expert_split_opens_only_its_experts(syn, monkeypatch):
    g, pg, folder = syn
    counter = ReadCounter()
    monkeypatch.setattr(ckpt_mod, "safe_open", counter.safe_open)
    load_rank_checkpoint(g, pg, 3, folder, SYN)       # k.experts: groups of 2 spaced 2: rank 3 is index 1
    assert sorted(n for n in counter.counts if n.startswith("k.experts.")) == \
        [f"k.experts.{e}.w1.weight_{p}" for e in (2, 3) for p in ("packed", "scale")]
    # rows of each expert of l.experts.w2 (mxfp4): a quarter of every expert's packed bytes
    assert counter.counts["l.experts.0.w2.weight_packed"] == 8 * 32 // 4


def test_mxfp4_packed_dim_split_is_refused_as_in_memory(syn):
    g, _, folder = syn
    bad = parse_fir(SYN_RANKS.replace("%a.weight : mxfp4[2, 64] {split = [0], ranks = 4}",
                                      "%a.weight : mxfp4[8, 16] {split = [1], ranks = 4}"))
    with pytest.raises(ExecError, match=r"^cannot split an mxfp4 tensor along its packed \(last\) dim$"):
        load_rank_checkpoint(g, bad, 0, folder, SYN)
    with pytest.raises(ExecError, match=r"^cannot split an mxfp4 tensor along its packed \(last\) dim$"):
        materialize_weights(bad, load_checkpoint(g, folder, SYN), 0)


def test_rank_weights_of_another_rank_are_refused(syn):
    g, pg, folder = syn
    w = load_rank_checkpoint(g, pg, 1, folder, SYN)
    with pytest.raises(ExecError, match="^weights sliced for rank 1 given to rank 0$"):
        materialize_weights(pg, w, 0)


# -- errors -------------------------------------------------------------------------------------

variant = checkpoint_variant


def rank_error(k3, path, rank) -> str:
    g, pg = k3[0], k3[1]
    with pytest.raises(CheckpointError) as e:
        load_rank_checkpoint(g, pg, rank, path, kimi_k3)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def full_error(k3, path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(k3[0], path, kimi_k3)
    return str(e.value)


def test_missing_tensor_of_another_ranks_expert(k3, tmp_path):
    name = LM + "layers.4.block_sparse_moe.experts.17.w2.weight_scale"     # expert 17 of 32: rank 1's
    p = variant(k3, tmp_path, edit_map=lambda wm: wm.pop(name))
    msg = rank_error(k3, p, 0)
    assert msg.endswith(f"missing tensor {name} needed by graph weight layers.4.block_sparse_moe.experts.w2")
    assert msg == rank_error(k3, p, 1) == full_error(k3, p)


def test_misshapen_tensor_of_another_ranks_expert(k3, tmp_path):
    name = LM + "layers.5.block_sparse_moe.experts.30.w1.weight_packed"
    p = variant(k3, tmp_path, extra={name: torch.zeros(128, 256, dtype=torch.uint8)})
    msg = rank_error(k3, p, 0)
    assert msg.endswith(f"tensor {name} has shape [128, 256], expected [128, 128] "
                        "(graph weight layers.5.block_sparse_moe.experts.w1)")
    assert msg == full_error(k3, p)


def test_poison_is_checked_on_what_is_read(k3, tmp_path):
    g, pg, folder, index = k3
    name = LM + "layers.2.self_attn.q_proj.weight"
    with safe_open(str(folder / index["weight_map"][name]), "pt") as f:
        t = f.get_tensor(name).clone()
    t[-1, 3] = float("nan")           # the last row: in rank 1's half (q_proj is split over its rows)
    p = variant(k3, tmp_path, extra={name: t})
    load_rank_checkpoint(g, pg, 0, p, kimi_k3)        # rank 0 does not read it
    msg = rank_error(k3, p, 1)
    # the index is the checkpoint tensor's (as a full load names it), not the slice's
    assert msg.startswith(f"{p}: tensor {name} has non-finite values (1 NaN), first at [255, 3] ")
    assert msg == full_error(k3, p)
    assert msg.endswith("(graph weight layers.2.self_attn.q_proj.weight); pass allow_nonfinite=True "
                        "(--allow-nonfinite) to load it anyway")
    got = load_rank_checkpoint(g, pg, 1, p, kimi_k3, allow_nonfinite=True)
    assert torch.isnan(got.tensors["layers.2.self_attn.merged_proj.weight"].float()).sum() == 1


def test_nan_scale_of_one_ranks_expert(k3, tmp_path):
    g, pg, folder, index = k3
    name = LM + "layers.3.block_sparse_moe.experts.2.w3.weight_scale"     # expert 2: rank 0's
    with safe_open(str(folder / index["weight_map"][name]), "pt") as f:
        t = f.get_tensor(name).clone()
    t[5, 1] = 0xFF
    p = variant(k3, tmp_path, extra={name: t})
    load_rank_checkpoint(g, pg, 1, p, kimi_k3)
    msg = rank_error(k3, p, 0)
    assert f"tensor {name} has 1 E8M0 scale byte(s) 0xFF (NaN), first at [5, 1] " in msg
    assert msg == full_error(k3, p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_load_to_gpu(k3, rank):
    g, pg, folder, _ = k3
    got = load_rank_checkpoint(g, pg, rank, folder, kimi_k3, device="cuda")
    cpu = load_rank_checkpoint(g, pg, rank, folder, kimi_k3)
    for n, t in got.tensors.items():
        parts = (t.packed, t.scale) if isinstance(t, MXFP4Tensor) else (t,)
        assert all(p.is_cuda for p in parts), n
        back = MXFP4Tensor(t.packed.cpu(), t.scale.cpu()) if isinstance(t, MXFP4Tensor) else t.cpu()
        assert same(back, cpu.tensors[n]), n
