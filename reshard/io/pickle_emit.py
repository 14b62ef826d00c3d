"""Emit pickle protocol-2 opcodes for objects named by module and class text (pure, no torch).

torch's formats are pickles of torch classes (``torch._utils._rebuild_tensor_v2``,
``torch.distributed.checkpoint.metadata.Metadata``, ...). Python's own pickler can
only name a global it can import, so writing them without importing torch means
emitting the opcodes ourselves. The memo numbering follows CPython's pickler
(every global, string, non-empty tuple, list, dict and reduced object gets the next
``BINPUT``), so a structure built like the one torch pickles gives the same bytes.

>>> from pickletools import dis
>>> p = PickleEmitter()
>>> data = p.dumps(Reduce(Global("collections", "OrderedDict"), ()))
>>> import pickle; pickle.loads(data)
OrderedDict()
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["Global", "Reduce", "NewObj", "PersistentId", "Dict", "Value", "PickleEmitter"]


@dataclass(frozen=True, slots=True)
class Global:
    """A module-level name (class or function), written as ``GLOBAL module\\nname\\n``."""

    module: str
    name: str


@dataclass(frozen=True, slots=True)
class Reduce:
    """``func(*args)``, what ``__reduce__`` returning ``(func, args)`` pickles to."""

    func: Global
    args: tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class NewObj:
    """``cls.__new__(cls, *args)`` then ``BUILD`` with ``state`` (the default for dataclasses)."""

    cls: Global
    state: Value
    args: tuple[Value, ...] = ()


@dataclass(frozen=True, slots=True)
class PersistentId:
    """A persistent reference (``BINPERSID``), how torch points ``data.pkl`` at a storage record."""

    pid: tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class Dict:
    """A dict whose keys are objects (``Metadata.storage_data`` is keyed by ``MetadataIndex``)."""

    items: tuple[tuple[Value, Value], ...]


Value: TypeAlias = (
    "None | bool | int | str | tuple[Value, ...] | list[Value] | dict[str, Value]"
    " | Global | Reduce | NewObj | PersistentId | Dict"
)

_BATCH = 1000  # CPython's pickler batches APPENDS/SETITEMS in groups of this size


class PickleEmitter:
    """One pickle being written: opcodes plus the memo.

    Globals and strings are memoized by value, so a repeated class or key is a
    ``BINGET``; everything CPython memoizes also takes a memo slot here, to keep
    the numbering identical.
    """

    def __init__(self) -> None:
        self._out = bytearray()
        self._memo: dict[tuple[str, str] | str, int] = {}
        self._next = 0

    def dumps(self, obj: Value) -> bytes:
        """The complete pickle (``PROTO 2`` ... ``STOP``) of ``obj``."""
        self._out = bytearray(b"\x80\x02")
        self._memo.clear()
        self._next = 0
        self._save(obj)
        self._out += b"."
        return bytes(self._out)

    def _put(self, key: tuple[str, str] | str | None = None) -> None:
        idx = self._next
        self._next += 1
        if key is not None:
            self._memo[key] = idx
        self._out += b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx)

    def _get(self, key: tuple[str, str] | str) -> bool:
        idx = self._memo.get(key)
        if idx is None:
            return False
        self._out += b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)
        return True

    def _save(self, obj: Value) -> None:
        if obj is None:
            self._out += b"N"
        elif isinstance(obj, bool):
            self._out += b"\x88" if obj else b"\x89"
        elif isinstance(obj, int):
            self._save_int(obj)
        elif isinstance(obj, str):
            if not self._get(obj):
                raw = obj.encode("utf-8")
                self._out += b"X" + struct.pack("<I", len(raw)) + raw
                self._put(obj)
        elif isinstance(obj, tuple):
            self._save_tuple(obj)
        elif isinstance(obj, list):
            self._out += b"]"
            self._put()
            self._appends(obj)
        elif isinstance(obj, dict):
            self._out += b"}"
            self._put()
            self._setitems(list(obj.items()))
        elif isinstance(obj, Dict):
            self._out += b"}"
            self._put()
            self._setitems(list(obj.items))
        else:
            self._save_object(obj)

    def _save_object(self, obj: Global | Reduce | NewObj | PersistentId) -> None:
        """Globals (memoized by name), ``func(*args)``, ``cls.__new__`` + ``BUILD``, persistent ids."""
        if isinstance(obj, Global):
            key = (obj.module, obj.name)
            if not self._get(key):
                self._out += b"c" + f"{obj.module}\n{obj.name}\n".encode()
                self._put(key)
        elif isinstance(obj, Reduce):
            self._save(obj.func)
            self._save_tuple(obj.args)
            self._out += b"R"
            self._put()
        elif isinstance(obj, NewObj):
            self._save(obj.cls)
            self._save_tuple(obj.args)
            self._out += b"\x81"
            self._put()
            self._save(obj.state)
            self._out += b"b"
        else:
            self._save_tuple(obj.pid)
            self._out += b"Q"

    def _save_int(self, v: int) -> None:
        if 0 <= v <= 0xFF:
            self._out += b"K" + bytes([v])
        elif 0 <= v <= 0xFFFF:
            self._out += b"M" + struct.pack("<H", v)
        elif -0x80000000 <= v <= 0x7FFFFFFF:
            self._out += b"J" + struct.pack("<i", v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self._out += b"\x8a" + bytes([len(raw)]) + raw

    def _save_tuple(self, t: tuple[Value, ...]) -> None:
        if not t:
            self._out += b")"
            return
        if len(t) <= 3:
            for x in t:
                self._save(x)
            self._out += b"\x85\x86\x87"[len(t) - 1 : len(t)]
        else:
            self._out += b"("
            for x in t:
                self._save(x)
            self._out += b"t"
        self._put()

    def _appends(self, items: list[Value]) -> None:
        for start in range(0, len(items), _BATCH):
            group = items[start : start + _BATCH]
            if len(group) > 1:
                self._out += b"("
            for item in group:
                self._save(item)
            self._out += b"e" if len(group) > 1 else b"a"

    def _setitems(self, items: list[tuple[str, Value]] | list[tuple[Value, Value]]) -> None:
        for start in range(0, len(items), _BATCH):
            group = items[start : start + _BATCH]
            if len(group) > 1:
                self._out += b"("
            for k, v in group:
                self._save(k)
                self._save(v)
            self._out += b"u" if len(group) > 1 else b"s"
