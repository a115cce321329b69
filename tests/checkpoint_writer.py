"""Test helper: the published Kimi K3 checkpoint layout, spelled out from KIMI_K3.md, and a writer.

`k3_published_tensors(cfg)` lists every text tensor of the published checkpoint ("Checkpoint
format" table in shared/models/KIMI_K3.md) with its shape and dtype for a K3Config, written
out here by hand from the table, independently of fusec.checkpoint, so the loader's naming is
checked against the spec rather than against itself. `write_k3_checkpoint` writes a synthetic
checkpoint in that exact format (shards, index json, per-expert MXFP4 tensors, vision tensors)
with safetensors directly. `checkpoint_variant` copies a written checkpoint with an edited index
or an extra shard (the error tests).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from fusec.ir.quant import MXFP4Tensor

BF16, F32, U8 = "BF16", "F32", "U8"
TORCH = {BF16: torch.bfloat16, F32: torch.float32, U8: torch.uint8}
LM = "language_model.model."

# A few vision-tower tensors as a multimodal checkpoint carries them; decode must ignore them.
VISION = {
    "vision_tower.patch_embed.proj.weight": ([64, 3, 14, 14], BF16),
    "vision_tower.encoder.blocks.0.attn.qkv.weight": ([192, 64], BF16),
    "vision_tower.encoder.blocks.0.norm0.weight": ([64], BF16),
    "multi_modal_projector.linear_1.weight": ([512, 256], BF16),
}


def k3_published_tensors(c) -> dict[str, tuple[list[int], str, tuple]]:
    """Published name -> (shape, dtype, source); source = (graph weight, expert, part) or None.

    part is "packed" / "scale" for MXFP4 experts, "whole" otherwise; source None means the
    published checkpoint holds a tensor the decode graph does not read (layer 0's mixer AttnRes).
    """
    H, W, hd = c.hidden, c.kda_heads * c.kda_head_dim, c.qk_nope + c.qk_rope
    t: dict = {}

    def add(name, shape, dtype, graph_name="", expert=None, part="whole"):
        src = None if graph_name is None else (graph_name or name.removeprefix(LM), expert, part)
        t[name] = (list(shape), dtype, src)

    add(LM + "embed_tokens.weight", [c.vocab, H], BF16)
    add("language_model.lm_head.weight", [c.vocab, H], BF16, "lm_head.weight")
    add(LM + "norm.weight", [H], BF16)
    add(LM + "output_attn_res_norm.weight", [H], BF16)
    add(LM + "output_attn_res_proj.weight", [1, H], BF16)
    for i in range(c.layers):
        L = f"{LM}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(L + n + ".weight", [H], BF16, None if i == 0 and n == "self_attention_res_norm" else "")
        add(L + "self_attention_res_proj.weight", [1, H], BF16, None if i == 0 else "")
        add(L + "mlp_res_proj.weight", [1, H], BF16)
        a = L + "self_attn."
        if i in c.mla_layers:
            add(a + "q_a_proj.weight", [c.q_lora, H], BF16)
            add(a + "q_a_layernorm.weight", [c.q_lora], BF16)
            add(a + "q_b_proj.weight", [c.mla_heads * hd, c.q_lora], BF16)
            add(a + "kv_a_proj_with_mqa.weight", [c.kv_lora + c.qk_rope, H], BF16)
            add(a + "kv_a_layernorm.weight", [c.kv_lora], BF16)
            add(a + "kv_b_proj.weight", [c.mla_heads * (c.qk_nope + c.v_dim), c.kv_lora], BF16)
            add(a + "g_proj.weight", [c.mla_heads * c.v_dim, H], BF16)
            add(a + "o_proj.weight", [H, c.mla_heads * c.v_dim], BF16)
        else:
            for n in ("q", "k", "v", "g"):
                add(a + f"{n}_proj.weight", [W, H], BF16)
            for n in ("q", "k", "v"):
                add(a + f"{n}_conv1d.weight", [W, 1, c.conv_width], F32)
            add(a + "f_a_proj.weight", [c.f_rank, H], BF16)
            add(a + "f_b_proj.weight", [W, c.f_rank], BF16)
            add(a + "A_log", [c.a_log_len], F32)
            add(a + "dt_bias", [W], F32)
            add(a + "b_proj.weight", [c.kda_heads, H], BF16)
            add(a + "o_norm.weight", [c.kda_head_dim], F32)
            add(a + "o_proj.weight", [H, W], BF16)
        if i in c.dense_layers:
            add(L + "mlp.gate_proj.weight", [c.dense_inter, H], BF16)
            add(L + "mlp.up_proj.weight", [c.dense_inter, H], BF16)
            add(L + "mlp.down_proj.weight", [H, c.dense_inter], BF16)
            continue
        m = L + "block_sparse_moe."
        add(m + "gate.weight", [c.experts, H], BF16)
        add(m + "gate.e_score_correction_bias", [c.experts], F32)
        add(m + "routed_expert_down_proj.weight", [c.latent, H], BF16)
        add(m + "routed_expert_norm.weight", [c.latent], BF16)
        add(m + "routed_expert_up_proj.weight", [H, c.latent], BF16)
        add(m + "shared_experts.gate_proj.weight", [c.shared_inter, H], BF16)
        add(m + "shared_experts.up_proj.weight", [c.shared_inter, H], BF16)
        add(m + "shared_experts.down_proj.weight", [H, c.shared_inter], BF16)
        g = m.removeprefix(LM) + "experts."
        for e in range(c.experts):
            for wn, (rows, k) in (("w1", (c.expert_inter, c.latent)), ("w2", (c.latent, c.expert_inter)),
                                  ("w3", (c.expert_inter, c.latent))):
                x = f"{m}experts.{e}.{wn}."
                if c.expert_dtype == "mxfp4":
                    add(x + "weight_packed", [rows, k // 2], U8, g + wn, e, "packed")
                    add(x + "weight_scale", [rows, k // 32], U8, g + wn, e, "scale")
                else:
                    add(x + "weight", [rows, k], BF16, g + wn, e, "whole")
    return t


def _data(name, shape, dtype, src, weights, gen):
    if src is None:   # published but unused by decode: any values
        return torch.randn(shape, generator=gen).to(TORCH[dtype])
    w, expert, part = src
    x = weights[w]
    if isinstance(x, MXFP4Tensor):
        x = x.packed if part == "packed" else x.scale
    if expert is not None:
        x = x[expert]
    x = x.contiguous().clone()
    assert list(x.shape) == shape and x.dtype == TORCH[dtype], \
        f"graph weight for {name} is {x.dtype} {list(x.shape)}, spec says {dtype} {shape}"
    return x


def write_k3_checkpoint(c, weights, folder, shards: int = 3, vision: bool = True) -> dict:
    """Write `weights` (graph name -> tensor) as the published K3 layout; returns the index dict."""
    os.makedirs(folder, exist_ok=True)
    table = k3_published_tensors(c)
    gen = torch.Generator().manual_seed(1234)
    names = list(table)
    if vision:   # the published checkpoint puts the vision tower in the last shard
        names += list(VISION)
        table = {**table, **{k: (s, d, None) for k, (s, d) in VISION.items()}}
    per = -(-len(names) // shards)
    wmap, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n in names[i * per:(i + 1) * per]:
            shape, dtype, src = table[n]
            part[n] = _data(n, shape, dtype, src, weights, gen)
            total += part[n].numel() * part[n].element_size()
            wmap[n] = fname
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": wmap}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
    return index


def checkpoint_variant(ckpt, tmp_path, edit_map=None, extra: dict | None = None, index_text: str | None = None):
    """A copy of the checkpoint `ckpt` = (.., .., folder, index dict) in tmp_path: its shards
    symlinked, the index's weight map edited by `edit_map(wm)` in place, `extra` tensors in an
    extra shard, or the index replaced by `index_text`."""
    _, _, folder, index = ckpt
    for f in set(index["weight_map"].values()):
        (tmp_path / f).symlink_to(folder / f)
    wm = dict(index["weight_map"])
    if extra:
        save_file(extra, str(tmp_path / "extra.safetensors"))
        wm.update({n: "extra.safetensors" for n in extra})
    if edit_map:
        edit_map(wm)
    (tmp_path / "model.safetensors.index.json").write_text(
        index_text if index_text is not None else json.dumps({"weight_map": wm}))
    return tmp_path
