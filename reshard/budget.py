"""How ``--workers`` and ``--max-memory`` turn into buffers, and the peak memory a plan will use (pure).

The arithmetic (``--max-memory M`` with ``W`` workers; each worker's share ``S = M / W``):

* a write buffer ``B = S / 32``, kept between 4 KiB and 256 KiB (writes of 64-256 KiB
  are the fastest into the page cache);
* a row cache of ``8 B`` (strided source spans read whole, see :mod:`reshard.io.reader`);
* a window of mapped source pages released every ``S - 9 B`` bytes read through the
  maps, at most 8 MiB (``verify``, ``inspect --check``; ``convert`` maps nothing and
  holds that many bytes of source spans aside for source verification instead,
  :mod:`reshard.io.readhash`).

So the buffers and the window together stay within ``M`` once ``M / W >= 36 KiB``
(below that the 4 KiB floor of ``B`` wins). Not counted in ``M``, and added by
:func:`memory_estimate`: the interpreter (~36 MiB), torch when casting or reducing
(~224 MiB), one more buffer ``B`` per extra Partial group and for a cast's output,
the largest output header per worker, a 13.25 MiB scratch per worker for short reads
(windows of the source files, :data:`reshard.io.reader.SCRATCH`), and the pages of
one strided box read through a map before its window is released (at most one slab:
``B`` bytes of items, but whole pages of each source row).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .io.reader import DENSE, SCRATCH
from .plan import Plan

__all__ = [
    "DEFAULT_BUFFER",
    "RELEASE_EVERY",
    "BASELINE_RSS",
    "TORCH_RSS",
    "Budget",
    "default_workers",
    "budget_for",
    "memory_estimate",
    "DEFAULT_MAX_BYTES",
]

DEFAULT_MAX_BYTES = 64 << 20
"""Default bound on the comparison buffers of ``verify`` and ``inspect --check``, in bytes."""

DEFAULT_BUFFER = 256 * 1024
"""Largest write buffer: 2 MiB writes were ten times slower than 256 KiB on this kernel."""

MIN_BUFFER = 4096

RELEASE_EVERY = 8 * 1024 * 1024
"""Largest window of mapped source pages a worker holds before releasing them."""

BASELINE_RSS = 36 * 1024 * 1024
"""Resident memory of the interpreter with reshard, numpy, yaml and rich imported (measured: 34 MiB)."""

TORCH_RSS = 224 * 1024 * 1024
"""What ``import torch`` adds; paid only by casts and Partial reductions (measured)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Per worker: the write buffer size and the mapped-page release window, in bytes."""

    workers: int
    buffer: int = DEFAULT_BUFFER
    window: int = RELEASE_EVERY


def default_workers() -> int:
    """Writer threads when ``--workers`` is not given: one per core, at most 4.

    Page-cache copies scale across cores here (two threads copy 1.8 GB in 0.48 s
    against 0.72 s for one); more than 4 only adds buffers.
    """
    return max(1, min(4, os.cpu_count() or 1))


def budget_for(max_memory: int, workers: int) -> Budget:
    """Buffers for a ``--max-memory`` budget shared by ``workers`` (see the module docstring)."""
    n = max(1, workers)
    share = max_memory // n
    buffer = max(MIN_BUFFER, min(DEFAULT_BUFFER, share // 32))
    window = max(0, min(RELEASE_EVERY, share - (1 + DENSE) * buffer))
    return Budget(n, buffer, window)


COLUMN_WRITES = 4
"""The column path gathers this many write buffers of entries at a time (fewer numpy calls per
byte) and writes them a buffer per ``pwrite`` (larger writes were slower here)."""


def memory_estimate(plan: Plan, budget: Budget) -> int:
    """Peak resident memory a conversion of ``plan`` will use, in bytes.

    Interpreter baseline, plus per worker: one slab buffer per Partial group (plus a
    cast output), the row cache, the column path's buffer (:data:`COLUMN_WRITES` buffers),
    mapped source pages up to the release window, the scratch of short reads
    (``io.reader.SCRATCH``, 13.25 MiB) and the largest output header.
    """
    groups = max((t.groups for t in plan.tensors), default=1)
    casts = any(t.dtype != t.src.dtype for t in plan.tensors) or groups > 1
    buffers = groups + (1 if casts else 0) + DENSE + COLUMN_WRITES
    per_worker = budget.buffer * buffers + budget.window + SCRATCH
    header = max((sum(len(b) for _, b in f.layout.fixed) for f in plan.files), default=0)
    n = max(1, budget.workers)  # spare workers split a file's entries, so all of them run
    return BASELINE_RSS + (TORCH_RSS if casts else 0) + n * (per_worker + header)
