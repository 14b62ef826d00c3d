"""The torchrun path: share a conversion's output files among ranks; live DTensors.

Nothing here imports torch unless the process runs under torchrun
(``WORLD_SIZE`` > 1) or the live-DTensor API is called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["Coordinator", "coordinator", "share_by_bytes"]

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


class _TorchrunCoordinator(Coordinator):
    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self._dist = dist
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
