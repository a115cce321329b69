"""Every knob of the compiler in one typed place: compile options and the FUSEC_* environment
variables. On the passes floor, so every pass (and the backends, and the driver above them)
reads the same `Options`; the GPU it targets is `gpu`, a name in `fusec.passes.target.GPUS`.

Environment variables (read once per call of `Options.from_env`):
  FUSEC_LOG            comma list of log channels to print to stderr (e.g. `fusion,overlap,pass`)
  FUSEC_VERIFY         `end` (default) verifies the program once, after the last pass; `each`
                       after every pass (tests build `Options` directly, where verifying after
                       every pass is the default)
  FUSEC_SMS            SMs per GPU for scheduling (default: the target GPU's, 132 on an H200)
  FUSEC_SPLIT_REDUCE   `gated` (default): split_reduce cuts an all-reduce only where its cost
                       gate predicts a shorter step; `forced`: every eligible one (passes/split_reduce.py)
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

from .target import DEFAULT_GPU, gpu_spec

SPLIT_REDUCE_MODES = ("gated", "forced")


@dataclass(frozen=True)
class Options:
    ranks: int = 1
    batch: int = 1
    max_len: int = 4096             # cache capacity bound to the symbolic dim L
    sms: int | None = None          # None: the target GPU's SM count
    gpu: str = DEFAULT_GPU
    verify_each_pass: bool = True
    print_ir_after_all: bool = False
    dump_dir: str | None = None
    log: frozenset[str] = field(default_factory=frozenset)
    split_reduce: str = "gated"     # or "forced": cut every eligible all-reduce (no cost gate)

    def __post_init__(self):
        if self.split_reduce not in SPLIT_REDUCE_MODES:
            raise ValueError(f"split_reduce must be one of {', '.join(SPLIT_REDUCE_MODES)}, not {self.split_reduce!r}")
        if self.sms is None:   # frozen: set through object.__setattr__, once, at construction
            object.__setattr__(self, "sms", gpu_spec(self.gpu).sms)

    @staticmethod
    def from_env(**overrides) -> "Options":
        env = os.environ
        base = dict(
            log=frozenset(x for x in env.get("FUSEC_LOG", "").split(",") if x),
            verify_each_pass=env.get("FUSEC_VERIFY", "end") == "each",
            sms=int(env["FUSEC_SMS"]) if env.get("FUSEC_SMS") else None,
        )
        if env.get("FUSEC_SPLIT_REDUCE"):
            base["split_reduce"] = env["FUSEC_SPLIT_REDUCE"]
        base.update({k: v for k, v in overrides.items() if v is not None})
        return Options(**base)

    def replace(self, **kw) -> "Options":
        return dataclasses.replace(self, **kw)

    @property
    def dims(self) -> dict[str, int]:
        return {"B": self.batch, "L": self.max_len}


def log(opts: Options, channel: str, msg: str) -> None:
    """Print `[channel] msg` to stderr when the channel is enabled (FUSEC_LOG)."""
    if channel in opts.log or "all" in opts.log:
        print(f"[{channel}] {msg}", file=sys.stderr)
