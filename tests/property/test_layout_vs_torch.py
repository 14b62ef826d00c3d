"""Layouts against the oracle, torch itself; and the interval algebra against brute force.

For random (mesh, shape, placements) the block reshard computes for each
coordinate must select, from ``arange(numel).reshape(shape)``, exactly the local
tensor torch's own placement splitting (``Shard._split_tensor`` /
``_StridedShard._split_tensor``) gives that coordinate, and its local shape and
first global offset must be what ``_compute_local_shape_and_global_offset`` says.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from reshard.intervals import (
    Interval,
    block_volume,
    contiguous_runs,
    index_list_size,
    intersect,
    normalize,
    overlap_segments,
    select,
)
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.placements import Partial, Replicate, Shard, StridedShard
from tests.strategies import (
    examples,
    index_array,
    index_lists,
    intervals,
    meshes,
    placements,
    shapes_and_boxes,
    tensor_shapes,
    torch_local,
    torch_placements,
)


@st.composite
def raw_layouts(draw: st.DrawFn, **kw: object) -> tuple[Mesh, tuple[int, ...], tuple[object, ...]]:
    """(mesh, shape, placements as drawn: negative dims kept)."""
    mesh = draw(meshes())
    shape = draw(tensor_shapes())
    pls = draw(placements(len(shape), mesh.ndim, **kw))
    return mesh, shape, pls


def gather(full: torch.Tensor, block: tuple) -> torch.Tensor:
    """``full`` at the Cartesian product of the block's index lists."""
    out = full
    for d, ilist in enumerate(block):
        out = out.index_select(d, torch.tensor(index_array(ilist), dtype=torch.long))
    return out


def _check_against_torch(mesh: Mesh, shape: tuple[int, ...], pls: tuple) -> None:
    lay = TensorLayout.make(shape, mesh, pls)
    tpls = torch_placements(pls, len(shape))
    full = torch.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    for coord in mesh.coordinates():
        want = torch_local(full, mesh.shape, coord, tpls)
        block = lay.block(coord)
        got = gather(full, block)
        where = f"shape={shape} mesh={mesh.shape} placements={[str(p) for p in pls]} coord={coord}"
        assert tuple(got.shape) == tuple(want.shape), where
        assert torch.equal(got, want), where
        assert lay.local_shape(coord) == tuple(want.shape), where
        t_shape, t_offset = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coord), tpls)
        assert lay.local_shape(coord) == tuple(t_shape), where
        for d, ilist in enumerate(block):
            if t_shape[d] > 0:
                assert ilist[0].start == t_offset[d], f"{where} dim {d}"


@settings(max_examples=examples(150))
@given(raw_layouts())
@example((Mesh(("tp",), (4,)), (10, 3), (Shard(0),)))
@example((Mesh(("tp",), (4,)), (3, 2), (Shard(0),)))  # fewer rows than ranks: empty shards
@example((Mesh(("tp",), (4,)), (12, 2), (StridedShard(0, 2),)))  # fused gate/up, uneven
@example((Mesh(("fsdp", "tp"), (2, 2)), (10, 4), (StridedShard(0, 2), Shard(0))))  # FSDP over TP
@example((Mesh(("a", "b", "c"), (2, 2, 2)), (11, 6), (Shard(0), Shard(0), Shard(1))))
@example((Mesh(("a", "b"), (3, 2)), (7, 5), (Shard(-1), StridedShard(-2, 3))))
@example((Mesh(("a", "b"), (2, 4)), (13,), (StridedShard(0, 3), StridedShard(0, 4))))
@example((Mesh(("a",), (4,)), (), (Partial("max"),)))
def test_blocks_select_what_torch_splitting_gives(case):
    mesh, shape, pls = case
    _check_against_torch(mesh, shape, pls)


@settings(max_examples=examples(100))
@given(raw_layouts())
def test_blocks_tile_the_tensor(case):
    """Every element is held by some rank; two ranks' blocks are identical or disjoint."""
    mesh, shape, pls = case
    lay = TensorLayout.make(shape, mesh, pls)
    n = int(np.prod(shape, dtype=np.int64))
    flat = np.arange(n).reshape(shape)
    distinct: dict[frozenset[int], int] = {}
    for r, blk in enumerate(lay.blocks()):
        sel = flat[np.ix_(*[np.array(index_array(il), dtype=np.int64) for il in blk])] if shape else flat
        elems = frozenset(np.asarray(sel).ravel().tolist())
        assert len(elems) == block_volume(blk) == np.asarray(sel).size, f"rank {r}"
        distinct.setdefault(elems, r)
    union = frozenset().union(*distinct)
    assert union == frozenset(range(n))
    # distinct sets that cover n elements with sizes summing to n are pairwise disjoint
    assert sum(len(s) for s in distinct if s) == n


@settings(max_examples=examples(100))
@given(raw_layouts())
def test_index_lists_are_ascending_disjoint_nonempty(case):
    mesh, shape, pls = case
    lay = TensorLayout.make(shape, mesh, pls)
    for blk in lay.blocks():
        assert len(blk) == len(shape)
        for d, ilist in enumerate(blk):
            for iv in ilist:
                assert 0 <= iv.start < iv.stop <= shape[d]
            for a, b in itertools.pairwise(ilist):
                assert a.stop < b.start  # normalized: adjacent runs are merged


@settings(max_examples=examples(100))
@given(raw_layouts())
def test_replicas_hold_equal_blocks(case):
    """Ranks whose coordinates differ only on Replicate / Partial mesh dims hold equal blocks."""
    mesh, shape, pls = case
    lay = TensorLayout.make(shape, mesh, pls)
    shard_dims = [m for m, p in enumerate(lay.placements) if isinstance(p, (Shard, StridedShard))]
    groups: dict[tuple[int, ...], set] = {}
    for coord in mesh.coordinates():
        key = tuple(coord[m] for m in shard_dims)
        groups.setdefault(key, set()).add(lay.block(coord))
    for key, blocks in groups.items():
        assert len(blocks) == 1, f"sub-coordinate {key}: {len(blocks)} different blocks"
    if all(isinstance(p, (Replicate, Partial)) for p in lay.placements):
        assert set(lay.blocks()) == {tuple(normalize([Interval(0, n)]) for n in shape)}


@settings(max_examples=examples(60))
@given(raw_layouts(allow_partial=False))
def test_negative_dims_mean_the_same_as_positive(case):
    mesh, shape, pls = case
    pos = tuple(
        type(p)(p.dim % len(shape), *([p.split_factor] if isinstance(p, StridedShard) else []))
        if isinstance(p, (Shard, StridedShard))
        else p
        for p in pls
    )
    assert TensorLayout.make(shape, mesh, pls).blocks() == TensorLayout.make(shape, mesh, pos).blocks()


# --- interval algebra --------------------------------------------------------------


def _set(iv: Interval) -> set[int]:
    return set(range(iv.start, iv.stop))


@given(intervals(), intervals())
def test_intersect_commutative_and_matches_sets(a, b):
    ab, ba = intersect(a, b), intersect(b, a)
    assert ab == ba
    assert _set(ab) == _set(a) & _set(b)


@given(intervals())
def test_intersect_idempotent(a):
    assert intersect(a, a) == a
    assert intersect(intersect(a, a), a) == a


@given(intervals(), st.integers(0, 24))
def test_intersect_empty_absorbs(a, s):
    e = Interval(s, s)
    assert intersect(a, e).size == 0
    assert intersect(e, a).size == 0


@given(intervals(), intervals(), intervals())
def test_intersect_associative(a, b, c):
    assert _set(intersect(intersect(a, b), c)) == _set(intersect(a, intersect(b, c)))


@settings(max_examples=examples(200))
@given(shapes_and_boxes())
def test_contiguous_runs_cover_the_box_in_order(sb):
    shape, box = sb
    n = int(np.prod(shape, dtype=np.int64))
    flat = np.arange(n).reshape(shape)
    want = flat[tuple(slice(iv.start, iv.stop) for iv in box)].ravel().tolist() if shape else [0]
    runs = list(contiguous_runs(shape, box))
    got = [i for off, size in runs for i in range(off, off + size)]
    assert got == want
    for off, size in runs:
        assert size > 0 and 0 <= off and off + size <= max(n, 1)
    for (o1, s1), (o2, _) in itertools.pairwise(runs):
        assert o1 + s1 < o2, "runs must be increasing and maximal (touching runs merged)"


@given(index_lists(), st.data())
def test_select_matches_brute_force(ilist, data):
    n = index_list_size(ilist)
    start = data.draw(st.integers(0, n + 2))
    stop = data.draw(st.integers(start, n + 3))
    got = select(ilist, start, stop)
    assert index_array(got) == index_array(ilist)[start:stop]
    assert got == normalize(got)
    assert all(iv.size > 0 for iv in got)


@given(index_lists(), index_lists())
def test_overlap_segments_match_brute_force(src, dst):
    src_idx = index_array(src)
    dst_idx = index_array(dst)
    where_src = {g: p for p, g in enumerate(src_idx)}
    want = [(where_src[g], q) for q, g in enumerate(dst_idx) if g in where_src]
    segs = overlap_segments(src, dst)
    got = [(s + k, d + k) for s, d, size in segs for k in range(size)]
    assert got == want
    assert all(size > 0 for _, _, size in segs)
    for (s1, d1, z1), (s2, d2, _) in itertools.pairwise(segs):
        assert s1 + z1 <= s2 and d1 + z1 <= d2, "segments in ascending order"
        assert not (s1 + z1 == s2 and d1 + z1 == d2), "segments contiguous on both sides are merged"


@given(index_lists())
def test_normalize_is_idempotent_and_keeps_indices(ilist):
    split = [Interval(i, i + 1) for i in index_array(ilist)]
    assert normalize(split) == ilist
    assert normalize(ilist) == ilist
