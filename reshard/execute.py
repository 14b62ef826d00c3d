"""Run a Plan: move bytes from source pieces into output files under a byte budget.

Two ways bytes move:

* a box contiguous in both the source piece and the target tensor (row-sharded
  pieces, whole tensors), or small and strided along one dim (column shards of
  small tensors), is a run of rows. Files whose entries come as columns (safetensors:
  arrays of offsets and sizes) are written a buffer of back-to-back entries at a time,
  each geometry's runs in it moved by :meth:`reshard.io.reader.Windows.gather_arrays`
  with one numpy copy per window of a source file (:mod:`reshard.bulk` groups the
  tensors by geometry); other files queue runs that land back to back in the file,
  grouped by geometry, for :meth:`~reshard.io.reader.Windows.gather_groups` (one
  ``pwrite`` per buffer, hashed on the way); a run larger than the buffer is copied
  through it;
* everything else (column slices, strided shards, casts, Partial reductions)
  is gathered slab by slab into that buffer with :func:`reshard.io.reader.read_box`
  and written with one ``pwrite`` per slab.

Each thread writes a group of sibling files in lockstep, slab by slab, so the
ranks that cut the same source rows into columns read those rows once between
them (writers that declare ``lockstep``). Fewer files than workers: the spare
workers split a file's entries. Where bytes go is the writer's
:class:`~reshard.plan.FileLayout`; files are written, hashed and renamed by
:mod:`reshard.io.writer`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

from .budget import COLUMN_WRITES, DEFAULT_BUFFER, RELEASE_EVERY
from .bulk import Geometries, shared_sources
from .checkpoint import TensorSource
from .dtypes import DTYPE_SIZES
from .intervals import block_shape, clip_box, row_major_strides, slabs
from .io import checksum
from .io.pages import PageWindow, Seen, SourceFiles
from .io.reader import (
    DENSE,
    SPAN,
    SPAN_SLOTS,
    WINDOW,
    RowCache,
    Run,
    Span,
    Spans,
    Windows,
    read_box,
    slab_items,
    uint_dtype,
)
from .io.views import open_piece
from .io.writer import FileResult, Sink, TmpFile
from .plan import Copy, OutEntry, OutFile, Plan, TargetTensor, copy_boxes
from .transform_plan import piece_strides

__all__ = [
    "ProgressFn",
    "execute_plan",
    "GROUP_FILES",
    "Run",
    "Span",
    "entry_runs",
    "interleaved",
]

ProgressFn = Callable[[int], None]

T = TypeVar("T")

GROUP_FILES = 64
"""Files one thread writes in lockstep: enough for the ranks that split one source row
between them to share its read (at 8, HF -> TP-64 read each column-sharded tensor 8 times:
8.1 GB of source for a 2 GB model), few enough to keep open files and headers modest."""


class _Buffers:
    """One thread's buffers, shared by the writers it runs in lockstep (one at a time)."""

    def __init__(self, budget: int, sources: SourceFiles, window: int) -> None:
        budget = max(budget, 16)  # at least one item of the widest dtype (C64, F64: 8 bytes)
        self.budget = budget
        self.write = bytearray(budget)
        self.partials: list[bytearray] = []  # slabs of Partial groups 1.. (group 0: the write buffer)
        self._rows: RowCache | None = None
        self.pages = PageWindow(sources, window)  # one for all its writers, so bounded
        self.windows = Windows(sources, _WINDOW)  # short reads, shared by its writers too
        self.spans = Spans(sources, _SPAN)  # the column path's reads (its scratch made when first used)
        self._columns = bytearray(0)

    @property
    def rows(self) -> RowCache:
        """Source spans read whole (at most DENSE times what a slab uses; made when first used)."""
        if self._rows is None:
            self._rows = RowCache(DENSE * self.budget + 64)
        return self._rows

    def columns(self, size: int) -> bytearray:
        """The column path's buffer, at least ``size`` bytes (at most :data:`COLUMN_WRITES` write
        buffers; made when first used, as large as asked)."""
        if len(self._columns) < size:
            self._columns = bytearray(max(size, min(2 * len(self._columns), COLUMN_WRITES * self.budget)))
        return self._columns

    def slab_buffers(self, groups: int) -> list[bytearray]:
        """One slab buffer per Partial group; group 0 gathers straight into the write buffer."""
        while len(self.partials) < groups - 1:
            self.partials.append(bytearray(self.budget))
        return [self.write, *self.partials[: groups - 1]]


_WIDE = 8
"""A tensor's copies into one target piece from at least this many source pieces take the
large slabs of :meth:`_Writer._gather`."""


def _contiguous(shape: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether a box is one contiguous run of a row-major array of ``shape``."""
    k = len(shape) - 1
    while k > 0 and starts[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    return all(s == 1 for s in sizes[:k])


def _box_offset(shape: Sequence[int], starts: Sequence[int]) -> int:
    return sum(s * st for s, st in zip(starts, row_major_strides(shape)))


_REGROW = 8
"""Batches in a row that fit under a cap :meth:`_Writer._batches` set after a refusal before
it tries twice as many entries again."""

_STRIDED_MAX = 65536
"""Strided boxes up to this many bytes are copied as rows from the map (one numpy copy each),
with the queue; larger ones are gathered slab by slab (whole rows read once, shared by the
sibling files written in lockstep)."""

_RUNS: dict[tuple[int, int, int], tuple[object, object, tuple[Run, ...] | None]] = {}


def entry_runs(src: TensorSource, copies: tuple[Copy, ...], isz: int) -> tuple[Run, ...] | None:
    """An entry's copies as runs of rows in target order, or None if a box needs gathering.

    Shared by every tensor of one geometry: the planner hands them the same ``copies``
    tuple and the readers the same ``piece_blocks`` tuple, so the cache is keyed by their
    identity (and holds them, so the identities stay theirs). A 100k-tensor checkpoint
    then costs one dict lookup per entry instead of box arithmetic.
    """
    key = (id(copies), id(src.piece_blocks), isz)
    hit = _RUNS.get(key)
    if hit is None:
        if len(_RUNS) > 65536:
            _RUNS.clear()
        hit = _RUNS[key] = (copies, src.piece_blocks, _runs(src, copies, isz))
    return hit[2]


def _dense(strides: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether a box of a piece with element ``strides`` is one contiguous run in the box's own
    row-major order (a transposed view's box is not, even when its elements are contiguous)."""
    want = 1
    for st, z in zip(reversed(strides), reversed(sizes)):
        if z == 1:
            continue
        if st != want:
            return False
        want *= z
    return True


def _runs(src: TensorSource, copies: Sequence[Copy], isz: int) -> tuple[Run, ...] | None:
    # the target block's shape: the copies cover it exactly (the planner checked)
    ndim = len(copies[0].segments) if copies else 0
    dshape = tuple(max(s[1] + s[2] for c in copies for s in c.segments[d]) for d in range(ndim))
    runs: list[Run] = []
    for c in copies:
        sstrides = piece_strides(src, c.piece)  # a transform's view may be strided
        if sstrides is None:
            return None  # zeros: gathered
        sshape = src.piece_shape(c.piece)
        for s_st, d_st, sz in copy_boxes(c):
            if sstrides != row_major_strides(sshape):  # a transform's view: contiguous runs only
                if not (_dense(sstrides, sz) and _contiguous(dshape, d_st, sz)):
                    return None
                s_off = sum(a * st for a, st in zip(s_st, sstrides)) * isz
                runs.append((_box_offset(dshape, d_st) * isz, c.piece, s_off, isz * _prod(sz), 1, 0, 0))
                continue
            run = _box_run(sshape, dshape, s_st, d_st, sz, isz)
            if run is None:
                return None
            runs.append((run[0], c.piece, *run[1:]))
    runs.sort()
    if interleaved(runs) and isz * _prod(dshape) > _STRIDED_MAX:
        return None
    merged: list[Run] = []
    for r in runs:
        if merged:
            d, k, s, n, rows, _, _ = merged[-1]
            if rows == 1 and r[4] == 1 and k == r[1] and d + n == r[0] and s + n == r[2]:
                merged[-1] = (d, k, s, n + r[3], 1, 0, 0)
                continue
        merged.append(r)
    return tuple(_progressions(merged))


_AHEAD = 8
"""How many runs after a row :func:`_progressions` looks among for the next row of its progression."""


def _progressions(runs: list[Run]) -> list[Run]:
    """One-row runs that are arithmetic progressions on both sides as strided runs, in target
    order: a RoPE permutation's rows (every second target row from consecutive source rows,
    two progressions a head) are a few runs a block, not one a row.

    A row's next one is looked for among the :data:`_AHEAD` runs after it, the longest
    progression taken; rows apart by less than their size on either side are left alone.

    >>> rows = [(0, 0, 0, 4, 1, 0, 0), (4, 0, 32, 4, 1, 0, 0), (8, 0, 4, 4, 1, 0, 0),
    ...         (12, 0, 36, 4, 1, 0, 0), (16, 0, 8, 4, 1, 0, 0), (20, 0, 40, 4, 1, 0, 0)]
    >>> _progressions(rows)
    [(0, 0, 0, 4, 3, 4, 8), (4, 0, 32, 4, 3, 4, 8)]
    """
    if len(runs) < 3:
        return runs
    where = {(r[1], r[0], r[2], r[3]): i for i, r in enumerate(runs) if r[4] == 1}
    used = bytearray(len(runs))
    out: list[Run] = []
    for i, r in enumerate(runs):
        if used[i]:
            continue
        used[i] = 1
        d, k, s, n, rows = r[:5]
        best: tuple[int, int, int, list[int]] = (1, 0, 0, [])
        for j in range(i + 1, min(i + 1 + _AHEAD, len(runs)) if rows == 1 else i + 1):
            q = runs[j]
            dd, dsrc = q[0] - d, q[2] - s
            if used[j] or q[4] != 1 or q[1] != k or q[3] != n or dd < n or dsrc < n:
                continue
            members, m = [j], 2
            while True:
                x = where.get((k, d + m * dd, s + m * dsrc, n))
                if x is None or used[x]:
                    break
                members.append(x)
                m += 1
            if m > best[0]:
                best = (m, dd, dsrc, members)
        m, dd, dsrc, members = best
        if m < 3:
            out.append(r)
            continue
        for x in members:
            used[x] = 1
        out.append((d, k, s, n, m, dsrc, dd))
    out.sort()
    return out


def closed_chunks(runs: tuple[Run, ...], nbytes: int, cap: int) -> tuple[Chunk, ...] | None:
    """An entry of ``nbytes`` whose runs interleave, as consecutive target ranges of at most
    ``cap`` bytes made of whole rows (a contiguous run may be cut anywhere), each
    ``(offset, its runs from there, bytes)``; None when a strided row is larger than ``cap``.
    Cached like :func:`entry_runs` (by the runs' identity, held)."""
    key = (id(runs), nbytes, cap)
    hit = _CHUNKS.get(key)
    if hit is None:
        if len(_CHUNKS) > 4096:
            _CHUNKS.clear()
        hit = _CHUNKS[key] = (runs, _chunks(runs, nbytes, cap))
    return hit[1]


Chunk = tuple[int, tuple[Run, ...], int]
_CHUNKS: dict[tuple[int, int, int], tuple[object, tuple[Chunk, ...] | None]] = {}


def _chunks(runs: Sequence[Run], nbytes: int, cap: int) -> tuple[Chunk, ...] | None:
    import bisect

    spans = sorted(
        (d + j * ds, n, rows == 1) for d, _, _, n, rows, _, ds in runs for j in range(rows)
    )  # the runs tile the entry: each span starts where the one before ends
    cuts, c = [0], 0
    for a, n, whole in spans:
        if a + n - c <= cap:
            continue
        if a > c:
            cuts.append(a)
            c = a
        if n > cap:
            if not whole:
                return None
            while a + n - c > cap:
                c += cap
                cuts.append(c)
    cuts.append(nbytes)
    parts: list[list[Run]] = [[] for _ in range(len(cuts) - 1)]
    for d, k, s, n, rows, ss, ds in runs:
        if rows == 1:
            for ci in range(bisect.bisect_right(cuts, d) - 1, bisect.bisect_left(cuts, d + n)):
                a, b = max(d, cuts[ci]), min(d + n, cuts[ci + 1])
                parts[ci].append((a - cuts[ci], k, s + a - d, b - a, 1, 0, 0))
            continue
        last = d + (rows - 1) * ds
        for ci in range(bisect.bisect_right(cuts, d) - 1, bisect.bisect_right(cuts, last)):
            j0 = max(0, -(-(cuts[ci] - d) // ds))
            j1 = min(rows, -(-(cuts[ci + 1] - d) // ds))
            if j1 > j0:
                sub = (ss, ds) if j1 - j0 > 1 else (0, 0)
                parts[ci].append((d + j0 * ds - cuts[ci], k, s + j0 * ss, n, j1 - j0, *sub))
    return tuple((cuts[i], tuple(sorted(p)), cuts[i + 1] - cuts[i]) for i, p in enumerate(parts))


def interleaved(runs: Sequence[Run]) -> bool:
    """Whether some run's rows are not back to back in the target (the runs then interleave)."""
    return any(r[4] > 1 and r[6] != r[3] for r in runs)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _rows(
    shape: Sequence[int], st: Sequence[int], sz: Sequence[int], isz: int
) -> tuple[int, int, int] | None:
    """A box of a row-major array as (bytes per row, rows, stride): runs of whole inner dims and
    part of one more, along at most one outer dim; None when it takes two outer dims."""
    k = len(sz) - 1
    while k > 0 and st[k] == 0 and sz[k] == shape[k]:
        k -= 1  # dims k+1.. are whole: a row runs over them and part of dim k
    outer = [j for j in range(k) if sz[j] != 1]
    n = isz * _prod(sz[k:])
    if not outer:
        return n, 1, 0
    if len(outer) > 1:
        return None
    return n, sz[outer[0]], row_major_strides(shape)[outer[0]] * isz


def _box_run(
    sshape: tuple[int, ...],
    dshape: tuple[int, ...],
    s_st: tuple[int, ...],
    d_st: tuple[int, ...],
    sz: tuple[int, ...],
    isz: int,
) -> tuple[int, int, int, int, int, int] | None:
    """A box as (target offset, source offset, bytes per row, rows, source stride, target stride).

    Contiguous on both sides: one row. Rows along one outer dim on either side (a column
    slice of a small matrix read, or written): strided rows, up to :data:`_STRIDED_MAX`
    bytes. Anything else is gathered.
    """
    src, dst = _rows(sshape, s_st, sz, isz), _rows(dshape, d_st, sz, isz)
    if src is None or dst is None:
        return None
    d_off, s_off = _box_offset(dshape, d_st) * isz, _box_offset(sshape, s_st) * isz
    if src[1] == 1 and dst[1] == 1:
        return d_off, s_off, src[0], 1, 0, 0
    if isz * _prod(sz) > _STRIDED_MAX:
        return None
    if src[1] == 1:  # contiguous in the source: rows of the target's width
        src = (dst[0], dst[1], dst[0])
    elif dst[1] == 1:
        dst = (src[0], src[1], src[0])
    if src[:2] != dst[:2]:
        return None
    return d_off, s_off, src[0], src[1], src[2], dst[2]


_WINDOW = WINDOW  # module names, so tests can change them
_SPAN = SPAN


class _Writer:
    """Writes the entries of one output file (or a consecutive run of them).

    Contiguous runs that land next to each other in the file are queued and written
    together (:meth:`_flush`): one ``pwrite`` per buffer, however small the tensors.
    """

    def __init__(
        self,
        sources: SourceFiles,
        fd: int,
        bufs: _Buffers,
        progress: ProgressFn | None,
        stop: threading.Event,
        lo: int = 0,
    ) -> None:
        self.sources = sources
        self.stop = stop
        self.bufs = bufs
        self.progress = progress
        self.bytes_read = 0
        self.sink = Sink(fd, lo)
        self.crc32s: dict[int, int] = {}
        self._queued: list[int] = []  # single runs whose bytes go back to back: 7 ints a Span
        self._groups: dict[int, list[Any]] = {}  # entries by geometry: id(runs) -> [runs, positions, srcs]
        self._q_start = 0  # file offset of the first queued byte
        self._q_end = -1  # one past the last
        self.order: _Order | None = None  # the plan's tensor order (lockstep siblings: _write_group)
        self.at = (-1, 0)  # (tensor in plan order, slab) of the last step: see _write_group

    def _place(self, t: TargetTensor) -> int:
        """``t``'s place in the plan, for :attr:`at` (the last one's when there is no order)."""
        return self.at[0] if self.order is None else self.order.get(t, self.at[0])

    def file_steps(
        self, f: OutFile, items: Iterable[tuple[int, bytes] | tuple[int, OutEntry]]
    ) -> Iterator[None]:
        """Write ``items`` (fixed bytes and entries, in file order), yielding after each slab."""
        crcs, keep = f.needs_crc32, _patches(f)
        for i, item in items:
            _check(self.stop)
            if isinstance(item, bytes):
                self._flush()
                self.sink.submit(item, i)
                continue
            if crcs:
                self._flush()
                self.sink.start_crc(f.head_bytes)
            yield from self.entry_steps(item)
            if crcs:
                self._flush()
                crc, head = self.sink.end_crc()
                if keep:
                    self.crc32s[i] = crc
                tail = f.trailer(i, crc, head)
                if tail:
                    self.sink.submit(tail, item.start + item.nbytes)
        self._flush()

    def column_steps(self, f: OutFile, geos: Geometries, first: int = 0, stop: int = -1) -> Iterator[None]:
        """:meth:`file_steps` for a file whose entries come as columns and whose fixed bytes all
        precede them (safetensors): items ``first`` to ``stop`` (-1: the end) of
        :func:`_in_file_order`, a buffer of back-to-back entries at a time, each geometry's
        entries in it moved with a few numpy copies (:meth:`Spans.gather`);
        entries that are not plain runs, or larger than the buffer, go the per-entry way."""
        import numpy as np

        lay = f.layout
        fixed = lay.fixed
        tensors, rank, base, starts, sizes = lay.entries.columns()  # type: ignore[attr-defined]
        count = len(sizes)
        stop = len(fixed) + count if stop < 0 else stop
        for i in range(first, min(stop, len(fixed))):
            self.sink.submit(fixed[i][1], fixed[i][0])
        lo, hi = max(0, first - len(fixed)), max(0, stop - len(fixed))
        if hi <= lo:
            return
        cap = self.bufs.budget
        most = COLUMN_WRITES * cap
        st = np.frombuffer(starts, dtype=np.int64, count=count)  # views: nothing per entry is kept
        sz = np.frombuffer(sizes, dtype=np.int64, count=count)
        plain = _plain_runs(geos, rank)
        bad = np.flatnonzero(~plain[geos.group] | (sz > cap))  # entries that go the per-entry way
        gaps = np.flatnonzero(st[1:] != st[:-1] + sz[:-1]) + 1  # entries not right after the previous
        ends = np.union1d(bad, gaps)  # where a buffer must end

        def alone(i: int) -> Iterator[None]:
            if sz[i]:
                yield from self.entry_steps(OutEntry(tensors[i], rank, base + int(st[i]), int(sz[i])))

        def batch_end(i: int, b: int) -> int:
            limit = int(st[i]) + most
            j = int(np.searchsorted(st, limit, "right"))
            if st[j - 1] + sz[j - 1] > limit:
                j -= 1
            k = int(np.searchsorted(ends, i, "right"))
            return min(j, hi, int(ends[k]) if k < len(ends) else hi)

        def copy(i: int, j: int) -> bool:
            return self._copy_columns(geos, rank, st, base, i, j, int(st[j - 1] + sz[j - 1] - st[i]))

        yield from self._batches(tensors, lo, hi, bad, alone, batch_end, copy)

    def _batches(
        self,
        tensors: Sequence[TargetTensor],
        lo: int,
        hi: int,
        bad: Any,
        alone: Callable[[int], Iterator[None]],
        batch_end: Callable[[int, int], int],
        copy: Callable[[int, int], bool],
    ) -> Iterator[None]:
        """Entries ``lo`` to ``hi`` a buffer at a time, yielding after each buffer: the entries in
        ``bad`` (sorted) one by one with ``alone(i)``, the others in batches ``[i, j)`` (``j`` at
        most ``batch_end(i, b)``, ``b`` where ``i`` would sit in ``bad``) with ``copy(i, j)``,
        halved while it refuses (its reads would not stay for the siblings). A batch that had
        to be halved caps the next ones at its size (the next entries are most often alike: a
        refusal gathers nothing but costs as much to find), lifted again after
        :data:`_REGROW` batches that fit."""
        import numpy as np

        i = lo
        cap, fits = hi - lo, 0  # entries a batch may take; batches in a row that fit in it
        while i < hi:
            _check(self.stop)
            b = int(np.searchsorted(bad, i))
            if b < len(bad) and bad[b] == i:
                yield from alone(i)
                i += 1
                continue
            j = max(i + 1, min(batch_end(i, b), i + cap))
            self._flush()
            halved = False
            while not copy(i, j):
                j, halved = i + (j - i) // 2, True
            if halved:
                cap, fits = j - i, 0
            elif j - i == cap:
                fits += 1
                if fits >= _REGROW:
                    cap, fits = 2 * cap, 0
            self.at = (self._place(tensors[j - 1]), 0)
            yield
            i = j
        self._flush()

    def _copy_columns(
        self, geos: Geometries, rank: int, st: Any, base: int, i: int, j: int, size: int
    ) -> bool:
        """Write entries ``i`` to ``j`` (at ``base + st[...]``, back to back, plain runs, ``size``
        bytes in all) through the column buffer: per geometry and run, the pieces of each
        source file in one call.

        False (nothing written) when the spans they read would not all stay for the sibling
        files written next in lockstep (more than the slots), and there are entries to spare.
        """
        bufs = self.bufs
        buf = bufs.columns(size)
        s0 = int(st[i])
        q0 = base + s0
        if not self._gather_columns(geos, rank, st, s0, i, j, buf):
            return False
        out = memoryview(buf)
        step = bufs.budget
        for a in range(0, size, step):
            self.sink.submit(out[a : min(size, a + step)], q0 + a)
        self.bytes_read += size
        if self.progress:
            self.progress(size)
        return True

    def _gather_columns(
        self, geos: Geometries, rank: int, st: Any, s0: int, i: int, j: int, buf: Any
    ) -> bool:
        """Entries ``i`` to ``j`` (plain runs) into ``buf``, entry ``k`` at ``st[k] - s0``: per
        geometry and run, the pieces of each source file in one call. False (nothing read) when
        their spans would not all stay for lockstep siblings (more than the slots), and there
        are entries to spare."""
        import numpy as np

        bufs = self.bufs
        gs = geos.group[i:j]
        if gs.min() == gs.max():
            parts = [(int(gs[0]), np.arange(i, j))]
        else:
            order = np.argsort(gs, kind="stable")
            ordered = gs[order]
            cuts = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), len(order)]
            idx = order + i
            parts = [(int(ordered[a]), idx[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        jobs = []
        for g, idx in parts:
            runs = geos.runs(g, rank)
            assert runs is not None
            rows_of = geos.row[idx]
            at = st[idx] - s0
            for d, k, s, n, rows, ss, ds in runs:
                fi, offs = geos.column(g, k)
                lo = offs[rows_of] + s
                pos = at + d
                if isinstance(fi, int):
                    jobs.append((fi, lo, pos, n, rows, ss, ds))
                else:
                    files = fi[rows_of]
                    for one in np.unique(files).tolist():
                        sel = files == one
                        jobs.append((one, lo[sel], pos[sel], n, rows, ss, ds))
        # the windows siblings read too must all stay (else nothing is read)
        return bufs.spans.gather(jobs, buf, check=j - i > 1)

    def chunk_steps(self, f: OutFile, geos: Geometries, first: int = 0, stop: int = -1) -> Iterator[None]:
        """:meth:`file_steps` for a file of archives, each its fixed bytes, an entry and a trailer
        made from the entry's CRC32 (DCP, :meth:`OutFile.trailer`): items ``first`` to ``stop``
        (even: an archive's first item) of :func:`_in_file_order`, whole archives a buffer at a
        time, their entries gathered as :meth:`column_steps` does, then each one's prefix, CRC32
        and trailer put around it in the buffer. Archives larger than the buffer, or whose entry
        is not plain runs, go the per-entry way."""
        import numpy as np

        lay = f.layout
        tensors, rank, base, starts, sizes = lay.entries.columns()  # type: ignore[attr-defined]
        arcs, archives = f.chunk_columns()  # type: ignore[attr-defined]
        count = len(sizes)
        lo, hi = first // 2, count if stop < 0 else stop // 2
        most = COLUMN_WRITES * self.bufs.budget
        st = np.frombuffer(starts, dtype=np.int64, count=count)
        sz = np.frombuffer(sizes, dtype=np.int64, count=count)
        ast = np.frombuffer(arcs, dtype=np.int64, count=count)
        ends = np.append(ast[1:], f.size)  # each archive's end: the next one's start
        plain = _plain_runs(geos, rank)
        bad = np.flatnonzero(~plain[geos.group] | (ends - ast > most))

        def alone(i: int) -> Iterator[None]:
            self._flush()
            e = OutEntry(tensors[i], rank, base + int(st[i]), int(sz[i]))
            yield from self.file_steps(f, iter([(int(ast[i]), archives[i].prefix), (i, e)]))

        def batch_end(i: int, b: int) -> int:
            j = int(np.searchsorted(ends, ast[i] + most, "right"))
            return min(j, hi, int(bad[b]) if b < len(bad) else hi)

        def copy(i: int, j: int) -> bool:
            return self._copy_chunks(f, geos, rank, base, st, sz, ast, ends, archives, i, j)

        yield from self._batches(tensors, lo, hi, bad, alone, batch_end, copy)

    def _copy_chunks(
        self,
        f: OutFile,
        geos: Geometries,
        rank: int,
        base: int,
        st: Any,
        sz: Any,
        ast: Any,
        ends: Any,
        archives: Sequence[Any],
        i: int,
        j: int,
    ) -> bool:
        """Write archives ``i`` to ``j`` through the column buffer (see :meth:`chunk_steps`)."""
        lo = int(ast[i])
        size = int(ends[j - 1]) - lo
        buf = self.bufs.columns(size)
        if not self._gather_columns(geos, rank, st, lo - base, i, j, buf):
            return False
        out = memoryview(buf)
        want = f.head_bytes
        keep = _patches(f)
        for k, a, d, n, e in zip(
            range(i, j), (ast[i:j] - lo).tolist(), (st[i:j] + base - lo).tolist(), sz[i:j].tolist(),
            (ends[i:j] - lo).tolist(),
        ):  # fmt: skip
            arc = archives[k]
            p = arc.prefix
            out[a : a + len(p)] = p
            data = out[d : d + n]
            crc = checksum.crc32(data, 0)
            if keep:
                self.crc32s[k] = crc
            tail = arc.trailer(crc, bytes(data[:want]))  # f.trailer(k, ...), without finding it
            if d + n + len(tail) != e:
                raise AssertionError(
                    f"{f.name}: archive {k} is laid out {d + n + len(tail) - a} bytes, not {e - a}"
                )
            out[d + n : e] = tail
        step = self.bufs.budget
        for a in range(0, size, step):
            self.sink.submit(out[a : min(size, a + step)], lo + a)
        nbytes = int(sz[i:j].sum())
        self.bytes_read += nbytes
        if self.progress:
            self.progress(nbytes)
        return True

    def entry_steps(self, e: OutEntry) -> Iterator[None]:
        """Write one entry, yielding after each slab (so sibling files can go in lockstep)."""
        if e.nbytes == 0:
            return
        runs = self._runs(e)
        if runs is not None and e.nbytes > self.bufs.budget and interleaved(runs):
            chunks = closed_chunks(runs, e.nbytes, self.bufs.budget)
            if chunks is not None:  # a RoPE permutation's block: buffers of whole rows
                for at, part, n in chunks:
                    if self._queue(e.start + at, e.tensor.src, part, n):
                        self.at = (self._place(e.tensor), 0)
                        yield
                return
            runs = None
        if runs is not None and (e.nbytes <= self.bufs.budget or not interleaved(runs)):
            if self._queue(e.start, e.tensor.src, runs, e.nbytes):
                self.at = (self._place(e.tensor), 0)
                yield
            return
        self._flush()
        t = e.tensor
        yield from self._gather(e, t.copies[e.rank], block_shape(t.layout.blocks()[e.rank]))

    @staticmethod
    def _runs(e: OutEntry) -> tuple[Run, ...] | None:
        """The entry's runs, or None when it needs gathering (strided, cast, reduced)."""
        t = e.tensor
        src = t.src
        if t.groups != 1 or t.dtype != src.dtype:
            return None
        return entry_runs(src, t.copies[e.rank], DTYPE_SIZES[src.dtype])

    def _queue(self, start: int, src: TensorSource, runs: Sequence[Run], nbytes: int) -> bool:
        """Queue an entry's runs (interleaved ones only when the entry fits in the buffer);
        True if the queue was written on the way."""
        cap = self.bufs.budget
        flushed = False
        if start != self._q_end or start + nbytes - self._q_start > cap:
            if self._q_end >= 0:
                self._flush()
                flushed = True
            if nbytes > cap:  # run by run (back to back in the target: not interleaved)
                files, offsets = src.piece_files, src.piece_offsets
                for d, k, s, n, rows, ss, _ in runs:
                    flushed = self._queue_run(start + d, files[k], offsets[k] + s, n, rows, ss) or flushed
                return flushed
            self._q_start = start
        self._add(start, src, runs, nbytes)
        return flushed

    def _add(self, start: int, src: TensorSource, runs: Sequence[Run], nbytes: int) -> None:
        """Queue an entry that extends the queue, with the queued entries of its geometry."""
        g = self._groups.get(id(runs))
        if g is None:
            g = self._groups[id(runs)] = [runs, [], []]
        g[1].append(start - self._q_start)
        g[2].append(src)
        self._q_end = start + nbytes

    def _queue_run(self, at: int, fi: int, lo: int, n: int, rows: int, ss: int) -> bool:
        """Queue ``rows`` rows of ``n`` bytes for target offset ``at`` (split when larger than the
        buffer; one contiguous run larger than it is copied through it); True if written on the way."""
        cap = self.bufs.budget
        size = n * rows
        flushed = False
        if at != self._q_end or at + size - self._q_start > cap:
            if self._q_end >= 0:
                self._flush()
                flushed = True
            if size > cap and rows == 1:
                self._copy_run(fi, lo, at, size)
                return True  # siblings take their turn: each source file read in order
            if size > cap:  # strided, larger than the buffer: in groups of rows
                per = max(1, cap // n)
                for j in range(0, rows, per):
                    flushed = (
                        self._queue_run(at + j * n, fi, lo + j * ss, n, min(per, rows - j), ss) or flushed
                    )
                return flushed
            self._q_start = at
        self._queued += (fi, lo, n, rows, ss, at - self._q_start, n)
        self._q_end = at + size
        return flushed

    def _flush(self) -> None:
        """Gather the queued runs into the write buffer and write them with one ``pwrite``."""
        if self._q_end < 0:
            return
        buf = self.bufs.write
        size = self._q_end - self._q_start
        windows = self.bufs.windows
        windows.gather(self._queued, buf)
        windows.gather_groups(self._groups.values(), buf)
        self.sink.submit(memoryview(buf)[:size], self._q_start)
        self.bytes_read += size
        if self.progress:
            self.progress(size)
        self._queued.clear()
        self._groups.clear()
        self._q_end = -1

    def _copy_run(self, fi: int, src_off: int, dst_off: int, n: int) -> None:
        """Copy one contiguous run through the write buffer (hashed on the way)."""
        buf = memoryview(self.bufs.write)
        size = len(buf)
        self.bytes_read += n
        while n > 0:
            _check(self.stop)
            k = min(size, n)
            self.sources.pread(fi, buf[:k], src_off)
            self.sink.submit(buf[:k], dst_off)
            if self.progress:
                self.progress(k)
            n -= k
            src_off += k
            dst_off += k

    def _gather(self, e: OutEntry, copies: Sequence[Copy], dshape: tuple[int, ...]) -> Iterator[None]:
        import numpy as np

        t = e.tensor
        src = t.src
        s_isz = DTYPE_SIZES[src.dtype]
        d_isz = DTYPE_SIZES[t.dtype]
        # many pieces a slab (a column-split tensor consolidated from 64 ranks: a read_box and a
        # pread per piece and slab): slabs as large as the column path's buffer, written in
        # budget-sized pieces, so the Python work per piece is spread over 4x the bytes
        wide = t.groups == 1 and t.dtype == src.dtype and len(copies) >= _WIDE
        budget_items = max(1, self.bufs.budget * (COLUMN_WRITES if wide else 1) // max(s_isz, d_isz))
        pages, rows = self.bufs.pages, self.bufs.rows
        plans = [(c.group, open_piece(self.sources, src, c.piece, mapped=False), c) for c in copies]
        boxes = {id(c): list(copy_boxes(c)) for c in copies}
        npt = uint_dtype(s_isz)
        cap = len(rows.buf)  # slabs whose source rows fit the row cache, so siblings share them
        for _, p, c in plans:
            if p is not None and p.arr is None:
                budget_items = min([budget_items] + [slab_items(p, st, z, cap) for st, _, z in boxes[id(c)]])
        ti = self._place(t)
        for k, slab in enumerate(slabs(dshape, 1, budget_items)):
            _check(self.stop)
            self.at = (ti, k)
            shape = tuple(b - a for a, b in slab)
            n = 1
            for x in shape:
                n *= x
            bufs = [self.bufs.columns(n * s_isz)] if wide else self.bufs.slab_buffers(t.groups)
            views = [np.frombuffer(b, dtype=npt, count=n).reshape(shape) for b in bufs]
            for g, piece, c in plans:
                for s_st, d_st, sz in boxes[id(c)]:
                    clipped = clip_box(slab, s_st, d_st, sz)
                    if clipped is not None:
                        if piece is None:  # a transform's zero part (padding)
                            views[g][clipped[1]] = 0
                            continue
                        # a transform's view (any strides) is read through the map; the rest by pread
                        part = read_box(pages, piece, clipped[0], rows if piece.arr is None else None)
                        views[g][clipped[1]] = part
                        self.bytes_read += part.nbytes
            off = e.start + _box_offset(dshape, tuple(a for a, _ in slab)) * d_isz
            out: Any = bufs[0] if t.groups == 1 and t.dtype == src.dtype else self._transform(t, views, n)
            mv, step = memoryview(out)[: n * d_isz], self.bufs.budget
            for a in range(0, len(mv), step):  # writes of the buffer size are the fast ones here
                self.sink.submit(mv[a : a + step], off + a)
            if self.progress:
                self.progress(n * d_isz)
            del views
            yield
        del plans
        pages.release()

    @staticmethod
    def _transform(t: Any, views: list[Any], n: int) -> Any:
        from .torch_ops import cast_reduce

        return cast_reduce(views, t.src.dtype, t.dtype, t.reduce_op, n)


def _in_file_order(f: OutFile) -> Iterator[tuple[int, bytes] | tuple[int, OutEntry]]:
    """The file's fixed byte runs ``(offset, bytes)`` and entries ``(index, entry)``, in file order
    (made as they are consumed: a 100k-tensor file's list of items is not held)."""
    lay = f.layout
    fixed = lay.fixed
    entries = lay.entries
    j = 0
    if entries and all(off + len(b) <= entries[0].start for off, b in fixed):  # headers only
        yield from fixed
        yield from enumerate(entries)
        return
    for i, e in enumerate(entries):
        while j < len(fixed) and fixed[j][0] <= e.start:
            yield fixed[j]
            j += 1
        yield i, e
    yield from fixed[j:]


def _split_items(
    items: Iterable[tuple[int, bytes] | tuple[int, OutEntry]], total: int, parts: int
) -> list[tuple[int, int, int]]:
    """Consecutive runs of a file's items with about equal entry bytes (``total`` in all): each
    run's first byte offset and its first and stop item positions.

    A run starts at an entry or at the fixed bytes just before it, so each run is a
    consecutive byte range written in order (and hashed on the way). Positions, not items:
    a 200k-tensor file's items made once at a time (held, they were 37 MiB).
    """
    if parts <= 1 or total == 0:
        return [(0, 0, -1)]
    out: list[list[int]] = [[0, 0, -1]]
    acc = 0
    pending: tuple[int, int] | None = None  # the first fixed run since the last entry: offset, position
    for n, (i, it) in enumerate(items):
        if not isinstance(it, OutEntry):
            if pending is None:
                pending = (i, n)
            continue
        if n > out[-1][1] and acc >= total * len(out) / parts and len(out) < parts:
            lo, first = pending if pending is not None else (it.start, n)
            out[-1][2] = first
            out.append([lo, first, -1])
        pending = None
        acc += it.nbytes
    return [(lo, a, b) for lo, a, b in out]


def _plain_runs(geos: Geometries, rank: int) -> Any:
    """Per geometry, whether rank ``rank``'s block of it is plain runs (the column paths copy those)."""
    import numpy as np

    return np.array([geos.runs(g, rank) is not None for g in range(len(geos.firsts))], dtype=bool)


def _patches(f: OutFile) -> bool:
    """Whether ``f`` writes bytes from its entries' CRC32s once they are all known (its own
    :meth:`OutFile.finish`): only then are they kept (a DCP file's 800k chunks put theirs in
    their trailers as they go)."""
    return type(f).finish is not OutFile.finish


class _GeometriesOf:
    """The :class:`~reshard.bulk.Geometries` of each tensor list whose files are written by
    columns, made once for the sibling files that share the list (held for the run)."""

    def __init__(self, tensors: Sequence[TargetTensor] = ()) -> None:
        self._made: dict[int, tuple[Sequence[TargetTensor], Geometries]] = {}
        self._lock = threading.Lock()
        self._tensors = tensors
        self._order: _Order | None = None

    def order(self) -> _Order:
        """The planned tensors' order (made once, on first use)."""
        with self._lock:
            if self._order is None:
                self._order = _Order(self._tensors)
            return self._order

    def of(self, f: OutFile) -> Geometries | None:
        """The geometries of ``f``'s tensor list, or None when ``f`` is not written by columns
        (no columns, CRC32s to compute, or fixed bytes between its entries)."""
        lay = f.layout
        columns = getattr(lay.entries, "columns", None)
        if columns is None or f.needs_crc32:
            return None
        tensors, _, base, starts, _ = columns()
        if starts and any(off + len(b) > base + starts[0] for off, b in lay.fixed):
            return None
        return self._of(tensors)

    def of_chunks(self, f: OutFile) -> Geometries | None:
        """The geometries of ``f``'s tensor list when ``f`` is archives written by columns
        (:meth:`_Writer.chunk_steps`: entries as columns, each archive's fixed bytes and trailer)."""
        columns = getattr(f.layout.entries, "columns", None)
        if columns is None or not f.needs_crc32 or not hasattr(f, "chunk_columns"):
            return None
        return self._of(columns()[0])

    def _of(self, tensors: Sequence[TargetTensor]) -> Geometries:
        with self._lock:
            hit = self._made.get(id(tensors))
            if hit is None or hit[0] is not tensors:
                hit = self._made[id(tensors)] = (tensors, Geometries(tensors, entry_runs))
            return hit[1]


class _Order:
    """Each planned tensor's place in the plan, found by ``id``: two arrays, not a dict (at 200k
    tensors a dict of them is 20 MiB, the arrays 3 MiB); looked up once a step, not an entry."""

    def __init__(self, tensors: Sequence[TargetTensor]) -> None:
        import numpy as np

        ids = np.fromiter(map(id, tensors), dtype=np.int64, count=len(tensors))
        self._by_id = np.argsort(ids, kind="stable")
        self._ids = ids[self._by_id]
        self._key = np.int64  # searched as the array's own type: a Python int made numpy convert it whole

    def get(self, t: object, default: int) -> int:
        """``t``'s place in the plan, or ``default`` for a tensor not in it."""
        key = id(t)
        i = int(self._ids.searchsorted(self._key(key)))
        return int(self._by_id[i]) if i < len(self._ids) and int(self._ids[i]) == key else default


def _steps(w: _Writer, f: OutFile, geos: _GeometriesOf, first: int = 0, stop: int = -1) -> Iterator[None]:
    """Writer ``w``'s steps for items ``first`` to ``stop`` (-1: the end) of file ``f``: by columns
    where it can, else entry by entry."""
    g = geos.of(f)
    if g is not None:
        return w.column_steps(f, g, first, stop)
    g = geos.of_chunks(f)
    if g is not None and first % 2 == 0 and (stop < 0 or stop % 2 == 0):  # whole archives
        return w.chunk_steps(f, g, first, stop)
    return w.file_steps(f, _items_of(f, first, stop))


def _split_columns(f: OutFile, parts: int) -> list[tuple[int, int, int]]:
    """:func:`_split_items` of a file written by columns (its fixed bytes all first)."""
    _, _, base, starts, _ = f.layout.entries.columns()  # type: ignore[attr-defined]
    fixed = len(f.layout.fixed)
    return _split_at_entries(f, parts, lambda m: (base + starts[m], fixed + m))


def _split_chunks(f: OutFile, parts: int) -> list[tuple[int, int, int]]:
    """:func:`_split_items` of a file of chunk archives (a DCP file: items ``2i`` and ``2i + 1``
    are archive ``i``'s prefix and data, its trailer written after the data): each run is whole
    archives (:meth:`_Writer.chunk_steps`)."""
    arcs = f.chunk_columns()[0]  # type: ignore[attr-defined]
    return _split_at_entries(f, parts, lambda m: (arcs[m], 2 * m))


def _split_at_entries(
    f: OutFile, parts: int, place: Callable[[int], tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """``f``'s items in runs split where the entries before hold about ``k / parts`` of its entry
    bytes (found by a search over its columns), a run starting at ``place(m)``: the byte offset and
    item position where entry ``m``'s run begins."""
    import numpy as np

    sizes = f.layout.entries.columns()[4]  # type: ignore[attr-defined]
    sz = np.frombuffer(sizes, dtype=np.int64, count=len(sizes))
    before = np.cumsum(sz) - sz  # entry bytes before each entry
    total = int(before[-1] + sz[-1]) if len(sz) else 0
    out: list[list[int]] = [[0, 0, -1]]
    for k in range(1, parts if total else 1):
        m = int(np.searchsorted(before, total * k / parts, "left"))
        if m < len(sz):
            lo, at = place(m)
            if at > out[-1][1]:
                out[-1][2] = at
                out.append([lo, at, -1])
    return [(lo, a, b) for lo, a, b in out]


def _split_runs(f: OutFile, parts: int, geos: _GeometriesOf) -> list[tuple[int, int, int]]:
    """``f``'s items in ``parts`` runs of about equal entry bytes (:func:`_split_items`): by its
    columns, its chunk archives, or item by item."""
    if geos.of(f) is not None:
        return _split_columns(f, parts)
    if geos.of_chunks(f) is not None:
        return _split_chunks(f, parts)
    return _split_items(_in_file_order(f), sum(e.nbytes for e in f.entries), parts)


def _items_of(f: OutFile, first: int, stop: int) -> Iterator[tuple[int, bytes] | tuple[int, OutEntry]]:
    """Items ``first`` to ``stop`` (-1: the end) of :func:`_in_file_order`, made as consumed."""
    return itertools.islice(_in_file_order(f), first, None if stop < 0 else stop)


def _write_group(
    files: Sequence[OutFile],
    dst: Path,
    sources: SourceFiles,
    buffer_size: int,
    window: int,
    progress: ProgressFn | None,
    stop: threading.Event,
    geos: _GeometriesOf,
) -> list[FileResult]:
    """Write each file in this thread, the files in lockstep.

    Round robin, slab by slab: files that cut the same source rows differently (the
    ranks of a column-sharded tensor) then ask for the same rows one after the other,
    and all but the first take them from the rows just read (see :class:`RowCache`).
    Each file is still written in order, so it is hashed on the way.
    """
    bufs = _Buffers(buffer_size, sources, window)
    opened: list[TmpFile] = []
    try:
        for f in files:
            opened.append(TmpFile(dst, f.name, f.size))
        writers = [_Writer(sources, tmp.fd, bufs, progress, stop) for tmp in opened]
        _lockstep(writers, files, [(0, -1)] * len(files), geos)
        done = [(w.sink.close(f.size), w.crc32s, w.bytes_read) for w, f in zip(writers, files)]
        del writers, bufs  # free the buffers before reading back unhashed pieces
        return [_finished(f, tmp, *d, {}) for f, tmp, d in zip(files, opened, done)]
    except BaseException:
        for tmp in opened:
            tmp.discard()
        raise


_END = object()


def _lockstep(
    writers: Sequence[_Writer],
    files: Sequence[OutFile],
    ranges: Sequence[tuple[int, int]],
    geos: _GeometriesOf,
) -> None:
    """Write items ``ranges[i]`` (first, stop: :func:`_steps`) of each file ``files[i]`` with
    ``writers[i]`` (one thread's, sharing its buffers), a slab of each in turn."""
    if len(writers) > 1:  # files in lockstep: the spans they all read are kept for each other
        writers[0].bufs.spans.shared = shared_sources(files, lambda f: geos.of(f) or geos.of_chunks(f))
        order = geos.order()
        for w in writers:
            w.order = order
    active = [(w, _steps(w, f, geos, a, b)) for w, f, (a, b) in zip(writers, files, ranges)]
    while active:
        # the files furthest behind in the plan's tensor order step first: siblings that hold
        # different tensors (DCP ranks each holding some replicated ones) stay on the same
        # tensor, so they still read its rows one after the other
        low = min(w.at for w, _ in active)
        active = [(w, g) for w, g in active if w.at != low or next(g, _END) is not _END]


def _read_by_all(
    files: Sequence[OutFile], groups: Sequence[Sequence[OutFile]], most: int, geos: _GeometriesOf
) -> bool:
    """Whether ``files`` (siblings, written by columns, at most ``most``) would be better written
    by :func:`_write_parts` than in ``groups``: most of the source files a group reads, another
    reads too (HF -> TP-8: every group the whole source). Not otherwise: two threads writing
    one file contend for it in the kernel (TP-4 -> TP-8, groups reading their own rank files
    but for the norms: 0.2 s more system time in parts). Nor for more files than span slots:
    a part cuts every file's entries, so each thread's lockstep reads pieces for all of them and
    evicts the spans it will need again (2 GB HF -> TP-32: 4.41 GB read in parts, 3.16 in
    groups).

    DCP rank files (chunk archives) go in parts only when every group reads every source file
    the others read (HF -> DCP TP-8: the groups' reads ran half a tensor apart, and the
    source's hashes held 400 MB aside): a DCP of 4 ranks -> DCP TP-8 has groups reading
    mostly their own rank files, sharing a few (1.34 s in groups, 1.72 s in parts); nor the
    files of one rank, which hold different tensors (split at ``--max-shard-size``)."""
    if len(files) > min(most, SPAN_SLOTS):
        return False
    if any(geos.of(f) is None for f in files):
        if any(geos.of_chunks(f) is None for f in files) or len({f.local_rank for f in files}) < len(files):
            return False
        sets = [_group_sources(g, geos.of_chunks) for g in groups]
        return all(s == sets[0] for s in sets)
    reads: collections.Counter[int] = collections.Counter()
    for g in groups:
        reads.update(_group_sources(g, geos.of))
    return 2 * sum(1 for n in reads.values() if n > 1) > len(reads)


def _group_sources(group: Sequence[OutFile], of: Callable[[OutFile], Geometries | None]) -> set[int]:
    """The source files a group of files reads by runs (:meth:`Geometries.sources`)."""
    mine: set[int] = set()
    for f in group:
        mine |= of(f).sources(f.local_rank)  # type: ignore[union-attr]
    return mine


def _write_parts(
    files: Sequence[OutFile],
    dst: Path,
    sources: SourceFiles,
    buffer_size: int,
    window: int,
    progress: ProgressFn | None,
    parts: int,
    stop: threading.Event,
    geos: _GeometriesOf,
) -> list[FileResult]:
    """Write sibling files written by columns with ``parts`` threads, thread ``k`` the ``k``-th
    run of entries of every file, the files in lockstep (:func:`_write_group`, split as
    :func:`_write_split` splits one file): each thread reads its part of the source once for
    all the files, where groups of files read all of it each (HF -> TP-8, two groups of 4
    files: the 1.2 GB source read twice)."""
    opened: list[TmpFile] = []
    try:
        for f in files:
            opened.append(TmpFile(dst, f.name, f.size))
        splits = [_split_runs(f, parts, geos) for f in files]

        def run(k: int) -> list[tuple[int, dict[int, bytes], dict[int, int], int, _Begun]]:
            mine = [i for i, sp in enumerate(splits) if k < len(sp)]
            bufs = _Buffers(buffer_size, sources, window)
            writers = [_Writer(sources, opened[i].fd, bufs, progress, stop, splits[i][k][0]) for i in mine]
            _lockstep(writers, [files[i] for i in mine], [splits[i][k][1:] for i in mine], geos)
            closed = [(i, w.sink.close(files[i].size), w) for i, w in zip(mine, writers)]
            return [(i, d, w.crc32s, w.bytes_read, w.sink.partial) for i, d, w in closed]

        digests: list[dict[int, bytes]] = [{} for _ in files]
        crc32s: list[dict[int, int]] = [{} for _ in files]
        begun: list[_Begun] = [{} for _ in files]
        nread = [0] * len(files)
        for part in _run_all([functools.partial(run, k) for k in range(parts)], stop):
            for i, d, c, n, b in part:
                digests[i].update(d)
                crc32s[i].update(c)
                begun[i].update(b)
                nread[i] += n
        return [_finished(*parts) for parts in zip(files, opened, digests, crc32s, nread, begun)]
    except BaseException:
        for tmp in opened:
            tmp.discard()
        raise


class _Stopped(Exception):
    """A writer thread stopping because the run is stopping (Ctrl-C, another thread failed)."""


def _check(stop: threading.Event) -> None:
    if stop.is_set():
        raise _Stopped


def _run_all(jobs: Sequence[Callable[[], T]], stop: threading.Event, workers: int = 0) -> list[T]:
    """Run ``jobs`` on threads; results in order. On Ctrl-C (raised in this, the main thread,
    while it waits) or a job's failure, ``stop`` tells the others to stop at their next slab,
    so the run ends within a slab's time, whatever the worker count."""
    pool = ThreadPoolExecutor(max_workers=workers or len(jobs))
    try:
        futures = [pool.submit(job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)  # a failure anywhere stops the rest at once
        out = [fu.result() for fu in futures]
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return out


_Begun = dict[int, tuple[Any, int]]
"""Pieces a part's writer began and the next part ended: their hashers and where they stopped
(:attr:`~reshard.io.writer.Sink.partial`)."""


def _finished(
    f: OutFile, tmp: TmpFile, digests: dict[int, bytes], crc32s: dict[int, int], nread: int, begun: _Begun
) -> FileResult:
    """A file written (in one part, or in parts by several threads), finished: the CRC32s its
    format writes before the data patched in (their pieces' digests given again), then renamed
    into place, reading back of each piece a part began only what the next part wrote of it."""
    if f.needs_crc32 and _patches(f):
        tmp.patch(f.finish([crc32s[i] for i in range(len(f.entries))]), digests, begun)
    return tmp.finish(digests, nread, begun)


def _write_split(
    f: OutFile,
    dst: Path,
    sources: SourceFiles,
    buffer_size: int,
    window: int,
    progress: ProgressFn | None,
    parts: int,
    stop: threading.Event,
    geos: _GeometriesOf,
) -> FileResult:
    """Write one file with ``parts`` threads, each a consecutive run of its entries."""
    tmp = TmpFile(dst, f.name, f.size)

    def run(lo: int, first: int, stop_at: int) -> tuple[dict[int, bytes], dict[int, int], int, _Begun]:
        """Write items ``first`` to ``stop_at``; returns their digests, CRC32s, bytes read and the
        piece begun and not ended (its buffers are freed)."""
        w = _Writer(sources, tmp.fd, _Buffers(buffer_size, sources, window), progress, stop, lo)
        for _ in _steps(w, f, geos, first, stop_at):
            pass
        return w.sink.close(f.size), w.crc32s, w.bytes_read, w.sink.partial

    try:
        runs = _split_runs(f, parts, geos)
        parts_done = _run_all([functools.partial(run, lo, a, b) for lo, a, b in runs], stop)
        digests: dict[int, bytes] = {}
        crc32s: dict[int, int] = {}
        begun: _Begun = {}
        for d, c, _, b in parts_done:
            digests.update(d)
            crc32s.update(c)
            begun.update(b)
        return _finished(f, tmp, digests, crc32s, sum(p[2] for p in parts_done), begun)
    except BaseException:
        tmp.discard()
        raise


def _groups(files: Sequence[OutFile], workers: int, most: int = GROUP_FILES) -> list[list[OutFile]]:
    """Consecutive files (sibling ranks) in groups: at least one per worker, at most ``most`` each."""
    count = max(min(workers, len(files)), -(-len(files) // most))
    out: list[list[OutFile]] = []
    for i in range(count):
        a, b = i * len(files) // count, (i + 1) * len(files) // count
        if b > a:
            out.append(list(files[a:b]))
    return out


def execute_plan(
    plan: Plan,
    dst: Path,
    *,
    workers: int = 1,
    buffer_size: int = DEFAULT_BUFFER,
    window: int = RELEASE_EVERY,
    progress: ProgressFn | None = None,
    files: Sequence[OutFile] | None = None,
    on_file_done: Callable[[FileResult], None] | None = None,
    seen: Seen | None = None,
) -> list[FileResult]:
    """Write every output file of ``plan`` (or the given subset) into ``dst``.

    Files are handed to ``workers`` threads largest first, so the work is
    balanced by bytes. Results come back in plan order. ``seen`` is shown every
    source span read (source verification hashes them on the way).
    """
    todo = list(plan.files if files is None else files)
    sources = SourceFiles(plan.source.files, plan.source.file_sizes, seen)
    lock = threading.Lock()
    stop = threading.Event()  # set on Ctrl-C or a failure: every writer stops at its next slab

    def prog(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    results_by_name: dict[str, FileResult] = {}

    def done(r: FileResult) -> None:
        with lock:
            if on_file_done is not None:
                on_file_done(r)
            results_by_name[r.name] = r

    geos = _GeometriesOf(plan.tensors)

    def group(fs: list[OutFile]) -> None:
        for r in _write_group(fs, dst, sources, buffer_size, window, prog, stop, geos):
            done(r)

    # fewer files than workers: the spare workers split the files' entries between them
    parts = max(1, workers // max(1, len(todo)))
    try:
        if parts > 1:
            for f in todo:
                done(_write_split(f, dst, sources, buffer_size, window, prog, parts, stop, geos))
        else:
            # lockstep files hold the same tensors cut differently: siblings share reads. Others
            # (hf shards) hold different tensors: one at a time, so each finishes (and is journaled) sooner
            most = GROUP_FILES if plan.writer.lockstep else 1
            groups = sorted(_groups(todo, workers, most), key=lambda g: -sum(f.size for f in g))
            if workers > 1 and len(groups) > 1 and _read_by_all(todo, groups, most, geos):
                for r in _write_parts(todo, dst, sources, buffer_size, window, prog, workers, stop, geos):
                    done(r)
            elif workers <= 1 or len(groups) <= 1:
                for g in groups:
                    group(g)
            else:
                _run_all([functools.partial(group, g) for g in groups], stop, workers)
        return [results_by_name[f.name] for f in todo]
    finally:
        sources.close()
