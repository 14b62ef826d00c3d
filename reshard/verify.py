"""Prove two checkpoints hold the same logical tensors, bit for bit, whatever their layouts.

For each tensor the pieces of B (replicas dropped) are the *regions*; the
planner's :func:`~reshard.plan.match_blocks` says which bytes of A (and of B)
make up each region. Regions are compared slab by slab, never more than
``max_bytes`` of buffers at a time: a region held by one piece is a numpy view
of the memory-mapped file, anything else (column slices of another layout,
strided shards, Partial sums) is gathered into a reused buffer. Items are
compared as unsigned integers of the item size, so ``-0.0 != 0.0`` and NaNs
with different payloads differ, exactly when their bits do.

Partial tensors (a checkpoint saved with ``P(...)`` placements) are reduced
in rank order with :func:`reshard.torch_ops.cast_reduce`, as ``convert`` does,
and the reduced values are compared.

Replicas are read once, from the lowest piece (``inspect --check`` compares them);
:func:`verify_repeats` compares the copies a transform's ``split`` reads once (vLLM's
KV heads repeated over TP ranks) the same way, for ``verify --transforms``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from .budget import DEFAULT_MAX_BYTES
from .checkpoint import Checkpoint, TensorSource
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
from .io.reader import WINDOW, WINDOW_SLOTS, MappedFiles, Piece, Run, Windows, read_box, uint_dtype
from .io.views import open_piece
from .plan import Copy, copy_boxes, match_blocks, natural_key
from .transform_plan import TransformedSource, file_at, match_any, target_sources
from .transforms import Repeat

__all__ = ["verify_checkpoints", "verify_repeats", "with_repeats", "Verdict", "Difference"]


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
    bufs: tuple[list[bytearray], list[bytearray]],
) -> tuple[int, tuple[list[int], int, int] | None]:
    """Bytes compared, and the smallest differing global index with A's and B's bits (or None)."""
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
            neq = np.not_equal(va, vb)
            if neq.any():
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


def _file_order(a: Checkpoint, b: Checkpoint) -> list[str]:
    """Every tensor name, in the order B's files hold the tensors (then A's extra names).

    Reading follows the files: neighbouring tensors are read as one span, and the pages
    mapped around each read (the kernel maps 64 KiB around a fault) are the ones read next,
    not pages of tensors far away (a 100k-tensor HF file in name order touched 8x the bytes
    compared, and held them until the next release). Differences are sorted by name after.
    """
    located = sorted(
        (t.piece_files[0] if t.piece_files else -1, t.piece_offsets[0] if t.piece_offsets else -1, n)
        for n, t in b.tensors.items()
    )
    return [n for _, _, n in located] + [n for n in a.tensors if n not in b.tensors]


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


_BATCH = 1 << 20
"""Bytes of tensors compared in one batch: the source spans of a batch (its tensors' pieces in
up to 8 files a side) fit the windows of :class:`~reshard.io.reader.Windows`, so tensors of
each geometry, gathered one geometry after another, read each source byte once (with 16 MiB
batches, MoE verify read 4.6x the bytes compared)."""


class _Batch:
    """Tensors whose regions are contiguous runs on both sides, compared many at a time.

    A 100k-tensor checkpoint compared tensor by tensor costs ~100 us each in numpy calls;
    here both sides' bytes are gathered back to back, tensors of one geometry together
    (:meth:`~reshard.io.reader.Windows.gather_entries`: a few strided copies per batch), and
    compared eight bytes at a time. Only the tensors holding a differing byte are compared
    again, alone, to find each difference's first index.
    """

    def __init__(
        self,
        fa: MappedFiles,
        fb: MappedFiles,
        cap: int,
        max_bytes: int,
        bufs: tuple[list[bytearray], list[bytearray]],
    ) -> None:
        self.fa, self.fb, self.cap, self.max_bytes, self.bufs = fa, fb, cap, max_bytes, bufs
        self.compared = 0
        self.size = 0
        self.items: list[tuple[str, TensorSource, TensorSource, _Match, int]] = []
        self.buffers: tuple[bytearray, bytearray] | None = None
        window = min(WINDOW, max_bytes // (8 * WINDOW_SLOTS))  # both sides' windows: 1/4 of the budget
        self.windows = (Windows(fa.sources, window, own=True), Windows(fb.sources, window, own=True))
        # per side, tensors by geometry: id(runs) -> [runs, positions, tensors]
        self.groups: tuple[dict[int, list[Any]], dict[int, list[Any]]] = ({}, {})
        self.templates: dict[tuple[int, bool, str], tuple[Run, ...] | None] = {}  # by id(_Match): held

    def has_room(self, a: TensorSource) -> bool:
        """Whether tensor ``a`` fits in the batch besides the tensors queued (flush first if not)."""
        return self.size + a.numel * DTYPE_SIZES[a.dtype] <= self.cap

    def add(self, name: str, a: TensorSource, b: TensorSource, m: _Match) -> bool:
        """Queue a tensor; False when it cannot be batched (no room, strided, reduced)."""
        n = a.numel * DTYPE_SIZES[a.dtype]
        if self.size + n > self.cap:
            return False
        runs = [self._template(a, m, True), self._template(b, m, False)]
        if runs[0] is None or runs[1] is None:
            return False
        for side, src in enumerate((a, b)):
            g = self.groups[side].get(id(runs[side]))
            if g is None:
                g = self.groups[side][id(runs[side])] = [runs[side], [], []]
            g[1].append(self.size)
            g[2].append(src)
        self.items.append((name, a, b, m, n))
        self.size += n
        return True

    def flush(self) -> list[Difference]:
        """Compare the queued tensors; their differences, in queue order."""
        import numpy as np

        out: list[Difference] = []
        if not self.items:
            return out
        if self.buffers is None:
            self.buffers = (bytearray(self.cap), bytearray(self.cap))
        ba, bb = self.buffers
        n = self.size
        for windows, groups, buf in zip(self.windows, self.groups, self.buffers):
            windows.gather_groups(groups.values(), buf)
            groups.clear()
        differ = _differing(ba, bb, n)
        if differ is None:
            self.compared += n
        else:  # the tensors holding a differing byte, each compared alone for its first index
            ends = np.cumsum([size for *_, size in self.items])
            hit = set(np.searchsorted(ends, differ, side="right").tolist())
            for i, (name, a, b, m, size) in enumerate(self.items):
                if i not in hit:
                    self.compared += size
                    continue
                diff = self.compare(name, a, b, m)
                if diff is not None:
                    out.append(diff)
        self.items.clear()
        self.size = 0
        return out

    def _template(self, src: TensorSource, m: _Match, a_side: bool) -> tuple[Run, ...] | None:
        key = (id(m), a_side, src.dtype)
        if key not in self.templates:
            self.templates[key] = _template(src, m, a_side)
        return self.templates[key]

    def compare(self, name: str, a: TensorSource, b: TensorSource, m: _Match) -> Difference | None:
        """One tensor compared region by region (its first differing index, if any)."""
        n, first = _first_difference(self.fa, self.fb, a, b, m, self.max_bytes, self.bufs)
        self.compared += n
        return None if first is None else _values_difference(name, a.dtype, *first)


def _differing(ba: bytearray, bb: bytearray, n: int) -> Any:
    """The positions of the bytes that differ in the first ``n`` of two buffers (None: none do),
    compared eight bytes at a time."""
    import numpy as np

    w = n - n % 8
    va, vb = np.frombuffer(ba, np.uint64, w // 8), np.frombuffer(bb, np.uint64, w // 8)
    ta, tb = np.frombuffer(ba, np.uint8, n - w, w), np.frombuffer(bb, np.uint8, n - w, w)
    if np.array_equal(va, vb) and np.array_equal(ta, tb):
        return None
    words = np.flatnonzero(va != vb)  # then the bytes of those words (one may hold several tensors)
    wa = np.frombuffer(ba, np.uint8, w).reshape(-1, 8)[words]
    wb = np.frombuffer(bb, np.uint8, w).reshape(-1, 8)[words]
    row, col = np.nonzero(wa != wb)
    return np.concatenate((words[row] * 8 + col, w + np.flatnonzero(ta != tb)))


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
        ``{"tensor", "kind", "message"}`` with ``kind`` one of ``missing`` (only
        in A), ``extra`` (only in B), ``dtype``, ``shape``, ``values``; a
        ``values`` difference also has ``index`` (the smallest differing global
        index, row-major order) and ``a_bits``/``b_bits`` (the items there, hex).

    Raises:
        PlanError: a checkpoint's pieces leave holes or overlap without being replicas.
    """
    names = _file_order(a, b)
    diffs: list[Difference] = []
    compared_tensors = 0
    fa = MappedFiles(a.files, max_bytes // 4)
    fb = MappedFiles(b.files, max_bytes // 4)
    bufs: tuple[list[bytearray], list[bytearray]] = ([], [])
    matches: dict[tuple[Hashable, ...], _Match] = {}
    batch = _Batch(fa, fb, max(1, min(_BATCH, max_bytes // 4)), max_bytes, bufs)  # two buffers
    try:
        for name in names:
            ta, tb = a.tensors.get(name), b.tensors.get(name)
            diff = _metadata_difference(name, ta, tb)
            if ta is not None and tb is not None:
                compared_tensors += 1
            if diff is not None:
                diffs.append(diff)
                continue
            assert ta is not None and tb is not None
            if ta.numel == 0:
                continue
            key = (ta.signature, tb.signature, ta.shape)
            m = matches.get(key)
            if m is None:
                m = matches[key] = _match(ta, tb, a.path, b.path)
            if not batch.has_room(ta):
                diffs += batch.flush()
            if not batch.add(name, ta, tb, m):
                diffs += batch.flush()
                first = batch.compare(name, ta, tb, m)
                if first is not None:
                    diffs.append(first)
        diffs += batch.flush()
    finally:
        del bufs
        fa.close()
        fb.close()
    diffs.sort(key=lambda d: natural_key(d["tensor"]))
    total = batch.compared
    return {
        "equal": not diffs,
        "tensors": compared_tensors,
        "bytes_compared": total,
        "differences": diffs,
        "a": _describe(a),
        "b": _describe(b),
    }


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
