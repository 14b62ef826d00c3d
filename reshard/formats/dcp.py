"""torch Distributed Checkpoint (DCP) directories (``.metadata`` + ``.distcp``), read without torch.

``.metadata`` is a plain pickle of ``Metadata``: per flattened FQN either a
``TensorStorageMetadata`` (dtype, global size, chunks as boxes) or a
``BytesStorageMetadata`` (a non-tensor item); and per stored item its file,
offset and length (``_StorageInfo``). With ``use_collectives=False`` every rank
writes ``__{rank}.metadata`` instead, describing what it wrote; those are merged.
Both are read by :func:`reshard.io.unpickle.load_dcp_metadata`, which refuses
every class DCP does not use: no pickled code runs.

Each tensor chunk is a complete ``torch.save`` zip archive at its offset. Its
``data.pkl`` (read by the restricted :func:`~reshard.io.unpickle.load_stored_tensor`)
names the storage record, dtype, size and stride; the element bytes are record
``data/<key>``, stored uncompressed, so a piece is just its absolute offset in
the ``.distcp`` file and the copy path reads it with ``pread``. Opening parses
each chunk's zip directory and ``data.pkl`` once and checks that the record is
stored, little-endian, of the right length and row-major.

What the format does not say, and how it is handled:

- **No placements.** DCP stores one box per rank's local tensor (an FSDP2+TP
  ``_StridedShard`` x ``Shard`` local tensor is one box). Tensors are therefore
  sets of boxes; converting never needs the source placements.
- **Transposed or permuted views** are saved as is (``x.t()`` has strides
  ``(1, n)``). The copy path reads row-major pieces, so such a chunk is copied
  once at open time, tile by tile in bounded memory, into its row-major layout
  in the spool file below (its CRC32 checked on the way). Strides that are not
  a permuted dense layout are refused.
- **zstd** (``_extensions=[ZStandard()]``, descriptor ``stream.zstd/1``): the
  whole chunk archive is compressed. It is decompressed at open time, streaming
  in bounded memory, into one spool file under ``$TMPDIR`` (removed at exit,
  :func:`~reshard.io.pages.scratch_dir`),
  and its pieces point there (the spool is one more file of the checkpoint).
  Needs the ``zstandard`` or ``pyzstd`` module; other descriptors are refused.
- **SAFETENSORS serialisation** (``FileSystemWriter(serialization_format=SAFETENSORS)``):
  a chunk offset points at a safetensors blob instead of a zip; told apart by
  the bytes at the offset.
- **Megatron-Core ``torch_dist``** (``MCoreMetadata``): stacked layer/expert
  axes give chunks whose ``offsets`` have more dims than their ``sizes``; the
  missing leading sizes are 1.
- **Non-tensor items** (optimizer ``param_groups``, ``lr_scheduler``, ...) cannot
  go into safetensors: they are listed in :attr:`Checkpoint.non_tensors` (name,
  size, file; kind ``object`` for a ``torch.save``'d value, ``bytes`` for raw
  ``io.BytesIO`` contents, unknown when compressed), never decoded.
"""

from __future__ import annotations

import io
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..checkpoint import Checkpoint, CheckpointWarning, NonTensor, TensorSource
from ..dtypes import DTYPE_SIZES
from ..errors import HeaderError, LayoutError, UsageError
from ..intervals import Block, overlapping_pairs
from ..io.header import MAX_HEADER_SIZE, Header, decode_header
from ..io.pages import scratch_dir
from ..io.torchzip import STORED, TorchZip, crc32_range, read_record, read_torch_zip
from ..io.unpickle import (
    SAFETENSORS_DTYPES,
    ChunkMeta,
    DcpMetadata,
    TensorMeta,
    load_dcp_metadata,
    load_stored_tensor,
)
from .base import NO, YES, Probe, Reader, ReadOptions
from .dcp_safetensors import StoredChunk, _global_shape, _overlap_warning

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
_SPOOL_BLOCK = 1 << 20
_SPOOL_TILE = 8 << 20
_MAX_OPEN = 64


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
        self._spool: int | None = None
        self._spool_fd = -1

    def index(self, rel: str, where: str) -> int:
        i = self._index.get(rel)
        if i is not None:
            return i
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise HeaderError(f"{where}: data file {rel!r} is not a file inside the checkpoint", path=where)
        p = self.root / rel
        try:
            size = p.stat().st_size
        except OSError as e:
            raise HeaderError(
                f"{p}: cannot read a data file {where} refers to ({e.strerror}); copy the whole "
                "checkpoint directory",
                path=str(p),
            ) from None
        self.paths.append(p)
        self._sizes.append(size)
        self._index[rel] = len(self.paths) - 1
        return len(self.paths) - 1

    def fd(self, fi: int) -> int:
        """An open descriptor of file ``fi`` (least recently used ones are closed)."""
        if fi == self._spool:
            return self._spool_fd
        fd = self._open.get(fi)
        if fd is not None:
            self._open.move_to_end(fi)
            return fd
        if len(self._open) >= _MAX_OPEN:
            os.close(self._open.popitem(last=False)[1])
        fd = os.open(self.paths[fi], os.O_RDONLY)
        self._open[fi] = fd
        return fd

    def size(self, fi: int) -> int:
        return os.fstat(self._spool_fd).st_size if fi == self._spool else self._sizes[fi]

    def spool(self) -> int:
        """The spool file (made on first use): decompressed chunks and row-major copies of permuted ones."""
        if self._spool is None:
            p = scratch_dir("reshard-dcp-") / "spool.bin"  # removed at exit, under torchrun too
            self._spool_fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.paths.append(p)
            self._sizes.append(0)
            self._spool = len(self.paths) - 1
        return self._spool

    def permute(
        self, fi: int, offset: int, size: tuple[int, ...], order: tuple[int, ...], isz: int
    ) -> tuple[int, int]:
        """Write the row-major copy of a permuted dense chunk to the spool; its (file, offset) there.

        Tile by tile through memory maps, released as it goes, so memory stays bounded
        (about ``_SPOOL_TILE`` bytes of each map) whatever the chunk's size.
        """
        import mmap
        from itertools import product

        import numpy as np

        sp = self.spool()
        sfd = self.fd(sp)
        start = os.fstat(sfd).st_size
        numel = _numel(size)
        os.ftruncate(sfd, start + numel * isz)
        npt = np.dtype(f"u{isz}")
        tile = list(size)
        while _numel(tile) * isz > _SPOOL_TILE:
            k = max(range(len(tile)), key=lambda d: tile[d])
            tile[k] = (tile[k] + 1) // 2
        src_mm = mmap.mmap(self.fd(fi), 0, access=mmap.ACCESS_READ)
        dst_mm = mmap.mmap(sfd, 0)
        try:
            stored = np.frombuffer(src_mm, npt, numel, offset).reshape([size[d] for d in order])
            logical = stored.transpose([order.index(d) for d in range(len(size))])
            out = np.frombuffer(dst_mm, npt, numel, start).reshape(size)
            for corner in product(*(range(0, n, t) for n, t in zip(size, tile, strict=True))):
                key = tuple(slice(c, c + t) for c, t in zip(corner, tile, strict=True))
                out[key] = logical[key]
                src_mm.madvise(mmap.MADV_DONTNEED)  # the page cache keeps them; RSS stays bounded
                dst_mm.madvise(mmap.MADV_DONTNEED)  # a shared file map: written pages live on in the cache
            del stored, logical, out
        finally:
            for mm in (src_mm, dst_mm):
                try:
                    mm.close()
                except BufferError:  # a numpy view still alive (an error mid-copy): it goes with it
                    pass
        return sp, start

    def decompress(self, fi: int, offset: int, length: int, where: str) -> tuple[int, int, int]:
        """Spool the zstd stream at ``[offset, offset + length)``; its (file, offset, size) there."""
        z, errors = _zstd_reader(io.BufferedReader(_Range(self.fd(fi), offset, length)), where)
        sp = self.spool()  # after the module check: no temporary directory for nothing
        sfd = self.fd(sp)
        start = os.fstat(sfd).st_size
        pos = start
        try:
            with z:
                while block := z.read(_SPOOL_BLOCK):
                    pos += os.pwrite(sfd, block, pos)
        except errors as e:
            raise HeaderError(f"{where}: zstd stream is damaged ({e})", path=str(self.paths[fi])) from None
        return sp, start, pos - start

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()
        if self._spool_fd >= 0:
            os.close(self._spool_fd)
            self._spool_fd = -1


# --------------------------------------------------------------------------- chunks


@dataclass(frozen=True, slots=True)
class _Stored:
    """A chunk's elements in its archive: offset, CRC32, stored shape, storage order if permuted."""

    start: int
    crc: int | None
    size: tuple[int, ...]
    order: tuple[int, ...] | None
    itemsize: int


@dataclass(frozen=True, slots=True)
class _Piece:
    chunk: StoredChunk
    crc: int | None


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
    files: _Files,
    fi: int,
    base: int,
    length: int,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
    where: str,
) -> _Stored:
    """Where the chunk archive at ``base`` keeps the chunk's elements, after checking it holds the chunk."""
    fd, path = files.fd(fi), str(files.paths[fi])
    tz: TorchZip = read_torch_zip(fd, path, base, length)
    st = load_stored_tensor(read_record(fd, tz, tz.record("data.pkl")), path=where)
    q = f'{where}: tensor "{fqn}"'
    bo = tz.get("byteorder")
    if bo is not None and read_record(fd, tz, bo).strip() != b"little":
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
    rec = tz.record(f"data/{st.key}")
    isz = DTYPE_SIZES[SAFETENSORS_DTYPES[st.dtype]]
    first, nbytes = st.storage_offset * isz, numel * isz
    if rec.compress_type != STORED or rec.size != st.storage_nbytes or first + nbytes > rec.size:
        raise HeaderError(
            f"{q} data record {rec.name} is {rec.size} bytes (zip method {rec.compress_type}); the "
            f"chunk needs {nbytes} stored bytes at {first} of a {st.storage_nbytes}-byte storage",
            path=path,
            tensor=fqn,
        )
    crc = rec.crc32 if first == 0 and nbytes == rec.size else None
    moving = [d for d in order or () if st.size[d] != 1]  # size-1 dims may have any stride
    permuted = bool(numel) and moving != sorted(moving)
    return _Stored(rec.offset + first, crc, st.size, order if permuted else None, isz)


def _safetensors_piece(
    files: _Files,
    fi: int,
    base: int,
    fqn: str,
    meta: TensorMeta,
    sizes: tuple[int, ...],
    where: str,
    cache: dict[Any, Header],
) -> int:
    """Absolute data offset of ``fqn`` in the safetensors blob at ``base`` (SAFETENSORS serialisation)."""
    fd, path = files.fd(fi), str(files.paths[fi])
    h = cache.get((fi, base))
    if h is None:
        n = int.from_bytes(os.pread(fd, 8, base).ljust(8, b"\0"), "little")
        if not 0 < n <= MAX_HEADER_SIZE or base + 8 + n > files.size(fi):
            raise HeaderError(
                f"{where}: neither a torch.save zip nor a safetensors blob starts here; the file is "
                "damaged or .metadata belongs to another checkpoint",
                path=path,
                tensor=fqn,
            )
        h = decode_header(os.pread(fd, n, base + 8), path=where)
        cache[(fi, base)] = h
    e = h.entry(fqn)
    if e.dtype != SAFETENSORS_DTYPES.get(meta.dtype) or _numel(e.shape) != _numel(sizes):
        raise HeaderError(
            f'{where}: tensor "{fqn}" is {e.dtype} {list(e.shape)} in the safetensors blob but '
            f".metadata says {meta.dtype} {list(sizes)}",
            path=path,
            tensor=fqn,
        )
    return base + h.data_start + e.start


def _chunk_for(meta: TensorMeta, offset: tuple[int, ...] | None, fqn: str, where: str) -> ChunkMeta:
    c = meta.chunk_at(offset)
    if c is not None:
        return c
    raise HeaderError(
        f'{where}: storage entry of tensor "{fqn}" at offsets {list(offset or ())} matches none '
        "of its chunks",
        path=where,
        tensor=fqn,
    )


class _Reader:
    """What the metadata files of one checkpoint add up to, read one file at a time."""

    def __init__(self, root: Path) -> None:
        self.files = _Files(root)
        self.meta: dict[str, TensorMeta] = {}
        self.pieces: dict[str, list[_Piece]] = {}
        self.non_tensors: dict[str, NonTensor] = {}
        self.warnings: list[CheckpointWarning] = []
        self.blobs: dict[Any, Header] = {}

    def read(self, mpath: Path) -> None:
        md = load_dcp_metadata(mpath.read_bytes(), path=str(mpath))
        self._merge_meta(md, mpath)
        stored: set[tuple[str, tuple[int, ...] | None]] = set()
        for e in sorted(md.storage, key=lambda e: (e.info.relative_path, e.info.offset)):  # file order
            m = md.entries.get(e.fqn)
            if m is None:
                raise HeaderError(
                    f'{mpath}: storage_data has an item "{e.fqn}" that state_dict_metadata does not list',
                    path=str(mpath),
                    tensor=e.fqn,
                )
            info = e.info
            fi = self.files.index(info.relative_path, str(mpath))
            where = f"{self.files.paths[fi]} (bytes {info.offset}..{info.offset + info.length})"
            if info.offset + info.length > self.files.size(fi):
                raise HeaderError(
                    f'{where}: item "{e.fqn}" runs past the end of the file ({self.files.size(fi)} bytes); '
                    "the file is truncated",
                    path=str(self.files.paths[fi]),
                    tensor=e.fqn,
                )
            if not isinstance(m, TensorMeta):
                if e.fqn not in self.non_tensors:
                    kind = ""  # compressed: unknown without decompressing
                    if not info.transform_descriptors:
                        zipped = os.pread(self.files.fd(fi), 4, info.offset) == _ZIP_MAGIC
                        kind = "object" if zipped else "bytes"
                    self.non_tensors[e.fqn] = NonTensor(e.fqn, info.length, fi, kind)
                continue
            self.pieces.setdefault(e.fqn, []).append(self._piece(e.fqn, m, e.offset, fi, where, info))
            stored.add((e.fqn, e.offset))
        for fqn, m in md.entries.items():
            if isinstance(m, TensorMeta):
                lost = [c for c in m.chunks if (fqn, c.offsets) not in stored]
                if lost:
                    msg = (
                        f'{mpath}: tensor "{fqn}" chunk at offsets {list(lost[0].offsets)}'
                        + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
                        + " has no storage entry, so its data is missing"
                    )
                    self.warnings.append(CheckpointWarning(msg, True, str(mpath), fqn))

    def _merge_meta(self, md: DcpMetadata, mpath: Path) -> None:
        for fqn, m in md.entries.items():
            if not isinstance(m, TensorMeta):
                continue
            prev = self.meta.setdefault(fqn, m)
            if (prev.dtype, prev.size) != (m.dtype, m.size):
                raise LayoutError(
                    f'{mpath}: tensor "{fqn}" is {m.dtype} {list(m.size)} but another rank\'s metadata '
                    f"says {prev.dtype} {list(prev.size)}; the directory mixes two saves",
                    path=str(mpath),
                    tensor=fqn,
                )

    def _piece(
        self, fqn: str, m: TensorMeta, offset: tuple[int, ...] | None, fi: int, where: str, info: Any
    ) -> _Piece:
        chunk = _chunk_for(m, offset, fqn, where)
        if len(chunk.offsets) != len(m.size) or len(chunk.sizes) > len(m.size):
            raise HeaderError(
                f'{where}: tensor "{fqn}" of shape {list(m.size)} has a chunk with offsets '
                f"{list(chunk.offsets)} and sizes {list(chunk.sizes)}",
                path=where,
                tensor=fqn,
            )
        sizes = _full_sizes(chunk, len(m.size))
        base, length = info.offset, info.length
        tds = info.transform_descriptors
        if tds:
            if tds != (ZSTD_DESCRIPTOR,):
                raise HeaderError(
                    f'{where}: tensor "{fqn}" is stored through transforms {list(tds)}; this reader '
                    f"undoes only {ZSTD_DESCRIPTOR}",
                    path=where,
                    tensor=fqn,
                )
            fi, base, length = self.files.decompress(fi, base, length, where)
        crc: int | None = None
        if os.pread(self.files.fd(fi), 4, base) == _ZIP_MAGIC:
            stored = _zip_piece(self.files, fi, base, length, fqn, m, sizes, where)
            start, crc = stored.start, stored.crc
            if stored.order is not None:
                fi, start = self._unpermute(fqn, fi, stored, where)
                crc = None
        else:
            start = _safetensors_piece(self.files, fi, base, fqn, m, sizes, where, self.blobs)
        st_dtype = SAFETENSORS_DTYPES[m.dtype]
        return _Piece(StoredChunk(fi, chunk.offsets, sizes, st_dtype, start, m.size), crc)

    def _unpermute(self, fqn: str, fi: int, stored: _Stored, where: str) -> tuple[int, int]:
        """Spool a row-major copy of a permuted chunk, checking the stored bytes' CRC32 on the way."""
        assert stored.order is not None
        nbytes = _numel(stored.size) * stored.itemsize
        if (
            stored.crc is not None
            and crc32_range(self.files.fd(fi), stored.start, nbytes, where) != stored.crc
        ):
            msg = f'{where}: tensor "{fqn}" chunk bytes fail their CRC32 check; the file is damaged'
            self.warnings.append(CheckpointWarning(msg, True, str(self.files.paths[fi]), fqn))
        return self.files.permute(fi, stored.start, stored.size, stored.order, stored.itemsize)

    def tensors(self) -> dict[str, TensorSource]:
        out: dict[str, TensorSource] = {}
        paths = self.files.paths
        for name in sorted(self.meta):
            m = self.meta[name]
            ps = self.pieces.get(name, [])
            cs = [p.chunk for p in ps]
            shape = _global_shape(name, cs, paths) if cs else m.size
            blocks: tuple[Block, ...] = tuple(c.block for c in cs)
            pairs = overlapping_pairs(blocks)
            if pairs:
                self.warnings.append(_overlap_warning(name, cs, pairs, shape, paths))
            out[name] = TensorSource(
                name=name,
                dtype=SAFETENSORS_DTYPES[m.dtype],
                shape=shape,
                piece_files=tuple(c.file for c in cs),
                piece_offsets=tuple(c.start for c in cs),
                piece_blocks=blocks,
                signature=("boxes", shape, blocks),
                piece_crc32=tuple(p.crc for p in ps),
            )
        return out


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
    finally:
        r.files.close()
    return Checkpoint(
        path=str(root),
        format="dcp",
        files=tuple(str(p) for p in r.files.paths),
        file_sizes=sizes,
        tensors=tensors,
        warnings=r.warnings,
        non_tensors=tuple(r.non_tensors[k] for k in sorted(r.non_tensors)),
    )


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
