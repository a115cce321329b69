"""fusec.checkpoint: load the published K3 layout, validate it, write it back; Llama HF names."""
from __future__ import annotations

import fnmatch
import json
import os
import pathlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoint_writer import VISION, checkpoint_variant, k3_published_tensors, write_k3_checkpoint
from fusec.backends.reference.executor import init_state, prepare_weights, run_step
from fusec.checkpoint import CheckpointError, expected_tensors, load_checkpoint, write_checkpoint
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.types import DType
from fusec.models import kimi_k3
from fusec.weights import random_weights

INDEX = "model.safetensors.index.json"
ST_TO_DTYPE = {"BF16": DType.bf16, "F32": DType.f32, "U8": DType.u8}


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(y, MXFP4Tensor):
            assert isinstance(x, MXFP4Tensor), k
            assert torch.equal(x.packed, y.packed) and torch.equal(x.scale, y.scale), k
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), k


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    g = kimi_k3.build_graph("tiny")
    w = random_weights(g, 3, kimi_k3.WEIGHT_INIT)
    folder = tmp_path_factory.mktemp("k3tiny")
    index = write_k3_checkpoint(kimi_k3.get_config("tiny"), w, folder, shards=3)
    return g, w, folder, index


# -- the happy path -----------------------------------------------------------------------------

def test_published_layout_loads_bit_exact(tiny):
    g, w, folder, index = tiny
    assert len({f for f in index["weight_map"].values()}) == 3
    assert any(n.startswith("vision_tower.") for n in index["weight_map"])
    got = load_checkpoint(g, folder, kimi_k3)
    assert_same_weights(got, w)
    assert isinstance(got["layers.1.block_sparse_moe.experts.w2"], MXFP4Tensor)
    assert got["layers.1.block_sparse_moe.experts.w2"].shape == (32, 256, 128)


def test_loaded_weights_give_identical_logits(tiny):
    g, w, folder, _ = tiny
    dims = {"B": 2, "L": 8}
    inputs = {"tokens": torch.tensor([5, 4000], dtype=torch.int32), "pos": torch.tensor([0, 0], dtype=torch.int32)}
    outs = []
    for weights in (w, load_checkpoint(g, folder / INDEX, kimi_k3)):
        st = init_state(g, dims, precision="fp32")
        outs.append(run_step(g, prepare_weights(g, weights, "fp32"), st, inputs, dims, "fp32"))
    assert torch.isfinite(outs[0][0]).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_single_file_checkpoint(tiny, tmp_path):
    g, w, _, _ = tiny
    files = write_checkpoint(w, g, kimi_k3, tmp_path, shards=1)
    assert files == ["model.safetensors"] and not (tmp_path / INDEX).exists()
    assert_same_weights(load_checkpoint(g, tmp_path, kimi_k3), w)
    assert_same_weights(load_checkpoint(g, tmp_path / "model.safetensors", kimi_k3), w)


def test_bf16_experts(tmp_path):
    g = kimi_k3.build_graph("tiny", expert_dtype="bf16")
    w = random_weights(g, 5, kimi_k3.WEIGHT_INIT)
    write_k3_checkpoint(kimi_k3.get_config("tiny", expert_dtype="bf16"), w, tmp_path, shards=2, vision=False)
    with safe_open(str(tmp_path / "model-00002-of-00002.safetensors"), "pt") as f:
        assert "language_model.model.layers.8.block_sparse_moe.experts.31.w3.weight" in f.keys()
    got = load_checkpoint(g, tmp_path, kimi_k3)
    assert_same_weights(got, w)
    assert got["layers.1.block_sparse_moe.experts.w1"].dtype == torch.bfloat16


# -- writing ------------------------------------------------------------------------------------

def test_write_checkpoint_matches_published_layout(tiny, tmp_path):
    g, w, _, _ = tiny
    files = write_checkpoint(w, g, kimi_k3, tmp_path, shards=3)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    index = json.loads((tmp_path / INDEX).read_text())
    spec = {n: v for n, v in k3_published_tensors(kimi_k3.get_config("tiny")).items() if v[2] is not None}
    assert index["weight_map"].keys() == spec.keys()
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(tmp_path / shard), "pt") as f:
            assert f.keys(), shard
            for n in f.keys():
                assert index["weight_map"][n] == shard
                sl = f.get_slice(n)
                assert (sl.get_shape(), sl.get_dtype()) == (spec[n][0], spec[n][1]), n
                t = f.get_tensor(n)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert_same_weights(load_checkpoint(g, tmp_path, kimi_k3), w)


def test_write_checkpoint_rejects_bad_weights(tiny, tmp_path):
    g, w, _, _ = tiny
    bad = dict(w)
    bad["norm.weight"] = w["norm.weight"].float()
    with pytest.raises(CheckpointError, match=r"^graph weight norm.weight is float32, expected bf16$"):
        write_checkpoint(bad, g, kimi_k3, tmp_path)
    del bad["norm.weight"]
    with pytest.raises(CheckpointError, match=r"^no tensor for graph weight norm.weight$"):
        write_checkpoint(bad, g, kimi_k3, tmp_path)


# -- errors: one line naming the tensor ----------------------------------------------------------

variant = checkpoint_variant


def load_error(g, path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(g, path, kimi_k3)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_tensor(tiny, tmp_path):
    g = tiny[0]
    p = variant(tiny, tmp_path, edit_map=lambda wm: wm.pop("language_model.model.layers.2.self_attn.q_proj.weight"))
    assert load_error(g, p).endswith("missing tensor language_model.model.layers.2.self_attn.q_proj.weight "
                                     "needed by graph weight layers.2.self_attn.q_proj.weight")


def test_missing_expert_tensor(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.layers.4.block_sparse_moe.experts.17.w2.weight_scale"
    p = variant(tiny, tmp_path, edit_map=lambda wm: wm.pop(name))
    assert load_error(g, p).endswith(f"missing tensor {name} needed by graph weight "
                                     "layers.4.block_sparse_moe.experts.w2")


def test_extra_language_model_tensor(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.layers.1.self_attn.rotary_emb.inv_freq"
    p = variant(tiny, tmp_path, extra={name: torch.zeros(4)})
    msg = load_error(g, p)
    assert f"unexpected tensor {name} " in msg and "CHECKPOINT_UNUSED" in msg


def test_tensors_outside_the_language_model_are_ignored(tiny, tmp_path):
    g, w = tiny[0], tiny[1]
    p = variant(tiny, tmp_path, extra={"audio_tower.conv.weight": torch.zeros(3)})
    assert_same_weights(load_checkpoint(g, p, kimi_k3), w)


def test_misshapen_tensor(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.layers.1.self_attn.dt_bias"
    p = variant(tiny, tmp_path, extra={name: torch.zeros(255)})
    assert load_error(g, p).endswith(f"tensor {name} has shape [255], expected [256] "
                                     "(graph weight layers.1.self_attn.dt_bias)")


def test_misshapen_expert_tensor(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.layers.5.block_sparse_moe.experts.3.w1.weight_packed"
    p = variant(tiny, tmp_path, extra={name: torch.zeros(128, 256, dtype=torch.uint8)})
    assert load_error(g, p).endswith(f"tensor {name} has shape [128, 256], expected [128, 128] "
                                     "(graph weight layers.5.block_sparse_moe.experts.w1)")


def test_wrong_dtype(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.layers.0.self_attn.A_log"
    p = variant(tiny, tmp_path, extra={name: torch.zeros(8, dtype=torch.bfloat16)})
    assert load_error(g, p).endswith(f"tensor {name} has dtype BF16, expected F32 (graph weight layers.0.self_attn.A_log)")


def test_missing_shard_file(tiny, tmp_path):
    g = tiny[0]
    name = "language_model.model.norm.weight"
    p = variant(tiny, tmp_path, edit_map=lambda wm: wm.update({name: "model-00004-of-00003.safetensors"}))
    assert load_error(g, p).endswith(f"shard file model-00004-of-00003.safetensors (holding {name}) does not exist")


def test_index_names_a_shard_without_the_tensor(tiny, tmp_path):
    g, _, _, index = tiny
    name = "language_model.model.norm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    p = variant(tiny, tmp_path, edit_map=lambda wm: wm.update({name: other}))
    assert load_error(g, p).endswith(f"index puts tensor {name} in {other}, which does not hold it")


def test_corrupt_shard(tiny, tmp_path):
    g = tiny[0]
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    p = variant(tiny, tmp_path, edit_map=lambda wm: wm.update({"language_model.model.norm.weight": "junk.safetensors"}))
    assert "junk.safetensors: not a safetensors file (" in load_error(g, p)


@pytest.mark.parametrize("text, why", [
    ('{"weight_map": {"a": ', "malformed index json: Expecting value at line 1 col 22"),
    ('{"metadata": {}}', "malformed index: no 'weight_map' object"),
    ('{"weight_map": {"language_model.model.norm.weight": 3}}',
     "malformed index: tensor language_model.model.norm.weight maps to 3, not a shard file name"),
])
def test_malformed_index(tiny, tmp_path, text, why):
    assert load_error(tiny[0], variant(tiny, tmp_path, index_text=text)).endswith(f"{INDEX}: {why}")


def test_no_checkpoint(tiny, tmp_path):
    assert load_error(tiny[0], tmp_path) == f"{tmp_path}: no {INDEX} and no model.safetensors"


def test_several_problems_in_one_line(tiny, tmp_path):
    g = tiny[0]
    p = variant(tiny, tmp_path, edit_map=lambda wm: [wm.pop(n) for n in list(wm) if n.endswith("o_proj.weight")])
    # 9 layers, each with an o_proj: the first is named, the other 8 counted
    assert load_error(g, p).endswith("needed by graph weight layers.0.self_attn.o_proj.weight (and 8 more problems)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_load_to_gpu(tiny):
    g, w, folder, _ = tiny
    got = load_checkpoint(g, folder, kimi_k3, device="cuda")
    x = got["layers.2.block_sparse_moe.experts.w3"]
    assert x.packed.is_cuda and x.scale.is_cuda and got["embed_tokens.weight"].is_cuda
    assert_same_weights({k: v.to("cpu") for k, v in got.items()}, w)


# -- the full K3 layout, from the spec table, without materialising a tensor -------------------------

def test_full_k3_names_and_shapes_match_the_spec():
    g = kimi_k3.build_graph("full")
    exp = expected_tensors(g, kimi_k3)
    u8, bf16, f32 = DType.u8, DType.bf16, DType.f32
    by_hand = {  # rows of the "Checkpoint format" table in KIMI_K3.md
        "language_model.model.layers.5.block_sparse_moe.experts.17.w2.weight_packed": ((3584, 1536), u8),
        "language_model.model.layers.5.block_sparse_moe.experts.17.w2.weight_scale": ((3584, 96), u8),
        "language_model.model.layers.92.block_sparse_moe.experts.895.w1.weight_packed": ((3072, 1792), u8),
        "language_model.model.layers.1.block_sparse_moe.experts.0.w3.weight_scale": ((3072, 112), u8),
        "language_model.model.embed_tokens.weight": ((163840, 7168), bf16),
        "language_model.lm_head.weight": ((163840, 7168), bf16),
        "language_model.model.output_attn_res_proj.weight": ((1, 7168), bf16),
        "language_model.model.layers.12.mlp_res_proj.weight": ((1, 7168), bf16),
        "language_model.model.layers.4.self_attn.A_log": ((128,), f32),
        "language_model.model.layers.4.self_attn.dt_bias": ((12288,), f32),
        "language_model.model.layers.4.self_attn.k_conv1d.weight": ((12288, 1, 4), f32),
        "language_model.model.layers.4.self_attn.o_norm.weight": ((128,), f32),
        "language_model.model.layers.4.self_attn.b_proj.weight": ((96, 7168), bf16),
        "language_model.model.layers.91.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), bf16),
        "language_model.model.layers.92.self_attn.q_b_proj.weight": ((18432, 1536), bf16),
        "language_model.model.layers.3.self_attn.kv_b_proj.weight": ((24576, 512), bf16),
        "language_model.model.layers.0.mlp.down_proj.weight": ((7168, 33792), bf16),
        "language_model.model.layers.7.block_sparse_moe.gate.e_score_correction_bias": ((896,), f32),
        "language_model.model.layers.7.block_sparse_moe.shared_experts.up_proj.weight": ((6144, 7168), bf16),
    }
    for n, v in by_hand.items():
        assert exp[n] == v, n
    assert "language_model.model.layers.91.self_attn.A_log" not in exp      # MLA layer
    assert "language_model.model.layers.90.self_attn.kv_b_proj.weight" not in exp  # KDA layer

    # Count per the table: 5 global + 93 x 6 per layer + 69 KDA x 14 + 24 MLA x 8 + 3 dense
    # + 92 MoE x (8 + 896 experts x 3 matrices x 2) = 497,052 = 497,220 - 168 vision.
    spec_text = 5 + 93 * 6 + 69 * 14 + 24 * 8 + 3 + 92 * (8 + 896 * 3 * 2)
    assert spec_text == 497_220 - 168
    # The decode graph reads all of them but layer 0's mixer-side AttnRes pair (one source: identity).
    table = k3_published_tensors(kimi_k3.get_config("full"))
    assert len(table) == spec_text
    unread = sorted(set(table) - set(exp))
    assert unread == ["language_model.model.layers.0.self_attention_res_norm.weight",
                      "language_model.model.layers.0.self_attention_res_proj.weight"]
    assert len(exp) == spec_text - 2 and set(exp) <= set(table)
    assert all(any(fnmatch.fnmatchcase(n, p) for p in kimi_k3.CHECKPOINT_UNUSED) for n in unread)
    for n, (shape, dt) in exp.items():
        assert (list(shape), dt) == (table[n][0], ST_TO_DTYPE[table[n][1]]), n


def test_vision_names_are_declared_unused():
    assert all(any(fnmatch.fnmatchcase(n, p) for p in kimi_k3.CHECKPOINT_UNUSED) for n in VISION)


# -- Llama (HF names), once models/llama.py exists ------------------------------------------------------

LLAMA = pathlib.Path(__file__).resolve().parents[1] / "models" / "llama.py"


@pytest.mark.skipif(not LLAMA.exists(), reason="models/llama.py is not written yet (another engineer's task)")
@pytest.mark.parametrize("tied", [True, False])
def test_llama_hf_checkpoint(tmp_path, tied):
    from fusec.models import llama
    g = llama.build_graph("tiny", tie_embeddings=tied)
    c = llama.get_config("tiny")
    w = random_weights(g, 0, getattr(llama, "WEIGHT_INIT", ()))
    # HF LlamaForCausalLM names, spelled out by hand -> graph weight (the model strips "model.")
    hf = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
    if not tied:
        hf["lm_head.weight"] = "lm_head.weight"
    for i in range(c.layers):
        p = f"model.layers.{i}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        names += [f"self_attn.{x}_proj.weight" for x in "qkvo"] + [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        hf.update({p + n: f"layers.{i}." + n for n in names})
    assert set(expected_tensors(g, llama)) == set(hf)
    assert expected_tensors(g, llama)["model.layers.1.self_attn.k_proj.weight"] == ((c.kv_heads * c.head_dim, c.hidden),
                                                                                     DType.bf16)
    # an HF checkpoint as transformers writes it (tied: lm_head.weight still stored as a copy)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for j, (n, gw) in enumerate(hf.items()):
        files[sorted(files)[j % 2]][n] = w[gw].clone()
    if tied:
        files["model-00002-of-00002.safetensors"]["lm_head.weight"] = w["embed_tokens.weight"].clone()
    for f, d in files.items():
        save_file(d, str(tmp_path / f))
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {n: f for f, d in files.items() for n in d}}))
    assert_same_weights(load_checkpoint(g, tmp_path, llama), w)
    out = tmp_path / "rewritten"
    write_checkpoint(w, g, llama, out, shards=2)
    assert_same_weights(load_checkpoint(g, out, llama), w)
