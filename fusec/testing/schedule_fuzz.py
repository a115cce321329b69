"""Schedule fuzzer: an independent cross-check of the memory-order verifier, at scale.

Edits compiled schedules of K3 tiny and Llama tiny at R = 1, 2 and 8 (unsafe edits of many
kinds, and edits meant to be safe), and asks two judges about each edit: the verifier
(`check_schedule`, on the Schedule object and, for a share of the edits, on the printed and
re-parsed text as `fusec verify` reads it) and an oracle that shares none of the verifier's code
and decides by running the schedule (`fusec.testing.schedule_fuzz_oracle`: structural
feasibility, a tagged executor that poisons stale reads, freeze runs and a happens-before
simulation for deadlocks). Per kind: edits, unsafe by the oracle, rejected by the verifier,
false accepts (unsafe, accepted), false rejects (safe, rejected), crashes (the verifier raised).

    python -m fusec.testing.schedule_fuzz --edits 10000 --out docs/results/verifier_fuzz.json

The edits (`fusec.testing.schedule_fuzz_edits`) are made on Schedule objects (rank 0's lists of a
replicated schedule, i.e. every rank at once; at R > 1 a quarter of them then go to the verifier
materialized, its explicit per-rank path), never with `fusec.testing.mutate` and never by asking
the verifier where to edit. A kind that has no site in a schedule is skipped for it (counted, not
an edit). Results and the command: docs/verifier.md, "Fuzzer".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
import traceback
import zlib
from collections import Counter, defaultdict

from fusec.ir.schedule import Schedule

from .schedule_fuzz_edits import KINDS, Ctx, Skip, copy_schedule

CONFIGS = [("llama", 1), ("llama", 2), ("llama", 8), ("kimi_k3", 1), ("kimi_k3", 2), ("kimi_k3", 8)]
# share of the edits per configuration (K3 at R = 8 is the slowest to run and to verify)
WEIGHTS = {("llama", 1): 2, ("llama", 2): 1.5, ("llama", 8): 1, ("kimi_k3", 1): 2.5, ("kimi_k3", 2): 2,
           ("kimi_k3", 8): 1}


# rough seconds per edit (oracle + verifier), for ordering the work
COST = {("llama", 1): 0.02, ("llama", 2): 0.05, ("llama", 8): 0.2, ("kimi_k3", 1): 0.25, ("kimi_k3", 2): 0.4,
        ("kimi_k3", 8): 1.5}


# -- the two judges --------------------------------------------------------------------------------
_LAST_RESORT = "the verifier cannot analyse it"


def verify(s: Schedule, text: bool):
    """(rejected, rules, crash traceback or None, text verdict or None)."""
    from fusec.passes.memory_order import check_schedule
    try:
        rep = check_schedule(s)
    except Exception:
        return True, [], "object: " + traceback.format_exc(limit=4), None
    rejected, rules = (not rep.ok), sorted(rep.rules())
    if any(_LAST_RESORT in e.message for e in rep.errors):     # a rule's code raised; check_schedule caught it
        rules.append("internal")
    if not text:
        return rejected, rules, None, None
    from fusec.ir.schedule_text import ScheduleSyntaxError, parse_schedule, print_schedule
    try:
        txt = print_schedule(s)
    except Exception:       # a schedule the printer cannot write is not a text `fusec verify` can be given
        return rejected, rules, None, None
    try:
        rep = check_schedule(parse_schedule(txt))
        tverdict = not rep.ok
    except ScheduleSyntaxError:
        tverdict = True
    except Exception:
        return rejected, rules, "text: " + traceback.format_exc(limit=4), None
    return rejected, rules, None, tverdict


def oracle_structure_ok(s, oracle) -> bool:
    from fusec.testing.schedule_fuzz_oracle import structure
    return structure(s, oracle.bufs) is None



_BASES: dict = {}


def base(model: str, ranks: int):
    """(schedule, oracle) of a compiled tiny model: batch 2, max_len 16, 8 SMs."""
    key = (model, ranks)
    if key not in _BASES:
        from fusec.compiler import lower
        from fusec.passes.options import Options
        from fusec.loader import load_graph
        from fusec.testing.schedule_fuzz_oracle import Oracle
        g, _ = load_graph(model, "tiny")
        s = lower(g, Options(ranks=ranks, batch=2, max_len=16, sms=8, verify_each_pass=False)).schedule
        _BASES[key] = (s, Oracle(s))
    return _BASES[key]


def one_edit(model, ranks, kind, seed, text_share=0.05, explicit_share=0.25):
    """Make edit `seed` of `kind` on the configuration; judge it. None when the kind has no site."""
    s0, oracle = base(model, ranks)
    rng = random.Random(zlib.crc32(f"{model}:{ranks}:{kind}:{seed}".encode()))
    s = copy_schedule(s0)
    try:
        what = KINDS[kind].fn(Ctx.of(s), rng)
    except Skip:
        return None
    # a share of the edits at R > 1 go to the verifier materialized (its explicit, per-rank path):
    # the same edit on every rank. A malformed replicated schedule stays as it is (materializing
    # would take its out-of-range ranks modulo R or renumber its bad task ids).
    explicit = ranks > 1 and s.replicated and rng.random() < explicit_share and oracle_structure_ok(s, oracle)
    if explicit:
        s = s.materialize()
        s.replicated = False
    t0 = time.perf_counter()
    v = oracle.classify(s)
    t1 = time.perf_counter()
    rejected, rules, crash, tv = verify(s, rng.random() < text_share)
    t2 = time.perf_counter()
    return {"config": f"{model} R={ranks}", "kind": kind, "seed": seed, "explicit": explicit, "edit": what,
            "oracle": v.kind, "unsafe": v.unsafe, "oracle_why": v.why, "runs": v.runs,
            "unproven": v.unproven, "undecided": v.undecided,
            "rejected": rejected, "rules": rules, "crash": crash,
            "text": tv, "t_oracle": t1 - t0, "t_verify": t2 - t1}


def _chunk(args):
    model, ranks, kinds, start, count = args
    out, skipped = [], Counter()
    i = start
    made = 0
    tries = 0
    while made < count and tries < count * 20:
        kind = kinds[i % len(kinds)]
        seed = i // len(kinds)
        i += 1
        tries += 1
        r = one_edit(model, ranks, kind, seed)
        if r is None:
            skipped[kind] += 1
            continue
        out.append(r)
        made += 1
    return out, dict(skipped)


def plan(edits: int, configs=CONFIGS, chunk: int = 25):
    """Chunks (model, ranks, kinds, start index, count) that add up to `edits` edits."""
    total = sum(WEIGHTS[c] for c in configs)
    kinds = list(KINDS)
    out = []
    left = edits
    for j, (model, ranks) in enumerate(configs):
        n = left if j == len(configs) - 1 else round(edits * WEIGHTS[(model, ranks)] / total)
        left -= n
        start = 0
        while n > 0:
            c = min(chunk, n)
            # chunks start at far-apart indices so their (kind, seed) pairs never collide
            out.append((model, ranks, kinds, start * 1000, c))
            start += 1
            n -= c
    # the slowest configurations first, so that the workers finish together
    order = {c: j for j, c in enumerate(sorted(configs, key=lambda c: -COST[c]))}
    return sorted(out, key=lambda ch: order[(ch[0], ch[1])])


def run(edits: int, workers: int = 2, configs=CONFIGS, progress=None) -> dict:
    t0 = time.time()
    for model, ranks in configs:      # compile and prepare before forking: the workers share them
        base(model, ranks)
    chunks = plan(edits, configs)
    records, skipped = [], Counter()
    if workers > 1:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers) as pool:
            for recs, sk in pool.imap_unordered(_chunk, chunks):
                records += recs
                skipped.update(sk)
                if progress:
                    progress(len(records))
    else:
        for ch in chunks:
            recs, sk = _chunk(ch)
            records += recs
            skipped.update(sk)
            if progress:
                progress(len(records))
    return summarize(records, skipped, time.time() - t0, workers)


def summarize(records, skipped, seconds, workers) -> dict:
    per = defaultdict(Counter)
    per_config = defaultdict(Counter)
    bad = []
    for r in records:
        for key, table in ((r["kind"], per), (r["config"], per_config)):
            c = table[key]
            c["edits"] += 1
            c["unsafe"] += r["unsafe"]
            c["rejected"] += r["rejected"]
            c["false_accepts"] += r["unsafe"] and not r["rejected"]
            c["false_rejects"] += (not r["unsafe"]) and r["rejected"] and not r["crash"]
            c["crashes"] += bool(r["crash"])
            c["internal_errors"] += "internal" in r["rules"]
            c["contract_only"] += r["oracle"] == "contract"
            c["oracle_undecided"] += r["undecided"] > 0
            c["text_checked"] += r["text"] is not None
            c["text_disagrees"] += r["text"] is not None and r["text"] != r["rejected"]
        if (r["unsafe"] != r["rejected"]) or r["crash"] or "internal" in r["rules"] or (
                r["text"] is not None and r["text"] != r["rejected"]):
            bad.append(r)
    total = Counter()
    for c in per.values():
        total.update(c)
    oracle_kinds = Counter(r["oracle"] for r in records)
    return {
        "edits": len(records), "seconds": round(seconds, 1), "workers": workers,
        "configs": sorted(per_config), "total": dict(total),
        "per_kind": {k: {"group": KINDS[k].group, "what": KINDS[k].what, **per[k]} for k in KINDS if k in per},
        "per_config": {k: dict(v) for k, v in sorted(per_config.items())},
        "oracle_verdicts": dict(oracle_kinds),
        "skipped_no_site": dict(skipped),
        "oracle_runs_mean": round(sum(r["runs"] for r in records) / max(1, len(records)), 2),
        "oracle_s_mean": round(sum(r["t_oracle"] for r in records) / max(1, len(records)), 4),
        "verify_s_mean": round(sum(r["t_verify"] for r in records) / max(1, len(records)), 4),
        "disagreements": [{k: r[k] for k in ("config", "kind", "seed", "explicit", "edit", "oracle", "oracle_why",
                                             "rejected", "rules", "crash", "text")} for r in bad[:200]],
    }


def table(summary: dict) -> str:
    """The per-kind table as Markdown."""
    cols = ("edits", "unsafe", "contract_only", "rejected", "false_accepts", "false_rejects", "crashes",
            "internal_errors")
    lines = ["| kind | group | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for k, c in summary["per_kind"].items():
        lines.append(f"| {k} | {c['group']} | " + " | ".join(str(c.get(x, 0)) for x in cols) + " |")
    t = summary["total"]
    lines.append("| **total** | | " + " | ".join(f"**{t.get(x, 0)}**" for x in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusec.testing.schedule_fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", type=int, default=10000, help="number of edits (all configurations together)")
    ap.add_argument("--workers", type=int, default=2, help="processes (this machine has 2 cores)")
    ap.add_argument("--configs", default="all", help="comma list like llama:1,kimi_k3:8 (default: all six)")
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args(argv)
    if args.edits < 1 or args.workers < 1:
        print("fusec: error: --edits and --workers must be >= 1", file=sys.stderr)
        return 2
    configs = CONFIGS
    if args.configs != "all":
        configs = [tuple(x.split(":")) for x in args.configs.split(",")]
        configs = [(c[0], int(c[1])) for c in configs if len(c) == 2 and c[1].isdigit()]
        bad = [c for c in configs if c not in CONFIGS]
        if bad or not configs:
            print(f"fusec: error: --configs takes a comma list of {', '.join(f'{m}:{r}' for m, r in CONFIGS)}",
                  file=sys.stderr)
            return 2
    last = [0.0]

    def progress(n):
        if time.time() - last[0] > 10:
            last[0] = time.time()
            print(f"  {n} edits", file=sys.stderr, flush=True)

    summ = run(args.edits, args.workers, configs, progress)
    summ["command"] = "python -m fusec.testing.schedule_fuzz " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(summ))
    print(f"{summ['edits']} edits in {summ['seconds']} s ({summ['workers']} workers); "
          f"oracle {summ['oracle_s_mean']} s, verifier {summ['verify_s_mean']} s per edit")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summ, f, indent=1)
            f.write("\n")
    t = summ["total"]
    return 1 if t.get("false_accepts") or t.get("false_rejects") or t.get("crashes") or t.get("internal_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
