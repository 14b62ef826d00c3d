"""The planner: intersect target blocks with source pieces into copy operations (pure).

A :class:`Copy` moves the Cartesian product of per-dim segments
``(src_local_start, dst_local_start, size)`` from one source piece into one
target local tensor. Work is shared between tensors of the same geometry
(same source signature, shape and target placements), so a checkpoint of
100k tensors costs as many matchings as it has distinct tensor layouts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, overload

from .checkpoint import Checkpoint, TensorSource
from .dtypes import DTYPE_SIZES, FLOAT_DTYPES
from .errors import LayoutError, PlanError
from .intervals import Block, IndexList, Segment, block_volume, overlap_segments
from .layout import TensorLayout
from .mesh import Mesh
from .placements import Placement

if TYPE_CHECKING:
    from .config import LayoutConfig

__all__ = [
    "Copy",
    "TargetTensor",
    "match_blocks",
    "plan_tensor",
    "copy_boxes",
    "natural_key",
    "natural_sorted",
    "WriteOptions",
    "OutEntry",
    "LazySequence",
    "FileLayout",
    "OutFile",
    "OutputFormat",
    "local_nbytes",
    "distinct_layouts",
    "Plan",
    "Matcher",
    "make_plan",
    "check_reduce",
    "copies_counts",
    "plan_copies",
]


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy from source piece ``piece`` the product of ``segments`` (one tuple per dim)."""

    piece: int
    segments: tuple[tuple[Segment, ...], ...]
    group: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for segs in self.segments:
            n *= sum(s[2] for s in segs)
        return n


@dataclass(frozen=True, slots=True)
class TargetTensor:
    """One tensor of the target: its layout and, per target rank, the copies that fill it."""

    name: str
    src: TensorSource
    dtype: str
    layout: TensorLayout
    copies: tuple[tuple[Copy, ...], ...]
    groups: int = 1
    reduce_op: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements


def copy_boxes(copy: Copy) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Expand a copy into boxes ``(src_starts, dst_starts, sizes)`` in local coordinates."""
    for combo in product(*copy.segments):
        yield (
            tuple(s[0] for s in combo),
            tuple(s[1] for s in combo),
            tuple(s[2] for s in combo),
        )


@dataclass(slots=True)
class _SourceIndex:
    """Deduplicated pieces of one partial group, indexed for matching."""

    pieces: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)


def _index_sources(src: TensorSource) -> dict[int, _SourceIndex]:
    groups: dict[int, _SourceIndex] = {}
    seen: dict[tuple[int, Block], int] = {}
    partials = src.piece_partials
    for k, blk in enumerate(src.piece_blocks):
        g = partials[k] if partials is not None else 0
        if (g, blk) in seen or block_volume(blk) == 0:
            continue  # a replica: the first piece (lowest file index) is read
        seen[(g, blk)] = k
        idx = groups.setdefault(g, _SourceIndex())
        idx.pieces.append(k)
        idx.blocks.append(blk)
    return groups


def match_blocks(src: TensorSource, dst_blocks: Sequence[Block]) -> tuple[tuple[tuple[Copy, ...], ...], int]:
    """Copies filling each destination block from the source pieces.

    Returns per destination block its copies, and the number of partial groups.

    Raises:
        PlanError: a destination region is not covered by the source (a hole),
            or covered twice by pieces that are not replicas (a conflicting overlap).
    """
    groups = _index_sources(src)
    group_ids = sorted(groups)
    if not group_ids:
        group_ids = [0]
        groups[0] = _SourceIndex()
    seg_cache: dict[tuple[IndexList, IndexList], tuple[Segment, ...]] = {}
    out: list[tuple[Copy, ...]] = []
    for dblk in dst_blocks:
        need = block_volume(dblk)
        copies: list[Copy] = []
        if need:
            for gi, g in enumerate(group_ids):
                idx = groups[g]
                got = 0
                for k, sblk in zip(idx.pieces, idx.blocks):
                    segs_all: list[tuple[Segment, ...]] = []
                    for sl, dl in zip(sblk, dblk):
                        key = (sl, dl)
                        segs = seg_cache.get(key)
                        if segs is None:
                            segs = overlap_segments(sl, dl)
                            seg_cache[key] = segs
                        if not segs:
                            break
                        segs_all.append(segs)
                    else:
                        c = Copy(k, tuple(segs_all), gi)
                        got += c.numel
                        copies.append(c)
                if got != need:
                    what = "holes" if got < need else "conflicting overlaps"
                    raise PlanError(
                        f'tensor "{src.name}": the source pieces leave {what} '
                        f"({got} of {need} elements of a target block covered"
                        + (f", partial group {g}" if len(group_ids) > 1 else "")
                        + "). The checkpoint is incomplete or its layout is wrong; "
                        "run `reshard inspect --check` on it.",
                        tensor=src.name,
                    )
        out.append(tuple(copies))
    return tuple(out), len(group_ids)


_MATCH_CACHE: dict[tuple[object, ...], tuple[tuple[tuple[Copy, ...], ...], int]] = {}


def check_reduce(src: TensorSource) -> None:
    """Refuse what torch refuses to reduce: a ``Partial("avg")`` source of an integer or bool
    dtype in more than one partial group. torch 2.13's ``full_tensor()`` and
    ``redistribute(mesh, [Replicate()])`` of such a DTensor raise (``result type Float can't be
    cast to the desired output type Int``), so it has no value to convert (reshard rounded down).
    ``sum``, ``max`` and ``min`` of integers wrap and compare as torch's do.

    Raises:
        PlanError: naming the tensor, its placements and what to do.
    """
    if src.reduce_op != "avg" or src.dtype in FLOAT_DTYPES or src.piece_partials is None:
        return
    groups = len(set(src.piece_partials))
    if groups > 1:  # an empty tensor too: torch refuses it whatever its size
        placed = f" placed {', '.join(map(str, src.placements))}" if src.placements else ""
        raise PlanError(
            f'tensor "{src.name}" ({src.dtype}{placed}) is saved as Partial(avg) of {groups} partial '
            "values: torch refuses to reduce an integer or bool Partial(avg) DTensor (full_tensor() and "
            "redistribute to Replicate raise \"result type Float can't be cast to the desired output "
            'type"), so it has no value to convert. Reduce it in torch as you mean it (e.g. a sum, then '
            "a rounding division) and save that, or --exclude it",
            tensor=src.name,
        )


def plan_tensor(src: TensorSource, layout: TensorLayout, dtype: str) -> TargetTensor:
    """Plan one tensor: reuse the matching of any earlier tensor of the same geometry."""
    return _target(src, layout, dtype, _matched(src, layout))


Matcher = Callable[[TensorSource, Sequence[Block]], tuple[tuple[tuple[Copy, ...], ...], int]]
"""How target blocks are matched against a source's pieces (:func:`match_blocks`, or through
transform views: :func:`reshard.transform_plan.match_any`)."""


def _matched(
    src: TensorSource, layout: TensorLayout, match: Matcher = match_blocks
) -> tuple[tuple[tuple[Copy, ...], ...], int]:
    if layout.partial_op is not None:
        raise PlanError(
            f'tensor "{src.name}": a Partial target placement {layout.placement_strs()} is not '
            "supported; a converted checkpoint holds the reduced value. Use R instead of P.",
            tensor=src.name,
        )
    key = (src.signature, layout.shape, layout.mesh.shape, layout.placements)
    hit = _MATCH_CACHE.get(key)
    if hit is None:
        hit = match(src, layout.blocks())
        if len(_MATCH_CACHE) > 100_000:
            _MATCH_CACHE.clear()
        _MATCH_CACHE[key] = hit
    return hit


def _target(
    src: TensorSource, layout: TensorLayout, dtype: str, hit: tuple[tuple[tuple[Copy, ...], ...], int]
) -> TargetTensor:
    copies, groups = hit
    check_reduce(src)
    return TargetTensor(
        name=src.name,
        src=src,
        dtype=dtype,
        layout=layout,
        copies=copies,
        groups=groups,
        reduce_op=src.reduce_op if groups > 1 else None,
    )


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key putting ``layers.2`` before ``layers.10``.

    >>> sorted(["l.10.w", "l.2.w", "a"], key=natural_key)
    ['a', 'l.2.w', 'l.10.w']
    """
    parts = _DIGITS.split(name)  # the digit runs are at the odd positions
    key: list[object] = list(parts)
    key[1::2] = [int(p) for p in parts[1::2]]
    return tuple(key)


_NUMPY_SORT = 2048
"""Sort this many names or more by byte keys (:func:`natural_sorted`)."""


def natural_sorted(names: Iterable[str]) -> list[str]:
    """``sorted(names, key=natural_key)``, for 100k names in a sixth of the time.

    Each name becomes a byte key by numpy, a chunk of names at a time (bounded scratch memory:
    the whole 200k names at once took 60 MiB): every digit run gets a NUL (below any other
    character: a shorter text part sorts first, as in the tuple key) and zeros to the longest
    run's width (equal numbers, equal bytes), so plain byte order is the key order. Names it
    cannot key that way (non-ASCII, holding a newline or NUL, digit runs over 32) are sorted
    by :func:`natural_key`, as are a few names (no numpy import for them).

    >>> natural_sorted(["l.10.w", "l.2.w", "l.2", "a"])
    ['a', 'l.2', 'l.2.w', 'l.10.w']
    """
    names = list(names)
    if len(names) < _NUMPY_SORT:
        return sorted(names, key=natural_key)
    chunks = [names[lo : lo + _KEY_CHUNK] for lo in range(0, len(names), _KEY_CHUNK)]
    width = 0
    for part in chunks:  # the widest digit run of all names first: every key pads to it
        b = _name_bytes(part)
        if b is None:
            return sorted(names, key=natural_key)
        width = max(width, int(_digit_runs(b)[1].max(initial=0)))
    if width > 32:
        return sorted(names, key=natural_key)
    keys: list[bytes] = []
    for part in chunks:
        keys += _byte_keys(part, width)
    return [names[i] for i in sorted(range(len(names)), key=keys.__getitem__)]


_KEY_CHUNK = 16384
"""Names keyed at a time by :func:`natural_sorted`."""


def _name_bytes(names: list[str]) -> Any:
    """The names joined by newlines as a numpy byte array, or None when they are not all
    ASCII without newline and NUL."""
    import numpy as np  # lazy: inspect of a small checkpoint never needs it

    text = "\n".join(names)
    if not text.isascii() or text.count("\n") != len(names) - 1 or "\0" in text:
        return None
    return np.frombuffer(text.encode("ascii"), np.uint8)


def _digit_runs(b: Any) -> tuple[Any, Any]:
    """Where the digit runs of byte array ``b`` start, and their lengths."""
    import numpy as np

    digit = np.r_[False, (b >= 0x30) & (b <= 0x39), False]
    edges = np.flatnonzero(digit[1:] != digit[:-1])  # run starts and stops, alternating
    return edges[0::2], edges[1::2] - edges[0::2]


def _byte_keys(names: list[str], width: int) -> list[bytes]:
    """:func:`natural_sorted`'s byte key of each name (all ASCII, digit runs of ``width`` at most)."""
    import numpy as np

    b = _name_bytes(names)
    starts, lengths = _digit_runs(b)
    if width and len(starts):
        pads = width + 1 - lengths  # NUL, then zeros up to the width, before each run
        fill = np.full(int(pads.sum()), 0x30, np.uint8)
        fill[np.cumsum(pads) - pads] = 0
        b = np.insert(b, np.repeat(starts, pads), fill)
    keys: list[bytes] = b.tobytes().split(b"\n")
    return keys


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """Target options a writer may use to lay out its files."""

    max_shard_size: int = 5 * 10**9
    """Split a rank's (or the consolidated) output into files of at most this many bytes."""
    file_names: Mapping[str, str] | None = None
    """Tensor name -> its name inside rank files, where not its own (``Own(NAME, local)``)."""
    read_order: bool = False
    """Keep the plan's tensor order in each file (the order their bytes lie in the source, see
    :func:`make_plan`) instead of the reference writer's (dtype, then name)."""


T = TypeVar("T")


class LazySequence(Sequence[T]):
    """A sequence whose items are made as they are read (a writer's layout of 100k entries holds
    arrays, not objects): a subclass gives ``__len__`` and ``_item(i)`` (and a faster ``__iter__``)."""

    __slots__ = ()

    def _item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...

    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return self._items(range(*i.indices(len(self))))
        return self._item(i)

    def _items(self, positions: range) -> Sequence[T]:
        """The items at ``positions`` (a slice): one by one, unless a subclass makes them together."""
        return [self._item(k) for k in positions]


class OutEntry(NamedTuple):
    """One tensor in one output file: target rank ``rank``'s block, ``nbytes`` at absolute ``start``.

    A named tuple, not a dataclass: writers make one per tensor per file as the executor
    walks a file (800k for a 100k-tensor checkpoint at TP-8), and a tuple is built in
    half the time of a frozen dataclass."""

    tensor: TargetTensor
    rank: int
    start: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where every byte of one output file comes from.

    ``fixed`` are the bytes known before any tensor data is written (headers, and
    for container formats the records between entries), as ``(offset, bytes)`` in
    increasing offset order, never overlapping an entry. ``entries`` are the tensor
    data runs in increasing ``start`` order. Every byte of ``[0, size)`` is in one
    of them (or is a zero gap the file system gives for free).
    """

    fixed: Sequence[tuple[int, bytes]]  # a tuple, or a writer's lazy sequence (100k-chunk DCP files)
    entries: Sequence[OutEntry]  # a tuple, or a writer's lazy sequence (100k-tensor files)
    size: int


class OutFile:
    """One output file of a writer: target rank ``rank``'s blocks of ``tensors`` (the writer interface).

    A writer subclasses this and implements :meth:`lay_out`. The layout is computed
    on first use, not at planning time: a checkpoint of 100k tensors planned for 64
    ranks has 6.4M file entries, and each worker lays out only the files it writes.

    Formats whose bytes depend on the data (zip archives with CRC32 fields) set
    ``needs_crc32``: the executor then computes ``zlib.crc32`` of each entry's bytes
    as it writes them. Bytes right after an entry that depend on it (a zip data
    descriptor, the records after it) come from :meth:`trailer`, written in order as
    soon as the entry is, so they are hashed on the way; ``(offset, bytes)`` patches
    anywhere else come from :meth:`finish`, written before the file is checksummed
    and renamed (the pieces they touch are read back to hash them).
    """

    __slots__ = ("name", "rank", "tensors", "_layout")

    needs_crc32: bool = False
    head_bytes: int = 0
    """How many leading bytes of each entry :meth:`trailer` is given (with ``needs_crc32``)."""

    def __init__(self, name: str, rank: int | None, tensors: Sequence[TargetTensor]) -> None:
        self.name = name
        self.rank = rank  # the target rank whose blocks the file holds; None: consolidated (rank 0)
        self.tensors = tensors
        self._layout: FileLayout | None = None

    def lay_out(self) -> FileLayout:
        """Compute the file's layout (called once, lazily)."""
        raise NotImplementedError

    def finish(self, crc32s: Sequence[int]) -> Sequence[tuple[int, bytes]]:
        """Bytes to write once all data is written, from the entries' CRC32s (in entry order)."""
        return ()

    def trailer(self, index: int, crc32: int, head: bytes) -> bytes:
        """The bytes right after entry ``index`` (at its end, up to the next fixed run or entry).

        Args:
            index: the entry's position in :attr:`entries`.
            crc32: ``zlib.crc32`` of the entry's bytes (0 for an empty entry).
            head: its first ``min(head_bytes, nbytes)`` bytes.
        """
        return b""

    @property
    def layout(self) -> FileLayout:
        if self._layout is None:
            self._layout = self.lay_out()
        return self._layout

    @property
    def prefix(self) -> bytes:
        """The fixed bytes from offset 0 (the header, which may be given in consecutive runs), or empty."""
        parts = []
        at = 0
        for off, data in self.layout.fixed:
            if off != at:
                break
            parts.append(data)
            at += len(data)
        return b"".join(parts)

    @property
    def entries(self) -> Sequence[OutEntry]:
        return self.layout.entries

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def local_rank(self) -> int:
        """The target rank whose blocks this file holds (0 for a consolidated file)."""
        return 0 if self.rank is None else self.rank

    @property
    def copies(self) -> int:
        r = self.local_rank
        return sum(len(copies[r]) * n for copies, n in copies_counts(self.tensors))


def copies_counts(tensors: Sequence[TargetTensor]) -> list[tuple[tuple[tuple[Copy, ...], ...], int]]:
    """The distinct ``copies`` of ``tensors`` (tensors of one geometry share theirs) and how many
    tensors have each: what sibling files sharing one tensor list count once between them."""
    count: dict[int, int] = {}
    first: dict[int, tuple[tuple[Copy, ...], ...]] = {}
    for t in tensors:
        k = id(t.copies)
        if k in count:
            count[k] += 1
        else:
            count[k] = 1
            first[k] = t.copies
    return [(first[k], n) for k, n in count.items()]


def plan_copies(plan: Plan) -> int:
    """Copies of all the plan's files, counted once per tensor list (TP-8 of 100k tensors: 100k
    steps, not 800k)."""
    lists: dict[int, tuple[Sequence[TargetTensor], list[tuple[tuple[tuple[Copy, ...], ...], int]]]] = {}
    total = 0
    for f in plan.files:
        hit = lists.get(id(f.tensors))
        if hit is None or hit[0] is not f.tensors:
            hit = lists[id(f.tensors)] = (f.tensors, copies_counts(f.tensors))
        r = f.local_rank
        total += sum(len(copies[r]) * n for copies, n in hit[1])
    return total


class OutputFormat(Protocol):
    """What the planner needs of a writer (``reshard.formats.base.Writer`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def consolidated(self) -> bool:
        """Every tensor whole (all placements Replicate on a one-rank mesh)."""
        ...

    @property
    def lockstep(self) -> bool:
        """The files are sibling ranks holding the same tensors cut differently (they share reads)."""
        ...

    def files(self, tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
        """The output files for planned tensors (in natural name order) on the target mesh."""
        ...


def local_nbytes(t: TargetTensor, rank: int) -> int:
    """Bytes of target rank ``rank``'s block of ``t``."""
    return _local_nbytes(t.layout, t.dtype)[rank]


def distinct_layouts(layouts: Iterable[TensorLayout]) -> list[TensorLayout]:
    """``layouts`` (e.g. of the planned tensors), each once: by identity (the tensors of one
    geometry share the planner's layout object), so a property of every tensor's layout is
    tested once per geometry."""
    return list({id(lay): lay for lay in layouts}.values())


@lru_cache(maxsize=65536)
def _local_nbytes(layout: TensorLayout, dtype: str) -> tuple[int, ...]:
    isz = DTYPE_SIZES[dtype]
    return tuple(isz * block_volume(blk) for blk in layout.blocks())


@dataclass(slots=True)
class Plan:
    """Everything a conversion does, decided before a byte is written."""

    source: Checkpoint
    writer: OutputFormat
    mesh: Mesh
    tensors: list[TargetTensor]
    files: list[OutFile]
    rules: LayoutConfig | None = None  # the target's layout rules, when there are any
    transforms: dict[str, Any] | None = None  # the transforms applied (recorded in reshard.json)
    transformed: Mapping[str, Any] | None = None  # target name -> TransformedTensor (for `plan`)

    @property
    def format(self) -> str:
        return self.writer.name

    @property
    def bytes_written(self) -> int:
        return sum(f.size for f in self.files)

    def file_reads(self, f: OutFile) -> dict[int, int]:
        """Bytes read per source file index to produce ``f``."""
        out: dict[int, int] = {}
        shared: dict[tuple[int, str], list[tuple[int, int]]] = {}  # per geometry (alive in the plan)
        for e in f.entries:
            t = e.tensor
            copies = t.copies[e.rank]
            per = shared.get((id(copies), t.src.dtype))
            if per is None:
                isz = DTYPE_SIZES[t.src.dtype]
                per = shared[(id(copies), t.src.dtype)] = [(c.piece, c.numel * isz) for c in copies]
            files = t.src.piece_files
            for k, n in per:
                if files[k] >= 0:  # -1: zeros (transform padding), nothing read
                    out[files[k]] = out.get(files[k], 0) + n
        return out

    @property
    def bytes_read(self) -> int:
        return sum(sum(self.file_reads(f).values()) for f in self.files)


def _target_layout(
    src: TensorSource, mesh: Mesh, placements: Sequence[Placement | str], rules: LayoutConfig | None
) -> TensorLayout:
    """The target layout of ``src``; a placement that does not fit names the rule it came from."""
    try:
        return TensorLayout.for_tensor(src.name, src.shape, mesh, placements)
    except LayoutError as e:
        if rules is None:
            raise
        raise LayoutError(
            f"{rules.rule_location(src.name)}: {e.message}",
            path=rules.source,
            tensor=src.name,
            hint=e.hint or "change the rule, or add a rule for this tensor before it",
        ) from None


class _Geometries:
    """Target layouts and matchings shared by the tensors of one geometry, found by identity
    (each value holds the objects its key names, so their ids stay theirs): a 100k-tensor
    checkpoint then hashes no placements per tensor, and writers can cache by layout."""

    __slots__ = ("mesh", "rules", "match", "layouts", "matched", "seen")

    def __init__(self, mesh: Mesh, rules: LayoutConfig | None, match: Matcher) -> None:
        self.mesh, self.rules, self.match = mesh, rules, match
        self.layouts: dict[tuple[object, ...], tuple[object, TensorLayout]] = {}
        self.matched: dict[tuple[int, int, int], tuple[object, object, tuple[Any, int]]] = {}
        # (piece blocks, placements) by identity -> what :meth:`_of` gave a source of those blocks,
        # shape, signature and partials (a reader's geometry shares them: one lookup per tensor)
        self.seen: dict[tuple[int, int], tuple[Any, ...]] = {}

    def add(self, src: TensorSource, pl: Sequence[Placement | str]) -> tuple[Any, ...]:
        """What :attr:`seen` holds for ``src`` placed ``pl`` (found there by :func:`make_plan` for
        the next tensor of this geometry): the objects its key names, those it is checked
        against (shape, signature, partials), then the target layout, copies and group count."""
        if len(self.seen) >= _SEEN_MAX:  # placements made per tensor (Own): their ids are not reused
            self.seen.clear()
        layout, (copies, groups) = self._of(src, pl)
        hit = (src.piece_blocks, pl, src.shape, src.signature, src.piece_partials, layout, copies, groups)
        self.seen[(id(src.piece_blocks), id(pl))] = hit
        return hit

    def _of(
        self, src: TensorSource, pl: Sequence[Placement | str]
    ) -> tuple[TensorLayout, tuple[tuple[tuple[Copy, ...], ...], int]]:
        lkey = (src.shape, *map(id, pl))
        lay = self.layouts.get(lkey)
        if lay is None:
            lay = self.layouts[lkey] = (pl, _target_layout(src, self.mesh, pl, self.rules))
        layout = lay[1]
        mkey = (id(src.piece_blocks), id(src.piece_partials), id(layout))
        hit = self.matched.get(mkey)
        if hit is None or (src.signature is not hit[0] and src.signature != hit[0]):
            hit = self.matched[mkey] = (src.signature, src.piece_blocks, _matched(src, layout, self.match))
        return layout, hit[2]


_SEEN_MAX = 4096
"""Objects :class:`_Geometries` remembers by identity before starting over."""


class _Target:
    """:class:`TargetTensor`'s slots, set by plain assignment; then the object becomes a
    TargetTensor (as :func:`reshard.checkpoint.tensor_source` makes sources): a frozen
    dataclass sets each field through ``object.__setattr__``, 0.6 us a tensor."""

    __slots__ = TargetTensor.__slots__  # same names, same order: the same memory layout

    def __init__(
        self,
        name: str,
        src: TensorSource,
        dtype: str,
        layout: TensorLayout,
        copies: tuple[tuple[Copy, ...], ...],
        groups: int,
        reduce_op: str | None,
    ) -> None:
        self.name = name
        self.src = src
        self.dtype = dtype
        self.layout = layout
        self.copies = copies
        self.groups = groups
        self.reduce_op = reduce_op
        self.__class__ = TargetTensor  # type: ignore[assignment]


def _one_to_one(targets: Iterable[TensorSource]) -> bool:
    """Whether each target reads one source tensor that no other target reads (renamed,
    permuted or padded; not fused, split, stacked or copied). A source tensor is known by where
    its bytes start (a renamed one is a copy of its source object)."""
    seen: set[tuple[int, int]] = set()
    for t in targets:
        inputs = getattr(t, "inputs", None) or (t,)  # a transformed source's, else itself
        first = inputs[0]
        at = _read_at(first)
        if any(x is not first for x in inputs) or at in seen:
            return False
        seen.add(at)
    return True


def _read_at(src: TensorSource) -> tuple[int, int]:
    """Where ``src``'s first stored byte lies: (file index, offset); after every file when it
    reads none (zero parts)."""
    return min(((f, o) for f, o in zip(src.piece_files, src.piece_offsets) if f >= 0), default=(1 << 62, 0))


def make_plan(
    source: Checkpoint,
    mesh: Mesh,
    placements_for: Callable[[str], Sequence[Placement | str]],
    *,
    writer: OutputFormat,
    dtype: str | None = None,
    options: WriteOptions = WriteOptions(),
    rules: LayoutConfig | None = None,
    sources: Mapping[str, TensorSource] | None = None,
    match: Matcher = match_blocks,
    transforms: dict[str, Any] | None = None,
) -> Plan:
    """Plan a conversion of ``source`` to ``mesh`` with the placements ``placements_for(name)``.

    Args:
        source: the opened source checkpoint.
        mesh: the target mesh (a one-rank mesh for a consolidated writer).
        placements_for: target placements for a tensor name, one per mesh dim
            (not called for a consolidated writer: every tensor is whole).
        writer: lays out the output files (``reshard.formats.writer(name)``).
        dtype: cast floating tensors to this safetensors dtype (``BF16``, ``F16``, ``F32``).
        options: what the writer may use (``max_shard_size``).
        rules: the target layout rules, recorded in the output.
        sources: the tensors to plan, by target name (default: the source's own); transforms
            give views of the source's pieces (:mod:`reshard.transform_plan`), with ``match``.
        transforms: what those transforms were, recorded in the output.

    Raises:
        LayoutError: a placement does not fit a tensor.
        PlanError: the source cannot produce the target.
    """
    by_name = source.tensors if sources is None else sources
    tensors: list[TargetTensor] = []
    whole = ["R"] * mesh.ndim if writer.consolidated else None
    geometries = _Geometries(mesh, None if whole is not None else rules, match)
    seen = geometries.seen
    names = natural_sorted(by_name)
    if sources is not None and _one_to_one(sources.values()):
        # Renames put tensors in an order of names that is not the order of their bytes in the
        # source. Files list them in the source's order instead: the copy then reads each source
        # file front to back, which checks a source's recorded 64 MiB hashes in one pass (in name
        # order, HF -> torchtitan names read 1.5x the source). Only when each target is one
        # source tensor and the other way round: the inverse profile then gives back the source's
        # order (fused or split tensors would come back in another one)
        names.sort(key=lambda n: _read_at(by_name[n]))
        options = dataclasses.replace(options, read_order=True)
    for name in names:
        src = by_name[name]
        pl = whole if whole is not None else placements_for(name)
        blocks = src.piece_blocks
        hit = seen.get((id(blocks), id(pl)))  # the geometry of an earlier tensor (by identity)
        if hit is None or not (
            hit[0] is blocks
            and hit[1] is pl
            and hit[2] is src.shape
            and hit[3] is src.signature
            and hit[4] is src.piece_partials
        ):
            hit = geometries.add(src, pl)
        layout, copies, groups = hit[5], hit[6], hit[7]
        out_dtype = src.dtype
        if dtype is not None and out_dtype != dtype and out_dtype in FLOAT_DTYPES:
            out_dtype = dtype
        reduce_op = src.reduce_op if groups > 1 else None
        if src.reduce_op == "avg":
            check_reduce(src)
        tensors.append(_Target(src.name, src, out_dtype, layout, copies, groups, reduce_op))  # type: ignore[arg-type]
    files = writer.files(tensors, mesh, options)
    return Plan(source, writer, mesh, tensors, files, rules=rules, transforms=transforms)
