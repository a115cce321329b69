"""shard: hybrid tensor parallel + expert parallel over R = prog.opts.ranks ranks (SPMD).

One graph that every rank runs, with per-rank weight and state shards. Degrees (`plan_degrees`):
  tp = the largest divisor of R that divides every head count and every column-parallel part of
       a merged projection (K3: R = 64 -> 32, R = 72 -> 24);
  ep = gcd(R, E) for the routed experts (E = 896 for K3: R = 64 -> 64, R = 72 -> 8).
A group of g ranks is the coset {r mod s + k s : k < g}, s = R / g, and rank r's index in it is
r // s (fusec/ir/ops/comm.py): every collective's peers are the same offsets on every rank, so
the schedule stays a pure rotation. The R ranks form R / tp *replica groups* that compute the
same values: at decode every rank holds every token, so a replica repeats the others' mixer
work and the mixer weights are read tp-way, not R-way (the layout of deployments without
data-parallel attention). With ep < R the experts are replicated R / ep times (even placement;
uneven placement of 896 experts over 72 ranks is not planned). A plain linear whose width tp
does not divide is split over the largest subgroup that divides it; lm_head over the largest
divisor of R that divides the vocab.

The pass walks the ops in order and tracks each value's *layout* on the ranks:
  FULL         every rank holds the whole value (replicated computation)
  SPLIT(d, g)  rank r holds the (r // s)-th of g equal chunks of dim d (s = R / g)
  PARTIAL(g)   the value is the sum over r's group of g ranks of what each member holds
  EP           expert-parallel rows: each [token, slot] row lives on the EP group member owning
               its expert, zeros on the others (so also a PARTIAL(ep))
  PARTS        a merged projection's output: each slice of it has its own layout
An op either runs on the layouts it gets (its sharding rule) or its inputs are converted first:
PARTIAL -> FULL `all_reduce`, PARTIAL -> SPLIT (same group) `reduce_scatter`, SPLIT -> FULL
`all_gather`, FULL -> SPLIT `rank_slice` (local, no traffic), with attrs `ranks` = g and
`stride` = s; between groups through FULL. Conversions are memoised, so a value is
all-gathered at most once. The plan per op is in docs/passes.md; in short: column-parallel
projections split their output (heads for KDA/MLA/GQA), row-parallel o_proj/down_proj give
PARTIAL sums, routed experts are split E/ep per rank (`ep_ranks`, `ep_stride`), the combined
latent is all-reduced (EP group) before the latent RMSNorm, the latent up-projection is
row-parallel and shares the shared expert's all-reduce when both sums live on one group,
lm_head is vocab-parallel and its logits are all-gathered before argmax.

Which linears are column/row parallel is their weight's param attr `tp` (col / row / vocab, as
the model file states it; a merged weight keeps its sources' roles as `source_tp`; unstated:
replicated); passes/_shard_plan.py reads it and picks tp and ep (`plan_degrees`). The sharded
graph drops `tp` / `source_tp`: its `split` annotations say what was done. Every other weight's slicing follows
from the op that reads it. Each sharded parameter is annotated `{split = [...], ranks = g}` plus
`stride = s` when s > 1 (and keeps canonicalize's `sources`) so a loader slices the full
checkpoint tensor (rank r takes slice r // s) and the printed .fir re-parses. Replicated
unmerged parameters carry no annotation.

Requires: a verified graph, not yet sharded (no collectives); canonicalize's merged projections
          only as `linear` -> `slice` of whole parts.
Ensures:  R == 1: no change. R > 1: per-rank shapes; every graph output FULL; fusion groups that a
          collective now cuts are split (the side without the anchor leaves the group, logged);
          `prog.notes["shard"]` = {"ranks", "tp", "ep"}. Smaller degrees than planned can be asked
          for with `prog.notes["shard_degrees"]` = {"tp": t, "ep": e} (divisors of the plan's).
"""
from __future__ import annotations

from .options import log
from fusec.ir.graph import Graph, Op, Value
from fusec.ir.registry import Trait
from fusec.ir.types import Kind
from fusec.passes.manager import Program, register_pass

from ._shard_plan import COL, REP, ROW, VOCAB, ShardError, divisors, plan_degrees, source_roles, source_rows, weight_role

FULL, EP = ("full",), ("ep",)


def SPLIT(d: int, parts: int):
    """dim d split over the group of `parts` ranks (groups are fixed by their size, see comm.py)."""
    return ("split", d, parts)


def PARTIAL(parts: int):
    """the sum over the group of `parts` ranks of what each member holds."""
    return ("partial", parts)


@register_pass("shard")
def run(prog: Program) -> bool:
    R = prog.opts.ranks
    if R == 1:
        return False
    if any(Trait.collective in op.opdef.traits for op in prog.graph.ops):
        raise ShardError("shard: the graph already has collectives (sharded twice?)")
    tp, ep = plan_degrees(prog.graph, R)
    # an explicit request (simulation sweeps): prog.notes["shard_degrees"] = {"tp": .., "ep": ..}
    req = prog.notes.get("shard_degrees", {})
    for name, want, best in (("tp", req.get("tp"), tp), ("ep", req.get("ep"), ep)):
        if want is not None and (R % want or best % want):
            raise ShardError(f"shard: {name} = {want} must divide R = {R} and the planned {name} = {best}")
    tp, ep = req.get("tp", tp), req.get("ep", ep)
    while True:
        try:
            graph = _Sharder(prog, R, tp, ep).run()
            break
        except ShardError as e:     # a split dim plan_degrees does not know about: a smaller tp
            if tp == 1:
                raise
            smaller = plan_degrees(prog.graph, R, below=tp)[0]
            log(prog.opts, "fusion", f"shard: tp = {tp} fails ({e}); trying tp = {smaller}")
            tp = smaller
    prog.graph = graph
    log(prog.opts, "fusion", f"shard: R = {R}: tp = {tp} ({R // tp} replica groups), ep = {ep}")
    _split_cut_groups(prog)
    prog.notes["ranks"] = R
    prog.notes["shard"] = {"ranks": R, "tp": tp, "ep": ep}
    return True


class _Sharder:
    def __init__(self, prog: Program, R: int, tp: int, ep: int):
        self.prog, self.R, self.src = prog, R, prog.graph
        self.T, self.ts = tp, R // tp          # TP group: size and stride
        self.E, self.es = ep, R // ep          # EP group: size and stride
        self.users = prog.graph.users()
        self.g = Graph(self.src.name, self.src.dims)
        self.m: dict[str, Value] = {}          # old value name -> new value
        self.lay: dict[str, tuple] = {}        # new value name -> layout
        self.conv: dict[tuple, Value] = {}     # (new value name, layout) -> converted value
        self.spec: dict[str, dict] = {}        # param name -> annotation
        self.group: str | None = None

    # -- driver -----------------------------------------------------------------------------------
    def run(self) -> Graph:
        src = self.src
        self.param_done: set[str] = set()
        for v in src.params:
            if v.kind is not Kind.weight and v.kind is not Kind.state:
                self._declare(v, v.type.shape, {})
        for op in src.ops:
            self.group = op.group
            rule = getattr(self, "_op_" + op.opname, None)
            (rule or self._op_default)(op)
        outs = [self.to(self.m[v.name], FULL) for v in src.outputs]
        self.g.set_outputs(outs)
        for name, v in src.updates.items():
            self.g.updates[name] = self.m[v.name]
        order = {v.name: i for i, v in enumerate(src.params)}
        self.g.params.sort(key=lambda p: order[p.name])
        return self.g

    # -- parameters -------------------------------------------------------------------------------
    def _declare(self, v: Value, shape, ann: dict, parts: int = 0) -> Value:
        nv = self.g.param(v.name, v.type.with_shape(shape))
        src_ann = dict(self.src.param_attrs.get(v.name, {}))
        for key in ("tp", "source_tp"):       # consumed here: the split says what was done
            src_ann.pop(key, None)
        if ann:
            size = parts or self.T
            stride = self.R // size
            src_ann.update(ann)
            src_ann["ranks"] = size
            if stride > 1:
                src_ann["stride"] = stride
        if src_ann:
            self.g.param_attrs[v.name] = src_ann
        self.m[v.name] = nv
        self.lay[nv.name] = FULL
        self.param_done.add(v.name)
        return nv

    def split(self, d: int, parts: int = 0) -> tuple:
        """Layout: dim d split over the group of `parts` ranks (default: the TP group)."""
        return SPLIT(d, parts or self.T)

    def param(self, v: Value, dim: int = -1, split_len: int = 0, parts: int = 0) -> Value:
        """The new param for old param v, split along `dim` (-1: whole) on first use over the
        group of `parts` ranks (default: the TP group)."""
        if v.name in self.param_done:
            nv = self.m[v.name]
            want = self._split_of(v.name)
            got = (dim, split_len, (parts or self.T) if dim >= 0 else 1)
            if want != got:
                raise ShardError(f"shard: %{v.name} is read with two different splits {want} and {got}")
            return nv
        if dim < 0:
            return self._declare(v, v.type.shape, {})
        shape = list(v.type.shape)
        n = split_len or shape[dim]
        parts = parts or self.T
        self._need(n, f"dim {dim} of %{v.name}", parts)
        shape[dim] = n // parts
        n_src = len(self.src.param_attrs.get(v.name, {}).get("sources", (v.name,)))
        if n_src > 1:
            raise ShardError(f"shard: merged %{v.name} must be split per source (a linear's weight)")
        ann = {"split": (dim,)}
        if split_len:
            ann["split_len"] = (split_len,)
        nv = self._declare(v, shape, ann, parts)
        self.lay[nv.name] = self.split(dim, parts)
        return nv

    def _split_of(self, name: str):
        a = self.g.param_attrs.get(name, {})
        d = a.get("split", (-1,))[0]
        return (d, a.get("split_len", (0,))[0], a.get("ranks", 1) if d >= 0 else 1)

    def _need(self, n, what: str, parts: int = 0) -> None:
        parts = parts or self.T
        if not isinstance(n, int) or n % parts:
            raise ShardError(f"shard: cannot split {what} ({n}) over {parts} ranks: {parts} must divide it")

    def _group(self, lay: tuple) -> dict:
        """Collective attrs of the group a layout lives on (groups are fixed by their size)."""
        size = self.E if lay == EP else lay[-1]
        return {"ranks": size, "stride": self.R // size}

    # -- emitting ---------------------------------------------------------------------------------
    def emit(self, opname: str, inputs: list[Value], attrs: dict, names: list[str] | None = None,
             group=None) -> list[Value]:
        if names is None:       # a conversion: named after what it converts, e.g. %l3.o_proj.all_reduce
            base = f"{inputs[0].name}.{opname}"
            names, i = [base], 1
            while self.g.has_value(names[0]) or self.src.has_value(names[0]):
                names, i = [f"{base}.{i}"], i + 1
        return self.g.add_op(opname, inputs, attrs, names=names, group=group)

    def copy_op(self, op: Op, inputs: list[Value], attrs: dict | None = None, layouts=None) -> list[Value]:
        outs = self.emit(op.opname, inputs, dict(op.attrs if attrs is None else attrs),
                         [v.name for v in op.outputs], self.group)
        for old, new, lay in zip(op.outputs, outs, layouts):
            self.m[old.name] = new
            self.lay[new.name] = lay
        return outs

    def to(self, v: Value, want: tuple) -> Value:
        have = self.lay[v.name]
        if have == want or (want == PARTIAL(self.E) and have == EP):
            return v
        key = (v.name, want)
        if key in self.conv:
            return self.conv[key]
        sums = have == EP or have[0] == "partial"
        if sums and want == FULL:
            out = self.emit("all_reduce", [v], self._group(have))[0]
        elif sums and want[0] == "split":
            if self._group(have) != self._group(want):     # a sum over another group: via FULL
                return self.to(self.to(v, FULL), want)
            self._need(v.type.shape[want[1]], f"dim {want[1]} of %{v.name}", want[-1])
            out = self.emit("reduce_scatter", [v], {**self._group(have), "dim": want[1]})[0]
        elif have[0] == "split" and want == FULL:
            out = self.emit("all_gather", [v], {**self._group(have), "dim": have[1]})[0]
        elif have == FULL and want[0] == "split":
            self._need(v.type.shape[want[1]], f"dim {want[1]} of %{v.name}", want[-1])
            out = self.emit("rank_slice", [v], {**self._group(want), "dim": want[1]}, group=self.group)[0]
        elif have[0] == "split" and want[0] == "split":
            return self.to(self.to(v, FULL), want)
        else:
            raise ShardError(f"shard: cannot convert %{v.name} from {have} to {want}")
        self.lay[out.name] = want
        self.conv[key] = out
        return out

    def act(self, v: Value) -> Value:
        """The new value for an old non-weight operand."""
        if v.producer is None and v.name not in self.param_done:
            return self.param(v)      # a param whose split no rule chose: replicated
        return self.m[v.name]

    def L(self, v: Value) -> tuple:
        return self.lay[self.act(v).name]

    # -- rules ------------------------------------------------------------------------------------
    def _op_default(self, op: Op) -> None:
        """Unknown or replicated op: every operand FULL, weights whole, results FULL."""
        conv = [v for v in op.inputs if v.kind is not Kind.weight and self.L(v) != FULL]
        if conv and op.outputs:
            log(self.prog.opts, "fusion", f"shard: {op.opname} %{op.outputs[0].name} runs replicated; "
                f"{', '.join(f'%{v.name} ({self.L(v)[0]})' for v in conv)} made full first")
        ins = [self.param(v) if v.kind is Kind.weight else self.to(self.act(v), FULL) for v in op.inputs]
        self.copy_op(op, ins, layouts=[FULL] * len(op.outputs))

    def _elementwise(self, op: Op, allow_partial: bool) -> None:
        lays = {self.L(v) for v in op.inputs}
        if len(lays) == 1:
            (lay,) = lays
            if lay[0] == "split" or lay == FULL or (allow_partial and (lay == EP or lay[0] == "partial")):
                lay = PARTIAL(self.E) if lay == EP else lay
                self.copy_op(op, [self.act(v) for v in op.inputs], layouts=[lay] * len(op.outputs))
                return
        self._op_default(op)

    def _op_add(self, op):
        self._elementwise(op, allow_partial=True)

    _op_cast = _op_mul = _op_sigmoid = _op_sigmoid_mul = _op_situ_glu = _op_silu_mul = \
        lambda self, op: self._elementwise(op, allow_partial=False)

    def _op_linear(self, op: Op) -> None:
        x, w = op.inputs
        sources = self.src.param_attrs.get(w.name, {}).get("sources")
        if sources:
            return self._merged_linear(op, list(sources))
        plan = weight_role(self.src, w.name)
        n = w.type.shape[1 if plan == ROW else 0]
        # the TP group, or its largest subgroup that divides the width (the vocab: any divisor of R)
        t = max(d for d in divisors(self.R if plan == VOCAB else self.T) if n % d == 0)
        if t < self.T and plan in (COL, ROW):
            log(self.prog.opts, "fusion", f"shard: %{w.name} ({n}) split {t}-way, not tp = {self.T}")
        if t == 1:
            plan = REP
        if plan in (COL, VOCAB):
            self.copy_op(op, [self.to(self.act(x), FULL), self.param(w, 0, parts=t)],
                         layouts=[self.split(x.type.rank - 1, t)])
        elif plan == ROW:
            xs = self.to(self.act(x), self.split(x.type.rank - 1, t))
            self.copy_op(op, [xs, self.param(w, 1, parts=t)], layouts=[PARTIAL(t)])
        else:
            self.copy_op(op, [self.to(self.act(x), FULL), self.param(w)], layouts=[FULL])

    def _merged_linear(self, op: Op, sources: list[str]) -> None:
        x, w = op.inputs
        plans, parts, start, lstart = [], [], 0, 0
        rows = source_rows(self.users, op)
        for s, role, n in zip(sources, source_roles(self.src, w.name), rows):
            p = role if self.T > 1 else REP
            if p == ROW:
                log(self.prog.opts, "fusion", f"shard: row-parallel %{s} inside merged %{w.name}: kept whole")
                p = REP
            if p == COL:
                self._need(n, f"output dim of %{s} in merged %{w.name}")
            ln = n // self.T if p == COL else n
            parts.append((start, start + n, self.split(x.type.rank - 1) if p == COL else FULL, lstart, lstart + ln))
            plans.append(0 if p == COL else -1)
            start, lstart = start + n, lstart + ln
        nw = self._declare(w, (lstart, w.type.shape[1]), {"split": tuple(plans)})   # keeps `sources`
        self.copy_op(op, [self.to(self.act(x), FULL), nw], layouts=[("parts", tuple(parts))])

    def _op_slice(self, op: Op) -> None:
        (x,) = op.inputs
        nx = self.act(x)
        lay = self.lay[nx.name]
        d = op.attrs["dim"] % x.type.rank
        if lay[0] == "parts":
            for s, e, play, ls, le in lay[1]:
                if (s, e) == (op.attrs["start"], op.attrs["end"]):
                    self.copy_op(op, [nx], {**op.attrs, "start": ls, "end": le}, layouts=[play])
                    return
            raise ShardError(f"shard: slice %{op.outputs[0].name} is not one part of merged %{x.name}")
        if lay[0] == "split" and lay[1] != d:
            self.copy_op(op, [nx], layouts=[lay])
            return
        self._op_default(op)

    def _op_reshape(self, op: Op) -> None:
        (x,) = op.inputs
        shape = list(op.attrs["shape"])
        if self.L(x) == self.split(1) and x.type.rank == 2 and len(shape) == 3 and isinstance(shape[1], int):
            self._need(shape[1], f"heads of reshape %{op.outputs[0].name}")
            shape[1] //= self.T
            self.copy_op(op, [self.act(x)], {"shape": tuple(shape)}, layouts=[self.split(1)])
            return
        self._op_default(op)

    def _heads_split(self, op: Op, acts: list[Value], heads_attr: str = "heads") -> bool:
        if all(self.L(v) == self.split(1) for v in acts):
            self._need(op.attrs[heads_attr], f"{heads_attr} of {op.opname} %{op.outputs[0].name}")
            return True
        return False

    def _op_conv_update(self, op: Op) -> None:
        x, st, w = op.inputs
        if self.L(x) == self.split(1):
            self.copy_op(op, [self.act(x), self.param(st, 1), self.param(w, 0)], layouts=[self.split(1), self.split(1)])
        else:
            self._op_default(op)

    def _op_l2_norm(self, op: Op) -> None:
        (x,) = op.inputs
        if self.L(x) == self.split(1) and (x.type.shape[1] // self.T) % op.attrs["head_dim"] == 0:
            self.copy_op(op, [self.act(x)], layouts=[self.split(1)])
        else:
            self._op_default(op)

    def _op_kda_gate(self, op: Op) -> None:
        f, a_log, dt = op.inputs
        if not self._heads_split(op, [f]):
            return self._op_default(op)
        h, d = op.attrs["heads"], op.attrs["head_dim"]
        n = h if op.attrs["a_log_broadcast"] == "head" else h * d
        na = self.param(a_log, 0, n if n != a_log.type.shape[0] else 0)
        self.copy_op(op, [self.act(f), na, self.param(dt, 0)], {**op.attrs, "heads": h // self.T},
                     layouts=[self.split(1)])

    def _op_kda_recurrent(self, op: Op) -> None:
        *acts, st = op.inputs
        if not self._heads_split(op, acts):
            return self._op_default(op)
        self.copy_op(op, [*map(self.act, acts), self.param(st, 1)],
                     {**op.attrs, "heads": op.attrs["heads"] // self.T}, layouts=[self.split(1), self.split(1)])

    def _op_gated_rms_norm(self, op: Op) -> None:
        x, gate, w = op.inputs
        if self.L(x) == self.split(1) and self.L(gate) == self.split(1):
            self.copy_op(op, [self.act(x), self.act(gate), self.param(w)], layouts=[self.split(1)])
        else:
            self._op_default(op)

    def _mla(self, op: Op, acts: list[Value], kv_b: Value | None) -> None:
        if not self._heads_split(op, acts):
            return self._op_default(op)
        new_in = []
        for v in op.inputs:
            if v is kv_b:
                new_in.append(self.param(v, 0))      # kv_b rows are head blocks [nope + v] per head
            elif v in acts:
                new_in.append(self.act(v))
            else:
                new_in.append(self.to(self.act(v), FULL))   # the latent cache and pos: replicated
        self.copy_op(op, new_in, {**op.attrs, "heads": op.attrs["heads"] // self.T}, layouts=[self.split(1)])

    def _op_mla_attention_naive(self, op):
        self._mla(op, op.inputs[:2], op.inputs[3])

    def _op_mla_q_absorb(self, op):
        self._mla(op, op.inputs[:1], op.inputs[1])

    def _op_mla_attention(self, op):
        self._mla(op, op.inputs[:2], None)

    def _op_mla_v_up(self, op):
        self._mla(op, op.inputs[:1], op.inputs[1])

    def _op_rope(self, op: Op) -> None:
        x, pos = op.inputs
        if self.L(x) == self.split(1) and (x.type.shape[1] // self.T) % op.attrs["head_dim"] == 0:
            self.copy_op(op, [self.act(x), self.to(self.act(pos), FULL)], layouts=[self.split(1)])
        else:
            self._op_default(op)

    def _op_cache_append(self, op: Op) -> None:
        cache, row, pos = op.inputs
        if self.L(row) == self.split(1):      # GQA caches: heads split like the k/v projections
            self.copy_op(op, [self.param(cache, 2), self.act(row), self.to(self.act(pos), FULL)],
                         layouts=[self.split(2)])
        else:
            self._op_default(op)

    def _op_attention(self, op: Op) -> None:
        q, kc, vc, pos = op.inputs
        if self.L(q) == self.split(1) and self.L(kc) == self.split(2) and self.L(vc) == self.split(2):
            self._need(op.attrs["heads"], f"heads of attention %{op.outputs[0].name}")
            self._need(op.attrs["kv_heads"], f"kv_heads of attention %{op.outputs[0].name}")
            at = {**op.attrs, "heads": op.attrs["heads"] // self.T, "kv_heads": op.attrs["kv_heads"] // self.T}
            self.copy_op(op, [self.act(q), self.act(kc), self.act(vc), self.to(self.act(pos), FULL)], at,
                         layouts=[self.split(1)])
        else:
            self._op_default(op)

    # MoE: tokens and the router are replicated; each rank runs the E/ep experts of its EP group
    # index on every token (rows of other ranks' experts stay zero), so the combined latent is a
    # sum over the EP group. ep == 1: the experts run replicated.
    def _ep_attrs(self, op: Op) -> dict:
        return {**op.attrs, "ep_ranks": self.E, "ep_stride": self.es}

    def _op_moe_gate_up(self, op: Op) -> None:
        x, ids, w1, w3 = op.inputs
        if self.E == 1:
            return self._op_default(op)
        self._need(w1.type.shape[0], f"experts of %{op.outputs[0].name}", self.E)
        self.copy_op(op, [self.to(self.act(x), FULL), self.to(self.act(ids), FULL), self.param(w1, 0, parts=self.E),
                          self.param(w3, 0, parts=self.E)], self._ep_attrs(op), layouts=[EP])

    def _op_moe_down(self, op: Op) -> None:
        h, ids, w2 = op.inputs
        if self.E == 1:
            return self._op_default(op)
        self._need(w2.type.shape[0], f"experts of %{op.outputs[0].name}", self.E)
        if self.L(h) != EP:
            raise ShardError(f"shard: moe_down %{op.outputs[0].name} needs its input from an expert-parallel moe_gate_up")
        self.copy_op(op, [self.act(h), self.to(self.act(ids), FULL), self.param(w2, 0, parts=self.E)],
                     self._ep_attrs(op), layouts=[EP])

    def _op_moe_combine(self, op: Op) -> None:
        y, w = op.inputs
        if self.L(y) == EP:      # linear in y: a weighted sum of EP rows is a sum over the EP group
            self.copy_op(op, [self.act(y), self.to(self.act(w), FULL)], layouts=[PARTIAL(self.E)])
        else:
            self._op_default(op)


# -- fusion groups cut by a collective --------------------------------------------------------------
def _split_cut_groups(prog: Program) -> None:
    from fusec.passes.fuse import group_anchor
    g = prog.graph
    index = {id(op): i for i, op in enumerate(g.ops)}
    users = g.users()
    groups: dict[str, list[Op]] = {}
    for op in g.ops:
        if op.group:
            groups.setdefault(op.group, []).append(op)
    for op in g.ops:
        if Trait.collective not in op.opdef.traits:
            continue
        src = op.inputs[0].producer
        name = src.group if src is not None else None
        if not name or name not in groups:
            continue
        ops = [o for o in groups[name] if o.group == name]
        last = max(index[id(o)] for o in ops)
        # group members downstream of the collective (a walk bounded by the group's last op)
        after: set[int] = set()
        todo = [u for v in op.outputs for u in users[v.name]]
        seen: set[int] = set()
        while todo:
            u = todo.pop()
            if id(u) in seen or index[id(u)] > last:
                continue
            seen.add(id(u))
            if u.group == name:
                after.add(id(u))
            todo += [w for v in u.outputs for w in users[v.name]]
        if not after:
            continue
        anchor = group_anchor(ops)
        leave = [o for o in ops if (id(o) in after) != (id(anchor) in after)]
        for o in leave:
            o.group = None
        log(prog.opts, "fusion", f"shard: group {name} is cut by {op.opname} %{op.outputs[0].name}; "
            f"{', '.join('%' + o.outputs[0].name for o in leave)} leave it")
        info = prog.notes.get("fusion_groups", {}).get(name)
        gone = {o.outputs[0].name for o in leave}
        if info is not None:
            for key in ("prologue", "epilogue", "whole_row"):
                info[key] = [n for n in info[key] if n not in gone]
        rest = [o for o in ops if o.group == name]
        if len(rest) == 1:              # a group of one op is no group
            rest[0].group = None
            prog.notes.get("fusion_groups", {}).pop(name, None)
