"""Config from the checkpoint: a K3-format folder's own config.json gives the graph.

A checkpoint whose dims match no named config loads with no --config and no --set, and its
logits match the independent plain-torch K3 (tests/independent/k3_torch.py) in fp32, fed the
tensors read straight from the shards with safetensors (not through fusec.checkpoint). The
config.json texts below are written out by hand with the published K3 keys
(shared/models/KIMI_K3.md, S1), not produced by the reader under test; naming a config that
disagrees lists every field that differs, in one line.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_writer import write_k3_checkpoint
from independent.k3_torch import K3Decoder
from numerics_harness import rel_err

import fusec
from fusec.checkpoint import CheckpointError
from fusec.loader import ModelError
from fusec.models import kimi_k3
from fusec.weights import random_weights

K3 = "models/kimi_k3.py"
ROOT = Path(__file__).resolve().parent.parent

# Dims unlike any named config. Layers 1 and 4 are MLA (1-based 2 and 5 in config.json), layers 0
# and 1 dense, AttnRes blocks freeze at layers 0, 2 and 4.
ODD = dict(vocab=1000, hidden=192, layers=5, mla_layers=(1, 4), dense_layers=(0, 1), dense_inter=384,
           rms_eps=1e-6, attn_res_block=2, mla_heads=3, q_lora=96, kv_lora=48, qk_nope=24, qk_rope=8, v_dim=16,
           kda_heads=3, kda_head_dim=32, conv_width=3, a_log_len=4, f_rank=32, experts=10, topk=3,
           expert_inter=96, latent=128, shared_inter=192, routed_scale=2.5, expert_dtype="mxfp4")
# Fields config.json does not state: fusec's MLA layernorm eps (vLLM's value) and A_log read per head.
ODD_UNSTATED = dict(mla_eps=1e-5, a_log_broadcast="head")

MXFP4_QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
               "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                             "weights": {"group_size": 32, "num_bits": 4, "type": "float",
                                                         "strategy": "group", "symmetric": True}}},
               "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                          "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}

ODD_JSON = {
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "tie_word_embeddings": False,
    "text_config": {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": 1000, "hidden_size": 192, "num_hidden_layers": 5, "intermediate_size": 384,
        "rms_norm_eps": 1e-6, "attn_res_block_size": 2, "first_k_dense_replace": 2, "moe_layer_freq": 1,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 96, "kv_lora_rank": 48,
        "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "num_heads": 3, "head_dim": 32,
                               "short_conv_kernel_size": 3, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_experts": 10, "num_experts_per_token": 3, "moe_intermediate_size": 96, "num_shared_experts": 2,
        "routed_expert_hidden_size": 128, "routed_scaling_factor": 2.5, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
        "dtype": "bfloat16", "quantization_config": MXFP4_QUANT,
    },
    "vision_config": {"vt_hidden_size": 64, "text_hidden_size": 192},
}

# The published K3 text config (S1), the keys the decode graph depends on.
FULL_JSON = {
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "intermediate_size": 33792, "rms_norm_eps": 1e-05, "attn_res_block_size": 12, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64,
                                                    68, 72, 76, 80, 84, 88, 92, 93],
                               "kda_layers": [n for n in range(1, 94) if n % 4 and n not in (93,)],
                               "gate_lower_bound": -5.0, "head_dim": 128, "num_heads": 96,
                               "short_conv_kernel_size": 4, "use_full_rank_gate": True},
        "num_experts": 896, "num_experts_per_token": 16, "moe_intermediate_size": 3072, "num_shared_experts": 2,
        "routed_expert_hidden_size": 3584, "routed_scaling_factor": 1.0, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "quantization_config": MXFP4_QUANT,
    },
}


def _write(folder: Path, dims: dict, doc: dict | None, seed: int = 3) -> dict:
    """A published-layout checkpoint of `dims` (graph weights drawn at random) plus `doc` as its
    config.json; returns the weights."""
    w = random_weights(kimi_k3.build_graph("tiny", **dims), seed, kimi_k3.WEIGHT_INIT)
    write_k3_checkpoint(SimpleNamespace(**dims), w, folder, shards=2)
    if doc is not None:
        (folder / "config.json").write_text(json.dumps(doc, indent=2))
    return w


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3odd")
    # Weight seed 7 with token seed 11: the oracle's 3rd and 4th router scores stay >= 4e-3 apart
    # in every step and layer (seed 5 has a 1-ulp near-tie at layer 4 of step 2, where two fp32
    # implementations may legitimately pick different experts).
    _write(folder, ODD, ODD_JSON, seed=7)
    return folder


class _Mx:   # the oracle's MXFP4 container: anything with .packed and .scale
    def __init__(self, packed, scale):
        self.packed, self.scale = packed, scale


def _read_shards(folder: Path) -> dict:
    """Published name -> tensor, straight from the shards; per-expert MXFP4 tensors stacked into
    `...experts.wN` containers, as the oracle takes them."""
    flat = {}
    for f in sorted(folder.glob("*.safetensors")):
        flat.update(load_file(f))
    out, experts = {}, {}
    for name, t in flat.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(w[123])\.weight_(packed|scale)", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {}).setdefault(m[4], {})[int(m[2])] = t
        else:
            out[name] = t
    for name, parts in experts.items():
        stack = {k: torch.stack([v[e] for e in range(len(v))]) for k, v in parts.items()}
        out[name] = _Mx(stack["packed"], stack["scale"])
    return out


def test_checkpoint_with_its_own_config_loads_without_overrides_and_matches_independent(odd):
    step = fusec.compile(K3, weights=odd, precision="fp32", batch=3, max_len=16)
    assert step.graph.name == "kimi_k3_checkpoint"
    oracle = K3Decoder(SimpleNamespace(**ODD, **ODD_UNSTATED), _read_shards(odd), 3, 16)
    gen = torch.Generator().manual_seed(11)
    off = torch.tensor([0, 2, 5], dtype=torch.int32)
    for t in range(6):
        tokens = torch.randint(0, ODD["vocab"], (3,), generator=gen, dtype=torch.int32)
        out = step(tokens, off + t)
        want = oracle.step(tokens, off + t)
        err = rel_err(out.logits, want)
        assert err < 1e-5, f"step {t}: logits rel err {err:.3g}"
        assert torch.equal(out.next_tokens.long(), want.argmax(-1)), f"step {t}: greedy tokens differ"


# Every field config.json determines differs from `tiny`, except expert_dtype (mxfp4 in both) and
# f_rank (32 in both).
TINY_VS_ODD = {"vocab": (1000, 4096), "hidden": (192, 512), "layers": (5, 9), "mla_layers": ("1,4", "3,7,8"),
               "dense_layers": ("0,1", "0"), "dense_inter": (384, 1024), "rms_eps": (1e-06, 1e-05),
               "attn_res_block": (2, 3), "mla_heads": (3, 4), "q_lora": (96, 128), "kv_lora": (48, 64),
               "qk_nope": (24, 32), "qk_rope": (8, 16), "v_dim": (16, 32), "kda_heads": (3, 4),
               "kda_head_dim": (32, 64), "conv_width": (3, 4), "a_log_len": (4, 8), "experts": (10, 32),
               "topk": (3, 4), "expert_inter": (96, 128), "latent": (128, 256), "shared_inter": (192, 256),
               "routed_scale": (2.5, 1.0)}


def test_named_config_that_disagrees_lists_every_field(odd):
    with pytest.raises(ModelError) as e:
        fusec.compile(K3, "tiny", weights=odd)
    msg = str(e.value)
    assert "\n" not in msg and "config.json and config 'tiny' disagree on 24 fields" in msg, msg
    for field, (ckpt, named) in TINY_VS_ODD.items():
        assert f"{field} (config.json {ckpt}, tiny {named})" in msg, field


def test_cli_run_reads_the_config_and_reports_disagreements_in_one_line(odd):
    ok = subprocess.run([sys.executable, "-m", "fusec", "run", K3, "--weights", str(odd), "--steps", "2"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("step ") == 2
    bad = subprocess.run([sys.executable, "-m", "fusec", "run", K3, "--config", "tiny", "--set", "topk=3",
                          "--weights", str(odd), "--steps", "1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("fusec: error: ") and "config 'tiny' with --set disagree on 23 fields" in bad.stderr
    assert all(f"{f} (config.json" in bad.stderr for f in TINY_VS_ODD if f != "topk")


def test_overrides_may_set_only_what_config_json_leaves_open(odd):
    step = fusec.compile(K3, weights=odd, overrides={"mla_eps": 1e-6, "hidden": 192}, max_len=4)
    assert step.graph.name == "kimi_k3_checkpoint"
    with pytest.raises(ModelError, match=r"config.json and --set disagree on 2 fields: hidden \(config.json 192, "
                                         r"--set 512\), experts \(config.json 10, --set 12\)$"):
        fusec.compile(K3, weights=odd, overrides={"hidden": 512, "experts": 12, "mla_eps": 1e-6})


def test_checkpoint_of_a_named_config_takes_its_name(tmp_path):
    tiny = kimi_k3.get_config("tiny")
    dims = {f: getattr(tiny, f) for f in ODD}
    doc = copy.deepcopy(ODD_JSON)
    t = doc["text_config"]
    t.update(vocab_size=4096, hidden_size=512, num_hidden_layers=9, intermediate_size=1024, rms_norm_eps=1e-5,
             attn_res_block_size=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             num_experts=32, num_experts_per_token=4, moe_intermediate_size=128, routed_expert_hidden_size=256,
             routed_scaling_factor=1.0)
    t["linear_attn_config"].update(full_attn_layers=[4, 8, 9], kda_layers=[1, 2, 3, 5, 6, 7], num_heads=4,
                                   head_dim=64, short_conv_kernel_size=4)
    # tiny's shared expert is 256 wide = 2 x 128
    _write(tmp_path, dims, doc)
    assert fusec.compile(K3, weights=tmp_path, max_len=4).graph.name == "kimi_k3_tiny"
    assert fusec.compile(K3, "tiny", weights=tmp_path, max_len=4).graph.name == "kimi_k3_tiny"


def test_published_full_config_is_the_full_config():
    fields = kimi_k3.config_from_checkpoint(FULL_JSON)
    full = kimi_k3.get_config("full")
    assert fields == {k: getattr(full, k) for k in fields}
    # all but the header-derived dims (a_log_len, f_rank: no shards here) and the unstated ones
    assert set(fields) == set(ODD) - {"a_log_len", "f_rank"}


def test_every_config_json_problem_in_one_error(odd, tmp_path):
    doc = copy.deepcopy(ODD_JSON)
    t = doc["text_config"]
    del t["hidden_size"]
    t.update(mla_use_nope=False, moe_layer_freq=2, num_key_value_heads=1, kv_lora_rank="48")
    t["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4]
    for f in odd.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ModelError) as e:
        fusec.compile(K3, weights=tmp_path)
    msg = str(e.value)
    assert "6 problems" in msg and "\n" not in msg, msg
    for part in ("hidden_size missing", "mla_use_nope = false", "moe_layer_freq = 2", "num_key_value_heads = 1",
                 'kv_lora_rank = "48"', "full_attn_layers and kda_layers do not split layers 1..5"):
        assert part in msg, part


def test_malformed_config_json(odd, tmp_path):
    for f in odd.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").write_text('{"text_config": {')
    with pytest.raises(CheckpointError, match=r"config.json: malformed json: .* at line 1"):
        fusec.compile(K3, weights=tmp_path)
