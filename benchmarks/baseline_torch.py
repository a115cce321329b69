"""A careful plain-PyTorch decode step of Kimi K3: the baseline fusec must beat (issue 10).

What a performance engineer would write for one decode step, to run under
`torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)` (one graph, no breaks,
replayed as a CUDA graph), on the *same weights* as a fusec step so the logits can be compared:

  * bound from fusec's weights: `K3Weights(cfg, weights)` takes the tensors of a fusec weight
    dict by the graph's names (the dict `fusec.compile(weights=...)` receives, or a
    `ReferenceRunner.weights`) and checks it consumed every weight of the graph. Projections
    that read the same input are concatenated once at bind time into one GEMM each (KDA:
    q|k|v|g|f_a|b; MLA: q_a|kv_a|g; LatentMoE: latent-down|shared gate|shared up; layer 0:
    gate|up). With `share=True` the dict's entries are replaced by row views of those buffers,
    so fusec and the baseline hold one copy between them (slice4 is 57.6 GB).
  * state: own buffers (`K3TorchStep`), zero like fusec's initial state, updated in place:
    KDA conv windows (q|k|v in one [B, 3W, 3] buffer), KDA recurrent state in fp32
    [B, H, 128, 128], MLA latent cache [B, L, 576].
  * KDA: short conv + SiLU, L2 norms, the decay gate, then the delta rule with the recurrent
    state read twice and written once: one batched matmul [k e^g; q e^g] @ S gives k^T S' and
    q^T S' (S' = diag(e^g) S), u = v - k^T S', o = q^T S' + (q . beta k) u, and one fused
    elementwise pass writes S' + beta k u^T.
  * MLA, absorbed: q_lat = q_nope W_UK per head (bmm), scores = [q_lat, q_pe] . cache rows
    0..ctx-1 (one bmm over the 576-wide latent rows, fp32 scores where the fp32-output bmm
    exists, see below; rows past each sequence's position are masked), fp32 softmax,
    o_lat = P cache[:, :512], o = o_lat W_UV^T (bmm). `ctx` defaults to
    the cache length, and speed.py builds with max_len = pos + 1, so exactly rows 0..pos are read.
  * AttnRes: the softmax over the block sources in fp32, fused by Inductor.
  * LatentMoE (`moe=`):
      - "grouped" (bf16 experts): the B*topk (token, expert) slots sorted by expert, tokens
        gathered in that order, `torch._grouped_mm` (CUTLASS grouped GEMM on sm90) with the
        per-expert offsets from `searchsorted` (static shapes, no host sync): each routed
        expert's weights are read once however many tokens chose it;
      - "dense" (bf16 experts): every token through every expert (W1/W3 as one [E*I, D] GEMM
        each, W2 as a bmm over experts), combined with a dense [B, E] weight matrix; reads all
        E experts, but as a few large GEMMs: can win once most experts are routed to anyway
        (batch 16, top-16 of 128 routes to ~113 of 128 at random), so speed.py times it against
        "grouped" wherever B*topk >= E;
      - "gather" (bf16 or MXFP4): per sorted slot a GEMV written as multiply + sum over the
        gathered expert rows; Inductor turns it into one Triton reduction kernel per matrix
        that loads the expert's weights through the slot's index. For MXFP4 this kernel reads
        the E2M1 nibbles and E8M0 scales and decodes them in registers (16-entry LUT, 2^(s-127)),
        so it reads 4.25 bits per weight -- the MXFP4 path. Slots are sorted by expert so
        tokens sharing an expert read the same rows back to back (L2 hits);
      - "dequant" (MXFP4): the distinct routed experts (padded to min(E, B*topk), a static
        shape) dequantized to bf16 inside the step, then the "grouped" GEMMs: the obvious
        Hopper recipe (no FP4 tensor cores; torch's MX-format `scaled_mm` /
        `scaled_grouped_mm` need sm100). At K3 widths one expert is 17.6 MB in MXFP4 but 66 MB
        in bf16, so this path moves 17.6 + 66 written + 66 re-read = ~8.5x the bytes the
        in-register decode of "gather" reads; speed.py still times it against "gather" where
        its bf16 buffer stays small (B*topk <= 64), and "gather" is the MXFP4 default.
    `default_moe(expert_dtype, batch, topk, experts, device)` picks grouped / gather;
    benchmarks/speed.py times the candidates (`moe_candidates`) per batch and keeps the
    fastest. The combine is sum_j w_j y_j in fp32, in slot order.
  * router logits, lm_head logits and MLA scores in fp32: `torch.mm/bmm(..., out_dtype=float32)`
    (bf16 inputs, fp32 output: CUDA) when this torch runs and compiles it
    (`fp32_out_matmul_ok`); else the router from an fp32 copy of its (small) gate weight and
    logits and scores as bf16 GEMM outputs upcast (what HF-style code does).
  * everything else bf16 weights and activations with fp32 accumulation (cuBLAS), fp32 state.

Independent of fusec's executor: only the weight names and the model config (K3Config) are
shared; the math is written here with torch ops (tests/test_baseline_torch.py checks it against
the reference executor in fp32 on the CPU). In fp32 (a fp32 weight dict) every op runs in fp32.
"""
from __future__ import annotations

from typing import Mapping, MutableMapping

import torch
import torch.nn.functional as F

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MOE_IMPLS = ("grouped", "dense", "gather", "dequant")
MX_GROUP = 32


# situ_glu and rms restate the model's math here on purpose (the registry has the same formulas,
# ir/ops/core.py): the baseline is written from the model card, not from fusec's code, so a
# mistake in fusec's registry cannot cancel out in the comparison.
def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU in fp32: (4 tanh(g/4) sigmoid(g)) * (25 tanh(u/25))."""
    g, u = g.float(), u.float()
    return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)) * (25.0 * torch.tanh(u / 25.0))


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (returns fp32)."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


_PROBES: dict[tuple[str, str], bool] = {}


def grouped_mm_available(device=None) -> bool:
    """Whether `torch._grouped_mm` exists and runs on `device` (bf16 on CUDA: sm90 and newer;
    the CPU has a reference implementation in recent torch). Without a device: whether it exists."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device is None:
        return True
    dev = torch.device(device)
    key = ("grouped_mm", str(dev))
    if key not in _PROBES:
        try:
            dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
            a = torch.randn(32, 64, device=dev, dtype=dt)
            w = torch.randn(4, 32, 64, device=dev, dtype=dt)
            offs = torch.tensor([8, 8, 24, 32], device=dev, dtype=torch.int32)
            y = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
            ref = torch.cat([a[:8].float() @ w[0].float().T, a[8:24].float() @ w[2].float().T,
                             a[24:].float() @ w[3].float().T])
            _PROBES[key] = bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-1))
        except Exception:
            _PROBES[key] = False
    return _PROBES[key]


def fp32_out_matmul_ok(device) -> bool:
    """Whether `torch.mm/bmm(bf16, bf16, out_dtype=torch.float32)` runs and compiles
    (fullgraph) on `device`: CUDA in recent torch; never on the CPU."""
    dev = torch.device(device)
    key = ("fp32_out", str(dev))
    if key in _PROBES:
        return _PROBES[key]
    ok = False
    if dev.type == "cuda":
        try:
            a = torch.randn(4, 64, device=dev, dtype=torch.bfloat16)
            b = torch.randn(64, 32, device=dev, dtype=torch.bfloat16)

            def f(a, b):
                return (torch.mm(a, b, out_dtype=torch.float32),
                        torch.bmm(a[None], b[None], out_dtype=torch.float32))
            y1, y2 = torch.compile(f, fullgraph=True, dynamic=False)(a, b)
            ref = a.float() @ b.float()
            ok = (y1.dtype == y2.dtype == torch.float32 and torch.allclose(y1, ref, rtol=1e-3, atol=1e-3)
                  and torch.allclose(y2[0], ref, rtol=1e-3, atol=1e-3))
        except Exception:
            ok = False
    _PROBES[key] = ok
    return ok


def default_moe(expert_dtype: str, batch: int, topk: int, experts: int, device=None) -> str:
    """The MoE path to use without timing: "gather" for MXFP4 (in-register decode) and where
    torch has no grouped GEMM on `device`, else "grouped"."""
    if expert_dtype == "mxfp4" or not grouped_mm_available(device):
        return "gather"
    return "grouped"


def moe_candidates(expert_dtype: str, batch: int, topk: int, experts: int, device=None) -> list[str]:
    """The MoE paths worth timing at this batch (benchmarks/speed.py keeps the fastest)."""
    slots = batch * topk
    gmm = grouped_mm_available(device)
    if expert_dtype == "mxfp4":
        # dequant-then-GEMM writes 2 bytes per weight of every routed expert: only tried while
        # that buffer stays small (it is ~4 GB at 64 slots of K3's 66 MB bf16 experts)
        return ["gather"] + (["dequant"] if gmm and slots <= 64 else [])
    out = ["grouped"] if gmm else ["gather"]
    if slots >= experts:           # most experts are routed to (B=16, top-16 of 128): dense may win
        out.append("dense")
    if batch == 1 and "gather" not in out:
        out.append("gather")
    return out


class _Bufs(torch.nn.Module):
    """A bag of tensors registered as (non-persistent) buffers, so that torch.compile and its
    CUDA graphs treat them as static inputs (never copied per replay)."""

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.register_buffer(name, t, persistent=False)
        return t


class K3Weights(torch.nn.Module):
    """Kimi K3 weights bound from a fusec weight dict (graph names), fused for the baseline.

    `weights`: name -> tensor (or MXFP4 tensor with .packed/.scale) for every weight of the
    model graph, all on one device; bf16 matrices give a bf16 step, fp32 ones an fp32 step.
    `share=True`: replace each concatenated weight in `weights` by a view of the fused buffer
    (same values), so that both this module and whoever else reads `weights` (fusec.compile)
    hold one copy. `graph`: if given, every graph weight must be consumed (a guard against
    drift between models/kimi_k3.py and this file)."""

    def __init__(self, cfg, weights: MutableMapping, *, share: bool = False, graph=None):
        super().__init__()
        self.cfg = cfg
        self._src, self._share, self._used = weights, share, set()
        emb = self._take("embed_tokens.weight")
        self.dtype, self.device = emb.dtype, emb.device
        self.expert_dtype = cfg.expert_dtype
        self.fp32_out = self.dtype != torch.float32 and fp32_out_matmul_ok(self.device)
        top = _Bufs()
        top.put("embed", emb)
        top.put("norm", self._take("norm.weight"))
        top.put("lm_head", self._take("lm_head.weight"))
        top.put("out_res_key", self._res_key("output_attn_res"))
        top.put("lut", torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=self.device))
        self.top = top
        self.layers = torch.nn.ModuleList(self._layer(i) for i in range(cfg.layers))
        if graph is not None:
            missing = {v.name for v in graph.weights()} - self._used
            if missing:
                raise ValueError(f"baseline does not use graph weights: {sorted(missing)[:8]}")
        del self._src

    # -- binding ---------------------------------------------------------------------------
    def _take(self, name: str):
        if name not in self._src:
            raise KeyError(f"weight {name} is missing")
        self._used.add(name)
        return self._src[name]

    def _rows(self, names: list[str]) -> torch.Tensor:
        """The named [N_i, K] matrices stacked along N (one GEMM); views back into the source
        dict when sharing."""
        parts = [self._take(n) for n in names]
        if len(parts) == 1:
            return parts[0]
        cat = torch.cat(parts, 0)
        if self._share:
            a = 0
            for n, p in zip(names, parts):
                self._src[n] = cat[a:a + p.shape[0]]
                a += p.shape[0]
        return cat

    def _res_key(self, prefix: str) -> torch.Tensor:
        return (self._take(prefix + "_norm.weight").float() * self._take(prefix + "_proj.weight").float()[0]).contiguous()

    def _layer(self, i: int) -> _Bufs:
        c, p = self.cfg, f"layers.{i}."
        L = _Bufs()
        L.kind = "mla" if c.is_mla(i) else "kda"
        L.dense = i in c.dense_layers
        if i > 0:
            L.put("res_attn", self._res_key(p + "self_attention_res"))
        L.put("res_ffn", self._res_key(p + "mlp_res"))
        L.put("ln_in", self._take(p + "input_layernorm.weight"))
        L.put("ln_post", self._take(p + "post_attention_layernorm.weight"))
        a = p + "self_attn."
        if L.kind == "kda":
            L.put("w_in", self._rows([a + n + ".weight" for n in
                                      ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")]))
            L.put("conv_w", torch.cat([self._take(a + n + "_conv1d.weight")[:, 0, :].float() for n in "qkv"], 0)
                  .contiguous())
            a_log = self._take(a + "A_log").float()
            w, d = c.kda_width, c.kda_head_dim
            a_ch = a_log[:c.kda_heads].repeat_interleave(d) if c.a_log_broadcast == "head" else a_log[:w]
            L.put("a_exp", torch.exp(a_ch).contiguous())
            L.put("dt_bias", self._take(a + "dt_bias").float())
            L.put("f_b", self._take(a + "f_b_proj.weight"))
            L.put("o_norm", self._take(a + "o_norm.weight").float())
            L.put("o_proj", self._take(a + "o_proj.weight"))
        else:
            L.put("w_in", self._rows([a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", a + "g_proj.weight"]))
            L.put("q_a_ln", self._take(a + "q_a_layernorm.weight"))
            L.put("kv_a_ln", self._take(a + "kv_a_layernorm.weight"))
            L.put("q_b", self._take(a + "q_b_proj.weight"))
            kv_b = self._take(a + "kv_b_proj.weight").view(c.mla_heads, c.qk_nope + c.v_dim, c.kv_lora)
            L.put("w_uk", kv_b[:, :c.qk_nope])                   # [H, nope, lora] (a view)
            L.put("w_uv_t", kv_b[:, c.qk_nope:].transpose(1, 2))  # [H, lora, v]
            L.put("o_proj", self._take(a + "o_proj.weight"))
        if L.dense:
            m = p + "mlp."
            L.put("w_gu", self._rows([m + "gate_proj.weight", m + "up_proj.weight"]))
            L.put("w_down", self._take(m + "down_proj.weight"))
            return L
        m = p + "block_sparse_moe."
        gate = self._take(m + "gate.weight")
        L.put("router", gate if self.fp32_out or gate.dtype == torch.float32 else gate.float())
        L.put("router_bias", self._take(m + "gate.e_score_correction_bias").float())
        L.put("w_moe_in", self._rows([m + "routed_expert_down_proj.weight", m + "shared_experts.gate_proj.weight",
                                      m + "shared_experts.up_proj.weight"]))
        L.put("lat_norm", self._take(m + "routed_expert_norm.weight"))
        L.put("lat_up", self._take(m + "routed_expert_up_proj.weight"))
        L.put("sh_down", self._take(m + "shared_experts.down_proj.weight"))
        for n in ("w1", "w3", "w2"):
            w = self._take(m + "experts." + n)
            if hasattr(w, "packed"):
                L.put(n + "_q", w.packed)
                L.put(n + "_s", w.scale)
            else:
                L.put(n, w)
        return L


class K3TorchStep(torch.nn.Module):
    """One Kimi K3 decode step over `K3Weights`, with its own state for `batch` sequences of up
    to `max_len` tokens. `forward(tokens [B] int, positions [B] int) -> (logits [B, V] fp32,
    next_tokens [B] int32)`; state is updated in place. `ctx` (<= max_len): cache rows the
    attention reads (positions must be < ctx). `moe`: see the module docstring."""

    def __init__(self, w: K3Weights, batch: int, max_len: int, *, moe: str | None = None, ctx: int | None = None):
        super().__init__()
        c = w.cfg
        self.w, self.cfg, self.batch, self.max_len = w, c, batch, max_len
        self.ctx = max_len if ctx is None else ctx
        if not 0 < self.ctx <= max_len:
            raise ValueError("ctx must be in (0, max_len]")
        self.moe = moe or default_moe(c.expert_dtype, batch, c.topk, c.experts, w.device)
        if self.moe not in MOE_IMPLS:
            raise ValueError(f"moe must be one of {MOE_IMPLS}")
        if self.moe in ("grouped", "dense") and c.expert_dtype == "mxfp4":
            raise ValueError(f"moe={self.moe} needs bf16 experts (MXFP4: gather or dequant)")
        if self.moe == "dequant" and c.expert_dtype != "mxfp4":
            raise ValueError("moe=dequant is for MXFP4 experts")
        if self.moe in ("grouped", "dequant") and not grouped_mm_available(w.device):
            raise ValueError(f"torch._grouped_mm is missing or fails on {w.device} in this torch")
        dev, dt = w.device, w.dtype
        st = _Bufs()
        for i in range(c.layers):
            if c.is_mla(i):
                st.put(f"cache{i}", torch.zeros(batch, max_len, c.kv_lora + c.qk_rope, dtype=dt, device=dev))
            else:
                st.put(f"conv{i}", torch.zeros(batch, 3 * c.kda_width, c.conv_width - 1, dtype=dt, device=dev))
                st.put(f"rec{i}", torch.zeros(batch, c.kda_heads, c.kda_head_dim, c.kda_head_dim,
                                              dtype=torch.float32, device=dev))
        st.put("experts", torch.arange(c.experts, device=dev))
        st.put("rows", torch.arange(self.ctx, device=dev))
        st.put("bidx", torch.arange(batch, device=dev))
        self.st = st

    def mark_static(self) -> None:
        """Tell torch.compile's CUDA graphs that every weight and state tensor keeps its address
        (so none is copied into the graph's pool per replay)."""
        for t in list(self.w.buffers()) + list(self.st.buffers()):
            torch._dynamo.mark_static_address(t)

    def reset(self) -> None:
        for name, t in self.st.named_buffers():
            if name.startswith(("cache", "conv", "rec")):
                t.zero_()

    # -- pieces ----------------------------------------------------------------------------
    def _mm32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T with an fp32 result (see the module docstring)."""
        if w.dtype == torch.float32:
            return F.linear(x.float(), w)
        if self.w.fp32_out:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x, w).float()

    def _attn_res(self, key, blocks, partial):
        v = torch.stack([b.float() for b in blocks] + [partial.float()], 0)           # [J, B, H]
        s = (rms(v, None, self.cfg.rms_eps) * key).sum(-1)                            # [J, B]
        p = torch.softmax(s, 0)
        return (p[..., None] * v).sum(0).to(self.w.dtype)

    def _kda(self, i, L, hn):
        c, dt = self.cfg, self.w.dtype
        B, w, h, d = hn.shape[0], c.kda_width, c.kda_heads, c.kda_head_dim
        proj = F.linear(hn, L.w_in)                                                   # [B, 4w + f + h]
        conv = getattr(self.st, f"conv{i}")
        win = torch.cat([conv, proj[:, :3 * w, None]], -1)                            # [B, 3w, W]
        y = F.silu((win.float() * L.conv_w).sum(-1)).to(dt)                           # [B, 3w]
        conv.copy_(win[..., 1:])
        q = y[:, :w].float().view(B, h, d)
        k = y[:, w:2 * w].float().view(B, h, d)
        v = y[:, 2 * w:].float().view(B, h, d)
        q = (q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5).to(dt).float()
        k = (k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)).to(dt).float()
        gate = proj[:, 3 * w:4 * w]
        fa = proj[:, 4 * w:4 * w + c.f_rank]
        f = F.linear(fa, L.f_b)                                                       # [B, w]
        g = -5.0 * torch.sigmoid(L.a_exp * (f.float() + L.dt_bias))                    # log decay, fp32
        beta = torch.sigmoid(proj[:, 4 * w + c.f_rank:].float())                      # [B, h]
        eg = torch.exp(g).view(B, h, d)
        S = getattr(self.st, f"rec{i}")                                               # [B, h, dk, dv] fp32
        r = torch.matmul(torch.stack([k * eg, q * eg], 2), S)                         # [B, h, 2, dv]
        u = v - r[:, :, 0]                                                            # v - k^T S'
        bk = beta[..., None] * k
        o = r[:, :, 1] + (q * bk).sum(-1, keepdim=True) * u                           # q^T (S' + bk u^T)
        S.copy_(eg[..., None] * S + bk[..., :, None] * u[..., None, :])
        on = rms(o, L.o_norm, c.rms_eps) * torch.sigmoid(gate.float().view(B, h, d))
        return F.linear(on.reshape(B, w).to(dt), L.o_proj)

    def _mla(self, i, L, hn, pos):
        c, dt = self.cfg, self.w.dtype
        B, H = hn.shape[0], c.mla_heads
        lora, rope, nope = c.kv_lora, c.qk_rope, c.qk_nope
        proj = F.linear(hn, L.w_in)                                                   # [B, q_lora + 576 + H*v]
        qa = rms(proj[:, :c.q_lora], L.q_a_ln, c.mla_eps).to(dt)
        q = F.linear(qa, L.q_b).view(B, H, nope + rope)
        kv = proj[:, c.q_lora:c.q_lora + lora + rope]
        row = torch.cat([rms(kv[:, :lora], L.kv_a_ln, c.mla_eps).to(dt), kv[:, lora:]], -1)   # [B, 576]
        cache = getattr(self.st, f"cache{i}")
        cache.index_put_((self.st.bidx, pos), row)
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), L.w_uk).transpose(0, 1)      # [B, H, lora]
        qf = torch.cat([q_lat, q[..., nope:]], -1)                                    # [B, H, 576]
        kvc = cache[:, :self.ctx]                                                     # rows 0..ctx-1
        if self.w.fp32_out:
            s = torch.bmm(qf, kvc.transpose(1, 2), out_dtype=torch.float32)
        else:
            s = torch.bmm(qf, kvc.transpose(1, 2)).float()                            # [B, H, ctx]
        keep = self.st.rows[None, :] <= pos[:, None]
        s = s.masked_fill(~keep[:, None, :], float("-inf")) * ((nope + rope) ** -0.5)
        p = torch.softmax(s, -1).to(dt)
        o_lat = torch.bmm(p, kvc[..., :lora])                                         # [B, H, lora]
        o = torch.bmm(o_lat.transpose(0, 1), L.w_uv_t).transpose(0, 1).reshape(B, H * c.v_dim)
        g = proj[:, c.q_lora + lora + rope:]
        o = (o.float() * torch.sigmoid(g.float())).to(dt)
        return F.linear(o, L.o_proj)

    def _dense_ffn(self, L, hn):
        gu = F.linear(hn, L.w_gu)
        n = gu.shape[1] // 2
        return F.linear(situ_glu(gu[:, :n], gu[:, n:]).to(self.w.dtype), L.w_down)

    def _moe(self, L, hn):
        c, dt = self.cfg, self.w.dtype
        logits = self._mm32(hn, L.router)                                             # [B, E] fp32
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + L.router_bias, c.topk, dim=-1).indices               # [B, k]
        wts = scores.gather(-1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * c.routed_scale
        proj = F.linear(hn, L.w_moe_in)
        lat = proj[:, :c.latent]
        sh = proj[:, c.latent:]
        u = self._routed(L, lat, ids, wts)                                            # [B, latent] fp32
        up = F.linear(rms(u, L.lat_norm, c.rms_eps).to(dt), L.lat_up)
        shared = F.linear(situ_glu(sh[:, :c.shared_inter], sh[:, c.shared_inter:]).to(dt), L.sh_down)
        return (up.float() + shared.float()).to(dt)

    def _routed(self, L, lat, ids, wts):
        """sum_j w_j W2[e_j] SiTU-GLU(W1[e_j] x, W3[e_j] x) per token, fp32."""
        c, dt = self.cfg, self.w.dtype
        B, k = ids.shape
        if self.moe == "dense":
            E, I = c.experts, c.expert_inter
            h1 = F.linear(lat, L.w1.view(E * I, c.latent))                            # [B, E*I]
            h3 = F.linear(lat, L.w3.view(E * I, c.latent))
            hh = situ_glu(h1, h3).to(dt).view(B, E, I).transpose(0, 1)                # [E, B, I]
            y = torch.bmm(hh, L.w2.transpose(1, 2))                                   # [E, B, latent]
            dense_w = torch.zeros(B, E, dtype=torch.float32, device=lat.device).scatter(1, ids, wts)
            return (dense_w.t()[..., None] * y.float()).sum(0)
        S = B * k
        flat = ids.reshape(S)
        order = torch.argsort(flat, stable=True)                                      # slots by expert
        es = flat[order]
        xs = lat[torch.div(order, k, rounding_mode="floor")]                          # [S, latent]
        if self.moe == "grouped":
            offs = torch.searchsorted(es, self.st.experts, right=True).to(torch.int32)
            h = situ_glu(torch._grouped_mm(xs, L.w1.transpose(-2, -1), offs=offs),
                         torch._grouped_mm(xs, L.w3.transpose(-2, -1), offs=offs)).to(dt)
            y = torch._grouped_mm(h, L.w2.transpose(-2, -1), offs=offs)
        elif self.moe == "gather":
            if self.cfg.expert_dtype == "mxfp4":
                h = situ_glu(self._gemv_mx(xs, es, L.w1_q, L.w1_s), self._gemv_mx(xs, es, L.w3_q, L.w3_s)).to(dt)
                y = self._gemv_mx(h, es, L.w2_q, L.w2_s)
            else:
                h = situ_glu(self._gemv(xs, es, L.w1), self._gemv(xs, es, L.w3)).to(dt)
                y = self._gemv(h, es, L.w2)
        else:  # dequant: the distinct routed experts, padded to a static count, to bf16
            first = torch.cat([torch.ones_like(es[:1], dtype=torch.bool), es[1:] != es[:-1]])
            grp = torch.cumsum(first.to(torch.int64), 0) - 1                         # compact group per slot
            n = min(c.experts, S)
            uniq = es[-1:].expand(n).clone().scatter(0, grp, es)                     # padding: last expert again
            offs = torch.searchsorted(grp, self.st.experts[:n], right=True).to(torch.int32)
            h = situ_glu(torch._grouped_mm(xs, self._dequant(L.w1_q, L.w1_s, uniq).transpose(-2, -1), offs=offs),
                         torch._grouped_mm(xs, self._dequant(L.w3_q, L.w3_s, uniq).transpose(-2, -1), offs=offs)
                         ).to(dt)
            y = torch._grouped_mm(h, self._dequant(L.w2_q, L.w2_s, uniq).transpose(-2, -1), offs=offs)
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(S, device=order.device))
        ys = y.float()[inv].view(B, k, -1)                                            # back to slot order
        return (ys * wts[..., None]).sum(1)

    @staticmethod
    def _gemv(x, es, w):
        """y[s] = W[es[s]] x[s] as multiply + sum over the gathered rows (one reduction kernel
        under Inductor), fp32."""
        return (x[:, None, :].float() * w[es].float()).sum(-1)

    def _gemv_mx(self, x, es, packed, scale):
        """As _gemv with MXFP4 weights decoded in the reduction: nibbles (low = even input)
        through the E2M1 LUT, times 2^(e8m0 - 127) per 32 inputs."""
        S, K = x.shape
        N, G = packed.shape[1], K // MX_GROUP
        xv = x.float().view(S, 1, G, MX_GROUP // 2, 2)
        p = packed[es].view(S, N, G, MX_GROUP // 2)
        lut = self.w.top.lut
        lo, hi = lut[(p & 15).long()], lut[(p >> 4).long()]
        sc = torch.exp2(scale[es].float() - 127.0)                                    # [S, N, G]
        return ((xv[..., 0] * lo + xv[..., 1] * hi) * sc[..., None]).sum((-2, -1))

    def _dequant(self, packed, scale, idx):
        """bf16 (or the step dtype) copies of experts `idx`: [n, N, K]."""
        p = packed[idx]
        n, N, K2 = p.shape
        lut = self.w.top.lut
        v = torch.stack([lut[(p & 15).long()], lut[(p >> 4).long()]], -1).view(n, N, K2 * 2 // MX_GROUP, MX_GROUP)
        return (v * torch.exp2(scale[idx].float() - 127.0)[..., None]).view(n, N, K2 * 2).to(self.w.dtype)

    # -- the step ---------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor):
        c, w, dt = self.cfg, self.w, self.w.dtype
        pos = positions.long()
        x = w.top.embed[tokens.long()]
        blocks: list[torch.Tensor] = []
        partial = x
        for i, L in enumerate(w.layers):
            h = partial if i == 0 else self._attn_res(L.res_attn, blocks, partial)
            if c.freezes_block(i):
                blocks.append(partial)
                partial = None
            hn = rms(h, L.ln_in, c.rms_eps).to(dt)
            mix = self._mla(i, L, hn, pos) if L.kind == "mla" else self._kda(i, L, hn)
            partial = mix if partial is None else (partial.float() + mix.float()).to(dt)
            h = self._attn_res(L.res_ffn, blocks, partial)
            hn = rms(h, L.ln_post, c.rms_eps).to(dt)
            ffn = self._dense_ffn(L, hn) if L.dense else self._moe(L, hn)
            partial = (partial.float() + ffn.float()).to(dt)
        h = self._attn_res(w.top.out_res_key, blocks, partial)
        hn = rms(h, w.top.norm, c.rms_eps).to(dt)
        logits = self._logits(hn)
        return logits, logits.argmax(-1).to(torch.int32)

    def _logits(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] from the final normed hidden state (benchmarks/baseline_tp.py
        gathers its vocabulary slices here)."""
        return self._mm32(hn, self.w.top.lm_head)


def compile_step(step: K3TorchStep, mode: str = "reduce-overhead"):
    """torch.compile(step, mode, fullgraph=True, dynamic=False) with every weight and state
    buffer marked static. A graph break raises (fullgraph); callers should call
    `torch.compiler.cudagraph_mark_step_begin()` before each step and clone the outputs they
    keep (CUDA-graph outputs are overwritten by the next replay)."""
    step.mark_static()
    return torch.compile(step, mode=mode, fullgraph=True, dynamic=False)


def step_call(step, compiled=None, cuda: bool = False):
    """(tokens, positions) -> (logits, next) under no_grad: `compiled` (from compile_step) when
    given, each call marking a new CUDA-graph step on CUDA; else the eager `step`. Keeps no
    reference to CUDA-graph memory between calls (callers clone what they keep)."""
    if compiled is None:
        def eager(tok, pos):
            with torch.no_grad():
                return step(tok, pos)
        return eager

    def graphed(tok, pos):
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return compiled(tok, pos)
    return graphed


def from_weights(cfg, weights: MutableMapping, batch: int, max_len: int, *, moe: str | None = None,
                 share: bool = False, graph=None, ctx: int | None = None) -> K3TorchStep:
    """K3TorchStep on weights bound from a fusec weight dict."""
    return K3TorchStep(K3Weights(cfg, weights, share=share, graph=graph), batch, max_len, moe=moe, ctx=ctx)


def from_reference(runner, cfg, *, moe: str | None = None) -> K3TorchStep:
    """K3TorchStep on a fusec ReferenceRunner's prepared weights (its precision: bf16 or fp32),
    sized like the runner (dims B and L)."""
    return from_weights(cfg, dict(runner.weights), int(runner.dims["B"]), int(runner.dims["L"]), moe=moe,
                        graph=runner.graph)


def k3_config(config: str = "tiny", overrides: Mapping | None = None):
    from fusec.models.kimi_k3 import get_config
    return get_config(config, **dict(overrides or {}))


__all__ = ["K3Weights", "K3TorchStep", "compile_step", "from_weights", "from_reference", "k3_config",
           "default_moe", "moe_candidates", "fp32_out_matmul_ok", "grouped_mm_available", "MOE_IMPLS",
           "situ_glu", "rms"]
