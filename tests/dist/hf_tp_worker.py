"""Worker for tests/dist/test_hf_tp_plans.py: transformers' own tensor/expert parallelism, under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/hf_tp_worker.py tp OUT MODEL_DIR...
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/hf_tp_worker.py ep OUT MODEL_DIR...

Each rank loads every model directory with ``AutoModelForCausalLM.from_pretrained`` and a
``DistributedConfig`` (gloo on CPU; transformers initialises the process group itself):
``tp``: ``tp_plan="auto"`` (the model class's ``base_model_tp_plan``), ``tp_size`` = world;
``ep``: the same plus ``ep_size`` = world (``base_model_ep_plan``: experts ``Shard(0)``).
It then saves, for every entry of ``model.state_dict()``, ``to_local()`` of a DTensor (a plain
tensor as is) to ``OUT/{mode}/{dir name}/rank-{r:05d}-of-{W:05d}.safetensors``, and the
placements to ``placements.json`` (rank 0). Importing this module has no side effects.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _save(model_dir: Path, mode: str, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    ep = {"ep_size": world} if mode == "ep" else {}
    cfg = DistributedConfig(tp_plan="auto", tp_size=world, **ep)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), distributed_config=cfg)
    local: dict[str, torch.Tensor] = {}
    placements: dict[str, list[str]] = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            placements[name] = [str(p) for p in t.placements]
            t = t.to_local()
        else:
            placements[name] = ["Replicate()"]
        local[name] = t.detach().contiguous().clone()
    dst = out / mode / model_dir.name
    dst.mkdir(parents=True, exist_ok=True)
    save_file(local, str(dst / f"rank-{rank:05d}-of-{world:05d}.safetensors"))
    if rank == 0:
        (dst / "placements.json").write_text(json.dumps(placements, indent=1, sort_keys=True))


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    mode, out, dirs = argv[0], Path(argv[1]), [Path(d) for d in argv[2:]]
    for d in dirs:
        _save(d, mode, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
