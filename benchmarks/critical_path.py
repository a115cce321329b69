"""Critical path of one profiled megakernel step, from a profile saved by cute_speed.py.

    FUSEC_PROFILE_DIR=. python benchmarks/cute_speed.py --config slice4-e128 --batches 16
    python benchmarks/critical_path.py profile_slice4-e128_b16.pt [--top 16]

The profile build stamps every task row with three globaltimer values (wait start, body start,
body end) and records its CTA. With --config and --batch (the profiled build's), the table is
rebuilt on the CPU (row i = profile row i, checked) and the walk follows the table's own events
(`walk_events`): from the row that ends last, back to whichever gated its start, the previous
row on its CTA or the last row that signals its wait's event; it reports the bodies on that
path, the cross-CTA hops with the time from release to body, the gaps between rows on one CTA
and, over every waiting row, the median from release to body per opcode (stop 26: 1.28 us).
Without --config the walk is a heuristic: a row that waited (body start more than 0.3 us after its wait start) is charged the signal
latency from the latest-ending row on ANOTHER CTA before its body started, and the walk moves to
that row (the events are not consulted, so a row released by an earlier producer while an
unrelated row ends later is misattributed: at B = 1 it wandered through 386 NOP rows); a row
that did not wait moves to the previous row of its own CTA. Body time is summed per
(opcode / sub / K) along the way and printed largest first. Either way the rows of the
non-streaming opcodes on the path are listed by the IR ops of their task when --config is given.

    python benchmarks/critical_path.py profile_slice4-e128_b1.pt --gaps

prints instead how long n CTAs were inside a weight-streaming body, by bands of n, and every
stretch of the step with none (with the rows that ran then): stop 27's count of B = 1's serial
time.
"""
from __future__ import annotations

import argparse
import bisect
import collections

import torch

from fusec.backends.cute.plan import Opcode

WAITED_US = 0.3     # a row whose body starts this long after its wait began was released late


STREAMING = ("GEMV_BF16", "GEMV_MXFP4", "EXPERT_BF16", "EXPERT_MXFP4")


def walk(path: str, names=None):
    """(body us per kind along the critical path, latency us per kind, path length in us, body us
    per (kind, IR ops of the task) of the non-streaming rows when `names` maps task id -> ops)."""
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
    by_ops = collections.defaultdict(float)
    for _ in range(n):
        body[kind(cur)] += be[cur] - bs[cur]
        if names is not None and Opcode(int(rows[cur, 1])).name not in STREAMING:
            by_ops[(kind(cur), names.get(int(rows[cur, 0]), "?"))] += be[cur] - bs[cur]
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
    return body, lat, span, by_ops


def walk_events(path: str, tasks, names):
    """The critical path walked by the table's own events (`tasks`: the profiled table's rows, as
    the CPU build lays them out; row i of the table is row i of the profile). A row's start is
    gated by the later of the previous row on its CTA and its wait's release (the last row that
    signals the event ends); the walk follows that gate backwards. Returns (body us per kind on
    the path, cross-CTA hops, us from release to body over them, us of gaps between consecutive
    rows on one CTA, span, body us by (kind, ops) of the non-streaming rows, the median release ->
    body us per opcode over every waiting row)."""
    d = torch.load(path)
    prof, rows, cta = d["prof"], d["rows"], d["cta"].tolist()
    if len(tasks) != len(rows) or any(t.task_id != int(rows[i, 0]) or int(t.opcode) != int(rows[i, 1])
                                      for i, t in enumerate(tasks)):
        raise SystemExit("critical_path: error: the CPU build's table does not match the profile's rows "
                         "(another config, batch or commit?)")
    t0 = int(prof[:, 0][prof[:, 0] > 0].min())
    ws, bs, be = (((prof[:, c] - t0) / 1e3).tolist() for c in range(3))
    signals = collections.defaultdict(list)
    for i, t in enumerate(tasks):
        if t.signal_event >= 0:
            signals[t.signal_event].append(i)
    release = {i: max(be[j] for j in signals[t.wait_event]) for i, t in enumerate(tasks)
               if t.wait_event >= 0 and signals[t.wait_event]}
    per_cta = collections.defaultdict(list)
    for i in range(len(tasks)):
        per_cta[cta[i]].append(i)
    prev = {}
    for lst in per_cta.values():
        lst.sort(key=lambda i: ws[i])
        prev.update(zip(lst[1:], lst))
    kind = lambda i: f"{Opcode(int(rows[i, 1])).name}/{int(rows[i, 2])}/k{int(rows[i, 5])}"  # noqa: E731
    cur = max(range(len(tasks)), key=lambda i: be[i])
    span = be[cur]
    body, by_ops = collections.defaultdict(float), collections.defaultdict(float)
    hops, hop_us, gap_us = 0, 0.0, 0.0
    while True:
        body[kind(cur)] += be[cur] - bs[cur]
        if names is not None and Opcode(int(rows[cur, 1])).name not in STREAMING:
            by_ops[(kind(cur), names.get(int(rows[cur, 0]), "?"))] += be[cur] - bs[cur]
        p = prev.get(cur)
        rel = release.get(cur, -1.0)
        if cur in release and rel > (be[p] if p is not None else -1.0):
            hops += 1
            hop_us += bs[cur] - rel
            cur = max(signals[tasks[cur].wait_event], key=lambda j: be[j])
        elif p is not None:
            gap_us += bs[cur] - be[p]
            cur = p
        else:
            break
    after = collections.defaultdict(list)
    for i, r in release.items():
        after[Opcode(int(rows[i, 1])).name].append(bs[i] - max(ws[i], r))
    medians = {k: sorted(v)[len(v) // 2] for k, v in after.items()}
    return body, hops, hop_us, gap_us, span, by_ops, medians


def streaming_gaps(path: str, min_gap_us: float = 0.5):
    """How much of the step the weight streams use (stop 27's question): ([(lo, hi, us)] time
    with lo..hi CTAs inside a streaming body, over the bands below, and [(start us, length us,
    {opcode/sub: rows running})] for every stretch of at least `min_gap_us` with none inside
    one). At B = 1 every family streams at ~4.6 TB/s while all CTAs stream, so the step's
    distance from the roofline is these stretches."""
    d = torch.load(path)
    prof, rows, ncta = d["prof"], d["rows"], len(set(d["cta"].tolist()))
    t0 = int(prof[:, 0][prof[:, 0] > 0].min())
    ws, bs, be = (((prof[:, c] - t0) / 1e3).tolist() for c in range(3))
    span = max(be)
    name = lambda i: Opcode(int(rows[i, 1])).name  # noqa: E731
    edges = sorted(e for i in range(len(bs)) if name(i) in STREAMING and be[i] > bs[i]
                   for e in ((bs[i], 1), (be[i], -1)))
    occupancy = collections.defaultdict(float)
    gaps, cur, last = [], 0, 0.0
    for t, step in edges + [(span, 0)]:
        occupancy[cur] += t - last
        if cur == 0 and t - last >= min_gap_us:
            gaps.append((last, t))
        cur, last = cur + step, t
    hi = max(ncta, max(occupancy))
    bands = [(0, 0), (1, hi // 8), (hi // 8 + 1, hi // 2), (hi // 2 + 1, hi * 5 // 6),
             (hi * 5 // 6 + 1, hi * 19 // 20), (hi * 19 // 20 + 1, hi)]
    hist = [(lo, h, sum(v for k, v in occupancy.items() if lo <= k <= h)) for lo, h in bands]
    listed = []
    for a, b in gaps:
        running = collections.Counter(f"{name(i)}/{int(rows[i, 2])}" for i in range(len(bs))
                                      if bs[i] < b and be[i] > a and name(i) != "NOP")
        listed.append((a, b - a, dict(running)))
    return hist, listed


def task_ops(config: str, batch: int, max_len: int) -> dict[int, str]:
    """Task id -> its IR ops ('+'-joined) in the K3 config's schedule at this batch (CPU build)."""
    import os

    import fusec.models as models
    from fusec.compiler import lower_for_cute
    from fusec.loader import load_graph
    graph, _ = load_graph(os.path.join(os.path.dirname(models.__file__), "kimi_k3.py"), config, None)
    prog, _ = lower_for_cute(graph, batch, max_len)
    return {t.id: "+".join(t.ops) for t in prog.schedule.tasks}


def table_rows(config: str, batch: int, max_len: int):
    """The K3 config's task table as the runner builds it (CPU; row i = profile row i)."""
    from fusec.backends.cute.weight_tiles import tile_options
    from fusec.compiler import lower_for_cute
    from fusec.models import kimi_k3
    low = lower_for_cute(kimi_k3.build_graph(config), batch, max_len)[1]
    return low.plan(base=0, **tile_options(low, None)).tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a profile_<config>_b<B>.pt written by cute_speed.py with FUSEC_PROFILE_DIR")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--config", help="the profiled K3 config (e.g. slice4-e128): name the rows' IR ops")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--gaps", action="store_true", help="print how many CTAs stream weights over the step and "
                    "every stretch with none (streaming_gaps) instead of the walk")
    args = ap.parse_args()
    if args.gaps:
        hist, gaps = streaming_gaps(args.profile)
        print(f"{args.profile}: time with n CTAs inside a weight-streaming body "
              f"({', '.join(STREAMING)}):")
        for lo, hi, us in hist:
            print(f"  {lo:4d}-{hi:4d} CTAs  {us:8.1f} us")
        print(f"  {len(gaps)} stretches with none, {sum(g[1] for g in gaps):.1f} us; start us, length us, rows running:")
        for a, n, running in gaps:
            print(f"    {a:8.1f} {n:6.1f}  {running}")
        return
    names = task_ops(args.config, args.batch, args.max_len) if args.config else None
    if args.config:
        tasks = table_rows(args.config, args.batch, args.max_len)
        body, hops, hop_us, gap_us, span, by_ops, medians = walk_events(args.profile, tasks, names)
        print(f"{args.profile}: step span {span:.0f} us, by the table's events: bodies on the path "
              f"{sum(body.values()):.0f} us over {len(body)} kinds, {hops} cross-CTA hops "
              f"{hop_us:.0f} us ({hop_us / max(hops, 1):.2f} each, release -> body), gaps between rows "
              f"on one CTA {gap_us:.0f} us")
        for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {k:28s} {v:8.1f} us")
        print("  median us from a wait's release (or its start, if later) to the body, every row:",
              ", ".join(f"{k} {v:.2f}" for k, v in sorted(medians.items())))
        print("  non-streaming rows on the path by task ops:")
        for (k, ops), v in sorted(by_ops.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"    {v:7.1f} us  {k:20s} {ops[:110]}")
        return
    body, lat, span, by_ops = walk(args.profile, names)
    print(f"{args.profile}: step span {span:.0f} us, bodies on the path {sum(body.values()):.0f} us, "
          f"latency {sum(lat.values()):.0f} us")
    for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {k:28s} {v:8.1f} us")
    print("  largest latencies:", ", ".join(f"{k} {v:.1f} us" for k, v in
                                            sorted(lat.items(), key=lambda kv: -kv[1])[:6]))
    if names is not None:
        print("  non-streaming rows on the path by task ops:")
        for (k, ops), v in sorted(by_ops.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"    {v:7.1f} us  {k:20s} {ops[:110]}")


if __name__ == "__main__":
    main()
