"""Run under ``torchrun --nproc-per-node 4``: DTensors on a (fsdp=2, tp=2) mesh -> save_dtensors.

``python -m torch.distributed.run --standalone --nproc-per-node 4 save_world.py OUT``

Every rank builds the same full tensors (:func:`full_tensors`, fixed seed), distributes
them with ``distribute_tensor(..., src_data_rank=None)`` (each rank keeps its own
slice, no communication) and calls :func:`reshard.save_dtensors` into ``OUT/ckpt``.
The state dict also holds a Partial DTensor (rank fsdp=0 holds the value, fsdp=1
zeros, so the sum is exact), a DTensor on the 1-D ``fsdp`` sub-mesh (as FSDP2 leaves
non-TP parameters) and a plain tensor. The parent test checks the directory with
``reshard inspect --check`` and consolidates it against :func:`expected`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

WORLD = 4
MESH_SHAPE = (2, 2)
MESH_NAMES = ("fsdp", "tp")


def full_tensors() -> dict[str, Any]:
    """The logical tensors (identical on every rank and in the parent)."""
    import torch

    g = torch.Generator().manual_seed(2024)
    return {
        "a.uneven_s0": torch.randn(7, 3, generator=g),  # [S(0), R]: fsdp rows 4 + 3
        "a.nested_s0": torch.randn(5, 2, generator=g),  # [S(0), S(0)]: rows 2,1 | 1,1
        "b.s1": torch.randn(4, 5, generator=g).to(torch.bfloat16),  # [R, S(1)]: cols 3 + 2
        "c.rep": torch.randn(3, 5, generator=g).to(torch.float16),  # [R, R]
        "d.fsdp_tp": torch.randn(8, 4, generator=g),  # [_S(0, 2), S(0)]: FSDP2 over TP
        "e.2d_int": torch.arange(30, dtype=torch.int64).reshape(6, 5) * 7 - 3,  # [S(0), S(1)]
        "f.bool": torch.tensor([True, False, True, True, False]),  # [R, S(0)]: 3 + 2
        "g.partial": torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5,  # [P(sum), S(1)]
        "h.fsdp_only": torch.randn(6, 2, generator=g),  # on mesh["fsdp"]: S(0)
        "step": torch.tensor(41.0, dtype=torch.float64),  # a plain tensor: R
    }


def placements() -> dict[str, list[Any]]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "a.uneven_s0": [Shard(0), Replicate()],
        "a.nested_s0": [Shard(0), Shard(0)],
        "b.s1": [Replicate(), Shard(1)],
        "c.rep": [Replicate(), Replicate()],
        "d.fsdp_tp": [_StridedShard(0, split_factor=2), Shard(0)],
        "e.2d_int": [Shard(0), Shard(1)],
        "f.bool": [Replicate(), Shard(0)],
        "g.partial": [Partial("sum"), Shard(1)],
    }


def main(out: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from reshard import save_dtensors

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    full = full_tensors()
    state: dict[str, Any] = {}
    for name, pls in placements().items():
        if name == "g.partial":
            # Partial cannot be distributed; build it: fsdp=0 holds the value, fsdp=1 zeros
            col = distribute_tensor(full[name], mesh["tp"], [Shard(1)], src_data_rank=None).to_local()
            local = col if mesh.get_coordinate()[0] == 0 else torch.zeros_like(col)
            state[name] = DTensor.from_local(local, mesh, pls, run_check=False,
                                             shape=full[name].shape, stride=full[name].stride())
        else:
            state[name] = distribute_tensor(full[name], mesh, pls, src_data_rank=None)
    state["h.fsdp_only"] = distribute_tensor(full["h.fsdp_only"], mesh["fsdp"], [Shard(0)],
                                             src_data_rank=None)
    state["step"] = full["step"]
    save_dtensors(state, out / "ckpt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
