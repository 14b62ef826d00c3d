"""Large ``--json`` documents written as they are made, in memory bounded by a batch (pure).

``inspect --json`` of a 200k-tensor checkpoint is a 60 MB document: built whole (200k row
dicts) and encoded whole (one 60 MB bytes object) it cost 330 MB. :func:`write_compact`
writes the top-level object field by field and the items of its lists in batches, and the
items of a :class:`Rows` list are made while they are written, so neither the objects nor
the text of the whole document are ever held.

The text is the one the document gave encoded whole: orjson's bytes when orjson takes the
whole document and they are ASCII without DEL (then they are ``json.dumps(doc,
separators=(",", ":"))``'s text, floats aside: orjson writes ``1e-7`` where Python writes
``1e-07``), the stdlib's compact text otherwise. Whether a late row holds a non-ASCII name
is only known when it is made, so the items of a :class:`Rows` list hold no floats (their
text is the same from both encoders), and the fields written before a :class:`Rows` list
must give the same text from both; a document whose early fields do not is made whole
first (never the case in reshard's reports).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

__all__ = ["Rows", "BATCH", "items", "materialized", "write_compact"]

BATCH = 4096
"""List items encoded per call: a few MB of text at most for inspect's rows."""


class Rows:
    """A list of a document whose items are made as they are iterated (each iteration anew).

    Its items must hold no floats (ints, strings, booleans, None, lists and dicts of them):
    see the module's docstring.
    """

    __slots__ = ("_len", "_make")

    def __init__(self, length: int, make: Callable[[], Iterable[Any]]) -> None:
        self._len = length
        self._make = make

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        return iter(self._make())


def items(doc: Mapping[str, Any]) -> int:
    """Number of items in the top-level lists of ``doc`` (what makes a document large)."""
    return sum(len(v) for v in doc.values() if isinstance(v, (list, Rows)))


def materialized(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with its :class:`Rows` made into lists."""
    return {k: list(v) if isinstance(v, Rows) else v for k, v in doc.items()}


def _orjson_module() -> Any:
    try:
        import orjson
    except ImportError:  # no wheel for this platform: the stdlib writes everything
        return None
    return orjson


def _fast(value: Any) -> bytes | None:
    """orjson's text of ``value`` when it is ASCII without DEL (the stdlib escapes both: other
    characters as ``\\u00e9``, DEL as ``\\u007f``); None for a value orjson does not take (an int
    over 64 bits, a lone surrogate) or without orjson."""
    orjson = _orjson_module()
    if orjson is None:
        return None
    try:
        raw: bytes = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return None
    return raw if raw.isascii() and b"\x7f" not in raw else None


def _std(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("ascii")


def _batches(value: Iterable[Any], batch: int) -> Iterator[list[Any]]:
    if isinstance(value, list):
        for i in range(0, len(value), batch):
            yield value[i : i + batch]
        return
    it = iter(value)
    while chunk := list(islice(it, batch)):
        yield chunk


def _parts(value: Any, batch: int) -> Iterator[Any]:
    """What a field is encoded as: its list's batches, or itself."""
    if isinstance(value, (list, Rows)):
        yield from _batches(value, batch)
    else:
        yield value


def write_compact(
    doc: Mapping[str, Any], write: Callable[[bytes | memoryview], object], *, batch: int = BATCH
) -> None:
    """Write ``doc`` as one compact JSON text (no newline) through ``write``, a batch at a time.

    Args:
        doc: a JSON object with string keys; top-level lists and :class:`Rows` are written
            ``batch`` items per encoder call, a :class:`Rows` list made as it is written.
        write: takes each piece of the text (bytes or a memoryview of them).
        batch: list items per encoder call.
    """
    fields = list(doc.items())
    made = [i for i, (_, v) in enumerate(fields) if isinstance(v, Rows)]
    # orjson's text for the whole document unless a field written now refuses it; the rows
    # decide the rest as they are made
    whole = all(_fast(k) is not None for k, _ in fields) and all(
        _fast(part) is not None for _, v in fields if not isinstance(v, Rows) for part in _parts(v, batch)
    )
    if whole and made:
        early = [v for _, v in fields[: made[-1]] if not isinstance(v, Rows)]
        if any(_fast(part) != _std(part) for v in early for part in _parts(v, batch)):
            write_compact(materialized(doc), write, batch=batch)  # floats before the rows
            return
    write(b"{")
    for i, (key, value) in enumerate(fields):
        write((b"," if i else b"") + _std(key) + b":")
        rows = isinstance(value, Rows)
        if not (rows or isinstance(value, list)):
            fast = _fast(value) if whole else None
            write(fast if fast is not None else _std(value))
            continue
        write(b"[")
        for j, part in enumerate(_batches(value, batch)):
            # rows hold no floats: orjson's text is the stdlib's whenever it is ASCII
            raw = _fast(part) if whole or rows else None
            if raw is None:
                raw = _std(part)
                whole = whole and not rows
            if j:
                write(b",")
            write(memoryview(raw)[1:-1])
        write(b"]")
    write(b"}")
