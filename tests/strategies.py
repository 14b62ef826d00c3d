"""Hypothesis strategies for reshard's property tests, shrinking toward small cases.

Meshes have 1-4 dims of size 1-4 (at most ``max_ranks`` ranks); tensor dims are
drawn from small sizes including 0 and primes; placements are reshard's own
values (one per mesh dim), valid for the shape: no shard of a 0-d tensor, one
Partial reduce op per layout (torch refuses mixed ops too).

Also the *torch oracle* helpers used by the property and gloo tests: the local
tensor torch's own placement splitting gives a coordinate. torch is imported
lazily, so importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from reshard.intervals import Box, IndexList, Interval, normalize
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.placements import REDUCE_OPS, Partial, Placement, Replicate, Shard, StridedShard

__all__ = [
    "DIM_SIZES",
    "mesh_shapes",
    "meshes",
    "dim_sizes",
    "tensor_shapes",
    "placements",
    "layouts",
    "layouts_on",
    "intervals",
    "index_lists",
    "boxes",
    "shapes_and_boxes",
    "numel",
    "index_array",
    "torch_placement",
    "torch_placements",
    "torch_local",
    "same_bits",
    "examples",
]

DIM_SIZES = (0, 1, 2, 3, 5, 7, 8, 11, 13, 16)
"""Tensor dim sizes: 0, 1, primes and a few powers of two (first ones shrink best)."""


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@st.composite
def mesh_shapes(
    draw: st.DrawFn, *, min_dims: int = 1, max_dims: int = 4, max_ranks: int = 16
) -> tuple[int, ...]:
    """Mesh shapes of ``min_dims..max_dims`` dims, sizes 1-4, at most ``max_ranks`` ranks."""
    ndim = draw(st.integers(min_dims, max_dims))
    budget = max_ranks
    out = []
    for _ in range(ndim):
        s = draw(st.integers(1, max(1, min(4, budget))))
        budget //= s
        out.append(s)
    return tuple(out)


@st.composite
def meshes(draw: st.DrawFn, **kw: Any) -> Mesh:
    """Meshes with dims named ``d0, d1, ...`` (see :func:`mesh_shapes` for the options)."""
    shape = draw(mesh_shapes(**kw))
    return Mesh(tuple(f"d{i}" for i in range(len(shape))), shape)


def dim_sizes() -> st.SearchStrategy[int]:
    return st.sampled_from(DIM_SIZES)


def tensor_shapes(
    *, min_dims: int = 0, max_dims: int = 4, max_numel: int = 4096
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes of ``min_dims..max_dims`` dims with at most ``max_numel`` elements."""
    return (
        st.lists(dim_sizes(), min_size=min_dims, max_size=max_dims)
        .map(tuple)
        .filter(lambda s: numel(s) <= max_numel)
    )


@st.composite
def placements(
    draw: st.DrawFn,
    ndim: int,
    mesh_ndim: int,
    *,
    allow_partial: bool = True,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    negative_dims: bool = True,
    max_split_factor: int = 4,
) -> tuple[Placement, ...]:
    """One placement per mesh dim, valid for an ``ndim``-d tensor.

    Shard / StridedShard dims may be negative (counting from the end); a 0-d
    tensor only gets Replicate / Partial. All Partials of one layout share a reduce op.
    """
    op = draw(st.sampled_from(tuple(reduce_ops))) if allow_partial else "sum"
    lo = -ndim if negative_dims else 0
    options: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if ndim > 0:
        dims = st.integers(lo, ndim - 1)
        options.append(st.builds(Shard, dims))
        options.append(st.builds(StridedShard, dims, st.integers(1, max_split_factor)))
    if allow_partial:
        options.append(st.just(Partial(op)))
    one = st.one_of(*options)
    return tuple(draw(one) for _ in range(mesh_ndim))


@st.composite
def layouts_on(draw: st.DrawFn, mesh: Mesh, *, shape: Sequence[int] | None = None, **kw: Any) -> TensorLayout:
    """A random layout of a random (or the given) shape on ``mesh``.

    Keyword options go to :func:`placements`, except ``min_dims``/``max_dims``/``max_numel``
    which go to :func:`tensor_shapes`.
    """
    shape_kw = {k: kw.pop(k) for k in ("min_dims", "max_dims", "max_numel") if k in kw}
    shp = tuple(shape) if shape is not None else draw(tensor_shapes(**shape_kw))
    pls = draw(placements(len(shp), mesh.ndim, **kw))
    return TensorLayout.make(shp, mesh, pls)


@st.composite
def layouts(draw: st.DrawFn, *, mesh_kw: dict[str, Any] | None = None, **kw: Any) -> TensorLayout:
    """A random mesh, shape and placements as a :class:`TensorLayout`.

    ``layout.placements`` holds normalized dims; the placements as drawn (with
    possibly negative dims) are not kept. Use :func:`placements` directly when
    the raw placements matter.
    """
    mesh = draw(meshes(**(mesh_kw or {})))
    return draw(layouts_on(mesh, **kw))


# --- interval algebra --------------------------------------------------------------


def intervals(max_stop: int = 24) -> st.SearchStrategy[Interval]:
    """Intervals inside ``[0, max_stop]``, empty ones included."""
    return st.tuples(st.integers(0, max_stop), st.integers(0, max_stop)).map(
        lambda t: Interval(min(t), max(t))
    )


def index_lists(max_stop: int = 24) -> st.SearchStrategy[IndexList]:
    """Ascending, disjoint, non-empty, non-adjacent intervals inside ``[0, max_stop)``."""

    def build(points: list[int]) -> IndexList:
        pts = sorted(points)
        ivs = [Interval(pts[i], pts[i + 1]) for i in range(0, len(pts) - 1, 2)]
        return normalize(ivs)

    return st.lists(st.integers(0, max_stop), unique=True, max_size=10).map(build)


@st.composite
def boxes(draw: st.DrawFn, shape: Sequence[int]) -> Box:
    """A box (one interval per dim) inside ``shape``; may be empty."""
    out = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(0, n))
        out.append(Interval(min(a, b), max(a, b)))
    return tuple(out)


@st.composite
def shapes_and_boxes(
    draw: st.DrawFn, *, max_dims: int = 4, max_numel: int = 4096
) -> tuple[tuple[int, ...], Box]:
    shape = draw(tensor_shapes(max_dims=max_dims, max_numel=max_numel))
    return shape, draw(boxes(shape))


def index_array(ilist: IndexList) -> list[int]:
    """The global indices of an index list, in local order."""
    return [i for iv in ilist for i in range(iv.start, iv.stop)]


# --- the torch oracle --------------------------------------------------------------


def torch_placement(p: Placement, ndim: int) -> Any:
    """The torch placement object for a reshard placement (dims normalized, as
    ``distribute_tensor`` normalizes them)."""
    from torch.distributed.tensor.placement_types import Partial as TPartial
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, Replicate):
        return TReplicate()
    if isinstance(p, Partial):
        return TPartial(p.reduce_op)
    d = p.dim + ndim if p.dim < 0 else p.dim
    if isinstance(p, StridedShard):
        assert isinstance(p.split_factor, int)
        return _StridedShard(d, split_factor=p.split_factor)
    return TShard(d)


def torch_placements(pls: Sequence[Placement], ndim: int) -> list[Any]:
    return [torch_placement(p, ndim) for p in pls]


def torch_local(full: Any, mesh_shape: Sequence[int], coord: Sequence[int], pls: Sequence[Any]) -> Any:
    """The local tensor torch's own placement splitting gives ``coord``.

    ``pls`` are torch placements; they apply left to right on the local tensor,
    each Shard / _StridedShard keeping chunk ``coord[m]`` of
    ``_split_tensor(local, mesh_shape[m], with_padding=False)``.
    """
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    local = full
    for m, p in enumerate(pls):
        if isinstance(p, (TShard, _StridedShard)):
            local = p._split_tensor(local, mesh_shape[m], with_padding=False)[0][coord[m]]
    return local


def examples(n: int) -> int:
    """``n`` examples under the ``dev``/``ci`` profiles (100 examples), scaled up with
    the loaded profile's ``max_examples`` (``nightly``: 20x)."""
    from hypothesis import settings

    return max(1, n * settings.default.max_examples // 100)


def same_bits(a: Any, b: Any) -> bool:
    """Two torch tensors with the same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    import torch

    return (
        a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and bool(
            torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8),
                b.contiguous().reshape(-1).view(torch.uint8),
            )
        )
    )
