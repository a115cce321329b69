"""Test helper: run a worker in R processes (torch.multiprocessing) and collect what each saved.

`spawn_ranks(worker, folder, R, *args)` calls `worker(rank, init, out, *args)` in R processes,
with `init` a file:// rendezvous in `folder` for `torch.distributed.init_process_group` and `out`
the path prefix each rank saves its result to (`torch.save(..., f"{out}.{rank}")`), and returns
the R results in rank order."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp


def spawn_ranks(worker, folder, ranks: int, *args) -> list:
    mp.spawn(worker, args=(f"file://{folder}/pg", str(folder / "out"), *args), nprocs=ranks, join=True)
    return [torch.load(folder / f"out.{r}", weights_only=False) for r in range(ranks)]
