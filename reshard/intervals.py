"""Half-open index intervals, per-dimension index lists and boxes (pure, no torch).

A rank's local tensor is, along each tensor dim, an ascending list of disjoint
global intervals concatenated (an *index list*); its local block is the
Cartesian product of those lists. Everything here works on plain tuples.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Interval",
    "IndexList",
    "Block",
    "Box",
    "Segment",
    "intersect",
    "index_list_size",
    "select",
    "normalize",
    "overlap_segments",
    "block_shape",
    "block_volume",
    "full_block",
    "contiguous_runs",
    "row_major_strides",
    "clip_box",
    "box_span",
    "slabs",
    "global_index",
    "coverage_holes",
    "overlapping_pairs",
    "format_box",
]


@dataclass(frozen=True, slots=True, order=True)
class Interval:
    """Half-open range ``[start, stop)`` of global indices along one dim.

    >>> Interval(4, 8).size
    4
    >>> Interval(5, 5).size
    0
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.stop):
            raise ValueError(f"invalid interval [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"[{self.start}:{self.stop})"


IndexList = tuple[Interval, ...]
"""Ascending, disjoint, non-empty intervals (an empty list means no indices)."""

Block = tuple[IndexList, ...]
"""One index list per tensor dim: the Cartesian product is a rank's local tensor."""

Box = tuple[Interval, ...]
"""One interval per tensor dim: a hyper-rectangle."""

Segment = tuple[int, int, int]
"""``(src_local_start, dst_local_start, size)`` along one dim."""


def intersect(a: Interval, b: Interval) -> Interval:
    """Intersection of two intervals; an empty result is ``Interval(s, s)``.

    Commutative and idempotent; an empty interval absorbs.

    >>> intersect(Interval(0, 6), Interval(4, 9))
    Interval(start=4, stop=6)
    >>> intersect(Interval(0, 2), Interval(4, 9)).size
    0
    """
    lo = max(a.start, b.start)
    hi = min(a.stop, b.stop)
    if a.size == 0 or b.size == 0 or hi <= lo:
        return Interval(lo, lo)
    return Interval(lo, hi)


def index_list_size(ilist: IndexList) -> int:
    """Number of indices in an index list."""
    return sum(iv.size for iv in ilist)


def normalize(intervals: Sequence[Interval]) -> IndexList:
    """Drop empty intervals and merge adjacent ones (input must be ascending)."""
    out: list[Interval] = []
    for iv in intervals:
        if iv.size == 0:
            continue
        if out and out[-1].stop == iv.start:
            out[-1] = Interval(out[-1].start, iv.stop)
        else:
            out.append(iv)
    return tuple(out)


def select(ilist: IndexList, start: int, stop: int) -> IndexList:
    """Global intervals of local positions ``[start, stop)`` of an index list.

    >>> select((Interval(0, 4), Interval(8, 12)), 2, 6)
    (Interval(start=2, stop=4), Interval(start=8, stop=10))
    """
    out: list[Interval] = []
    pos = 0
    for iv in ilist:
        lo = max(start, pos)
        hi = min(stop, pos + iv.size)
        if lo < hi:
            out.append(Interval(iv.start + lo - pos, iv.start + hi - pos))
        pos += iv.size
        if pos >= stop:
            break
    return normalize(out)


def _local_starts(ilist: IndexList) -> list[int]:
    starts = []
    pos = 0
    for iv in ilist:
        starts.append(pos)
        pos += iv.size
    return starts


def overlap_segments(src: IndexList, dst: IndexList) -> tuple[Segment, ...]:
    """Where two index lists share global indices, in local positions of both.

    Returns ``(src_local_start, dst_local_start, size)`` segments in ascending
    global order, merged where they are contiguous on both sides.

    >>> overlap_segments((Interval(0, 8),), (Interval(4, 6), Interval(10, 12)))
    ((4, 0, 2),)
    """
    if not src or not dst:
        return ()
    src_pos = _local_starts(src)
    dst_pos = _local_starts(dst)
    src_starts = [iv.start for iv in src]
    out: list[Segment] = []
    for j, d in enumerate(dst):
        # first src interval that could overlap d
        i = max(bisect_right(src_starts, d.start) - 1, 0)
        while i < len(src) and src[i].start < d.stop:
            s = src[i]
            lo = max(s.start, d.start)
            hi = min(s.stop, d.stop)
            if lo < hi:
                seg = (src_pos[i] + lo - s.start, dst_pos[j] + lo - d.start, hi - lo)
                if out and out[-1][0] + out[-1][2] == seg[0] and out[-1][1] + out[-1][2] == seg[1]:
                    prev = out[-1]
                    out[-1] = (prev[0], prev[1], prev[2] + seg[2])
                else:
                    out.append(seg)
            i += 1
    out.sort(key=lambda s: s[1])
    return tuple(out)


def block_shape(block: Block) -> tuple[int, ...]:
    """Local tensor shape of a block."""
    return tuple(index_list_size(il) for il in block)


def block_volume(block: Block) -> int:
    """Number of elements in a block."""
    n = 1
    for s in block_shape(block):
        n *= s
    return n


def full_block(shape: Sequence[int]) -> Block:
    """The block holding a whole tensor of ``shape``."""
    return tuple(normalize([Interval(0, n)]) for n in shape)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array."""
    strides = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)


def contiguous_runs(shape: Sequence[int], box: Box) -> Iterator[tuple[int, int]]:
    """The Box's elements in a row-major array of ``shape`` as ``(offset, size)`` runs.

    Runs are in increasing offset order, maximal, and cover exactly the Box.

    >>> list(contiguous_runs((4, 6), (Interval(1, 3), Interval(2, 4))))
    [(8, 2), (14, 2)]
    >>> list(contiguous_runs((4, 6), (Interval(1, 3), Interval(0, 6))))
    [(6, 12)]
    """
    ndim = len(shape)
    if any(iv.size == 0 for iv in box):
        return
    if ndim == 0:
        yield (0, 1)
        return
    strides = row_major_strides(shape)
    # innermost dim k such that every dim after it is covered fully
    k = ndim - 1
    while k > 0 and box[k].start == 0 and box[k].stop == shape[k]:
        k -= 1
    # dims after k are full; if box[k] is also full then k and the full dims merge
    run = box[k].size * strides[k]
    outer = box[:k]

    def rec(d: int, base: int) -> Iterator[tuple[int, int]]:
        if d == k:
            yield (base + box[k].start * strides[k], run)
            return
        for i in range(box[d].start, box[d].stop):
            yield from rec(d + 1, base + i * strides[d])

    prev: tuple[int, int] | None = None
    for off, size in rec(0, 0) if outer else iter([(box[k].start * strides[k], run)]):
        if prev is not None and prev[0] + prev[1] == off:
            prev = (prev[0], prev[1] + size)
            continue
        if prev is not None:
            yield prev
        prev = (off, size)
    if prev is not None:
        yield prev


def clip_box(
    window: Sequence[tuple[int, int]],
    src_starts: Sequence[int],
    dst_starts: Sequence[int],
    sizes: Sequence[int],
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """The part of a copy box inside a destination window, as (src, window-relative dst) slices.

    The box maps ``src_starts + i`` to ``dst_starts + i`` for ``0 <= i < sizes``;
    ``window`` is a ``(start, stop)`` range per dim in destination coordinates.
    Returns None when they do not meet.

    >>> clip_box([(0, 4), (2, 6)], (10, 0), (1, 0), (5, 3))
    ((slice(10, 13, None), slice(2, 3, None)), (slice(1, 4, None), slice(0, 1, None)))
    """
    src: list[slice] = []
    dst: list[slice] = []
    for (a, b), ss, ds, z in zip(window, src_starts, dst_starts, sizes):
        lo = max(a, ds)
        hi = min(b, ds + z)
        if hi <= lo:
            return None
        dst.append(slice(lo - a, hi - a))
        src.append(slice(ss + lo - ds, ss + hi - ds))
    return tuple(src), tuple(dst)


def box_span(strides: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> tuple[int, int]:
    """Element offsets ``[first, stop)`` from a non-empty box's first element to past its last.

    >>> box_span((6, 1), (1, 2), (2, 2))
    (8, 16)
    """
    first = sum(a * st for a, st in zip(starts, strides))
    last = sum((a + z - 1) * st for a, z, st in zip(starts, sizes, strides))
    return first, last + 1


def slabs(shape: Sequence[int], itemsize: int, budget: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Contiguous pieces of a row-major array, each at most ``budget`` bytes (at least one row)."""
    nd = len(shape)
    if nd == 0:
        yield ()
        return
    if any(s == 0 for s in shape):
        return
    inner = itemsize
    j = nd - 1
    while j > 0 and inner * shape[j] <= budget:
        inner *= shape[j]
        j -= 1
    # dims > j are whole; take `rows` indices of dim j per slab
    if inner * shape[j] <= budget:
        rows = shape[j]
    else:
        rows = max(1, budget // inner)

    def rec(d: int, prefix: tuple[tuple[int, int], ...]) -> Iterator[tuple[tuple[int, int], ...]]:
        if d == j:
            tail = tuple((0, shape[k]) for k in range(j + 1, nd))
            for a in range(0, shape[j], rows):
                yield prefix + ((a, min(a + rows, shape[j])),) + tail
            return
        for i in range(shape[d]):
            yield from rec(d + 1, prefix + ((i, i + 1),))

    yield from rec(0, ())


def global_index(block: Block, local: Sequence[int]) -> list[int]:
    """Global index of the element at local position ``local`` of a block.

    >>> from reshard.intervals import Interval
    >>> global_index(((Interval(0, 2), Interval(6, 8)), (Interval(0, 3),)), (3, 1))
    [7, 1]
    """
    out = []
    for ilist, p in zip(block, local, strict=True):
        for iv in ilist:
            if p < iv.size:
                out.append(iv.start + p)
                break
            p -= iv.size
        else:
            raise AssertionError(f"local index {list(local)} outside block {block}")
    return out


def coverage_holes(shape: Sequence[int], blocks: Sequence[Block]) -> list[Box]:
    """Disjoint boxes of a tensor of ``shape`` that none of ``blocks`` covers.

    A sweep along each dim in turn: the elementary intervals between the
    blocks' boundaries, merged where the same blocks cover them, recursing into
    the blocks covering each; the recursion is memoized on the set of remaining
    per-dim index lists, so regular layouts cost about one pass over their blocks.

    >>> I = Interval
    >>> coverage_holes((6, 4), [((I(0, 2),), (I(0, 4),)), ((I(4, 6),), (I(0, 4),))])
    [(Interval(start=2, stop=4), Interval(start=0, stop=4))]
    >>> coverage_holes((6, 4), [((I(0, 6),), (I(0, 4),))])
    []
    """
    ndim = len(shape)
    if any(n == 0 for n in shape):
        return []
    memo: dict[tuple[int, frozenset[Block]], list[Box]] = {}

    def rec(d: int, tails: frozenset[Block]) -> list[Box]:
        if d == ndim:
            return [] if tails else [()]
        key = (d, tails)
        hit = memo.get(key)
        if hit is not None:
            return hit
        n = shape[d]
        events: dict[int, list[tuple[Block, int]]] = {0: [], n: []}
        for t in tails:
            for iv in t[0]:
                lo, hi = min(iv.start, n), min(iv.stop, n)
                if lo < hi:
                    events.setdefault(lo, []).append((t[1:], 1))
                    events.setdefault(hi, []).append((t[1:], -1))
        active: dict[Block, int] = {}
        runs: list[tuple[int, int, frozenset[Block]]] = []
        cuts = sorted(events)
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            for tail, step in events[lo]:
                c = active.get(tail, 0) + step
                if c:
                    active[tail] = c
                else:
                    del active[tail]
            cover = frozenset(active)
            if runs and runs[-1][2] == cover:
                runs[-1] = (runs[-1][0], hi, cover)
            else:
                runs.append((lo, hi, cover))
        out: list[Box] = []
        for lo, hi, cover in runs:
            for h in rec(d + 1, cover):
                out.append((Interval(lo, hi),) + h)
        memo[key] = out
        return out

    return rec(0, frozenset(blocks))


def overlapping_pairs(blocks: Sequence[Block]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of blocks that share an element without being equal.

    Equal blocks are replicas and empty blocks hold nothing: neither is reported.
    A sweep along the dim whose block starts differ most, comparing only blocks
    whose hulls meet, so blocks that tile a tensor cost about ``n log n``.

    >>> iv = Interval
    >>> overlapping_pairs([((iv(0, 4),),), ((iv(2, 6),),), ((iv(4, 8),),), ((iv(0, 4),),)])
    [(0, 1), (1, 2), (1, 3)]
    >>> overlapping_pairs([((iv(0, 2),), (iv(0, 3),)), ((iv(2, 4),), (iv(0, 3),)), ((), (iv(0, 3),))])
    []
    """
    live = [i for i, b in enumerate(blocks) if b and all(b)]
    if len(live) < 2:
        return []
    ndim = len(blocks[live[0]])
    hull = {i: [(blocks[i][d][0].start, blocks[i][d][-1].stop) for d in range(ndim)] for i in live}
    d0 = max(range(ndim), key=lambda d: len({h[d][0] for h in hull.values()}))
    order = sorted(live, key=lambda i: hull[i][d0])
    pairs: list[tuple[int, int]] = []
    for x, i in enumerate(order):
        hi, bi = hull[i], blocks[i]
        for j in order[x + 1 :]:
            hj, bj = hull[j], blocks[j]
            if hj[d0][0] >= hi[d0][1]:
                break
            if bi == bj or not all(hi[d][0] < hj[d][1] and hj[d][0] < hi[d][1] for d in range(ndim)):
                continue
            if all(overlap_segments(bi[d], bj[d]) for d in range(ndim)):
                pairs.append((min(i, j), max(i, j)))
    return sorted(pairs)


def format_box(box: Box) -> str:
    """The one human form of a box: half-open intervals per dim, joined by ``x``.

    >>> format_box((Interval(0, 4), Interval(2, 3)))
    '[0:4)x[2:3)'
    >>> format_box(())
    '(scalar)'
    """
    return "x".join(str(iv) for iv in box) if box else "(scalar)"
