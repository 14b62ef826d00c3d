"""Hugging Face consolidated checkpoints: model.safetensors, or shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import Checkpoint, TensorSource
from ..errors import HeaderError, TensorNotFoundError
from ..intervals import full_block
from ..io.header import Header, read_header

__all__ = ["INDEX", "SINGLE", "open_hf"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _tensor(name: str, header: Header, file_index: int) -> TensorSource:
    e = header.entry(name)
    return TensorSource(
        name=name,
        dtype=e.dtype,
        shape=e.shape,
        piece_files=(file_index,),
        piece_offsets=(header.data_start + e.start,),
        piece_blocks=(full_block(e.shape),),
        signature=("full", e.shape),
    )


def open_hf(path: Path) -> Checkpoint:
    """Open ``model.safetensors``, a sharded checkpoint with its index, or one ``.safetensors`` file.

    Raises:
        HeaderError: unreadable index or headers, a shard named by the index missing.
        TensorNotFoundError: the index names a tensor its shard does not hold.
    """
    warnings: list[str] = []
    if path.is_file():
        files = [path]
        weight_map = None
        root = path.parent
    else:
        root = path
        index = path / INDEX
        if index.exists():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
                ):
                    raise TypeError("weight_map must map tensor names to file names")
            except (ValueError, KeyError, TypeError) as e:
                raise HeaderError(f"{index}: not a valid safetensors index ({e})", path=str(index)) from None
            names = sorted(set(weight_map.values()))
            for n in names:
                if "/" in n or n.startswith("."):
                    raise HeaderError(
                        f"{index}: shard name {n!r} points outside the checkpoint", path=str(index)
                    )
            files = [path / n for n in names]
            for f in files:
                if not f.exists():
                    raise HeaderError(f"{f}: listed in {INDEX} but missing", path=str(f))
        elif (path / SINGLE).exists():
            files = [path / SINGLE]
            weight_map = None
        else:
            cands = sorted(p for p in path.glob("*.safetensors"))
            if len(cands) != 1:
                raise HeaderError(f"{path}: no {SINGLE} or {INDEX} found", path=str(path))
            files = cands
            weight_map = None
    headers = [read_header(f) for f in files]
    tensors: dict[str, TensorSource] = {}
    if weight_map is None:
        for name in headers[0].names:
            tensors[name] = _tensor(name, headers[0], 0)
    else:
        pos = {f.name: i for i, f in enumerate(files)}
        for name, fname in weight_map.items():
            i = pos[fname]
            try:
                tensors[name] = _tensor(name, headers[i], i)
            except TensorNotFoundError:
                raise TensorNotFoundError(
                    f'{files[i]}: tensor "{name}" is missing ({INDEX} says it is here)',
                    path=str(files[i]),
                    tensor=name,
                ) from None
        for f, h in zip(files, headers):
            extra = [n for n in h.names if n not in weight_map]
            if extra:
                warnings.append(f'{f.name}: tensor "{extra[0]}" is not in {INDEX}; ignored')
    return Checkpoint(
        path=str(root if path.is_dir() else path),
        format="hf",
        files=tuple(str(f) for f in files),
        file_sizes=tuple(f.stat().st_size for f in files),
        tensors=dict(sorted(tensors.items())),
        warnings=warnings,
    )
