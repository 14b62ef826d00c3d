"""dcp_boxes against torch: boxes as DCP records them, owners as dedup_save_plans picks them.

For random layouts, a rank's box (when reshard says there is one) is exactly the
(local shape, global offset) torch's DCP records, and slicing the full tensor with it
gives the local data torch's own placement splitting gives. When reshard says there
is none, torch's recorded box would point at other data: DCP cannot express it.
The owners of replicated chunks are checked against torch's ``dedup_save_plans``
itself, fed plans built from the same boxes (both ``dedup_owners`` and the writer's
array form, ``rank_chunks``).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from reshard.formats.dcp_boxes import WriteItem as RWriteItem
from reshard.formats.dcp_boxes import dedup_owners, rank_box, rank_chunks, save_items
from reshard.intervals import block_volume
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.placements import Shard, StridedShard
from tests.strategies import (
    examples,
    layouts_on,
    meshes,
    placements,
    tensor_shapes,
    torch_local,
    torch_placements,
)


@st.composite
def dcp_layouts(draw: st.DrawFn) -> TensorLayout:
    mesh = draw(meshes(max_dims=3))
    shape = draw(tensor_shapes(max_dims=3, max_numel=2048))
    pls = draw(placements(len(shape), mesh.ndim, allow_partial=False))
    return TensorLayout.make(shape, mesh, pls)


@settings(max_examples=examples(200))
@given(dcp_layouts())
@example(TensorLayout.make((8, 4), Mesh(("dp", "tp"), (2, 2)), [StridedShard(0, 2), Shard(0)]))
@example(TensorLayout.make((8, 2), Mesh(("dp", "tp"), (2, 2)), ["R", StridedShard(0, 2)]))
@example(TensorLayout.make((3, 2), Mesh(("a", "b"), (2, 2)), [Shard(0), Shard(0)]))
@example(TensorLayout.make((8, 0), Mesh(("a", "b"), (2, 2)), ["R", StridedShard(0, 2)]))
def test_rank_box_is_what_torch_records(lay: TensorLayout) -> None:
    shape = lay.shape
    tpls = torch_placements(lay.placements, len(shape))
    full = torch.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    for rank, coord in enumerate(lay.mesh.coordinates()):
        t_shape, t_offset = _compute_local_shape_and_global_offset(shape, lay.mesh.shape, list(coord), tpls)
        local = torch_local(full, lay.mesh.shape, coord, tpls)
        at_torch_box = full[tuple(slice(o, o + n) for o, n in zip(t_offset, t_shape))]
        box = rank_box(lay, rank)
        where = f"{shape} {lay.mesh.shape} {lay.placement_strs()} rank {rank}"
        if box is None:
            assert block_volume(lay.blocks()[rank]) > 0, where
            assert not torch.equal(at_torch_box, local), where
            continue
        assert tuple(iv.start for iv in box) == tuple(t_offset), where
        assert tuple(iv.size for iv in box) == tuple(t_shape), where
        assert torch.equal(full[tuple(slice(iv.start, iv.stop) for iv in box)], local), where


def _torch_plans(tensors: list[tuple[str, TensorLayout, int]], world: int) -> list[SavePlan]:
    dtypes = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}
    plans = []
    for rank in range(world):
        items = []
        for fqn, lay, itemsize in tensors:
            box = rank_box(lay, rank)
            assert box is not None
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([iv.start for iv in box]), sizes=torch.Size([iv.size for iv in box])
            )
            data = TensorWriteData(chunk, TensorProperties(dtype=dtypes[itemsize]), torch.Size(lay.shape))
            items.append(WriteItem(MetadataIndex(fqn, chunk.offsets), WriteItemType.SHARD, tensor_data=data))
        plans.append(SavePlan(items))
    return plans


@st.composite
def state_dicts(draw: st.DrawFn) -> list[tuple[str, TensorLayout, int]]:
    mesh = draw(meshes(max_dims=3, max_ranks=8))
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        lay = draw(layouts_on(mesh, max_dims=3, max_numel=512, allow_partial=False))
        if all(rank_box(lay, r) is not None for r in range(mesh.size)):
            out.append((f"t{i}", lay, draw(st.sampled_from([1, 2, 4, 8]))))
    return out


@settings(max_examples=examples(150))
@given(state_dicts())
def test_dedup_owners_match_torch(tensors: list[tuple[str, TensorLayout, int]]) -> None:
    if not tensors:
        return
    world = tensors[0][1].mesh.size
    names = [fqn for fqn, _, _ in tensors]
    items = save_items(tensors)
    owners = dedup_owners([it for _, _, it in items])
    ours = {(fqn, tuple(iv.start for iv in box)): o for (fqn, box, _), o in zip(items, owners)}
    theirs = {}
    for rank, plan in enumerate(dedup_save_plans(_torch_plans(tensors, world))):
        for item in plan.items:
            theirs[(item.index.fqn, tuple(item.index.offset))] = rank
    assert ours == theirs
    # rank_chunks: the same owners, each rank's chunks in tensor order, boxes as save_items has them
    per_rank = rank_chunks(tensors)
    assert len(per_rank) == world
    for rank, (idx, boxes) in enumerate(per_rank):
        want = sorted(
            ((names.index(fqn), box) for (fqn, box, _), o in zip(items, owners) if o == rank),
            key=lambda x: x[0],
        )
        assert list(idx) == [i for i, _ in want] and boxes == [b for _, b in want]


def test_dedup_counts_unique_chunks_too() -> None:
    # rank 0 already holds 8 bytes of its own, so the shared chunk goes to rank 1
    items = [RWriteItem("own", (0,), 8), RWriteItem("shared", (0, 1), 4)]
    assert dedup_owners(items) == [0, 1]
