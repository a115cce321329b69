"""`.fir` parser: text -> Graph. Every error names file:line:col and what was expected.

Two readers, one language (as for schedules, ir/schedule_text.py): the grammar `fir.lark` (lark,
LALR) defines it, and a line-oriented reader (`_fast_fir`) reads the printed layout of
`print_graph` (one statement a line, single spaces), about 10x faster (a full K3 lowered graph,
6,860 lines, is ~2.5 s in lark). It builds the graph with the same calls in the same order and
gives up on any line outside that layout or any error; then the lark reader reads the whole text,
so what is accepted, what it means and every error message are the lark reader's
(`parse_fir(..., fast=False)` forces it; tests/test_schedule_reader.py checks the two agree).
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .graph import Graph, GraphError
from .registry import OpError
from .types import DType, Kind, TensorType

GRAMMAR = Path(__file__).with_name("fir.lark")


class FirSyntaxError(ValueError):
    """A `.fir` file that does not parse or does not type-check; str() is one line with file:line:col."""


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


_TOKEN_NAMES = {"VAR": "a %value", "NAME": "a name", "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('",
                "RPAR": "')'", "COLON": "':'", "EQUAL": "'='", "COMMA": "','", "LSQB": "'['", "RSQB": "']'",
                "DTYPE": "a dtype", "KIND": "weight/state/io/comm", "NUMBER": "a number", "INT": "an int",
                "ESCAPED_STRING": "a string", "RETURN": "'return'", "UPDATE": "'update'", "GRAPH": "'graph'"}


def _expected(names) -> str:
    shown = sorted({_TOKEN_NAMES.get(n, n) for n in names})
    return " or ".join(shown[:6]) + (" ..." if len(shown) > 6 else "")


def parse_fir(text: str, filename: str = "<string>", fast: bool = True) -> Graph:
    if fast:
        g = _fast_fir(text)
        if g is not None:
            return g
    try:
        tree = _lark().parse(text)
    except UnexpectedToken as e:
        if e.token.type == "$END":
            raise FirSyntaxError(f"{filename}:{e.line}:{e.column}: unexpected end of file "
                                 f"(is a closing '}}' missing?)") from None
        got = repr(str(e.token))
        raise FirSyntaxError(f"{filename}:{e.line}:{e.column}: expected {_expected(e.expected)}, got {got}") from None
    except UnexpectedCharacters as e:
        raise FirSyntaxError(f"{filename}:{e.line}:{e.column}: unexpected character {text[e.pos_in_stream]!r}") from None
    except UnexpectedEOF as e:
        raise FirSyntaxError(f"{filename}: unexpected end of file, expected {_expected(e.expected)}") from None
    except UnexpectedInput as e:  # pragma: no cover - other lark errors
        raise FirSyntaxError(f"{filename}:{getattr(e, 'line', '?')}:{getattr(e, 'column', '?')}: {e}") from None
    return _Builder(filename).build(tree.children[0])


def parse_fir_file(path) -> Graph:
    path = Path(path)
    return parse_fir(path.read_text(), str(path))


class _Builder:
    def __init__(self, filename: str):
        self.filename = filename

    def err(self, node, msg: str) -> FirSyntaxError:
        line = getattr(node, "line", None) or getattr(getattr(node, "meta", None), "line", "?")
        col = getattr(node, "column", None) or getattr(getattr(node, "meta", None), "column", "?")
        return FirSyntaxError(f"{self.filename}:{line}:{col}: {msg}")

    def build(self, t: Tree) -> Graph:
        name = str(t.children[0])
        rest = t.children[1:]
        dims: tuple[str, ...] = ()
        if rest and isinstance(rest[0], Tree) and rest[0].data == "dimlist":
            dims = tuple(str(c) for c in rest[0].children)
            rest = rest[1:]
        g = Graph(name, dims)
        self.g = g
        returned = False
        for st in rest:
            try:
                getattr(self, st.data)(st)
            except (GraphError, OpError) as e:
                raise self.err(st.meta, str(e)) from None
            returned |= st.data == "ret"
        if not returned:
            raise FirSyntaxError(f"{self.filename}: graph {name} has no return statement")
        return g

    def var(self, tok: Token):
        name = str(tok)[1:]
        if not self.g.has_value(name):
            raise self.err(tok, f"use of undefined value %{name}")
        return self.g.value(name)

    def type(self, t: Tree, kind: Kind = Kind.act) -> TensorType:
        dtype = DType(str(t.children[0]))
        shape = []
        for d in t.children[1:]:
            tok = d.children[0]
            if d.data == "int_dim":
                shape.append(int(tok))
            else:
                if str(tok) not in self.g.dims:
                    raise self.err(tok, f"symbolic dim {tok} is not declared in the graph's dim list")
                shape.append(str(tok))
        return TensorType(tuple(shape), dtype, kind)

    def param(self, t: Tree):
        kind, var, ty, *ann = t.children
        name = str(var)[1:]
        self.g.param(name, self.type(ty, Kind(str(kind))))
        if ann:
            attrs = {}
            for a in ann[0].children:
                key = str(a.children[0])
                if key in attrs:
                    raise self.err(a.meta, f"attribute '{key}' given twice")
                attrs[key] = self.value(a.children[1])
            if attrs:
                self.g.param_attrs[name] = attrs

    def value(self, t):
        if isinstance(t, Token):
            return str(t)
        k = t.data
        if k == "number":
            s = str(t.children[0])
            return float(s) if any(c in s for c in ".eE") else int(s)
        if k == "string":
            import json
            return json.loads(str(t.children[0]))
        if k == "true":
            return True
        if k == "false":
            return False
        if k == "sym":
            return str(t.children[0])
        if k == "list":
            return tuple(self.value(c) for c in t.children)
        raise self.err(t.meta, f"bad attribute value {t}")  # pragma: no cover

    def opstmt(self, t: Tree):
        results = [c for c in t.children if isinstance(c, Tree) and c.data == "result"]
        rest = t.children[len(results):]
        opname = rest[0]
        args = [c for c in rest[1:] if isinstance(c, Token) and c.type == "VAR"]
        group = next((str(c)[1:] for c in rest[1:] if isinstance(c, Token) and c.type == "GROUP"), None)
        attrs_t = [c for c in rest[1:] if isinstance(c, Tree) and c.data == "attrs"]
        attrs = {}
        for a in (attrs_t[0].children if attrs_t else []):
            key = str(a.children[0])
            if key in attrs:
                raise self.err(a.meta, f"attribute '{key}' given twice")
            attrs[key] = self.value(a.children[1])
        from .registry import get_op
        try:
            opdef = get_op(str(opname))
        except OpError as e:
            raise self.err(opname, str(e)) from None
        opdef.check_arity(len(args))
        inputs = [self.var(a) for a in args]
        names = [str(r.children[0])[1:] for r in results]
        inferred = opdef.infer([v.type for v in inputs], opdef.normalize_attrs(dict(attrs)))
        types = [self.type(r.children[1], k.kind) for r, k in zip(results, inferred)]
        self.g.add_op(str(opname), inputs, attrs, names=names, types=types, group=group)

    def ret(self, t: Tree):
        self.g.set_outputs([self.var(v) for v in t.children])

    def upd(self, t: Tree):
        state, new = t.children
        self.g.update(self.var(state), self.var(new))


# -- fast line-oriented reader ---------------------------------------------------------------------
_NAME = r"[A-Za-z_][A-Za-z0-9_.]*"
_VAR = r"%[A-Za-z0-9_.]+"
_TYPE = rf"(bf16|f16|f32|fp8e4m3|mxfp4|i32|i64|u8)\[((?:(?:\d+|{_NAME})(?:, (?:\d+|{_NAME}))*)?)\]"
_RE_GRAPH = re.compile(rf"graph ({_NAME}) \(((?:{_NAME}(?:, {_NAME})*)?)\) \{{")
_RE_PARAM = re.compile(rf"(weight|state|io|comm) ({_VAR}) : ({_TYPE})(?: \{{(.*)\}})?")
_RE_OP = re.compile(rf"((?:{_VAR} : {_TYPE})(?:, {_VAR} : {_TYPE})*) = ({_NAME})\(((?:{_VAR}(?:, {_VAR})*)?)\)"
                    rf"(?: \{{(.*)\}})?(?: @([A-Za-z0-9_.]+))?")
_RE_RESULT = re.compile(rf"({_VAR}) : ({_TYPE})")
_RE_TYPE = re.compile(_TYPE)
_RE_UPDATE = re.compile(rf"update ({_VAR}) = ({_VAR})")
_RE_RETURN = re.compile(rf"return(?: ({_VAR}(?:, {_VAR})*))?")
_RE_INT = re.compile(r"\d+")
# attribute tokens, as fir.lark's terminals lex them (a NAME that spells true/false is the keyword)
_RE_TOK = re.compile(r'[ \t\f\r\n]*(?:(-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)|("(?:[^"\\\n]|\\.)*")'
                     rf'|({_NAME})|([\[\],=]))')


class _GiveUp(Exception):
    """The fast reader does not take this text: the lark reader decides."""


def _fast_fir(text: str) -> Graph | None:
    """The graph of printed `.fir` text, or None where the lark reader must decide."""
    try:
        return _FastFir().read(text)
    except Exception:           # _GiveUp, or any error: the lark reader gives the message
        return None


class _FastFir:
    def __init__(self):
        self.types: dict = {}            # (type text, kind) -> TensorType

    def read(self, text: str) -> Graph:
        lines = iter(text.split("\n"))
        g = None
        for raw in lines:
            line = raw.strip(" \t\f\r")
            if not line or line[0] == "#":
                continue
            m = _RE_GRAPH.fullmatch(line)
            if m is None:
                raise _GiveUp
            g = Graph(m[1], tuple(m[2].split(", ")) if m[2] else ())
            break
        if g is None:
            raise _GiveUp
        self.g = g
        returned = closed = False
        for raw in lines:
            line = raw.strip(" \t\f\r")
            if not line or line[0] == "#":
                continue
            if closed:
                raise _GiveUp
            c = line[0]
            if c == "%":
                self.opstmt(line)
            elif line == "}":
                closed = True
            elif line.startswith("return"):
                m = _RE_RETURN.fullmatch(line)
                if m is None:
                    raise _GiveUp
                g.set_outputs([self.var(v) for v in m[1].split(", ")] if m[1] else [])
                returned = True
            elif line.startswith("update "):
                m = _RE_UPDATE.fullmatch(line)
                if m is None:
                    raise _GiveUp
                g.update(self.var(m[1]), self.var(m[2]))
            else:
                self.param(line)
        if not closed or not returned:
            raise _GiveUp
        return g

    def var(self, text: str):
        name = text[1:]
        if not self.g.has_value(name):
            raise _GiveUp
        return self.g.value(name)

    def type(self, text: str, kind: Kind) -> TensorType:
        key = (text, kind)
        t = self.types.get(key)
        if t is None:
            m = _RE_TYPE.fullmatch(text)
            shape = []
            for d in (m[2].split(", ") if m[2] else ()):
                if _RE_INT.fullmatch(d):
                    shape.append(int(d))
                elif d in self.g.dims:
                    shape.append(d)
                else:
                    raise _GiveUp
            t = self.types[key] = TensorType(tuple(shape), DType(m[1]), kind)
        return t

    def param(self, line: str) -> None:
        m = _RE_PARAM.fullmatch(line)
        if m is None:
            raise _GiveUp
        name = m[2][1:]
        self.g.param(name, self.type(m[3], Kind(m[1])))
        if m[6] is not None:
            attrs = _attrs(m[6])
            if attrs:
                self.g.param_attrs[name] = attrs

    def opstmt(self, line: str) -> None:
        m = _RE_OP.fullmatch(line)
        if m is None:
            raise _GiveUp
        results, opname, args, attrs, group = m[1], m[6], m[7], m[8], m[9]
        from .registry import get_op
        opdef = get_op(opname)
        attrs = _attrs(attrs) if attrs is not None else {}
        opdef.check_arity(len(args.split(", ")) if args else 0)
        inputs = [self.var(a) for a in args.split(", ")] if args else []
        res = _RE_RESULT.findall(results)
        names = [r[0][1:] for r in res]
        inferred = opdef.infer([v.type for v in inputs], opdef.normalize_attrs(dict(attrs)))
        types = [self.type(r[1], k.kind) for r, k in zip(res, inferred)]
        self.g.add_op(opname, inputs, attrs, names=names, types=types, group=group)


def _attrs(text: str) -> dict:
    """`k = v, ...` (the inside of an attribute block) as the lark reader's _Builder reads it."""
    toks = []
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos] in " \t\f\r\n":
            pos += 1
        if pos == n:
            break
        m = _RE_TOK.match(text, pos)
        if m is None:
            raise _GiveUp
        toks.append(m.groups())
        pos = m.end()
    attrs: dict = {}
    i = 0
    if not toks:
        return attrs
    while True:
        if i + 2 >= len(toks) or toks[i][2] is None or toks[i + 1][3] != "=" or toks[i][2] in ("true", "false"):
            raise _GiveUp
        key = toks[i][2]
        if key in attrs:
            raise _GiveUp
        attrs[key], i = _value(toks, i + 2)
        if i == len(toks):
            return attrs
        if toks[i][3] != ",":
            raise _GiveUp
        i += 1


def _value(toks, i):
    num, string, name, punct = toks[i]
    if num is not None:
        return (float(num) if any(c in num for c in ".eE") else int(num)), i + 1
    if string is not None:
        return json.loads(string), i + 1
    if name is not None:
        return (True if name == "true" else False if name == "false" else name), i + 1
    if punct != "[":
        raise _GiveUp
    items = []
    i += 1
    if toks[i][3] == "]":
        return tuple(items), i + 1
    while True:
        v, i = _value(toks, i)
        items.append(v)
        if toks[i][3] == "]":
            return tuple(items), i + 1
        if toks[i][3] != ",":
            raise _GiveUp
        i += 1
