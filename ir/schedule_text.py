"""The schedule text form: canonical printer and lark parser (grammar in `schedule.lark`).

A schedule file is the `.fir` text of the schedule's graph followed by one `schedule` block:

    graph g (B) { ... }
    schedule g ranks = 1 sms = 2 dims(B = 1) {
      event 0 rank 0 "x.ready" per_step 1
      task 0 rank 0 sm 0 gemv ops(%x) tile [0:1, 0:8] cost 1.0 {
        load %w [0:8, 0:4]
        compute
        store %x [0:1, 0:8]
        signal e0 release gpu
      }
      queue 0 0 : 0
    }

`print_schedule(parse_schedule(t))` reproduces `t` exactly for printed text; a parse error is a
`ScheduleSyntaxError` whose one-line message starts with file:line:col.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from lark import Lark, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .parser import FirSyntaxError, parse_fir
from .printer import print_graph
from .schedule import Event, Instr, InstrKind, Region, Schedule, Scope, Sem, Task
from .types import DType, Kind, TensorType

GRAMMAR = Path(__file__).with_name("schedule.lark")
_HEADER = re.compile(r"^schedule\b", re.M)


class ScheduleSyntaxError(ValueError):
    """A schedule file that does not parse; str() is one line starting with file:line:col."""


# -- printer -------------------------------------------------------------------------------------
def _box(box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def format_region(r: Region) -> str:
    at = f" @{r.rank}" if r.rank is not None else ""
    return f"%{r.tensor} {_box(r.box)}{at}"


def format_instr(i: Instr) -> str:
    peer = f" peer {i.peer}" if i.peer is not None else ""
    if i.kind is InstrKind.LOAD:
        addr = f" addressed_by %{i.addressed_by}" if i.addressed_by else ""
        return f"load {format_region(i.region)}{addr}"
    if i.kind is InstrKind.STORE:
        return f"store {format_region(i.region)}"
    if i.kind is InstrKind.WAIT:
        return f"wait e{i.event} >= {i.threshold} {i.sem.value} {i.scope.value}{peer}"
    if i.kind is InstrKind.SIGNAL:
        return f"signal e{i.event} {i.sem.value} {i.scope.value}{peer}"
    return "compute"


def _cost(c: float) -> str:
    r = repr(float(c))
    return r


def print_schedule(s: Schedule) -> str:
    """Canonical text: the graph, then events, tasks (by id) and queues (by rank, sm)."""
    dims = ", ".join(f"{k} = {v}" for k, v in s.dims.items())
    rep = " replicated" if getattr(s, "replicated", False) else ""
    out = [print_graph(s.graph).rstrip("\n"),
           f"schedule {s.graph.name} ranks = {s.ranks} sms = {s.sms} dims({dims}){rep} {{"]
    for k, v in s.meta.items():
        out.append(f"  meta {k} = {json.dumps(v)}")
    for name, ty in getattr(s, "buffers", {}).items():
        shape = ", ".join(str(d) for d in ty.shape)
        out.append(f"  buffer %{name} : {ty.kind.value} {ty.dtype.value}[{shape}]")
    for e in s.events:
        out.append(f"  event {e.id} rank {e.rank} {json.dumps(e.name)} per_step {e.per_step}")
    for t in s.tasks:
        ops = ", ".join(f"%{o}" for o in t.ops)
        out.append(f"  task {t.id} rank {t.rank} sm {t.sm} {t.body_kind} ops({ops}) tile {_box(t.tile)} "
                   f"cost {_cost(t.cost_us)} {{")
        out.extend(f"    {format_instr(i)}" for i in t.instrs)
        out.append("  }")
    for (rank, sm), ids in sorted(s.queues.items()):
        out.append(f"  queue {rank} {sm} :" + "".join(f" {i}" for i in ids))
    out.append("}")
    return "\n".join(out) + "\n"


# -- parser --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


def parse_schedule(text: str, filename: str = "<string>") -> Schedule:
    m = _HEADER.search(text)
    if m is None:
        raise ScheduleSyntaxError(f"{filename}:1:1: expected a graph followed by a 'schedule' block")
    graph = parse_fir(text[:m.start()], filename)
    # keep line numbers of the schedule part equal to the file's: blank out the graph part
    body = re.sub(r"[^\n]", " ", text[:m.start()]) + text[m.start():]
    try:
        tree = _lark().parse(body)
    except UnexpectedToken as e:
        got = "end of file" if e.token.type == "$END" else repr(str(e.token))
        raise ScheduleSyntaxError(f"{filename}:{e.line}:{e.column}: expected one of "
                                  f"{', '.join(sorted(e.expected))}, got {got}") from None
    except UnexpectedCharacters as e:
        raise ScheduleSyntaxError(f"{filename}:{e.line}:{e.column}: unexpected character "
                                  f"{body[e.pos_in_stream]!r}") from None
    except UnexpectedEOF as e:
        raise ScheduleSyntaxError(f"{filename}: unexpected end of file, expected "
                                  f"{', '.join(sorted(e.expected))}") from None
    except UnexpectedInput as e:  # pragma: no cover - other lark errors
        raise ScheduleSyntaxError(f"{filename}:{getattr(e, 'line', '?')}:{getattr(e, 'column', '?')}: {e}") from None
    return _Builder(filename, graph).build(tree.children[0])


def parse_schedule_file(path) -> Schedule:
    path = Path(path)
    return parse_schedule(path.read_text(), str(path))


def _var(tok) -> str:
    return str(tok)[1:]


class _Builder:
    def __init__(self, filename: str, graph):
        self.filename, self.graph = filename, graph
        self.buffers: dict = {}

    def err(self, node, msg: str) -> ScheduleSyntaxError:
        meta = getattr(node, "meta", None)
        line = getattr(node, "line", None) or getattr(meta, "line", "?")
        col = getattr(node, "column", None) or getattr(meta, "column", "?")
        return ScheduleSyntaxError(f"{self.filename}:{line}:{col}: {msg}")

    def build(self, t: Tree) -> Schedule:
        name, ranks, sms, dimbind, *items = t.children
        if str(name) != self.graph.name:
            raise self.err(name, f"schedule '{name}' does not match graph '{self.graph.name}'")
        dims = {str(b.children[0]): int(b.children[1]) for b in dimbind.children}
        s = Schedule(self.graph, dims, int(ranks), int(sms), [], [], {}, {})
        s.replicated = bool(items) and getattr(items[0], "type", None) == "REPLICATED"
        s.buffers = {}
        if s.replicated:
            items = items[1:]
        for it in items:
            getattr(self, it.data)(s, it)
        for i, task in enumerate(s.tasks):
            if task.id != i:
                raise ScheduleSyntaxError(f"{self.filename}: task ids must be 0..n-1 in order; "
                                          f"position {i} holds task {task.id}")
        return s

    def meta(self, s, t):
        s.meta[str(t.children[0])] = json.loads(t.children[1])

    def buffer(self, s, t):
        var, kind, dtype, *shape = t.children
        s.buffers[_var(var)] = self.buffers[_var(var)] = TensorType(tuple(int(d) for d in shape), DType(str(dtype)), Kind(str(kind)))

    def event(self, s, t):
        eid, rank, name, per = t.children
        s.events.append(Event(int(eid), int(rank), json.loads(name), int(per)))

    def task(self, s, t):
        tid, rank, sm, body, *rest = t.children
        ops = tuple(_var(x) for x in rest if getattr(x, "type", None) == "VAR")
        tile_box, cost, *instrs = [x for x in rest if getattr(x, "type", None) != "VAR"]
        for o in ops:
            if not self.graph.has_value(o):
                raise self.err(t, f"task {tid} computes unknown value %{o}")
        s.tasks.append(Task(int(tid), int(rank), int(sm), str(body), ops, self.box(tile_box),
                            [self.instr(i) for i in instrs], float(cost)))

    def queue(self, s, t):
        rank, sm, *ids = t.children
        key = (int(rank), int(sm))
        if key in s.queues:
            raise self.err(t, f"queue {key[0]} {key[1]} given twice")
        s.queues[key] = [int(i) for i in ids]

    def box(self, t) -> tuple:
        return tuple((int(sp.children[0]), int(sp.children[1])) for sp in t.children)

    def region(self, t) -> Region:
        var, box, *at = t.children
        name = _var(var)
        if not self.graph.has_value(name) and name not in self.buffers:
            raise self.err(var, f"unknown tensor %{name}")
        return Region(name, self.box(box), int(at[0].children[0]) if at else None)

    def instr(self, t) -> Instr:
        k = t.data
        if k == "load":
            addr = _var(t.children[1].children[0]) if len(t.children) > 1 else None
            return Instr(InstrKind.LOAD, self.region(t.children[0]), addressed_by=addr)
        if k == "store":
            return Instr(InstrKind.STORE, self.region(t.children[0]))
        if k == "compute":
            return Instr(InstrKind.COMPUTE)
        peer = None
        if t.children and isinstance(t.children[-1], Tree) and t.children[-1].data == "peer":
            peer = int(t.children[-1].children[0])
        if k == "wait":
            ev, thr, sem, scope = t.children[:4]
            return Instr(InstrKind.WAIT, event=int(str(ev)[1:]), threshold=int(thr), sem=Sem(str(sem)),
                         scope=Scope(str(scope)), peer=peer)
        ev, sem, scope = t.children[:3]
        return Instr(InstrKind.SIGNAL, event=int(str(ev)[1:]), sem=Sem(str(sem)), scope=Scope(str(scope)), peer=peer)
