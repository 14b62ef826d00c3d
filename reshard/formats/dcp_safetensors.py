"""torch DCP safetensors checkpoints: ``HuggingFaceStorageWriter(save_distributed=True)`` output.

Each rank writes ``shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors``
holding the chunks it saves (after DCP removed replicated duplicates), each
under its global name with its *local* shape. The file's ``__metadata__`` has
``DCP_SHARDING_INFO``, a JSON string mapping every tensor of the file to
``{"saved_offsets": [global offset per dim]}`` (torch 2.x writes nothing
else: no global shape, no dtype; also ``DCP_VERSION`` ``"1.0"`` and
``format`` ``"pt"``). A tensor is therefore a set of boxes at global offsets;
its global shape is ``max(offset + size)`` per dim over its boxes, exactly as
torch's own ``HuggingFaceStorageReader`` and ``consolidate_safetensors_files``
derive it. Two optional per-tensor keys are honoured when present (torch does
not write them): ``global_shape`` (the full shape; boxes must fit in it) and
``sizes`` (the stored chunk's shape; must equal the stored tensor's shape).

What the format cannot say:

- A missing box at the far end of a dim shrinks the derived shape instead of
  leaving a hole (torch's reader has the same blind spot). An empty chunk
  (a trailing rank of an uneven ``Shard``) is stored with its offset at the
  global size of the sharded dim, so it still records the extent.
- torch records a DTensor's chunk as one box of the local shape at the *first*
  global offset of the local tensor (``compute_local_shape_and_global_offset``).
  For a ``_StridedShard`` whose local rows are not contiguous in the global
  tensor (fused ``gate_up``: ``[R, _S(0, 2)]``) that box is wrong. torch 2.13's
  ``DefaultSavePlanner`` rejects such a plan ("overlapping chunks"); a save
  planner that skips ``_validate_global_plan`` writes it. The boxes then
  overlap each other (rank 0 ``[0:4)``, rank 1 ``[2:6)`` for 8 rows on 2
  ranks), which :func:`open_dcp_safetensors` reports in
  :attr:`Checkpoint.warnings`. The FSDP2-over-TP form ``[_S(0, tp), S(0)]``
  holds contiguous rows and is stored correctly.
- torch keys a file's tensors by name, so a rank that saves two chunks of one
  tensor (a ShardedTensor with two local shards) keeps only the last one; the
  lost chunk shows up as a hole when converting.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import Checkpoint, CheckpointWarning, TensorSource
from ..errors import HeaderError, LayoutError
from ..intervals import Block, Box, Interval, format_box, normalize, overlapping_pairs
from ..io.header import MAX_INT64, Header, read_header
from ..io.safe import load_json
from .base import NO, YES, Probe, Reader, ReadOptions

__all__ = [
    "DCP_FILE",
    "SHARDING_INFO_KEY",
    "SAVED_OFFSETS_KEY",
    "StoredChunk",
    "dcp_files",
    "read_sharding_info",
    "open_dcp_safetensors",
    "READER",
]

#: File names torch's writer gives with ``save_distributed=True``.
DCP_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
#: ``__metadata__`` key holding the JSON sharding info (torch ``CUSTOM_METADATA_KEY``).
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
#: Per-tensor key of the global offset of the stored box (torch ``SAVED_OFFSETS_KEY``).
SAVED_OFFSETS_KEY = "saved_offsets"
_VERSION_KEY = "DCP_VERSION"
_GLOBAL_SHAPE_KEY = "global_shape"
_SIZES_KEY = "sizes"
_MAX_LISTED = 3


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One stored chunk of a tensor: a box of ``shape`` at global ``offsets``.

    Attributes:
        file: index of the file in the checkpoint's file list.
        offsets: global offset of the box, one per dim.
        shape: the stored (local) shape.
        dtype: the safetensors dtype.
        start: absolute byte offset of the chunk's data in its file.
        global_shape: the full shape when the metadata states it, else None.
    """

    file: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    start: int
    global_shape: tuple[int, ...] | None = None

    @property
    def box(self) -> Box:
        """The chunk's global hyper-rectangle."""
        return tuple(Interval(o, o + s) for o, s in zip(self.offsets, self.shape, strict=True))

    @property
    def block(self) -> Block:
        """The box as a block (an empty dim has an empty index list)."""
        return tuple(normalize([iv]) for iv in self.box)


def dcp_files(directory: Path) -> tuple[list[Path], list[CheckpointWarning]]:
    """The ``shard-*-model-*-of-*.safetensors`` files of a directory, in (rank, file) order.

    Returns:
        The files, and warnings about other ``.safetensors`` files (ignored).

    Raises:
        HeaderError: no such file, or files that disagree on the file count ``n``
            (two saves mixed in one directory).
    """
    found: list[tuple[int, int, Path]] = []
    others: list[str] = []
    counts: dict[int, Path] = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or not p.name.endswith(".safetensors"):
            continue
        m = DCP_FILE.match(p.name)
        if m is None:
            others.append(p.name)
            continue
        shard, index, count = (int(g) for g in m.groups())
        if not 1 <= index <= count:
            raise HeaderError(
                f"{p}: file number {index} is outside 1..{count}; not a name torch's "
                "HuggingFaceStorageWriter writes",
                path=str(p),
            )
        counts.setdefault(count, p)
        found.append((shard, index, p))
    if not found:
        raise HeaderError(
            f"{directory}: no shard-*-model-*-of-*.safetensors files "
            "(torch HuggingFaceStorageWriter output with save_distributed=True)",
            path=str(directory),
        )
    if len(counts) > 1:
        (a, pa), (b, pb) = sorted(counts.items())[:2]
        raise HeaderError(
            f"{directory}: {pa.name} says {a} file(s) per rank but {pb.name} says {b}; "
            "the directory mixes files of different saves. Remove the stale files.",
            path=str(directory),
        )
    found.sort(key=lambda t: (t[0], t[1], t[2].name))
    warnings = [
        CheckpointWarning(
            f"{directory / n}: not a shard-*-model-*-of-*.safetensors file; ignored", path=str(directory / n)
        )
        for n in others
    ]
    return [p for _, _, p in found], warnings


def _int_list(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, list):
        return None
    out: list[int] = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return None
        out.append(v)
    return tuple(out)


def read_sharding_info(header: Header, path: Path) -> dict[str, dict[str, object]]:
    """The parsed ``DCP_SHARDING_INFO`` of one file: tensor name -> its info object.

    Raises:
        HeaderError: the key is missing, not JSON, or not an object of objects.
    """
    meta = header.metadata or {}
    raw = meta.get(SHARDING_INFO_KEY)
    if raw is None:
        raise HeaderError(
            f"{path}: __metadata__ has no {SHARDING_INFO_KEY}; this is not a file torch's "
            "HuggingFaceStorageWriter(save_distributed=True) wrote. Open a consolidated "
            "checkpoint with --from hf.",
            path=str(path),
        )
    info = load_json(raw.encode(), path=str(path), what=SHARDING_INFO_KEY, error=HeaderError)
    if not isinstance(info, dict):
        raise HeaderError(
            f"{path}: {SHARDING_INFO_KEY} must be a JSON object mapping tensor names to "
            f'{{"{SAVED_OFFSETS_KEY}": [...]}}, got {type(info).__name__}',
            path=str(path),
        )
    for name, value in info.items():
        if not isinstance(value, dict):
            raise HeaderError(
                f'{path}: {SHARDING_INFO_KEY} entry for tensor "{name}" must be an object '
                f'like {{"{SAVED_OFFSETS_KEY}": [0, 0]}}',
                path=str(path),
                tensor=name,
            )
    return info


def _chunk(name: str, info: dict[str, object], header: Header, path: Path, file_index: int) -> StoredChunk:
    entry = header.entry(name)
    where = f'{path}: tensor "{name}"'
    if SAVED_OFFSETS_KEY not in info:
        raise HeaderError(
            f"{where} has no {SAVED_OFFSETS_KEY} in {SHARDING_INFO_KEY}",
            path=str(path),
            tensor=name,
        )
    offsets = _int_list(info[SAVED_OFFSETS_KEY])
    if offsets is None:
        raise HeaderError(
            f"{where}: {SAVED_OFFSETS_KEY} {json.dumps(info[SAVED_OFFSETS_KEY])} must be a "
            "list of non-negative integers",
            path=str(path),
            tensor=name,
        )
    if len(offsets) != len(entry.shape):
        raise HeaderError(
            f"{where} is stored with shape {list(entry.shape)} ({len(entry.shape)}-d) but "
            f"{SHARDING_INFO_KEY} gives {len(offsets)} {SAVED_OFFSETS_KEY} {list(offsets)}",
            path=str(path),
            tensor=name,
        )
    if _SIZES_KEY in info:
        sizes = _int_list(info[_SIZES_KEY])
        if sizes != entry.shape:
            raise LayoutError(
                f"{where} is stored with shape {list(entry.shape)} but {SHARDING_INFO_KEY} "
                f"says its chunk has sizes {json.dumps(info[_SIZES_KEY])}",
                path=str(path),
                tensor=name,
            )
    global_shape = None
    if _GLOBAL_SHAPE_KEY in info:
        global_shape = _int_list(info[_GLOBAL_SHAPE_KEY])
        if global_shape is None or len(global_shape) != len(entry.shape):
            raise HeaderError(
                f"{where}: {_GLOBAL_SHAPE_KEY} {json.dumps(info[_GLOBAL_SHAPE_KEY])} must be "
                f"{len(entry.shape)} non-negative integers",
                path=str(path),
                tensor=name,
            )
    return StoredChunk(
        file=file_index,
        offsets=offsets,
        shape=entry.shape,
        dtype=entry.dtype,
        start=header.data_start + entry.start,
        global_shape=global_shape,
    )


def _global_shape(name: str, chunks: Sequence[StoredChunk], files: Sequence[Path]) -> tuple[int, ...]:
    first = chunks[0]
    for c in chunks[1:]:
        if c.dtype != first.dtype:
            raise LayoutError(
                f'tensor "{name}" is {c.dtype} in {files[c.file].name} but {first.dtype} in '
                f"{files[first.file].name}; all chunks of a tensor must have one dtype",
                path=str(files[c.file]),
                tensor=name,
            )
        if len(c.shape) != len(first.shape):
            raise LayoutError(
                f'tensor "{name}" is {len(c.shape)}-d in {files[c.file].name} but '
                f"{len(first.shape)}-d in {files[first.file].name}",
                path=str(files[c.file]),
                tensor=name,
            )
    stated = [c for c in chunks if c.global_shape is not None]
    if stated:
        shape = stated[0].global_shape
        assert shape is not None
        for c in stated[1:]:
            if c.global_shape != shape:
                raise LayoutError(
                    f'tensor "{name}": {files[c.file].name} gives global shape '
                    f"{list(c.global_shape or ())} but {files[stated[0].file].name} gives "
                    f"{list(shape)}",
                    path=str(files[c.file]),
                    tensor=name,
                )
    else:
        # torch's reader does the same; an empty chunk's offset is the size of its dim
        ext = [0] * len(first.shape)
        for c in chunks:
            for d, (o, s) in enumerate(zip(c.offsets, c.shape, strict=True)):
                ext[d] = max(ext[d], o + s)
        shape = tuple(ext)
    if math.prod(shape) > MAX_INT64 or max(shape, default=0) > MAX_INT64:

        def end(c: StoredChunk) -> int:
            return max((o + s for o, s in zip(c.offsets, c.shape)), default=0)

        far = stated[0] if stated else max(chunks, key=end)
        said = f"{_GLOBAL_SHAPE_KEY}" if stated else f"{SAVED_OFFSETS_KEY} {list(far.offsets)} give it"
        raise HeaderError(
            f'{files[far.file]}: tensor "{name}": {said} a global shape {list(shape)} over '
            f"{MAX_INT64} elements (int64; torch refuses it)",
            path=str(files[far.file]),
            tensor=name,
        )
    for c in chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.shape, shape, strict=True)):
            raise LayoutError(
                f'{files[c.file].name}: tensor "{name}" is stored as box {format_box(c.box)} '
                f"(offsets {list(c.offsets)}, shape {list(c.shape)}), which exceeds its global "
                f"shape {list(shape)}",
                path=str(files[c.file]),
                tensor=name,
            )
    return shape


def _overlap_warning(
    name: str,
    chunks: Sequence[StoredChunk],
    pairs: Sequence[tuple[int, int]],
    shape: tuple[int, ...],
    files: Sequence[Path],
) -> CheckpointWarning:
    i, j = pairs[0]
    a, b = chunks[i], chunks[j]
    more = f" (and {len(pairs) - 1} more overlapping pair(s))" if len(pairs) > 1 else ""
    return CheckpointWarning(
        f'tensor "{name}": stored boxes {format_box(a.box)} ({files[a.file].name}) and '
        f"{format_box(b.box)} ({files[b.file].name}) overlap{more}. torch saves a "
        "_StridedShard (or any non-contiguous) local tensor as one box at its first global "
        "offset, so these chunks do not say where their elements belong, and the derived "
        f"global shape {list(shape)} may be wrong; converting this tensor fails. Re-save it "
        "with placements whose local blocks are contiguous (e.g. redistribute to Shard), or "
        "save it as a per-rank checkpoint (reshard.save_dtensors).",
        problem=True,
        path=str(files[b.file]),
        tensor=name,
    )


def _read_chunks(files: Sequence[Path], warnings: list[CheckpointWarning]) -> dict[str, list[StoredChunk]]:
    """Every stored chunk, per tensor name, from the files' headers and sharding info."""
    chunks: dict[str, list[StoredChunk]] = {}
    headers = [read_header(f) for f in files]
    for fi, (f, h) in enumerate(zip(files, headers, strict=True)):
        info = read_sharding_info(h, f)
        version = (h.metadata or {}).get(_VERSION_KEY)
        if version is not None and version.split(".")[0] != "1":
            warnings.append(
                CheckpointWarning(
                    f"{f.name}: {_VERSION_KEY} {version!r} is newer than the 1.x this reader knows; "
                    "reading it as 1.0",
                    path=str(f),
                )
            )
        for name in h.names:
            if name not in info:
                raise HeaderError(
                    f'{f}: tensor "{name}" has no entry in {SHARDING_INFO_KEY}, so its global '
                    "offset is unknown",
                    path=str(f),
                    tensor=name,
                )
            chunks.setdefault(name, []).append(_chunk(name, info[name], h, f, fi))
        stray = [n for n in info if n not in set(h.names)]
        if stray:
            warnings.append(
                CheckpointWarning(
                    f'{f.name}: {SHARDING_INFO_KEY} lists tensor "{stray[0]}"'
                    + (f" (and {len(stray) - 1} more)" if len(stray) > 1 else "")
                    + " but the file does not hold it; ignored",
                    path=str(f),
                )
            )
    return chunks


def _tensors(
    chunks: dict[str, list[StoredChunk]], files: Sequence[Path], warnings: list[CheckpointWarning]
) -> dict[str, TensorSource]:
    """One tensor per name: a piece per chunk; overlapping chunks are reported as a problem."""
    tensors: dict[str, TensorSource] = {}
    overlap_cache: dict[tuple[Block, ...], list[tuple[int, int]]] = {}
    for name in sorted(chunks):
        cs = chunks[name]
        shape = _global_shape(name, cs, files)
        blocks = tuple(c.block for c in cs)
        pairs = overlap_cache.get(blocks)
        if pairs is None:
            pairs = overlapping_pairs(blocks)
            overlap_cache[blocks] = pairs
        if pairs:
            warnings.append(_overlap_warning(name, cs, pairs, shape, files))
        tensors[name] = TensorSource(
            name=name,
            dtype=cs[0].dtype,
            shape=shape,
            piece_files=tuple(c.file for c in cs),
            piece_offsets=tuple(c.start for c in cs),
            piece_blocks=blocks,
            signature=("boxes", shape, blocks),
        )
    return tensors


def open_dcp_safetensors(path: Path) -> Checkpoint:
    """Open torch ``HuggingFaceStorageWriter(save_distributed=True)`` output.

    Every tensor becomes the set of its stored chunks: one piece per chunk, its
    block the box at the chunk's ``saved_offsets``. Coverage is not checked here
    (the planner raises :class:`~reshard.errors.PlanError` on holes and
    overlaps; ``inspect --check`` reports them); overlapping boxes, the mark of
    a mis-recorded ``_StridedShard`` chunk, are reported in ``warnings``.

    Args:
        path: the checkpoint directory, or one such ``.safetensors`` file.

    Returns:
        A :class:`Checkpoint` of format ``dcp-safetensors``, tensors in name
        order, with no mesh or layout.

    Raises:
        HeaderError: no shard files; unreadable headers; ``DCP_SHARDING_INFO``
            missing, not JSON, or without valid ``saved_offsets`` for a tensor.
        LayoutError: chunks of one tensor with different dtypes or ranks, or a
            box outside the tensor's global shape.
    """
    warnings: list[CheckpointWarning] = []
    if path.is_file():
        files = [path]
    else:
        files, warnings = dcp_files(path)
    tensors = _tensors(_read_chunks(files, warnings), files, warnings)
    return Checkpoint(
        path=str(path),
        format="dcp-safetensors",
        files=tuple(str(f) for f in files),
        file_sizes=tuple(f.stat().st_size for f in files),
        tensors=tensors,
        warnings=warnings,
    )


def _detect(probe: Probe) -> int:
    return YES if not probe.is_file and any(DCP_FILE.match(n) for n in probe.names) else NO


def _open(path: Path, options: ReadOptions) -> Checkpoint:
    return open_dcp_safetensors(path)


READER = Reader(
    name="dcp-safetensors",
    help="torch HuggingFaceStorageWriter(save_distributed=True) output: "
    "shard-*-model-*-of-*.safetensors with DCP_SHARDING_INFO",
    detect=_detect,
    open=_open,
)
