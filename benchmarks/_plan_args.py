"""What the KernelPlan-variant scripts (plan_variants.py, ab_seq_split.py, ptxas_bodies.py) share:
the K3 config / batch / length arguments, the timed builds' parser, and `field=value` plan settings parsed against the plan's own field
types (bool("False") is True, so bools are parsed by name)."""
from __future__ import annotations

import argparse


def plan_config_args(ap: argparse.ArgumentParser) -> None:
    """--config, --batch, --max-len: the K3 config and the step the plan is built for."""
    ap.add_argument("--config", default="slice4-e128")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=4096)


def timed_builds_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The parser of a script that times builds of one config against its default build:
    plan_config_args and --reps, --rounds, --control (the interleaved rounds of
    `_timing.rotated_rounds`); the script adds what it varies."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    plan_config_args(ap)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--control", action="store_true", help="also time the default built again (an A/A row)")
    return ap


def plan_fields(plan, text: str, prog: str) -> dict:
    """'field=value[,field=value]' -> {field: value typed like plan.field}; a bad value exits with
    one `<prog>: error:` line."""
    out = {}
    for item in (f for f in text.split(",") if f):
        field, _, value = item.partition("=")
        if not hasattr(plan, field):
            raise SystemExit(f"{prog}: error: KernelPlan has no field {field!r}")
        cur = getattr(plan, field)
        if isinstance(cur, bool):
            if value not in ("True", "False"):
                raise SystemExit(f"{prog}: error: {field} takes True or False, not {value!r}")
            out[field] = value == "True"
        else:
            try:
                out[field] = type(cur if cur is not None else 0)(value)
            except ValueError:
                raise SystemExit(f"{prog}: error: {field}={value!r} is not a {type(cur).__name__}") from None
    return out
