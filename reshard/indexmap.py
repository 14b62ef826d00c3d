"""Index maps between tensors: every target element comes from one source element (pure).

A tensor transform that only moves elements (rename, concat, split, stack,
RoPE permutation, padding, ...) is, per target tensor, a list of :class:`Part`
values. A part reads one source tensor (or yields zeros) and is a product of
per-target-dim maps: along target dim ``t`` a :class:`DimMap` says which source
dim it walks (``src_dim``) and, as :class:`Seg` arithmetic progressions, which
source index each target index reads. Source dims no target dim walks are
pinned to one index (``fixed``: unstacking), and target dims with no source dim
are new (stacking). Strided segments keep the count small: a gate/up
alternating-row split is one segment, a RoPE permutation two per head.

Maps compose (:func:`compose`), so a chain of transforms collapses to parts
that read the original source tensors directly; the executor turns each part
into copy runs without materialising anything in between.

>>> ident = identity_part("w", (4, 3))
>>> ident.dims[0].segs
(Seg(dst=0, src=0, size=4, dst_step=1, src_step=1),)
>>> evens_then_odds = (Seg(0, 0, 2, 1, 2), Seg(2, 1, 2, 1, 2))  # rows 0, 2, 1, 3 of 4
>>> compose_dim(evens_then_odds, evens_then_odds)  # its own inverse: the identity, one segment
(Seg(dst=0, src=0, size=4, dst_step=1, src_step=1),)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from .intervals import Block, IndexList

__all__ = [
    "Seg",
    "DimMap",
    "Part",
    "identity_part",
    "full_dims",
    "zero_part",
    "seg_indices",
    "normalize_segs",
    "compose_dim",
    "compose",
    "merge_parts",
    "index_list_segs",
    "localize",
    "unit_segments",
    "part_numel",
    "dim_extent",
]


@dataclass(frozen=True, slots=True)
class Seg:
    """Target indices ``dst + k*dst_step`` read source indices ``src + k*src_step``, ``0 <= k < size``.

    A size-1 segment has both steps 1 (they mean nothing there), so equal maps
    compare equal.
    """

    dst: int
    src: int
    size: int
    dst_step: int = 1
    src_step: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or self.dst < 0 or self.src < 0 or self.dst_step < 1 or self.src_step < 1:
            raise ValueError(f"invalid segment {self!r}")
        if self.size == 1 and (self.dst_step, self.src_step) != (1, 1):
            object.__setattr__(self, "dst_step", 1)
            object.__setattr__(self, "src_step", 1)

    @property
    def dst_last(self) -> int:
        return self.dst + (self.size - 1) * self.dst_step

    @property
    def src_last(self) -> int:
        return self.src + (self.size - 1) * self.src_step


@dataclass(frozen=True, slots=True)
class DimMap:
    """How one target dim reads its source: ``src_dim`` None means a new dim (no source coordinate)."""

    src_dim: int | None
    segs: tuple[Seg, ...]


@dataclass(frozen=True, slots=True)
class Part:
    """A product region of a target tensor read from ``source`` (None: zeros).

    Attributes:
        source: source tensor name, or None for a zero-filled region (padding).
        dims: one map per target dim; the region is the product of their target indices.
        fixed: ``(source dim, index)`` for source dims that no target dim walks.
    """

    source: str | None
    dims: tuple[DimMap, ...]
    fixed: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        walked = [d.src_dim for d in self.dims if d.src_dim is not None]
        pinned = [s for s, _ in self.fixed]
        if len(set(walked + pinned)) != len(walked) + len(pinned):
            raise ValueError(f"part reads a source dim twice: {self!r}")

    @classmethod
    def of_checked(
        cls, source: str | None, dims: tuple[DimMap, ...], fixed: tuple[tuple[int, int], ...]
    ) -> Part:
        """A part with the dims and pins of one already made (so already checked): no check again."""
        p = object.__new__(cls)
        object.__setattr__(p, "source", source)
        object.__setattr__(p, "dims", dims)
        object.__setattr__(p, "fixed", fixed)
        return p


def identity_part(name: str, shape: Sequence[int]) -> Part:
    """The whole tensor ``name`` read as is (no part for an empty tensor's empty dims)."""
    return Part(name, full_dims(tuple(shape)))


@lru_cache(maxsize=4096)
def full_dims(shape: tuple[int, ...]) -> tuple[DimMap, ...]:
    """Each dim of ``shape`` read as is (shared: checkpoints repeat a few shapes many times)."""
    return tuple(DimMap(t, (Seg(0, 0, n),) if n else ()) for t, n in enumerate(shape))


def zero_part(dims: Sequence[Sequence[Seg]]) -> Part:
    """Zeros over the product of the target indices of ``dims``."""
    return Part(None, tuple(DimMap(None, tuple(s)) for s in dims))


def seg_indices(seg: Seg) -> Iterator[tuple[int, int]]:
    """``(target, source)`` index pairs of a segment (for tests and small checks)."""
    for k in range(seg.size):
        yield seg.dst + k * seg.dst_step, seg.src + k * seg.src_step


def dim_extent(segs: Sequence[Seg]) -> int:
    """Number of target indices a dim map covers."""
    return sum(s.size for s in segs)


def part_numel(part: Part) -> int:
    """Number of target elements a part fills."""
    n = 1
    for d in part.dims:
        n *= dim_extent(d.segs)
    return n


def _continues(a: Seg, b: Seg) -> Seg | None:
    """``a`` extended by ``b`` when ``b`` carries on ``a``'s progression on both sides."""
    if a.size > 1:
        ds, ss = a.dst_step, a.src_step
    else:
        ds, ss = b.dst - a.dst, b.src - a.src
    if ds < 1 or ss < 1 or b.dst != a.dst + a.size * ds or b.src != a.src + a.size * ss:
        return None
    if b.size > 1 and (b.dst_step, b.src_step) != (ds, ss):
        return None
    return Seg(a.dst, a.src, a.size + b.size, ds, ss)


def normalize_segs(segs: Sequence[Seg]) -> tuple[Seg, ...]:
    """Sort by target start and merge segments that continue each other.

    A map that is a constant shift over a contiguous target range (however it
    was split) becomes one segment, so a transform followed by its inverse is
    the identity map again.
    """
    ordered = sorted(segs, key=lambda s: s.dst)
    out: list[Seg] = []
    for s in ordered:
        merged = _continues(out[-1], s) if out else None
        if merged is None:
            out.append(s)
        else:
            out[-1] = merged
    if len(out) > 1 and _is_shift(out):
        lo = min(s.dst for s in out)
        return (Seg(lo, lo + out[0].src - out[0].dst, sum(s.size for s in out)),)
    return tuple(out)


def _is_shift(segs: Sequence[Seg]) -> bool:
    shift = segs[0].src - segs[0].dst
    if any(s.dst_step != s.src_step or s.src - s.dst != shift for s in segs):
        return False
    lo = min(s.dst for s in segs)
    hi = max(s.dst_last for s in segs)
    return hi - lo + 1 == sum(s.size for s in segs)  # disjoint by construction, so it tiles


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _meet(o: Seg, i: Seg) -> Seg | None:
    """Compose outer ``o`` (target -> middle) with inner ``i`` (middle -> source) where they meet.

    Middle indices of ``o`` are ``o.src + k*a``; those ``i`` covers are
    ``i.dst + j*b``. Solutions of ``o.src + k*a == i.dst + j*b`` are one
    progression in ``k`` (step ``b/g``) and ``j`` (step ``a/g``).
    """
    if o.src_last < i.dst or i.dst_last < o.src:
        return None
    a, b = o.src_step, i.dst_step
    g = gcd(a, b)
    c = i.dst - o.src
    if c % g:
        return None
    p, q = b // g, a // g
    k0 = 0 if p == 1 else (c // g) * pow(q, -1, p) % p
    j0 = (o.src + k0 * a - i.dst) // b
    lo = max(_ceil_div(-k0, p), _ceil_div(-j0, q))
    hi = min((o.size - 1 - k0) // p, (i.size - 1 - j0) // q)
    if hi < lo:
        return None
    k, j = k0 + lo * p, j0 + lo * q
    return Seg(o.dst + k * o.dst_step, i.src + j * i.src_step, hi - lo + 1, o.dst_step * p, i.src_step * q)


def compose_dim(outer: Sequence[Seg], inner: Sequence[Seg]) -> tuple[Seg, ...]:
    """The map target -> source of ``outer`` (target -> middle) then ``inner`` (middle -> source).

    Only target indices whose middle index ``inner`` covers are kept.
    """
    out = []
    for o in outer:
        for i in inner:
            m = _meet(o, i)
            if m is not None:
                out.append(m)
    return normalize_segs(out)


def _fixed_in(segs: Sequence[Seg], index: int) -> int | None:
    """The source index ``segs`` maps middle index ``index`` to, if it covers it."""
    for s in segs:
        k, r = divmod(index - s.dst, s.dst_step)
        if r == 0 and 0 <= k < s.size:
            return s.src + k * s.src_step
    return None


def _compose_one(outer: Part, inner: Part) -> Part | None:
    """``outer`` (reading a middle tensor) through ``inner`` (one part of that middle tensor)."""
    fixed = list(inner.fixed)
    for v, x in outer.fixed:
        m = inner.dims[v]
        s = _fixed_in(m.segs, x)
        if s is None:
            return None
        if m.src_dim is not None:
            fixed.append((m.src_dim, s))
    dims = []
    for d in outer.dims:
        if d.src_dim is None:
            dims.append(d)
            continue
        m = inner.dims[d.src_dim]
        segs = compose_dim(d.segs, m.segs)
        if not segs:
            return None
        dims.append(DimMap(m.src_dim if inner.source is not None else None, segs))
    if inner.source is None:
        return Part(None, tuple(dims))
    return _pair_pinned(Part(inner.source, tuple(dims), tuple(sorted(fixed))))


def _pair_pinned(part: Part) -> Part:
    """Pair single-index target dims with single-index source dims in order (canonical form).

    A target dim holding one index reads one source index, whether it walks a
    source dim or the source dim is pinned (``fixed``), so which pairs with
    which is free; pairing them in order makes unstack-then-stack and similar
    round trips compare equal to the identity part.
    """
    points = [t for t, d in enumerate(part.dims) if len(d.segs) == 1 and d.segs[0].size == 1]
    if not points or (not part.fixed and len(points) < 2):
        return part
    srcs = list(part.fixed)
    for t in points:
        s = part.dims[t].src_dim
        if s is not None:
            srcs.append((s, part.dims[t].segs[0].src))
    srcs.sort()
    dims = list(part.dims)
    for n, t in enumerate(points):
        dst = dims[t].segs[0].dst
        dims[t] = (
            DimMap(srcs[n][0], (Seg(dst, srcs[n][1], 1),))
            if n < len(srcs)
            else DimMap(None, (Seg(dst, 0, 1),))
        )
    return Part(part.source, tuple(dims), tuple(srcs[len(points) :]))


def _is_identity(part: Part) -> bool:
    """Whether ``part`` reads its source as is (the whole of it, when it is a tensor's only part)."""
    if part.source is None or part.fixed:
        return False
    for t, d in enumerate(part.dims):
        if d.src_dim != t or len(d.segs) != 1:
            return False
        s = d.segs[0]
        if s.dst != 0 or s.src != 0 or s.dst_step != 1 or s.src_step != 1:
            return False
    return True


def compose(outer: Part, inner: Mapping[str, Sequence[Part]]) -> list[Part]:
    """Rewrite ``outer``, which reads a middle tensor, into parts reading the middle tensor's sources.

    Args:
        outer: a part whose ``source`` names a tensor of ``inner``.
        inner: each middle tensor's parts.

    Returns:
        Parts filling exactly ``outer``'s target region; a zero part stays as is.
    """
    if any(not d.segs for d in outer.dims):
        return []  # an empty region
    if outer.source is None:
        return [outer]
    parts = inner[outer.source]
    if len(parts) == 1 and _is_identity(parts[0]):
        # the middle tensor is a source as is: what _compose_one would give, without the intersections
        dims = tuple(
            d if d.src_dim is None else DimMap(d.src_dim, normalize_segs(d.segs)) for d in outer.dims
        )
        return [_pair_pinned(Part(parts[0].source, dims, outer.fixed))]
    out = []
    for p in parts:
        c = _compose_one(outer, p)
        if c is not None:
            out.append(c)
    return out


def _merge2(a: Part, b: Part) -> Part | None:
    """``a`` and ``b`` as one part when they differ in one dim only (their union is then a product)."""
    if a.source != b.source or a.fixed != b.fixed or len(a.dims) != len(b.dims):
        return None
    diff = [t for t, (x, y) in enumerate(zip(a.dims, b.dims)) if x != y]
    if len(diff) != 1 or a.dims[diff[0]].src_dim != b.dims[diff[0]].src_dim:
        return None
    t = diff[0]
    merged = DimMap(a.dims[t].src_dim, normalize_segs(a.dims[t].segs + b.dims[t].segs))
    return Part(a.source, a.dims[:t] + (merged,) + a.dims[t + 1 :], a.fixed)


def merge_parts(parts: Sequence[Part]) -> tuple[Part, ...]:
    """Fewer, larger parts: join parts of one source that differ along a single dim.

    Parts of one target tensor are disjoint, so the union of two products that
    agree on all dims but one is the product with that dim's segments joined.
    """
    buckets: dict[tuple[object, ...], list[Part]] = {}
    for p in parts:  # only parts of one source with the same pins can merge
        buckets.setdefault((p.source, p.fixed, len(p.dims)), []).append(p)
    return tuple(q for bucket in buckets.values() for q in _merge_bucket(bucket))


def _merge_bucket(parts: list[Part]) -> list[Part]:
    out = parts
    changed = len(out) > 1
    while changed:  # a merge can enable another with an earlier part, so repeat until none
        changed = False
        i = 0
        while i < len(out):
            for j in range(i + 1, len(out)):
                m = _merge2(out[i], out[j])
                if m is not None:
                    out[i] = m
                    del out[j]
                    changed = True
                    break
            else:
                i += 1
    return out


def index_list_segs(ilist: IndexList) -> tuple[Seg, ...]:
    """An index list as segments from local position (``dst``) to global index (``src``).

    >>> from reshard.intervals import Interval
    >>> index_list_segs((Interval(0, 2), Interval(6, 8)))
    (Seg(dst=0, src=0, size=2, dst_step=1, src_step=1), Seg(dst=2, src=6, size=2, dst_step=1, src_step=1))
    """
    out, pos = [], 0
    for iv in ilist:
        if iv.size:
            out.append(Seg(pos, iv.start, iv.size))
            pos += iv.size
    return tuple(out)


def _global_to_local(ilist: IndexList) -> tuple[Seg, ...]:
    return tuple(Seg(s.src, s.dst, s.size) for s in index_list_segs(ilist))


def localize(part: Part, target: Block, piece: Block | None, source: str | None = None) -> Part | None:
    """The slice of ``part`` that a source piece gives a target block, in local coordinates of both.

    This is the planner's matching step through a transform: ``target`` is a
    target rank's block (index lists in target coordinates), ``piece`` the block
    of one stored piece of ``part.source`` (None for a zero part). The result
    reads the piece's local array (named ``source``) into the block's local
    array, strided where the part is, or is None when they do not meet.
    """
    dims = []
    for t, d in enumerate(part.dims):
        m = compose_dim(index_list_segs(target[t]), d.segs)  # target local -> source global
        if d.src_dim is not None and part.source is not None:
            assert piece is not None
            m = compose_dim(m, _global_to_local(piece[d.src_dim]))  # -> piece local
        if not m:
            return None
        dims.append(DimMap(d.src_dim if part.source is not None else None, m))
    fixed = []
    for s, i in part.fixed:
        assert piece is not None
        local = _fixed_in(_global_to_local(piece[s]), i)
        if local is None:
            return None
        fixed.append((s, local))
    return Part(source if part.source is not None else None, tuple(dims), tuple(fixed))


def unit_segments(segs: Sequence[Seg]) -> tuple[tuple[int, int, int], ...]:
    """Strided segments as the planner's unit-step ``(src_start, dst_start, size)`` runs, by target.

    >>> unit_segments((Seg(0, 1, 3, 1, 2),))
    ((1, 0, 1), (3, 1, 1), (5, 2, 1))
    """
    out = []
    for s in segs:
        if s.dst_step == 1 and s.src_step == 1:
            out.append((s.src, s.dst, s.size))
        else:
            out.extend((s.src + k * s.src_step, s.dst + k * s.dst_step, 1) for k in range(s.size))
    return tuple(sorted(out, key=lambda x: x[1]))
