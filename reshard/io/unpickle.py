"""Restricted unpicklers for torch's pickles: no pickled code ever runs.

A pickle reaches code only through ``find_class`` (``GLOBAL``/``STACK_GLOBAL``,
``INST``/``OBJ``, ``EXT*``) and ``persistent_load``; ``REDUCE``, ``NEWOBJ`` and
``BUILD`` only call or build what those returned. :class:`RestrictedUnpickler`
answers ``find_class`` from an explicit table (``(module, name) -> object``)
and refuses every other global with :class:`UnsafePickleError` (exit 2) naming
the file and the class; the objects in the tables are inert stand-ins (plain
records, ``tuple``, ``dict``), never torch. Two tables are defined here:

- :data:`DCP_METADATA_GLOBALS` for a DCP ``.metadata`` (plain ``pickle.dump`` of
  ``torch.distributed.checkpoint.metadata.Metadata``), read by
  :func:`load_dcp_metadata` into frozen dataclasses (:class:`DcpMetadata`);
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
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DTYPE_SIZES, TORCH_NAMES
from ..errors import HeaderError

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
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError, OverflowError) as e:  # fmt: skip
        raise HeaderError(
            f"{path}: not a valid {what} pickle ({type(e).__name__}: {e}); the file is damaged "
            "or not written by torch",
            path=path,
        ) from None


# --------------------------------------------------------------------------- stand-ins


class TorchDtype(str):
    """A ``torch.<dtype>`` global, as its name (``"bfloat16"``)."""

    __slots__ = ()


class Record:
    """Inert stand-in for a pickled class instance: remembers its state, runs nothing."""

    # NEWOBJ builds instances with __new__ only, so the defaults live on the class
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


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


def _path_join(*parts: Any) -> str:
    return os.path.join(*(str(p) for p in parts)) if parts else ""


def _identity(x: Any) -> Any:
    return x


_DCP_MOD = "torch.distributed.checkpoint.metadata"
_DTYPE_GLOBALS: dict[tuple[str, str], Any] = {("torch", n): TorchDtype(n) for n in SAFETENSORS_DTYPES}

#: Everything a torch 2.x DCP ``.metadata`` (and Megatron-Core's) refers to.
DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MOD, "Metadata"): _Metadata,
    (_DCP_MOD, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP_MOD, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP_MOD, "TensorProperties"): _TensorProperties,
    (_DCP_MOD, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP_MOD, "MetadataIndex"): _MetadataIndex,
    (_DCP_MOD, "StorageMeta"): _StorageMeta,
    (_DCP_MOD, "_MEM_FORMAT_ENCODING"): int,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"): _MCoreMetadata,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _identity,
    ("pathlib", "PosixPath"): _path_join,
    ("pathlib", "WindowsPath"): _path_join,
    ("pathlib", "PurePosixPath"): _path_join,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_DTYPE_GLOBALS,
}


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


class _StorageType:
    """A ``torch.<X>Storage`` / ``torch.storage.UntypedStorage`` global: just its dtype."""

    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


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
}


def _int_tuple(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, (tuple, list)) and all(type(x) is int for x in v):
        return tuple(v)
    return None


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None) -> StoredTensor:
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
    if dtype is None:
        dtype = storage.dtype
    if dtype is None or dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    isz = DTYPE_SIZES[SAFETENSORS_DTYPES[dtype]]
    nbytes = storage.numel if storage.dtype is None else storage.numel * isz
    return StoredTensor(storage.key, dtype, nbytes, offset, sz, st)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> StoredTensor:
    return _rebuild(storage, offset, size, stride, None)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _rg: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> StoredTensor:
    if not isinstance(dtype, TorchDtype):
        raise ValueError(f"_rebuild_tensor_v3 dtype {dtype!r} is not a torch dtype")
    return _rebuild(storage, offset, size, stride, str(dtype))


#: Everything the ``data.pkl`` of a ``torch.save``-d plain CPU tensor refers to.
TORCH_SAVE_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", n): _StorageType(d) for n, d in _TYPED_STORAGES.items()},
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
    """A ``TensorStorageMetadata``: torch dtype name, global size and its chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]
    _by_offsets: dict[tuple[int, ...], ChunkMeta] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_offsets", {c.offsets: c for c in self.chunks})

    def chunk_at(self, offsets: tuple[int, ...] | None) -> ChunkMeta | None:
        """The chunk at these global offsets (how ``storage_data`` keys refer to chunks), or None."""
        return self._by_offsets.get(offsets) if offsets is not None else None


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


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """A DCP ``.metadata``, as plain values.

    Attributes:
        entries: flattened FQN -> tensor or non-tensor item.
        storage: every stored item.
        version: ``Metadata.version`` (``"1.0.0"`` in torch 2.13; None before).
        megatron: True for Megatron-Core's ``MCoreMetadata``.
    """

    entries: dict[str, TensorMeta | BytesMeta]
    storage: tuple[StorageEntry, ...]
    version: str | None
    megatron: bool


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


def _storage_entry(key: Any, value: Any) -> StorageEntry:
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
    return StorageEntry(
        fqn,
        None if off is None else _dims(off, "MetadataIndex offset"),
        StorageInfo(rel, start, length, tuple(tds)),
    )


def load_dcp_metadata(data: bytes, *, path: str) -> DcpMetadata:
    """Read a DCP ``.metadata`` (or ``__{rank}.metadata``) without running any of it.

    Raises:
        UnsafePickleError: the pickle refers to a class DCP metadata does not use.
        HeaderError: not a pickled ``Metadata``, or fields of the wrong kind.
    """
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
        storage = tuple(_storage_entry(k, v) for k, v in sd.items())
        version = st.get("version")
    except ValueError as e:
        raise HeaderError(f"{path}: not a valid {what} ({e})", path=path) from None
    return DcpMetadata(
        entries, storage, version if isinstance(version, str) else None, isinstance(obj, _MCoreMetadata)
    )


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


class _DTensorClass:
    """The ``DTensor`` class global: only a marker that ``_rebuild_from_type_v2`` recognises."""


_DTENSOR = _DTensorClass()


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
    if cls is not _DTENSOR or not isinstance(dtype, TorchDtype) or _int_tuple(size) is None:
        raise ValueError("_rebuild_wrapper_subclass of something other than a DTensor")
    return _WrapperSubclass(dtype, tuple(size), stride)


def _placement_text(p: Any) -> str:
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
    coordinate, rank and root mesh."""
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


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> StoredDTensor:
    """A DTensor: the wrapper's dtype and global shape, the local tensor and the spec from ``state``."""
    if func is not _rebuild_wrapper_subclass or new_type is not _DTENSOR or not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 of a tensor subclass other than DTensor")
    shell = func(*args)
    d = state[1] if isinstance(state, tuple) and len(state) == 2 else state
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
TORCH_SAVE_STATE_GLOBALS: dict[tuple[str, str], Any] = {
    **TORCH_SAVE_TENSOR_GLOBALS,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch.distributed.tensor", "DTensor"): _DTENSOR,
    ("torch.distributed.tensor._api", "DTensor"): _DTENSOR,
    (_SPEC, "DTensorSpec"): _DTensorSpec,
    (_SPEC, "TensorMeta"): Record,
    (_SPEC, "ShardOrderEntry"): Record,
    ("torch.distributed.device_mesh", "DeviceMesh"): _DeviceMesh,
    (_LAYOUT, "_MeshLayout"): _MeshLayout,
    (_LAYOUT, "_FlatLayout"): _FlatLayout,
    (_PT, "Shard"): _Shard,
    (_PT, "_StridedShard"): _StridedShardP,
    (_PT, "Replicate"): _ReplicateP,
    (_PT, "Partial"): _PartialP,
    ("torch", "device"): _device,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _identity,
    ("_codecs", "encode"): _latin1_bytes,
}


def load_torch_save(data: bytes, *, path: str) -> Any:
    """The object a ``torch.save`` archive's ``data.pkl`` holds, run-free: dicts, lists and scalars
    as themselves, tensors as :class:`StoredTensor`, DTensors as :class:`StoredDTensor`.

    Raises:
        UnsafePickleError: the pickle refers to a global outside :data:`TORCH_SAVE_STATE_GLOBALS`
            (nothing of it ran).
        HeaderError: the pickle is damaged or builds those objects from the wrong fields.
    """
    return restricted_load(
        data,
        path=path,
        allowed=TORCH_SAVE_STATE_GLOBALS,
        what="torch.save",
        persistent_load=storage_persistent_load,
    )
