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

Committing works like DCP's: ``.metadata`` (:mod:`reshard.io.dcp_metadata`) is written
last through a temporary name, fsynced and renamed, then ``reshard.json``. A directory
without ``.metadata`` is not a checkpoint to torch, and one without ``reshard.json`` is
unfinished to reshard (``--resume`` removes ``.metadata`` before it rewrites anything),
so an interrupted write never looks finished to either.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..dtypes import DTYPE_SIZES
from ..intervals import Box
from ..io.dcp_metadata import ChunkEntry, TensorEntry, encode_metadata
from ..io.header import no_gc
from ..io.torchzip_write import ChunkArchive, chunk_archive
from ..io.writer import FileResult, write_atomic
from ..mesh import Mesh
from ..plan import FileLayout, OutEntry, OutFile, Plan, TargetTensor, WriteOptions
from .base import Writer
from .dcp_boxes import dedup_owners, save_items
from .manifest import complete_with_manifest

__all__ = ["METADATA", "WRITER", "DcpFile", "dcp_file_name", "metadata_bytes"]

METADATA = ".metadata"


def dcp_file_name(rank: int, k: int = 0) -> str:
    """``__3_0.distcp``: rank 3's first data file, as ``FileSystemWriter`` names it."""
    return f"__{rank}_{k}.distcp"


class DcpFile(OutFile):
    """One ``.distcp`` file: rank ``rank``'s chunks (``tensors[i]`` in ``boxes[i]``), ``torch.save`` zips."""

    __slots__ = ("boxes",)

    needs_crc32 = True
    head_bytes = 8

    def __init__(self, name: str, rank: int, tensors: Sequence[TargetTensor], boxes: Sequence[Box]) -> None:
        super().__init__(name, rank, tensors)
        self.boxes = tuple(boxes)

    def archive(self, i: int) -> ChunkArchive:
        """The archive of chunk ``i`` (cached per dtype and shape)."""
        return chunk_archive(self.tensors[i].dtype, tuple(iv.size for iv in self.boxes[i]))

    def lay_out(self) -> FileLayout:
        fixed: list[tuple[int, bytes]] = []
        entries: list[OutEntry] = []
        pos = 0
        for i, t in enumerate(self.tensors):
            a = self.archive(i)
            fixed.append((pos, a.prefix))
            entries.append(OutEntry(t, self.local_rank, pos + a.data_offset, a.data_size))
            pos += a.size
        return FileLayout(tuple(fixed), tuple(entries), pos)

    def trailer(self, index: int, crc32: int, head: bytes) -> bytes:
        return self.archive(index).trailer(crc32, head)

    def chunks(self) -> Iterator[tuple[TargetTensor, ChunkEntry]]:
        """Each chunk as ``.metadata`` records it: its box and where its archive lies."""
        for i, (t, e) in enumerate(zip(self.tensors, self.entries)):
            a = self.archive(i)
            offsets = tuple(iv.start for iv in self.boxes[i])
            sizes = tuple(iv.size for iv in self.boxes[i])
            yield t, ChunkEntry(offsets, sizes, self.name, e.start - a.data_offset, a.size)


def _split(
    tensors: Sequence[TargetTensor], chunks: Sequence[tuple[int, Box]], limit: int
) -> list[list[tuple[int, Box]]]:
    """Consecutive chunks ``(tensor index, box)`` in files of at most ``limit`` bytes
    (a bigger chunk gets a file to itself)."""
    out: list[list[tuple[int, Box]]] = [[]]
    sizes: dict[tuple[str, Box], int] = {}
    acc = 0
    for i, box in chunks:
        key = (tensors[i].dtype, box)
        n = sizes.get(key)
        if n is None:
            n = sizes[key] = chunk_archive(key[0], tuple(iv.size for iv in box)).size
        if out[-1] and acc + n > limit:
            out.append([])
            acc = 0
        out[-1].append((i, box))
        acc += n
    return out


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    """Per rank, the chunks ``dcp.save`` would make it write, in state-dict (plan) order.

    Raises:
        LayoutError: a rank's block of some tensor is not one box (DCP cannot record it).
    """
    with no_gc():
        return _rank_files(tensors, mesh, options)


def _rank_files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    items = save_items([(t.name, t.layout, DTYPE_SIZES[t.dtype]) for t in tensors])
    owners = dedup_owners([it for _, _, it in items])
    index = {t.name: i for i, t in enumerate(tensors)}
    per_rank: list[list[tuple[int, Box]]] = [[] for _ in range(mesh.size)]
    for (fqn, box, _), owner in zip(items, owners):
        per_rank[owner].append((index[fqn], box))
    files: list[OutFile] = []
    for rank, mine in enumerate(per_rank):
        mine.sort(key=lambda c: c[0])  # a rank holds one box per tensor
        for k, group in enumerate(_split(tensors, mine, options.max_shard_size)):
            chosen = [tensors[i] for i, _ in group]
            files.append(DcpFile(dcp_file_name(rank, k), rank, chosen, [b for _, b in group]))
    return files


def metadata_bytes(files: Sequence[OutFile], results: Sequence[FileResult]) -> bytes:
    """``.metadata`` of these files: tensors in order of first appearance, chunks in file order.

    ``save_id`` is derived from the files' checksums (torch draws a random one; nothing
    reads it back), so the same conversion gives the same bytes.
    """
    chunks: dict[str, tuple[TargetTensor, list[ChunkEntry]]] = {}
    for f in files:
        assert isinstance(f, DcpFile)
        for t, c in f.chunks():
            chunks.setdefault(t.name, (t, []))[1].append(c)
    tensors = [TensorEntry(t.name, t.dtype, t.shape, tuple(cs)) for t, cs in chunks.values()]
    digest = hashlib.sha256("\n".join(f"{r.name} {r.checksum}" for r in results).encode()).digest()
    return encode_metadata(tensors, save_id=str(uuid.UUID(bytes=digest[:16], version=4)))


def _complete(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    """``.metadata`` (what makes a checkpoint to torch: durable before the rename), then ``reshard.json``."""
    write_atomic(dst / METADATA, metadata_bytes(plan.files, results), fsync=True)
    complete_with_manifest(dst, plan, results)


WRITER = Writer(
    name="dcp",
    help="torch Distributed Checkpoint: .metadata + __{rank}_{k}.distcp, each rank's box as dcp.save "
    "writes it (no target layout: one chunk per tensor, split at --max-shard-size)",
    files=_files,
    complete=_complete,
    lockstep=True,
    owns=(".distcp",),
    marks=(METADATA,),
    whole_by_default=True,
)
