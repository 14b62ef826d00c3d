"""Worker for tests/dist/test_rt_transforms.py: a torchtitan-named training checkpoint saved by torch.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/dist/rt_transforms_worker.py OUT FAMILY=HF_DIR...

FAMILY is llama or qwen3. For each model, every rank reads the Hugging Face model ``HF_DIR``
(written by ``save_pretrained``), turns it into torchtitan's state dict with torchtitan's own
``from_hf`` (tests/unit/test_transform_profiles.py runs the installed adapter source),
``distribute_tensor``s every tensor on a (fsdp=2, tp=2) gloo mesh as FSDP over TP shards it
(column-parallel: ``_StridedShard(0, sf=2)`` on fsdp, ``Shard(0)`` on tp; row-parallel: ``Shard(0)``,
``Shard(1)``; stacked experts: ``Shard(0)`` on fsdp, ``Shard(1)`` on tp; norms ``Shard(0)`` on fsdp),
saves it with ``torch.distributed.checkpoint.save`` to ``OUT/NAME/dcp`` (NAME: HF_DIR's name), and
each rank's ``to_local()`` of every tensor to ``OUT/NAME/local/rank-{r:05d}-of-00004.safetensors``.
Importing this module has no side effects.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _save(family: str, src: Path, out: Path, mesh: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from tests.unit.test_transform_profiles import torchtitan_llama3_adapter, torchtitan_qwen3_adapter

    cfg = json.loads((src / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings"))
    if family == "llama":
        adapter = torchtitan_llama3_adapter(cfg, tied=tied)
        adapter.model_config.layers[0].attention.head_dim = cfg.get("head_dim")
    else:
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        adapter = torchtitan_qwen3_adapter({**cfg, "num_experts": experts}, (), tied=tied)
    full = adapter.from_hf(load_file(str(src / "model.safetensors")))
    state = {}
    for name, t in full.items():
        if ".inner_experts." in name:
            pl: tuple[Any, ...] = (Shard(0), Shard(1))
        elif name.endswith(("wo.weight", "w2.weight")):  # row-parallel
            pl = (Shard(0), Shard(1))
        elif t.dim() == 2:  # column-parallel: wq/wk/wv, w1/w3, router gate, tok_embeddings, lm_head
            pl = (_StridedShard(0, split_factor=2), Shard(0))
        else:  # norms
            pl = (Shard(0), Replicate())
        state[name] = distribute_tensor(t.contiguous(), mesh, list(pl))
    dcp.save(state, checkpoint_id=str(out / "dcp"))
    r, w = dist.get_rank(), dist.get_world_size()
    (out / "local").mkdir(parents=True, exist_ok=True)
    local = {n: t.to_local().contiguous() for n, t in state.items()}
    save_file(local, str(out / "local" / f"rank-{r:05d}-of-{w:05d}.safetensors"))


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = Path(argv[0])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    for job in argv[1:]:
        family, _, src = job.partition("=")
        _save(family, Path(src), out / Path(src).name, mesh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
