"""What a checkpoint holds, whatever its format: tensors as pieces in files (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .intervals import Block, block_shape, block_volume
from .mesh import Mesh
from .placements import Placement

__all__ = ["TensorSource", "StoredObject", "Checkpoint"]


@dataclass(frozen=True, slots=True)
class TensorSource:
    """One logical tensor and where its pieces lie.

    Piece ``k`` is the row-major local tensor ``piece_blocks[k]`` stored at
    absolute byte offset ``piece_offsets[k]`` of file ``piece_files[k]``.
    Pieces with equal blocks and equal ``piece_partials`` are replicas;
    pieces in different partial groups are reduced with ``reduce_op``.

    ``signature`` identifies the piece geometry (same signature, same blocks)
    so the planner can reuse work across tensors of the same shape and layout.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    piece_files: tuple[int, ...]
    piece_offsets: tuple[int, ...]
    piece_blocks: tuple[Block, ...]
    signature: tuple[Any, ...]
    piece_partials: tuple[int, ...] | None = None
    reduce_op: str | None = None
    placements: tuple[Placement, ...] | None = None
    piece_crcs: tuple[int | None, ...] | None = None  # each piece's CRC32, when its format stores one

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def piece_shape(self, k: int) -> tuple[int, ...]:
        return block_shape(self.piece_blocks[k])

    def piece_numel(self, k: int) -> int:
        return block_volume(self.piece_blocks[k])


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A non-tensor item (DCP ``BYTE_IO``): ``length`` opaque bytes at ``offset`` of file ``file``.

    It cannot go into safetensors; converting lists it instead of copying it.
    """

    name: str
    file: int
    offset: int
    length: int


@dataclass(slots=True)
class Checkpoint:
    """A readable checkpoint: its files and its logical tensors (in name order)."""

    path: str
    format: str
    files: tuple[str, ...]
    file_sizes: tuple[int, ...]
    tensors: dict[str, TensorSource]
    mesh: Mesh | None = None
    layout: Any = None  # config.LayoutConfig when known
    manifest: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    objects: dict[str, StoredObject] = field(default_factory=dict)  # non-tensor items, by name

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes)
