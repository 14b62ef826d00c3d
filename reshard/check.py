"""Prove a checkpoint whole: coverage, equal replicas and overlaps, byte ranges, checksums.

``check_checkpoint`` backs ``reshard inspect --check``. It reports problems
instead of raising, so one run lists everything wrong:

* ``warning``: a reader warning marked as a data problem (text starting ``"problem: "``);
* ``missing-file``, ``size``, ``checksum``, ``unlisted-file``, ``manifest``: the
  files against ``reshard.json`` (sizes, ``xxh3_128`` checksums, tensor dtypes and shapes);
* ``bounds``: a piece's bytes lie outside its file; ``outside``: a piece's
  indices lie outside its tensor's global shape;
* ``hole``: a global region no piece holds (per Partial group);
* ``crc``: a piece whose bytes do not match the CRC32 its format stores (DCP chunks);
* ``replica``: pieces holding the same block that differ byte for byte;
  ``overlap``: pieces holding different but overlapping blocks that differ on
  the overlap.

Coverage is interval arithmetic, once per piece geometry (tensors of the same
:attr:`~reshard.checkpoint.TensorSource.signature` share it), never element by
element. Data is compared through memory maps in chunks of at most
``max_bytes``, and the pages read are released as we go.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint, TensorSource
from .execute import CHECKSUM_PREFIX, file_checksum, slabs
from .intervals import (
    Block,
    Box,
    IndexList,
    Interval,
    Segment,
    block_volume,
    normalize,
    overlap_segments,
    select,
)
from .io.header import DTYPE_SIZES
from .plan import natural_key
from .verify import DEFAULT_MAX_BYTES, MappedFiles, global_index

__all__ = ["check_checkpoint", "coverage_holes", "PROBLEM_PREFIX", "MAX_REGIONS"]

#: A reader warning starting with this text reports a data problem, not just information.
PROBLEM_PREFIX = "problem: "

#: Hole regions reported per tensor and partial group; the rest are summed up in one more problem.
MAX_REGIONS = 8

_CHECKSUM_ALGO = CHECKSUM_PREFIX


def _problem(
    kind: str,
    message: str,
    *,
    path: str | None = None,
    tensor: str | None = None,
    region: Box | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "message": message,
        "path": path,
        "tensor": tensor,
        "region": [[iv.start, iv.stop] for iv in region] if region is not None else None,
        **extra,
    }


def _box_str(box: Box) -> str:
    return "[" + ", ".join(f"{iv.start}:{iv.stop}" for iv in box) + "]"


def _volume(box: Box) -> int:
    n = 1
    for iv in box:
        n *= iv.size
    return n


# --------------------------------------------------------------------------- coverage


def _contains(ilist: IndexList, x: int) -> bool:
    i = bisect_right([iv.start for iv in ilist], x) - 1
    return i >= 0 and x < ilist[i].stop


def coverage_holes(shape: Sequence[int], blocks: Sequence[Block]) -> list[Box]:
    """Disjoint boxes of a tensor of ``shape`` that none of ``blocks`` covers.

    A sweep along each dim in turn: the elementary intervals between the
    blocks' boundaries, merged where the same blocks cover them, recursing into
    the blocks covering each; the recursion is memoized on the set of remaining
    per-dim index lists, so regular layouts cost about one pass over their blocks.

    >>> I = Interval
    >>> coverage_holes((6, 4), [((I(0, 2),), (I(0, 4),)), ((I(4, 6),), (I(0, 4),))])
    [(Interval(start=2, stop=4), Interval(start=0, stop=4))]
    >>> coverage_holes((6, 4), [((I(0, 6),), (I(0, 4),))])
    []
    """
    ndim = len(shape)
    if any(n == 0 for n in shape):
        return []
    memo: dict[tuple[int, frozenset[Block]], list[Box]] = {}

    def rec(d: int, tails: frozenset[Block]) -> list[Box]:
        if d == ndim:
            return [] if tails else [()]
        key = (d, tails)
        hit = memo.get(key)
        if hit is not None:
            return hit
        n = shape[d]
        events: dict[int, list[tuple[Block, int]]] = {0: [], n: []}
        for t in tails:
            for iv in t[0]:
                lo, hi = min(iv.start, n), min(iv.stop, n)
                if lo < hi:
                    events.setdefault(lo, []).append((t[1:], 1))
                    events.setdefault(hi, []).append((t[1:], -1))
        active: dict[Block, int] = {}
        runs: list[tuple[int, int, frozenset[Block]]] = []
        cuts = sorted(events)
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            for tail, step in events[lo]:
                c = active.get(tail, 0) + step
                if c:
                    active[tail] = c
                else:
                    del active[tail]
            cover = frozenset(active)
            if runs and runs[-1][2] == cover:
                runs[-1] = (runs[-1][0], hi, cover)
            else:
                runs.append((lo, hi, cover))
        out: list[Box] = []
        for lo, hi, cover in runs:
            for h in rec(d + 1, cover):
                out.append((Interval(lo, hi),) + h)
        memo[key] = out
        return out

    return rec(0, frozenset(blocks))


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


def _overlapping(blocks: Sequence[Block]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of distinct blocks that share an element (sweep on the best dim)."""
    n = len(blocks)
    if n < 2 or not blocks[0]:
        return []
    ndim = len(blocks[0])
    hull = [[(b[d][0].start, b[d][-1].stop) for d in range(ndim)] for b in blocks]
    d0 = max(range(ndim), key=lambda d: len({h[d][0] for h in hull}))
    order = sorted(range(n), key=lambda i: hull[i][d0])
    pairs: list[tuple[int, int]] = []
    for x, i in enumerate(order):
        stop_i = hull[i][d0][1]
        for j in order[x + 1 :]:
            if hull[j][d0][0] >= stop_i:
                break
            hulls_meet = all(
                hull[i][d][0] < hull[j][d][1] and hull[j][d][0] < hull[i][d][1] for d in range(ndim)
            )
            bi, bj = blocks[i], blocks[j]
            if hulls_meet and all(overlap_segments(bi[d], bj[d]) for d in range(ndim)):
                pairs.append((min(i, j), max(i, j)))
    return sorted(pairs)


def _geometry(t: TensorSource) -> _Geometry:
    outside = []
    for k, blk in enumerate(t.piece_blocks):
        if len(blk) != len(t.shape):
            outside.append((k, -1))
            continue
        for d, (ilist, n) in enumerate(zip(blk, t.shape, strict=True)):
            if ilist and ilist[-1].stop > n:
                outside.append((k, d))
    numels = tuple(block_volume(b) for b in t.piece_blocks) if not outside else ()
    if outside:
        return _Geometry(tuple(outside), (), numels)
    partials = t.piece_partials
    by_group: dict[int, list[int]] = {}
    for k in range(len(t.piece_blocks)):
        by_group.setdefault(partials[k] if partials is not None else 0, []).append(k)
    if not by_group:
        by_group[0] = []
    groups = []
    numel = t.numel
    for gid in sorted(by_group):
        reps: dict[Block, int] = {}
        replicas: list[tuple[int, int]] = []
        for k in by_group[gid]:
            blk = t.piece_blocks[k]
            if numels[k] == 0:
                continue
            r = reps.get(blk)
            if r is None:
                reps[blk] = k
            else:
                replicas.append((r, k))
        distinct = list(reps)
        holes = coverage_holes(t.shape, distinct) if numel else []
        covered = numel - sum(_volume(h) for h in holes)
        overlaps: list[tuple[int, int, tuple[tuple[Segment, ...], ...]]] = []
        if sum(block_volume(b) for b in distinct) > covered:
            # some distinct blocks overlap: find which (a well-formed layout never gets here)
            for i, j in _overlapping(distinct):
                segs = tuple(overlap_segments(a, b) for a, b in zip(distinct[i], distinct[j], strict=True))
                overlaps.append((reps[distinct[i]], reps[distinct[j]], segs))
        groups.append(_Group(gid, tuple(holes), tuple(replicas), tuple(overlaps)))
    return _Geometry((), tuple(groups), numels)


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

    def overlap(
        self, t: TensorSource, i: int, j: int, segs: tuple[tuple[Segment, ...], ...]
    ) -> list[int] | None:
        """First differing global index where pieces ``i`` and ``j`` overlap, or None."""
        from itertools import product

        import numpy as np

        isz = DTYPE_SIZES[t.dtype]
        ai = self.files.array(t, i)
        aj = self.files.array(t, j)
        items = max(1, self.chunk // isz)
        try:
            for combo in product(*segs):
                s_st = [s[0] for s in combo]
                d_st = [s[1] for s in combo]
                sizes = tuple(s[2] for s in combo)
                for slab in slabs(sizes, 1, items):
                    ki = tuple(slice(s + a, s + b) for s, (a, b) in zip(s_st, slab, strict=True))
                    kj = tuple(slice(s + a, s + b) for s, (a, b) in zip(d_st, slab, strict=True))
                    va = ai[ki] if ki else ai[...]
                    vb = aj[kj] if kj else aj[...]
                    self.files.touch(t, i, ki)
                    self.files.touch(t, j, kj)
                    neq = np.not_equal(va, vb)
                    if neq.any():
                        shape = tuple(b - a for a, b in slab)
                        pos = int(np.argmax(neq.reshape(-1)))
                        local = [int(x) for x in np.unravel_index(pos, shape)] if shape else []
                        in_j = [s.start + x for s, x in zip(kj, local, strict=True)]
                        return global_index(t.piece_blocks[j], in_j)
                    del va, vb, neq
        finally:
            del ai, aj
            self.files.release()
        return None


# --------------------------------------------------------------------------- checks


def _manifest_root(ckpt: Checkpoint) -> Path:
    p = Path(ckpt.path)
    return p if p.is_dir() else p.parent


def _check_files(ckpt: Checkpoint, out: list[dict[str, Any]]) -> list[int | None]:
    sizes: list[int | None] = []
    for f in ckpt.files:
        try:
            sizes.append(os.stat(f).st_size)
        except OSError as e:
            sizes.append(None)
            out.append(_problem("missing-file", f"{f}: cannot be read ({e.strerror})", path=f))
    return sizes


def _check_manifest(ckpt: Checkpoint, out: list[dict[str, Any]], max_bytes: int) -> None:
    man = ckpt.manifest
    chunk = max(4096, min(8 << 20, max_bytes // 2))
    if man is None:
        return
    root = _manifest_root(ckpt)
    where = str(root / "reshard.json")
    files = man.get("files")
    if files is not None and not isinstance(files, dict):
        out.append(_problem("manifest", f'{where}: "files" is not an object', path=where))
        files = None
    if files is not None:
        for name, info in files.items():
            path = root / name
            if not isinstance(info, dict) or "/" in name or "\\" in name or name.startswith("."):
                msg = f"{where}: invalid entry for file {name!r}"
                out.append(_problem("manifest", msg, path=where))
                continue
            if not path.is_file():
                out.append(
                    _problem(
                        "missing-file",
                        f"{path}: listed in reshard.json but missing. Copy it back from the source "
                        "or convert again.",
                        path=str(path),
                    )
                )
                continue
            size = path.stat().st_size
            want = info.get("size")
            if isinstance(want, int) and want != size:
                out.append(
                    _problem(
                        "size",
                        f"{path}: {size} bytes, but reshard.json says {want}; the file is truncated "
                        "or was replaced",
                        path=str(path),
                        expected=want,
                        actual=size,
                    )
                )
                continue
            cs = info.get("checksum")
            if cs is None:
                continue
            if not isinstance(cs, str) or not cs.startswith(_CHECKSUM_ALGO):
                out.append(
                    _problem(
                        "manifest",
                        f"{where}: checksum {cs!r} of {name} is not {_CHECKSUM_ALGO}<hex>",
                        path=where,
                    )
                )
                continue
            actual = file_checksum(path, chunk=chunk)
            if actual != cs:
                out.append(
                    _problem(
                        "checksum",
                        f"{path}: checksum {actual} does not match {cs} in reshard.json; "
                        "the file's bytes changed since it was written",
                        path=str(path),
                        expected=cs,
                        actual=actual,
                    )
                )
        for f in ckpt.files:
            p = Path(f)
            if p.parent == root and p.name not in files:
                out.append(
                    _problem(
                        "unlisted-file",
                        f"{p}: part of the checkpoint but not listed in reshard.json",
                        path=str(p),
                    )
                )
    tensors = man.get("tensors")
    if not isinstance(tensors, dict):
        return
    for name in sorted(set(tensors) - set(ckpt.tensors), key=natural_key):
        out.append(
            _problem(
                "manifest",
                f'{where}: tensor "{name}" is listed but no file holds it',
                path=where,
                tensor=name,
            )
        )
    for name in sorted(set(ckpt.tensors) - set(tensors), key=natural_key):
        out.append(
            _problem(
                "manifest",
                f'{where}: tensor "{name}" is in the files but not listed',
                path=where,
                tensor=name,
            )
        )
    for name, info in tensors.items():
        t = ckpt.tensors.get(name)
        if t is None or not isinstance(info, dict):
            continue
        if "dtype" in info and info["dtype"] != t.dtype:
            out.append(
                _problem(
                    "manifest",
                    f'{where}: tensor "{name}" is {info["dtype"]}, but the files hold {t.dtype}',
                    path=where,
                    tensor=name,
                )
            )
        if "shape" in info and info["shape"] != list(t.shape):
            out.append(
                _problem(
                    "manifest",
                    f'{where}: tensor "{name}" has shape {info["shape"]}, but the files give {list(t.shape)}',
                    path=where,
                    tensor=name,
                )
            )


def _check_bounds(
    ckpt: Checkpoint,
    t: TensorSource,
    g: _Geometry,
    sizes: Sequence[int | None],
    out: list[dict[str, Any]],
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
            f = ckpt.files[fi]
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
    out: list[dict[str, Any]],
) -> None:
    q = f'tensor "{t.name}"'
    if g.outside:
        for k, d in g.outside:
            f = ckpt.files[t.piece_files[k]]
            what = f"dim {d}" if d >= 0 else f"{len(t.piece_blocks[k])} dims"
            out.append(
                _problem(
                    "outside",
                    f"{f}: {q} holds indices outside the global shape {list(t.shape)} ({what})",
                    path=f,
                    tensor=t.name,
                )
            )
        return
    readable = _check_bounds(ckpt, t, g, sizes, out)
    several = len(g.groups) > 1
    for grp in g.groups:
        gtxt = f" in partial group {grp.gid}" if several else ""
        for box in grp.holes[:MAX_REGIONS]:
            out.append(
                _problem(
                    "hole",
                    f"{q} (shape {list(t.shape)}): region {_box_str(box)}{gtxt} is in no piece "
                    f"({_volume(box)} elements). A rank file or shard is missing, "
                    "or the layout is wrong.",
                    tensor=t.name,
                    region=box,
                )
            )
        rest = grp.holes[MAX_REGIONS:]
        if rest:
            out.append(
                _problem(
                    "hole",
                    f"{q}: {len(rest)} more hole region(s){gtxt} ({sum(_volume(b) for b in rest)} elements)",
                    tensor=t.name,
                )
            )
    if not readable:
        return
    isz = DTYPE_SIZES[t.dtype]
    if t.piece_crcs is not None:
        _check_crcs(ckpt, t, g, out)
    for grp in g.groups:
        for r, k in grp.replicas:
            idx = data.replica(t, r, k, g.numels[r] * isz)
            if idx is not None:
                fr, fk = ckpt.files[t.piece_files[r]], ckpt.files[t.piece_files[k]]
                blk = t.piece_blocks[r]
                box = tuple(_interval_at(il, x) for il, x in zip(blk, idx, strict=True))
                out.append(
                    _problem(
                        "replica",
                        f"{q}: replicas of region {_box_str(box)} differ: {Path(fk).name} and "
                        f"{Path(fr).name} hold different bytes, first at index {idx}",
                        path=fk,
                        tensor=t.name,
                        region=box,
                        index=idx,
                        other=fr,
                    )
                )
        for i, j, segs in grp.overlaps:
            idx = data.overlap(t, i, j, segs)
            if idx is not None:
                fi, fj = ckpt.files[t.piece_files[i]], ckpt.files[t.piece_files[j]]
                box = tuple(
                    _interval_at(_overlap_list(t.piece_blocks[j][d], s), x)
                    for d, (s, x) in enumerate(zip(segs, idx, strict=True))
                )
                out.append(
                    _problem(
                        "overlap",
                        f"{q}: overlapping pieces disagree on region {_box_str(box)}: {Path(fj).name} "
                        f"and {Path(fi).name} hold different bytes, first at index {idx}",
                        path=fj,
                        tensor=t.name,
                        region=box,
                        index=idx,
                        other=fi,
                    )
                )


def _check_crcs(ckpt: Checkpoint, t: TensorSource, g: _Geometry, out: list[dict[str, Any]]) -> None:
    """Report pieces whose bytes fail the CRC32 the format recorded for them."""
    from .io.torchzip import crc32_range

    assert t.piece_crcs is not None
    isz = DTYPE_SIZES[t.dtype]
    for k, want in enumerate(t.piece_crcs):
        if want is None:
            continue
        f = ckpt.files[t.piece_files[k]]
        off, n = t.piece_offsets[k], g.numels[k] * isz
        fd = os.open(f, os.O_RDONLY)
        try:
            got = crc32_range(fd, off, n, f)
        finally:
            os.close(fd)
        if got != want:
            out.append(
                _problem(
                    "crc",
                    f'{f}: tensor "{t.name}" bytes [{off}, {off + n}) have CRC32 {got:08x}, but the '
                    f"archive records {want:08x}; the file is damaged",
                    path=f,
                    tensor=t.name,
                    expected=f"{want:08x}",
                    actual=f"{got:08x}",
                )
            )


def _overlap_list(ilist: IndexList, segs: tuple[Segment, ...]) -> IndexList:
    """Global indices of ``ilist`` at the segments' destination positions."""
    out: list[Interval] = []
    for _, dst, size in segs:
        out.extend(select(ilist, dst, dst + size))
    return normalize(sorted(out))


def check_checkpoint(ckpt: Checkpoint, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[dict[str, Any]]:
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
    out: list[dict[str, Any]] = []
    for w in ckpt.warnings:
        if w.startswith(PROBLEM_PREFIX):
            out.append(_problem("warning", w[len(PROBLEM_PREFIX) :]))
    sizes = _check_files(ckpt, out)
    _check_manifest(ckpt, out, max_bytes)
    cache: dict[tuple[Any, ...], _Geometry] = {}
    data = _Data(ckpt, max_bytes)
    try:
        for name in sorted(ckpt.tensors, key=natural_key):
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
