"""Per-rank ``torch.save`` files (``.pt``): veRL FSDP checkpoints and any ``torch.save(state_dict)``
per rank, read without torch and without running any pickled code.

Each file is a ``torch.save`` zip. Its ``data.pkl`` is read by
:func:`reshard.io.unpickle.load_torch_save`, whose allow-list holds only what a
state dict refers to (tensor and parameter rebuilds, storages, DTensor with its
spec, DeviceMesh and placements, ``OrderedDict``); anything else exits 2 naming
the file and the global, and nothing of the pickle runs. Tensor bytes stay in
the zip's stored ``data/N`` records and are read in place by offset.

- **Rank numbers** come from the file names: ``…rank_{r}.pt``, ``rank-{r}.pt``,
  or ``…_{r}.pt`` when the name holds one number; ``.bin`` with ``rank`` in the name
  (accelerate's ``use_dcp=False`` ``pytorch_model_fsdp_0_rank{r}.bin``). A directory
  holding several kinds of rank files (veRL's ``model_…``, ``optim_…``,
  ``extra_state_…``; accelerate's ``optimizer_0_rank{r}.bin``) is read through its
  ``model`` files.
- **One file** (``torch.save(model.state_dict())``: ``model.pt``, ``pytorch_model.bin``),
  given as the path or alone in its directory without a rank number, is a world of one.
- **transformers' legacy weights** (``save_pretrained(safe_serialization=False)``): a directory
  holding ``pytorch_model.bin``, or ``pytorch_model-0000i-of-0000N.bin`` shards with
  ``pytorch_model.bin.index.json``, is one consolidated checkpoint (a world of one whose
  tensors lie in several files), chosen as ``from_pretrained`` chooses, whatever else the
  directory holds (``training_args.bin``, ``optimizer.pt``, ``rng_state_{r}.pth``).
- **Leaves** of nested dicts and lists are named by their keys joined with ``.``.
  Non-tensor leaves (ints, strings, ...) are listed, not converted.
- **DTensors describe themselves**: global shape, placements (``_StridedShard``
  included) and mesh, checked equal on every rank; each file's mesh coordinate
  must be the one its rank number gives. A DTensor on a sub-mesh (``mesh["tp"]``)
  is replicated over the root mesh's other dims.
- **Plain tensors** take their placements from ``--source-layout`` (its mesh must
  be the DTensors' mesh); without one they are replicated, with a warning
  (``inspect --check`` verifies the replicas), and a checkpoint of plain
  tensors only needs a layout unless it is a single file.
- **Views are read as torch holds them**: a tensor saved as a view of a bigger storage
  (``x.t()``, ``x.permute(...)``, ``big[::3]``, ``big[4:7]``, an ``expand``) is what
  ``torch.load`` gives back, ``.contiguous()``. A row-major one is read in place; any other
  gets a region of a spool file under ``$TMPDIR`` when the file is opened (:mod:`reshard.io.spool`,
  removed at exit; nothing is written then), filled with its row-major copy, tile by tile in
  bounded memory, when a command first reads it (the record's CRC32 checked on the way: a
  mismatch is an error naming the file and tensor, a ``crc32`` problem for ``inspect --check``).
  So ``inspect`` and ``plan`` copy nothing, and ``convert --exclude`` of a view never copies it.
  Reports name the ``.pt`` file, never the spool (:attr:`~reshard.checkpoint.Checkpoint.spooled`).
- Legacy (pre-zip, ``_use_new_zipfile_serialization=False``) files are refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import UNREADABLE, Checkpoint, CheckpointWarning, NonTensor, Spooled
from ..dtypes import DTYPE_SIZES
from ..errors import (
    HeaderError,
    LayoutError,
    ReshardError,
    SourceChangedError,
    TensorNotFoundError,
    UsageError,
)
from ..io.header import Header, TensorEntry
from ..io.spool import LazySpool, SpoolCheckError, strided_span
from ..io.torchsave import geometry_of, leaves, locate, stored_record
from ..io.torchzip import TorchZip, crc32_range, read_record, read_torch_zip
from ..io.unpickle import MeshInfo, StoredDTensor, StoredTensor, UnreadableTensor, load_torch_save
from ..mesh import Mesh
from ..placements import Placement, Shard, StridedShard, parse_placement
from .base import MAYBE, NO, YES, Probe, Reader, ReadOptions
from .hf import duplicates
from .hf_extras import read_weight_index
from .per_rank import RankFiles, exact_rules, layout_describe, rank_checkpoint, source_layout

if TYPE_CHECKING:
    from ..config import LayoutConfig

__all__ = ["READER", "BIN_SINGLE", "BIN_INDEX", "pt_files", "rank_of", "read_pt", "open_bin_shards"]

_SUFFIXES = (".pt", ".pth")
_SINGLE_SUFFIXES = (*_SUFFIXES, ".bin")  # one whole state dict: also HF's legacy pytorch_model.bin
_RANK = re.compile(r"(?:^|[^a-z])rank[_-]?(\d+)", re.I)
_NUMBER = re.compile(r"\d+")
#: a training run's state beside the model's file, never a model's weights
_NOT_MODEL = re.compile(r"optim|sched|rng_state|random_state|training_args", re.I)
#: transformers' pickle weights (``save_pretrained(safe_serialization=False)``; transformers < 5)
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_LEGACY_START = b"\x80\x02\x8a\x0a"  # a protocol-2 pickle of torch's 10-byte magic number (LONG1)


def rank_of(name: str) -> tuple[str, int] | None:
    """``(template, rank)`` of a file name: the rank from ``rank_{r}``/``rank-{r}``, else its only
    number when it ends the stem (``…_{r}.pt``; a ``.bin`` needs ``rank``); the template is the
    name with ``{r}`` for it."""
    stem, dot, ext = name.rpartition(".")
    if not dot or "." + ext not in _SINGLE_SUFFIXES:
        return None
    found = list(_RANK.finditer(stem))
    if "." + ext not in _SUFFIXES and not found:  # .bin: accelerate's …_rank{r}.bin; never HF's shards
        return None
    if found:
        a, b = found[-1].span(1)
    else:
        nums = list(_NUMBER.finditer(stem))
        if len(nums) != 1 or nums[0].end() != len(stem) or nums[0].start() == 0:
            return None
        a, b = nums[0].span()
        if stem[a - 1] not in "_-":
            return None
    return stem[:a] + "{r}" + stem[b:] + dot + ext, int(stem[a:b])


def pt_files(directory: Path) -> list[Path]:
    """The rank files in rank order (every rank from 0 to the highest).

    Raises:
        HeaderError: no rank files, files of several kinds, a rank twice or missing.
    """
    groups: dict[str, dict[int, Path]] = {}
    for p in sorted(directory.iterdir()):
        got = rank_of(p.name) if p.is_file() else None
        if got is not None:
            groups.setdefault(got[0], {})
            if got[1] in groups[got[0]]:
                raise HeaderError(
                    f"{p}: rank {got[1]} also given by {groups[got[0]][got[1]].name}", path=str(p)
                )
            groups[got[0]][got[1]] = p
    if not groups:
        single = _single_file(directory)
        if single is not None:
            return [single]
    if len(groups) > 1:  # veRL: model_…, optim_…, extra_state_…; accelerate: pytorch_model_fsdp_0_…,
        # optimizer_0_…: the model is what converts
        groups = {t: g for t, g in groups.items() if "model" in t.lower()} or groups
    if len(groups) != 1:
        kinds = ", ".join(sorted(groups)) or "none"
        raise HeaderError(
            f"{directory}: expected one set of per-rank .pt files named with their rank "
            f"(rank_{{r}}.pt, rank-{{r}}.pt, ..._{{r}}.pt); found {kinds}",
            path=str(directory),
        )
    ((template, files),) = groups.items()
    if len(files) == 1 and 0 not in files and not _RANK.search(template):
        # one file numbered by a step (model_1000.pt, checkpoint-500.pth), not a rank: the whole
        # state dict, as torch.load reads it (a world's rank files are numbered from 0)
        return list(files.values())
    missing = [r for r in range(max(files) + 1) if r not in files]
    if missing:
        found = ", ".join(p.name for p in list(files.values())[:4]) + (", ..." if len(files) > 4 else "")
        raise HeaderError(
            f"{directory}: no .pt file for rank(s) {missing[:8]} (found {found}): per-rank files are "
            "numbered from rank 0; if these are saves of several steps, give the one to convert as SRC",
            path=str(directory),
        )
    return [files[r] for r in range(len(files))]


def _whole(names: Sequence[str]) -> str | None:
    """The one ``torch.save`` file (by suffix) of ``names`` once a training run's other state is
    set aside (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``; accelerate's ``optimizer.bin``
    and ``scheduler.bin`` beside its ``pytorch_model_fsdp.bin``): the model is what converts. None
    when there is none, or several (``model.pt`` and ``ema.pt``: which one is meant?)."""
    found = [n for n in names if n.endswith(_SINGLE_SUFFIXES)]
    if len(found) > 1:
        found = [n for n in found if not _NOT_MODEL.search(n)]
    return found[0] if len(found) == 1 else None


def _single_file(directory: Path) -> Path | None:
    """The directory's whole state dict file (:func:`_whole` of its regular files), else None."""
    name = _whole([p.name for p in sorted(directory.iterdir()) if p.is_file()])
    return None if name is None else directory / name


@dataclass(frozen=True, slots=True)
class DTensorSpec:
    """What a rank file says of a DTensor beyond its local tensor: global shape, mesh, placements
    (one object for all DTensors that say the same: 100k DTensors have a handful)."""

    shape: tuple[int, ...]
    mesh: MeshInfo
    placements: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PtFile:
    """One rank file: its local tensors as header entries (absolute offsets), DTensors, other leaves,
    and the zip's CRC32 of each tensor whose record holds exactly its bytes; ``spooled``: the
    tensors whose row-major copies are in the spool (their entries' offsets are the spool's), and
    what was noticed on the way."""

    header: Header
    dtensors: dict[str, DTensorSpec]
    others: dict[str, Any]
    crc32s: dict[str, int]
    spooled: frozenset[str] = frozenset()
    warnings: tuple[CheckpointWarning, ...] = ()


#: Containers nested deeper than this (a state dict needs a handful) are refused: the pickle can
#: nest lists past Python's recursion limit, or hold a list that contains itself.
MAX_PT_DEPTH = 256
#: Containers and leaves visited in one file: a pickle can refer to one list from many places
#: (``[L1, L1]``, ``L1 = [L2, L2]``, ...), so a small file can name 2**60 leaves.
MAX_PT_NODES = 5_000_000


def _open_zip(fd: int, path: Path) -> TorchZip:
    head = os.pread(fd, 16, 0)
    if head.startswith(_LEGACY_START):
        raise HeaderError(
            f"{path}: a legacy torch.save file (written before torch 1.6 or with "
            "_use_new_zipfile_serialization=False); re-save it with a plain torch.save(obj, path)",
            path=str(path),
        )
    if not head.startswith(b"PK"):
        raise HeaderError(f"{path}: not a torch.save zip archive", path=str(path))
    return read_torch_zip(fd, str(path))


def _entry(
    name: str,
    st: StoredTensor,
    tz: TorchZip,
    path: Path,
    fd: int,
    spool: LazySpool,
    index: int,
    geometries: dict[Any, Any],
) -> tuple[TensorEntry, int | None, list[CheckpointWarning] | None]:
    """Where the local tensor's row-major bytes are, after checking its record: in place when it
    is row-major, else in a region reserved in ``spool`` (its row-major copy, made when first
    read, the record's CRC32 checked then; ``index``: the file's number, for its origin), with
    an empty list of problems instead of a CRC32."""
    g = geometry_of(st, geometries)
    if isinstance(g, str) or g[2]:  # row-major (or a dtype safetensors has no name for): in place
        entry, crc = locate(name, st, tz, path, geometries)
        return entry, crc, None
    q = f'{path}: tensor "{name}"'
    dtype, numel, _ = g
    if min(st.stride) < 0:
        raise LayoutError(
            f"{q} of shape {list(st.size)} has negative strides {list(st.stride)}, which torch "
            "never writes; the file is damaged",
            path=str(path),
            tensor=name,
        )
    isz = DTYPE_SIZES[dtype]
    nbytes = strided_span(st.size, st.stride) * isz  # the stored bytes it spans
    rec, first = stored_record(name, st, tz, path, isz, nbytes)
    at = rec.offset + first
    fill = partial(_fill_view, str(path), name, rec.name, rec.offset, rec.size, rec.crc32, at, st, isz)
    start = spool.reserve(numel * isz, (index, at, at + nbytes), fill)
    return TensorEntry(name, dtype, st.size, start, start + numel * isz), None, []


def _fill_view(
    path: str,
    name: str,
    record: str,
    rec_offset: int,
    rec_size: int,
    crc: int | None,
    at: int,
    st: StoredTensor,
    isz: int,
    spool: LazySpool,
    start: int,
) -> None:
    """Make the spooled row-major copy of a view (a :data:`~reshard.io.spool.Fill`): the record's
    CRC32 checked, then the copy tile by tile."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        now = os.fstat(fd).st_size
        if now < rec_offset + rec_size:  # (a mapped read past the end is SIGBUS)
            raise SourceChangedError(
                f"{path}: the source file changed while it was being read (now {now} bytes, too short "
                f'for tensor "{name}"); is another job rewriting it? Convert again once it is finished',
                path=path,
                tensor=name,
            )
        if crc is not None and crc32_range(fd, rec_offset, rec_size, path) != crc:
            raise SpoolCheckError(
                f'{path}: tensor "{name}": data record {record} fails its CRC32 check; the file is damaged',
                path=path,
                tensor=name,
            )
        spool.write_strided(start, fd, at, st.size, st.stride, isz)
    finally:
        os.close(fd)


def read_pt(
    path: Path, spool: LazySpool | None = None, index: int = 0, shared: dict[Any, Any] | None = None
) -> PtFile:
    """Read one rank file's pickle (restricted; nothing runs) and locate its tensors; reserve the
    row-major copies of those that are not in ``spool`` (one made here when None; made when first
    read), as file number ``index``.
    ``shared`` interns names and DTensor specs across the files of one checkpoint (each file
    names the same 100k tensors: one string each, not one per file).

    Raises:
        UnsafePickleError: a global outside the allow-list (names the file and the global).
        HeaderError: a legacy or damaged file, big-endian data, a tensor record that does not fit.
        LayoutError: negative strides.
    """
    spool = spool if spool is not None else LazySpool("reshard-pt-")
    fd = os.open(path, os.O_RDONLY)
    try:
        tz = _open_zip(fd, path)
        bo = tz.get("byteorder")
        if bo is not None and read_record(fd, tz, bo).strip() != b"little":
            raise HeaderError(
                f"{path}: saved big-endian; re-save it on a little-endian machine", path=str(path)
            )
        obj = load_torch_save(read_record(fd, tz, tz.record("data.pkl")), path=str(path))
        shared = {} if shared is None else shared
        geometries: dict[Any, Any] = {}
        entries: list[TensorEntry] = []
        dtensors: dict[str, DTensorSpec] = {}
        others: dict[str, Any] = {}
        crc32s: dict[str, int] = {}
        spooled: set[str] = set()
        warnings: list[CheckpointWarning] = []
        seen: set[str] = set()
        for name, leaf in leaves(obj, path, max_depth=MAX_PT_DEPTH, max_nodes=MAX_PT_NODES):
            if isinstance(leaf, (StoredTensor, StoredDTensor)):
                if name in seen:
                    raise HeaderError(
                        f'{path}: two tensors of the state dict are both named "{name}" once nested '
                        "keys are joined with '.' (a key 'a.b' beside a key 'a' holding 'b', or 1 "
                        "beside '1'); rename one and re-save",
                        path=str(path),
                        tensor=name,
                    )
                seen.add(name)
                name = shared.setdefault(name, name)
                if isinstance(leaf, StoredDTensor):
                    spec = (leaf.shape, leaf.mesh, leaf.placements)
                    dtensors[name] = shared.get(spec) or shared.setdefault(spec, DTensorSpec(*spec))
                    local = leaf.local
                else:
                    local = leaf
                entry, crc, problems = _entry(name, local, tz, path, fd, spool, index, geometries)
                entries.append(entry)
                if crc is not None:
                    crc32s[name] = crc
                if problems is not None:
                    spooled.add(name)
                    warnings += problems
            else:
                others[name] = leaf
    finally:
        os.close(fd)
    return PtFile(
        Header(tuple(entries), None, 0), dtensors, others, crc32s, frozenset(spooled), tuple(warnings)
    )


def _root(m: MeshInfo) -> MeshInfo:
    return m.root if m.root is not None else m


def _names(m: MeshInfo) -> tuple[str, ...]:
    return m.names if m.names is not None else tuple(f"d{i}" for i in range(len(m.shape)))


def _root_placements(dt: DTensorSpec, root: MeshInfo, name: str, path: Path) -> tuple[str, ...]:
    """The DTensor's placements on the root mesh: a sub-mesh's dims by name, the others replicated."""
    if dt.mesh.root is None:
        return dt.placements
    pos = {n: i for i, n in enumerate(dt.mesh.names or ())}
    out = tuple(dt.placements[pos[n]] if n in pos else "R" for n in _names(root))
    if dt.mesh.names is None or len([n for n in _names(root) if n in pos]) != len(pos):
        raise LayoutError(
            f'{path}: DTensor "{name}" is on a sub-mesh {dt.mesh.names} whose dims are not dims of its '
            f"root mesh {_names(root)} (a flattened mesh dim); redistribute it onto the root mesh first",
            path=str(path),
            tensor=name,
        )
    return out


def _dtensor_mesh(paths: Sequence[Path], files: Sequence[PtFile]) -> Mesh | None:
    """The root mesh every DTensor of every file lives on, each file's coordinate checked against
    its rank; None when there are no DTensors."""
    first = next((dt for f in files for dt in f.dtensors.values()), None)
    if first is None:
        return None
    root = _root(first.mesh)
    mesh = Mesh(_names(root), root.shape)
    if mesh.size != len(paths):
        raise LayoutError(
            f"{paths[0].parent}: {len(paths)} rank files but the DTensors' mesh {mesh} has {mesh.size} ranks",
            path=str(paths[0].parent),
        )
    for r, (p, f) in enumerate(zip(paths, files)):
        for dt, name in _first_names(f).items():  # a spec says the same of each of its names
            rt = _root(dt.mesh)
            if (_names(rt), rt.shape) != (mesh.names, mesh.shape):
                raise LayoutError(
                    f'{p}: DTensor "{name}" is on mesh {_names(rt)} {rt.shape}, not {mesh}; '
                    "every DTensor must share one root mesh",
                    path=str(p),
                    tensor=name,
                )
            if rt.coordinate is not None and rt.coordinate != mesh.coordinate(r):
                raise LayoutError(
                    f"{p}: its DTensors are at mesh coordinate {list(rt.coordinate)}, but rank {r} "
                    f"(from the file name) is at {list(mesh.coordinate(r))} of {mesh}; are the files "
                    "named by global rank?",
                    path=str(p),
                )
    return mesh


def _first_names(f: PtFile) -> dict[DTensorSpec, str]:
    """Each DTensor spec of a file with the first name that has it, in order."""
    out: dict[DTensorSpec, str] = {}
    for name, dt in f.dtensors.items():
        if dt not in out:
            out[dt] = name
    return out


_Described = dict[str, tuple[tuple[int, ...], list[str]]]


def _described(paths: Sequence[Path], files: Sequence[PtFile]) -> _Described:
    """Per DTensor name: global shape and root-mesh placements, equal on every rank."""
    out: _Described = {}
    for i, (p, f) in enumerate(zip(paths, files)):
        said: dict[int, tuple[tuple[int, ...], list[str]]] = {}  # per spec object (one list for its names)
        for name, dt in f.dtensors.items():
            got = said.get(id(dt))
            if got is None:
                got = said[id(dt)] = (dt.shape, list(_root_placements(dt, _root(dt.mesh), name, p)))
            want = out.setdefault(name, got) if i == 0 else out.get(name)
            if want != got:
                shown = "a plain tensor" if want is None else f"{list(want[0])} {want[1]}"
                raise LayoutError(
                    f'{p}: DTensor "{name}" is {list(got[0])} {got[1]}, but {shown} in {paths[0].name}; '
                    "every rank must save the same DTensor",
                    path=str(p),
                    tensor=name,
                )
    return out


def open_pt(directory: Path, options: ReadOptions, paths: Sequence[Path] | None = None) -> Checkpoint:
    """Open a directory of per-rank ``torch.save`` files, or the given ones (see the module docstring)."""
    paths = pt_files(directory) if paths is None else paths
    shared: dict[Any, Any] = {}  # names and DTensor specs, one object each for all files
    spool = LazySpool("reshard-pt-")  # row-major copies of the files' other views (made when read)
    files = [read_pt(p, spool, i, shared) for i, p in enumerate(paths)]
    del shared
    cfg = source_layout(options)
    described = _described(paths, files)
    mesh = _dtensor_mesh(paths, files)
    if cfg is not None and mesh is not None and (cfg.mesh.names, cfg.mesh.shape) != (mesh.names, mesh.shape):
        raise LayoutError(
            f"{directory}: the layout's mesh {cfg.mesh} ({cfg.source}) is not the DTensors' mesh {mesh}; "
            "give a layout on that mesh (its rules are for the plain tensors)",
            path=str(directory),
        )
    if mesh is None:
        mesh = cfg.mesh if cfg is not None else Mesh.single() if len(paths) == 1 else None
    if mesh is None:
        raise LayoutError(
            f"{directory}: the .pt files hold plain tensors, which do not say how they were split; "
            "pass --source-layout FILE (and --source-mesh to set its sizes)",
            path=str(directory),
        )
    plain = [n for n in files[0].header.names if n not in described]
    overridden = _overridden(cfg, described) if cfg is not None else []
    by_layout = layout_describe(cfg.placements_for, mesh, paths[0], cfg.source) if cfg is not None else None

    def describe(
        name: str, local_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[tuple[int, ...], Sequence[Placement | str]]:
        if name in described:
            return described[name]
        if by_layout is not None:
            return by_layout(name, local_shapes)
        return local_shapes[0], ["R"] * mesh.ndim

    rank_files = RankFiles(
        tuple(paths), tuple(f.header for f in files), tuple((r,) for r in range(len(paths)))
    )
    ckpt = rank_checkpoint(directory, "pt", rank_files, mesh, describe)
    ckpt.tensors = {  # inspect --check verifies each piece against the zip's CRC32
        n: replace(t, piece_crc32=tuple(files[f].crc32s.get(n) for f in t.piece_files))
        for n, t in ckpt.tensors.items()
    }
    if len(spool):  # the spooled pieces are in the spool, at their entries' offsets
        sp = len(ckpt.files)
        for n, t in ckpt.tensors.items():
            if any(n in files[f].spooled for f in t.piece_files):
                pfs = tuple(sp if n in files[f].spooled else f for f in t.piece_files)
                ckpt.tensors[n] = replace(t, piece_files=pfs)
        ckpt.files += (str(spool.path),)
        ckpt.file_sizes += (spool.size,)
        ckpt.spooled = {sp: Spooled.of(spool.origins, spool)}
    ckpt.warnings += [w for f in files for w in f.warnings]
    ckpt.non_tensors = tuple(
        NonTensor(n, 0, 0, UNREADABLE)
        if isinstance(v, UnreadableTensor)
        else NonTensor(n, len(v) if isinstance(v, (str, bytes)) else 0, 0, type(v).__name__)
        for n, v in files[0].others.items()
    )
    ckpt.warnings += [
        CheckpointWarning(v.message(str(paths[0]), n), path=str(paths[0]), tensor=n)
        for n, v in files[0].others.items()
        if isinstance(v, UnreadableTensor)
    ]
    if plain and cfg is None and mesh.size > 1:
        ckpt.warnings.append(
            CheckpointWarning(
                f'{paths[0].parent}: {len(plain)} plain tensor(s) (e.g. "{plain[0]}") are taken as '
                "replicated on every rank; pass --source-layout if they are split "
                "(inspect --check verifies the replicas)",
                path=str(paths[0]),
                tensor=plain[0],
            )
        )
    if overridden:
        name, said, ruled = overridden[0]
        more = f" (and {len(overridden) - 1} more)" if len(overridden) > 1 else ""
        ckpt.warnings.append(
            CheckpointWarning(
                f'{paths[0].parent}: DTensor "{name}" says it is {said}, but the layout gives it '
                f"{ruled}{more}; a DTensor's own placements are used (the layout's rules are for the "
                "plain tensors): check that the layout is the one these files were saved with",
                path=str(paths[0]),
                tensor=name,
            )
        )
    ckpt.layout = cfg if cfg is not None else exact_rules(ckpt)
    return ckpt


def _overridden(cfg: LayoutConfig, described: _Described) -> list[tuple[str, str, str]]:
    """DTensors whose own placements differ from what a rule of ``cfg`` gives their name (a rule
    that does not fit, or no rule, is not a difference): ``(name, theirs, the rule's)``."""
    out: list[tuple[str, str, str]] = []
    seen: dict[tuple[int, tuple[str, ...], int], bool] = {}
    for name, (shape, said) in described.items():
        try:
            ruled = cfg.placements_for(name)
        except ReshardError:
            continue
        key = (id(ruled), tuple(said), len(shape))
        same = seen.get(key)
        if same is None:
            try:
                a = [_normal(parse_placement(p), len(shape)) for p in said]
                b = [_normal(p, len(shape)) for p in ruled]
            except ReshardError:
                continue
            same = seen[key] = a == b
        if not same:
            out.append((name, "[" + ", ".join(map(str, said)) + "]", "[" + ", ".join(map(str, ruled)) + "]"))
    return out


def _normal(p: Placement, ndim: int) -> Placement:
    return p.normalized(ndim) if isinstance(p, (Shard, StridedShard)) else p


def open_bin_shards(directory: Path, options: ReadOptions) -> Checkpoint:
    """transformers' sharded pickle weights: ``pytorch_model-0000i-of-0000N.bin`` files named by
    ``pytorch_model.bin.index.json``, as one checkpoint (a world of one) whose tensors lie in
    several ``torch.save`` zips, each read as :func:`read_pt` reads one (nothing pickled runs).

    The index decides which file each tensor is read from, as ``hf`` does for safetensors shards:
    a tensor the index names but its file does not hold exits 2, a tensor in a shard the index
    does not name is ignored with a warning, a second copy elsewhere is checked (see
    :func:`~reshard.formats.hf.duplicates`).

    Raises:
        HeaderError: a broken index, shards it names that are missing.
        TensorNotFoundError: tensors the index names that their shard does not hold.
    """
    weight_map = read_weight_index(directory / BIN_INDEX)
    paths = [directory / n for n in sorted(set(weight_map.values()))]
    parts = [open_pt(directory, options, [p]) for p in paths]
    headers = [_header_of(part) for part in parts]
    pos = {p.name: i for i, p in enumerate(paths)}
    missing = [n for n, f in weight_map.items() if n not in parts[pos[f]].tensors]
    if missing:
        _index_names_missing(directory, missing, weight_map, paths, parts)
    warnings: list[CheckpointWarning] = [w for part in parts for w in part.warnings]
    warnings += duplicates(paths, headers, weight_map, BIN_INDEX)
    for p, part in zip(paths, parts):
        extra = [n for n in part.tensors if n not in weight_map]
        if extra:
            msg = f'{p.name}: tensor "{extra[0]}"' + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
            msg += f" not in {BIN_INDEX}; ignored"
            warnings.append(CheckpointWarning(msg, path=str(p), tensor=extra[0]))
    tensors = {}
    for name in sorted(weight_map):
        i = pos[weight_map[name]]
        t = parts[i].tensors[name]
        tensors[name] = replace(t, piece_files=(i,) * len(t.piece_files))
    ckpt = Checkpoint(
        path=str(directory),
        format="pt",
        files=tuple(str(p) for p in paths),
        file_sizes=tuple(part.file_sizes[0] for part in parts),
        tensors=tensors,
        mesh=parts[0].mesh,
        warnings=warnings,
        non_tensors=tuple(replace(n, file=i) for i, part in enumerate(parts) for n in part.non_tensors),
    )
    cfg = source_layout(options)
    ckpt.layout = cfg if cfg is not None else exact_rules(ckpt)
    return ckpt


def _header_of(ckpt: Checkpoint) -> Header:
    """A one-file checkpoint's tensors as header entries (for :func:`~reshard.formats.hf.duplicates`)."""
    entries = []
    for t in ckpt.tensors.values():
        size = DTYPE_SIZES[t.dtype] * t.numel
        entries.append(TensorEntry(t.name, t.dtype, t.shape, t.piece_offsets[0], t.piece_offsets[0] + size))
    return Header(tuple(entries), None, 0)


def _index_names_missing(
    directory: Path,
    missing: Sequence[str],
    weight_map: Mapping[str, str],
    paths: Sequence[Path],
    parts: Sequence[Checkpoint],
) -> None:
    """Tensors the index names that their shard does not hold: exit 2 naming them (and where they
    are, when another shard holds them: the index belongs to another save)."""
    name = missing[0]
    home = weight_map[name]
    elsewhere = [p.name for p, part in zip(paths, parts) if name in part.tensors]
    more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})"
    where = (
        f"; {', '.join(elsewhere)} holds it: the index and the shards are from different saves"
        if elsewhere
        else "; no shard holds it"
    )
    raise TensorNotFoundError(
        f'{directory / home}: tensor "{name}" is missing ({BIN_INDEX} says it is here)'
        + (more if len(missing) > 1 else "")
        + where
        + "; download or save the checkpoint again",
        path=str(directory / home),
        tensor=name,
    )


def _open(path: Path, options: ReadOptions) -> Checkpoint:
    if path.is_dir():
        single, index = path / BIN_SINGLE, path / BIN_INDEX
        if single.is_file():
            ckpt = open_pt(path, options, [single])
            if index.exists():
                ckpt.warnings.append(
                    CheckpointWarning(
                        f"{path}: holds both {BIN_SINGLE} and {BIN_INDEX}; reading {BIN_SINGLE}, as "
                        f"transformers does (remove {BIN_SINGLE} to read the shards)",
                        path=str(path),
                    )
                )
            return ckpt
        if index.exists():
            return open_bin_shards(path, options)
        return open_pt(path, options)
    if not path.name.endswith(_SINGLE_SUFFIXES):
        raise UsageError(
            f"{path}: a pt checkpoint is a torch.save file ({', '.join(_SINGLE_SUFFIXES)}) "
            "or a directory of per-rank .pt files",
            path=str(path),
        )
    return open_pt(path.parent, options, [path])


def _detect(probe: Probe) -> int:
    if probe.is_file:
        return MAYBE if probe.path.name.endswith(_SINGLE_SUFFIXES) else NO
    if BIN_SINGLE in probe.names or BIN_INDEX in probe.names:
        return YES  # transformers' names; a safetensors model beside them is hf's (it wins ties)
    if any(rank_of(n) is not None for n in probe.names):
        return YES
    return MAYBE if _whole(probe.names) is not None else NO


READER = Reader(
    name="pt",
    help="one torch.save .pt file per rank (rank_{r}.pt, veRL model_world_size_W_rank_r.pt, "
    "accelerate pytorch_model_fsdp_0_rank{r}.bin): "
    "DTensors self-described, plain tensors with --source-layout; or one whole state dict "
    "(model.pt, pytorch_model.bin); transformers' pytorch_model-*-of-*.bin with pytorch_model.bin.index.json",
    detect=_detect,
    open=_open,
)
