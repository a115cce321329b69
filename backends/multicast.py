"""NVLink multicast stays off in every multi-rank run (issue 13): the three switches of the
libraries a multi-process run goes through, NCCL (process group), PyTorch symmetric memory
(arenas and event counters) and NVSHMEM (symmetric memory's other backend).

`multicast_off(environ)` sets each to its off value where unset and refuses (ValueError naming
the variable) one set to anything else. NCCL and the allocators read them when they initialise:
the CLI sets them in the environment of the processes it starts; an engine that creates its own
process group calls this (or sets them) before `init_process_group`; `fusec.compile(ranks=R)`
calls it too, which is in time for symmetric memory but not for an NCCL communicator the engine
has already created.
"""
from __future__ import annotations

import os

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off(environ=None) -> dict:
    """Set the multicast-off variables in `environ` (default os.environ) where unset; returns it."""
    env = os.environ if environ is None else environ
    for name, off in MULTICAST_OFF.items():
        have = env.setdefault(name, off)
        if have.strip() != off:
            raise ValueError(f"{name}={have} would allow NVLink multicast; fusec's multi-rank runs keep it off "
                             f"({name}={off}, or unset it)")
    return env
