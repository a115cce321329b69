"""Critical path of one profiled megakernel step, from a profile saved by cute_speed.py.

    FUSEC_PROFILE_DIR=. python benchmarks/cute_speed.py --config slice4-e128 --batches 16
    python benchmarks/critical_path.py profile_slice4-e128_b16.pt [--top 16]

The profile build stamps every task row with three globaltimer values (wait start, body start,
body end) and records its CTA. The walk starts at the row that ends last and goes backwards:
a row that waited (body start more than 0.3 us after its wait start) is charged the signal
latency from the latest-ending row on ANOTHER CTA before its body started, and the walk moves to
that row (a heuristic for its releasing producer: the table's events are not consulted, so a
row released by an earlier producer while an unrelated row ends later is misattributed); a row
that did not wait moves to the previous row of its own CTA. Body time is summed per
(opcode / sub / K) along the way and printed largest first, with the largest latencies.
"""
from __future__ import annotations

import argparse
import bisect
import collections

import torch

from fusec.backends.cute.plan import Opcode

WAITED_US = 0.3     # a row whose body starts this long after its wait began was released late


def walk(path: str):
    """(body us per kind along the critical path, latency us per kind, path length in us)."""
    d = torch.load(path)
    prof, rows, cta = d["prof"], d["rows"], d["cta"].tolist()
    t0 = int(prof[:, 0][prof[:, 0] > 0].min())
    ws, bs, be = (((prof[:, c] - t0) / 1e3).tolist() for c in range(3))
    n = len(ws)

    def kind(i):
        return f"{Opcode(int(rows[i, 1])).name}/{int(rows[i, 2])}/k{int(rows[i, 5])}"

    order = sorted(range(n), key=lambda i: be[i])
    ends = [be[i] for i in order]
    prev, per_cta = {}, collections.defaultdict(list)
    for i in range(n):
        per_cta[cta[i]].append(i)
    for lst in per_cta.values():
        lst.sort(key=lambda i: ws[i])
        prev.update(zip(lst[1:], lst))
    cur = max(range(n), key=lambda i: be[i])
    span = be[cur]
    body, lat = collections.defaultdict(float), collections.defaultdict(float)
    for _ in range(n):
        body[kind(cur)] += be[cur] - bs[cur]
        if bs[cur] - ws[cur] > WAITED_US:
            j = bisect.bisect_right(ends, bs[cur]) - 1
            while j >= 0 and cta[order[j]] == cta[cur]:
                j -= 1
            if j < 0:
                break
            lat[kind(cur)] += bs[cur] - be[order[j]]
            cur = order[j]
        else:
            p = prev.get(cur)
            if p is None:
                break
            lat["gap on the CTA"] += max(0.0, ws[cur] - be[p])
            cur = p
    return body, lat, span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a profile_<config>_b<B>.pt written by cute_speed.py with FUSEC_PROFILE_DIR")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    body, lat, span = walk(args.profile)
    print(f"{args.profile}: step span {span:.0f} us, bodies on the path {sum(body.values()):.0f} us, "
          f"latency {sum(lat.values()):.0f} us")
    for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {k:28s} {v:8.1f} us")
    print("  largest latencies:", ", ".join(f"{k} {v:.1f} us" for k, v in
                                            sorted(lat.items(), key=lambda kv: -kv[1])[:6]))


if __name__ == "__main__":
    main()
