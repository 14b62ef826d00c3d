"""Write DCP safetensors checkpoints with torch's own HuggingFaceStorageWriter, in a gloo world.

Run as a script (``python save_world.py OUT``): forks 4 CPU processes on a
``(dp=2, tp=2)`` mesh. Every rank builds the same full tensors (fixed seed),
distributes them with ``distribute_tensor`` and saves them with
``torch.distributed.checkpoint.save(..., storage_writer=HuggingFaceStorageWriter(
..., save_distributed=True))``. Outputs under OUT:

- ``ckpt/``: the main checkpoint, one file per rank.
- ``ckpt_multi/``: the same state dict split over two files per rank
  (``fqn_to_index_mapping``).
- ``fused/``: a _StridedShard(0, sf=2) tensor whose local rows are not contiguous
  in the global tensor, saved with a planner that skips torch's global-plan
  validation (the default planner refuses it; what it says is in result.json).
- ``full.pt`` (full tensors), ``local-{rank}.pt`` (each rank's local tensors,
  ``to_local()``), ``result.json`` (per rank: what happened).

Run as a subprocess of the tests, so the forked ranks start from a plain
interpreter (not pytest's, with its warning filters and importlib machinery).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

WORLD = 4
MESH_SHAPE = (2, 2)
MESH_NAMES = ("dp", "tp")


def full_tensors() -> dict[str, Any]:
    """The logical tensors of the main checkpoint (identical on every rank)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return {
        "w.uneven": torch.randn(5, 3, generator=g),  # [R, S(0)]: tp rows 3 + 2
        "w.nested_empty": torch.randn(3, 4, generator=g),  # [S(0), S(0)]: rows 1,1,1,0
        "w.shard1": torch.randn(4, 6, generator=g).to(torch.bfloat16),  # [R, S(1)]
        "w.rep": torch.randn(3, 5, generator=g),  # [R, R]
        "w.2d": torch.randn(6, 8, generator=g),  # [S(0), S(1)]
        "w.fsdp_tp": torch.randn(8, 4, generator=g),  # [_S(0, 2), S(0)]: FSDP2 over TP
        "w.int": torch.arange(10, dtype=torch.int64) * 3 - 7,  # [S(0), R]
        "w.f16_3d": torch.randn(2, 3, 4, generator=g).to(torch.float16),  # [S(2), S(0)]
        "step": torch.tensor(17.5, dtype=torch.float64),  # plain tensor, 0-d
    }


def placements() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "w.uneven": [Replicate(), Shard(0)],
        "w.nested_empty": [Shard(0), Shard(0)],
        "w.shard1": [Replicate(), Shard(1)],
        "w.rep": [Replicate(), Replicate()],
        "w.2d": [Shard(0), Shard(1)],
        "w.fsdp_tp": [_StridedShard(0, split_factor=2), Shard(0)],
        "w.int": [Shard(0), Replicate()],
        "w.f16_3d": [Shard(2), Shard(0)],
    }


def _no_validation_planner() -> Any:
    """A save planner without torch's global-plan validation, so torch's writer
    stores what ``DefaultSavePlanner`` would reject."""
    import dataclasses

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import (
        DefaultSavePlanner,
        create_default_global_save_plan,
    )

    class NoValidationPlanner(DefaultSavePlanner):
        def _create_global_plan(self, all_plans: Any) -> Any:
            global_plan, metadata = create_default_global_save_plan(dedup_save_plans(all_plans))
            merged: dict[str, Any] = {}
            for p in global_plan:
                merged.update(p.planner_data or {})
            return global_plan, dataclasses.replace(metadata, planner_data=merged)

    return NoValidationPlanner()


def worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    root = Path(out)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=WORLD
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
        full = full_tensors()
        pls = placements()
        sd: dict[str, Any] = {}
        for name, t in full.items():
            if name in pls:
                sd[name] = distribute_tensor(t, mesh, pls[name], src_data_rank=None)
            else:
                sd[name] = t.clone()
        torch.save(
            {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in sd.items()},
            root / f"local-{rank}.pt",
        )
        if rank == 0:
            torch.save(full, root / "full.pt")
        dcp.save(
            sd, storage_writer=HuggingFaceStorageWriter(str(root / "ckpt"), save_distributed=True)
        )

        mapping = {name: 1 + (i % 2) for i, name in enumerate(sorted(full))}
        dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(
                str(root / "ckpt_multi"), fqn_to_index_mapping=mapping, save_distributed=True
            ),
        )

        fused_full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
        fused = {
            "fused": distribute_tensor(
                fused_full,
                mesh,
                [Replicate(), _StridedShard(0, split_factor=2)],
                src_data_rank=None,
            )
        }
        if rank == 0:
            torch.save({"fused": fused_full}, root / "fused_full.pt")
        result["fused_local_shape"] = list(fused["fused"].to_local().shape)
        try:
            dcp.save(
                fused,
                storage_writer=HuggingFaceStorageWriter(
                    str(root / "fused_refused"), save_distributed=True
                ),
            )
            result["fused_default_planner"] = "saved"
        except CheckpointException as e:  # a BaseException, raised on every rank
            result["fused_default_planner"] = str(e)
        dcp.save(
            fused,
            storage_writer=HuggingFaceStorageWriter(str(root / "fused"), save_distributed=True),
            planner=_no_validation_planner(),
        )
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
        raise
    finally:
        (root / f"result-{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # import everything the workers use once, then fork (CPU only, no CUDA state):
    # four spawned interpreters each importing torch cost seconds on a small CI box
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.multiprocessing as mp

    out = Path(argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(worker, args=(str(out),), nprocs=WORLD, join=True, start_method="fork")
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(WORLD)]
    (out / "result.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
