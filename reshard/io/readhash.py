"""Source verification as the copy reads: hash the bytes read once, read back only what was not.

A source that records hashes of its bytes is checked against them while it is
converted, so a damaged source is not laundered into a fresh checkpoint with
fresh checksums. Two kinds of record, one mechanism:

* ``reshard.json`` lists each file's ``xxh3_128-64MiB`` checksum
  (:mod:`reshard.io.checksum`): the regions are the file's 64 MiB pieces, whose
  digests make the file's checksum;
* DCP ``.distcp`` chunks and ``torch.save`` records carry the CRC32 of each
  tensor piece (:attr:`~reshard.checkpoint.TensorSource.piece_crc32`): the regions
  are those pieces.

A region's hash must be fed its bytes in order, but the copy reads in its own
order, on several threads. :meth:`ReadHashes.feed` (the
:class:`~reshard.io.pages.SourceFiles` ``seen`` hook) takes every span read:
the part at a region's cursor is hashed (one thread at a time per region, outside
any lock, so threads hashing different regions run in parallel: xxh3 and CRC32
release the GIL); a part ahead of the cursor is copied aside, within a byte
budget, and hashed when the cursor reaches it; a part behind it was hashed
already. :meth:`ReadHashes.problems`, after the copy, reads back only what no
span covered in order (pieces of files a ``--resume`` kept, headers the copy
never reads, spans past the budget) and compares.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SourceChangedError
from .checksum import PIECE, combine_pieces, crc32

__all__ = ["Region", "CrcRegions", "ReadHashes", "Mismatch", "xxh3_regions"]

_READ_BACK = 1 << 20
_BLOCK = 256 << 10
"""Spans held aside at least this long go into reused blocks of this size: a fresh ``bytes``
that large is a fresh mapping under the CLI's mmap threshold, and memory touched for the
first time costs more here than the copy into it (``MACHINE-NOTES``: HF -> TP-8 of 2 GB
with two workers held ~500 MiB that way and spent 0.6 s of system time on it)."""
_SMALL_COST = 320
"""What a short span held aside costs beside its bytes, counted against the budget: its
``bytes`` header, memoryview and heap tuple (~300 bytes). HF -> TP-64 at 200k tensors held
169k spans of 2-384 bytes: 16 MiB counted, 28 MiB used."""
_GAP = 2 << 20
"""A span at most this far ahead of a region's cursor, and at most a 64th of the region, is
joined to it by reading the bytes between (padding, a tensor read later or never). A span
further ahead is held aside, within the budget, else read back after the copy. Bytes the
copy never reads (a file's header, before its first piece) do not count: they are read
either way. The 64th keeps a small file's joins small whichever thread reads first: with
2 MiB, two workers consolidating 6 MiB files read up to 1.5 MiB of a file again when the
second worker got to its part before the first had read up to it."""


@dataclass(frozen=True, slots=True)
class Region:
    """A byte range ``[start, stop)`` of a source file with a recorded hash.

    ``crc``: the recorded CRC32 of the range (a tensor piece), None for a 64 MiB
    piece of a file whose whole ``xxh3_128-64MiB`` checksum is recorded instead.
    ``what``: how to name the range in an error (the tensor and its box).
    """

    start: int
    stop: int
    crc: int | None = None
    what: str = ""
    tensor: str | None = None


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A file (or tensor piece) whose bytes do not have their recorded hash."""

    path: str
    message: str
    tensor: str | None = None


def xxh3_regions(size: int) -> list[Region]:
    """The 64 MiB pieces of a file of ``size`` bytes (one, empty, for an empty file)."""
    return [Region(i * PIECE, min(size, (i + 1) * PIECE)) for i in range(max(1, -(-size // PIECE)))]


class CrcRegions:
    """One file's CRC32 regions as columns, sorted by start, not a :class:`Region` each (a
    ``dcp.save`` of 100k tensors from 4 ranks has 400k chunks: their objects and error texts
    were 85 MiB). ``describe(tensor, piece)`` words a region in an error, when one is made."""

    __slots__ = ("starts", "stops", "crcs", "tensors", "pieces", "describe")

    def __init__(self, describe: Callable[[str, int], str]) -> None:
        self.starts = array("q")
        self.stops = array("q")
        self.crcs = array("q")
        self.tensors: list[str] = []
        self.pieces = array("q")
        self.describe = describe

    def append(self, start: int, stop: int, crc: int, tensor: str, piece: int) -> None:
        self.starts.append(start)
        self.stops.append(stop)
        self.crcs.append(crc)
        self.tensors.append(tensor)
        self.pieces.append(piece)

    def __len__(self) -> int:
        return len(self.starts)

    def region(self, i: int) -> Region:
        t = self.tensors[i]
        return Region(self.starts[i], self.stops[i], self.crcs[i], self.describe(t, self.pieces[i]), t)


Regions = Sequence[Region] | CrcRegions
"""A file's regions: :class:`Region` objects, or :class:`CrcRegions` columns."""


class _Crc:
    """A CRC32 that takes ``update`` like a hasher."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = crc32(data, self.value)


_Held = tuple[int, int, memoryview, "bytearray | None"]
"""A span held aside: (file offset, sequence number, its bytes, the pool block holding them
or None for a small span copied to its own ``bytes``)."""


@dataclass(slots=True)
class _State:
    """A region being hashed: its hasher, how far it got, the spans held for later."""

    hasher: Any
    cursor: int
    busy: bool = False  # a thread is feeding the hasher (outside the lock)
    held: list[_Held] = field(default_factory=list)  # heap, by file offset


class _File:
    """One file's regions, their states and results."""

    def __init__(
        self, path: str, regions: Sequence[Region] | CrcRegions, checksum: str | None, unread: int
    ) -> None:
        self.path = path
        self.unread = unread  # the copy reads nothing before this offset (the file's header)
        self.regions: Sequence[Region] | CrcRegions
        self.starts: Sequence[int]
        self.stops: Sequence[int]
        if isinstance(regions, CrcRegions):
            self.regions, self.starts, self.stops = regions, regions.starts, regions.stops
        else:
            self.regions = listed = list(regions)
            self.starts, self.stops = [r.start for r in listed], [r.stop for r in listed]
        self.checksum = checksum  # the recorded file checksum (xxh3 pieces) or None (CRC regions)
        self.states: dict[int, _State] = {}
        self.results: dict[int, Any] = {}  # region index -> digest bytes or CRC32
        self.lock = threading.Lock()

    def state(self, i: int) -> _State:
        st = self.states.get(i)
        if st is None:
            hasher: Any = _Crc() if self.checksum is None else _xxh3()
            st = self.states[i] = _State(hasher, self.starts[i])
        return st

    def region(self, i: int) -> Region:
        regions = self.regions
        return regions.region(i) if isinstance(regions, CrcRegions) else regions[i]


def _xxh3() -> Any:
    import xxhash

    return xxhash.xxh3_128()


class ReadHashes:
    """The recorded hashes of a source's files, fed the bytes the copy reads.

    Args:
        files: per file index with a record: its path, its regions, and the recorded
            ``xxh3_128-64MiB`` checksum (regions: :func:`xxh3_regions`) or None (regions
            carry CRC32s).
        hold: bytes of spans read ahead of a region's cursor that may be kept aside.
        unread: per file index, the offset before which the copy reads nothing (where its
            first piece starts: a header is read back whole, never waited for).
    """

    def __init__(
        self,
        files: dict[int, tuple[str, Sequence[Region] | CrcRegions, str | None]],
        hold: int,
        unread: dict[int, int] | None = None,
    ) -> None:
        skip = unread or {}
        self._files = {fi: _File(p, regs, cs, skip.get(fi, 0)) for fi, (p, regs, cs) in files.items() if regs}
        self._hold = hold
        self._held = 0
        self._lock = threading.Lock()
        self._blocks: list[bytearray] = []  # pool blocks free for reuse (touched once)
        self._seq = itertools.count()  # ties between spans held at one offset (never compare bytes)
        self._local = threading.local()  # each thread's read-back buffer
        self.read_back = 0  # bytes read again by problems() (what the copy did not hash)

    def __bool__(self) -> bool:
        return bool(self._files)

    def feed(self, fi: int, offset: int, data: memoryview) -> None:
        """Take a span the copy read: ``data`` at ``offset`` of file ``fi`` (any thread)."""
        f = self._files.get(fi)
        if f is None:
            return
        end = offset + len(data)
        starts, stops = f.starts, f.stops
        i = max(0, bisect_right(starts, offset) - 1)
        n = len(starts)
        while i < n and starts[i] < end:
            stop = stops[i]
            if stop > offset and i not in f.results:
                lo, hi = max(offset, starts[i]), min(end, stop)
                self._feed_region(f, i, lo, data[lo - offset : hi - offset])
            i += 1

    def _feed_region(self, f: _File, i: int, lo: int, data: memoryview) -> None:
        hi = lo + len(data)
        with f.lock:
            if i in f.results:
                return
            st = f.state(i)
            if hi <= st.cursor:
                return  # hashed already
            if st.busy:  # another thread is hashing: hold the new part for it (or drop it)
                at = max(lo, st.cursor)
                self._keep(st, at, data[at - lo :])
                return
            # a span far ahead of the cursor is held for when the cursor gets there (another
            # thread's or a sibling's reads fill the bytes between); a span near it, or one the
            # budget cannot hold, is joined to it by reading the bytes between here
            gap = lo - max(st.cursor, min(f.unread, lo))
            if gap > min(_GAP, (f.stops[i] - f.starts[i]) >> 6) and self._keep(st, lo, data):
                return
            st.busy = True
            at_cursor = lo == st.cursor and not st.held
        if at_cursor:  # the usual case, a read in order: hash it, no span list, one more lock
            st.hasher.update(data)
            with f.lock:
                st.cursor = hi
                if not st.held:
                    if hi >= f.stops[i]:
                        self._finish(f, i, st)
                    else:
                        st.busy = False
                    return
            self._own(f, i, st, hi, [])  # spans held meanwhile by other threads: take them on
            return
        self._own(f, i, st, hi, [(lo, data)])

    def _keep(self, st: _State, at: int, data: memoryview) -> bool:
        """Hold a span ahead of the cursor if the budget allows (else it is read back later).

        A long span is copied into pool blocks (each counted whole against the budget), a
        short one into its own ``bytes``. Called with the file's lock held.
        """
        n = len(data)
        if n < _BLOCK // 4:
            with self._lock:
                if self._held + n + _SMALL_COST > self._hold:
                    return False
                self._held += n + _SMALL_COST
            heapq.heappush(st.held, (at, next(self._seq), memoryview(bytes(data)), None))
            return True
        count = -(-n // _BLOCK)
        with self._lock:
            if self._held + count * _BLOCK > self._hold:
                return False
            self._held += count * _BLOCK
            blocks = [self._blocks.pop() if self._blocks else bytearray(_BLOCK) for _ in range(count)]
        for k, block in enumerate(blocks):
            part = data[k * _BLOCK : (k + 1) * _BLOCK]
            view = memoryview(block)[: len(part)]
            view[:] = part
            heapq.heappush(st.held, (at + k * _BLOCK, next(self._seq), view, block))
        return True

    def _own(self, f: _File, i: int, st: _State, want: int, span: list[tuple[int, memoryview]]) -> None:
        """This thread owns region ``i``'s hasher (``st.busy``): take its cursor to ``want``.

        Hashes ``span`` (none, or the one just read) and the held spans as the cursor
        reaches them, reading from the file the bytes no span holds; then finishes the
        region or lets the hasher go.
        """
        r_stop = f.stops[i]
        fd = -1
        used: _Held | None = None  # the held span being hashed: its block is freed after
        try:
            while True:
                with f.lock:
                    if used is not None:
                        self._release(used)
                        used = None
                    take, used = self._next(st, span)
                    if take is None:
                        if st.cursor >= r_stop:
                            self._finish(f, i, st)
                            return
                        if st.cursor >= want:
                            st.busy = False
                            return
                        at = st.cursor
                        stop = min([want, *(lo for lo, _ in span), *(st.held[0][:1] if st.held else ())])
                if take is not None:
                    st.hasher.update(take)
                    continue
                if fd < 0:
                    fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
                buf = self._buffer(min(_READ_BACK, stop - at))
                n = min(len(buf), stop - at)
                st.hasher.update(_pread(fd, buf[:n], at, f.path))
                self.read_back += n
                with f.lock:
                    st.cursor = at + n
        finally:
            if used is not None:
                with f.lock:
                    self._release(used)
            if fd >= 0:
                os.close(fd)

    def _buffer(self, n: int) -> memoryview:
        """This thread's read-back buffer, at least ``n`` bytes (at least 64 KiB), reused."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(max(n, 1 << 16))
        return memoryview(buf)

    def _next(self, st: _State, span: list[tuple[int, memoryview]]) -> tuple[memoryview | None, _Held | None]:
        """The next bytes at the cursor, from a held span or ``span`` (emptied once used), and
        the cursor moved past them; None when neither reaches the cursor (held spans and
        ``span`` behind it are dropped). Second: the held span the bytes come from, to
        :meth:`_release` once they are hashed. Called with the file's lock held."""
        while st.held and st.held[0][0] <= st.cursor:
            held = heapq.heappop(st.held)
            at, _, data, _ = held
            if at + len(data) > st.cursor:
                out = data[st.cursor - at :]
                st.cursor = at + len(data)
                return out, held
            self._release(held)
        if span and span[0][0] <= st.cursor:
            lo, mv = span.pop()
            if lo + len(mv) > st.cursor:
                out = mv[st.cursor - lo :]
                st.cursor = lo + len(mv)
                return out, None
        return None, None

    def _release(self, held: _Held) -> None:
        """A held span is done with: its budget back, its block back to the pool."""
        block = held[3]
        with self._lock:
            if block is None:
                self._held -= len(held[2]) + _SMALL_COST
            else:
                self._held -= _BLOCK
                self._blocks.append(block)

    def _finish(self, f: _File, i: int, st: _State) -> None:
        """Region ``i`` is hashed whole (called with ``f.lock`` held)."""
        h = st.hasher
        f.results[i] = h.value if isinstance(h, _Crc) else bytes(h.digest())
        for held in st.held:
            self._release(held)
        del f.states[i]

    def problems(self) -> list[Mismatch]:
        """After the copy: read back what was not hashed on the way; the mismatches, in file order.

        Raises:
            SourceChangedError: a file ended early (it shrank since it was opened).
        """
        out: list[Mismatch] = []
        for f in self._files.values():
            self._complete(f)
            if f.checksum is not None:
                got = combine_pieces([f.results[i] for i in range(len(f.starts))])
                if got != f.checksum:
                    msg = (
                        f"{f.path}: checksum {got} does not match {f.checksum} in reshard.json; "
                        "the file's bytes changed since it was written"
                    )
                    out.append(Mismatch(f.path, msg))
                continue
            regions = f.regions
            crcs = regions.crcs if isinstance(regions, CrcRegions) else [r.crc for r in regions]
            for i in range(len(f.starts)):
                if f.results[i] != crcs[i]:
                    r = f.region(i)
                    msg = (
                        f"{f.path}: {r.what}: CRC32 {f.results[i]:08x} does not match the recorded "
                        f"{r.crc:08x}; the file's bytes changed since it was written"
                    )
                    out.append(Mismatch(f.path, msg, r.tensor))
        return out

    def _complete(self, f: _File) -> None:
        """Hash every region of ``f`` not finished during the copy, reading back what is missing."""
        for i in range(len(f.starts)):
            if i not in f.results:
                st = f.state(i)
                st.busy = True
                self._own(f, i, st, f.stops[i], [])


def _pread(fd: int, buf: memoryview, offset: int, path: str) -> memoryview:
    got = os.preadv(fd, [buf], offset)
    if got != len(buf):
        raise SourceChangedError(
            f"{path}: the source file ended early ({got} of {len(buf)} bytes at offset {offset}); "
            "it changed while being read",
            path=path,
        )
    return buf
