"""`fusec run --ranks R`: R processes, one rank each, started by torchrun (torch.distributed.run).

The parent (`launch`) checks what it can without starting anything (devices, the multicast
switches), then runs `python -m torch.distributed.run --standalone --nproc-per-node R -m
fusec.cli run ...` with the same interpreter and arguments, NVLink multicast off in the
children's environment (backends/multicast.py). Each child (a torchrun worker: `worker()` is
true) joins the group (`init_worker`: gloo on the CPU, NCCL with one GPU per process), compiles
its rank (`fusec.compile(..., ranks=R)`), generates, and checks that every rank produced the
same tokens (`check_same_tokens`, an all-gather); rank 0 prints what a single-rank `fusec run`
prints. The parent captures the children's output: on success it prints rank 0's, on failure
the first `fusec: error:` line a child printed (it names the rank), never torchrun's traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys

ERROR, INTERNAL = "fusec: error: ", "fusec: internal error: "


def worker() -> bool:
    """Whether this process is a rank started by torchrun (which sets these for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def rank_device(ranks: int, backend: str, device: str | None) -> str:
    """The device every rank runs on, "cpu" or "cuda" (each rank its own GPU, cuda:LOCAL_RANK);
    ValueError for what R processes cannot run."""
    device = device or ("cuda" if backend == "cute" else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--ranks {ranks} gives every rank its own GPU (cuda:LOCAL_RANK): use --device cpu or "
                         f"cuda, not {device}")
    if backend == "cute" and device != "cuda":
        raise ValueError("backend 'cute' needs device='cuda'")
    return device


def launch(argv: list[str], ranks: int, backend: str, device: str | None) -> int:
    """Start the R ranks of `fusec run` (`argv`: the command's own arguments) and relay them."""
    import torch

    from fusec.backends.multicast import multicast_off

    device = rank_device(ranks, backend, device)
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < ranks:
            raise ValueError(f"--ranks {ranks} on {device} needs {ranks} GPUs, one per rank (have {have})")
    env = multicast_off(dict(os.environ))
    env.setdefault("OMP_NUM_THREADS", "1")      # torchrun's default, set here so it does not warn
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "fusec.cli", *argv]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode == 0:
        sys.stdout.write(p.stdout)
        return 0
    lines = p.stderr.splitlines()
    for prefix, rc in ((ERROR, 2), (INTERNAL, 70)):
        line = next((ln for ln in lines if ln.startswith(prefix)), None)
        if line is not None:
            print(line, file=sys.stderr)
            return rc
    last = next((ln for ln in reversed(lines) if ln.strip()), "no output")
    print(f"{INTERNAL}torchrun exited with {p.returncode}: {last.strip()}", file=sys.stderr)
    return 70


def init_worker(device: str) -> None:
    """Join the group torchrun set up (its environment): NCCL with this process's GPU on CUDA,
    gloo on the CPU."""
    import torch
    import torch.distributed as dist

    from fusec.backends.multicast import multicast_off

    multicast_off()
    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")


def token_mismatch(per_rank) -> str | None:
    """What differs between the ranks' generated tokens (`per_rank[r]`: [steps, B]), or None."""
    for r, t in enumerate(per_rank[1:], 1):
        for s in range(per_rank[0].shape[0]):
            if not bool((t[s] == per_rank[0][s]).all()):
                return f"rank {r} generated other tokens than rank 0 at step {s}: {t[s].tolist()} vs {per_rank[0][s].tolist()}"
    return None


def check_same_tokens(tokens, ranks: int) -> None:
    """All-gather every rank's generated tokens; ValueError naming the first rank that differs."""
    import torch
    import torch.distributed as dist

    on = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    t = tokens.to(device=on, dtype=torch.int64).contiguous()
    parts = [torch.empty_like(t) for _ in range(ranks)]
    dist.all_gather(parts, t)
    bad = token_mismatch([p.cpu() for p in parts])
    if bad:
        raise ValueError(bad)
