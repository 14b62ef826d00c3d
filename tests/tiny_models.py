"""Tiny random models of real families, built by transformers from configs (nothing downloaded).

``build(family, path)`` writes what ``save_pretrained`` writes (Hugging Face names: per-expert
``block_sparse_moe.experts.N.w1.weight`` for Mixtral, fused ``qkv_proj`` for Phi-3);
``stacked=`` also saves the model's in-memory ``state_dict()`` (transformers v5's stacked
``mlp.experts.gate_up_proj``/``down_proj``) as a second Hugging Face directory. Shared by the
preset tests (tests/cli/test_presets.py) and the transformers TP/EP oracle
(tests/dist/test_hf_tp_plans.py, whose torchrun worker loads these directories).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen3", "phi3", "mixtral", "qwen3_moe")
MOE = ("mixtral", "qwen3_moe")

# Per-expert file names of the stacked in-memory tensors: (file prefix of the MoE block, gate, up, down).
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def config(family: str, *, kv_heads: int = 2) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if family == "qwen2":  # q/k/v with biases
        return transformers.Qwen2Config(**common)
    if family == "phi3":
        return transformers.Phi3Config(**common, pad_token_id=0)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
    raise ValueError(family)


def build(family: str, path: Path, *, kv_heads: int = 2, stacked: Path | None = None, seed: int = 0) -> None:
    """Save a random ``family`` model to ``path`` (and its in-memory state dict to ``stacked``)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family, kv_heads=kv_heads))
    model.save_pretrained(path)
    if stacked is not None:
        stacked.mkdir(parents=True)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
        (stacked / "config.json").write_bytes((path / "config.json").read_bytes())


def per_expert(family: str, name: str, tensors: dict[str, Any], experts: int) -> Any | None:
    """Rebuild in-memory tensor ``name`` (stacked experts, or the renamed router) from per-expert tensors.

    ``gate_up_proj[e] = cat([gate_e, up_e])`` and ``down_proj[e] = down_e`` (transformers'
    MergeModulelist + Concatenate); None when ``name`` is not one of those.
    """
    import torch

    if family not in EXPERT_NAMES or ".mlp." not in name:
        return None
    block, gate, up, down = EXPERT_NAMES[family]
    head, _, tail = name.partition(".mlp.")
    base = f"{head}.{block}."
    if tail == "gate.weight":
        return tensors.get(base + "gate.weight")
    if tail == "experts.gate_up_proj":
        return torch.stack(
            [
                torch.cat(
                    [tensors[f"{base}experts.{e}.{gate}.weight"], tensors[f"{base}experts.{e}.{up}.weight"]]
                )
                for e in range(experts)
            ]
        )
    if tail == "experts.down_proj":
        return torch.stack([tensors[f"{base}experts.{e}.{down}.weight"] for e in range(experts)])
    return None
