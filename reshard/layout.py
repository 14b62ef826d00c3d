"""A tensor's layout on a mesh: global shape + placements -> the block each rank holds (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .errors import LayoutError, ReshardError
from .intervals import Block, IndexList, Interval, block_shape, normalize
from .mesh import Mesh
from .placements import Owned, Partial, Placement, Shard, StridedShard, parse_placement

__all__ = ["TensorLayout", "layout_blocks", "infer_global_shape"]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Global shape, mesh and placements (one per mesh dim, normalized dims).

    Placements apply left to right on the index list each rank already holds,
    as torch's ``compute_local_shape_and_global_offset`` and ``distribute_tensor`` do.

    >>> lay = TensorLayout.make((7, 4), Mesh(("tp",), (4,)), ["S(0)"])
    >>> [lay.local_shape(c) for c in lay.mesh.coordinates()]
    [(2, 4), (2, 4), (2, 4), (1, 4)]
    """

    shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"{len(self.placements)} placements for a {self.mesh.ndim}-d mesh ({self.mesh})"
            )
        ndim = len(self.shape)
        ops = set()
        for p, size in zip(self.placements, self.mesh.shape):
            if isinstance(p, Owned) and (ndim == 0 or p.owner >= size):
                why = (
                    "a 0-d tensor (scalar) has no extent to leave empty"
                    if ndim == 0
                    else (f"the mesh dim has {size} coordinates")
                )
                raise LayoutError(f"{p} does not fit: {why}")
            if isinstance(p, (Shard, StridedShard)):
                if not 0 <= p.dim < ndim:
                    raise LayoutError(f"{p} does not fit a {ndim}-d tensor of shape {list(self.shape)}")
                if isinstance(p, StridedShard) and not isinstance(p.split_factor, int):
                    raise LayoutError(f"{p}: split factor is not bound to a mesh size")
            if isinstance(p, Partial):
                ops.add(p.reduce_op)
        if len(ops) > 1:
            raise LayoutError(
                f"mixed Partial reduce ops {sorted(ops)} are not supported (torch refuses them too)"
            )

    @classmethod
    def make(cls, shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement | str]) -> TensorLayout:
        """Build a layout, parsing text placements, resolving named split factors and negative dims."""
        sizes = dict(zip(mesh.names, mesh.shape))
        ndim = len(shape)
        out: list[Placement] = []
        for p in placements:
            q = parse_placement(p)
            if isinstance(q, StridedShard):
                q = q.resolve(sizes)
            if isinstance(q, (Shard, StridedShard)):
                if ndim == 0:
                    raise LayoutError(f"{q} cannot shard a 0-d tensor (scalar); use R")
                q = q.normalized(ndim)
            out.append(q)
        return cls(tuple(int(s) for s in shape), mesh, tuple(out))

    @classmethod
    def for_tensor(
        cls, name: str, shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement | str]
    ) -> TensorLayout:
        """:meth:`make` for a named tensor: a placement that does not fit says which tensor.

        Raises:
            LayoutError: naming the tensor and its shape.
        """
        try:
            return cls.make(shape, mesh, placements)
        except ReshardError as e:
            raise LayoutError(
                f'tensor "{name}" of shape {list(shape)}: {e.message}',
                tensor=name,
                path=e.path,
                hint=e.hint,
            ) from None

    @property
    def partial_op(self) -> str | None:
        for p in self.placements:
            if isinstance(p, Partial):
                return p.reduce_op
        return None

    def block(self, coordinate: Sequence[int]) -> Block:
        """Per tensor dim, the ascending global intervals the rank at ``coordinate`` holds."""
        return layout_blocks(self.shape, self.mesh.shape, self.placements)[self.mesh.rank(coordinate)]

    def local_shape(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        return block_shape(self.block(coordinate))

    def blocks(self) -> tuple[Block, ...]:
        """Blocks of every rank, indexed by global rank."""
        return layout_blocks(self.shape, self.mesh.shape, self.placements)

    def partial_index(self, coordinate: Sequence[int]) -> int:
        """Row-major index of the coordinate restricted to the Partial mesh dims (0 if none)."""
        idx = 0
        for p, c, s in zip(self.placements, coordinate, self.mesh.shape):
            if isinstance(p, Partial):
                idx = idx * s + c
        return idx

    def placement_strs(self) -> list[str]:
        return [str(p) for p in self.placements]

    @property
    def assigned(self) -> bool:
        """Whether some mesh dim holds the tensor on one coordinate only (:class:`Owned`)."""
        return any(isinstance(p, Owned) for p in self.placements)

    def holds(self, coordinate: Sequence[int]) -> bool:
        """Whether the rank at ``coordinate`` holds the tensor at all (False off its ``Own`` owner).

        A rank left an empty chunk by ``Shard`` still holds the tensor (a 0-size entry, as torch
        saves it); a rank that an ``Own`` placement leaves out has no entry for it.
        """
        return all(not isinstance(p, Owned) or c == p.owner for p, c in zip(self.placements, coordinate))


@lru_cache(maxsize=4096)
def layout_blocks(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[Block, ...]:
    """Blocks of all ranks of a mesh (cached: many tensors share a signature)."""
    # Along each tensor dim, the index list depends only on the coordinates of
    # the mesh dims sharding that dim: compute those once per distinct sub-coordinate.
    ndim = len(shape)
    full: list[IndexList] = [normalize([Interval(0, n)]) for n in shape]
    sharding: list[list[int]] = [[] for _ in range(ndim)]
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            sharding[p.dim].append(m)
        elif isinstance(p, Owned):  # whole or nothing: non-owners hold an empty dim 0
            sharding[0].append(m)
    per_dim: list[dict[tuple[int, ...], IndexList]] = []
    for d in range(ndim):
        table: dict[tuple[int, ...], IndexList] = {(): full[d]}
        for m in sharding[d]:
            p = placements[m]
            n = mesh_shape[m]
            table = {sub + (c,): p.split(ilist, n, c) for sub, ilist in table.items() for c in range(n)}
        per_dim.append(table)
    world = 1
    for s in mesh_shape:
        world *= s
    out: list[Block] = []
    for r in range(world):
        coord = []
        rr = r
        for s in reversed(mesh_shape):
            coord.append(rr % s)
            rr //= s
        coord.reverse()
        out.append(tuple(per_dim[d][tuple(coord[m] for m in sharding[d])] for d in range(ndim)))
    return tuple(out)


def infer_global_shape(
    local_shapes: Sequence[Sequence[int]], mesh: Mesh, placements: Sequence[Placement | str]
) -> tuple[int, ...] | None:
    """Global shape that gives exactly these per-rank local shapes, or None.

    Along each tensor dim the candidate is found from the ranks' local sizes
    (sum over the sharding mesh dims at coordinate 0 elsewhere), then checked
    by recomputing every rank's local shape.
    """
    if not local_shapes:
        return None
    ndim = len(local_shapes[0])
    parsed = [parse_placement(p) for p in placements]
    cand: list[int] = []
    for d in range(ndim):
        mdims = [
            m
            for m, p in enumerate(parsed)
            if (isinstance(p, (Shard, StridedShard)) and (p.dim % ndim if ndim else 0) == d)
            or (isinstance(p, Owned) and d == 0)
        ]
        if not mdims:
            cand.append(local_shapes[0][d])
            continue
        total = 0
        for r, coord in enumerate(mesh.coordinates()):
            if all(coord[m] == 0 for m in range(mesh.ndim) if m not in mdims):
                total += local_shapes[r][d]
        cand.append(total)
    shape = tuple(cand)
    try:
        lay = TensorLayout.make(shape, mesh, parsed)
    except LayoutError:
        return None
    for r, coord in enumerate(mesh.coordinates()):
        if lay.local_shape(coord) != tuple(local_shapes[r]):
            return None
    return shape
