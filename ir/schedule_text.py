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

Two readers, one language: the grammar in `schedule.lark` (lark, LALR) defines it, and a
line-oriented reader (`_FastReader`) reads the canonical printed layout, one statement a line,
about 30x faster, sharing equal boxes, op tuples and instructions (a full K3 schedule is 55 MB,
1.1 M lines, ~340 K distinct instruction lines). The fast reader accepts a subset of the grammar's
texts and gives up (`_GiveUp`) on anything else: a line not in the printed layout (statements
split or joined across lines, other spacing, trailing comments) or any error; the lark reader then
reads the whole text, so what is accepted, what it means and every error message are the lark
reader's (`parse_schedule(..., fast=False)` forces it; tests check the two agree).
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import itertools
import json
import re
import sys
from pathlib import Path

from lark import Lark, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .gc_pause import gc_paused
from .parser import _NAME, _VAR, FirSyntaxError, parse_fir   # one spelling of names and %values for both readers
from .printer import print_graph
from .schedule import Event, Family, Instr, InstrKind, Region, Schedule, Scope, Sem, Task
from .types import DType, Kind, TensorType

GRAMMAR = Path(__file__).with_name("schedule.lark")
_HEADER = re.compile(r"^schedule\b", re.M)


class ScheduleSyntaxError(ValueError):
    """A schedule file that does not parse; str() is one line starting with file:line:col."""


# -- printer -------------------------------------------------------------------------------------
def _box(box) -> str:
    n = len(box)           # the common ranks unpacked: ~10^6 boxes are printed for a full K3
    if n == 2:
        (a, b), (c, d) = box
        return f"[{a}:{b}, {c}:{d}]"
    if n == 3:
        (a, b), (c, d), (e, f) = box
        return f"[{a}:{b}, {c}:{d}, {e}:{f}]"
    return "[" + ", ".join([f"{lo}:{hi}" for lo, hi in box]) + "]"


def format_region(r: Region) -> str:
    at = f" @{r.rank}" if r.rank is not None else ""
    return f"%{r.tensor} {_box(r.box)}{at}"


def format_instr(i: Instr) -> str:
    kind = i.kind
    if kind is InstrKind.LOAD:
        addr = f" addressed_by %{i.addressed_by}" if i.addressed_by else ""
        return f"load {format_region(i.region)}{addr}"
    if kind is InstrKind.STORE:
        return f"store {format_region(i.region)}"
    peer = f" peer {i.peer}" if i.peer is not None else ""
    if i.kind is InstrKind.WAIT:
        return f"wait e{i.event} >= {i.threshold} {i.sem.value} {i.scope.value}{peer}"
    if i.kind is InstrKind.SIGNAL:
        return f"signal e{i.event} {i.sem.value} {i.scope.value}{peer}"
    return "compute"


def _box_text(box, boxes: dict) -> str:
    """`_box(box)`, remembered in `boxes` by identity (the caller keeps `box` alive)."""
    text = boxes[id(box)] = _box(box)
    return text


def _instr_line(i: Instr, lines: dict, boxes: dict) -> str:
    """The line of `i` in a task body (`format_instr`, indented), remembered in `lines`; box
    texts are remembered in `boxes` (both by identity: the caller keeps `i` alive)."""
    kind = i.kind
    if kind is InstrKind.LOAD or kind is InstrKind.STORE:
        r = i.region
        box = boxes.get(id(r.box)) or _box_text(r.box, boxes)
        at = f" @{r.rank}" if r.rank is not None else ""
        if kind is InstrKind.LOAD:
            addr = f" addressed_by %{i.addressed_by}" if i.addressed_by else ""
            line = f"    load %{r.tensor} {box}{at}{addr}"
        else:
            line = f"    store %{r.tensor} {box}{at}"
    else:
        line = f"    {format_instr(i)}"
    lines[id(i)] = line
    return line


def _cost(c: float) -> str:
    r = repr(float(c))
    return r


def _runs(ids) -> str:
    """Task ids as `lo:hi` runs (hi exclusive), in list order."""
    out, i, n = [], 0, len(ids)
    while i < n:
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1:
            j += 1
        out.append(f"{ids[i]}:{ids[j - 1] + 1}")
        i = j
    return ", ".join(out)


def _peer(p) -> str:
    return "" if p is None else f" peer {p}"


def _family_text(f: Family) -> str:
    """`family "name" body ops(...) tasks(runs) deps("a", ...)[ collective][ quiet]`, then a
    `{ ... }` block of its pre / post / named lines when it has any."""
    flags = (" collective" if f.collective else "") + ("" if f.signals_local else " quiet")
    head = (f"  family {json.dumps(f.name)} {f.body} ops({', '.join(f'%{o}' for o in f.ops)}) "
            f"tasks({_runs(f.task_ids)}) deps({', '.join(json.dumps(d) for d in f.deps)}){flags}")
    items = [f"    pre {i} {json.dumps(e)} >= {th}{_peer(p)}" for i, lst in sorted(f.pre.items()) for e, th, p in lst]
    items += [f"    post {i} {json.dumps(e)}{_peer(p)}" for i, lst in sorted(f.post.items()) for e, p in lst]
    items += [f"    named {json.dumps(e)} per_step {n}" for e, n in f.named_events.items()]
    if not items:
        return head
    return "\n".join([head + " {", *items, "  }"])


def print_schedule(s: Schedule) -> str:
    """Canonical text: the graph, then events, tasks (by id), families (in their order) and
    queues (by rank, sm)."""
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
    # Instructions and op lists are shared between the tasks of a family (a full K3 schedule has
    # ~9 * 10^5 instruction lines, ~3.4 * 10^5 distinct instructions): each is formatted once,
    # keyed by identity (every one stays alive in `s` meanwhile).
    # Boxes are often shared too (the tile pass keeps one tuple per distinct box).
    lines: dict[int, str] = {}
    get = lines.get
    boxes: dict[int, str] = {}
    ops_text: dict[int, tuple] = {}
    append = out.append
    for t in s.tasks:
        got = ops_text.get(id(t.ops))
        if got is None or got[0] is not t.ops:
            got = ops_text[id(t.ops)] = (t.ops, ", ".join(f"%{o}" for o in t.ops))
        body = [get(id(i)) or _instr_line(i, lines, boxes) for i in t.instrs]
        tile = boxes.get(id(t.tile)) or _box_text(t.tile, boxes)
        append("\n".join([f"  task {t.id} rank {t.rank} sm {t.sm} {t.body_kind} ops({got[1]}) tile {tile} "
                          f"cost {_cost(t.cost_us)} {{", *body, "  }"]))
    for f in s.families:
        append(_family_text(f))
    for (rank, sm), ids in sorted(s.queues.items()):
        out.append(f"  queue {rank} {sm} :" + "".join(f" {i}" for i in ids))
    out.append("}\n")                  # the final newline without copying the whole text again
    return "\n".join(out)


# -- parser --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


def parse_schedule(text: str, filename: str = "<string>", fast: bool = True) -> Schedule:
    """Parse schedule text (the line-oriented reader first, the lark reader when it gives up)."""
    with gc_paused():
        return _parse_schedule(text, filename, fast)


def _parse_schedule(text: str, filename: str, fast: bool) -> Schedule:
    m = _HEADER.search(text)
    if m is None:
        raise ScheduleSyntaxError(f"{filename}:1:1: expected a graph followed by a 'schedule' block")
    graph = parse_fir(text[:m.start()], filename, fast=fast)
    if fast:
        s = _FastReader(graph).read(text[m.start():].split("\n"))
        if s is not None:
            return s
    return _parse_lark(text, m, filename, graph)


def _parse_lark(text: str, m, filename: str, graph) -> Schedule:
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


def parse_schedule_file(path, fast: bool = True) -> Schedule:
    """Parse a schedule file (`.fsched`, or `.fsched.gz` gzip); streams its lines (the 55 MB text of a full model is never held
    whole) unless the fast reader gives up."""
    path = Path(path)
    with gc_paused():
        return _parse_schedule_file(path, fast)


def _open_text(path: Path):
    """The file as text lines; a `.gz` file (what `fusec compile` writes) decompressed as read."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def _parse_schedule_file(path: Path, fast: bool) -> Schedule:
    if fast:
        with _open_text(path) as f:     # the decoding and newline handling of Path.read_text
            head = []
            for line in f:
                if line.startswith("schedule") and _HEADER.match(line):
                    break
                head.append(line)
            else:
                line = None
            if line is not None:
                graph = parse_fir("".join(head), str(path))
                del head
                s = _FastReader(graph).read(itertools.chain((line,), f))
                if s is not None:
                    return s
    with _open_text(path) as f:
        return _parse_schedule(f.read(), str(path), fast=False)


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

    def family(self, s, t):
        name, body, *rest = t.children
        kind = lambda x: getattr(x, "type", None)  # noqa: E731
        ops = tuple(_var(x) for x in rest if kind(x) == "VAR")
        deps = tuple(json.loads(x) for x in rest if kind(x) == "ESCAPED_STRING")
        flags = {str(x) for x in rest if kind(x) == "FFLAG"}
        trees = [x for x in rest if isinstance(x, Tree)]
        ids = [i for sp in trees if sp.data == "span" for i in range(int(sp.children[0]), int(sp.children[1]))]
        for o in ops:
            if not self.graph.has_value(o):
                raise self.err(t, f"family {name} computes unknown value %{o}")
        f = Family(json.loads(name), str(body), ops, ids, deps, "collective" in flags, "quiet" not in flags)
        for fb in (x for x in trees if x.data == "fbody"):
            for it in fb.children:
                c = it.children
                peer = int(c[-1].children[0]) if isinstance(c[-1], Tree) else None
                if it.data == "fpre":
                    f.pre.setdefault(int(c[0]), []).append((json.loads(c[1]), int(c[2]), peer))
                elif it.data == "fpost":
                    f.post.setdefault(int(c[0]), []).append((json.loads(c[1]), peer))
                else:
                    f.named_events[json.loads(c[0])] = int(c[1])
        s.families.append(f)

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


# -- fast line-oriented reader -----------------------------------------------------------------------
class _GiveUp(Exception):
    """The fast reader does not take this text: the lark reader decides."""


_WS = " \t\f\r\n"          # lark's common.WS
_STR = r'"(?:[^"\\\n]|\\.)*"'
_NUM = r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
_BOX = r"(?:\d+:\d+(?:, \d+:\d+)*)?"
_SEM = "(relaxed|acquire|release)"
_SCOPE = "(cta|gpu|sys)"
_RE_HEADER = re.compile(rf"schedule ({_NAME}) ranks = (\d+) sms = (\d+) "
                        rf"dims\(((?:{_NAME} = \d+(?:, {_NAME} = \d+)*)?)\)( replicated)? \{{")
_RE_META = re.compile(rf"meta ({_NAME}) = ({_STR})")
_RE_BUFFER = re.compile(rf"buffer ({_VAR}) : (weight|state|act|io|comm) "
                        r"(bf16|f16|f32|fp8e4m3|mxfp4|i32|i64|u8)\[((?:\d+(?:, \d+)*)?)\]")
_RE_EVENT = re.compile(rf"event (\d+) rank (\d+) ({_STR}) per_step (\d+)")
_RE_TASK = re.compile(rf"task (\d+) rank (\d+) sm (-?\d+) ({_NAME}) ops\(((?:{_VAR}(?:, {_VAR})*)?)\) "
                      rf"tile \[({_BOX})\] cost ({_NUM}) \{{")
_RE_QUEUE = re.compile(r"queue (\d+) (\d+) :((?: \d+)*)")
_RE_FAMILY = re.compile(rf"family ({_STR}) ({_NAME}) ops\(((?:{_VAR}(?:, {_VAR})*)?)\) tasks\(({_BOX})\) "
                        rf"deps\(((?:{_STR}(?:, {_STR})*)?)\)( collective)?( quiet)?( \{{)?")
_RE_FPRE = re.compile(rf"pre (\d+) ({_STR}) >= (\d+)(?: peer (\d+))?")
_RE_FPOST = re.compile(rf"post (\d+) ({_STR})(?: peer (\d+))?")
_RE_FNAMED = re.compile(rf"named ({_STR}) per_step (\d+)")
_RE_BOXTEXT = re.compile(_BOX)
_RE_AT = re.compile(r"(?: @(\d+))?")
_NO = object()
_RE_VAR = re.compile(_VAR)
_RE_WAIT = re.compile(rf"wait e(\d+) >= (\d+) {_SEM} {_SCOPE}(?: peer (\d+))?")
_RE_SIGNAL = re.compile(rf"signal e(\d+) {_SEM} {_SCOPE}(?: peer (\d+))?")
_COMPUTE = Instr(InstrKind.COMPUTE)
# Instr and Region are frozen dataclasses whose __init__ only assigns their fields; the fast
# reader builds its ~340 K distinct instructions (a full model) by filling __dict__, ~2x faster
# (equal and hashing alike: tests/test_schedule_reader.py compares with the lark reader's).
_INSTR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Instr)}
_new = object.__new__


def _instr(kind, region=None, **fields) -> Instr:
    o = _new(Instr)
    d = o.__dict__
    d.update(_INSTR_DEFAULTS)
    d["kind"], d["region"] = kind, region
    if fields:
        d.update(fields)
    return o


def _region(tensor, box, rank) -> Region:
    o = _new(Region)
    o.__dict__.update(tensor=tensor, box=box, rank=rank)
    return o


class _FastReader:
    """Reads the printed layout line by line into the same Schedule the lark reader builds
    (equal boxes, op tuples and instructions are shared: all are immutable). `read` returns
    None where the lark reader must decide (see the module docstring)."""

    def __init__(self, graph):
        self.graph = graph
        self.buffers: dict = {}
        self.known: dict = {}            # %var text -> its name, checked to be a graph value or buffer
        self.boxes: dict = {}            # box text -> tuple of (lo, hi)
        self.regions: dict = {}          # region text -> Region
        self.ats: dict = {}              # region rank text ('' or ' @1') -> None or the rank
        self.ops: dict = {}              # ops text -> tuple of value names
        self.instrs: dict = {}           # instruction line -> Instr

    def read(self, lines) -> Schedule | None:
        try:
            return self._read(lines)
        except (_GiveUp, ValueError, KeyError, IndexError, StopIteration):
            return None

    def box(self, text: str) -> tuple:
        """The box of `lo:hi, ...` text (checked against the layout once per distinct text)."""
        b = self.boxes.get(text)
        if b is None:
            if _RE_BOXTEXT.fullmatch(text) is None:
                raise _GiveUp
            b = self.boxes[text] = tuple(tuple(map(int, sp.split(":"))) for sp in text.split(", ")) \
                if text else ()
        return b

    def tensor(self, var: str) -> str:
        """The name of a %var the graph or an earlier buffer declares (one shared str per name)."""
        name = self.known.get(var)
        if name is None:
            if _RE_VAR.fullmatch(var) is None:
                raise _GiveUp
            name = var[1:]
            if not self.graph.has_value(name) and name not in self.buffers:
                raise _GiveUp
            name = self.known[var] = sys.intern(name)
        return name

    def region(self, text: str) -> Region:
        r = self.regions.get(text)
        if r is None:
            # `%var [box]` or `%var [box] @rank`: a %var has no space or '[', a box no ']', so
            # these splits are exact; each part is checked against the layout (once per text)
            var, sep, rest = text.partition(" [")
            box, sep2, at = rest.partition("]")
            if not sep or not sep2:
                raise _GiveUp
            rank = self.ats.get(at, _NO)
            if rank is _NO:
                m = _RE_AT.fullmatch(at)
                if m is None:
                    raise _GiveUp
                rank = self.ats[at] = int(m[1]) if m[1] is not None else None
            r = self.regions[text] = _region(self.tensor(var), self.box(box), rank)
        return r

    def instr(self, line: str) -> Instr:
        if line.startswith("load "):
            k = line.find(" addressed_by ")
            if k < 0:
                return _instr(InstrKind.LOAD, self.region(line[5:]))
            addr = line[k + 14:]
            if _RE_VAR.fullmatch(addr) is None:
                raise _GiveUp
            return _instr(InstrKind.LOAD, self.region(line[5:k]), addressed_by=sys.intern(addr[1:]))
        if line.startswith("store "):
            return _instr(InstrKind.STORE, self.region(line[6:]))
        if line.startswith("wait "):
            m = _RE_WAIT.fullmatch(line)
            if m is None:
                raise _GiveUp
            ev, thr, sem, scope, peer = m.groups()
            return _instr(InstrKind.WAIT, event=int(ev), threshold=int(thr), sem=Sem(sem), scope=Scope(scope),
                         peer=None if peer is None else int(peer))
        if line.startswith("signal "):
            m = _RE_SIGNAL.fullmatch(line)
            if m is None:
                raise _GiveUp
            ev, sem, scope, peer = m.groups()
            return _instr(InstrKind.SIGNAL, event=int(ev), sem=Sem(sem), scope=Scope(scope),
                         peer=None if peer is None else int(peer))
        if line == "compute":
            return _COMPUTE
        raise _GiveUp

    def family(self, line: str, it) -> Family:
        """A family line (and its `{ ... }` block, read from `it`, when the line opens one)."""
        m = _RE_FAMILY.fullmatch(line)
        if m is None:
            raise _GiveUp
        name, body, ops, runs, deps, coll, quiet, block = m.groups()
        opt = tuple(o[1:] for o in ops.split(", ")) if ops else ()
        if not all(self.graph.has_value(o) for o in opt):
            raise _GiveUp
        ids = [i for lo, hi in self.box(runs) for i in range(lo, hi)]
        f = Family(json.loads(name), sys.intern(body), opt, ids, tuple(json.loads(f"[{deps}]")),
                   coll is not None, quiet is None)
        if block is None:
            return f
        for raw in it:
            sub = raw.strip(_WS)
            if sub == "}":
                return f
            if (m := _RE_FPRE.fullmatch(sub)) is not None:
                f.pre.setdefault(int(m[1]), []).append((json.loads(m[2]), int(m[3]), None if m[4] is None else int(m[4])))
            elif (m := _RE_FPOST.fullmatch(sub)) is not None:
                f.post.setdefault(int(m[1]), []).append((json.loads(m[2]), None if m[3] is None else int(m[3])))
            elif (m := _RE_FNAMED.fullmatch(sub)) is not None:
                f.named_events[json.loads(m[1])] = int(m[2])
            else:
                raise _GiveUp
        raise _GiveUp

    def _read(self, lines) -> Schedule:
        graph, ws = self.graph, _WS
        it = iter(lines)
        m = _RE_HEADER.fullmatch(next(it).strip(ws))
        if m is None or m[1] != graph.name:
            raise _GiveUp
        dims = {}
        for b in (m[4].split(", ") if m[4] else ()):
            k, v = b.split(" = ")
            dims[k] = int(v)
        s = Schedule(graph, dims, int(m[2]), int(m[3]), [], [], {}, {})
        s.replicated = m[5] is not None
        s.buffers = {}
        tasks, cache, closed = s.tasks, self.instrs, False
        for raw in it:
            line = raw.strip(ws)
            if not line or line[0] == "#":
                continue
            if closed:
                raise _GiveUp
            c = line[0]
            if c == "t":
                m = _RE_TASK.fullmatch(line)
                if m is None:
                    raise _GiveUp
                tid, rank, sm, body, ops, tile, cost = m.groups()
                opt = self.ops.get(ops)
                if opt is None:
                    opt = self.ops[ops] = tuple(o[1:] for o in ops.split(", ")) if ops else ()
                    if not all(graph.has_value(o) for o in opt):
                        raise _GiveUp
                instrs = []
                tasks.append(Task(int(tid), int(rank), int(sm), sys.intern(body), opt, self.box(tile), instrs, float(cost)))
                for raw in it:          # the task's body, up to its closing brace
                    ins = cache.get(raw)
                    if ins is None:
                        line = raw.strip(ws)
                        if line == "}":
                            break
                        if not line or line[0] == "#":
                            continue
                        ins = cache[raw] = self.instr(line)
                    instrs.append(ins)
                else:
                    raise _GiveUp
            elif c == "f":
                s.families.append(self.family(line, it))
            elif c == "q":
                m = _RE_QUEUE.fullmatch(line)
                if m is None:
                    raise _GiveUp
                key = (int(m[1]), int(m[2]))
                if key in s.queues:
                    raise _GiveUp
                s.queues[key] = list(map(int, m[3].split()))
            elif c == "e":
                m = _RE_EVENT.fullmatch(line)
                if m is None:
                    raise _GiveUp
                s.events.append(Event(int(m[1]), int(m[2]), json.loads(m[3]), int(m[4])))
            elif c == "b":
                m = _RE_BUFFER.fullmatch(line)
                if m is None:
                    raise _GiveUp
                var, kind, dtype, shape = m.groups()
                shape = tuple(map(int, shape.split(", "))) if shape else ()
                s.buffers[var[1:]] = self.buffers[var[1:]] = TensorType(shape, DType(dtype), Kind(kind))
            elif c == "m":
                m = _RE_META.fullmatch(line)
                if m is None:
                    raise _GiveUp
                s.meta[m[1]] = json.loads(m[2])
            elif line == "}":
                closed = True
            else:
                raise _GiveUp
        if not closed:
            raise _GiveUp
        for i, task in enumerate(tasks):
            if task.id != i:
                raise _GiveUp
        return s
