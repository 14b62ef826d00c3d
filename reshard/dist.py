"""The torchrun path: share a conversion's output files among ranks; live DTensors.

Nothing here imports torch unless the process runs under torchrun
(``WORLD_SIZE`` > 1) or the live-DTensor API is called.

* :func:`coordinator` / :class:`Coordinator`: ``reshard convert`` under torchrun; each
  rank writes its share of the output files (balanced by bytes), rank 0 the manifest.
* :func:`load_dtensors`: a checkpoint of any format -> DTensors on a DeviceMesh, each
  rank reading only the slices its coordinate holds (``Own(...)`` tensors: only on the
  ranks owning them).
* :func:`save_dtensors`: DTensors -> a self-describing per-rank checkpoint, each rank
  writing its own local shards (no gather).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from .budget import RELEASE_EVERY
from .checkpoint import Checkpoint, TensorSource
from .config import LayoutConfig, load_layout, resolve_preset
from .dtypes import DTYPE_SIZES
from .errors import ConfigError, LayoutError, ReshardError, UsageError, WriteError
from .formats import open_checkpoint
from .formats.manifest import MANIFEST, TensorInfo, manifest, write_manifest
from .formats.per_rank import RANK_FILE, describe_tensors, rank_file_name, rank_metadata
from .intervals import Block, block_shape, block_volume, row_major_strides
from .io.checksum import file_checksum
from .io.header import encode_header
from .io.pages import PageWindow, SourceFiles
from .io.reader import Piece, read_box, uint_dtype
from .io.writer import create_exclusive, temp_name
from .layout import TensorLayout
from .mesh import Mesh
from .placements import Owned, Partial, Placement, Replicate, Shard, StridedShard
from .plan import check_reduce, copy_boxes, match_blocks, natural_key

__all__ = ["Coordinator", "coordinator", "share_by_bytes", "load_dtensors", "save_dtensors"]

T = TypeVar("T")


def share_by_bytes(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Deterministic balanced assignment of items to ranks: largest first, to the least loaded.

    >>> share_by_bytes([5, 1, 4, 2], 2)
    [[0, 1], [2, 3]]
    """
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += sizes[i]
    return [sorted(x) for x in out]


class Coordinator:
    """One process: it is rank 0 of 1, and every collective is the identity."""

    rank = 0
    world = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        return None

    def share(self, files: Sequence[T]) -> list[T]:
        """This rank's share of ``files`` (objects with a ``size``), balanced by bytes."""
        if self.world == 1:
            return list(files)
        parts = share_by_bytes([getattr(f, "size", 0) for f in files], self.world)
        return [files[i] for i in parts[self.rank]]

    def gather(self, items: Sequence[T]) -> list[T]:
        """Every rank's items, concatenated in rank order, on every rank."""
        return list(items)


def _init_gloo() -> None:
    """Initialise the default process group (gloo, env://) and destroy it at exit.

    A gloo process group still alive at interpreter exit can abort the process
    ("terminate called without an active exception", exit code -6) in torch 2.x,
    which torchrun reports as a failed worker; a group we create, we destroy.
    """
    import atexit

    import torch.distributed as dist

    dist.init_process_group("gloo")
    atexit.register(_destroy_default_group, dist.group.WORLD)


def _destroy_default_group(pg: object) -> None:
    global _COORD
    import gc

    import torch.distributed as dist

    if dist.is_initialized() and dist.group.WORLD is pg:
        dist.destroy_process_group()
        # free the groups while the interpreter is whole, not during its finalization
        if isinstance(_COORD, _TorchrunCoordinator):
            _COORD = None
        gc.collect()


class _TorchrunCoordinator(Coordinator):
    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            _init_gloo()
        self._dist = dist
        self.world_group: object = dist.group.WORLD
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._pg = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        self._dist.barrier(group=self._pg)

    def gather(self, items: Sequence[T]) -> list[T]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, list(items), group=self._pg)
        return [x for part in out for x in part]


_COORD: Coordinator | None = None


def coordinator() -> Coordinator:
    """The coordinator for this process: torchrun's world when launched by it, else a single rank."""
    global _COORD
    if _COORD is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
            _COORD = _TorchrunCoordinator()
        else:
            _COORD = Coordinator()
    return _COORD


# --------------------------------------------------------------------------- live DTensors


def _live_coordinator() -> Coordinator:
    """A coordinator over the live default process group (initialising gloo under torchrun).

    Without a process group and outside torchrun this is the one-rank coordinator.
    The module-level :func:`coordinator` is updated too, so ``convert()`` in the same
    process shares the group. A collective: every rank calls it at the same point.
    """
    global _COORD
    import torch.distributed as dist

    if not dist.is_available():
        return coordinator()
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
            _init_gloo()
        else:
            return coordinator()
    if not (isinstance(_COORD, _TorchrunCoordinator) and _COORD.world_group is dist.group.WORLD):
        _COORD = _TorchrunCoordinator()  # first use, or the process group was re-initialised
    return _COORD


def _mesh_names(device_mesh: Any) -> tuple[str, ...] | None:
    names = getattr(device_mesh, "mesh_dim_names", None)
    return tuple(str(n) for n in names) if names else None


def _reshard_mesh(device_mesh: Any, names: tuple[str, ...] | None = None) -> Mesh:
    """The reshard :class:`Mesh` of a torch DeviceMesh: its dim names (or ``d0, d1, ...``) and shape."""
    shape = tuple(int(s) for s in device_mesh.shape)
    if names is None:
        names = _mesh_names(device_mesh) or tuple(f"d{i}" for i in range(len(shape)))
    return Mesh(names, shape)


def _torch_placements(placements: Sequence[Placement], tensor: str) -> list[Any]:
    """torch placements for reshard ones; a Partial target is refused."""
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(TShard(p.dim))
        elif isinstance(p, StridedShard):
            assert isinstance(p.split_factor, int)  # TensorLayout.make resolved it
            out.append(_StridedShard(p.dim, split_factor=p.split_factor))
        elif isinstance(p, Replicate):
            out.append(TReplicate())
        else:
            assert not isinstance(p, Owned)  # _load_one places owned tensors on the other dims
            raise LayoutError(
                f'tensor "{tensor}": a Partial target placement ({p}) cannot be loaded; '
                "a loaded tensor holds the reduced value. Use R instead of P in the layout.",
                tensor=tensor,
            )
    return out


def _reshard_placement(p: Any, tensor: str) -> Placement:
    """The reshard placement of a torch one (``_StridedShard``, ``Shard``, ``Replicate``, ``Partial``)."""
    from torch.distributed.tensor.placement_types import Partial as TPartial
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return StridedShard(int(p.dim), int(p.split_factor))
    if isinstance(p, TShard):
        return Shard(int(p.dim))
    if isinstance(p, TReplicate):
        return Replicate()
    # subclasses (_MaskPartial, _NormPartial) hold values that are not a plain reduction
    if type(p) is TPartial:
        try:
            return Partial(str(p.reduce_op))
        except ReshardError as e:
            raise LayoutError(f'tensor "{tensor}": {e.message}', tensor=tensor) from None
    raise LayoutError(
        f'tensor "{tensor}": placement {p!r} cannot be saved (reshard stores Shard, '
        "_StridedShard, Replicate and Partial(sum|avg|max|min)); redistribute it first",
        tensor=tensor,
    )


LayoutArg = Union["LayoutConfig", str, "os.PathLike[str]", None]
"""``layout=`` of :func:`load_dtensors`: rules, a layout file or preset name, or None."""


def _layout_config(layout: LayoutArg, what: str) -> LayoutConfig | None:
    """A ``layout=``/``source_layout=`` argument as rules."""
    if layout is None or isinstance(layout, LayoutConfig):
        return layout
    if isinstance(layout, (str, os.PathLike)):
        return load_layout(resolve_preset(os.fspath(layout)))
    raise UsageError(
        f"{what} must be a LayoutConfig, a layout file path, a preset name or None, got {layout!r}"
    )


def _resolve_layout(
    layout: LayoutArg, ckpt: Checkpoint, device_mesh: Any
) -> tuple[Mesh, LayoutConfig | None]:
    """The reshard mesh of ``device_mesh`` and the rules to place tensors on it (None: Replicate)."""
    cfg = ckpt.layout if layout is None else _layout_config(layout, "layout")
    names = _mesh_names(device_mesh)
    if names is None and cfg is not None and cfg.mesh.ndim == len(device_mesh.shape):
        names = cfg.mesh.names  # an unnamed DeviceMesh takes the layout's dim names
    mesh = _reshard_mesh(device_mesh, names)
    if cfg is not None:
        try:
            cfg = cfg.with_mesh(mesh).assign(ckpt.tensors)  # Own(...) deals the tensors by name
        except ConfigError as e:
            raise ConfigError(
                f"{e.message} (loading onto DeviceMesh {mesh})",
                path=e.path,
                hint="pass layout= a layout whose rules fit this mesh",
            ) from None
    return mesh, cfg


def load_dtensors(
    path: str | os.PathLike[str], mesh: Any, layout: LayoutArg = None, *, source_layout: LayoutArg = None
) -> dict[str, Any]:
    """Read a checkpoint into DTensors on ``mesh``; each rank reads only its own slices.

    Run under torchrun (the default process group is initialised with gloo if it is
    not yet). No collective is used: every rank opens the checkpoint, computes the
    block its mesh coordinate holds for each tensor, and fills it from the source
    pieces that intersect it, through read-only memory maps whose pages are
    released after each tensor.

    Partial sources (``P(sum)`` etc., e.g. a per-rank checkpoint saved from
    Partial DTensors) are reduced as ``reshard convert`` reduces them (torch ops on
    the raw values; ``avg`` of integers is refused, as torch refuses it); this holds one buffer per
    partial group of the local block while reducing.

    Tensors a rule places ``Own(NAME)`` on a mesh dim (whole-tensor assignment: expert
    ``n`` on the ep rank owning it) are returned only by the ranks owning them, as the
    per-rank files ``convert`` writes hold them: a ``DTensor`` on the sub-mesh of the other
    dims (``mesh["fsdp"]`` for ``{ep: Own(expert), fsdp: S(0)}``; the DeviceMesh needs
    ``mesh_dim_names``), or the whole ``torch.Tensor`` when ``Own`` is on every dim (a 1-d
    ``ep`` mesh). ``Own(NAME, local)`` names them by their rank-local number.

    Args:
        path: a checkpoint of any readable format (per-rank directory, hf directory or
            ``.safetensors`` file, dcp-safetensors or sharded-state directory).
        mesh: the torch ``DeviceMesh`` to place the tensors on. Its dim names
            (``mesh_dim_names``; ``d0, d1, ...`` or the layout's names when unnamed)
            are the names the layout rules use.
        layout: a :class:`reshard.config.LayoutConfig`, a layout YAML path or preset
            name; None uses the checkpoint's own rules (per-rank checkpoints), else
            replicates every tensor.
        source_layout: the layout the checkpoint was saved with, for formats that do not
            describe theirs (``--source-layout``: per-rank files without metadata, vLLM
            ``sharded_state`` files); its mesh sizes must be the saved ones.

    Returns:
        Tensor name -> ``DTensor`` (source dtype, global shape, contiguous strides), in
        checkpoint order; owned tensors as above (this rank's only).

    Raises:
        ReshardError: the checkpoint, the layout or the mesh do not fit together (a tensor
            no rule matches, a Partial target placement, holes in the source, ...).
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        _init_gloo()
    ckpt = open_checkpoint(Path(path), layout=_layout_config(source_layout, "source_layout"))
    rmesh, cfg = _resolve_layout(layout, ckpt, mesh)
    coord = mesh.get_coordinate()
    if coord is None:
        raise UsageError(f"this rank is not part of the DeviceMesh {rmesh}; load_dtensors needs it")
    coord = tuple(int(c) for c in coord)
    renamed = cfg.file_names(rmesh) if cfg is not None else {}  # Own(NAME, local): rank-local numbers
    sources = SourceFiles(ckpt.files)
    out: dict[str, Any] = {}
    subs: dict[tuple[int, ...], Any] = {(): None}  # sub-meshes of owned tensors, by their mesh dims
    try:
        for name, src in ckpt.tensors.items():
            pls = cfg.placements_for(name) if cfg is not None else ["R"] * rmesh.ndim
            lay = TensorLayout.for_tensor(name, src.shape, rmesh, pls)
            if lay.holds(coord):  # an Own(...) tensor another rank owns: not this rank's
                out[renamed.get(name, name)] = _load_one(
                    sources, src, lay, _on(name, lay, rmesh, mesh, subs), coord
                )
        return out
    finally:
        sources.close()


def _on(name: str, lay: TensorLayout, rmesh: Mesh, mesh: Any, subs: dict[tuple[int, ...], Any]) -> Any:
    """The DeviceMesh a tensor is loaded on: ``mesh``, or for an owned tensor the sub-mesh of
    the dims not ``Own`` (None: owned on every dim, a plain tensor)."""
    if not lay.assigned:
        return mesh
    dims = tuple(d for d, p in enumerate(lay.placements) if not isinstance(p, Owned))
    if dims not in subs:
        if _mesh_names(mesh) is None:
            raise UsageError(
                f'tensor "{name}" is placed {lay.placement_strs()}: an owned tensor lives on the '
                f"sub-mesh of the other dims ({', '.join(rmesh.names[d] for d in dims)}), which needs a "
                "DeviceMesh with mesh_dim_names (init_device_mesh(..., mesh_dim_names=...))",
                tensor=name,
            )
        subs[dims] = mesh[tuple(rmesh.names[d] for d in dims)]  # no collective: the groups exist
    return subs[dims]


def _load_one(
    sources: SourceFiles, src: TensorSource, lay: TensorLayout, on: Any, coord: tuple[int, ...]
) -> Any:
    """One tensor as a DTensor on ``on`` (the mesh, or an owned tensor's sub-mesh; None: a plain
    tensor, owned on every dim): this rank's block, read from the source pieces."""
    import torch
    from torch.distributed.tensor import DTensor

    local = _read_block(sources, src, lay.block(coord))
    if on is None:
        return local  # the whole tensor, as its owner's rank file holds it
    return DTensor.from_local(
        local,
        on,
        _torch_placements([p for p in lay.placements if not isinstance(p, Owned)], src.name),
        run_check=False,
        shape=torch.Size(src.shape),
        stride=row_major_strides(src.shape),
    )


def _read_block(sources: SourceFiles, src: TensorSource, block: Block) -> Any:
    """A new torch tensor holding ``block`` of ``src``, filled box by box from mapped pieces."""
    import numpy as np
    import torch

    from .torch_ops import cast_reduce, torch_dtype

    shape = block_shape(block)
    npt = uint_dtype(DTYPE_SIZES[src.dtype])
    local = torch.empty(shape, dtype=torch_dtype(src.dtype))
    n = block_volume(block)
    if n == 0:
        return local
    (copies,), groups = match_blocks(src, [block])
    check_reduce(src)
    # raw items of the local tensor; bool and fp8 go through uint8 like every 1-byte dtype
    dst = local.reshape(-1).view(torch.uint8).numpy().view(npt).reshape(shape)
    bufs = [dst] if groups == 1 else [np.empty(shape, dtype=npt) for _ in range(groups)]
    pages = PageWindow(sources, RELEASE_EVERY)
    for c in copies:
        piece = Piece.of(sources, src, c.piece)
        view = bufs[c.group]
        for s_st, d_st, sz in copy_boxes(c):
            key = tuple(slice(s, s + z) for s, z in zip(s_st, sz))
            view[tuple(slice(d, d + z) for d, z in zip(d_st, sz)) or ...] = read_box(pages, piece, key)
        del piece  # no view of a mapped file may outlive this function (SourceFiles.close)
    pages.release()
    if groups > 1:
        reduced = cast_reduce(bufs, src.dtype, src.dtype, src.reduce_op, n)
        dst.reshape(-1).view(np.uint8)[:] = reduced
    return local


def _safetensors_dtype(dtype: Any, tensor: str) -> str:
    from .dtypes import TORCH_NAMES
    from .torch_ops import torch_dtype

    for st_name in TORCH_NAMES:
        try:
            if torch_dtype(st_name) == dtype:
                return st_name
        except AttributeError:  # a dtype this torch does not have
            continue
    raise LayoutError(f'tensor "{tensor}": dtype {dtype} has no safetensors equivalent', tensor=tensor)


def _is_submesh(sub: Any, world: Any) -> list[int] | None:
    """Mesh dims of ``world`` that ``sub`` is the slice of (in order), containing this rank, or None."""
    import torch

    sub_names, world_names = _mesh_names(sub), _mesh_names(world)
    if sub_names is None or world_names is None:
        return None
    if not all(n in world_names for n in sub_names):
        return None
    dims = [world_names.index(n) for n in sub_names]
    if dims != sorted(dims) or tuple(sub.shape) != tuple(world.shape[d] for d in dims):
        return None
    coord = world.get_coordinate()
    if coord is None:
        return None
    index = tuple(slice(None) if d in dims else int(coord[d]) for d in range(world.ndim))
    if not torch.equal(world.mesh[index].cpu(), sub.mesh.cpu()):
        return None
    return dims


def _agree(
    coord: Coordinator, error: ReshardError | None, what: str, cls: type[ReshardError] = ReshardError
) -> None:
    """Raise on every rank if any rank failed (so no rank waits at a barrier for a dead peer).

    A collective: the failing rank raises its own error, the others a ``cls`` naming it.
    """
    errors = coord.gather([(coord.rank, type(error).__name__, error.message) if error else None])
    failed = [e for e in errors if e is not None]
    if error is not None:
        raise error
    if failed:
        rank, kind, message = failed[0]
        raise cls(f"{what} failed on rank {rank} ({kind}): {message}")


def save_dtensors(state_dict: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write each rank's local shards as a per-rank checkpoint; no tensor is gathered.

    Run under torchrun (or in one process: then this writes a one-rank checkpoint).
    Every rank writes ``rank-{r:05d}-of-{W:05d}.safetensors``, ``r`` being the
    row-major index of its coordinate in the state dict's mesh, holding its
    ``to_local()`` tensors under their global names, and the ``reshard`` metadata
    (mesh, rank, coordinate, global shapes, placements; SPEC §3). Rank 0 then writes
    ``reshard.json`` with the checksums every rank computed of its own file. The
    result converts with ``reshard convert PATH OUT --consolidate`` or
    ``--target-mesh ...`` and loads with :func:`load_dtensors`.

    The mesh is the DeviceMesh with the most dims among the DTensors; DTensors on an
    ordered sub-mesh of it (FSDP2's dp-only parameters next to dp x tp ones) are
    Replicate on the other dims. Plain tensors are Replicate. With no DTensors the
    mesh is ``world=W``. ``Partial`` DTensors are stored as ``P(op)`` and reduced when
    converted. Files are written to fresh temporaries and renamed; rank 0 first removes a
    previous ``reshard.json`` and rank files of another world size in ``path``.

    Args:
        state_dict: tensor name -> ``DTensor`` or ``torch.Tensor`` (the same names,
            shapes, dtypes and placements on every rank).
        path: the output directory (created).

    Raises:
        ReshardError: on every rank, when any rank's state dict cannot be saved (not a
            tensor, a mesh that is not the whole world, ranks disagreeing, ...).
        WriteError: on every rank, when any rank failed to write its file.
    """
    coord = _live_coordinator()
    out = Path(path)
    prep = _agreed_save(state_dict, coord)
    # every rank runs the same collectives whatever fails where: the gathers in _agree
    # are the barriers (rank 0 prepares the directory before anyone writes into it)
    error: ReshardError | None = None
    if coord.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            _clear_stale(out, prep.mesh.size)
        except OSError as e:
            error = WriteError(f"{out}: cannot prepare the directory ({e.strerror or e})", path=str(out))
    _agree(coord, error, "preparing the output directory", WriteError)
    results = coord.gather([_write_own_file(out, prep, coord)])
    error = None
    if coord.is_main:
        try:
            _write_manifest(out, prep.mesh, prep.info, results)
        except OSError as e:
            where = out / MANIFEST
            error = WriteError(f"{where}: writing failed ({e.strerror or e})", path=str(where))
    _agree(coord, error, "writing reshard.json", WriteError)


@dataclass(frozen=True, slots=True)
class _Save:
    """This rank's part of a save: its file name, header prefix and tensors (file order), and the table."""

    fname: str
    prefix: bytes
    datas: list[Any]
    info: dict[str, TensorInfo]
    mesh: Mesh


def _agreed_save(state_dict: Mapping[str, Any], coord: Coordinator) -> _Save:
    """Prepare this rank's file; raise on every rank if any rank cannot, or if ranks disagree."""
    prepared: _Save | None = None
    error: ReshardError | None = None
    try:
        prepared = _prepare_save(state_dict, coord)
    except ReshardError as e:
        error = e
    _agree(coord, error, "save_dtensors")
    assert prepared is not None
    # every rank must describe the same checkpoint: compare the tensor table
    digests = coord.gather([json.dumps([prepared.mesh.to_json(), prepared.info], sort_keys=True)])
    if len(set(digests)) != 1:
        bad = next(r for r, d in enumerate(digests) if d != digests[0])
        raise LayoutError(
            f"save_dtensors: rank {bad}'s state dict differs from rank 0's (tensor names, "
            "dtypes, global shapes, placements or mesh); every rank must save the same tensors"
        )
    return prepared


def _write_own_file(out: Path, prep: _Save, coord: Coordinator) -> tuple[str, int, str] | None:
    """Write this rank's file; if any rank failed, remove it and raise on every rank."""
    result: tuple[str, int, str] | None = None
    error: ReshardError | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)  # a node that does not share rank 0's disk
        result = _write_rank_file(out, prep.fname, prep.prefix, prep.datas)
    except OSError as e:
        where = out / prep.fname
        error = WriteError(f"{where}: writing failed ({e.strerror or e})", path=str(where))
    try:
        _agree(coord, error, "writing the per-rank files", WriteError)
    except WriteError:
        if result is not None:  # no partial checkpoint is left behind
            (out / prep.fname).unlink(missing_ok=True)
        raise
    return result


def _write_manifest(
    out: Path, mesh: Mesh, info: dict[str, TensorInfo], results: Sequence[tuple[str, int, str] | None]
) -> None:
    """``reshard.json``, as a converted per-rank checkpoint has it, atomically."""
    rules: list[list[object]] = [["re:" + re.escape(n), t["placements"]] for n, t in info.items()]
    files = sorted((r for r in results if r is not None), key=lambda r: r[0])
    write_manifest(out, manifest("per-rank", mesh, rules, info, files))


def _clear_stale(out: Path, world: int) -> None:
    """Remove the manifest (the checkpoint is incomplete until rewritten) and other worlds' rank files."""
    (out / MANIFEST).unlink(missing_ok=True)
    for p in out.iterdir():
        m = RANK_FILE.match(p.name)
        if m and int(m.group(2)) != world and p.is_file():
            p.unlink()


def _prepare_save(state_dict: Mapping[str, Any], coord: Coordinator) -> _Save:
    """This rank's file name, header prefix, tensor bytes (in file order), tensor table, mesh."""
    _check_state_dict(state_dict)
    world_mesh, mesh, coordinate = _save_mesh(state_dict, coord)
    rank = mesh.rank(coordinate)
    info: dict[str, TensorInfo] = {}
    locals_: dict[str, Any] = {}
    layouts: dict[str, TensorLayout] = {}
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for name in sorted(state_dict, key=natural_key):
        value = state_dict[name]
        local, lay = _local_layout(name, value, world_mesh, mesh)
        want = lay.local_shape(coordinate)
        if tuple(local.shape) != want:
            raise LayoutError(
                f'tensor "{name}": rank {coord.rank} holds a local tensor of shape {list(local.shape)}, '
                f"but {list(lay.shape)} with {lay.placement_strs()} on mesh {mesh} gives coordinate "
                f"{list(coordinate)} {list(want)} (torch.chunk rule); reshard stores only "
                "DTensors laid out as distribute_tensor lays them out",
                tensor=name,
            )
        dtype = _safetensors_dtype(local.dtype, name)
        info[name] = {"dtype": dtype, "shape": list(lay.shape), "placements": lay.placement_strs()}
        locals_[name] = local
        layouts[name] = lay
        specs.append((name, dtype, want))
    # the same metadata the per-rank writer writes, so a saved file equals a converted one
    text = describe_tensors((n, info[n]["dtype"], lay) for n, lay in layouts.items())
    prefix, header = encode_header(specs, rank_metadata(mesh, rank, text))
    datas = [locals_[e.name] for e in header.entries]
    return _Save(rank_file_name(rank, mesh.size), prefix, datas, info, mesh)


def _check_state_dict(state_dict: Mapping[str, Any]) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(state_dict, Mapping):
        raise UsageError(f"save_dtensors takes a mapping of name -> tensor, got {type(state_dict).__name__}")
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise UsageError(f"save_dtensors: tensor names must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise UsageError(
                f'save_dtensors: "{name}" ({type(value).__name__}) is not a tensor; '
                "save only tensors (keep other state elsewhere)",
                tensor=name,
            )
        if value.is_meta or value.device.type == "meta":  # a DTensor on meta, or a plain meta tensor
            kind = "DTensor" if isinstance(value, DTensor) else "tensor"
            raise UsageError(
                f'save_dtensors: "{name}" is a {kind} on the meta device ({str(value.dtype)[6:]} '
                f"{list(value.shape)}): it has a shape but no data (a model built under "
                'torch.device("meta") or init_empty_weights and never materialized); give it '
                "values first (model.to_empty(device=...) then initialize, or load_state_dict) "
                "and save again",
                tensor=name,
            )


def _save_mesh(state_dict: Mapping[str, Any], coord: Coordinator) -> tuple[Any, Mesh, tuple[int, ...]]:
    """The DeviceMesh with the most dims (None without DTensors), its reshard Mesh, this rank's coordinate."""
    from torch.distributed.tensor import DTensor

    dts = [v for v in state_dict.values() if isinstance(v, DTensor)]
    if dts:
        world_mesh = max((d.device_mesh for d in dts), key=lambda m: m.ndim)
        mesh = _reshard_mesh(world_mesh)
        wc = world_mesh.get_coordinate()
        if wc is None:
            raise UsageError(f"save_dtensors: this rank is not part of the DeviceMesh {mesh}")
        coordinate = tuple(int(c) for c in wc)
    else:
        world_mesh = None
        mesh = Mesh(("world",), (coord.world,))
        coordinate = (coord.rank,)
    if mesh.size != coord.world:
        raise LayoutError(
            f"save_dtensors: the DeviceMesh {mesh} has {mesh.size} ranks but the world has "
            f"{coord.world}; save from a mesh spanning every rank (one checkpoint per pipeline "
            "stage is not supported)"
        )
    return world_mesh, mesh, coordinate


def _local_layout(name: str, value: Any, world_mesh: Any, mesh: Mesh) -> tuple[Any, TensorLayout]:
    """The local tensor and the layout (placements on the whole mesh) of one state-dict value."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        pls = [_reshard_placement(p, name) for p in value.placements]
        if value.device_mesh != world_mesh:
            dims = _is_submesh(value.device_mesh, world_mesh)
            if dims is None:
                raise LayoutError(
                    f'tensor "{name}": its DeviceMesh {_reshard_mesh(value.device_mesh)} is not an '
                    f"ordered sub-mesh of {mesh} (the largest mesh in the state dict); "
                    "redistribute it onto that mesh first",
                    tensor=name,
                )
            full: list[Placement] = [Replicate()] * mesh.ndim
            for d, p in zip(dims, pls):
                full[d] = p
            pls = full
        local = value.to_local()
    else:
        pls = [Replicate()] * mesh.ndim
        local = value
    shape = tuple(int(s) for s in value.shape)
    try:
        return local, TensorLayout.make(shape, mesh, pls)
    except ReshardError as e:
        raise LayoutError(f'tensor "{name}" of shape {list(shape)}: {e.message}', tensor=name) from None


def _write_rank_file(out: Path, fname: str, prefix: bytes, datas: Sequence[Any]) -> tuple[str, int, str]:
    """Write header and tensor bytes to a fresh temporary (never through a link), hash it,
    rename; returns (name, size, checksum)."""
    import torch

    final = out / fname
    tmp = out / temp_name(fname)
    try:
        with open(create_exclusive(tmp), "wb") as f:
            f.write(prefix)
            for t in datas:
                if t.numel() == 0:
                    continue
                flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(flat.numpy()))
        size = tmp.stat().st_size
        checksum = file_checksum(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return fname, size, checksum
