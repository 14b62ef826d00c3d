"""Megatron-Core's MoE GPTModel at expert parallelism 2 (two ranks, two of the four experts each):
its own ``dist_checkpointing.load`` of a ``torch_dist`` checkpoint reshard wrote, and its own save
of the EP-2 model, which is what an EP training run writes.

Run as a script: ``python megatron_moe_ep.py OUT.json HF_DIR DIST_DIR EP_DIR [HF_DIR DIST_DIR EP_DIR ...]``
(a 2-rank gloo world, forked, as ``save_megatron_gpt.py`` runs; needs ``megatron-core`` 0.16 and
``transformers``). Per triple, both ranks: build the MoE model of ``HF_DIR/config.json``
(``megatron_moe_forward.build_model``) with ``expert_model_parallel_size=2``, load ``DIST_DIR``
into it, check that each rank's local expert ``k`` holds global expert ``2 * rank + k``'s
``[gate; up]`` and down projection, then save it to ``EP_DIR``. OUT.json gets per HF directory
``{"experts_equal": bool, "ep_dir": what EP_DIR's .metadata says}``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

EP = 2


def one(hf_dir: Path, dist_dir: Path, ep_dir: Path, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron_moe_forward import build_model
    from save_megatron_gpt import describe
    from torch.distributed.checkpoint import FileSystemReader

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=EP)
    mrandom.get_cuda_rng_tracker().reset()
    mrandom.get_cuda_rng_tracker().states_["model-parallel-rng"] = None
    mrandom.get_cuda_rng_tracker().states_["expert-parallel-rng"] = None

    c = transformers.AutoConfig.from_pretrained(hf_dir)
    md = FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata
    model = build_model(c, md["embedding.word_embeddings.weight"].size[0], md)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(dist_dir))
    model.load_state_dict(state, strict=False)
    from safetensors.torch import load_file

    hf = load_file(str(hf_dir / "model.safetensors"))
    mixtral = any(".block_sparse_moe." in k for k in hf)
    sd = model.state_dict()
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    equal = True
    for layer in range(c.num_hidden_layers):
        for k in range(experts // EP):
            e = rank * (experts // EP) + k
            if mixtral:
                p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
                gate, up, down = hf[p + "w1.weight"], hf[p + "w3.weight"], hf[p + "w2.weight"]
            else:
                p = f"model.layers.{layer}.mlp.experts.{e}."
                gate, up, down = (hf[p + f"{x}_proj.weight"] for x in ("gate", "up", "down"))
            q = f"decoder.layers.{layer}.mlp.experts.local_experts.{k}."
            equal &= torch.equal(sd[q + "linear_fc1.weight"], torch.cat([gate, up]))
            equal &= torch.equal(sd[q + "linear_fc2.weight"], down)
    if rank == 0:
        ep_dir.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(ep_dir))
    dist.barrier()
    flags = [None] * EP
    dist.all_gather_object(flags, equal)
    return {"experts_equal": all(flags), "ep_dir": describe(ep_dir)} if rank == 0 else {}


if __name__ == "__main__":
    import save_megatron_gpt

    sys.exit(save_megatron_gpt.main(sys.argv, one))
