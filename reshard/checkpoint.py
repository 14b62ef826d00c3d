"""What a checkpoint holds, whatever its format: tensors as pieces in files (pure).

Every reader (:mod:`reshard.formats`) produces a :class:`Checkpoint`; everything
downstream (plan, convert, verify, ``inspect --check``, ``load_dtensors``) works
on it alone.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from .intervals import Block, block_shape, block_volume
from .mesh import Mesh
from .placements import Placement

if TYPE_CHECKING:
    from .config import LayoutConfig

__all__ = [
    "Signature",
    "TensorSource",
    "tensor_source",
    "FewOffsets",
    "few_offsets",
    "offset_columns",
    "ColumnSlice",
    "Crc32Slice",
    "NonTensor",
    "stored_objects",
    "CheckpointWarning",
    "Spooled",
    "Checkpoint",
]

Signature = tuple[Hashable, ...]
"""Identifies a tensor's piece geometry: equal signatures, equal piece blocks (any hashable
values a reader chooses, e.g. ``("layout", shape, mesh_shape, placements)``)."""


_V = TypeVar("_V")


class _AsTuple(Sequence[_V]):
    """A sequence that stands for the tuple of its items: equal, hashing and shown as that tuple."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class FewOffsets(_AsTuple[int]):
    """A tensor's piece offsets when its many pieces lie at a few distinct offsets: piece ``k``
    is at ``values[picks[k]]``. ``picks`` is one tuple for every tensor of the files (the rank
    files of one header length and entry section put each tensor at one offset), so a tensor
    holds its distinct offsets alone: 64 rank files of 100k tensors held 64 ints per tensor,
    57 MiB of tuples. Equal (and hashing equal) to the tuple of its offsets.

    >>> o = FewOffsets((8, 24), (0, 0, 1))
    >>> o[2], list(o), o == (8, 8, 24), len(o), o[1:]
    (24, [8, 8, 24], True, 3, (8, 24))
    """

    __slots__ = ("values", "picks")

    def __init__(self, values: tuple[int, ...], picks: tuple[int, ...]) -> None:
        self.values = values
        self.picks = picks

    @overload
    def __getitem__(self, k: int) -> int: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[int, ...]: ...
    def __getitem__(self, k: int | slice) -> int | tuple[int, ...]:
        if isinstance(k, slice):
            return tuple(map(self.values.__getitem__, self.picks[k]))
        return self.values[self.picks[k]]

    def __len__(self) -> int:
        return len(self.picks)

    def __iter__(self) -> Iterator[int]:
        return map(self.values.__getitem__, self.picks)


FEW_OFFSETS_MIN = 16
"""Pieces from which :func:`few_offsets` gives a :class:`FewOffsets`: below, a tuple of the
offsets is as small (and indexed without a Python call)."""


def few_offsets(values: tuple[int, ...], picks: tuple[int, ...]) -> Sequence[int]:
    """The offsets ``values[picks[k]]`` for a reader's :attr:`TensorSource.piece_offsets`: a
    :class:`FewOffsets` (``picks`` shared by the caller's tensors) for many pieces, else a tuple."""
    if len(picks) >= FEW_OFFSETS_MIN:
        return FewOffsets(values, picks)
    if len(values) == 1:
        return values * len(picks)
    return tuple(map(values.__getitem__, picks))


class _Window(_AsTuple[_V]):
    """Items ``start`` to ``stop`` of an integer ``column`` a reader shares between its tensors."""

    __slots__ = ("column", "start", "stop")

    def __init__(self, column: Sequence[int], start: int, stop: int) -> None:
        self.column = column
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _at(self, k: int) -> int:
        """The column's item at index ``k`` of the window (negative: from its end)."""
        n = self.stop - self.start
        if not -n <= k < n:
            raise IndexError(k)
        return self.column[self.start + k if k >= 0 else self.stop + k]


class ColumnSlice(_Window[int]):
    """Items ``column[start:stop]`` of an integer column (an ``array``) a reader shares between
    its tensors: a tensor's piece offsets as one small object, not a tuple of ints. A TP-8 DCP
    checkpoint of 200k tensors has 1.6M pieces: their offsets and CRC32s as tuples took 1.1 KiB
    a tensor (an int object a piece each), as slices 0.1 KiB plus 8 bytes a piece in the column.
    Equal (and hashing equal) to the tuple of its items.

    >>> from array import array
    >>> c = ColumnSlice(array("q", [5, 8, 24, 40]), 1, 3)
    >>> c[1], c[-1], list(c), c == (8, 24), len(c), c[:1], tuple(reversed(c))
    (24, 24, [8, 24], True, 2, (8,), (24, 8))
    """

    __slots__ = ()

    @overload
    def __getitem__(self, k: int) -> int: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[int, ...]: ...
    def __getitem__(self, k: int | slice) -> int | tuple[int, ...]:
        if isinstance(k, slice):
            return tuple(self)[k]
        return self._at(k)

    def __iter__(self) -> Iterator[int]:
        return iter(self.column[self.start : self.stop])


class Crc32Slice(_Window["int | None"]):
    """A tensor's piece CRC32s as a :class:`ColumnSlice` does it: ``column[start:stop]``, a
    negative item meaning the piece has none (None). Equal (and hashing equal) to the tuple
    of its items.

    >>> from array import array
    >>> c = Crc32Slice(array("q", [7, -1, 3]), 0, 3)
    >>> c[1], c[2], list(c), c == (7, None, 3), len(c)
    (None, 3, [7, None, 3], True, 3)
    """

    __slots__ = ()

    @overload
    def __getitem__(self, k: int) -> int | None: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[int | None, ...]: ...
    def __getitem__(self, k: int | slice) -> int | None | tuple[int | None, ...]:
        if isinstance(k, slice):
            return tuple(self)[k]
        v = self._at(k)
        return None if v < 0 else v

    def __iter__(self) -> Iterator[int | None]:
        items = self.column[self.start : self.stop]
        if min(items, default=0) >= 0:
            return iter(items)
        return iter([None if v < 0 else v for v in items])


def offset_columns(offsets: Sequence[Sequence[int]], pieces: int) -> tuple[Any, Sequence[int]]:
    """The piece offsets of tensors with ``pieces`` pieces each, as an int64 array ``values`` and
    per piece a column ``picks[k]`` of it: tensor ``i``'s piece ``k`` is at
    ``values[i, picks[k]]``. Tensors whose :class:`FewOffsets` share their picks give their few
    columns (64 ranks: 1-3 columns, not 64); other offsets give one column per piece.

    >>> v, p = offset_columns([FewOffsets((8, 24), pk := (0, 0, 1)), FewOffsets((9, 25), pk)], 3)
    >>> v.tolist(), p
    ([[8, 24], [9, 25]], (0, 0, 1))
    >>> col = array("I", [5, 7, 9, 11])
    >>> v, p = offset_columns([ColumnSlice(col, 2, 4), ColumnSlice(col, 0, 2)], 2)
    >>> v.tolist(), list(p), v.dtype.name
    ([[9, 11], [5, 7]], [0, 1], 'int64')
    >>> v, p = offset_columns([(1, 2), (3, 4)], 2)
    >>> v.tolist(), list(p)
    ([[1, 2], [3, 4]], [0, 1])
    """
    import numpy as np  # lazy: the pure core loads without numpy

    first = offsets[0] if len(offsets) else None
    if type(first) is ColumnSlice:
        column = first.column
        dtype = _COLUMN_TYPES.get(column.typecode) if isinstance(column, array) else None
        if (
            isinstance(column, array)
            and dtype is not None
            and all(type(o) is ColumnSlice and o.column is column and len(o) == pieces for o in offsets)
        ):  # slices of one column (the DCP reader's): gathered from it, not item by item
            starts = np.fromiter(map(_START, offsets), np.int64, count=len(offsets))
            if not pieces or not len(column):
                return np.zeros((len(offsets), pieces), np.int64), range(pieces)
            # each tensor's window of the column (no array of every item's index)
            windows = np.lib.stride_tricks.sliding_window_view(np.frombuffer(column, dtype), pieces)
            return windows[starts].astype(np.int64, copy=False), range(pieces)
    if isinstance(first, FewOffsets):
        picks = first.picks
        g = len(first.values)
        if all(type(o) is FewOffsets and o.picks is picks and len(o.values) == g for o in offsets):
            values = chain.from_iterable(map(_VALUES, offsets))
            return np.fromiter(values, np.int64, count=len(offsets) * g).reshape(len(offsets), g), picks
    flat = np.fromiter(chain.from_iterable(offsets), np.int64, count=len(offsets) * pieces)
    return flat.reshape(len(offsets), pieces), range(pieces)


_VALUES = attrgetter("values")
_START = attrgetter("start")
_COLUMN_TYPES = {"q": "<i8", "I": "<u4"} if array("I").itemsize == 4 else {"q": "<i8"}
"""Columns :func:`offset_columns` reads as numpy arrays: their typecode's numpy type."""


@dataclass(frozen=True, slots=True)
class TensorSource:
    """One logical tensor and where its pieces lie.

    Piece ``k`` is the row-major local tensor ``piece_blocks[k]`` stored at
    absolute byte offset ``piece_offsets[k]`` of file ``piece_files[k]``.
    Pieces with equal blocks and equal ``piece_partials`` are replicas;
    pieces in different partial groups are reduced with ``reduce_op``.

    ``signature`` identifies the piece geometry (same signature, same blocks)
    so the planner can reuse work across tensors of the same shape and layout.
    ``piece_crc32`` holds, when the format records them, the CRC32 of each piece's
    stored bytes (None for a piece without one); ``inspect --check`` verifies them.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    piece_files: tuple[int, ...]
    piece_offsets: Sequence[int]
    piece_blocks: tuple[Block, ...]
    signature: Signature
    piece_partials: tuple[int, ...] | None = None
    reduce_op: str | None = None
    placements: tuple[Placement, ...] | None = None
    piece_crc32: Sequence[int | None] | None = None

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


class _Unfrozen:
    """:class:`TensorSource`'s slots, set by plain assignment; then the object becomes a
    TensorSource: what :func:`tensor_source` is at run time (called directly, no function in
    between: 100k tensors, 10-20 ms). ``__class__`` may change between classes of the same slots
    and base: the object's memory is already a TensorSource's.

    ``TensorSource(...)`` (the same frozen value) in a fifth of the time, for readers making
    one per tensor: a frozen dataclass sets each field through ``object.__setattr__``, 0.8 us
    for eleven fields, a checkpoint of 100k tensors 80 ms of opening it.

    >>> from reshard.intervals import Interval
    >>> t = tensor_source("w", "F32", (2,), (0,), (8,), (((Interval(0, 2),),),), ("sig",))
    >>> t == TensorSource("w", "F32", (2,), (0,), (8,), (((Interval(0, 2),),),), ("sig",)), type(t).__name__
    (True, 'TensorSource')
    """

    __slots__ = TensorSource.__slots__  # same names, same order: the same memory layout

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        piece_files: tuple[int, ...],
        piece_offsets: Sequence[int],
        piece_blocks: tuple[Block, ...],
        signature: Signature,
        piece_partials: tuple[int, ...] | None = None,
        reduce_op: str | None = None,
        placements: tuple[Placement, ...] | None = None,
        piece_crc32: Sequence[int | None] | None = None,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.piece_files = piece_files
        self.piece_offsets = piece_offsets
        self.piece_blocks = piece_blocks
        self.signature = signature
        self.piece_partials = piece_partials
        self.reduce_op = reduce_op
        self.placements = placements
        self.piece_crc32 = piece_crc32
        self.__class__ = TensorSource  # type: ignore[assignment]


# ``TensorSource(...)`` in a fifth of the time (see :class:`_Unfrozen`); typed as the class, whose
# fields are its parameters, so callers are checked against the one signature
tensor_source = cast("type[TensorSource]", _Unfrozen)


HOLDS_TENSORS = "object holding tensors"
"""The :attr:`NonTensor.kind` of an item whose pickle holds tensors: a whole dict that
``dcp.save(..., planner=DefaultSavePlanner(flatten_state_dict=False))`` stored as one object.
Converting without it would drop those tensors: ``convert`` refuses it unless excluded."""

UNREADABLE = "tensor of a dtype safetensors lacks"
"""The :attr:`NonTensor.kind` of a tensor whose dtype safetensors has no name for (``complex128``,
``qint8``): listed, its bytes never read; ``convert`` refuses it unless excluded, as it would
otherwise be dropped."""


@dataclass(frozen=True, slots=True)
class NonTensor:
    """An item of the checkpoint that is not a tensor (bytes, a pickled object): listed, never converted.

    Attributes:
        name: its key in the checkpoint.
        size: its stored size in bytes.
        file: index of the file holding it in :attr:`Checkpoint.files`, or None
            (kept in the checkpoint's metadata).
        kind: what it is, for people (``"bytes"``, ``"object"``).
        offset: where its stored bytes start in that file, when they are one run a writer
            can copy as they are (a DCP ``BYTE_IO`` item: ``--to dcp`` carries it over);
            None for a leaf inside a pickle.
        transforms: the ``transform_descriptors`` its bytes are stored through (zstd), kept
            with them when copied.
    """

    name: str
    size: int
    file: int | None = None
    kind: str = ""
    offset: int | None = None
    transforms: tuple[str, ...] = ()

    @property
    def stored(self) -> bool:
        """Whether it is one stored run of bytes, which a writer can copy as it is (a DCP source's
        ``BYTE_IO`` item; a leaf inside a pickle is not)."""
        return self.file is not None and self.offset is not None


def stored_objects(ckpt: Checkpoint) -> list[NonTensor]:
    """``ckpt``'s non-tensor items that are each one stored run of bytes (:attr:`NonTensor.stored`)."""
    return [n for n in ckpt.non_tensors if n.stored]


@dataclass(frozen=True, slots=True)
class CheckpointWarning:
    """Something a reader noticed that does not stop it.

    Attributes:
        message: the text for people (names the file and tensor).
        problem: a data problem (``inspect --check`` reports it and exits 1), not just
            information such as an ignored stray file.
        path: the file it is about, when there is one.
        tensor: the tensor it is about, when there is one.
    """

    message: str
    problem: bool = False
    path: str | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class Spooled:
    """Where the pieces in a reader's spool file (:mod:`reshard.io.spool`: row-major copies of
    transposed or strided tensors, decompressed chunks) came from: bytes ``[starts[k], stops[k])``
    of the spool were made from bytes ``[origin_starts[k], origin_stops[k])`` of the checkpoint's
    file ``files[k]``, ``starts`` increasing. ``spool``: the reader's
    :class:`~reshard.io.spool.LazySpool`, which makes each region when it is first read (kept
    alive with the checkpoint: its readers find it by the spool's path)."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]
    files: tuple[int, ...]
    origin_starts: tuple[int, ...]
    origin_stops: tuple[int, ...]
    spool: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, regions: Sequence[tuple[int, int, int, int, int]], spool: Any = None) -> Spooled:
        """From :attr:`reshard.io.spool.LazySpool.origins` rows ``(start, stop, file, o_start, o_stop)``."""
        cols = tuple(zip(*sorted(regions), strict=True)) or ((), (), (), (), ())
        starts, stops, files, origin_starts, origin_stops = cols
        return cls(starts, stops, files, origin_starts, origin_stops, spool)

    def origin(self, offset: int) -> tuple[int, int, int]:
        """``(file, start, stop)``: the checkpoint's bytes the spooled piece at ``offset`` came from.

        >>> Spooled((0, 96), (96, 200), (0, 1), (2345, 10), (2441, 400)).origin(100)
        (1, 10, 400)
        """
        k = bisect_right(self.starts, offset) - 1
        if k < 0 or not (offset < self.stops[k] or offset == self.starts[k]):
            raise KeyError(offset)  # not a piece the reader spooled: a bug, not the user's
        return self.files[k], self.origin_starts[k], self.origin_stops[k]


@dataclass(slots=True)
class Checkpoint:
    """A readable checkpoint: its files and its logical tensors (in name order).

    Attributes:
        path: the directory (or file) opened.
        format: the reader's name.
        files: every file the pieces refer to, by index: the checkpoint's own files and the
            reader's spool (see ``spooled``).
        file_sizes: their sizes, in bytes.
        tensors: name -> :class:`TensorSource`.
        mesh: the mesh it was saved on, when it says.
        layout: its placement rules, when known (self-described, or the source layout).
        manifest: its ``reshard.json``, when present.
        warnings: what the reader noticed.
        non_tensors: items that are not tensors (listed by ``inspect``, not converted).
        left_out: tensors ``--include``/``--exclude`` left out (:mod:`reshard.select`).
        spooled: per file index of a spool the reader made under ``$TMPDIR`` (not part of the
            checkpoint), where its pieces came from. Reports name :meth:`own_files` only and
            show a spooled piece as the bytes of its own file (:meth:`origin`).
    """

    path: str
    format: str
    files: tuple[str, ...]
    file_sizes: tuple[int, ...]
    tensors: dict[str, TensorSource]
    mesh: Mesh | None = None
    layout: LayoutConfig | None = None
    manifest: dict[str, object] | None = None
    warnings: list[CheckpointWarning] = field(default_factory=list)
    non_tensors: tuple[NonTensor, ...] = ()
    left_out: int = 0
    spooled: dict[int, Spooled] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The bytes of the checkpoint's own files (a spool is not the checkpoint's)."""
        if not self.spooled:
            return sum(self.file_sizes)
        return sum(self.file_sizes[i] for i in self.own_files())

    def own_files(self) -> list[int]:
        """Indices of the checkpoint's own files: every file but a reader's spool."""
        return [i for i in range(len(self.files)) if i not in self.spooled]

    def origin(self, fi: int, offset: int) -> tuple[int, int, int] | None:
        """``(file, start, stop)`` of the checkpoint's own bytes a piece in a spool (at byte
        ``offset`` of file ``fi``) was made from; None for a piece of an own file."""
        sp = self.spooled.get(fi)
        return None if sp is None else sp.origin(offset)

    def shown_file(self, fi: int, offset: int) -> str:
        """The path to name for the piece at byte ``offset`` of file ``fi``: its own file."""
        got = self.origin(fi, offset)
        return self.files[fi if got is None else got[0]]
