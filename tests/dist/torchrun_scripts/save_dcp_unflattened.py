"""Run under ``torchrun --nproc-per-node 2``: ``dcp.save`` with ``DefaultSavePlanner(flatten_state_dict=False)``
of nested dicts holding DTensors, as torch 2.13 stores them.

``python -m torch.distributed.run --standalone --nproc-per-node 2 save_dcp_unflattened.py OUT``

- ``OUT/replicated``: ``{"model": {"w": Replicate DTensor, "plain": tensor}, "top": DTensor S(0)}``;
- ``OUT/sharded``: ``{"model": {"w": Shard(0) DTensor}}``: only one rank's object is stored.

Rank 0 writes ``OUT/<name>.full.pt``: each tensor whole (``full_tensor()``), under the flattened
names, the oracle.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main(out: Path) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)  # the same values on every rank
    w = torch.randn(6, 4, dtype=torch.bfloat16)
    top = torch.arange(10, dtype=torch.int32)
    cases = {
        "replicated": {
            "model": {"w": distribute_tensor(w, mesh, [Replicate()]), "plain": torch.ones(3), "step": 7},
            "top": distribute_tensor(top, mesh, [Shard(0)]),
        },
        "sharded": {"model": {"w": distribute_tensor(w, mesh, [Shard(0)])}},
    }
    full = {
        "replicated": {"model.w": w, "model.plain": torch.ones(3), "top": top},
        "sharded": {"model.w": w},
    }
    for name, state in cases.items():
        dcp.save(state, checkpoint_id=str(out / name), planner=DefaultSavePlanner(flatten_state_dict=False))
        if rank == 0:
            torch.save(full[name], out / f"{name}.full.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
