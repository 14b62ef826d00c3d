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

import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_model(c: Any, padded_vocab: int, qk_norm: bool) -> Any:
    """``megatron_gpt_forward.build_model`` with the HF config's routed experts."""
    from megatron_gpt_forward import build_model as gpt_model

    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return gpt_model(
        c,
        padded_vocab,
        False,
        qk_norm,
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
    from torch.distributed.checkpoint import FileSystemReader

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    c = hf.config
    md = FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata
    padded = md["embedding.word_embeddings.weight"].size[0]
    model = build_model(c, padded, "decoder.layers.self_attention.q_layernorm.weight" in md)
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
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=g)
    positions = torch.arange(9).expand(2, 9)
    causal = torch.triu(torch.ones(1, 1, 9, 9, dtype=torch.bool), 1)  # True: masked
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens, positions, causal)
    return {
        "loaded": loaded,
        "experts_fc1_equal": bool(fc1_equal),
        "max_abs_diff": float((got[..., : c.vocab_size] - want).abs().max()),
        "logits_scale": float(want.abs().max()),
    }


def main() -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    out, pairs = Path(sys.argv[1]), sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        parallel_state.initialize_model_parallel(1, 1)
        mrandom._get_cuda_rng_state = lambda *a, **k: None
        mrandom._set_cuda_rng_state = lambda *a, **k: None
        mrandom.get_cuda_rng_tracker().states_["model-parallel-rng"] = None
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # 0.16's router names it without TransformerEngine
            moe_utils.te_general_gemm = None
        result = {
            Path(h).name: compare(Path(h), Path(d), Path(f"{d}-megatron"))
            for h, d in zip(pairs[::2], pairs[1::2], strict=True)
        }
        dist.destroy_process_group()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
