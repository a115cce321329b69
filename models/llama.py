"""Dense Llama decode step (LlamaForCausalLM): GQA attention with RoPE (Llama-3 frequency
scaling), SwiGLU MLP, RMSNorm, pre-norm residuals; optional tied embeddings.

Configs: `llama-3.2-1b` (default; the published HF config) and `tiny` (CPU tests); any field can
be overridden, e.g. `build_graph("tiny", tie_embeddings=False)`. Weights are named by their HF
checkpoint path without the `model.` prefix (`layers.{i}.self_attn.q_proj.weight`, ...;
`lm_head.weight` as is); `checkpoint_name` maps them back. With tied embeddings the head reads
`embed_tokens.weight` and no `lm_head.weight` is declared.

KV caches are state `[B, L, kv_heads * head_dim]` per layer, written with `cache_append` at each
sequence's position; keys are cached after RoPE (as HF does), so the cache is position-final.
"""
from __future__ import annotations

from dataclasses import dataclass

from fusec.ir.builder import GraphBuilder
from fusec.modelconfig import select_config
from fusec.ir.graph import Graph
from fusec.ir.types import DType

BF16, I32 = DType.bf16, DType.i32


@dataclass(frozen=True)
class LlamaConfig:
    name: str = "llama-3.2-1b"
    vocab: int = 128256
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    inter: int = 8192
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    # rope_scaling {"rope_type": "llama3", ...}; factor 1.0 disables it
    rope_factor: float = 32.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    tie_embeddings: bool = True


CONFIGS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(),
    "tiny": LlamaConfig(name="tiny", vocab=1024, hidden=256, layers=3, heads=8, kv_heads=2, head_dim=32, inter=512),
}
DEFAULT_CONFIG = "llama-3.2-1b"

# How the shard pass splits each linear over a tensor-parallel group (GraphBuilder.finish puts
# them on the weights as param attr `tp`; a tied lm head is the embedding table: whole).
TP_ROLES = [
    ("*.q_proj.weight", "col"), ("*.k_proj.weight", "col"), ("*.v_proj.weight", "col"),
    ("*.gate_proj.weight", "col"), ("*.up_proj.weight", "col"),
    ("*.o_proj.weight", "row"), ("*.down_proj.weight", "row"),
    ("lm_head.weight", "vocab"),
]


def get_config(config: str | LlamaConfig = DEFAULT_CONFIG, **overrides) -> LlamaConfig:
    c = select_config("llama", CONFIGS, config, overrides)
    if c.heads % c.kv_heads:
        raise ValueError(f"llama config: heads ({c.heads}) must be a multiple of kv_heads ({c.kv_heads})")
    return c


def build_graph(config: str | LlamaConfig = DEFAULT_CONFIG, **overrides) -> Graph:
    """The whole decode step: tokens, positions -> logits and greedy next tokens."""
    c = get_config(config, **overrides)
    b = GraphBuilder(f"llama_{c.name}".replace("-", "_").replace(".", "_"), dims=("B", "L"))
    tokens = b.io("tokens", ["B"], I32)
    pos = b.io("pos", ["B"], I32)
    embed = b.weight("embed_tokens.weight", [c.vocab, c.hidden])
    x = b.op("embedding", embed, tokens, name="embed")
    for i in range(c.layers):
        p = f"layers.{i}."
        with b.scope(f"l{i}"):
            h = b.op("rms_norm", x, b.weight(p + "input_layernorm.weight", [c.hidden]), eps=c.rms_eps,
                     name="attn_in")
            x = b.op("add", x, _attention(b, c, p, h, pos), name="resid_attn")
            h = b.op("rms_norm", x, b.weight(p + "post_attention_layernorm.weight", [c.hidden]), eps=c.rms_eps,
                     name="ffn_in")
            x = b.op("add", x, _mlp(b, c, p + "mlp.", h), name="resid_ffn")
    with b.scope("out"):
        h = b.op("rms_norm", x, b.weight("norm.weight", [c.hidden]), eps=c.rms_eps, name="norm")
        head = embed if c.tie_embeddings else b.weight("lm_head.weight", [c.vocab, c.hidden])
        logits = b.op("linear", h, head, out_dtype="f32", name="logits")
        nxt = b.op("argmax", logits, name="next_token")
    return b.finish([logits, nxt], tp_roles=TP_ROLES)


def _attention(b, c, p, h, pos):
    a = p + "self_attn."
    q_w, kv_w = c.heads * c.head_dim, c.kv_heads * c.head_dim
    rope = dict(head_dim=c.head_dim, theta=c.rope_theta, scaling_factor=c.rope_factor,
                low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                original_max_pos=c.rope_original_max_pos)

    def proj(n, out):
        return b.op("linear", h, b.weight(a + n + ".weight", [out, c.hidden]), name=n)

    q = b.op("rope", proj("q_proj", q_w), pos, name="q_rope", **rope)
    k = b.op("rope", proj("k_proj", kv_w), pos, name="k_rope", **rope)
    v = proj("v_proj", kv_w)
    caches = []
    for n, row in (("k", k), ("v", v)):
        cache = b.state(f"{p}attn.{n}_cache", ["B", "L", kv_w], BF16)
        new = b.op("cache_append", cache, row, pos, name=f"{n}_cache")
        b.g.update(cache, new)
        caches.append(new)
    o = b.op("attention", q, *caches, pos, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
             scale=c.head_dim ** -0.5, name="attn")
    return b.op("linear", o, b.weight(a + "o_proj.weight", [c.hidden, q_w]), name="o_proj")


def _mlp(b, c, m, h):
    g = b.op("linear", h, b.weight(m + "gate_proj.weight", [c.inter, c.hidden]), name="gate_proj")
    u = b.op("linear", h, b.weight(m + "up_proj.weight", [c.inter, c.hidden]), name="up_proj")
    act = b.op("silu_mul", g, u, name="swiglu")
    return b.op("linear", act, b.weight(m + "down_proj.weight", [c.hidden, c.inter]), name="down_proj")


# Random-init rules (fnmatch on weight names; first match wins) for tests and benchmarks.
WEIGHT_INIT = [
    ("embed_tokens.weight", "normal"),
]

CHECKPOINT_PREFIX = "model."
CHECKPOINT_RENAMES = {"lm_head.weight": "lm_head.weight"}
# With tied embeddings HF checkpoints may still carry lm_head.weight (a copy); the graph does not read it.
CHECKPOINT_UNUSED = ["lm_head.weight"]


def checkpoint_name(weight: str) -> str:
    return CHECKPOINT_RENAMES.get(weight, CHECKPOINT_PREFIX + weight)
