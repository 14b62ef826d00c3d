"""DTensor placements as pure index algebra: Replicate, Shard, StridedShard, Partial (and Owned).

Semantics are torch's, exactly (``torch.distributed.tensor.placement_types``):
a placement on a mesh dim of size ``n`` turns the index list a rank already
holds along one tensor dim into the sub-list it keeps at coordinate ``i``.
:class:`Owned` (whole-tensor assignment, for expert parallelism) is reshard's own: it has
no torch counterpart.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError
from .intervals import IndexList, Interval, index_list_size, normalize, select

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "Partial",
    "Owned",
    "owned",
    "REDUCE_OPS",
    "MAX_SPLIT_FACTOR",
    "chunk_interval",
    "parse_placement",
]

REDUCE_OPS = ("sum", "avg", "max", "min")

#: Largest split factor: it is a mesh dim size, so the bound is mesh.MAX_WORLD_SIZE
#: (not imported: placements sit below mesh). ``split`` loops over it.
MAX_SPLIT_FACTOR = 1 << 20


def chunk_interval(size: int, n: int, i: int) -> Interval:
    """Local positions of chunk ``i`` when ``size`` is split ``n`` ways (torch.chunk rule).

    Chunks are ``ceil(size / n)`` long; trailing chunks may be short or empty.

    >>> [chunk_interval(5, 4, i).size for i in range(4)]
    [2, 2, 1, 0]
    """
    c = -(-size // n)
    return Interval(min(i * c, size), min((i + 1) * c, size))


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank holds the full extent.

    >>> [(r, (r,), str(Replicate().split((Interval(0, 8),), 4, r)[0])) for r in range(4)]
    [(0, (0,), '[0:8)'), (1, (1,), '[0:8)'), (2, (2,), '[0:8)'), (3, (3,), '[0:8)')]
    """

    def split(self, ilist: IndexList, n: int, i: int) -> IndexList:
        return ilist

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    """``torch.chunk`` along tensor dim ``dim``: chunk = ceil(size/n), trailing may be empty.

    >>> [(r, (r,), [str(iv) for iv in Shard(0).split((Interval(0, 7),), 4, r)]) for r in range(4)]
    [(0, (0,), ['[0:2)']), (1, (1,), ['[2:4)']), (2, (2,), ['[4:6)']), (3, (3,), ['[6:7)'])]
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ConfigError(f"Shard dim must be an integer, got {self.dim!r}")

    def split(self, ilist: IndexList, n: int, i: int) -> IndexList:
        local = chunk_interval(index_list_size(ilist), n, i)
        return select(ilist, local.start, local.stop)

    def normalized(self, ndim: int) -> Shard:
        return Shard(_norm_dim(self.dim, ndim, self))

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard:
    """Split the current extent into ``split_factor`` chunks, chunk each ``n`` ways;
    a rank holds its piece of every chunk, concatenated (torch ``_StridedShard``).

    ``split_factor`` may be a mesh-dim name until :meth:`resolve` binds it.
    Not a :class:`Shard`, and never equal to one.

    >>> p = StridedShard(0, 2)
    >>> for r in range(4):
    ...     print(r, (r,), [str(iv) for iv in p.split((Interval(0, 8),), 4, r)])
    0 (0,) ['[0:1)', '[4:5)']
    1 (1,) ['[1:2)', '[5:6)']
    2 (2,) ['[2:3)', '[6:7)']
    3 (3,) ['[3:4)', '[7:8)']
    """

    dim: int
    split_factor: int | str

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ConfigError(f"StridedShard dim must be an integer, got {self.dim!r}")
        sf = self.split_factor
        if isinstance(sf, bool) or not isinstance(sf, (int, str)):
            raise ConfigError(f"StridedShard split_factor must be an int or a mesh dim name, got {sf!r}")
        if isinstance(sf, int) and not 1 <= sf <= MAX_SPLIT_FACTOR:
            shown = sf if sf < 10**15 else "a huge number"
            raise ConfigError(f"StridedShard split_factor must be from 1 to {MAX_SPLIT_FACTOR}, got {shown}")

    def resolve(self, mesh_sizes: Mapping[str, int]) -> StridedShard:
        if isinstance(self.split_factor, int):
            return self
        if self.split_factor not in mesh_sizes:
            raise ConfigError(
                f"{self}: split factor names mesh dim {self.split_factor!r}, "
                f"but the mesh has only {', '.join(mesh_sizes) or 'no dims'}"
            )
        return StridedShard(self.dim, mesh_sizes[self.split_factor])

    def split(self, ilist: IndexList, n: int, i: int) -> IndexList:
        sf = self.split_factor
        if not isinstance(sf, int):
            raise ConfigError(f"{self}: split factor {sf!r} is not bound to a mesh")
        size = index_list_size(ilist)
        out: list[Interval] = []
        for j in range(sf):
            first = chunk_interval(size, sf, j)
            second = chunk_interval(first.size, n, i)
            out.extend(select(ilist, first.start + second.start, first.start + second.stop))
        return normalize(out)

    def normalized(self, ndim: int) -> StridedShard:
        return StridedShard(_norm_dim(self.dim, ndim, self), self.split_factor)

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every rank holds a full-shape partial value; the tensor is their reduction.

    >>> [(r, (r,), str(Partial().split((Interval(0, 8),), 4, r)[0])) for r in range(4)]
    [(0, (0,), '[0:8)'), (1, (1,), '[0:8)'), (2, (2,), '[0:8)'), (3, (3,), '[0:8)')]
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ConfigError(
                f"Partial reduce op {self.reduce_op!r} is not supported (use one of {', '.join(REDUCE_OPS)})"
            )

    def split(self, ilist: IndexList, n: int, i: int) -> IndexList:
        return ilist

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


@dataclass(frozen=True, slots=True)
class Owned:
    """The whole tensor on the ranks at coordinate ``owner`` of this mesh dim, nothing on the others.

    Whole-tensor assignment: expert ``e``'s per-expert tensors held by the expert-parallel
    rank owning ``e`` (a layout's ``Own(expert)`` resolves to ``Own(owner)`` per tensor). The
    other ranks hold an empty extent along dim 0, and the per-rank writer leaves the
    tensor out of their files. Not a torch placement: ``load_dtensors`` gives the tensor to
    the owning ranks only, on the sub-mesh of the other dims.

    >>> [[str(iv) for iv in Owned(1).split((Interval(0, 8),), 4, r)] for r in range(3)]
    [[], ['[0:8)'], []]
    """

    owner: int

    def __post_init__(self) -> None:
        if isinstance(self.owner, bool) or not isinstance(self.owner, int) or self.owner < 0:
            raise ConfigError(f"Own owner must be a mesh coordinate (an integer >= 0), got {self.owner!r}")

    def split(self, ilist: IndexList, n: int, i: int) -> IndexList:
        if self.owner >= n:
            raise ConfigError(f"{self}: owner {self.owner} is not a coordinate of a mesh dim of size {n}")
        return ilist if i == self.owner else normalize([])

    def __str__(self) -> str:
        return f"Own({self.owner})"


Placement = Replicate | Shard | StridedShard | Partial | Owned


@functools.lru_cache(maxsize=4096)
def owned(owner: int) -> Owned:
    """``Owned(owner)``, one object per owner: the planner shares a layout's work between tensors
    by the identity of their placements (100k experts dealt to 8 ranks: 8 layouts, not 100k)."""
    return Owned(owner)


def _norm_dim(dim: int, ndim: int, p: object) -> int:
    if not -ndim <= dim < ndim:
        raise ConfigError(f"{p} does not fit a {ndim}-d tensor (dim out of range)")
    return dim + ndim if dim < 0 else dim


_CALL = re.compile(r"^\s*([A-Za-z_]+)\s*(?:\((.*)\))?\s*$", re.S)
# ASCII digits only (str.isdigit accepts '²', which int() refuses), at most 9 of them:
# no real dim or split factor is longer, and int() of thousands of digits is refused.
_INT = re.compile(r"[+-]?[0-9]{1,9}")

_NAMES = {
    "r": "R",
    "replicate": "R",
    "s": "S",
    "shard": "S",
    "_s": "SS",
    "ss": "SS",
    "stridedshard": "SS",
    "_stridedshard": "SS",
    "p": "P",
    "partial": "P",
    "own": "O",
    "owned": "O",
}


def _short(value: object) -> str:
    """A bounded repr for messages: a 1 MB placement string is not echoed back."""
    if isinstance(value, int) and abs(value) >= 10**15:
        return "a huge number"  # repr() of a > 4300-digit int raises
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(text: str, what: str, full: str) -> int:
    text = text.strip()
    if not _INT.fullmatch(text):
        raise ConfigError(
            f"placement {_short(full)}: {what} must be an integer of at most 9 digits, got {_short(text)}"
        )
    return int(text)


def parse_placement(text: object) -> Placement:
    """Parse one placement in any of the accepted text forms.

    >>> [str(parse_placement(t)) for t in ["R", "Shard(-1)", "_S(0, 2)", "StridedShard(1, sf=tp)", "P(avg)"]]
    ['R', 'S(-1)', '_S(0, 2)', '_S(1, tp)', 'P(avg)']
    """
    if isinstance(text, (Replicate, Shard, StridedShard, Partial, Owned)):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"placement must be a string such as R, S(0) or _S(0, 2), got {_short(text)}")
    m = _CALL.match(text)
    kind = _NAMES.get(m.group(1).lower()) if m else None
    if m is None or kind is None:
        raise ConfigError(
            f"unknown placement {_short(text)}: use R, S(d), _S(d, sf), P(sum) or their long forms "
            "Replicate(), Shard(d), _StridedShard(d, sf=N), Partial(sum)"
        )
    pos, kw = _arguments(m.group(2), text)
    return _BUILD[kind](pos, kw, text)


def _arguments(raw: str | None, text: str) -> tuple[list[str], dict[str, str]]:
    """Positional and keyword arguments of a placement call (``0, sf=tp``)."""
    args = [a.strip() for a in raw.split(",")] if raw and raw.strip() else []
    pos: list[str] = []
    kw: dict[str, str] = {}
    for a in args:
        k, eq, v = a.partition("=")
        if eq:
            kw[k.strip()] = v.strip()
        else:
            if kw:
                raise ConfigError(f"placement {_short(text)}: positional argument after keyword")
            pos.append(a)
    return pos, kw


def _arg(pos: list[str], kw: dict[str, str], *names: str) -> str | None:
    """Take an argument by any of its keyword names, else the next positional one."""
    for n in names:
        value = kw.pop(n, None)
        if value:
            return value
    return pos.pop(0) if pos else None


def _replicate(pos: list[str], kw: dict[str, str], text: str) -> Placement:
    if pos or kw:
        raise ConfigError(f"placement {_short(text)}: Replicate takes no arguments")
    return Replicate()


def _partial(pos: list[str], kw: dict[str, str], text: str) -> Placement:
    op = _arg(pos, kw, "reduce_op") or "sum"
    if pos or kw:
        raise ConfigError(f"placement {_short(text)}: Partial takes one reduce op (sum, avg, max, min)")
    return Partial(op.strip("'\""))


def _dim(pos: list[str], kw: dict[str, str], text: str) -> int:
    dim_text = _arg(pos, kw, "dim")
    if dim_text is None:
        raise ConfigError(f"placement {_short(text)}: missing the tensor dim, e.g. S(0)")
    return _int(dim_text, "the dim", text)


def _shard(pos: list[str], kw: dict[str, str], text: str) -> Placement:
    dim = _dim(pos, kw, text)
    if pos or kw:
        raise ConfigError(f"placement {_short(text)}: Shard takes one dim")
    return Shard(dim)


def _strided(pos: list[str], kw: dict[str, str], text: str) -> Placement:
    dim = _dim(pos, kw, text)
    sf_text = _arg(pos, kw, "sf", "split_factor")
    if sf_text is None:
        raise ConfigError(
            f"placement {_short(text)}: missing the split factor, e.g. _S(0, 2) or _S(0, sf=tp)"
        )
    if pos or kw:
        raise ConfigError(f"placement {_short(text)}: StridedShard takes a dim and a split factor")
    sf_text = sf_text.strip("'\"")
    sf: int | str = _int(sf_text, "the split factor", text) if sf_text[:1] in "+-0123456789" else sf_text
    return StridedShard(dim, sf)


def _owned(pos: list[str], kw: dict[str, str], text: str) -> Placement:
    owner = _arg(pos, kw, "owner")
    if owner is None or pos or kw:
        raise ConfigError(f"placement {_short(text)}: Own takes one owner coordinate, e.g. Own(3)")
    if not _INT.fullmatch(owner):
        raise ConfigError(
            f"placement {_short(text)}: Own(NAME) (the owner by a number the pattern captures) goes in "
            "a layout rule's {dim: Own(NAME)} mapping; as a placement, Own takes a mesh coordinate: Own(3)"
        )
    return owned(_int(owner, "the owner", text))


_BUILD = {"R": _replicate, "P": _partial, "S": _shard, "SS": _strided, "O": _owned}
