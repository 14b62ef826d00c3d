"""Hugging Face consolidated checkpoints: model.safetensors, or shards with an index."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from operator import attrgetter
from pathlib import Path

from ..checkpoint import Checkpoint, CheckpointWarning, TensorSource, tensor_source
from ..errors import HeaderError, TensorNotFoundError
from ..intervals import Block, full_block
from ..io.header import Header, TensorEntry, read_header
from ..io.writer import FileResult, write_json
from ..mesh import Mesh
from ..plan import OutFile, Plan, TargetTensor, WriteOptions, local_nbytes
from .base import MAYBE, NO, YES, Probe, Reader, Writer
from .hf_extras import INDEX, SINGLE, hf_weight_files
from .manifest import complete_self_described
from .safetensors import SafetensorsFile, file_order, split_parts

__all__ = ["INDEX", "SINGLE", "READER", "WRITER", "open_hf", "duplicates"]


@lru_cache(maxsize=65536)
def _whole(shape: tuple[int, ...]) -> tuple[Block]:
    """One piece holding the whole tensor; one object per shape, so the executor's per-geometry
    caches (keyed by identity) hit for every tensor of that shape."""
    return (full_block(shape),)


def _tensor(name: str, header: Header, file_index: int, e: TensorEntry | None = None) -> TensorSource:
    e = header.entry(name) if e is None else e
    blocks, signature = _geometry(e.shape)
    # positional, without the dataclass constructor: a 100k-tensor checkpoint builds 100k
    return tensor_source(
        name,
        e.dtype,
        e.shape,
        _FILES[file_index] if file_index < len(_FILES) else (file_index,),
        (header.data_start + e.start,),
        blocks,
        signature,
    )


_NAME = attrgetter("name")

_FILES = tuple((i,) for i in range(4096))
"""``(i,)`` for each file index, one object each (not one per tensor: 200k tensors, 10 MB)."""


@lru_cache(maxsize=65536)
def _geometry(shape: tuple[int, ...]) -> tuple[tuple[Block], tuple[object, ...]]:
    """The piece blocks and signature of a whole tensor, one pair of objects per shape."""
    return _whole(shape), ("full", shape)


def open_hf(path: Path) -> Checkpoint:
    """Open ``model.safetensors``, a sharded checkpoint with its index, or one ``.safetensors`` file.

    The weight files are those transformers would load (:func:`hf_weight_files`):
    with both ``model.safetensors`` and an index present, the single file, and a warning.

    Raises:
        HeaderError: unreadable index or headers, a shard named by the index missing.
        TensorNotFoundError: the index names a tensor its shard does not hold.
    """
    if path.is_file():
        files, weight_map, warning = [path], None, None
    else:
        files, weight_map, warning = hf_weight_files(path)
    warnings = [CheckpointWarning(warning, path=str(path))] if warning else []
    if weight_map is None:
        header = read_header(files[0])
        # made in name order: the dict is the checkpoint's as it is (not remade sorted: 10 MB at 200k)
        tensors = {e.name: _tensor(e.name, header, 0, e) for e in sorted(header.entries, key=_NAME)}
    else:
        found = _sharded(files, weight_map, warnings)
        del weight_map  # (200k names and their shards: 28 MB) before the dict is made in name order
        tensors = {n: found[n] for n in sorted(found)}
        del found
    return Checkpoint(
        path=str(path),
        format="hf",
        files=tuple(str(f) for f in files),
        file_sizes=tuple(f.stat().st_size for f in files),
        tensors=tensors,
        warnings=warnings,
    )


def _sharded(
    files: Sequence[Path], weight_map: dict[str, str], warnings: list[CheckpointWarning]
) -> dict[str, TensorSource]:
    """The tensors of an index's shards (in file order), a shard's header at a time (a 200k-tensor
    checkpoint holds one header, not all of them, next to the index; no name index per header).

    The index decides which file is read. A tensor a shard holds that the index does not name is
    ignored with a warning (one a shard). A second copy of a tensor in another shard of another
    dtype or shape means the shards disagree (a stale file from another save), which is refused
    rather than silently resolved; of the same dtype and shape, a warning.

    Raises:
        TensorNotFoundError: the index names a tensor its shard does not hold.
        HeaderError: two shards disagree (naming both files and both descriptions).
    """
    tensors: dict[str, TensorSource] = {}
    copies: list[tuple[str, str, str, tuple[int, ...]]] = []  # (name, file, dtype, shape) held elsewhere too
    for i, f in enumerate(files):
        header = read_header(f)
        extra = None
        for e in header.entries:
            home = weight_map.get(e.name)
            if home == f.name:
                tensors[e.name] = _tensor(e.name, header, i, e)
            elif home is None:
                extra = extra or e.name
            else:
                copies.append((e.name, f.name, e.dtype, e.shape))
        if extra is not None:
            msg = f'{f.name}: tensor "{extra}" is not in {INDEX}; ignored'
            warnings.append(CheckpointWarning(msg, path=str(f)))
        del header
    if len(tensors) < len(weight_map):
        name = next(n for n in weight_map if n not in tensors)
        where = files[0].parent / weight_map[name]
        raise TensorNotFoundError(
            f'{where}: tensor "{name}" is missing ({INDEX} says it is here)', path=str(where), tensor=name
        )
    for n, fname, dtype, shape in copies:
        home, a = weight_map[n], tensors[n]
        if (a.dtype, a.shape) != (dtype, shape):
            raise HeaderError(
                f'tensor "{n}" is {a.dtype} {list(a.shape)} in {home} ({INDEX} names that file) but '
                f"{dtype} {list(shape)} in {fname}: two shards disagree; remove the stale file",
                path=str(files[0].parent / fname),
                tensor=n,
            )
        msg = f'{fname}: tensor "{n}" is also in {home}; reading {home}, as {INDEX} says'
        warnings.append(CheckpointWarning(msg, path=str(files[0].parent / fname), tensor=n))
    return tensors


def duplicates(
    files: Sequence[Path], headers: Sequence[Header], weight_map: dict[str, str], index: str = INDEX
) -> list[CheckpointWarning]:
    """Tensors that shards other than the index's choice hold too (the pt reader's legacy
    ``.bin`` shards; :func:`_sharded` checks the safetensors shards as it reads them).

    The index decides which file is read; a second copy of another dtype or shape
    means the shards disagree (a stale file from another save), which is refused
    rather than silently resolved. Same dtype and shape: a warning.

    Raises:
        HeaderError: naming both files and both descriptions.
    """
    pos = {f.name: i for i, f in enumerate(files)}
    out: list[CheckpointWarning] = []
    for f, h in zip(files, headers):
        for n in h.names:
            home = weight_map.get(n)
            if home is None or home == f.name:
                continue
            a, b = headers[pos[home]].entry(n), h.entry(n)
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise HeaderError(
                    f'tensor "{n}" is {a.dtype} {list(a.shape)} in {home} ({index} names that file) but '
                    f"{b.dtype} {list(b.shape)} in {f.name}: two shards disagree; remove the stale file",
                    path=str(f),
                    tensor=n,
                )
            msg = f'{f.name}: tensor "{n}" is also in {home}; reading {home}, as {index} says'
            out.append(CheckpointWarning(msg, path=str(f), tensor=n))
    return out


def _detect(probe: Probe) -> int:
    if probe.is_file:
        return YES if probe.path.name.endswith(".safetensors") else NO
    if INDEX in probe.names or SINGLE in probe.names:
        return YES
    return MAYBE if len(probe.with_suffix(".safetensors")) == 1 else NO


READER = Reader(
    name="hf",
    help=f"{SINGLE}, or model-*-of-*.safetensors with {INDEX}, or one .safetensors file",
    detect=_detect,
    open=lambda path, options: open_hf(path),
)


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    """Consolidated tensors in natural order, split into files of at most ``max_shard_size``."""
    groups = split_parts(tensors, 0, options.max_shard_size)
    total = len(groups)
    return [
        SafetensorsFile(
            SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors",
            None,
            file_order(group, options),
            '{"format":"pt"}',
        )
        for i, group in enumerate(groups)
    ]


def _complete(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    """The index (for more than one file), then ``reshard.json``."""
    if len(plan.files) > 1:
        where = {t.name: f.name for f in plan.files for t in f.tensors}
        total = sum(local_nbytes(t, 0) for t in plan.tensors)
        weight_map = {t.name: where[t.name] for t in plan.tensors}
        write_json(dst / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    complete_self_described(dst, plan, results)


WRITER = Writer(
    name="hf",
    help="consolidated Hugging Face safetensors, split at --max-shard-size, with the index",
    files=_files,
    complete=_complete,
    consolidated=True,
    owns=(".safetensors", INDEX),
)
