"""Prove a checkpoint whole: coverage, equal replicas and overlaps, byte ranges, checksums.

``check_checkpoint`` backs ``reshard inspect --check``. It reports problems
instead of raising, so one run lists everything wrong:

* ``warning``: a reader warning marked as a data problem (:attr:`CheckpointWarning.problem`);
* ``missing-file``, ``size``, ``checksum``, ``unlisted-file``, ``manifest``: the
  files against ``reshard.json`` (sizes, ``xxh3_128`` checksums, tensor dtypes and shapes);
* ``bounds``: a piece's bytes lie outside its file; ``outside``: a piece's
  indices lie outside its tensor's global shape;
* ``hole``: a global region no piece holds (per Partial group);
* ``replica``: pieces holding the same block that differ byte for byte;
  ``overlap``: pieces holding different but overlapping blocks that differ on
  the overlap.
* ``crc32``: a piece whose bytes do not have the CRC32 its format recorded
  (:attr:`~reshard.checkpoint.TensorSource.piece_crc32`).

Coverage is interval arithmetic, once per piece geometry (tensors of the same
:attr:`~reshard.checkpoint.TensorSource.signature` share it), never element by
element. Data is compared through memory maps in chunks of at most
``max_bytes``, and the pages read are released as we go.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, TypedDict

from .budget import DEFAULT_MAX_BYTES
from .bulkcheck import Geometry, suspects
from .checkpoint import Checkpoint, TensorSource
from .dtypes import DTYPE_SIZES
from .intervals import (
    Block,
    Box,
    IndexList,
    Interval,
    Segment,
    block_volume,
    coverage_holes,
    format_box,
    global_index,
    normalize,
    overlap_segments,
    overlapping_pairs,
    select,
    slabs,
)
from .io.checksum import CHECKSUM_PREFIX, file_checksum
from .io.reader import MappedFiles, read_box
from .io.readhash import CrcRegions, ReadHashes, Region, xxh3_regions
from .io.spool import SpoolCheckError
from .plan import natural_key, natural_sorted
from .select import LEFT_OUT

__all__ = [
    "check_checkpoint",
    "check_metadata",
    "checks_made",
    "replica_problems",
    "source_hashes",
    "Problem",
    "MAX_REGIONS",
]

#: Hole regions reported per tensor and partial group; the rest are summed up in one more problem.
MAX_REGIONS = 8


class _ProblemCore(TypedDict):
    kind: str
    message: str
    path: str | None
    tensor: str | None
    region: list[list[int]] | None


class Problem(_ProblemCore, total=False):
    """One problem found, as JSON (``inspect --check --json``).

    ``region`` is a global box ``[[start, stop], ...]``; ``size``/``checksum``/``crc32``
    problems add ``expected`` and ``actual``, ``replica``/``overlap`` add ``index`` (the
    first differing global index) and ``other`` (the file compared with).
    """

    expected: int | str
    actual: int | str
    index: list[int]
    other: str


def _problem(
    kind: str,
    message: str,
    *,
    path: str | None = None,
    tensor: str | None = None,
    region: Box | None = None,
    expected: int | str | None = None,
    actual: int | str | None = None,
    index: list[int] | None = None,
    other: str | None = None,
) -> Problem:
    p: Problem = {
        "kind": kind,
        "message": message,
        "path": path,
        "tensor": tensor,
        "region": [[iv.start, iv.stop] for iv in region] if region is not None else None,
    }
    if expected is not None and actual is not None:
        p["expected"], p["actual"] = expected, actual
    if index is not None and other is not None:
        p["index"], p["other"] = index, other
    return p


def _volume(box: Box) -> int:
    n = 1
    for iv in box:
        n *= iv.size
    return n


# --------------------------------------------------------------------------- coverage


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True, slots=True)
class _Group:
    """One partial group of a geometry: its holes, replica pairs and overlapping pairs."""

    gid: int
    holes: tuple[Box, ...]
    replicas: tuple[tuple[int, int], ...]  # (representative piece, replica piece)
    overlaps: tuple[tuple[int, int, tuple[tuple[Segment, ...], ...]], ...]


@dataclass(frozen=True, slots=True)
class _Geometry:
    """What only depends on the pieces' blocks: shared by tensors of one signature."""

    outside: tuple[tuple[int, int], ...]  # (piece, dim) with indices past the shape
    groups: tuple[_Group, ...]
    numels: tuple[int, ...]


def _geometry(t: TensorSource) -> _Geometry:
    outside = _outside(t)
    if outside:
        return _Geometry(tuple(outside), (), ())
    numels = tuple(block_volume(b) for b in t.piece_blocks)
    partials = t.piece_partials
    by_group: dict[int, list[int]] = {}
    for k in range(len(t.piece_blocks)):
        by_group.setdefault(partials[k] if partials is not None else 0, []).append(k)
    if not by_group:
        by_group[0] = []
    groups = tuple(_group(t, gid, by_group[gid], numels) for gid in sorted(by_group))
    return _Geometry((), groups, numels)


def _outside(t: TensorSource) -> list[tuple[int, int]]:
    """``(piece, dim)`` of pieces with indices past the global shape (dim -1: wrong rank)."""
    outside = []
    for k, blk in enumerate(t.piece_blocks):
        if len(blk) != len(t.shape):
            outside.append((k, -1))
            continue
        for d, (ilist, n) in enumerate(zip(blk, t.shape, strict=True)):
            if ilist and ilist[-1].stop > n:
                outside.append((k, d))
    return outside


def _group(t: TensorSource, gid: int, pieces: Sequence[int], numels: Sequence[int]) -> _Group:
    """Holes, replica pairs and overlapping pairs of one partial group's pieces."""
    reps: dict[Block, int] = {}
    replicas: list[tuple[int, int]] = []
    for k in pieces:
        blk = t.piece_blocks[k]
        if numels[k] == 0:
            continue
        r = reps.get(blk)
        if r is None:
            reps[blk] = k
        else:
            replicas.append((r, k))
    distinct = list(reps)
    numel = t.numel
    holes = coverage_holes(t.shape, distinct) if numel else []
    covered = numel - sum(_volume(h) for h in holes)
    overlaps: list[tuple[int, int, tuple[tuple[Segment, ...], ...]]] = []
    if sum(block_volume(b) for b in distinct) > covered:
        # some distinct blocks overlap: find which (a well-formed layout never gets here)
        for i, j in overlapping_pairs(distinct):
            segs = tuple(overlap_segments(a, b) for a, b in zip(distinct[i], distinct[j], strict=True))
            overlaps.append((reps[distinct[i]], reps[distinct[j]], segs))
    return _Group(gid, tuple(holes), tuple(replicas), tuple(overlaps))


# --------------------------------------------------------------------------- data


def _interval_at(ilist: IndexList, x: int) -> Interval:
    for iv in ilist:
        if iv.start <= x < iv.stop:
            return iv
    raise AssertionError(f"{x} not in {ilist}")


class _Data:
    """Byte-for-byte comparisons of pieces through memory maps, in bounded chunks."""

    def __init__(self, ckpt: Checkpoint, max_bytes: int) -> None:
        self.ckpt = ckpt
        self.files = MappedFiles(ckpt.files, max_bytes // 4)
        # a chunk needs its mask (one byte per byte or per item) besides the two mapped views
        self.chunk = max(1, max_bytes // 2)

    def close(self) -> None:
        self.files.close()

    def replica(self, t: TensorSource, r: int, k: int, nbytes: int) -> list[int] | None:
        """First differing global index of two pieces holding the same block, or None."""
        import numpy as np

        fr, fk = t.piece_files[r], t.piece_files[k]
        orr, ok = t.piece_offsets[r], t.piece_offsets[k]
        pos = 0
        # touched pages are released every `release_every` bytes (MappedFiles.touch_range)
        while pos < nbytes:
            n = min(self.chunk, nbytes - pos)
            a = self.files.raw(fr, orr + pos, n)
            b = self.files.raw(fk, ok + pos, n)
            neq = np.not_equal(a, b)
            if neq.any():
                byte = pos + int(np.argmax(neq))
                item = byte // DTYPE_SIZES[t.dtype]
                shape = t.piece_shape(r)
                local = [int(x) for x in np.unravel_index(item, shape)] if shape else []
                return global_index(t.piece_blocks[r], local)
            del a, b, neq
            pos += n
        return None

    def crc32(self, fi: int, offset: int, nbytes: int) -> int:
        """CRC32 of ``nbytes`` of file ``fi`` at ``offset``, read in bounded chunks."""
        crc = 0
        for pos in range(offset, offset + nbytes, self.chunk):
            crc = zlib.crc32(self.files.raw(fi, pos, min(self.chunk, offset + nbytes - pos)).data, crc)
        return crc

    def overlap(
        self, t: TensorSource, i: int, j: int, segs: tuple[tuple[Segment, ...], ...]
    ) -> list[int] | None:
        """First differing global index where pieces ``i`` and ``j`` overlap, or None."""
        from itertools import product

        import numpy as np

        isz = DTYPE_SIZES[t.dtype]
        pi = self.files.piece(t, i)
        pj = self.files.piece(t, j)
        items = max(1, self.chunk // isz)
        try:
            for combo in product(*segs):
                s_st = [s[0] for s in combo]
                d_st = [s[1] for s in combo]
                sizes = tuple(s[2] for s in combo)
                for slab in slabs(sizes, 1, items):
                    ki = tuple(slice(s + a, s + b) for s, (a, b) in zip(s_st, slab, strict=True))
                    kj = tuple(slice(s + a, s + b) for s, (a, b) in zip(d_st, slab, strict=True))
                    va = read_box(self.files, pi, ki)
                    vb = read_box(self.files, pj, kj)
                    neq = np.not_equal(va, vb)
                    if neq.any():
                        shape = tuple(b - a for a, b in slab)
                        pos = int(np.argmax(neq.reshape(-1)))
                        local = [int(x) for x in np.unravel_index(pos, shape)] if shape else []
                        in_j = [s.start + x for s, x in zip(kj, local, strict=True)]
                        return global_index(t.piece_blocks[j], in_j)
                    del va, vb, neq
        finally:
            del pi, pj
            self.files.release()
        return None


# --------------------------------------------------------------------------- checks


def _manifest_root(ckpt: Checkpoint) -> Path:
    p = Path(ckpt.path)
    return p if p.is_dir() else p.parent


def _check_files(ckpt: Checkpoint, out: list[Problem]) -> list[int | None]:
    sizes: list[int | None] = []
    for fi, f in enumerate(ckpt.files):
        if fi in ckpt.spooled:  # a reader's spool: made (at this size) when first read
            sizes.append(ckpt.file_sizes[fi])
            continue
        try:
            sizes.append(os.stat(f).st_size)
        except OSError as e:
            sizes.append(None)
            out.append(_problem("missing-file", f"{f}: cannot be read ({e.strerror})", path=f))
    return sizes


def _check_manifest(ckpt: Checkpoint, out: list[Problem], max_bytes: int, *, hashes: bool = True) -> None:
    """The files and tensors against ``reshard.json`` (``hashes``: the files' checksums too)."""
    man = ckpt.manifest
    if man is None:
        return
    root = _manifest_root(ckpt)
    where = str(root / "reshard.json")
    files = man.get("files")
    if files is not None and not isinstance(files, dict):
        out.append(_problem("manifest", f'{where}: "files" is not an object', path=where))
        files = None
    if files is not None:
        # 256 KiB reads: a fresh 8 MiB buffer a 64 MiB piece (first-touched) doubled the time
        chunk = max(4096, min(256 << 10, max_bytes // 2))
        for name, info in files.items():
            _check_listed_file(root, where, name, info, chunk, out, hashes=hashes)
        for f in ckpt.files:
            p = Path(f)
            if p.parent == root and p.name not in files:
                msg = f"{p}: part of the checkpoint but not listed in reshard.json"
                out.append(_problem("unlisted-file", msg, path=str(p)))
    tensors = man.get("tensors")
    if isinstance(tensors, dict):  # format version 1 lists them
        _check_listed_tensors(ckpt, where, tensors, out)
    count = man.get("tensor_count")  # version 2 counts them (the files describe them)
    held = len(ckpt.tensors) + man.get(LEFT_OUT, 0)  # type: ignore[operator]
    if count is not None and count != held:
        msg = f"{where}: says the checkpoint holds {count!r} tensors, but the files hold {held}"
        out.append(_problem("manifest", msg, path=where))


def _check_listed_file(
    root: Path, where: str, name: str, info: object, chunk: int, out: list[Problem], *, hashes: bool = True
) -> None:
    """One file of ``reshard.json``: present, of its size, with its checksum."""
    path = root / name
    if not isinstance(info, dict) or "/" in name or "\\" in name or name.startswith("."):
        out.append(_problem("manifest", f"{where}: invalid entry for file {name!r}", path=where))
        return
    if not path.is_file():
        msg = f"{path}: listed in reshard.json but missing. Copy it back from the source or convert again."
        out.append(_problem("missing-file", msg, path=str(path)))
        return
    size = path.stat().st_size
    want = info.get("size")
    if isinstance(want, int) and want != size:
        msg = f"{path}: {size} bytes, but reshard.json says {want}; the file is truncated or was replaced"
        out.append(_problem("size", msg, path=str(path), expected=want, actual=size))
        return
    cs = info.get("checksum")
    if cs is None or not hashes:
        return
    if not isinstance(cs, str) or not cs.startswith(CHECKSUM_PREFIX):
        msg = f"{where}: checksum {cs!r} of {name} is not {CHECKSUM_PREFIX}<hex>"
        out.append(_problem("manifest", msg, path=where))
        return
    actual = file_checksum(path, chunk=chunk)
    if actual != cs:
        msg = (
            f"{path}: checksum {actual} does not match {cs} in reshard.json; "
            "the file's bytes changed since it was written"
        )
        out.append(_problem("checksum", msg, path=str(path), expected=cs, actual=actual))


def _check_listed_tensors(
    ckpt: Checkpoint, where: str, tensors: dict[str, object], out: list[Problem]
) -> None:
    """The tensors of ``reshard.json`` against the files': same names, dtypes and shapes."""
    for name in sorted(set(tensors) - set(ckpt.tensors), key=natural_key):
        msg = f'{where}: tensor "{name}" is listed but no file holds it'
        out.append(_problem("manifest", msg, path=where, tensor=name))
    for name in sorted(set(ckpt.tensors) - set(tensors), key=natural_key):
        msg = f'{where}: tensor "{name}" is in the files but not listed'
        out.append(_problem("manifest", msg, path=where, tensor=name))
    for name, info in tensors.items():
        t = ckpt.tensors.get(name)
        if t is None or not isinstance(info, dict):
            continue
        if "dtype" in info and info["dtype"] != t.dtype:
            msg = f'{where}: tensor "{name}" is {info["dtype"]}, but the files hold {t.dtype}'
            out.append(_problem("manifest", msg, path=where, tensor=name))
        if "shape" in info and info["shape"] != list(t.shape):
            msg = f'{where}: tensor "{name}" has shape {info["shape"]}, but the files give {list(t.shape)}'
            out.append(_problem("manifest", msg, path=where, tensor=name))


def _check_bounds(
    ckpt: Checkpoint,
    t: TensorSource,
    g: _Geometry,
    sizes: Sequence[int | None],
    out: list[Problem],
) -> bool:
    """Report pieces whose bytes are not all in their file; True when every piece is readable."""
    isz = DTYPE_SIZES.get(t.dtype)
    if isz is None:
        out.append(_problem("bounds", f'tensor "{t.name}": unknown dtype {t.dtype}', tensor=t.name))
        return False
    ok = True
    for k, (fi, off) in enumerate(zip(t.piece_files, t.piece_offsets, strict=True)):
        size = sizes[fi]
        if size is None:
            ok = False
            continue
        stop = off + g.numels[k] * isz
        if off < 0 or stop > size:
            ok = False
            f = ckpt.shown_file(fi, off)
            out.append(
                _problem(
                    "bounds",
                    f'{f}: tensor "{t.name}" bytes [{off}, {stop}) run past the end of the file '
                    f"({size} bytes); the file is truncated",
                    path=f,
                    tensor=t.name,
                )
            )
    return ok


def _check_tensor(
    ckpt: Checkpoint,
    t: TensorSource,
    g: _Geometry,
    sizes: Sequence[int | None],
    data: _Data,
    out: list[Problem],
) -> None:
    if g.outside:
        for k, d in g.outside:
            f = ckpt.shown_file(t.piece_files[k], t.piece_offsets[k])
            what = f"dim {d}" if d >= 0 else f"{len(t.piece_blocks[k])} dims"
            msg = f'{f}: tensor "{t.name}" holds indices outside the global shape {list(t.shape)} ({what})'
            out.append(_problem("outside", msg, path=f, tensor=t.name))
        return
    readable = _check_bounds(ckpt, t, g, sizes, out)
    for grp in g.groups:
        _report_holes(t, grp, len(g.groups) > 1, out)
    if not readable:
        return
    for grp in g.groups:
        _report_replicas(ckpt, t, g, grp, data, out)
        _report_overlaps(ckpt, t, grp, data, out)
    if t.piece_crc32 is not None:
        _report_crc32(ckpt, t, g, data, out)


def _report_holes(t: TensorSource, grp: _Group, several: bool, out: list[Problem]) -> None:
    q = f'tensor "{t.name}"'
    gtxt = f" in partial group {grp.gid}" if several else ""
    for box in grp.holes[:MAX_REGIONS]:
        msg = (
            f"{q} (shape {list(t.shape)}): region {format_box(box)}{gtxt} is in no piece "
            f"({_volume(box)} elements). A rank file or shard is missing, or the layout is wrong."
        )
        out.append(_problem("hole", msg, tensor=t.name, region=box))
    rest = grp.holes[MAX_REGIONS:]
    if rest:
        msg = f"{q}: {len(rest)} more hole region(s){gtxt} ({sum(_volume(b) for b in rest)} elements)"
        out.append(_problem("hole", msg, tensor=t.name))


def _report_replicas(
    ckpt: Checkpoint, t: TensorSource, g: _Geometry, grp: _Group, data: _Data, out: list[Problem]
) -> None:
    isz = DTYPE_SIZES[t.dtype]
    for r, k in grp.replicas:
        idx = data.replica(t, r, k, g.numels[r] * isz)
        if idx is None:
            continue
        fr, fk = (ckpt.shown_file(t.piece_files[x], t.piece_offsets[x]) for x in (r, k))
        box = tuple(_interval_at(il, x) for il, x in zip(t.piece_blocks[r], idx, strict=True))
        msg = (
            f'tensor "{t.name}": replicas of region {format_box(box)} differ: {Path(fk).name} and '
            f"{Path(fr).name} hold different bytes, first at index {idx}"
        )
        out.append(_problem("replica", msg, path=fk, tensor=t.name, region=box, index=idx, other=fr))


def _report_overlaps(ckpt: Checkpoint, t: TensorSource, grp: _Group, data: _Data, out: list[Problem]) -> None:
    for i, j, segs in grp.overlaps:
        idx = data.overlap(t, i, j, segs)
        if idx is None:
            continue
        fi, fj = (ckpt.shown_file(t.piece_files[x], t.piece_offsets[x]) for x in (i, j))
        box = tuple(
            _interval_at(_overlap_list(t.piece_blocks[j][d], s), x)
            for d, (s, x) in enumerate(zip(segs, idx, strict=True))
        )
        msg = (
            f'tensor "{t.name}": overlapping pieces disagree on region {format_box(box)}: {Path(fj).name} '
            f"and {Path(fi).name} hold different bytes, first at index {idx}"
        )
        out.append(_problem("overlap", msg, path=fj, tensor=t.name, region=box, index=idx, other=fi))


def _report_crc32(ckpt: Checkpoint, t: TensorSource, g: _Geometry, data: _Data, out: list[Problem]) -> None:
    """Pieces whose stored bytes do not have the CRC32 the format recorded for them."""
    assert t.piece_crc32 is not None
    isz = DTYPE_SIZES[t.dtype]
    # zipped, not indexed: a DCP reader's offsets and CRC32s are views of columns
    for k, (want, fi, at) in enumerate(zip(t.piece_crc32, t.piece_files, t.piece_offsets)):
        if want is None:
            continue
        got = data.crc32(fi, at, g.numels[k] * isz)
        if got != want:
            f = ckpt.shown_file(fi, at)
            msg = (
                f'{f}: tensor "{t.name}" piece {format_box(_hull(t.piece_blocks[k]))}: CRC32 {got:08x} '
                f"does not match the recorded {want:08x}; the file's bytes changed since it was written"
            )
            out.append(
                _problem("crc32", msg, path=f, tensor=t.name, expected=f"{want:08x}", actual=f"{got:08x}")
            )


def _hull(block: Block) -> Box:
    return tuple(Interval(il[0].start, il[-1].stop) if il else Interval(0, 0) for il in block)


def _overlap_list(ilist: IndexList, segs: tuple[Segment, ...]) -> IndexList:
    """Global indices of ``ilist`` at the segments' destination positions."""
    out: list[Interval] = []
    for _, dst, size in segs:
        out.extend(select(ilist, dst, dst + size))
    return normalize(sorted(out))


def check_metadata(ckpt: Checkpoint) -> list[Problem]:
    """The checks of :func:`check_checkpoint` that read no tensor data: files present and of
    the sizes ``reshard.json`` lists, its tensors' names, dtypes and shapes those the files
    hold, every piece inside its file. ``convert`` refuses a source with any of these."""
    out: list[Problem] = []
    sizes = _check_files(ckpt, out)
    _check_manifest(ckpt, out, DEFAULT_MAX_BYTES, hashes=False)
    if _bounds_hold(ckpt, sizes):
        return out
    cache: dict[tuple[Hashable, ...], _Geometry] = {}
    for t in ckpt.tensors.values():
        key = (t.signature, t.shape, t.piece_partials)
        g = cache.get(key)
        if g is None:
            g = cache[key] = _geometry(t)
        _check_bounds(ckpt, t, g, sizes, out)
    return out


_BOUNDS_CHUNK = 16384
"""Tensors whose piece offsets :func:`_bounds_hold` holds as one array (bounded scratch memory)."""


def _bounds_hold(ckpt: Checkpoint, sizes: Sequence[int | None]) -> bool:
    """Whether every piece of every tensor lies inside its file, tested per geometry on arrays of
    offsets (a 100k-tensor checkpoint: no Python loop over its pieces). False when some piece
    does not, or when this cannot tell (a file missing, an unknown dtype, a piece outside its
    tensor): :func:`check_metadata` then looks at each tensor and names the problems."""
    import numpy as np  # lazy: only checks load it

    if any(size is None for size in sizes):
        return False
    groups: dict[tuple[int, int, str, tuple[int, ...]], list[TensorSource]] = {}
    for i, t in enumerate(ckpt.tensors.values()):  # a reader's tensors of one geometry share blocks and files
        key = (id(t.piece_blocks), id(t.piece_files), t.dtype, t.shape)
        members = groups.get(key)
        if members is None:
            if len(groups) > 64 + i // 16:  # tuples of their own (DCP chunks): arrays would not pay
                return False
            members = groups[key] = []
        members.append(t)  # the first member holds the objects the key names (their ids stay theirs)
    for members in groups.values():
        first = members[0]
        isz = DTYPE_SIZES.get(first.dtype)
        k = len(first.piece_blocks)
        if isz is None or _outside(first) or len(first.piece_files) != k:
            return False
        if k == 0:
            continue
        # the last offset each piece may start at: its file's size less its bytes
        limits = np.array([sizes[fi] for fi in first.piece_files], dtype=np.int64)
        limits -= np.array([block_volume(b) * isz for b in first.piece_blocks], dtype=np.int64)
        for lo in range(0, len(members), _BOUNDS_CHUNK):
            part = members[lo : lo + _BOUNDS_CHUNK]
            values = chain.from_iterable(map(attrgetter("piece_offsets"), part))
            try:
                offs = np.fromiter(values, np.int64, count=len(part) * k).reshape(len(part), k)
            except (OverflowError, ValueError):  # offsets past int64, or fewer than one per piece
                return False
            if next(values, None) is not None or not ((offs >= 0).all() and (offs <= limits).all()):
                return False
    return True


def source_hashes(ckpt: Checkpoint, hold: int) -> ReadHashes:
    """The hashes ``convert`` checks the source's bytes against as it reads them.

    A file its ``reshard.json`` lists with a checksum is checked whole (its 64 MiB
    pieces); in other files, each piece with a CRC32 its format recorded (DCP chunks,
    ``torch.save`` records). ``hold``: bytes of spans read ahead of a hash that may
    be kept aside (:class:`~reshard.io.readhash.ReadHashes`).
    """
    man = ckpt.manifest
    listed = man.get("files") if man is not None else None
    root = _manifest_root(ckpt)
    files: dict[int, tuple[str, Sequence[Region] | CrcRegions, str | None]] = {}
    for fi, f in enumerate(ckpt.files):
        p = Path(f)
        info = listed.get(p.name) if isinstance(listed, dict) and p.parent == root else None
        cs = info.get("checksum") if isinstance(info, dict) else None
        if isinstance(cs, str) and cs.startswith(CHECKSUM_PREFIX):
            files[fi] = (f, xxh3_regions(os.stat(f).st_size), cs)

    def describe(name: str, k: int) -> str:
        return f'tensor "{name}" piece {format_box(_hull(ckpt.tensors[name].piece_blocks[k]))}'

    # per file: (start, stop, crc, tensor, piece) of each piece, as columns; pieces at one start
    # (none, in a sound file): the last one's, as a dict by start would keep
    crcs: dict[int, list[list[Any]]] = {}
    counts: dict[int, tuple[tuple[Block, ...], list[int]]] = {}  # items per piece, by blocks (shared)
    for t in ckpt.tensors.values():
        if t.piece_crc32 is None:
            continue
        isz = DTYPE_SIZES[t.dtype]
        blocks = t.piece_blocks
        hit = counts.get(id(blocks))
        if hit is None or hit[0] is not blocks:
            hit = counts[id(blocks)] = (blocks, [block_volume(b) for b in blocks])
        numels = hit[1]
        for k, (want, fi, start) in enumerate(zip(t.piece_crc32, t.piece_files, t.piece_offsets)):
            if want is not None and fi not in files:
                cols = crcs.get(fi)
                if cols is None:
                    cols = crcs[fi] = [[], [], [], [], []]
                cols[0].append(start)
                cols[1].append(start + numels[k] * isz)
                cols[2].append(want)
                cols[3].append(t.name)
                cols[4].append(k)
    for fi, cols in crcs.items():
        starts = cols[0]
        order = sorted(range(len(starts)), key=starts.__getitem__)
        regions = CrcRegions(describe)
        for j, i in enumerate(order):
            if j + 1 < len(order) and starts[order[j + 1]] == starts[i]:
                continue
            regions.append(starts[i], cols[1][i], cols[2][i], cols[3][i], cols[4][i])
        del cols[:], order
        files[fi] = (ckpt.files[fi], regions, None)
    return ReadHashes(files, hold, _first_pieces(ckpt, set(files) - set(crcs)))


def _first_pieces(ckpt: Checkpoint, files: set[int]) -> dict[int, int]:
    """Where the first piece of each of ``files`` starts: the copy reads nothing before it."""
    first: dict[int, int] = {}
    if files:
        for t in ckpt.tensors.values():
            for fi, start in zip(t.piece_files, t.piece_offsets):
                if fi in files and start < first.get(fi, start + 1):
                    first[fi] = start
    return first


def check_checkpoint(ckpt: Checkpoint, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Problem]:
    """Prove a checkpoint whole; returns its problems (empty when it is whole).

    Args:
        ckpt: the opened checkpoint (headers were validated when it was opened).
        max_bytes: bound on the comparison buffers, in bytes.

    Returns:
        One dict per problem with keys ``kind``, ``message``, ``path`` (the file, or
        None), ``tensor`` (or None) and ``region`` (a global box ``[[start, stop], ...]``,
        or None); value problems (``replica``, ``overlap``) also carry ``index`` (the
        first differing global index) and ``other`` (the file compared with).
    """
    out: list[Problem] = []
    for w in ckpt.warnings:
        if w.problem:
            out.append(_problem("warning", w.message, path=w.path, tensor=w.tensor))
    _make_spooled(ckpt, out)
    sizes = _check_files(ckpt, out)
    _check_manifest(ckpt, out, max_bytes)
    cache: dict[tuple[Hashable, ...], _Geometry] = {}
    data = _Data(ckpt, max_bytes)
    try:
        for name in natural_sorted(_suspects(ckpt, sizes, cache, data, max_bytes)):
            t = ckpt.tensors[name]
            key = (t.signature, t.shape, t.piece_partials)
            g = cache.get(key)
            if g is None:
                g = _geometry(t)
                cache[key] = g
            _check_tensor(ckpt, t, g, sizes, data, out)
    finally:
        data.close()
    return out


def _make_spooled(ckpt: Checkpoint, out: list[Problem]) -> None:
    """Make every spooled piece of ``ckpt``'s tensors, empty ones too (a reader's spool makes
    them when first read, and the checks below read only some): each made from stored bytes
    that fail their CRC32 (a zstd chunk's, a transposed view's record) is a ``crc32`` problem.

    Raises:
        ReshardError: a piece cannot be made (a damaged zstd stream, a bad inner archive).
    """
    spools = {fi: sp.spool for fi, sp in ckpt.spooled.items() if sp.spool is not None}
    if not spools:
        return
    for t in ckpt.tensors.values():
        if not spools.keys() & set(t.piece_files):
            continue
        isz = DTYPE_SIZES[t.dtype]
        for k, (fi, at) in enumerate(zip(t.piece_files, t.piece_offsets, strict=True)):
            spool = spools.get(fi)
            if spool is None:
                continue
            try:
                spool.ensure_piece(at, block_volume(t.piece_blocks[k]) * isz)
            except SpoolCheckError as e:
                out.append(_problem("crc32", e.message, path=e.path, tensor=e.tensor))


def _suspects(
    ckpt: Checkpoint,
    sizes: Sequence[int | None],
    cache: dict[tuple[Hashable, ...], _Geometry],
    data: _Data,
    max_bytes: int,
) -> set[str]:
    """The tensors :func:`_check_tensor` must see: those of a geometry with pieces outside the
    tensor, holes or overlaps, and those :func:`reshard.bulkcheck.suspects` does not prove
    whole (the others have no problem for it to report)."""
    names: set[str] = set()
    clean: list[tuple[list[TensorSource], Geometry]] = []
    for ts, g in _by_geometry(ckpt, cache):
        bulk = _bulk_geometry(g)
        if bulk is None:
            names.update(x.name for x in ts)
        else:
            clean.append((ts, bulk))
    cap = max(1, min(_BATCH, max_bytes // 8))
    names.update(t.name for t in suspects(clean, sizes, data.files.sources, cap))
    return names


def _bulk_geometry(g: _Geometry) -> Geometry | None:
    """``g`` as :func:`reshard.bulkcheck.suspects` takes it (element counts, replica pairs), or
    None when it is not clean (pieces outside the tensor, holes or overlaps)."""
    if g.outside or any(grp.holes or grp.overlaps for grp in g.groups):
        return None
    return g.numels, tuple(p for grp in g.groups for p in grp.replicas)


def _by_geometry(
    ckpt: Checkpoint, cache: dict[tuple[Hashable, ...], _Geometry]
) -> list[tuple[list[TensorSource], _Geometry]]:
    """``ckpt``'s tensors grouped by geometry (signature, shape and partial groups)."""
    # readers share a signature object between the tensors of a geometry: found by id; others
    # (a new tuple per tensor) by value, without an entry a tensor
    by_id: dict[tuple[int, tuple[int, ...], tuple[int, ...] | None], list[TensorSource]] = {}
    by_value: dict[tuple[Hashable, ...], list[TensorSource]] = {}
    for t in ckpt.tensors.values():
        same = by_id.get((id(t.signature), t.shape, t.piece_partials))
        if same is None:
            value = (t.signature, t.shape, t.piece_partials)
            same = by_value.get(value)
            if same is None:
                same = by_id[(id(t.signature), t.shape, t.piece_partials)] = by_value[value] = []
        same.append(t)
    out = []
    for key, ts in by_value.items():
        g = cache.get(key)
        if g is None:
            g = cache[key] = _geometry(ts[0])
        out.append((ts, g))
    return out


def replica_problems(ckpt: Checkpoint, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Problem]:
    """The ``replica`` problems of :func:`check_checkpoint` alone: pieces holding the same block
    of a tensor (a ``Replicate`` placement's copies) whose bytes differ, each with its first
    differing global index and both files.

    What ``verify`` adds to its comparison, which reads one copy: a checkpoint whose copies
    disagree does not hold one value. Geometries with holes or overlaps are left to the
    comparison (it refuses holes) and to ``inspect --check``; missing or short files too.
    """
    if max(map(len, map(_BLOCKS, ckpt.tensors.values())), default=0) < 2:
        return []  # a piece a tensor (a consolidated checkpoint): no copies, no grouping of 100k tensors
    sizes: list[int | None] = _check_files(ckpt, [])
    cache: dict[tuple[Hashable, ...], _Geometry] = {}
    clean: list[tuple[list[TensorSource], Geometry]] = []
    for ts, g in _by_geometry(ckpt, cache):
        bulk = _bulk_geometry(g)
        if bulk is not None and bulk[1]:  # clean, with replicas
            clean.append((ts, bulk))
    out: list[Problem] = []
    if not clean:
        return out
    data = _Data(ckpt, max_bytes)
    try:
        cap = max(1, min(_BATCH, max_bytes // 8))
        found = suspects(clean, sizes, data.files.sources, cap)
        for t in sorted(found, key=lambda t: natural_key(t.name)):
            g = cache[(t.signature, t.shape, t.piece_partials)]
            if not _check_bounds(ckpt, t, g, sizes, []):
                continue
            for grp in g.groups:
                _report_replicas(ckpt, t, g, grp, data, out)
    finally:
        data.close()
    return out


_BLOCKS = attrgetter("piece_blocks")

_BATCH = 4 << 20
"""Bytes of replicas compared at once (:class:`reshard.compare.Batch`: two buffers, a window)."""


def checks_made(ckpt: Checkpoint) -> list[str]:
    """What a clean :func:`check_checkpoint` of ``ckpt`` proved, in words: never a check not made.

    Coverage always; equal replicas only when some tensor has replicas; checksums only
    when ``reshard.json`` lists them or the format records piece CRC32s, else the
    reason there were none (``inspect --check`` prints this after ``check: ok``).
    """
    said = ["full coverage"]
    blocks = {id(t.piece_blocks): t.piece_blocks for t in ckpt.tensors.values()}  # one per geometry
    if any(len(set(b)) < len(b) for b in blocks.values()):
        said.append("replicas equal")
    files = ckpt.manifest.get("files") if ckpt.manifest is not None else None
    listed = isinstance(files, dict) and any(
        isinstance(i, dict) and isinstance(i.get("checksum"), str) for i in files.values()
    )
    crcs = any(
        t.piece_crc32 is not None and any(c is not None for c in t.piece_crc32) for t in ckpt.tensors.values()
    )
    if listed:
        said.append("checksums in reshard.json match")
    if crcs:
        said.append("stored CRC32s match")
    if not listed and not crcs:
        why = "reshard.json absent" if ckpt.manifest is None else "reshard.json lists none"
        said.append(f"no checksums recorded ({why})")
    return said
