"""Run under ``torchrun --nproc-per-node 3``: Partial DTensors of small integer and bool dtypes, per
rank ``torch.save``d, and what torch 2.13 makes of them (``full_tensor()``), the oracle.

``python -m torch.distributed.run --standalone --nproc-per-node 3 save_partial_ints.py OUT``

- ``OUT/sums/rank_{r}.pt``: ``P(sum)`` of int8 (wrapping past 127), uint8 (past 255), int32, bool
  (torch: a logical or), ``P(max)``/``P(min)`` of int8; ``OUT/sums.safetensors``: their
  ``full_tensor()``;
- ``OUT/avg/rank_{r}.pt``: ``P(avg)`` of an int32 and a float32 DTensor; ``OUT/avg.json``: the error
  torch's ``full_tensor()`` of each integer one raised (torch refuses integer averages).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

VALUES = {0: [7, -7, 100, 127, -128, 5], 1: [0, 0, 100, 127, -128, -6], 2: [0, 0, 100, 1, -1, 0]}


def main(out: Path) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    v = torch.tensor(VALUES[rank], dtype=torch.int64)
    locals_ = {
        "sums": {
            "i8_sum": (v.to(torch.int8), "sum"),
            "u8_sum": (v.abs().to(torch.uint8), "sum"),
            "i32_sum": (v.to(torch.int32), "sum"),
            "bool_sum": (v > 0, "sum"),
            "i8_max": (v.to(torch.int8), "max"),
            "i8_min": (v.to(torch.int8), "min"),
        },
        "avg": {"i32_avg": (v.to(torch.int32), "avg"), "f32_avg": (v.to(torch.float32), "avg")},
    }
    for case, tensors in locals_.items():
        state = {n: DTensor.from_local(t, mesh, [Partial(op)], run_check=False) for n, (t, op) in tensors.items()}
        (out / case).mkdir(parents=True, exist_ok=True)
        torch.save(state, out / case / f"rank_{rank}.pt")
        full, errors = {}, {}
        for n, d in state.items():
            try:
                full[n] = d.full_tensor().contiguous()
            except RuntimeError as e:
                errors[n] = str(e)
        if rank == 0:
            save_file(full, str(out / f"{case}.safetensors"))
            (out / f"{case}.json").write_text(json.dumps(errors))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
