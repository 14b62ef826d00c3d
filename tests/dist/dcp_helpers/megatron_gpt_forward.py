"""Load a checkpoint reshard wrote with ``hf-to-megatron-gpt`` into megatron-core's own GPTModel and
compare its logits with the Hugging Face model it came from.

Run as a script: ``python megatron_gpt_forward.py OUT.json HF_DIR MEGATRON_DIR [HF_DIR MEGATRON_DIR ...]``;
needs ``megatron-core`` (0.16) and ``transformers``. For each pair it builds, from ``HF_DIR/config.json``,
Megatron-Core's ``GPTModel`` with the local (non-TransformerEngine) layer spec, on CPU in a 1-rank
gloo world: RMSNorm, SwiGLU, GQA with ``num_query_groups``, RoPE with the model's ``rope_theta``,
``add_qkv_bias`` when the HF model has q/k/v biases (Qwen2), ``qk_layernorm`` when it has
``q_norm``/``k_norm`` (Qwen3), the padded vocab of the embedding reshard wrote. The local spec
keeps the two per-layer norms as modules of their own (``input_layernorm``, ``pre_mlp_layernorm``)
where TransformerEngine's spec, whose names the profile writes, fuses them into the linear layers
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``): those two names are mapped,
every other name and every shape must be the model's own (``load_state_dict(strict=True)`` apart
from Megatron's ``_extra_state`` entries). Then the logits of both models on the same tokens.

Megatron's forward is written for CUDA: ``torch.cuda.current_device`` gives ``"cpu"`` and its
dropout RNG tracker (dropout is 0 here) forks nothing. Writes
``{family: {"keys_missing": [...], "keys_unexpected": [...], "max_abs_diff": float}}`` to OUT.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from collections.abc import Callable
from typing import Any

LOCAL_NAMES = {  # TransformerEngine's fused layer-norm names -> the local spec's modules
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def local_name(name: str) -> str:
    for te, local in LOCAL_NAMES.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def build_model(
    c: Any, padded_vocab: int, bias: bool, qk_norm: bool, tp: int = 1, experts: int = 0, **moe: Any
) -> Any:
    """Megatron-Core's GPTModel (local spec, fp32, CPU) for the HF config ``c``, at tensor-parallel
    degree ``tp`` (the model-parallel state must be initialised for it); with ``experts``, every
    layer's MLP is that many routed experts (``SequentialMLP``) and ``moe`` the rest of its
    ``TransformerConfig`` (``moe_ffn_hidden_size``, ``moe_router_topk``, ...)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    if experts:
        moe |= {"num_moe_experts": experts, "moe_grouped_gemm": False}
    cfg = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=head_dim,
        ffn_hidden_size=moe.get("moe_ffn_hidden_size", c.intermediate_size),
        add_qkv_bias=bias,
        qk_layernorm=qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=tp,
        **moe,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=c.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta),
        share_embeddings_and_output_weights=False,
    ).eval()


def logits(hf: Any, model: Any) -> tuple[Any, Any]:
    """The HF model's and the Megatron model's logits on the same 2 x 9 random tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 9), generator=g)
    positions = torch.arange(9).expand(2, 9)
    causal = torch.triu(torch.ones(1, 1, 9, 9, dtype=torch.bool), 1)  # True: masked
    with torch.no_grad():
        return hf(tokens).logits, model(tokens, positions, causal)


def compare(hf_dir: Path, meg_dir: Path) -> dict[str, Any]:
    import torch
    import transformers
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    c = hf.config
    names = set(hf.state_dict())
    bias = "model.layers.0.self_attn.q_proj.bias" in names
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in names
    state = {local_name(k): v for k, v in load_file(str(meg_dir / "model.safetensors")).items()}
    model = build_model(c, state["embedding.word_embeddings.weight"].shape[0], bias, qk_norm)  # padded vocab
    missing, unexpected = model.load_state_dict(state, strict=False)  # shapes are checked here
    missing = [k for k in missing if not k.endswith("._extra_state")]
    want, got = logits(hf, model)
    return {
        "keys_missing": sorted(missing),
        "keys_unexpected": sorted(unexpected),
        "padded_logits_max": float(got[..., c.vocab_size :].abs().max()) if got.shape[-1] > c.vocab_size else 0.0,
        "max_abs_diff": float((got[..., : c.vocab_size] - want).abs().max()),
        "logits_scale": float(want.abs().max()),
    }


def one_rank(each: Callable[[Path, Path], dict[str, Any]]) -> None:
    """``each(A, B)`` per pair of ``sys.argv[2:]`` in a 1-rank gloo world with Megatron's CUDA
    assumptions patched, ``{A's name: result}`` written to ``sys.argv[1]`` as JSON."""
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # RoPE's inv_freq.to(device=...)
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    out, pairs = Path(sys.argv[1]), sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe import moe_utils

        parallel_state.initialize_model_parallel(1, 1)
        # the attention's dropout RNG fork: a CUDA generator state; dropout is 0, nothing to fork
        mrandom._get_cuda_rng_state = lambda *a, **k: None
        mrandom._set_cuda_rng_state = lambda *a, **k: None
        mrandom.get_cuda_rng_tracker().states_["model-parallel-rng"] = None
        if not hasattr(moe_utils, "te_general_gemm"):  # 0.16's MoE router names it without TransformerEngine
            moe_utils.te_general_gemm = None
        result = {Path(a).name: each(Path(a), Path(b)) for a, b in zip(pairs[::2], pairs[1::2], strict=True)}
        dist.destroy_process_group()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    one_rank(compare)
