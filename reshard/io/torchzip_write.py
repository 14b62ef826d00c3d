"""The bytes of one ``torch.save`` zip archive of a tensor, laid out before its data exists (pure, no torch).

DCP stores every tensor chunk as a complete ``torch.save`` archive (dcp.md §A.4).
torch 2.13 writes it with miniz through ``PyTorchStreamWriter``: records
``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
``data/0``, ``version``, ``.data/serialization_id``, all stored (not compressed),
each record's data 64-byte aligned relative to the archive start by an ``FB``
padding extra field, bit 3 set so the CRC32 and sizes follow the data in a data
descriptor, and zip64 end records always. This module reproduces that byte for
byte, so a writer can preallocate the archive, write :attr:`ChunkArchive.prefix`,
stream the tensor bytes while updating a CRC32, then write
:meth:`ChunkArchive.trailer`. Nothing in the prefix depends on the data, so no
bytes need patching afterwards.

>>> a = chunk_archive("BF16", (2, 3))
>>> a.data_offset, a.data_size, a.size
(704, 12, 1577)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..dtypes import TORCH_NAMES
from .header import DTYPE_SIZES
from .pickle_emit import Global, PersistentId, PickleEmitter, Reduce

__all__ = [
    "ARCHIVE_PREFIX",
    "ZIP64_LIMIT",
    "ChunkArchive",
    "chunk_archive",
    "tensor_pickle",
    "contiguous_strides",
    "crc32_combine",
]

#: Record-name prefix of archives written to a stream, as DCP does (``torch.save(t, BytesIO)``).
ARCHIVE_PREFIX = "archive"

#: miniz switches a record to zip64 fields when its size or offset reaches this (``MZ_UINT32_MAX``).
ZIP64_LIMIT = 0xFFFFFFFF

_ALIGN = 64  # torch.utils.serialization.config.save.storage_alignment
_UTF8 = 0x0800  # bit 11: UTF-8 names
_DESCRIBED = 0x0008  # bit 3: CRC and sizes follow the data (miniz sets it only for non-empty records)
# files_written_ holds the record names without prefix; their combined std::hash is
# the first half of the serialization id. It is the same for every one-storage
# archive (checked against torch 2.13 in tests/io/test_torchzip_write.py).
_NAME_HASH = 15728199511854643026
_MASK64 = (1 << 64) - 1
_VERSION = b"3\n"  # the "version" record, written last by writeEndOfFile
_VERSION_CRC = zlib.crc32(_VERSION)

# Storage classes of _rebuild_tensor_v2; every other dtype is one of
# torch.storage._new_dtypes() and goes through _rebuild_tensor_v3 + UntypedStorage.
_TYPED_STORAGE = {
    "BOOL": "BoolStorage",
    "U8": "ByteStorage",
    "I8": "CharStorage",
    "I16": "ShortStorage",
    "I32": "IntStorage",
    "I64": "LongStorage",
    "F16": "HalfStorage",
    "BF16": "BFloat16Storage",
    "F32": "FloatStorage",
    "F64": "DoubleStorage",
    "C64": "ComplexFloatStorage",
}


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides torch gives a contiguous tensor: a zero-size dim counts as 1.

    >>> contiguous_strides((2, 0, 3)), contiguous_strides(())
    ((3, 3, 1), ())
    """
    out: list[int] = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def tensor_pickle(dtype: str, shape: Sequence[int]) -> bytes:
    """``data.pkl`` of a contiguous tensor whose only storage is record ``data/0``.

    Args:
        dtype: safetensors dtype name (``"BF16"``, ``"F8_E4M3"``, ``"U16"``, ...).
        shape: the tensor's shape.

    Raises:
        ValueError: the dtype has no torch equivalent.
    """
    if dtype not in TORCH_NAMES:
        raise ValueError(f"dtype {dtype} has no torch equivalent")
    numel = 1
    for n in shape:
        numel *= n
    hooks = Reduce(Global("collections", "OrderedDict"), ())
    size, stride = tuple(int(n) for n in shape), contiguous_strides(shape)
    storage = _TYPED_STORAGE.get(dtype)
    if storage is not None:
        pid = PersistentId(("storage", Global("torch", storage), "0", "cpu", numel))
        rebuild = Reduce(Global("torch._utils", "_rebuild_tensor_v2"), (pid, 0, size, stride, False, hooks))
    else:
        nbytes = numel * DTYPE_SIZES[dtype]
        pid = PersistentId(("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", nbytes))
        args = (pid, 0, size, stride, False, hooks, Global("torch", TORCH_NAMES[dtype]))
        rebuild = Reduce(Global("torch._utils", "_rebuild_tensor_v3"), args)
    return PickleEmitter().dumps(rebuild)


@dataclass(frozen=True, slots=True)
class _Record:
    """Where one record sits: its local header offset, name, size and whether miniz uses zip64 for it."""

    offset: int
    name: bytes
    size: int
    zip64: bool
    header: bytes  # local header + name + extra fields; the data follows

    @property
    def flags(self) -> int:
        return _UTF8 | _DESCRIBED if self.size else _UTF8

    @property
    def end(self) -> int:
        """Offset just past the record's data descriptor (an empty record has none)."""
        return self.offset + len(self.header) + self.size + _descriptor_size(self)


@dataclass(frozen=True, slots=True)
class ChunkArchive:
    """One tensor chunk's ``torch.save`` archive: the bytes around its data.

    Attributes:
        prefix: every byte before the tensor data (``data_offset`` bytes).
        data_offset: where the raw tensor bytes start, relative to the archive (a multiple of 64).
        data_size: number of tensor bytes (``numel * itemsize``).
        size: total archive length, known before any data is written.
    """

    prefix: bytes
    data_offset: int
    data_size: int
    size: int
    _data: _Record
    _sid: _Record
    _seen: tuple[int, ...]  # CRC32s torch folds into the serialization id before data/0's
    _middle: bytes  # the version record and the serialization id's local header
    _cd_head: bytes  # central directory entries of the records before data/0
    _cd_version: bytes
    _end: bytes  # zip64 end record, locator, end record
    _limit: int
    _seed: int  # _fold(_seen): where the serialization id's fold of CRC32s goes on from
    _cut: tuple[bytes, ...]  # the trailer's fixed bytes around its four CRC32 fields

    def trailer(self, crc32: int, data_head: bytes) -> bytes:
        """The bytes after the tensor data: its data descriptor, the last records and the directory.

        Args:
            crc32: ``zlib.crc32`` of the tensor bytes (0 for an empty chunk).
            data_head: the first ``min(8, data_size)`` tensor bytes. torch folds any
                write that starts with a data-descriptor signature into the
                serialization id, the tensor data included; the id then matches
                torch's exactly.
        """
        seed = self._seed
        if len(data_head) >= 8 and data_head[:4] == b"PK\x07\x08":
            seed = _fold_one(seed, struct.unpack_from("<I", data_head, 4)[0])
        if self.data_size:
            seed = _fold_one(seed, crc32)
        sid = f"{_NAME_HASH:020d}{_fold_one(seed, _VERSION_CRC):020d}".encode()
        c, s = _U32.pack(crc32), _U32.pack(zlib.crc32(sid))
        a, b, d, e, f, g = self._cut
        if not self.data_size:  # an empty record has no data descriptor
            return b"".join((b, sid, d, s, e, c, f, s, g))
        return b"".join((a, c, b, sid, d, s, e, c, f, s, g))


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's ``crc32_combine``).

    Lets a writer that fills a chunk's bytes out of order, or in parallel pieces,
    still produce the record's CRC without reading the data back.

    >>> crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
    True
    """
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def _fold(crcs: Sequence[int]) -> int:
    """``c10::hash_combine`` over the CRC32s torch saw in data descriptors, in write order."""
    seed = 0
    for v in crcs:
        seed = _fold_one(seed, v)
    return seed


def _fold_one(seed: int, v: int) -> int:
    return (seed ^ ((v + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK64)) & _MASK64


_U32 = struct.Struct("<I")


def _u32(v: int, limit: int) -> int:
    return 0xFFFFFFFF if v >= limit else v


def _local_header(name: bytes, size: int, offset: int, limit: int) -> _Record:
    """Local header + name + zip64 extra + ``FB`` padding extra, as miniz and ``getPadding`` write them."""
    zip64 = size >= limit or offset >= limit
    z64 = b""
    if zip64:
        fields = (struct.pack("<QQ", size, 0) if size >= limit else b"") + (
            struct.pack("<Q", offset) if offset >= limit else b""
        )
        z64 = struct.pack("<HH", 1, len(fields)) + fields
    start = offset + 30 + len(name) + len(z64) + 4
    pad = -start % _ALIGN
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    flags = _UTF8 | _DESCRIBED if size else _UTF8
    head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return _Record(offset, name, size, zip64, head + name + extra)


def _descriptor(crc: int, rec: _Record) -> bytes:
    if not rec.size:
        return b""
    if rec.zip64:
        return struct.pack("<IIQQ", 0x08074B50, crc, rec.size, rec.size)
    return struct.pack("<IIII", 0x08074B50, crc, rec.size, rec.size)


def _descriptor_size(rec: _Record) -> int:
    return 0 if not rec.size else 24 if rec.zip64 else 16


def _cd_entry(rec: _Record, crc: int, limit: int) -> bytes:
    """One central directory entry (miniz ``add_to_central_dir``; zip64 fields past ``limit``)."""
    extra = b""
    if rec.zip64:
        fields = (struct.pack("<QQ", rec.size, rec.size) if rec.size >= limit else b"") + (
            struct.pack("<Q", rec.offset) if rec.offset >= limit else b""
        )
        extra = struct.pack("<HH", 1, len(fields)) + fields
    size32 = _u32(rec.size, limit)
    head = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        *(0x02014B50, 0, 0, rec.flags, 0, 0, 0, crc, size32, size32, len(rec.name), len(extra)),
        *(0, 0, 0, 0, _u32(rec.offset, limit)),
    )
    return head + rec.name + extra


def _end_records(n: int, cd_offset: int, cd_size: int, limit: int) -> bytes:
    """zip64 end record and locator, then the end record (miniz ``finalize_archive``, zip64 always on)."""
    end64_offset = cd_offset + cd_size
    return (
        struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_offset)
        + struct.pack("<IIQI", 0x07064B50, 0, end64_offset, 1)
        + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, _u32(cd_size, limit), _u32(cd_offset, limit), 0)
    )


def chunk_archive(
    dtype: str, shape: Sequence[int], *, prefix: str = ARCHIVE_PREFIX, zip64_limit: int = ZIP64_LIMIT
) -> ChunkArchive:
    """Lay out the ``torch.save`` archive of one contiguous tensor chunk.

    Cached: the chunks of one checkpoint share a few (dtype, shape) pairs.

    Args:
        dtype: safetensors dtype name of the chunk.
        shape: the chunk's (local) shape; ``()`` for a scalar, zero sizes allowed.
        prefix: record-name prefix; DCP and every ``torch.save`` to a stream use ``archive``.
        zip64_limit: size/offset from which records use zip64 fields. Only tests lower
            it, to exercise the zip64 layout without writing 4 GiB.

    Raises:
        ValueError: unknown dtype.
    """
    return _chunk_archive(dtype, tuple(int(n) for n in shape), prefix, zip64_limit)


@lru_cache(maxsize=4096)
def _chunk_archive(dtype: str, shape: tuple[int, ...], prefix: str, limit: int) -> ChunkArchive:
    numel = 1
    for n in shape:
        numel *= n
    small = [
        (b"data.pkl", tensor_pickle(dtype, shape)),
        (b".format_version", b"1"),
        (b".storage_alignment", b"64"),
        (b"byteorder", b"little"),
    ]
    sizes = [len(c) for _, c in small] + [numel * DTYPE_SIZES[dtype], len(_VERSION), 40]
    names = [n for n, _ in small] + [b"data/0", b"version", b".data/serialization_id"]
    records: list[_Record] = []
    cursor = 0
    for name, size in zip(names, sizes):
        records.append(_local_header(prefix.encode() + b"/" + name, size, cursor, limit))
        cursor = records[-1].end
    data, version, sid = records[4:]
    out = bytearray()
    crcs = [zlib.crc32(content) for _, content in small]
    for rec, (_, content), crc in zip(records, small, crcs):
        out += rec.header + content + _descriptor(crc, rec)
    out += data.header
    cd_head = b"".join(_cd_entry(rec, crc, limit) for rec, crc in zip(records, crcs))
    cd_version = _cd_entry(version, _VERSION_CRC, limit)
    cd_size = len(cd_head) + len(cd_version) + len(_cd_entry(data, 0, limit)) + len(_cd_entry(sid, 0, limit))
    end = _end_records(len(records), sid.end, cd_size, limit)
    middle = version.header + _VERSION + _descriptor(_VERSION_CRC, version) + sid.header
    total = sid.end + cd_size + len(end)
    fixed = (middle, cd_head, cd_version, end, limit)
    # the trailer cut around its CRC32 fields (data: C, serialization id: S) and the id:
    # descriptor signature | C | descriptor + middle | id | signature | S | descriptor + directory
    # ... | C | ... | S | ... + end records (no data descriptor for an empty record)
    desc, sid_desc = _descriptor(0, data), _descriptor(0, sid)
    cd_data, cd_sid = _cd_entry(data, 0, limit), _cd_entry(sid, 0, limit)
    cut = (
        desc[:4],
        desc[8:] + middle,
        sid_desc[:4],
        sid_desc[8:] + cd_head + cd_data[:16],
        cd_data[20:] + cd_version + cd_sid[:16],
        cd_sid[20:] + end,
    )
    return ChunkArchive(
        bytes(out), len(out), data.size, total, data, sid, tuple(crcs), *fixed, _fold(crcs), cut
    )
