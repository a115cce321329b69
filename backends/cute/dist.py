"""One rank of a multi-rank megakernel per process: arenas and event counters in PyTorch
symmetric memory, one process per GPU (issue 13).

`DistCuteRunner` is the cute backend's runner for THIS process's rank r of R (its process group
rank; torchrun starts one process per GPU). From the program's replicated schedule it builds its
own rank's table (`lower_ranks(schedule)[r]`: one memory plan on every rank), then

- allocates its arena (`MemoryPlan.arena_bytes()`) and its event counters in symmetric memory
  (`torch.distributed._symmetric_memory.empty`) and exchanges them with the group
  (`rendezvous(tensor, group)`, collective): the handle's `buffer_ptrs` are every rank's
  allocation as this process maps it (peer GPU memory over NVLink / PCIe P2P);
- binds its weights (its slices of the full checkpoint, or `RankWeights` read as such) into its arena;
- relocates its table with the peers' arena bases (`Lowered.plan(base, peer_bases)`, peer p =
  rank (r + p) % R, verified there), so a COMM PUSH row stores into the peer's arena;
- builds its kernel over the symmetric event counters (`Megakernel(events=...)`) with the peers
  table of the other ranks' counters (`set_peers`), so system-scope signals land in the peer's
  counter; warms it (module loaded before any rank spins on another) and waits at a group
  barrier, so no rank's first step pushes into an arena still being bound.

Steps are `CuteRunner`'s (one launch or graph replay, bounded-wait errors read back
asynchronously); a timed-out wait names this rank. Every rank must run the same steps: the
kernels wait on each other inside the launch. NVLink multicast stays off (backends/multicast.py;
no multimem instruction is generated: the PTX audit's rule P4).

Written and compile-checked on a machine without a GPU; not yet run on two GPUs
(tests/gpu/test_cute_dist.py is the check, docs/cute_backend.md says what ran where).
"""
from __future__ import annotations

from fusec.backends.multicast import multicast_off

from .runner import CuteRunner, check_cute_args


def peer_pointers(handle, local, ranks: int) -> list[int]:
    """Every rank's address of the symmetric tensor `local` (this rank's), by group rank, as this
    process maps it: the handle's allocation bases plus `local`'s offset in its allocation (the
    same on every rank: the allocations are symmetric)."""
    if handle.world_size != ranks:
        raise ValueError(f"symmetric memory handle over {handle.world_size} ranks, expected {ranks}")
    ptrs = list(handle.buffer_ptrs)
    off = local.data_ptr() - ptrs[handle.rank]
    if off < 0:
        raise ValueError("symmetric tensor lies before its allocation's base")
    return [p + off for p in ptrs]


def rank_plan(low, rank: int, ranks: int, arenas: list[int], counters: list[int], plan_options=None):
    """Rank `rank`'s plan relocated into the arenas (`arenas[q]`: rank q's arena as this process
    maps it) and its peers table (entry p: rank (rank + p) % R's event counters)."""
    plan = low.plan(base=arenas[rank], peer_bases={p: arenas[(rank + p) % ranks] for p in range(ranks)},
                    **(plan_options or {}))
    return plan, [counters[(rank + p) % ranks] for p in range(ranks)]


class DistCuteRunner(CuteRunner):
    """fusec.api Runner for rank `rank` of a multi-rank program, one process per GPU."""

    def __init__(self, program, weights: dict, dims: dict, device: str, precision: str, *, rank: int,
                 group=None, plan_options: dict | None = None, out_dir=None):
        """`program`: after the default pipeline with `Options(ranks=R)`; `weights`: the model
        graph's full (unsharded) weights, the same on every rank (sliced here), or this rank's
        `RankWeights` (already sliced, e.g. read from a checkpoint: only cast); `group`: the
        torch.distributed process group of the R processes (None: the default group)."""
        import torch
        import torch.distributed as dist
        from torch.distributed import _symmetric_memory as symm

        from fusec.backends.reference.ranks import materialize_weights
        from .lower import bind_weights, lower_ranks
        from .runtime import Megakernel

        multicast_off()
        check_cute_args(program, device, precision)
        torch.cuda.set_device(device)
        R = program.schedule.ranks
        if R < 2:
            raise ValueError("DistCuteRunner runs a multi-rank schedule (ranks >= 2)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("the multi-rank cute runner needs an initialized torch.distributed process group")
        if dist.get_world_size(group) != R or dist.get_rank(group) != rank:
            raise ValueError(f"process group of {dist.get_world_size(group)} processes (this one rank "
                             f"{dist.get_rank(group)}) for rank {rank} of {R}")
        self.dims, self.device, self.rank, self.ranks, self.group = dims, device, rank, R, group
        lows = lower_ranks(program.schedule)          # one memory plan on every rank (checked there)
        self.program, self.lowered = program, lows[rank]
        g = program.graph
        # Symmetric allocations: the same sizes on every rank (every rank lowers every table).
        arena = symm.empty(self.lowered.memory.arena_bytes(), dtype=torch.uint8, device=device)
        events = symm.empty(max(1, max(low.num_events for low in lows)), dtype=torch.int32, device=device)
        # rendezvous takes a group or its name, not None (seen on the H200: TypeError)
        grp = group if group is not None else dist.group.WORLD
        self._symm = (arena, events, symm.rendezvous(arena, grp), symm.rendezvous(events, grp))
        bases = peer_pointers(self._symm[2], arena, R)
        counters = peer_pointers(self._symm[3], events, R)
        self.mem = self.lowered.memory.bind(device, arena=arena)
        with torch.no_grad():
            bind_weights(self.lowered, self.mem, materialize_weights(g, weights, rank, "bf16"))
        self.plan, peers = rank_plan(self.lowered, rank, R, bases, counters, plan_options)
        self.kernel = Megakernel(self.plan, out_dir=out_dir, device=device, events=events)
        self.kernel.set_peers(torch.tensor(peers, dtype=torch.int64, device=device))
        self.kernel.warm()
        self._init_host()
        # every rank's arena bound, counters zeroed and kernel loaded before any rank's first step
        torch.cuda.synchronize(device)
        dist.barrier(group)
