"""The proof section of `fusec report`: what the memory-order verifier checked, rule by rule, the
randomized-order runs, the PTX audit and the prefetch check.

Rule counts: the verifier's rules (passes/memory_order.py) are run one by one here, in the
order `check_schedule` runs them and over the same derived facts, so each gets its violation
count, its time and the number of things it was stated over (what it checked). The verdict the
compile reached (`prog.notes["memory_order"]`) is shown beside them; the two must agree.
"""
from __future__ import annotations

import time

from fusec.ir.schedule import InstrKind
from fusec.ir.types import Kind

from .sections import section, table


def rule_counts(schedule) -> list[dict]:
    """One row per rule: what it was stated over (count), its violations and its time."""
    from fusec.ir.gc_pause import gc_paused
    with gc_paused():       # as check_schedule does: ~10^6 long-lived objects, nothing to collect
        return _rule_counts(schedule)


def _rule_counts(schedule) -> list[dict]:
    from fusec.passes import memory_order as mo
    from fusec.passes._derive import Derived, structure
    from fusec.passes.memory_access import Access, expand_ranks

    rows = []

    def run(rule, what, n, fn):
        t = time.perf_counter()
        errs = fn()
        rows.append({"rule": rule, "checked": what, "count": n, "violations": len(errs),
                     "first": str(errs[0]) if errs else "", "ms": round((time.perf_counter() - t) * 1e3, 1)})
        return errs

    s0 = schedule
    instrs = [i for t in s0.tasks for i in t.instrs]
    ranked = sum(1 for i in instrs if i.peer is not None or (i.region is not None and i.region.rank is not None))
    sync = sum(1 for i in instrs if i.kind in (InstrKind.WAIT, InstrKind.SIGNAL))
    mem = sum(1 for i in instrs if i.kind in (InstrKind.LOAD, InstrKind.STORE))
    struct = structure(s0)
    for r, what, n in (("S1", "tasks, queue entries and instructions", len(s0.tasks) + sum(map(len, s0.queues.values())) + len(instrs)),
                       ("S2", "event declarations and the waits/signals naming them", len(s0.events) + sync),
                       ("S3", "queue headers and instructions naming a rank or peer", len(s0.queues) + ranked)):
        run(r, what, n, lambda r=r: [e for e in struct if e.rule.value == r])
    if struct:
        return rows
    der = Derived(s0)
    fatal = []

    def s4():
        errs, stop = der.check()
        fatal.append(stop)
        return errs
    run("S4", "LOAD/STORE lines against the regions derived from each task's ops", mem, s4)
    if fatal[0]:
        return rows
    sym = bool(getattr(s0, "replicated", False)) and s0.ranks > 1
    s = s0 if sym else expand_ranks(s0)
    R = s.ranks
    run("V7", "queues compared across ranks" if R > 1 and not sym else "queues on the one grid every rank runs",
        len(s.queues), lambda: mo.v7_same_grid(s))
    s_instrs = [i for t in s.tasks for i in t.instrs]
    run("V6", "signals (release after the last store) and waits (acquire, sys scope across GPUs)",
        sum(1 for i in s_instrs if i.kind in (InstrKind.WAIT, InstrKind.SIGNAL)), lambda: mo.v6_signal_semantics(s))
    t0 = time.perf_counter()
    hb = mo.HappensBefore(s, symmetric=sym)
    hb_ms = (time.perf_counter() - t0) * 1e3
    run("V5", "wait thresholds, event signal counts and queues walked to completion",
        sum(1 for i in s_instrs if i.kind is InstrKind.WAIT) + len(s.events) + len(s.tasks), lambda: mo.v5_deadlock(s, hb))
    acc = Access(s, hb, der)
    data = [a for a in acc.loads if a.kind is not Kind.weight and not a.is_input]
    run("V1+V2", "reads of activations, state and comm buffers: producer happens before, wait placed before",
        len(data), lambda: mo.v1_v2_producers(s, hb, acc))
    run("V3", "loads addressed by a run-time value (expert ids, positions): after its producer",
        sum(1 for a in acc.loads if a.addr), lambda: mo.v3_addressed_loads(s, hb, acc))
    pairs = sum(1 for _ in acc.overlapping_store_pairs())
    run("V4", "reads checked for a write-after-read race, plus pairs of overlapping stores (write-after-write)",
        len(data) + pairs, lambda: mo.v4_races(s, hb, acc))
    rows.append({"rule": "HB", "checked": "happens-before: one simulated step, a vector clock per instruction",
                 "count": len(s_instrs), "violations": 0, "first": "", "ms": round(hb_ms, 1)})
    return rows


def prefetch_check(schedule, hoisted: int | None) -> dict:
    """Only static weights cross waits: every LOAD placed before a task's first WAIT must read a
    weight that no run-time value addresses (the prefetch pass's rule, checked on the result)."""
    weights = {v.name for v in schedule.graph.params if v.kind is Kind.weight}
    early = bad = addressed_after = 0
    first_bad = ""
    for t in schedule.tasks:
        seen_wait = False
        for i in t.instrs:
            if i.kind is InstrKind.WAIT:
                seen_wait = True
            elif i.kind is InstrKind.LOAD and not seen_wait and any(x.kind is InstrKind.WAIT for x in t.instrs):
                early += 1
                if i.region.tensor not in weights or i.addressed_by is not None:
                    bad += 1
                    first_bad = first_bad or f"task {t.id}: %{i.region.tensor} loaded before a wait"
            elif i.kind is InstrKind.LOAD and seen_wait and i.addressed_by is not None:
                addressed_after += 1
    return {"loads_before_waits": early, "not_static_weight": bad, "first": first_bad,
            "addressed_after_waits": addressed_after, "hoisted_by_pass": hoisted}


def random_orders(schedule, orders: int, budget_s: float) -> dict:
    """Run up to `orders` random legal orders (two steps each) within `budget_s` seconds (at least
    one). Numeric at R = 1 (outputs compared with the reference executor), symbolic above (poisoned
    reads and deadlocks only: numeric needs the full unsharded checkpoint)."""
    from fusec.testing.random_order import RandomOrderRunner
    t0 = time.perf_counter()
    runner = RandomOrderRunner(schedule, steps=2)
    prep = time.perf_counter() - t0
    results = []
    for seed in range(orders):
        if results and time.perf_counter() - t0 > budget_s:
            break
        t = time.perf_counter()
        r = runner.run(seed)
        results.append({"seed": seed, "policy": r.policy.value, "ok": r.ok, "why": r.why(), "instructions": r.instrs,
                        "s": round(time.perf_counter() - t, 2)})
    return {"numeric": runner.numeric, "asked": orders, "ran": len(results), "results": results,
            "prepare_s": round(prep, 2), "memo_hits": runner.memo_hits}


def ptx_audit(prog, enabled: bool) -> dict:
    from fusec.extras import MissingExtraError, require_cute
    try:
        require_cute()
    except MissingExtraError as e:
        return {"ran": False, "why": f"the cute extra is not installed ({e})"}
    if not enabled:
        return {"ran": False, "why": "not run: compiling the megakernel for sm_90a takes ~30 s on a CPU; "
                                     "`fusec report ... --ptx-audit` runs it (so does `fusec compile --emit cute`)"}
    import os
    import tempfile
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from fusec.backends.cute.lower import lower_schedule
    from fusec.backends.cute.ptx_audit import audit_plan
    t = time.perf_counter()
    plan = lower_schedule(prog.schedule).plan(base=0)
    with tempfile.TemporaryDirectory(prefix="fusec-report-ptx-") as d:
        rep = audit_plan(plan, d)
    return {"ran": True, "ok": rep.ok, "summary": rep.summary(), "violations": rep.violations[:20],
            "s": round(time.perf_counter() - t, 1)}


def proof_section(prog, *, orders: int, orders_budget_s: float, ptx: bool) -> dict:
    s = prog.schedule
    verdict = prog.notes.get("memory_order")
    rows = rule_counts(s)
    found = sum(r["violations"] for r in rows)
    ro = random_orders(s, orders, orders_budget_s)
    pf = prefetch_check(s, prog.notes.get("prefetched_loads"))
    audit = ptx_audit(prog, ptx)
    ok_orders = sum(r["ok"] for r in ro["results"])
    parts = [f"verifier {'OK' if verdict is None or verdict.ok else 'FAILED'} ({len(rows) - 1} rules, {found} violations)",
             f"random orders {ok_orders}/{ro['ran']} ok ({'numeric' if ro['numeric'] else 'symbolic'})",
             ("PTX audit " + ("PASS" if audit["ok"] else "FAIL")) if audit["ran"] else "PTX audit not run",
             f"prefetch: {pf['loads_before_waits']} loads before waits, {pf['not_static_weight']} not static weights"]
    tables = [table("memory-order verifier, rule by rule (passes/memory_order.py; docs/verifier.md)",
                    ["rule", "what it checked", "count", "violations", "first violation", "ms"],
                    [[r["rule"], r["checked"], r["count"], r["violations"], r["first"] or "-", r["ms"]] for r in rows]),
              table(f"randomized legal orders, two steps each ({'outputs compared with the reference executor' if ro['numeric'] else 'symbolic: poisoned reads and deadlocks; numeric runs need the full unsharded checkpoint'})",
                    ["seed", "policy", "ok", "instructions", "result", "s"],
                    [[r["seed"], r["policy"], "yes" if r["ok"] else "NO", r["instructions"], r["why"], r["s"]]
                     for r in ro["results"]])]
    notes = []
    if ro["ran"] < ro["asked"]:
        notes.append(f"random orders: {ro['ran']} of {ro['asked']} ran within the report's time budget "
                     f"({orders_budget_s:.0f} s); `--orders N` with more time runs more")
    facts = [("verifier verdict at compile", "OK" if verdict is None or verdict.ok else verdict.first_error()),
             ("prefetch check", f"{pf['loads_before_waits']} LOADs sit before a task's first WAIT; "
                                f"{pf['not_static_weight']} of them are not static weights"
                                + (f" (first: {pf['first']})" if pf["first"] else "")
                                + f"; {pf['addressed_after_waits']} addressed loads stay after the waits"
                                + (f"; the prefetch pass hoisted {pf['hoisted_by_pass']}" if pf["hoisted_by_pass"] is not None else "")),
             ("PTX audit (P1-P3)", audit["summary"] + f" ({audit['s']} s)" if audit["ran"] else audit["why"])]
    sec = section("proof", "Proof", "; ".join(parts) + ".", facts=facts, tables=tables, notes=notes)
    sec["data"] = {"rules": rows, "random_orders": ro, "prefetch": pf, "ptx_audit": audit,
                   "verdict_ok": verdict is None or verdict.ok}
    return sec
