"""HF Mixtral / Qwen2-MoE / Qwen3-MoE <-> Megatron-Core MoE ``torch_dist`` (``mixtral-to-megatron-torch-dist``,
``qwen2-moe-to-megatron-torch-dist``, ``qwen3-moe-to-megatron-torch-dist``), with megatron-core
0.16 itself as the oracle (Qwen2-MoE: q/k/v biases and a gated shared expert).

Tiny random models (hidden 32, 2 layers, 4 experts of 24, 4 heads over 2 KV groups, vocab 100,
so Megatron's embedding is padded to 128) are saved by transformers' ``save_pretrained`` with
per-expert names. reshard writes ``torch_dist`` from them; megatron-core's own MoE ``GPTModel``
(local spec, ``SequentialMLP``, CPU, 1-rank gloo world: ``dcp_helpers/megatron_moe_forward.py``)
loads it with ``dist_checkpointing.load`` at Megatron's default strictness and gives the HF
model's logits; Megatron then saves the model itself, and reshard's ``--inverse`` turns that
save (Megatron's chunks: two a ``[gate; up]`` expert) back into the HF tensors, bit for bit.
The same at expert parallelism 2 (``dcp_helpers/megatron_moe_ep.py``, a 2-rank gloo world):
Megatron's EP-2 model loads reshard's output with each rank's experts right, and the EP-2
checkpoint it saves (each rank's experts in its own files) exports back to the HF tensors.
Skipped without ``megatron-core`` or ``transformers``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_convert_cli import run
from tests.dist.test_megatron_torch_dist import assert_same, gloo_helper

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (pip install megatron-core)", allow_module_level=True)
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.dist

HELPER = Path(__file__).resolve().parent / "dcp_helpers" / "megatron_moe_forward.py"
EP_HELPER = Path(__file__).resolve().parent / "dcp_helpers" / "megatron_moe_ep.py"
COMMON = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 24, "num_local_experts": 4}, "mixtral-to-megatron-torch-dist"),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"intermediate_size": 48, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "num_experts": 4},
        "qwen2-moe-to-megatron-torch-dist",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"intermediate_size": 48, "moe_intermediate_size": 24, "num_experts": 4, "head_dim": 8},
        "qwen3-moe-to-megatron-torch-dist",
    ),
}
STACKED = {  # Megatron's keys, as its own dist_checkpointing.save of the MoE GPTModel writes them
    "embedding.word_embeddings.weight": [128, 32],
    "output_layer.weight": [128, 32],
    "decoder.final_layernorm.weight": [32],
    "decoder.layers.self_attention.linear_qkv.weight": [2, 64, 32],
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [2, 32],
    "decoder.layers.self_attention.linear_proj.weight": [2, 32, 32],
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": [2, 32],
    "decoder.layers.mlp.router.weight": [2, 4, 32],
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": [2, 4, 48, 32],
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": [2, 4, 32, 24],
}


def tensors_of(ck: Path) -> dict[str, list[int]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    return {k: list(v.size) for k, v in md.items() if isinstance(v, TensorStorageMetadata)}


def items_of(ck: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(ck)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per family: the HF dir and tensors, reshard's torch_dist of it, Megatron's resave, and what
    Megatron's load and forward said."""
    root = tmp_path_factory.mktemp("megamoe")
    out: dict[str, Any] = {}
    args: list[str] = []
    for family, (cls, extra, profile) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**(COMMON | extra)))
        with torch.no_grad():  # random values everywhere (norms start at ones)
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
        src, dist = root / family, root / f"{family}-dist"
        model.save_pretrained(src)
        p = run("convert", str(src), str(dist), "--to", "dcp", "--transforms", profile,
                "--model-config", str(src / "config.json"), "--quiet")  # fmt: skip
        assert p.returncode == 0, p.stderr
        out[family] = {"src": src, "dist": dist, "profile": profile, "hf": load_file(str(src / "model.safetensors"))}
        args += [str(src), str(dist)]
    for name, doc in gloo_helper(HELPER, root / "moe.json", args).items():
        out[name]["megatron"] = doc
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_megatron_loads_it_and_gives_the_hf_logits(saved: dict[str, Any], family: str) -> None:
    c = saved[family]
    doc = c["megatron"]
    assert doc["loaded"] and doc["experts_fc1_equal"], doc
    assert doc["max_abs_diff"] <= 1e-5 * max(1.0, doc["logits_scale"]), doc


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_keys_and_shapes_are_megatrons_own(saved: dict[str, Any], family: str) -> None:
    c = saved[family]
    want = dict(STACKED)
    if family == "qwen3_moe":
        want |= {f"decoder.layers.self_attention.{q}_layernorm.weight": [2, 8] for q in "qk"}
    if family == "qwen2_moe":  # q/k/v biases, and the gated shared expert of 40
        want |= {
            "decoder.layers.self_attention.linear_qkv.bias": [2, 64],
            "decoder.layers.mlp.shared_experts.linear_fc1.weight": [2, 80, 32],
            "decoder.layers.mlp.shared_experts.linear_fc2.weight": [2, 32, 40],
            "decoder.layers.mlp.shared_experts.gate_weight": [2, 1, 32],
        }
    mine, theirs = c["dist"], Path(f"{c['dist']}-megatron")
    assert tensors_of(mine) == tensors_of(theirs) == want
    # every object Megatron saves (the experts' _extra_state per layer and expert among them), and
    # TransformerEngine's attention kernel's, which the local spec does not ask for
    extra = items_of(mine) - items_of(theirs)
    assert extra == {f"decoder.layers.self_attention.core_attention._extra_state/shard_{i}_2" for i in range(2)}
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4" in items_of(mine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("which", ["megatron", "reshard"])
def test_the_inverse_exports_megatrons_save_to_the_hf_tensors(
    saved: dict[str, Any], family: str, which: str, tmp_path: Path
) -> None:
    c = saved[family]
    ck = Path(f"{c['dist']}-megatron") if which == "megatron" else c["dist"]
    out = tmp_path / "hf"
    p = run("convert", str(ck), str(out), "--transforms", c["profile"], "--inverse", "--model-config",
            str(c["src"] / "config.json"), "--consolidate", "--config-from", str(c["src"]), "--quiet")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert_same(load_file(str(out / "model.safetensors")), c["hf"])
    p = run("verify", str(out), str(c["src"]))
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_dense_layer_among_moe_layers_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    """Megatron stacks homogeneous layers only: an HF model whose layer 1 is dense (Qwen3-MoE's
    mlp_only_layers) exits 2 naming what is missing, and writes nothing."""
    cls, extra, profile = FAMILIES["qwen3_moe"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**(COMMON | extra | {"mlp_only_layers": [1]}))
    )
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src)
    p = run("convert", str(src), str(out), "--to", "dcp", "--transforms", profile,
            "--model-config", str(src / "config.json"))  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert not out.exists()


@pytest.fixture(scope="module")
def ep2(saved: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per family: what Megatron's EP-2 model said of reshard's output, and its own EP-2 save."""
    root = tmp_path_factory.mktemp("megamoe-ep")
    args: list[str] = []
    for family, c in saved.items():
        args += [str(c["src"]), str(c["dist"]), str(root / f"{family}-ep2")]
    doc = gloo_helper(EP_HELPER, root / "ep.json", args)
    return {family: {**doc[family], "dir": root / f"{family}-ep2"} for family in saved}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_expert_parallel_megatron_run_loads_it_and_its_save_exports_back(
    saved: dict[str, Any], ep2: dict[str, Any], family: str, tmp_path: Path
) -> None:
    c, e = saved[family], ep2[family]
    assert e["experts_equal"], e  # rank r's local expert k is global expert 2r + k
    assert sorted(p.name for p in e["dir"].glob("*.distcp")) == [f"__{r}_{i}.distcp" for r in range(2) for i in range(2)]
    assert e["ep_dir"]["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == [[2, 4, 32, 24], "float32", 8]
    out = tmp_path / "hf"
    p = run("convert", str(e["dir"]), str(out), "--transforms", c["profile"], "--inverse", "--model-config",
            str(c["src"] / "config.json"), "--consolidate", "--quiet")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert_same(load_file(str(out / "model.safetensors")), c["hf"])
