"""Lowering of collectives and long-cache attention for the `tile` pass (not a pass).

`emit_collective`: a collective becomes a push family (one task per peer offset d = 1..R-1 that
writes the whole operand into slot d of the peer's `comm` buffer `<y>.slots` [R, ...] and
signals the peer's `<y>.arrive` at system scope, after waiting for threshold 0 of its own
`<y>.ack`, i.e. every acknowledgement of the previous step) and a local family that waits for
R - 1 arrivals, reduces or gathers the slots (the rank-dependent part lives in the body, never
in a region, so the schedule stays rank-symmetric) and acknowledges each sender.

`split_sequence`: absorbed MLA attention over a long cache becomes `mla_attention_partial`
(one task per chunk of cache rows) + `attention_combine` in the graph itself, so every
executor runs the same ops the tasks compute.
"""
from __future__ import annotations

import math

from fusec.cost import task_time_us
from fusec.ir.graph import Graph, Op, Value
from fusec.ir.registry import get_op
from fusec.ir.schedule import Instr, InstrKind, Region, Task
from fusec.ir.types import Kind, TensorType

from . import _lowering
from ._lowering import Unit, full_box


def emit_collective(ctx: _Ctx, name: str, op: Op) -> list[Unit]:
    """Push unit (per peer offset d) + local reduce/gather unit; see passes/tile.py."""
    R = op.attrs["ranks"]
    x, y = op.inputs[0], op.outputs[0]
    xs = ctx.shape[x.name]
    slot = f"{y.name}.slots"
    slot_t = TensorType((R, *xs), x.type.dtype, Kind.comm)
    ctx.buffers[slot] = slot_t
    arrive, ack = f"{y.name}.arrive", f"{y.name}.ack"
    extra = [v for v in op.inputs[1:]]
    push = Unit(name + ".push", [op], "comm_push", collective=True, signals_local=False,
                named_events={arrive: R - 1, ack: R - 1})
    xb = ctx.nbytes(x, full_box(xs))
    for d in range(1, R):
        ins = [Instr(InstrKind.LOAD, Region(ctx.storage[v.name], full_box(ctx.shape[v.name]))) for v in [x, *extra]]
        ins += [Instr(InstrKind.COMPUTE),
                Instr(InstrKind.STORE, Region(slot, ((d, d + 1), *full_box(xs)), rank=d))]
        t = Task(len(ctx.tasks), 0, -1, "comm_push", (y.name,), ((d, d + 1),), ins,
                 task_time_us(ctx.spec, xb, 0.0, remote_bytes=xb, remote_hops=1, sms=ctx.sms,
                              off_domain=d >= ctx.spec.nvlink_domain, remote_streams=R - 1))
        ctx.tasks.append(t)
        push.task_ids.append(t.id)
        i = len(push.task_ids) - 1
        # the peer's slot d is free once every receiver acknowledged the previous step (t = 0)
        push.pre[i] = [(ack, 0, None)]
        push.post[i] = [(arrive, d)]
    push.reads |= {x.name, *(v.name for v in extra)}
    local = Unit(name, [op], "comm_" + op.opname, collective=True)
    ins = [Instr(InstrKind.LOAD, Region(ctx.storage[v.name], full_box(ctx.shape[v.name]))) for v in [x, *extra]]
    if R > 1:
        ins.append(Instr(InstrKind.LOAD, Region(slot, ((1, R), *full_box(xs)))))
    ins += [Instr(InstrKind.COMPUTE), Instr(InstrKind.STORE, Region(ctx.storage[y.name], full_box(ctx.shape[y.name])))]
    t = Task(len(ctx.tasks), 0, -1, "comm_" + op.opname, (y.name,), full_box(ctx.shape[y.name]), ins,
             task_time_us(ctx.spec, xb * R + ctx.nbytes(y, full_box(ctx.shape[y.name])), 0.0, sms=ctx.sms))
    ctx.tasks.append(t)
    local.task_ids.append(t.id)
    local.reads |= {x.name, *(v.name for v in extra)}
    local.writes.add(y.name)
    if R > 1:
        local.pre[0] = [(arrive, R - 1, None)]
        local.post[0] = [(ack, (R - d) % R) for d in range(1, R)]   # tell each sender: slot consumed
        return [push, local]
    return [local]


def split_sequence(g: Graph, dims, sms: int, logf) -> int:
    """Replace each absorbed MLA attention over a long cache by split-sequence partials (one
    task per chunk of cache rows) and a combine; returns how many were split. Every head of
    MLA reads the whole latent cache, so splitting heads does not shorten a task: chunks do."""
    n = 0
    new_ops: list[Op] = []
    for op in g.ops:
        if op.opname != "mla_attention":
            new_ops.append(op)
            continue
        cache = op.inputs[2]
        cb = cache.type.nbytes(dims)
        rows = cache.type.concrete(dims)[1]
        chunks = min(sms, rows, math.ceil(cb / _lowering.MIN_TASK_BYTES))
        if chunks <= 1:
            new_ops.append(op)
            continue
        attrs = {**op.attrs, "chunks": chunks}
        pdef = get_op("mla_attention_partial")
        (pt,) = pdef.infer([v.type for v in op.inputs], attrs)
        out = op.outputs[0]
        part = Op("mla_attention_partial", list(op.inputs), [], attrs, None)
        part.outputs = [Value(g.fresh(out.name + ".partial"), pt, part)]
        comb = Op("attention_combine", [part.outputs[0]], [out], {}, op.group)
        out.producer = comb
        new_ops += [part, comb]
        n += 1
        logf(f"split-sequence: %{out.name} over {chunks} chunks of {rows // chunks} cache rows + combine")
    if n:
        g.ops = new_ops
        g.rebuild_index()
    return n
