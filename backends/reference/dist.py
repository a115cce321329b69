"""One rank of an SPMD (sharded) graph per process: the reference backend over torch.distributed.

`DistReferenceRunner` runs THIS process's rank of the graph the shard pass produced (after
`fusec.compiler.lower` with `Options(ranks=R)`): its weights are its slices of the full
checkpoint (`materialize_weights`; or read as such, `RankWeights`), its state its slices (zero at reset), and its ops the same
loop as the one-process multi-rank oracle (`ranks.run_ops`): a non-collective op runs its
registry reference under `as_rank(rank)`; a collective all-gathers every rank's operand (fp32:
exact for bf16 and fp32 operands) over the process group and applies the op's `group_ref` to
its group's members in group-index order. Every rank therefore computes exactly the bits
`run_step_ranks` computes for it, and the ranks holding replicated outputs (the logits, the
greedy tokens) hold identical ones.

The group is any torch.distributed process group of R processes, process rank r (in the group)
being fusec rank r: gloo with CPU tensors, NCCL with CUDA ones (one process per GPU).
"""
from __future__ import annotations

import torch

from fusec.ir.graph import Graph

from .executor import first_nonfinite_op, init_state
from .ranks import materialize_weights, rank_env, run_ops


def group_all_gather(group, ranks: int):
    """`run_ops`'s exchange for one rank per process: this rank's operand in, every rank's out."""
    import torch.distributed as dist

    def exchange(local: dict) -> list[torch.Tensor]:
        (x,) = local.values()
        x = x.float().contiguous()
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x, group=group)
        return parts
    return exchange


class DistReferenceRunner:
    """fusec.api Runner for rank `rank` of `ranks` (`run(tokens, positions) -> outputs`, `reset()`)."""

    def __init__(self, graph: Graph, full_weights: dict, dims: dict, device: str, precision: str,
                 rank: int, ranks: int, group=None):
        """`graph`: the SPMD graph; `full_weights`: the model's full (unsharded) weights, the same
        on every rank (sliced here), or this rank's `RankWeights` (already sliced, e.g. read rank
        by rank from a checkpoint: only cast); `group`: the torch.distributed group (None: the
        default)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("a multi-rank reference runner needs an initialized torch.distributed process group")
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if size != ranks or me != rank:
            raise ValueError(f"process group of {size} processes (this one rank {me}) for rank {rank} of {ranks}")
        self.graph, self.dims, self.device, self.precision = graph, dims, device, precision
        self.rank, self.ranks, self.group = rank, ranks, group
        self.weights = {k: w.to(device) for k, w in materialize_weights(graph, full_weights, rank, precision).items()}
        self._exchange = group_all_gather(group, ranks)
        self.reset()

    def reset(self) -> None:
        # zero state: the zero full state's slices are zeros of this rank's shapes
        self.state = init_state(self.graph, self.dims, self.device, self.precision)
        self.last_env = None

    def run(self, tokens, positions, hook=None):
        """One step of this rank; `hook`: its executor hook (op, inputs, outputs) -> outputs."""
        env = rank_env(self.graph, self.weights, self.state, {"tokens": tokens, "pos": positions}, self.precision)
        run_ops(self.graph, {self.rank: env}, self.precision, self._exchange,
                None if hook is None else {self.rank: hook})
        self.last_env = env
        for name, v in self.graph.updates.items():
            self.state[name] = env[v.name]
        return [env[v.name] for v in self.graph.outputs]

    def explain_nonfinite(self) -> str | None:
        """'rank r: op NAME -> %value' for the first op of the last step with a non-finite result."""
        hit = first_nonfinite_op(self.graph, self.last_env or {})
        return None if hit is None else f"rank {self.rank}: first produced by op {hit[0].opname} -> %{hit[1]}"
