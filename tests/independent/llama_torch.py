"""Llama decode in plain PyTorch, written from the HF LlamaForCausalLM description alone.

An oracle for the reference executor: no fusec op, ref, builder or executor code. Weights are
keyed by HF checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight` unless the embeddings are tied). Formulated differently from the graph on purpose:
RoPE as a complex rotation of (x[:d/2], x[d/2:]) pairs with frequencies from a scalar loop;
GQA by repeating kv heads (HF `repeat_kv`); attention one sequence at a time over its own prefix.
All math and the KV cache are fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def llama3_inv_freq(head_dim, theta, factor, low, high, original) -> list[float]:
    """HF `_compute_llama3_parameters`, one frequency at a time (factor <= 1: plain RoPE)."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        if factor > 1.0:
            wavelen = 2 * math.pi / f
            if wavelen > original / low:          # long wavelengths: interpolate
                f = f / factor
            elif wavelen >= original / high:      # medium: blend
                smooth = (original / wavelen - low) / (high - low)
                f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return out


class LlamaDecoder:
    def __init__(self, cfg, weights: dict, batch: int, max_len: int):
        self.c = cfg
        self.w = {n: t.to(torch.float32) for n, t in weights.items()}
        self.inv_freq = torch.tensor(llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_factor,
                                                     cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                                     cfg.rope_original_max_pos), dtype=torch.float64)
        shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape) for _ in range(cfg.layers)]

    def W(self, name):
        return self.w["model." + name]

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_eps) * self.W(name)

    def rotate(self, x, pos):
        """x [B, heads, D]; pair (j, j + D/2) rotated by pos * inv_freq[j]."""
        half = x.shape[-1] // 2
        angle = pos.to(torch.float64)[:, None] * self.inv_freq[None]              # [B, D/2]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
            torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([z.real, z.imag], -1).to(torch.float32)

    @torch.no_grad()
    def step(self, tokens, pos):
        c = self.c
        B, D, G = tokens.shape[0], c.head_dim, c.heads // c.kv_heads
        x = self.W("embed_tokens.weight")[tokens.long()]
        for i in range(c.layers):
            a = f"layers.{i}.self_attn."
            h = self.norm(x, f"layers.{i}.input_layernorm.weight")
            q = self.rotate((h @ self.W(a + "q_proj.weight").T).view(B, c.heads, D), pos)
            k = self.rotate((h @ self.W(a + "k_proj.weight").T).view(B, c.kv_heads, D), pos)
            v = (h @ self.W(a + "v_proj.weight").T).view(B, c.kv_heads, D)
            out = []
            for b in range(B):
                p = int(pos[b])
                self.k[i][b, p], self.v[i][b, p] = k[b], v[b]
                keys = self.k[i][b, :p + 1].repeat_interleave(G, dim=1)            # [n, heads, D]
                vals = self.v[i][b, :p + 1].repeat_interleave(G, dim=1)
                att = torch.softmax(torch.einsum("hd,nhd->hn", q[b], keys) / math.sqrt(D), -1)
                out.append(torch.einsum("hn,nhd->hd", att, vals).reshape(-1))
            x = x + torch.stack(out) @ self.W(a + "o_proj.weight").T
            h = self.norm(x, f"layers.{i}.post_attention_layernorm.weight")
            m = f"layers.{i}.mlp."
            x = x + (F.silu(h @ self.W(m + "gate_proj.weight").T) * (h @ self.W(m + "up_proj.weight").T)) \
                @ self.W(m + "down_proj.weight").T
        h = self.norm(x, "norm.weight")
        head = self.W("embed_tokens.weight") if c.tie_embeddings else self.w["lm_head.weight"]
        return h @ head.T
