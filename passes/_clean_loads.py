"""Vectorized pre-check for the memory-order verifier: which loads cannot break V1/V2 or V4.

Not a pass and not a rule of its own: `memory_order.v1_v2_producers` and `v4_races` run their
per-load Python code only on the loads this module cannot clear, so every violation is still
found and worded by the rules themselves. A full K3 schedule has ~240 K checked loads; per load,
the rules' Python costs ~20 us, the arrays below ~1 us.

Per buffer copy (the loads of one (rank, buffer) and the stores into it), with numpy over the
(load, store) matrix, exactly the conditions the rules test load by load:

* overlap: a0 < b1 and b0 < a1 in every dim (`Access._overlapping`); `same` = the store writes
  the version the load reads, `later` = a later version; `own` = the same task instance;
* store-before-load: own instance -> earlier instruction, else `hb.before` (the load's clock
  entry for the store's queue >= the store's position);
* V1/V2 clear: every other-instance `same` store happens before the load; no `later` store
  (another instance's, or the load's own earlier one) happens before it; and, when the load needs
  a producer, the `same` stores (the load's own later ones excluded) cover its volume (the
  rules' volume count, `Access.covered`);
* V4 clear: every other-instance `later` store is ordered with the load one way or the other
  (load-before-store: the store's clock entry for the load's queue >= the load's position), and
  no `same` store is a peer's write (the comm-reuse check stays with the rule).

A load of a buffer copy whose boxes differ in rank, or of a symmetric schedule's copy other
than rank 0, is left to the rules.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from fusec.ir.types import Kind


_CELLS = 1 << 22        # loads x clock entries per vectorized batch (whole buffer copies): ~16 MB


def clear_loads(hb, acc) -> tuple[np.ndarray, np.ndarray]:
    """(V1/V2 clear, V4 clear): one bool per `acc.loads` entry (weight and io-input loads, which
    neither rule reads, are left False)."""
    loads = acc.loads
    ok12 = np.zeros(len(loads), dtype=bool)
    ok4 = np.zeros(len(loads), dtype=bool)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, ld in enumerate(loads):
        if ld.kind is Kind.weight or ld.is_input or (hb.sym and ld.copy != 0):
            continue
        groups[(ld.rank, ld.buf)].append(i)
    batch: list[tuple[list[int], list]] = []
    size, chunk = 0, max(256, _CELLS // (hb.R * hb.nq))
    for (rank, buf), idx in groups.items():
        L, S = [loads[i] for i in idx], acc.stores_at(rank, buf)
        nd = len(L[0].region.box)
        if any(len(a.region.box) != nd for a in L) or any(len(a.region.box) != nd for a in S):
            continue                                  # boxes of another rank: left to the rules
        batch.append((idx, S))
        size += len(idx)
        if size >= chunk:
            _batch(hb, loads, batch, ok12, ok4)
            batch, size = [], 0
    if batch:
        _batch(hb, loads, batch, ok12, ok4)
    return ok12, ok4


def _batch(hb, loads, batch, ok12, ok4) -> None:
    """The two flags for the loads of several buffer copies at once (`batch`: per copy, the
    load indices and the stores into it)."""
    where, vc, sym, R, nq = hb.where, hb.vc, hb.sym, hb.R, hb.nq
    W = R * nq
    idx, key_of, keys, reps, kgroup = [], {}, [], [], []
    own_tasks = [{st.uid for st in sts} for _, sts in batch]
    for g, (ids, _) in enumerate(batch):
        for i in ids:
            ld = loads[i]
            if ld.uid in own_tasks[g]:
                continue                # the load's task stores into this copy too: left to the rules
            k = (g, ld.region.box, ld.version)
            j = key_of.get(k)
            if j is None:
                j = key_of[k] = len(reps)
                reps.append(ld)
                kgroup.append(g)
            idx.append(i)
            keys.append(j)
    if not idx:
        return
    S = [st for _, sts in batch for st in sts]
    nK, nL = len(reps), len(idx)
    gK = np.array(kgroup, dtype=np.int64)
    gS = np.repeat(np.arange(len(batch)), [len(sts) for _, sts in batch])
    nd = max(len(a.region.box) for a in reps + S)
    pad = ((0, 1),) * nd                # a [0, 1) dim overlaps itself and counts 1 in a volume
    Kb = np.array([a.region.box + pad[len(a.region.box):] for a in reps], dtype=np.int64).reshape(nK, nd, 2)
    Sb = np.array([a.region.box + pad[len(a.region.box):] for a in S], dtype=np.int64).reshape(len(S), nd, 2)
    volK = np.prod(np.maximum(Kb[:, :, 1] - Kb[:, :, 0], 0), axis=1)
    # candidate (load box, store) pairs, per buffer copy: its stores sorted by their start along
    # the dim with the most distinct starts; those starting before the box ends and whose
    # running maximum end passes its start form one run per box (`Access._overlapping`'s index).
    # Keys carry the copy's number times `big`: one sorted array serves every copy of the batch.
    big = int(max(Kb.max(initial=0), Sb.max(initial=0))) + 1
    dS = np.zeros(len(batch), dtype=np.int64)
    for g, (_, sts) in enumerate(batch):
        if sts:
            n = len(sts[0].region.box)
            dS[g] = max(range(n), key=lambda k: len({a.region.box[k][0] for a in sts})) if n else 0
    ar = np.arange(len(S))
    lo_s, hi_s = gS * big + Sb[ar, dS[gS], 0], gS * big + Sb[ar, dS[gS], 1]
    order = np.argsort(lo_s, kind="stable")
    pmax = np.maximum.accumulate(hi_s[order]) if len(S) else hi_s
    a = np.searchsorted(pmax, gK * big + Kb[np.arange(nK), dS[gK], 0], side="right")
    b = np.maximum(np.searchsorted(lo_s[order], gK * big + Kb[np.arange(nK), dS[gK], 1], side="left"), a)
    cnt = b - a
    ki = np.repeat(np.arange(nK), cnt)
    si = order[np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(a, cnt)]
    kb, sb = Kb[ki], Sb[si]
    # the rules' overlap test (a0 < b1 and b0 < a1 in every dim) and the volume they count
    over = ((sb[:, :, 0] < kb[:, :, 1]) & (kb[:, :, 0] < sb[:, :, 1])).all(axis=1)
    ki, si, kb, sb = ki[over], si[over], kb[over], sb[over]
    inter = np.prod(np.maximum(np.minimum(kb[:, :, 1], sb[:, :, 1]) - np.maximum(kb[:, :, 0], sb[:, :, 0]), 0), axis=1)
    vK, vS = np.array([x.version for x in reps]), np.array([x.version for x in S], dtype=np.int64)
    same, later = vS[si] == vK[ki], vS[si] > vK[ki]
    qpS = [where[x.task.id] for x in S]
    copyS = np.array([x.copy for x in S], dtype=np.int64)
    # the store's clock entry as seen from a load (a symmetric schedule's loads are copy 0)
    cS = np.array([q for q, _ in qpS], dtype=np.int64) + ((copyS % R) * nq if sym else 0)
    pS = np.array([p for _, p in qpS], dtype=np.int64)
    # per box: the position each queue must have reached (every same-version store before the
    # load) and the first position that would put a later-version store before it
    req = np.full((nK, W), -1, dtype=np.int32)
    np.maximum.at(req, (ki[same], cS[si[same]]), pS[si[same]])
    first_later = np.full((nK, W), np.iinfo(np.int32).max, dtype=np.int32)
    np.minimum.at(first_later, (ki[later], cS[si[later]]), pS[si[later]])
    cov = np.bincount(ki[same], weights=inter[same], minlength=nK) >= volK
    peer = np.bincount(ki[same], weights=(copyS != np.array([x.rank for x in S]))[si[same]], minlength=nK) > 0
    keys = np.array(keys)
    L = [loads[i] for i in idx]
    VCl = np.stack([vc[x.task.id][x.idx] for x in L])
    need = np.array([x.needs_producer for x in L])
    c1 = (VCl >= req[keys]).all(axis=1)
    c3 = ~(VCl >= first_later[keys]).any(axis=1)
    ok12[idx] = c1 & (cov[keys] | ~need) & c3
    # V4: every later-version store is ordered with the load one way or the other
    # (`hb.before(load -> store)`: the store's clock entry for the load's queue)
    kl = np.flatnonzero(np.bincount(ki[later], minlength=nK) > 0)
    war = np.zeros(nL, dtype=bool)
    if len(kl):
        has = np.isin(keys, kl)
        lpos = np.flatnonzero(has)
        pairs_k = ki[later]
        ls = si[later]
        # (load, later store) pairs of the loads whose box has any
        korder = np.argsort(pairs_k, kind="stable")
        pk, ps = pairs_k[korder], ls[korder]
        start = np.searchsorted(pk, keys[lpos], side="left")
        end = np.searchsorted(pk, keys[lpos], side="right")
        n = end - start
        lp = np.repeat(lpos, n)
        sp = ps[np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(start, n)]
        qpL = [where[L[i].task.id] for i in lp]
        qL = np.array([q for q, _ in qpL], dtype=np.int64)
        pL = np.array([p for _, p in qpL], dtype=np.int64)
        VCs = np.stack([vc[S[j].task.id][S[j].idx] for j in sp]) if len(sp) else np.zeros((0, W), np.int16)
        col = qL + ((-copyS[sp] % R) * nq if sym else 0)
        lbs = VCs[np.arange(len(sp)), col] >= pL
        sbl = VCl[lp, cS[sp]] >= pS[sp]
        bad = ~sbl & ~lbs
        war[lp[bad]] = True
    ok4[idx] = ~war & ~peer[keys]
