"""Which box each rank's chunk is in a DCP checkpoint, and which rank stores a replicated one (pure).

``dcp.save`` stores one chunk per rank and tensor: ``_create_write_items_for_dtensor``
records ``compute_local_shape_and_global_offset`` (local shape, offset of the first
local index per dim; an empty shard sits at offset = dim size). DCP has no way to
say "rows 0-1 and 4-5", so a rank whose local data is not one box cannot be
expressed: torch itself fails such a save with "overlapping chunks"
(dcp.md §A.2). In reshard's algebra a rank's block is one index list per dim; it
is a box exactly when every list has at most one interval.

Chunks with equal ``(fqn, offset)`` on several ranks (replicas) are written once;
:func:`dedup_owners` picks the rank the way torch's ``dedup_save_plans`` does.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..errors import LayoutError
from ..intervals import Box, Interval, index_list_size
from ..layout import TensorLayout

__all__ = ["rank_box", "WriteItem", "save_items", "dedup_owners", "rank_chunks"]


def rank_box(layout: TensorLayout, rank: int) -> Box | None:
    """The box torch's ``dcp.save`` records for ``rank``, or None when the local data is not one box.

    Per dim: the rank's one interval; an empty shard is ``Interval(n, n)`` at the dim's
    size ``n``, as torch's offset rule gives. A rank holding no data at all always has
    a box (torch records first index and local size; no bytes are stored).

    >>> from reshard.mesh import Mesh
    >>> lay = TensorLayout.make((3, 2), Mesh(("tp",), (4,)), ["S(0)"])
    >>> [tuple(str(iv) for iv in rank_box(lay, r)) for r in range(4)]
    [('[0:1)', '[0:2)'), ('[1:2)', '[0:2)'), ('[2:3)', '[0:2)'), ('[3:3)', '[0:2)')]
    >>> rank_box(TensorLayout.make((8,), Mesh(("a", "b"), (2, 2)), ["R", "_S(0, 2)"]), 0) is None
    True

    Raises:
        LayoutError: the layout has a Partial placement (DCP stores reduced values only).
    """
    if layout.partial_op is not None:
        raise LayoutError(
            f"{layout.placement_strs()}: DCP stores full values, not Partial ones",
            hint="reduce the Partial placement (use R or S(d)) in the target layout",
        )
    block = layout.blocks()[rank]
    empty = any(not ilist for ilist in block) and bool(block)
    box: list[Interval] = []
    for n, ilist in zip(layout.shape, block):
        if not ilist:
            box.append(Interval(n, n))
        elif len(ilist) == 1 or empty:
            # no data: torch records (first index, local size) and nothing is stored
            box.append(Interval(ilist[0].start, ilist[0].start + index_list_size(ilist)))
        else:
            return None
    return tuple(box)


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One chunk as torch's save planner sees it.

    Attributes:
        key: what identifies the chunk across ranks, ``(fqn, offsets)`` as ``MetadataIndex`` compares.
        ranks: every rank whose local plan has this chunk.
        nbytes: ``WriteItem.tensor_storage_size()``: numel * itemsize of the whole
            (global) tensor, not of the chunk, which is what torch weighs.
    """

    key: Hashable
    ranks: tuple[int, ...]
    nbytes: int


def save_items(tensors: Sequence[tuple[str, TensorLayout, int]]) -> list[tuple[str, Box, WriteItem]]:
    """Every distinct chunk of these tensors, in the order torch's ``dedup_save_plans`` meets them.

    Args:
        tensors: ``(fqn, layout, itemsize)`` in state-dict order; all on meshes of the same ranks.

    Returns:
        ``(fqn, box, item)`` per distinct ``(fqn, offsets)``: rank 0's chunks in
        tensor order, then chunks first held by rank 1, and so on. Linear in
        tensors x ranks: the boxes are worked out once per distinct layout.

    Raises:
        LayoutError: a rank's local data is not one box (names the tensor and rank).
    """
    world = max((lay.mesh.size for _, lay, _ in tensors), default=0)
    by_rank: list[list[tuple[str, Box, WriteItem]]] = [[] for _ in range(world)]
    for fqn, layout, itemsize in tensors:
        chunks, bad = _distinct_chunks(layout)
        if bad is not None:
            raise LayoutError(
                f'tensor "{fqn}": {layout.placement_strs()} leaves rank {bad} a local tensor that is '
                "not one box; DCP stores one box per rank and cannot express it",
                tensor=fqn,
                hint="choose placements whose local shards are contiguous (S(d) rather than _S(d, k))",
            )
        nbytes = itemsize
        for n in layout.shape:
            nbytes *= n
        for first, box, holders in chunks:
            offsets = tuple(iv.start for iv in box)
            by_rank[first].append((fqn, box, WriteItem((fqn, offsets), holders, nbytes)))
    return [item for items in by_rank for item in items]


def rank_chunks(tensors: Sequence[tuple[str, TensorLayout, int]]) -> list[tuple[array[int], list[Box]]]:
    """Per rank, the chunks it writes: tensor positions (ascending) and boxes, what
    :func:`save_items` + :func:`dedup_owners` give, without an object per chunk.

    The same walk as theirs (chunks first held by rank 0 in tensor order, then rank 1's,
    ...; each to the holder with the fewest planned bytes), with a rank's tensor positions
    in an array: 800k chunks (100k tensors at TP-8) hold 3 MiB, not 200.

    Raises:
        LayoutError: a rank's local data is not one box (the first such tensor, as
            :func:`save_items` names it).
    """
    world = max((lay.mesh.size for _, lay, _ in tensors), default=0)
    firsts: list[array[int]] = [array("i") for _ in range(world)]  # tensors with a chunk first held by r
    by_layout: dict[int, tuple[TensorLayout, dict[int, tuple[Box, tuple[int, ...]]]]] = {}
    for i, (fqn, layout, _) in enumerate(tensors):
        hit = by_layout.get(id(layout))
        if hit is None or hit[0] is not layout:
            chunks, bad = _distinct_chunks(layout)
            if bad is not None:
                save_items([(fqn, layout, 1)])  # raises, naming the tensor and rank
            hit = by_layout[id(layout)] = (layout, {r: (box, holders) for r, box, holders in chunks})
        for r in hit[1]:
            firsts[r].append(i)
    planned = [0] * world
    idx: list[array[int]] = [array("i") for _ in range(world)]
    boxes: list[list[Box]] = [[] for _ in range(world)]
    for r in range(world):
        for i in firsts[r]:
            _, layout, itemsize = tensors[i]
            box, holders = by_layout[id(layout)][1][r]  # a rank has one box: one chunk first held by it
            owner = holders[0] if len(holders) == 1 else min(holders, key=planned.__getitem__)
            nbytes = itemsize
            for n in layout.shape:
                nbytes *= n
            planned[owner] += nbytes or 1
            idx[owner].append(i)
            boxes[owner].append(box)
        firsts[r] = array("i")
    out: list[tuple[array[int], list[Box]]] = []
    for mine, bs in zip(idx, boxes):
        order = sorted(range(len(mine)), key=mine.__getitem__)
        out.append((array("i", [mine[k] for k in order]), [bs[k] for k in order]))
    return out


@lru_cache(maxsize=65536)
def _distinct_chunks(layout: TensorLayout) -> tuple[tuple[tuple[int, Box, tuple[int, ...]], ...], int | None]:
    """Per distinct box offset: the first rank holding it, its box, every rank holding it (ascending);
    or, as the second value, the first rank whose local data is not one box."""
    holders: dict[tuple[int, ...], list[int]] = {}
    first: dict[tuple[int, ...], tuple[int, Box]] = {}
    for r in range(layout.mesh.size):
        box = rank_box(layout, r)
        if box is None:
            return (), r
        offsets = tuple(iv.start for iv in box)
        holders.setdefault(offsets, []).append(r)
        first.setdefault(offsets, (r, box))
    return tuple((r, box, tuple(holders[off])) for off, (r, box) in first.items()), None


def dedup_owners(items: Sequence[WriteItem]) -> list[int]:
    """The rank that writes each item, as ``dedup_save_plans`` (torch 2.13) decides.

    Items must be all chunks (unique ones too: they count towards a rank's bytes), in
    torch's order (:func:`save_items`). Each goes to the holder that has planned the
    fewest bytes so far (lowest rank on ties); a zero-byte item counts 1.

    >>> dedup_owners([WriteItem("a", (0, 1), 8), WriteItem("b", (0, 1), 8), WriteItem("c", (0, 1), 4)])
    [0, 1, 0]
    """
    planned: dict[int, int] = {}
    owners: list[int] = []
    for item in items:
        owner = min(sorted(item.ranks), key=lambda r: planned.get(r, 0))
        planned[owner] = planned.get(owner, 0) + (item.nbytes or 1)
        owners.append(owner)
    return owners
