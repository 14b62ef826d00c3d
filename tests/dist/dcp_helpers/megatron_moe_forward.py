"""Load a Megatron MoE ``torch_dist`` checkpoint reshard wrote (``hf-moe-to-megatron-torch-dist``)
into megatron-core's own MoE GPTModel with Megatron's own ``dist_checkpointing.load``, and compare
its logits with the Hugging Face model (Mixtral, Qwen3-MoE) it came from.

Run as a script: ``python megatron_moe_forward.py OUT.json HF_DIR DIST_DIR [HF_DIR DIST_DIR ...]``;
needs ``megatron-core`` (0.16) and ``transformers``. For each pair, on CPU in a 1-rank gloo world:
the GPTModel of ``HF_DIR/config.json`` with routed experts (local spec: ``SequentialMLP``, top-k
routing, renormalised as Mixtral does and Qwen3-MoE with ``norm_topk_prob``; RMSNorm, SwiGLU, GQA,
RoPE, Qwen3's q/k layernorms), its ``sharded_state_dict()`` filled by ``dist_checkpointing.load``
from ``DIST_DIR`` with Megatron's default strictness, then the logits of both models on the same
tokens; and Megatron's own ``dist_checkpointing.save`` of the loaded model to ``DIST_DIR-megatron``
(its keys and chunks: two per expert's ``[gate; up]``), for the export direction. Writes
``{name: {"max_abs_diff", "logits_scale", "loaded", "experts_fc1_equal"}}``:
``experts_fc1_equal`` checks by hand that expert ``e`` of layer ``l`` holds ``[gate; up]``.
Megatron's code is written for CUDA: ``torch.cuda.current_device`` gives ``"cpu"``, its
dropout RNG tracker (dropout is 0) forks nothing, and the router's TransformerEngine GEMM,
which 0.16 names without importing when TransformerEngine is absent, is None (torch's path).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_model(c: Any, padded_vocab: int, keys: Any) -> Any:
    """``megatron_gpt_forward.build_model`` with the HF config's routed experts, and Qwen2-MoE's
    gated shared expert; q/k/v biases and q/k layernorms as the checkpoint's ``keys`` hold them."""
    from megatron_gpt_forward import build_model as gpt_model

    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    shared = getattr(c, "shared_expert_intermediate_size", None)
    extra = {"moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": True} if shared else {}
    return gpt_model(
        c,
        padded_vocab,
        "decoder.layers.self_attention.linear_qkv.bias" in keys,
        "decoder.layers.self_attention.q_layernorm.weight" in keys,
        **extra,
        experts=getattr(c, "num_local_experts", None) or c.num_experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=c.num_experts_per_tok,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
        # Mixtral renormalises the top-k probabilities, Qwen3-MoE only with norm_topk_prob (off by
        # default): softmax over all experts first, as Megatron's pre-softmax routing does
        moe_router_pre_softmax=not getattr(c, "norm_topk_prob", True),
    )


def compare(hf_dir: Path, dist_dir: Path, resave: Path | None = None) -> dict[str, Any]:
    import torch
    import transformers
    from megatron.core import dist_checkpointing
    from megatron_gpt_forward import logits
    from torch.distributed.checkpoint import FileSystemReader

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    c = hf.config
    md = FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata
    padded = md["embedding.word_embeddings.weight"].size[0]
    model = build_model(c, padded, md)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(dist_dir))  # default strictness
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = not unexpected and all(k.endswith("._extra_state") for k in missing)
    sd, hsd = model.state_dict(), hf.state_dict()
    fc1_equal = True
    for name, t in hsd.items():  # expert e of layer l: [gate; up]
        for gate, up in ((".w1.weight", ".w3.weight"), (".gate_proj.weight", ".up_proj.weight")):
            if ".experts." in name and name.endswith(gate):
                parts = name.split(".")
                layer, expert = parts[2], parts[parts.index("experts") + 1]
                mine = sd[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"]
                fc1_equal &= torch.equal(mine, torch.cat([t, hsd[name[: -len(gate)] + up]]))
    if resave is not None:  # Megatron's own save of what it loaded: its chunks, its keys
        resave.mkdir(parents=True)
        dist_checkpointing.save(model.sharded_state_dict(), str(resave))
    want, got = logits(hf, model)
    return {
        "loaded": loaded,
        "experts_fc1_equal": bool(fc1_equal),
        "max_abs_diff": float((got[..., : c.vocab_size] - want).abs().max()),
        "logits_scale": float(want.abs().max()),
    }


if __name__ == "__main__":
    from megatron_gpt_forward import one_rank

    one_rank(lambda hf, dist: compare(hf, dist, Path(f"{dist}-megatron")))
