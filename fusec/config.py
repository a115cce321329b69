"""Every knob of fusec in one typed place: compile options and the FUSEC_* environment variables.

Environment variables (read once per call of `Options.from_env`):
  FUSEC_LOG            comma list of log channels to print to stderr (e.g. `fusion,overlap,pass`)
  FUSEC_VERIFY         `end` (default) verifies the program once, after the last pass; `each`
                       after every pass (tests build `Options` directly, where verifying after
                       every pass is the default)
  FUSEC_SMS            SMs per GPU for scheduling (default 132, an H200)
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Options:
    ranks: int = 1
    batch: int = 1
    max_len: int = 4096             # cache capacity bound to the symbolic dim L
    sms: int = 132
    gpu: str = "h200"
    verify_each_pass: bool = True
    print_ir_after_all: bool = False
    dump_dir: str | None = None
    log: frozenset[str] = field(default_factory=frozenset)

    @staticmethod
    def from_env(**overrides) -> "Options":
        env = os.environ
        base = dict(
            log=frozenset(x for x in env.get("FUSEC_LOG", "").split(",") if x),
            verify_each_pass=env.get("FUSEC_VERIFY", "end") == "each",
            sms=int(env.get("FUSEC_SMS", "132")),
        )
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
