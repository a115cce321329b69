"""Kimi K3 decode in plain PyTorch, written from shared/models/KIMI_K3.md alone.

An oracle for the reference executor: it uses no fusec op, ref, builder or executor code.
It reads a config object (the fields of models/kimi_k3.K3Config) and a weights dict keyed by
the published checkpoint names (`language_model.model.layers.{i}...`, `language_model.lm_head.weight`);
stacked routed-expert weights `...experts.w1` / `.w2` / `.w3` may be one MXFP4 container (anything
with `.packed` [E, N, K/2] u8 and `.scale` [E, N, K/32] u8) or a float tensor [E, N, K].

Deliberately different formulations from the graph: MXFP4 is decoded bit by bit from the spec;
the short conv is `F.conv1d` over a rolling buffer; KDA runs as matrix products per head; MLA is the
textbook UNABSORBED form (the latent cache is decompressed with kv_b_proj into per-head k_nope
and v, one sequence at a time); routed experts are evaluated token by token.

All math is fp32; state (conv buffers, recurrent state, latent cache) is held here, in fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # index = bits 0-2 of a nibble
MX_GROUP = 32                                                  # inputs per E8M0 scale
E8M0_BIAS = 127


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 (compressed-tensors): packed [.., N, K/2] u8 (low nibble = even element), scale [.., N, K/32]."""
    p = packed.to(torch.int64)
    k = p.shape[-1] * 2
    nib = torch.empty((*p.shape[:-1], k), dtype=torch.int64)
    nib[..., 0::2] = p & 0xF          # element 2j
    nib[..., 1::2] = (p >> 4) & 0xF   # element 2j+1
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[nib & 0x7]
    sign = torch.where((nib & 0x8) != 0, -1.0, 1.0).to(torch.float64)
    factor = torch.pow(2.0, scale.to(torch.float64) - E8M0_BIAS)          # E8M0: 2^(byte - 127)
    factor = factor.repeat_interleave(MX_GROUP, dim=-1)                   # group j -> cols [32j, 32j+32)
    return (sign * mag * factor).to(torch.float32)


def as_float(w) -> torch.Tensor:
    if hasattr(w, "packed") and hasattr(w, "scale"):
        return mxfp4_decode(w.packed, w.scale)
    return w.to(torch.float32)


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))


def mla_unabsorbed(q_nope, q_pe, cache, kv_b, pos, *, heads, nope, rope, kv_lora, v_dim, scale):
    """Textbook MLA over a latent cache [B, L, kv_lora + rope]: decompress keys and values per head.

    q_nope [B, H, nope], q_pe [B, H, rope], kv_b [H*(nope+v), kv_lora] (per head: nope key rows, then
    v value rows); sequence b attends to cache rows 0..pos[b]. Returns [B, H*v].
    """
    out = []
    for b in range(q_nope.shape[0]):
        n = int(pos[b]) + 1
        lat, k_pe = cache[b, :n, :kv_lora], cache[b, :n, kv_lora:]
        kv = (lat @ kv_b.T).view(n, heads, nope + v_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(n, heads, rope)], -1)      # [n, H, nope+rope]
        q = torch.cat([q_nope[b], q_pe[b]], -1)                                   # [H, nope+rope]
        att = torch.softmax((k * q[None]).sum(-1) * scale, dim=0)                # [n, H] over rows
        out.append((att[..., None] * v).sum(0).reshape(-1))
    return torch.stack(out)


class K3Decoder:
    """Holds the weights (as fp32) and the decode state for `batch` sequences of up to `max_len` tokens."""

    def __init__(self, cfg, weights: dict, batch: int, max_len: int):
        self.c = cfg
        self.w = {n: as_float(t) for n, t in weights.items()}
        c, B = cfg, batch
        self.conv = {}      # layer -> {"q"|"k"|"v": [B, C, W-1] past inputs, oldest first}
        self.rec = {}       # layer -> [B, H, Dk, Dv]
        self.cache = {}     # layer -> [B, L, kv_lora + rope]
        for i in range(c.layers):
            if i in c.mla_layers:
                self.cache[i] = torch.zeros(B, max_len, c.kv_lora + c.qk_rope)
            else:
                width = c.kda_heads * c.kda_head_dim
                self.conv[i] = {n: torch.zeros(B, width, c.conv_width - 1) for n in "qkv"}
                self.rec[i] = torch.zeros(B, c.kda_heads, c.kda_head_dim, c.kda_head_dim)

    def W(self, name: str) -> torch.Tensor:
        return self.w[PREFIX + name]

    # -- pieces ------------------------------------------------------------------------------
    def attn_res(self, prefix: str, sources: list[torch.Tensor]) -> torch.Tensor:
        key = self.W(prefix + "_norm.weight") * self.W(prefix + "_proj.weight")[0]
        logits = torch.stack([(rms(v, None, self.c.rms_eps) * key).sum(-1) for v in sources], -1)  # [B, J]
        p = torch.softmax(logits, -1)
        h = torch.zeros_like(sources[0])
        for j, v in enumerate(sources):
            h = h + p[:, j:j + 1] * v
        return h

    def short_conv(self, i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.W(f"layers.{i}.self_attn.{name}_conv1d.weight")                 # [C, 1, W]
        buf = torch.cat([self.conv[i][name], x[..., None]], -1)                  # [B, C, W], newest last
        self.conv[i][name] = buf[..., 1:]
        y = F.conv1d(buf, w, groups=w.shape[0])[..., 0]                          # causal: tap W-1 = now
        return F.silu(y)

    def kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, a = self.c, f"layers.{i}.self_attn."
        H, D = c.kda_heads, c.kda_head_dim
        B = x.shape[0]
        heads = lambda t: t.view(B, H, D)
        q = heads(self.short_conv(i, "q", x @ self.W(a + "q_proj.weight").T))
        k = heads(self.short_conv(i, "k", x @ self.W(a + "k_proj.weight").T))
        v = heads(self.short_conv(i, "v", x @ self.W(a + "v_proj.weight").T))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (x @ self.W(a + "f_a_proj.weight").T) @ self.W(a + "f_b_proj.weight").T
        A = self.W(a + "A_log")
        if c.a_log_broadcast == "head":
            A = A[:H][:, None].expand(H, D)
        else:
            A = A[:H * D].view(H, D)
        g = -5.0 * torch.sigmoid(torch.exp(A) * heads(f + self.W(a + "dt_bias")))   # [B, H, D] log decay
        beta = torch.sigmoid(x @ self.W(a + "b_proj.weight").T)                         # [B, H]
        S = self.rec[i] * torch.exp(g)[..., None]                                       # diag(exp g) S
        kS = (k[:, :, None, :] @ S)[:, :, 0]                                            # k^T S  [B, H, Dv]
        S = S + beta[..., None, None] * (k[..., :, None] @ (v - kS)[..., None, :])
        self.rec[i] = S
        o = (q[:, :, None, :] @ S)[:, :, 0]                                             # q^T S
        gate = heads(x @ self.W(a + "g_proj.weight").T)
        o = rms(o, self.W(a + "o_norm.weight"), c.rms_eps) * torch.sigmoid(gate)
        return o.reshape(B, H * D) @ self.W(a + "o_proj.weight").T

    def mla(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, a = self.c, f"layers.{i}.self_attn."
        B, H, hd = x.shape[0], c.mla_heads, c.qk_nope + c.qk_rope
        qa = rms(x @ self.W(a + "q_a_proj.weight").T, self.W(a + "q_a_layernorm.weight"), c.mla_eps)
        q = (qa @ self.W(a + "q_b_proj.weight").T).view(B, H, hd)
        kv = x @ self.W(a + "kv_a_proj_with_mqa.weight").T
        lat = rms(kv[:, :c.kv_lora], self.W(a + "kv_a_layernorm.weight"), c.mla_eps)
        row = torch.cat([lat, kv[:, c.kv_lora:]], -1)                       # NoPE: k_pe never rotated
        for b in range(B):
            self.cache[i][b, int(pos[b])] = row[b]
        o = mla_unabsorbed(q[..., :c.qk_nope], q[..., c.qk_nope:], self.cache[i], self.W(a + "kv_b_proj.weight"),
                           pos, heads=H, nope=c.qk_nope, rope=c.qk_rope, kv_lora=c.kv_lora, v_dim=c.v_dim,
                           scale=1.0 / math.sqrt(hd))
        o = o * torch.sigmoid(x @ self.W(a + "g_proj.weight").T)
        return o @ self.W(a + "o_proj.weight").T

    def glu_mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g = x @ self.W(prefix + "gate_proj.weight").T
        u = x @ self.W(prefix + "up_proj.weight").T
        return situ_glu(g, u) @ self.W(prefix + "down_proj.weight").T

    def latent_moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, m = self.c, f"layers.{i}.block_sparse_moe."
        scores = torch.sigmoid(x @ self.W(m + "gate.weight").T)                         # [B, E]
        chosen = torch.topk(scores + self.W(m + "gate.e_score_correction_bias"), c.topk, -1).indices
        w1, w2, w3 = (self.W(m + f"experts.w{n}") for n in (1, 2, 3))
        lat = x @ self.W(m + "routed_expert_down_proj.weight").T                        # [B, latent]
        combined = []
        for b in range(x.shape[0]):
            raw = scores[b, chosen[b]]
            weights = raw / raw.sum() * c.routed_scale
            acc = torch.zeros(c.latent)
            for wj, e in zip(weights, chosen[b].tolist()):
                h = situ_glu(w1[e] @ lat[b], w3[e] @ lat[b])
                acc = acc + wj * (w2[e] @ h)
            combined.append(acc)
        u = rms(torch.stack(combined), self.W(m + "routed_expert_norm.weight"), c.rms_eps)
        return u @ self.W(m + "routed_expert_up_proj.weight").T + self.glu_mlp(m + "shared_experts.", x)

    # -- one decode step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens, pos [B] -> logits [B, vocab] (fp32); advances the state."""
        c = self.c
        x = self.W("embed_tokens.weight")[tokens.long()]
        blocks: list[torch.Tensor] = []
        partial = x
        for i in range(c.layers):
            L = f"layers.{i}."
            # layer 0's mixer reads the embedding (a single source: AttnRes is the identity)
            h = partial if i == 0 else self.attn_res(L + "self_attention_res", blocks + [partial])
            restart = i % c.attn_res_block == 0
            if restart:
                blocks.append(partial)
            hn = rms(h, self.W(L + "input_layernorm.weight"), c.rms_eps)
            mix = self.mla(i, hn, pos) if i in c.mla_layers else self.kda(i, hn)
            partial = mix if restart else partial + mix
            h = self.attn_res(L + "mlp_res", blocks + [partial])
            hn = rms(h, self.W(L + "post_attention_layernorm.weight"), c.rms_eps)
            ffn = self.glu_mlp(L + "mlp.", hn) if i in c.dense_layers else self.latent_moe(i, hn)
            partial = partial + ffn
        h = self.attn_res("output_attn_res", blocks + [partial])
        return rms(h, self.W("norm.weight"), c.rms_eps) @ self.w[LM_HEAD].T
