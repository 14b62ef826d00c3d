"""Prove two checkpoints hold the same logical tensors, bit for bit, whatever their layouts.

For each tensor the pieces of B (replicas dropped) are the *regions*; the
planner's :func:`~reshard.plan.match_blocks` says which bytes of A (and of B)
make up each region. Regions are compared slab by slab, never more than
``max_bytes`` of buffers at a time: a region held by one piece is a numpy view
of the memory-mapped file, anything else (column slices of another layout,
strided shards, Partial sums) is gathered into a reused buffer. Items are
compared as unsigned integers of the item size, so ``-0.0 != 0.0`` and NaNs
with different payloads differ, exactly when their bits do.

Small tensors whose regions are runs of rows on both sides (most of a 100k-tensor
checkpoint) are compared many at a time (:class:`~reshard.compare.Batch`: both sides'
bytes gathered into two buffers, compared eight bytes at a time); a tensor a batch
finds a differing byte in is compared again alone, as above, for its first differing
index. Names are looked up, dtypes and shapes compared and tensors grouped by geometry
a chunk of names at a time with list operations, not a Python step per tensor.

Partial tensors (a checkpoint saved with ``P(...)`` placements) are reduced
in rank order with :func:`reshard.torch_ops.cast_reduce`, as ``convert`` does,
and the reduced values are compared.

Replicas are read once, from the lowest piece (``inspect --check`` compares them);
:func:`verify_repeats` compares the copies a transform's ``split`` reads once (vLLM's
KV heads repeated over TP ranks) the same way, for ``verify --transforms``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from .budget import DEFAULT_MAX_BYTES
from .checkpoint import UNREADABLE, Checkpoint, TensorSource
from .compare import Batch, Group, batches
from .dtypes import DTYPE_SIZES
from .errors import PlanError
from .execute import entry_runs
from .intervals import (
    Block,
    block_shape,
    block_volume,
    clip_box,
    coverage_holes,
    full_block,
    global_index,
    row_major_strides,
    slabs,
)
from .io.reader import MappedFiles, Piece, Run, read_box, uint_dtype
from .io.views import open_piece
from .plan import Copy, check_reduce, copy_boxes, match_blocks, natural_key
from .text import name_pattern
from .transform_plan import TransformedSource, file_at, match_any, target_sources
from .transforms import Repeat

__all__ = ["verify_checkpoints", "verify_repeats", "with_repeats", "with_replicas", "Verdict", "Difference"]


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


_Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class _DifferenceCore(TypedDict):
    tensor: str
    kind: str
    message: str


class Difference(_DifferenceCore, total=False):
    """One difference found, as JSON: ``dtype``/``shape`` add ``a`` and ``b``; ``values`` adds
    ``index`` (the smallest differing global index) and ``a_bits``/``b_bits`` (hex);
    ``replica`` (:func:`verify_repeats`) adds ``index`` and ``path``/``other``, the files
    holding the two copies."""

    a: str | list[int]
    b: str | list[int]
    index: list[int]
    a_bits: str
    b_bits: str
    path: str
    other: str


class Side(TypedDict):
    path: str
    format: str


class Verdict(TypedDict):
    """What :func:`verify_checkpoints` returns (the ``verify --json`` document body)."""

    equal: bool
    tensors: int
    bytes_compared: int
    differences: list[Difference]
    a: Side
    b: Side


class _Region:
    """One side's values over one region (a destination block), produced slab by slab."""

    def __init__(
        self,
        files: MappedFiles,
        src: TensorSource,
        copies: Sequence[Copy],
        groups: int,
        geometry: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
        bufs: list[bytearray],
    ) -> None:
        check_reduce(src)
        self.files = files
        self.src = src
        self.groups = groups
        self.bufs = bufs
        self.isz = DTYPE_SIZES[src.dtype]
        self.npt = uint_dtype(self.isz)
        # One copy, one segment per dim, one group: the region is a view of one piece.
        self.view: tuple[Piece, tuple[int, ...]] | None = None
        self.plans: list[tuple[int, Piece | None, list[_Box]]] = []  # None: zeros (transform padding)
        for c in copies:
            piece = (
                open_piece(files.sources, src, c.piece)
                if isinstance(src, TransformedSource)
                else files.piece(src, c.piece, geometry[c.piece][0])
            )
            if (
                piece is not None
                and groups == 1
                and len(copies) == 1
                and all(len(s) == 1 for s in c.segments)
            ):
                self.view = (piece, tuple(s[0][0] for s in c.segments))
            else:
                self.plans.append((c.group, piece, list(copy_boxes(c))))

    def slab(self, slab: tuple[tuple[int, int], ...], shape: tuple[int, ...], n: int) -> Any:
        """The region's items in ``slab`` (local ``(start, stop)`` per dim), shaped ``shape``."""
        import numpy as np

        if self.view is not None:
            p, starts = self.view
            key = tuple(slice(s + a, s + b) for s, (a, b) in zip(starts, slab, strict=True))
            return read_box(self.files, p, key)
        while len(self.bufs) < self.groups:
            self.bufs.append(bytearray())
        isz = DTYPE_SIZES[self.src.dtype]
        views = []
        for g in range(self.groups):
            if len(self.bufs[g]) < n * isz:
                self.bufs[g] = bytearray(n * isz)
            views.append(np.frombuffer(self.bufs[g], dtype=self.npt, count=n).reshape(shape))
        for g, piece, boxes in self.plans:
            for s_st, d_st, sz in boxes:
                clipped = clip_box(slab, s_st, d_st, sz)
                if clipped is not None:
                    src_sl, dst_sl = clipped
                    views[g][dst_sl or ...] = 0 if piece is None else read_box(self.files, piece, src_sl)
        if self.groups == 1:
            return views[0]
        from .torch_ops import cast_reduce

        out = cast_reduce(views, self.src.dtype, self.src.dtype, self.src.reduce_op, n)
        return out.view(self.npt).reshape(shape)


_Geometry = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class _Match:
    """How the regions (B's blocks) are read from A and from B: shared by tensors of a signature."""

    regions: tuple[Block, ...]
    shapes: tuple[tuple[int, ...], ...]
    a_copies: tuple[tuple[Copy, ...], ...]
    ga: int
    a_geometry: _Geometry
    b_copies: tuple[tuple[Copy, ...], ...]
    gb: int
    b_geometry: _Geometry


def _piece_geometry(src: TensorSource) -> _Geometry:
    shapes = [block_shape(b) for b in src.piece_blocks]
    return tuple((s, row_major_strides(s)) for s in shapes)


def _regions(b: TensorSource) -> tuple[Block, ...]:
    """B's distinct non-empty blocks of its first partial group: they tile B's tensor."""
    partials = b.piece_partials
    first = min(partials) if partials else 0
    seen: set[Block] = set()
    out: list[Block] = []
    for k, blk in enumerate(b.piece_blocks):
        if partials is not None and partials[k] != first:
            continue
        if blk in seen or block_volume(blk) == 0:
            continue
        seen.add(blk)
        out.append(blk)
    return tuple(out)


def _self_copies(b: TensorSource, regions: tuple[Block, ...]) -> tuple[tuple[Copy, ...], ...] | None:
    """B over its own blocks, one whole piece each, when they tile B's tensor (else None).

    Volumes adding up to the tensor's with no hole mean the blocks are
    disjoint; then the quadratic matching is not needed.
    """
    if b.piece_partials is not None and len(set(b.piece_partials)) > 1:
        return None
    if sum(block_volume(r) for r in regions) != b.numel or coverage_holes(b.shape, regions):
        return None
    first: dict[Block, int] = {}
    for k, blk in enumerate(b.piece_blocks):
        first.setdefault(blk, k)  # the lowest piece, as match_blocks reads replicas
    return tuple((Copy(first[r], tuple(((0, 0, n),) for n in block_shape(r))),) for r in regions)


def _match(a: TensorSource, b: TensorSource, a_path: str, b_path: str) -> _Match:
    regions = _regions(b) if not isinstance(b, TransformedSource) else (full_block(b.shape),)
    own = _self_copies(b, regions) if not isinstance(b, TransformedSource) else None
    if own is not None:
        b_copies, gb = own, 1
    elif isinstance(b, TransformedSource):  # a view (verify_repeats): one region, the whole tensor
        b_copies, gb = match_any(b, regions)
    else:
        try:
            b_copies, gb = match_blocks(b, regions)
        except PlanError as e:
            raise PlanError(f"{b_path}: {e.message}", path=b_path, tensor=b.name) from None
    covered = sum(block_volume(r) for r in regions)
    if covered != b.numel:
        raise PlanError(
            f'{b_path}: tensor "{b.name}": its pieces cover {covered} of {b.numel} elements '
            "(holes). The checkpoint is incomplete or its layout is wrong; "
            "run `reshard inspect --check` on it.",
            path=b_path,
            tensor=b.name,
        )
    try:
        a_copies, ga = match_any(a, regions)
    except PlanError as e:
        raise PlanError(f"{a_path}: {e.message}", path=a_path, tensor=a.name) from None
    return _Match(
        regions,
        tuple(block_shape(r) for r in regions),
        a_copies,
        ga,
        _piece_geometry(a),
        b_copies,
        gb,
        _piece_geometry(b),
    )


def _first_difference(
    fa: MappedFiles,
    fb: MappedFiles,
    a: TensorSource,
    b: TensorSource,
    m: _Match,
    max_bytes: int,
    bufs: tuple[list[bytearray], list[bytearray], list[bytearray]],
) -> tuple[int, tuple[list[int], int, int] | None]:
    """Bytes compared, and the smallest differing global index with A's and B's bits (or None).

    ``bufs``: A's and B's gather buffers and the mask's, reused from call to call (a fresh
    mask a slab was memory touched for the first time, at a fraction of copy speed here).
    """
    import numpy as np

    isz = DTYPE_SIZES[a.dtype]
    ga, gb = m.ga, m.gb
    # bytes held per item: gather buffers (plus reduction outputs) of both sides, and the mask
    per_item = isz * (ga + gb + (ga > 1) + (gb > 1)) + 1
    items = max(1, max_bytes // per_item)
    compared = 0
    best: tuple[list[int], int, int] | None = None
    for j, blk in enumerate(m.regions):
        if best is not None:
            # a block's smallest global index is its first index along every dim
            corner = [il[0].start for il in blk]
            if corner >= best[0]:
                continue
        dshape = m.shapes[j]
        ra = _Region(fa, a, m.a_copies[j], ga, m.a_geometry, bufs[0])
        rb = _Region(fb, b, m.b_copies[j], gb, m.b_geometry, bufs[1])
        for slab in slabs(dshape, 1, items):
            shape = tuple(hi - lo for lo, hi in slab)
            n = _prod(shape)
            va = ra.slab(slab, shape, n)
            vb = rb.slab(slab, shape, n)
            compared += n * isz
            neq = _not_equal(va, vb, shape, n, bufs[2])
            if neq is not None:
                pos = int(np.argmax(neq.reshape(-1)))
                local = [int(x) for x in np.unravel_index(pos, shape)] if shape else []
                at = tuple(local)
                bits_a, bits_b = int(va[at]), int(vb[at])
                pos_in_blk = [lo + x for (lo, _), x in zip(slab, local, strict=True)]
                idx = global_index(blk, pos_in_blk)
                if best is None or idx < best[0]:
                    best = (idx, bits_a, bits_b)
                del va, vb, neq
                break  # local row-major order is global order within a block
            del va, vb, neq
        del ra, rb
    return compared, best


def _not_equal(va: Any, vb: Any, shape: tuple[int, ...], n: int, mask: list[bytearray]) -> Any:
    """Where ``va`` and ``vb`` differ (a bool array shaped ``shape`` in ``mask[0]``), or None when nowhere."""
    import numpy as np

    if not mask:
        mask.append(bytearray())
    if len(mask[0]) < n:
        mask[0] = bytearray(n)
    neq = np.frombuffer(mask[0], np.bool_, n).reshape(shape)
    np.not_equal(va, vb, out=neq)
    return neq if neq.any() else None


def _file_order(a: Checkpoint, b: Checkpoint) -> tuple[list[str], list[TensorSource | None]]:
    """Every tensor name, in the order B's files hold the tensors (then A's extra names), and
    B's tensor of each name (None for A's extras: not looked up again by name).

    Reading follows the files: neighbouring tensors are read as one span, and the pages
    mapped around each read (the kernel maps 64 KiB around a fault) are the ones read next,
    not pages of tensors far away (a 100k-tensor HF file in name order touched 8x the bytes
    compared, and held them until the next release). Batches then read B's bytes in file order
    too. Tensors at the same place keep B's order. Differences are sorted by name after.
    """
    import numpy as np

    names = list(b.tensors)
    ts = b.tensors.values()
    try:  # map and C callables, no Python step per tensor (100k names: 62 -> 44 ms)
        files = np.fromiter(map(_FIRST, map(_FILES, ts)), np.int64, len(names))
        offsets = np.fromiter(map(_FIRST, map(_OFFSETS, ts)), np.int64, len(names))
    except IndexError:  # a tensor without pieces (empty)
        files = np.fromiter((f[0] if f else -1 for f in map(_FILES, ts)), np.int64, len(names))
        offsets = np.fromiter((o[0] if o else -1 for o in map(_OFFSETS, ts)), np.int64, len(names))
    order = np.lexsort((offsets, files)).tolist()
    extra = list(itertools.filterfalse(b.tensors.__contains__, a.tensors))
    tbs: list[TensorSource | None] = list(map(list(ts).__getitem__, order))
    return list(map(names.__getitem__, order)) + extra, tbs + [None] * len(extra)


def _template(src: TensorSource, m: _Match, a_side: bool) -> tuple[Run, ...] | None:
    """The runs of ``src``'s regions placed one after another (those of every tensor of ``m``'s
    geometry); None when a region needs gathering (large strided pieces, Partial groups)."""
    copies, groups = (m.a_copies, m.ga) if a_side else (m.b_copies, m.gb)
    if groups != 1:
        return None
    isz = DTYPE_SIZES[src.dtype]
    out: list[Run] = []
    at = 0
    for region, shape in zip(copies, m.shapes, strict=True):
        runs = entry_runs(src, region, isz)
        if runs is None:
            return None
        out += [(at + d, k, s, n, rows, ss, ds) for d, k, s, n, rows, ss, ds in runs]
        at += isz * _prod(shape)
    return tuple(out)


_BATCH = 4 << 20
"""Bytes of tensors compared in one :class:`~reshard.compare.Batch` (a buffer a side, and a
window of up to twice that the source spans are read into). Larger batches cut more numpy
calls per byte (tensors of one geometry move as a few strided copies a batch), smaller ones
keep the buffers in the CPU's cache; 4 MiB measured best on the 100k-tensor MoE checkpoint."""


_CHUNK = 1 << 14
"""Tensors looked up, checked and grouped at once: lists of this many, whatever the count."""

_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_SIGNATURE = attrgetter("signature")
_FILES = attrgetter("piece_files")
_OFFSETS = attrgetter("piece_offsets")
_FIRST = operator.itemgetter(0)


class _Kind(NamedTuple):
    """What tensors of one pair of signature objects, shape and dtype share."""

    size: int  # bytes
    match: _Match | None  # None: empty tensors
    runs: tuple[tuple[Run, ...], tuple[Run, ...]] | None  # None: compared alone
    group: int  # tensors of one match and dtype are batched together
    held: tuple[object, object]  # the signatures whose ids key it, kept alive


class _Verifier:
    """The state of :func:`verify_checkpoints`: tensors go through it a chunk of names at a time.

    Lookups, the metadata comparison and the grouping by geometry are list operations over
    a chunk (``map``, list equality); tensors whose regions are contiguous runs on both sides
    are compared in :class:`~reshard.compare.Batch` es, the rest (large, strided beyond a
    run, reduced) and the tensors a batch found a difference in are compared alone with
    :func:`_first_difference`.
    """

    def __init__(self, a: Checkpoint, b: Checkpoint, max_bytes: int) -> None:
        self.a, self.b, self.max_bytes = a, b, max_bytes
        self.diffs: list[Difference] = []
        self.tensors = 0
        self.compared = 0
        self.fa = MappedFiles(a.files, max_bytes // 4)
        self.fb = MappedFiles(b.files, max_bytes // 4)
        self.bufs: tuple[list[bytearray], list[bytearray], list[bytearray]] = ([], [], [])
        self.matches: dict[tuple[Hashable, ...], _Match] = {}
        self.kinds: dict[tuple[int, int, tuple[int, ...], str], int] = {}  # by signature ids
        self.by_value: dict[tuple[Hashable, ...], int] = {}  # by signatures
        self.kind_list: list[_Kind] = []
        self.groups: dict[tuple[int, str], int] = {}
        self.batch = Batch((self.fa.sources, self.fb.sources), max(1, min(_BATCH, max_bytes // 8)))

    def close(self) -> None:
        self.bufs = ([], [], [])
        self.fa.close()
        self.fb.close()

    def chunk(self, names: list[str], tbs: list[Any]) -> None:
        """Compare the tensors of ``names`` (``tbs``: B's tensor of each, or None)."""
        import numpy as np

        tas: list[Any] = list(map(self.a.tensors.get, names))
        if not _plain(tas, tbs):
            names, tas, tbs = self._metadata(names, tas, tbs)
        self.tensors += len(names)
        dtypes = list(map(_DTYPE, tas))
        keys = list(
            zip(
                map(id, map(_SIGNATURE, tas)),
                map(id, map(_SIGNATURE, tbs)),
                map(_SHAPE, tas),
                dtypes,
                strict=True,
            )
        )
        ks: list[Any] = list(map(self.kinds.get, keys))
        if None in ks:
            for i, k in enumerate(ks):
                if k is None:
                    k = ks[i] = self.kinds.get(keys[i])
                if k is None:
                    ks[i] = self._kind(keys[i], tas[i], tbs[i])
        del keys
        kinds = self.kind_list
        kk = np.array(ks, np.int64)
        size = np.array([k.size for k in kinds], np.int64)[kk]
        # dtype given: with no kind yet (every tensor so far differed in dtype or shape) the list
        # is empty, and an empty array is float64, which ~ refuses
        batched = np.array([k.runs is not None and 0 < k.size <= self.batch.cap for k in kinds], bool)[kk]
        for i in np.flatnonzero(~batched & (size > 0)).tolist():
            self._alone(names[i], tas[i], tbs[i], kinds[ks[i]])
        idx = np.flatnonzero(batched)
        gid = np.array([k.group for k in kinds], np.int64)[kk[idx]]
        sizes = size[idx]
        ends = np.cumsum(sizes)
        for lo, hi in batches(sizes, self.batch.cap):
            self._batch(
                names,
                tas,
                tbs,
                ks,
                idx[lo:hi],
                gid[lo:hi],
                ends[lo:hi] - sizes[lo:hi] - (ends[lo - 1] if lo else 0),
            )

    def _batch(
        self, names: list[str], tas: list[Any], tbs: list[Any], ks: list[int], idx: Any, gid: Any, at: Any
    ) -> None:
        """Compare the tensors ``idx`` (of groups ``gid``, at ``at``) as one batch."""
        import numpy as np

        groups = []
        members = []
        for g in np.unique(gid).tolist():
            sel = np.flatnonzero(gid == g)
            items = idx[sel].tolist()
            kind = self.kind_list[ks[items[0]]]
            assert kind.runs is not None
            side_a, side_b = list(map(tas.__getitem__, items)), list(map(tbs.__getitem__, items))
            groups.append(Group(kind.runs, kind.size, (side_a, side_b), at[sel]))
            members.append(items)
        self.compared += int(sum(g.size * len(g.at) for g in groups))
        for gi, j in self.batch.compare(groups):  # the tensors holding a differing byte
            i = members[gi][j]
            self.compared -= groups[gi].size
            self._alone(names[i], tas[i], tbs[i], self.kind_list[ks[i]])

    def _kind(self, key: tuple[int, int, tuple[int, ...], str], ta: TensorSource, tb: TensorSource) -> int:
        """Index of the kind of tensors like ``ta``/``tb`` (the first of a kind is matched here).

        Readers that share one signature object between the tensors of a geometry are served
        by ``key`` (the objects' ids); for the others (a new tuple per tensor) each tensor
        looks its signatures up by value, and ``kinds`` does not grow with them.
        """
        vkey = (ta.signature, tb.signature, ta.shape, ta.dtype)
        known = self.by_value.get(vkey)
        if known is not None:
            return known
        size = ta.numel * DTYPE_SIZES[ta.dtype]
        m = runs = None
        group = -1
        if size:
            mkey = (ta.signature, tb.signature, ta.shape)
            m = self.matches.get(mkey)
            if m is None:
                m = self.matches[mkey] = _match(ta, tb, self.a.path, self.b.path)
            ra, rb = _template(ta, m, True), _template(tb, m, False)
            runs = None if ra is None or rb is None else (ra, rb)
            group = self.groups.setdefault((id(m), ta.dtype), len(self.groups))  # matches are held
        self.kinds[key] = self.by_value[vkey] = len(self.kind_list)
        self.kind_list.append(_Kind(size, m, runs, group, (ta.signature, tb.signature)))
        return self.kinds[key]

    def _alone(self, name: str, ta: TensorSource, tb: TensorSource, kind: _Kind) -> None:
        """One tensor compared region by region (its first differing index, if any)."""
        assert kind.match is not None
        n, first = _first_difference(self.fa, self.fb, ta, tb, kind.match, self.max_bytes, self.bufs)
        self.compared += n
        if first is not None:
            self.diffs.append(_values_difference(name, ta.dtype, *first))

    def _metadata(
        self, names: list[str], tas: list[Any], tbs: list[Any]
    ) -> tuple[list[str], list[Any], list[Any]]:
        """Report the names missing on a side and the dtype and shape differences; the rest."""
        keep: tuple[list[str], list[Any], list[Any]] = ([], [], [])
        for name, ta, tb in zip(names, tas, tbs, strict=True):
            diff = _metadata_difference(name, ta, tb)
            if diff is None:
                keep[0].append(name)
                keep[1].append(ta)
                keep[2].append(tb)
                continue
            self.diffs.append(diff)
            if ta is not None and tb is not None:
                self.tensors += 1
        return keep


def _plain(tas: list[Any], tbs: list[Any]) -> bool:
    """Whether every tensor is on both sides with one dtype and shape (list operations only)."""
    none = itertools.repeat(None)
    if any(map(operator.is_, tas, none)) or any(map(operator.is_, tbs, none)):
        return False
    return list(map(_DTYPE, tas)) == list(map(_DTYPE, tbs)) and list(map(_SHAPE, tas)) == list(
        map(_SHAPE, tbs)
    )


def _describe(c: Checkpoint) -> Side:
    return {"path": c.path, "format": c.format}


def verify_checkpoints(a: Checkpoint, b: Checkpoint, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Verdict:
    """Compare two checkpoints: tensor names, dtypes, global shapes and values bit for bit.

    Args:
        a: the first checkpoint (any format and layout).
        b: the second checkpoint.
        max_bytes: bound on the comparison buffers (approximate, at least one item per side).

    Returns:
        ``{"equal", "tensors", "bytes_compared", "differences", "a", "b"}``:
        ``tensors`` counts names present in both; each difference is
        ``{"tensor", "kind", "message"}`` with ``kind`` one of ``unreadable`` (a dtype
        safetensors lacks, on either side), ``missing`` (only
        in A), ``extra`` (only in B), ``dtype``, ``shape``, ``values``; a
        ``values`` difference also has ``index`` (the smallest differing global
        index, row-major order) and ``a_bits``/``b_bits`` (the items there, hex).

    Raises:
        PlanError: a checkpoint's pieces leave holes or overlap without being replicas.
    """
    names, tbs = _file_order(a, b)
    v = _Verifier(a, b, max_bytes)
    try:
        for c in range(0, len(names), _CHUNK):
            v.chunk(names[c : c + _CHUNK], tbs[c : c + _CHUNK])
    finally:
        v.close()
    diffs = v.diffs + _unreadable(a, "A") + _unreadable(b, "B")
    diffs.sort(key=lambda d: natural_key(d["tensor"]))
    total = v.compared
    return {
        "equal": not diffs,
        "tensors": v.tensors,
        "bytes_compared": total,
        "differences": diffs,
        "a": _describe(a),
        "b": _describe(b),
    }


def _unreadable(ck: Checkpoint, side: str) -> list[Difference]:
    """A difference per tensor of ``ck`` of a dtype reshard cannot read: never said equal unseen."""
    return [
        {
            "tensor": n.name,
            "kind": "unreadable",
            "message": f'tensor "{n.name}" of {side} ({ck.path}) has a dtype safetensors lacks, so '
            f"reshard cannot compare it; --exclude {name_pattern(n.name)} compares the rest",
        }
        for n in ck.non_tensors
        if n.kind == UNREADABLE
    ]


def verify_repeats(
    source: Checkpoint, repeats: Sequence[Repeat], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[list[Difference], int]:
    """Compare each copy a ``split`` with ``shards`` does not read with the copy it reads.

    vLLM holds each KV head on ``tp / num_key_value_heads`` ranks; reading its files back
    (``hf-to-vllm --inverse``) takes the first copy. Like the replicas of a Replicate
    placement (which ``inspect --check`` compares), the others must hold the same bytes.

    Returns:
        A ``replica`` difference per copy that differs (its first index in the split target,
        and the files holding that element of both copies), and the bytes compared.
    """
    if not repeats:
        return [], 0
    label = {f"{r.first.name} (copy {r.copy + 1} of {r.count})": r for r in repeats}
    other = dataclasses.replace(
        source,
        tensors=target_sources(
            {n: dataclasses.replace(r.other, name=n) for n, r in label.items()}, source.tensors
        ),
    )
    first = dataclasses.replace(
        source,
        tensors=target_sources(
            {n: dataclasses.replace(r.first, name=n) for n, r in label.items()}, source.tensors
        ),
    )
    verdict = verify_checkpoints(other, first, max_bytes=max_bytes)
    out: list[Difference] = []
    for d in verdict["differences"]:
        r, idx = label[d["tensor"]], d.get("index", [])
        fo, ff = (file_at(c.tensors[d["tensor"]], idx) for c in (other, first))
        po = source.files[fo] if fo is not None else source.path
        pf = source.files[ff] if ff is not None else source.path
        msg = (
            f'tensor "{r.first.name}": the copies of its rows that "{r.fused}" holds {r.count} times '
            f"differ: {Path(po).name} (copy {r.copy + 1}) and {Path(pf).name} (copy 1, the one read) "
            f"hold different bytes, first at index {idx}"
        )
        out.append(
            {"tensor": r.first.name, "kind": "replica", "message": msg, "index": idx, "path": po, "other": pf}
        )
    return out, verdict["bytes_compared"]


def with_repeats(verdict: Verdict, source: Checkpoint, repeats: Sequence[Repeat]) -> Verdict:
    """``verdict`` (A seen through transforms against B) with :func:`verify_repeats` of A's
    ``source`` added: ``replica`` differences, and their bytes compared."""
    diffs, compared = verify_repeats(source, repeats)
    if not repeats:
        return verdict
    merged = sorted([*verdict["differences"], *diffs], key=lambda d: natural_key(d["tensor"]))
    return {
        **verdict,
        "equal": verdict["equal"] and not diffs,
        "bytes_compared": verdict["bytes_compared"] + compared,
        "differences": merged,
    }


def with_replicas(verdict: Verdict, a: Checkpoint, b: Checkpoint) -> Verdict:
    """``verdict`` (of ``a`` against ``b``) with the copies of each side's replicated tensors
    compared as well.

    The comparison reads one copy of a replicated block (the lowest piece); a side whose
    other copies hold other bytes does not hold one value, so each such copy is a
    ``replica`` difference (its first differing global index, the file holding it as
    ``path`` and the copy read as ``other``), found by :func:`reshard.check.replica_problems`.
    A side seen through transforms is checked as stored: the tensors its views read.
    """
    from .check import replica_problems

    diffs: list[Difference] = []
    for side, ckpt in (("A", _stored(a)), ("B", _stored(b))):
        for p in replica_problems(ckpt):
            name = p["tensor"]
            assert name is not None
            diffs.append(
                {
                    "tensor": name,
                    "kind": "replica",
                    "message": f"in {side} ({ckpt.path}): {p['message']}",
                    "index": p.get("index", []),
                    "path": p["path"] or ckpt.path,
                    "other": p.get("other", ""),
                }
            )
    if not diffs:
        return verdict
    merged = sorted([*verdict["differences"], *diffs], key=lambda d: natural_key(d["tensor"]))
    return {**verdict, "equal": False, "differences": merged}


def _stored(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` with each tensor seen through transforms replaced by the stored tensors it reads."""
    if not any(map(isinstance, ckpt.tensors.values(), itertools.repeat(TransformedSource))):
        return ckpt
    tensors: dict[str, TensorSource] = {}
    for t in ckpt.tensors.values():
        for x in t.inputs if isinstance(t, TransformedSource) else (t,):
            tensors[x.name] = x
    return dataclasses.replace(ckpt, tensors=tensors)


def _metadata_difference(name: str, ta: TensorSource | None, tb: TensorSource | None) -> Difference | None:
    """A tensor missing on one side, or of another dtype or shape; None when they match."""
    q = f'tensor "{name}"'
    if tb is None:
        return {"tensor": name, "kind": "missing", "message": f"{q} is in A but missing in B"}
    if ta is None:
        return {"tensor": name, "kind": "extra", "message": f"{q} is in B but not in A"}
    if ta.dtype != tb.dtype:
        msg = f"{q}: dtype {ta.dtype} in A, {tb.dtype} in B"
        return {"tensor": name, "kind": "dtype", "a": ta.dtype, "b": tb.dtype, "message": msg}
    if ta.shape != tb.shape:
        msg = f"{q}: shape {list(ta.shape)} in A, {list(tb.shape)} in B"
        return {"tensor": name, "kind": "shape", "a": list(ta.shape), "b": list(tb.shape), "message": msg}
    return None


def _values_difference(name: str, dtype: str, idx: list[int], bits_a: int, bits_b: int) -> Difference:
    w = 2 * DTYPE_SIZES[dtype]
    ha, hb = f"0x{bits_a:0{w}x}", f"0x{bits_b:0{w}x}"
    q = f'tensor "{name}"'
    return {
        "tensor": name,
        "kind": "values",
        "index": idx,
        "a_bits": ha,
        "b_bits": hb,
        "message": f"{q}: values differ, first at index {idx} ({dtype} bits {ha} in A, {hb} in B)",
    }
