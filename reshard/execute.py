"""Run a Plan: move bytes from source pieces into output files under a byte budget.

Two ways bytes move:

* a box contiguous in both the source piece and the target tensor (row-sharded
  pieces, whole tensors) is copied through one reused buffer, hashed on the way
  (``RESHARD_COPY=kernel``: inside the kernel with ``copy_file_range``);
* everything else (column slices, strided shards, casts, Partial reductions)
  is gathered slab by slab into that buffer, from source rows read whole with
  one ``pread`` (or, when far sparser, through a map released as we go), and
  written with one ``pwrite`` per slab.

Each thread writes a group of sibling files in lockstep, slab by slab, so the
ranks that cut the same source rows into columns read those rows once between
them. Every output file is written to ``NAME.tmp``, hashed, then renamed.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .intervals import block_shape, box_span, clip_box, row_major_strides
from .io.header import DTYPE_SIZES
from .plan import PER_RANK, Copy, OutEntry, OutFile, Plan, copy_boxes

__all__ = [
    "DEFAULT_BUFFER",
    "buffer_for",
    "default_workers",
    "memory_estimate",
    "FileResult",
    "SourceFiles",
    "execute_plan",
    "file_checksum",
    "CHECKSUM_PREFIX",
    "PIECE",
    "slabs",
    "PageWindow",
]

DEFAULT_BUFFER = 256 * 1024

COPY_MODE = os.environ.get("RESHARD_COPY", "buffer")
"""How contiguous runs move: ``buffer`` (pread/pwrite through a reused buffer, hashed on
the way) or ``kernel`` (copy_file_range, then the file is read back to hash it)."""
_RELEASE_EVERY = 8 * 1024 * 1024
DENSE = 8
"""A strided source span is read whole with one pread when it holds at most this many
times the bytes needed: cheaper than the page faults of reading it through the map
(measured: HF -> TP-8, 1/8-width columns, 0.88 s against 1.04 s, and less RSS)."""

ProgressFn = Callable[[int], None]


def default_workers() -> int:
    """Writer threads when ``--workers`` is not given: one per core, at most 4.

    Page-cache copies scale across cores here (two threads copy 1.8 GB in 0.48 s
    against 0.72 s for one); more than 4 only adds buffers.
    """
    return max(1, min(4, os.cpu_count() or 1))


def buffer_for(max_memory: int, workers: int) -> int:
    """Slab buffer size per worker for a ``--max-memory`` budget.

    Each worker holds a write buffer (plus one per extra Partial group) and up
    to ``_RELEASE_EVERY`` bytes of mapped source pages; writes of 64-256 KiB
    are the fastest into the page cache, so the buffer is capped there.
    """
    share = max_memory // max(1, workers)
    return max(4096, min(DEFAULT_BUFFER, share // 4))


BASELINE_RSS = 36 * 1024 * 1024
"""Resident memory of the interpreter with reshard, numpy, yaml and rich imported (measured: 34 MiB)."""

TORCH_RSS = 224 * 1024 * 1024
"""What ``import torch`` adds; paid only by casts and Partial reductions (measured)."""


def memory_estimate(plan: Plan, *, workers: int, buffer_size: int) -> int:
    """Peak resident memory a conversion of ``plan`` will use, in bytes.

    Interpreter baseline, plus per worker: one slab buffer per Partial group
    (plus a cast output), mapped source pages up to the release window, and
    the largest output header.
    """
    groups = max((t.groups for t in plan.tensors), default=1)
    casts = any(t.dtype != t.src.dtype for t in plan.tensors) or groups > 1
    per_worker = buffer_size * (groups + (1 if casts else 0) + DENSE) + _RELEASE_EVERY
    header = max((len(f.prefix) for f in plan.files), default=0)
    n = max(1, workers)  # spare workers split a file's entries, so all of them run
    return BASELINE_RSS + (TORCH_RSS if casts else 0) + n * (per_worker + header)


@dataclass(frozen=True, slots=True)
class FileResult:
    name: str
    size: int
    checksum: str
    bytes_read: int = 0
    """Source bytes this run actually moved into the file (0 for a file kept by --resume)."""


CHECKSUM_PREFIX = "xxh3_128-64MiB:"
"""Output checksums: xxh3-128 over the concatenated xxh3-128 digests of the file's
64 MiB pieces. Pieces can be hashed by different threads as they are written,
and a single piece can be re-read, so hashing never costs a second pass."""

PIECE = 64 * 1024 * 1024


def _piece_digest(data: Any) -> bytes:
    import xxhash

    return bytes(xxhash.xxh3_128(data).digest())


def combine_pieces(digests: Sequence[bytes]) -> str:
    """The file checksum from its pieces' digests, in file order."""
    import xxhash

    return CHECKSUM_PREFIX + xxhash.xxh3_128(b"".join(digests)).hexdigest()


def piece_digest_of(path: str | os.PathLike[str], index: int, chunk: int = 8 * 1024 * 1024) -> bytes:
    """Digest of piece ``index`` of a file, read back in chunks into one reused buffer."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(min(chunk, PIECE))
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(index * PIECE)
        left = PIECE
        while left:
            n = f.readinto(mv[: min(len(mv), left)])
            if not n:
                break
            h.update(mv[:n])
            left -= n
    return bytes(h.digest())


def file_checksum(path: str | os.PathLike[str], chunk: int = 8 * 1024 * 1024) -> str:
    """The :data:`CHECKSUM_PREFIX` checksum of a file's bytes."""
    size = os.path.getsize(path)
    pieces = max(1, -(-size // PIECE))
    return combine_pieces([piece_digest_of(path, i, chunk) for i in range(pieces)])


class SourceFiles:
    """Open source files once: a file descriptor and a read-only map each, shared by threads."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = list(paths)
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            with self._lock:
                fd = self._fds.get(i)
                if fd is None:
                    fd = os.open(self._paths[i], os.O_RDONLY)
                    self._fds[i] = fd
        return fd

    def map(self, i: int) -> mmap.mmap:
        mm = self._maps.get(i)
        if mm is None:
            fd = self.fd(i)
            with self._lock:
                mm = self._maps.get(i)
                if mm is None:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                    self._maps[i] = mm
        return mm

    def release(self, i: int) -> None:
        """Drop every mapped page of file ``i`` from this process (the page cache keeps them).

        The whole mapping, not just the ranges read: the kernel maps neighbours of
        each faulting page too (fault-around, read-around), and those would pile up
        run after run. Walking the page tables of a mostly unmapped range is cheap.
        """
        mm = self._maps.get(i)
        if mm is not None and len(mm):
            mm.madvise(mmap.MADV_DONTNEED, 0, len(mm))

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a numpy view still alive; the map goes with it
                pass
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()


class PageWindow:
    """Source pages read through the maps, released (whole mappings) every ``every`` bytes.

    Mapped pages count in a process's RSS; releasing them as reading goes on keeps
    memory bounded however large the source files are.
    """

    def __init__(self, sources: SourceFiles, every: int) -> None:
        self.sources = sources
        self._every = every
        self._touched: set[int] = set()
        self._touched_bytes = 0

    def touch_slices(
        self, fi: int, base: int, strides: Sequence[int], isz: int, key: Sequence[slice]
    ) -> None:
        """Record reading slices ``key`` of the row-major array at byte ``base`` of file ``fi``."""
        first, stop = box_span(strides, [s.start for s in key], [s.stop - s.start for s in key])
        self.touch_range(fi, base + first * isz, base + stop * isz)

    def touch_range(self, fi: int, lo: int, hi: int) -> None:
        """Record that bytes ``[lo, hi)`` of file ``fi`` were read through its map."""
        self._touched.add(fi)
        self._touched_bytes += hi - lo
        if self._touched_bytes >= self._every:
            self.release()

    def release(self) -> None:
        """Drop every mapped page of the files read since the last release."""
        for fi in self._touched:
            self.sources.release(fi)
        self._touched.clear()
        self._touched_bytes = 0


def _np_dtype(itemsize: int) -> Any:
    import numpy as np

    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


def _contiguous(shape: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether a box is one contiguous run of a row-major array of ``shape``."""
    k = len(shape) - 1
    while k > 0 and starts[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    return all(s == 1 for s in sizes[:k])


def _box_offset(shape: Sequence[int], starts: Sequence[int]) -> int:
    return sum(s * st for s, st in zip(starts, row_major_strides(shape)))


def _copy_range(src_fd: int, dst_fd: int, n: int, src_off: int, dst_off: int) -> None:
    """Kernel-side copy of ``n`` bytes; falls back to pread/pwrite where unsupported."""
    while n > 0:
        try:
            done = os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
        except OSError:
            done = 0
        if done <= 0:
            chunk = min(n, DEFAULT_BUFFER)
            data = os.pread(src_fd, chunk, src_off)
            if not data:
                raise OSError(f"unexpected end of source file at offset {src_off}")
            done = os.pwrite(dst_fd, data, dst_off)
        n -= done
        src_off += done
        dst_off += done


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


class _Buffers:
    """One thread's buffers, shared by the writers it runs in lockstep (one at a time).

    ``scratch`` holds the last source window read whole; ``window`` says what it holds,
    ``(file, lo, hi)`` in file bytes, so writers of sibling files that need other columns
    of the same rows take them from it instead of reading them again.
    """

    def __init__(self, budget: int) -> None:
        budget = max(budget, 16)  # at least one item of the widest dtype (C64, F64: 8 bytes)
        self.budget = budget
        self.write = bytearray(budget)
        self.partials: list[bytearray] = []  # slabs of Partial groups 1.. (group 0: the write buffer)
        self.scratch = bytearray(DENSE * budget + 64)  # source spans read whole (<= DENSE x used)
        self.window: tuple[int, int, int] | None = None
        self.pages: PageWindow | None = None

    def pages_of(self, sources: SourceFiles) -> PageWindow:
        """The mapped-page window of this thread (one for all its writers, so bounded)."""
        if self.pages is None:
            self.pages = PageWindow(sources, _RELEASE_EVERY)
        return self.pages

    def slab_buffers(self, groups: int) -> list[bytearray]:
        """One slab buffer per Partial group; group 0 gathers straight into the write buffer."""
        while len(self.partials) < groups - 1:
            self.partials.append(bytearray(self.budget))
        return [self.write, *self.partials[: groups - 1]]

    def read(self, fd: int, fi: int, lo: int, hi: int, wlo: int, whi: int) -> int | None:
        """Make file bytes ``[lo, hi)`` of file ``fi`` available in ``scratch``; returns where they start.

        A hit costs nothing. A miss reads the window ``[wlo, whi)`` (the whole rows around
        ``[lo, hi)``) when it fits in ``scratch``, else just ``[lo, hi)``; None when even that
        does not fit (the caller reads through the map instead).
        """
        w = self.window
        if w is not None and w[0] == fi and w[1] <= lo and hi <= w[2]:
            return lo - w[1]
        if whi - wlo > len(self.scratch):
            wlo, whi = lo, hi
            if hi - lo > len(self.scratch):
                return None
        self.window = None
        n = whi - wlo
        got = os.preadv(fd, [memoryview(self.scratch)[:n]], wlo)
        if got != n:
            raise OSError(f"short read at offset {wlo} (file changed while reading?)")
        self.window = (fi, wlo, whi)
        return lo - wlo


class _Sink:
    """The write stage of one writer: pwrite buffers, hashing 64 MiB pieces on the way.

    A writer writes a consecutive range of the file from ``lo`` on, in order; every piece
    it writes from the first byte to the last is hashed as its bytes go by. Pieces it cannot hash
    (straddling another writer's range, or written out of order) are left to
    :func:`_finish_checksum`, which reads just those back. (A second thread writing
    while the first gathers was measured twice: with one writer per core, and for a
    single output file with a core to spare; neither was faster.)
    """

    def __init__(self, fd: int, lo: int = 0) -> None:
        self.fd = fd
        self.pos = lo  # the next byte expected in order
        self.digests: dict[int, bytes] = {}
        self._hashing = True
        self._cur: Any = None  # hasher of the piece being written, if it started with us
        self._cur_index = -1

    def _hash(self, mv: memoryview) -> None:
        import xxhash

        while len(mv):
            index = self.pos // PIECE
            end = (index + 1) * PIECE
            if index != self._cur_index:
                self._cur_index = index
                # a piece is ours only if we write it from its first byte
                self._cur = xxhash.xxh3_128() if self.pos == index * PIECE else None
            take = min(len(mv), end - self.pos)
            if self._cur is not None:
                self._cur.update(mv[:take])
            self.pos += take
            mv = mv[take:]
            if self.pos == end and self._cur is not None:
                self.digests[index] = bytes(self._cur.digest())
                self._cur = None

    def submit(self, data: Any, off: int) -> None:
        """Write all of ``data`` (bytes-like) at ``off``."""
        mv = memoryview(data)
        if self._hashing:
            if off == self.pos:
                self._hash(mv)
            else:
                self._hashing = False  # out of order: the rest is read back
        while len(mv):
            w = os.pwrite(self.fd, mv, off)
            mv = mv[w:]
            off += w

    def no_hash(self) -> None:
        """Bytes reach the file another way: the rest is read back."""
        self._hashing = False

    def close(self, file_size: int) -> dict[int, bytes]:
        """Digests of the pieces hashed on the way (the last, short piece included)."""
        if self._hashing and self._cur is not None and self.pos == file_size:
            self.digests[self._cur_index] = bytes(self._cur.digest())
        return self.digests


def _finish_checksum(path: Path, size: int, digests: dict[int, bytes]) -> str:
    """The file checksum, reading back only the pieces no writer hashed."""
    pieces = max(1, -(-size // PIECE))
    return combine_pieces([digests[i] if i in digests else piece_digest_of(path, i) for i in range(pieces)])


class _Writer:
    """Writes the entries of one output file (or a consecutive run of them)."""

    def __init__(
        self,
        plan: Plan,
        sources: SourceFiles,
        fd: int,
        bufs: _Buffers,
        progress: ProgressFn | None,
        lo: int = 0,
    ) -> None:
        self.plan = plan
        self.sources = sources
        self.fd = fd
        self.bufs = bufs
        self.budget = bufs.budget
        self.progress = progress
        self.window = bufs.pages_of(sources)
        self.bytes_read = 0
        self.sink = _Sink(fd, lo)

    def write_entry(self, e: OutEntry) -> None:
        for _ in self.entry_steps(e):
            pass

    def entry_steps(self, e: OutEntry) -> Iterator[None]:
        """Write one entry, yielding after each slab (so sibling files can go in lockstep)."""
        t = e.tensor
        copies = t.copies[e.rank]
        dshape = block_shape(t.layout.blocks()[e.rank])
        if e.nbytes == 0:
            return
        transform = t.groups > 1 or t.dtype != t.src.dtype
        if not transform and self._all_contiguous(t.src, copies, dshape):
            isz = DTYPE_SIZES[t.src.dtype]
            runs = []
            for c in copies:
                sshape = t.src.piece_shape(c.piece)
                fi = t.src.piece_files[c.piece]
                base = t.src.piece_offsets[c.piece]
                for s_st, d_st, sz in copy_boxes(c):
                    n = isz
                    for x in sz:
                        n *= x
                    runs.append(
                        (
                            e.start + _box_offset(dshape, d_st) * isz,
                            fi,
                            base + _box_offset(sshape, s_st) * isz,
                            n,
                        )
                    )
            runs.sort()  # in file order, so the file is hashed as it is written
            for dst_off, fi, src_off, n in runs:
                self._copy_run(fi, src_off, dst_off, n)
                self.bytes_read += n
                if self.progress:
                    self.progress(n)
            yield
            return
        yield from self._gather(e, copies, dshape)

    def _copy_run(self, fi: int, src_off: int, dst_off: int, n: int) -> None:
        """Copy one contiguous run: through the write buffer (hashed on the way) or in the kernel."""
        sfd = self.sources.fd(fi)
        if COPY_MODE == "kernel":
            self.sink.no_hash()
            _copy_range(sfd, self.fd, n, src_off, dst_off)
            return
        buf = memoryview(self.bufs.write)
        size = len(buf)
        while n > 0:
            k = os.preadv(sfd, [buf[: min(size, n)]], src_off)
            if k <= 0:
                raise OSError(f"unexpected end of source file at offset {src_off}")
            self.sink.submit(buf[:k], dst_off)
            n -= k
            src_off += k
            dst_off += k

    @staticmethod
    def _all_contiguous(src: Any, copies: Sequence[Copy], dshape: Sequence[int]) -> bool:
        for c in copies:
            sshape = src.piece_shape(c.piece)
            for s_st, d_st, sz in copy_boxes(c):
                if not (_contiguous(sshape, s_st, sz) and _contiguous(dshape, d_st, sz)):
                    return False
        return True

    def _gather(self, e: OutEntry, copies: Sequence[Copy], dshape: tuple[int, ...]) -> Iterator[None]:
        import numpy as np

        t = e.tensor
        src = t.src
        s_isz = DTYPE_SIZES[src.dtype]
        d_isz = DTYPE_SIZES[t.dtype]
        npt = _np_dtype(s_isz)
        budget_items = max(1, self.budget // max(s_isz, d_isz))
        scratch = self.bufs.scratch
        # per copy: its source array (a view of the mapped file) and its boxes
        plans = []
        for c in copies:
            fi = src.piece_files[c.piece]
            sshape = src.piece_shape(c.piece)
            count = 1
            for x in sshape:
                count *= x
            arr = np.frombuffer(
                self.sources.map(fi), dtype=npt, count=count, offset=src.piece_offsets[c.piece]
            ).reshape(sshape)
            strides = row_major_strides(sshape)
            plans.append(
                (c.group, fi, src.piece_offsets[c.piece], sshape, strides, count, arr, list(copy_boxes(c)))
            )
        for slab in slabs(dshape, 1, budget_items):
            sshape_slab = tuple(b - a for a, b in slab)
            n = 1
            for x in sshape_slab:
                n *= x
            bufs = self.bufs.slab_buffers(t.groups)
            views = [np.frombuffer(b, dtype=npt, count=n).reshape(sshape_slab) for b in bufs]
            for g, fi, base, sshape, strides, count, arr, boxes in plans:
                for s_st, d_st, sz in boxes:
                    clipped = clip_box(slab, s_st, d_st, sz)
                    if clipped is None:
                        continue
                    src_sl, dst_sl = clipped
                    starts = [x.start for x in src_sl]
                    sizes = [x.stop - x.start for x in src_sl]
                    used = s_isz
                    for x in sizes:
                        used *= x
                    first, stop = box_span(strides, starts, sizes)
                    at = None
                    if (stop - first) * s_isz <= DENSE * used:
                        # dense enough: the span read whole with one pread (no mapped pages, no
                        # page faults), widened to whole rows so sibling files reuse it
                        row = _row_elems(sshape, strides, sizes)
                        wfirst = first - first % row
                        wstop = min(count, -(-stop // row) * row)
                        at = self.bufs.read(
                            self.sources.fd(fi),
                            fi,
                            base + first * s_isz,
                            base + stop * s_isz,
                            base + wfirst * s_isz,
                            base + wstop * s_isz,
                        )
                    if at is not None:
                        part = np.ndarray(
                            tuple(sizes),
                            dtype=npt,
                            buffer=scratch,
                            offset=at,
                            strides=tuple(st * s_isz for st in strides),
                        )
                    else:
                        # sparse (a narrow column of wide rows): touch only the pages needed
                        self.window.touch_slices(fi, base, strides, s_isz, src_sl)
                        part = arr[src_sl]
                    views[g][dst_sl] = part
                    self.bytes_read += part.nbytes
            off = e.start + _box_offset(dshape, tuple(a for a, _ in slab)) * d_isz
            if t.groups == 1 and t.dtype == src.dtype:
                self.sink.submit(memoryview(bufs[0])[: n * d_isz], off)
            else:
                out = self._transform(t, views, n)
                self.sink.submit(memoryview(out)[: n * d_isz], off)
            if self.progress:
                self.progress(n * d_isz)
            del views
            yield
        del plans
        self.window.release()

    def _transform(self, t: Any, views: list[Any], n: int) -> Any:
        from .torch_ops import cast_reduce

        return cast_reduce(views, t.src.dtype, t.dtype, t.reduce_op, n)


def _row_elems(shape: Sequence[int], strides: Sequence[int], sizes: Sequence[int]) -> int:
    """Elements per "row" of a box's source: the stride of the dim just outside its innermost
    partial dim (1 when the box is whole or only its outermost dim is cut)."""
    j = len(shape) - 1
    while j >= 0 and sizes[j] == shape[j]:
        j -= 1
    return strides[j - 1] if j >= 1 else 1


def _split_entries(entries: Sequence[OutEntry], parts: int) -> list[list[OutEntry]]:
    """Consecutive runs of entries with about equal bytes (file order kept)."""
    total = sum(e.nbytes for e in entries)
    if parts <= 1 or total == 0:
        return [list(entries)]
    out: list[list[OutEntry]] = [[]]
    acc = 0
    for e in entries:
        if out[-1] and acc >= total * len(out) / parts and len(out) < parts:
            out.append([])
        out[-1].append(e)
        acc += e.nbytes
    return out


@functools.cache
def _fallocate() -> Any:
    """``fallocate(2)`` from the C library, or None where there is none (not Linux)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def preallocate(fd: int, size: int) -> None:
    """Give a new, empty file ``size`` bytes, its blocks allocated up front where the file system can.

    Writes into allocated extents skip ext4's per-page delayed-allocation work (measured:
    1 GiB of page-cache writes in 0.13 s against 0.21 s), and a full disk fails here, before
    anything is copied. Where ``fallocate`` is unsupported the file is only extended
    (``posix_fallocate`` is not used: glibc emulates it by writing zeros).
    """
    import ctypes
    import errno

    fn = _fallocate()
    if size > 0 and fn is not None:
        if fn(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)


def _open_tmp(dst: Path, f: OutFile) -> tuple[Path, int]:
    tmp = dst / (f.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        preallocate(fd, f.size)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return tmp, fd


_END = object()


def _write_group(
    plan: Plan,
    files: Sequence[OutFile],
    dst: Path,
    sources: SourceFiles,
    buffer_size: int,
    progress: ProgressFn | None,
) -> list[tuple[Path, int, dict[int, bytes]]]:
    """Write ``NAME.tmp`` of each file in this thread, the files in lockstep.

    Round robin, slab by slab: files that cut the same source rows differently (the
    ranks of a column-sharded tensor) then ask for the same rows one after the other,
    and all but the first take them from the rows just read (see :class:`_Buffers`).
    Each file is still written in order, so it is hashed on the way.

    Returns, per file: the file, the source bytes moved, the digests of its 64 MiB pieces.
    """
    bufs = _Buffers(buffer_size)
    opened: list[tuple[Path, int]] = []
    try:
        for f in files:
            opened.append(_open_tmp(dst, f))
        writers = [_Writer(plan, sources, fd, bufs, progress) for _, fd in opened]

        def steps(w: _Writer, f: OutFile) -> Iterator[None]:
            w.sink.submit(f.prefix, 0)
            for e in f.entries:
                yield from w.entry_steps(e)

        active = [steps(w, f) for w, f in zip(writers, files)]
        while active:
            active = [g for g in active if next(g, _END) is not _END]
    except BaseException:
        for tmp, fd in opened:
            os.close(fd)
            tmp.unlink(missing_ok=True)
        raise
    for _, fd in opened:
        os.close(fd)
    return [(tmp, w.bytes_read, w.sink.close(f.size)) for (tmp, _), w, f in zip(opened, writers, files)]


def _write_split(
    plan: Plan,
    f: OutFile,
    dst: Path,
    sources: SourceFiles,
    buffer_size: int,
    progress: ProgressFn | None,
    parts: int,
) -> tuple[Path, int, dict[int, bytes]]:
    """Write ``NAME.tmp`` of one file with ``parts`` threads, each a consecutive run of its entries.

    Returns the file, the source bytes moved, and the digests of the 64 MiB pieces
    hashed on the way.
    """
    tmp, fd = _open_tmp(dst, f)

    def run(entries: Sequence[OutEntry], lo: int, prefix: bool) -> tuple[int, dict[int, bytes]]:
        w = _Writer(plan, sources, fd, _Buffers(buffer_size), progress, lo)
        if prefix:
            w.sink.submit(f.prefix, 0)
        for e in entries:
            w.write_entry(e)
        return w.bytes_read, w.sink.close(f.size)

    try:
        groups = _split_entries(f.entries, parts)
        starts = [0] + [g[0].start for g in groups[1:]]
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            futs = [pool.submit(run, g, lo, i == 0) for i, (g, lo) in enumerate(zip(groups, starts))]
            results = [fu.result() for fu in futs]
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    digests: dict[int, bytes] = {}
    for _, d in results:
        digests.update(d)
    return tmp, sum(r[0] for r in results), digests


GROUP_FILES = 8
"""Files one thread writes in lockstep: enough for the ranks that split one source row
between them to share its read, few enough to keep open files and headers modest."""


def _groups(files: Sequence[OutFile], workers: int, most: int = GROUP_FILES) -> list[list[OutFile]]:
    """Consecutive files (sibling ranks) in groups: at least one per worker, at most ``most`` each."""
    count = max(min(workers, len(files)), -(-len(files) // most))
    out: list[list[OutFile]] = []
    for i in range(count):
        a, b = i * len(files) // count, (i + 1) * len(files) // count
        if b > a:
            out.append(list(files[a:b]))
    return out


def _finish(f: OutFile, tmp: Path, bytes_read: int, digests: dict[int, bytes]) -> FileResult:
    """Checksum a written ``NAME.tmp`` (reading back only unhashed pieces), rename it into place."""
    checksum = _finish_checksum(tmp, f.size, digests)
    os.replace(tmp, tmp.with_name(f.name))
    return FileResult(f.name, f.size, checksum, bytes_read)


def execute_plan(
    plan: Plan,
    dst: Path,
    *,
    workers: int = 1,
    buffer_size: int = DEFAULT_BUFFER,
    progress: ProgressFn | None = None,
    files: Sequence[OutFile] | None = None,
    on_file_done: Callable[[FileResult], None] | None = None,
) -> list[FileResult]:
    """Write every output file of ``plan`` (or the given subset) into ``dst``.

    Files are handed to ``workers`` threads largest first, so the work is
    balanced by bytes. Results come back in plan order.
    """
    todo = list(plan.files if files is None else files)
    sources = SourceFiles(plan.source.files)
    lock = threading.Lock()

    def prog(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    # fewer files than workers: the spare workers split the files' entries between them
    parts = max(1, workers // max(1, len(todo)))
    results_by_name: dict[str, FileResult] = {}

    def done(f: OutFile, written: tuple[Path, int, dict[int, bytes]]) -> None:
        r = _finish(f, *written)
        with lock:
            if on_file_done is not None:
                on_file_done(r)
            results_by_name[f.name] = r

    def one(f: OutFile) -> None:
        done(f, _write_split(plan, f, dst, sources, buffer_size, prog, parts))

    def group(fs: list[OutFile]) -> None:
        for f, written in zip(fs, _write_group(plan, fs, dst, sources, buffer_size, prog)):
            done(f, written)

    try:
        if parts > 1:
            for f in todo:
                one(f)
        else:
            # per-rank files hold the same tensors cut differently: siblings share reads. hf shards
            # hold different tensors: one at a time, so each finishes (and is journaled) sooner
            most = GROUP_FILES if plan.format == PER_RANK else 1
            groups = sorted(_groups(todo, workers, most), key=lambda g: -sum(f.size for f in g))
            if workers <= 1 or len(groups) <= 1:
                for g in groups:
                    group(g)
            else:
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    for fut in [pool.submit(group, g) for g in groups]:
                        fut.result()
        results = [results_by_name[f.name] for f in todo]
    finally:
        for f in todo:
            (dst / (f.name + ".tmp")).unlink(missing_ok=True)
        sources.close()
    return results
