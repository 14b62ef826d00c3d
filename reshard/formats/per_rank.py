"""Per-rank checkpoints: one safetensors file per rank, local tensors under global names."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from ..checkpoint import FEW_OFFSETS_MIN, Checkpoint, TensorSource, few_offsets, tensor_source
from ..dtypes import DTYPE_RANK
from ..errors import ConfigError, HeaderError, LayoutError, ReshardError, TensorNotFoundError, UsageError
from ..intervals import Block, block_shape
from ..io.header import Header, TensorEntry, forget_shared, read_header
from ..io.safe import expect_object, expect_shape, expect_strings, load_json
from ..layout import TensorLayout, infer_global_shape
from ..mesh import Mesh, check_world_size
from ..placements import Placement, Shard, StridedShard, parse_placement
from ..plan import OutFile, TargetTensor, WriteOptions, distinct_layouts
from .base import MAYBE, NO, YES, Probe, Reader, ReadOptions, Writer
from .manifest import MANIFEST, complete_self_described, read_manifest
from .safetensors import SafetensorsFile, file_order, metadata_text

if TYPE_CHECKING:
    from ..config import LayoutConfig

__all__ = [
    "RANK_FILE",
    "READER",
    "WRITER",
    "rank_files",
    "rank_file_name",
    "rank_metadata",
    "tensors_text",
    "describe_tensors",
    "open_per_rank",
    "self_description",
    "RankMetadata",
    "RankFiles",
    "Describe",
    "layout_describe",
    "rank_checkpoint",
    "source_layout",
    "manifest_layout",
    "exact_rules",
    "local_names",
]

RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.safetensors$")
_DIGITS = re.compile(r"\d+")


def rank_files(directory: Path, *, strict: bool) -> dict[int, Path]:
    """Rank number -> file, from ``rank-{r:05d}-of-{W:05d}.safetensors`` names or, unless
    ``strict``, from any ``*.safetensors`` names carrying exactly one number."""
    files = sorted(p for p in directory.iterdir() if p.name.endswith(".safetensors") and p.is_file())
    out: dict[int, Path] = {}
    worlds = set()
    for p in files:
        m = RANK_FILE.match(p.name)
        if m:
            rank = int(m.group(1))
            worlds.add(int(m.group(2)))
        elif strict:
            continue
        else:
            nums = _DIGITS.findall(p.name[: -len(".safetensors")])
            if len(nums) != 1:
                raise HeaderError(
                    f"{p}: cannot tell which rank this file belongs to (its name should carry "
                    "exactly one rank number, e.g. rank-00003-of-00008.safetensors)",
                    path=str(p),
                )
            rank = int(nums[0])
        if rank in out:
            raise HeaderError(f"{p}: rank {rank} also given by {out[rank].name}", path=str(p))
        out[rank] = p
    if len(worlds) > 1:
        raise HeaderError(
            f"{directory}: rank files disagree on the world size ({sorted(worlds)})", path=str(directory)
        )
    if worlds:
        (world,) = worlds
        check_world_size(world, what=str(directory / f"rank-*-of-{world}.safetensors"))
        missing = [r for r in range(world) if r not in out]
        if missing:
            raise HeaderError(
                f"{directory}: missing rank file(s) "
                + ", ".join(f"rank-{r:05d}-of-{world:05d}.safetensors" for r in missing[:5])
                + (" ..." if len(missing) > 5 else ""),
                path=str(directory),
            )
    return out


class TensorDescription(TypedDict):
    shape: list[int]
    placements: list[str]


class RankMetadata(TypedDict):
    """``__metadata__["reshard"]`` of a per-rank file written by reshard (:func:`rank_metadata`)."""

    format_version: int
    mesh: dict[str, list[Any]]
    rank: int
    coordinate: list[int]
    tensors: dict[str, TensorDescription]


def self_description(header: Header, path: Path, *, tensors: bool = True) -> RankMetadata | None:
    """The ``reshard`` metadata a per-rank file written by reshard carries, or None.

    Every version reads into the same form: ``format_version`` 1 lists each tensor's global
    shape and placements; 2 (:func:`describe_tensors`) stores the distinct placements once
    and per tensor an index, plus the global shapes an even split does not give. Without
    ``tensors`` the ``tensors`` member is left empty (the other ranks' files: only their
    rank and mesh are compared).
    """
    meta = header.metadata or {}
    raw = meta.get("reshard")
    if raw is None:
        return None
    where = str(path)
    data = expect_object(
        load_json(raw.encode(), path=where, what="reshard metadata", error=HeaderError),
        path=where,
        field="the reshard metadata",
        error=HeaderError,
    )
    try:
        version = data.get("format_version")
        if version not in (1, 2, OWN_VERSION):
            raise ValueError("unsupported format_version")
        mesh = _described_mesh(data, where)
        rank = data["rank"]
        if type(rank) is not int or not 0 <= rank < mesh.size:
            raise ValueError(f"rank {rank!r} is not a rank of mesh {mesh}")
        coordinate = data.get("coordinate")  # derived from the rank; when given, it must agree
        if coordinate is not None and coordinate != list(mesh.coordinate(rank)):
            raise ValueError(
                f"coordinate {coordinate!r} is not rank {rank}'s {list(mesh.coordinate(rank))} on mesh {mesh}"
            )
        if version in (2, OWN_VERSION):
            data["tensors"] = _v2_tensors(data, header, mesh, where) if tensors else {}
        _check_tensors(data["tensors"], where)
    except KeyError as e:  # a field left out
        raise HeaderError(f"{path}: invalid reshard metadata (no {e} field)", path=str(path)) from None
    except (ValueError, TypeError, IndexError, ArithmeticError) as e:
        raise HeaderError(f"{path}: invalid reshard metadata ({e})", path=str(path)) from None
    return cast(RankMetadata, data)  # the fields used are checked above


_CODES = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Format version 2: a tensor's index into the placements table, one character each."""

OWN_VERSION = 3
"""Format version 3: version 2's members describing only the file's own entries (``Own``
layouts: each rank's file holds other tensors); the checkpoint's description joins all files'."""


def _described_mesh(data: dict[str, Any], where: str) -> Mesh:
    """The mesh a file's reshard metadata names, checked as untrusted input."""
    mesh = expect_object(data["mesh"], path=where, field="reshard.mesh", error=HeaderError)
    shape = expect_shape(mesh["shape"], path=where, field="reshard.mesh.shape", error=HeaderError)
    for d in shape:
        check_world_size(d, what=f"{where}: reshard.mesh.shape")
    names = expect_strings(mesh["names"], path=where, field="reshard.mesh.names", error=HeaderError)
    return Mesh(tuple(names), shape)


def _check_tensors(tensors: object, where: str) -> None:
    """Each described tensor has a shape and a list of placement strings (untrusted input).

    Version 2's descriptions share their values per placement code and geometry, so each
    distinct value is checked once.
    """
    tensors = expect_object(tensors, path=where, field="reshard.tensors", error=HeaderError)
    seen: set[int] = set()
    for name, info in tensors.items():
        if id(info) in seen:  # a description shared by a geometry (version 2)
            continue
        field = f"reshard.tensors[{json.dumps(name)}]"
        info = expect_object(info, path=where, field=field, error=HeaderError)
        shape, pls = info.get("shape"), info.get("placements")
        if id(shape) not in seen:
            expect_shape(shape, path=where, field=field + ".shape", error=HeaderError)
            seen.add(id(shape))
        if id(pls) not in seen:
            expect_strings(pls, path=where, field=field + ".placements", error=HeaderError)
            seen.add(id(pls))
        seen.add(id(info))


def _v2_tensors(data: dict[str, Any], header: Header, mesh: Mesh, where: str) -> dict[str, TensorDescription]:
    """Format version 2's description, per tensor (in this file's data order) global shape and placements."""
    table = [
        list(expect_strings(pls, path=where, field="reshard.placements[]", error=HeaderError))
        for pls in data["placements"]
    ]
    codes = data["layout"]
    shapes = data.pop("shapes", {})  # read here alone: its 100k names and lists go when this returns
    if not isinstance(codes, str) or len(codes) != len(header.entries) or not isinstance(shapes, dict):
        raise ValueError(f'"layout" must hold one code per tensor ({len(header.entries)})')
    index = {c: i for i, c in enumerate(_CODES[: len(table)])}
    unknown = set(codes) - index.keys()
    if unknown:
        raise ValueError(
            f'"layout" code {min(unknown)!r} names no entry of "placements" (it has {len(table)})'
        )
    derived: dict[tuple[tuple[int, ...], str], TensorDescription] = {}  # one description per geometry
    # given shapes that are lists of ints (else each is described alone, and checked so): one
    # description per shape and code, as derived ones (64 ranks of 100k unevenly split tensors
    # held a description per tensor, 40 MiB)
    given: dict[tuple[tuple[int, ...], str], TensorDescription] | None = None
    values = shapes.values()
    if set(map(type, values)) <= {list} and set(map(type, chain.from_iterable(values))) <= {int}:
        given = {}
    out: dict[str, TensorDescription] = {}
    for e, code in zip(header.entries, codes):
        shape = shapes.get(e.name)
        if shape is not None:
            if given is None:
                out[e.name] = {"shape": shape, "placements": table[index[code]]}
                continue
            key = (tuple(shape), code)
            desc = given.get(key)
            if desc is None:
                desc = given[key] = {"shape": shape, "placements": table[index[code]]}
            out[e.name] = desc
            continue
        key = (e.shape, code)
        desc = derived.get(key)
        if desc is None:
            pls = table[index[code]]
            desc = derived[key] = {"shape": _even_global(e.shape, mesh, pls), "placements": pls}
        out[e.name] = desc
    return out


def _even_global(local: tuple[int, ...], mesh: Mesh, pls: Sequence[str]) -> list[int]:
    """The global shape of an evenly split tensor: each sharded dim times its mesh sizes."""
    shape = list(local)
    for p, n in zip(pls, mesh.shape):
        try:
            q = parse_placement(p)
        except ReshardError as e:  # a bad placement in the file: reported as invalid metadata
            raise ValueError(e.message) from None
        if isinstance(q, (Shard, StridedShard)):
            shape[q.dim % len(shape)] *= n
    return shape


@dataclass(frozen=True, slots=True)
class RankFiles:
    """The files of a checkpoint saved one rank at a time, and which of them hold each rank's tensors.

    Attributes:
        paths: every file, by index.
        headers: their safetensors headers.
        ranks: per rank (flat mesh rank), the indices of its files (a rank may have several parts).
    """

    paths: tuple[Path, ...]
    headers: tuple[Header, ...]
    ranks: tuple[tuple[int, ...], ...]
    names: tuple[Mapping[str, str], ...] = ()
    """Per file (when any): an entry's name -> the tensor's name, where they differ
    (``Own(NAME, local)``: experts under rank-local numbers)."""

    @classmethod
    def one_per_rank(cls, paths: Sequence[Path]) -> RankFiles:
        """File ``r`` holds rank ``r``'s tensors; reads every header."""
        heads = tuple(_rank_header(p, r) for r, p in enumerate(paths))
        forget_shared()  # the last entry section is shared with every sibling that has it: all are read
        return cls(tuple(paths), heads, tuple((r,) for r in range(len(paths))))

    def entries(self) -> list[dict[str, tuple[int, TensorEntry]]]:
        """Per rank: tensor name -> (file index, header entry); no name twice in one rank's files."""
        out: list[dict[str, tuple[int, TensorEntry]]] = []
        for files in self.ranks:
            where: dict[str, tuple[int, TensorEntry]] = {}
            for i in files:
                renamed = self.names[i] if self.names else {}
                for entry_name in self.headers[i].names:
                    name = renamed.get(entry_name, entry_name)
                    if name in where:
                        p = self.paths[i]
                        raise HeaderError(
                            f'{p}: tensor "{name}" is also in {self.paths[where[name][0]].name} '
                            "(files of one rank must not repeat a tensor)",
                            path=str(p),
                            tensor=name,
                        )
                    where[name] = (i, self.headers[i].entry(entry_name))
            out.append(where)
        return out


_ACROSS_RANKS = ("format_version", "mesh", "rank", "coordinate", "local_names")
"""What a self-description past rank 0's is read for (:func:`_rank_mesh`, :func:`local_names`)."""


_DIGEST = "per_tensor_digest"
"""Kept in place of a large per-tensor part past rank 0: ``hash()`` of its text (this process only)."""


_DESCRIPTION_HEAD = re.compile(
    r'\{"format_version":[123],"mesh":\{[^{}]*\},"rank":\d+,"coordinate":\[[\d,]*\],'
)
"""The members :func:`rank_metadata` writes first, up to the per-tensor part."""


def _rank_header(path: Path, rank: int) -> Header:
    """The header of rank ``rank``'s file; past rank 0, a self-description is kept only for
    what is compared across ranks (:data:`_ACROSS_RANKS`).

    Its per-tensor part (format 2: placement codes, uneven global shapes; format 1, which
    ``Own`` layouts write: every tensor's shape and placements) is read from rank 0's file
    alone: 64 rank files of 100k unevenly split tensors held 64 copies of it (6 MB each),
    and 8 expert-parallel files of 100k tensors took 8 s to check theirs.
    """
    h = read_header(path)
    raw = (h.metadata or {}).get("reshard")
    if rank == 0 or raw is None or len(raw) < 4096 or raw.startswith(f'{{"format_version":{OWN_VERSION},'):
        return h  # (version 3: each file describes its own tensors, all read)
    head = _DESCRIPTION_HEAD.match(raw)
    digest = None
    try:
        if head is not None and '"local_names"' not in raw:  # what reshard writes: the head alone
            data = json.loads(head.group(0)[:-1] + "}")
            digest = hash(raw[head.end() :])  # the per-tensor part, compared with rank 0's
        else:  # Python's own decoder (C): load_json's checks would cost seconds on a part never read
            data = json.loads(raw)
    except (ValueError, RecursionError):
        return h  # reported where it is read
    if isinstance(data, dict) and data.get("format_version") in (1, 2):
        assert h.metadata is not None
        kept = {k: data[k] for k in _ACROSS_RANKS if k in data}
        if digest is not None:
            kept[_DIGEST] = digest
        if data["format_version"] == 1:
            kept["tensors"] = {}  # every tensor's shape and placements: rank 0's are read
        h.metadata["reshard"] = json.dumps(kept, separators=(",", ":"))
    return h


Describe = Callable[[str, Sequence[tuple[int, ...]]], tuple[tuple[int, ...], Sequence[Placement | str]]]
"""Tensor name, local shapes per rank -> global shape and placements."""


def layout_describe(
    placements_for: Callable[[str], Sequence[Placement | str]], mesh: Mesh, where: Path, layout_source: str
) -> Describe:
    """Placements from a layout, the global shape derived from the local shapes (checked on every rank)."""

    shapes: dict[tuple[object, ...], tuple[int, ...]] = {}  # per geometry: derived once

    def describe(
        name: str, local_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[tuple[int, ...], Sequence[Placement | str]]:
        pls = placements_for(name)
        key = (tuple(local_shapes), tuple(pls))
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = _derived_shape(name, local_shapes, mesh, pls, where, layout_source)
        return shape, pls

    return _ByLayout(placements_for, describe)


class _ByLayout:
    """A :data:`Describe` from a layout (:func:`layout_describe`). Its answer depends on the local
    shapes and the placements ``placements_for`` gives alone: a layout gives the tensors of one
    rule one placements tuple, so :func:`_uniform_sources` tells geometries apart by that tuple's
    identity, before describing (100k tensors: a few descriptions)."""

    __slots__ = ("placements_for", "_describe")

    def __init__(
        self, placements_for: Callable[[str], Sequence[Placement | str]], describe: Describe
    ) -> None:
        self.placements_for = placements_for
        self._describe = describe

    def __call__(
        self, name: str, local_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[tuple[int, ...], Sequence[Placement | str]]:
        return self._describe(name, local_shapes)


_SEEN_MAX = 4096
"""Objects :func:`_uniform_sources` remembers by identity per local shape before starting over."""


def open_per_rank(
    directory: Path,
    *,
    mesh: Mesh | None,
    placements_for: Callable[[str], Sequence[Placement | str]] | None,
    layout_source: str = "the layout",
    names: Sequence[Mapping[str, str]] | None = None,
) -> Checkpoint:
    """Open a per-rank checkpoint.

    Global shapes and placements come from each file's ``reshard`` metadata, or,
    with ``placements_for`` (a source layout), are derived from local shapes and
    checked on every rank. Per rank, ``names`` renames entries (a layout's
    ``Own(NAME, local)``); self-described files carry their own (``local_names``).

    Raises:
        HeaderError: missing rank files, unreadable headers.
        LayoutError: local shapes inconsistent with the placements, rank count != mesh size.
        TensorNotFoundError: a tensor missing on some rank.
    """
    paths = _rank_paths(directory, strict=placements_for is None)
    files = RankFiles.one_per_rank(paths)
    mesh, desc0 = _rank_mesh(directory, paths, files.headers, mesh, described=placements_for is None)
    if names is not None or placements_for is None:
        renamed = tuple(names) if names is not None else local_names(files)
        files = dataclasses.replace(files, names=renamed if any(renamed) else ())
    describe: Describe
    if placements_for is not None:
        describe = layout_describe(placements_for, mesh, paths[0], layout_source)
    else:
        assert desc0 is not None
        describe = _described_by(desc0, paths[0])
    return rank_checkpoint(directory, "per-rank", files, mesh, describe)


def rank_checkpoint(
    directory: Path, fmt: str, files: RankFiles, mesh: Mesh, describe: Describe
) -> Checkpoint:
    """The checkpoint of rank files: each rank's local tensors, their global shapes and placements
    from ``describe``, every rank's local shape checked against them.

    Raises:
        LayoutError: rank count != mesh size, local shapes that do not fit, dtypes that differ.
        TensorNotFoundError: a tensor missing on some rank.
    """
    if mesh.size != len(files.ranks):
        raise LayoutError(
            f"{directory}: {len(files.ranks)} rank files but the mesh {mesh} has {mesh.size} ranks; "
            "fix --source-mesh or the layout's mesh",
            path=str(directory),
        )
    uniform = _uniform_order(files)
    positional = None if uniform is not None else _positional_order(files)
    if uniform is not None:  # every rank lists the same entries: paired without name lookups
        tensors = _uniform_sources(files, uniform, mesh, describe)
    elif positional is not None and (found := _positional_sources(files, positional, mesh, describe)):
        tensors = found  # the same names in the same order (uneven shards): paired by position
    else:
        tensors = _named_sources(files, mesh, describe)
    return Checkpoint(
        path=str(directory),
        format=fmt,
        files=tuple(str(p) for p in files.paths),
        file_sizes=tuple(p.stat().st_size for p in files.paths),
        tensors=tensors,
        mesh=mesh,
    )


def _uniform_sources(
    files: RankFiles, order: tuple[int, ...], mesh: Mesh, describe: Describe
) -> dict[str, TensorSource]:
    """:func:`rank_checkpoint`'s tensors when every rank's file lists the same entries (``order``)."""
    coords = list(mesh.coordinates())
    tensors: dict[str, TensorSource] = {}
    geometries: dict[tuple[object, ...], _Geometry] = {}
    starts = [files.headers[i].data_start for i in order]
    paths = [files.paths[i] for i in order]
    # Rank files whose headers are as long (the usual case) put each tensor at one offset in
    # all of them: one int per tensor, repeated, instead of one per rank (200k tensors x 8
    # ranks: 45 MiB of ints); else one per distinct data start (see few_offsets)
    bases = list(dict.fromkeys(starts))
    same = bases[0] if len(bases) == 1 else None
    picks = tuple(map(bases.index, starts))
    n = len(starts)
    # Tensors of one geometry found by identity, no placements hashed per tensor: per local shape,
    # what stands for the rest of the geometry (a layout's placements tuple, see _ByLayout; else
    # describe's answer) -> the geometry's TensorSource fields (each value holds that object,
    # so its id stays its own)
    per_shape: dict[tuple[int, ...], tuple[tuple[tuple[int, ...], ...], dict[int, tuple[object, Any]]]] = {}
    mark_of = describe.placements_for if isinstance(describe, _ByLayout) else None
    marks = describe.marks if isinstance(describe, _ByDescription) else None
    # the offsets of rank files of one data start, as few_offsets makes them (made here: no call a tensor)
    repeated = same is not None and n < FEW_OFFSETS_MIN
    for en in files.headers[order[0]].entries:
        got = per_shape.get(en.shape)
        if got is None:
            got = per_shape[en.shape] = ((en.shape,) * n, {})
        local, seen = got
        desc = None
        if marks is not None:
            mark: object = marks.get(en.name)
            if mark is None:  # not described: describe says so
                mark = desc = describe(en.name, local)
        elif mark_of is not None:
            mark = mark_of(en.name)
        else:
            mark = desc = describe(en.name, local)
        hit = seen.get(id(mark))
        if hit is None or hit[0] is not mark:
            shape, pls = desc if desc is not None else describe(en.name, local)
            key = (en.shape, shape, tuple(pls))
            geo = geometries.get(key)
            if geo is None:  # the first tensor of this geometry: lay it out and check it (errors name it)
                entries = [en] * n
                geo = geometries[key] = _geometry(en.name, shape, mesh, pls, coords, order, paths, entries)
            if len(seen) >= _SEEN_MAX:  # placements (or descriptions) made per tensor: ids not reused
                seen.clear()
            hit = seen[id(mark)] = (mark, geo.fields)
        if repeated:
            offsets: Sequence[int] = (same + en.start,) * n  # type: ignore[operator]
        else:
            at = (same + en.start,) if same is not None else tuple(map(en.start.__add__, bases))
            offsets = few_offsets(at, picks)
        shape, pfiles, blocks, signature, partials, op, placements = hit[1]
        tensors[en.name] = tensor_source(
            en.name, en.dtype, shape, pfiles, offsets, blocks, signature, partials, op, placements
        )
    return tensors


def _positional_order(files: RankFiles) -> tuple[int, ...] | None:
    """Each rank's file index when every rank has one file and all list the same names in the
    same order (their entries differing: uneven shards, where some ranks hold empty ones)."""
    if files.names or not all(len(r) == 1 for r in files.ranks):
        return None
    order = tuple(r[0] for r in files.ranks)
    first = files.headers[order[0]]
    names = first.names
    checked = {id(first.entries)}
    for i in order[1:]:
        h = files.headers[i]
        if id(h.entries) not in checked:
            if h.names != names:
                return None
            checked.add(id(h.entries))
    return order


def _positional_sources(
    files: RankFiles, order: tuple[int, ...], mesh: Mesh, describe: Describe
) -> dict[str, TensorSource] | None:
    """:func:`rank_checkpoint`'s tensors when every rank lists the same names in the same order
    (``order``), paired by position: a few distinct entry sections, not a dict of names per
    rank (100k tensors at 64 ranks: 6.4M entries, 1.6 GB). Ranks of one section and data start
    share each tensor's offset. None when dtypes differ (the named pairing says which)."""
    coords = list(mesh.coordinates())
    paths = [files.paths[i] for i in order]
    sections: list[Sequence[TensorEntry]] = []
    index: dict[int, int] = {}
    groups: dict[tuple[int, int], int] = {}  # (section, data start) -> its number
    rank_section, rank_group = [], []
    for i in order:
        h = files.headers[i]
        sec = index.setdefault(id(h.entries), len(index))
        if sec == len(sections):
            sections.append(h.entries)
        rank_section.append(sec)
        rank_group.append(groups.setdefault((sec, h.data_start), len(groups)))
    group_starts = list(groups)
    picks = tuple(rank_group)  # each rank's offset among a tensor's few (see few_offsets)
    locals_of: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}
    geometries: dict[tuple[object, ...], _Geometry] = {}
    tensors: dict[str, TensorSource] = {}
    dtypes = list(map(_DTYPE, sections[0]))
    if any(list(map(_DTYPE, sec)) != dtypes for sec in sections[1:]):
        return None
    for ents in zip(*sections):  # a tensor's entry in each section
        en = ents[0]
        shapes = tuple(map(_SHAPE, ents))
        local = locals_of.get(shapes)
        if local is None:
            local = locals_of[shapes] = tuple(map(shapes.__getitem__, rank_section))
        shape, pls = describe(en.name, local)
        key = (shapes, shape, tuple(pls))
        geo = geometries.get(key)
        if geo is None:  # the first tensor of this geometry: lay it out and check it (errors name it)
            entries = [ents[sec] for sec in rank_section]
            geo = geometries[key] = _geometry(en.name, shape, mesh, pls, coords, order, paths, entries)
        offsets = tuple([start + ents[sec].start for sec, start in group_starts])
        tensors[en.name] = _tensor_source(en.name, en.dtype, geo, few_offsets(offsets, picks))
    return tensors


_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")


def _named_sources(files: RankFiles, mesh: Mesh, describe: Describe) -> dict[str, TensorSource]:
    """:func:`rank_checkpoint`'s tensors, each found by name in every rank's files."""
    coords = list(mesh.coordinates())
    tensors: dict[str, TensorSource] = {}
    geometries: dict[tuple[object, ...], _Geometry] = {}
    where = files.entries()
    absent: dict[tuple[object, ...], tuple[tuple[int, ...], ...]] = {}
    heads = files.headers
    # Own(...) tensors some files leave out, described by the files: what _fill_absent made of the
    # first of each description (by identity, see _ByDescription), holding files and absent ranks,
    # taken for the rest (200k experts at EP-8: 7 empty entries each, 5 of 11 s of inspect)
    marks = describe.marks if isinstance(describe, _ByDescription) else None
    filled: dict[tuple[object, ...], tuple[object, _Geometry, tuple[int, ...]]] = {}
    for name in _all_names(where):
        found, missing = _rank_entries(name, files, where)
        mark = marks.get(name) if missing and marks is not None else None
        if mark is not None:
            fkey = (tuple((i, en.shape) for i, en in found), tuple(missing), id(mark))
            hit = filled.get(fkey)
            if hit is not None and hit[0] is mark:
                got = iter(found)
                offsets = tuple(
                    heads[fi].data_start if r in missing else _offset(heads, next(got))
                    for r, fi in enumerate(hit[2])
                )
                tensors[name] = _tensor_source(name, found[0][1].dtype, hit[1], offsets)
                continue
        if missing:
            found, shape, pls = _fill_absent(name, found, missing, files, describe, mesh, coords, absent)
        entries = [en for _, en in found]
        local_shapes = tuple(en.shape for en in entries)
        if not missing:
            shape, pls = describe(name, local_shapes)
        piece_files = tuple(i for i, _ in found)
        key = (local_shapes, shape, tuple(pls), piece_files)
        geo = geometries.get(key)
        if geo is None:  # the first tensor of this geometry: lay it out and check it (errors name it)
            paths = [files.paths[i] for i in piece_files]
            geo = geometries[key] = _geometry(name, shape, mesh, pls, coords, piece_files, paths, entries)
        # an empty piece's offset is its file's data start, the int itself (the 7 empty pieces of
        # each of 200k experts at EP-8: 1.4M ints, 45 MiB, made by adding 0)
        offsets = tuple(
            heads[i].data_start + en.start if en.start else heads[i].data_start for i, en in found
        )
        tensors[name] = _tensor_source(name, entries[0].dtype, geo, offsets)
        if mark is not None:
            filled[fkey] = (mark, geo, piece_files)
    return tensors


def _offset(heads: Sequence[Header], found: tuple[int, TensorEntry]) -> int:
    i, en = found
    return heads[i].data_start + en.start


def _tensor_source(name: str, dtype: str, geo: _Geometry, offsets: Sequence[int]) -> TensorSource:
    # positional, from the geometry's own tuple: built once per tensor, 100k times for an MoE checkpoint
    shape, files, blocks, signature, partials, op, placements = geo.fields
    return tensor_source(name, dtype, shape, files, offsets, blocks, signature, partials, op, placements)


@dataclass(frozen=True, slots=True)
class _Geometry:
    """What tensors of one global shape, placements and local shapes share."""

    layout: TensorLayout
    files: tuple[int, ...]
    blocks: tuple[Block, ...]
    signature: tuple[object, ...]
    partials: tuple[int, ...] | None
    # A TensorSource's fields but its name, dtype and offsets, in order: (shape, files, blocks,
    # signature, partials, reduce op, placements); made once, unpacked per tensor.
    fields: tuple[Any, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lay = self.layout
        values = (lay.shape, self.files, self.blocks, self.signature, self.partials, lay.partial_op)
        object.__setattr__(self, "fields", (*values, lay.placements))


def _geometry(
    name: str,
    shape: tuple[int, ...],
    mesh: Mesh,
    pls: Sequence[Placement | str],
    coords: Sequence[tuple[int, ...]],
    piece_files: tuple[int, ...],
    paths: Sequence[Path],
    entries: Sequence[TensorEntry],
) -> _Geometry:
    """The layout of ``name``, its local shapes checked against every rank's entry."""
    layout = TensorLayout.for_tensor(name, shape, mesh, list(pls))
    _check_local_shapes(name, layout, coords, paths, entries)
    partials = tuple(layout.partial_index(c) for c in coords) if layout.partial_op else None
    return _Geometry(
        layout,
        piece_files,
        layout.blocks(),
        ("layout", layout.shape, mesh.shape, layout.placements),
        partials,
    )


_HF_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def _rank_paths(directory: Path, *, strict: bool) -> list[Path]:
    """The rank files in rank order; every rank from 0 to the highest has one."""
    files = rank_files(directory, strict=strict)
    if not files:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
        shards = [n for n in names if _HF_SHARD.fullmatch(n)]
        if shards:  # the per-rank reader's guess for several .safetensors: say what they look like
            raise HeaderError(
                f"{directory}: Hugging Face shard files ({', '.join(shards[:3])}"
                f"{', ...' if len(shards) > 3 else ''}) but no model.safetensors.index.json; "
                "copy the index with them",
                path=str(directory),
            )
        loose = _loose_rank_files(directory) if strict else None
        if loose:  # rank files by a looser name (rank-0.safetensors) are read with a layout only
            shown = ", ".join(p.name for p in loose[:3]) + (", ..." if len(loose) > 3 else "")
            raise LayoutError(
                f"{directory}: {len(loose)} files named as ranks ({shown}) that do not describe their "
                "layout; pass --source-layout FILE (a YAML layout, see configs/) to read them as "
                "per-rank files",
                path=str(directory),
            )
        raise HeaderError(
            f"{directory}: no rank files found: none of its {len(names)} .safetensors files "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) has one rank number in its "
            "name, and there is no model.safetensors or model.safetensors.index.json",
            path=str(directory),
        )
    world = max(files) + 1
    check_world_size(world, what=str(files[world - 1]))
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise HeaderError(f"{directory}: no file for rank(s) {missing[:8]}", path=str(directory))
    return [files[r] for r in range(world)]


def _loose_rank_files(directory: Path) -> list[Path]:
    """The files ``rank_files(strict=False)`` would take as ranks 0 to N-1 (two or more), else []."""
    try:
        files = rank_files(directory, strict=False)
    except HeaderError:
        return []
    if len(files) < 2 or sorted(files) != list(range(len(files))):
        return []
    return [files[r] for r in range(len(files))]


def _rank_mesh(
    directory: Path, paths: Sequence[Path], headers: Sequence[Header], mesh: Mesh | None, *, described: bool
) -> tuple[Mesh, RankMetadata | None]:
    """The mesh (given, or from the self-description every file must agree on) and rank 0's description."""
    desc0 = self_description(headers[0], paths[0])
    if described:
        if desc0 is None:
            raise LayoutError(
                f"{paths[0]}: this per-rank checkpoint does not describe its layout; "
                "pass --source-layout FILE (a YAML layout, see configs/)",
                path=str(paths[0]),
            )
        if mesh is None:
            mesh = Mesh(tuple(desc0["mesh"]["names"]), tuple(desc0["mesh"]["shape"]))
    if mesh is None:
        raise LayoutError(f"{directory}: no mesh given", path=str(directory))
    if described and desc0 is not None and desc0["format_version"] == OWN_VERSION:
        _join_descriptions(desc0, paths, headers, mesh)
    elif described:
        assert desc0 is not None
        digest0: list[int] = []  # of rank 0's per-tensor text, made once
        for r, (p, h) in enumerate(zip(paths, headers)):
            d = desc0 if r == 0 else self_description(h, p, tensors=False)  # rank 0's: read once
            if d is None or d["rank"] != r or d["mesh"] != desc0["mesh"]:
                raise HeaderError(
                    f"{p}: its reshard metadata does not say rank {r} of mesh {mesh}", path=str(p)
                )
            if r:
                _check_same_description(desc0, d, headers[0], h, paths[0], p, digest0)
    return mesh, desc0


def _join_descriptions(
    desc0: RankMetadata, paths: Sequence[Path], headers: Sequence[Header], mesh: Mesh
) -> None:
    """Format version 3 (``Own`` layouts): each file describes the tensors it holds (under its
    entries' names, mapped back by its ``local_names``); the checkpoint's description, set as
    ``desc0``'s, is all of theirs, a tensor several files hold described alike by each."""
    joined: dict[str, TensorDescription] = {}
    first: dict[str, int] = {}
    for r, (p, h) in enumerate(zip(paths, headers)):
        d = desc0 if r == 0 else self_description(h, p)
        if d is None or d["rank"] != r or d["mesh"] != desc0["mesh"] or d["format_version"] != OWN_VERSION:
            raise HeaderError(
                f"{p}: its reshard metadata does not say rank {r} of mesh {mesh} in format version "
                f"{OWN_VERSION}, as {paths[0].name}'s does",
                path=str(p),
            )
        renamed = _local_names(p, h, cast(dict[str, Any], d))
        items = d["tensors"].items()
        if renamed:
            items = {renamed.get(entry, entry): info for entry, info in items}.items()
            if len(items) < len(d["tensors"]):
                names = [renamed.get(e, e) for e in d["tensors"]]
                name = next(n for i, n in enumerate(names) if n in names[:i])
                raise HeaderError(
                    f'{p}: tensor "{name}" is also in {p.name} (files of one rank must not repeat a tensor)',
                    path=str(p),
                    tensor=name,
                )
        for name, info in items:
            prev = joined.setdefault(name, info)
            if prev is not info and not _same_description(prev, info):
                raise HeaderError(
                    f'{p}: its reshard metadata describes tensor "{name}" as shape {list(info["shape"])} '
                    f"{list(info['placements'])}, but {paths[first[name]].name} as {list(prev['shape'])} "
                    f"{list(prev['placements'])}; the rank files are not of one checkpoint",
                    path=str(p),
                    tensor=name,
                )
            first.setdefault(name, r)
    desc0["tensors"] = joined


def _same_description(a: TensorDescription, b: TensorDescription) -> bool:
    """The same global shape and placements (written alike, or parsing to the same; both
    checked by :func:`_check_tensors`)."""
    if a == b:
        return True
    try:
        return [int(x) for x in a["shape"]] == [int(x) for x in b["shape"]] and [
            parse_placement(t) for t in a["placements"]
        ] == [parse_placement(t) for t in b["placements"]]
    except ConfigError:
        return False


def _check_same_description(
    desc0: RankMetadata,
    desc: RankMetadata,
    header0: Header,
    header: Header,
    path0: Path,
    path: Path,
    digest0: list[int],
) -> None:
    """Rank 0's description is the one read; another rank's file must describe the tensors it
    holds alike (one describing a tensor as ``P(sum)`` where rank 0 says ``S(0)`` made ``convert``
    sum the shards and ``inspect --check`` pass). Equal text is the common case, compared whole;
    else each tensor both describe is compared, global shape and parsed placements."""
    d0, d = cast(dict[str, Any], desc0), cast(dict[str, Any], desc)
    digest = d.get(_DIGEST)
    if digest is not None:  # a large description, kept as a digest (:func:`_rank_header`)
        if not digest0:
            raw0 = (header0.metadata or {}).get("reshard", "")
            head0 = _DESCRIPTION_HEAD.match(raw0)
            digest0.append(hash(raw0[head0.end() :]) if head0 is not None else 0)
        if digest0[0] == digest:
            return
        header = read_header(path)  # they differ: this file's description, whole, names the tensor
    elif (d["format_version"] == 2 and "layout" not in d) or (d["format_version"] == 1 and not d["tensors"]):
        return  # dropped unread (rank-local names: each rank's text differs)
    elif d0["format_version"] == d["format_version"] == 2 and header0.names == header.names:
        if all(d0.get(k) == d.get(k) for k in ("placements", "layout", "shapes")):
            return
    elif d0["format_version"] == d["format_version"] == 1 and d0["tensors"] == d["tensors"]:
        return
    try:  # version 2 decoded per tensor; only when the text differs
        full = self_description(header, path)
    except HeaderError:  # this rank's tensors differ from its description: reported where read
        return
    assert full is not None
    mine = full["tensors"]
    for name, info0 in desc0["tensors"].items():
        info = mine.get(name)
        if info is None:
            continue
        if not _same_description(info, info0):
            raise HeaderError(
                f'{path}: its reshard metadata describes tensor "{name}" as shape {list(info["shape"])} '
                f"{list(info['placements'])}, but {path0.name} (rank 0) as {list(info0['shape'])} "
                f"{list(info0['placements'])}; the rank files are not of one checkpoint",
                path=str(path),
                tensor=name,
            )


def _uniform_order(files: RankFiles) -> tuple[int, ...] | None:
    """Each rank's file index when every rank has one file and all share one entry tuple.

    Identical entry sections (the usual case, see :func:`reshard.io.header.decode_header`)
    hold the same tensors with the same dtypes, local shapes and offsets.
    """
    heads = files.headers
    if files.names:  # renamed entries: the same entries are other tensors on each rank
        return None
    if all(len(r) == 1 for r in files.ranks) and all(h.entries is heads[0].entries for h in heads):
        return tuple(r[0] for r in files.ranks)
    return None


def _all_names(where: Sequence[dict[str, tuple[int, TensorEntry]]]) -> list[str]:
    """Rank 0's tensor names (in its files' order), then those only other ranks hold (``Own``)."""
    names = dict.fromkeys(where[0])
    for found in where[1:]:
        names.update(dict.fromkeys(found))
    return list(names)


def _fill_absent(
    name: str,
    found: list[tuple[int, TensorEntry]],
    missing: Sequence[int],
    files: RankFiles,
    describe: Describe,
    mesh: Mesh,
    coords: Sequence[tuple[int, ...]],
    absent: dict[tuple[object, ...], tuple[tuple[int, ...], ...]] | None = None,
) -> tuple[list[tuple[int, TensorEntry]], tuple[int, ...], Sequence[Placement | str]]:
    """Every rank's entry, global shape and placements of a tensor some ranks' files leave out.

    Its ``Own`` placement must leave out exactly those ranks: each gets an empty entry. Any
    other missing rank is an error (every rank holds every tensor; an empty shard has a
    0-size dim). ``absent`` remembers the empty entries' shapes per global shape, placements
    and missing ranks (the 100k experts of an expert-parallel checkpoint: a few layouts).
    """
    first = found[0]
    shapes = [en.shape for _, en in found]
    for r in missing:  # Own empties dim 0; the other dims as a holder's (for a layout deriving the shape)
        shapes.insert(r, (0, *first[1].shape[1:]))
    shape, pls = describe(name, tuple(shapes))
    key = (shape, tuple(map(str, pls)), tuple(missing))
    empties = absent.get(key) if absent is not None else None
    if empties is None:  # the first tensor of this shape, placements and absences: checked
        layout = TensorLayout.for_tensor(name, shape, mesh, list(pls))
        for r in missing:
            p = files.paths[files.ranks[r][0]]
            if layout.holds(coords[r]):
                raise TensorNotFoundError(
                    f'{p}: tensor "{name}" is missing (it is in {files.paths[first[0]].name})',
                    path=str(p),
                    tensor=name,
                )
        empties = tuple(layout.local_shape(coords[r]) for r in missing)
        if absent is not None:
            absent[key] = empties
    out = list(found)
    for r, local in zip(missing, empties):
        out.insert(r, (files.ranks[r][0], TensorEntry(name, first[1].dtype, local, 0, 0)))
    return out, shape, pls


def _rank_entries(
    name: str, files: RankFiles, where: Sequence[dict[str, tuple[int, TensorEntry]]]
) -> tuple[list[tuple[int, TensorEntry]], list[int]]:
    """The tensor's (file index, header entry) on the ranks holding it, all of one dtype, and
    the ranks whose files leave it out (``Own``; checked by :func:`_fill_absent`)."""
    found = []
    missing = []
    for r, w in enumerate(where):
        hit = w.get(name)
        if hit is None:
            missing.append(r)
        else:
            found.append(hit)
    first = files.paths[found[0][0]]
    dtype = found[0][1].dtype
    for i, en in found:
        if en.dtype != dtype:
            p = files.paths[i]
            raise LayoutError(
                f'{p}: tensor "{name}" is {en.dtype} but {dtype} in {first.name}; '
                "all ranks must hold the same dtype",
                path=str(p),
                tensor=name,
            )
    return found, missing


def _derived_shape(
    name: str,
    local_shapes: Sequence[tuple[int, ...]],
    mesh: Mesh,
    pls: Sequence[Placement | str],
    where: Path,
    layout_source: str,
) -> tuple[int, ...]:
    """The global shape the local shapes imply under the layout's placements (``where``: for messages)."""
    try:
        shape = infer_global_shape(local_shapes, mesh, list(pls))
    except ReshardError as e:  # a placement that cannot apply to this tensor at all
        raise LayoutError(
            f'tensor "{name}" (local shape {list(local_shapes[0])} in {where.name}): '
            f"{e.message}, from {layout_source}. Check the rule that matches it.",
            path=str(where),
            tensor=name,
        ) from None
    if shape is None:
        _raise_bad_local(name, local_shapes, mesh, pls, where, layout_source)
    assert shape is not None
    return shape


class _ByDescription:
    """A :data:`Describe` from the files' reshard metadata (:func:`_described_by`): ``marks`` maps
    each described name to its description, which version 2 shares per geometry, so
    :func:`_uniform_sources` tells geometries apart by its identity, before describing."""

    __slots__ = ("marks", "_describe")

    def __init__(self, marks: Mapping[str, object], describe: Describe) -> None:
        self.marks = marks
        self._describe = describe

    def __call__(
        self, name: str, local_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[tuple[int, ...], Sequence[Placement | str]]:
        return self._describe(name, local_shapes)


def _described_by(desc0: RankMetadata, path: Path) -> Describe:
    """Global shape and placements from rank 0's reshard metadata (converted once per description:
    version 2 shares one per geometry)."""
    described = desc0["tensors"]
    values: dict[int, tuple[tuple[int, ...], list[str]]] = {}  # by id: ``described`` holds them

    def describe(name: str, _shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], list[str]]:
        info = described.get(name)
        if info is None:
            raise HeaderError(
                f'{path}: tensor "{name}" is not described in the reshard metadata',
                path=str(path),
                tensor=name,
            )
        hit = values.get(id(info))
        if hit is None:
            hit = values[id(info)] = (tuple(int(x) for x in info["shape"]), list(info["placements"]))
        return hit

    return _ByDescription(described, describe)


def _check_local_shapes(
    name: str,
    layout: TensorLayout,
    coords: Sequence[tuple[int, ...]],
    paths: Sequence[Path],
    entries: Sequence[TensorEntry],
) -> None:
    for r, (p, en) in enumerate(zip(paths, entries)):
        want = layout.local_shape(coords[r])
        if en.shape != want:
            raise LayoutError(
                f'{p.name}: tensor "{name}" has shape {list(en.shape)}, but the global shape '
                f"{list(layout.shape)} with {layout.placement_strs()} on mesh {layout.mesh} gives rank {r} "
                f"{list(want)}. Check that the layout names the one this checkpoint was saved with.",
                path=str(p),
                tensor=name,
            )


def _raise_bad_local(
    name: str,
    local_shapes: Sequence[tuple[int, ...]],
    mesh: Mesh,
    pls: Sequence[Placement | str],
    where: Path,
    layout_source: str,
) -> None:
    pl = [str(p) for p in pls]
    shapes = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(local_shapes[:8]))
    raise LayoutError(
        f'tensor "{name}": local shapes ({shapes}{" ..." if len(local_shapes) > 8 else ""}) '
        f"do not fit placements {pl} on mesh {mesh} from {layout_source} for any global shape. "
        "Check that --source-layout and --source-mesh name the layout this checkpoint was saved with.",
        tensor=name,
        path=str(where.parent),
    )


# --------------------------------------------------------------------------- reader


def _detect(probe: Probe) -> int:
    if probe.is_file:
        return NO
    st = probe.with_suffix(".safetensors")
    if any(RANK_FILE.match(n) for n in st):
        return YES
    return MAYBE if len(st) > 1 else NO


def source_layout(options: ReadOptions) -> LayoutConfig | None:
    """``--source-layout`` on the mesh ``--source-mesh`` resizes."""
    cfg = options.layout
    if cfg is None:
        if options.mesh_sizes:
            raise ConfigError(
                "--source-mesh needs --source-layout (or a self-describing checkpoint has its mesh)"
            )
        return None
    mesh = cfg.mesh.with_sizes(options.mesh_sizes) if options.mesh_sizes else cfg.mesh
    return cfg.with_mesh(mesh)


def manifest_layout(directory: Path, manifest: dict[str, object] | None) -> LayoutConfig | None:
    """The placement rules (on its mesh) ``reshard.json`` records, or None when it has none.

    Raises:
        LayoutError: the recorded rules are not a valid layout.
    """
    from ..config import LayoutConfig  # YAML is not needed to list formats (reshard --help)

    if manifest is None or "rules" not in manifest:
        return None
    try:
        return LayoutConfig.from_json(
            {"mesh": manifest["mesh"], "rules": manifest["rules"]}, source=str(directory / MANIFEST)
        )
    except (ConfigError, KeyError, TypeError) as e:
        raise LayoutError(
            f"{directory / MANIFEST}: invalid layout rules ({e})", path=str(directory / MANIFEST)
        ) from None


def _open(path: Path, options: ReadOptions) -> Checkpoint:
    """Open a per-rank directory; its layout rules: the given layout, ``reshard.json``'s, or exact names."""
    if not path.is_dir():
        raise UsageError(f"{path}: a per-rank checkpoint is a directory", path=str(path))
    cfg = source_layout(options)
    names = None
    if cfg is not None and any(r.own is not None for r in cfg.rules):  # Own(...) deals by the names held
        held = [read_header(p).names for p in _rank_paths(path, strict=False)]
        if any(r.own is not None and r.own[1].local for r in cfg.rules):  # rank-local numbers
            names = cfg.global_names(held)
            held = [tuple(m.get(n, n) for n in h) for h, m in zip(held, names)]
        cfg = cfg.assign(n for h in held for n in h)
    ckpt = open_per_rank(
        path,
        mesh=cfg.mesh if cfg is not None else None,
        placements_for=cfg.placements_for if cfg is not None else None,
        layout_source=cfg.source if cfg is not None else "the layout",
        names=names,
    )
    manifest = read_manifest(path)
    ckpt.manifest = manifest
    if cfg is None:
        cfg = manifest_layout(path, manifest)
    ckpt.layout = cfg if cfg is not None else exact_rules(ckpt)
    return ckpt


def exact_rules(ckpt: Checkpoint) -> LayoutConfig:
    r"""Rules giving each tensor of a self-described checkpoint its own placements, compactly.

    Names that differ only in their numbers (``layers.{i}.experts.{j}.w``) share one rule
    ``re:layers\.\d+\.experts\.\d+\.w`` when they share placements: ``\d`` (RE2:
    ASCII digits) spans whole digit runs only, as the literal text between them holds no
    digit, so the rule matches exactly the names of its shape. Names placed otherwise than
    most of their shape come first as exact-name rules. 100k tensors give a handful of
    rules, not 100k (which took seconds to build and filled a reused layout's manifest).

    >>> from types import SimpleNamespace as T
    >>> ts = [T(name=f"l.{i}.w", placements=("R" if i == 1 else "S(0)",)) for i in range(3)]
    >>> ts.append(T(name="l.2x", placements=("R",)))
    >>> ck = T(mesh=Mesh(("tp",), (2,)), path="ck", tensors={t.name: t for t in ts})
    >>> [(r.pattern, [str(p) for _, p in r.spec]) for r in exact_rules(ck).rules]
    [('l.1.w', ['R']), ('re:l\\.\\d+\\.w', ['S(0)']), ('l.2x', ['R'])]
    """
    from ..config import LayoutConfig

    assert ckpt.mesh is not None
    # shape of a name (its text between digit runs) -> placements -> names
    shapes: dict[tuple[str, ...], dict[tuple[str, ...], list[str]]] = {}
    strs: dict[object, tuple[str, ...]] = {}
    for t in ckpt.tensors.values():
        pls = t.placements or ()
        text = strs.get(pls)
        if text is None:
            text = strs[pls] = tuple(str(p) for p in pls)
        shapes.setdefault(tuple(_DIGIT_RUNS.split(t.name)), {}).setdefault(text, []).append(t.name)
    exact: list[list[object]] = []
    shared: list[list[object]] = []
    dims = ckpt.mesh.names  # by name, not position: --target-mesh may add a dim (Replicate there)
    for parts, by_placements in shapes.items():
        ranked = sorted(by_placements.items(), key=lambda kv: -len(kv[1]))
        (most, names), rest = ranked[0], ranked[1:]
        exact.extend([_exact_pattern(n), dict(zip(dims, pls, strict=True))] for pls, ns in rest for n in ns)
        pattern = _exact_pattern(names[0]) if len(names) == 1 else "re:" + r"\d+".join(map(re.escape, parts))
        shared.append([pattern, dict(zip(dims, most, strict=True))])
    return LayoutConfig.from_json(
        {"mesh": ckpt.mesh.to_json(), "rules": exact + shared}, source=f"{ckpt.path} (file metadata)"
    )


_DIGIT_RUNS = re.compile("[0-9]+")


def _exact_pattern(name: str) -> str:
    """A rule pattern matching ``name`` alone: itself, unless it reads as a glob or regex or is
    empty (``torch.save(tensor)`` holds one tensor named ``""``; a rule pattern is never empty).

    >>> print(*(_exact_pattern(n) for n in ("a.b", "a*", "")))
    a.b re:a\\* re:^$
    """
    if not name:
        return "re:^$"
    if name.startswith("re:") or any(c in name for c in "*?["):
        return "re:" + re.escape(name)
    return name


READER = Reader(
    name="per-rank",
    help="rank-{r:05d}-of-{W:05d}.safetensors, one per rank (self-described, or with --source-layout)",
    detect=_detect,
    open=_open,
)


# --------------------------------------------------------------------------- writer


def rank_file_name(rank: int, world: int) -> str:
    """``rank-00003-of-00008.safetensors``."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def tensors_text(tensors: Iterable[tuple[str, Sequence[int], Sequence[str]]]) -> str:
    """Format version 1's ``tensors`` member: name -> global shape and placements (as ``json.dumps``
    of that mapping writes it; each distinct value's text made once, not a dict per tensor)."""
    values: dict[tuple[tuple[int, ...], tuple[str, ...]], str] = {}
    items = []
    for name, shape, pls in tensors:
        key = (tuple(shape), tuple(pls))
        value = values.get(key)
        if value is None:
            value = values[key] = json.dumps(
                {"shape": list(shape), "placements": list(pls)}, separators=(",", ":")
            )
        items.append(f"{json.dumps(name)}:{value}")
    return '"tensors":{' + ",".join(items) + "}"


def describe_tensors(tensors: Iterable[tuple[str, str, TensorLayout]]) -> tuple[int, str]:
    """The format version and the tensor members of the per-rank metadata, from ``(name, dtype, layout)``.

    Version 2 (compact: well under the header entries' own size, where version 1 doubled
    a 100k-tensor header): ``"placements"`` lists the distinct placements once,
    ``"layout"`` holds one character per tensor in the file's data order (dtype, then
    name, as the reference writer lays them out) indexing it, and ``"shapes"`` the global
    shapes of the tensors that are not split evenly (every other one is its local shape
    times the mesh sizes sharding each dim). More distinct placements than codes: version 1.
    """
    ordered = sorted(tensors, key=lambda t: (-DTYPE_RANK[t[1]], t[0]))
    return _described([n for n, _, _ in ordered], [lay for _, _, lay in ordered])


def _described(
    names: Sequence[str], layouts: Sequence[TensorLayout], coord: tuple[int, ...] | None = None
) -> tuple[int, str]:
    """:func:`describe_tensors` of the tensors ``names`` laid out ``layouts``, in the file's data
    order; with ``coord``, of one rank's file alone (version 3): a global shape is given where
    that rank's local shape does not give it."""
    table: dict[tuple[str, ...], str] = {}
    # tensors of one geometry share one layout object (the planner's): its code and evenness
    # are found once, by identity (``layouts`` holds them, so their ids stay theirs), each
    # distinct layout in the order it first comes (so the codes are given in that order)
    ids = list(map(id, layouts))
    per_layout: dict[int, str] = {}
    uneven: set[int] = set()
    for key, layout in dict(zip(ids, layouts)).items():
        pls = _placement_texts(layout.placements)
        code = table.get(pls)
        if code is None:
            if len(table) == len(_CODES):
                every = zip(names, layouts)
                return 1, tensors_text((n, lay.shape, lay.placement_strs()) for n, lay in every)
            code = table[pls] = _CODES[len(table)]
        per_layout[key] = code
        if not (_splits_evenly(layout) if coord is None else _even_at(layout, coord)):
            uneven.add(key)
    codes = "".join(map(per_layout.__getitem__, ids))
    shapes = {}
    if uneven:
        for name, key, layout in zip(names, ids, layouts):
            if key in uneven:
                shapes[name] = list(layout.shape)
    compact = (",", ":")
    text = (
        f'"placements":{json.dumps([list(p) for p in table], separators=compact)},'
        f'"layout":"{codes}","shapes":{json.dumps(shapes, separators=compact)}'
    )
    return 2, text


@lru_cache(maxsize=4096)
def _placement_texts(placements: tuple[Placement, ...]) -> tuple[str, ...]:
    return tuple(str(p) for p in placements)


def _even_at(layout: TensorLayout, coord: tuple[int, ...]) -> bool:
    """The local shape at ``coord`` is what :func:`_even_global` turns back into the global shape."""
    local = layout.local_shape(coord)
    return _even_global(tuple(local), layout.mesh, layout.placement_strs()) == list(layout.shape)


@lru_cache(maxsize=65536)
def _splits_evenly(layout: TensorLayout) -> bool:
    """Every rank holds the local shape :func:`_even_global` turns back into the global shape."""
    pls = layout.placement_strs()
    return all(_even_global(block_shape(b), layout.mesh, pls) == list(layout.shape) for b in layout.blocks())


def rank_metadata(mesh: Mesh, rank: int, tensors: tuple[int, str]) -> dict[str, str]:
    """The ``__metadata__`` of rank ``rank``'s file (``tensors`` from :func:`describe_tensors`).

    The one place it is made: converted files and :func:`reshard.dist.save_dtensors`'
    files are byte-identical.
    """
    compact = (",", ":")
    version, text = tensors
    meta = (
        f'{{"format_version":{version},"mesh":{json.dumps(mesh.to_json(), separators=compact)},'
        f'"rank":{rank},"coordinate":{json.dumps(list(mesh.coordinate(rank)), separators=compact)},'
        f"{text}}}"
    )
    return {"reshard": meta}


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    ordered = file_order(tensors, options)
    layouts = [t.layout for t in ordered]
    if any(lay.assigned for lay in distinct_layouts(layouts)):
        return _owned_files(ordered, mesh, options.file_names or {})
    # header order is the metadata's order (dtype, then name: names are unique)
    version, text = _described([t.name for t in ordered], layouts)
    shared = _escaped(text)
    return [
        SafetensorsFile(
            rank_file_name(rank, mesh.size), rank, ordered, _metadata_parts(mesh, rank, version, shared)
        )
        for rank in range(mesh.size)
    ]


def _escaped(text: str) -> bytes:
    """``text`` as it reads inside a JSON string (:func:`metadata_text`'s escaping), UTF-8."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def _metadata_parts(
    mesh: Mesh, rank: int, version: int, shared: bytes, extra: str = ""
) -> tuple[bytes, bytes, bytes]:
    """``metadata_text(rank_metadata(mesh, rank, (version, text + extra)))`` in three parts, the
    second ``shared`` (``_escaped(text)``, the same object in every rank's file: 64 ranks of 100k
    unevenly split tensors held 64 copies of its 12 MB). JSON escaping maps each character on
    its own, so escaping the parts apart gives the escaped whole.
    """
    whole = metadata_text(rank_metadata(mesh, rank, (version, "")))
    end = _escaped("}") + b'"}'
    head = whole.encode()
    assert head.endswith(end), head[-8:]
    return head[: -len(end)], shared, _escaped(extra + "}") + b'"}'


def _owned_files(ordered: Sequence[TargetTensor], mesh: Mesh, renamed: Mapping[str, str]) -> list[OutFile]:
    """``Own(...)``: a rank's file leaves out the tensors it does not own, and describes only its
    own (format version 3: version 2's codes, for this file's entries; a reader joins the
    files' descriptions). Version 1 (every tensor's shape and placements, in every file: 8 ranks
    of 200k tensors carried 19 MB each, four times their entries) only when a file's tensors have
    more distinct placements than version 2 has codes. Tensors ``renamed`` (``Own(NAME, local)``)
    are stored under their rank-local names, in the reference writer's order of those names, and
    the file's metadata maps them back: ``"local_names": {name in this file: tensor name}``.
    """
    layouts = distinct_layouts(t.layout for t in ordered)
    files: list[tuple[int, list[TargetTensor], list[str] | None, str]] = []
    for rank, coord in enumerate(mesh.coordinates()):
        held = {id(lay) for lay in layouts if lay.holds(coord)}  # tensors share a few layouts
        mine = [t for t in ordered if id(t.layout) in held]
        names, extra = None, ""
        if renamed:
            pairs = sorted(
                ((renamed.get(t.name, t.name), t) for t in mine),
                key=lambda p: (-DTYPE_RANK[p[1].dtype], p[0]),
            )
            _check_unique(pairs, rank)
            mine, names = [t for _, t in pairs], [n for n, _ in pairs]
            local = {n: t.name for n, t in pairs if n != t.name}
            extra = ',"local_names":' + json.dumps(local, separators=(",", ":")) if local else ""
        files.append((rank, mine, names, extra))
    texts = []
    coords = list(mesh.coordinates())
    for rank, mine, names, _ in files:  # in each file's data order, under its entries' names
        version, text = _described(names or [t.name for t in mine], [t.layout for t in mine], coords[rank])
        if version != 2:
            break
        texts.append(_escaped(text))
    version = OWN_VERSION
    if len(texts) < len(files):  # placements version 2 cannot code: every tensor's, in every file
        shared = _escaped(tensors_text((t.name, t.shape, t.layout.placement_strs()) for t in ordered))
        texts, version = [shared] * len(files), 1  # one object in all the files
    return [
        SafetensorsFile(
            rank_file_name(rank, mesh.size),
            rank,
            mine,
            _metadata_parts(mesh, rank, version, text, extra),
            names,
        )
        for (rank, mine, names, extra), text in zip(files, texts, strict=True)
    ]


def _check_unique(pairs: Sequence[tuple[str, TargetTensor]], rank: int) -> None:
    """No two tensors of one rank's file under one name (a rank-local name taken by another tensor)."""
    seen: dict[str, str] = {}
    for n, t in pairs:
        if n in seen:
            raise LayoutError(
                f'tensors "{seen[n]}" and "{t.name}" would both be named "{n}" in rank {rank}\'s file: '
                "Own(NAME, local) renumbers a tensor to a name another tensor of that rank has; "
                "change the layout's rules so only one of them is renumbered",
                tensor=t.name,
            )
        seen[n] = t.name


def local_names(files: RankFiles) -> tuple[dict[str, str], ...]:
    """Per file, the ``local_names`` its reshard metadata records (``Own(NAME, local)``: an entry's
    name -> the tensor's), each naming an entry of the file.

    Raises:
        HeaderError: the member is not an object of names the file holds.
    """
    return tuple(_local_names(p, h) for p, h in zip(files.paths, files.headers))


def _local_names(p: Path, h: Header, data: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The ``local_names`` of one file's reshard metadata (``data``, when already decoded), checked."""
    raw = (h.metadata or {}).get("reshard")
    found: dict[str, str] = {}
    if raw is not None and '"local_names"' in raw:
        where = str(p)
        if data is None:
            data = expect_object(
                load_json(raw.encode(), path=where, what="reshard metadata", error=HeaderError),
                path=where,
                field="the reshard metadata",
                error=HeaderError,
            )
        found = expect_object(
            data.get("local_names"), path=where, field="reshard.local_names", error=HeaderError
        )
        held = set(h.names)
        for k, v in found.items():
            if k not in held or not isinstance(v, str):
                raise HeaderError(
                    f"{p}: invalid reshard metadata (local_names maps {k!r} to {v!r}; it must map "
                    "names this file holds to tensor names)",
                    path=where,
                )
    return found


WRITER = Writer(
    name="per-rank",
    help="one self-described safetensors file per target rank",
    files=_files,
    complete=complete_self_described,
    lockstep=True,
    owns=(".safetensors",),
)
