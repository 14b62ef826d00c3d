"""Bounded reading of small documents: inputs are bounded before they are believed.

A layout file, an HF index or a ``reshard.json`` is read whole, so each read here
refuses what would hang or exhaust memory before a byte is parsed:

- only regular files: a FIFO, a device (``/dev/zero``), a socket or a directory is
  refused at once. Files are opened with ``O_NONBLOCK`` so opening a FIFO cannot
  block, then ``fstat`` decides on the opened file itself (no check-then-open race);
- a size limit, checked on the size and again while reading (a file that grows);
- JSON: duplicate keys, ``NaN``/``Infinity``, integers over Python's digit limit and
  nesting deeper than a limit are errors naming the file, not tracebacks.

>>> load_json(b'{"weight_map": {"a": "x.safetensors"}}', path="index.json")
{'weight_map': {'a': 'x.safetensors'}}
>>> load_json(b'{"a": 1, "a": 2}', path="index.json")
Traceback (most recent call last):
...
reshard.errors.ConfigError: index.json: duplicate key "a" in JSON document
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from typing import Any

from reshard.errors import ConfigError, ReshardError

__all__ = [
    "MAX_LAYOUT_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "file_kind",
    "open_regular",
    "read_document",
    "parse_json_text",
    "load_json",
    "expect_object",
    "expect_shape",
    "expect_strings",
]

#: Largest layout YAML file read (real layouts are a few kB).
MAX_LAYOUT_BYTES = 1 << 20
#: Largest JSON document (HF index, ``reshard.json``) read; an index of 100k tensors is ~10 MB.
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting of JSON arrays/objects accepted; real documents nest 3-4 levels.
MAX_JSON_DEPTH = 32

# O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a non-regular file is (``"a FIFO (named pipe)"``), or None for a regular file.

    >>> file_kind(stat.S_IFREG), file_kind(stat.S_IFIFO)
    (None, 'a FIFO (named pipe)')
    """
    if stat.S_ISREG(mode):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(
    path: str | os.PathLike[str], *, what: str, error: type[ReshardError] = ConfigError
) -> tuple[int, os.stat_result]:
    """Open a file for reading only if it is a regular file; never blocks on a FIFO.

    Args:
        path: the file.
        what: what the file is, for messages (``"layout file"``).
        error: the ReshardError subclass to raise.

    Returns:
        ``(fd, stat)``: an open descriptor (the caller closes it) and its ``fstat``.

    Raises:
        error: missing, unreadable, or not a regular file.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | _NONBLOCK
    try:
        fd = os.open(name, flags)
    except FileNotFoundError:
        raise error(f"{name}: no such file", path=name, hint=f"check the {what} path") from None
    except OSError as exc:
        raise error(f"{name}: cannot open the {what}: {exc.strerror or exc}", path=name) from None
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise error(f"{name}: the {what} is {kind}, not a regular file; pass a regular file", path=name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_document(
    path: str | os.PathLike[str], *, limit: int, what: str, error: type[ReshardError] = ConfigError
) -> bytes:
    """Read a whole small document, refusing non-regular files and anything over ``limit`` bytes.

    Raises:
        error: not a regular file, unreadable, or larger than ``limit``.
    """
    name = os.fspath(path)
    fd, st = open_regular(name, what=what, error=error)
    too_big = f"{name}: the {what} is over the {limit}-byte limit"
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise error(f"{too_big} ({st.st_size} bytes); is this the right file?", path=name)
        try:
            data = f.read(limit + 1)  # one more: a file growing past the limit is caught too
        except OSError as exc:
            raise error(f"{name}: cannot read the {what}: {exc.strerror or exc}", path=name) from None
    if len(data) > limit:
        raise error(f"{too_big}; is this the right file?", path=name)
    return data


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _BadConstantError(Exception):
    def __init__(self, constant: str) -> None:
        super().__init__(constant)
        self.constant = constant


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the first repeated key only then
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return out


def _reject_constant(constant: str) -> Any:
    raise _BadConstantError(constant)


def parse_json_text(text: str, *, path: str, what: str, error: type[ReshardError] = ConfigError) -> object:
    """``json.loads`` that turns every way text can be bad JSON into ``error`` naming ``path``.

    Duplicate keys (JSON would keep the last silently), ``NaN``/``Infinity``, integers
    over Python's digit limit and nesting past the interpreter's recursion limit are
    refused. Callers that accept nesting need :func:`load_json`'s depth limit too.
    """
    bad = f"{path}: {what} is not valid JSON"
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise error(f"{bad}: {exc.msg} (char {exc.pos})", path=path) from None
    except _DuplicateKeyError as exc:
        key = json.dumps(exc.key, ensure_ascii=False)
        raise error(f"{path}: duplicate key {key} in {what}", path=path) from None
    except _BadConstantError as exc:
        raise error(f"{bad}: non-standard constant {exc.constant}", path=path) from None
    except RecursionError:
        raise error(f"{bad}: nested too deeply", path=path) from None
    except ValueError:  # int() refusing a many-thousand-digit integer literal
        digits = sys.get_int_max_str_digits()
        raise error(f"{bad}: a number is too long (over {digits} digits)", path=path) from None


_STRING = re.compile(r'"[^"]*"')
_PAIR = re.compile(r"\[\]|\{\}")
_BRACKETS_ONLY = str.maketrans("", "", "".join(chr(c) for c in range(128) if chr(c) not in "[]{}"))


def _text_depth(text: str, limit: int) -> bool:
    """:func:`_depth` of valid JSON text without backslashes, at C speed (a 100k-tensor
    ``reshard.json``: 70 ms instead of 170): with its strings removed (none holds an escaped
    quote), only brackets are kept and each pass removes the innermost pairs."""
    brackets = _STRING.sub("", text).translate(_BRACKETS_ONLY)
    for _ in range(limit):
        if not brackets:
            return True
        brackets = _PAIR.sub("", brackets)
    return not brackets


def _depth(value: object, limit: int) -> bool:
    """Whether ``value`` nests arrays/objects at most ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if level > limit:
            return False
        stack.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    return True


def load_json(
    source: str | os.PathLike[str] | bytes,
    *,
    limit: int = MAX_JSON_BYTES,
    depth: int = MAX_JSON_DEPTH,
    what: str = "JSON document",
    path: str | None = None,
    error: type[ReshardError] = ConfigError,
) -> object:
    """Read (if given a path) and parse a bounded JSON document.

    Args:
        source: a file path, or the document's bytes.
        limit: largest size accepted, in bytes.
        depth: deepest nesting of arrays/objects accepted.
        what: what the document is, for messages (``"HF index"``).
        path: the name used in messages when ``source`` is bytes.
        error: the ReshardError subclass to raise.

    Returns:
        The decoded value.

    Raises:
        error: not a regular file, too big, not UTF-8, not JSON, duplicate keys,
            non-standard constants, huge integers, or nested too deeply.
    """
    if isinstance(source, bytes):
        name = path or "<bytes>"
        if len(source) > limit:
            raise error(f"{name}: the {what} is over the {limit}-byte limit ({len(source)} bytes)", path=name)
        raw = source
    else:
        name = os.fspath(source)
        raw = read_document(name, limit=limit, what=what, error=error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{name}: {what} is not valid UTF-8 (byte {exc.start})", path=name) from None
    del raw  # (a 200k-tensor HF index: 17 MB not held through the parse)
    value = parse_json_text(text, path=name, what=what, error=error)
    if not (_text_depth(text, depth) if "\\" not in text else _depth(value, depth)):
        raise error(f"{name}: {what} nests deeper than {depth} levels; is this the right file?", path=name)
    return value


# -- typed access to decoded documents ------------------------------------------------
#
# A decoded document is untrusted: ``data["tensors"][name]["shape"]`` may be a string,
# ``"abc"``, or a list of 5000-digit ints. These turn each wrong type into ``error``
# naming the file and the field, instead of a TypeError deep in a caller.

_MAX_INT64 = (1 << 63) - 1


def _shown(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def expect_object(
    value: object, *, path: str, field: str, error: type[ReshardError] = ConfigError
) -> dict[str, Any]:
    """``value`` if it is a JSON object, else ``error`` naming ``path`` and ``field``.

    >>> expect_object("x", path="rank-0.safetensors", field='reshard.tensors["w"]')
    Traceback (most recent call last):
    ...
    reshard.errors.ConfigError: rank-0.safetensors: reshard.tensors["w"] must be an object, got "x"
    """
    if not isinstance(value, dict):
        raise error(f"{path}: {field} must be an object, got {_shown(value)}", path=path)
    return value


def expect_shape(
    value: object, *, path: str, field: str, error: type[ReshardError] = ConfigError
) -> tuple[int, ...]:
    """``value`` as a shape: a list of integers from 0 to 2**63 - 1 whose running product stays there.

    >>> expect_shape([2, 3], path="f", field="shape")
    (2, 3)
    >>> expect_shape("abc", path="r0.safetensors", field="shape")
    Traceback (most recent call last):
    ...
    reshard.errors.ConfigError: r0.safetensors: shape must be a list of non-negative integers, got "abc"
    """
    ok = isinstance(value, list)
    n = 1
    for d in value if isinstance(value, list) else ():
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= _MAX_INT64:
            ok = False
            break
        n *= d
        if n > _MAX_INT64:
            ok = False
            break
    if not ok:
        raise error(
            f"{path}: {field} must be a list of non-negative integers, got {_shown(value)}"
            + (" (over int64)" if isinstance(value, list) and n > _MAX_INT64 else ""),
            path=path,
        )
    assert isinstance(value, list)
    return tuple(value)


def expect_strings(
    value: object, *, path: str, field: str, error: type[ReshardError] = ConfigError
) -> list[str]:
    """``value`` if it is a list of strings (placements, mesh dim names), else ``error``.

    >>> expect_strings(["R", "S(0)"], path="f", field="placements")
    ['R', 'S(0)']
    """
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise error(f"{path}: {field} must be a list of strings, got {_shown(value)}", path=path)
    return value
