"""Run under ``torchrun --nproc-per-node 2``: ``save_dtensors`` of a state dict whose DTensor is on the
meta device on rank 1 only (a model rank 1 built on meta and never materialized).

``python -m torch.distributed.run --standalone --nproc-per-node 2 save_meta.py OUT``

Every rank must raise a ReshardError (no rank left waiting at a collective, no torch error); each
writes its message to ``OUT/rank{r}.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from reshard import save_dtensors
from reshard.errors import ReshardError


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    device = "meta" if rank == 1 else "cpu"
    state = {
        "b": distribute_tensor(torch.ones(4), mesh, [Shard(0)]),
        "w": distribute_tensor(torch.empty(4, 6, device=device), mesh, [Shard(0)], src_data_rank=None),
    }
    try:
        save_dtensors(state, out / "ckpt")
        message = "saved"
    except ReshardError as e:
        message = f"{type(e).__name__}: {e.message}"
    (out / f"rank{rank}.txt").write_text(message)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
