"""The planner: intersect target blocks with source pieces into copy operations (pure).

A :class:`Copy` moves the Cartesian product of per-dim segments
``(src_local_start, dst_local_start, size)`` from one source piece into one
target local tensor. Work is shared between tensors of the same geometry
(same source signature, shape and target placements), so a checkpoint of
100k tensors costs as many matchings as it has distinct tensor layouts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import Any

from .checkpoint import Checkpoint, TensorSource
from .errors import PlanError
from .intervals import Block, IndexList, Segment, block_shape, block_volume, overlap_segments
from .io.header import DTYPE_RANK, DTYPE_SIZES, FLOAT_DTYPES
from .layout import TensorLayout
from .mesh import Mesh
from .placements import Placement

__all__ = [
    "Copy",
    "TargetTensor",
    "match_blocks",
    "plan_tensor",
    "copy_boxes",
    "natural_key",
    "OutEntry",
    "OutFile",
    "Plan",
    "make_plan",
    "rank_file_name",
    "PER_RANK",
    "HF",
]


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy from source piece ``piece`` the product of ``segments`` (one tuple per dim)."""

    piece: int
    segments: tuple[tuple[Segment, ...], ...]
    group: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for segs in self.segments:
            n *= sum(s[2] for s in segs)
        return n


@dataclass(frozen=True, slots=True)
class TargetTensor:
    """One tensor of the target: its layout and, per target rank, the copies that fill it."""

    name: str
    src: TensorSource
    dtype: str
    layout: TensorLayout
    copies: tuple[tuple[Copy, ...], ...]
    groups: int = 1
    reduce_op: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements


def copy_boxes(copy: Copy) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Expand a copy into boxes ``(src_starts, dst_starts, sizes)`` in local coordinates."""
    for combo in product(*copy.segments):
        yield (
            tuple(s[0] for s in combo),
            tuple(s[1] for s in combo),
            tuple(s[2] for s in combo),
        )


@dataclass(slots=True)
class _SourceIndex:
    """Deduplicated pieces of one partial group, indexed for matching."""

    pieces: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)


def _index_sources(src: TensorSource) -> dict[int, _SourceIndex]:
    groups: dict[int, _SourceIndex] = {}
    seen: dict[tuple[int, Block], int] = {}
    partials = src.piece_partials
    for k, blk in enumerate(src.piece_blocks):
        g = partials[k] if partials is not None else 0
        if (g, blk) in seen or block_volume(blk) == 0:
            continue  # a replica: the first piece (lowest file index) is read
        seen[(g, blk)] = k
        idx = groups.setdefault(g, _SourceIndex())
        idx.pieces.append(k)
        idx.blocks.append(blk)
    return groups


def match_blocks(src: TensorSource, dst_blocks: Sequence[Block]) -> tuple[tuple[tuple[Copy, ...], ...], int]:
    """Copies filling each destination block from the source pieces.

    Returns per destination block its copies, and the number of partial groups.

    Raises:
        PlanError: a destination region is not covered by the source (a hole),
            or covered twice by pieces that are not replicas (a conflicting overlap).
    """
    groups = _index_sources(src)
    group_ids = sorted(groups)
    if not group_ids:
        group_ids = [0]
        groups[0] = _SourceIndex()
    seg_cache: dict[tuple[IndexList, IndexList], tuple[Segment, ...]] = {}
    out: list[tuple[Copy, ...]] = []
    for dblk in dst_blocks:
        need = block_volume(dblk)
        copies: list[Copy] = []
        if need:
            for gi, g in enumerate(group_ids):
                idx = groups[g]
                got = 0
                for k, sblk in zip(idx.pieces, idx.blocks):
                    segs_all: list[tuple[Segment, ...]] = []
                    for sl, dl in zip(sblk, dblk):
                        key = (sl, dl)
                        segs = seg_cache.get(key)
                        if segs is None:
                            segs = overlap_segments(sl, dl)
                            seg_cache[key] = segs
                        if not segs:
                            break
                        segs_all.append(segs)
                    else:
                        c = Copy(k, tuple(segs_all), gi)
                        got += c.numel
                        copies.append(c)
                if got != need:
                    what = "holes" if got < need else "conflicting overlaps"
                    raise PlanError(
                        f'tensor "{src.name}": the source pieces leave {what} '
                        f"({got} of {need} elements of a target block covered"
                        + (f", partial group {g}" if len(group_ids) > 1 else "")
                        + "). The checkpoint is incomplete or its layout is wrong; "
                        "run `reshard inspect --check` on it.",
                        tensor=src.name,
                    )
        out.append(tuple(copies))
    return tuple(out), len(group_ids)


_MATCH_CACHE: dict[tuple[object, ...], tuple[tuple[tuple[Copy, ...], ...], int]] = {}


def plan_tensor(src: TensorSource, layout: TensorLayout, dtype: str) -> TargetTensor:
    """Plan one tensor: reuse the matching of any earlier tensor of the same geometry."""
    if layout.partial_op is not None:
        raise PlanError(
            f'tensor "{src.name}": a Partial target placement {layout.placement_strs()} is not '
            "supported; a converted checkpoint holds the reduced value. Use R instead of P.",
            tensor=src.name,
        )
    key = (src.signature, layout.shape, layout.mesh.shape, layout.placements)
    hit = _MATCH_CACHE.get(key)
    if hit is None:
        hit = match_blocks(src, layout.blocks())
        if len(_MATCH_CACHE) > 100_000:
            _MATCH_CACHE.clear()
        _MATCH_CACHE[key] = hit
    copies, groups = hit
    return TargetTensor(
        name=src.name,
        src=src,
        dtype=dtype,
        layout=layout,
        copies=copies,
        groups=groups,
        reduce_op=src.reduce_op if groups > 1 else None,
    )


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key putting ``layers.2`` before ``layers.10``.

    >>> sorted(["l.10.w", "l.2.w", "a"], key=natural_key)
    ['a', 'l.2.w', 'l.10.w']
    """
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(name))


@dataclass(frozen=True, slots=True)
class OutEntry:
    """One tensor in one output file: target rank ``rank``'s block, at absolute ``start``."""

    tensor: TargetTensor
    rank: int
    start: int
    nbytes: int


class OutFile:
    """One output file: target rank ``rank``'s blocks of ``tensors``.

    The header bytes and tensor offsets are laid out on first use, not at
    planning time: a checkpoint of 100k tensors planned for 64 ranks has 6.4M
    file entries, and each worker lays out only the files it writes.
    """

    __slots__ = ("name", "rank", "tensors", "_meta", "_layout")

    def __init__(self, name: str, rank: int | None, tensors: Sequence[TargetTensor], meta: str) -> None:
        self.name = name
        self.rank = rank
        self.tensors = tensors  # in header order (dtype rank descending, then name)
        self._meta = meta  # the JSON text of __metadata__
        self._layout: tuple[bytes, tuple[OutEntry, ...], int] | None = None

    def _lay_out(self) -> tuple[bytes, tuple[OutEntry, ...], int]:
        if self._layout is None:
            r = 0 if self.rank is None else self.rank
            parts = ['"__metadata__":' + self._meta]
            spans = []
            offset = 0
            for t in self.tensors:
                shape_text, nbytes = _local_text(t, r)
                stop = offset + nbytes
                parts.append(
                    f'{_quoted(t.name)}:{{"dtype":"{t.dtype}","shape":[{shape_text}],'
                    f'"data_offsets":[{offset},{stop}]}}'
                )
                spans.append((offset, nbytes))
                offset = stop
            body = ("{" + ",".join(parts) + "}").encode("utf-8")
            body += b" " * (-len(body) % 8)
            prefix = len(body).to_bytes(8, "little") + body
            base = len(prefix)
            entries = tuple(OutEntry(t, r, base + a, n) for t, (a, n) in zip(self.tensors, spans))
            self._layout = (prefix, entries, base + offset)
        return self._layout

    @property
    def prefix(self) -> bytes:
        return self._lay_out()[0]

    @property
    def entries(self) -> tuple[OutEntry, ...]:
        return self._lay_out()[1]

    @property
    def size(self) -> int:
        return self._lay_out()[2]

    @property
    def copies(self) -> int:
        r = 0 if self.rank is None else self.rank
        return sum(len(t.copies[r]) for t in self.tensors)


_QUOTED: dict[str, str] = {}


def _quoted(name: str) -> str:
    q = _QUOTED.get(name)
    if q is None:
        q = json.dumps(name, ensure_ascii=False)
        if len(_QUOTED) < 1_000_000:
            _QUOTED[name] = q
    return q


@lru_cache(maxsize=65536)
def _local_texts(layout: TensorLayout, dtype: str) -> tuple[tuple[str, int], ...]:
    """Per rank: the local shape as header text, and the local bytes (shared by equal layouts)."""
    isz = DTYPE_SIZES[dtype]
    out = []
    for blk in layout.blocks():
        shp = block_shape(blk)
        n = isz
        for x in shp:
            n *= x
        out.append((",".join(map(str, shp)), n))
    return tuple(out)


def _local_text(t: TargetTensor, rank: int) -> tuple[str, int]:
    return _local_texts(t.layout, t.dtype)[rank]


def _header_order(tensors: Sequence[TargetTensor]) -> list[TargetTensor]:
    """The reference writer's order: dtype rank (Rust enum) descending, then name."""
    return sorted(tensors, key=lambda t: (-DTYPE_RANK[t.dtype], t.name))


@dataclass(slots=True)
class Plan:
    """Everything a conversion does, decided before a byte is written."""

    source: Checkpoint
    format: str
    mesh: Mesh
    tensors: list[TargetTensor]
    files: list[OutFile]
    rules: Any = None  # config.LayoutConfig of the target, when there is one
    index: dict[str, Any] | None = None  # model.safetensors.index.json for hf output

    @property
    def bytes_written(self) -> int:
        return sum(f.size for f in self.files)

    def file_reads(self, f: OutFile) -> dict[int, int]:
        """Bytes read per source file index to produce ``f``."""
        out: dict[int, int] = {}
        for e in f.entries:
            t = e.tensor
            isz = DTYPE_SIZES[t.src.dtype]
            for c in t.copies[e.rank]:
                fi = t.src.piece_files[c.piece]
                out[fi] = out.get(fi, 0) + c.numel * isz
        return out

    @property
    def bytes_read(self) -> int:
        return sum(sum(self.file_reads(f).values()) for f in self.files)


PER_RANK = "per-rank"
HF = "hf"


def rank_file_name(rank: int, world: int) -> str:
    """``rank-00003-of-00008.safetensors``."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def make_plan(
    source: Checkpoint,
    mesh: Mesh,
    placements_for: Callable[[str], Sequence[Placement | str]],
    *,
    fmt: str = PER_RANK,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    rules: Any = None,
) -> Plan:
    """Plan a conversion of ``source`` to ``mesh`` with the placements ``placements_for(name)``.

    Args:
        source: the opened source checkpoint.
        mesh: the target mesh (a one-rank mesh for ``hf``).
        placements_for: target placements for a tensor name, one per mesh dim.
        fmt: ``per-rank`` or ``hf``.
        dtype: cast floating tensors to this safetensors dtype (``BF16``, ``F16``, ``F32``).
        max_shard_size: split ``hf`` output files at this many bytes.
        rules: the target layout rules, recorded in the output.

    Raises:
        LayoutError: a placement does not fit a tensor.
        PlanError: the source cannot produce the target.
    """
    names = sorted(source.tensors, key=natural_key)
    tensors: list[TargetTensor] = []
    for name in names:
        src = source.tensors[name]
        out_dtype = src.dtype
        if dtype is not None and src.dtype != dtype:
            if src.dtype in FLOAT_DTYPES:
                out_dtype = dtype
        pl = placements_for(name) if fmt == PER_RANK else ["R"] * mesh.ndim
        layout = TensorLayout.for_tensor(name, src.shape, mesh, pl)
        tensors.append(plan_tensor(src, layout, out_dtype))
    if fmt == PER_RANK:
        files = _per_rank_files(tensors, mesh)
        index = None
    elif fmt == HF:
        files, index = _hf_files(tensors, max_shard_size)
    else:
        raise PlanError(f"unknown output format {fmt!r} (use per-rank or hf)")
    return Plan(source, fmt, mesh, tensors, files, rules=rules, index=index)


def _per_rank_files(tensors: Sequence[TargetTensor], mesh: Mesh) -> list[OutFile]:
    tensors_json = json.dumps(
        {t.name: {"shape": list(t.shape), "placements": t.layout.placement_strs()} for t in tensors},
        separators=(",", ":"),
    )
    mesh_json = json.dumps(mesh.to_json(), separators=(",", ":"))
    ordered = _header_order(tensors)
    files = []
    for rank in range(mesh.size):
        coord = list(mesh.coordinate(rank))
        meta = (
            f'{{"format_version":1,"mesh":{mesh_json},"rank":{rank},'
            f'"coordinate":{json.dumps(coord, separators=(",", ":"))},"tensors":{tensors_json}}}'
        )
        files.append(
            OutFile(
                rank_file_name(rank, mesh.size),
                rank,
                ordered,
                json.dumps({"reshard": meta}, ensure_ascii=False, separators=(",", ":")),
            )
        )
    return files


def _hf_files(tensors: Sequence[TargetTensor], max_shard_size: int) -> tuple[list[OutFile], dict[str, Any]]:
    groups: list[list[TargetTensor]] = [[]]
    acc = 0
    for t in tensors:
        n = _local_text(t, 0)[1]
        if groups[-1] and acc + n > max_shard_size:
            groups.append([])
            acc = 0
        groups[-1].append(t)
        acc += n
    total = len(groups)
    files = []
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, group in enumerate(groups):
        name = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        files.append(OutFile(name, None, _header_order(group), '{"format":"pt"}'))
        for t in group:
            weight_map[t.name] = name
            total_size += _local_text(t, 0)[1]
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return files, index
