"""Reading boxes of source pieces: the one way convert, verify, check and load_dtensors read data.

A source piece is a row-major local tensor at an absolute byte offset of a file
(:class:`reshard.checkpoint.TensorSource`). :func:`read_box` returns the items of
one box of it as a numpy array of unsigned integers of the item size (so every
bit pattern survives, NaN payloads and ``-0.0`` included):

* with a :class:`RowCache` (``convert``): always by ``pread``
  (:meth:`~reshard.io.pages.SourceFiles.pread`), never through the map, so a source
  file truncated mid-run is a named error, never a SIGBUS. The whole rows around
  the box are read with one ``pread`` into the cache and a strided view of them is
  returned (sibling output files asking for other columns of the same rows hit the
  cache); a box whose rows do not fit is read in bands of rows that do, into a
  fresh array;
* otherwise (``verify``, ``inspect --check``, ``load_dtensors``) a view of the
  file's read-only memory map, the pages recorded in a
  :class:`~reshard.io.pages.PageWindow` that releases them as reading goes on.

Many short reads (the pieces of 100k small tensors) go through :class:`Windows`
instead: windows of the source files read by ``pread`` and kept, the pieces of
tensors of one geometry moved with one strided numpy copy per progression and window.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from ..checkpoint import TensorSource
from ..dtypes import DTYPE_SIZES
from ..intervals import box_span, row_major_strides
from .pages import PageWindow, SourceFiles

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Items = npt.NDArray[np.unsignedinteger[Any]]
else:
    Items = Any

__all__ = [
    "DENSE",
    "SCRATCH",
    "WINDOW",
    "WINDOW_SLOTS",
    "SPAN",
    "SPAN_SLOTS",
    "Spans",
    "Job",
    "job_reach",
    "Run",
    "Span",
    "Windows",
    "Items",
    "uint_dtype",
    "Piece",
    "RowCache",
    "read_box",
    "slab_items",
    "MappedFiles",
]

DENSE = 8
"""The row cache holds this many times a writer's buffer: a box of a buffer's bytes whose
source span is at most this many times larger is read whole with one pread (measured:
HF -> TP-8, 1/8-width columns, 0.88 s against 1.04 s through the map, and less RSS);
sparser boxes are read in bands of rows."""

WINDOW = 256 << 10
"""Short reads (a small tensor's bytes, a few strided rows) are served from a window of this
many bytes of their file, read with one ``pread``: the neighbouring tensors a rank file takes
next are usually in it, so 100k small tensors cost a few thousand system calls, not 100k."""

WINDOW_SLOTS = 13
"""Windows a writer holds at once, kept from one buffer to the next (the oldest refilled
first; the last slot holds a read across a window's edge): the sibling files written in
lockstep take their pieces of the same source bytes from them (HF -> TP-8: a buffer's 1 KiB
pieces, 8 KiB apart, span 2 MiB of the source)."""

SPAN = 1 << 20
"""The column path's reads (:class:`Spans`): the source bytes a buffer of entries needs from one
file, read whole with one ``pread`` up to this size (larger: in parts of it)."""

SPAN_SLOTS = 10
"""Spans a writer thread keeps for the sibling files written next in lockstep (which ask for the
same bytes): the least recently used is read over first. At 8, one worker writing TP-4 -> TP-8
(8 files, 4 sources, ~3 windows of each a buffer) read 1.82 GB for the 1.27 GB source; at 10
and more, 1.22 GB."""

SCRATCH = WINDOW_SLOTS * WINDOW + SPAN_SLOTS * SPAN
"""Bytes of a writer thread's scratch buffers: its windows (see ``memory_estimate``)."""


@cache
def uint_dtype(itemsize: int) -> Any:
    """The numpy unsigned integer type of an item size (items are moved as raw bits)."""
    import numpy as np

    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


@dataclass(frozen=True, slots=True)
class Piece:
    """Piece ``k`` of a tensor as read: its file, byte offset, shape, strides and, when mapped,
    a view of it in the file's map (``arr``; None for ``convert``, which reads by ``pread``)."""

    fi: int
    base: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    count: int
    arr: Items | None

    @property
    def dtype(self) -> Any:
        """The numpy unsigned integer type its items are moved as."""
        return uint_dtype(self.itemsize)

    @classmethod
    def of(
        cls,
        sources: SourceFiles,
        src: TensorSource,
        k: int,
        shape: tuple[int, ...] | None = None,
        *,
        mapped: bool = True,
    ) -> Piece:
        """Piece ``k`` of ``src`` (``shape``: its local shape, when the caller has it); ``mapped``:
        with a view of the file's map (a file that shrank since it was opened is then an error)."""
        if shape is None:
            shape = src.piece_shape(k)
        isz = DTYPE_SIZES[src.dtype]
        fi = src.piece_files[k]
        base = src.piece_offsets[k]
        count = 1
        for x in shape:
            count *= x
        arr = None
        if mapped:
            import numpy as np

            sources.check(fi)
            sources.ready(fi, base, base + count * isz)  # (a lazy spool's region: made now)
            arr = np.frombuffer(sources.map(fi), dtype=uint_dtype(isz), count=count, offset=base)
            arr = arr.reshape(shape)
        return cls(fi, base, shape, row_major_strides(shape), isz, count, arr)


class RowCache:
    """Source spans read whole with one ``pread``, kept for the next reader of the same rows.

    ``window`` says what ``buf`` holds, ``(file, lo, hi)`` in file bytes, so writers of
    sibling files that need other columns of the same rows take them from it.
    """

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.window: tuple[int, int, int] | None = None

    def read(self, sources: SourceFiles, fi: int, lo: int, hi: int, wlo: int, whi: int) -> int | None:
        """Make file bytes ``[lo, hi)`` of file ``fi`` available in ``buf``; returns where they start.

        A hit costs nothing. A miss reads the window ``[wlo, whi)`` (the whole rows around
        ``[lo, hi)``) when it fits in ``buf``, else just ``[lo, hi)``; None when even that
        does not fit (the caller reads it in bands).
        """
        w = self.window
        if w is not None and w[0] == fi and w[1] <= lo and hi <= w[2]:
            return lo - w[1]
        if whi - wlo > len(self.buf):
            wlo, whi = lo, hi
            if hi - lo > len(self.buf):
                return None
        self.window = None
        sources.pread(fi, memoryview(self.buf)[: whi - wlo], wlo)
        self.window = (fi, wlo, whi)
        return lo - wlo


def read_box(pages: PageWindow, piece: Piece, key: tuple[slice, ...], rows: RowCache | None = None) -> Items:
    """The items of box ``key`` (one slice per dim, local to the piece) of a source piece.

    The result is a view (of ``rows.buf`` or of the map) or a fresh array: use it before
    the next read.
    """
    if rows is None:
        # a mapped read: verify and check, which check the file's size first
        assert piece.arr is not None, "a mapped read of an unmapped piece"
        pages.touch_slices(piece.fi, piece.base, piece.strides, piece.itemsize, key)
        part: Items = piece.arr[key] if key else piece.arr[...]
        return part
    import numpy as np

    if any(s.stop <= s.start for s in key):
        return np.empty([max(0, s.stop - s.start) for s in key], dtype=piece.dtype)
    got = _cached(pages.sources, piece, key, rows)
    if got is not None:
        return got

    out: Items = np.empty([s.stop - s.start for s in key], dtype=piece.dtype)
    for band in _bands(piece, key, len(rows.buf)):
        cut = _cached(pages.sources, piece, band, rows)
        assert cut is not None  # a band's span fits the cache
        out[tuple(slice(b.start - k.start, b.stop - k.start) for b, k in zip(band, key))] = cut
    return out


def _cached(sources: SourceFiles, piece: Piece, key: tuple[slice, ...], rows: RowCache) -> Items | None:
    """Box ``key`` as a strided view of its rows read into the cache; None if its span does not fit."""
    isz = piece.itemsize
    starts = [s.start for s in key]
    sizes = [s.stop - s.start for s in key]
    first, stop = box_span(piece.strides, starts, sizes) if key else (0, 1)
    row = _row_elems(piece.shape, piece.strides, sizes)
    wfirst = first - first % row
    wstop = min(piece.count, -(-stop // row) * row)
    base = piece.base
    at = rows.read(
        sources, piece.fi, base + first * isz, base + stop * isz, base + wfirst * isz, base + wstop * isz
    )
    if at is None:
        return None
    import numpy as np

    view: Items = np.ndarray(
        tuple(sizes),
        dtype=piece.dtype,
        buffer=rows.buf,
        offset=at,
        strides=tuple(st * isz for st in piece.strides),
    )
    return view


def slab_items(piece: Piece, starts: Sequence[int], sizes: Sequence[int], cap: int) -> int:
    """How many items of box ``(starts, sizes)`` a slab may take so that the whole source rows
    around them fit a row cache of ``cap`` bytes (at least 1).

    Slabs that small are read with one ``pread`` each, and the sibling files in lockstep
    that want other columns of the same rows find them in the cache: cut larger, a sparse
    box is read in bands that no sibling can reuse.
    """
    used = 1
    for z in sizes:
        used *= z
    if used == 0:
        return cap
    first, stop = box_span(piece.strides, starts, sizes) if sizes else (0, 1)
    row = _row_elems(piece.shape, piece.strides, sizes)
    window = (stop - first + 2 * row) * piece.itemsize  # widened to whole rows at both ends
    return max(1, cap * used // window)


def _bands(piece: Piece, key: tuple[slice, ...], cap: int) -> Iterator[tuple[slice, ...]]:
    """Sub-boxes of ``key`` cut along its outermost dims, each spanning at most ``cap`` bytes.

    Cut along the first dim longer than 1 into runs of as many indices as fit; where one
    index of it spans more than ``cap``, each index is cut along the next dim, and so on
    (a box of one item spans one item, which fits).
    """
    isz = piece.itemsize
    sizes = [s.stop - s.start for s in key]
    first, stop = box_span(piece.strides, [s.start for s in key], sizes)
    if (stop - first) * isz <= cap:
        yield key
        return
    d = next(i for i, z in enumerate(sizes) if z > 1)
    inner = (stop - first - (sizes[d] - 1) * piece.strides[d]) * isz  # the span of one index of dim d
    step = max(1, 1 + (cap - inner) // (piece.strides[d] * isz)) if inner <= cap else 1
    for a in range(key[d].start, key[d].stop, step):
        sub = key[:d] + (slice(a, min(a + step, key[d].stop)),) + key[d + 1 :]
        yield from _bands(piece, sub, cap)


def _row_elems(shape: Sequence[int], strides: Sequence[int], sizes: Sequence[int]) -> int:
    """Elements per "row" of a box's source: the stride of the dim just outside its innermost
    partial dim (1 when the box is whole or only its outermost dim is cut)."""
    j = len(shape) - 1
    while j >= 0 and sizes[j] == shape[j]:
        j -= 1
    return strides[j - 1] if j >= 1 else 1


SMALL_READ = 1 << 20
""":meth:`MappedFiles.raw` copies reads up to this size by ``pread`` rather than mapping them."""


class MappedFiles(PageWindow):
    """Read-only maps of a checkpoint's files whose touched pages are released as we go.

    Args:
        files: the checkpoint's file paths.
        release_every: bytes of touched pages to hold before releasing them (at least 1 MiB).
    """

    def __init__(self, files: Sequence[str], release_every: int) -> None:
        super().__init__(SourceFiles(files), max(1 << 20, release_every))

    def piece(self, src: TensorSource, k: int, shape: tuple[int, ...] | None = None) -> Piece:
        """Piece ``k`` of ``src``, mapped."""
        return Piece.of(self.sources, src, k, shape)

    def raw(self, fi: int, offset: int, count: int) -> Items:
        """``count`` bytes of file ``fi`` at ``offset`` as a read-only uint8 numpy array: a
        small read copied by ``pread`` (through the map, the kernel maps whole folios around
        it: the replicas of 200k small tensors held 100 MiB of mapped pages), a large one a
        view of the map (its pages released as the window fills)."""
        import numpy as np

        if count <= SMALL_READ:
            buf = bytearray(count)
            self.sources.pread(fi, memoryview(buf), offset)
            return np.frombuffer(buf, np.uint8)
        arr = np.frombuffer(self.sources.map(fi), dtype=np.uint8, count=count, offset=offset)
        self.touch_range(fi, offset, offset + count)
        return arr

    def close(self) -> None:
        """Release pages and close maps and file descriptors."""
        self.release()
        self.sources.close()


Span = tuple[int, int, int, int, int, int, int]
"""A source read: (file, offset, n, rows, source stride, position in the buffer, buffer stride):
``rows`` rows of ``n`` bytes, ``source stride`` apart in the file and ``buffer stride`` apart
in the buffer (one row: strides unused)."""

Run = tuple[int, int, int, int, int, int, int]
"""A copy of ``rows`` rows of ``n`` bytes: (byte offset in the target entry, source piece, byte
offset in the piece, n, rows, source stride, target stride). One row (strides 0) is a contiguous
run; rows whose target stride is ``n`` are back to back in the target; other runs interleave
with the entry's other runs (a column shard of a small tensor written whole). Made by
:func:`reshard.execute.entry_runs`."""

_UINTS = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}
_PERIODS = 4
"""Entries of one geometry that alternate with others are tried as this many progressions at most."""
_LOCAL = threading.local()
_TOKENS = itertools.count()


class Windows:
    """Windows of source files in this thread's scratch buffer, kept from one gather to the next.

    Many short reads (a 100k-tensor file's pieces) cost a few numpy copies, not Python work
    per piece: :meth:`gather_entries` takes consecutive entries of one geometry, and the run
    ``j`` of each is a progression (one file, a fixed step in both the file and the buffer:
    one tensor's piece after the previous one's), moved with one strided copy per window.
    Windows of ``window`` bytes are read by ``pread`` (never mapped: a file that shrank is a
    named error, not a SIGBUS) into ``slots`` slots, the oldest refilled first, and stay for
    the next gather, so sibling files written in lockstep take their pieces of the same
    source bytes from one read. Reads larger than half a window go straight into the buffer.

    The scratch is the thread's (memory touched once, kept: see MACHINE-NOTES); windows of
    another :class:`Windows` that used it in between are forgotten, not trusted. ``own``: a
    scratch of its own instead (``verify``'s two sides, which take turns), so the windows stay.
    """

    def __init__(
        self, sources: SourceFiles, window: int = WINDOW, slots: int = WINDOW_SLOTS, *, own: bool = False
    ) -> None:
        self.sources = sources
        self.window = window
        self.slots: list[tuple[int, int, int]] = [(-1, 0, 0)] * max(1, slots)  # (file, lo, hi)
        self.last = 0  # the slot hit last
        self.next = 0  # the slot refilled next
        self.token = next(_TOKENS)
        self.own = own
        self.scratch = bytearray(window * len(self.slots) if own else 0)
        self.view = memoryview(self.scratch)

    def _claim(self) -> None:
        """Take this thread's scratch; if another :class:`Windows` used it since, forget our windows."""
        if self.own or getattr(_LOCAL, "owner", None) == self.token:
            return
        need = self.window * len(self.slots)
        buf: bytearray | None = getattr(_LOCAL, "buf", None)
        if buf is None or len(buf) < need:
            buf = _LOCAL.buf = bytearray(need)
        _LOCAL.owner = self.token
        self.scratch, self.view = buf, memoryview(buf)
        self.slots = [(-1, 0, 0)] * len(self.slots)

    def gather(self, spans: list[int], buf: bytearray) -> None:
        """Copy the source bytes of ``spans`` (seven ints a :data:`Span`, one after another)
        into ``buf`` at their positions, by ``pread`` only; neighbouring one-row spans that
        land next to each other are read as one."""
        if not spans:
            return
        self._claim()
        out = memoryview(buf)
        fi, lo, n, rows, ss, pos, ds = spans[:7]
        for i in range(7, len(spans) + 7, 7):
            nxt = spans[i : i + 7]
            if nxt and nxt[0] == fi and nxt[1] == lo + n and nxt[5] == pos + n and rows == 1 == nxt[3]:
                n += nxt[2]
                continue
            if rows == 1:
                self._piece(fi, lo, n, pos, out)
            else:
                self._copy(fi, lo, ss, pos, ds, rows, n, buf)
            if nxt:
                fi, lo, n, rows, ss, pos, ds = nxt

    def gather_entries(
        self, runs: Sequence[Run], at: list[int], srcs: Sequence[TensorSource], buf: bytearray
    ) -> None:
        """Copy entries of one geometry into ``buf``: entry ``i`` (of tensor ``srcs[i]``) at
        ``at[i]``, made of ``runs``.

        Run ``j`` of the entries is one progression when the pieces it reads follow each other
        at a fixed step in one file and the entries at a fixed step in the buffer (checked with
        list comparisons); or every second (third, fourth) entry is (tensors of this geometry
        alternating with others: an expert's gate and up). Entries that are not (a layer's
        norms shift the rest) are split in halves until they are.
        """
        self.gather_groups([(runs, at, srcs)], buf)

    def gather_groups(self, groups: Iterable[Sequence[Any]], buf: bytearray) -> None:
        """:meth:`gather_entries` for several geometries ``(runs, at, srcs)``, their runs in file
        order: the windows of a file serve every geometry before the next file's are read."""
        self._claim()
        jobs = []
        for runs, at, srcs in groups:
            for d, k, s, n, rows, ss, ds in runs:
                fis = [t.piece_files[k] for t in srcs]
                los = [t.piece_offsets[k] for t in srcs]
                jobs.append((fis[0], los[0], fis, los, at, (s, d, n, rows, ss, ds)))
        jobs.sort(key=lambda job: job[:2])
        for _, _, fis, los, at, run in jobs:
            self._periodic(fis, los, at, run, buf)

    def _periodic(
        self, fis: list[int], los: list[int], at: list[int], run: tuple[int, ...], buf: bytearray
    ) -> None:
        """Copy pieces ``los[i] + s`` of files ``fis[i]`` to ``at[i] + d`` as up to
        :data:`_PERIODS` interleaved progressions, or each half so."""
        s, d, n, rows, ss, ds = run
        count = len(fis)
        for p in range(1, min(_PERIODS, count // 2) + 1):
            cut = [(fis[r::p], los[r::p], at[r::p]) for r in range(p)]
            steps = [_step(lo_) if f_.count(f_[0]) == len(f_) else None for f_, lo_, _ in cut]
            moves = [_step(a_) for _, _, a_ in cut]
            if None not in steps and None not in moves:
                for (f_, lo_, a_), dl, dp in zip(cut, steps, moves):
                    self._copy(f_[0], lo_[0] + s, dl or 0, a_[0] + d, dp or 0, len(f_), n, buf, rows, ss, ds)
                return
        if count <= 4 * _PERIODS:
            self._longest(fis, los, at, run, buf)
            return
        h = count // 2
        self._periodic(fis[:h], los[:h], at[:h], run, buf)
        self._periodic(fis[h:], los[h:], at[h:], run, buf)

    def _longest(
        self, fis: list[int], los: list[int], at: list[int], run: tuple[int, ...], buf: bytearray
    ) -> None:
        """Copy pieces ``los[i] + s`` of files ``fis[i]`` to ``at[i] + d`` in the longest
        progressions, in order."""
        s, d, n, rows, ss, ds = run
        count = len(fis)
        i = 0
        while i < count:
            f, j = fis[i], i + 1
            dl, dp = (los[j] - los[i], at[j] - at[i]) if j < count and fis[j] == f else (0, 0)
            while j < count and fis[j] == f and los[j] - los[j - 1] == dl and at[j] - at[j - 1] == dp:
                j += 1
            self._copy(f, los[i] + s, dl, at[i] + d, dp, j - i, n, buf, rows, ss, ds)
            i = j

    def _copy(
        self,
        fi: int,
        lo: int,
        dl: int,
        pos: int,
        dp: int,
        k: int,
        n: int,
        buf: bytearray,
        rows: int = 1,
        ss: int = 0,
        ds: int = 0,
    ) -> None:
        """``k`` items, ``dl`` apart from ``lo`` in file ``fi`` and ``dp`` apart from ``pos`` in
        the buffer, each ``rows`` rows of ``n`` bytes (``ss`` apart in the file, ``ds`` in the
        buffer): one strided numpy copy per window."""
        if rows == 1 and dl == n == dp:  # back to back on both sides: one read
            self._piece(fi, lo, n * k, pos, memoryview(buf))
            return
        span = (rows - 1) * ss + n
        if span > self.window // 2 or n <= 0 or ss < 0:
            for i in range(k):  # too large for a window: item by item, row by row
                if rows == 1:
                    self._piece(fi, lo + i * dl, n, pos + i * dp, memoryview(buf))
                else:
                    self._copy(fi, lo + i * dl, ss, pos + i * dp, ds, rows, n, buf)
            return
        import numpy as np

        if dl < 0:  # walk the file forwards
            lo, pos, dl, dp = lo + (k - 1) * dl, pos + (k - 1) * dp, -dl, -dp
        while k > 0:
            at, hi = self._window(fi, lo, span)
            fit = k if dl == 0 else min(k, (hi - lo - span) // dl + 1)
            g = n | at | pos | dl | dp | (ss | ds if rows > 1 else 0)
            isz = min(8, g & -g) if g else 8  # the widest items all offsets and strides allow
            shape = (fit, rows, n // isz)
            dt = _UINTS[isz]
            dst = np.ndarray(shape, dt, buf, pos, (dp, ds, isz))
            dst[...] = np.ndarray(shape, dt, self.scratch, at, (dl, ss, isz))
            lo, pos, k = lo + fit * dl, pos + fit * dp, k - fit

    def _piece(self, fi: int, lo: int, n: int, pos: int, out: memoryview) -> None:
        """``n`` bytes of file ``fi`` at ``lo`` into the buffer at ``pos``."""
        if n > self.window // 2:
            self.sources.pread(fi, out[pos : pos + n], lo)
        elif n > 0:
            at, _ = self._window(fi, lo, n)
            out[pos : pos + n] = self.view[at : at + n]

    def _window(self, fi: int, lo: int, n: int) -> tuple[int, int]:
        """Where file ``fi``'s bytes ``[lo, lo + n)`` are in the scratch (``n <= window``), read
        if no window holds them; and the file offset where that window ends.

        Windows sit on a grid of ``window`` bytes, so walks over the same bytes (sibling files,
        another geometry's entries) meet the same windows and read each byte once; bytes across
        a grid line are read on their own into the last slot.
        """
        slots = self.slots
        f, a, b = slots[self.last]
        if f == fi and a <= lo and lo + n <= b:
            return self.last * self.window + lo - a, b
        for j, (f, a, b) in enumerate(slots):
            if f == fi and a <= lo and lo + n <= b:
                self.last = j
                return j * self.window + lo - a, b
        w = self.window
        start = lo - lo % w
        hi = min(start + w, self.sources.size(fi))
        if lo + n <= hi:
            j = self.next
            self.next = (j + 1) % max(1, len(slots) - 1)
        else:  # across a grid line (or past the end of the file: the read fails)
            j, start, hi = len(slots) - 1, lo, lo + n
        slots[j] = (-1, 0, 0)
        self.sources.pread(fi, self.view[j * w : j * w + hi - start], start)
        slots[j] = (fi, start, hi)
        self.last = j
        return j * w + lo - start, hi


def _step(xs: list[int]) -> int | None:
    """The fixed step of ``xs`` (0 for one item), or None when it has none."""
    if len(xs) < 2:
        return 0
    a, step = xs[0], xs[1] - xs[0]
    if step == 0:
        return 0 if xs.count(a) == len(xs) else None
    return step if xs == list(range(a, a + step * len(xs), step)) else None


Job = tuple[int, Any, Any, int, int, int, int]
"""Pieces of one source file for :meth:`Spans.gather`: (file, offsets, buffer positions, n, rows,
source stride, buffer stride), offsets and positions as int64 arrays."""


_MOVING = 96 << 10
"""Bytes of pieces :class:`Spans` moves with one numpy copy (below the CLI's 128 KiB mmap threshold)."""


def job_reach(jobs: Iterable[Job]) -> dict[int, tuple[int, int, int]]:
    """Per source file of ``jobs``: the first and last byte they read from it (plus one), and
    how many pieces."""
    reach: dict[int, tuple[int, int, int]] = {}
    for fi, lo, _, n, rows, ss, _ in jobs:
        if len(lo):
            a, b, k = reach.get(fi, (int(lo.min()), 0, 0))
            reach[fi] = (min(a, int(lo.min())), max(b, int(lo.max()) + (rows - 1) * ss + n), k + len(lo))
    return reach


_MANY = 8
"""Pieces of one file in a buffer from which :class:`Spans` reads whole windows for siblings."""


_SPARSE = 8
"""A few pieces (at most :data:`_MANY`) that fill less than one part in this many of the bytes
from the first to the last are read each on its own (:meth:`Spans._scattered`)."""

_PERIODIC = 16
"""A job's pieces are copied as progressions (:func:`_progressions`) when their steps change at
most once per this many pieces (a layer's norms between its experts); else by index arrays."""

_SMALL = 512
"""Pieces of one row smaller than this are copied as progressions where they are: numpy's index
arrays copy larger ones as fast (a memcpy each), and finding the progressions costs ~30 us a job."""

Period = tuple[int, int, int, int]
"""Pieces ``a, a + p, a + 2p, ...`` of a job (and ``a + 1, a + 1 + p, ...``, up to ``p`` of them)
``step`` bytes apart in the file and ``move`` in the buffer: ``(a, p, step, move)``."""


def _progressions(lo: Any, pos: Any) -> list[tuple[int, int, Period | None]]:
    """A job's pieces (``lo`` sorted) as consecutive ranges ``(first, stop, period)``: up to
    :data:`_PERIODS` interleaved progressions (tensors of one geometry one after another, or
    alternating with another geometry's: an expert's gate and up), or None (any offsets)."""
    import numpy as np

    count = len(lo)
    for p in range(1, _PERIODS + 1):
        if count < 4 * p:
            break
        dl, dq = lo[p:] - lo[:-p], pos[p:] - pos[:-p]
        cuts = (np.flatnonzero((dl[1:] != dl[:-1]) | (dq[1:] != dq[:-1])) + 1).tolist()
        if len(cuts) * _PERIODIC > count:  # steps change too often: try a longer period
            continue
        firsts = [0, *cuts]
        out: list[tuple[int, int, Period | None]] = []
        done = 0
        for u, v, step, move in zip(firsts, [*cuts, count - p], dl[firsts].tolist(), dq[firsts].tolist()):
            a, b = max(u, done), v + p  # from piece a, each p-th piece is step after the last, to b
            if b - a < 2 * p:
                continue  # left to the index arrays
            if a > done:
                out.append((done, a, None))
            out.append((a, b, (a, p, step, move)))
            done = b
        if done < count:
            out.append((done, count, None))
        return out
    return [(0, count, None)]


def _stride(job: Job, i: int, j: int, per: Period, held: bytearray, shift: int, buf: bytearray) -> None:
    """Pieces ``i`` to ``j`` of ``job``, of a run of progressions ``per``, their bytes at
    ``lo + shift`` in ``held``: one strided numpy copy per progression (no index arrays, no
    temporary)."""
    import numpy as np

    _, lo, pos, n, rows, ss, ds = job
    a, p, step, move = per
    item = _item(n)
    for r in range(p):
        t = i + (a + r - i) % p  # the first of progression r from piece i
        if t < j:
            shape, src, dst = ((j - t + p - 1) // p, rows), int(lo[t]) + shift, int(pos[t])
            out = np.ndarray(shape, item, buf, dst, (move, ds))  # a piece's rows: the inner loop
            out[...] = np.ndarray(shape, item, held, src, (step, ss))


@cache
def _item(n: int) -> Any:
    """The numpy type of an item of ``n`` bytes (an unsigned integer where there is one)."""
    import numpy as np

    return np.dtype(_UINTS.get(n, f"V{n}"))


class Spans:
    """Spans of source files read whole by ``pread`` into ``slots`` buffers of at most ``span``
    bytes, kept for the next reader (the least recently used read over first).

    The column path's reads (:meth:`gather`). A buffer is made when its slot is first used,
    as large as the reads it has taken (so a few small tensors cost a few small buffers).
    Never mapped: a file that shrank is a named error, not a SIGBUS.
    """

    def __init__(self, sources: SourceFiles, span: int = SPAN, slots: int = SPAN_SLOTS) -> None:
        self.sources = sources
        self.span = max(1, span)
        self.slots: list[tuple[int, int, int]] = [(-1, 0, 0)] * max(1, slots)  # (file, lo, hi)
        self.bufs = [bytearray(0) for _ in self.slots]
        self.used = [0] * len(self.slots)
        self.clock = 0
        self.shared: AbstractSet[int] = frozenset()
        """The source files sibling files written in lockstep read too: read in whole windows
        and kept for them (:meth:`keeps`). Files only one of them reads are read as asked:
        TP-64 -> TP-8 siblings each read their own 8 rank files, and whole windows of those,
        read over by the next sibling's before anyone took the rest, read 145 times the output."""

    def keeps(self, jobs: Iterable[Job]) -> bool:
        """Whether the windows ``jobs`` read from :attr:`shared` files all fit in the slots, so
        they stay for the siblings (the reads of files no sibling reads need not stay)."""
        return self._fits(job_reach(jobs))

    def _fits(self, reach: dict[int, tuple[int, int, int]]) -> bool:
        span, shared = self.span, self.shared
        windows = sum((b - a) // span + 2 for fi, (a, b, _) in reach.items() if fi in shared)
        return windows <= len(self.slots)

    def locate(self, fi: int, lo: int, hi: int) -> tuple[bytearray, int]:
        """The buffer holding file ``fi``'s bytes ``[lo, hi)`` (at most :attr:`span`), and where
        they start in it; read if no slot holds them. A slot holding their start is extended to
        hold them (up to :attr:`span`): siblings in lockstep ask for spans from the same first
        byte (a norm) to their own rows, each longer than the last (64 ranks: read once, not
        64 times over)."""
        self.clock += 1
        for j, (f, a, b) in enumerate(self.slots):
            if f == fi and a <= lo and hi <= b:
                self.used[j] = self.clock
                return self.bufs[j], lo - a
        for j, (f, a, b) in enumerate(self.slots):
            if f == fi and a <= lo <= b and hi - a <= self.span:
                held = self.bufs[j]
                if len(held) < hi - a:
                    held = bytearray(min(self.span, max(hi - a, 2 * len(held))))
                    held[: b - a] = memoryview(self.bufs[j])[: b - a]
                    self.bufs[j] = held
                self.slots[j] = (-1, 0, 0)
                self.sources.pread(fi, memoryview(held)[b - a : hi - a], b)
                self.slots[j] = (fi, a, hi)
                self.used[j] = self.clock
                return held, lo - a
        j = min(range(len(self.slots)), key=self.used.__getitem__)
        if len(self.bufs[j]) < hi - lo:
            self.bufs[j] = bytearray(min(self.span, max(hi - lo, 2 * len(self.bufs[j]), 64 << 10)))
        self.slots[j] = (-1, 0, 0)
        self.sources.pread(fi, memoryview(self.bufs[j])[: hi - lo], lo)
        self.slots[j] = (fi, lo, hi)
        self.used[j] = self.clock
        return self.bufs[j], 0

    def gather(self, jobs: Sequence[Job], buf: bytearray, *, check: bool = False) -> bool:
        """Copy the pieces of ``jobs`` into ``buf``; True. With ``check``: False, nothing read,
        when the windows they read from :attr:`shared` files would not all stay in the slots
        (:meth:`keeps`).

        A job ``(file, lo, pos, n, rows, ss, ds)`` moves piece ``i``, ``rows`` rows of ``n`` bytes
        ``ss`` apart from file offset ``lo[i]``, to ``pos[i]`` with rows ``ds`` apart (``lo`` and
        ``pos``: int64 arrays). Files are read in windows of :attr:`span` bytes on a fixed grid,
        so the sibling files that want other pieces of the same bytes find them read; each
        job's pieces in a window are moved with one numpy copy (items of ``n`` bytes at any
        offsets): many small pieces cost a few calls, not Python work per piece. Pieces across
        a grid line, larger than a window, or a few far apart are read on their own.
        """
        windowed, alone, scattered, reach = self._sort(jobs)
        if check and not self._fits(reach):
            return False
        for job in alone:
            self._one_by_one(job, buf)
        for job in scattered:
            self._scattered(job, buf)
        for job in windowed:
            fi = job[0]
            # whole windows when siblings will want the pieces between ours; else only the bytes
            # wanted (alone, or a few tensors, which siblings want whole or cut in a few)
            first, size, pieces = reach[fi]
            if pieces >= _MANY and fi in self.shared:
                first, size = 0, self.sources.size(fi)
            self._windows(job, first, size, buf)
        return True

    def _sort(
        self, jobs: Sequence[Job]
    ) -> tuple[list[Job], list[Job], list[Job], dict[int, tuple[int, int, int]]]:
        """``jobs`` as the ones read in windows (their pieces sorted by offset, the jobs by file and
        first offset), the ones read piece by piece (larger than a window), the few pieces far
        apart (:meth:`_scattered`), and :func:`job_reach` of the first."""
        import numpy as np

        windowed: list[Job] = []
        alone: list[Job] = []
        scattered: list[Job] = []
        reach: dict[int, tuple[int, int, int]] = {}
        for job in jobs:
            fi, lo, pos, n, rows, ss, ds = job
            count = len(lo)
            if not count or n <= 0:
                continue
            extent = (rows - 1) * ss + n
            if extent > self.span or ss < 0 or (rows > 1 and ds < n):
                alone.append(job)
                continue
            if count > 1 and not (lo[1:] >= lo[:-1]).all():
                o = np.argsort(lo, kind="stable")
                lo = lo[o]
                job = (fi, lo, pos[o], n, rows, ss, ds)
            a, b = int(lo[0]), int(lo[-1]) + extent  # job_reach, of sorted offsets
            if 1 < count <= _MANY and count * extent * _SPARSE < b - a:
                scattered.append(job)  # a few pieces far apart (a layer's norms): not the bytes between
                continue
            windowed.append(job)
            hit = reach.get(fi)
            reach[fi] = (a, b, count) if hit is None else (min(a, hit[0]), max(b, hit[1]), hit[2] + count)
        windowed.sort(key=lambda job: (job[0], int(job[1][0])))  # a file's windows serve all in turn
        return windowed, alone, scattered, reach

    def _windows(self, job: Job, first: int, size: int, buf: bytearray) -> None:
        """A job's (sorted) pieces, window by window of the grid: windows of file bytes ``first`` to
        ``size`` (see :meth:`gather`); pieces across a grid line read on their own."""
        import numpy as np

        w = self.span
        fi, lo, pos, n, rows, ss, _ = job
        extent = (rows - 1) * ss + n
        # index arrays for large pieces (a memcpy each); progressions where they are tiny items
        cut = rows > 1 or n < _SMALL
        for i, count, per in _progressions(lo, pos) if cut else [(0, len(lo), None)]:
            while i < count:
                g = int(lo[i]) - int(lo[i]) % w  # the grid window of piece i
                stop = g + w
                j = min(count, int(np.searchsorted(lo, stop - extent, "right")))  # the pieces it holds whole
                if j > i:
                    start = max(g, first)
                    held, at = self.locate(fi, start, max(min(stop, size), int(lo[j - 1]) + extent))
                    if per is None:
                        self._copy(job, i, j, held, at - start, buf)
                    else:
                        _stride(job, i, j, per, held, at - start, buf)
                    i = j
                k = min(count, int(np.searchsorted(lo, stop, "left")))  # those across the grid line
                if k > i:
                    self._one_by_one((fi, lo[i:k], pos[i:k], *job[3:]), buf)
                    i = k

    @staticmethod
    def _copy(job: Job, i: int, j: int, held: bytearray, shift: int, buf: bytearray) -> None:
        """Pieces ``i`` to ``j`` of ``job``, their bytes at ``lo + shift`` in ``held``."""
        import numpy as np

        _, lo, pos, n, rows, ss, ds = job
        item = np.dtype(f"V{n}")
        if rows == 1:
            src = np.ndarray((len(held) - n + 1,), item, held, 0, (1,))
            dst = np.ndarray((len(buf) - n + 1,), item, buf, 0, (1,))
        else:
            extent = (rows - 1) * ss + n
            src = np.ndarray((len(held) - extent + 1, rows), item, held, 0, (1, ss))
            dst = np.ndarray((len(buf) - (rows - 1) * ds - n + 1, rows), item, buf, 0, (1, ds))
        if j == i + 1:
            dst[int(pos[i])] = src[int(lo[i]) + shift]
            return
        # numpy moves them through a temporary: at most _MOVING bytes at a time, since the CLI
        # maps every allocation over 128 KiB afresh, and faulting it in cost more than the copy
        step = max(1, _MOVING // (rows * n))
        for a in range(i, j, step):
            b = min(j, a + step)
            dst[pos[a:b]] = src[lo[a:b] + shift]

    def _scattered(self, job: Job, buf: bytearray) -> None:
        """A job's pieces each from a slot that holds it, else read on its own (:meth:`_one_by_one`):
        a few pieces far apart, whose windows would be read for them alone (the norms of a layer
        or two, which sibling files each want whole: a 1 MiB window read for 384 bytes)."""
        fi, lo, pos, n, rows, ss, ds = job
        extent = (rows - 1) * ss + n
        rest = []
        for i, a in enumerate(lo.tolist()):
            for j, (f, x, y) in enumerate(self.slots):
                if f == fi and x <= a and a + extent <= y:
                    self._copy(job, i, i + 1, self.bufs[j], -x, buf)
                    break
            else:
                rest.append(i)
        if rest:
            self._one_by_one((fi, lo[rest], pos[rest], n, rows, ss, ds), buf)

    def _one_by_one(self, job: Job, buf: bytearray) -> None:
        """A job's pieces each read on its own (across a grid line, or larger than a window):
        straight into the buffer, row by row when strided."""
        import numpy as np

        fi, lo, pos, n, rows, ss, ds = job
        out = memoryview(buf)
        extent = (rows - 1) * ss + n
        for a, p in zip(lo.tolist(), pos.tolist()):
            if rows == 1 or (ss == n == ds):
                self.sources.pread(fi, out[p : p + rows * n], a)
            elif 0 <= ss and extent <= 1 << 20:  # strided: read whole, then its rows
                tmp = bytearray(extent)
                self.sources.pread(fi, memoryview(tmp), a)
                dst = np.ndarray((rows, n), np.uint8, buf, p, (ds, 1))
                dst[...] = np.ndarray((rows, n), np.uint8, tmp, 0, (ss, 1))
            else:
                for r in range(rows):
                    self.sources.pread(fi, out[p + r * ds : p + r * ds + n], a + r * ss)
