"""Byte sets for the CuTe table verifier (table_verify.py): exact sets of arena bytes, kept
symbolic so that a box over many rows costs about what one range does.

An operand or a LOAD / STORE box is stated as *pieces*: plain ranges (start, end) and strided
runs (start, stride, count, width) = the ranges [start + i * stride, ... + width) for i < count
(the rows of a box whose inner dims are not whole). A conservative box, e.g. an embedding
table's every row at a narrow column slice, is one run of 163840 rows, never 163840 ranges.

A byte set is exact and canonical, and kept per *segment* of a `ByteSpace`: each region is one
segment, seen as rows of P bytes (P = the row size the space is given for it: for the arena,
the region's last dim), and the gaps between regions (and all below / above them) are segments
of P = 1. Within a segment a set is a sorted list of *bands* (row0, row1, cols): rows
row0..row1-1 hold exactly the byte columns `cols` (sorted, disjoint, non-adjacent [c0, c1)
pairs); touching bands with equal columns are one band. A run along a region's rows is then one
or two bands whatever its row count (a run of a few columns per row, e.g. a slice of every
head, one band of periodic columns), and union / difference / intersection sweep band lists
arithmetically. A set is a dict {segment: bands}, no key for an empty segment, so "no byte" is
an empty dict and the regions a set touches are its keys. A message can still name the first
byte range and the number of ranges of a set as one list of merged byte ranges would (`merged`,
`count_ranges`).

    space = ByteSpace(regions, row_bytes)      # regions: .offset, .nbytes, .name
    S = space.bytes_of(pieces)                 # or space.operand(pieces): cached, with names
    set_op(S, T, MINUS) / set_op(S, T, INTER) / union_all([S, T, ...]) / meets(S, T)
    left(S, covers, skip)                      # a byte of S outside every cover (and skip segments)?
    merged(space, S) / count_ranges(space, S) / lowest / highest
"""
from __future__ import annotations

import bisect
from collections import defaultdict


def _cols(pairs) -> tuple:
    """Sorted, disjoint, non-adjacent, non-empty column pairs covering the same columns."""
    out = []
    for a, b in sorted(pairs):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _cunion(a, b):
    if not b or a == b:
        return a
    if not a:
        return b
    return _cols(a + b)


def _cminus(a, b):
    if not b:
        return a
    if a == b:
        return ()
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return tuple(out)


def _cinter(a, b):
    if a == b:
        return a
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


UNION, MINUS, INTER = 0, 1, 2
_COLOP = {UNION: _cunion, MINUS: _cminus, INTER: _cinter}


def _end(band):
    return band[1]


def _start(band):
    return band[0]


def bands_op(A, B, op) -> list:
    """The band list of A op B (A, B: band lists of one segment)."""
    if op != UNION and A and B:            # only B's bands beside A's rows matter
        j0 = bisect.bisect_right(B, A[0][0], key=_end)
        j1 = bisect.bisect_left(B, A[-1][1], key=_start)
        if j0 or j1 < len(B):
            B = B[j0:j1]
    if not B:
        return [] if op == INTER else A
    if not A:
        return B if op == UNION else []
    if A is B or A == B:
        return [] if op == MINUS else A
    if len(A) == 1 and len(B) == 1 and op != UNION:     # the common case: one band each
        (a0, a1, ac), (b0, b1, bc) = A[0], B[0]        # (B's overlaps A's rows: cut above)
        if op == INTER:
            cols = _cinter(ac, bc)
            return [(max(a0, b0), min(a1, b1), cols)] if cols else []
        if b0 <= a0 and a1 <= b1:
            cols = _cminus(ac, bc)
            return [(a0, a1, cols)] if cols else []
    f = _COLOP[op]
    out: list = []
    i = j = 0
    nA, nB = len(A), len(B)
    x = min(A[0][0], B[0][0])
    while True:
        while i < nA and A[i][1] <= x:
            i += 1
        while j < nB and B[j][1] <= x:
            j += 1
        a = A[i] if i < nA else None
        b = B[j] if j < nB else None
        if a is None and (op != UNION or b is None) or (op == INTER and b is None):
            break
        a_on = a is not None and a[0] <= x
        b_on = b is not None and b[0] <= x
        if not a_on and (op != UNION or not b_on) or (op == INTER and not b_on):
            if op == MINUS:
                x = a[0]
            elif op == INTER:
                x = max(a[0], b[0])
            else:
                x = min(a[0] if a is not None else b[0], b[0] if b is not None else a[0])
            continue
        y = (a[1] if a_on else a[0]) if a is not None else None
        if b is not None:
            yb = b[1] if b_on else b[0]
            y = yb if y is None or yb < y else y
        cols = f(a[2] if a_on else (), b[2] if b_on else ())
        if cols:
            if out and out[-1][1] == x and out[-1][2] == cols:
                out[-1] = (out[-1][0], y, cols)
            else:
                out.append((x, y, cols))
        x = y
    return out


def _from_rects(rects) -> list:
    """The band list covering rectangles (row0, row1, col0, col1) (a sweep over their rows)."""
    if len(rects) == 1:
        r0, r1, c0, c1 = rects[0]
        return [(r0, r1, ((c0, c1),))]
    rects.sort()
    if all(rects[i][1] <= rects[i + 1][0] for i in range(len(rects) - 1)):    # rows apart: no sweep
        out = []
        for r0, r1, c0, c1 in rects:
            cols = ((c0, c1),)
            if out and out[-1][1] == r0 and out[-1][2] == cols:
                out[-1] = (out[-1][0], r1, cols)
            else:
                out.append((r0, r1, cols))
        return out
    pts = sorted({r[0] for r in rects} | {r[1] for r in rects})
    out: list = []
    active: list = []
    i = 0
    for x, y in zip(pts, pts[1:]):
        while i < len(rects) and rects[i][0] <= x:
            active.append(rects[i])
            i += 1
        active = [r for r in active if r[1] > x]
        if not active:
            continue
        cols = _cols([(r[2], r[3]) for r in active]) if len(active) > 1 else ((active[0][2], active[0][3]),)
        if out and out[-1][1] == x and out[-1][2] == cols:
            out[-1] = (out[-1][0], y, cols)
        else:
            out.append((x, y, cols))
    return out


def set_op(A: dict, B: dict, op) -> dict:
    """A op B for byte sets, op MINUS or INTER (unions: `_union_all`)."""
    out = {}
    for k, ba in A.items():
        bb = B.get(k)
        if bb is None:
            if op == MINUS:
                out[k] = ba
            continue
        r = bands_op(ba, bb, op)
        if r:
            out[k] = r
    return out


def meets(A: dict, B: dict) -> bool:
    """Whether byte sets A and B share a byte."""
    return any(k in B and bands_op(ba, B[k], INTER) for k, ba in A.items())


def union_all(sets) -> dict:
    """The union of byte sets."""
    per: dict = defaultdict(list)
    seen = set()
    for S in sets:
        if id(S) in seen:
            continue
        seen.add(id(S))
        for k, bands in S.items():
            per[k].append(bands)
    out = {}
    for k, lists in per.items():
        if len(lists) == 1:
            out[k] = lists[0]
        elif len(lists) == 2:
            out[k] = bands_op(lists[0], lists[1], UNION)
        else:
            out[k] = _from_rects([(r0, r1, c0, c1) for bands in lists for r0, r1, cols in bands for c0, c1 in cols])
    return out


class Operand:
    """One operand's bytes: the byte set, the names of the regions it touches (none when it
    starts below byte 0, as a shifted or unrelocated address can) and its lowest byte."""
    __slots__ = ("bytes", "names", "lo")

    def __init__(self, S: dict, names: frozenset, lo: int):
        self.bytes, self.names, self.lo = S, names, lo


class ByteSpace:
    """The segments byte sets are kept in: `regions` (objects with .offset, .nbytes, .name,
    non-overlapping), each seen as rows of `row_bytes(region)` bytes, and the gaps around them as
    segments of 1-byte rows. Converts pieces to byte sets (cached) and names a set's regions."""

    def __init__(self, regions, row_bytes):
        regions = sorted(regions, key=lambda r: r.offset)
        # segment 2i + 1 is region i, segment 2i the gap below it, segment 2N all above the last:
        # bisect_right(bounds, x) is the segment of byte x
        self.bounds = [x for r in regions for x in (r.offset, r.offset + r.nbytes)]
        self.origin, self.period, self.seg_region = [], [], []
        for r in regions:
            self.origin += [0, r.offset]
            row = row_bytes(r)
            self.period += [1, row if row > 0 and r.nbytes % row == 0 else r.nbytes]
            self.seg_region += [None, r]
        self.origin.append(0)
        self.period.append(1)
        self.seg_region.append(None)
        self._cache: dict = {}
        self._runs: dict = {}

    # -- pieces -> byte sets ---------------------------------------------------------------------
    def operand(self, pieces) -> Operand:
        """The byte set of `pieces` (ranges and runs), cached: tiles of one op read the same bytes."""
        key = tuple(pieces)
        got = self._cache.get(key)
        if got is None:
            S = self._one_range(key[0]) if len(key) == 1 and len(key[0]) == 2 else None
            if S is None:
                S = self.bytes_of(key)
            lo = lowest(self, S) if S else 0
            names = frozenset(self.seg_region[k].name for k in S if self.seg_region[k] is not None) \
                if lo >= 0 else frozenset()
            got = self._cache[key] = Operand(S, names, lo)
        return got

    def bytes_of(self, pieces) -> dict:
        rects: dict = defaultdict(list)
        runs = []
        for p in pieces:
            if len(p) == 2:
                self._range(p[0], p[1], rects)
            else:
                runs.append(self._run_set(p))
        S = {k: _from_rects(v) for k, v in rects.items()}
        if not runs:
            return S
        return runs[0] if len(runs) == 1 and not S else union_all([S] + runs)

    def _run_set(self, p) -> dict:
        """The byte set of run p, cached: a task's LOAD box and its row's operand are often one run."""
        got = self._runs.get(p)
        if got is None:
            got = self._runs[p] = self._run(*p)
        return got

    def _one_range(self, p):
        """The byte set of one range inside one segment (most operands: a batch row's columns),
        without the rectangle sweep; None for any other."""
        a, b = p
        k = bisect.bisect_right(self.bounds, a)
        if b <= a or k < len(self.bounds) and b > self.bounds[k]:
            return None
        o, P = self.origin[k], self.period[k]
        r0, c0 = divmod(a - o, P)
        r1, c1 = divmod(b - o, P)
        if r0 == r1:
            return {k: [(r0, r0 + 1, ((c0, c1),))]}
        if c0 == 0 and c1 == 0:
            return {k: [(r0, r1, ((0, P),))]}
        return None

    def _range(self, a, b, rects) -> None:
        k = bisect.bisect_right(self.bounds, a)
        while a < b:
            e = min(b, self.bounds[k]) if k < len(self.bounds) else b
            if e > a:
                o, P = self.origin[k], self.period[k]
                r0, c0 = divmod(a - o, P)
                r1, c1 = divmod(e - o, P)
                out = rects[k]
                if r0 == r1:
                    out.append((r0, r0 + 1, c0, c1))
                else:
                    if c0:
                        out.append((r0, r0 + 1, c0, P))
                        r0 += 1
                    if r1 > r0:
                        out.append((r0, r1, 0, P))
                    if c1:
                        out.append((r1, r1 + 1, 0, c1))
                a = e
            k += 1

    def _run(self, start, stride, count, width) -> dict:
        rects: dict = defaultdict(list)
        if count <= 0 or width <= 0:
            return {}
        if stride < 0:
            start, stride = start + (count - 1) * stride, -stride
        end = start + (count - 1) * stride + width
        if count == 1 or width >= stride:           # the rows touch or overlap: one range
            self._range(start, end, rects)
            return {k: _from_rects(v) for k, v in rects.items()}
        k = bisect.bisect_right(self.bounds, start)
        o, P = self.origin[k], self.period[k]
        one_segment = bisect.bisect_right(self.bounds, end - 1) == k
        if one_segment and stride < P and P % stride == 0 and (start - o) % stride + width <= stride:
            # several elements a row (a few columns of every head): the same columns in every
            # whole row, the first and last rows cut
            ph, q = (start - o) % stride, P // stride
            r0, j0 = divmod((start - o) // stride, q)
            rl, jl = divmod((start - o) // stride + count - 1, q)
            full = tuple((ph + j * stride, ph + j * stride + width) for j in range(q))
            if r0 == rl:
                return {k: [(r0, r0 + 1, full[j0:jl + 1])]}
            bands = [(r0, r0 + 1, full[j0:])] if j0 else []
            mid0, mid1 = r0 + (1 if j0 else 0), rl + (1 if jl == q - 1 else 0)
            if mid1 > mid0:
                bands.append((mid0, mid1, full))
            if jl < q - 1:
                bands.append((rl, rl + 1, full[:jl + 1]))
            return {k: bands}
        if one_segment and stride % P == 0:
            # along the segment's rows: every element is the first one shifted by m rows
            m = stride // P
            r0, c0 = divmod(start - o, P)
            er, ec = divmod(c0 + width, P)
            if m == 1:                              # one band (two where a row wraps past P)
                if c0 + width <= P:
                    return {k: [(r0, r0 + count, ((c0, c0 + width),))]}
                return {k: _from_rects([(r0, r0 + count, c0, P), (r0 + 1, r0 + count + 1, 0, ec)])}
            el, rr = [], 0                          # the first element: rows relative to it
            if er == 0:
                el.append((0, 1, ((c0, c0 + width),)))
            else:
                if c0:
                    el.append((0, 1, ((c0, P),)))
                    rr = 1
                if er > rr:
                    el.append((rr, er, ((0, P),)))
                if ec:
                    el.append((er, er + 1, ((0, ec),)))
            if el[-1][1] <= m:                      # elements on rows of their own: bands as they are
                bands: list = []
                for i in range(count):
                    x = r0 + i * m
                    for a, b, cols in el:
                        if bands and bands[-1][1] == x + a and bands[-1][2] == cols:
                            bands[-1] = (bands[-1][0], x + b, cols)
                        else:
                            bands.append((x + a, x + b, cols))
                return {k: bands}
        for i in range(count):                      # irregular: one element at a time
            s = start + i * stride
            self._range(s, s + width, rects)
        return {k: _from_rects(v) for k, v in rects.items()}


def lowest(space: ByteSpace, S: dict) -> int:
    k = min(S)
    r0, _, cols = S[k][0]
    return space.origin[k] + r0 * space.period[k] + cols[0][0]


def highest(space: ByteSpace, S: dict) -> int:
    k = max(S)
    _, r1, cols = S[k][-1]
    return space.origin[k] + (r1 - 1) * space.period[k] + cols[-1][1]


def _pieces(space: ByteSpace, S: dict, lo=None):
    """S's byte ranges in address order, adjacent ones not yet merged; with `lo`, a band wholly
    below `lo` gives only its last row (the only bytes of it a range reaching past it starts at:
    within a row that is not whole the column pairs do not touch)."""
    for k in sorted(S):
        o, P = space.origin[k], space.period[k]
        for r0, r1, cols in S[k]:
            if len(cols) == 1 and cols[0] == (0, P):
                yield o + r0 * P, o + r1 * P
                continue
            if lo is not None and o + r1 * P <= lo:
                r0 = r1 - 1
            for r in range(r0, r1):
                x = o + r * P
                for c0, c1 in cols:
                    yield x + c0, x + c1


def merged(space: ByteSpace, S: dict, lo=None):
    """S as merged byte ranges in address order (with `lo`: exact for every range ending past
    `lo`; ranges ending before it may be cut)."""
    cur = None
    for a, b in _pieces(space, S, lo):
        if cur is not None and a <= cur[1]:
            cur[1] = max(cur[1], b)
        else:
            if cur is not None:
                yield cur[0], cur[1]
            cur = [a, b]
    if cur is not None:
        yield cur[0], cur[1]


def count_ranges(space: ByteSpace, S: dict) -> int:
    """How many merged byte ranges S is (counted per band: no row is listed)."""
    n, prev = 0, None
    for k in sorted(S):
        o, P = space.origin[k], space.period[k]
        for r0, r1, cols in S[k]:
            rows = r1 - r0
            n += rows * len(cols)
            if cols[0][0] == 0 and cols[-1][1] == P:    # each row's end joins the next row's start
                n -= rows - 1
            if o + r0 * P + cols[0][0] == prev:
                n -= 1
            prev = o + (r1 - 1) * P + cols[-1][1]
    return n


def left(S: dict, covers, skip) -> bool:
    """Whether a byte of S lies in no set of `covers` and in no segment of `skip`."""
    for k, bands in S.items():
        if k in skip:
            continue
        for cov in covers:
            cb = cov.get(k)
            if cb is not None:
                bands = bands_op(bands, cb, MINUS)
                if not bands:
                    break
        if bands:
            return True
    return False
