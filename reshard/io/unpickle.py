"""Restricted unpicklers for torch's pickles: no pickled code ever runs.

A pickle reaches code only through ``find_class`` (``GLOBAL``/``STACK_GLOBAL``,
``INST``/``OBJ``, ``EXT*``) and ``persistent_load``; ``REDUCE``, ``NEWOBJ`` and
``BUILD`` only call or build what those returned. :class:`RestrictedUnpickler`
answers ``find_class`` from an explicit table (``(module, name) -> object``)
and refuses every other global with :class:`UnsafePickleError` (exit 2) naming
the file and the class; the objects in the tables are inert stand-ins (plain
records, wrapped ``tuple``, ``OrderedDict``), never torch. A stand-in is shared by every load
of the process, so none can be changed by a pickle: ``BUILD``, ``SETITEM(S)``, ``APPEND(S)`` or
``ADDITEMS`` on one (or setting its attributes, class included) raises, and the load is refused
as unsafe naming the global (:class:`_StandIn`, :class:`_StandInType`); one file read can never
change how the next one is read. Two tables are defined here:

- :data:`DCP_METADATA_GLOBALS` for a DCP ``.metadata`` (plain ``pickle.dump`` of
  ``torch.distributed.checkpoint.metadata.Metadata``), read by
  :func:`load_dcp_metadata` into plain values (:class:`DcpMetadata`): by a pickle
  machine of its own with the same table (:class:`_MetaDecoder`: a 100k-tensor
  file in bounded memory, its items matched by learnt templates), or by the C
  unpickler for any pickle that machine leaves;
- :data:`TORCH_SAVE_TENSOR_GLOBALS` for the ``data.pkl`` of a ``torch.save``
  archive holding one tensor (each DCP chunk), read by :func:`load_stored_tensor`
  into a :class:`StoredTensor` (storage key, dtype, offset, size, stride).

To read other pickles (a ``.pt`` of DTensors, say), build a table from these
(``{**TORCH_SAVE_TENSOR_GLOBALS, ("torch.distributed.tensor", "DTensor"): ...}``,
stand-ins derived from :class:`Record`) and call :func:`restricted_load` with
``persistent_load=storage_persistent_load``: tensors then come out as
:class:`StoredTensor` records.
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import re
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DTYPE_SIZES, TORCH_NAMES
from ..errors import HeaderError
from ..text import name_pattern
from .header import MAX_INT64

__all__ = [
    "UnsafePickleError",
    "Globals",
    "RestrictedUnpickler",
    "restricted_load",
    "TorchDtype",
    "Record",
    "storage_persistent_load",
    "StorageRef",
    "StoredTensor",
    "ChunkMeta",
    "TensorMeta",
    "BytesMeta",
    "StorageInfo",
    "StorageEntry",
    "StorageTable",
    "DcpMetadata",
    "DCP_METADATA_GLOBALS",
    "TORCH_SAVE_TENSOR_GLOBALS",
    "SAFETENSORS_DTYPES",
    "load_dcp_metadata",
    "load_stored_tensor",
    "MeshInfo",
    "StoredDTensor",
    "TORCH_SAVE_STATE_GLOBALS",
    "load_torch_save",
]

Globals = Mapping[tuple[str, str], Any]
"""A ``find_class`` table: ``(module, qualified name)`` -> the object to use instead."""

#: torch dtype name (``bfloat16``) -> safetensors dtype (``BF16``).
SAFETENSORS_DTYPES: dict[str, str] = {v: k for k, v in TORCH_NAMES.items()}


_TORCH_DTYPE_NAME = re.compile(r"(complex|float|bfloat|bits|q?u?int)\d.*|q?u?int\d+x\d+")
"""``torch.<name>`` globals that are dtypes (``complex128``, ``float4_e2m1fn_x2``, ``quint4x2``)."""
_STORAGE_NAME = re.compile(r"[A-Z][A-Za-z0-9]*Storage")
"""``torch.<name>`` globals that are typed storage classes (``QInt8Storage``)."""
_QSCHEMES = frozenset(
    ["per_tensor_affine", "per_channel_affine", "per_tensor_symmetric", "per_channel_symmetric"]
    + ["per_channel_affine_float_qparams"]
)
"""``torch.<name>`` globals that are quantization schemes (a quantized tensor's first parameter)."""


class UnsafePickleError(HeaderError):
    """A pickle refers to a class or function outside the allow-list; nothing of it ran."""


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals come only from a table.

    Args:
        file: the pickle stream.
        path: the file the pickle is in (for messages).
        allowed: the ``find_class`` table.
        what: what the pickle is, for messages (``"DCP metadata"``).
        persistent_load: handler for persistent ids; None refuses them.
    """

    def __init__(
        self,
        file: io.BufferedIOBase | io.BytesIO,
        *,
        path: str,
        allowed: Globals,
        what: str,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = allowed
        self._what = what
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            odd = _odd_global(module, name)
            if odd is not None:
                return odd
            raise UnsafePickleError(
                f"{self._path}: the {self._what} pickle refers to {module}.{name}, which a "
                f"{self._what} does not use; refusing to load it (nothing of it was run). If you "
                "trust this file, load it with torch and re-save it.",
                path=self._path,
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(
                f"{self._path}: the {self._what} pickle holds a persistent id {pid!r}, which it "
                "does not use; refusing to load it",
                path=self._path,
            )
        return self._persistent(pid)


def restricted_load(
    data: bytes,
    *,
    path: str,
    allowed: Globals,
    what: str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`.

    Raises:
        UnsafePickleError: a global outside ``allowed``.
        HeaderError: the bytes are not a valid pickle of the expected objects.
    """
    up = RestrictedUnpickler(
        io.BytesIO(data), path=path, allowed=allowed, what=what, persistent_load=persistent_load
    )
    try:
        return up.load()
    except HeaderError:
        raise
    except _ChangeRefused as e:
        raise UnsafePickleError(
            f"{path}: the {what} pickle tries to change {e.name} ({e.how} on it), which a {what} "
            "never does; refusing to load it (nothing of it was run, nothing was changed). If you "
            "trust this file, load it with torch and re-save it.",
            path=path,
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError, OverflowError) as e:  # fmt: skip
        raise HeaderError(
            f"{path}: not a valid {what} pickle ({type(e).__name__}: {e}); the file is damaged "
            "or not written by torch",
            path=path,
        ) from None


# --------------------------------------------------------------------------- stand-ins
#
# What ``find_class`` returns is shared by every load of the process: a pickle that changed it
# (``BUILD`` state or ``__class__`` onto ``torch.FloatStorage``'s stand-in, ``SETITEM`` on a
# class) would change how every later file is read. So no stand-in can be changed: the
# instances are :class:`_StandIn` (no ``__dict__``, every mutating hook refuses), the classes
# are made by :class:`_StandInType` (``BUILD``, item and attribute changes on the class
# refuse; their instances, made per load, are ordinary), and functions and builtin types are
# wrapped in :class:`_Call`. The refusal (:class:`_ChangeRefused`) becomes an
# :class:`UnsafePickleError` naming the file and the global.


class _ChangeRefused(Exception):
    """A pickle tried to change a stand-in; ``name`` is its global, ``how`` the opcode."""

    def __init__(self, name: str, how: str) -> None:
        super().__init__(f"{how} on {name}")
        self.name = name
        self.how = how


class _StandIn:
    """Base of the stand-in instances: nothing of them can be set, added or built."""

    __slots__ = ()

    def _global(self) -> str:
        return object.__getattribute__(self, "name")  # type: ignore[no-any-return]

    def __setstate__(self, state: Any) -> None:
        raise _ChangeRefused(self._global(), "BUILD")

    def __setattr__(self, name: str, value: Any) -> None:
        raise _ChangeRefused(self._global(), "setattr")

    def __delattr__(self, name: str) -> None:
        raise _ChangeRefused(self._global(), "delattr")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise _ChangeRefused(self._global(), "SETITEM(S)")

    def __delitem__(self, key: Any) -> None:
        raise _ChangeRefused(self._global(), "delitem")

    def append(self, value: Any) -> None:
        raise _ChangeRefused(self._global(), "APPEND(S)")

    def extend(self, values: Any) -> None:
        raise _ChangeRefused(self._global(), "APPEND(S)")

    def add(self, value: Any) -> None:
        raise _ChangeRefused(self._global(), "ADDITEMS")

    def __repr__(self) -> str:
        return f"<stand-in for {self._global()}>"


class _Call(_StandIn):
    """A function or builtin type stand-in (``torch.Size`` -> ``tuple``): calls ``fn``, and that is all."""

    __slots__ = ("fn", "name")
    fn: Callable[..., Any]
    name: str

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "name", name)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _refuse_build(name: str) -> Callable[[Any], None]:
    def build(state: Any) -> None:
        raise _ChangeRefused(name, "BUILD")

    return build


class _StandInType(type):
    """Metaclass of the class stand-ins: the class itself cannot be changed (its instances can:
    each load makes its own). ``name`` is the global the class stands for."""

    name = ""

    # a data descriptor of the metaclass wins over the class's own __setstate__ (the instances'),
    # so BUILD on the class finds this one
    @property
    def __setstate__(cls) -> Callable[[Any], None]:
        return _refuse_build(cls.name)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _ChangeRefused(cls.name, "setattr")

    def __delattr__(cls, name: str) -> None:
        raise _ChangeRefused(cls.name, "delattr")

    def __setitem__(cls, key: Any, value: Any) -> None:
        raise _ChangeRefused(cls.name, "SETITEM(S)")

    def append(cls, value: Any) -> None:
        raise _ChangeRefused(cls.name, "APPEND(S)")

    def extend(cls, values: Any) -> None:
        raise _ChangeRefused(cls.name, "APPEND(S)")

    def add(cls, value: Any) -> None:
        raise _ChangeRefused(cls.name, "ADDITEMS")


def _named(table: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """``table`` after giving each class stand-in the name of its global (one class, one global)."""
    for (module, name), v in table.items():
        if isinstance(v, _StandInType):
            full = f"{module}.{name}"
            if v.__dict__.get("name", full) != full:
                raise AssertionError(f"{v.__name__} stands for {v.name} and {full}")
            type.__setattr__(v, "name", full)
    return table


class TorchDtype(str, _StandIn):
    """A ``torch.<dtype>`` global, as its name (``"bfloat16"``)."""

    __slots__ = ()

    def _global(self) -> str:
        return f"torch.{str.__str__(self)}"


class TorchQScheme(str, _StandIn):
    """A ``torch.<qscheme>`` global (``per_tensor_affine``), as its name."""

    __slots__ = ()

    def _global(self) -> str:
        return f"torch.{str.__str__(self)}"


class Record(metaclass=_StandInType):
    """Inert stand-in for a pickled class instance: remembers its state, runs nothing."""

    # NEWOBJ builds instances with __new__ only, so the defaults live on the class
    args: tuple[Any, ...] = ()
    state: Any = None
    made: Any = None  # what a reader made of this record (a mesh's MeshInfo), until its state changes

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __repr__(self) -> str:  # what messages show: no address (it differs from load to load)
        return f"<{type(self).name or type(self).__name__.lstrip('_')} object>"

    def __setstate__(self, state: Any) -> None:
        self.state = state
        self.made = None


class _Metadata(Record):
    pass


class _MCoreMetadata(_Metadata):
    pass


class _TensorStorageMetadata(Record):
    pass


class _ChunkStorageMetadata(Record):
    pass


class _TensorProperties(Record):
    pass


class _BytesStorageMetadata(Record):
    pass


class _MetadataIndex(Record):
    pass


class _StorageInfo(Record):
    pass


class _StorageMeta(Record):
    pass


class _SavePlan(Record):
    pass


class _WriteItem(Record):
    pass


class _TensorWriteData(Record):
    pass


class _BytesIOWriteData(Record):
    pass


def _path_join(*parts: Any) -> str:
    return os.path.join(*(str(p) for p in parts)) if parts else ""


def _identity(x: Any) -> Any:
    return x


_GET_LAYOUT = _Call(_identity, "torch.serialization._get_layout")
_TORCH_SIZE = _Call(tuple, "torch.Size")
_ORDERED_DICT = _Call(collections.OrderedDict, "collections.OrderedDict")
_MEM_FORMAT = _Call(int, "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING")
_WRITE_ITEM_TYPE = _Call(int, "torch.distributed.checkpoint.planner.WriteItemType")


_DCP_MOD = "torch.distributed.checkpoint.metadata"
_PLANNER_MOD = "torch.distributed.checkpoint.planner"
_DTYPE_GLOBALS: dict[tuple[str, str], Any] = {("torch", n): TorchDtype(n) for n in SAFETENSORS_DTYPES}

#: Everything a torch 2.x DCP ``.metadata`` (and Megatron-Core's) refers to.
DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = _named(
    {
        (_DCP_MOD, "Metadata"): _Metadata,
        (_DCP_MOD, "TensorStorageMetadata"): _TensorStorageMetadata,
        (_DCP_MOD, "ChunkStorageMetadata"): _ChunkStorageMetadata,
        (_DCP_MOD, "TensorProperties"): _TensorProperties,
        (_DCP_MOD, "BytesStorageMetadata"): _BytesStorageMetadata,
        (_DCP_MOD, "MetadataIndex"): _MetadataIndex,
        (_DCP_MOD, "StorageMeta"): _StorageMeta,
        (_DCP_MOD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"): _MCoreMetadata,
        # Megatron-Core's torch_dist keeps every rank's save plan as Metadata.all_local_plans
        # (strategies/state_dict_saver.py): torch's planner data classes; read and not used
        (_PLANNER_MOD, "SavePlan"): _SavePlan,
        (_PLANNER_MOD, "WriteItem"): _WriteItem,
        (_PLANNER_MOD, "WriteItemType"): _WRITE_ITEM_TYPE,
        (_PLANNER_MOD, "TensorWriteData"): _TensorWriteData,
        (_PLANNER_MOD, "BytesIOWriteData"): _BytesIOWriteData,
        ("torch", "Size"): _TORCH_SIZE,
        ("torch.serialization", "_get_layout"): _GET_LAYOUT,
        **{
            ("pathlib", n): _Call(_path_join, f"pathlib.{n}")
            for n in ("PosixPath", "WindowsPath", "PurePosixPath")
        },
        ("collections", "OrderedDict"): _ORDERED_DICT,
        **_DTYPE_GLOBALS,
    }
)


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A ``persistent_load(('storage', type, key, location, numel))`` of a ``torch.save`` pickle."""

    key: str
    dtype: str | None  # torch dtype name of a typed storage; None for UntypedStorage (bytes)
    numel: int


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """The tensor a ``data.pkl`` rebuilds: where its elements are and how they are laid out.

    Attributes:
        key: the storage key: its bytes are record ``data/<key>``.
        dtype: torch dtype name (``bfloat16``).
        storage_nbytes: size of the storage in bytes.
        storage_offset: first element of the tensor in the storage (elements).
        size: the tensor shape.
        stride: the tensor strides (elements).
    """

    key: str
    dtype: str
    storage_nbytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class UnreadableTensor:
    """A tensor of a dtype safetensors has no name for (``complex128``, ``qint8``,
    ``float4_e2m1fn_x2``): what a reader says of it; its bytes are never read.

    Attributes:
        dtype: torch's dtype name (``complex128``), or the typed storage class's
            (``ComplexDoubleStorage``) when the pickle names only that.
        size: its (global) shape.
    """

    dtype: str
    size: tuple[int, ...]

    def message(self, where: str, name: str) -> str:
        """Why ``name`` (in ``where``) is not converted, and what to do."""
        quantized = self.dtype.lower().startswith(("qint", "quint"))
        fix = "dequantize it (tensor.dequantize())" if quantized else "cast it"
        return (
            f'{where}: tensor "{name}" is torch.{self.dtype} {list(self.size)}: safetensors has no '
            "such dtype, so reshard cannot convert it (listed as an item, its bytes not read). "
            f"--exclude {name_pattern(name)} converts the rest; or {fix} with torch and re-save"
        )


class _StorageType(_StandIn):
    """A ``torch.<X>Storage`` / ``torch.storage.UntypedStorage`` global: just its dtype."""

    __slots__ = ("dtype", "name")
    dtype: str | None
    name: str

    def __init__(self, dtype: str | None, name: str) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "name", name)


_TYPED_STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    # dtypes safetensors lacks: their tensors become UnreadableTensor
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}


def _odd_global(module: str, name: str) -> Any | None:
    """A ``torch`` dtype or typed storage class no allow-list names (``complex128``, a storage
    class of a later torch), as inert data: the tensors of it become :class:`UnreadableTensor`,
    which a reader lists and ``convert`` refuses unless excluded; None for anything else."""
    if module != "torch":
        return None
    if _TORCH_DTYPE_NAME.fullmatch(name):
        return TorchDtype(name)
    if _STORAGE_NAME.fullmatch(name):
        return _StorageType(name, f"torch.{name}")
    if name in _QSCHEMES:
        return TorchQScheme(name)
    return None


def _int_tuple(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, (tuple, list)) and all(type(x) is int for x in v):
        return tuple(v)
    return None


def _rebuild(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None
) -> StoredTensor | UnreadableTensor:
    sz, st = _int_tuple(size), _int_tuple(stride)
    if (
        not isinstance(storage, StorageRef)
        or type(offset) is not int
        or sz is None
        or st is None
        or len(sz) != len(st)
        or min((offset, *sz, *st)) < 0
    ):
        raise ValueError("tensor rebuild arguments are not (storage, offset, sizes, strides) >= 0")
    if math.prod(sz) > MAX_INT64 or max(sz, default=0) > MAX_INT64:  # torch: "numel: ... overflow"
        raise ValueError(f"tensor size {list(sz)} is over {MAX_INT64} elements (int64; torch refuses it)")
    if dtype is None:
        dtype = storage.dtype
    if dtype is None:
        raise ValueError("a tensor rebuilt from an untyped storage without a dtype")
    if dtype not in SAFETENSORS_DTYPES:
        return UnreadableTensor(dtype, sz)
    isz = DTYPE_SIZES[SAFETENSORS_DTYPES[dtype]]
    nbytes = storage.numel if storage.dtype is None else storage.numel * isz
    return StoredTensor(storage.key, dtype, nbytes, offset, sz, st)


def _rebuild_v2(
    storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any
) -> StoredTensor | UnreadableTensor:
    return _rebuild(storage, offset, size, stride, None)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _rg: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> StoredTensor | UnreadableTensor:
    if not isinstance(dtype, TorchDtype):
        raise ValueError(f"_rebuild_tensor_v3 dtype {dtype!r} is not a torch dtype")
    return _rebuild(storage, offset, size, stride, str(dtype))


def _rebuild_q(
    storage: Any, offset: Any, size: Any, stride: Any, qparams: Any, *_rest: Any
) -> UnreadableTensor:
    """A quantized tensor (``torch._utils._rebuild_qtensor``): never its integers alone, which
    mean nothing without the scales and zero points beside them."""
    if not (isinstance(qparams, tuple) and qparams and isinstance(qparams[0], TorchQScheme)):
        raise ValueError("_rebuild_qtensor quantizer parameters do not start with a torch qscheme")
    got = _rebuild(storage, offset, size, stride, None)
    return got if isinstance(got, UnreadableTensor) else UnreadableTensor(got.dtype, got.size)


#: Everything the ``data.pkl`` of a ``torch.save``-d plain CPU tensor refers to.
TORCH_SAVE_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _Call(_rebuild_v2, "torch._utils._rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"): _Call(_rebuild_v3, "torch._utils._rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_qtensor"): _Call(_rebuild_q, "torch._utils._rebuild_qtensor"),
    ("torch.storage", "UntypedStorage"): _StorageType(None, "torch.storage.UntypedStorage"),
    ("collections", "OrderedDict"): _ORDERED_DICT,
    **{("torch", n): _StorageType(d, f"torch.{n}") for n, d in _TYPED_STORAGES.items()},
    **_DTYPE_GLOBALS,
}


def storage_persistent_load(pid: Any) -> StorageRef:
    """``persistent_load`` of a ``torch.save`` pickle: ``('storage', type, key, location, numel)``."""
    if (
        isinstance(pid, tuple)
        and len(pid) == 5
        and pid[0] == "storage"
        and isinstance(pid[1], _StorageType)
        and isinstance(pid[2], str)
        and type(pid[4]) is int
        and pid[4] >= 0
    ):
        return StorageRef(pid[2], pid[1].dtype, pid[4])
    raise ValueError(f"persistent id {pid!r} is not a torch storage reference")


def load_stored_tensor(data: bytes, *, path: str) -> StoredTensor:
    """The tensor described by a ``torch.save`` archive's ``data.pkl`` (one plain tensor).

    Raises:
        UnsafePickleError: the pickle refers to anything but tensor rebuilding.
        HeaderError: the pickle does not rebuild exactly one tensor.
    """
    obj = restricted_load(
        data,
        path=path,
        allowed=TORCH_SAVE_TENSOR_GLOBALS,
        what="torch.save tensor",
        persistent_load=storage_persistent_load,
    )
    if not isinstance(obj, StoredTensor):
        raise HeaderError(f"{path}: data.pkl holds a {type(obj).__name__}, not one tensor", path=path)
    return obj


# --------------------------------------------------------------------------- DCP metadata


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One stored box of a tensor: global ``offsets`` and ``sizes`` (Megatron may give more offsets)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A ``TensorStorageMetadata``: torch dtype name, global size and its chunks.

    The decoder gives every tensor whose pickled entry has the same bytes the same object,
    so a checkpoint of 100k tensors holds one per geometry.
    """

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]
    _by_offsets: dict[tuple[int, ...], ChunkMeta] | None = field(
        default=None, init=False, repr=False, compare=False, hash=False
    )

    def chunk_at(self, offsets: tuple[int, ...] | None) -> ChunkMeta | None:
        """The chunk at these global offsets (how ``storage_data`` keys refer to chunks), or None."""
        if offsets is None:
            return None
        by = self._by_offsets
        if by is None:
            by = {c.offsets: c for c in self.chunks}
            object.__setattr__(self, "_by_offsets", by)
        return by.get(offsets)


@dataclass(frozen=True, slots=True)
class BytesMeta:
    """A ``BytesStorageMetadata``: a non-tensor item (a ``torch.save`` of any object)."""


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """A ``_StorageInfo``: where an item's bytes are and which transforms to undo."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StorageEntry:
    """One ``storage_data`` item: ``MetadataIndex(fqn, offset, index)`` -> :class:`StorageInfo`."""

    fqn: str
    offset: tuple[int, ...] | None
    info: StorageInfo


class StorageTable:
    """``storage_data`` as columns, in pickle order: one row per stored item.

    A 100k-tensor checkpoint saved at TP-8 has 800k items; a row is references to shared
    strings and tuples plus two machine integers, not objects of its own. Iterating gives
    :class:`StorageEntry` values.

    Attributes:
        fqns: ``MetadataIndex.fqn`` per row.
        offsets: ``MetadataIndex.offset`` per row (the chunk's global offsets; None for bytes).
        paths: ``_StorageInfo.relative_path`` per row.
        starts: ``_StorageInfo.offset`` per row.
        lengths: ``_StorageInfo.length`` per row.
        transforms: row -> ``transform_descriptors``, for the rows that have some.
    """

    __slots__ = ("fqns", "offsets", "paths", "starts", "lengths", "transforms")

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.offsets: list[tuple[int, ...] | None] = []
        self.paths: list[str] = []
        self.starts = array("q")
        self.lengths = array("q")
        self.transforms: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self.fqns)

    def append(
        self,
        fqn: str,
        offset: tuple[int, ...] | None,
        path: str,
        start: int,
        length: int,
        transforms: tuple[str, ...] = (),
    ) -> None:
        if start > _I64 or length > _I64:
            raise ValueError(f"_StorageInfo of {fqn!r} has an offset or length past 2**63")
        if transforms:
            self.transforms[len(self.fqns)] = transforms
        self.fqns.append(fqn)
        self.offsets.append(offset)
        self.paths.append(path)
        self.starts.append(start)
        self.lengths.append(length)

    def __getitem__(self, i: int) -> StorageEntry:
        info = StorageInfo(self.paths[i], self.starts[i], self.lengths[i], self.transforms.get(i, ()))
        return StorageEntry(self.fqns[i], self.offsets[i], info)

    def __iter__(self) -> Iterator[StorageEntry]:
        return (self[i] for i in range(len(self.fqns)))


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """A DCP ``.metadata``, as plain values.

    Attributes:
        entries: flattened FQN -> tensor or non-tensor item.
        storage: every stored item.
        version: ``Metadata.version`` (``"1.0.0"`` in torch 2.13; None before).
        megatron: True for Megatron-Core's ``MCoreMetadata``.
        decoder: ``"fast"`` (:class:`_MetaDecoder`) or ``"reference"`` (the C unpickler).
    """

    entries: dict[str, TensorMeta | BytesMeta]
    storage: StorageTable
    version: str | None
    megatron: bool
    decoder: str = "fast"


_I64 = (1 << 63) - 1


def _state(obj: Any, cls: type[Record], what: str) -> dict[str, Any]:
    if not isinstance(obj, cls) or not isinstance(obj.state, dict):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a {cls.__name__[1:]}")
    st: dict[str, Any] = obj.state
    return st


def _dims(v: Any, what: str) -> tuple[int, ...]:
    t = _int_tuple(v)
    if t is None or any(x < 0 for x in t):
        raise ValueError(f"{what} {v!r} is not a tuple of non-negative integers")
    return t


def _tensor_meta(obj: Any, fqn: str) -> TensorMeta | BytesMeta:
    if isinstance(obj, _BytesStorageMetadata):
        return BytesMeta()
    st = _state(obj, _TensorStorageMetadata, f"entry {fqn!r}")
    props = st.get("properties")
    pstate = props.state if isinstance(props, _TensorProperties) else None
    dtype = (
        pstate[0]
        if isinstance(pstate, tuple) and pstate
        else getattr(pstate, "get", lambda _k: None)("dtype")
    )
    if not isinstance(dtype, TorchDtype):
        raise ValueError(f"entry {fqn!r} has no torch dtype in its properties")
    chunks = []
    for c in st.get("chunks") or ():
        cs = _state(c, _ChunkStorageMetadata, f"a chunk of {fqn!r}")
        chunks.append(
            ChunkMeta(_dims(cs.get("offsets"), "chunk offsets"), _dims(cs.get("sizes"), "chunk sizes"))
        )
    return TensorMeta(str(dtype), _dims(st.get("size"), f"size of {fqn!r}"), tuple(chunks))


def _storage_entry(
    key: Any, value: Any
) -> tuple[str, tuple[int, ...] | None, str, int, int, tuple[str, ...]]:
    """A ``storage_data`` item as a :class:`StorageTable` row."""
    ks = _state(key, _MetadataIndex, "a storage_data key")
    vs = _state(value, _StorageInfo, "a storage_data value")
    fqn = ks.get("fqn")
    if not isinstance(fqn, str):
        raise ValueError(f"MetadataIndex fqn {fqn!r} is not a string")
    off = ks.get("offset")
    rel, start, length = vs.get("relative_path"), vs.get("offset"), vs.get("length")
    tds = vs.get("transform_descriptors") or ()
    if (
        not isinstance(rel, str)
        or type(start) is not int
        or type(length) is not int
        or start < 0
        or length < 0
    ):
        raise ValueError(f"_StorageInfo of {fqn!r} is not (path, offset, length)")
    if not isinstance(tds, (list, tuple)) or not all(isinstance(t, str) for t in tds):
        raise ValueError(f"transform_descriptors of {fqn!r} are not strings")
    return (fqn, None if off is None else _dims(off, "MetadataIndex offset"), rel, start, length, tuple(tds))


def _reference_metadata(data: bytes, path: str) -> DcpMetadata:
    """:func:`load_dcp_metadata` through the C unpickler: the whole object graph, then values.

    Every pickle the fast decoder leaves (other writers, damaged or hostile files) comes here;
    its errors are the ones users see."""
    what = "DCP metadata"
    obj = restricted_load(data, path=path, allowed=DCP_METADATA_GLOBALS, what=what)
    try:
        st = _state(obj, _Metadata, "the pickle")
        sdm = st.get("state_dict_metadata")
        sd = st.get("storage_data")
        if not isinstance(sdm, dict) or not isinstance(sd, dict):
            raise ValueError("Metadata has no state_dict_metadata / storage_data dicts")
        entries: dict[str, TensorMeta | BytesMeta] = {}
        for fqn, m in sdm.items():
            if not isinstance(fqn, str):
                raise ValueError(f"state_dict_metadata key {fqn!r} is not a string")
            entries[fqn] = _tensor_meta(m, fqn)
        storage = StorageTable()
        for k, v in sd.items():
            storage.append(*_storage_entry(k, v))
        version = st.get("version")
    except ValueError as e:
        raise HeaderError(f"{path}: not a valid {what} ({e})", path=path) from None
    return DcpMetadata(
        entries,
        storage,
        version if isinstance(version, str) else None,
        isinstance(obj, _MCoreMetadata),
        "reference",
    )


def load_dcp_metadata(data: bytes | mmap.mmap, *, path: str) -> DcpMetadata:
    """Read a DCP ``.metadata`` (or ``__{rank}.metadata``) without running any of it.

    :class:`_MetaDecoder` reads the pickles torch and reshard write (protocols 2-5) in
    bounded memory; any other pickle goes to the C unpickler with the same allow-list
    (:data:`DCP_METADATA_GLOBALS`), which also gives the errors.

    Args:
        data: the file's bytes (or a read-only map of it).
        path: the file, for messages.

    Raises:
        UnsafePickleError: the pickle refers to a class DCP metadata does not use.
        HeaderError: not a pickled ``Metadata``, or fields of the wrong kind.
    """
    try:
        return _MetaDecoder(data, path).decode()
    except _Unsupported:
        pass
    return _reference_metadata(bytes(data), path)


# --------------------------------------------------------------------------- fast DCP metadata decoder
#
# A DCP ``.metadata`` of 100k tensors is a 36 MB pickle of ~10M opcodes. The C unpickler keeps
# every object it memoizes (all of them: torch's and reshard's picklers memoize everything) until
# the load ends: ~2.5 KB a tensor, 600 MB at 200k tensors. _MetaDecoder is a pickle machine of
# its own for the same opcodes and the same allow-list whose memo keeps only what a later opcode
# of these files refers to (strings, classes), and which reads the items of ``state_dict_metadata``,
# ``storage_data`` and ``planner_data`` without building their objects: each item is matched by a
# regular expression (a template learnt from the first item of its shape: the bytes of the item
# with its variable fields as groups) and turned straight into values. Items no template matches
# (the first of a shape, one cut by a protocol-4 FRAME) run through the machine and are converted
# as the C path converts them, at the end (a later opcode may still change what the machine built).
# Megatron-Core's ``all_local_plans`` (protocol 4/5) is read and dropped: its tensor write items by
# templates (keys and classes checked, memo gets of values checked to exist), the rest op by op,
# where a get of an object not kept gives an inert _DROPPED that only a container may hold. Anything
# unusual (an opcode these files do not use, a memo entry it did not keep, a class outside the
# allow-list, any error) raises _Unsupported: the C path decides.
# It is as strict as the C unpickler (reading from a file) where that one refuses (mark fences,
# truncated arguments, an opcode across a FRAME's end), tested on damaged pickles, with one
# exception: in protocol 2/3 items a template does not read the index of a BINPUT (the picklers
# number them in order and nothing refers to most of them), so a damaged index reads as written
# where the C unpickler trips on it; an index past the pickle's size is refused (the C unpickler
# would size its memo array by it).


class _Unsupported(Exception):
    """The fast decoder leaves this pickle to the reference (C unpickler) path."""


class _Compact:
    """An item an item reader converted, pushed on the machine's stack (key or value) while items
    the machine built wait for their SETITEMS: items keep their pickle order."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _SdmAcc(dict):  # type: ignore[type-arg]
    """``state_dict_metadata`` as the decoder reads it: fqn -> TensorMeta | BytesMeta (equal
    values one object: ``metas``, the decoder's).

    Items the machine built are converted at the end (:meth:`finish`), as the C path converts
    them: a later opcode may still change them (a get of one and a BUILD or SETITEM on it)."""

    __slots__ = ("metas", "pending")

    def __init__(self) -> None:
        super().__init__()
        self.metas: dict[Any, Any] = {}
        self.pending: list[tuple[str, Any]] = []

    def vm_items(self, items: list[Any]) -> None:
        for i in range(0, len(items), 2):
            k, v = items[i], items[i + 1]
            if type(v) is _Compact:
                self[k] = v.value
            elif type(k) is not str:
                raise _Unsupported
            else:
                self[k] = v
                self.pending.append((k, v))

    def finish(self) -> None:
        for k, v in self.pending:
            if self.get(k) is v:  # (not set again by a later item)
                m = _tensor_meta(v, k)
                self[k] = self.metas.setdefault(m, m)
        self.pending = []


class _StorageAcc(StorageTable):
    """``storage_data`` as the decoder reads it: rows in pickle order (those the machine built
    converted at the end, :meth:`finish`, as :class:`_SdmAcc` does)."""

    __slots__ = ("_keys", "pending")

    def __init__(self) -> None:
        super().__init__()
        self._keys: set[int] = set()
        self.pending: list[tuple[int, Any, Any]] = []

    def vm_items(self, items: list[Any]) -> None:
        for i in range(0, len(items), 2):
            k, v = items[i], items[i + 1]
            if type(k) is _Compact:
                self.append(*k.value)
                continue
            if id(k) in self._keys:  # one key object twice: a dict would keep one item
                raise _Unsupported
            self._keys.add(id(k))  # k lives on in the memo: ids stay unique
            self.pending.append((len(self.fqns), k, v))
            self.append("", None, "", 0, 0)

    def finish(self) -> None:
        for i, k, v in self.pending:
            fqn, off, path, start, length, tds = _storage_entry(k, v)
            if start > _I64 or length > _I64:
                raise ValueError(f"_StorageInfo of {fqn!r} has an offset or length past 2**63")
            self.fqns[i], self.offsets[i], self.paths[i] = fqn, off, path
            self.starts[i], self.lengths[i] = start, length
            if tds:
                self.transforms[i] = tds
        self.pending = []


class _PlannerAcc(dict):  # type: ignore[type-arg]
    """``planner_data``: read and dropped (nothing reads it)."""

    __slots__ = ()

    def vm_items(self, items: list[Any]) -> None:
        for i in range(0, len(items), 2):
            hash(items[i])  # a dict would refuse an unhashable key


_ACCUMULATORS: dict[str, type[Any]] = {
    "state_dict_metadata": _SdmAcc,
    "storage_data": _StorageAcc,
    "planner_data": _PlannerAcc,
}

#: Argument bytes of the fixed-size opcodes (for tokenizing).
_FIXED_ARG = {
    **dict.fromkeys(b"(.012NaebdlstuR)]}\x85\x86\x87\x88\x89\x81\x92\x93\x94\x8f\x90\x91", 0),
    **dict.fromkeys(b"Khq\x80", 1),
    **dict.fromkeys(b"M", 2),
    **dict.fromkeys(b"Jjr", 4),
    **dict.fromkeys(b"G\x95", 8),
}
#: Length-prefixed opcodes: size of the length field.
_LEN_ARG = {ord("X"): 4, 0x8C: 1, 0x8D: 8, ord("B"): 4, ord("C"): 1, 0x8E: 8, 0x8A: 1, 0x8B: 4}
_PUT_OPS = frozenset(b"qr\x94")
#: Bytes each opcode's argument (or its length field) takes.
_ARG_WIDTH = {**{op: n for op, n in _FIXED_ARG.items() if n}, **_LEN_ARG}
#: Stack items each opcode takes (or looks at) above the last MARK.
_POPS = {
    **dict.fromkeys(b"\x94qr\x85.2", 1),
    **dict.fromkeys(b"\x86aRb\x81\x93", 2),
    **dict.fromkeys(b"\x87s\x92", 3),
}
_DIGITS = b"0123456789"
_RELEASE = 8 << 20  # give mapped pages of .metadata back every this many bytes read


def _tokens(data: Any, start: int, end: int) -> list[tuple[int, int, int]]:
    """``(opcode, start, end)`` of each opcode in ``data[start:end]`` (which the caller knows parse)."""
    out = []
    pos = start
    while pos < end:
        op = data[pos]
        n = _FIXED_ARG.get(op)
        if n is not None:
            stop = pos + 1 + n
        elif op in _LEN_ARG:
            w = _LEN_ARG[op]
            stop = pos + 1 + w + int.from_bytes(data[pos + 1 : pos + 1 + w], "little")
        elif op == 0x63:  # GLOBAL module\nname\n
            nl = data.find(b"\n", data.find(b"\n", pos) + 1)
            if nl < 0:
                raise _Unsupported
            stop = nl + 1
        else:
            raise _Unsupported
        out.append((op, pos, stop))
        pos = stop
    if pos != end:
        raise _Unsupported
    return out


def _opcode_at(data: bytes, at: int, stop: int) -> bool:
    """Whether ``data[:stop]`` parses as opcodes, one of them starting at ``at``."""
    try:
        return any(s == at for _, s, _ in _tokens(data, 0, stop))
    except _Unsupported:
        return False


def _gidx(b: bytes) -> int:
    """The memo index of a BINGET / LONG_BINGET."""
    return b[1] if b[0] == 0x68 else int.from_bytes(b[1:5], "little")


def _int_of(b: bytes) -> int:
    """The value of a BININT1 / BININT2 / BININT / LONG1."""
    op = b[0]
    if op == 0x4B:
        return b[1]
    if op == 0x4D:
        return int.from_bytes(b[1:3], "little")
    if op == 0x4A:
        return int.from_bytes(b[1:5], "little", signed=True)
    return int.from_bytes(b[2:], "little", signed=True)


_INT_RE = re.compile(rb"K.|M..|J....|\x8a\x00|\x8a\x01.|\x8a\x02..|\x8a\x03...|\x8a\x04....|\x8a\x05.....|"
                     rb"\x8a\x06......|\x8a\x07.......|\x8a\x08........", re.S)  # fmt: skip


def _int_tuple_of(b: bytes) -> tuple[int, ...]:
    """The ints of a tuple's opcodes (``K.K.\\x86``, ``)``, ``(K.K.K.K.t``), read in order up to
    the tuple opcode (what follows, a memo put, is not read: its argument may look like an int)."""
    out = []
    pos = 1 if b[:1] == b"(" else 0
    while (m := _INT_RE.match(b, pos)) is not None:
        out.append(_int_of(m.group()))
        pos = m.end()
    return tuple(out)


#: The items of ``Metadata``'s dicts as torch's and reshard's picklers write them, in
#: ``re.VERBOSE`` syntax with placeholders: ``<G>`` a memo GET, ``<P>`` a memo PUT (MEMOIZE, or
#: BINPUT / LONG_BINPUT), ``<I>`` an int, ``<T>`` a tuple of ints, ``<NEWOBJ>`` an instance of
#: the class just got with its state dict opened, ``<CHUNK>`` a ``ChunkStorageMetadata``.
_ITEM_PARTS = {
    b"<NEWOBJ>": rb"\)\x81 <P> \} <P> \(",
    b"<T>": rb"(?: \) | <I>\x85<P> | <I>{2}\x86<P> | <I>{3}\x87<P> | \(<I>*t<P> )",
    b"<I>": b"(?:" + _INT_RE.pattern + b")",
    b"<G>": rb"(?:h.|j....)",
    # a string (its length is checked where it is read; bounded: a lazy .* tried at every
    # position where an item does not match would scan the rest of the file each time)
    b"<S>": rb"(?:\x8c.{1,256}?|X.{4,8196}?)",
}
_CHUNK = rb"""
    (<G>) <NEWOBJ>                          # ChunkStorageMetadata(
    (<G>) (<G>) (<T>) \x85<P> R<P>           #   offsets=torch.Size(...),
    (<G>) (<G>) (<T>) \x85<P> R<P>           #   sizes=torch.Size(...))
    u b
"""
_SDM_ITEM = rb"""
    (?P<tsm><G>) <NEWOBJ>                   # (the fqn is read before) TensorStorageMetadata(
    (?P<kprop><G>) (?P<tp><G>) \)\x81<P> \(  #   properties=TensorProperties((dtype,
    (?P<dtype><G>)
    (?: (?P<lay><G>) <G> \x85<P> R<P> | <G> )         # _get_layout('torch.strided') or its result,
    [\x88\x89]                                      # requires_grad,
    (?: (?P<mf><G>) <I> \x85<P> R<P> | <G> )          # _MEM_FORMAT_ENCODING(i) or its result,
    [\x88\x89] t<P> b                               # pin_memory)),
    (?P<ksize><G>) (?P<szc><G>) (?P<size><T>) \x85<P> R<P>       # size=torch.Size(...),
    (?P<kchunks><G>) \]<P> (?P<chunks> (?: <CHUNK>a | (?: \( (?:<CHUNK>)+ e )+ )? )  # chunks=[...])
    u b
"""
_STORAGE_ITEM = rb"""
    (?P<mi><G>) <NEWOBJ>                                  # MetadataIndex(
    (?P<kf><G>) (?P<fqn><G> | <S><P>)                     #   fqn= (a string of its own: gathered ranks),
    (?P<ki><G>) (?P<idx><I>)                              #   index=,
    (?P<ko><G>) (?P<szc><G>) (?P<off><T>) \x85<P> R<P>    #   offset=torch.Size(...))
    u b
    (?P<si><G>) <NEWOBJ>                                  # _StorageInfo(
    (?P<kp><G>) (?P<path><G>)                             #   relative_path=,
    (?P<ko2><G>) (?P<start><I>)                           #   offset=,
    (?P<kl><G>) (?P<len><I>)                              #   length=)
    u b
"""
_PLANNER_ITEM = rb"(<G>) ( <G>\x85 | <G>{2}\x86 | <G>{3}\x87 | \(<G>*t ) <P>"
#: A ``torch.Size`` value: a memo get, or ``Size`` called on a tuple of ints (``@`` its group names' stem).
_SIZE_OF = rb"(?: (?P<@_g><G>) | (?P<@_c><G>) (?P<@_t><T>) \x85<P> R<P> )"
#: A ``WriteItem`` of a tensor in Megatron-Core's ``all_local_plans`` (protocol 4/5 only). The
#: ``_g`` groups are memo gets of values (anything already memoized: the decoder need not have
#: kept it), the others keys and classes (checked once per bytes).
_WRITE_ITEM = rb"""
    (?P<wi><G>) <NEWOBJ>                                         # WriteItem(
    (?P<k_index><G>) (?P<mi><G>) <NEWOBJ>                        #   index=MetadataIndex(
    (?P<k_fqn><G>) (?: (?P<fqn_g><G>) | (?P<fqn_s><S>) <P> )     #     fqn=,
    (?P<k_idx><G>) (?: N | <I> )                                 #     index=None or an int,
    (?P<k_off><G>) <SIZE:off>                                    #     offset=Size)
    u b
    (?P<k_type><G>) (?P<type_g><G>)                              #   type=(memoized) WriteItemType.SHARD,
    (?P<k_bio><G>) N                                             #   bytes_io_data=None,
    (?P<k_td><G>) (?P<twd><G>) <NEWOBJ>                          #   tensor_data=TensorWriteData(
    (?P<k_chunk><G>) (?: (?P<chunk_g><G>)                        #     chunk= (usually state_dict_metadata's)
        | (?P<csm><G>) <NEWOBJ> (?P<k_co><G>) <SIZE:co> (?P<k_cz><G>) <SIZE:cz> u b )
    (?P<k_props><G>) (?: (?P<props_g><G>)                        #     properties=
        | (?P<tp><G>) \)\x81<P> \( (?P<dt_g><G>) (?P<lay_g><G>) [\x88\x89] (?P<mf_g><G>) [\x88\x89] t<P> b )
    (?P<k_size><G>) <SIZE:size>                                  #     size=Size)
    u b
    u b
"""


class _Patterns:
    """The item regular expressions of one pickle family: protocol 2/3 (``BINPUT`` indexes)
    or protocol 4/5 (``MEMOIZE``)."""

    def __init__(self, p4: bool) -> None:
        self.put = rb"\x94" if p4 else rb"(?:q.|r....)"
        self.int = _ITEM_PARTS[b"<I>"]
        self.get = _ITEM_PARTS[b"<G>"]
        self.chunk = self._compile(_CHUNK)
        no_groups = re.sub(rb"(?<!\\)\((?!\?)", b"(?:", _CHUNK)
        self.sdm = self._compile(_SDM_ITEM.replace(b"<CHUNK>", no_groups))
        self.storage = self._compile(_STORAGE_ITEM)
        self.planner = self._compile(_PLANNER_ITEM)
        self.planner_same = self._compile(rb"(<G>) (<G>) \x85<P>")
        self.planner_own = self._compile(rb"(<S>) \x94 (<G>) \x85\x94")  # protocol 4 only
        self.gets = self._compile(b"<G>")
        self.write_item = self.write_item_rx(None) if p4 else None

    def write_item_rx(self, keys: tuple[bytes | None, ...] | None) -> re.Pattern[bytes]:
        """:data:`_WRITE_ITEM`; with ``keys`` (checked :data:`_WRITE_ITEM_KEYS` bytes) a template:
        those gets as they are, the alternatives whose key is None never."""
        pattern = _WRITE_ITEM
        for stem in (b"off", b"co", b"cz", b"size"):
            pattern = pattern.replace(b"<SIZE:" + stem + b">", _SIZE_OF.replace(b"@", stem))
        if keys is not None:
            for name, b in zip(_WRITE_ITEM_KEYS, keys, strict=True):
                group = b"(?P<" + name.encode() + b"><G>)"
                assert pattern.count(group) == 1
                pattern = pattern.replace(group, b"(?!)" if b is None else b"(?:" + re.escape(b) + b")")
        return self._compile(pattern)

    def _compile(self, pattern: bytes) -> re.Pattern[bytes]:
        for k, v in _ITEM_PARTS.items():
            pattern = pattern.replace(k, v)
        return re.compile(pattern.replace(b"<P>", self.put), re.S | re.X)


class _Template:
    """A learnt item: its regular expression and what a match means.

    ``value`` is the converted item (a TensorMeta) when the template leaves no field variable;
    ``puts`` counts its MEMOIZE opcodes (protocol 4: the memo index of what comes next)."""

    __slots__ = ("rx", "value", "puts", "at")

    def __init__(self, rx: re.Pattern[bytes], value: Any, puts: int, at: int = -1) -> None:
        self.rx = rx
        self.value = value
        self.puts = puts
        self.at = at  # a storage item whose fqn is a string of its own: its MEMOIZE among the item's


_MAX_TEMPLATES = 256
_MAX_INTS = 4096
_JOIN = 1 << 12  # bytes of an item across a frame's end read by the item reader (items: ~120)
_NO_FRAME = 1 << 62
_MAX_MEMO = 1 << 24


class _MetaDecoder:
    """The pickle machine (see the comment above)."""

    def __init__(self, data: Any, path: str = "<metadata>") -> None:
        self.data = data
        self.path = path
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.memo_len = 0  # MEMOIZE's next index (protocol 4)
        self.frame_end = _NO_FRAME  # where the open protocol-4 frame ends
        self.family: bool | None = None  # True: MEMOIZE, False: BINPUT indexes
        self.pats: _Patterns | None = None
        self.items: Callable[[int], int] | None = None
        self.acc: Any = None
        self.base = 0
        self.released = 0
        self.metas: dict[TensorMeta, TensorMeta] = {}
        self.sdm_templates: list[_Template] = []
        self.sdm_hints: dict[bytes, _Template] = {}
        self.storage_templates: list[_Template] = []
        self.tuples: dict[bytes, tuple[int, ...] | None] = {}
        self.ints: dict[bytes, int] = {}  # a storage item's length opcode -> its value
        self.joined = b""  # an item across a frame's end, without the FRAME opcode between
        self.sdm_acc: dict[str, Any] = {}
        self.names: dict[str, str] | None = None
        self.depth = 2  # len(marks) where the item reader reads
        self.pairs = True  # the reader's items are key, value pairs (a dict's)
        self.plans_mark = 0  # len(marks) of the all_local_plans list's batch (0: outside it)
        self.plans_memo = 0  # memo_len where that batch began
        self.item_templates: list[re.Pattern[bytes]] = []

    def _names(self) -> dict[str, str]:
        """The state_dict_metadata keys, each its own value (made once): storage rows whose fqn
        is a string of its own share the key's string (400k rows, 100k names: 30 MB less)."""
        if self.names is None:
            self.names = {k: k for k in self.sdm_acc}
        return self.names

    # ------------------------------------------------------------------ the machine

    def decode(self) -> DcpMetadata:
        try:
            obj = self._run()
            return self._convert(obj)
        except (_Unsupported, HeaderError):
            raise
        except _ChangeRefused:
            raise _Unsupported from None  # the C path refuses it, naming the file and the global
        except (LookupError, TypeError, ValueError, AttributeError, ArithmeticError, struct.error,
                RecursionError, MemoryError):  # fmt: skip
            raise _Unsupported from None  # the C path gives the verdict (and the message)

    def _convert(self, obj: Any) -> DcpMetadata:
        if not isinstance(obj, _Metadata) or not isinstance(obj.state, dict):
            raise _Unsupported
        st = obj.state
        sdm, sd = st.get("state_dict_metadata"), st.get("storage_data")
        if isinstance(sdm, _SdmAcc):
            acc = sdm
        elif type(sdm) is dict:
            acc = _SdmAcc()
            acc.metas = self.metas
            acc.vm_items([x for kv in sdm.items() for x in kv])
        else:
            raise _Unsupported
        acc.finish()
        entries: dict[str, TensorMeta | BytesMeta] = acc
        if isinstance(sd, _StorageAcc):
            sacc = sd
        elif type(sd) is dict:
            sacc = _StorageAcc()
            sacc.vm_items([x for kv in sd.items() for x in kv])
        else:
            raise _Unsupported
        sacc.finish()
        storage: StorageTable = sacc
        version = st.get("version")
        return DcpMetadata(
            entries, storage, version if isinstance(version, str) else None, isinstance(obj, _MCoreMetadata)
        )

    def _put(self, idx: int, obj: Any) -> None:
        if idx > max(len(self.data), _MAX_MEMO):
            # no pickler numbers past its opcodes; the C unpickler would size its memo array by it
            raise HeaderError(
                f"{self.path}: not a valid DCP metadata pickle (memo index {idx} in a "
                f"{len(self.data)}-byte pickle); the file is damaged or not written by torch",
                path=self.path,
            )
        if self.family is None:
            self._family(False)
        elif self.family:
            raise _Unsupported  # BINPUT and MEMOIZE mixed: no pickler writes that
        self.memo[idx] = obj

    def _family(self, p4: bool) -> None:
        self.family = p4
        self.pats = _Patterns(p4)

    def _release(self, pos: int) -> None:
        """Give back the mapped pages already read (a map's pages count as the process's memory)."""
        madvise = getattr(self.data, "madvise", None)
        if madvise is None or not hasattr(mmap, "MADV_DONTNEED"):
            self.released = pos
            return
        upto = pos - pos % mmap.PAGESIZE
        if upto > self.released:
            madvise(mmap.MADV_DONTNEED, self.released, upto - self.released)
            self.released = upto

    def _run(self) -> Any:  # noqa: C901 - one opcode per branch, as pickle.py's dispatch table
        data = self.data
        stack = self.stack
        marks = self.marks
        memo = self.memo
        end = len(data)
        pos = 0
        while True:
            items = self.items
            if items is not None and len(marks) == self.depth:
                n = len(stack) - self.base
                if (not n & 1 or not self.pairs) and (n == 0 or _complete(stack[-1])):
                    pos = items(pos)
                    if pos - self.released > _RELEASE:
                        self._release(pos)
            if pos >= self.frame_end:  # a protocol-4 frame ends here (an opcode across its end: refused)
                if pos > self.frame_end:
                    raise _Unsupported
                self.frame_end = _NO_FRAME
            if pos >= end:
                raise _Unsupported
            op = data[pos]
            pos += 1
            # as strict as the C unpickler: arguments inside the data, no pop below the last MARK
            if pos + _ARG_WIDTH.get(op, 0) > end:
                raise _Unsupported
            if len(stack) - (marks[-1] if marks else 0) < _POPS.get(op, 0):
                raise _Unsupported
            if op == 0x94:  # MEMOIZE
                if self.family is None:
                    self._family(True)
                elif not self.family:
                    raise _Unsupported
                memo[self.memo_len] = stack[-1]
                self.memo_len += 1
            elif op == 0x71:  # BINPUT
                self._put(data[pos], stack[-1])
                pos += 1
            elif op == 0x72:  # LONG_BINPUT
                self._put(int.from_bytes(data[pos : pos + 4], "little"), stack[-1])
                pos += 4
            elif op == 0x68:  # BINGET
                try:
                    stack.append(memo[data[pos]])
                except KeyError:
                    stack.append(self._dropped(data[pos]))
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                i = int.from_bytes(data[pos : pos + 4], "little")
                try:
                    stack.append(memo[i])
                except KeyError:
                    stack.append(self._dropped(i))
                pos += 4
            elif op in (0x8C, 0x58, 0x8D):  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                w = _LEN_ARG[op]
                n = int.from_bytes(data[pos : pos + w], "little")
                pos += w
                if pos + n > end:
                    raise _Unsupported
                stack.append(str(data[pos : pos + n], "utf-8", "surrogatepass"))
                pos += n
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x4D:  # BININT2
                stack.append(int.from_bytes(data[pos : pos + 2], "little"))
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(int.from_bytes(data[pos : pos + 4], "little", signed=True))
                pos += 4
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                w = _LEN_ARG[op]
                n = int.from_bytes(data[pos : pos + w], "little", signed=op == 0x8B)
                pos += w
                if n < 0 or pos + n > end:
                    raise _Unsupported
                stack.append(int.from_bytes(data[pos : pos + n], "little", signed=True))
                pos += n
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == 0x74:  # TUPLE
                k = self._pop_mark()
                t = tuple(stack[k:])
                del stack[k:]
                stack.append(t)
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x61:  # APPEND
                v = stack.pop()
                if type(stack[-1]) is not list:
                    raise _Unsupported
                stack[-1].append(v)
            elif op == 0x65:  # APPENDS
                k = self._pop_mark()
                if k <= self._fence() or type(stack[k - 1]) is not list:
                    raise _Unsupported
                stack[k - 1].extend(stack[k:])
                del stack[k:]
            elif op == 0x6C:  # LIST
                k = self._pop_mark()
                lst = stack[k:]
                del stack[k:]
                stack.append(lst)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x64:  # DICT
                k = self._pop_mark()
                kv = stack[k:]
                del stack[k:]
                if len(kv) % 2:
                    raise _Unsupported
                stack.append({kv[j]: kv[j + 1] for j in range(0, len(kv), 2)})
            elif op == 0x73:  # SETITEM
                v = stack.pop()
                k = stack.pop()
                self._setitems(stack[-1], [k, v])
            elif op == 0x75:  # SETITEMS
                k = self._pop_mark()
                kv = stack[k:]
                del stack[k:]
                if len(kv) % 2 or k <= self._fence():
                    raise _Unsupported
                self._setitems(stack[k - 1], kv)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                if len(marks) == 2:
                    self._items_start()
                elif self.plans_mark and type(stack[-1]) is list and stack[-2] == "items":
                    self._write_items_start()
            elif op == 0x30:  # POP
                if marks and marks[-1] == len(stack):
                    self._pop_mark()
                else:
                    stack.pop()
            elif op == 0x31:  # POP_MARK
                del stack[self._pop_mark() :]
            elif op == 0x32:  # DUP
                stack.append(stack[-1])
            elif op == 0x63:  # GLOBAL
                nl = data.find(b"\n", pos)
                nl2 = data.find(b"\n", nl + 1)
                if nl < 0 or nl2 < 0:
                    raise _Unsupported
                module = str(data[pos:nl], "utf-8")
                name = str(data[nl + 1 : nl2], "utf-8")
                pos = nl2 + 1
                stack.append(self._find(module, name))
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise _Unsupported
                stack.append(self._find(module, name))
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack[-1]
                if type(args) is not tuple or not isinstance(cls, type):
                    raise _Unsupported
                stack[-1] = cls.__new__(cls, *args)
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = stack.pop()
                args = stack.pop()
                cls = stack[-1]
                if type(args) is not tuple or type(kwargs) is not dict or not isinstance(cls, type):
                    raise _Unsupported
                stack[-1] = cls.__new__(cls, *args, **kwargs)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                if type(args) is not tuple:
                    raise _Unsupported
                stack[-1] = stack[-1](*args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                _build(stack[-1], state)
            elif op == 0x47:  # BINFLOAT
                stack.append(struct.unpack(">d", data[pos : pos + 8])[0])
                pos += 8
            elif op in (0x42, 0x43, 0x8E):  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                w = _LEN_ARG[op]
                n = int.from_bytes(data[pos : pos + w], "little")
                pos += w
                if pos + n > end:
                    raise _Unsupported
                stack.append(bytes(data[pos : pos + n]))
                pos += n
            elif op == 0x8F:  # EMPTY_SET
                stack.append(set())
            elif op == 0x90:  # ADDITEMS
                k = self._pop_mark()
                if k <= self._fence() or type(stack[k - 1]) is not set:
                    raise _Unsupported
                stack[k - 1].update(stack[k:])
                del stack[k:]
            elif op == 0x91:  # FROZENSET
                k = self._pop_mark()
                fs = frozenset(stack[k:])
                del stack[k:]
                stack.append(fs)
            elif op == 0x80:  # PROTO
                if data[pos] > 5:
                    raise _Unsupported
                pos += 1
            elif op == 0x95:  # FRAME: only where no frame is open
                n = int.from_bytes(data[pos : pos + 8], "little")
                if n > end - pos - 8 or self.frame_end != _NO_FRAME:
                    raise _Unsupported
                pos += 8
                self.frame_end = pos + n
            elif op == 0x2E:  # STOP
                return stack.pop()
            else:  # text-mode, extension, persistent-id and buffer opcodes: not in these files
                raise _Unsupported

    def _fence(self) -> int:
        return self.marks[-1] if self.marks else 0

    def _pop_mark(self) -> int:
        k = self.marks.pop()
        if self.items is not None and len(self.marks) < self.depth:
            self.items = None
            self.depth = 2
            self.pairs = True
        if self.plans_mark and len(self.marks) < self.plans_mark:
            self._plans_end()
        return k

    def _dropped(self, idx: int) -> Any:
        """A memo get of an object the decoder did not keep: inside Megatron's ``all_local_plans``
        (whose objects nothing reads) an inert :data:`_DROPPED` if the C unpickler has the entry
        (protocol 4: every index below ``memo_len``); anywhere else the C path decides."""
        if not self.plans_mark or idx >= self.memo_len:
            raise _Unsupported
        return _DROPPED

    def _plans_end(self) -> None:
        """The ``all_local_plans`` batch is appended: forget what it made but strings, numbers and
        globals, so nothing after it reaches an object holding a :data:`_DROPPED` (a get of one
        leaves the file to the C path)."""
        memo, start = self.memo, self.plans_memo
        for k in [k for k, v in memo.items() if k >= start and not _keepable(v)]:
            del memo[k]
        self.plans_mark = 0

    def _find(self, module: str, name: str) -> Any:
        try:
            return DCP_METADATA_GLOBALS[(module, name)]
        except KeyError:
            odd = _odd_global(module, name)  # as RestrictedUnpickler gives it
            if odd is None:
                raise _Unsupported from None  # the C path refuses it, naming it
            return odd

    def _setitems(self, target: Any, kv: list[Any]) -> None:
        if type(target) is dict:
            for j in range(0, len(kv), 2):
                target[kv[j]] = kv[j + 1]
        elif type(target) in (_SdmAcc, _StorageAcc, _PlannerAcc):
            target.vm_items(kv)
        else:
            raise _Unsupported

    def _items_start(self) -> None:
        """On the MARK that opens a batch of items of ``Metadata``'s state: read them with an
        item reader (the dict becomes the reader's accumulator)."""
        stack = self.stack
        if self.marks[0] != 2 or len(stack) < 4 or len(stack) % 2 or self.pats is None:
            return
        if not isinstance(stack[0], _Metadata) or type(stack[1]) is not dict:
            return
        key, top = stack[-2], stack[-1]
        if key == "all_local_plans" and type(top) is list and self.family:
            # Megatron-Core's save plans (protocol 4/5: memo indexes known without the objects)
            self.plans_mark = 2
            self.plans_memo = self.memo_len
            return
        if type(top) is dict and not top and type(key) is str and key in _ACCUMULATORS:
            old = top
            top = stack[-1] = _ACCUMULATORS[key]()
            if type(top) is _SdmAcc:
                top.metas = self.metas
            memo = self.memo
            for k in [k for k, v in memo.items() if v is old]:  # a get of the dict gets the reader's
                memo[k] = top
        kind = type(top)
        if kind is _SdmAcc:
            self.items = self._sdm_items
            self.sdm_acc = top
        elif kind is _StorageAcc:
            self.items = self._storage_items
        elif kind is _PlannerAcc:
            self.items = self._planner_items
        else:
            return
        self.acc = top
        self.base = len(stack)

    # ------------------------------------------------------------------ item readers

    def _sdm_items(self, pos: int) -> int:  # noqa: C901 - the per-item loop, kept flat for speed
        """``fqn: TensorStorageMetadata`` items, as long as templates match them."""
        data, memo, stack, acc = self.data, self.memo, self.stack, self.acc
        hints, templates = self.sdm_hints, self.sdm_templates
        p4 = self.family
        base = self.base
        fend = self.frame_end
        idx = 0
        while True:
            op = data[pos]
            if op == 0x8C:
                s = pos + 2
                e = s + data[pos + 1]
            elif op == 0x58:
                s = pos + 5
                e = s + int.from_bytes(data[pos + 1 : s], "little")
            else:
                return pos
            kb = data[s:e]
            put = data[e]
            if p4:
                if put != 0x94:
                    return pos
                body = e + 1
            elif put == 0x71:
                idx = data[e + 1]
                body = e + 2
            elif put == 0x72:
                idx = int.from_bytes(data[e + 1 : e + 5], "little")
                body = e + 5
            else:
                return pos
            hint = kb.translate(None, _DIGITS)
            t = hints.get(hint)
            m = None if t is None else t.rx.match(data, body)
            if t is None or m is None:
                found = _first_match(templates, data, body) or self._learn_sdm(body)
                if found is None:
                    return pos
                t, m = found
                hints[hint] = t
            stop = m.end()
            if stop > fend:  # across the frame's end: the machine refuses it
                return pos
            try:
                fqn = str(kb, "utf-8", "surrogatepass")
            except UnicodeDecodeError:
                return pos
            if p4:
                memo[self.memo_len] = fqn
                self.memo_len += 1 + t.puts
            else:
                memo[idx] = fqn
            if len(stack) == base:
                acc[fqn] = t.value
            else:
                stack.append(fqn)
                stack.append(_Compact(t.value))
            pos = stop
            if stop == fend:
                return pos  # the machine closes the frame

    def _learn_sdm(self, body: int) -> tuple[_Template, re.Match[bytes]] | None:
        """Match the generic item expression at ``body``, check what its memo references are, and
        learn the item's bytes (any BINPUT index) as a template; None if it does not match."""
        pats = self.pats
        assert pats is not None
        m = pats.sdm.match(self.data, body)
        if m is None:
            return None
        memo = self.memo
        toks = _tokens(self.data, body, m.end())
        if not _gets_known(self.data, toks, memo):
            return None
        r = {g: memo[_gidx(m.group(g))] if m.group(g) else None for g in _SDM_GETS}
        dtype = r["dtype"]
        if (
            r["tsm"] is not _TensorStorageMetadata
            or r["kprop"] != "properties"
            or r["tp"] is not _TensorProperties
            or not isinstance(dtype, TorchDtype)
            or r["lay"] not in (None, _GET_LAYOUT)  # REDUCE(_get_layout, ...) or its memoized result
            or r["mf"] not in (None, _MEM_FORMAT)  # REDUCE(_MEM_FORMAT_ENCODING, ...) or its result
            or r["ksize"] != "size"
            or r["szc"] is not _TORCH_SIZE
            or r["kchunks"] != "chunks"
        ):
            return None
        size = _int_tuple_of(m.group("size"))
        chunks = []
        for c in pats.chunk.finditer(m.group("chunks")):
            cr = [memo[_gidx(c.group(j))] for j in (1, 2, 3, 5, 6)]
            if (
                cr[0] is not _ChunkStorageMetadata
                or cr[1] != "offsets"
                or cr[2] is not _TORCH_SIZE
                or cr[3] != "sizes"
                or cr[4] is not _TORCH_SIZE
            ):
                return None
            chunks.append(ChunkMeta(_int_tuple_of(c.group(4)), _int_tuple_of(c.group(7))))
        if any(x < 0 for x in size) or any(x < 0 for c in chunks for x in (*c.offsets, *c.sizes)):
            return None
        meta = TensorMeta(str(dtype), size, tuple(chunks))
        meta = self.metas.setdefault(meta, meta)
        p2 = not self.family
        rx = b"".join(pats.put if p2 and op in _PUT_OPS else re.escape(self.data[s:e]) for op, s, e in toks)
        t = _Template(re.compile(rx, re.S), meta, sum(op == 0x94 for op, _, _ in toks))
        if len(self.sdm_templates) < _MAX_TEMPLATES:
            self.sdm_templates.append(t)
        again = t.rx.match(self.data, body)
        return None if again is None else (t, again)

    def _storage_items(self, pos: int) -> int:  # noqa: C901 - the per-item loop, kept flat for speed
        """``MetadataIndex: _StorageInfo`` items of tensor chunks, as long as templates match them.

        The per-item work is kept to the match and a few lookups (400k items at 100k tensors):
        the template's fields in locals, an own-string fqn decoded inline, lengths (a few
        distinct values) and path gets decoded once per bytes."""
        data, memo, stack, acc = self.data, self.memo, self.stack, self.acc
        templates, tuples = self.storage_templates, self.tuples
        flat = len(stack) == self.base  # (only the other branch pushes: it stays so)
        fqns, offsets, paths = acc.fqns.append, acc.offsets.append, acc.paths.append
        starts, lengths = acc.starts.append, acc.lengths.append
        from_bytes = int.from_bytes
        fend = self.frame_end
        t = templates[0] if templates else None
        match = None if t is None else t.rx.match
        at = -1 if t is None else t.at
        tputs = 0 if t is None else t.puts
        puts = 0
        names = self._names()
        memo_len = self.memo_len  # memo writes below go at or past it: gets below it are stable
        got_path: dict[bytes, Any] = {}
        ints = self.ints
        # an item across the frame's end: (its position, the next frame's start and end), read
        # from its bytes with the FRAME opcode between left out (see :meth:`_across_frame`)
        joined: tuple[int, int, int] | None = None
        cut = back = 0  # then: where the frame ended in those bytes, and where they start
        try:
            while True:
                m = None if match is None else match(data, pos)
                if m is None:
                    found = _first_match(templates, data, pos)
                    if found is None and joined is None:
                        found = self._learn_storage(pos)
                    if found is not None:
                        t, m = found
                        match, at, tputs = t.rx.match, t.at, t.puts
                if m is None or m.end() > fend:
                    if joined is not None:
                        return back
                    joined = self._across_frame(pos)
                    if joined is None:
                        return pos
                    data, cut, back = self.joined, fend - pos, pos
                    pos, fend = 0, len(data)
                    continue
                stop = m.end()
                if joined is not None and (stop <= cut or not _opcode_at(data, cut, stop)):
                    return back  # (opcodes across the frame's end: the machine refuses them)
                fb, ob, pb, sb, lb = m.groups()
                op = fb[0]
                fqn: Any
                if op == 0x8C:  # a string of its own (each rank's MetadataIndex, gathered by dcp.save)
                    if len(fb) - 2 != fb[1]:  # the lazy match ended early: the machine reads it
                        return pos + back
                    try:
                        fqn = str(fb[2:], "utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        return pos + back
                    fqn = names.get(fqn, fqn)  # the state_dict_metadata key: one string a tensor
                elif op == 0x68 or op == 0x6A:
                    fqn = memo.get(fb[1] if op == 0x68 else from_bytes(fb[1:], "little"))
                else:
                    fqn = _own_string(fb)
                    if fqn is None:
                        return pos + back
                    fqn = names.get(fqn, fqn)
                path = got_path.get(pb)
                if path is None:
                    i = pb[1] if len(pb) == 2 else from_bytes(pb[1:], "little")
                    path = memo.get(i)
                    if type(path) is not str:
                        return pos + back
                    if i < memo_len:
                        got_path[pb] = path
                off = tuples.get(ob, False)
                if off is False:
                    off = _int_tuple_of(ob)
                    off = tuples[ob] = None if any(x < 0 for x in off) else off
                # BININT1 / BININT2 (unsigned) / BININT (signed) / LONG1 (length byte, signed)
                op = sb[0]
                if op == 0x4A:
                    start = from_bytes(sb[1:], "little", signed=True)
                elif op == 0x4B:
                    start = sb[1]
                else:
                    start = from_bytes(sb[2:] if op == 0x8A else sb[1:], "little", signed=op != 0x4D)
                length = ints.get(lb)
                if length is None:
                    op = lb[0]
                    length = (
                        lb[1]
                        if op == 0x4B
                        else from_bytes(lb[2:] if op == 0x8A else lb[1:], "little", signed=op != 0x4D)
                    )
                    if len(ints) < _MAX_INTS:
                        ints[lb] = length
                if type(fqn) is not str or off is None or start < 0 or length < 0:
                    return pos + back
                if start > _I64 or length > _I64:
                    return pos + back
                if at >= 0:
                    memo[memo_len + puts + at] = fqn
                if flat:
                    fqns(fqn)
                    offsets(off)
                    paths(path)
                    starts(start)
                    lengths(length)
                else:
                    stack.append(_Compact((fqn, off, path, start, length, ())))
                    stack.append(None)
                puts += tputs
                pos = stop
                if joined is not None:  # back in the file, inside the next frame
                    _, frame, self.frame_end = joined
                    data, pos, fend = self.data, frame + stop - cut, self.frame_end
                    joined, back = None, 0
                    self.joined = b""
                if pos == fend:
                    return pos
        finally:
            self.memo_len += puts

    def _across_frame(self, pos: int) -> tuple[int, int, int] | None:
        """When the open frame ends a few KiB after ``pos`` and a well-formed FRAME opcode follows
        (as the machine checks it), the bytes from ``pos`` on without that opcode in
        ``self.joined`` (up to :data:`_JOIN` bytes of the next frame), and ``(pos, the next
        frame's first byte, its end)``; else None. CPython's pickler starts a frame between
        two opcodes of an item: 1 item in 40 of ``storage_data`` is across a frame's end."""
        data, fend = self.data, self.frame_end
        end = len(data)
        if not pos < fend <= pos + _JOIN or fend + 9 > end or data[fend] != 0x95:
            return None
        n = int.from_bytes(data[fend + 1 : fend + 9], "little")
        if n > end - fend - 9:
            return None
        frame = fend + 9
        self.joined = data[pos:fend] + data[frame : frame + min(n, _JOIN)]
        return pos, frame, frame + n

    def _learn_storage(self, pos: int) -> tuple[_Template, re.Match[bytes]] | None:
        pats = self.pats
        assert pats is not None
        data = self.data
        m = pats.storage.match(data, pos)
        if m is None:
            return None
        memo = self.memo
        try:
            toks = _tokens(data, pos, m.end())
        except _Unsupported:  # a string's lazy match ended inside an opcode: the machine reads it
            return None
        if not _gets_known(data, toks, memo):
            return None
        at = -1
        fs, fe = m.span("fqn")
        if data[fs] not in (0x68, 0x6A):  # the fqn a string of its own, then its memo put
            ends = {s: (op, e) for op, s, e in toks}
            op, e = ends.get(fs, (0, 0))
            if not self.family or op not in (0x8C, 0x58) or ends.get(e, (0, 0)) != (0x94, fe):
                return None  # (protocol 2/3: a BINPUT index to keep; the machine reads it)
            at = sum(op == 0x94 for op, s, _ in toks if s < fs)
        r = {g: memo[_gidx(m.group(g))] for g in ("mi", "kf", "ki", "ko", "szc", "si", "kp", "ko2", "kl")}
        if (
            r["mi"] is not _MetadataIndex
            or r["kf"] != "fqn"
            or r["ki"] != "index"
            or r["ko"] != "offset"
            or r["szc"] is not _TORCH_SIZE
            or r["si"] is not _StorageInfo
            or r["kp"] != "relative_path"
            or r["ko2"] != "offset"
            or r["kl"] != "length"
        ):
            return None
        # the fields that vary from chunk to chunk become groups, in the order the reader takes them
        off_s, off_e = m.span("off")
        fqn_rx = b"(" + pats.get + b")" if at < 0 else b"(" + _ITEM_PARTS[b"<S>"] + b")" + pats.put
        groups = {m.start("fqn"): (m.end("fqn"), fqn_rx),
                  m.start("idx"): (m.end("idx"), pats.int),
                  m.start("path"): (m.end("path"), b"(" + pats.get + b")"),
                  m.start("start"): (m.end("start"), b"(" + pats.int + b")"),
                  m.start("len"): (m.end("len"), b"(" + pats.int + b")")}  # fmt: skip
        off_toks = [(op, s, e) for op, s, e in toks if off_s <= s < off_e]
        if off_toks[-1][0] in _PUT_OPS:  # the tuple's own memo put stays outside the group
            off_e = off_toks[-1][1]
        ints = sum(1 for op, s, e in off_toks if s < off_e and op not in b"()t\x85\x86\x87")
        shape = data[off_s:off_e]
        shape_rx = re.escape(bytes(shape[:1])) if shape[:1] == b"(" else b""
        shape_rx += pats.int * ints + re.escape(bytes(shape[-1:]))
        groups[off_s] = (off_e, b"(" + shape_rx + b")")
        out = []
        i = 0
        while i < len(toks):
            op, s, e = toks[i]
            g = groups.get(s)
            if g is not None:
                out.append(g[1])
                while i < len(toks) and toks[i][1] < g[0]:
                    i += 1
                continue
            out.append(pats.put if op in _PUT_OPS and not self.family else re.escape(data[s:e]))
            i += 1
        t = _Template(re.compile(b"".join(out), re.S), None, sum(op == 0x94 for op, _, _ in toks), at)
        if len(self.storage_templates) < _MAX_TEMPLATES:
            self.storage_templates.append(t)
        again = t.rx.match(data, pos)
        return None if again is None else (t, again)

    def _planner_items(self, pos: int) -> int:  # noqa: C901 - the per-item loop, kept flat for speed
        """``fqn: (path, ...)`` items of memoized strings: checked and dropped."""
        data, memo = self.data, self.memo
        pats = self.pats
        assert pats is not None
        same, rx, gets, own = pats.planner_same, pats.planner, pats.gets, pats.planner_own
        from_bytes = int.from_bytes
        fend = self.frame_end
        p4 = self.family
        names = self._names()
        n = 0  # memo puts (protocol 4)
        try:
            while True:
                if p4 and data[pos] in (0x8C, 0x58):  # a key of its own (gathered ranks): (fqn,)
                    m = own.match(data, pos)
                    key = None if m is None or m.end() > fend else _own_string(m.group(1))
                    if key is None or type(memo.get(_gidx(m.group(2)))) is not str:  # type: ignore[union-attr]
                        return pos
                    memo[self.memo_len + n] = names.get(key, key)
                    n += 2
                    pos = m.end()  # type: ignore[union-attr]
                    if pos == fend:
                        return pos
                    continue
                m = same.match(data, pos)  # (fqn,) of the key itself: the common item
                if m is not None:
                    k, v = m.groups()
                    if k != v:
                        m = None
                    elif type(memo.get(k[1] if len(k) == 2 else from_bytes(k[1:], "little"))) is not str:
                        return pos
                if m is None:
                    m = rx.match(data, pos)
                    if m is None:
                        return pos
                    if type(memo.get(_gidx(m.group(1)))) is not str:
                        return pos
                    for g in gets.finditer(m.group(2)):
                        if _gidx(g.group()) not in memo:
                            return pos
                stop = m.end()
                if stop > fend:
                    return pos
                n += 1
                pos = stop
                if stop == fend:
                    return pos
        finally:
            if self.family:
                self.memo_len += n

    def _write_items_start(self) -> None:
        """On the MARK of a batch of a save plan's ``items`` (inside ``all_local_plans``): read
        them with :meth:`_write_items`."""
        if self.items is None:
            self.items = self._write_items
            self.depth = len(self.marks)
            self.pairs = False
            self.base = len(self.stack)

    def _write_items(self, pos: int) -> int:
        """Tensor ``WriteItem`` s of a save plan, as long as :data:`_WRITE_ITEM` matches them: each
        checked and dropped (an inert :data:`_DROPPED` stands for it on the stack).

        What the C unpickler does with such an item is fixed by its bytes: it makes new objects,
        sets their state and fills their fresh state dicts, and only places the objects its memo
        gets fetch (never calls, builds, fills or hashes one), so it cannot fail nor change an
        object made before. The keys and classes are checked (once per bytes: a memo index holds
        one object), the values' gets refer to entries made before the item (protocol 4: below
        ``memo_len``)."""
        data, memo, stack = self.data, self.memo, self.stack
        pats = self.pats
        assert pats is not None and pats.write_item is not None
        templates = self.item_templates
        fend = self.frame_end
        names = self._names()
        from_bytes = int.from_bytes
        t = templates[-1] if templates else None
        while True:
            m = None if t is None else t.match(data, pos)
            if m is None:
                t, m = self._learn_write_item(pos)
                if m is None:
                    return pos
            stop = m.end()
            if stop > fend:
                return pos
            fqn_s, chunk_g, props_g, *rest = m.group(*_WRITE_ITEM_READ)
            n = self.memo_len
            for b in rest[:_WRITE_ITEM_NVALUES]:  # the values' gets: entries made before the item
                if b is not None and (b[1] if len(b) == 2 else from_bytes(b[1:], "little")) >= n:
                    return pos
            puts = 6
            for b in rest[_WRITE_ITEM_NVALUES:]:  # a new torch.Size: its tuple's, TUPLE1's, REDUCE's
                if b is not None:
                    puts += 2 if b == b")" else 3
            if chunk_g is None:  # a new ChunkStorageMetadata
                puts += 2
            if props_g is None:  # a new TensorProperties
                puts += 2
            if fqn_s is not None:
                fqn = _own_string(fqn_s)
                if fqn is None:
                    return pos
                memo[n + 4] = names.get(fqn, fqn)  # (WriteItem, its dict, MetadataIndex, its dict)
                puts += 1
            self.memo_len = n + puts
            stack.append(_DROPPED)
            pos = stop
            if stop == fend:
                return pos

    def _learn_write_item(self, pos: int) -> tuple[re.Pattern[bytes] | None, re.Match[bytes] | None]:
        """A template whose keys and classes match the write item at ``pos`` (the one known, or
        one made after checking them), and its match; (None, None) if it is not a write item."""
        pats = self.pats
        assert pats is not None and pats.write_item is not None
        for t in self.item_templates:
            m = t.match(self.data, pos)
            if m is not None:
                return t, m
        g = pats.write_item.match(self.data, pos)
        if g is None or len(self.item_templates) >= _MAX_TEMPLATES:
            return None, None
        keys = g.group(*_WRITE_ITEM_KEYS)
        if not _write_item_keys_known(keys, self.memo):
            return None, None
        t = pats.write_item_rx(keys)
        self.item_templates.append(t)
        return t, t.match(self.data, pos)


def _own_string(b: bytes) -> str | None:
    """The text of a SHORT_BINUNICODE / BINUNICODE opcode matched by ``<S>`` (a lazy match: None
    unless its length field says it ends there), or None if it is not UTF-8."""
    s = 2 if b[0] == 0x8C else 5
    if len(b) - s != (b[1] if s == 2 else int.from_bytes(b[1:5], "little")):
        return None
    try:
        return str(b[s:], "utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def _first_match(templates: list[_Template], data: Any, pos: int) -> tuple[_Template, re.Match[bytes]] | None:
    """The first of ``templates`` matching at ``pos``, and its match."""
    for t in templates:
        m = t.rx.match(data, pos)
        if m is not None:
            return t, m
    return None


_SDM_GETS = ("tsm", "kprop", "tp", "dtype", "lay", "mf", "ksize", "szc", "kchunks")


#: The key and class gets of a :data:`_WRITE_ITEM` and what each must be (a key its string).
_WRITE_ITEM_EXPECT: dict[str, Any] = {
    "wi": _WriteItem, "k_index": "index", "mi": _MetadataIndex, "k_fqn": "fqn", "k_idx": "index",
    "k_off": "offset", "off_c": _TORCH_SIZE, "k_type": "type", "k_bio": "bytes_io_data",
    "k_td": "tensor_data", "twd": _TensorWriteData, "k_chunk": "chunk", "csm": _ChunkStorageMetadata,
    "k_co": "offsets", "co_c": _TORCH_SIZE, "k_cz": "sizes", "cz_c": _TORCH_SIZE,
    "k_props": "properties", "tp": _TensorProperties, "k_size": "size", "size_c": _TORCH_SIZE,
}  # fmt: skip
_WRITE_ITEM_KEYS = tuple(_WRITE_ITEM_EXPECT)
_WRITE_ITEM_VALUES = ("fqn_g", "off_g", "type_g", "chunk_g", "co_g", "cz_g", "props_g", "dt_g", "lay_g",
                      "mf_g", "size_g")  # fmt: skip
_WRITE_ITEM_NVALUES = len(_WRITE_ITEM_VALUES)
#: What the reader takes of a write item's match: then the values' gets, then the new sizes' tuples.
_WRITE_ITEM_READ = ("fqn_s", "chunk_g", "props_g", *_WRITE_ITEM_VALUES, "off_t", "co_t", "cz_t", "size_t")


def _write_item_keys_known(sig: tuple[bytes | None, ...], memo: dict[int, Any]) -> bool:
    """Whether the key and class gets of a write item (``sig``: :data:`_WRITE_ITEM_KEYS`' bytes)
    refer to the strings and classes they must be."""
    for b, want in zip(sig, _WRITE_ITEM_EXPECT.values(), strict=True):
        if b is None:
            continue
        got = memo.get(_gidx(b), _DROPPED)
        if got is not want if not isinstance(want, str) else type(got) is not str or got != want:
            return False
    return True


class _Dropped(_StandIn):
    """What the decoder has instead of an object of Megatron's ``all_local_plans`` it did not keep:
    a value only (building, filling, calling or hashing it leaves the file to the C path)."""

    __slots__ = ()

    def _global(self) -> str:
        return "an object of all_local_plans"

    def __hash__(self) -> int:
        raise _Unsupported


_DROPPED = _Dropped()


def _keepable(v: Any) -> bool:
    """Whether a memo entry holds nothing that a :data:`_DROPPED` could be inside of."""
    return type(v) in (str, int, bool, float, type(None)) or isinstance(v, (_StandIn, _StandInType))


def _gets_known(data: Any, toks: list[tuple[int, int, int]], memo: dict[int, Any]) -> bool:
    """Whether every BINGET / LONG_BINGET among ``toks`` refers to a memo entry the decoder kept
    (a template's references are checked once: later items of it have the same bytes there)."""
    return all(_gidx(data[s:e]) in memo for op, s, e in toks if op in (0x68, 0x6A))


def _complete(top: Any) -> bool:
    """Whether the object on top of the stack is a finished item value (so the next item may start)."""
    if isinstance(top, Record):
        return top.state is not None
    return not callable(top)


def _build(inst: Any, state: Any) -> None:
    """BUILD as the C unpickler does it: ``__setstate__``, else the ``__dict__`` (and slots)."""
    setstate = getattr(inst, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return
    slots = None
    if type(state) is tuple and len(state) == 2:
        state, slots = state
    if state:
        if type(state) is not dict:
            raise _Unsupported
        d = inst.__dict__
        for k, v in state.items():
            d[sys.intern(k) if type(k) is str else k] = v
    if slots:
        if type(slots) is not dict:
            raise _Unsupported
        for k, v in slots.items():
            setattr(inst, k, v)


# --------------------------------------------------------------------------- torch.save state dicts


@dataclass(frozen=True, slots=True)
class MeshInfo:
    """A pickled ``DeviceMesh``, as plain data.

    Attributes:
        names: ``_mesh_dim_names`` (None when unnamed).
        shape: the size of each mesh dim.
        coordinate: this rank's ``_coordinate_on_dim`` (None when not recorded).
        rank: this rank's global rank ``_rank`` (None when not recorded).
        root: the mesh this one was sliced from (``_root_mesh``), or None for a root mesh.
    """

    names: tuple[str, ...] | None
    shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    rank: int | None
    root: MeshInfo | None


@dataclass(frozen=True, slots=True)
class StoredDTensor:
    """A pickled ``DTensor``: its local tensor and what its ``DTensorSpec`` says.

    Attributes:
        local: the local tensor (its storage record, dtype, size, stride).
        dtype: torch dtype name of the DTensor.
        shape: the global shape.
        mesh: the mesh it lives on.
        placements: one per mesh dim, as text (``S(0)``, ``_S(0, 2)``, ``R``, ``P(sum)``).
    """

    local: StoredTensor
    dtype: str
    shape: tuple[int, ...]
    mesh: MeshInfo
    placements: tuple[str, ...]


class _DTensorClass(_StandIn):
    """The ``DTensor`` class global: only a marker that ``_rebuild_from_type_v2`` recognises."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)


class _WrapperSubclass(Record):
    """What ``_rebuild_wrapper_subclass(cls, dtype, size, stride, ...)`` made (the DTensor shell)."""


class _DTensorSpec(Record):
    pass


class _DeviceMesh(Record):
    pass


class _MeshLayout(Record):
    pass


class _FlatLayout(Record):
    pass


class _SpecTensorMeta(Record):
    pass


class _ShardOrderEntry(Record):
    pass


class _Placement(Record):
    """A placement instance; its text comes from the class (:data:`_PLACEMENT_TEXT`) and its state."""

    kind = ""


class _Shard(_Placement):
    kind = "S"


class _StridedShardP(_Placement):
    kind = "_S"


class _ReplicateP(_Placement):
    kind = "R"


class _PartialP(_Placement):
    kind = "P"


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, *_rest: Any) -> _WrapperSubclass:
    if type(cls) is not _DTensorClass or not isinstance(dtype, TorchDtype) or _int_tuple(size) is None:
        raise ValueError("_rebuild_wrapper_subclass of something other than a DTensor")
    return _WrapperSubclass(dtype, tuple(size), stride)


def _placement_text(p: Any) -> str:
    """``S(0)``, ``_S(0, 2)``, ``R``, ``P(sum)`` (made once a record: placements are shared)."""
    if isinstance(p, Record) and p.made is not None:
        return p.made  # type: ignore[no-any-return]
    text = _placement_text_of(p)
    if isinstance(p, Record):
        p.made = text
    return text


def _placement_text_of(p: Any) -> str:
    st = p.state if isinstance(p.state, dict) else {}
    if isinstance(p, _Shard) and type(st.get("dim")) is int:
        return f"S({st['dim']})"
    if isinstance(p, _StridedShardP) and type(st.get("dim")) is int and type(st.get("split_factor")) is int:
        return f"_S({st['dim']}, {st['split_factor']})"
    if isinstance(p, _ReplicateP):
        return "R"
    if isinstance(p, _PartialP) and isinstance(st.get("reduce_op"), str):
        return f"P({st['reduce_op']})"
    raise ValueError(f"placement {type(p).__name__} {st!r} is not Shard, _StridedShard, Replicate or Partial")


def _mesh_info(m: Any, depth: int = 0) -> MeshInfo:
    """A ``DeviceMesh`` record's names, shape (from ``_layout``, or the ``mesh`` tensor of older torch),
    coordinate, rank and root mesh; made once a record (a file's DTensors share their mesh: 100k
    tensors made 100k of them, 6 s and a MeshInfo each)."""
    if depth == 0 and isinstance(m, _DeviceMesh) and m.made is not None:
        return m.made  # type: ignore[no-any-return]
    info = _mesh_info_of(m, depth)
    if depth == 0:
        m.made = info
    return info


def _mesh_info_of(m: Any, depth: int) -> MeshInfo:
    st = _state(m, _DeviceMesh, "a DTensor's mesh")
    layout = st.get("_layout")
    if isinstance(layout, _MeshLayout) and isinstance(layout.state, dict):
        shape = []
        for ax in layout.state.get("axes") or ():
            sizes = _dims(_state(ax, _FlatLayout, "a mesh layout axis").get("shape"), "mesh axis shape")
            n = 1
            for s in sizes:
                n *= s
            shape.append(n)
    elif isinstance(st.get("mesh"), StoredTensor):
        shape = list(st["mesh"].size)
    else:
        raise ValueError("DeviceMesh has neither _layout nor mesh")
    names = st.get("_mesh_dim_names")
    if names is not None and (
        not isinstance(names, tuple) or not all(isinstance(n, str) for n in names) or len(names) != len(shape)
    ):
        raise ValueError(f"DeviceMesh dim names {names!r} do not fit its shape {shape}")
    coord, rank, root = st.get("_coordinate_on_dim"), st.get("_rank"), st.get("_root_mesh")
    return MeshInfo(
        names,
        tuple(shape),
        None if coord is None else _dims(coord, "DeviceMesh coordinate"),
        rank if type(rank) is int else None,
        None if root is None or depth > 4 else _mesh_info(root, depth + 1),
    )


_REBUILD_WRAPPER = _Call(_rebuild_wrapper_subclass, "torch._utils._rebuild_wrapper_subclass")


def _rebuild_from_type_v2(
    func: Any, new_type: Any, args: Any, state: Any
) -> StoredDTensor | UnreadableTensor:
    """A DTensor: the wrapper's dtype and global shape, the local tensor and the spec from ``state``."""
    if func is not _REBUILD_WRAPPER or type(new_type) is not _DTensorClass or not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 of a tensor subclass other than DTensor")
    shell = _rebuild_wrapper_subclass(*args)
    d = state[1] if isinstance(state, tuple) and len(state) == 2 else state
    if isinstance(d, dict) and isinstance(d.get("_local_tensor"), UnreadableTensor):
        return UnreadableTensor(str(shell.args[0]), shell.args[1])
    if not isinstance(d, dict) or not isinstance(d.get("_local_tensor"), StoredTensor):
        raise ValueError("DTensor state has no _local_tensor")
    spec = _state(d.get("_spec"), _DTensorSpec, "DTensor _spec")
    pls = spec.get("placements")
    if not isinstance(pls, tuple) or not all(isinstance(p, _Placement) for p in pls):
        raise ValueError(f"DTensorSpec placements {pls!r} are not placements")
    mesh = _mesh_info(spec.get("mesh"))
    if len(pls) != len(mesh.shape):
        raise ValueError(f"{len(pls)} placements for a {len(mesh.shape)}-dim mesh")
    dtype, shape = shell.args[0], shell.args[1]
    return StoredDTensor(d["_local_tensor"], str(dtype), shape, mesh, tuple(_placement_text(p) for p in pls))


def _rebuild_parameter(data: Any, _requires_grad: Any, _hooks: Any, *_rest: Any) -> Any:
    """An ``nn.Parameter``: its tensor (a state dict saved with ``keep_vars=True``)."""
    if not isinstance(data, (StoredTensor, StoredDTensor)):
        raise ValueError("_rebuild_parameter of something other than a tensor")
    return data


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def _latin1_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode``, which protocol-2 pickles use for ``bytes`` values: latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError("_codecs.encode of something other than latin-1 text")
    return text.encode("latin1")


_PT = "torch.distributed.tensor.placement_types"
_SPEC = "torch.distributed.tensor._dtensor_spec"
_LAYOUT = "torch.distributed._mesh_layout"

#: Everything a ``torch.save`` of a state dict refers to: plain tensors and parameters, DTensors
#: (spec, DeviceMesh, placements), ``OrderedDict``; containers and scalars need no global.
TORCH_SAVE_STATE_GLOBALS: dict[tuple[str, str], Any] = _named(
    {
        **TORCH_SAVE_TENSOR_GLOBALS,
        ("torch._utils", "_rebuild_parameter"): _Call(_rebuild_parameter, "torch._utils._rebuild_parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"): _Call(
            _rebuild_from_type_v2, "torch._tensor._rebuild_from_type_v2"
        ),
        ("torch._utils", "_rebuild_wrapper_subclass"): _REBUILD_WRAPPER,
        ("torch.distributed.tensor", "DTensor"): _DTensorClass("torch.distributed.tensor.DTensor"),
        ("torch.distributed.tensor._api", "DTensor"): _DTensorClass("torch.distributed.tensor._api.DTensor"),
        (_SPEC, "DTensorSpec"): _DTensorSpec,
        (_SPEC, "TensorMeta"): _SpecTensorMeta,
        (_SPEC, "ShardOrderEntry"): _ShardOrderEntry,
        ("torch.distributed.device_mesh", "DeviceMesh"): _DeviceMesh,
        (_LAYOUT, "_MeshLayout"): _MeshLayout,
        (_LAYOUT, "_FlatLayout"): _FlatLayout,
        (_PT, "Shard"): _Shard,
        (_PT, "_StridedShard"): _StridedShardP,
        (_PT, "Replicate"): _ReplicateP,
        (_PT, "Partial"): _PartialP,
        ("torch", "device"): _Call(_device, "torch.device"),
        ("torch", "Size"): _TORCH_SIZE,
        ("torch.serialization", "_get_layout"): _GET_LAYOUT,
        ("_codecs", "encode"): _Call(_latin1_bytes, "_codecs.encode"),
    }
)


def load_torch_save(data: bytes, *, path: str, fast: bool = True) -> Any:
    """The object a ``torch.save`` archive's ``data.pkl`` holds, run-free: dicts, lists and scalars
    as themselves, tensors as :class:`StoredTensor`, DTensors as :class:`StoredDTensor`.

    A state dict of many tensors is read by learnt item templates
    (:mod:`reshard.io.pt_pickle`: bounded memory, the same values); any pickle that decoder
    leaves, and every one with ``fast=False``, by the C unpickler, which gives the errors.

    Raises:
        UnsafePickleError: the pickle refers to a global outside :data:`TORCH_SAVE_STATE_GLOBALS`
            (nothing of it ran).
        HeaderError: the pickle is damaged or builds those objects from the wrong fields.
    """
    if fast:
        from .pt_pickle import Unsupported, decode_state_pickle

        try:
            return decode_state_pickle(data, path, lambda b, memo: _load_with_memo(b, memo, path), _STAND_INS)
        except Unsupported:
            pass
    return restricted_load(
        data,
        path=path,
        allowed=TORCH_SAVE_STATE_GLOBALS,
        what="torch.save",
        persistent_load=storage_persistent_load,
    )


_STAND_INS: dict[str, Any] = {
    "OrderedDict": TORCH_SAVE_STATE_GLOBALS[("collections", "OrderedDict")],
    "StoredDTensor": StoredDTensor,
    "StoredTensor": StoredTensor,
    "StorageRef": StorageRef,
    "StorageType": _StorageType,
    "rebuild": _rebuild,
    "rebuild_v2": TORCH_SAVE_STATE_GLOBALS[("torch._utils", "_rebuild_tensor_v2")],
    "itemsize": lambda dtype: DTYPE_SIZES[SAFETENSORS_DTYPES[dtype]],
}


class _MemoDonor(pickle.Unpickler):
    """Fills a memo with given objects (``up.memo = donor.memo``: CPython 3.11 drops a dict's)."""

    def __init__(self, data: bytes, objs: Mapping[int, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._objs = objs

    def persistent_load(self, pid: Any) -> Any:
        return self._objs[pid]


def _load_with_memo(data: bytes, memo: Mapping[int, Any], path: str) -> tuple[Any, dict[int, Any]]:
    """Run ``data`` through :class:`RestrictedUnpickler` (the state-dict allow-list) with ``memo``
    preset: what it returns and its memo after. Any error is the caller's cue to give up."""
    from .pt_pickle import Unsupported

    try:
        fill = bytearray(b"\x80\x02")
        for k in memo:
            fill += b"J" + struct.pack("<i", k) + b"Qr" + struct.pack("<I", k) + b"0"
        donor = _MemoDonor(bytes(fill + b"N."), memo)
        donor.load()
        up = RestrictedUnpickler(
            io.BytesIO(data),
            path=path,
            allowed=TORCH_SAVE_STATE_GLOBALS,
            what="torch.save",
            persistent_load=storage_persistent_load,
        )
        up.memo = donor.memo
        got = up.load()
        return got, up.memo.copy()
    except Exception:  # noqa: BLE001 - any verdict is the C path's, on the whole file
        raise Unsupported from None
