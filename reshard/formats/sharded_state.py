"""vLLM / SGLang ``sharded_state`` checkpoints: ``model-rank-{rank}-part-{part}.safetensors``.

vLLM's ``ShardedStateLoader.save_model`` writes each tensor-parallel rank's
``model.state_dict()`` with ``safetensors.torch.save_file`` (no ``__metadata__``),
starting a new part when the next tensor would take the part over ``max_size``;
its loader globs ``model-rank-{rank}-part-*.safetensors`` and reads every key.
The files store local tensors only, so reading needs the placements: a
``--source-layout`` (global shapes are derived from the local shapes and checked
on every rank), or the ``reshard.json`` reshard writes next to the files.

Written files are exactly what vLLM writes (no ``__metadata__``; vLLM would ignore
it, but then a part is byte-identical to ``save_file`` of the same tensors); the
placements go into ``reshard.json`` only, so ``reshard convert OUT OUT2
--target-mesh tp=2`` works without a layout. Tensor names are kept as they are:
vLLM's fused parameters (``qkv_proj``, ``gate_up_proj``) and KV-head replication
are transforms, not part of this format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import Checkpoint
from ..errors import HeaderError, LayoutError, UsageError
from ..mesh import Mesh
from ..placements import Placement
from ..plan import OutFile, TargetTensor, WriteOptions
from .base import NO, YES, Probe, Reader, ReadOptions, Writer
from .manifest import MANIFEST, complete_with_manifest, read_manifest
from .per_rank import Describe, RankFiles, layout_describe, manifest_layout, rank_checkpoint, source_layout
from .safetensors import SafetensorsFile, file_order, split_parts

if TYPE_CHECKING:
    from ..config import LayoutConfig

__all__ = ["PART_FILE", "READER", "WRITER", "part_file_name", "part_files"]

PART_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


def part_file_name(rank: int, part: int) -> str:
    """``model-rank-{rank}-part-{part}.safetensors`` (vLLM's ``DEFAULT_PATTERN``; numbers not padded)."""
    return f"model-rank-{rank}-part-{part}.safetensors"


def part_files(directory: Path) -> list[list[Path]]:
    """Per rank (0 to the highest), its part files in part order.

    Raises:
        HeaderError: no part files, or a rank below the highest has none.
    """
    by_rank: dict[int, list[tuple[int, Path]]] = {}
    for p in sorted(directory.iterdir()):
        m = PART_FILE.match(p.name)
        if m and p.is_file():
            by_rank.setdefault(int(m.group(1)), []).append((int(m.group(2)), p))
    if not by_rank:
        raise HeaderError(
            f"{directory}: no model-rank-{{rank}}-part-{{part}}.safetensors files found", path=str(directory)
        )
    missing = [r for r in range(max(by_rank) + 1) if r not in by_rank]
    if missing:
        raise HeaderError(
            f"{directory}: no model-rank-{{rank}}-part-*.safetensors file for rank(s) {missing[:8]}",
            path=str(directory),
        )
    return [[p for _, p in sorted(by_rank[r])] for r in range(len(by_rank))]


def _manifest_describe(directory: Path, manifest: Mapping[str, object]) -> tuple[Mesh, Describe]:
    """The mesh and per-tensor global shape and placements ``reshard.json`` records."""
    where = directory / MANIFEST
    try:
        mesh_doc = manifest["mesh"]
        assert isinstance(mesh_doc, dict)
        mesh = Mesh(tuple(mesh_doc["names"]), tuple(int(x) for x in mesh_doc["shape"]))
        tensors = manifest["tensors"]
        if not isinstance(tensors, dict):
            raise TypeError("tensors is not an object")
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        raise HeaderError(f"{where}: invalid mesh or tensors ({e!r})", path=str(where)) from None

    def describe(
        name: str, _local_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[tuple[int, ...], Sequence[Placement | str]]:
        info = tensors.get(name)
        if not isinstance(info, dict) or "shape" not in info or "placements" not in info:
            raise HeaderError(
                f'{where}: tensor "{name}" is not described; pass --source-layout FILE',
                path=str(where),
                tensor=name,
            )
        return tuple(int(x) for x in info["shape"]), [str(x) for x in info["placements"]]

    return mesh, describe


def _open(path: Path, options: ReadOptions) -> Checkpoint:
    """Open a sharded-state directory with ``--source-layout``, else with its ``reshard.json``."""
    if not path.is_dir():
        raise UsageError(f"{path}: a sharded-state checkpoint is a directory", path=str(path))
    ranks = part_files(path)
    paths = [p for parts in ranks for p in parts]
    index = {p: i for i, p in enumerate(paths)}
    files = RankFiles.one_per_rank(paths)
    files = RankFiles(files.paths, files.headers, tuple(tuple(index[p] for p in parts) for parts in ranks))
    cfg = source_layout(options)
    manifest = read_manifest(path)
    layout: LayoutConfig | None
    if cfg is not None:
        mesh, layout = cfg.mesh, cfg
        describe = layout_describe(cfg.placements_for, mesh, paths[0], cfg.source)
    elif manifest is not None and "tensors" in manifest:
        mesh, describe = _manifest_describe(path, manifest)
        layout = manifest_layout(path, manifest)
    else:
        raise LayoutError(
            f"{path}: sharded-state files store no placements; pass --source-layout FILE "
            "(a YAML layout or preset, with --source-mesh tp=N for its tensor-parallel size)",
            path=str(path),
        )
    ckpt = rank_checkpoint(path, "sharded-state", files, mesh, describe)
    ckpt.manifest = manifest
    ckpt.layout = layout
    return ckpt


def _detect(probe: Probe) -> int:
    if probe.is_file:
        return NO
    return YES if any(PART_FILE.match(n) for n in probe.with_suffix(".safetensors")) else NO


READER = Reader(
    name="sharded-state",
    help="vLLM/SGLang model-rank-{rank}-part-{part}.safetensors (with --source-layout, or its reshard.json)",
    detect=_detect,
    open=_open,
)


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    """Each rank's tensors in checkpoint order, split into parts; listed part by part, so that
    consecutive files are sibling ranks holding the same tensors (written in lockstep)."""
    per_rank = [split_parts(tensors, rank, options.max_shard_size) for rank in range(mesh.size)]
    out: list[OutFile] = []
    for part in range(max(len(p) for p in per_rank)):
        for rank, parts in enumerate(per_rank):
            if part < len(parts):
                out.append(
                    SafetensorsFile(part_file_name(rank, part), rank, file_order(parts[part], options), None)
                )
    return out


WRITER = Writer(
    name="sharded-state",
    help="vLLM/SGLang model-rank-{rank}-part-{part}.safetensors per target rank, parts split at "
    "--max-shard-size (placements in reshard.json; tensor names kept)",
    files=_files,
    complete=complete_with_manifest,
    lockstep=True,
    owns=(".safetensors",),
)
