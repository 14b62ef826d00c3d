"""Device meshes: ordered named dims, row-major rank numbering (pure)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["MAX_WORLD_SIZE", "Mesh", "check_world_size", "parse_mesh_spec"]

#: Most ranks a mesh (and each of its dims) may have. Plans, layouts and rank lists
#: are sized by the world, so a typo such as ``tp=1000000000`` or a rank file named
#: ``rank-99999999999-of-...`` must stop here, before anything is allocated.
#: The largest real jobs are ~10^5 ranks.
MAX_WORLD_SIZE = 1 << 20

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DIGITS = re.compile(r"[0-9]+")


def _size_text(n: int) -> str:
    """``n`` for a message; huge ints as their magnitude (``str()`` refuses > 4300 digits)."""
    return str(n) if n < 10**15 else f"about 10^{int(n.bit_length() * 0.30103)}"


def check_world_size(world: int, *, what: str = "the mesh") -> None:
    """Refuse a rank count over :data:`MAX_WORLD_SIZE` before anything is sized by it.

    Raises:
        ConfigError: ``world`` is over the limit; the message starts with ``what``.

    >>> check_world_size(8)
    >>> check_world_size(99999999999, what="rank-99999999999-of-1.safetensors")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    reshard.errors.ConfigError: rank-...: 99999999999 ranks is over the limit of 1048576 ranks (...); ...
    """
    if world > MAX_WORLD_SIZE:
        raise ConfigError(
            f"{what}: {_size_text(world)} ranks is over the limit of {MAX_WORLD_SIZE} ranks "
            "(MAX_WORLD_SIZE); check the mesh sizes"
        )


@dataclass(frozen=True, slots=True)
class Mesh:
    """An ordered list of named mesh dims, outermost first.

    Global rank is the row-major index of the coordinate, as in
    ``DeviceMesh(torch.arange(world).reshape(shape))``.

    >>> m = Mesh(("fsdp", "tp"), (2, 4))
    >>> m.size, m.coordinate(6), m.rank((1, 2))
    (8, (1, 2), 6)
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shape):
            raise ConfigError(f"mesh has {len(self.names)} names but {len(self.shape)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"mesh dim names must be unique, got {list(self.names)}")
        for n, s in zip(self.names, self.shape):
            if not _NAME.match(n):
                raise ConfigError(f"mesh dim name {n!r} is not an identifier")
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ConfigError(f"mesh dim {n!r} must have a size >= 1, got {_short(s)}")
        check_world_size(self.size, what=f"mesh {self}")

    @classmethod
    def single(cls) -> Mesh:
        """A one-rank mesh (consolidated checkpoints)."""
        return cls(("world",), (1,))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range for mesh of {self.size}")
        coord = []
        for s in reversed(self.shape):
            coord.append(rank % s)
            rank //= s
        return tuple(reversed(coord))

    def rank(self, coordinate: Sequence[int]) -> int:
        r = 0
        for c, s in zip(coordinate, self.shape):
            if not 0 <= c < s:
                raise ValueError(f"coordinate {tuple(coordinate)} outside mesh {self.shape}")
            r = r * s + c
        return r

    def coordinates(self) -> Iterator[tuple[int, ...]]:
        for r in range(self.size):
            yield self.coordinate(r)

    def with_sizes(self, sizes: Mapping[str, int]) -> Mesh:
        """This mesh overridden by ``sizes`` (``--source-mesh`` and ``--target-mesh`` alike).

        One rule for both options, so the same text gives the same rank numbering
        whether it describes the source or the target:

        - a dim ``sizes`` does not name keeps its size and its position;
        - the positions of the dims it names are refilled with them in the order
          written in ``sizes``, with their new sizes;
        - a dim new to this mesh goes just before the next dim of this mesh written
          after it in ``sizes`` (just after the last one if none follows); if
          ``sizes`` names no dim of this mesh, its dims are appended innermost.

        So ``sizes`` naming every dim gives exactly its written order.

        >>> str(Mesh(("tp", "fsdp"), (4, 2)).with_sizes({"fsdp": 2, "tp": 4}))
        'fsdp=2,tp=4'
        >>> str(Mesh(("fsdp", "tp"), (2, 4)).with_sizes({"tp": 8}))
        'fsdp=2,tp=8'
        >>> str(Mesh(("pp", "tp"), (2, 4)).with_sizes({"fsdp": 2, "tp": 4}))
        'pp=2,fsdp=2,tp=4'
        >>> str(Mesh(("tp",), (4,)).with_sizes({"ep": 2}))
        'tp=4,ep=2'
        """
        groups: list[list[str]] = [[]]  # each named dim of this mesh, with the new dims before it
        for name in sizes:
            groups[-1].append(name)
            if name in self.names:
                groups.append([])
        tail = groups.pop()
        if groups:
            groups[-1].extend(tail)
        refill = iter(groups)
        names: list[str] = []
        for name in self.names:
            names.extend(next(refill) if name in sizes else (name,))
        if not groups:
            names.extend(tail)
        own = dict(zip(self.names, self.shape, strict=True))
        return Mesh(tuple(names), tuple(sizes[n] if n in sizes else own[n] for n in names))

    def to_json(self) -> dict[str, list[object]]:
        return {"names": list(self.names), "shape": list(self.shape)}

    def __str__(self) -> str:
        return ",".join(f"{n}={_size_text(s)}" for n, s in zip(self.names, self.shape))


def _short(value: object) -> str:
    """A bounded repr of a bad value for a message."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _size_text(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_mesh_spec(text: str, *, option: str = "--mesh") -> dict[str, int]:
    """Parse ``"fsdp=2,tp=4"`` into an ordered ``{name: size}``.

    >>> parse_mesh_spec("fsdp=2, tp=4")
    {'fsdp': 2, 'tp': 4}
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not _NAME.match(name) or not _DIGITS.fullmatch(size):
            raise ConfigError(
                f"{option} {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. tp=8 or fsdp=2,tp=4"
            )
        if name in out:
            raise ConfigError(f"{option} {text!r}: dim {name!r} given twice")
        # Length first: int() of thousands of digits is slow, or refused past 4300.
        value = int(size) if len(size) <= 16 else MAX_WORLD_SIZE + 1
        if value < 1:
            raise ConfigError(f"{option} {text!r}: size of {name!r} must be >= 1")
        if value > MAX_WORLD_SIZE:
            given = str(value) if len(size) <= 16 else f"a {len(size)}-digit number"
            raise ConfigError(
                f"{option}: size of {name!r} is {given}, over the limit of {MAX_WORLD_SIZE} ranks "
                "(MAX_WORLD_SIZE); check the mesh sizes"
            )
        out[name] = value
    if not out:
        raise ConfigError(f"{option} {text!r}: empty mesh")
    return out
