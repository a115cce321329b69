"""`.fir` parser: text -> Graph. Every error names file:line:col and what was expected."""
from __future__ import annotations

import functools
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


def parse_fir(text: str, filename: str = "<string>") -> Graph:
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
