"""Kimi K3 decode step (KimiLinearForCausalLM text model), as in shared/models/KIMI_K3.md.

93 layers: KDA linear attention everywhere except the NoPE gated MLA layers 3, 7, ..., 87, 91,
92; a dense SiTU-GLU FFN at layer 0 and Stable LatentMoE (896 MXFP4 experts, top-16, in a
3584-wide latent, plus a 6144-wide shared expert) at layers 1..92; Block Attention Residuals
(block 12) before every mixer and FFN and before the output norm.

Configs: `full` (default), `tiny`, `slice4`, `slice4-e128`; any field can be overridden, e.g.
`build_graph("slice4", attn_res_block=2)` or `fusec compile models/kimi_k3.py --config slice4
--set attn_res_block=2`. Weights are named by their checkpoint path without the
`language_model.model.` prefix; `checkpoint_names` maps them to the published tensors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from fusec.ir.builder import GraphBuilder
from fusec.modelconfig import select_config
from fusec.ir.graph import Graph, Value
from fusec.ir.types import DType

BF16, F32, I32, MXFP4 = DType.bf16, DType.f32, DType.i32, DType.mxfp4


@dataclass(frozen=True)
class K3Config:
    name: str = "full"
    vocab: int = 163840
    hidden: int = 7168
    layers: int = 93
    mla_layers: tuple[int, ...] = tuple(range(3, 88, 4)) + (91, 92)
    dense_layers: tuple[int, ...] = (0,)
    dense_inter: int = 33792
    rms_eps: float = 1e-5
    mla_eps: float = 1e-5          # q_a / kv_a layernorm eps (vLLM's value; HF default would be 1e-6)
    attn_res_block: int = 12
    # MLA
    mla_heads: int = 96
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_dim: int = 128
    # KDA
    kda_heads: int = 96
    kda_head_dim: int = 128
    conv_width: int = 4
    a_log_len: int = 128           # the checkpoint stores 128 floats; the first `kda_heads` are used
    a_log_broadcast: str = "head"  # "head": one A per head (vLLM, SGLang); "channel": per channel
    f_rank: int = 128
    # LatentMoE
    experts: int = 896
    topk: int = 16
    expert_inter: int = 3072
    latent: int = 3584
    shared_inter: int = 6144
    routed_scale: float = 1.0
    expert_dtype: str = "mxfp4"

    @property
    def kda_width(self) -> int:
        return self.kda_heads * self.kda_head_dim

    def is_mla(self, i: int) -> bool:
        return i in self.mla_layers

    def freezes_block(self, i: int) -> bool:
        return i % self.attn_res_block == 0


CONFIGS: dict[str, K3Config] = {
    "full": K3Config(),
    "tiny": K3Config(name="tiny", vocab=4096, hidden=512, layers=9, mla_layers=(3, 7, 8), dense_inter=1024,
                     attn_res_block=3, mla_heads=4, q_lora=128, kv_lora=64, qk_nope=32, qk_rope=16, v_dim=32,
                     kda_heads=4, kda_head_dim=64, a_log_len=8, f_rank=32, experts=32, topk=4,
                     expert_inter=128, latent=256, shared_inter=256),
    "slice4": K3Config(name="slice4", layers=4, mla_layers=(3,)),
    "slice4-e128": K3Config(name="slice4-e128", layers=4, mla_layers=(3,), experts=128, expert_dtype="bf16"),
}
DEFAULT_CONFIG = "full"

# How the shard pass splits each linear over a tensor-parallel group (first match wins; "rep" and
# unmatched: whole). GraphBuilder.finish puts them on the weights as param attr `tp`.
TP_ROLES = [
    ("*.routed_expert_up_proj.weight", "row"),   # input: the normalised full latent (shares the
    ("*.routed_expert_down_proj.weight", "rep"),  # shared expert's all_reduce); latent on every rank
    ("*.q_a_proj.weight", "rep"), ("*.kv_a_proj_with_mqa.weight", "rep"), ("*.f_a_proj.weight", "rep"),
    ("*.q_proj.weight", "col"), ("*.k_proj.weight", "col"), ("*.v_proj.weight", "col"),
    ("*.g_proj.weight", "col"), ("*.b_proj.weight", "col"), ("*.f_b_proj.weight", "col"),
    ("*.q_b_proj.weight", "col"), ("*.gate_proj.weight", "col"), ("*.up_proj.weight", "col"),
    ("*.o_proj.weight", "row"), ("*.down_proj.weight", "row"),
    ("lm_head.weight", "vocab"),    # column-parallel over the largest divisor of R dividing the vocab
]


def get_config(config: str | K3Config = DEFAULT_CONFIG, **overrides) -> K3Config:
    return select_config("kimi_k3", CONFIGS, config, overrides)


def build_graph(config: str | K3Config = DEFAULT_CONFIG, **overrides) -> Graph:
    """The whole decode step: tokens, positions -> logits and greedy next tokens."""
    c = get_config(config, **overrides)
    b = GraphBuilder(f"kimi_k3_{c.name}".replace("-", "_"), dims=("B", "L"))
    tokens = b.io("tokens", ["B"], I32)
    pos = b.io("pos", ["B"], I32)
    x = b.op("embedding", b.weight("embed_tokens.weight", [c.vocab, c.hidden]), tokens, name="embed")
    blocks: list[Value] = []
    partial = x
    for i in range(c.layers):
        p = f"layers.{i}."
        with b.scope(f"l{i}"):
            h = partial if i == 0 else _attn_res(b, c, p + "self_attention_res", blocks, partial, "mix_attn")
            if c.freezes_block(i):
                blocks.append(partial)   # the running residual becomes a block; the partial restarts
                partial = None
            hn = b.op("rms_norm", h, b.weight(p + "input_layernorm.weight", [c.hidden]), eps=c.rms_eps, name="attn_in")
            mix = _mla(b, c, p, hn, pos) if c.is_mla(i) else _kda(b, c, p, hn)
            partial = mix if partial is None else b.op("add", partial, mix, name="resid_attn")
            h = _attn_res(b, c, p + "mlp_res", blocks, partial, "mix_ffn")
            hn = b.op("rms_norm", h, b.weight(p + "post_attention_layernorm.weight", [c.hidden]), eps=c.rms_eps,
                      name="ffn_in")
            ffn = _dense_ffn(b, c, p, hn) if i in c.dense_layers else _latent_moe(b, c, p, hn)
            partial = b.op("add", partial, ffn, name="resid_ffn")
    with b.scope("out"):
        h = _attn_res(b, c, "output_attn_res", blocks, partial, "mix")
        hn = b.op("rms_norm", h, b.weight("norm.weight", [c.hidden]), eps=c.rms_eps, name="norm")
        logits = b.op("linear", hn, b.weight("lm_head.weight", [c.vocab, c.hidden]), out_dtype="f32", name="logits")
        nxt = b.op("argmax", logits, name="next_token")
    return b.finish([logits, nxt], tp_roles=TP_ROLES)


def _attn_res(b, c, prefix, blocks, partial, name):
    norm = b.weight(prefix + "_norm.weight", [c.hidden])
    proj = b.weight(prefix + "_proj.weight", [1, c.hidden])
    return b.op("attn_res", norm, proj, *blocks, partial, eps=c.rms_eps, name=name)


def _kda(b, c, p, h):
    a = p + "self_attn."
    w = c.kda_width
    d = c.kda_head_dim

    def proj(n, out, k=c.hidden, **kw):
        return b.op("linear", h, b.weight(a + n + ".weight", [out, k]), name=n, **kw)

    def conv(x, n):
        st = b.state(f"{p}kda.{n}_conv_state", ["B", w, c.conv_width - 1], BF16)
        y, new = b.op("conv_update", x, st, b.weight(a + n + "_conv1d.weight", [w, 1, c.conv_width], F32),
                      names=[n + "_conv", n + "_conv_state"])
        b.g.update(st, new)
        return y

    q = b.op("l2_norm", conv(proj("q_proj", w), "q"), head_dim=d, scale=d ** -0.5, name="q")
    k = b.op("l2_norm", conv(proj("k_proj", w), "k"), head_dim=d, name="k")
    v = conv(proj("v_proj", w), "v")
    fa = proj("f_a_proj", c.f_rank)
    f = b.op("linear", fa, b.weight(a + "f_b_proj.weight", [w, c.f_rank]), name="f_b_proj")
    g = b.op("kda_gate", f, b.weight(a + "A_log", [c.a_log_len], F32), b.weight(a + "dt_bias", [w], F32),
             heads=c.kda_heads, head_dim=d, a_log_broadcast=c.a_log_broadcast, name="decay")
    beta = b.op("sigmoid", proj("b_proj", c.kda_heads, out_dtype="f32"), name="beta")
    s = b.state(f"{p}kda.recurrent_state", ["B", c.kda_heads, d, d], F32)
    o, s_new = b.op("kda_recurrent", q, k, v, g, beta, s, heads=c.kda_heads, head_dim=d,
                    names=["kda_o", "kda_state"])
    b.g.update(s, s_new)
    gate = proj("g_proj", w)
    o = b.op("gated_rms_norm", o, gate, b.weight(a + "o_norm.weight", [d], F32), head_dim=d, eps=c.rms_eps,
             name="o_norm")
    return b.op("linear", o, b.weight(a + "o_proj.weight", [c.hidden, w]), name="o_proj")


def _mla(b, c, p, h, pos):
    a = p + "self_attn."
    hd = c.qk_nope + c.qk_rope
    mla = dict(heads=c.mla_heads, nope=c.qk_nope, rope=c.qk_rope, kv_lora=c.kv_lora, v_dim=c.v_dim)
    qa = b.op("linear", h, b.weight(a + "q_a_proj.weight", [c.q_lora, c.hidden]), name="q_a")
    qa = b.op("rms_norm", qa, b.weight(a + "q_a_layernorm.weight", [c.q_lora]), eps=c.mla_eps, name="q_a_norm")
    q = b.op("linear", qa, b.weight(a + "q_b_proj.weight", [c.mla_heads * hd, c.q_lora]), name="q_b")
    q = b.op("reshape", q, shape=("B", c.mla_heads, hd), name="q_heads")
    q_nope = b.op("slice", q, dim=2, start=0, end=c.qk_nope, name="q_nope")
    q_pe = b.op("slice", q, dim=2, start=c.qk_nope, end=hd, name="q_pe")   # NoPE: never rotated
    kv = b.op("linear", h, b.weight(a + "kv_a_proj_with_mqa.weight", [c.kv_lora + c.qk_rope, c.hidden]), name="kv_a")
    ckv = b.op("slice", kv, dim=1, start=0, end=c.kv_lora, name="c_kv")
    ckv = b.op("rms_norm", ckv, b.weight(a + "kv_a_layernorm.weight", [c.kv_lora]), eps=c.mla_eps, name="c_kv_norm")
    kpe = b.op("slice", kv, dim=1, start=c.kv_lora, end=c.kv_lora + c.qk_rope, name="k_pe")
    row = b.op("concat", ckv, kpe, dim=1, name="cache_row")
    cache = b.state(f"{p}mla.latent_cache", ["B", "L", c.kv_lora + c.qk_rope], BF16)
    new_cache = b.op("cache_append", cache, row, pos, name="latent_cache")
    b.g.update(cache, new_cache)
    kv_b = b.weight(a + "kv_b_proj.weight", [c.mla_heads * (c.qk_nope + c.v_dim), c.kv_lora])
    o = b.op("mla_attention_naive", q_nope, q_pe, new_cache, kv_b, pos, scale=hd ** -0.5, name="attn", **mla)
    gate = b.op("linear", h, b.weight(a + "g_proj.weight", [c.mla_heads * c.v_dim, c.hidden]), name="g_proj")
    o = b.op("sigmoid_mul", o, gate, name="gated")
    return b.op("linear", o, b.weight(a + "o_proj.weight", [c.hidden, c.mla_heads * c.v_dim]), name="o_proj")


def _glu_mlp(b, c, prefix, h, inter):
    g = b.op("linear", h, b.weight(prefix + "gate_proj.weight", [inter, c.hidden]), name="gate_proj")
    u = b.op("linear", h, b.weight(prefix + "up_proj.weight", [inter, c.hidden]), name="up_proj")
    act = b.op("situ_glu", g, u, name="glu")
    return b.op("linear", act, b.weight(prefix + "down_proj.weight", [c.hidden, inter]), name="down_proj")


def _dense_ffn(b, c, p, h):
    return _glu_mlp(b, c, p + "mlp.", h, c.dense_inter)


def _latent_moe(b, c, p, h):
    m = p + "block_sparse_moe."
    edt = DType(c.expert_dtype)
    logits = b.op("linear", h, b.weight(m + "gate.weight", [c.experts, c.hidden]), out_dtype="f32", name="router_logits")
    w, ids = b.op("router", logits, b.weight(m + "gate.e_score_correction_bias", [c.experts], F32),
                  topk=c.topk, scale=c.routed_scale, names=["route_w", "route_ids"])
    lat = b.op("linear", h, b.weight(m + "routed_expert_down_proj.weight", [c.latent, c.hidden]), name="latent")
    hh = b.op("moe_gate_up", lat, ids, b.weight(m + "experts.w1", [c.experts, c.expert_inter, c.latent], edt),
              b.weight(m + "experts.w3", [c.experts, c.expert_inter, c.latent], edt), name="experts_glu")
    y = b.op("moe_down", hh, ids, b.weight(m + "experts.w2", [c.experts, c.latent, c.expert_inter], edt),
             name="experts_down")
    u = b.op("moe_combine", y, w, name="combine")
    u = b.op("rms_norm", u, b.weight(m + "routed_expert_norm.weight", [c.latent]), eps=c.rms_eps, out_dtype="bf16",
             name="latent_norm")
    up = b.op("linear", u, b.weight(m + "routed_expert_up_proj.weight", [c.hidden, c.latent]), name="latent_up")
    with b.scope("shared"):
        sh = _glu_mlp(b, c, m + "shared_experts.", h, c.shared_inter)
    return b.op("add", up, sh, name="moe_out")


# Random-init rules (fnmatch on weight names; first match wins) for tests and benchmarks.
WEIGHT_INIT = [
    ("*.A_log", "alog"),
    ("*.dt_bias", "small"),
    ("*.e_score_correction_bias", "small"),
    ("*conv1d.weight", "normal"),
    ("embed_tokens.weight", "normal"),
    ("*_res_proj.weight", "linear"),
]

# Checkpoint names: graph weights are the published names without this prefix; stacked expert
# weights `...experts.w1` gather `...experts.{e}.w1.weight_packed/.weight_scale` (see fusec.checkpoint).
CHECKPOINT_PREFIX = "language_model.model."
CHECKPOINT_RENAMES = {"lm_head.weight": "language_model.lm_head.weight"}
# Published tensors the decode graph does not read: the vision tower, and layer 0's mixer-side
# AttnRes (layer 0 has a single source, so its mix is the identity).
CHECKPOINT_UNUSED = ["vision_tower.*", "multi_modal_projector.*", "mm_projector.*",
                     "language_model.model.layers.0.self_attention_res_*"]


def checkpoint_name(weight: str) -> str:
    return CHECKPOINT_RENAMES.get(weight, CHECKPOINT_PREFIX + weight)


# -- config.json ------------------------------------------------------------------------------
# The published checkpoint's config.json: `KimiK3ForConditionalGeneration` (model_type kimi_k3)
# wraps the text model's `KimiLinearForCausalLM` config (model_type kimi_linear) in `text_config`;
# a bare kimi_linear config is read the same way. Key -> K3Config field:
HF_KEYS = {
    "vocab_size": "vocab", "hidden_size": "hidden", "num_hidden_layers": "layers",
    "intermediate_size": "dense_inter", "rms_norm_eps": "rms_eps", "attn_res_block_size": "attn_res_block",
    "num_attention_heads": "mla_heads", "q_lora_rank": "q_lora", "kv_lora_rank": "kv_lora",
    "qk_nope_head_dim": "qk_nope", "qk_rope_head_dim": "qk_rope", "v_head_dim": "v_dim",
    "num_experts": "experts", "num_experts_per_token": "topk", "moe_intermediate_size": "expert_inter",
    "routed_expert_hidden_size": "latent", "routed_scaling_factor": "routed_scale",
}
HF_KDA_KEYS = {"num_heads": "kda_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size": "conv_width"}
# Published keys whose value is the only one this graph implements: any other value is a model
# the graph does not describe, named as such rather than built wrong.
HF_FIXED = {
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "mla_use_nope": True, "mla_use_output_gate": True, "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "moe_layer_freq": 1,
    "num_expert_group": 1, "topk_group": 1, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
}
HF_KDA_FIXED = {"gate_lower_bound": -5.0, "use_full_rank_gate": True}


def config_from_checkpoint(doc: dict, shape_of=None) -> dict:
    """The K3Config fields a checkpoint's config.json (`doc`) determines, as a dict.

    Layer lists are 1-based in config.json (`linear_attn_config.full_attn_layers` are the MLA
    layers, `kda_layers` the rest), 0-based here. Two dims config.json does not state are read
    from the tensor headers when `shape_of(checkpoint tensor name) -> shape | None` is given:
    the stored A_log length and the decay gate's rank (f_a_proj rows). Every missing key,
    mistyped value and unsupported setting is collected into one ValueError.
    """
    t = doc.get("text_config", doc) if isinstance(doc, dict) else None
    if not isinstance(t, dict):
        raise ValueError("config.json is not a JSON object")
    problems: list[str] = []
    out: dict = {}

    def num(where: dict, key: str, prefix: str = "", kind=int, minimum=1):
        v = where.get(key)
        ok = not isinstance(v, bool) and (isinstance(v, int) if kind is int else isinstance(v, (int, float)))
        if key not in where:
            problems.append(f"{prefix}{key} missing")
        elif not ok or (kind is int and v < minimum) or (kind is float and v <= 0):
            problems.append(f"{prefix}{key} = {_json(v)}: expected "
                            + (f"an integer >= {minimum}" if kind is int else "a number > 0"))
        else:
            return kind(v)
        return None

    model_type = doc.get("model_type") if isinstance(doc, dict) else None
    if t.get("model_type", model_type) not in ("kimi_linear", "kimi_k3"):
        problems.append(f"model_type = {_json(t.get('model_type', model_type))}: expected kimi_linear "
                        "(or kimi_k3 wrapping it)")
    for key, field in HF_KEYS.items():
        v = num(t, key, kind=float if field in ("rms_eps", "routed_scale") else int)
        if v is not None:
            out[field] = v
    heads, kv_heads = t.get("num_attention_heads"), t.get("num_key_value_heads", t.get("num_attention_heads"))
    if kv_heads != heads:
        problems.append(f"num_key_value_heads = {_json(kv_heads)}: MLA needs one KV head per query head "
                        f"({_json(heads)})")
    shared = num(t, "num_shared_experts")
    if shared is not None and "expert_inter" in out:
        out["shared_inter"] = shared * out["expert_inter"]   # the shared experts run as one wide MLP
    dense = num(t, "first_k_dense_replace", minimum=0)
    if dense is not None:
        out["dense_layers"] = tuple(range(dense))
    for key, want in HF_FIXED.items():
        if key in t and not _same(t[key], want):
            problems.append(f"{key} = {_json(t[key])}: this graph implements {_json(want)} only")
    q = t.get("quantization_config")
    if q is None:
        out["expert_dtype"] = "bf16"
    elif isinstance(q, dict) and q.get("format") == "mxfp4-pack-quantized":
        out["expert_dtype"] = "mxfp4"
    else:
        fmt = q.get("format") if isinstance(q, dict) else q
        problems.append(f"quantization_config.format = {_json(fmt)}: expected mxfp4-pack-quantized "
                        "(or no quantization_config: bf16 experts)")

    lac = t.get("linear_attn_config")
    if not isinstance(lac, dict):
        problems.append("linear_attn_config missing (or not an object)")
        lac = {}
    for key, field in HF_KDA_KEYS.items():
        v = num(lac, key, "linear_attn_config.")
        if v is not None:
            out[field] = v
    for key, want in HF_KDA_FIXED.items():
        if key in lac and not _same(lac[key], want):
            problems.append(f"linear_attn_config.{key} = {_json(lac[key])}: this graph implements "
                            f"{_json(want)} only")
    n = out.get("layers")
    full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
    for key, v in (("full_attn_layers", full), ("kda_layers", kda)):
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            problems.append(f"linear_attn_config.{key} missing (or not a list of layer numbers)")
        elif n is not None and any(not 1 <= x <= n for x in v):
            problems.append(f"linear_attn_config.{key} = {v}: layer numbers run 1..{n}")
    if n is not None and isinstance(full, list) and isinstance(kda, list) and \
            sorted(full + kda) != list(range(1, n + 1)):
        problems.append(f"linear_attn_config: full_attn_layers and kda_layers do not split layers 1..{n} "
                        "between them (every layer is exactly one of MLA or KDA)")
    elif isinstance(full, list):
        out["mla_layers"] = tuple(sorted(x - 1 for x in full))

    if shape_of is not None and n is not None and "mla_layers" in out:
        kda0 = next((i for i in range(n) if i not in out["mla_layers"]), None)
        if kda0 is not None:
            a = f"layers.{kda0}.self_attn."
            a_log, f_a = shape_of(checkpoint_name(a + "A_log")), shape_of(checkpoint_name(a + "f_a_proj.weight"))
            if a_log is not None and len(a_log) == 1:
                out["a_log_len"] = int(a_log[0])
            if f_a is not None and len(f_a) == 2:
                out["f_rank"] = int(f_a[0])
    if problems:
        raise ValueError(f"{len(problems)} problem{'s' if len(problems) > 1 else ''}: " + "; ".join(problems))
    return out


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b if isinstance(b, bool) else (not isinstance(a, bool) and a == b)


def _json(v) -> str:
    return json.dumps(v)
