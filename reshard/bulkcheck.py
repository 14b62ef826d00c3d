"""Which tensors ``inspect --check`` must look at one by one: the others are proved whole here,
a geometry at a time.

:func:`reshard.check.check_checkpoint` reports every problem of a tensor with its per-tensor
code (messages, regions, first differing indices); running it on each of 100k tensors cost
more than reading their bytes. Here the tensors of one *clean* geometry (no piece outside the
tensor, no hole, no overlapping pieces: what the geometry alone says) are checked with array
arithmetic: every piece's bytes inside its file, and each replica's bytes equal to those of
the piece it copies (:class:`~reshard.compare.Batch`). A tensor that fails any of these, or
that this module does not check (a dtype without a size, recorded CRC32s, a replica larger
than a batch), is a *suspect*: the caller runs its per-tensor checks on it, which find and
word its problems. A tensor that passes has none, so the result is the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from .checkpoint import TensorSource
from .compare import Batch, Group
from .dtypes import DTYPE_SIZES
from .io.pages import SourceFiles

__all__ = ["Geometry", "suspects"]

Geometry = tuple[tuple[int, ...], tuple[tuple[int, int], ...]]
"""A clean geometry: the element count of each piece, and its replica pairs ``(first, copy)``."""

_DTYPE = attrgetter("dtype")
_CRC32 = attrgetter("piece_crc32")
_OFFSETS = attrgetter("piece_offsets")
_FILES = attrgetter("piece_files")


def suspects(
    groups: Sequence[tuple[Sequence[TensorSource], Geometry]],
    sizes: Sequence[int | None],
    sources: SourceFiles,
    cap: int,
) -> list[TensorSource]:
    """The tensors of ``groups`` (each a list of tensors of one clean geometry) that need the
    per-tensor checks, possibly more than once; ``sizes``: the files' sizes (None: missing);
    ``cap``: bytes of replicas compared at once (two buffers of it and a window of twice that)."""
    import numpy as np

    out: list[TensorSource] = []
    size = np.array([-1 if s is None else s for s in sizes], np.int64)
    batch = _Replicas(Batch((sources, sources), cap), out)
    for group, (numels, pairs) in groups:
        for c in range(0, len(group), _CHUNK):
            _chunk(group[c : c + _CHUNK], numels, pairs, size, batch, out)
    batch.flush()
    return out


_CHUNK = 1 << 13
"""Tensors checked at once: arrays of their pieces' offsets stay small (200k tensors' at once
took 40 MiB)."""


def _chunk(
    tensors: Sequence[TensorSource],
    numels: tuple[int, ...],
    pairs: tuple[tuple[int, int], ...],
    size: Any,
    batch: _Replicas,
    out: list[TensorSource],
) -> None:
    """:func:`suspects` of some tensors of one geometry."""
    import numpy as np

    crcs = list(map(_CRC32, tensors))
    if crcs.count(None) != len(crcs):  # CRC32s are checked one tensor at a time
        out += [t for t, c in zip(tensors, crcs, strict=True) if c is not None]
        tensors = [t for t, c in zip(tensors, crcs, strict=True) if c is None]
    dtypes = list(map(_DTYPE, tensors))
    for dtype in dict.fromkeys(dtypes):
        ts = tensors if dtypes.count(dtype) == len(dtypes) else [t for t in tensors if t.dtype == dtype]
        isz = DTYPE_SIZES.get(dtype)
        if isz is None or not ts or not numels:
            out += ts if isz is None else []
            continue
        ok = _in_bounds(ts, np.array(numels, np.int64) * isz, size)
        if not ok.all():
            out += [t for t, good in zip(ts, ok.tolist(), strict=True) if not good]
            ts = [t for t, good in zip(ts, ok.tolist(), strict=True) if good]
        for r, k in pairs:
            batch.add(r, k, numels[r] * isz, ts)


def _in_bounds(ts: Sequence[TensorSource], nbytes: Any, size: Any) -> Any:
    """Per tensor, whether every piece's bytes lie inside its file (of a known size); all
    False when the arrays cannot say (offsets past int64, a piece count or file index that
    does not fit): the per-tensor checks then look."""
    import numpy as np

    t, p = len(ts), len(nbytes)
    ol, fl = list(map(_OFFSETS, ts)), list(map(_FILES, ts))
    if sum(map(len, ol)) != t * p or sum(map(len, fl)) != t * p:
        return np.zeros(t, bool)
    try:
        offs = np.fromiter(itertools.chain.from_iterable(ol), np.int64, t * p).reshape(t, p)
        if fl.count(fl[0]) == t:  # readers share one tuple between a file's tensors
            files = np.broadcast_to(np.array(fl[0], np.int64), (t, p))
        else:
            files = np.fromiter(itertools.chain.from_iterable(fl), np.int64, t * p).reshape(t, p)
    except OverflowError:
        return np.zeros(t, bool)
    if t and (files.min() < 0 or files.max() >= len(size)):
        return np.zeros(t, bool)
    have = size[files]
    return ((offs >= 0) & (have >= 0) & (offs <= have - nbytes)).all(axis=1)


class _Replicas:
    """Replica pairs queued into batches; the tensors of the pairs that differ go to ``out``."""

    def __init__(self, batch: Batch, out: list[TensorSource]) -> None:
        self.batch, self.out = batch, out
        self.groups: list[Group] = []
        self.tensors: list[Sequence[TensorSource]] = []
        self.used = 0

    def add(self, r: int, k: int, nbytes: int, ts: Sequence[TensorSource]) -> None:
        """Compare piece ``k`` of each tensor of ``ts`` with its piece ``r`` (``nbytes`` each)."""
        import numpy as np

        if nbytes > self.batch.cap:  # compared in chunks, tensor by tensor
            self.out += ts
            return
        runs = (((0, r, 0, nbytes, 1, 0, 0),), ((0, k, 0, nbytes, 1, 0, 0),))
        i = 0
        while i < len(ts):
            room = (self.batch.cap - self.used) // nbytes
            if not room:
                self.flush()
                continue
            take = ts[i : i + room]
            at = self.used + nbytes * np.arange(len(take), dtype=np.int64)
            self.groups.append(Group(runs, nbytes, (take, take), at))
            self.tensors.append(take)
            self.used += nbytes * len(take)
            i += len(take)

    def flush(self) -> None:
        if self.groups:
            self.out += [self.tensors[g][j] for g, j in self.batch.compare(self.groups)]
        self.groups, self.tensors, self.used = [], [], 0
