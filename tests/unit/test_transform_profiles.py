"""Bundled transform profiles: round trips (A -> B -> A byte-identical) and oracles.

Oracles: torchtitan's own llama3 ``Llama3StateDictAdapter.from_hf``/``to_hf``
on a tiny random state dict; Megatron-Bridge's QKV grouping formula, vLLM's
fused layout and torch.stack written as torch ops on full tensors.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from reshard.errors import ConfigError
from reshard.transforms import apply, inverse, list_profiles, load_transforms
from tests.transform_ref import materialise, run_spec

LLAMA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 32,  # head_dim 8: the RoPE permutation is not its own inverse (it is at 4)
    "intermediate_size": 24,
    "vocab_size": 50,
    "num_hidden_layers": 2,
}
MIXTRAL = {**LLAMA, "num_local_experts": 3}


def llama_hf(cfg: dict[str, int] = LLAMA, *, tied: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, hd = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    f, v = cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, d),
            p + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, d),
            p + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * hd, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return {n: torch.randn(s, generator=g) for n, s in sorted(shapes.items())}


def mixtral_hf() -> dict[str, torch.Tensor]:
    sd = llama_hf(MIXTRAL)
    g = torch.Generator().manual_seed(1)
    for i in range(MIXTRAL["num_hidden_layers"]):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[f"model.layers.{i}.mlp.{name}.weight"]
        sd[f"model.layers.{i}.block_sparse_moe.gate.weight"] = torch.randn(3, 32, generator=g)
        for e in range(MIXTRAL["num_local_experts"]):
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            sd[p + "w1.weight"] = torch.randn(24, 32, generator=g)
            sd[p + "w3.weight"] = torch.randn(24, 32, generator=g)
            sd[p + "w2.weight"] = torch.randn(32, 24, generator=g)
    return sd


QWEN3_MOE = {**LLAMA, "num_experts": 3, "moe_intermediate_size": 12}
QWEN2_MOE = {**QWEN3_MOE, "shared_expert_intermediate_size": 20}


def qwen3_moe_hf() -> dict[str, torch.Tensor]:
    """Qwen3-MoE's saved names: one gate/up/down tensor per expert under ``mlp.experts.N``."""
    sd = llama_hf(QWEN3_MOE)
    g = torch.Generator().manual_seed(2)
    for i in range(QWEN3_MOE["num_hidden_layers"]):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[f"model.layers.{i}.mlp.{name}.weight"]
        sd[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(3, 32, generator=g)
        for e in range(QWEN3_MOE["num_experts"]):
            p = f"model.layers.{i}.mlp.experts.{e}."
            sd[p + "gate_proj.weight"] = torch.randn(12, 32, generator=g)
            sd[p + "up_proj.weight"] = torch.randn(12, 32, generator=g)
            sd[p + "down_proj.weight"] = torch.randn(32, 12, generator=g)
    return sd


def qwen2_moe_hf() -> dict[str, torch.Tensor]:
    """Qwen2-MoE's saved names: Qwen3-MoE's, plus q/k/v biases and a gated shared expert."""
    sd = qwen3_moe_hf()
    g = torch.Generator().manual_seed(3)
    d, s, hd = 32, QWEN2_MOE["shared_expert_intermediate_size"], 32 // LLAMA["num_attention_heads"]
    for i in range(QWEN2_MOE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        heads, kv = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
        for x, n in (("q", heads), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.bias"] = torch.randn(n * hd, generator=g)
        sd[p + "mlp.shared_expert.gate_proj.weight"] = torch.randn(s, d, generator=g)
        sd[p + "mlp.shared_expert.up_proj.weight"] = torch.randn(s, d, generator=g)
        sd[p + "mlp.shared_expert.down_proj.weight"] = torch.randn(d, s, generator=g)
        sd[p + "mlp.shared_expert_gate.weight"] = torch.randn(1, d, generator=g)
    return dict(sorted(sd.items()))


def qwen3_hf(
    cfg: dict[str, int] = QWEN3_MOE, *, dense_layers: tuple[int, ...] = (1,)
) -> dict[str, torch.Tensor]:
    """Qwen3(-MoE) as saved: Llama's names, per-head q/k RMSNorms, and in the layers not in
    ``dense_layers`` one tensor per expert and a router (``mlp_only_layers``: dense layers in a
    MoE model); a config without ``num_experts`` is dense Qwen3."""
    sd = llama_hf(cfg)
    g = torch.Generator().manual_seed(3)
    hd, experts = cfg["hidden_size"] // cfg["num_attention_heads"], cfg.get("num_experts", 0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_norm.weight"] = torch.randn(hd, generator=g)
        sd[p + "self_attn.k_norm.weight"] = torch.randn(hd, generator=g)
        if not experts or i in dense_layers:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[p + f"mlp.{name}.weight"]
        sd[p + "mlp.gate.weight"] = torch.randn(experts, cfg["hidden_size"], generator=g)
        f = cfg["moe_intermediate_size"]
        for e in range(experts):
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(f, cfg["hidden_size"], generator=g)
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = torch.randn(f, cfg["hidden_size"], generator=g)
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = torch.randn(cfg["hidden_size"], f, generator=g)
    return dict(sorted(sd.items()))


def phi3_hf() -> dict[str, torch.Tensor]:
    """Phi-3's saved names: llama_hf's q/k/v fused into ``qkv_proj`` = [q; k; v] and gate/up into
    ``gate_up_proj`` = [gate; up] (Phi3Attention's slices, Phi3MLP's chunk(2))."""
    sd = llama_hf()
    for i in range(LLAMA["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sd[a + "qkv_proj.weight"] = torch.cat([sd.pop(a + f"{x}_proj.weight") for x in "qkv"])
        sd[m + "gate_up_proj.weight"] = torch.cat([sd.pop(m + f"{x}_proj.weight") for x in ("gate", "up")])
    return dict(sorted(sd.items()))


def numpy_of(sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: t.numpy() for n, t in sd.items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == tuple(t.shape), name
        assert got[name].tobytes() == t.contiguous().numpy().tobytes(), name


PROFILES = {
    "hf-to-torchtitan-llama": (llama_hf, LLAMA),
    "hf-to-torchtitan-qwen3": (qwen3_hf, QWEN3_MOE),
    "hf-to-megatron-gpt": (llama_hf, LLAMA),
    "hf-to-megatron-torch-dist": (lambda: qwen3_hf(LLAMA), LLAMA),  # dense Qwen3: q/k layernorms stacked too
    # megatron-core's own MoE GPTModel is their oracle: tests/dist/test_megatron_moe.py
    "mixtral-to-megatron-torch-dist": (mixtral_hf, MIXTRAL),
    "qwen3-moe-to-megatron-torch-dist": (qwen3_moe_hf, QWEN3_MOE),
    "qwen2-moe-to-megatron-torch-dist": (qwen2_moe_hf, QWEN2_MOE),
    "hf-to-vllm": (llama_hf, LLAMA),
    "mixtral-experts-stack": (mixtral_hf, MIXTRAL),
    "phi3-to-llama": (phi3_hf, LLAMA),  # transformers' models are its oracle: tests/cli/test_phi3_profile.py
    # transformers' own loading is their oracle: tests/cli/test_transformers_experts.py
    "mixtral-to-transformers-experts": (mixtral_hf, MIXTRAL),
    "qwen3-moe-to-transformers-experts": (qwen3_moe_hf, QWEN3_MOE),
}


def test_every_bundled_profile_is_tested() -> None:
    assert sorted(PROFILES) == list_profiles()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_round_trip_is_byte_identical(name: str) -> None:
    make, cfg = PROFILES[name]
    spec = load_transforms(name)
    src = numpy_of(make())
    there = run_spec(spec, src, cfg)
    assert sorted(there) != sorted(src)  # the names did change
    back = run_spec(inverse(spec), there, cfg)
    assert_same(back, {n: torch.from_numpy(a) for n, a in src.items()})


def test_phi3_to_llama_splits_into_llamas_tensors() -> None:
    """The split gives back the q/k/v and gate/up tensors phi3_hf fused with torch.cat, by Llama's names."""
    assert_same(run_spec(load_transforms("phi3-to-llama"), numpy_of(phi3_hf()), LLAMA), llama_hf())


# -- torchtitan's own adapter --------------------------------------------------------


class _ComplexRoPE:
    class Config:
        pass


def torchtitan_llama3_adapter(cfg: dict[str, int], *, tied: bool = False) -> Any:
    """torchtitan's Llama3StateDictAdapter, run from its installed source.

    Importing the module pulls torchtitan's model code (triton kernels); its
    conversion only needs the model config, so the two imports used for an
    isinstance check and a type hint are replaced by stand-ins. Everything
    else (the name map, _permute, _reverse_permute, to_hf, from_hf) is
    torchtitan's code, unchanged.
    """
    pytest.importorskip("torchtitan.protocols.state_dict_adapter")
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "models" / "llama3" / "state_dict_adapter.py"
    text = path.read_text(encoding="utf-8")
    for line in (
        "from torchtitan.models.common.rope import ComplexRoPE\n",
        "from .model import Llama3Model\n",
    ):
        assert line in text, f"torchtitan changed its imports: {line!r}"
        text = text.replace(line, "")
    ns: dict[str, Any] = {"ComplexRoPE": _ComplexRoPE, "Llama3Model": SimpleNamespace(Config=object)}
    exec(compile(text, str(path), "exec"), ns)  # noqa: S102 - torchtitan's own installed source
    attention = SimpleNamespace(
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg["num_key_value_heads"],
        head_dim=None,
        rope=_ComplexRoPE.Config(),
    )
    layers = [SimpleNamespace(attention=attention)] * cfg["num_hidden_layers"]
    model = SimpleNamespace(layers=layers, dim=cfg["hidden_size"], enable_weight_tying=tied)
    return ns["Llama3StateDictAdapter"](model, None)


def test_hf_to_torchtitan_matches_torchtitan_from_hf_and_to_hf() -> None:
    adapter = torchtitan_llama3_adapter(LLAMA)
    spec = load_transforms("hf-to-torchtitan-llama")
    hf = llama_hf()
    hf_with_buffers = {**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.arange(2.0)}
    titan = adapter.from_hf(dict(hf_with_buffers))
    assert "layers.0.attention.qkv_linear.wq.weight" in titan
    assert_same(run_spec(spec, numpy_of(hf_with_buffers), LLAMA), titan)
    titan_np = numpy_of({n: t.contiguous() for n, t in titan.items()})
    assert_same(run_spec(inverse(spec), titan_np, LLAMA), adapter.to_hf(titan))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_torchtitan_tied_embeddings_follow_tie_word_embeddings(family: str) -> None:
    """tie_word_embeddings in the config (enable_weight_tying in torchtitan): from_hf copies
    embed_tokens to lm_head, to_hf drops it; the profiles' conditional tie does the same, and
    nothing when the config says false (or does not say)."""
    cfg = {**(LLAMA if family == "llama" else QWEN3_MOE), "tie_word_embeddings": True}
    if family == "llama":
        adapter, hf = torchtitan_llama3_adapter(cfg, tied=True), llama_hf(tied=True)
    else:
        adapter = torchtitan_qwen3_adapter(cfg, dense_layers=(1,), tied=True)
        hf = {n: t for n, t in qwen3_hf(cfg).items() if n != "lm_head.weight"}
    spec = load_transforms(f"hf-to-torchtitan-{family}")
    titan = adapter.from_hf(dict(hf))
    assert "lm_head.weight" in titan
    assert_same(run_spec(spec, numpy_of(hf), cfg), titan)
    back = run_spec(inverse(spec), numpy_of({n: t.contiguous() for n, t in titan.items()}), cfg)
    assert_same(back, adapter.to_hf(titan))  # to_hf drops the tied lm_head; untie does too
    untied = run_spec(spec, numpy_of(hf), {**cfg, "tie_word_embeddings": False})
    assert "lm_head.weight" not in untied


def torchtitan_qwen3_adapter(
    cfg: dict[str, int], dense_layers: tuple[int, ...], *, tied: bool = False
) -> Any:
    """torchtitan's Qwen3StateDictAdapter and the MoEStateDictAdapter it extends, run from their
    installed source (their modules import torchtitan's model code and triton kernels): the
    imports of the model config and RoPE classes (an isinstance check, type hints) are
    stand-ins, and MoEStateDictAdapter is its class statement from ``models/utils.py`` alone.
    The name map, from_hf's stacking and to_hf's splitting are torchtitan's code, unchanged."""
    import ast

    pytest.importorskip("torchtitan.protocols.state_dict_adapter")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    models = Path(spec.submodule_search_locations[0]) / "models"
    utils = (models / "utils.py").read_text(encoding="utf-8")
    (cls,) = [
        n for n in ast.parse(utils).body if isinstance(n, ast.ClassDef) and n.name == "MoEStateDictAdapter"
    ]
    ns: dict[str, Any] = {
        "torch": torch,
        "DeviceMesh": DeviceMesh,
        "DTensor": DTensor,
        "Replicate": Replicate,
        "Shard": Shard,
        "_StridedShard": _StridedShard,
        "StateDictAdapter": StateDictAdapter,
        "Decoder": SimpleNamespace(Config=object),
        "logger": None,
    }
    exec(compile(ast.get_source_segment(utils, cls) or "", str(models / "utils.py"), "exec"), ns)  # noqa: S102
    path = models / "qwen3" / "state_dict_adapter.py"
    text = path.read_text(encoding="utf-8")
    for line in (
        "from torchtitan.models.common.rope import CosSinRoPE\n",
        "from torchtitan.models.utils import MoEStateDictAdapter\n",
        "from .model import Qwen3Model\n",
    ):
        assert line in text, f"torchtitan changed its imports: {line!r}"
        text = text.replace(line, "")
    ns |= {"CosSinRoPE": _ComplexRoPE, "Qwen3Model": SimpleNamespace(Config=object)}
    exec(compile(text, str(path), "exec"), ns)  # noqa: S102 - torchtitan's own installed source
    attention = SimpleNamespace(rope=_ComplexRoPE.Config())
    moe = SimpleNamespace(num_experts=cfg["num_experts"]) if "num_experts" in cfg else None
    layers = [
        SimpleNamespace(attention=attention, moe=None if i in dense_layers else moe)
        for i in range(cfg["num_hidden_layers"])
    ]
    model = SimpleNamespace(layers=layers, dim=cfg["hidden_size"], enable_weight_tying=tied)
    return ns["Qwen3StateDictAdapter"](model, None)


@pytest.mark.parametrize("moe", [False, True])
def test_hf_to_torchtitan_qwen3_matches_torchtitan_from_hf_and_to_hf(moe: bool) -> None:
    """Dense Qwen3, and Qwen3-MoE with a dense layer (``mlp_only_layers``): the profile gives
    torchtitan's from_hf (experts stacked, q/k not permuted) and its inverse to_hf."""
    cfg = QWEN3_MOE if moe else LLAMA
    adapter = torchtitan_qwen3_adapter(cfg, dense_layers=(1,))
    spec = load_transforms("hf-to-torchtitan-qwen3")
    hf = {**qwen3_hf(cfg), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.arange(2.0)}
    titan = adapter.from_hf(dict(hf))
    assert "layers.0.attention.q_norm.weight" in titan
    assert ("layers.0.moe.routed_experts.inner_experts.w2_EDF" in titan) is moe
    assert_same(run_spec(spec, numpy_of(hf), cfg), titan)
    titan_np = numpy_of({n: t.contiguous() for n, t in titan.items()})
    assert_same(run_spec(inverse(spec), titan_np, cfg), adapter.to_hf(titan))


# -- Megatron, vLLM, Mixtral: the same transforms as torch ops -----------------------


def test_hf_to_megatron_matches_bridge_layout() -> None:
    hf = llama_hf()
    got = run_spec(load_transforms("hf-to-megatron-gpt"), numpy_of(hf), LLAMA)
    g, hd, d = 2, 8, 32
    want: dict[str, torch.Tensor] = {}
    for i in range(2):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        # Megatron-Bridge merge_qkv_weights: per query group [q heads, k, v]
        want[m + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.view(g, -1, d), k.view(g, hd, d), v.view(g, hd, d)], dim=1
        ).reshape(-1, d)
        want[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
        want[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        want[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        want[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        want[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
    pad = torch.nn.functional.pad
    want["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"], (0, 0, 0, 128 - 50))
    want["output_layer.weight"] = pad(hf["lm_head.weight"], (0, 0, 0, 128 - 50))
    want["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    assert_same(got, want)


def test_hf_to_megatron_torch_dist_is_the_per_layer_profile_stacked() -> None:
    """hf-to-megatron-torch-dist = hf-to-megatron-gpt, then torch.stack of each per-layer tensor over
    the layers (TransformerBlock's prepended axis); its real-checkpoint oracle is megatron-core's
    own save, tests/dist/test_megatron_torch_dist.py."""
    hf = numpy_of(qwen3_hf(LLAMA))
    per_layer = run_spec(load_transforms("hf-to-megatron-gpt"), hf, LLAMA)
    want: dict[str, torch.Tensor] = {}
    for name, a in per_layer.items():
        if not name.startswith("decoder.layers.0."):
            if not name.startswith("decoder.layers."):
                want[name] = torch.from_numpy(a)
            continue
        rest = name.removeprefix("decoder.layers.0.")
        want["decoder.layers." + rest] = torch.stack(
            [torch.from_numpy(per_layer[f"decoder.layers.{i}.{rest}"]) for i in range(2)]
        )
    assert "decoder.layers.self_attention.q_layernorm.weight" in want
    assert_same(run_spec(load_transforms("hf-to-megatron-torch-dist"), hf, LLAMA), want)


def test_hf_to_vllm_matches_fused_layout() -> None:
    hf = llama_hf()
    got = run_spec(load_transforms("hf-to-vllm"), numpy_of(hf), LLAMA)
    want = dict(hf)
    for i in range(2):
        p = f"model.layers.{i}."
        want[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [want.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        )
        want[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [want.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
        )
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        want[name] = torch.nn.functional.pad(want[name], (0, 0, 0, 64 - 50))
    assert_same(got, want)


def test_mixtral_experts_stack_matches_torch_stack() -> None:
    hf = mixtral_hf()
    got = run_spec(load_transforms("mixtral-experts-stack"), numpy_of(hf), MIXTRAL)
    want = {n: t for n, t in hf.items() if ".experts." not in n}
    for i in range(2):
        for w in ("w1", "w2", "w3"):
            p = f"model.layers.{i}.block_sparse_moe.experts."
            want[p + w] = torch.stack([hf[f"{p}{e}.{w}.weight"] for e in range(3)])
    assert_same(got, want)
    parts = apply(
        load_transforms("mixtral-experts-stack"), {n: tuple(t.shape) for n, t in hf.items()}, config=MIXTRAL
    )
    assert (
        len(parts["model.layers.0.block_sparse_moe.experts.w1"].parts) == 3
    )  # one whole-tensor copy per expert


def test_profile_needs_its_config_values() -> None:
    with pytest.raises(ConfigError, match="unknown size name 'num_attention_heads'"):
        run_spec(load_transforms("hf-to-torchtitan-llama"), numpy_of(llama_hf()))


def test_missing_expert_is_named() -> None:
    hf = mixtral_hf()
    del hf["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(
        ConfigError, match='"model.layers.1.block_sparse_moe.experts.w3": stacking needs indices'
    ):
        apply(
            load_transforms("mixtral-experts-stack"),
            {n: tuple(t.shape) for n, t in hf.items()},
            config=MIXTRAL,
        )


def vllm_rank_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, tp: int, r: int
) -> torch.Tensor:
    """What vLLM's QKVParallelLinear holds on TP rank r: its chunk of q, and KV head chunk
    ``r // (tp / kv_heads)`` when the KV heads are replicated (tp > kv_heads), else chunk r."""
    kv_chunk = r * kv_heads // tp if tp > kv_heads else r
    kv_parts = min(tp, kv_heads)
    return torch.cat(
        [torch.chunk(q, tp)[r], torch.chunk(k, kv_parts)[kv_chunk], torch.chunk(v, kv_parts)[kv_chunk]]
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp"), [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 4, 2), (8, 2, 8), (4, 1, 4)]
)
def test_hf_to_vllm_with_tp_orders_rows_as_vllm_ranks_hold_them(heads: int, kv_heads: int, tp: int) -> None:
    """--set tp=N: S(0) of the fused tensors gives each rank vLLM's [q_r; k_r; v_r], [gate_r; up_r]."""
    cfg = {**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    hf = llama_hf(cfg)
    spec = load_transforms("hf-to-vllm").with_values({"tp": tp})  # --set tp=N
    got = run_spec(spec, numpy_of(hf), cfg)
    for i in range(2):
        p = f"model.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        qkv = torch.from_numpy(got[p + "self_attn.qkv_proj.weight"])
        gate_up = torch.from_numpy(got[p + "mlp.gate_up_proj.weight"])
        for r in range(tp):
            assert torch.equal(torch.chunk(qkv, tp)[r], vllm_rank_qkv(q, k, v, kv_heads, tp, r)), (i, r)
            want = torch.cat([torch.chunk(gate, tp)[r], torch.chunk(up, tp)[r]])
            assert torch.equal(torch.chunk(gate_up, tp)[r], want), (i, r)
    back = run_spec(inverse(spec), got, cfg)  # the first copy of each replicated KV head
    assert_same(back, hf)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 8)])
def test_hf_to_vllm_fuses_qwen2_qkv_biases_as_the_weights(heads: int, kv_heads: int, tp: int) -> None:
    """Qwen2's q/k/v biases become vLLM's qkv_proj.bias, each rank's [q_r; k_r; v_r] as for the
    weights (they were left unfused, three tensors vLLM does not have); the inverse gives them back."""
    cfg = {**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    hf = llama_hf(cfg)
    gen = torch.Generator().manual_seed(3)
    for i in range(2):
        for x in "qkv":
            w = hf[f"model.layers.{i}.self_attn.{x}_proj.weight"]
            hf[f"model.layers.{i}.self_attn.{x}_proj.bias"] = torch.randn(w.shape[0], generator=gen)
    spec = load_transforms("hf-to-vllm").with_values({"tp": tp})
    got = run_spec(spec, numpy_of(hf), cfg)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        assert not any(f"{p}{x}_proj.bias" in got for x in "qkv")
        q, k, v = (hf[p + f"{x}_proj.bias"] for x in "qkv")
        fused = torch.from_numpy(got[p + "qkv_proj.bias"])
        for r in range(tp):
            assert torch.equal(torch.chunk(fused, tp)[r], vllm_rank_qkv(q, k, v, kv_heads, tp, r)), (i, r)
    assert_same(run_spec(inverse(spec), got, cfg), hf)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 4), (8, 2, 8), (4, 1, 4), (4, 2, 2)])
def test_vllm_read_back_lists_the_kv_copies_it_does_not_read(heads: int, kv_heads: int, tp: int) -> None:
    """Each rank's copy of a replicated KV head made distinct (torch): the inverse reads the first
    copies; ``repeats`` gives, per copy c, the target read from the ranks holding copy c."""
    cfg = {**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    hf = llama_hf(cfg)
    spec = load_transforms("hf-to-vllm").with_values({"tp": tp})
    p = "model.layers.0.self_attn."
    q, k, v = (hf[p + f"{x}_proj.weight"] for x in "qkv")
    fused = torch.cat([vllm_rank_qkv(q, k + 100 * r, v - 100 * r, kv_heads, tp, r) for r in range(tp)])
    src = run_spec(spec, numpy_of(hf), cfg)  # the vLLM tensors, layer 0's KV copies made distinct:
    src[p + "qkv_proj.weight"] = fused.numpy()
    repeats: list[Any] = []
    apply(inverse(spec), {n: a.shape for n, a in src.items()}, config=cfg, repeats=repeats)
    repeats = [r for r in repeats if r.first.name.startswith(p)]
    rep = tp // kv_heads if tp > kv_heads else 1
    assert sorted((r.first.name, r.copy, r.count) for r in repeats) == sorted(
        (p + f"{x}_proj.weight", c, rep) for x in "kv" for c in range(1, rep)
    )
    chunks = min(tp, kv_heads)

    def read(base: torch.Tensor, sign: int, copy: int) -> torch.Tensor:
        """KV chunk j as rank j*rep + copy holds it: ``base`` shifted by that rank's 100 * rank."""
        return torch.cat(
            [torch.chunk(base + sign * 100 * (j * rep + copy), chunks)[j] for j in range(chunks)]
        )

    for r in repeats:
        base, sign = (k, 1) if r.first.name.endswith("k_proj.weight") else (v, -1)
        assert r.fused == p + "qkv_proj.weight"
        assert torch.equal(torch.from_numpy(materialise(r.first, src)), read(base, sign, 0))
        assert torch.equal(torch.from_numpy(materialise(r.other, src)), read(base, sign, r.copy))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (4, 2, 3, r"heads / tp.*4 / 3 is not a whole number"),
        (6, 3, 2, r"kv_heads / kv_shards.*3 / 2 is not a whole number"),
        (6, 2, 3, r"shards \[3, 2, 2\] do not fit: each must divide groups: 3"),
    ],
)
def test_hf_to_vllm_refuses_a_tp_that_does_not_divide_the_heads(
    heads: int, kv_heads: int, tp: int, message: str
) -> None:
    cfg = {**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": 8 * heads}
    with pytest.raises(ConfigError, match=message):
        run_spec(load_transforms("hf-to-vllm").with_values({"tp": tp}), numpy_of(llama_hf(cfg)), cfg)
