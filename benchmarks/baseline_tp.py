"""A plain-PyTorch tensor-parallel K3 decode step: baseline_torch.py's careful step split over R
ranks the way a performance engineer would (issue 13's baseline; one process per GPU).

Bound from the SAME per-rank weights as fusec's rank r of the sharded graph: `rank_weights`
cuts every full tensor exactly as the shard pass's parameter annotations say
(backends/reference/ranks.py `param_cuts`), keyed by the model's own names, so
`K3TPStep(K3TPWeights(cfg, rank_weights(...)))` holds the bytes fusec's rank holds. The split:

  * KDA: heads column-parallel (q|k|v|g|b and f_b rows, the conv channels, A_log and dt_bias of
    the rank's heads; the low-rank f_a replicated), o_proj row-parallel -> one all-reduce;
  * MLA: q_a and kv_a replicated (every rank keeps the whole latent cache: it is per token, not
    per head), q_b / kv_b / g heads column-parallel, o_proj row-parallel -> one all-reduce;
  * dense FFN (layer 0): gate|up column-parallel, down row-parallel -> one all-reduce;
  * LatentMoE: the router and the latent down-projection replicated; the routed experts
    EXPERT-parallel (rank r holds experts [r E/R, (r+1) E/R), fusec's cut): each rank runs the
    slots routed to its experts and the fp32 combine is all-reduced (fusec's `combine`
    all-reduce); the latent RMSNorm on the full latent, then the latent up-projection
    row-parallel over the rank's latent slice and the shared expert column/row-parallel, their
    sum all-reduced once (fusec's `resid_ffn`);
  * lm_head vocabulary-parallel (rows), the fp32 logit slices all-gathered along the vocabulary.

Collectives are torch.distributed functional collectives (`_functional_collectives.all_reduce`
and `all_gather_tensor`), which torch.compile traces into the one graph of each rank (fullgraph)
and NCCL runs (gloo on the CPU). Activations bf16 (partial sums all-reduced in bf16 as vLLM-style
TP does), the routed combine in fp32.

EP with static shapes: each rank sees all B*topk slots (the router is replicated) and sends the
non-local ones nowhere: "grouped" sorts them after the local ones and leaves them out of the
grouped GEMM's offsets (no weight read, no compute); "dense" gives them zero weight (reads the
rank's E/R experts whole); "gather" cannot skip a slot in a static shape, so it points the
non-local slots at the last local expert of the sorted order (its rows are read back to back:
L2 hits) and masks them. The MXFP4 "dequant" path is not offered here.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping

import torch
import torch.nn.functional as F

import baseline_torch as bt

# all_gather_tensor's gather_dim is what the logits need; newer torch suggests all_gather_single
# (dim 0 only) in a FutureWarning per call
warnings.filterwarnings("ignore", message=".*all_gather_tensor.*deprecated", category=FutureWarning)


def rank_weights(spmd_graph, full: Mapping, rank: int) -> dict:
    """Rank `rank`'s slices of the full (model-named) weights, by model name: every parameter of
    the sharded graph `spmd_graph` (fusec.compiler.lower with Options(ranks=R)) broken into its
    sources' cuts (`param_cuts`), each cut a view of the full tensor."""
    from fusec.backends.reference.ranks import full_meta, narrow, param_cuts

    out = {}
    meta = full_meta(full)
    for v in spmd_graph.weights():
        for cut in param_cuts(spmd_graph, v.name, rank, meta):
            out[cut.source] = narrow(full[cut.source], cut)
    return out


def local_config(cfg, ranks: int):
    """The K3 config one rank of `ranks` sees: its heads, FFN/shared widths and experts."""
    for name in ("kda_heads", "mla_heads", "dense_inter", "shared_inter", "experts", "latent", "vocab"):
        if getattr(cfg, name) % ranks:
            raise ValueError(f"{name} = {getattr(cfg, name)} does not split over {ranks} ranks")
    return dataclasses.replace(cfg, kda_heads=cfg.kda_heads // ranks, mla_heads=cfg.mla_heads // ranks,
                               dense_inter=cfg.dense_inter // ranks, shared_inter=cfg.shared_inter // ranks,
                               experts=cfg.experts // ranks)


def moe_candidates(expert_dtype: str, batch: int, topk: int, experts_local: int, device=None) -> list[str]:
    """The EP MoE paths worth timing (baseline_torch.moe_candidates without "dequant")."""
    return [m for m in bt.moe_candidates(expert_dtype, batch, topk, experts_local, device) if m != "dequant"]


class K3TPStep(bt.K3TorchStep):
    """One rank of the TP decode step (module docstring). `w`: `bt.K3Weights(local_config(cfg, R),
    rank_weights(...))`; `full_cfg`: the model's config; `group`: the process group of the R
    ranks (None: the default group)."""

    def __init__(self, w: bt.K3Weights, full_cfg, batch: int, max_len: int, *, rank: int, ranks: int,
                 group=None, moe: str | None = None, ctx: int | None = None):
        import torch.distributed as dist

        if moe == "dequant":
            raise ValueError("the TP baseline has no dequant MoE path")
        super().__init__(w, batch, max_len, moe=moe or bt.default_moe(w.cfg.expert_dtype, batch, w.cfg.topk,
                                                                      w.cfg.experts, w.device), ctx=ctx)
        self.full_cfg, self.rank, self.ranks = full_cfg, rank, ranks
        self.group = group if group is not None else dist.group.WORLD
        self.lat0 = rank * (full_cfg.latent // ranks)
        self.lat1 = self.lat0 + full_cfg.latent // ranks
        self.expert0 = rank * w.cfg.experts

    # -- collectives -------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def _all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), x.dim() - 1, self.group))

    # -- the row-parallel ends of each block ---------------------------------------------------
    def _kda(self, i, L, hn):
        return self._all_reduce(super()._kda(i, L, hn))

    def _mla(self, i, L, hn, pos):
        return self._all_reduce(super()._mla(i, L, hn, pos))

    def _dense_ffn(self, L, hn):
        return self._all_reduce(super()._dense_ffn(L, hn))

    def _moe(self, L, hn):
        c, dt = self.cfg, self.w.dtype
        logits = self._mm32(hn, L.router)                                             # [B, E] fp32, all experts
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + L.router_bias, c.topk, dim=-1).indices               # global expert ids
        wts = scores.gather(-1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * c.routed_scale
        proj = F.linear(hn, L.w_moe_in)
        lat = proj[:, :c.latent]                                                      # full latent (replicated)
        sh = proj[:, c.latent:]                                                       # this rank's shared slice
        u = self._all_reduce(self._routed(L, lat, ids, wts))                          # [B, latent] fp32
        un = rms(u, L.lat_norm, c.rms_eps)[:, self.lat0:self.lat1].to(dt)
        up = F.linear(un, L.lat_up)                                                   # row-parallel partial
        shared = F.linear(bt.situ_glu(sh[:, :c.shared_inter], sh[:, c.shared_inter:]).to(dt), L.sh_down)
        return self._all_reduce((up.float() + shared.float()).to(dt))

    def _routed(self, L, lat, ids, wts):
        """This rank's experts' part of sum_j w_j W2[e_j] SiTU-GLU(W1[e_j] x, W3[e_j] x), fp32."""
        c, dt = self.cfg, self.w.dtype
        B, k = ids.shape
        El = c.experts
        loc = ids - self.expert0
        valid = (loc >= 0) & (loc < El)
        if self.moe == "dense":
            I = c.expert_inter
            h1 = F.linear(lat, L.w1.view(El * I, c.latent))
            h3 = F.linear(lat, L.w3.view(El * I, c.latent))
            hh = bt.situ_glu(h1, h3).to(dt).view(B, El, I).transpose(0, 1)             # [El, B, I]
            y = torch.bmm(hh, L.w2.transpose(1, 2))                                   # [El, B, latent]
            dense_w = torch.zeros(B, El, dtype=torch.float32, device=lat.device).scatter_add(
                1, loc.clamp(0, El - 1), torch.where(valid, wts, torch.zeros_like(wts)))
            return (dense_w.t()[..., None] * y.float()).sum(0)
        S = B * k
        key = torch.where(valid, loc, torch.full_like(loc, El)).reshape(S)             # non-local slots last
        order = torch.argsort(key, stable=True)
        es = key[order]
        ok = es < El                                                                  # local, in sorted order
        xs = lat[torch.div(order, k, rounding_mode="floor")]
        if self.moe == "grouped":
            offs = torch.searchsorted(es, self.st.experts, right=True).to(torch.int32)  # non-local: past the end
            h = bt.situ_glu(torch._grouped_mm(xs, L.w1.transpose(-2, -1), offs=offs),
                            torch._grouped_mm(xs, L.w3.transpose(-2, -1), offs=offs)).to(dt)
            y = torch._grouped_mm(h, L.w2.transpose(-2, -1), offs=offs)
        else:  # gather: non-local slots re-read the last local expert (L2 hits), masked below
            last = torch.where(ok, es, torch.zeros_like(es)).max()
            es = torch.where(ok, es, last)
            if c.expert_dtype == "mxfp4":
                h = bt.situ_glu(self._gemv_mx(xs, es, L.w1_q, L.w1_s), self._gemv_mx(xs, es, L.w3_q, L.w3_s)).to(dt)
                y = self._gemv_mx(h, es, L.w2_q, L.w2_s)
            else:
                h = bt.situ_glu(self._gemv(xs, es, L.w1), self._gemv(xs, es, L.w3)).to(dt)
                y = self._gemv(h, es, L.w2)
        # rows the grouped GEMM never wrote are garbage (not zero): select, never multiply
        y = torch.where(ok[:, None], y.float(), torch.zeros((), dtype=torch.float32, device=y.device))
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(S, device=order.device))
        ys = y[inv].view(B, k, -1)
        return (ys * wts[..., None]).sum(1)

    def _logits(self, hn):
        return self._all_gather_last(self._mm32(hn, self.w.top.lm_head))              # [B, V/R] -> [B, V]


rms = bt.rms


def from_full(cfg, spmd_graph, full: Mapping, batch: int, max_len: int, *, rank: int, ranks: int,
              group=None, moe: str | None = None, model_graph=None) -> K3TPStep:
    """Rank `rank`'s TP step on its slices of the full weights `full` (model names)."""
    w = bt.K3Weights(local_config(cfg, ranks), rank_weights(spmd_graph, full, rank), share=False, graph=model_graph)
    return K3TPStep(w, cfg, batch, max_len, rank=rank, ranks=ranks, group=group, moe=moe)


__all__ = ["rank_weights", "local_config", "moe_candidates", "K3TPStep", "from_full"]
