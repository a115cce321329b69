"""What a kernel's warps stall on and what its hottest loop is made of, from Nsight Compute's
per-SASS-line source counters.

    python benchmarks/ncu_sass_summary.py ncu_mx_sass.csv

The input is what `ncu --import R.ncu-rep --page source --csv --print-source sass` writes (stage
`ncu-mx-src` of benchmarks/h200_session.sh leaves it in $OUT as ncu_mx_sass.csv): a kernel-name
line, a header line, then one line per SASS instruction with its stall samples by reason and its
executed count. Printed: the share of all stall samples by reason; the instruction mix of the
most-executed loop (the instructions whose executed count is the largest, one count per trip);
and the most-sampled instruction of that loop with the share of its own samples that are long
scoreboard. This file is the summary in docs/results/ncu_h200_mx_glu_b16_stalls_stop36.txt.
"""
from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _opcode(source: str) -> str:
    """The opcode of a SASS line, its guard predicate (@P0) dropped."""
    words = source.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def summarize(lines: list[str], reasons: int = 9) -> str:
    rows = list(csv.reader(lines))
    header = next(r for r in rows if "Source" in r and SAMPLES in r)
    data = [r for r in rows[rows.index(header) + 1:] if len(r) >= len(header)]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, h):
        return int(r[col[h]] or 0)

    total = sum(num(r, SAMPLES) for r in data)
    by_reason = collections.Counter({h[len("stall_"):]: sum(num(r, h) for r in data) for h in stalls})
    out = [f"stall samples {total}, by reason:"]
    out += [f"  {k:18s} {v / total:6.1%}" for k, v in by_reason.most_common(reasons) if v]
    trips = max(num(r, EXECUTED) for r in data)
    loop = [r for r in data if num(r, EXECUTED) == trips]
    mix = collections.Counter(_opcode(r[col["Source"]].strip()) for r in loop)
    out.append(f"the most-executed loop ({len(loop)} SASS instructions, executed {trips} times):")
    out.append("  " + ", ".join(f"{k} {v}" for k, v in mix.most_common()))
    hot = max(loop, key=lambda r: num(r, SAMPLES))
    share = num(hot, "stall_long_sb") / max(1, num(hot, SAMPLES))
    out.append(f"its most-sampled instruction: {hot[col['Source']].strip()} ({num(hot, SAMPLES) / total:.1%} of all "
               f"samples, long_sb {share:.0%} of its own)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        print(summarize(f.read().splitlines()))


if __name__ == "__main__":
    main()
