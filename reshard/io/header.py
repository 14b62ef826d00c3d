"""Strict, pure-stdlib codec for safetensors headers.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes
of UTF-8 JSON (the header), then the data section. The header maps each tensor
name to ``{"dtype", "shape", "data_offsets"}`` (offsets relative to the start
of the data section) plus an optional ``"__metadata__"`` object of strings.

This module reads and writes headers only; it never touches tensor bytes and
never imports torch or numpy. :func:`encode_header` reproduces the reference
writer (``safetensors.torch.save`` / ``save_file``) byte for byte: tensors are
laid out by descending position of their dtype in the Rust ``Dtype`` enum
(``U64, I64, F64, C64, F32, U32, I32, BF16, F16, U16, I16, F8_E5M2FNUZ,
F8_E4M3FNUZ, F8_E8M0, F8_E4M3, F8_E5M2, I8, U8, BOOL``) then by name (byte-wise
UTF-8 order, which equals code point order), the JSON is compact, starts with
``__metadata__`` when present, lists tensors in layout order with keys
``dtype, shape, data_offsets``, and is space-padded to a multiple of 8 bytes.

Example:
    >>> prefix, header = encode_header([("b", "F16", [2]), ("a", "F32", [1, 2])])
    >>> int.from_bytes(prefix[:8], "little"), prefix[8:64]
    (112, b'{"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},')
    >>> header.names, header.data_start, header.data_size
    (('a', 'b'), 120, 12)
    >>> decode_header(prefix[8:]) == header
    True
"""

from __future__ import annotations

import array
import difflib
import gc
import itertools
import json
import operator
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from reshard.dtypes import DTYPE_RANK, DTYPE_SIZES, FLOAT_DTYPES, SUBBYTE_DTYPES
from reshard.errors import HeaderError, TensorNotFoundError
from reshard.io.safe import (
    _BadConstantError,
    _DuplicateKeyError,
    _pairs_hook,
    _reject_constant,
    open_regular,
    parse_json_text,
)

__all__ = [
    "no_gc",
    "DTYPE_SIZES",
    "DTYPE_RANK",
    "FLOAT_DTYPES",
    "MAX_HEADER_SIZE",
    "MAX_INT64",
    "TensorEntry",
    "Header",
    "decode_header",
    "read_header",
    "encode_header",
    "header_prefix",
    "forget_shared",
    "entries_text",
    "entry_head",
    "joined_entries",
    "prefix_parts",
]

#: Largest header the reference implementation accepts, in bytes.
MAX_HEADER_SIZE = 100_000_000

_RANK = DTYPE_RANK

#: Largest dim, element count, byte count or offset accepted: torch holds sizes in
#: int64, and safetensors refuses a shape whose running product overflows.
MAX_INT64 = (1 << 63) - 1

# Longest rendering of a bad value in a message: a 5000-entry shape stays readable.
_RENDER_LIMIT = 200

_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as described by a safetensors header.

    Attributes:
        name: the tensor name (the header key).
        dtype: the safetensors dtype string, a key of :data:`DTYPE_SIZES`.
        shape: the tensor shape; ``()`` for a 0-d tensor.
        start: first byte, relative to the start of the data section.
        stop: one past the last byte, relative to the start of the data section.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes (``stop - start``)."""
        return self.stop - self.start

    @property
    def itemsize(self) -> int:
        """Size of one element in bytes."""
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded safetensors header.

    Attributes:
        entries: the tensors, sorted by ``(start, stop)``; zero-size tensors at the
            same offset are in reference-writer order (dtype rank descending, then
            name).
        metadata: the ``__metadata__`` object, or None when the header has none.
        data_start: absolute file offset of the data section (8 + header length).
    """

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None = field(hash=False)
    data_start: int
    _index: dict[str, TensorEntry] | None = field(init=False, repr=False, compare=False, hash=False)
    """Made when a name is first looked up (readers that walk the entries never need it:
    200k tensors, 7 MB)."""
    _data_size: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shared = _SHARED
        object.__setattr__(self, "_index", None)
        if shared is not None and shared[2] is self.entries:  # a sibling rank's identical entries
            object.__setattr__(self, "_data_size", shared[3])
            return
        object.__setattr__(self, "_data_size", max((e.stop for e in self.entries), default=0))
        if len({e.name for e in self.entries}) != len(self.entries):
            seen: set[str] = set()
            for e in self.entries:
                if e.name in seen:
                    raise HeaderError(f"duplicate tensor name {_q(e.name)}", tensor=e.name)
                seen.add(e.name)

    @property
    def data_size(self) -> int:
        """Size of the data section in bytes: the largest ``stop`` (0 if no tensors)."""
        return self._data_size

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in data-section order."""
        return tuple(e.name for e in self.entries)

    def entry(self, name: str) -> TensorEntry:
        """Return the entry for ``name``.

        Args:
            name: the tensor name.

        Returns:
            The matching :class:`TensorEntry`.

        Raises:
            TensorNotFoundError: no tensor of that name is in the header.
        """
        index = self._index
        if index is None:
            index = {e.name: e for e in self.entries}
            object.__setattr__(self, "_index", index)
        try:
            return index[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(index), n=3)
            hint = ("did you mean " + ", ".join(_q(c) for c in close) + "?") if close else None
            raise TensorNotFoundError(
                f"tensor {_q(name)} is not in this file", tensor=name, hint=hint
            ) from None


# --------------------------------------------------------------------------- helpers


def _q(name: str) -> str:
    """Quote a name for messages: JSON string syntax, non-ASCII kept."""
    return json.dumps(name, ensure_ascii=False)


def _render(value: object) -> str:
    """Render a JSON value for an error message (``[2, 3]``, ``"x"``, ``null``)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _RENDER_LIMIT else text[: _RENDER_LIMIT - 3] + "..."


def _json_type(value: object) -> str:
    """The JSON type name of a decoded value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _numel(shape: object) -> int | None:
    """Element count of a header shape; None unless a list of non-negative ints.

    More than :data:`MAX_INT64` when a dim or the running product does (safetensors'
    checked fold, in torch's int64): ``[0, 2**64, 2**64]`` holds no element but is
    still refused, as safetensors refuses it.
    """
    if not isinstance(shape, list):
        return None
    n = 1
    for d in shape:
        if not _is_uint(d):
            return None
        n *= d
        if n > MAX_INT64 or d > MAX_INT64:
            return MAX_INT64 + 1
    return n


def _layout_key(e: TensorEntry) -> tuple[int, int, int, str]:
    return (e.start, e.stop, -_RANK[e.dtype], e.name)


def _check_dtype(dtype: str, name: str, where: str, path: str | None) -> None:
    if dtype in DTYPE_SIZES:
        return
    if dtype in SUBBYTE_DTYPES:
        raise HeaderError(
            f"{where}tensor {_q(name)} has unsupported dtype {_q(dtype)}: "
            f"sub-byte dtypes ({', '.join(SUBBYTE_DTYPES)}) are not supported",
            path=path,
            tensor=name,
        )
    raise HeaderError(
        f"{where}tensor {_q(name)} has unknown dtype {_render(dtype)}",
        path=path,
        tensor=name,
        hint="known dtypes: " + ", ".join(DTYPE_SIZES),
    )


# --------------------------------------------------------------------------- decode


def _parse_metadata(value: object, path: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise HeaderError(
            f"{path}: __metadata__ must be an object of strings, got {_json_type(value)}",
            path=path,
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(
                f"{path}: __metadata__ value for {_q(key)} must be a string, "
                f"got {_json_type(item)} {_render(item)}",
                path=path,
            )
    return dict(value)


def _parse_entry(name: str, value: object, path: str) -> TensorEntry:
    where = f"{path}: "
    if not isinstance(value, dict):
        raise HeaderError(
            f"{where}tensor {_q(name)} must be an object, got {_json_type(value)}",
            path=path,
            tensor=name,
        )
    for key in _ENTRY_KEYS:
        if key not in value:
            raise HeaderError(f"{where}tensor {_q(name)} is missing {_q(key)}", path=path, tensor=name)
    for key in value:
        if key not in _ENTRY_KEYS:
            raise HeaderError(
                f"{where}tensor {_q(name)} has unexpected key {_q(key)}", path=path, tensor=name
            )
    dtype = value["dtype"]
    if not isinstance(dtype, str):
        raise HeaderError(
            f"{where}tensor {_q(name)} has dtype {_render(dtype)}: must be a string",
            path=path,
            tensor=name,
        )
    _check_dtype(dtype, name, where, path)
    shape = value["shape"]
    numel = _numel(shape)
    if numel is None:
        raise HeaderError(
            f"{where}tensor {_q(name)} has invalid shape {_render(shape)}: "
            "must be a list of non-negative integers",
            path=path,
            tensor=name,
        )
    if numel > MAX_INT64:
        raise HeaderError(
            f"{where}tensor {_q(name)} has impossible shape {_render(shape)}: a dim or the product "
            f"of the dims so far exceeds {MAX_INT64} (int64; safetensors and torch refuse it)",
            path=path,
            tensor=name,
        )
    offsets = value["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise HeaderError(
            f"{where}tensor {_q(name)} has invalid data_offsets {_render(offsets)}: "
            "must be [begin, end] with non-negative integers",
            path=path,
            tensor=name,
        )
    start, stop = offsets
    if stop > MAX_INT64:
        raise HeaderError(
            f"{where}tensor {_q(name)} has impossible data_offsets {_render(offsets)}: "
            f"over {MAX_INT64} (int64)",
            path=path,
            tensor=name,
        )
    if start > stop:
        raise HeaderError(
            f"{where}tensor {_q(name)} has data_offsets {_render(offsets)} with begin after end",
            path=path,
            tensor=name,
        )
    entry = TensorEntry(name, dtype, tuple(shape), start, stop)
    need = numel * DTYPE_SIZES[dtype]
    if entry.nbytes != need:
        raise HeaderError(
            f"{where}tensor {_q(name)} has data_offsets {_render(offsets)} but shape "
            f"{_render(shape)} of {dtype} needs {need} bytes",
            path=path,
            tensor=name,
        )
    return entry


def _entry_hook(pairs: list[tuple[str, Any]]) -> Any:
    """The decoder's object hook: an entry object that passes :func:`_parse_entry`'s checks
    becomes a :class:`TensorEntry` (its name set by :func:`_fast_entries`) as it is decoded
    (a 100k-tensor header never holds 100k dicts and 200k lists at once); anything else
    becomes a dict, duplicate keys refused."""
    if len(pairs) == 3:
        (kd, dtype), (ks, shape), (ko, offs) = pairs
        if kd == "dtype" and ks == "shape" and ko == "data_offsets" and type(dtype) is str:
            isz = DTYPE_SIZES.get(dtype)
            if isz is not None and type(shape) is list and type(offs) is list and len(offs) == 2:
                n = 1
                for d in shape:
                    if type(d) is not int or d < 0:
                        break
                    n *= d
                    if n > MAX_INT64 or d > MAX_INT64:  # impossible (int64): named by _parse_entry
                        break
                else:
                    a, b = offs
                    if type(a) is int and type(b) is int and 0 <= a and b <= MAX_INT64 and b - a == n * isz:
                        shared = _shared_shape(tuple(shape))
                        return TensorEntry("", _DTYPE_NAMES[dtype], shared, a, b)  # named below
    return _pairs_hook(pairs)


_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
"""One tuple per distinct shape decoded (a 200k-tensor header has a few dozen: 10 MB saved)."""


def _shared_shape(t: tuple[int, ...]) -> tuple[int, ...]:
    """The one tuple kept for shape ``t`` (``t`` itself the first time, while fewer than 4096 are kept)."""
    shared = _SHAPES.get(t)
    if shared is None:
        shared = t
        if len(_SHAPES) < 4096:
            _SHAPES[t] = t
    return shared


_DTYPE_NAMES = {d: d for d in DTYPE_SIZES}
"""Each dtype name as one string object (a decoded header makes a new one per entry)."""


_DECODER = json.JSONDecoder(object_pairs_hook=_entry_hook, parse_constant=_reject_constant)


def _fast_entries(text: str) -> tuple[dict[str, str] | None, list[TensorEntry]] | None:
    """The metadata and entries of a header whose every entry is well formed, else None
    (:func:`_decoded_header` then decodes it again to say what is wrong)."""
    try:
        obj, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError, _DuplicateKeyError, _BadConstantError):
        return None
    if type(obj) is not dict or text[end:].strip(" \t\n\r") or not text.startswith("{"):
        return None
    meta = obj.pop(_METADATA_KEY, None)
    if meta is not None and (type(meta) is not dict or any(type(v) is not str for v in meta.values())):
        return None
    entries = list(obj.values())
    set_name = object.__setattr__
    for name, v in zip(obj, entries):
        if type(v) is not TensorEntry or v.name:
            return None
        set_name(v, "name", name)  # made by the decoder's hook, not yet seen by anyone
    return meta, entries


# ----------------------------------------------------------------- compact headers, scanned

_ENTRY = re.compile(
    r'"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]{1,16}","shape":\[[0-9,]*)\],'
    r'"data_offsets":\[(0|[1-9][0-9]{0,18}),(0|[1-9][0-9]{0,18})\]\}'
)
"""One entry as the reference writer (and reshard) writes it, groups: its name (no quote,
backslash or control character: the JSON text is the name), its head (dtype and shape text:
``I16","shape":[32,192``) and its offsets (JSON integers of at most 19 digits)."""

_GROUPS = 4
_META_OPEN = '{"' + _METADATA_KEY + '":'
_META_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_hook, parse_constant=_reject_constant)
_WHITESPACE = " \t\n\r"  # JSON's
_SCAN_CHUNK = 1 << 20
"""Characters of entries split at a time (about 9000 entries): the pieces of a whole
200k-entry header at once would be 60 MB."""
_BOUNDARY = ']},"'  # an entry's end and the next one's start (or a name's characters: then a slower decoding)
_new = object.__new__
_ENTRY_SETTERS = tuple(getattr(TensorEntry, f).__set__ for f in ("name", "dtype", "shape", "start", "stop"))


def _head_info(head: str) -> tuple[str, tuple[int, ...], int] | None:
    """The dtype, shape and byte size of an entry head matched by :data:`_ENTRY`, or None unless
    :func:`_entry_hook` takes them (known dtype, dims JSON integers of at most ``MAX_INT64``
    whose running product stays at most that)."""
    dtype, _, dims = head.partition('","shape":[')
    isz = DTYPE_SIZES.get(dtype)
    if isz is None:
        return None
    n = 1
    shape = []
    if dims:
        for tok in dims.split(","):
            if not tok or len(tok) > 19 or (tok[0] == "0" and len(tok) > 1):
                return None
            d = int(tok)
            n *= d
            if n > MAX_INT64 or d > MAX_INT64:
                return None
            shape.append(d)
    return _DTYPE_NAMES[dtype], _shared_shape(tuple(shape)), n * isz


def _scanned_entries(text: str) -> tuple[dict[str, str] | None, list[TensorEntry], int | None] | None:
    """:func:`_fast_entries` of a compact header (no whitespace but the trailing padding, each entry's
    keys in writer order, names without escapes, offsets at most 19 digits), found by splitting it with
    :data:`_ENTRY` instead of decoding it; None for any other header, which is then decoded.

    Accepts a header only where the decoder would give the same metadata and entries: every piece
    between two matches must be one comma, the names must be unique and none ``__metadata__``.
    The third item is the data size when the entries are known laid out as :func:`_check_layout`
    wants and in order (each starts where the one before stops, from 0, and holds bytes), else None.
    """
    begun = _scan_begin(text)
    if begun is None:
        return None
    meta, pos = begun
    if pos < 0:
        return meta, [], 0
    scan = _Scan()
    for chunk, last in _entry_chunks(text, pos):
        if not scan.add(chunk, last):
            return None
    unique = set(scan.names)
    if len(unique) != len(scan.names) or _METADATA_KEY in unique:
        return None
    return meta, scan.entries, scan.stop if scan.contiguous and not scan.empty else None


def _scan_begin(text: str) -> tuple[dict[str, str] | None, int] | None:
    """The metadata of a compact header and where its first entry starts (-1: it has none, and
    ends there), or None when it does not start as :func:`_scanned_entries` wants."""
    meta = None
    pos = 1
    if text.startswith(_META_OPEN):
        try:
            meta, pos = _META_DECODER.raw_decode(text, len(_META_OPEN))
        except (ValueError, RecursionError, _DuplicateKeyError, _BadConstantError):
            return None
        if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
            return None
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("}", pos) or text[pos + 1 :].strip(_WHITESPACE):
            return None
        else:
            return meta, -1
    elif not text.startswith("{"):
        return None
    elif text.startswith("}", 1):
        return None if text[2:].strip(_WHITESPACE) else (None, -1)
    if _ENTRY.match(text, pos) is None:  # not this shape: no time spent splitting it
        return None
    return meta, pos


def _entry_chunks(text: str, pos: int) -> Iterator[tuple[str, bool]]:
    """The entries from ``pos`` on in pieces of about :data:`_SCAN_CHUNK` characters, each ending
    with an entry when the header is well formed, and whether it is the last (the header's end)."""
    while pos + _SCAN_CHUNK < len(text):
        cut = text.find(_BOUNDARY, pos + _SCAN_CHUNK)
        if cut < 0:
            break
        yield text[pos : cut + 2], False
        pos = cut + 3
    yield text[pos:], True


class _Scan:
    """One header's entries as its pieces are scanned, what each distinct head holds, and
    whether the entries so far are laid out end to end."""

    def __init__(self) -> None:
        self.dtype_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        self.size_of: dict[str, int] = {}
        self.entries: list[TensorEntry] = []
        self.names: list[str] = []
        self.stop, self.stop_text = 0, "0"  # where the last entry stops
        self.contiguous = True  # each entry starts where the one before stops, from 0
        self.empty = False  # a tensor of no bytes: it may start where the next one does (then sorted)

    def add(self, chunk: str, last: bool) -> bool:
        """Add the entries of ``chunk`` (ending the header when ``last``); False unless it is
        entries as :func:`_scanned_entries` takes them, separated by commas."""
        parts = _ENTRY.split(chunk)
        seps = parts[:: _GROUPS + 1]
        k = len(seps) - 1
        tail = seps[-1]
        if k == 0 or seps[0] or seps[1:-1] != [","] * (k - 1):
            return False
        if (tail[:1] != "}" or tail[1:].strip(_WHITESPACE)) if last else tail:
            return False
        heads = parts[2 :: _GROUPS + 1]
        for head in set(heads).difference(self.dtype_of):
            info = _head_info(head)
            if info is None:
                return False
            self.dtype_of[head], self.shape_of[head], self.size_of[head] = info
            self.empty = self.empty or info[2] == 0
        a_texts = parts[3 :: _GROUPS + 1]
        b_texts = parts[4 :: _GROUPS + 1]
        stops = list(map(int, b_texts))
        if self.contiguous and a_texts[0] == self.stop_text and a_texts[1:] == b_texts[:-1]:
            starts = [self.stop, *stops[:-1]]  # each start is the stop before it: one int for both
        else:
            self.contiguous = False
            starts = list(map(int, a_texts))
        self.stop, self.stop_text = stops[-1], b_texts[-1]
        sizes = list(map(self.size_of.__getitem__, heads))
        if max(stops) > MAX_INT64 or sizes != list(map(operator.sub, stops, starts)):
            return False
        made = list(map(_new, itertools.repeat(TensorEntry, k)))
        names = parts[1 :: _GROUPS + 1]
        dtypes, shapes = map(self.dtype_of.__getitem__, heads), map(self.shape_of.__getitem__, heads)
        columns: tuple[Iterable[Any], ...] = (names, dtypes, shapes, starts, stops)
        for setter, column in zip(_ENTRY_SETTERS, columns):  # a frozen dataclass's __init__, by field
            any(map(setter, made, column))
        self.entries += made
        self.names += names
        return True


def _check_layout(entries: Sequence[TensorEntry], path: str) -> None:
    expected = 0
    prev: TensorEntry | None = None
    for e in entries:
        if e.start > expected:
            after = f"between tensor {_q(prev.name)} and" if prev is not None else "before"
            raise HeaderError(
                f"{path}: gap in data section: bytes [{expected}, {e.start}) {after} "
                f"tensor {_q(e.name)} are not covered by any tensor",
                path=path,
                tensor=e.name,
            )
        if e.start < expected:
            assert prev is not None  # expected > 0 only after a tensor
            raise HeaderError(
                f"{path}: tensors {_q(prev.name)} [{prev.start}, {prev.stop}] and "
                f"{_q(e.name)} [{e.start}, {e.stop}] overlap",
                path=path,
                tensor=e.name,
            )
        expected = e.stop
        prev = e


def decode_header(raw: bytes, *, path: str = "<bytes>", file_size: int | None = None) -> Header:
    """Decode and strictly validate a safetensors JSON header.

    Args:
        raw: the header bytes, without the 8-byte length prefix (trailing space
            padding is allowed).
        path: file name used in error messages.
        file_size: total file size in bytes; when given, the data section must
            end exactly at the end of the file.

    Returns:
        The validated :class:`Header`, with ``data_start = 8 + len(raw)``.

    Raises:
        HeaderError: the header is not valid safetensors; the message names the
            path, the tensor when relevant, and what is wrong.
    """
    box = [bytes(raw)]
    del raw  # the box holds the only reference: decoding drops it once the text is made
    return _decode(box, path, file_size)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unpaired(header: Header, path: str) -> None:
    """Refuse a name or metadata text holding an unpaired surrogate (``"\\udcff"``), as
    safetensors does ("lone leading surrogate in hex escape"): no UTF-8 file can name it."""
    meta = header.metadata or {}
    for text in (*(e.name for e in header.entries), *meta, *meta.values()):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise HeaderError(
                f"{path}: {text.encode('utf-8', 'backslashreplace').decode()!r} holds an unpaired "
                "surrogate escape (\\ud800-\\udfff alone); safetensors refuses it",
                path=path,
            ) from None


def _decode(box: list[bytes], path: str, file_size: int | None) -> Header:
    """:func:`decode_header` of the bytes in ``box``, which it empties as soon as it can (a
    200k-tensor header is 23 MB of bytes besides its 23 MB of text)."""
    escaped = _SURROGATE_ESCAPE.search(box[0]) is not None  # \ud800-\udfff: paired, or not
    header = _sibling_header(box[0], path)
    if header is None:
        header = _decoded_header(box, path)
    box.clear()
    if escaped:
        _check_unpaired(header, path)
    if file_size is not None:
        have = file_size - header.data_start
        if have < header.data_size:
            raise HeaderError(
                f"{path}: file is truncated: header says {header.data_size} data bytes, "
                f"file has {max(have, 0)}",
                path=path,
            )
        if have > header.data_size:
            raise HeaderError(
                f"{path}: file has {have - header.data_size} trailing bytes after the data "
                f"section: header says {header.data_size} data bytes, file has {have}",
                path=path,
            )
    return header


@contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic collector off while many small acyclic objects are made, restored after: its
    passes over them as they are made cost as much again (a header's 200k entries: 0.34 s, not
    0.22; a DCP plan's chunks for 10k tensors x 64 ranks: 12 s, not 2.7; the CLI runs with it
    off anyway)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _decoded_header(box: list[bytes], path: str) -> Header:
    """Decode and check the whole header in ``box`` (its entries are remembered for
    :func:`_sibling_header`); the bytes are dropped from the box once decoded to text."""
    global _SHARED
    _SHARED = None  # not this header's section (else it is a sibling's): let it go before decoding
    raw = box[0]
    size = len(raw)
    fast = None
    shared = None
    laid_out = None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        body = _section_start(raw, text)
        if body is not None:
            stop = _unpadded(raw)
            shared = (stop - body, raw[body:stop])
        box.clear()
        del raw  # the text is all the decoding needs
        with no_gc():
            scanned = _scanned_entries(text)
            if scanned is not None:
                fast, laid_out = scanned[:2], scanned[2]
            else:
                fast = _fast_entries(text)
    if fast is not None:
        metadata, entries = fast
    else:  # something is wrong: the strict decoding and the per-entry checks say what
        # the box was emptied when the text was made
        obj = _header_object(text.encode("utf-8") if text is not None else box[0], path)
        metadata = _parse_metadata(obj.get(_METADATA_KEY), path)
        entries = [_parse_entry(name, value, path) for name, value in obj.items() if name != _METADATA_KEY]
    if laid_out is None:
        if any(a.start >= b.start for a, b in zip(entries, entries[1:])):
            entries.sort(key=_layout_key)
        _check_layout(entries, path)
    ordered = tuple(entries)
    if shared is not None and laid_out is not None:  # names unique, data size known: as a sibling's
        _SHARED = (*shared, ordered, laid_out)
        return Header(ordered, metadata, 8 + size)
    header = Header(ordered, metadata, 8 + size)
    if shared is not None:
        _SHARED = (*shared, ordered, header._data_size)
    return header


def _unpadded(raw: bytes) -> int:
    """The length of ``raw`` without its trailing spaces (no copy of a long header)."""
    tail = raw[-64:]
    if tail.strip(b" "):
        return len(raw) - len(tail) + len(tail.rstrip(b" "))
    return len(raw.rstrip(b" "))


_SHARED: tuple[int, bytes, tuple[TensorEntry, ...], int] | None = None
"""The entry section (the header's bytes after ``__metadata__``, without the padding) last decoded:
its length and bytes, its entries and data size.

The rank files of one checkpoint usually list the same tensors with the same local shapes
and offsets and differ only in their metadata (rank, coordinate): their entry sections are
byte-identical, so each sibling file costs a comparison of its section and its metadata's
decoding instead of a 100k-entry JSON parse, and every rank shares one entry per tensor. The
section's bytes are kept, not a digest: comparing 64 files' 11 MB sections took 0.02 s, hashing
them 0.37 s. They are 23 MB at 200k entries: readers of many files drop them (:func:`forget_shared`)
once every header is read."""


def forget_shared() -> None:
    """Let the entries of the header last decoded go (a checkpoint is open: its siblings are read).

    Kept for the next header, they outlived the checkpoint (opening a second one, as ``verify``
    does, held both checkpoints' 200k entries at once: 36 MiB)."""
    global _SHARED
    _SHARED = None


_META_START = b'{"' + _METADATA_KEY.encode() + b'":'


def _section_start(raw: bytes, text: str) -> int | None:
    """Where the header's entry section starts in ``raw`` (its decoded ``text``): after a leading
    ``"__metadata__"`` object, or 0 without one; None when the metadata cannot be split off."""
    if not raw.startswith(_META_START):
        return 0
    try:
        _, end = json.JSONDecoder().raw_decode(text, len(_META_START))
    except (ValueError, RecursionError):
        return None
    return end if len(text) == len(raw) else len(text[:end].encode("utf-8"))


def _sibling_header(raw: bytes, path: str) -> Header | None:
    """The header from the last decoded entry section when this one ends with the same bytes, else None.

    The entries were checked when first decoded; what differs (``__metadata__``, and so the
    data start) is decoded and checked here. The bytes before the section must be a leading
    ``"__metadata__"`` member and nothing else (``{"__metadata__":{...}`` closed by ``}`` is
    an object of that one key), so the header is that member followed by the known section.
    A header that is not well formed is never a hit: its section differs, or what precedes it
    is not one metadata member and the full decoding reports it.
    """
    shared = _SHARED
    stop = _unpadded(raw)
    if shared is None or shared[0] > stop:
        return None
    start = stop - shared[0]
    if start == 0:  # a header without metadata: the whole of it, an object
        if not raw.startswith(b"{"):
            return None
    elif not raw.startswith(_META_START) or raw[start : start + 1] not in (b",", b"}"):
        return None
    if not raw.startswith(shared[1], start):  # compared in place: the section ends at ``stop``
        return None
    metadata = None
    if start:  # only the metadata object is decoded (its bytes copied once: 64 rank files' 6 MB)
        try:
            obj = _header_object(b"".join((memoryview(raw)[:start], b"}")), path)
        except HeaderError:
            return None
        if list(obj) != [_METADATA_KEY]:
            return None
        metadata = _parse_metadata(obj[_METADATA_KEY], path)
    return Header(shared[2], metadata, 8 + len(raw))


def _header_object(raw: bytes, path: str) -> dict[str, object]:
    """The header's JSON object: strict UTF-8 and JSON, no duplicate keys, starting with ``{``."""
    if not raw:
        raise HeaderError(f"{path}: header is empty", path=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{path}: header is not valid UTF-8 (byte {exc.start})", path=path) from None
    # Nesting needs no limit of its own: every value's structure is checked below.
    obj = parse_json_text(text, path=path, what="header", error=HeaderError)
    if not isinstance(obj, dict):
        raise HeaderError(f"{path}: header must be a JSON object, got {_json_type(obj)}", path=path)
    if not text.startswith("{"):
        raise HeaderError(f"{path}: header must start with '{{'", path=path)
    return obj


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file without reading tensor data.

    Args:
        path: the file to read.

    Returns:
        The validated :class:`Header`; the file size is checked against it.

    Raises:
        HeaderError: the file is missing, unreadable, not a regular file (a FIFO or
            a device would block or never end), or not valid safetensors.
    """
    name = os.fspath(path)
    fd, st = open_regular(name, what="safetensors file", error=HeaderError)
    with open(fd, "rb") as f:
        try:
            size = st.st_size
            prefix = f.read(8)
            if size < 8 or len(prefix) < 8:
                raise HeaderError(
                    f"{name}: file is too short to be safetensors: {size} bytes, need at least 8",
                    path=name,
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_SIZE:
                raise HeaderError(
                    f"{name}: header length {n} is over the {MAX_HEADER_SIZE}-byte limit",
                    path=name,
                )
            if n > size - 8:
                raise HeaderError(
                    f"{name}: header length {n} is larger than the file: only "
                    f"{size - 8} bytes follow the length prefix",
                    path=name,
                )
            raw = f.read(n)
        except OSError as exc:
            raise HeaderError(f"{name}: cannot read: {exc.strerror}", path=name) from None
    if len(raw) != n:
        raise HeaderError(
            f"{name}: file is truncated: header length is {n} but only {len(raw)} bytes could be read",
            path=name,
        )
    box = [raw]
    del raw
    return _decode(box, name, size)


# --------------------------------------------------------------------------- encode


def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, Header]:
    """Lay out tensors like the reference writer and build the file prefix.

    Tensors are placed in the order ``safetensors`` (0.8) uses: dtype rank in
    the Rust ``Dtype`` enum descending, then name; offsets start at 0 with no
    gaps. ``prefix + b"".join(raw bytes of each tensor in header.entries order)``
    is byte-identical to ``safetensors.torch.save`` of the same tensors and
    metadata (for metadata with more than one key the reference writer emits
    keys in hash order; here they keep the mapping's iteration order).

    Args:
        tensors: ``(name, dtype, shape)`` for every tensor; any order.
        metadata: optional ``__metadata__`` strings; ``{}`` is written as an
            empty object, None omits the key.

    Returns:
        ``(prefix, header)``: ``prefix`` is the 8-byte little-endian length plus
        the compact JSON header, space-padded so ``len(prefix) % 8 == 0``;
        ``header`` describes it (``header.data_start == len(prefix)``).

    Raises:
        HeaderError: duplicate or invalid names, unknown dtype, invalid shape,
            non-string metadata, or a header over :data:`MAX_HEADER_SIZE`.
    """
    where = "cannot encode header: "
    specs = _checked_specs(tensors, where)
    meta = _checked_metadata(metadata, where)
    specs.sort(key=lambda s: (-_RANK[s[1]], s[0]))
    items = []
    for name, dtype, shape_t in specs:
        numel = 1
        for dim in shape_t:
            numel *= dim
        items.append((_q(name), dtype, ",".join(map(str, shape_t)), numel * DTYPE_SIZES[dtype]))
    meta_text = None if meta is None else json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
    try:
        prefix, starts = header_prefix(items, meta_text)
    except UnicodeEncodeError as exc:
        raise HeaderError(
            f"{where}a tensor name or metadata string is not valid Unicode "
            f"(unpaired surrogate {exc.object[exc.start : exc.end]!r})"
        ) from None
    if len(prefix) - 8 > MAX_HEADER_SIZE:
        raise HeaderError(
            f"{where}header would be {len(prefix) - 8} bytes, over the {MAX_HEADER_SIZE}-byte limit"
        )
    entries = [
        TensorEntry(name, dtype, shape_t, a, a + it[3])
        for (name, dtype, shape_t), it, a in zip(specs, items, starts)
    ]
    return prefix, Header(tuple(entries), meta, len(prefix))


def _checked_specs(
    tensors: Sequence[tuple[str, str, Sequence[int]]], where: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for item in tensors:
        name, dtype, shape = item
        if not isinstance(name, str):
            raise HeaderError(f"{where}tensor name {name!r} is not a string")
        if name == _METADATA_KEY:
            raise HeaderError(f"{where}{_q(name)} is reserved and cannot name a tensor", tensor=name)
        if name in seen:
            raise HeaderError(f"{where}duplicate tensor name {_q(name)}", tensor=name)
        seen.add(name)
        if not isinstance(dtype, str):
            raise HeaderError(f"{where}tensor {_q(name)} has dtype {dtype!r}: must be a string", tensor=name)
        _check_dtype(dtype, name, where, None)
        specs.append((name, dtype, _checked_shape(shape, name, where)))
    return specs


def _checked_shape(shape: Sequence[int], name: str, where: str) -> tuple[int, ...]:
    dims: list[int] = []
    for d in shape:
        try:
            dim = -1 if isinstance(d, bool) else operator.index(d)
        except TypeError:
            dim = -1
        if dim < 0:
            raise HeaderError(
                f"{where}tensor {_q(name)} has invalid shape {list(shape)!r}: must be non-negative integers",
                tensor=name,
            )
        dims.append(dim)
    return tuple(dims)


def _checked_metadata(metadata: Mapping[str, str] | None, where: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    meta: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise HeaderError(f"{where}metadata key {key!r} is not a string")
        if not isinstance(value, str):
            raise HeaderError(
                f"{where}metadata value for {_q(key)} must be a string, got {type(value).__name__} {value!r}"
            )
        meta[key] = value
    return meta


def header_prefix(
    tensors: Sequence[tuple[str, str, str, int]], metadata: str | None
) -> tuple[bytes, Sequence[int]]:
    """The bytes before a safetensors file's data section: the one place they are made.

    No validation and no sorting (callers pass checked values in file order), so
    writers can lay out 100k-tensor files cheaply; :func:`encode_header` validates
    first.

    Args:
        tensors: per tensor in file order: its JSON-quoted name, dtype, shape as text
            (``"2,3"``; ``""`` for 0-d) and data bytes.
        metadata: the JSON text of the ``__metadata__`` object, or None to omit it.

    Returns:
        The prefix (8-byte little-endian length, compact JSON, space-padded to a
        multiple of 8) and each tensor's data offset relative to the data section.

    Raises:
        UnicodeEncodeError: a name or metadata text holds an unpaired surrogate.
    """
    text, starts = entries_text(tensors)
    return b"".join(prefix_parts(text, metadata)), starts


def entries_text(tensors: Sequence[tuple[str, str, str, int]]) -> tuple[tuple[bytes, ...], Sequence[int]]:
    """The tensor entries of a header (``tensors`` as :func:`header_prefix` takes them), comma-joined
    UTF-8 in parts (:func:`joined_entries`), and each tensor's data offset: what sibling rank files
    with equal local shapes share."""
    heads = [entry_head(dtype, shape_text) for _, dtype, shape_text, _ in tensors]
    return joined_entries([t[0] for t in tensors], heads, [t[3] for t in tensors])


def entry_head(dtype: str, shape_text: str) -> str:
    """The text of a header entry between its quoted name and its data offsets (shared by the
    entries of one dtype and shape), e.g. ``:{"dtype":"F32","shape":[2,3],"data_offsets":[``."""
    return f':{{"dtype":"{dtype}","shape":[{shape_text}],"data_offsets":['


def joined_entries(
    quoted: Sequence[str], heads: Sequence[str], sizes: Sequence[int]
) -> tuple[tuple[bytes, ...], array.array[int]]:
    """:func:`entries_text` from per tensor its quoted name, :func:`entry_head` and data bytes.

    The heads are shared per dtype and shape, so an entry costs one short format (100k entries:
    a third of formatting each one whole). The text comes in parts of a few thousand entries
    (each but the last ending in its comma), whose concatenation it is: never joined, so it is
    never held twice (200k entries are 22 MB; TP-64 siblings hold two such texts, one of
    empty pieces).
    """
    stops = array.array("q", itertools.accumulate(sizes))  # 200k as lists: 9 MiB
    starts = array.array("q", [0]) + stops[:-1] if stops else array.array("q")
    step = 16384  # entries formatted at a time: 200k entries' strings at once held 29 MiB
    count = len(stops)
    parts = tuple(
        (
            ",".join(
                [
                    f"{q}{h}{a},{b}]}}"
                    for q, h, a, b in zip(*(s[i : i + step] for s in (quoted, heads, starts, stops)))
                ]
            )
            + ("," if i + step < count else "")
        ).encode("utf-8")
        for i in range(0, count, step)
    )
    return parts, starts


def prefix_parts(entries: Sequence[bytes], metadata: str | Sequence[bytes] | None) -> tuple[bytes, ...]:
    """The header prefix of :func:`entries_text`'s ``entries`` and ``metadata`` (as :func:`header_prefix`),
    in parts whose concatenation it is: what precedes the entries, the entries' parts, what follows.

    Sibling files then share the entries' bytes (a 100k-tensor header is 10 MB) instead of
    each holding a prefix of its own. ``metadata`` may come as the UTF-8 parts of its text:
    each is a part of what precedes the entries, so one shared by sibling files (the per-tensor
    part of a per-rank description) stays one object too.
    """
    if metadata is None:
        head = [b"{"]
    else:
        head = [metadata.encode()] if isinstance(metadata, str) else list(metadata)
        head[0] = f'{{"{_METADATA_KEY}":'.encode() + head[0]
        head[-1] += b"," if entries else b""
    size = sum(map(len, head)) + sum(map(len, entries)) + 1
    head[0] = struct.pack("<Q", size + (-size % 8)) + head[0]
    return (*head, *entries, b"}" + b" " * (-size % 8))
