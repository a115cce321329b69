"""The R ranks of one multi-rank schedule run on ONE GPU: each rank its own persistent megakernel
over its own arena, the kernels co-resident on disjoint SMs.

What it is for: the in-kernel collectives of a multi-rank table (COMM pushes into a peer's
arena, system-scope release/acquire on a peer's event counter, bounded waits naming the rank)
run on real hardware and are checked against the reference while no second GPU is available.
Every rank's arena is a separate allocation on the one device; a rank reaches its peers through
exactly what a symmetric allocation over several GPUs gives it: its table relocated with the
peers' arena bases (`Lowered.plan(peer_bases=...)`, verified there) and a peers table of their
event counters (`Megakernel.set_peers`). The schedule must be built for at most SMs / R SMs per
rank (`Options(sms=...)`): the ranks wait on each other inside their kernels, so all R must be
resident at once (the check below refuses grids that cannot be).

What it does not show: NVLink's latency and bandwidth and the memory model across GPUs (peer
stores here are stores to the same device's memory); one process per GPU over torch symmetric
memory (not built: issue 13).
"""
from __future__ import annotations

from fusec.backends.reference.ranks import materialize_weights

from .codegen import compile_key
from .lower import bind_weights, lower_ranks
from .runtime import Megakernel


class RankGroup:
    """`run(tokens, positions) -> [[logits, next_tokens] per rank]`, `reset()`."""

    def __init__(self, program, weights: dict, device: str = "cuda", plan_options=None):
        """`program`: after the default pipeline with `Options(ranks=R, sms=...)`; `weights`: the
        model graph's full (unsharded) weights, sliced per rank; `plan_options(rank) -> dict`:
        KernelPlan settings per rank (e.g. delay injection on one rank)."""
        import torch

        sched = program.schedule
        R = sched.ranks
        if R < 2:
            raise ValueError("RankGroup runs a multi-rank schedule (ranks >= 2)")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        lows = lower_ranks(sched)
        ctas = sum(len(low.queues) for low in lows)
        if ctas > sms:
            raise ValueError(f"{R} ranks x {len(lows[0].queues)} CTAs do not fit on {sms} SMs at once: build the "
                             f"schedule with Options(sms={sms // R})")
        g = program.graph
        self.program, self.ranks, self.device = program, R, device
        self.mems = [low.memory.bind(device) for low in lows]
        with torch.no_grad():
            for r, (low, mem) in enumerate(zip(lows, self.mems)):
                bind_weights(low, mem, materialize_weights(g, weights, r, "bf16"))
        self.plans = [low.plan(base=self.mems[r].base,
                               peer_bases={p: self.mems[(r + p) % R].base for p in range(R)},
                               **((plan_options or (lambda _r: {}))(r)))
                      for r, low in enumerate(lows)]
        # The tables differ only in words the kernel reads at run time (addresses, the rank's
        # own rows): ranks with the same generated source share one compile (siblings); other
        # plan settings on one rank (e.g. delay injection) compile their own.
        self.kernels = []
        for p in self.plans:
            twin = next((k for k in self.kernels if compile_key(k.plan) == compile_key(p)), None)
            self.kernels.append(twin.sibling(p) if twin is not None else Megakernel(p, device=device))
        for r, k in enumerate(self.kernels):
            k.set_peers(torch.tensor([self.kernels[(r + p) % R].events.data_ptr() for p in range(R)],
                                     dtype=torch.int64, device=device))
        for k in self.kernels:
            k.warm()
        self.streams = [torch.cuda.Stream(device) for _ in range(R)]
        self.state_names = [v.name for v in g.params if v.type.kind.value == "state"]
        self.out_names = [v.name for v in g.outputs]
        self.reset()

    def reset(self) -> None:
        for mem in self.mems:
            for n in self.state_names:
                mem.tensor(n).zero_()

    def run(self, tokens, positions) -> list[list]:
        """One step on every rank: the inputs copied into each arena, the R launches on their
        own streams (concurrent), then each rank's bounded-wait error raised (naming the rank)
        and copies of every rank's outputs returned."""
        import torch

        cur = torch.cuda.current_stream(self.device)
        for mem in self.mems:
            mem.tensor("tokens").copy_(tokens)
            mem.tensor("pos").copy_(positions)
        for k, s in zip(self.kernels, self.streams):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                k.step()
        for s in self.streams:
            cur.wait_stream(s)
        for k in self.kernels:
            k.check()
        return [[mem.tensor(n).clone() for n in self.out_names] for mem in self.mems]
