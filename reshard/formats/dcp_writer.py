"""Writing torch Distributed Checkpoints (``.metadata`` + ``__{rank}_{k}.distcp``) without torch.

Each target rank's chunks go into its own files, boxes and replica owners exactly as
``dcp.save`` from that mesh records them (:mod:`reshard.formats.dcp_boxes`); without a
target layout every tensor is one chunk of rank 0. A file is the chunks' ``torch.save``
archives back to back (:mod:`reshard.io.torchzip_write`): the bytes before each chunk's
data are fixed, the bytes after it (data descriptor, central directory) depend on the
data's CRC32 and first 8 bytes and are written as soon as the data is
(:meth:`DcpFile.trailer`), so the file is hashed as it is written and never patched.
A rank's files are split at ``--max-shard-size`` (``__{rank}_1.distcp`` ...), as torch
names the files of one rank.

The source's non-tensor items stored as one run each (a DCP's ``BYTE_IO`` items: optimizer
hyper-parameters, a step counter) are copied as they are into one more file of rank 0 and
recorded as torch records them, so ``dcp.load`` of a full training state needs no
``allow_partial_load``.

Committing works like DCP's: ``.metadata`` (:mod:`reshard.io.dcp_metadata`) is written
last through a temporary name, fsynced and renamed, then ``reshard.json``. A directory
without ``.metadata`` is not a checkpoint to torch, and one without ``reshard.json`` is
unfinished to reshard (``--resume`` removes ``.metadata`` before it rewrites anything),
so an interrupted write never looks finished to either.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import TypeVar, overload

from ..checkpoint import NonTensor, stored_objects
from ..dtypes import DTYPE_SIZES
from ..errors import SourceChangedError, UsageError
from ..intervals import Box
from ..io.checksum import file_checksum
from ..io.dcp_metadata import ObjectRecord, StorageRecord, TensorRecord, natural_key, write_metadata
from ..io.header import no_gc
from ..io.safe import open_regular
from ..io.torchzip_write import ChunkArchive, chunk_archive
from ..io.writer import FileResult, write_atomic_with
from ..mesh import Mesh
from ..plan import FileLayout, LazySequence, OutEntry, OutFile, Plan, TargetTensor, WriteOptions
from ..text import name_pattern
from .base import Writer
from .dcp_boxes import rank_chunks
from .manifest import complete_self_described
from .torch_dist import COMMON as TORCH_DIST_COMMON
from .torch_dist import CONFIG as TORCH_DIST_CONFIG
from .torch_dist import extra_states, marker_files

__all__ = ["METADATA", "WRITER", "DcpFile", "dcp_file_name", "metadata_bytes", "write_metadata_to"]

METADATA = ".metadata"

T = TypeVar("T")


def dcp_file_name(rank: int, k: int = 0) -> str:
    """``__3_0.distcp``: rank 3's first data file, as ``FileSystemWriter`` names it."""
    return f"__{rank}_{k}.distcp"


class _Picks(Sequence[T]):
    """``values[picks[i]]`` for each ``i``: per-chunk references to a few shared objects (boxes,
    archives) as an array of small ints, not a pointer each (1.6M chunks: 3 MB, not 13).

    >>> p = _Picks(("a", "b"), _narrow(array("i", [1, 0, 1]), 2))
    >>> p[0], list(p), len(p), p.picks.typecode
    ('b', ['b', 'a', 'b'], 3, 'B')
    """

    __slots__ = ("values", "picks")

    def __init__(self, values: Sequence[T], picks: array[int]) -> None:
        self.values, self.picks = values, picks

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...
    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return _Picks(self.values, self.picks[i])
        return self.values[self.picks[i]]

    def __len__(self) -> int:
        return len(self.picks)

    def __iter__(self) -> Iterator[T]:
        return map(self.values.__getitem__, self.picks)


def _narrow(ids: array[int], count: int) -> array[int]:
    """``ids`` (each below ``count``) in the smallest unsigned array type that holds them."""
    code = "B" if count <= 0x100 else "H" if count <= 0x10000 else "i"
    return ids if ids.typecode == code else array(code, ids)


def _ids_of(objs: Iterable[T], table: dict[int, int], values: list[T]) -> array[int]:
    """Each of ``objs``' index in ``values`` by identity (``table``: id -> index), the new ones
    appended: per-chunk references to shared boxes as small ints (see :class:`_Picks`)."""
    ids = array("i")
    for obj in objs:
        k = table.get(id(obj))
        if k is None:
            k = table[id(obj)] = len(values)
            values.append(obj)
        ids.append(k)
    return ids


class _Fixed(LazySequence[tuple[int, bytes]]):
    """A DCP file's fixed byte runs, made as they are read: each chunk's archive prefix at its
    start (a 100k-chunk file holds its archives' starts, not 100k byte runs)."""

    __slots__ = ("_archives", "_starts")

    def __init__(self, archives: Sequence[ChunkArchive], starts: array[int]) -> None:
        self._archives, self._starts = archives, starts

    def __len__(self) -> int:
        return len(self._starts)

    def _item(self, i: int) -> tuple[int, bytes]:
        return self._starts[i], self._archives[i].prefix

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return zip(self._starts, (a.prefix for a in self._archives))


class _Entries(LazySequence[OutEntry]):
    """A DCP file's entries (each chunk's tensor data inside its archive), made as they are read."""

    __slots__ = ("_tensors", "_rank", "_archives", "_starts", "_columns")

    def __init__(
        self, tensors: Sequence[TargetTensor], rank: int, archives: Sequence[ChunkArchive], starts: array[int]
    ) -> None:
        self._tensors, self._rank, self._archives, self._starts = tensors, rank, archives, starts
        self._columns: tuple[array[int], array[int]] | None = None

    def columns(self) -> tuple[Sequence[TargetTensor], int, int, array[int], array[int]]:
        """The entries as columns (as a safetensors file's, see ``formats.safetensors._Entries``):
        entry ``i`` is rank ``rank``'s block of ``tensors[i]``, ``sizes[i]`` bytes at ``starts[i]``."""
        if self._columns is None:
            arcs = self._archives
            starts = array("q", (a + arc.data_offset for a, arc in zip(self._starts, arcs)))
            self._columns = (starts, array("q", (arc.data_size for arc in arcs)))
        return self._tensors, self._rank, 0, *self._columns

    def __len__(self) -> int:
        return len(self._starts)

    def _item(self, i: int) -> OutEntry:
        return _entry(self._tensors[i], self._rank, self._archives[i], self._starts[i])

    def __iter__(self) -> Iterator[OutEntry]:
        return map(_entry, self._tensors, repeat(self._rank), self._archives, self._starts)


def _entry(t: TargetTensor, rank: int, a: ChunkArchive, start: int) -> OutEntry:
    return OutEntry(t, rank, start + a.data_offset, a.data_size)


class DcpFile(OutFile):
    """One ``.distcp`` file: rank ``rank``'s chunks (``tensors[i]`` in ``boxes[i]``), ``torch.save`` zips.

    Its layout is each chunk's archive (shared by the chunks of one dtype and box) and
    where it starts: two arrays, whatever the chunk count.
    """

    __slots__ = ("boxes",)

    needs_crc32 = True
    head_bytes = 8

    def __init__(self, name: str, rank: int, tensors: Sequence[TargetTensor], boxes: Sequence[Box]) -> None:
        super().__init__(name, rank, tensors)
        if not isinstance(boxes, _Picks):
            values: list[Box] = []
            ids = _ids_of(boxes, {}, values)
            boxes = _Picks(values, _narrow(ids, len(values)))
        self.boxes: _Picks[Box] = boxes

    def archive(self, i: int) -> ChunkArchive:
        """The archive of chunk ``i`` (cached per dtype and shape)."""
        return self._archives()[i]

    def _archives(self) -> Sequence[ChunkArchive]:
        fixed = self.layout.fixed
        assert isinstance(fixed, _Fixed)
        return fixed._archives

    def starts(self) -> array[int]:
        """Where each chunk's archive starts in the file."""
        fixed = self.layout.fixed
        assert isinstance(fixed, _Fixed)
        return fixed._starts

    def lay_out(self) -> FileLayout:
        values: list[ChunkArchive] = []
        ids = array("i")
        starts = array("q")
        made: dict[tuple[str, int], int] = {}  # boxes are shared by the tensors of a geometry
        boxes = self.boxes.values
        pos = 0
        for t, b in zip(self.tensors, self.boxes.picks):
            k = made.get((t.dtype, b))
            if k is None:
                k = made[(t.dtype, b)] = len(values)
                values.append(chunk_archive(t.dtype, tuple(iv.size for iv in boxes[b])))
            ids.append(k)
            starts.append(pos)
            pos += values[k].size
        archives = _Picks(values, _narrow(ids, len(values)))
        return FileLayout(
            _Fixed(archives, starts), _Entries(self.tensors, self.local_rank, archives, starts), pos
        )

    def trailer(self, index: int, crc32: int, head: bytes) -> bytes:
        return self.archive(index).trailer(crc32, head)

    def chunk_columns(self) -> tuple[array[int], Sequence[ChunkArchive]]:
        """Per chunk, where its archive starts and the archive (its ``prefix``, the bytes before the
        data, and its ``trailer(crc32, head)``, as :meth:`trailer`): the executor's column path
        writes a window of whole archives at a time (``execute._Writer.chunk_steps``)."""
        return self.starts(), self._archives()


def _split(
    tensors: Sequence[TargetTensor], idx: Sequence[int], boxes: Sequence[Box], limit: int
) -> list[tuple[int, int]]:
    """Consecutive chunks ``(tensors[idx[k]], boxes[k])`` in files of at most ``limit`` bytes
    (a bigger chunk gets a file to itself): each file's first and stop position."""
    out: list[tuple[int, int]] = []
    sizes: dict[tuple[str, int], int] = {}  # by box identity: boxes are shared per layout
    first = acc = 0
    for k, (i, box) in enumerate(zip(idx, boxes)):
        dtype = tensors[i].dtype
        n = sizes.get((dtype, id(box)))
        if n is None:
            n = sizes[(dtype, id(box))] = chunk_archive(dtype, tuple(iv.size for iv in box)).size
        if k > first and acc + n > limit:
            out.append((first, k))
            first, acc = k, 0
        acc += n
    out.append((first, len(idx)))
    return out


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    """Per rank, the chunks ``dcp.save`` would make it write, in state-dict (plan) order.

    Raises:
        LayoutError: a rank's block of some tensor is not one box (DCP cannot record it).
    """
    with no_gc():
        return _rank_files(tensors, mesh, options)


def _rank_files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    per_rank = rank_chunks([(t.name, t.layout, DTYPE_SIZES[t.dtype]) for t in tensors])
    per_rank += [(array("i"), [])] * (mesh.size - len(per_rank))
    files: list[OutFile] = []
    lists: dict[bytes, list[TargetTensor]] = {}  # the ranks that hold the same tensors share one list
    table: dict[int, int] = {}  # every rank's boxes (shared per layout) as ids into one list
    values: list[Box] = []
    for rank in range(len(per_rank)):
        idx, boxes = per_rank[rank]
        picks = _Picks(values, _narrow(_ids_of(boxes, table, values), 1 << 31))
        per_rank[rank] = (idx, [])  # (the list of a box per chunk freed as it goes)
        for k, (a, b) in enumerate(_split(tensors, idx, picks, options.max_shard_size)):
            key = idx[a:b].tobytes()
            chosen = lists.get(key)
            if chosen is None:  # (the executor's per-list tables are then made once for them)
                chosen = lists[key] = [tensors[i] for i in idx[a:b]]
            files.append(DcpFile(dcp_file_name(rank, k), rank, chosen, picks[a:b]))
    for f in files:
        assert isinstance(f, DcpFile)
        f.boxes.picks = _narrow(f.boxes.picks, len(values))
    return files


def _box_dims(
    box: Box, cache: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A box's offsets and sizes (once per box object: the files hold them, so ids stay theirs)."""
    hit = cache.get(id(box))
    if hit is None:
        hit = cache[id(box)] = (tuple(iv.start for iv in box), tuple(iv.size for iv in box))
    return hit


def _records(files: Sequence[DcpFile]) -> tuple[Iterator[TensorRecord], Iterator[StorageRecord]]:
    """``.metadata``'s tensors (order of first appearance over the files, chunks in file order) and
    storage items (natural file order, then offset), made as they are written: what is held is
    a few integers per chunk (tensor and position), not objects."""
    import numpy as np

    ids: dict[str, int] = {}
    first: list[TargetTensor] = []
    per_file: list[array[int]] = []
    for f in files:
        tids = array("i")
        for t in f.tensors:
            k = ids.get(t.name)
            if k is None:
                k = ids[t.name] = len(first)
                first.append(t)
            tids.append(k)
        per_file.append(tids)
    del ids
    counts = [len(a) for a in per_file]
    tid = (
        np.concatenate([np.frombuffer(a, dtype=np.int32) for a in per_file])
        if files
        else np.zeros(0, np.int32)
    )
    del per_file
    order = np.argsort(tid, kind="stable")  # each tensor's chunks, in file (plan) order
    bounds = np.searchsorted(tid[order], np.arange(len(first) + 1))
    index = np.empty(len(tid), dtype=np.int32)  # each chunk's position among its tensor's chunks
    index[order] = np.arange(len(tid), dtype=np.int32) - np.repeat(bounds[:-1], np.diff(bounds)).astype(
        np.int32
    )
    del tid
    base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    file_of = np.repeat(np.arange(len(files), dtype=np.int32), counts)[order]
    entry_of = (order - base[:-1][file_of]).astype(np.int32)
    del order
    cache: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def tensors() -> Iterator[TensorRecord]:
        # arrays, sliced per tensor: as lists, 1.6M chunks' ints took 77 MB
        fs, es = array("i", file_of.tobytes()), array("i", entry_of.tobytes())
        ends = bounds.tolist()
        picks = [f.boxes.picks for f in files]
        values = [f.boxes.values for f in files]
        for k, t in enumerate(first):
            a, b = ends[k], ends[k + 1]
            yield (
                t.name,
                t.dtype,
                t.shape,
                [_box_dims(values[fi][picks[fi][ei]], cache) for fi, ei in zip(fs[a:b], es[a:b])],
            )

    def storage() -> Iterator[StorageRecord]:
        for fi in sorted(range(len(files)), key=lambda i: natural_key(files[i].name)):
            f = files[fi]
            name = f.name
            idx = index[int(base[fi]) : int(base[fi + 1])].tolist()
            for t, box, i, start, a in zip(f.tensors, f.boxes, idx, f.starts(), f._archives()):
                yield t.name, i, _box_dims(box, cache)[0], name, start, a.size

    return tensors(), storage()


def _save_id(results: Sequence[FileResult]) -> str:
    """``save_id`` derived from the files' checksums (torch draws a random one; nothing reads
    it back), so the same conversion gives the same bytes."""
    digest = hashlib.sha256("\n".join(f"{r.name} {r.checksum}" for r in results).encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def write_metadata_to(
    write: Callable[[bytes], object],
    files: Sequence[OutFile],
    results: Sequence[FileResult],
    objects: Sequence[ObjectRecord] = (),
) -> None:
    """``.metadata`` of these files, handed to ``write`` a MiB at a time: tensors in order of
    first appearance, chunks in file order; then the non-tensor ``objects``."""
    dcp = [f for f in files if isinstance(f, DcpFile)]
    assert len(dcp) == len(files)
    with no_gc():
        tensors, storage = _records(dcp)
        write_metadata(write, tensors, storage, save_id=_save_id(results), objects=objects)


def metadata_bytes(files: Sequence[OutFile], results: Sequence[FileResult]) -> bytes:
    """The bytes of ``.metadata`` of these files (:func:`write_metadata_to`, gathered)."""
    out: list[bytes] = []
    write_metadata_to(out.append, files, results)
    return b"".join(out)


def _write_objects(
    dst: Path, plan: Plan, items: Sequence[NonTensor | tuple[str, bytes]]
) -> tuple[list[ObjectRecord], FileResult]:
    """Copy ``items``' stored bytes, as they are (or the bytes given with a name), back to back
    into one more file of rank 0 (``__0_{k}.distcp``, after its data files), as torch puts a
    rank's ``BYTE_IO`` items in its own file; their records for ``.metadata``.

    Raises:
        UsageError: an item has the name of a tensor (``.metadata`` keys are one namespace).
        SourceChangedError: a source file ends before an item's bytes.
    """
    names = {t.name for t in plan.tensors}
    clash = next((n.name for n in items if isinstance(n, NonTensor) and n.name in names), None)
    if clash is not None:
        raise UsageError(
            f'non-tensor item "{clash}" of {plan.source.path} has the name of a tensor of the output; '
            f"--exclude {name_pattern(clash)} or rename the tensor",
            tensor=clash,
        )
    name = dcp_file_name(0, sum(1 for f in plan.files if f.local_rank == 0))  # after rank 0's files
    records: list[ObjectRecord] = []

    def fill(write: Callable[[bytes], object]) -> None:
        at = 0
        for n in items:
            if not isinstance(n, NonTensor):
                write(n[1])
                records.append((n[0], name, at, len(n[1]), ()))
                at += len(n[1])
                continue
            assert n.file is not None and n.offset is not None
            path = plan.source.files[n.file]
            fd, _ = open_regular(path, what="source file", error=SourceChangedError)
            with os.fdopen(fd, "rb") as f:
                left, pos = n.size, n.offset
                while left:
                    block = os.pread(f.fileno(), min(left, 1 << 20), pos)
                    if not block:
                        raise SourceChangedError(
                            f'{path}: the file ends before the bytes of item "{n.name}" '
                            f"({n.offset}..{n.offset + n.size}); it changed while being read",
                            path=path,
                            tensor=n.name,
                        )
                    write(block)
                    left -= len(block)
                    pos += len(block)
            records.append((n.name, name, at, n.size, n.transforms))
            at += n.size

    return records, _written(dst, name, fill)


def _written(dst: Path, name: str, fill: Callable[[Callable[[bytes], object]], object]) -> FileResult:
    """Write ``dst / name`` atomically with the bytes ``fill`` hands over; its result for the manifest."""
    write_atomic_with(dst / name, fill)
    size = (dst / name).stat().st_size
    return FileResult(name, size, file_checksum(dst / name), size)


def _complete(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    """The source's non-tensor items (:func:`~reshard.checkpoint.stored_objects`), Megatron's
    ``metadata.json``, ``common.pt`` and layers' ``_extra_state`` objects where they belong
    (:func:`~.torch_dist.marker_files`, :func:`~.torch_dist.extra_states`),
    then ``.metadata`` (what makes a checkpoint to torch: durable before the rename), then
    ``reshard.json``."""
    items: list[NonTensor | tuple[str, bytes]] = list(stored_objects(plan.source))
    kept = {n.name for n in plan.source.non_tensors}  # a source's own objects stay as they are
    items += [x for x in extra_states(plan) if x[0] not in kept]
    records: list[ObjectRecord] = []
    if items:
        records, done = _write_objects(dst, plan, items)
        results = [*results, done]
    results = [*results, *(_written(dst, name, fill) for name, fill in marker_files(plan))]
    write_atomic_with(
        dst / METADATA, lambda write: write_metadata_to(write, plan.files, results, records), fsync=True
    )
    complete_self_described(dst, plan, results)  # .metadata describes every tensor


WRITER = Writer(
    name="dcp",
    help="torch Distributed Checkpoint: .metadata + __{rank}_{k}.distcp, each rank's box as dcp.save "
    "writes it (no target layout: one chunk per tensor, split at --max-shard-size)",
    files=_files,
    complete=_complete,
    lockstep=True,
    # torch's rank-local metadata (use_collectives=False): its loader reads them when .metadata
    # is missing, so one left beside new data files would describe them as its own checkpoint
    # and Megatron's two files (torch_dist)
    owns=(".distcp", "__[0-9]*.metadata", TORCH_DIST_CONFIG, TORCH_DIST_COMMON),
    marks=(METADATA,),
    objects=True,
)
