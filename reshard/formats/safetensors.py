"""Output files in safetensors form, shared by the writers of safetensors-based formats.

A :class:`SafetensorsFile` holds one target rank's blocks (or the whole tensors of a
consolidated file) in the reference writer's order, its header built by
:func:`reshard.io.header.prefix_parts`, so files are byte-identical to
``safetensors.torch.save_file`` of the same tensors and metadata.
"""

from __future__ import annotations

import json
import threading
import weakref
from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import accumulate, groupby, repeat
from operator import attrgetter

from ..dtypes import DTYPE_RANK, DTYPE_SIZES
from ..intervals import block_shape
from ..io.header import entry_head, joined_entries, prefix_parts
from ..layout import TensorLayout
from ..plan import FileLayout, LazySequence, OutEntry, OutFile, TargetTensor, WriteOptions, local_nbytes

__all__ = ["SafetensorsFile", "header_order", "file_order", "metadata_text", "split_parts"]


class SafetensorsFile(OutFile):
    """A safetensors output file: the header, then each tensor's block back to back."""

    __slots__ = ("_meta", "_sec", "_names")

    def __init__(
        self,
        name: str,
        rank: int | None,
        tensors: Sequence[TargetTensor],
        meta: str | Sequence[bytes] | None,
        names: Sequence[str] | None = None,
    ) -> None:
        """``tensors`` in header order (:func:`header_order`); ``meta`` the JSON text of ``__metadata__``,
        or its UTF-8 parts (one shared by sibling files is held once; see
        :func:`reshard.io.header.prefix_parts`), or None (no ``__metadata__``, as ``save_file``
        without metadata writes); ``names`` the
        entries' names when not the tensors' own (``Own(NAME, local)`` rank files)."""
        super().__init__(name, rank, tensors)
        self._meta = meta
        self._sec: _Section | None = None
        self._names = names

    def lay_out(self) -> FileLayout:
        r = self.local_rank
        sec = self._sec = _section(self.tensors, self._names)  # held: siblings find it while this file lives
        texts = tuple(_local_texts(lay, dtype)[r] for lay, dtype in sec.geometries)
        last = sec.last
        if last is None or last[0] != texts:  # siblings with equal local shapes share one section
            heads = [entry_head(dtype, shape) for (_, dtype), (shape, _) in zip(sec.geometries, texts)]
            sizes = array("q", map([n for _, n in texts].__getitem__, sec.geometry))
            text, offsets = joined_entries(sec.quoted(), list(map(heads.__getitem__, sec.geometry)), sizes)
            last = sec.last = (texts, text, array("q", offsets), sizes)
        _, text, starts, sizes = last
        parts = prefix_parts(text, self._meta)
        fixed: tuple[tuple[int, bytes], ...] = ((0, b"".join(parts)),)
        if text:
            fixed = tuple((at, p) for at, p in zip(accumulate(map(len, parts), initial=0), parts) if p)
        base = sum(map(len, parts))
        size = base + (starts[-1] + sizes[-1] if sizes else 0)
        return FileLayout(fixed, _Entries(self.tensors, r, base, starts, sizes), size)


class _Section:
    """What the files of one tensor list share: each tensor's geometry, and the entries text
    and offsets last laid out (siblings laid out in turn reuse them)."""

    __slots__ = ("tensors", "names", "geometries", "geometry", "last", "__weakref__")

    def __init__(self, tensors: Sequence[TargetTensor], names: Sequence[str] | None) -> None:
        self.tensors = tensors  # keeps the list's id its own while the section lives
        self.names = names
        index: dict[tuple[int, str], int] = {}
        self.geometries: list[tuple[TensorLayout, str]] = []
        self.geometry: list[int] = []
        for t in tensors:
            g = index.get((id(t.layout), t.dtype))
            if g is None:
                g = index[(id(t.layout), t.dtype)] = len(self.geometries)
                self.geometries.append((t.layout, t.dtype))
            self.geometry.append(g)
        self.last: tuple[tuple[tuple[str, int], ...], tuple[bytes, ...], array[int], array[int]] | None = None

    def quoted(self) -> Sequence[str]:
        """The entries' names as JSON text, made a slice at a time as an entries text takes them
        (not kept, nor made at once: 200k names are 20 MB, at the peak of planning 200k tensors)."""
        return _QuotedNames(list(self.names) if self.names is not None else [t.name for t in self.tensors])


class _QuotedNames(LazySequence[str]):
    """``_quoted_names(names)``, each slice quoted when it is taken."""

    __slots__ = ("_names",)

    def __init__(self, names: list[str]) -> None:
        self._names = names

    def __len__(self) -> int:
        return len(self._names)

    def _item(self, i: int) -> str:
        return _quoted_names([self._names[i]])[0]

    def _items(self, positions: range) -> list[str]:
        return _quoted_names([self._names[k] for k in positions])  # together: one join, one split


_SECTIONS: weakref.WeakValueDictionary[int, _Section] = weakref.WeakValueDictionary()
_SECTIONS_LOCK = threading.Lock()


def _section(tensors: Sequence[TargetTensor], names: Sequence[str] | None = None) -> _Section:
    """The section shared by the files of ``tensors`` (alive while one of their layouts is);
    ``names``: the entries' names, when not the tensors' own (a section of its own)."""
    if names is not None:
        return _Section(tensors, names)
    with _SECTIONS_LOCK:
        sec = _SECTIONS.get(id(tensors))
        if sec is None or sec.tensors is not tensors:
            sec = _SECTIONS[id(tensors)] = _Section(tensors, None)
        return sec


class _Entries(LazySequence[OutEntry]):
    """A safetensors file's entries, made as they are read: a 100k-tensor file holds two
    arrays of offsets and sizes (shared with its siblings), not 100k objects."""

    __slots__ = ("_tensors", "_rank", "_base", "_starts", "_sizes")

    def __init__(
        self, tensors: Sequence[TargetTensor], rank: int, base: int, starts: array[int], sizes: array[int]
    ) -> None:
        self._tensors, self._rank, self._base = tensors, rank, base
        self._starts, self._sizes = starts, sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def _item(self, i: int) -> OutEntry:
        return OutEntry(self._tensors[i], self._rank, self._base + self._starts[i], self._sizes[i])

    def columns(self) -> tuple[Sequence[TargetTensor], int, int, array[int], array[int]]:
        """The entries as columns: entry ``i`` is rank ``rank``'s block of ``tensors[i]``, its bytes
        at ``base + starts[i]``, ``sizes[i]`` long (what the executor's bulk path reads)."""
        return self._tensors, self._rank, self._base, self._starts, self._sizes

    def __iter__(self) -> Iterator[OutEntry]:
        base = self._base
        return map(OutEntry, self._tensors, repeat(self._rank), (base + a for a in self._starts), self._sizes)


def metadata_text(metadata: dict[str, str]) -> str:
    """The JSON text of a ``__metadata__`` object, as the reference writer writes it."""
    return json.dumps(metadata, ensure_ascii=False, separators=(",", ":"))


def header_order(tensors: Sequence[TargetTensor]) -> list[TargetTensor]:
    """The reference writer's order: dtype rank (Rust enum) descending, then name (names are
    unique: by name within each dtype, the dtypes in turn; no key tuple per tensor)."""
    by_dtype: dict[str, list[TargetTensor]] = {}
    for dtype, group in groupby(tensors, attrgetter("dtype")):
        by_dtype.setdefault(dtype, []).extend(group)
    out: list[TargetTensor] = []
    for dtype in sorted(by_dtype, key=DTYPE_RANK.__getitem__, reverse=True):
        out.extend(sorted(by_dtype[dtype], key=attrgetter("name")))
    return out


def file_order(tensors: Sequence[TargetTensor], options: WriteOptions) -> list[TargetTensor]:
    """The order of a file's entries: the plan's with ``options.read_order`` (the order of
    their bytes in the source, for transformed tensors), else :func:`header_order`."""
    return list(tensors) if options.read_order else header_order(tensors)


def split_parts(tensors: Sequence[TargetTensor], rank: int, max_size: int) -> list[list[TargetTensor]]:
    """Rank ``rank``'s tensors in order, in files of at most ``max_size`` bytes: a new file when the
    next tensor would take this one over (as Hugging Face's and vLLM's savers split); a tensor
    larger than ``max_size`` gets a file of its own, and no file is empty."""
    parts: list[list[TargetTensor]] = [[]]
    acc = 0
    sizes: dict[tuple[int, str], tuple[TensorLayout, int]] = {}  # by identity: no layout hash per tensor
    for t in tensors:
        hit = sizes.get((id(t.layout), t.dtype))
        if hit is None or hit[0] is not t.layout:
            hit = sizes[(id(t.layout), t.dtype)] = (t.layout, local_nbytes(t, rank))
        n = hit[1]
        if parts[-1] and acc + n > max_size:
            parts.append([])
            acc = 0
        parts[-1].append(t)
        acc += n
    return parts


def _quoted_names(names: list[str]) -> list[str]:
    """Each name as JSON text (``json.dumps(name, ensure_ascii=False)``, as the reference writer
    quotes it): names of printable characters other than ``"`` and ``\\`` need no escape, so
    100k of them are quoted by one join and one split."""
    if all(map(str.isprintable, names)):  # no control character (no newline either)
        text = '"' + '"\n"'.join(names) + '"'
        if text.count('"') == 2 * len(names) and "\\" not in text:
            return text.split("\n") if names else []
    return [json.dumps(name, ensure_ascii=False) for name in names]


@lru_cache(maxsize=65536)
def _local_texts(layout: TensorLayout, dtype: str) -> tuple[tuple[str, int], ...]:
    """Per rank: the local shape as header text, and the local bytes (shared by equal layouts)."""
    isz = DTYPE_SIZES[dtype]
    out = []
    for blk in layout.blocks():
        shp = block_shape(blk)
        n = isz
        for x in shp:
            n *= x
        out.append((",".join(map(str, shp)), n))
    return tuple(out)
