"""Structural cross-checks and derived accesses for the memory-order verifier ("derive, don't
trust"). Not a pass; `memory_order.check_schedule` runs these before the rules V1-V7.

* `structure(s)` -> violations of S1 (tasks, queues, instruction fields), S2 (events) and S3
  (ranks, SMs, peers). Any of them means the rules V1-V7 cannot be stated over the schedule
  (a queue naming a task that does not exist, an event nobody declared), so the verifier stops
  there with the message instead of crashing or guessing.
* `Derived(s).check()` -> S4 violations: each task's reads and writes are derived from its ops
  and the graph, with the region rules of the `tile` pass (passes/_regions.py, the tile loop of
  passes/_lowering.py), and the task's LOAD / STORE lines must cover exactly that: every region
  its ops read is loaded, nothing is loaded that no op reads, every value its ops compute for
  other tasks is stored over the derived box, nothing else is stored. `Derived.addr(task)`
  gives the addressing dependency of each load from the graph (`OpDef.addressed_by`: the
  operand that indexes the loaded one, e.g. moe_gate_up's router ids); V3 uses it together with
  the declared `addressed_by` (an annotation may only add a dependency, never remove one).

Collective tasks (one op of trait `collective`) are derived by what every lowering of a collective
does: the op's operands are loaded whole, writes go to the op's result (own rank) or to comm
buffers (slots, on any rank in R), and comm buffers may be loaded.
"""
from __future__ import annotations

from itertools import product

from fusec.ir.registry import Trait
from fusec.ir.schedule import InstrKind, Region, Schedule
from fusec.ir.types import Kind

from ._lowering import _anchor_kind, op_box_rule
from ._regions import box_hull, full_box, input_rule, out_rule
from ._rules import Rule, Violation


def _v(rule, task, message, region="", wait=""):
    return Violation(Rule(rule), task, region, wait, message)


_NO = object()     # a default no value is


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- S1-S3: structure ----------------------------------------------------------------------------
def structure(s: Schedule, syncs: list | None = None) -> list:
    """S1 tasks/queues/instructions, S2 events, S3 ranks/SMs/peers. Never raises.
    `syncs`, when given, receives per task [(instr index, instr)] of its WAITs and SIGNALs (what
    `memory_order.sync_instrs` computes; complete only when no violation is returned)."""
    out = []
    R, sms = s.ranks, s.sms
    rep = bool(getattr(s, "replicated", False)) and R > 1
    if not _is_int(R) or R < 1 or not _is_int(sms) or sms < 1:
        return [_v("S3", None, f"schedule declares {R} ranks x {sms} SMs (both must be >= 1)")]
    n = len(s.tasks)
    for i, t in enumerate(s.tasks):
        if t.id != i:
            out.append(_v("S1", t.id, f"task at position {i} of the task list has id {t.id} "
                                      f"(ids must be 0..{n - 1} in order, each once)"))
    if out:
        return out
    ranks_ok = range(1) if rep else range(R)
    # -- S2: events (declared first: the task walk below checks every use) ----------------------
    declared: dict[tuple[int, int], object] = {}
    for e in s.events:
        if not _is_int(e.id) or e.id < 0 or not _is_int(e.rank):
            out.append(_v("S2", None, f"event {e.id!r} on rank {e.rank!r} is malformed"))
            continue
        if e.rank not in ranks_ok:
            out.append(_v("S2", None, f"event e{e.id} is declared on rank {e.rank}, outside " +
                          ("rank 0 (a replicated schedule declares rank 0's events)" if rep
                           else f"ranks 0..{R - 1}")))
            continue
        if (e.rank, e.id) in declared:
            out.append(_v("S2", None, f"event e{e.id} is declared twice on rank {e.rank}"))
        declared[(e.rank, e.id)] = e
        if not _is_int(e.per_step) or e.per_step < 0:
            out.append(_v("S2", None, f"event e{e.id} on rank {e.rank} declares per_step {e.per_step}"))
    # -- S3 / S1: tasks' ranks and SMs, instruction fields, peers, region ranks, event uses ------
    LOAD, STORE, WAIT, SIGNAL, COMPUTE = (InstrKind.LOAD, InstrKind.STORE, InstrKind.WAIT, InstrKind.SIGNAL,
                                          InstrKind.COMPUTE)
    undeclared: dict[tuple[int, int], int] = {}
    ops_ok: dict[int, tuple] = {}       # id -> ops tuple found well-formed (shared by a family's tasks)
    for t in s.tasks:
        rank, sm = t.rank, t.sm
        # each check: a quick test of the exact types first, the full one only when it fails
        if not (rank.__class__ is int and rank in ranks_ok) and (not _is_int(rank) or rank not in ranks_ok):
            out.append(_v("S3", t.id, f"task header names rank {t.rank}, outside " +
                          ("rank 0 (a replicated schedule stores rank 0's tasks)" if rep else f"ranks 0..{R - 1}")))
            continue
        if not (sm.__class__ is int and 0 <= sm < sms) and (not _is_int(sm) or not 0 <= sm < sms):
            out.append(_v("S3", t.id, f"task header names sm {t.sm}, outside SMs 0..{sms - 1}"))
        tile, ops = t.tile, t.ops
        box = tile.__class__ is tuple
        for d in tile if box else ():
            if d.__class__ is not tuple or len(d) != 2 or d[0].__class__ is not int or d[1].__class__ is not int:
                box = False
                break
        if not box and (tile.__class__ is not tuple or not all(d.__class__ is tuple and len(d) == 2 and _is_int(d[0])
                                                               and _is_int(d[1]) for d in tile)):
            out.append(_v("S1", t.id, f"task tile {tile!r} is not a box [lo:hi, ...]"))
        if ops_ok.get(id(ops), _NO) is not ops:
            if ops.__class__ is not tuple or not all(o.__class__ is str for o in ops):
                out.append(_v("S1", t.id, f"task ops {ops!r} is not a list of value names"))
            else:
                ops_ok[id(ops)] = ops
        if not isinstance(t.instrs, list):
            out.append(_v("S1", t.id, "task body is not a list of instructions"))
            continue
        sy = []
        if syncs is not None:
            syncs.append(sy)
        for k, i in enumerate(t.instrs):
            try:
                kind = i.kind
            except AttributeError:
                kind = None
            if kind is LOAD or kind is STORE:           # fast path first: the common, well-formed case
                r = i.region
                if r.__class__ is Region and (r.rank is None or (r.rank.__class__ is int and 0 <= r.rank < R)) and r.tensor.__class__ is str and (
                        i.addressed_by is None or (kind is LOAD and i.addressed_by.__class__ is str)) \
                        and i.peer is None and i.event is None and i.threshold is None:
                    continue
            elif kind is WAIT or kind is SIGNAL:
                ev, pe = i.event, i.peer
                if ev.__class__ is int and ev >= 0 and (pe is None or (pe.__class__ is int and 0 <= pe < R)) and i.region is None \
                        and i.addressed_by is None and (i.threshold is None if kind is SIGNAL else (
                            i.threshold.__class__ is int and i.threshold >= 0)):
                    key = (0 if rep else (t.rank if pe is None else pe), ev)
                    if key not in declared and key not in undeclared:
                        undeclared[key] = t.id
                    sy.append((k, i))
                    continue
            elif kind is COMPUTE:
                if i.region is None and i.event is None and i.threshold is None and i.peer is None \
                        and i.addressed_by is None:
                    continue
            out += _instr_errors(t, k, i, R)
    for (rank, ev), tid in undeclared.items():
        out.append(_v("S2", tid, f"wait or signal on event e{ev} of rank {rank}, which is never declared"
                                 + (" (in rank 0's layout)" if rep else "")))
    # -- S1: queues ------------------------------------------------------------------------------
    for key, ids in s.queues.items():
        if not (isinstance(key, tuple) and len(key) == 2 and _is_int(key[0]) and _is_int(key[1])):
            out.append(_v("S1", None, f"queue key {key!r} is not (rank, sm)"))
            continue
        for pos, tid in enumerate(ids):
            if not _is_int(tid) or not 0 <= tid < n:
                out.append(_v("S1", None, f"queue (rank {key[0]}, sm {key[1]}) lists task {tid} at position "
                                          f"{pos}, which does not exist (tasks 0..{n - 1})"))
                continue
            t = s.tasks[tid]
            if (t.rank, t.sm) != key:
                out.append(_v("S1", tid, f"task header says rank {t.rank} sm {t.sm} but the task sits on the "
                                         f"queue of rank {key[0]} sm {key[1]}"))
    return out


def _instr_errors(t, k, i, R) -> list:
    """Why instruction k of task t is malformed (S1) or names a rank outside R (S3)."""
    out = []
    kind = getattr(i, "kind", None)
    if kind not in (InstrKind.LOAD, InstrKind.STORE, InstrKind.WAIT, InstrKind.SIGNAL, InstrKind.COMPUTE):
        return [_v("S1", t.id, f"instruction {k} is not a load/wait/compute/store/signal")]
    extra = [f for f, bad in (("region", i.region is not None and kind not in (InstrKind.LOAD, InstrKind.STORE)),
                              ("event", i.event is not None and kind not in (InstrKind.WAIT, InstrKind.SIGNAL)),
                              ("threshold", i.threshold is not None and kind is not InstrKind.WAIT),
                              ("peer", i.peer is not None and kind not in (InstrKind.WAIT, InstrKind.SIGNAL)),
                              ("addressed_by", i.addressed_by is not None and kind is not InstrKind.LOAD)) if bad]
    if extra:
        out.append(_v("S1", t.id, f"{kind.value} (instruction {k}) carries {', '.join(extra)}, which only "
                                  f"{'loads/stores' if extra[0] == 'region' else 'other instructions'} have"))
    if kind is InstrKind.COMPUTE:
        return out
    if kind in (InstrKind.LOAD, InstrKind.STORE):
        r = i.region
        if not isinstance(r, Region) or not isinstance(r.tensor, str):
            return [_v("S1", t.id, f"{kind.value} (instruction {k}) has no well-formed region")]
        if r.rank is not None and (not _is_int(r.rank) or not 0 <= r.rank < R):
            out.append(_v("S3", t.id, f"{kind.value} %{r.tensor} names rank {r.rank}, outside ranks "
                                      f"0..{R - 1} (rank indices are never taken modulo R)"))
        if i.addressed_by is not None and kind is InstrKind.LOAD and not isinstance(i.addressed_by, str):
            out.append(_v("S1", t.id, f"{kind.value} %{r.tensor} has a malformed addressed_by"))
        return out
    if not _is_int(i.event) or i.event < 0:
        out.append(_v("S1", t.id, f"{kind.value} (instruction {k}) names no event"))
    if kind is InstrKind.WAIT and (not _is_int(i.threshold) or i.threshold < 0):
        out.append(_v("S1", t.id, f"wait e{i.event} has threshold {i.threshold} (an int >= 0)"))
    if i.peer is not None and (not _is_int(i.peer) or not 0 <= i.peer < R):
        out.append(_v("S3", t.id, f"{kind.value} e{i.event} names peer {i.peer}, outside ranks "
                                  f"0..{R - 1} (peer indices are never taken modulo R)"))
    return out


# -- S4: derived accesses ------------------------------------------------------------------------
class _Ctx:
    """What passes/_regions.py needs of the tile pass's context: shapes and full boxes."""

    def __init__(self, s: Schedule):
        g = s.graph
        self.shape, self.fb, self.kind, self.storage = {}, {}, {}, {}
        for v in g.values():
            sh = tuple(v.type.concrete(s.dims))
            self.shape[v.name], self.fb[v.name], self.kind[v.name] = sh, full_box(sh), v.kind
        for v in g.params:
            self.storage[v.name] = v.name
        self.producer = {}
        for op in g.ops:
            for i, v in enumerate(op.outputs):
                self.producer[v.name] = op
                src = op.opdef.aliases.get(i)
                self.storage[v.name] = self.storage[op.inputs[src].name] if src is not None else v.name
        for name, ty in (getattr(s, "buffers", None) or {}).items():
            sh = tuple(ty.concrete(s.dims))
            self.shape.setdefault(name, sh)
            self.fb.setdefault(name, full_box(sh))
            self.kind.setdefault(name, ty.kind)
            self.storage.setdefault(name, name)
        self.users: dict[str, list] = {}
        for op in g.ops:
            for v in op.inputs:
                self.users.setdefault(v.name, []).append(op)
        self.outputs = {v.name for v in g.outputs} | {v.name for v in g.updates.values()}


def _covered(box, boxes) -> bool:
    """Is `box` inside the union of `boxes`?"""
    if any(all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(c, box)) and len(c) == len(box)
           for c in boxes):
        return True
    boxes = [c for c in boxes if len(c) == len(box)]
    if not boxes:
        return False
    cuts = []
    for d, (lo, hi) in enumerate(box):
        pts = {lo, hi}
        for c in boxes:
            pts |= {x for x in c[d] if lo < x < hi}
        pts = sorted(pts)
        cuts.append(list(zip(pts, pts[1:])))
    if sum(len(c) for c in cuts) > 64:
        return False        # conservative: the lowering emits one box per buffer
    for cell in product(*cuts):
        if not any(all(a0 <= c0 and c1 <= a1 for (a0, a1), (c0, c1) in zip(c, cell)) for c in boxes):
            return False
    return True


class Derived:
    """Per task: the regions its ops read and write, and the addressing of each read."""

    def __init__(self, s: Schedule):
        self.s = s
        self.ctx = _Ctx(s)
        self._memo: dict = {}
        self._addr: dict = {}           # (ops, tile) -> addr of the derivation (kept after `check`)
        self._fam: dict = {}

    # (reads {buffer: [box]}, writes {buffer: [box]}, addr {buffer: address buffer}, collective, error)
    def derive(self, t):
        key = (t.ops, t.tile)
        hit = self._memo.get(key)
        if hit is None:
            try:
                hit = self._derive(t)
            except Exception as e:         # malformed ops/tile: a violation, never a crash
                hit = (None, None, {}, False, f"cannot derive the task's regions from its ops: "
                                              f"{type(e).__name__}: {e}")
            self._memo[key] = hit
            self._addr[key] = hit[2]
        return hit

    def addr(self, t) -> dict:
        got = self._addr.get((t.ops, t.tile))
        return self.derive(t)[2] if got is None else got

    def _family(self, names):
        """What does not depend on the tile: the ops, their roles, what is stored (memoized per
        ops tuple: the tiles of one family share it)."""
        fam = self._fam.get(names)
        if fam is not None:
            return fam
        ctx = self.ctx
        unknown = [n for n in names if n not in ctx.producer]
        if unknown:
            fam = f"ops({', '.join('%' + n for n in unknown)}) names no op of the graph"
        elif not names:
            fam = "the task computes no op"
        else:
            ops = [ctx.producer[n] for n in names]
            st = ctx.storage
            if len(set(map(id, ops))) != len(ops):
                fam = "ops() names one op twice"
            elif any(Trait.collective in o.opdef.traits for o in ops):
                if len(ops) != 1:
                    fam = "a collective shares its task with other ops"
                else:
                    o = ops[0]
                    reads = {}
                    for v in o.inputs:
                        reads.setdefault(st[v.name], []).append(ctx.fb[v.name])
                    writes = {st[o.outputs[0].name]: [ctx.fb[o.outputs[0].name]]}
                    slots = o.outputs[0].name + ".slots"       # the lowering's slot buffer (passes/_collectives.py)
                    fam = ("coll", (reads, writes, {}, (slots, o) if slots in ctx.kind else True, None))
            else:
                members = {id(o) for o in ops}
                anchor = next((o for o in ops if _anchor_kind(o)), None)
                ai = ops.index(anchor) if anchor is not None else 0
                pro, tiled = ops[:ai], ops[ai:]
                produced = {v.name for o in ops for v in o.outputs}
                pro_loads, pro_boxes = {}, {}
                for o in pro:
                    for v in o.inputs:
                        if v.name not in produced:
                            pro_loads[v.name] = ctx.fb[v.name]
                    for v in o.outputs:
                        pro_boxes[v.name] = ctx.fb[v.name]
                # per tiled op: its operands read from outside the task (index, value, the storage
                # addressing it or None), and its output name when it has one output (whose box
                # is the op's box, `out_boxes`' contract), else None
                per_op = []
                for o in tiled:
                    ab = o.opdef.addressed_by or {}
                    ext = [(i, v.name, st[o.inputs[ab[i]].name] if i in ab else None)
                           for i, v in enumerate(o.inputs) if v.name not in produced]
                    per_op.append([o, ext, o.outputs[0].name if len(o.outputs) == 1 else None, None, None,
                                   None if o is anchor or anchor is None else op_box_rule(o)])
                stored = [(v.name, st[v.name]) for o in ops for v in o.outputs
                          if v.name in ctx.outputs or any(id(u) not in members for u in ctx.users.get(v.name, ()))]
                prim = ctx.shape[(anchor or ops[-1]).outputs[0].name]
                fam = ("ops", anchor, pro_loads, pro_boxes, per_op, stored, ctx.fb[ops[-1].outputs[0].name], prim)
        self._fam[names] = fam
        return fam

    def _derive(self, t):
        fam = self._family(t.ops)
        if isinstance(fam, str):
            return None, None, {}, False, fam
        if fam[0] == "coll":
            return self._coll_window(t, fam[1])
        _, anchor, pro_loads, pro_boxes, per_op, stored, last_fb, _ = fam
        ctx = self.ctx
        st = ctx.storage
        tile = t.tile
        for d in tile if tile.__class__ is tuple else (None,):
            if d.__class__ is not tuple:
                tile = tuple(map(tuple, tile))
                break
        if anchor is None and tile == last_fb:
            tile = None                   # an untiled unit: each op computes its whole output
        loads = dict(pro_loads)
        boxes = dict(pro_boxes)
        addr: dict[str, str] = {}
        fb = ctx.fb
        for rec in per_op:
            o, ext, single, in_rule, out_rule_, box_rule = rec
            if tile is None:
                ob = fb[o.outputs[0].name]
            elif box_rule is None:        # the anchor, or every op of an anchorless unit
                ob = tile
            else:
                ob = box_rule(boxes, tile)          # _op_box
                if ob is None:
                    continue
            if in_rule is None:
                in_rule = rec[3] = input_rule(ctx, o)
            bxs = in_rule(ob)
            n_bxs = len(bxs)
            for i, vn, src in ext:
                bx = bxs[i] if i < n_bxs else None
                if bx is None:
                    continue
                old = loads.get(vn)
                loads[vn] = bx if old is None or old == bx else box_hull(old, bx)
                if src is not None:
                    addr[st[vn]] = src
            if single is not None:
                boxes[single] = ob
            else:
                if out_rule_ is None:
                    out_rule_ = rec[4] = out_rule(ctx, o)
                for v, bx in zip(o.outputs, out_rule_(ob)):
                    boxes[v.name] = bx
        st = ctx.storage
        reads: dict[str, list] = {}
        for vn, bx in loads.items():
            b = st[vn]
            got = reads.get(b)
            if got is None:
                reads[b] = [bx]
            else:
                got.append(bx)
        writes: dict[str, list] = {}
        for vn, sto in stored:
            bx = boxes.get(vn)
            if bx is not None:
                got = writes.get(sto)
                if got is None:
                    writes[sto] = [bx]
                else:
                    got.append(bx)
        return reads, writes, addr, False, None

    def check(self) -> tuple[list, bool]:
        """S4 violations, and whether one of them makes the rules V1-V7 impossible to state
        (a region or address naming no tensor)."""
        out, fatal = [], False
        s, storage, fams = self.s, self.ctx.storage, self._fam
        LOAD, STORE, COMPUTE = InstrKind.LOAD, InstrKind.STORE, InstrKind.COMPUTE
        # Fast path, per task: every LOAD / STORE names a tensor of the graph on the task's own
        # copy (no region rank), the body is loads, one compute, stores in that order, and the
        # regions are the derived ones box for box. Such a task breaks no S4 rule. Any other
        # task goes through `_check_task`, which says why.
        for t in s.tasks:
            instrs = t.instrs
            dl: dict[str, list] = {}
            ds: dict[str, list] = {}
            ncomp, comp, last_load, first_store = 0, -1, -1, -1
            regular = instrs.__class__ is list
            for k, i in enumerate(instrs if regular else ()):
                kind = i.kind
                if kind is LOAD or kind is STORE:
                    r = i.region
                    buf = storage.get(r.tensor)
                    if buf is None or r.rank is not None or (i.addressed_by is not None and
                                                             i.addressed_by not in storage):
                        regular = False
                        break
                    if kind is LOAD:
                        last_load = k
                        got = dl.get(buf)
                        if got is None:
                            dl[buf] = [r.box]
                            continue
                    else:
                        if first_store < 0:
                            first_store = k
                        got = ds.get(buf)
                        if got is None:
                            ds[buf] = [r.box]
                            continue
                    got.append(r.box)
                elif kind is COMPUTE:
                    ncomp += 1
                    if comp < 0:
                        comp = k
            if regular and ncomp <= 1:
                fs = len(instrs) if first_store < 0 else first_store
                if not (ncomp and (last_load > comp or fs < comp)) and last_load <= fs:
                    reads, writes, _, coll, err = self.derive(t)
                    if not err and not coll and dl == reads and ds == writes:
                        # `_tile_ok`, inline: the tile is a non-empty box inside the output it tiles
                        fam = fams.get(t.ops)
                        if fam.__class__ is not tuple or fam[0] != "ops":
                            continue
                        tile, sh, ok = t.tile, fam[-1], False
                        try:
                            if len(tile) == len(sh):
                                for (a, b), n in zip(tile, sh):
                                    if not 0 <= a < b <= n:
                                        break
                                else:
                                    ok = True
                        except (TypeError, ValueError):
                            pass
                        if ok:
                            continue
            errs, bad = self._check_task(t)
            out += errs
            fatal = fatal or bad
        # the rules after S4 need only the addressing (`addr`): the derived boxes of ~10^5 tasks
        # (~90 MB on full K3) are let go; `derive` computes them again if asked
        self._memo = {}
        return out, fatal

    def _check_task(self, t) -> tuple[list, bool]:
        """S4 violations of one task, and whether one of them is fatal (see `check`)."""
        out = []
        ctx = self.ctx
        storage, shape, kinds = ctx.storage, ctx.shape, ctx.kind
        LOAD, STORE, COMPUTE = InstrKind.LOAD, InstrKind.STORE, InstrKind.COMPUTE
        own = (None, t.rank)
        bad = False
        dl: dict[str, list] = {}
        ds: dict[str, list] = {}
        mem = []
        computes, last_load, first_store = [], -1, None
        foreign = False         # a LOAD/STORE names another rank's copy
        for k, i in enumerate(t.instrs):
            kind = i.kind
            if kind is not LOAD and kind is not STORE:
                if kind is COMPUTE:
                    computes.append(k)
                continue
            if kind is LOAD:
                last_load = k
            elif first_store is None:
                first_store = k
            r = i.region
            buf = storage.get(r.tensor)
            if buf is None:
                out.append(_v("S4", t.id, f"{kind.value} names %{r.tensor}, which is no tensor of the "
                                          f"graph or the schedule's buffers"))
                bad = True
                continue
            if i.addressed_by is not None and i.addressed_by not in storage:
                out.append(_v("S4", t.id, f"load %{r.tensor} is addressed_by %{i.addressed_by}, which is no "
                                          f"tensor"))
                bad = True
            mem.append((kind, r, buf))
            if r.rank is None or r.rank == t.rank:
                got = (dl if kind is LOAD else ds).get(buf)
                if got is None:
                    (dl if kind is LOAD else ds)[buf] = [r.box]
                else:
                    got.append(r.box)
            else:
                foreign = True
        if bad:
            return out, True
        fs = len(t.instrs) if first_store is None else first_store
        if len(computes) > 1:
            out.append(_v("S4", t.id, f"the body has {len(computes)} compute lines (one computes the task's ops)"))
        elif computes and last_load > computes[0]:
            out.append(_v("S4", t.id, f"a LOAD comes after the compute line: the ops read "
                                      f"%{t.instrs[last_load].region.tensor} before it is loaded",
                          _rs(t.instrs[last_load].region)))
        elif (computes and fs < computes[0]) or last_load > fs:
            out.append(_v("S4", t.id, f"a STORE of %{t.instrs[fs].region.tensor} comes before the "
                                      f"{'compute line' if computes and fs < computes[0] else 'last LOAD'}: "
                                      f"it stores what is not computed yet", _rs(t.instrs[fs].region)))
        reads, writes, _, coll, err = self.derive(t)
        if not err and not coll and not foreign and dl == reads and ds == writes and self._tile_ok(t):
            return out, False     # exactly the derived regions, box for box (in bounds: the tile is)
        for kind, r, buf in mem:
            sh = shape[r.tensor]
            try:
                ok = len(r.box) == len(sh) and all(0 <= a < b <= n for (a, b), n in zip(r.box, sh))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                out.append(_v("S4", t.id, f"{kind.value} box is empty, malformed or outside %{r.tensor}'s "
                                          f"shape {list(sh)}", _rs(r) if isinstance(r.box, tuple) else ""))
                bad = True
        if bad:
            return out, True
        if err:
            out.append(_v("S4", t.id, err))
            return out, False
        if not self._tile_ok(t) and not coll:
            out.append(_v("S4", t.id, f"tile {_bs(t.tile)} is empty or outside the shape of the output it tiles"))
        dl, ds = {}, {}
        for kind, r, buf in mem:
            peer = r.rank not in own
            if coll and kinds.get(buf) is Kind.comm:
                continue      # slots: checked by _slots below
            if kind is LOAD:
                if peer:
                    out.append(_v("S4", t.id, f"loads another rank's copy of %{r.tensor}, which only "
                                              f"comm buffers of collectives may do", _rs(r)))
                elif buf not in reads:
                    out.append(_v("S4", t.id, f"loads %{r.tensor}, which none of its ops "
                                              f"({', '.join('%' + n for n in t.ops)}) reads", _rs(r)))
                else:
                    dl.setdefault(buf, []).append(r.box)
            else:
                if peer:
                    out.append(_v("S4", t.id, f"stores into another rank's copy of %{r.tensor}, which "
                                              f"only comm buffers of collectives may do", _rs(r)))
                elif buf not in writes or not any(
                        all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(w, r.box))
                        for w in writes[buf]):
                    what = kinds.get(buf)
                    what = f"the {what.value} " if what is not None else ""
                    out.append(_v("S4", t.id, f"stores into {what}%{r.tensor} {_bs(r.box)}, which no op of "
                                              f"the task computes there", _rs(r)))
                else:
                    ds.setdefault(buf, []).append(r.box)
        if isinstance(coll, tuple):
            out += self._slots(t, *coll)
        for buf, bxs in reads.items():
            for bx in bxs:
                if not _covered(bx, dl.get(buf, [])):
                    out.append(_v("S4", t.id, f"its ops read %{buf} {_bs(bx)} but no LOAD covers it "
                                              f"(declared: {', '.join(map(_bs, dl.get(buf, []))) or 'none'})"))
        if coll:
            if not any(k is STORE for k, _, _ in mem):
                out.append(_v("S4", t.id, "the collective task stores nothing"))
            return out, False     # a push stores slots, the local task the result
        for buf, bxs in writes.items():
            for bx in bxs:
                if not _covered(bx, ds.get(buf, [])):
                    out.append(_v("S4", t.id, f"its ops compute %{buf} {_bs(bx)} for other tasks but no STORE "
                                              f"covers it (declared: {', '.join(map(_bs, ds.get(buf, []))) or 'none'})"))
        return out, False

    def _tile_ok(self, t) -> bool:
        """Is the task's tile a non-empty box inside the output it tiles?"""
        fam = self._fam.get(t.ops)
        if not isinstance(fam, tuple) or fam[0] != "ops":
            return True
        sh = fam[-1]
        try:
            return len(t.tile) == len(sh) and all(0 <= a < b <= n for (a, b), n in zip(t.tile, sh))
        except (TypeError, ValueError):
            return False

    def _coll_window(self, t, derived):
        """A collective's task over a column window of its operand (passes/split_reduce.py): the
        local task's tile is the window of y it stores, a push task's tile its slot, then the
        window it moves. Such a task reads and writes that window only; its slots are those of
        its own comm buffer [G, window] (`_slots`). Any other tile: the whole collective."""
        tile = t.tile
        o = self.ctx.producer[t.ops[0]]
        x, y = o.inputs[0].name, o.outputs[0].name
        fx = self.ctx.fb[x]
        if len(o.inputs) != 1 or self.ctx.fb[y] != fx or Trait.columnwise not in o.opdef.traits:
            return derived
        win = tuple(tile[1:]) if len(tile) == len(fx) + 1 else tuple(tile)
        if win == fx or len(win) != len(fx) or not all(0 <= a < b <= n for (a, b), (_, n) in zip(win, fx)):
            return derived
        st = self.ctx.storage
        return {st[x]: [win]}, {st[y]: [win]}, derived[2], (None, o, win), derived[4]

    def _slots(self, t, slots: str | None, op, win=None) -> list:
        """A lowered collective: the local task (it stores the result) loads slots 1..G-1 of its
        own `<y>.slots`; a push task of in-group offset d (its tile [d:d+1]) stores exactly slot d
        of the peer d * stride ranks ahead (passes/_collectives.py). A task over a column window
        `win` (passes/split_reduce.py; `slots` None) does the same on the one comm buffer it
        names, which must be [G, window]."""
        ctx, s = self.ctx, self.s
        G, S, R = op.attrs.get("ranks", 1), op.attrs.get("stride", 1), s.ranks
        y = ctx.storage[op.outputs[0].name]
        x = ctx.fb[op.inputs[0].name]
        ins = [i for i in t.instrs if i.kind in (InstrKind.LOAD, InstrKind.STORE)]
        if win is not None:
            comm = sorted({i.region.tensor for i in ins if ctx.kind.get(ctx.storage.get(i.region.tensor)) is Kind.comm})
            x = tuple((0, b - a) for a, b in win)
            if len(comm) != 1 or ctx.shape.get(comm[0]) != (G,) + tuple(b for _, b in x):
                return [_v("S4", t.id, f"the collective's task over window {_bs(win)} names comm buffers "
                                       f"{', '.join('%' + c for c in comm) or 'none'}, not its one slots "
                                       f"buffer of shape [{G}, {', '.join(str(b) for _, b in x)}]")]
            slots = comm[0]
        local = any(i.kind is InstrKind.STORE and i.region.tensor == y for i in ins)
        comm_st = [i.region for i in ins if i.kind is InstrKind.STORE and ctx.kind.get(ctx.storage[i.region.tensor]) is Kind.comm]
        if local:
            got = [i.region.box for i in ins if i.kind is InstrKind.LOAD and i.region.tensor == slots
                   and i.region.rank in (None, t.rank)]
            need = ((1, G),) + x
            if G > 1 and not _covered(need, got):
                return [_v("S4", t.id, f"the collective reads slots {_bs(need)} of %{slots} but no LOAD covers them")]
            if comm_st:
                return [_v("S4", t.id, f"the collective's local task stores into comm buffer %{comm_st[0].tensor}",
                           _rs(comm_st[0]))]
            return []
        tile = tuple(t.tile)
        if win is not None and tile[1:] == win:
            tile = tile[:1]
        if len(tile) != 1 or not 1 <= tile[0][0] < G or tile[0][1] != tile[0][0] + 1:
            return [_v("S4", t.id, f"push task of %{y} has tile {_bs(tile)}, not one slot 1..{G - 1}")]
        d = tile[0][0]
        peer = (t.rank + d * S) % R
        want = ((d, d + 1),) + x
        if len(comm_st) != 1 or comm_st[0].tensor != slots or comm_st[0].box != want or comm_st[0].rank != peer:
            return [_v("S4", t.id, f"push of in-group offset {d} must store %{slots}{_bs(want)}@{peer} (the peer "
                                   f"{d} x {S} ranks ahead), stores "
                                   f"{', '.join(map(_rs, comm_st)) or 'nothing'}")]
        return []


def _bs(box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _rs(r) -> str:
    return f"%{r.tensor}{_bs(r.box)}" + (f"@rank{r.rank}" if r.rank is not None else "")
