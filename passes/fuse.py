"""fuse: assign fusion groups (`Op.group`, printed `@name`): ops of one group run as one task body.

A group has one *anchor*, the op that decides the tiling (`group_anchor`): a GEMV (linear, the
MoE expert GEMVs, MLA's absorb/up-projection), an attention, the KDA recurrence, or an AttnRes
mix. Around it:
  prologue  ops computing the anchor's input, recomputed by every tile: an RMSNorm (x is small at
            decode, so recomputing the row norm per tile is cheaper than a wait on a separate
            task) and, for the LatentMoE tail, the expert combine before the latent RMSNorm when
            its inputs are small (batch 1: `cost.PROLOGUE_MAX_BYTES`; at larger batches every
            tile re-reading them costs more than a separate task and its wait).
            Legal only if every user of the op is in the group; a norm read by several GEMVs
            is cheap, so it is cloned, one copy per GEMV.
  epilogue  ops applied to the anchor's output tile: elementwise ops (activations situ_glu /
            silu_mul, gates sigmoid_mul, residual adds, casts, slices of a merged projection,
            the conv update, kda_gate), per-head row ops (l2_norm, gated_rms_norm: the tile must
            hold whole heads, recorded as `align`), and the router (a reduction over the whole
            logits row, recorded as `whole_row`). Every other operand of an epilogue must be
            ready before the anchor starts (a parameter, a group value, or a value produced
            earlier in program order); otherwise the epilogue is refused -- that is what keeps
            every group convex (no path leaves the group and comes back).
  AttnRes   an attn_res mix and its following RMSNorm form their own group (anchor: the mix). The
            mix reads up to 9 block sources, too much to recompute in every GEMV tile.
Refusals are logged on the `fusion` channel (FUSEC_LOG=fusion) with their reason. Finally ops are
re-ordered (stably, topologically) so that each group is contiguous.

`prog.notes["fusion_groups"]` maps each group to {anchor, prologue, epilogue, align, whole_row}
(value names) for the tile pass; the same facts can be re-derived from a parsed dump
(`group_anchor` + the op traits), so nothing depends on notes surviving a .fir round trip.

Requires: a verified graph without groups (run before shard; shard splits groups a collective
          cuts).
Ensures:  every group has exactly one anchor and is contiguous in program order; no op changes
          its semantics (only cloned norms are new ops); outputs are unchanged.
"""
from __future__ import annotations

import heapq

from .cost import PROLOGUE_MAX_BYTES
from .options import log
from fusec.ir.graph import Graph, Op, Value
from fusec.ir.registry import Trait
from fusec.passes.manager import Program, register_pass

_ANCHOR_ORDER = (Trait.gemv, Trait.attention)
# Ops that may join an anchor's output tile; the value says what the tile must satisfy.
_ELEMENTWISE = "elementwise"
_PER_HEAD = "per_head"
_WHOLE_ROW = "whole_row"


def group_anchor(ops: list[Op]) -> Op:
    """The op that decides a group's tiling: its first GEMV, else attention, else another op
    the tile pass tiles on its own (the KDA recurrence), else its first op (an AttnRes mix)."""
    for trait in _ANCHOR_ORDER:
        for op in ops:
            if trait in op.opdef.traits:
                return op
    for op in ops:
        if op.opdef.tiling is not None:
            return op
    return ops[0]


def _is_anchor(op: Op) -> bool:
    return op.opdef.tiling is not None or Trait.mix in op.opdef.traits


def _epilogue_kind(op: Op) -> str | None:
    t = op.opdef.traits
    if _is_anchor(op) or Trait.collective in t:
        return None
    if Trait.rowwise in t:      # a reduction along the row maps a column tile only within a head
        return _PER_HEAD if Trait.headwise in t else None
    if Trait.whole_row in t:
        return _WHOLE_ROW
    if Trait.elementwise in t:
        return _ELEMENTWISE
    return None


@register_pass("fuse")
def run(prog: Program) -> bool:
    g = prog.graph
    if any(op.group for op in g.ops):
        log(prog.opts, "fusion", "fuse: the graph already has groups; leaving them")
        return False
    f = _Fuser(prog)
    f.attn_res_groups()
    f.prologues()
    f.epilogues()
    _make_contiguous(g)
    g.rebuild_index()
    prog.notes["fusion_groups"] = f.info
    return bool(f.info)


class _Fuser:
    def __init__(self, prog: Program):
        self.prog, self.g = prog, prog.graph
        self.info: dict[str, dict] = {}
        self._users = None
        self.refused: dict[str, str] = {}     # op result -> why it was not fused (logged if it stays alone)

    def say(self, msg: str) -> None:
        log(self.prog.opts, "fusion", "fuse: " + msg)

    def users(self):
        """Users of every value; kept up to date by `_clone_norm_for` (the only op edit here)."""
        if self._users is None:
            self._users = self.g.users()
        return self._users

    def new_group(self, anchor: Op) -> str:
        name = anchor.outputs[0].name
        anchor.group = name
        self.info[name] = {"anchor": name, "prologue": [], "epilogue": [], "align": 1, "whole_row": []}
        return name

    # AttnRes mix + its RMSNorm ----------------------------------------------------------------
    def attn_res_groups(self) -> None:
        users = self.users()
        for op in self.g.ops:
            if Trait.mix not in op.opdef.traits:
                continue
            us = users[op.outputs[0].name]
            if len(us) == 1 and Trait.norm in us[0].opdef.traits and us[0].group is None:
                name = self.new_group(op)
                us[0].group = name
                self.info[name]["epilogue"].append(us[0].outputs[0].name)
            else:
                self.say(f"attn_res %{op.outputs[0].name} stays alone: its result is read by "
                         f"{', '.join(u.opname for u in us)}, not by one RMSNorm")

    # prologues --------------------------------------------------------------------------------
    def prologues(self) -> None:
        for anchor in list(self.g.ops):
            if Trait.gemv not in anchor.opdef.traits or anchor.group is not None:
                continue
            p = anchor.inputs[0].producer
            if p is None or p.group is not None or Trait.norm not in p.opdef.traits:
                continue
            name = self.new_group(anchor)
            self._fold_norm(anchor, p, name)

    def _fold_norm(self, anchor: Op, norm: Op, name: str) -> None:
        users = self.users()[norm.outputs[0].name]
        others = [u for u in users if u is not anchor]
        if any(Trait.gemv not in u.opdef.traits or u.inputs[0] is not norm.outputs[0] for u in others):
            bad = next(u for u in others if Trait.gemv not in u.opdef.traits or u.inputs[0] is not norm.outputs[0])
            self.say(f"RMSNorm %{norm.outputs[0].name} not folded into %{anchor.outputs[0].name}: "
                     f"it is also read by {bad.opname} %{bad.outputs[0].name}, which is not a GEMV input")
            return
        for u in others:      # cheap to recompute: one copy per GEMV
            self._clone_norm_for(norm, u)
        norm.group = name
        self.info[name]["prologue"].append(norm.outputs[0].name)
        # LatentMoE tail: the expert combine feeding the latent norm joins too, if only it reads it
        c = norm.inputs[0].producer
        if c is not None and Trait.slot_sum in c.opdef.traits and c.group is None:
            nbytes = sum(v.type.nbytes(self.prog.opts.dims) for v in c.inputs)
            if nbytes > PROLOGUE_MAX_BYTES:
                self.say(f"moe_combine %{c.outputs[0].name} not folded: every tile would re-read its "
                         f"{nbytes / 1024:.0f} KiB of inputs (> {PROLOGUE_MAX_BYTES // 1024} KiB, cost.PROLOGUE_MAX_BYTES)")
            elif len(self.users()[c.outputs[0].name]) == 1:
                c.group = name
                self.info[name]["prologue"].insert(0, c.outputs[0].name)
            else:
                self.say(f"moe_combine %{c.outputs[0].name} not folded: read outside the latent norm")

    def _clone_norm_for(self, norm: Op, user: Op) -> None:
        g = self.g
        base = f"{norm.outputs[0].name}.for_{user.outputs[0].name.rsplit('.', 1)[-1]}"
        vname = base
        i = 1
        while g.has_value(vname):
            vname, i = f"{base}.{i}", i + 1
        clone = Op(norm.opname, list(norm.inputs), [], dict(norm.attrs), None)
        v = Value(vname, norm.outputs[0].type, clone)
        clone.outputs.append(v)
        g._claim(vname, v)
        g.ops.insert(g.ops.index(user), clone)
        user.inputs[0] = v
        users = self.users()
        users[norm.outputs[0].name] = [u for u in users[norm.outputs[0].name] if u is not user]
        users[vname] = [user]
        for x in clone.inputs:
            users[x.name].append(clone)
        self.say(f"RMSNorm %{norm.outputs[0].name} is read by several GEMVs: cloned as %{vname} "
                 f"for %{user.outputs[0].name}")
        if user.group is None:
            self._fold_norm_clone(user, clone)

    def _fold_norm_clone(self, user: Op, clone: Op) -> None:
        name = self.new_group(user)
        clone.group = name
        self.info[name]["prologue"].append(clone.outputs[0].name)

    # epilogues --------------------------------------------------------------------------------
    def epilogues(self) -> None:
        order = {id(op): i for i, op in enumerate(self.g.ops)}
        self._users = None
        self.users()
        for anchor in list(self.g.ops):
            if not _is_anchor(anchor) or Trait.mix in anchor.opdef.traits:
                continue
            name = anchor.group or self.new_group(anchor)
            self._grow(anchor, name, order)
        for name in [n for n, i in self.info.items() if not i["prologue"] and not i["epilogue"]]:
            for op in self.g.ops:
                if op.group == name:
                    op.group = None          # a group of one op is no group
            del self.info[name]
        for op in self.g.ops:
            why = self.refused.get(op.outputs[0].name) if op.outputs else None
            if why and op.group is None:
                self.say(why)

    def _grow(self, anchor: Op, name: str, order: dict) -> None:
        a_idx = order[id(anchor)]
        info = self.info[name]
        # prologue values are read only inside the group (that is their legality rule), so the
        # anchor's results are where epilogues start
        produced = {v.name for v in anchor.outputs}
        # candidates are users of group values, visited in program order
        heap = [(order[id(u)], id(u), u) for v in produced for u in self._users.get(v, ())]
        heapq.heapify(heap)
        seen: set[int] = set()
        while heap:
            _, _, op = heapq.heappop(heap)
            if id(op) in seen or op.group is not None or order[id(op)] <= a_idx:
                continue
            seen.add(id(op))
            kind = _epilogue_kind(op)
            if kind is None:
                continue       # the next anchor or a non-fusable op: a task boundary, not a refusal
            out = op.outputs[0].name
            late = [v for v in op.inputs if v.name not in produced and v.producer is not None
                    and order[id(v.producer)] > a_idx]
            if late:
                self.refused[out] = (f"{op.opname} %{out} not fused into %{info['anchor']}: operand "
                                     f"%{late[0].name} is produced after the anchor starts")
                continue
            op.group = name
            info["epilogue"].append(out)
            for v in op.outputs:
                produced.add(v.name)
                for u in self._users.get(v.name, ()):
                    heapq.heappush(heap, (order[id(u)], id(u), u))
            if kind == _PER_HEAD:
                info["align"] = _lcm(info["align"], op.attrs["head_dim"])
            elif kind == _WHOLE_ROW:
                info["whole_row"].append(out)


def _lcm(a: int, b: int) -> int:
    import math
    return a * b // math.gcd(a, b)


def _make_contiguous(g: Graph) -> None:
    """Stable topological order in which each group's ops are adjacent (groups are convex)."""
    units: list[list[Op]] = []
    unit_of: dict[int, int] = {}
    by_group: dict[str, int] = {}
    for op in g.ops:
        if op.group and op.group in by_group:
            units[by_group[op.group]].append(op)
        else:
            if op.group:
                by_group[op.group] = len(units)
            units.append([op])
        unit_of[id(op)] = by_group.get(op.group, len(units) - 1) if op.group else len(units) - 1
    deps: list[set[int]] = [set() for _ in units]
    for i, ops in enumerate(units):
        for op in ops:
            for v in op.inputs:
                if v.producer is not None and unit_of[id(v.producer)] != i:
                    deps[i].add(unit_of[id(v.producer)])
    users: list[list[int]] = [[] for _ in units]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    missing = [len(d) for d in deps]
    ready = [i for i, n in enumerate(missing) if n == 0]
    heapq.heapify(ready)
    out: list[Op] = []
    while ready:
        i = heapq.heappop(ready)
        out += units[i]
        for j in users[i]:
            missing[j] -= 1
            if missing[j] == 0:
                heapq.heappush(ready, j)
    if len(out) != len(g.ops):
        raise ValueError("fuse: fusion groups form a cycle (a group is not convex)")
    g.ops = out
