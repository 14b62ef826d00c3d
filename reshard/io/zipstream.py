"""Read a ``torch.save`` zip archive as a stream (a zstd-compressed DCP chunk, decompressed as it
is read): record by record, in the order their local headers come, without seeking.

torch.save writes ``<prefix>/data.pkl`` first, then ``.format_version``, ``.storage_alignment``,
``byteorder``, the storages ``data/<key>``, ``version`` and ``.data/serialization_id``, then
the central directory. Its records are stored (never compressed) and, written as a stream, each
followed by a data descriptor (general purpose flag bit 3: the local header's CRC32 and sizes
are zero, the descriptor after the bytes gives them).

:class:`ZipStream` reads the local headers in turn. The caller keeps a small record in memory
(:meth:`ZipStream.small`: its end found by its data descriptor, whose CRC32 and sizes must match
the bytes) or streams a large one elsewhere (:meth:`ZipStream.stream`: its size known by the
caller, its CRC32 computed on the way). Every byte kept (local headers, small records, the
central directory and the end records) is in :attr:`ZipStream.held` at its offset in the
archive, so :func:`~reshard.io.torchzip.read_torch_zip` and
:func:`~reshard.io.torchzip.read_record` check the archive from them as they check a file.

A stream that is not of this shape (records compressed, a data descriptor without its signature,
a record larger than :data:`MAX_HELD` of unknown size, bytes after the central directory over
that size) raises :class:`NotStreamable`: the caller reads it another way. Records whose size is
known to be over :data:`MAX_HELD` and that the caller asks to keep raise
:class:`~reshard.errors.HeaderError`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import HeaderError
from .torchzip import STORED, HeldBytes, _zip64_extra

__all__ = ["ZipStream", "LocalRecord", "NotStreamable", "MAX_HELD"]

#: Largest record :meth:`ZipStream.small` keeps in memory, and largest central directory.
MAX_HELD = 4 << 20
_BLOCK = 1 << 20
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_NEXT_SIGS = (b"PK\x03\x04", b"PK\x01\x02")  # what follows a record: the next one, or the directory
_U32 = 0xFFFFFFFF


class NotStreamable(Exception):
    """The archive is not of the shape :class:`ZipStream` reads; read it another way."""


@dataclass(frozen=True, slots=True)
class LocalRecord:
    """A local header read from the stream.

    Attributes:
        name: the record's name.
        header: offset of its local header in the archive.
        offset: offset of its first data byte.
        size: its size from the header, or None when a data descriptor gives it.
    """

    name: str
    header: int
    offset: int
    size: int | None


class ZipStream:
    """The records of a zip archive read from ``src`` (a stream of its bytes), in order.

    Args:
        src: the archive's bytes (``read(n)``; a short read is not the end, an empty one is).
        where: names the archive in messages (the file and its bytes).

    Attributes:
        held: the bytes kept, at their offsets in the archive.
        pos: the archive offset of the next byte to read.
    """

    def __init__(self, src: BinaryIO, where: str) -> None:
        self._src = src
        self._where = where
        self._buf = bytearray()  # bytes read from src, not consumed: archive offsets [pos, ...)
        self._eof = False
        self._descriptor = False  # the current record is followed by a data descriptor
        self.held = HeldBytes()
        self.pos = 0

    def _fill(self, n: int) -> bool:
        """Whether ``n`` bytes are buffered (reading more as needed)."""
        while len(self._buf) < n and not self._eof:
            block = self._src.read(max(_BLOCK, n - len(self._buf)))
            if not block:
                self._eof = True
            self._buf += block
        return len(self._buf) >= n

    def _take(self, n: int, keep: bool) -> bytes:
        if not self._fill(n):
            raise NotStreamable(f"the archive ends at byte {self.pos + len(self._buf)}")
        data = bytes(self._buf[:n])
        del self._buf[:n]
        if keep:
            self.held.add(self.pos, data)
        self.pos += n
        return data

    def next(self) -> LocalRecord | None:
        """The next record's local header; None at the central directory (the archive's rest, to
        the end of the stream, is then held).

        Raises:
            NotStreamable: a record is compressed or encrypted, or the rest is over
                :data:`MAX_HELD` bytes.
        """
        if not self._fill(4) or self._buf[:4] != _LOCAL_SIG:
            if self.pos == 0:
                raise NotStreamable("no zip local header at byte 0")
            while self._fill(len(self._buf) + 1):
                if len(self._buf) > MAX_HELD:
                    raise NotStreamable("the central directory is over the size held")
            self._take(len(self._buf), keep=True)
            return None
        header = self.pos
        f = _LOCAL.unpack(self._take(_LOCAL.size, keep=True))
        flags, method, csize, usize, nlen, xlen = f[3], f[4], f[8], f[9], f[10], f[11]
        name = self._take(nlen, keep=True).decode("utf-8", "replace")
        extra = self._take(xlen, keep=True)
        if method != STORED or flags & 1:
            raise NotStreamable(f"record {name} is compressed or encrypted")
        if _U32 in (csize, usize):
            sizes = [usize, csize, 0]
            try:
                _zip64_extra(extra, sizes, self._where, self._where)
            except HeaderError as e:
                raise NotStreamable(str(e)) from None
            usize, csize = sizes[0], sizes[1]
        if usize != csize:
            raise NotStreamable(f"stored record {name} has two sizes")
        self._descriptor = bool(flags & 8)
        return LocalRecord(name, header, self.pos, None if self._descriptor and not usize else usize)

    def small(self, rec: LocalRecord) -> bytes:
        """The bytes of ``rec`` (the record :meth:`next` just gave), kept in :attr:`held`.

        Raises:
            HeaderError: its header gives a size over :data:`MAX_HELD`.
            NotStreamable: its data descriptor is not found within :data:`MAX_HELD` bytes.
        """
        if rec.size is not None:
            if rec.size > MAX_HELD:
                raise HeaderError(
                    f"{self._where}: record {rec.name} is {rec.size} bytes, over the {MAX_HELD} "
                    "read into memory; the file is damaged or not written by torch.save",
                    path=self._where,
                )
            data = self._take(rec.size, keep=True)
            if self._descriptor:
                self._skip_descriptor(rec.size)
            return data
        # the end is where a descriptor follows whose CRC32 and sizes are those of the bytes before
        at = 0
        while True:
            i = self._buf.find(_DESCRIPTOR_SIG, at)
            if i < 0 or not self._fill(i + 16):
                at = max(len(self._buf) - 3, 0)
                if len(self._buf) > MAX_HELD or not self._fill(len(self._buf) + 1):
                    raise NotStreamable(f"no data descriptor after record {rec.name}")
                continue
            crc, c4, u4 = struct.unpack_from("<3L", self._buf, i + 4)
            if c4 == u4 == i and zlib.crc32(memoryview(self._buf)[:i]) == crc:
                data = self._take(i, keep=True)
                self._take(16, keep=True)
                return data
            at = i + 1

    def stream(self, rec: LocalRecord, size: int, out: Callable[[memoryview, int], None]) -> int:
        """Give the ``size`` bytes of ``rec`` (the record :meth:`next` just gave) to ``out`` in
        blocks, with their offset in the record; their CRC32.

        Raises:
            NotStreamable: the header gives another size, the archive ends within them, or no data
                descriptor follows them when the header says one does.
        """
        if rec.size is not None and rec.size != size:
            raise NotStreamable(f"record {rec.name} is {rec.size} bytes, not {size}")
        crc = 0
        done = 0
        if self._buf:
            n = min(len(self._buf), size)
            view = memoryview(self._buf)[:n]
            crc = zlib.crc32(view, crc)
            out(view, 0)
            view.release()
            del self._buf[:n]
            done = n
        while done < size:
            block = self._src.read(min(_BLOCK, size - done))
            if not block:
                raise NotStreamable(f"the archive ends within record {rec.name}")
            view = memoryview(block)
            crc = zlib.crc32(view, crc)
            out(view, done)
            done += len(block)
        self.pos += size
        if self._descriptor:
            self._skip_descriptor(size)
        return crc

    def _skip_descriptor(self, size: int) -> None:
        """Step over the data descriptor after a record of ``size`` bytes: its signature, CRC32 and
        sizes in 4 or 8 bytes (zip64), told apart by the signature following it. (Its fields are
        not read: the central directory's are checked.)"""
        if not self._fill(4) or self._buf[:4] != _DESCRIPTOR_SIG:
            raise NotStreamable("a data descriptor without its signature")
        for n in (16, 24) if size < _U32 else (24,):
            if self._fill(n + 4) and bytes(self._buf[n : n + 4]) in _NEXT_SIGS:
                self._take(n, keep=True)
                return
        raise NotStreamable("no record or central directory after a data descriptor")
