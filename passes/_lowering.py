"""Lowering helpers of the `tile` pass: task families (`Unit`), exact regions per op, collectives.

Not a pass. The box each op needs of its inputs for an output tile lives in `_regions.py`.
`build_units(graph, dims, opts)` returns (units in topological order, tasks, scratch
buffers). Each task's instructions are LOADs, one COMPUTE and STOREs; events are added later by
`schedule`, which also resolves the named collective events kept in `Unit.pre` / `Unit.post`.
Collectives and split-sequence attention are lowered in `passes/_collectives.py`.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math

from fusec.ir.graph import Graph, Op, Value
from fusec.ir.registry import Tiling, Trait
from fusec.ir.schedule import Instr, InstrKind, Region, Task, mem_instr
from fusec.ir.types import Kind, TensorType

from ._collectives import emit_collective
from ._regions import box_hull, full_box, input_rule, out_rule
from ._units import MIN_TASK_BYTES, Unit
from .cost import task_time_us
from .target import gpu_spec

COMPUTE = Instr(InstrKind.COMPUTE)
# An elementwise-only unit gets at least one task per this many output elements: its inputs are
# a few KB, but its math is not (SiTU-GLU of 16896 columns in one task took 31 us on the H200,
# on the critical path, while every other CTA waited).
EW_TASK_ELEMENTS = 2048
ALIGN = 8                       # GEMV tile rows are a multiple of this (16-byte bf16 vectors)

def splits(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges on `align` boundaries (fewer if n is small)."""
    units = max(1, n // align) if n % align == 0 else None
    if units is None:
        align, units = 1, n
    parts = max(1, min(parts, units))
    base, extra = divmod(units, parts)
    out, s = [], 0
    for p in range(parts):
        e = s + (base + (1 if p < extra else 0)) * align
        out.append((s, e))
        s = e
    return out


class _Ctx:
    def __init__(self, g: Graph, dims, opts, logf):
        self.g, self.dims, self.opts, self.log = g, dims, opts, logf
        self.spec = gpu_spec(opts.gpu)
        self.sms = opts.sms
        self.users = g.users()
        self.shape = {v.name: v.type.concrete(dims) for v in g.values()}
        self.fb = {n: full_box(s) for n, s in self.shape.items()}
        self.bpe = {v.name: v.type.dtype.bits / 8 for v in g.values()}
        self.numel = {n: math.prod(s) for n, s in self.shape.items()}
        self.kind = {v.name: v.kind for v in g.values()}
        self.storage: dict[str, str] = {}
        for v in g.params:
            self.storage[v.name] = v.name
        for op in g.ops:
            for i, v in enumerate(op.outputs):
                src = op.opdef.aliases.get(i)
                self.storage[v.name] = self.storage[op.inputs[src].name] if src is not None else v.name
        self.outputs = {v.name for v in g.outputs} | {v.name for v in g.updates.values()}
        self.tasks: list[Task] = []
        self.memo: dict = {}             # (value, box, addressed_by) -> (shared frozen Instr, bytes)
        # one tuple per distinct box (tiles and regions): full K3 has ~4 * 10^3 distinct boxes in
        # ~4.5 * 10^5 uses (less memory; equal boxes compare by identity first)
        self.boxes: dict[tuple, tuple] = {}
        self.buffers: dict[str, TensorType] = {}
        self.types: dict[str, TensorType] = {self.storage[v.name]: v.type for v in g.params}

    def nbytes(self, v: Value | str, box) -> float:
        size = self.bpe[v if isinstance(v, str) else v.name]
        for a, b in box:                 # called once per distinct load box: ~10^5 times on full K3
            size *= b - a
        return size


# -- region rules ----------------------------------------------------------------------------
def _anchor_kind(op: Op) -> Tiling | None:
    """How `op` cuts its output when it anchors a task family; None: it never anchors one."""
    return op.opdef.tiling


def _driver(op: Op, inside: set[str]) -> Value | None:
    """The operand through which an epilogue op sees the tile (the first one made in the unit)."""
    return next((v for v in op.inputs if v.name in inside), None)


def _epilogue_ok(ctx: _Ctx, op: Op, anchor: Op, inside: set[str]) -> str | None:
    """None when `op` maps the tile (as an epilogue of `anchor`), else the reason it does not."""
    if Trait.collective in op.opdef.traits:
        return "a collective"
    if not op.opdef.tile_epilogue:
        return "a reduction over the tiled axis or a shape change"
    if Trait.mergeable in op.opdef.traits:   # a sibling GEMV (gate and up reading the same x): same rows
        return None if (op.opdef is anchor.opdef and op.inputs[0] is anchor.inputs[0] and
                        ctx.shape[op.outputs[0].name] == ctx.shape[anchor.outputs[0].name]) else \
            "a GEMV that is not a sibling of the anchor"
    d = _driver(op, inside)
    if d is None:
        return "reads nothing the tile computes"
    if op.opdef.window is not None:
        return None if op.opdef.window(op.attrs)[0] in (-1, len(ctx.shape[d.name]) - 1) else "a slice across rows"
    if ctx.shape[op.outputs[0].name] != ctx.shape[d.name]:
        return "changes the tile's shape"
    if Trait.elementwise in op.opdef.traits or Trait.headwise in op.opdef.traits:
        return None
    return f"{op.opname} is not elementwise"


def _window_start(o: Op) -> int:
    """Where `o`'s result starts in its operand's last dim: a window's start (a slice of a merged
    projection's output), else 0."""
    return o.opdef.window(o.attrs)[1] if o.opdef.window is not None else 0


def _cut_rules(ctx: _Ctx, anchor: Op, epi: list[Op]) -> list[tuple[int, int, int]]:
    """(start, end, step): a tile boundary inside [start, end) of the anchor's last dim must be
    start + k * step (the anchor's own step, e.g. whole heads; whole heads for head-wise
    epilogues, reached through slices)."""
    off = {anchor.outputs[0].name: 0}
    w = ctx.shape[anchor.outputs[0].name][-1]
    rules = [(0, w, ALIGN)] if w % ALIGN == 0 else []
    if anchor.opdef.tile_step is not None:
        rules.append((0, w, anchor.opdef.tile_step(anchor.attrs)))
    for o in epi:
        d = _driver(o, set(off))
        if d is None:
            continue
        base = off[d.name] + _window_start(o)
        for v in o.outputs[:1]:
            off[v.name] = base
        hd = o.attrs.get("head_dim") if Trait.headwise in o.opdef.traits else None
        if hd:
            rules.append((base, base + ctx.shape[o.outputs[0].name][-1], hd))
    return rules


@functools.lru_cache(maxsize=None)
def _cuts(n: int, parts: int, rules: tuple) -> list[tuple[int, int]]:
    """`parts` near-equal ranges of [0, n) whose inner boundaries obey every rule (memoised:
    the 93 layers repeat the same shapes)."""
    # x in [0, n] is allowed when every rule (s, e, st) has x outside (s, e) or x - s a
    # multiple of st; as a byte mask (n is up to the vocabulary: 1.6 * 10^5 columns)
    mask = bytearray(b"\x01") * (n + 1)
    for s, e, st in rules:
        lo, hi = max(s + 1, 0), min(e, n + 1)            # (s, e) within [0, n]
        if lo >= hi:
            continue
        seg = bytearray(hi - lo)                         # inside (s, e): only s + k * st stays
        first = lo + (s - lo) % st
        seg[first - lo::st] = mask[first:hi:st]
        mask[lo:hi] = seg
    allowed = list(itertools.compress(range(n + 1), mask))   # 0 and n are always allowed
    pts = {0, n}
    for i in range(1, parts):
        c = round(i * n / parts)
        j = bisect.bisect_left(allowed, c)
        near = [allowed[k] for k in (j - 1, j) if 0 <= k < len(allowed)]
        pts.add(min(near, key=lambda x: (abs(x - c), x)))
    pts = sorted(pts)
    return [(a, b) for a, b in zip(pts, pts[1:]) if b > a]


def _tile_boxes(ctx: _Ctx, anchor: Op | None, ops: list[Op], epi: list[Op]):
    """The tiles (boxes of the primary output) and the body kind of a unit."""
    prim = anchor.outputs[0] if anchor is not None else ops[-1].outputs[0]
    s = ctx.shape[prim.name]
    fb = full_box(s)
    if anchor is None:
        body = ops[0].opname if len(ops) == 1 else "fused_" + ops[0].opname
        # slices are views: a slice of the tile's box feeds the elementwise op (gate and up
        # halves of a merged projection)
        elementwise = all((Trait.elementwise in o.opdef.traits and ctx.shape[o.outputs[0].name] == s)
                          or Trait.columnwise in o.opdef.traits for o in ops)
        if s and not elementwise and s[0] == ctx.dims.get("B") and \
                all(Trait.tokenwise in o.opdef.traits for o in ops):
            # per-token work (AttnRes + norm, router, argmax): one task per batch row, so a
            # batch of 16 does not run on one SM while the others wait
            return [((b0, b1),) + fb[1:] for b0, b1 in splits(s[0], min(ctx.sms, s[0]))], body
        if not elementwise or not s:
            return [None], body          # one task; every op computes its whole output
        nb = sum(ctx.nbytes(v, ctx.fb[v.name]) for o in ops for v in o.inputs)
        n = min(ctx.sms, s[-1], max(1, math.ceil(nb / MIN_TASK_BYTES), math.ceil(math.prod(s) / EW_TASK_ELEMENTS)))
        return [fb[:-1] + (r,) for r in splits(s[-1], n, 1)], body
    w = sum(ctx.nbytes(v, ctx.fb[v.name]) for o in ops for v in o.inputs if ctx.kind[v.name] is Kind.weight)
    w += sum(ctx.nbytes(anchor.inputs[i], ctx.fb[anchor.inputs[i].name]) for i in anchor.opdef.streams)
    tiling = anchor.opdef.tiling
    if tiling is Tiling.experts:
        # Every task takes all (token, slot) pairs for a slice of the output rows: the experts
        # are only known after routing, so a slice of every routed expert's rows on every SM is
        # what keeps all SMs streaming (and lets a task read each distinct expert's rows once).
        b, k = s[0], s[1]
        frac = min(1.0, b * k / ctx.shape[anchor.inputs[2].name][0])
        n = max(1, min(ctx.sms, math.ceil(w * frac / MIN_TASK_BYTES)))
        # Row ranges on no alignment (the expert bodies clamp partial 16-row tiles and store
        # scalars): on 8-row boundaries 2880 rows over 132 SMs were tasks of 24 and 16 rows, the
        # phase as long as the 24-row ones; 21-22 rows each even it out.
        return [((0, b), (0, k), r) for r in splits(s[2], n)], anchor.opname
    if tiling is Tiling.chunks:                      # one task per (cache chunk, batch row)
        return [((c, c + 1), (b, b + 1)) + fb[2:] for c in range(s[0]) for b in range(s[1])], anchor.opname
    if tiling is Tiling.heads:
        heads = s[1]                                 # (every head reads the whole streamed operand)
        n = min(heads, ctx.sms, max(1, math.ceil(w / MIN_TASK_BYTES)))
        if anchor.opdef.split_rows and s[0] > 1:
            # (batch row, head range) tiles, as many head ranges as the SMs allow beside the
            # rows: a task's items (one row's heads) are contiguous, so a body can take several
            # at once, where one head over every row was one item per row, merged serially
            n = max(1, min(n, ctx.sms // s[0]))
            return [((b, b + 1), r) + fb[2:] for b in range(s[0]) for r in splits(heads, n)], anchor.opname
        return [(fb[0], r, fb[2]) for r in splits(heads, n)], anchor.opname
    rules = _cut_rules(ctx, anchor, epi)            # Tiling.columns: ranges of the last dim
    n = min(ctx.sms, max(1, math.ceil(w / MIN_TASK_BYTES)))
    if anchor.opdef.min_tasks is not None:   # latency-bound (one KDA head per task) while SMs last
        n = max(n, min(ctx.sms, anchor.opdef.min_tasks(anchor.attrs)))
    cols = _cuts(s[-1], n, tuple(rules))
    parts = _row_parts(ctx, ops, s[0], len(cols)) if anchor.opdef.split_rows and len(s) >= 2 else 1
    if parts > 1:                            # (head, batch rows) tiles: SMs the heads leave idle
        return [(r,) + fb[1:-1] + (c,) for c in cols for r in splits(s[0], parts)], anchor.opname
    return [fb[:-1] + (r,) for r in cols], anchor.opname


def _row_parts(ctx: _Ctx, ops: list[Op], rows: int, cols: int) -> int:
    """How many ranges to cut the `rows` batch rows of a family into beside its `cols` column
    tiles (an anchor with `split_rows`): the fewest that minimise its predicted span, waves of
    tasks (ceil(tasks / SMs)) times the largest task's time, each task moving its share of the
    bytes the family's ops read and write (a recurrent state both)."""
    if cols >= ctx.sms or rows <= 1:
        return 1
    moved = 0.0
    for o in ops:
        c = o.opdef.cost([v.type for v in o.inputs], [v.type for v in o.outputs], o.attrs, ctx.dims)
        moved += c.bytes_read + c.bytes_written

    def span(r):
        biggest = math.ceil(rows / r)        # rows of the largest task (splits: near-equal ranges)
        t = task_time_us(ctx.spec, moved * biggest / (rows * cols), 0.0, sms=ctx.sms)
        return round(math.ceil(cols * r / ctx.sms) * t, 6)
    return min(range(1, rows + 1), key=lambda r: (span(r), r))


# -- units -----------------------------------------------------------------------------------
def _partition(ctx: _Ctx, ops: list[Op]) -> list[tuple[list[Op], list[Op], Op | None, list[Op]]]:
    """Split one group into units: (recomputed prologue, [anchor], anchor, epilogue) lists."""
    members = {id(o) for o in ops}
    anchors = [o for o in ops if _anchor_kind(o)]
    if any(Trait.collective in o.opdef.traits for o in ops) and len(ops) > 1:
        ctx.log(f"group {ops[0].group}: collective split out of its group")
        res = []
        for o in ops:
            res.extend(_partition(ctx, [o]))
        return res
    if not anchors:
        return [([], ops, None, [])]
    anchor = anchors[0]
    ai = ops.index(anchor)
    pro, early = [], []
    for o in ops[:ai]:
        inside_only = all(id(u) in members for v in o.outputs for u in ctx.users[v.name]) and \
            not any(v.name in ctx.outputs for v in o.outputs)
        if inside_only and not o.opdef.aliases and Trait.stateful not in o.opdef.traits \
                and _anchor_kind(o) is None:
            pro.append(o)
        else:
            early.append(o)
    res = []
    if early:
        ctx.log(f"group {anchor.group}: {', '.join(o.outputs[0].name for o in early)} run before "
                f"the anchor as their own unit (stateful or used outside the group)")
        res.extend(_partition(ctx, early))
    epi, rest = [], []
    inside = {v.name for v in anchor.outputs}
    off = {anchor.outputs[0].name: 0}    # where each tiled value sits along the anchor's last dim
    for i, o in enumerate(ops[ai + 1:]):
        why = _epilogue_ok(ctx, o, anchor, inside)
        mine = {off[v.name] for v in o.inputs if v.name in off}
        if why is None and len(mine) > 1:
            why = "it combines different slices of the tile (rows a tile does not hold together)"
        if why is None:
            if mine:
                off[o.outputs[0].name] = mine.pop() + _window_start(o)
            epi.append(o)
            inside |= {v.name for v in o.outputs}
        else:
            rest = ops[ai + 1 + i:]
            ctx.log(f"group {anchor.group}: {o.opname} %{o.outputs[0].name} is not an epilogue of the "
                    f"{anchor.opname} tile ({why}): it and the rest of the group form a new unit")
            break
    res.append((pro, [anchor], anchor, epi))
    # The rest splits where its ops do not feed each other: a router and the shared expert's
    # SiTU-GLU that follow one merged projection are separate units (the GLU then spreads over
    # the SMs instead of running on the router's one task).
    for part in _connected(rest):
        res.extend(_partition(ctx, part))
    return res


def _connected(ops: list[Op]) -> list[list[Op]]:
    """`ops` split into the groups linked by values made among them, each in program order."""
    root = list(range(len(ops)))

    def find(i):
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    made = {v.name: i for i, o in enumerate(ops) for v in o.outputs}
    for i, o in enumerate(ops):
        for v in o.inputs:
            if v.name in made:
                root[find(i)] = find(made[v.name])
    parts: dict[int, list[Op]] = {}
    for i, o in enumerate(ops):
        parts.setdefault(find(i), []).append(o)
    return sorted(parts.values(), key=lambda p: ops.index(p[0]))


def _op_box(ctx: _Ctx, o: Op, boxes: dict, tile) -> tuple | None:
    """Box of `o`'s first output in this tile from its driving operand; None = not computed."""
    return op_box_rule(o)(boxes, tile)


def op_box_rule(o: Op):
    """f(boxes, tile) -> `_op_box` of `o`, with what does not depend on the tile (the op's kind,
    its operands' names, whether each is made by an op) read once."""
    if Trait.mergeable in o.opdef.traits:   # sibling GEMV (`_epilogue_ok`): the anchor's rows
        return lambda boxes, tile: tile
    # the driver (`_driver`) is the first operand made in the unit, i.e. with a box so far
    cands = [(v.name, v.producer is not None) for v in o.inputs]
    if o.opdef.window is not None:
        _, start, end = o.opdef.window(o.attrs)

        def slice_box(boxes, tile):
            for name, made in cands:
                if name in boxes:
                    break
            else:
                return None
            if not made:
                return None
            db = boxes[name]
            lo, hi = db[-1]
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                return None
            return db[:-1] + ((a - start, b - start),)
        return slice_box

    def same_box(boxes, tile):
        for name, made in cands:
            if name in boxes:
                return boxes[name] if made else None
        return None
    return same_box


def _emit_unit(ctx: _Ctx, name: str, pro, core, anchor, epi, tiles=None) -> Unit:
    """The unit's tasks, cut by `_tile_boxes` (or into `tiles`, boxes of the anchor's output)."""
    ops = pro + core + epi
    members = {id(o) for o in ops}
    own, body = _tile_boxes(ctx, anchor, core + epi if anchor is not None else core, epi)
    tiles = own if tiles is None else tiles
    unit = Unit(name, ops, body)
    produced_here = {v.name for o in ops for v in o.outputs}
    stored = [v for o in ops for v in o.outputs
              if v.name in ctx.outputs or any(id(u) not in members for u in ctx.users[v.name])]
    op_names = tuple(o.outputs[0].name for o in ops)
    costs = {id(o): o.opdef.cost([v.type for v in o.inputs], [v.type for v in o.outputs], o.attrs, ctx.dims)
             for o in core + epi}
    # an in-place write through a run-time address (cache row at pos) stores a conservative
    # region (the whole cache) but moves only what the op's cost says
    store_bytes = {o.outputs[ri].name: costs[id(o)].bytes_written for o in core + epi
                   for ri, oi in o.opdef.aliases.items() if oi in o.opdef.addressed_by}
    pro_loads: dict[str, tuple] = {}
    for o in pro:                        # recomputed in full by every tile
        for v in o.inputs:
            if v.name not in produced_here:
                pro_loads[v.name] = ctx.fb[v.name]
    pro_boxes = {v.name: ctx.fb[v.name] for o in pro for v in o.outputs}
    memo = ctx.memo
    # Per tiled op, what is the same for every tile (the loop below runs ~10^5 times on full K3):
    # (op, its `_op_box` rule or None when it computes the whole tile, flops per output element,
    # its operands read from outside the unit as (index, value, storage addressing it or None,
    # expert-parallel odds), the name of its one output or None when it has several, its region
    # rules (built at first use))
    tiled_ops = []
    for o in core + epi:
        ab = o.opdef.addressed_by
        ext = []
        for i, v in enumerate(o.inputs):
            if v.name in produced_here:
                continue
            src = ab.get(i) if ab else None
            if src is None:
                ext.append((i, v.name, None, None))
            else:   # addressed by router ids (operand src); expert parallel: a slot's expert is
                # on this rank with odds 1 / ep_ranks
                ext.append((i, v.name, (ctx.storage[o.inputs[src].name], src), 1.0 / o.attrs.get("ep_ranks", 1)))
        tiled_ops.append([o, None if o is anchor or anchor is None else op_box_rule(o),
                          costs[id(o)].flops / max(1, ctx.numel[o.outputs[0].name]),
                          ext, o.outputs[0].name if len(o.outputs) == 1 else None, None, None])
    stored_names = [v.name for v in stored]
    last_fb = ctx.fb[ops[-1].outputs[0].name]
    storage, kinds, shape, bpe = ctx.storage, ctx.kind, ctx.shape, ctx.bpe
    LOAD, STORE, weight = InstrKind.LOAD, InstrKind.STORE, Kind.weight
    spec, sms, tasks, task_ids = ctx.spec, ctx.sms, ctx.tasks, unit.task_ids
    intern = ctx.boxes.setdefault
    for tile in tiles:
        boxes = dict(pro_boxes)
        loads = dict(pro_loads)
        addr: dict[str, str] = {}
        epf: dict[str, float] = {}
        pairs: dict[str, int] = {}      # addressed weight -> (token, slot) pairs the tile routes
        flops = 0.0
        for rec in tiled_ops:
            o, box_rule, fpe, ext, single, in_rule, out_rule_ = rec
            if tile is None:                 # untiled unit: each op computes its whole output
                ob = ctx.fb[o.outputs[0].name]
            elif box_rule is None:           # the anchor, or every op of an anchorless unit
                ob = tile
            else:
                ob = box_rule(boxes, tile)   # _op_box
                if ob is None:               # this tile holds none of the op's slice
                    continue
            if in_rule is None:
                in_rule = rec[5] = input_rule(ctx, o)
            ins = in_rule(ob)
            n_ins = len(ins)
            for i, vn, a, e in ext:
                bx = ins[i] if i < n_ins else None
                if bx is None:
                    continue
                old = loads.get(vn)
                loads[vn] = bx if old is None or old == bx else box_hull(old, bx)
                if a is not None:
                    addr[vn] = a[0]
                    epf[vn] = e
                    n_pairs = 1
                    for lo, hi in ins[a[1]]:
                        n_pairs *= hi - lo
                    pairs[vn] = max(pairs.get(vn, 0), n_pairs)
            if single is not None:
                boxes[single] = ob
            else:
                if out_rule_ is None:
                    out_rule_ = rec[6] = out_rule(ctx, o)
                for v, bx in zip(o.outputs, out_rule_(ob)):
                    boxes[v.name] = bx
            n = 1
            for lo, hi in ob:
                n *= hi - lo
            flops += fpe * n
        instrs, nbytes = [], 0.0
        for vn, box in loads.items():
            a = addr.get(vn)
            key = (vn, box, a, pairs.get(vn))
            hit = memo.get(key)
            if hit is None:
                nb = bpe[vn]                     # ctx.nbytes(vn, box)
                for lo, hi in box:
                    nb *= hi - lo
                if a is not None and kinds[vn] is weight:
                    # The box holds the tile's rows of every expert of this rank; the tile reads
                    # those of the distinct experts its pairs route to: with ids uniform over the
                    # E = local experts / odds of all ranks, each expert is hit with probability
                    # 1 - (1 - 1/E)^pairs. (One expert's rows was right when a task held one
                    # pair; since a task streams every pair's expert (Tiling.experts) that
                    # undercounted expert bytes 16x at batch 1 on K3.)
                    nb *= 1.0 - (1.0 - epf.get(vn, 1.0) / shape[vn][0]) ** pairs[vn]
                hit = memo[key] = (mem_instr(LOAD, Region(storage[vn], intern(box, box)), a), nb)   # = Instr(...)
            instrs.append(hit[0])
            nbytes += hit[1]
        instrs.append(COMPUTE)
        for vn in stored_names:
            bx = boxes.get(vn)
            if bx is None:
                continue
            key = (vn, bx, "store")
            hit = memo.get(key)
            if hit is None:
                if vn in store_bytes:
                    nb = store_bytes[vn]
                else:
                    nb = bpe[vn]                 # ctx.nbytes(vn, bx)
                    for lo, hi in bx:
                        nb *= hi - lo
                hit = memo[key] = (mem_instr(STORE, Region(storage[vn], intern(bx, bx))), nb)   # = Instr(...)
            instrs.append(hit[0])
            nbytes += hit[1]
        tid = len(tasks)
        tasks.append(Task(tid, 0, -1, body, op_names, intern(tile, tile) if tile is not None else last_fb, instrs,
                          task_time_us(spec, nbytes, flops, sms=sms)))
        task_ids.append(tid)
    unit.reads = {v.name for o in ops for v in o.inputs if v.name not in produced_here}
    unit.writes = {v.name for v in stored}
    return unit


class Retiler:
    """Re-cuts families the tile pass made (for `split_reduce`); one context for the graph."""

    def __init__(self, g: Graph, dims, opts):
        self.ctx = _Ctx(g, dims, opts, lambda m: None)
        self.groups: dict[str, list[Op]] = {}
        for o in g.ops:
            if o.group:
                self.groups.setdefault(o.group, []).append(o)
        self.first = {o.outputs[0].name: o for o in g.ops}

    def columns(self, op_names: tuple, name: str, windows: int):
        """The family computing `op_names` (a GEMV anchor tiled along its output columns, with
        its prologue and epilogues) re-cut as `windows` column windows of about equal width,
        each tiled on its own as if it were the whole GEMV (its share of the weight bytes, at
        most one task per SM), so the windows can run one after another at full width. Returns
        (windows [(c0, c1)] of the anchor, new tasks per window) or why it cannot; the tasks'
        ids continue this Retiler's count from 0 (the caller renumbers them)."""
        ctx = self.ctx
        want = set(op_names)
        first = self.first[op_names[0]]
        group = self.groups[first.group] if first.group else [first]
        match = [p for p in _partition(ctx, group) if {o.outputs[0].name for o in p[0] + p[1] + p[3]} == want]
        if len(match) != 1:
            return "its ops are not one unit of the tile pass"
        pro, core, anchor, epi = match[0]
        if anchor is None or anchor.opdef.tiling is not Tiling.columns or anchor.opdef.split_rows \
                or anchor.opdef.min_tasks is not None:
            return "it has no GEMV anchor tiled along its output columns"
        s = ctx.shape[anchor.outputs[0].name]
        fb = full_box(s)
        rules = _cut_rules(ctx, anchor, epi)
        cuts = _cuts(s[-1], windows, tuple(rules))
        if len(cuts) < windows:
            return f"output too narrow to split: {s[-1]} columns give {len(cuts)} window(s) on its tile boundaries"
        w = sum(ctx.nbytes(v, ctx.fb[v.name]) for o in core + epi for v in o.inputs
                if ctx.kind[v.name] is Kind.weight)
        per = []
        for c0, c1 in cuts:
            n = min(ctx.sms, max(1, math.ceil(w * (c1 - c0) / s[-1] / MIN_TASK_BYTES)))
            shifted = tuple((a - c0, b - c0, st) for a, b, st in rules)
            per.append([fb[:-1] + ((c0 + a, c0 + b),) for a, b in _cuts(c1 - c0, n, shifted)])
        start = len(ctx.tasks)
        _emit_unit(ctx, name, pro, core, anchor, epi, tiles=[t for p in per for t in p])
        out, i = [], start
        for p in per:
            out.append(ctx.tasks[i:i + len(p)])
            i += len(p)
        return cuts, out


def build_units(g: Graph, dims, opts, logf):
    ctx = _Ctx(g, dims, opts, logf)
    groups: list[list[Op]] = []
    by_name: dict[str, list[Op]] = {}
    for op in g.ops:
        if op.group is None:
            groups.append([op])
        elif op.group in by_name:
            by_name[op.group].append(op)
        else:
            by_name[op.group] = [op]
            groups.append(by_name[op.group])
    units: list[Unit] = []
    for ops in groups:
        for k, (pro, core, anchor, epi) in enumerate(_partition(ctx, ops)):
            base = (ops[0].group or ops[0].outputs[0].name) + (f"#{k}" if k else "")
            if len(core) == 1 and Trait.collective in core[0].opdef.traits and not pro and not epi:
                units.extend(emit_collective(ctx, base, core[0]))
            else:
                units.append(_emit_unit(ctx, base, pro, core, anchor, epi))
    return _toposort(ctx, units), ctx.tasks, ctx.buffers


def _toposort(ctx: _Ctx, units: list[Unit]) -> list[Unit]:
    """Kahn's order over value and write-after-read edges, ties by original order."""
    idx = {u.name: i for i, u in enumerate(units)}
    prod: dict[str, str] = {}
    for u in units:
        if not (u.collective and u.body == "comm_push"):
            for o in u.ops:
                for v in o.outputs:
                    prod[v.name] = u.name
    unit_of_op = {}
    for u in units:
        if not (u.collective and u.body == "comm_push"):
            for o in u.ops:
                unit_of_op[id(o)] = u.name
    # a value overwritten in place must first be read by everyone else (WAR)
    for o in ctx.g.ops:
        for ri, oi in o.opdef.aliases.items():
            v = o.inputs[oi]
            for r in ctx.users[v.name]:
                if r is not o and unit_of_op[id(r)] != unit_of_op[id(o)]:
                    units[idx[unit_of_op[id(o)]]].after.add(unit_of_op[id(r)])
    deps: dict[str, set[str]] = {}
    for u in units:
        d = {prod[v] for v in u.reads if v in prod} | u.after
        d.discard(u.name)
        deps[u.name] = d
    succ: dict[str, list[str]] = {u.name: [] for u in units}
    indeg = {u.name: len(deps[u.name]) for u in units}
    for n, ds in deps.items():
        for d in ds:
            succ[d].append(n)
    heap = [idx[u.name] for u in units if indeg[u.name] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        u = units[heapq.heappop(heap)]
        out.append(u)
        for s in succ[u.name]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, idx[s])
    if len(out) != len(units):
        raise ValueError("tile: task groups form a cycle (a fusion group both feeds and reads another)")
    for u in out:
        u.deps = deps[u.name]
    return out

