"""Run under ``torchrun --nproc-per-node 2``: a veRL FSDP2 checkpoint of a transformers Llama.

``python -m torch.distributed.run --standalone --nproc-per-node 2 save_verl_llama.py OUT``

Writes what veRL's ``FSDPCheckpointManager.save_checkpoint`` writes for FSDP2
(``verl/utils/checkpoint/fsdp_checkpoint_manager.py``): in ``OUT/ckpt``,
``model_world_size_2_rank_{r}.pt`` (``model.state_dict()`` of the ``fully_shard``-ed model:
``Shard(0)`` DTensors, the tied ``lm_head.weight`` under its own name),
``optim_world_size_2_rank_{r}.pt``, ``extra_state_world_size_2_rank_{r}.pt``,
``fsdp_config.json`` and ``huggingface/`` (the model's config and generation config, no
weights). ``OUT/orig`` is ``save_pretrained`` of the same model before sharding (the oracle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORLD = 2


def main(out: Path) -> int:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ckpt = out / "ckpt"
    if rank == 0:
        model.save_pretrained(out / "orig")
        model.config.save_pretrained(ckpt / "huggingface")
        model.generation_config.save_pretrained(ckpt / "huggingface")
        (ckpt / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}))
    dist.barrier()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.save(model.state_dict(), ckpt / f"model_world_size_{WORLD}_rank_{rank}.pt")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.save(opt.state_dict(), ckpt / f"optim_world_size_{WORLD}_rank_{rank}.pt")
    torch.save({"rng": torch.get_rng_state()}, ckpt / f"extra_state_world_size_{WORLD}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(Path(sys.argv[1])))
