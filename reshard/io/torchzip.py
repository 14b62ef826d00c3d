"""Read a ``torch.save`` zip archive lying in a byte range of a file, without torch or zipfile.

A DCP ``.distcp`` file is ``torch.save`` archives back to back (one per chunk,
at ``_StorageInfo.offset``, ``length`` bytes); a ``.pt`` file is one archive
at offset 0. torch writes its records **stored** (never compressed), 64-byte
aligned relative to the archive start, with a CRC32 each, and switches to
zip64 records past 4 GiB. Offsets inside the archive are relative to its
first byte.

This module parses the end-of-central-directory record (zip64 included), the
central directory and each record's local header, so a record's data is known
as an absolute ``[offset, offset + size)`` of the file: tensor bytes are then
read by ``pread`` straight from the file, never unzipped into memory. Every
field is bounds-checked against the range; bad input raises
:class:`~reshard.errors.HeaderError` naming the file and the archive offset.
:class:`ArchiveReader` reads many archives of one file (DCP chunks), parsing
each layout once and matching the others against it.

Example:
    >>> import io, os, tempfile, zipfile
    >>> buf = io.BytesIO()
    >>> with zipfile.ZipFile(buf, "w") as z:
    ...     z.writestr("archive/data.pkl", b"PKL")
    >>> fd, name = tempfile.mkstemp()
    >>> _ = os.write(fd, b"junk" + buf.getvalue()); os.close(fd)
    >>> with open(name, "rb") as f:
    ...     tz = read_torch_zip(f.fileno(), name, 4, len(buf.getvalue()))
    ...     tz.prefix, read_record(f.fileno(), tz, tz.record("data.pkl"))
    ('archive', b'PKL')
    >>> os.unlink(name)
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from ..errors import HeaderError

__all__ = [
    "STORED",
    "ZipRecord",
    "TorchZip",
    "read_torch_zip",
    "read_record",
    "crc32_range",
    "MAX_SMALL_RECORD",
    "CHECKED_RECORDS",
    "ArchiveLayout",
    "ArchiveReader",
    "HeldBytes",
    "NotHeld",
    "layout_of",
]

#: Zip compression method "stored" (torch writes only this).
STORED = 0
#: Largest record :func:`read_record` reads into memory (data.pkl, byteorder, ...).
MAX_SMALL_RECORD = 64 << 20

_EOCD = struct.Struct(
    "<4s4H2LH"
)  # sig, disk, cd disk, entries here, entries, cd size, cd offset, comment len
_EOCD_SIG = b"PK\x05\x06"
_LOC64 = struct.Struct("<4sLQL")  # sig, disk of eocd64, eocd64 offset, disks
_LOC64_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct(
    "<4sQ2H2L4Q"
)  # sig, size, made, needed, disk, cd disk, entries here, entries, cd size, cd off
_EOCD64_SIG = b"PK\x06\x06"
_CDIR = struct.Struct("<4s4B4HL2L5H2L")
_CDIR_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIG = b"PK\x03\x04"
_ZIP64_EXTRA = 0x0001
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_MAX_COMMENT = 0xFFFF
_CRC_BLOCK = 8 << 20


@dataclass(frozen=True, slots=True)
class ZipRecord:
    """One archive member, its data located in the file.

    Attributes:
        name: the member name (``archive/data/0``).
        offset: absolute file offset of the member's first data byte.
        size: uncompressed size in bytes.
        compressed_size: stored size in bytes (equal to ``size`` when stored).
        compress_type: zip method (0 = stored).
        crc32: the CRC32 the archive records for the uncompressed bytes.
        header: the record's local header, relative to the archive's first byte.
        entry: the record's central directory entry, relative to the archive's first byte.
        flags: the general purpose flags (bit 3: a data descriptor follows the bytes).
    """

    name: str
    offset: int
    size: int
    compressed_size: int
    compress_type: int
    crc32: int
    header: int = -1
    entry: int = -1
    flags: int = 0


@dataclass(frozen=True, slots=True)
class TorchZip:
    """A parsed archive: its byte range in ``path`` and its records by name."""

    path: str
    base: int
    length: int
    prefix: str
    records: dict[str, ZipRecord]

    def record(self, suffix: str) -> ZipRecord:
        """The record ``<prefix>/<suffix>`` (``data.pkl``, ``data/0``, ``byteorder``).

        Raises:
            HeaderError: the archive has no such record.
        """
        rec = self.records.get(f"{self.prefix}/{suffix}")
        if rec is None:
            raise HeaderError(
                f"{self.where}: the torch.save archive has no record {self.prefix}/{suffix}; "
                "the file is damaged or not written by torch.save",
                path=self.path,
            )
        return rec

    def get(self, suffix: str) -> ZipRecord | None:
        """The record ``<prefix>/<suffix>``, or None."""
        return self.records.get(f"{self.prefix}/{suffix}")

    @property
    def where(self) -> str:
        return f"{self.path} (archive at byte {self.base})" if self.base else self.path


class NotHeld(Exception):
    """A read of :class:`HeldBytes` asked for bytes not held."""


class HeldBytes:
    """The parts of an archive kept in memory, read by :func:`read_torch_zip` and
    :func:`read_record` as a file is (a streamed archive: its local headers, small records and
    central directory; its large record went elsewhere). Parts are added in increasing offset
    order; a read of bytes not held raises :class:`NotHeld`.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._parts: list[bytes] = []

    def add(self, at: int, data: bytes) -> None:
        if data:
            self._starts.append(at)
            self._parts.append(data)

    def pread(self, n: int, off: int) -> bytes:
        k = bisect_right(self._starts, off) - 1
        if k >= 0:
            rel = off - self._starts[k]
            part = self._parts[k]
            if rel + n <= len(part):
                return part[rel : rel + n]
        raise NotHeld(off, n)


def _pread(fd: int | HeldBytes, n: int, off: int, path: str) -> bytes:
    data = fd.pread(n, off) if isinstance(fd, HeldBytes) else os.pread(fd, n, off)
    if len(data) != n:
        raise HeaderError(
            f"{path}: file ends at byte {off + len(data)}, expected {n} bytes at {off}; "
            "the file is truncated",
            path=path,
        )
    return data


def _bad(where: str, path: str, what: str) -> HeaderError:
    return HeaderError(f"{where}: {what}; the file is damaged or not a torch.save archive", path=path)


def _find_eocd(fd: int | HeldBytes, path: str, where: str, base: int, length: int) -> tuple[int, bytes]:
    """Archive-relative position and bytes of the end-of-central-directory record."""
    last = _pread(fd, _EOCD.size, base + length - _EOCD.size, path)
    if last[:4] == _EOCD_SIG and _EOCD.unpack(last)[7] == 0:  # torch writes no comment: one small read
        return length - _EOCD.size, last
    tail = min(length, _EOCD.size + _MAX_COMMENT)
    buf = _pread(fd, tail, base + length - tail, path)
    i = buf.rfind(_EOCD_SIG)
    while i >= 0:
        rec = buf[i : i + _EOCD.size]
        if len(rec) == _EOCD.size and i + _EOCD.size + _EOCD.unpack(rec)[7] == tail:
            return length - tail + i, rec
        i = buf.rfind(_EOCD_SIG, 0, i)
    raise _bad(where, path, "no zip end-of-central-directory record")


def _central_directory(
    fd: int | HeldBytes, path: str, where: str, base: int, length: int
) -> tuple[int, int, int]:
    """``(entries, cd_offset, cd_size)``, from the zip64 record when the classic one overflows."""
    pos, rec = _find_eocd(fd, path, where, base, length)
    _, disk, cd_disk, _, entries, cd_size, cd_off, _ = _EOCD.unpack(rec)
    if disk or cd_disk:
        raise _bad(where, path, "multi-disk zip archive")
    if entries == _U16 or cd_size == _U32 or cd_off == _U32:
        if pos < _LOC64.size:
            raise _bad(where, path, "zip64 fields without a zip64 locator")
        sig, _, e64, _ = _LOC64.unpack(_pread(fd, _LOC64.size, base + pos - _LOC64.size, path))
        if sig != _LOC64_SIG or e64 + _EOCD64.size > pos:
            raise _bad(where, path, "bad zip64 end-of-central-directory locator")
        f = _EOCD64.unpack(_pread(fd, _EOCD64.size, base + e64, path))
        if f[0] != _EOCD64_SIG:
            raise _bad(where, path, "bad zip64 end-of-central-directory record")
        entries, cd_size, cd_off = f[7], f[8], f[9]
        end = e64
    else:
        end = pos
    if cd_off + cd_size > end:
        raise _bad(where, path, f"central directory [{cd_off}, {cd_off + cd_size}) runs past byte {end}")
    return entries, cd_off, cd_size


def _zip64_extra(extra: bytes, sizes: list[int], where: str, path: str) -> None:
    """Fill the 0xFFFFFFFF fields of ``sizes`` (size, compressed size, offset) from the zip64 extra."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, i)
        body = extra[i + 4 : i + 4 + n]
        if tag == _ZIP64_EXTRA:
            j = 0
            for k in range(3):
                if sizes[k] == _U32:
                    if j + 8 > len(body):
                        raise _bad(where, path, "short zip64 extra field")
                    sizes[k] = struct.unpack_from("<Q", body, j)[0]
                    j += 8
            return
        i += 4 + n
    if _U32 in sizes:
        raise _bad(where, path, "zip64 sizes without a zip64 extra field")


def _entry(
    cd: bytes, i: int, fd: int | HeldBytes, path: str, where: str, base: int, length: int, cd_off: int
) -> tuple[ZipRecord, int]:
    """The central directory entry at ``cd[i:]``, located through its local header; and the next ``i``."""
    if i + _CDIR.size > len(cd):
        raise _bad(where, path, "central directory is shorter than its entry count")
    f = _CDIR.unpack_from(cd, i)
    if f[0] != _CDIR_SIG:
        raise _bad(where, path, f"bad central directory entry signature at +{i}")
    flags, method, crc, csize, usize, nlen, xlen, clen = f[5], f[6], f[9], f[10], f[11], f[12], f[13], f[14]
    name_b = cd[i + _CDIR.size : i + _CDIR.size + nlen]
    extra = cd[i + _CDIR.size + nlen : i + _CDIR.size + nlen + xlen]
    nxt = i + _CDIR.size + nlen + xlen + clen
    if nxt > len(cd):
        raise _bad(where, path, "central directory entry runs past the directory")
    name = name_b.decode("utf-8", "replace")
    if flags & 1:
        raise _bad(where, path, f"record {name} is encrypted")
    sizes = [usize, csize, f[18]]
    _zip64_extra(extra, sizes, where, path)
    usize, csize, hoff = sizes
    if hoff + _LOCAL.size > length:
        raise _bad(where, path, f"record {name}'s local header at +{hoff} is outside the archive")
    loc = _LOCAL.unpack(_pread(fd, _LOCAL.size, base + hoff, path))
    if loc[0] != _LOCAL_SIG:
        raise _bad(where, path, f"record {name} has no local header at +{hoff}")
    start = hoff + _LOCAL.size + loc[10] + loc[11]
    if start + csize > length:
        raise _bad(
            where,
            path,
            f"record {name} bytes [{start}, {start + csize}) run past the archive's {length} bytes",
        )
    if method == STORED and csize != usize:
        raise _bad(where, path, f"stored record {name} has compressed size {csize} != size {usize}")
    return ZipRecord(name, base + start, usize, csize, method, crc, hoff, cd_off + i, flags), nxt


def read_torch_zip(fd: int | HeldBytes, path: str, base: int = 0, length: int | None = None) -> TorchZip:
    """Parse the ``torch.save`` archive occupying ``[base, base + length)`` of an open file.

    Args:
        fd: an open file descriptor (read with ``os.pread``; its position is not used), or the
            :class:`HeldBytes` of a streamed archive (then ``length`` is given).
        path: the file's name, for messages.
        base: absolute offset of the archive's first byte.
        length: archive size in bytes; default: to the end of the file.

    Returns:
        The archive's records, keyed by full name; ``prefix`` is the common
        first path component (``archive`` for DCP chunks, the file stem for a
        ``torch.save`` to a path).

    Raises:
        HeaderError: the range is not a well-formed single-disk zip archive, or
            its records do not share one top-level folder.
    """
    if length is None:
        assert isinstance(fd, int), "a HeldBytes archive's length is given"
        length = os.fstat(fd).st_size - base
    where = f"{path} (archive at byte {base})" if base else path
    if length < _EOCD.size:
        raise _bad(where, path, f"{length} bytes are too few for a zip archive")
    entries, cd_off, cd_size = _central_directory(fd, path, where, base, length)
    cd = _pread(fd, cd_size, base + cd_off, path)
    records: dict[str, ZipRecord] = {}
    i = 0
    for _ in range(entries):
        rec, i = _entry(cd, i, fd, path, where, base, length, cd_off)
        records[rec.name] = rec
    prefixes = {n.split("/", 1)[0] for n in records}
    if len(prefixes) != 1 or any("/" not in n for n in records):
        shown = ", ".join(sorted(records)[:4]) or "none"
        raise _bad(where, path, f"records ({shown}) do not share one top-level folder")
    return TorchZip(path, base, length, prefixes.pop(), records)


def read_record(fd: int | HeldBytes, tz: TorchZip, rec: ZipRecord, *, limit: int = MAX_SMALL_RECORD) -> bytes:
    """The bytes of a small stored record, CRC-checked.

    Raises:
        HeaderError: the record is compressed, larger than ``limit``, or its CRC32 does not match.
    """
    if rec.compress_type != STORED:
        raise HeaderError(
            f"{tz.where}: record {rec.name} is compressed (zip method {rec.compress_type}); "
            "torch.save stores records uncompressed",
            path=tz.path,
        )
    if rec.size > limit:
        raise HeaderError(f"{tz.where}: record {rec.name} is {rec.size} bytes, over {limit}", path=tz.path)
    data = _pread(fd, rec.size, rec.offset, tz.path)
    if zlib.crc32(data) != rec.crc32:
        raise HeaderError(
            f"{tz.where}: record {rec.name} fails its CRC32 check; the file is damaged", path=tz.path
        )
    return data


def crc32_range(fd: int, offset: int, size: int, path: str, *, block: int = _CRC_BLOCK) -> int:
    """CRC32 of ``size`` bytes at ``offset``, read in blocks of at most ``block`` bytes."""
    crc = 0
    pos = 0
    while pos < size:
        n = min(block, size - pos)
        crc = zlib.crc32(_pread(fd, n, offset + pos, path), crc)
        pos += n
    return crc


# --------------------------------------------------------------------------- many small archives

#: The records whose bytes a reader checks (their CRC32 and bytes are part of a layout).
CHECKED_RECORDS = ("data.pkl", "byteorder")
#: Records torch.save writes the same in every archive: a layout takes their bytes as they are
#: (an archive where they differ is another layout); the others (storages, the save's id) vary.
_CONSTANT_RECORDS = (".format_version", ".storage_alignment", "version")
_DESCRIPTOR_SIG = b"PK\x07\x08"
_MAX_LAYOUTS = 64  # per archive length: past this, archives of new layouts are parsed one by one
_RELEASE = 2 << 20
"""Bytes of a file after which the map's pages are given back (a reader per file: with 8 MiB,
the 8 files of a TP-8 DCP of 100k tensors held 64 MiB of pages at the peak)."""


@dataclass(eq=False, slots=True)
class ArchiveLayout:
    """What every archive of one layout has: the same length, records, and bytes, but for the
    bytes and CRC32s of the records a reader does not check (tensor storages, the save's id).

    Attributes:
        length: the archive's size in bytes.
        prefix: the records' top-level folder (``archive``).
        records: by full name, offsets relative to the archive (``base`` 0); the CRC32 of a
            record in ``varying`` is the one of the archive this layout was learnt from.
        checked: the bytes of :data:`CHECKED_RECORDS` present, by suffix (CRC32-checked).
        varying: the storage records (``<prefix>/data/...``) whose CRC32 each archive gives.
        split: ``[start, stop)`` of the largest unchecked record's bytes, never read.
        head: matches the archive's bytes before ``split``.
        head_bytes: those bytes, when none of them varies (compared, faster than a match).
        tail: matches the bytes after it; its groups are the ``varying`` CRC32s.
        tail_parts: what :meth:`match` compares instead of ``tail`` (the same test: every part
            of ``tail`` has a fixed length, so its literal bytes are at fixed offsets): a getter
            of those byte ranges of the tail, their bytes, and the offsets in the archive of the
            ``varying`` CRC32s; None when ``tail`` never matches (a layout of one archive).
    """

    length: int
    prefix: str
    records: dict[str, ZipRecord]
    checked: dict[str, bytes]
    varying: tuple[str, ...]
    split: tuple[int, int]
    head: re.Pattern[bytes]
    head_bytes: bytes | None
    tail: re.Pattern[bytes]
    tail_parts: tuple[Callable[[bytes], Any], Any, tuple[int, ...]] | None = field(default=None)

    def match(self, mm: mmap.mmap, base: int) -> tuple[bytes, ...] | None:
        """The ``varying`` CRC32s of the archive at ``base`` of ``mm`` if it has this layout."""
        a, b = self.split
        hb = self.head_bytes
        if hb is not None:
            if mm[base : base + a] != hb:
                return None
        elif self.head.fullmatch(mm, base, base + a) is None:
            return None
        tp = self.tail_parts
        if tp is None:
            t = self.tail.fullmatch(mm, base + b, base + self.length)
            return None if t is None else t.groups()
        get, want, crcs = tp
        end = base + self.length
        tail = mm[base + b : end]
        if get(tail) != want or len(tail) != end - base - b:
            return None
        return tuple([mm[base + c : base + c + 4] for c in crcs])


class ArchiveReader:
    """The ``torch.save`` archives of one file (DCP chunks: 100k and more back to back), read
    through a memory map.

    The first archive of each layout is parsed and checked record by record
    (:func:`read_torch_zip`, :func:`read_record`); the layout is then kept as two regular
    expressions over its bytes (every byte literal but the unchecked records' bytes and
    CRC32s). Later archives of the layout are one match of each, with no system call and
    no bytes copied: equal bytes mean equal records, and the checked records' bytes and
    CRC32s are the verified ones. Archives that match no layout are parsed in full (which
    gives the errors). Pages of the map are given back as the reads move on through the
    file, so memory stays bounded.

    Args:
        fd: an open descriptor of the file (the map keeps its own).
        path: the file's name, for messages.
        size: the file's size in bytes.
        layouts: layouts by archive length, shared by the readers of one checkpoint's files
            (a layout is a description of bytes: it holds in any file).
    """

    def __init__(
        self, fd: int, path: str, size: int, layouts: dict[int, list[ArchiveLayout]] | None = None
    ) -> None:
        self.fd = fd
        self.path = path
        self.size = size
        self.layouts: dict[int, list[ArchiveLayout]] = {} if layouts is None else layouts
        self._map: mmap.mmap | None = None
        self._released = 0

    def read(
        self, base: int, length: int, hint: ArchiveLayout | None = None
    ) -> tuple[ArchiveLayout, tuple[bytes, ...]] | None:
        """The layout of the archive at ``[base, base + length)`` and its ``varying`` CRC32s
        (4 bytes each, little-endian); None when the range does not start with a zip local
        header (a safetensors blob). ``hint``: the layout to try first.

        Raises:
            HeaderError: the range is not a well-formed archive (as :func:`read_torch_zip`),
                or a checked record fails its CRC32.
        """
        mm = self._map
        if mm is None:
            if self.fd < 0:
                raise ValueError(f"{self.path}: archive reader used after close")
            mm = self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        if base - self._released > _RELEASE:
            self._release(base)
        if hint is not None and hint.length == length:
            crcs = hint.match(mm, base)
            if crcs is not None:
                return hint, crcs
        for lay in self.layouts.get(length, ()):
            if lay is not hint:
                crcs = lay.match(mm, base)
                if crcs is not None:
                    return lay, crcs
        if mm[base : base + 4] != _LOCAL_SIG:
            return None
        return self._learn(mm, base, length)

    def _learn(self, mm: mmap.mmap, base: int, length: int) -> tuple[ArchiveLayout, tuple[bytes, ...]]:
        tz = read_torch_zip(self.fd, self.path, base, length)
        checked = {}
        for sfx in CHECKED_RECORDS:
            rec = tz.get(sfx)
            if rec is not None:
                checked[sfx] = read_record(self.fd, tz, rec)
        records = {n: _relative(r, base) for n, r in tz.records.items()}
        names = {f"{tz.prefix}/{sfx}" for sfx in (*checked, *_CONSTANT_RECORDS)}
        store = f"{tz.prefix}/data/"
        # (start, stop, group): the varying records' bytes and CRC32s
        ranges: list[tuple[int, int, bool]] = []
        wild = [r for r in records.values() if r.name not in names]
        for r in wild:
            end = r.offset + r.compressed_size
            ranges.append((r.offset, end, False))
            at = r.header + 14
            if not (r.flags & 8) or mm[base + at : base + at + 4] != b"\0\0\0\0":
                ranges.append((at, at + 4, False))  # (zero when a data descriptor holds it)
            if r.flags & 8:  # the data descriptor after the bytes: [signature] crc32 sizes
                at = end + 4 if mm[base + end : base + end + 4] == _DESCRIPTOR_SIG else end
                ranges.append((at, at + 4, False))
            ranges.append((r.entry + 16, r.entry + 20, r.name.startswith(store)))
        ranges.sort()
        if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])) or any(e > length for _, e, _ in ranges):
            return self._unlearnt(tz, records, checked)
        big = max(wild, key=lambda r: r.compressed_size, default=None)
        split = (big.offset, big.offset + big.compressed_size) if big is not None else (length, length)
        head = _layout_rx(mm, base, 0, split[0], ranges)
        fixed = not any(a < split[0] for a, _, _ in ranges)
        tail = _layout_rx(mm, base, split[1], length, ranges)
        varying = tuple(r.name for r in sorted(wild, key=lambda r: r.entry) if r.name.startswith(store))
        head_bytes = mm[base : base + split[0]] if fixed else None
        parts = _tail_parts(mm, base, split[1], length, ranges)
        lay = ArchiveLayout(
            length, tz.prefix, records, checked, varying, split, head, head_bytes, tail, parts
        )
        crcs = tuple(tz.records[n].crc32.to_bytes(4, "little") for n in varying)
        if lay.match(mm, base) != crcs:
            return self._unlearnt(tz, records, checked)
        known = self.layouts.setdefault(length, [])
        if len(known) < _MAX_LAYOUTS:
            known.append(lay)
        return lay, crcs

    def _unlearnt(
        self, tz: TorchZip, records: dict[str, ZipRecord], checked: dict[str, bytes]
    ) -> tuple[ArchiveLayout, tuple[bytes, ...]]:
        """A layout for this archive alone (records the expressions cannot describe)."""
        return _alone(tz, records, checked)

    def _release(self, upto: int) -> None:
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            upto -= upto % mmap.PAGESIZE
            if upto > self._released:
                self._map.madvise(mmap.MADV_DONTNEED, self._released, upto - self._released)
        self._released = upto

    def close(self) -> None:
        """Unmap the file (the descriptor stays the caller's, who may close it now)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        self._released = 0
        self.fd = -1


def layout_of(tz: TorchZip, checked: dict[str, bytes]) -> tuple[ArchiveLayout, tuple[bytes, ...]]:
    """The layout of one parsed archive alone (matching no other) and its ``varying`` CRC32s, as
    :meth:`ArchiveReader.read` gives them; ``checked``: its :data:`CHECKED_RECORDS`' bytes, read
    with :func:`read_record`."""
    return _alone(tz, {n: _relative(r, tz.base) for n, r in tz.records.items()}, checked)


def _alone(
    tz: TorchZip, records: dict[str, ZipRecord], checked: dict[str, bytes]
) -> tuple[ArchiveLayout, tuple[bytes, ...]]:
    varying = tuple(n for n in records if n.startswith(f"{tz.prefix}/data/"))
    never = re.compile(rb"(?!)")
    lay = ArchiveLayout(tz.length, tz.prefix, records, checked, varying, (0, 0), never, None, never)
    return lay, tuple(tz.records[n].crc32.to_bytes(4, "little") for n in varying)


def _relative(r: ZipRecord, base: int) -> ZipRecord:
    return ZipRecord(
        r.name,
        r.offset - base,
        r.size,
        r.compressed_size,
        r.compress_type,
        r.crc32,
        r.header,
        r.entry,
        r.flags,
    )


def _tail_parts(
    mm: mmap.mmap, base: int, start: int, stop: int, ranges: list[tuple[int, int, bool]]
) -> tuple[Callable[[bytes], Any], Any, tuple[int, ...]] | None:
    """What :func:`_layout_rx` of ``[start, stop)`` tests, as byte ranges: a getter of the literal
    ranges of those bytes (relative to ``start``), their bytes, and the archive offsets of the
    groups (4-byte CRC32s); None when the tail has no literal byte or a group that is not 4 bytes."""
    cuts: list[tuple[int, int]] = []
    crcs: list[int] = []
    pos = start
    for a, b, group in ranges:
        if b <= start or a >= stop:
            continue
        if a > pos:
            cuts.append((pos, a))
        if group:
            if b - a != 4:
                return None
            crcs.append(a)
        pos = b
    if stop > pos:
        cuts.append((pos, stop))
    if not cuts:
        return None
    get = itemgetter(*[slice(a - start, b - start) for a, b in cuts])
    return get, get(mm[base + start : base + stop]), tuple(crcs)


def _layout_rx(
    mm: mmap.mmap, base: int, start: int, stop: int, ranges: list[tuple[int, int, bool]]
) -> re.Pattern[bytes]:
    """An expression for the archive bytes ``[start, stop)``: literal, but for ``ranges``
    (any bytes; a group when the range's flag is set)."""
    out = []
    pos = start
    for a, b, group in ranges:
        if b <= start or a >= stop:
            continue
        out.append(re.escape(mm[base + pos : base + a]))
        out.append(b"(.{%d})" % (b - a) if group else b".{%d}" % (b - a))
        pos = b
    out.append(re.escape(mm[base + pos : base + stop]))
    return re.compile(b"".join(out), re.S)
