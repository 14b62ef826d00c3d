"""torch Distributed Checkpoint (DCP) directories (``.metadata`` + ``.distcp``), read without torch.

``.metadata`` is a plain pickle of ``Metadata``: per flattened FQN either a
``TensorStorageMetadata`` (dtype, global size, chunks as boxes) or a
``BytesStorageMetadata`` (a non-tensor item); and per stored item its file,
offset and length (``_StorageInfo``). With ``use_collectives=False`` every rank
writes ``__{rank}.metadata`` instead, describing what it wrote; those are merged.
Both are read by :func:`reshard.io.unpickle.load_dcp_metadata`, which refuses
every class DCP does not use: no pickled code runs (a 100k-tensor ``.metadata``
is read in bounded memory, without building its objects: see there), into
columns (:class:`~reshard.io.unpickle.StorageTable`).

Each tensor chunk is a complete ``torch.save`` zip archive at its offset. Its
``data.pkl`` (read by the restricted :func:`~reshard.io.unpickle.load_stored_tensor`)
names the storage record, dtype, size and stride; the element bytes are record
``data/<key>``, stored uncompressed, so a piece is just its absolute offset in
the ``.distcp`` file and the copy path reads it with ``pread``. Opening checks
that every chunk's record is stored, little-endian, of the right length and
row-major (or a permuted dense layout), and takes its CRC32. A MoE checkpoint has 100k chunks of a few
layouts: each layout is parsed once (zip directory, ``data.pkl``, byte order)
and later archives are matched against its bytes through a map
(:class:`~reshard.io.torchzip.ArchiveReader`); each layout and box is checked
once, and tensors of one geometry share their blocks and signature.

What the format does not say, and how it is handled:

- **No placements.** DCP stores one box per rank's local tensor (an FSDP2+TP
  ``_StridedShard`` x ``Shard`` local tensor is one box). Tensors are therefore
  sets of boxes; converting never needs the source placements.
- **Transposed or permuted views** are saved as is (``x.t()`` has strides
  ``(1, n)``). The copy path reads row-major pieces, so such a chunk is copied
  once, when first read, tile by tile in bounded memory, into its row-major layout
  in the spool file below (its CRC32 checked on the way). Strides that are not
  a permuted dense layout are refused (at open).
- **zstd** (``_extensions=[ZStandard()]``, descriptor ``stream.zstd/1``): the
  whole chunk archive is compressed. Opening reserves the chunk's region of one
  spool file under ``$TMPDIR`` (its size is the box's sizes times the dtype's,
  from ``.metadata``; removed at exit, :func:`~reshard.io.pages.reserve_scratch`),
  and its piece points there; nothing is decompressed. When a command first
  reads the region (:class:`~reshard.io.spool.LazySpool`) the archive is
  decompressed as a stream and read record by record
  (:class:`~reshard.io.zipstream.ZipStream`): the chunk's bytes are written
  straight into the region, and the archive checked as a stored one is (zip,
  ``data.pkl``, byte order, record, CRC32: errors name the ``.distcp`` file, its
  bytes and the tensor). A permuted chunk, a SAFETENSORS blob or an archive not
  as torch.save writes one is decompressed into a temporary file beside the
  spool instead, and read from there. So ``inspect`` and ``plan`` decompress
  nothing, ``convert --include`` only the selected tensors' chunks. The spool
  (:mod:`reshard.io.spool`) is not a file of the checkpoint: ``inspect`` and
  ``plan`` count and name the ``.distcp`` files only, a spooled chunk under the
  file (and byte range) it was made from (:attr:`Checkpoint.spooled`).
  Needs the ``zstandard`` or ``pyzstd`` module (checked at open); other
  descriptors are refused.
- **SAFETENSORS serialisation** (``FileSystemWriter(serialization_format=SAFETENSORS)``):
  a chunk offset points at a safetensors blob instead of a zip; told apart by
  the bytes at the offset.
- **Megatron-Core ``torch_dist``**: stacked layer/expert axes give chunks whose
  ``offsets`` may have more dims than their ``sizes`` (the missing leading sizes
  are 1); its ``.metadata`` keeps every rank's save plan (``all_local_plans``:
  torch's planner data classes, read and dropped), MCore <= 0.14 pickled it as
  ``MCoreMetadata``; its async writer names files ``{group}__{r}_{k}.distcp``.
  ``common.pt`` (the non-sharded state) is not read: a warning says so.
- **Non-tensor items** (optimizer ``param_groups``, ``lr_scheduler``, ...) cannot
  go into safetensors: they are listed in :attr:`Checkpoint.non_tensors` (name,
  size, file; kind ``object`` for a ``torch.save``'d value, ``bytes`` for raw
  ``io.BytesIO`` contents, unknown when compressed), never decoded.
- **Objects holding tensors** (``dcp.save(..., planner=DefaultSavePlanner(flatten_state_dict=False))``
  stores every nested dict of the state dict as one ``torch.save``'d object): the object's
  ``data.pkl`` goes through the restricted unpickler of the ``pt`` reader (nothing runs) and
  each tensor in it becomes a whole tensor named ``<item>.<keys>`` (the keys joined with
  ``.``, as ``dcp_to_torch_save`` and flattening name it), read in place from the object's
  stored ``data/N`` record; its other leaves are listed as non-tensor items. A DTensor split
  over ranks inside one (only one rank's object is stored: its local shard), a class the
  unpickler does not allow, or a tensor it cannot read leaves the item an
  ``object holding tensors``, with a warning saying why; ``convert`` refuses it.
"""

from __future__ import annotations

import io
import math
import operator
import os
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

from ..checkpoint import (
    HOLDS_TENSORS,
    UNREADABLE,
    Checkpoint,
    CheckpointWarning,
    ColumnSlice,
    Crc32Slice,
    NonTensor,
    Spooled,
    TensorSource,
    tensor_source,
)
from ..dtypes import DTYPE_SIZES
from ..errors import HeaderError, LayoutError, ReshardError, SourceChangedError, UsageError
from ..intervals import Block, Interval, full_block, normalize, overlapping_pairs
from ..io.header import MAX_HEADER_SIZE, MAX_INT64, Header, decode_header
from ..io.safe import file_kind
from ..io.spool import LazySpool, SpoolCheckError
from ..io.torchsave import leaves, locate
from ..io.torchzip import (
    CHECKED_RECORDS,
    STORED,
    ArchiveLayout,
    ArchiveReader,
    HeldBytes,
    NotHeld,
    crc32_range,
    layout_of,
    read_record,
    read_torch_zip,
)
from ..io.unpickle import (
    SAFETENSORS_DTYPES,
    BytesMeta,
    ChunkMeta,
    DcpMetadata,
    StoredDTensor,
    StoredTensor,
    TensorMeta,
    UnreadableTensor,
    load_dcp_metadata,
    load_stored_tensor,
    load_torch_save,
)
from ..io.zipstream import NotStreamable, ZipStream
from .base import NO, YES, Probe, Reader, ReadOptions
from .dcp_safetensors import StoredChunk, _global_shape, _overlap_warning
from .torch_dist import COMMON, is_torch_dist

__all__ = [
    "METADATA",
    "RANK_METADATA",
    "ZSTD_DESCRIPTOR",
    "metadata_files",
    "open_dcp",
    "READER",
]

#: The global metadata file.
METADATA = ".metadata"
#: Rank-local metadata (``use_collectives=False``).
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
#: The one transform this reader undoes.
ZSTD_DESCRIPTOR = "stream.zstd/1"

_ZIP_MAGIC = b"PK\x03\x04"


def _object_kind(fd: int | HeldBytes, path: str, start: int, length: int) -> str:
    """``"object"``, or :data:`HOLDS_TENSORS` when the item's ``torch.save`` archive has tensor
    data records (read from its zip directory; nothing is unpickled).

    Raises:
        HeaderError: the archive is damaged (it may hold tensors: never taken for an object).
    """
    tz = read_torch_zip(fd, path, start, length)
    return HOLDS_TENSORS if tz.get("data/0") is not None else "object"


#: Of a decompressed non-tensor archive larger than this, only its end (and its first
#: :data:`_OBJECT_HEAD` bytes) is kept to read its directory (optimizer hyper-parameters and step
#: counters are a few KiB; a data loader's state may be MiBs).
_MAX_COMPRESSED_OBJECT = 4 << 20
_OBJECT_HEAD = 64 << 10


def _compressed_kind(fd: int, path: str, start: int, length: int, where: str, fqn: str) -> str:
    """:func:`_object_kind` of a zstd-compressed non-tensor item, decompressed as a stream;
    ``"bytes"`` when it is not a zip. Of an archive over :data:`_MAX_COMPRESSED_OBJECT` bytes
    (a ``torch.save``d BytesIO: a data loader's state) only its first 64 KiB and its last
    :data:`_MAX_COMPRESSED_OBJECT` bytes are kept: its directory, and the local headers of
    the records after a large ``data.pkl``; a record read elsewhere makes it
    :data:`HOLDS_TENSORS` (not known not to).

    Raises:
        HeaderError: the stream or the archive in it is damaged.
        UsageError: no zstd module.
    """
    z, errors = _zstd_reader(io.BufferedReader(_Range(fd, start, length)), where)
    head = b""
    tail = bytearray()
    total = 0
    try:
        with z:
            while True:
                chunk = z.read(1 << 20)
                if not chunk:
                    break
                if total == 0 and chunk[: len(_ZIP_MAGIC)] != _ZIP_MAGIC:
                    return "bytes"  # a BytesIO item's raw bytes
                if len(head) < _OBJECT_HEAD:
                    head += chunk[: _OBJECT_HEAD - len(head)]
                total += len(chunk)
                tail += chunk
                if len(tail) > 2 * _MAX_COMPRESSED_OBJECT:
                    del tail[: len(tail) - _MAX_COMPRESSED_OBJECT]
    except ReshardError:
        raise
    except errors as e:
        raise HeaderError(f'{where}: item "{fqn}": zstd stream is damaged ({e})', path=path) from None
    held = HeldBytes()
    if total > len(tail):
        held.add(0, head)
    held.add(total - len(tail), bytes(tail))
    try:
        return _object_kind(held, f"{where}, decompressed", 0, total)
    except NotHeld:
        if total > len(tail):
            return HOLDS_TENSORS
        raise HeaderError(f"{where}, decompressed: not a whole zip archive", path=path) from None


_SPOOL_TILE = 8 << 20
_MAX_OPEN = 64
_MAX_STORED = 1 << 16  # remembered (layout, dtype, box) checks


def metadata_files(directory: Path) -> list[Path]:
    """``.metadata``, else every ``__{rank}.metadata`` in rank order; empty if none."""
    glob = directory / METADATA
    if glob.is_file():
        return [glob]
    ranks = []
    for p in directory.iterdir():
        m = RANK_METADATA.match(p.name)
        if m and p.is_file():
            ranks.append((int(m.group(1)), p))
    return [p for _, p in sorted(ranks)]


# --------------------------------------------------------------------------- files and spool


class _Range(io.RawIOBase):
    """A read-only stream over ``[offset, offset + length)`` of a file descriptor."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self._fd, self._pos, self._end = fd, offset, offset + length

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._end - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(b)[:n]], self._pos)
        self._pos += got
        return got


def _zstd_reader(raw: BinaryIO, where: str) -> tuple[BinaryIO, tuple[type[Exception], ...]]:
    """A streaming zstd decompressor over ``raw`` and the exceptions it raises on bad data."""
    try:
        import zstandard

        r: BinaryIO = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return r, (zstandard.ZstdError, ValueError)
    except ImportError:
        pass
    try:
        import pyzstd  # type: ignore[import-not-found]

        z: BinaryIO = pyzstd.ZstdFile(raw)
        return z, (pyzstd.ZstdError, ValueError, EOFError)
    except ImportError:
        raise UsageError(
            f"{where} is compressed with zstd ({ZSTD_DESCRIPTOR}); reading it needs the zstandard "
            "module: pip install zstandard",
        ) from None


def _zstd_module(where: str) -> None:
    """Nothing when a zstd module imports; else the :class:`UsageError` :func:`_zstd_reader` gives."""
    _zstd_reader(io.BytesIO(b""), where)


class _Files:
    """The checkpoint's data files by relative path, plus the spool file.

    At most ``_MAX_OPEN`` data files are open at once (a save over thousands of
    ranks has more files than the default descriptor limit).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: list[Path] = []
        self._sizes: list[int] = []
        self._index: dict[str, int] = {}
        self._open: OrderedDict[int, int] = OrderedDict()
        self._archives: dict[int, ArchiveReader] = {}
        self._spool: int | None = None
        self.spool = LazySpool("reshard-dcp-")
        self.sizes = self._sizes
        self.layouts: dict[int, list[ArchiveLayout]] = {}  # chunk archive layouts, for every file

    def index(self, rel: str, where: str) -> int:
        i = self._index.get(rel)
        if i is not None:
            return i
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise HeaderError(f"{where}: data file {rel!r} is not a file inside the checkpoint", path=where)
        p = self.root / rel
        try:
            st = p.stat()
        except OSError as e:
            raise HeaderError(
                f"{p}: cannot read a data file {where} refers to ({e.strerror}); copy the whole "
                "checkpoint directory",
                path=str(p),
            ) from None
        kind = file_kind(st.st_mode)
        if kind is not None:  # a directory opens, then fails to map: refuse it by name here
            msg = f"{p}: a data file {where} refers to is {kind}, not a regular file"
            raise HeaderError(msg, path=str(p))
        size = st.st_size
        self.paths.append(p)
        self._sizes.append(size)
        self._index[rel] = len(self.paths) - 1
        return len(self.paths) - 1

    def fd(self, fi: int) -> int:
        """An open descriptor of file ``fi`` (least recently used ones are closed)."""
        fd = self._open.get(fi)
        if fd is not None:
            self._open.move_to_end(fi)
            return fd
        if len(self._open) >= _MAX_OPEN:
            old, old_fd = self._open.popitem(last=False)
            ar = self._archives.pop(old, None)
            if ar is not None:
                ar.close()
            os.close(old_fd)
        fd = os.open(self.paths[fi], os.O_RDONLY)
        self._open[fi] = fd
        return fd

    def archives(self, fi: int) -> ArchiveReader:
        """The chunk archive reader of data file ``fi`` (closed with its descriptor)."""
        fd = self.fd(fi)
        ar = self._archives.get(fi)
        if ar is None:
            ar = ArchiveReader(fd, str(self.paths[fi]), self._sizes[fi], self.layouts)
            self._archives[fi] = ar
        return ar

    def size(self, fi: int) -> int:
        return self.spool.size if fi == self._spool else self._sizes[fi]

    def spool_index(self) -> int:
        """The spool's file index (listed with the first region reserved; the file is made when
        first read): decompressed chunks and row-major copies of permuted ones."""
        if self._spool is None:
            self.paths.append(self.spool.path)
            self._sizes.append(0)
            self._spool = len(self.paths) - 1
        return self._spool

    def permute(
        self,
        fi: int,
        offset: int,
        size: tuple[int, ...],
        order: tuple[int, ...],
        isz: int,
        crc: int | None,
        fqn: str,
        where: str,
    ) -> tuple[int, int]:
        """Reserve the row-major copy of a permuted dense chunk (stored at ``offset`` of file ``fi``,
        CRC32 ``crc`` when recorded) in the spool; its (file, offset) there. Made when first read
        (:func:`_fill_permuted`)."""
        nbytes = _numel(size) * isz
        fill = partial(_fill_permuted, str(self.paths[fi]), offset, size, order, isz, crc, fqn, where)
        sp = self.spool_index()
        return sp, self.spool.reserve(nbytes, (fi, offset, offset + nbytes), fill)

    def decompress(
        self,
        fi: int,
        offset: int,
        length: int,
        where: str,
        fqn: str,
        meta: TensorMeta,
        sizes: tuple[int, ...],
    ) -> tuple[int, int]:
        """Reserve the chunk of ``fqn`` (box ``sizes``) whose zstd-compressed archive is at
        ``[offset, offset + length)`` of file ``fi`` in the spool; its (file, offset) there. Made when
        first read (:func:`_fill_zstd`)."""
        _zstd_module(where)  # refused now, not at copy time, without one
        nbytes = _numel(sizes) * DTYPE_SIZES[SAFETENSORS_DTYPES[meta.dtype]]
        fill = partial(_fill_zstd, str(self.paths[fi]), offset, length, where, fqn, meta, sizes)
        sp = self.spool_index()
        return sp, self.spool.reserve(nbytes, (fi, offset, offset + length), fill)

    def spooled(self) -> dict[int, Spooled]:
        """Where the spool's pieces come from (:attr:`Checkpoint.spooled`)."""
        return {} if self._spool is None else {self._spool: Spooled.of(self.spool.origins, self.spool)}

    def close(self) -> None:
        for ar in self._archives.values():
            ar.close()
        self._archives.clear()
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


# --------------------------------------------------------------------------- chunks


@dataclass(frozen=True, slots=True)
class _Stored:
    """Where the elements of chunks of one archive layout and one box are: ``start`` relative to
    the archive, ``slot`` the index of the storage record's CRC32 among the archive's (None when
    the chunk is not the whole record), the stored shape, the storage order if permuted."""

    start: int
    slot: int | None
    size: tuple[int, ...]
    order: tuple[int, ...] | None
    itemsize: int


def _no_record(path: str, base: int, name: str) -> HeaderError:
    """A chunk archive (at byte ``base`` of ``path``) without the record ``name``."""
    at = f"{path} (archive at byte {base})" if base else path
    return HeaderError(
        f"{at}: the torch.save archive has no record {name}; the file is damaged or not "
        "written by torch.save",
        path=path,
    )


def _storage_order(size: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The dims from outermost to innermost in storage when ``(size, stride)`` is a dense layout
    (row-major up to a permutation: ``x.t()``, ``x.permute(...)``); None when it is not dense.

    >>> _storage_order((4, 3), (3, 1)), _storage_order((4, 3), (1, 4)), _storage_order((4, 3), (1, 1))
    ((0, 1), (1, 0), None)
    """
    order = tuple(sorted(range(len(size)), key=lambda d: -stride[d]))
    expect = 1
    for d in reversed(order):
        if size[d] != 1 and stride[d] != expect:
            return None
        expect *= size[d]
    return order


def _full_sizes(chunk: ChunkMeta, ndim: int) -> tuple[int, ...]:
    """Chunk sizes with the leading axes Megatron leaves out (prepended layer/expert axes) as 1."""
    return (1,) * (ndim - len(chunk.sizes)) + chunk.sizes


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _zip_piece(
    lay: ArchiveLayout,
    st: StoredTensor,
    base: int,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
    where: str,
    path: str,
) -> _Stored:
    """Where archives of layout ``lay`` keep a chunk's elements, after checking they hold the chunk
    (``st``: what their ``data.pkl`` rebuilds; ``base``: this archive's offset, for messages)."""
    q = f'{where}: tensor "{fqn}"'
    bo = lay.checked.get("byteorder")
    if bo is not None and bo.strip() != b"little":
        raise HeaderError(
            f"{q} was saved big-endian; re-save it on a little-endian machine", path=path, tensor=fqn
        )
    if st.dtype != meta.dtype:
        raise HeaderError(f"{q} chunk is {st.dtype} but .metadata says {meta.dtype}", path=path, tensor=fqn)
    if len(st.size) > len(sizes) or (1,) * (len(sizes) - len(st.size)) + st.size != sizes:
        raise HeaderError(
            f"{q} chunk has shape {list(st.size)} but .metadata gives its box sizes {list(sizes)}",
            path=path,
            tensor=fqn,
        )
    numel = _numel(sizes)
    order = _storage_order(st.size, st.stride)
    if numel and order is None:
        raise LayoutError(
            f"{q} chunk of shape {list(st.size)} is stored with strides {list(st.stride)}, which are "
            "not a dense layout (overlapping or gapped elements); re-save the state dict with "
            ".contiguous() tensors.",
            path=path,
            tensor=fqn,
        )
    name = f"{lay.prefix}/data/{st.key}"
    rec = lay.records.get(name)
    if rec is None:
        raise _no_record(path, base, name)
    isz = DTYPE_SIZES[SAFETENSORS_DTYPES[st.dtype]]
    first, nbytes = st.storage_offset * isz, numel * isz
    if rec.compress_type != STORED or rec.size != st.storage_nbytes or first + nbytes > rec.size:
        raise HeaderError(
            f"{q} data record {rec.name} is {rec.size} bytes (zip method {rec.compress_type}); the "
            f"chunk needs {nbytes} stored bytes at {first} of a {st.storage_nbytes}-byte storage",
            path=path,
            tensor=fqn,
        )
    slot = lay.varying.index(name) if first == 0 and nbytes == rec.size and name in lay.varying else None
    moving = [d for d in order or () if st.size[d] != 1]  # size-1 dims may have any stride
    permuted = bool(numel) and moving != sorted(moving)
    return _Stored(rec.offset + first, slot, st.size, order if permuted else None, isz)


def _safetensors_piece(
    fd: int,
    path: str,
    fsize: int,
    base: int,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
    where: str,
    cache: dict[Any, Header],
) -> int:
    """Absolute data offset of ``fqn`` in the safetensors blob at ``base`` of the file open as
    ``fd`` (``fsize`` bytes; SAFETENSORS serialisation)."""
    h = cache.get((path, base))
    if h is None:
        n = int.from_bytes(os.pread(fd, 8, base).ljust(8, b"\0"), "little")
        if not 0 < n <= MAX_HEADER_SIZE or base + 8 + n > fsize:
            raise HeaderError(
                f"{where}: neither a torch.save zip nor a safetensors blob starts here; the file is "
                "damaged or .metadata belongs to another checkpoint",
                path=path,
                tensor=fqn,
            )
        h = decode_header(os.pread(fd, n, base + 8), path=where)
        cache[(path, base)] = h
    e = h.entry(fqn)
    if e.dtype != SAFETENSORS_DTYPES.get(meta.dtype) or _numel(e.shape) != _numel(sizes):
        raise HeaderError(
            f'{where}: tensor "{fqn}" is {e.dtype} {list(e.shape)} in the safetensors blob but '
            f".metadata says {meta.dtype} {list(sizes)}",
            path=path,
            tensor=fqn,
        )
    return base + h.data_start + e.start


def _pickle(lay: ArchiveLayout, path: str, base: int, where: str) -> StoredTensor:
    """What the ``data.pkl`` of archives of layout ``lay`` rebuilds (``base``: this archive's offset)."""
    pkl = lay.checked.get("data.pkl")
    if pkl is None:
        raise HeaderError(
            f"{path} (archive at byte {base}): the torch.save archive has no record "
            f"{lay.prefix}/data.pkl; the file is damaged or not written by torch.save",
            path=path,
        )
    return load_stored_tensor(pkl, path=where)


def _order_strides(size: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a dense layout of ``size`` stored in dim order ``order``."""
    stride = [0] * len(size)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= size[d]
    return tuple(stride)


def _crc_failed(where: str, path: str, fqn: str) -> SpoolCheckError:
    return SpoolCheckError(
        f'{where}: tensor "{fqn}" chunk bytes fail their CRC32 check; the file is damaged',
        path=path,
        tensor=fqn,
    )


def _fill_permuted(
    path: str,
    offset: int,
    size: tuple[int, ...],
    order: tuple[int, ...],
    isz: int,
    crc: int | None,
    fqn: str,
    where: str,
    spool: LazySpool,
    at: int,
) -> None:
    """Make a permuted chunk's spooled row-major copy at byte ``at`` of ``spool`` (a
    :data:`~reshard.io.spool.Fill`), after checking the stored bytes' CRC32."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        now = os.fstat(fd).st_size
        if now < offset + _numel(size) * isz:  # (a mapped read past the end is SIGBUS)
            raise SourceChangedError(
                f"{path}: the source file changed while it was being read (now {now} bytes, too short "
                f'for tensor "{fqn}"); is another job rewriting it? Convert again once it is finished',
                path=path,
                tensor=fqn,
            )
        if crc is not None and crc32_range(fd, offset, _numel(size) * isz, where) != crc:
            raise _crc_failed(where, path, fqn)
        spool.write_strided(at, fd, offset, size, _order_strides(size, order), isz, _SPOOL_TILE)
    finally:
        os.close(fd)


def _fill_zstd(
    path: str,
    offset: int,
    length: int,
    where: str,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
    spool: LazySpool,
    at: int,
) -> None:
    """Make the spooled chunk of ``fqn`` (box ``sizes``) at byte ``at`` of ``spool`` (a
    :data:`~reshard.io.spool.Fill`) from its archive, zstd-compressed at ``[offset, offset +
    length)`` of ``path``.

    The archive is decompressed as a stream and read record by record (:func:`_stream_zstd`):
    the chunk's bytes go straight into the region, their CRC32 computed on the way, and the
    archive is checked as an uncompressed chunk is at open (zip, ``data.pkl``, byte order,
    record, CRC32). A chunk that is permuted, a SAFETENSORS blob, or an archive not laid out as
    torch.save writes one (:class:`~reshard.io.zipstream.NotStreamable`: this includes every
    damaged one but a bad CRC32) is decompressed again, into a temporary file beside the spool,
    and read from there (:func:`_place`), which gives the errors."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        z, errors = _zstd_reader(io.BufferedReader(_Range(fd, offset, length)), where)
        try:
            with z:
                _stream_zstd(z, spool, at, where, path, fqn, meta, sizes)
            return
        except NotStreamable:
            pass
        except ReshardError:  # (a HeaderError is a ValueError, which zstandard raises too)
            raise
        except errors as e:
            raise _zstd_damaged(where, path, fqn, e) from None
        z, errors = _zstd_reader(io.BufferedReader(_Range(fd, offset, length)), where)
        tmp = spool.scratch_file()
        try:
            try:
                with z:
                    n = _write_all(spool, z, tmp)
            except ReshardError:
                raise
            except errors as e:
                raise _zstd_damaged(where, path, fqn, e) from None
            _place(spool, at, tmp, n, where, path, fqn, meta, sizes)
        finally:
            os.close(tmp)
    finally:
        os.close(fd)


def _zstd_damaged(where: str, path: str, fqn: str, e: Exception) -> HeaderError:
    return HeaderError(f'{where}: tensor "{fqn}": zstd stream is damaged ({e})', path=path, tensor=fqn)


#: Records of a chunk archive kept in memory as it streams (their size is refused over
#: :data:`~reshard.io.zipstream.MAX_HELD`); any other record but the chunk's is read another way.
_HELD_RECORDS = (
    "data.pkl",
    "byteorder",
    "version",
    ".format_version",
    ".storage_alignment",
    ".data/serialization_id",
)


def _stream_zstd(
    z: BinaryIO,
    spool: LazySpool,
    at: int,
    where: str,
    path: str,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
) -> None:
    """Fill the region at ``at`` from the decompressed archive ``z`` read as a stream: the small
    records kept (:data:`_HELD_RECORDS`), the data record ``data.pkl`` names written straight into
    the region (pwrite) with its CRC32 computed; then the archive is checked from the bytes kept as
    a stored one is (:func:`~reshard.io.torchzip.read_torch_zip`, :func:`_zip_piece`), the record
    being the one the central directory names, and its CRC32 the one it records.

    Raises:
        NotStreamable: the chunk is permuted, not a zip, or the archive is not as torch.save writes
            one, or fails a check (read it another way: that gives the error).
        SpoolCheckError: the chunk's record fails its CRC32.
        HeaderError: a small record is over :data:`~reshard.io.zipstream.MAX_HELD` bytes.
    """
    inner = f"{where}, decompressed"
    isz = DTYPE_SIZES[SAFETENSORS_DTYPES[meta.dtype]]
    nbytes = _numel(sizes) * isz
    zs = ZipStream(z, inner)
    st: StoredTensor | None = None
    data: tuple[str, int, int, int] | None = None  # (name, offset, size, crc32) of the record streamed
    want = ""
    first = 0
    sfd = spool.open()

    def out(view: memoryview, pos: int) -> None:  # record bytes [pos, pos + len): the chunk's part
        lo, hi = max(pos, first), min(pos + len(view), first + nbytes)
        if lo < hi:
            spool.pwrite_all(sfd, view[lo - pos : hi - pos], at + lo - first)

    while (rec := zs.next()) is not None:
        if st is not None and rec.name == want and data is None:
            crc = zs.stream(rec, st.storage_nbytes, out)
            data = (rec.name, rec.offset, st.storage_nbytes, crc)
            continue
        prefix, _, sfx = rec.name.partition("/")
        if sfx not in _HELD_RECORDS:
            raise NotStreamable(f"record {rec.name} comes before data.pkl names it")
        try:
            got = zs.small(rec)
        except HeaderError as e:
            raise HeaderError(f'{e.message} (a chunk of tensor "{fqn}")', path=path, tensor=fqn) from None
        if sfx == "data.pkl" and st is None:
            try:
                st = load_stored_tensor(got, path=where)
            except ReshardError as e:
                raise NotStreamable(str(e)) from None
            order = _storage_order(st.size, st.stride)
            moving = [d for d in order or () if st.size[d] != 1]
            first = st.storage_offset * isz
            if (
                st.dtype != meta.dtype
                or _numel(st.size) * isz != nbytes
                or (nbytes and (order is None or moving != sorted(moving)))
                or first + nbytes > st.storage_nbytes
            ):
                raise NotStreamable("the chunk is not the row-major box .metadata gives")
            want = f"{prefix}/data/{st.key}"
    if data is None:
        raise NotStreamable(f"no record {want or 'data.pkl'}")
    try:
        tz = read_torch_zip(zs.held, inner, 0, zs.pos)
        checked = {sfx: read_record(zs.held, tz, r) for sfx in CHECKED_RECORDS if (r := tz.get(sfx))}
        lay, _ = layout_of(tz, checked)
        s = _zip_piece(lay, _pickle(lay, inner, 0, where), 0, fqn, meta, sizes, where, path)
    except (ReshardError, NotHeld) as e:
        raise NotStreamable(str(e)) from None
    name, start, size, crc = data
    zr = tz.records.get(name)
    if (
        zr is None
        or load_stored_tensor(checked["data.pkl"], path=where) != st
        or zr.offset != start
        or zr.size != size
        or s.start != start + first
        or s.order is not None
    ):
        raise NotStreamable("the central directory names other bytes than the stream gave")
    if crc != zr.crc32:
        raise _crc_failed(where, path, fqn)


def _write_all(spool: LazySpool, src: BinaryIO, fd: int) -> int:
    """Write what ``src`` reads to the start of file ``fd``; the bytes written.

    Raises:
        WriteError: no room under ``$TMPDIR`` (named as the spool's).
    """
    pos = 0
    while block := src.read(1 << 20):
        spool.pwrite_all(fd, memoryview(block), pos)
        pos += len(block)
    return pos


def _place(
    spool: LazySpool,
    at: int,
    tmp: int,
    n: int,
    where: str,
    path: str,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
) -> None:
    """Copy the chunk of a decompressed archive (``n`` bytes of file ``tmp``) to byte ``at`` of
    the spool, row-major, checking it as :func:`_zip_piece` checks a stored one and its CRC32."""
    import zlib

    inner = f"{where}, decompressed"
    try:
        ar = ArchiveReader(tmp, inner, n)
        try:
            got = ar.read(0, n)
        finally:
            ar.close()
        isz = DTYPE_SIZES[SAFETENSORS_DTYPES[meta.dtype]]
        nbytes = _numel(sizes) * isz
        crc = None
        if got is None:  # a safetensors blob
            start = _safetensors_piece(tmp, inner, n, 0, fqn, meta, sizes, where, {})
        else:
            lay, crcs = got
            s = _zip_piece(lay, _pickle(lay, inner, 0, where), 0, fqn, meta, sizes, where, path)
            crc = None if s.slot is None else int.from_bytes(crcs[s.slot], "little")
            start = s.start
            if s.order is not None:
                if crc is not None and crc32_range(tmp, start, nbytes, inner) != crc:
                    raise _crc_failed(where, path, fqn)
                spool.write_strided(at, tmp, start, s.size, _order_strides(s.size, s.order), isz, _SPOOL_TILE)
                return
    except HeaderError as e:
        if isinstance(e, SpoolCheckError) or e.tensor is not None:
            raise
        raise HeaderError(f'{e.message} (a chunk of tensor "{fqn}")', path=path, tensor=fqn) from None
    got_crc = 0
    pos = 0
    sfd = spool.open()
    while pos < nbytes:  # (os.copy_file_range has no CRC32 on the way)
        block = os.pread(tmp, min(1 << 20, nbytes - pos), start + pos)
        if not block:
            raise HeaderError(f'{inner}: tensor "{fqn}": the chunk ends early', path=path, tensor=fqn)
        got_crc = zlib.crc32(block, got_crc)
        spool.pwrite_all(sfd, memoryview(block), at + pos)
        pos += len(block)
    if crc is not None and got_crc != crc:
        raise _crc_failed(where, path, fqn)


def _read_metadata(mpath: Path) -> DcpMetadata:
    """``load_dcp_metadata`` of a file, read through a map (its pages given back as it goes)."""
    import mmap

    with open(mpath, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return load_dcp_metadata(b"", path=str(mpath))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return load_dcp_metadata(mm, path=str(mpath))
    finally:
        mm.close()


def _file_order(paths: list[str], starts: Sequence[int]) -> Sequence[int]:
    """Rows in file order (by relative path, then offset), stable: the order chunks are read in.
    Writers write ``storage_data`` in that order, so it is checked first (without a key per row
    when all rows are of one file); else the rows are sorted as columns (a tuple a row took 150
    MB for 1.6M rows).

    >>> list(_file_order(["b", "a", "b", "a"], [0, 9, 4, 2]))
    [3, 1, 0, 2]
    """
    n = len(paths)
    if n and paths.count(paths[0]) == n and all(map(operator.lt, starts, islice(starts, 1, None))):
        return range(n)
    import numpy as np

    rank = {p: i for i, p in enumerate(sorted(set(paths)))}
    codes = np.fromiter(map(rank.__getitem__, paths), np.int64, count=n)
    at = np.frombuffer(starts, np.int64) if isinstance(starts, array) else np.array(starts, np.int64)
    order = np.lexsort((at, codes))
    if (order == np.arange(n)).all():
        return range(n)
    return array("q", order.tobytes())


class _Chunk:
    """One box of one tensor's metadata, as its pieces share it (compared by identity)."""

    __slots__ = ("meta", "offsets", "sizes", "block", "layout", "stored", "index")

    def __init__(
        self, meta: TensorMeta, offsets: tuple[int, ...], sizes: tuple[int, ...], index: int
    ) -> None:
        self.meta = meta
        self.index = index  # its place in the reader's list of chunks (the pieces' chunk column)
        self.offsets = offsets
        self.sizes = sizes
        # the layout of the last archive of this box (likely the next's) and its check
        self.layout: ArchiveLayout | None = None
        self.stored: Any = None
        self.block: Block = tuple(
            normalize([Interval(o, o + s)]) for o, s in zip(offsets, sizes, strict=True)
        )


class _Geometry:
    """What the tensors with one tuple of chunks share: blocks, shape, signature, overlaps."""

    __slots__ = ("blocks", "shape", "signature", "pairs")

    def __init__(
        self, blocks: tuple[Block, ...], shape: tuple[int, ...], pairs: Sequence[tuple[int, int]]
    ) -> None:
        self.blocks = blocks
        self.shape = shape
        self.signature = ("boxes", shape, blocks)
        self.pairs = pairs


class _Pieces:
    """Every chunk read so far, a row each in columns (a TP-8 checkpoint of 200k tensors has
    1.6M): its tensor (in order of first appearance), :class:`_Chunk` (index), file, data
    offset and CRC32 (-1: none). As tuples (and their ints) they took 200 bytes a chunk."""

    __slots__ = ("tids", "tensor", "chunk", "file", "start", "crc")

    def __init__(self) -> None:
        self.tids: dict[str, int] = {}
        self.tensor = array("i")
        self.chunk = array("i")
        self.file = array("i")
        self.start = array("q")
        self.crc = array("q")

    def __len__(self) -> int:
        return len(self.tensor)

    def add(self, fqn: str, piece: tuple[int, _Chunk, int, int | None]) -> None:
        """A row for ``piece`` (``(file, chunk, data offset, CRC32)``) of tensor ``fqn``."""
        tid = self.tids.get(fqn)
        if tid is None:
            tid = self.tids[fqn] = len(self.tids)
        fi, chunk, start, crc = piece
        self.tensor.append(tid)
        self.chunk.append(chunk.index)
        self.file.append(fi)
        self.start.append(start)
        self.crc.append(-1 if crc is None else crc)

    def by_tensor(self) -> tuple[list[int], array[int], array[int], array[int], array[int]]:
        """The rows grouped by tensor, each tensor's in the order they were added: per tensor id
        where its rows start (one more: the end), then the chunk, file, offset and CRC32 columns
        in that order, the last two as 4-byte unsigned columns when their values fit (offsets
        below 4 GiB; a CRC32 for every chunk). The columns here are emptied."""
        import numpy as np

        n = len(self.tensor)
        tid = np.frombuffer(self.tensor, np.int32) if n else np.zeros(0, np.int32)
        order = np.argsort(tid, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(tid, minlength=len(self.tids)))])
        del tid
        self.tensor = array("i")
        cols: list[array[int]] = []
        for name in ("chunk", "file", "start", "crc"):
            col: array[int] = getattr(self, name)
            code = col.typecode
            got = array(code)
            if n:
                values = np.frombuffer(col, np.int32 if code == "i" else np.int64)[order]
                if code == "q" and array("I").itemsize == 4 and values.min() >= 0 and values.max() >> 32 == 0:
                    values, got = values.astype(np.uint32), array("I")
                got.frombytes(values.tobytes())
                del values
            setattr(self, name, array(code))
            cols.append(got)
        return bounds.tolist(), cols[0], cols[1], cols[2], cols[3]


class _Reader:
    """What the metadata files of one checkpoint add up to, read one file at a time.

    A piece is ``(file, chunk, data offset, CRC32)``, a row of ``self.pieces``; chunks of one
    tensor metadata and box are one :class:`_Chunk`, archives of one layout are checked once per
    box (``self.stored``).
    """

    def __init__(self, root: Path) -> None:
        self.files = _Files(root)
        self.meta: dict[str, TensorMeta] = {}
        self.pieces = _Pieces()
        self.chunk_list: list[_Chunk] = []
        self.non_tensors: dict[str, NonTensor] = {}
        self.warnings: list[CheckpointWarning] = []
        self.blobs: dict[Any, Header] = {}
        self.chunks: dict[tuple[int, tuple[int, ...] | None], _Chunk] = {}
        self.pickles: dict[ArchiveLayout, StoredTensor] = {}
        self.stored: dict[tuple[ArchiveLayout, str, tuple[int, ...]], _Stored] = {}
        # tensors of pickled objects (flatten_state_dict=False): name -> (item, source)
        self.object_tensors: dict[str, tuple[str, TensorSource]] = {}

    def read(self, mpath: Path) -> None:  # noqa: C901 - the per-chunk loop, kept flat for speed
        md = _read_metadata(mpath)
        odd = self._merge_meta(md, mpath)
        # tensors of a dtype safetensors lacks: items here (their rows add up their size)
        entries = md.entries if not odd else {**md.entries, **dict.fromkeys(odd, BytesMeta())}
        table = md.storage
        fqns, offs, paths, starts, lengths = (
            table.fqns,
            table.offsets,
            table.paths,
            table.starts,
            table.lengths,
        )
        transforms = table.transforms
        files = self.files
        sizes = files.sizes  # never the spool's: data files only
        mp = str(mpath)
        fis: dict[str, int] = {}
        order = _file_order(paths, starts)
        chunks, stored_cache = self.chunks, self.stored
        pieces = self.pieces
        first_row = len(pieces)
        tids = pieces.tids
        add_tensor, add_chunk, add_file = pieces.tensor.append, pieces.chunk.append, pieces.file.append
        add_start, add_crc = pieces.start.append, pieces.crc.append
        reader: ArchiveReader | None = None
        reader_fi = -1
        from_bytes = int.from_bytes
        rel = None
        fi = fsize = -1
        # the rows' columns in file order (as they are, the common case: no index per column)
        rows = (
            zip(order, fqns, paths, starts, lengths, offs)
            if isinstance(order, range)
            else zip(order, *(map(col.__getitem__, order) for col in (fqns, paths, starts, lengths, offs)))
        )
        for i, fqn, row_path, start, length, off in rows:
            m = entries.get(fqn)
            if m is None:
                raise HeaderError(
                    f'{mpath}: storage_data has an item "{fqn}" that state_dict_metadata does not list',
                    path=mp,
                    tensor=fqn,
                )
            if row_path != rel:
                rel = row_path
                fi = fis.get(rel, -1)
                if fi < 0:
                    fi = fis[rel] = files.index(rel, mp)
                fsize = sizes[fi]
            if start + length > fsize:
                where = f"{files.paths[fi]} (bytes {start}..{start + length})"
                raise HeaderError(
                    f'{where}: item "{fqn}" runs past the end of the file ({sizes[fi]} bytes); '
                    "the file is truncated",
                    path=str(files.paths[fi]),
                    tensor=fqn,
                )
            if type(m) is not TensorMeta:
                if fqn in odd:
                    nt = self.non_tensors[fqn]
                    self.non_tensors[fqn] = replace(nt, size=nt.size + length, file=fi)
                    continue
                if fqn not in self.non_tensors:
                    kind, readable = self._item_kind(fqn, fi, start, length, transforms.get(i, ()))
                    if kind != HOLDS_TENSORS or not readable or not self._object(fqn, fi, start, length):
                        self.non_tensors[fqn] = NonTensor(fqn, length, fi, kind, start, transforms.get(i, ()))
                    reader_fi = -1
                continue
            chunk = chunks.get((id(m), off))
            if chunk is None:
                chunk = self._chunk(m, off, fqn, fi, start, length)
            got = None
            try:
                if not transforms or i not in transforms:
                    if fi != reader_fi:
                        reader, reader_fi = files.archives(fi), fi
                    assert reader is not None
                    got = reader.read(start, length, chunk.layout)
                if got is not None:
                    lay, crcs = got
                    if lay is chunk.layout:
                        s = chunk.stored
                    else:
                        key = (lay, m.dtype, chunk.sizes)
                        s = stored_cache.get(key)
                        if s is None:
                            s = self._stored(lay, key, fqn, m, chunk, fi, start, length)
                        chunk.layout, chunk.stored = lay, s
            except HeaderError as e:
                if e.tensor is not None:
                    raise
                raise type(e)(
                    f'{e.message} (a chunk of tensor "{fqn}")', path=e.path, tensor=fqn, hint=e.hint
                ) from None
            if got is not None and s.order is None:  # the common case: added here, inline
                tid = tids.get(fqn)
                if tid is None:
                    tid = tids[fqn] = len(tids)
                add_tensor(tid)
                add_chunk(chunk.index)
                add_file(fi)
                add_start(start + s.start)
                slot = s.slot
                add_crc(-1 if slot is None else from_bytes(crcs[slot], "little"))
                continue
            if got is not None:
                piece = self._permuted(fqn, fi, start, length, s, crcs, chunk)
            else:
                piece = self._piece_slow(fqn, m, chunk, fi, start, length, transforms.get(i, ()))
            reader_fi = -1  # the spool may have taken a descriptor
            pieces.add(fqn, piece)
        self._lost_chunks(entries, first_row, mpath)

    def _lost_chunks(self, entries: dict[str, TensorMeta | BytesMeta], first_row: int, mpath: Path) -> None:
        """Warn about each tensor of ``entries`` (one metadata file's) with a chunk that the file's
        storage items (the pieces' rows from ``first_row`` on) do not store."""
        import numpy as np

        pieces = self.pieces
        tids = pieces.tids
        n = len(pieces) - first_row
        nchunks = max(len(self.chunk_list), 1)
        # per tensor, how many distinct chunks the file's rows store (a chunk: one box of its meta)
        tid = np.frombuffer(pieces.tensor, np.int32)[first_row:] if n else np.zeros(0, np.int32)
        cid = np.frombuffer(pieces.chunk, np.int32)[first_row:] if n else np.zeros(0, np.int32)
        pairs = np.sort(tid.astype(np.int64) * nchunks + cid)  # (np.unique: 2-3 s for 1.6M rows)
        distinct = np.ones(len(pairs), bool)
        np.not_equal(pairs[1:], pairs[:-1], out=distinct[1:])
        have = np.bincount(pairs[distinct] // nchunks, minlength=len(tids)).tolist()
        del pairs, distinct
        need: dict[int, tuple[TensorMeta, int]] = {}  # distinct chunk offsets per meta (by id)
        short: list[tuple[str, TensorMeta, int | None]] = []
        for fqn, m in entries.items():
            if type(m) is not TensorMeta or not m.chunks:
                continue
            hit = need.get(id(m))
            if hit is None or hit[0] is not m:
                hit = need[id(m)] = (m, len({c.offsets for c in m.chunks}))
            t = tids.get(fqn)
            if t is None or have[t] != hit[1]:
                short.append((fqn, m, t))
        if not short:
            return
        stored: dict[int, set[tuple[int, ...]]] = {t: set() for _, _, t in short if t is not None}
        for r in np.flatnonzero(np.isin(tid, np.array(list(stored), np.int64))).tolist():
            stored[int(tid[r])].add(self.chunk_list[int(cid[r])].offsets)
        for fqn, m, t in short:
            got = stored.get(t, set()) if t is not None else set()
            lost = [c for c in m.chunks if c.offsets not in got]
            if not lost:
                continue
            msg = (
                f'{mpath}: tensor "{fqn}" chunk at offsets {list(lost[0].offsets)}'
                + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
                + " has no storage entry, so its data is missing"
            )
            self.warnings.append(CheckpointWarning(msg, True, str(mpath), fqn))

    def _item_kind(self, fqn: str, fi: int, start: int, length: int, tds: Sequence[str]) -> tuple[str, bool]:
        """What the non-tensor item ``fqn`` is (``"bytes"``, ``"object"``, or :data:`HOLDS_TENSORS`)
        and whether its tensors can be taken (:meth:`_object`); when not, a warning says why:
        compressed (read only from a stored archive), or a damaged archive (it may hold tensors;
        a problem for ``--check``). ``convert`` refuses both unless excluded: no tensor is dropped
        unsaid."""
        fd, path, where = self.files.fd(fi), str(self.files.paths[fi]), self._where(fi, start, length)
        try:
            if tds:
                if tuple(tds) != (ZSTD_DESCRIPTOR,):
                    raise HeaderError(f"stored through transforms {list(tds)}", path=path)
                kind = _compressed_kind(fd, path, start, length, where, fqn)
                if kind == HOLDS_TENSORS:
                    msg = (
                        f'{where}: item "{fqn}" is a pickled object holding tensors (or one over '
                        f"{_MAX_COMPRESSED_OBJECT >> 20} MiB whose records could not all be seen) "
                        "compressed with zstd; reshard reads the tensors of such an object only when "
                        "it is stored uncompressed"
                    )
                    self.warnings.append(CheckpointWarning(msg, False, path, fqn))
                return kind, False
            if os.pread(fd, 4, start) != _ZIP_MAGIC:
                return "bytes", False
            return _object_kind(fd, path, start, length), True
        except HeaderError as e:
            msg = f'{where}: item "{fqn}" cannot be read ({e}); it may hold tensors'
            self.warnings.append(CheckpointWarning(msg, True, path, fqn))
            return HOLDS_TENSORS, False

    def _where(self, fi: int, start: int, length: int) -> str:
        return f"{self.files.paths[fi]} (bytes {start}..{start + length})"

    def _object(self, fqn: str, fi: int, start: int, length: int) -> bool:
        """Take the tensors of item ``fqn``, a pickled object holding tensors, as whole tensors
        named ``<fqn>.<keys>`` and its other leaves as non-tensor items; False, with a warning
        saying why, when they cannot be taken (the item then stays an object holding tensors)."""
        path = str(self.files.paths[fi])
        where = self._where(fi, start, length)
        fd = self.files.fd(fi)
        found: list[tuple[str, TensorSource]] = []
        others: list[NonTensor] = []
        odd: list[CheckpointWarning] = []
        try:
            tz = read_torch_zip(fd, path, start, length)
            bo = tz.get("byteorder")
            if bo is not None and read_record(fd, tz, bo).strip() != b"little":
                raise HeaderError(f"{where}: saved big-endian", path=path)
            obj = load_torch_save(read_record(fd, tz, tz.record("data.pkl")), path=where)
            for key, leaf in leaves(obj, where):
                name = f"{fqn}.{key}" if key else fqn
                if isinstance(leaf, StoredDTensor):
                    if any(p != "R" for p in leaf.placements):
                        msg = (
                            f'{where}: item "{fqn}" holds DTensor "{name}" placed '
                            f"{', '.join(leaf.placements)} on mesh {list(leaf.mesh.shape)}: dcp.save "
                            "(flatten_state_dict=False) stored one rank's object, so only that rank's "
                            "shard of it is in the checkpoint; re-save with the default planner"
                        )
                        self.warnings.append(CheckpointWarning(msg, True, path, fqn))
                        return False
                    leaf = leaf.local
                if isinstance(leaf, UnreadableTensor):  # listed; convert refuses it unless excluded
                    others.append(NonTensor(name, 0, fi, UNREADABLE))
                    odd.append(CheckpointWarning(leaf.message(where, name), path=path, tensor=name))
                    continue
                if not isinstance(leaf, StoredTensor):
                    size = len(leaf) if isinstance(leaf, (str, bytes)) else 0
                    others.append(NonTensor(name, size, fi, type(leaf).__name__))
                    continue
                e, crc = locate(name, leaf, tz, where)
                src = tensor_source(
                    name, e.dtype, e.shape, (fi,), (e.start,), (full_block(e.shape),), ("full", e.shape)
                )
                found.append((name, replace(src, piece_crc32=(crc,))))
        except ReshardError as e:
            msg = f'{where}: item "{fqn}" is a pickled object holding tensors that reshard cannot read: {e}'
            self.warnings.append(CheckpointWarning(msg, False, path, fqn))
            return False
        for name, src in found:
            prev = self.object_tensors.get(name)
            if prev is not None:
                raise HeaderError(
                    f'{where}: items "{prev[0]}" and "{fqn}" both hold a tensor named "{name}" once '
                    "their keys are joined with '.'; rename one and re-save",
                    path=path,
                    tensor=name,
                )
            self.object_tensors[name] = (fqn, src)
        for n in others:
            self.non_tensors.setdefault(n.name, n)
        self.warnings += odd
        return True

    def _chunk(
        self, m: TensorMeta, offset: tuple[int, ...] | None, fqn: str, fi: int, start: int, length: int
    ) -> _Chunk:
        """The :class:`_Chunk` of ``m`` at ``offset`` (made once per tensor metadata and box)."""
        c = m.chunk_at(offset)
        if c is None:
            where = self._where(fi, start, length)
            raise HeaderError(
                f'{where}: storage entry of tensor "{fqn}" at offsets {list(offset or ())} matches none '
                "of its chunks",
                path=where,
                tensor=fqn,
            )
        if len(c.offsets) != len(m.size) or len(c.sizes) > len(m.size):
            where = self._where(fi, start, length)
            raise HeaderError(
                f'{where}: tensor "{fqn}" of shape {list(m.size)} has a chunk with offsets '
                f"{list(c.offsets)} and sizes {list(c.sizes)}",
                path=where,
                tensor=fqn,
            )
        chunk = _Chunk(m, c.offsets, _full_sizes(c, len(m.size)), len(self.chunk_list))
        self.chunks[(id(m), offset)] = chunk
        self.chunk_list.append(chunk)
        return chunk  # (the chunk keeps m alive: the key's id stays m's)

    def _stored(
        self,
        lay: ArchiveLayout,
        key: tuple[ArchiveLayout, str, tuple[int, ...]],
        fqn: str,
        m: TensorMeta,
        chunk: _Chunk,
        fi: int,
        start: int,
        length: int,
    ) -> _Stored:
        """:func:`_zip_piece` of a layout and box not checked yet (then remembered)."""
        where = self._where(fi, start, length)
        path = str(self.files.paths[fi])
        st = self.pickles.get(lay)
        if st is None:
            pkl = lay.checked.get("data.pkl")
            if pkl is None:
                raise _no_record(path, start, f"{lay.prefix}/data.pkl")
            st = self.pickles[lay] = load_stored_tensor(pkl, path=where)
        s = _zip_piece(lay, st, start, fqn, m, chunk.sizes, where, path)
        if len(self.stored) < _MAX_STORED:
            self.stored[key] = s
        return s

    def _piece_slow(
        self,
        fqn: str,
        m: TensorMeta,
        chunk: _Chunk,
        fi: int,
        base: int,
        length: int,
        tds: tuple[str, ...],
    ) -> tuple[int, _Chunk, int, int | None]:
        """A chunk through transforms (zstd) or in a SAFETENSORS blob."""
        where = self._where(fi, base, length)
        if tds:
            if tds != (ZSTD_DESCRIPTOR,):
                raise HeaderError(
                    f'{where}: tensor "{fqn}" is stored through transforms {list(tds)}; this reader '
                    f"undoes only {ZSTD_DESCRIPTOR}",
                    path=where,
                    tensor=fqn,
                )
            sp, start = self.files.decompress(fi, base, length, where, fqn, m, chunk.sizes)
            return (sp, chunk, start, None)
        files = self.files
        start = _safetensors_piece(
            files.fd(fi), str(files.paths[fi]), files.size(fi), base, fqn, m, chunk.sizes, where, self.blobs
        )
        return (fi, chunk, start, None)

    def _permuted(
        self, fqn: str, fi: int, base: int, length: int, s: _Stored, crcs: tuple[bytes, ...], chunk: _Chunk
    ) -> tuple[int, _Chunk, int, int | None]:
        """Reserve a row-major copy of a permuted chunk in the spool (made when first read, after
        checking the stored bytes' CRC32)."""
        assert s.order is not None
        where = self._where(fi, base, length)
        want = None if s.slot is None else int.from_bytes(crcs[s.slot], "little")
        sp, start = self.files.permute(fi, base + s.start, s.size, s.order, s.itemsize, want, fqn, where)
        return (sp, chunk, start, None)

    def _merge_meta(self, md: DcpMetadata, mpath: Path) -> set[str]:
        """Add ``md``'s tensors to :attr:`meta`; the names of those of a dtype safetensors lacks,
        which become non-tensor items (with a warning) instead."""
        odd: set[str] = set()
        for fqn, m in md.entries.items():
            if type(m) is not TensorMeta:
                continue
            if m.dtype not in SAFETENSORS_DTYPES:
                odd.add(fqn)
                if fqn not in self.non_tensors:
                    self.non_tensors[fqn] = NonTensor(fqn, 0, None, UNREADABLE)
                    msg = UnreadableTensor(m.dtype, m.size).message(str(mpath), fqn)
                    self.warnings.append(CheckpointWarning(msg, path=str(mpath), tensor=fqn))
                continue
            prev = self.meta.setdefault(fqn, m)
            if prev is m and (math.prod(m.size) > MAX_INT64 or max(m.size, default=0) > MAX_INT64):
                raise HeaderError(
                    f'{mpath}: tensor "{fqn}" has size {list(m.size)}, over {MAX_INT64} elements '
                    "(int64; torch refuses it)",
                    path=str(mpath),
                    tensor=fqn,
                )
            if prev is not m and (prev.dtype, prev.size) != (m.dtype, m.size):
                raise LayoutError(
                    f'{mpath}: tensor "{fqn}" is {m.dtype} {list(m.size)} but another rank\'s metadata '
                    f"says {prev.dtype} {list(prev.size)}; the directory mixes two saves",
                    path=str(mpath),
                    tensor=fqn,
                )
        return odd

    def tensors(self) -> dict[str, TensorSource]:
        """The tensors in name order, each piece's offset and CRC32 a :class:`ColumnSlice` /
        :class:`Crc32Slice` of two columns all tensors share (the pieces grouped by tensor)."""
        out: dict[str, TensorSource] = {}
        paths = self.files.paths
        tids = self.pieces.tids
        bounds, chunk_col, file_col, start_col, crc_col = self.pieces.by_tensor()
        chunk_list = self.chunk_list
        geometries: dict[tuple[int, bytes], _Geometry] = {}
        files_seen: dict[tuple[int, ...], tuple[int, ...]] = {}
        for name in sorted(self.meta):
            m = self.meta[name]
            tid = tids.get(name)
            shape: tuple[int, ...] = m.size
            blocks: tuple[Block, ...] = ()
            sig: Any = ("boxes", shape, ())
            fis: tuple[int, ...] = ()
            offsets: Sequence[int] = ()
            crcs: Sequence[int | None] = ()
            if tid is not None:
                a, b = bounds[tid], bounds[tid + 1]
                cids = chunk_col[a:b]
                key = (id(m), cids.tobytes())
                fis = tuple(file_col[a:b])
                fis = files_seen.setdefault(fis, fis)
                offsets, crcs = ColumnSlice(start_col, a, b), Crc32Slice(crc_col, a, b)
                geo = geometries.get(key)
                if geo is None:
                    chunks = [chunk_list[c] for c in cids]
                    geo = geometries[key] = self._geometry(name, m, chunks, fis, offsets)
                shape, blocks, sig = geo.shape, geo.blocks, geo.signature
                if geo.pairs:
                    cs = self._stored_chunks(m, [chunk_list[c] for c in cids], fis, offsets)
                    self.warnings.append(_overlap_warning(name, cs, geo.pairs, shape, paths))
            out[name] = tensor_source(
                name,
                SAFETENSORS_DTYPES[m.dtype],
                shape,
                fis,
                offsets,
                blocks,
                sig,
                None,
                None,
                None,
                crcs,
            )
        if self.object_tensors:
            for name, (item, src) in self.object_tensors.items():
                if name in out:
                    raise HeaderError(
                        f'{paths[src.piece_files[0]]}: item "{item}" holds a tensor named "{name}" once its '
                        f"keys are joined with '.', and the checkpoint also stores a tensor \"{name}\"; "
                        "rename one and re-save",
                        path=str(paths[src.piece_files[0]]),
                        tensor=name,
                    )
                out[name] = src
            out = {k: out[k] for k in sorted(out)}
        return out

    def _stored_chunks(
        self, m: TensorMeta, chunks: Sequence[_Chunk], fis: Sequence[int], starts: Sequence[int]
    ) -> list[StoredChunk]:
        st_dtype = SAFETENSORS_DTYPES[m.dtype]
        return [
            StoredChunk(fi, c.offsets, c.sizes, st_dtype, start, m.size)
            for fi, c, start in zip(fis, chunks, starts, strict=True)
        ]

    def _geometry(
        self, name: str, m: TensorMeta, chunks: Sequence[_Chunk], fis: Sequence[int], starts: Sequence[int]
    ) -> _Geometry:
        """Blocks, global shape and overlapping pairs of one tuple of chunks (checked as
        :func:`_global_shape` checks them)."""
        shape = m.size
        for c in chunks:
            if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)):
                # raises, naming the file
                _global_shape(name, self._stored_chunks(m, chunks, fis, starts), self.files.paths)
        blocks = tuple(c.block for c in chunks)
        return _Geometry(blocks, shape, overlapping_pairs(blocks))


def open_dcp(path: Path) -> Checkpoint:
    """Open a torch DCP checkpoint directory (``.metadata`` or merged ``__{rank}.metadata``).

    Every tensor becomes the set of its stored chunks: one piece per chunk, its
    block the chunk's box, its bytes the ``data/<key>`` record of the chunk's
    archive (or the tensor of a SAFETENSORS blob). Coverage is not checked here
    (the planner raises on holes; ``inspect --check`` reports them, and checks
    each piece's CRC32); overlapping boxes are reported in ``warnings``.

    Args:
        path: the checkpoint directory (or its ``.metadata`` file).

    Returns:
        A :class:`Checkpoint` of format ``dcp``: tensors in name order, no mesh
        or layout, non-tensor items in ``non_tensors``.

    Raises:
        HeaderError: no metadata; a pickle that refers to a class DCP does not
            use (:class:`~reshard.io.unpickle.UnsafePickleError`); a damaged,
            truncated or inconsistent chunk; an unknown transform.
        LayoutError: a permuted (non row-major) chunk; a box outside its
            tensor; metadata files that disagree.
        UsageError: zstd-compressed chunks without a zstd module.
    """
    root = path.parent if path.is_file() else path
    metas = metadata_files(root) if root.is_dir() else []
    if not metas:
        raise HeaderError(
            f"{root}: no {METADATA} or __<rank>.metadata file; not a torch DCP checkpoint", path=str(root)
        )
    r = _Reader(root)
    try:
        for mp in metas:
            r.read(mp)
        tensors = r.tensors()
        sizes = tuple(r.files.size(i) for i in range(len(r.files.paths)))
        spooled = r.files.spooled()
    finally:
        r.files.close()
    return Checkpoint(
        path=str(root),
        format="dcp",
        files=tuple(str(p) for p in r.files.paths),
        file_sizes=sizes,
        tensors=tensors,
        warnings=r.warnings + _megatron_common(root),
        non_tensors=tuple(r.non_tensors[k] for k in sorted(r.non_tensors)),
        spooled=spooled,
    )


def _megatron_common(root: Path) -> list[CheckpointWarning]:
    """Megatron-Core ``torch_dist`` keeps its non-sharded state beside the DCP files, in
    ``common.pt`` (``args``, ``iteration``, plain tensors not wrapped in a ShardedTensor); it is
    not part of the DCP checkpoint: said, not read."""
    if not is_torch_dist(root):  # the one test, so --to dcp copies what this says it copies
        return []
    common = root / COMMON
    return [
        CheckpointWarning(
            f"{common}: Megatron-Core's common (non-sharded) state is not converted; the tensors "
            f"are the sharded ones of {METADATA} (--to dcp without --transforms copies it, and "
            "metadata.json, as it is)",
            path=str(common),
        )
    ]


def _detect(probe: Probe) -> int:
    """A directory holding ``.metadata`` or ``__{rank}.metadata`` is DCP."""
    if probe.is_file:
        return NO
    return YES if any(n == METADATA or RANK_METADATA.match(n) for n in probe.names) else NO


def _open(path: Path, options: ReadOptions) -> Checkpoint:
    return open_dcp(path)


READER = Reader(
    name="dcp",
    help="torch Distributed Checkpoint: .metadata (or __{r}.metadata per rank) with *.distcp, "
    "read without torch",
    detect=_detect,
    open=_open,
)
