"""Columns of an output tensor list, for copying 100k small tensors without Python work per tensor.

An output file whose entries come as columns (``entries.columns()``: the tensors, the
rank, and arrays of offsets and sizes, as :mod:`reshard.formats.safetensors` lays them
out) is written by the executor a buffer at a time: the entries of each geometry in the
buffer are moved with a few numpy copies. What it needs per tensor is here, shared by
the sibling files of one tensor list: each tensor's geometry (tensors of one geometry
have the same copies, so the same runs) and, per geometry and source piece, the pieces'
files and offsets as arrays, made once when first asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from .checkpoint import TensorSource
from .dtypes import DTYPE_SIZES
from .io.reader import Run
from .plan import Copy, TargetTensor

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Ints = npt.NDArray[np.int64]
else:
    Ints = Any

__all__ = ["Geometries", "Column"]

EntryRuns = Callable[[TensorSource, tuple[Copy, ...], int], "tuple[Run, ...] | None"]

_SRC, _OFFSETS, _FILES = attrgetter("src"), attrgetter("piece_offsets"), attrgetter("piece_files")

Column = tuple[int | Ints, Ints]
"""One source piece of every tensor of a geometry: its file (one for all, or per tensor) and offset."""


class Geometries:
    """The tensors of one output tensor list, by geometry.

    Attributes:
        tensors: the list (entry ``i`` of each file of it is ``tensors[i]``'s block).
        group: per tensor, its geometry's number (int32).
        row: per tensor, its position among its geometry's tensors (int64).
        members: per geometry, its tensors' positions in the list.
    """

    def __init__(self, tensors: Sequence[TargetTensor], entry_runs: EntryRuns) -> None:
        """``entry_runs``: an entry's copies as runs (:func:`reshard.execute.entry_runs`)."""
        import numpy as np

        self.tensors = tensors
        self._entry_runs = entry_runs
        keys: dict[tuple[object, ...], int] = {}
        group: list[int] = []
        firsts: list[TargetTensor] = []
        for t in tensors:
            src = t.src
            # identities: tensors of one geometry share their copies and piece blocks (the
            # planner's and the reader's caches), which the list holds while this lives
            key = (id(t.copies), id(src.piece_blocks), t.dtype, src.dtype, t.groups)
            g = keys.get(key)
            if g is None:
                g = keys[key] = len(firsts)
                firsts.append(t)
            group.append(g)
        self.firsts = firsts
        self.group = np.array(group, dtype=np.int32)
        order = np.argsort(self.group, kind="stable")
        bounds = np.searchsorted(self.group[order], np.arange(len(firsts) + 1))
        self.members = [order[bounds[g] : bounds[g + 1]] for g in range(len(firsts))]
        self.row = np.empty(len(tensors), dtype=np.int64)
        for m in self.members:
            self.row[m] = np.arange(len(m))
        self._columns: dict[tuple[int, int], Column] = {}
        self._runs: dict[tuple[int, int], tuple[Run, ...] | None] = {}
        self._lock = threading.Lock()

    def runs(self, g: int, rank: int) -> tuple[Run, ...] | None:
        """Geometry ``g``'s runs for target rank ``rank`` (None: its entries are gathered)."""
        key = (g, rank)
        if key not in self._runs:
            t = self.firsts[g]
            src = t.src
            ok = t.groups == 1 and t.dtype == src.dtype
            self._runs[key] = self._entry_runs(src, t.copies[rank], DTYPE_SIZES[src.dtype]) if ok else None
        return self._runs[key]

    def column(self, g: int, k: int) -> Column:
        """Source piece ``k`` of geometry ``g``'s tensors: its file (an int when one for all) and
        offsets, in the order of :attr:`members`."""
        hit = self._columns.get((g, k))
        if hit is not None:
            return hit
        import numpy as np

        m = self.members[g].tolist()
        srcs = list(map(_SRC, map(self.tensors.__getitem__, m)))
        offsets = np.fromiter(map(itemgetter(k), map(_OFFSETS, srcs)), dtype=np.int64, count=len(m))
        files = np.fromiter(map(itemgetter(k), map(_FILES, srcs)), dtype=np.int64, count=len(m))
        fi: int | Ints = int(files[0]) if len(m) and (files == files[0]).all() else files
        with self._lock:
            return self._columns.setdefault((g, k), (fi, offsets))
