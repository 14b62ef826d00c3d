"""``hf-to-megatron-gpt`` on Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms), judged by megatron-core itself.

Tiny random Llama, Qwen2 and Qwen3 models (hidden 64, 2 layers, 4 heads over 2 KV groups, vocab 100 so
the embedding is padded to 128) are saved by transformers' ``save_pretrained`` and converted by the
``reshard`` CLI. Oracles: the fused bias is ``torch.cat`` per query group of the saved biases
(Megatron-Bridge ``merge_qkv_bias``), the q/k layernorms are the saved ``q_norm``/``k_norm``; and
megatron-core's own ``GPTModel`` (``dcp_helpers/megatron_gpt_forward.py``, CPU, local spec) loads
the output by its own names and shapes and gives the HF model's logits. The inverse profile gives
the saved files back byte for byte. Skipped without ``megatron-core`` or ``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_convert_cli import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (pip install megatron-core)", allow_module_level=True)
from safetensors.torch import load_file  # noqa: E402

HELPER = Path(__file__).resolve().parent / "dcp_helpers" / "megatron_gpt_forward.py"
COMMON = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {"llama": ("LlamaConfig", {}), "qwen2": ("Qwen2Config", {}), "qwen3": ("Qwen3Config", {"head_dim": 32})}
PROFILE = ("--transforms", "hf-to-megatron-gpt")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per family: the saved HF tensors and config, reshard's Megatron tensors, the dirs, and
    what megatron-core's GPTModel made of them."""
    root = tmp_path_factory.mktemp("megaqwen")
    out: dict[str, Any] = {}
    pairs: list[str] = []
    for family, (cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, cls)(**(COMMON | extra))
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # random values everywhere (norms start at ones, biases at zeros)
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
        src, meg = root / family, root / f"{family}-megatron"
        model.save_pretrained(src)
        p = run("convert", str(src), str(meg), *PROFILE, "--consolidate")
        assert p.returncode == 0, p.stderr
        out[family] = {
            "src": src,
            "meg": meg,
            "hf": load_file(str(src / "model.safetensors")),
            "got": load_file(str(meg / "model.safetensors")),
            "cfg": json.loads((src / "config.json").read_text()),
        }
        pairs += [str(src), str(meg)]
    result = root / "megatron.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(result), *pairs], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    for family, doc in json.loads(result.read_text()).items():
        out[family]["megatron"] = doc
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_megatron_gpt_model_loads_the_output_and_gives_the_hf_logits(converted: dict[str, Any], family: str) -> None:
    """megatron-core's GPTModel (add_qkv_bias for Qwen2, qk_layernorm for Qwen3) takes every tensor
    by its own name and shape, and computes the HF model's logits (was: exit 2, no rule for the
    biases / q_norm / k_norm)."""
    doc = converted[family]["megatron"]
    assert doc["keys_missing"] == [] and doc["keys_unexpected"] == [], doc
    assert doc["padded_logits_max"] == 0.0  # the padded vocab rows are zeros
    assert doc["max_abs_diff"] <= 1e-5 * max(1.0, doc["logits_scale"]), doc


def test_qwen2_fused_bias_is_grouped_per_query_group(converted: dict[str, Any]) -> None:
    """linear_qkv.bias = per KV group g: [q biases of g's heads, k_g, v_g] (Bridge merge_qkv_bias)."""
    c = converted["qwen2"]
    hf, got, cfg = c["hf"], c["got"], c["cfg"]
    kv = cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    per = cfg["num_attention_heads"] // kv
    for i in range(cfg["num_hidden_layers"]):
        q, k, v = (hf[f"model.layers.{i}.self_attn.{x}_proj.bias"] for x in "qkv")
        qg, kg, vg = q.split(per * hd), k.split(hd), v.split(hd)
        want = torch.cat([torch.cat([qg[g], kg[g], vg[g]]) for g in range(kv)])
        fused = got[f"decoder.layers.{i}.self_attention.linear_qkv.bias"]
        assert not torch.equal(want, torch.cat([q, k, v]))  # the grouping is visible in this model
        assert torch.equal(fused, want), i
    assert not any(".bias" in n and "linear_qkv" not in n for n in got)


def test_qwen3_qk_norms_become_megatron_qk_layernorms(converted: dict[str, Any]) -> None:
    c = converted["qwen3"]
    hf, got = c["hf"], c["got"]
    for i in range(c["cfg"]["num_hidden_layers"]):
        for x in "qk":
            want = hf[f"model.layers.{i}.self_attn.{x}_norm.weight"]
            assert torch.equal(got[f"decoder.layers.{i}.self_attention.{x}_layernorm.weight"], want), (i, x)
    assert not any("q_norm" in n or "k_norm" in n for n in got)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inverse_gives_the_saved_files_back(converted: dict[str, Any], family: str, tmp_path: Path) -> None:
    c = converted[family]
    back = tmp_path / "back"
    p = run("convert", str(c["meg"]), str(back), *PROFILE, "--inverse", "--model-config",
            str(c["src"] / "config.json"), "--consolidate")  # fmt: skip
    assert p.returncode == 0, p.stderr
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(c["hf"])
    for name, t in c["hf"].items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name
    p = run("verify", str(c["src"]), str(c["meg"]), *PROFILE)
    assert p.returncode == 0, p.stdout + p.stderr
