"""Many small regions of two sources compared a batch at a time, with array arithmetic.

``verify`` (the tensors of two checkpoints) and ``inspect --check`` (the replicas of
one) compare up to hundreds of thousands of small items, where numpy calls per item
cost more than the bytes (~100 us a tensor). :meth:`Batch.compare` takes items laid
end to end in two buffers, one a side, in :class:`Group` s: the items of a group share
their :data:`~reshard.io.reader.Run` tuples (which rows of which piece land where in
the item) and differ only in where their pieces lie, so their piece offsets are arrays.

1. A side's source bytes are read by one ``pread`` per *cluster* (the span of a file the
   items' pieces cover, gaps of up to :data:`GAP` included) into a window buffer, or
   straight into the side's buffer when its items lie back to back in one file in the
   buffer's order (a consolidated file).
2. Each run of a group is moved from the window as a few strided numpy copies: the
   items are cut into progressions, where the steps between consecutive items'
   positions (in the window and in the buffer) stay the same, taking every second,
   third or fourth item when groups alternate (an expert's gate and up between downs).
3. The two buffers are compared eight bytes at a time; the items holding a differing
   byte are handed back.

Nothing here says *how* items differ: an item handed back is compared again by the
caller's own per-item code (which finds its first difference); an item not handed back
held the same bytes on both sides. Buffers are allocated once and reused (memory
touched for the first time is slow on the VMs we measured on).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from .checkpoint import TensorSource
from .io.pages import SourceFiles
from .io.reader import Run

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Ints = npt.NDArray[np.int64]
else:
    Ints = Any

__all__ = ["GAP", "Batch", "Group", "batches"]

GAP = 4096
"""Bytes of a file between two spans of a batch that are read too, to make one ``pread``."""

_PERIODS = 4
"""A group's items are tried as up to this many interleaved progressions (every p-th item)."""

_UINTS = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}

_OFFSETS = attrgetter("piece_offsets")
_FILES = attrgetter("piece_files")


@dataclass(frozen=True, slots=True)
class Group:
    """Items of one geometry in a batch: item ``i`` is ``size`` bytes at ``at[i]`` in each
    side's buffer, made on side ``s`` of ``runs[s]`` (their piece numbers are those of
    ``srcs[s][i]``; every source of a group has as many pieces)."""

    runs: tuple[Sequence[Run], Sequence[Run]]
    size: int
    srcs: tuple[Sequence[TensorSource], Sequence[TensorSource]]
    at: Ints


_Arrays = tuple["Ints", tuple["Ints", "Ints"], tuple["Ints", "Ints"]]
"""A group's item positions (T,), and per side its items' piece files and offsets (T, pieces)."""

_Job = tuple[Sequence[Run], "Ints", "Ints", "Ints"]
"""A group's runs on one side, with their files, file offsets and buffer positions (T, runs)."""


def batches(sizes: Sequence[int] | Ints, cap: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges of items of ``sizes`` holding at most ``cap`` bytes
    each, filled greedily (an item larger than ``cap`` alone)."""
    import numpy as np

    ends = np.cumsum(np.asarray(sizes, np.int64))
    out = []
    start, done = 0, 0
    while start < len(ends):
        stop = max(start + 1, int(np.searchsorted(ends, done + cap, side="right")))
        out.append((start, stop))
        start, done = stop, int(ends[stop - 1])
    return out


class Batch:
    """Compares items of two sources a batch at a time (see the module docstring).

    Args:
        sources: the files of side 0 and of side 1 (the same object for one checkpoint).
        cap: bytes of items one :meth:`compare` takes (each side's buffer); the window the
            source spans are read into holds up to twice that.
    """

    def __init__(self, sources: tuple[SourceFiles, SourceFiles], cap: int) -> None:
        self.sources = sources
        self.cap = max(1, cap)
        self._bufs: tuple[bytearray, bytearray] | None = None
        self._mask = bytearray(0)
        self._window = bytearray(0)

    def compare(self, groups: Sequence[Group]) -> list[tuple[int, int]]:
        """Compare items that lie end to end from position 0, at most :attr:`cap` bytes in all.

        Returns:
            ``(group, item)`` of each item that holds a differing byte, or whose source
            spans alone do not fit the window, by position: the caller compares them alone.
        """
        if self._bufs is None:
            self._bufs = (bytearray(self.cap), bytearray(self.cap))
            self._mask = bytearray(self.cap // 8 + 1)
        arrays = [_arrays(g) for g in groups]
        ends = [int(a[0].max()) + g.size for g, a in zip(groups, arrays, strict=True) if len(a[0])]
        hi = max(ends, default=0)
        assert hi <= self.cap, (hi, self.cap)
        out: list[tuple[int, int]] = []
        self._span(groups, arrays, 0, hi, out)
        return out

    def _span(
        self, groups: Sequence[Group], arrays: list[_Arrays], lo: int, hi: int, out: list[tuple[int, int]]
    ) -> None:
        """Compare the items at ``[lo, hi)``; halve the range when its source spans do not fit
        the window (a single item that does not is handed back)."""
        import numpy as np

        sel = [np.flatnonzero((a[0] >= lo) & (a[0] < hi)) for a in arrays]
        starts = np.concatenate([a[0][s] for a, s in zip(arrays, sel, strict=True)])
        if not len(starts):
            return
        assert self._bufs is not None
        if all(self._fill(side, groups, arrays, sel, self._bufs[side]) for side in (0, 1)):
            pos = self._differing(lo, hi)
            if pos is not None:
                out += _items_at(pos, arrays, sel)
        elif len(starts) > 1:
            mid = int(np.sort(starts)[len(starts) // 2])
            self._span(groups, arrays, lo, mid, out)
            self._span(groups, arrays, mid, hi, out)
        else:
            out += [(gi, int(s[0])) for gi, s in enumerate(sel) if len(s)]

    def _differing(self, lo: int, hi: int) -> Ints | None:
        """Positions of the bytes in ``[lo, hi)`` that differ between the two buffers (None: none)."""
        import numpy as np

        assert self._bufs is not None
        ba, bb = self._bufs
        w = (hi - lo) // 8
        va = np.frombuffer(ba, np.uint64, w, lo)
        vb = np.frombuffer(bb, np.uint64, w, lo)
        mask = np.frombuffer(self._mask, np.bool_, w)
        np.not_equal(va, vb, out=mask)
        tail = lo + 8 * w
        if not mask.any() and ba[tail:hi] == bb[tail:hi]:
            return None
        words = np.flatnonzero(mask)
        wa = np.frombuffer(ba, np.uint8, 8 * w, lo).reshape(-1, 8)[words]
        wb = np.frombuffer(bb, np.uint8, 8 * w, lo).reshape(-1, 8)[words]
        row, col = np.nonzero(wa != wb)
        ta = np.frombuffer(ba, np.uint8, hi - tail, tail)
        tb = np.frombuffer(bb, np.uint8, hi - tail, tail)
        return np.concatenate((lo + words[row] * 8 + col, tail + np.flatnonzero(ta != tb)))

    def _fill(
        self, side: int, groups: Sequence[Group], arrays: list[_Arrays], sel: list[Ints], buf: bytearray
    ) -> bool:
        """Put side ``side``'s bytes of the selected items in ``buf``; False if its source
        spans do not fit the window."""
        import numpy as np

        jobs: list[_Job] = []
        for g, (at, files, offs), s in zip(groups, arrays, sel, strict=True):
            if not len(s):
                continue
            runs = g.runs[side]
            ks = [r[1] for r in runs]
            f = files[side][s][:, ks]
            x = offs[side][s][:, ks] + np.array([r[2] for r in runs], np.int64)
            y = at[s][:, None] + np.array([r[0] for r in runs], np.int64)
            jobs.append((runs, f, x, y))
        f_all = np.concatenate([f.ravel() for _, f, _, _ in jobs])
        x_all = np.concatenate([x.ravel() for _, _, x, _ in jobs])
        n_all = np.concatenate(
            [
                np.broadcast_to(np.array([(r[4] - 1) * r[5] + r[3] for r in runs], np.int64), x.shape).ravel()
                for runs, _, x, _ in jobs
            ]
        )
        sources = self.sources[side]
        if self._direct(jobs, f_all, x_all, n_all, sources, buf):
            return True
        # clusters: the spans of a file at most GAP apart, on one axis (file, offset)
        stride = max(sources.size(fi) for fi in np.unique(f_all).tolist()) + 2 * GAP + 1
        key = f_all * stride + x_all
        order = np.argsort(key, kind="stable")
        klo = key[order]
        khi = np.maximum.accumulate(klo + n_all[order])
        new = np.flatnonzero(klo[1:] > khi[:-1] + GAP) + 1
        starts = np.concatenate(([0], new))
        ends = np.concatenate((new, [len(klo)])) - 1
        c_lo = klo[starts]
        sizes = khi[ends] - c_lo
        c_file = c_lo // stride
        lo, hi = int((c_lo % stride).min()), int((khi[ends] % stride).max())
        if (
            len(np.unique(c_file)) == len(c_lo) > 1
            and len(c_lo) * (hi - lo) <= 2 * self.cap
            and all(sources.size(fi) >= hi for fi in c_file.tolist())
        ):
            # one cluster a file: read each file's bytes [lo, hi), so that the same offset of
            # sibling files (rank files) is a fixed step apart in the window
            c_lo, sizes = c_file * stride + lo, np.full_like(sizes, hi - lo)
        total = int(sizes.sum())
        if total > 2 * self.cap:
            return False
        if len(self._window) < total:
            self._window = bytearray(max(total, min(2 * self.cap, 2 * len(self._window))))
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        view = memoryview(self._window)
        for b, c, z in zip(base.tolist(), c_lo.tolist(), sizes.tolist(), strict=True):
            fi, off = divmod(c, stride)
            sources.pread(fi, view[b : b + z], off)
        cid = np.repeat(np.arange(len(starts)), ends - starts + 1)
        win = np.empty_like(x_all)
        win[order] = base[cid] + klo - c_lo[cid]
        done = 0
        for runs, _, x, y in jobs:
            _move(runs, win[done : done + x.size].reshape(x.shape), y, self._window, buf)
            done += x.size
        return True

    def _direct(
        self, jobs: list[_Job], f_all: Ints, x_all: Ints, n_all: Ints, sources: SourceFiles, buf: bytearray
    ) -> bool:
        """Read the side with one ``pread`` into ``buf`` when its runs lie back to back in one
        file in the buffer's order (a consolidated file, whole tensors of a rank file)."""
        import numpy as np

        if any(r[4] != 1 for runs, *_ in jobs for r in runs) or f_all.min() != f_all.max():
            return False
        y_all = np.concatenate([y.ravel() for _, _, _, y in jobs])
        order = np.argsort(y_all, kind="stable")
        ys, xs, ns = y_all[order], x_all[order], n_all[order]
        if not np.array_equal(ys[1:], ys[:-1] + ns[:-1]) or not np.all(xs - ys == xs[0] - ys[0]):
            return False
        y0, total = int(ys[0]), int(ys[-1] + ns[-1] - ys[0])
        sources.pread(int(f_all[0]), memoryview(buf)[y0 : y0 + total], int(xs[0]))
        return True


def _items_at(pos: Ints, arrays: list[_Arrays], sel: list[Ints]) -> list[tuple[int, int]]:
    """``(group, item)`` of the selected items holding the byte positions ``pos``, by position."""
    import numpy as np

    starts = np.concatenate([a[0][s] for a, s in zip(arrays, sel, strict=True)])
    gidx = np.concatenate([np.full(len(s), gi) for gi, s in enumerate(sel)])
    iidx = np.concatenate(sel)
    order = np.argsort(starts, kind="stable")
    k = np.unique(np.searchsorted(starts[order], pos, side="right") - 1)
    return list(zip(gidx[order[k]].tolist(), iidx[order[k]].tolist(), strict=True))


def _arrays(g: Group) -> _Arrays:
    """A group's item positions, and per side its items' piece files and offsets."""
    import numpy as np

    at = np.asarray(g.at, np.int64)
    t = len(at)
    files = []
    offs = []
    for side in (0, 1):
        srcs = g.srcs[side]
        p = len(srcs[0].piece_offsets) if t else 0
        ol = list(map(_OFFSETS, srcs))
        assert sum(map(len, ol)) == t * p  # one geometry: as many pieces each
        o = np.fromiter(itertools.chain.from_iterable(ol), np.int64, t * p)
        fl = list(map(_FILES, srcs))
        if t and fl.count(fl[0]) == t:  # readers share one tuple between a file's tensors
            f = np.broadcast_to(np.array(fl[0], np.int64), (t, p))
        else:
            f = np.fromiter(itertools.chain.from_iterable(fl), np.int64, t * p).reshape(t, p)
        files.append(f)
        offs.append(o.reshape(t, p))
    return at, (files[0], files[1]), (offs[0], offs[1])


def _move(runs: Sequence[Run], win: Ints, pos: Ints, window: bytearray, buf: bytearray) -> None:
    """Copy run ``j`` of item ``i`` from ``win[i, j]`` in ``window`` to ``pos[i, j]`` in
    ``buf``, one strided copy per progression (and run, unless the runs are alike and a fixed
    step apart on both sides: the pieces of sibling rank files, then one copy for all)."""
    import numpy as np

    n, rows, ss, ds = runs[0][3:]
    across = None  # (runs, step in the window, step in the buffer)
    if len(runs) > 1 and all(r[3:] == (n, rows, ss, ds) for r in runs):
        sx, sy = win[:, 1:] - win[:, :-1], pos[:, 1:] - pos[:, :-1]
        if (sx == sx[0, 0]).all() and (sy == sy[0, 0]).all():
            across = (len(runs), int(sx[0, 0]), int(sy[0, 0]))
            win, pos, runs = win[:, :1], pos[:, :1], runs[:1]
    w, p_ = win.tolist(), pos.tolist()
    for i0, cnt, step in _progressions(win, pos):
        i1 = i0 + step
        for j, (_, _, _, n, rows, ss, ds) in enumerate(runs):
            x0, y0 = w[i0][j], p_[i0][j]
            dx, dy = (w[i1][j] - x0, p_[i1][j] - y0) if cnt > 1 else (0, 0)
            g = n | x0 | y0 | dx | dy | ((ss | ds) if rows > 1 else 0)
            if across is not None:
                g |= across[1] | across[2]
            isz = min(8, g & -g) if g else 8  # the widest items every offset and stride allows
            shape, s_st, d_st = [cnt], [dx], [dy]
            if across is not None:
                shape.append(across[0])
                s_st.append(across[1])
                d_st.append(across[2])
            if rows > 1:
                shape.append(rows)
                s_st.append(ss)
                d_st.append(ds)
            if n > isz or rows == 1:
                shape.append(n // isz)
                s_st.append(isz)
                d_st.append(isz)
            dt = _UINTS[isz]
            np.ndarray(tuple(shape), dt, buf, y0, tuple(d_st))[...] = np.ndarray(
                tuple(shape), dt, window, x0, tuple(s_st)
            )


def _progressions(x: Ints, y: Ints) -> list[tuple[int, int, int]]:
    """Cut items ``0..T-1`` (rows of ``x`` and ``y``) into progressions ``(first, count, step)``:
    items ``first, first + step, ...`` whose rows differ by the same amounts from one to the
    next. An item at the edge of two progressions may be in both (copied twice: the same
    bytes). Tried for every ``p``-th item, p = 1.. :data:`_PERIODS`: the fewest progressions."""
    import numpy as np

    t = x.shape[0]
    if t <= 2:
        return [(0, t, 1)]
    best: tuple[int, Any] | None = None
    for p in range(1, min(_PERIODS, t // 2) + 1):
        dx, dy = x[p:] - x[:-p], y[p:] - y[:-p]  # each item's step to the next of its class
        new = np.flatnonzero(((dx[p:] != dx[:-p]) | (dy[p:] != dy[:-p])).any(axis=1)) + p
        if best is None or p + len(new) < best[0] + len(best[1]):
            best = (p, new)  # item new[i] ends a progression of its class and starts the next
        if len(best[1]) + best[0] <= 2 * p:
            break
    assert best is not None
    p, new = best
    starts = np.concatenate((np.arange(p), new))
    starts = starts[np.lexsort((starts, starts % p))]  # by class, then position
    last = t - 1 - (t - 1 - np.arange(p)) % p  # the last item of each class
    ends = last[starts % p]
    follow = np.flatnonzero(starts[1:] % p == starts[:-1] % p)
    ends[follow] = starts[follow + 1]
    return list(zip(starts.tolist(), ((ends - starts) // p + 1).tolist(), itertools.repeat(p)))
