"""HF Mistral (transformers' ``save_pretrained``) through the Llama-named profiles, which list
``mistral`` among their families: Mistral's weights have Llama's names, shapes and rotate-half
RoPE (its sliding window is config, no weight carries it).

Oracles: torchtitan's own ``Llama3StateDictAdapter.from_hf`` on the saved tensors for
``hf-to-torchtitan-llama``; torch's ``cat`` of q/k/v and gate/up (vLLM's ``qkv_proj`` and
``gate_up_proj``) for ``hf-to-vllm``. Neither warns about the model's family, and each inverts
to the saved file byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_convert_cli import run

transformers = pytest.importorskip("transformers", reason="the source is transformers' own save_pretrained")

SIZES = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


@pytest.fixture
def mistral(tmp_path: Path) -> Path:
    cfg = transformers.MistralConfig(
        **SIZES, max_position_embeddings=64, sliding_window=32, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    src = tmp_path / "mistral"
    model.save_pretrained(src)
    return src


def _round_trip(src: Path, out: Path, profile: str) -> dict[str, torch.Tensor]:
    p = run("convert", str(src), str(out), "--transforms", profile, "--consolidate")
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr, p.stderr  # mistral is one of the profile's families
    back = out.with_name(out.name + "-back")
    p = run("convert", str(out), str(back), "--transforms", profile, "--inverse", "--consolidate")
    assert p.returncode == 0, p.stderr
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    return load_file(str(out / "model.safetensors"))


def test_mistral_to_torchtitan_equals_torchtitans_adapter(mistral: Path, tmp_path: Path) -> None:
    from tests.unit.test_transform_profiles import torchtitan_llama3_adapter

    saved = load_file(str(mistral / "model.safetensors"))
    want = torchtitan_llama3_adapter(SIZES).from_hf(dict(saved))
    got = _round_trip(mistral, tmp_path / "tt", "hf-to-torchtitan-llama")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.contiguous()), name


def test_mistral_to_vllm_fuses_as_torch_cat(mistral: Path, tmp_path: Path) -> None:
    saved = load_file(str(mistral / "model.safetensors"))
    got = _round_trip(mistral, tmp_path / "vllm", "hf-to-vllm")
    for i in range(SIZES["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = torch.cat([saved[a + f"{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(got[a + "qkv_proj.weight"], qkv)
        gate_up = torch.cat([saved[m + "gate_proj.weight"], saved[m + "up_proj.weight"]])
        assert torch.equal(got[m + "gate_up_proj.weight"], gate_up)
