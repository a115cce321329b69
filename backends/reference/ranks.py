"""Multi-rank reference executor: run an SPMD (sharded) graph on R simulated ranks in one process.

Used to prove the shard pass correct: the same full checkpoint, sliced per rank exactly as the
graph's parameter annotations say, must give the unsharded graph's outputs.

Parameter annotations (printed after a param's type, see docs/passes.md):
  sources = [a, b, ...]  the parameter is the concatenation along dim 0 of these full tensors
                         (canonicalize's merged projections); absent: the parameter's own name
  split   = [d, ...]     one per source: the dim of that source divided over the ranks (-1: kept
                         whole on every rank)
  split_len = [n, ...]   optional, one per source: only the first n entries of the split dim are
                         divided (K3's A_log stores 128 floats of which the first `heads` are used)
  ranks   = g            how many ranks the split is over (the size of the parameter's group)
  stride  = s            optional (default 1): the group's spacing; g * s = R, and rank r holds
                         slice r // s (its index in its group, see fusec/ir/ops/comm.py), so the
                         R / g groups (replicas) hold the same slices
`param_cuts` computes what a rank holds of each full tensor (the one place these rules live);
`materialize_weights` and `shard_state` apply them to tensors in memory, and
fusec/checkpoint.py's `load_rank_checkpoint` to a checkpoint's files (reading only those cuts).

`run_step_ranks` evaluates ops in program order on every rank in lockstep: a non-collective op
runs its registry reference once per rank (with `as_rank(r)` so rank-dependent ops see their
rank), a collective op is evaluated across all ranks' operands at once, group by group
(attrs `ranks` = group size and `stride`, see fusec/ir/ops/comm.py). `run_ops` is that loop
for any subset of the ranks; backends/reference/dist.py runs it on one rank per process, the
collectives' operands all-gathered over a torch.distributed group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from fusec.ir.graph import Graph
from fusec.ir.ops.comm import as_rank, group_index, group_members
from fusec.ir.quant import MXFP4Tensor
from fusec.ir.registry import Trait, get_op
from fusec.ir.types import Kind

from .executor import ExecError, prepare_weights, store, torch_dtype


@dataclass(frozen=True)
class Cut:
    """What one rank holds of one full tensor `source`: entries [start, start + length) of dim
    `dim` (dim -1: all of it). Computed by `param_cuts`, the one place the slicing rules live;
    applied to tensors in memory here (`param_for_rank`) and to safetensors files by
    fusec/checkpoint.py (`load_rank_checkpoint`)."""

    source: str
    dim: int = -1
    start: int = 0
    length: int = 0


def param_cuts(graph: Graph, name: str, rank: int, meta) -> list[Cut]:
    """The cuts of the full tensors that make parameter `name` of `graph` on `rank`, in the order
    they are concatenated (dim 0). `meta(source) -> (full shape, is mxfp4)`, None when there is
    no such full tensor."""
    ann = graph.param_attrs.get(name, {})
    sources = list(ann.get("sources", (name,)))
    splits = list(ann.get("split", (-1,) * len(sources)))
    lens = list(ann.get("split_len", (0,) * len(sources)))
    ranks = int(ann.get("ranks", 1))
    index = group_index(rank, ranks, int(ann.get("stride", 1)))
    if not (len(splits) == len(sources) == len(lens)):
        raise ExecError(f"parameter {name}: sources, split and split_len must have one entry per source")
    cuts = []
    for src, d, n in zip(sources, splits, lens):
        m = meta(src)
        if m is None:
            raise ExecError(f"parameter {name}: missing full tensor {src}")
        if d < 0 or ranks == 1:
            cuts.append(Cut(src))
            continue
        shape, mx = m
        if mx and d % len(shape) == len(shape) - 1:
            raise ExecError("cannot split an mxfp4 tensor along its packed (last) dim")
        n = n or shape[d]
        if n % ranks:
            raise ExecError(f"parameter {name} source {src}: dim {d} of length {n} does not split over {ranks} ranks")
        step = n // ranks
        cuts.append(Cut(src, d, index * step, step))
    return cuts


def build_param(graph: Graph, name: str, rank: int, meta, read):
    """Parameter `name` for `rank`: `read(cut)` of each of its cuts (`param_cuts`), concatenated
    along dim 0 (a merged parameter's sources)."""
    return cat0([read(c) for c in param_cuts(graph, name, rank, meta)])


def narrow(t, cut: Cut):
    """`cut` of the full tensor (or MXFP4Tensor: packed and scale alike) `t` in memory (a view)."""
    if cut.dim < 0:
        return t
    if isinstance(t, MXFP4Tensor):
        return MXFP4Tensor(t.packed.narrow(cut.dim, cut.start, cut.length),
                           t.scale.narrow(cut.dim, cut.start, cut.length))
    return t.narrow(cut.dim, cut.start, cut.length)


def cat0(parts):
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(p, MXFP4Tensor) for p in parts):
        return MXFP4Tensor(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]))
    return torch.cat(parts, 0)


def full_meta(full: Mapping):
    """`param_cuts`'s `meta` for full tensors in memory."""
    def meta(src):
        t = full.get(src)
        return None if t is None else (tuple(t.shape), isinstance(t, MXFP4Tensor))
    return meta


def param_for_rank(graph: Graph, name: str, full: Mapping, rank: int):
    """Build parameter `name` of `graph` for `rank` from full (unsharded, unmerged) tensors."""
    return build_param(graph, name, rank, full_meta(full), lambda c: narrow(full[c.source], c))


@dataclass(frozen=True)
class RankWeights:
    """Weights already sliced for rank `rank` of an SPMD graph (parameter name -> tensor or
    MXFP4Tensor in its stored dtype, as `param_for_rank` builds them), e.g. read rank by rank
    from a checkpoint (fusec/checkpoint.py `load_rank_checkpoint`); the runners take them in
    place of full weights and only cast them."""

    rank: int
    tensors: Mapping


def materialize_weights(graph: Graph, full, rank: int = 0, precision: str = "fp32") -> dict:
    """Every weight of `graph` for `rank`, built from the full checkpoint tensors and cast;
    `full` may be `RankWeights` of this rank (already sliced: only cast)."""
    if isinstance(full, RankWeights):
        if full.rank != rank:
            raise ExecError(f"weights sliced for rank {full.rank} given to rank {rank}")
        return prepare_weights(graph, full.tensors, precision)
    raw = {v.name: param_for_rank(graph, v.name, full, rank) for v in graph.weights()}
    return prepare_weights(graph, raw, precision)


def shard_state(graph: Graph, full_state: Mapping, rank: int) -> dict:
    """Each state parameter's slice for `rank` (state annotations use the same `split` rule)."""
    return {v.name: param_for_rank(graph, v.name, full_state, rank).clone() for v in graph.states()}


def gather_state(graph: Graph, per_rank: list[dict]) -> dict:
    """Inverse of `shard_state` for split (not merged) states: the full state after a step, read
    off rank 0's group (the other groups are replicas; `replica_mismatch` checks they agree)."""
    out = {}
    for v in graph.states():
        ann = graph.param_attrs.get(v.name, {})
        d = list(ann.get("split", (-1,)))[0]
        members = group_members(0, int(ann.get("ranks", 1)), int(ann.get("stride", 1)))
        out[v.name] = per_rank[0][v.name] if d < 0 or len(members) == 1 else \
            torch.cat([per_rank[r][v.name] for r in members], d)
    return out


def replica_mismatch(graph: Graph, per_rank: list[dict]) -> list[str]:
    """Names of the states whose replicas differ: ranks holding the same slice (the same index in
    their groups; every rank for a replicated state) must hold bit-identical tensors."""
    bad = []
    for v in graph.states():
        ann = graph.param_attrs.get(v.name, {})
        size, stride = int(ann.get("ranks", 1)), int(ann.get("stride", 1))
        if ann.get("split") is None:
            size, stride = 1, len(per_rank)      # replicated: every rank holds the same tensor
        first: dict[int, torch.Tensor] = {}
        for r, st in enumerate(per_rank):
            i = group_index(r, size, stride)
            if i in first and not torch.equal(first[i], st[v.name]):
                bad.append(v.name)
                break
            first.setdefault(i, st[v.name])
    return bad


# -- collectives across ranks ---------------------------------------------------------------------
def collective_results(opname: str, xs: list[torch.Tensor], attrs, want) -> dict[int, torch.Tensor]:
    """The results for ranks `want` of one collective given every rank's operand (`xs[r]`, all R
    ranks): evaluated once per group holding a wanted rank."""
    R = len(xs)
    g, s = attrs.get("ranks", R), attrs.get("stride", 1)
    if g * s != R:
        raise ExecError(f"{opname} is over groups of {g} ranks {s} apart but the executor runs {R} ranks")
    want = set(want)
    out: dict[int, torch.Tensor] = {}
    for c in sorted({r % s for r in want}):
        members = group_members(c, g, s)
        for r, y in zip(members, _group_collective(opname, [xs[r] for r in members], attrs)):
            if r in want:
                out[r] = y
    return out


def _collective(opname: str, xs: list[torch.Tensor], attrs) -> list[torch.Tensor]:
    """Every rank's result of one collective given every rank's operand."""
    out = collective_results(opname, xs, attrs, range(len(xs)))
    return [out[r] for r in range(len(xs))]


def _group_collective(opname: str, xs: list[torch.Tensor], attrs) -> list[torch.Tensor]:
    """Results of one collective within one group (operands in group index order): the op's
    registry entry says what they are (`OpDef.group_ref`)."""
    fn = get_op(opname).group_ref
    if fn is None:
        raise ExecError(f"the multi-rank reference executor does not implement collective {opname}")
    return fn([x.float() for x in xs], attrs)


# -- one step on some of the ranks ----------------------------------------------------------------
def rank_env(graph: Graph, weights: Mapping, state: Mapping, inputs: Mapping[str, torch.Tensor],
             precision: str) -> dict:
    """One rank's environment before its first op: its weights and state (already its slices)
    and the step inputs, cast for `precision`."""
    env: dict = {}
    for v in graph.params:
        if v.kind is Kind.weight:
            env[v.name] = weights[v.name]
        elif v.kind is Kind.state:
            env[v.name] = state[v.name].to(torch_dtype(v.type.dtype, precision))
        elif v.kind is Kind.io:
            if v.name not in inputs:
                raise ExecError(f"missing input {v.name}")
            env[v.name] = inputs[v.name].to(torch_dtype(v.type.dtype, precision))
    return env


def run_ops(graph: Graph, envs: Mapping[int, dict], precision: str, exchange, hooks=None) -> None:
    """Every op of the SPMD `graph` in program order on the ranks whose environments `envs` holds
    (rank -> env, filled in place): a non-collective op runs its registry reference per rank under
    `as_rank(r)`; a collective gets every rank's fp32 operand from `exchange({rank: operand} of
    the held ranks) -> [operand of rank 0..R-1]` (all ranks held: a lookup; one rank per process:
    an all-gather over the process group, backends/reference/dist.py) and is evaluated group by
    group, so every executor computes the same bits. `hooks[r]`: rank r's executor hook."""
    for op in graph.ops:
        if Trait.collective in op.opdef.traits:
            if len(op.inputs) != 1:
                raise ExecError(f"the multi-rank executor only runs single-operand collectives, not {op.opname}")
            xs = exchange({r: env[op.inputs[0].name].float() for r, env in envs.items()})
            outs = collective_results(op.opname, xs, op.attrs, envs.keys())
            for r, env in envs.items():
                env[op.outputs[0].name] = store(outs[r], op.outputs[0].type, precision)
            continue
        for r, env in envs.items():
            ins = [env[v.name] for v in op.inputs]
            with as_rank(r):
                outs = op.opdef.ref(ins, op.attrs)
            if hooks is not None:
                outs = hooks[r](op, ins, outs)
            for v, t in zip(op.outputs, outs):
                env[v.name] = store(t, v.type, precision)


def run_step_ranks(graph: Graph, full_weights: Mapping, ranks: int, full_state: dict,
                   inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int],
                   precision: str = "fp32", hooks=None) -> tuple[list[list[torch.Tensor]], dict]:
    """One decode step of the SPMD graph on `ranks` simulated ranks.

    `full_weights` and `full_state` are unsharded (keyed by the full names the annotations cite);
    returns (outputs of every rank, the full state after the step, gathered from the ranks).
    `full_state` is not mutated. `hooks[r]`: rank r's executor hook (op, inputs, outputs) ->
    outputs, e.g. fusec.debug.bisect.RouteAlign over that rank's kernel arena.
    """
    weights = [materialize_weights(graph, full_weights, r, precision) for r in range(ranks)]
    states = [shard_state(graph, full_state, r) for r in range(ranks)]
    envs = {r: rank_env(graph, weights[r], states[r], inputs, precision) for r in range(ranks)}
    run_ops(graph, envs, precision, lambda local: [local[r] for r in range(ranks)], hooks)
    new_states = [{name: envs[r][v.name] for name, v in graph.updates.items()} for r in range(ranks)]
    for r in range(ranks):
        for v in graph.states():
            new_states[r].setdefault(v.name, states[r][v.name])
    outputs = [[envs[r][v.name] for v in graph.outputs] for r in range(ranks)]
    bad = replica_mismatch(graph, new_states)
    if bad:     # replicas run the same ops on the same slices: a difference is a sharding bug
        raise ExecError(f"replicas disagree on the new state of {', '.join(bad[:3])}")
    return outputs, gather_state(graph, new_states)
