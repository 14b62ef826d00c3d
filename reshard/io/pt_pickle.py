"""The ``data.pkl`` of a ``torch.save`` state dict, read by learnt item templates (no code runs).

A veRL-style rank file of 100k DTensors has a 37 MB ``data.pkl``: the C unpickler with
reshard's stand-ins (:func:`~reshard.io.unpickle.load_torch_save`) keeps every object of it
in its memo until the load ends (~300 MiB) and calls a Python stand-in per object. torch's
pickler writes every tensor of one kind (dtype, global shape, placements) with the same
opcodes but for the key, the storage record and the local size and stride: this decoder
reads such items with a regular expression learnt from one of them and builds only the
values the C path would build (:class:`StoredTensor`, :class:`StoredDTensor`).

How it stays the C path's twin:

- Only protocol 2 (``torch.save``'s) and dicts (``{}``, ``OrderedDict``) of items are read
  here; every item no template matches (the first of each kind, non-tensor leaves) is run
  through the C unpickler itself, with the same allow-list and persistent loads, on its own
  bytes with the memo entries it refers to (renumbered): a reference to an entry this
  decoder did not keep fails and the whole file goes to the C path.
- Memo indices must be the pickler's: each put takes the next index (so no entry is ever
  overwritten and a reference means the same object in both paths).
- An item run by the C unpickler may not change an object made before it (a memo entry):
  no ``BUILD``, ``SETITEM(S)`` or ``APPEND(S)`` on anything but what the item made.
- A template is the learnt item's bytes, literal but for the key, the storage key, its
  element count, the storage offset, the local size and stride (the fields of
  ``_rebuild_tensor_v2``, read with the same checks) and the memo put indices. It is kept
  only if it decodes the item it was learnt from to the value the C unpickler made of it,
  its references go to objects made before the item, and that value is the local tensor
  itself (a tensor, a parameter) or a DTensor of that local tensor: every later item it
  matches runs the same opcodes on the same objects, so the C path would make the same
  DTensor around the new local tensor.
- Anything else (another protocol, an opcode outside the set, an error of any kind) raises
  :class:`Unsupported`: the C path reads the file and gives the verdict and the message.
"""

from __future__ import annotations

import collections
import re
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from operator import itemgetter
from typing import Any

from ..errors import HeaderError
from .header import MAX_INT64

__all__ = ["Unsupported", "decode_state_pickle"]


class Unsupported(Exception):
    """This decoder leaves the pickle to the C unpickler (the reference path)."""


# an int: BININT1, BININT2, BININT, LONG1 of 1-8 bytes (CPython's pickler never writes LONG1 of 0)
_INT = rb"(?:K.|M..|J....|" + b"|".join(rb"\x8a" + bytes([k]) + b"." * k for k in range(1, 9)) + b")"
_INT_RE = re.compile(_INT, re.S)
# an int tuple: (), 1-3 ints and TUPLE1-3, or MARK ints TUPLE (its memo put follows, outside)
_TUPLE = rb"(?:\)|" + _INT + rb"\x85|" + _INT + rb"{2}\x86|" + _INT + rb"{3}\x87|\(" + _INT + rb"*t)"
_PUT = rb"r(....)"
_PUT_OPT = rb"(?:r(....))?"
_U32 = struct.Struct("<I")

# opcodes read here (protocol 2 as CPython's pickler writes it, and a few more): argument sizes
_FIXED = {
    **dict.fromkeys(b"(.012NaebdlstuR)]}\x85\x86\x87\x88\x89\x81Q", 0),
    **dict.fromkeys(b"KhqC", 1),
    **dict.fromkeys(b"M", 2),
    **dict.fromkeys(b"Jjr", 4),
    **dict.fromkeys(b"G", 8),
}
_LEN = {ord("X"): 4, ord("B"): 4, ord("C"): 1, 0x8A: 1, 0x8B: 4}
_GETS = frozenset(b"hj")
_INT_OPS = frozenset(b"KMJ\x8a")
_DIGITS = b"0123456789"
_OD_GLOBAL = b"collections\nOrderedDict\n"
_PUTS = frozenset(b"qr")
_MAX_C_RUNS = 2000
_MAX_TEMPLATES = 256
_WARM = 256  # templates are learnt and used once puts are LONG_BINPUTs
_MAX_MEMO = 1 << 24


@dataclass(slots=True)
class _Tok:
    op: int
    start: int
    end: int
    idx: int  # memo index of a GET / PUT, else -1


@dataclass(eq=False, slots=True)
class _Template:
    """A learnt item: its expression, where its fields and memo puts are among the match's groups,
    the local tensor's dtype and the bytes an element of its storage takes (1 for untyped bytes),
    and the learnt item's value (the local tensor, or the DTensor around it)."""

    rx: re.Pattern[bytes]
    put_groups: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    field_groups: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    dtype: str
    itemsize: int
    value: Any
    dtensor: bool


class _Decoder:
    def __init__(self, data: bytes, path: str, load: Callable[..., Any], stand_ins: dict[str, Any]) -> None:
        self.data = data
        self.path = path
        self.load = load  # (bytes, memo) -> (object, memo) through the C unpickler
        self.si = stand_ins
        self.memo: dict[int, Any] = {}  # the entries kept (made by C runs)
        self.n = 0  # the next memo index
        self.c_runs = 0
        self.items = 0
        self.templates: list[_Template] = []
        self.hints: dict[bytes, _Template] = {}
        self.tuples: dict[bytes, tuple[int, ...]] = {}
        self.stored_tensor = stand_ins["StoredTensor"]
        self.stored_dtensor = stand_ins["StoredDTensor"]

    # ------------------------------------------------------------------ structure

    def decode(self) -> Any:
        data = self.data
        if data[:2] != b"\x80\x02" or not self._is_container(2):
            raise Unsupported
        obj, pos, extra = self._container(2)
        if extra is not None or pos != len(data) - 1 or data[pos] != 0x2E:
            raise Unsupported
        return obj

    def _put_at(self, pos: int) -> int:
        """Check the memo put at ``pos`` takes the next index; the position after it."""
        data = self.data
        op = data[pos]
        if op == 0x71:
            idx, end = data[pos + 1], pos + 2
        elif op == 0x72:
            idx, end = int.from_bytes(data[pos + 1 : pos + 5], "little"), pos + 5
        else:
            raise Unsupported
        self._next_put(idx)
        return end

    def _next_put(self, idx: int) -> None:
        """Take memo index ``idx``: the next one, or Unsupported (HeaderError past any pickler's)."""
        if idx != self.n:
            if idx > max(len(self.data), _MAX_MEMO):
                # no pickler numbers past its opcodes; the C unpickler would size its memo array by it
                raise HeaderError(
                    f"{self.path}: not a valid torch.save pickle (memo index {idx} in a "
                    f"{len(self.data)}-byte data.pkl); the file is damaged or not written by torch",
                    path=self.path,
                )
            raise Unsupported
        self.n += 1

    def _is_container(self, pos: int) -> bool:
        """Whether a dict (``}`` and its put) or ``OrderedDict()`` (the class, ``()``, ``REDUCE``) starts
        at ``pos``."""
        data = self.data
        op = data[pos]
        if op == 0x7D:
            return data[pos + 1] in _PUTS
        if op == 0x63:
            at = pos + 1 + len(_OD_GLOBAL)
            if data[pos + 1 : at] != _OD_GLOBAL or data[at] not in _PUTS:
                return False
            return data[at + (2 if data[at] == 0x71 else 5) : at + (4 if data[at] == 0x71 else 7)] == b")R"
        if op in _GETS:
            idx, at = self._get_at(pos)
            return self.memo.get(idx) is self.si["OrderedDict"] and data[at : at + 2] == b")R"
        return False

    def _container(self, pos: int) -> tuple[Any, int, Any]:
        """The dict or ``OrderedDict()`` at ``pos`` (:meth:`_is_container`) and its items: the object,
        the position after it, and an item read after it that is not its own (see :meth:`_item`)."""
        data = self.data
        if data[pos] == 0x7D:
            obj: Any = {}
            pos = self._put_at(pos + 1)
        else:
            if data[pos] == 0x63:
                self.memo[self.n] = self.si["OrderedDict"]
                pos = self._put_at(pos + 1 + len(_OD_GLOBAL))
            else:
                pos = self._get_at(pos)[1]
            pos = self._put_at(pos + 2)  # ) R
            obj = collections.OrderedDict()
        while True:
            op = data[pos]
            if op == 0x28:  # MARK: a batch of items, then SETITEMS
                pos += 1
                while data[pos] != 0x75:
                    key, value, pos, extra = self._item(pos)
                    obj[key] = value
                    while extra is not None:
                        key, value, pos, extra = extra
                        obj[key] = value
                pos += 1
            elif op == 0x58:  # one item then SETITEM, or (after an empty dict) the next item of its parent
                item = self._item(pos)
                if item[3] is not None or data[item[2]] != 0x73:
                    return obj, pos, item
                obj[item[0]] = item[1]
                pos = item[2] + 1
            else:
                break
        if type(obj) is collections.OrderedDict and data[pos] not in (0x2E, 0x75, 0x73):
            pos = self._build_state(pos, obj)
        return obj, pos, None

    def _get_at(self, pos: int) -> tuple[int, int]:
        data = self.data
        if data[pos] == 0x68:
            return data[pos + 1], pos + 2
        return int.from_bytes(data[pos + 1 : pos + 5], "little"), pos + 5

    def _build_state(self, pos: int, obj: Any) -> int:
        """The ``BUILD`` of an ``OrderedDict`` (a module state dict's ``_metadata``), by the C unpickler."""
        toks, end = self._tokens(pos, 1, stop=0x62)
        self._c_run(toks, 1, build=obj)
        return end + 1

    # ------------------------------------------------------------------ items

    def _item(self, pos: int) -> tuple[str, Any, int, Any]:
        """The item at ``pos``: key, value, the position after it, and (when the value is a dict
        whose batches end where its parent's next item starts) that next item, read the same way."""
        data = self.data
        self.items += 1
        if data[pos] == 0x58:
            n = int.from_bytes(data[pos + 1 : pos + 5], "little")
            kend = pos + 5 + n
            if data[kend] in _PUTS:
                if self.n >= _WARM:  # (a template never matches a dict: it starts with a GET)
                    got = self._templated(pos, kend)
                    if got is not None:
                        return got
                vpos = kend + (2 if data[kend] == 0x71 else 5)
                if self._is_container(vpos):
                    key = str(data[pos + 5 : kend], "utf-8", "surrogatepass")
                    self._put_at(kend)
                    value, end, extra = self._container(vpos)
                    return key, value, end, extra
        toks, end = self._tokens(pos, 2)
        start_n = self.n
        key, value, made = self._c_run(toks, 2)
        if type(key) is str and start_n >= _WARM and len(self.templates) < _MAX_TEMPLATES:
            self._learn(toks, start_n, key, value, made)
        return key, value, end, None

    def _templated(self, pos: int, kend: int) -> tuple[str, Any, int, None] | None:
        """The item at ``pos`` read by a template (as :meth:`_item`), or None when none reads it."""
        data = self.data
        kb = data[pos + 5 : kend]
        hint = kb.translate(None, _DIGITS)
        t = self.hints.get(hint)
        m = None if t is None else t.rx.match(data, kend)
        if m is None:
            for t in reversed(self.templates):
                m = t.rx.match(data, kend)
                if m is not None:
                    self.hints[hint] = t
                    break
            else:
                return None
        assert t is not None
        n = self.n
        gs = m.groups()
        puts = b"".join(filter(None, t.put_groups(gs)))
        k = len(puts) >> 2
        if puts != array("I", range(n, n + k)).tobytes():
            return None
        local = self._local(t, *t.field_groups(gs))
        if local is None:
            return None
        self.n = n + k
        key = str(kb, "utf-8", "surrogatepass")
        if t.dtensor:
            v = t.value
            return key, self.stored_dtensor(local, v.dtype, v.shape, v.mesh, v.placements), m.end(), None
        return key, local, m.end(), None

    def _int_tuple(self, b: bytes) -> tuple[int, ...]:
        t = self.tuples.get(b)
        if t is None:
            t = tuple(_int_of(m.group()) for m in _INT_RE.finditer(b, 1 if b[:1] == b"(" else 0))
            if len(self.tuples) < 4096:
                self.tuples[b] = t
        return t

    def _local(
        self, t: _Template, klen: bytes, key: bytes, numel: bytes, off: bytes, size: bytes, stride: bytes
    ) -> Any:
        """The local tensor of a templated item as ``_rebuild_tensor_v2`` makes it (the checks of
        ``storage_persistent_load`` and ``_rebuild``); None where the C path would fail."""
        if klen[0] != len(key):
            return None
        numel_v, off_v = _int_of(numel), _int_of(off)
        sz, st = self._int_tuple(size), self._int_tuple(stride)
        if numel_v < 0 or off_v < 0 or len(sz) != len(st) or (sz and min(sz) < 0) or (st and min(st) < 0):
            return None
        if prod(sz) > MAX_INT64:  # the C path names the size (over int64 elements)
            return None
        return self.stored_tensor(str(key, "ascii"), t.dtype, numel_v * t.itemsize, off_v, sz, st)

    # ------------------------------------------------------------------ the C unpickler on one item

    def _tokens(self, pos: int, depth: int, stop: int = -1) -> tuple[list[_Tok], int]:  # noqa: C901
        """The opcodes from ``pos`` to where ``depth`` new stack items stand with no MARK open and
        the next opcode starts another item (a key, or the end of the batch / ``stop``)."""
        data = self.data
        toks: list[_Tok] = []
        d = 0
        marks: list[int] = []
        end = len(data)
        while pos < end:
            op = data[pos]
            if d == depth and not marks and toks and (op == stop if stop >= 0 else op in b"Xus"):
                return toks, pos
            n = _FIXED.get(op)
            idx = -1
            if n is not None:
                stop_at = pos + 1 + n
                if op in _GETS or op in _PUTS:
                    idx = data[pos + 1] if n == 1 else int.from_bytes(data[pos + 1 : pos + 5], "little")
            elif op in _LEN:
                w = _LEN[op]
                stop_at = pos + 1 + w + int.from_bytes(data[pos + 1 : pos + 1 + w], "little")
            elif op == 0x63:
                a = data.find(b"\n", pos)
                b = data.find(b"\n", a + 1) if a >= 0 else -1
                if b < 0:
                    raise Unsupported
                stop_at = b + 1
            else:
                raise Unsupported
            if stop_at > end:
                raise Unsupported
            toks.append(_Tok(op, pos, stop_at, idx))
            pos = stop_at
            # stack depth (marks kept apart); anything popping below the start is refused
            if op == 0x28:
                marks.append(d)
                continue
            if op in b"tlduea":  # TUPLE LIST DICT SETITEMS APPENDS  (APPEND: below)
                if op == 0x61:
                    d -= 1
                elif not marks:
                    raise Unsupported
                else:
                    k = marks.pop()
                    d = k + (1 if op in b"tld" else 0)
            elif op == 0x31:  # POP_MARK
                if not marks:
                    raise Unsupported
                d = marks.pop()
            else:
                d += _EFFECT.get(op, 0)
            if d < (marks[-1] if marks else 0) or d < 0:
                raise Unsupported
            if op == 0x2E:
                raise Unsupported
        raise Unsupported

    def _c_run(self, toks: list[_Tok], depth: int, build: Any = None) -> Any:
        """Run ``toks`` through the C unpickler, its memo entries renumbered from 0: returns the
        ``depth`` items they leave (key and value) and the entries they made, by global index.
        With ``build``, the tokens are an object's state and ``BUILD`` applies it to ``build``."""
        self.c_runs += 1
        if self.c_runs > _MAX_C_RUNS or (self.items > 4000 and self.c_runs * 2 > self.items):
            raise Unsupported  # not a file of repeated items: the C path reads it faster
        data, memo = self.data, self.memo
        local: dict[int, int] = {}  # global memo index -> local
        objs: dict[int, Any] = {}  # local index -> an older object the run refers to
        out = bytearray(b"\x80\x02")
        fresh: list[bool] = []  # per stack item: made by this run (False: may be an older object)
        marks: list[int] = []
        if build is not None:  # the object the state is for, as local entry 0 (BUILD on it is the point)
            objs[0] = build
            out += b"h\x00"
            fresh.append(True)
        else:
            out += b"("
        puts: list[tuple[int, int]] = []  # (global, local)
        for t in toks:
            op = t.op
            if op in _GETS:
                li = local.get(t.idx)
                if li is None:
                    if t.idx not in memo:
                        raise Unsupported  # an entry this decoder did not keep
                    li = local[t.idx] = len(objs) + len(puts)
                    objs[li] = memo[t.idx]
                out += b"j" + _U32.pack(li)
                fresh.append(False)
            elif op in _PUTS:
                self._next_put(t.idx)
                li = local[t.idx] = len(objs) + len(puts)
                puts.append((t.idx, li))
                out += b"r" + _U32.pack(li)
            else:
                out += data[t.start : t.end]
                _fresh_step(op, fresh, marks)
        if build is not None:
            _fresh_step(0x62, fresh, marks)
            out += b"b."
        else:
            out += b"t."
        older = {k: _snapshot(v) for k, v in objs.items() if v is not build}
        got, lmemo = self.load(bytes(out), objs)
        if any(_snapshot(objs[k]) != v for k, v in older.items()):
            raise Unsupported  # the run changed an older object
        made = {}
        for g, li in puts:
            made[g] = memo[g] = lmemo[li]
        if build is not None:
            return None
        if type(got) is not tuple or len(got) != depth:
            raise Unsupported
        return got[0], got[1], made

    # ------------------------------------------------------------------ learning

    def _learn(  # noqa: C901
        self, toks: list[_Tok], start_n: int, key: str, value: Any, made: dict[int, Any]
    ) -> None:
        """A template from an item the C unpickler read (see the module docstring)."""
        si = self.si
        local_v: Any
        if type(value) is si["StoredDTensor"]:
            local_v, dtensor = value.local, True
        elif type(value) is si["StoredTensor"]:
            local_v, dtensor = value, False
        else:
            return
        ops = bytes(t.op for t in toks)
        if ops.count(b"Q") != 1 or ops[:2] != b"Xr":
            return
        if any((t.op in _GETS and t.idx >= start_n) or (t.op in _PUTS and t.idx < _WARM) for t in toks):
            return  # a reference inside the item (its index moves from item to item), or a BINPUT
        q = ops.index(b"Q")
        # GET(_rebuild_tensor_v2) ( ( GET('storage') GET(class) X(key) PUT GET(location) INT t PUT Q
        pre = toks[q - 11 : q] if q >= 11 else []
        shape = "".join("G" if t.op in _GETS else "I" if t.op in _INT_OPS else chr(t.op) for t in pre)
        if shape != "G((GGXrGItr":
            return
        rb, sk, cls = (self.memo.get(pre[i].idx) for i in (0, 3, 4))
        if rb is not si["rebuild_v2"] or sk != "storage" or type(cls) is not si["StorageType"]:
            return
        storage_dtype = cls.dtype  # type: ignore[union-attr]
        # Q INT(offset) TUPLE(size) [PUT] TUPLE(stride) [PUT]
        i = q + 1
        if i >= len(toks) or toks[i].op not in _INT_OPS:
            return
        fields = {pre[5].start: "key", pre[8].start: "numel", toks[i].start: "off"}
        ends: dict[int, int] = {}
        i += 1
        for field in ("size", "stride"):
            j = _tuple_end(toks, i)
            if j is None:
                return
            fields[toks[i].start] = field
            ends[toks[i].start] = j
            i = j + (1 if j < len(toks) and toks[j].op in _PUTS else 0)
        # requires_grad, OrderedDict(), the call: the local tensor is what that REDUCE made (and what
        # the value is, or holds), not an older tensor beside an unused rebuild
        tail = toks[i : i + 9]
        if "".join("G" if t.op in _GETS else chr(t.op) for t in tail[1:]) != "G)RrtrRr":
            return
        if tail[0].op not in (0x88, 0x89) or made.get(tail[8].idx) is not local_v:
            return
        # the template: literal bytes, groups for the fields and for the puts (from the key's put on)
        data = self.data
        parts: list[bytes] = []
        puts: list[int] = []
        where: dict[str, int] = {}
        group = 0
        ti = 1
        while ti < len(toks):
            t = toks[ti]
            name = fields.get(t.start)
            ti += 1
            if name == "key":
                parts.append(rb"X(.)\x00\x00\x00([0-9]{1,20})")
                where["klen"], where["key"] = group, group + 1
                group += 2
            elif name in ("numel", "off"):
                parts.append(b"(" + _INT + b")")
                where[name] = group
                group += 1
            elif name is not None:  # an int tuple, and its memo put if it has one
                parts.append(b"(" + _TUPLE + b")" + _PUT_OPT)
                where[name] = group
                puts.append(group + 1)
                group += 2
                ti = ends[t.start]
                if ti < len(toks) and toks[ti].op in _PUTS:
                    ti += 1
            elif t.op in _PUTS:
                parts.append(_PUT)
                puts.append(group)
                group += 1
            else:
                parts.append(re.escape(data[t.start : t.end]))
        dtype: str = local_v.dtype  # type: ignore[union-attr]
        itemsize = 1 if storage_dtype is None else si["itemsize"](dtype)
        getter = itemgetter(*(where[f] for f in ("klen", "key", "numel", "off", "size", "stride")))
        tpl = _Template(
            re.compile(b"".join(parts), re.S), itemgetter(*puts), getter, dtype, itemsize, value, dtensor
        )
        # it must read the item it was learnt from as the C unpickler did
        m = tpl.rx.match(data, toks[1].start)
        if m is None or m.end() != toks[-1].end or len(puts) < 2 or storage_dtype != dtype:
            return
        gs = m.groups()
        if self._local(tpl, *getter(gs)) != local_v:
            return
        got = b"".join(filter(None, tpl.put_groups(gs)))
        k = len(got) >> 2
        if got != array("I", range(start_n, start_n + k)).tobytes() or start_n + k != self.n:
            return
        self.templates.append(tpl)
        self.hints[key.encode("utf-8", "surrogatepass").translate(None, _DIGITS)] = tpl


def _tuple_end(toks: list[_Tok], i: int) -> int | None:
    """The token after an int tuple starting at ``toks[i]`` (``)``, ints + TUPLE1-3, ``(`` ints ``t``)."""
    if i >= len(toks):
        return None
    op = toks[i].op
    if op == 0x29:
        return i + 1
    j = i + 1 if op == 0x28 else i
    k = 0
    while j < len(toks) and toks[j].op in b"KMJ\x8a":
        j += 1
        k += 1
    if j >= len(toks):
        return None
    end = toks[j].op
    if op == 0x28:
        return j + 1 if end == 0x74 else None
    if (k, end) in ((1, 0x85), (2, 0x86), (3, 0x87)):
        return j + 1
    return None


_EFFECT = {
    **dict.fromkeys(b"XBCKMJ\x8a\x8bNG\x88\x89)]}hjc2", 1),
    **dict.fromkeys(b"qrQ\x85", 0),
    **dict.fromkeys(b"R\x81b0", -1),
    0x86: -1,
    0x87: -2,
    0x73: -2,  # SETITEM
    0x2E: -1,
}


def _fresh_step(op: int, fresh: list[bool], marks: list[int]) -> None:  # noqa: C901 - one opcode a branch
    """What ``op`` does to the stack's "made by this run" marks; Unsupported when it would change
    an object made before (a memo entry, or what a stand-in returned of one)."""
    if op == 0x28:
        marks.append(len(fresh))
    elif op in b"XBCKMJ\x8a\x8bNG\x88\x89)]}":
        fresh.append(True)
    elif op == 0x63:
        fresh.append(False)  # a global: shared
    elif op == 0x32:
        fresh.append(fresh[-1])
    elif op == 0x30:
        fresh.pop()
    elif op == 0x85:  # TUPLE1: as its item (a tuple holding an older object may hand it on)
        pass
    elif op in b"\x86\x87":
        k = 2 if op == 0x86 else 3
        f = all(fresh[-k:])
        del fresh[-k:]
        fresh.append(f)
    elif op in b"tld":
        k = marks.pop()
        f = all(fresh[k:])
        del fresh[k:]
        fresh.append(f if op == 0x74 else True)
    elif op == 0x31:
        del fresh[marks.pop() :]
    elif op == 0x51:  # BINPERSID: a new storage reference
        fresh[-1] = True
    elif op == 0x52:  # REDUCE: a stand-in may return its argument (_get_layout)
        a = fresh.pop()
        fresh[-1] = a
    elif op == 0x81:  # NEWOBJ: a new instance
        fresh.pop()
        fresh[-1] = True
    elif op == 0x62:  # BUILD
        fresh.pop()
        if not fresh[-1]:
            raise Unsupported
    elif op == 0x73:  # SETITEM
        del fresh[-2:]
        if not fresh[-1]:
            raise Unsupported
    elif op in b"ue":  # SETITEMS, APPENDS
        k = marks.pop()
        del fresh[k:]
        if not fresh[-1]:
            raise Unsupported
    elif op == 0x61:  # APPEND
        fresh.pop()
        if not fresh[-1]:
            raise Unsupported
    else:
        raise Unsupported


def _snapshot(obj: Any) -> Any:
    """What a run could change of an older object: its items and attributes (by identity)."""
    if isinstance(obj, (str, int, float, bytes, type(None))):
        return None
    items: Any = None
    if isinstance(obj, dict):
        items = [(k, id(v)) for k, v in obj.items()]
    elif isinstance(obj, (list, set)):
        items = [id(v) for v in obj]
    attrs = getattr(obj, "__dict__", None)
    slots = tuple(
        id(getattr(obj, s, None)) for s in getattr(type(obj), "__slots__", ()) if isinstance(s, str)
    )
    return (items, None if attrs is None else [(k, id(v)) for k, v in attrs.items()], slots)


def _int_of(b: bytes) -> int:
    op = b[0]
    if op == 0x4B:
        return b[1]
    if op == 0x4D:
        return int.from_bytes(b[1:3], "little")
    if op == 0x4A:
        return int.from_bytes(b[1:5], "little", signed=True)
    return int.from_bytes(b[2:], "little", signed=True)


def decode_state_pickle(
    data: bytes,
    path: str,
    load: Callable[[bytes, dict[int, Any]], tuple[Any, dict[int, Any]]],
    stand_ins: dict[str, Any],
) -> Any:
    """The object the C path makes of ``data``, or :class:`Unsupported`.

    Args:
        data: a ``torch.save`` archive's ``data.pkl``.
        path: the file (for messages of the C runs).
        load: runs a pickle through the C unpickler with the given memo: ``(object, memo)``.
        stand_ins: the objects of :mod:`reshard.io.unpickle` the values are made of.
    """
    try:
        return _Decoder(data, path, load, stand_ins).decode()
    except Unsupported:
        raise
    except (IndexError, KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError, struct.error,
            RecursionError, OverflowError):  # fmt: skip
        raise Unsupported from None
