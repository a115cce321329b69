"""split_reduce: cut a row-parallel projection and its all-reduce into parts along the output
columns, each part with its own all-reduce, so one part's reduction is in flight while the
next part's tasks still stream their weights.

Requires: `tile` ran (`prog.schedule.families`; a collective is a push family `<c>.push`, one
task per peer offset, and a local family `<c>`, one task; passes/_collectives.py), not yet
`schedule` (no events).
Ensures: R = 1 (or no collective): no change. Otherwise every all-reduce whose operand is
written by one ordinary family P, each task of P storing one whole-batch column window of it
(a GEMV tiled along its output rows, its epilogues riding along: o_proj + residual, the shared
expert's down-projection + the latent up-projection), with at least `PARTS` such tiles, becomes
`PARTS` pieces cut at P's tile boundaries into column windows [c0, c1) of about equal width:
  P.part<i>              P's tasks whose tiles lie in the window (the same tasks, regrouped)
  <c>.part<i>.push       one task per peer: the window of the operand into slot d of the
                         part's own comm buffer `<y>.part<i>.slots` [G, B, c1 - c0] on the peer
                         d * stride ranks ahead; waits for P.part<i> only
  <c>.part<i>            the local task: the window of y = the group's sum, in group-index order
                         in fp32, of the operand's window and its slots (the same per-element
                         order as the whole collective: bit-identical results)
each part with its own `arrive` / `ack` events (the V4 acknowledgement per part). A push
task's tile is its slot followed by the window it moves, ((d, d + 1), (0, B), (c0, c1)); a
local task's tile is the window of y it stores. Families that waited for P or <c> wait for
every part. Which collectives may be cut is the registry's: `Trait.collective` together with
`Trait.columnwise` (column c of y reads column c of every member's operand: all_reduce).

The cost gate: a cut is made only where the cost model predicts a shorter step. For each
candidate the time from its producer's start to the end of the collective's last local reduce
is predicted twice by the schedule pass's own list-scheduling rule (`cost.list_schedule`, task
times from `cost.task_time_us`: the tile pass's for the whole collective, the same formulas for
the parts), on SMs all idle at the producer's start:
  whole  P's tasks; its G - 1 pushes (waiting for P); the one local reduce (waiting for them)
  split  P.part0; its pushes; P.part1; its pushes; the local reduces, part by part (the order
         `overlap` issues them: a push as soon as its part is ready, local reduces last)
What that weighs: the communication the split hides (part 0's pushes run beside part 1's
tasks; each reduce, one task on one SM reading G slots of its window, reads half as much and
the two run on two SMs; each push moves half the bytes) against what it costs (one more push
and reduce, each with the task overhead and the link latency; a re-cut GEMV streams its
weights in two waves, each task paying the overhead; part 0's pushes take SMs from part 1's
wave). Where the producer is tiled into few tasks the halves run side by side and the split
mostly shortens the reduce; where each half is a full wave (slice4 at R = 2) the second wave's
overhead and latency usually outweigh it. The collective is cut only when the split is
predicted strictly earlier; a refusal logs both predictions. Not modelled: the SMs' state
before P (earlier families' stragglers), independent families `overlap` may move beside the
reduces, and both parts' pushes sharing the link when they overlap (each part's push is
charged the collective's G - 1 streams, as the tile pass charges the whole one).
`Options.split_reduce = "forced"` (FUSEC_SPLIT_REDUCE=forced, `fusec simulate --split forced`)
cuts every eligible collective, so gated, forced and off can be compared.

Refusals are logged with their reason (FUSEC_LOG=overlap). Turning it off: a `--passes` list
without `split_reduce` (`--passes -split_reduce`).
"""
from __future__ import annotations

from fusec.ir.registry import Trait
from fusec.ir.schedule import Family, Instr, InstrKind, Region, Task
from fusec.ir.types import Kind, TensorType

from ._lowering import Retiler
from .cost import list_schedule, task_time_us
from .manager import Program, register_pass
from .options import log
from .target import gpu_spec

PARTS = 2   # parts per collective: part 1's reduction flies while part 2 streams


@register_pass("split_reduce")
def run(prog: Program) -> bool:
    s = prog.schedule
    if s is None or not s.families:
        raise ValueError("split_reduce needs the tile pass first (no task families)")
    if prog.notes.get("scheduled"):
        raise ValueError("split_reduce runs before schedule (the families have events already)")
    if prog.opts.ranks == 1:
        return False
    ops = {op.outputs[0].name: op for op in s.graph.ops}
    retiler = None
    gone: set[int] = set()           # the producers' old tasks, replaced by re-cut ones
    changed = False
    for local in [f for f in s.families if f.collective and f.body != "comm_push"]:
        op = ops[local.ops[0]]
        y = op.outputs[0].name
        found = _producer(s, local, op)
        if isinstance(found, str):
            log(prog.opts, "overlap", f"split_reduce: %{y} not split: {found}")
            continue
        prod, xt, n = found
        if retiler is None:
            retiler = Retiler(s.graph, s.dims, prog.opts)
        cut = retiler.columns(prod.ops, prod.name, PARTS)
        parts = _windows(cut[1], xt, n) if not isinstance(cut, str) else cut
        if isinstance(parts, str):
            # not a GEMV (the MoE combine): its own tiles, grouped into parts, when there are enough
            kept = _regroup(s, prod, xt, n)
            if isinstance(kept, str):
                log(prog.opts, "overlap", f"split_reduce: %{y} not split: {prod.name}: {parts}; {kept}")
                continue
            parts, new_tasks = kept, None
            costs = [[s.tasks[t].cost_us for t in ids] for ids, _ in parts]
        else:
            new_tasks = cut[1]
            costs = [[t.cost_us for t in ts] for ts in new_tasks]
        whole_us, split_us = predict(s, prog.opts, local, prod, costs, [win for _, win in parts])
        gain = f"predicted {whole_us:.2f} us whole, {split_us:.2f} us split ({split_us - whole_us:+.2f} us)"
        if split_us >= whole_us and prog.opts.split_reduce != "forced":
            log(prog.opts, "overlap", f"split_reduce: %{y} not split: no gain: {gain}, from {prod.name}'s "
                f"start to the last local reduce ({prod.name}: {len(prod.task_ids)} tasks whole, "
                f"{' + '.join(str(len(c)) for c in costs)} split; FUSEC_SPLIT_REDUCE=forced cuts it)")
            continue
        if new_tasks is not None:
            for tasks in new_tasks:
                for t in tasks:
                    t.id = len(s.tasks)
                    s.tasks.append(t)
            gone |= set(prod.task_ids)
            parts = [([t.id for t in ts], win) for ts, (_, win) in zip(new_tasks, parts)]
        _split(prog, local, op, prod, xt, parts)
        changed = True
        log(prog.opts, "overlap", f"split_reduce: %{y} split into {len(parts)} all-reduces over columns "
            f"{', '.join(f'[{a}:{b}]' for _, (a, b) in parts)} ({prod.name}: "
            f"{' + '.join(str(len(ids)) for ids, _ in parts)} tasks; {gain}"
            f"{', forced' if split_us >= whole_us else ''})")
    if changed:
        _renumber(s, gone)
    return changed


def _push_cost(spec, sms: int, G: int, xb: float, peer: int) -> float:
    """A push of `xb` bytes to `peer`, sharing the link with the collective's other G - 2 pushes."""
    return task_time_us(spec, xb, 0.0, remote_bytes=xb, remote_hops=1, sms=sms,
                        off_domain=peer >= spec.nvlink_domain, remote_streams=G - 1)


def _local_cost(spec, sms: int, G: int, xb: float, yb: float) -> float:
    """The local reduce: reads the operand's window and G - 1 slots of it, stores y's window."""
    return task_time_us(spec, xb * G + yb, 0.0, sms=sms)


def predict(s, opts, local: Family, prod: Family, part_costs, windows) -> tuple[float, float]:
    """The gate (module docstring): the predicted time from the producer's start to the end of
    its all-reduce's last local reduce, (whole, split into `windows`): the schedule pass's list
    scheduling (`cost.list_schedule`) of just those families, in the order `overlap` issues them,
    on idle SMs. `part_costs`: per window, the costs of the producer's tasks that compute it."""
    spec = gpu_spec(opts.gpu)
    push = next(f for f in s.families if f.name == local.name + ".push")
    y = local.ops[0]
    G, B, _ = s.buffers[f"{y}.slots"].shape
    es = s.buffers[f"{y}.slots"].dtype.bits / 8
    ys = s.graph.value(y).type.dtype.bits / 8
    peers = [i.region.rank for t in push.task_ids for i in s.tasks[t].instrs if i.kind is InstrKind.STORE]
    cost = lambda tids: [s.tasks[t].cost_us for t in tids]
    whole = [("p", (), cost(prod.task_ids)), ("push", ("p",), cost(push.task_ids)),
             ("local", ("p", "push"), cost(local.task_ids))]
    split, locals_ = [], []
    for k, (costs, (c0, c1)) in enumerate(zip(part_costs, windows)):
        xb = B * (c1 - c0) * es
        split += [(f"p{k}", (), costs), (f"push{k}", (f"p{k}",), [_push_cost(spec, s.sms, G, xb, p) for p in peers])]
        locals_.append((f"local{k}", (f"p{k}", f"push{k}"), [_local_cost(spec, s.sms, G, xb, B * (c1 - c0) * ys)]))
    t_whole = list_schedule(whole, s.sms)[0]["local"]
    done = list_schedule(split + locals_, s.sms)[0]
    return t_whole, max(done[name] for name, _, _ in locals_)


def _producer(s, local: Family, op):
    """(the family that writes the operand, the operand's storage, its width) or why not."""
    traits = op.opdef.traits
    if not (Trait.collective in traits and Trait.columnwise in traits):
        return f"{op.opname} is not a per-column collective (registry: collective + columnwise)"
    by = {f.name: f for f in s.families}
    push = by.get(local.name + ".push")
    if push is None:
        return "a group of one rank (no peers, nothing in flight)"
    if len(local.task_ids) != 1 or set(local.pre) != {0}:
        return "its local side is not one task"
    x = op.inputs[0].name
    xt = next(i.region.tensor for i in s.tasks[local.task_ids[0]].instrs if i.kind is InstrKind.LOAD)
    st = s.buffers.get(f"{op.outputs[0].name}.slots")
    if st is None or len(st.shape) != 3:
        return f"operand %{x} is not a [B, n] matrix with one slot buffer"
    writers = [f for f in s.families if any(i.kind is InstrKind.STORE and i.region.tensor == xt
                                            for t in f.task_ids for i in s.tasks[t].instrs)]
    if len(writers) != 1 or writers[0].collective or writers[0].name not in push.deps:
        return f"operand %{x} is not written by one ordinary family the push waits for"
    if ".part" in writers[0].name:
        return f"its producer {writers[0].name} is a part of another split already"
    return writers[0], xt, st.shape[2]


def _stored_window(t: Task, xt: str, B: int):
    boxes = [i.region.box for i in t.instrs if i.kind is InstrKind.STORE and i.region.tensor == xt]
    if len(boxes) != 1 or len(boxes[0]) != 2 or boxes[0][0] != (0, B):
        return None
    return boxes[0][1]


def _windows(per_part, xt: str, n: int):
    """Per part (its tasks, the window of the operand they store), checked: each task stores one
    whole-batch column window, and the parts cover [0, n) in order."""
    out, at = [], 0
    for tasks in per_part:
        if not tasks:
            return "a part without tasks"
        B = next((i.region.box[0][1] for i in tasks[0].instrs if i.kind is InstrKind.STORE
                  and i.region.tensor == xt), None)
        wins = sorted(w for w in (_stored_window(t, xt, B) for t in tasks) if w is not None)
        if len(wins) != len(tasks):
            return f"a re-cut task does not store one whole-batch column window of %{xt}"
        if wins[0][0] != at or any(a[1] != b[0] for a, b in zip(wins, wins[1:])):
            return f"the re-cut tiles do not cover %{xt}'s columns once, in order"
        out.append((tasks, (at, wins[-1][1])))
        at = wins[-1][1]
    return out if at == n else f"the re-cut tiles cover {at} of %{xt}'s {n} columns"


def _regroup(s, prod: Family, xt: str, n: int):
    """The producer's own tasks grouped into `PARTS` column windows at its tile boundaries."""
    B = next(i.region.box[0][1] for t in prod.task_ids for i in s.tasks[t].instrs
             if i.kind is InstrKind.STORE and i.region.tensor == xt)
    tiles = []
    for tid in prod.task_ids:
        w = _stored_window(s.tasks[tid], xt, B)
        if w is None:
            return f"task {tid} does not store one whole-batch column window of %{xt}"
        tiles.append((w, tid))
    tiles.sort()
    edges = [0] + [b for (_, b), _ in tiles]
    if [a for (a, _), _ in tiles] != edges[:-1] or edges[-1] != n:
        return f"its tiles do not cover %{xt}'s {n} columns once, in order"
    if len(tiles) < PARTS:
        return f"output too narrow to split: {len(tiles)} tile(s), {PARTS} parts need {PARTS}"
    cuts = [0]
    for p in range(1, PARTS):
        cuts.append(min((b for b in edges[1:-1] if b > cuts[-1]), key=lambda b: (abs(b - p * n / PARTS), b)))
    cuts.append(n)
    return [([tid for (a, _), tid in tiles if c0 <= a < c1], (c0, c1)) for c0, c1 in zip(cuts, cuts[1:])]


def _split(prog: Program, local: Family, op, prod: Family, xt: str, parts) -> None:
    """Replace the producer, push and local families by one of each per part (module docstring)."""
    s = prog.schedule
    spec = gpu_spec(prog.opts.gpu)
    by = {f.name: f for f in s.families}
    push = by[local.name + ".push"]
    y = op.outputs[0].name
    st = s.buffers.pop(f"{y}.slots")
    G, B, _ = st.shape
    es = st.dtype.bits / 8
    ys = s.graph.value(y).type.dtype.bits / 8
    lt = s.tasks[local.task_ids[0]]
    yt = next(i.region.tensor for i in lt.instrs if i.kind is InstrKind.STORE)
    arrive, ack = f"{y}.arrive", f"{y}.ack"
    new_prod, new_push, new_local = [], [], []
    for k, (tids, (c0, c1)) in enumerate(parts):
        w = c1 - c0
        win = ((0, B), (c0, c1))
        pname = f"{prod.name}.part{k}"
        new_prod.append(Family(pname, prod.body, prod.ops, list(tids), prod.deps, prod.collective,
                               prod.signals_local, {}, {}, dict(prod.named_events)))
        pslot = f"{y}.part{k}.slots"
        s.buffers[pslot] = TensorType((G, B, w), st.dtype, Kind.comm)
        a, c = f"{y}.part{k}.arrive", f"{y}.part{k}.ack"
        xb = B * w * es
        pids, pre, post = [], {}, {}
        for i, tid in enumerate(push.task_ids):
            old = s.tasks[tid]
            (sto,) = [x for x in old.instrs if x.kind is InstrKind.STORE]
            d, peer = sto.region.box[0][0], sto.region.rank
            ins = [Instr(InstrKind.LOAD, Region(xt, win)), Instr(InstrKind.COMPUTE),
                   Instr(InstrKind.STORE, Region(pslot, ((d, d + 1), (0, B), (0, w)), rank=peer))]
            cost = _push_cost(spec, s.sms, G, xb, peer)
            pids.append(_task(s, old if k == 0 else None, "comm_push", old.ops, ((d, d + 1),) + win, ins, cost).id)
            pre[i] = [(c if e == ack else e, th, p) for e, th, p in push.pre.get(i, [])]
            post[i] = [(a if e == arrive else e, p) for e, p in push.post.get(i, [])]
        deps = tuple(sorted(pname if d == prod.name else d for d in push.deps))
        new_push.append(Family(f"{local.name}.part{k}.push", push.body, push.ops, pids, deps, True,
                               push.signals_local, pre, post, {a: G - 1, c: G - 1}))
        ins = [Instr(InstrKind.LOAD, Region(xt, win)), Instr(InstrKind.LOAD, Region(pslot, ((1, G), (0, B), (0, w)))),
               Instr(InstrKind.COMPUTE), Instr(InstrKind.STORE, Region(yt, win))]
        cost = _local_cost(spec, s.sms, G, xb, B * w * ys)
        t = _task(s, lt if k == 0 else None, lt.body_kind, lt.ops, win, ins, cost)
        lpre = {0: [(a if e == arrive else e, th, p) for e, th, p in local.pre.get(0, [])]}
        lpost = {0: [(c if e == ack else e, p) for e, p in local.post.get(0, [])]}
        ldeps = tuple(sorted(pname if d == prod.name else d for d in local.deps))
        new_local.append(Family(f"{local.name}.part{k}", local.body, local.ops, [t.id], ldeps, True,
                                local.signals_local, lpre, lpost, {}))
    repl = {prod.name: [f.name for f in new_prod], local.name: [f.name for f in new_local]}
    out = []
    for f in s.families:
        if f is prod:
            out += new_prod
        elif f is push:
            out += new_push
        elif f is local:
            out += new_local
        else:
            if any(d in repl for d in f.deps):
                f.deps = tuple(sorted({m for d in f.deps for m in repl.get(d, [d])}))
            out.append(f)
    s.families = out


def _task(s, old: Task | None, body: str, ops, tile, instrs, cost) -> Task:
    """Reuse `old` (part 0 keeps the task ids of the whole collective) or append a new task."""
    if old is not None:
        old.tile, old.instrs, old.cost_us = tile, instrs, cost
        return old
    t = Task(len(s.tasks), 0, -1, body, ops, tile, instrs, cost)
    s.tasks.append(t)
    return t


def _renumber(s, gone: set[int]) -> None:
    """Drop the replaced tasks and number the rest in family order (each family's tasks a
    contiguous range, as the tile pass leaves them); ids are positions again (only the families
    name them yet)."""
    order = [tid for f in s.families for tid in f.task_ids]
    listed = set(order)
    order += [t.id for t in s.tasks if t.id not in listed and t.id not in gone]
    new = {old: i for i, old in enumerate(order)}
    kept = [s.tasks[old] for old in order]
    for i, t in enumerate(kept):
        t.id = i
    s.tasks = kept
    for f in s.families:
        f.task_ids = [new[i] for i in f.task_ids]
