"""The transform profiles judged on models the bundled tests do not build: tiny random models of
more families, saved by transformers' own ``save_pretrained``, converted by the ``reshard`` CLI,
and compared with torch ops on the saved tensors (the fused layouts vLLM and Megatron document)
and with transformers' own loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_convert_cli import run

transformers = pytest.importorskip("transformers", reason="the sources are transformers' own save_pretrained")

COMMON = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def saved(tmp_path: Path, cls: str, **extra: object) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random model of config class ``cls`` saved by ``save_pretrained``, and its tensors."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**(COMMON | extra)))
    with torch.no_grad():  # random values everywhere (norms start at ones)
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    src = tmp_path / cls
    model.save_pretrained(src)
    return src, load_file(str(src / "model.safetensors"))


def _pad(t: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = -(-t.shape[0] // multiple) * multiple
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# Qwen3 (head_dim 128 with hidden 1024 and 16 heads in Qwen3-0.6B) and Gemma (head_dim 256 with
# hidden 3072 and 16 heads in Gemma-7B): q_proj has heads*head_dim rows, not hidden_size rows.
HEAD_DIM_FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma": ("GemmaConfig", {"head_dim": 32}),
    "llama": ("LlamaConfig", {"head_dim": 32}),
}


@pytest.mark.parametrize("family", sorted(HEAD_DIM_FAMILIES))
def test_fused_qkv_profiles_take_head_dim_from_the_config(tmp_path: Path, family: str) -> None:
    """head_dim != hidden_size / num_attention_heads: hf-to-vllm at TP-2 and hf-to-megatron-gpt
    fuse q/k/v with the model's own head_dim (was: exit 2, sizes computed from hidden_size)."""
    cls, extra = HEAD_DIM_FAMILIES[family]
    src, hf = saved(tmp_path, cls, **extra)
    cfg = json.loads((src / "config.json").read_text())
    hd, kv = cfg["head_dim"], cfg["num_key_value_heads"]
    assert hd * cfg["num_attention_heads"] != cfg["hidden_size"]

    vllm = tmp_path / "vllm"
    p = run("convert", str(src), str(vllm), "--transforms", "hf-to-vllm", "--set", "tp=2", "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(vllm / "model.safetensors"))
    for i in range(2):
        at = f"model.layers.{i}."
        q, k, v = (hf[f"{at}self_attn.{x}_proj.weight"] for x in "qkv")
        # vLLM TP-2: rank r holds [q_r; k_r; v_r] (2 KV heads, one a rank); the ranks in order
        want = torch.cat([torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]]) for r in range(2)])
        assert torch.equal(got[at + "self_attn.qkv_proj.weight"], want), i
        gate, up = hf[at + "mlp.gate_proj.weight"], hf[at + "mlp.up_proj.weight"]
        want = torch.cat([torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]) for r in range(2)])
        assert torch.equal(got[at + "mlp.gate_up_proj.weight"], want), i
    assert torch.equal(got["model.embed_tokens.weight"], _pad(hf["model.embed_tokens.weight"], 64))
    back = tmp_path / "vllm-back"
    p = run("convert", str(vllm), str(back), "--transforms", "hf-to-vllm", "--set", "tp=2", "--inverse",
            "--consolidate")  # fmt: skip
    assert p.returncode == 0, p.stderr
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(hf) and all(torch.equal(again[n], t) for n, t in hf.items())

    meg = tmp_path / "megatron"
    p = run("convert", str(src), str(meg), "--transforms", "hf-to-megatron-gpt", "--consolidate")
    assert p.returncode == 0, p.stderr  # Qwen3's q_norm/k_norm: Megatron's q/k layernorms
    got = load_file(str(meg / "model.safetensors"))
    if family == "qwen3":
        for i in range(2):
            for x in "qk":
                want = hf[f"model.layers.{i}.self_attn.{x}_norm.weight"]
                assert torch.equal(got[f"decoder.layers.{i}.self_attention.{x}_layernorm.weight"], want)
    for i in range(2):
        at = f"model.layers.{i}.self_attn."
        q, k, v = (hf[f"{at}{x}_proj.weight"] for x in "qkv")
        per = cfg["num_attention_heads"] // kv  # Megatron: per KV group g, [q heads of g, k_g, v_g]
        qg, kg, vg = q.split(per * hd), k.split(hd), v.split(hd)
        want = torch.cat([torch.cat([qg[g], kg[g], vg[g]]) for g in range(kv)])
        assert torch.equal(got[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], want), i


def test_get_reads_a_key_when_given_else_its_default() -> None:
    """``get(KEY, DEFAULT)``: --set / config.json's KEY, else (absent or null) DEFAULT; misuse refused."""
    from reshard.errors import ConfigError
    from reshard.transforms import apply, parse_transforms_text

    text = (
        "config: {head_dim: 'get(head_dim, hidden_size // num_attention_heads)'}\n"
        "transforms:\n  - split: {from: w, to: [a, b], sizes: [head_dim, 2*head_dim]}\n"
    )
    spec = parse_transforms_text(text)
    shapes = {"w": (48, 4)}
    for cfg in ({"hidden_size": 64, "num_attention_heads": 4}, {"hidden_size": 64, "num_attention_heads": 4,
                                                                "head_dim": None}):  # fmt: skip
        assert apply(spec, shapes, config=cfg)["a"].shape == (16, 4)
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 8}
    with pytest.raises(ConfigError, match="sizes"):  # 8 + 16 rows, not 48
        apply(spec, shapes, config=cfg)
    assert apply(spec, {"w": (24, 4)}, config=cfg)["a"].shape == (8, 4)
    assert apply(spec.with_values({"head_dim": 16}), shapes, config=cfg)["a"].shape == (16, 4)
    for bad in ("get(1, 2)", "get(head_dim)", "get(head_dim, 1, 2)"):
        with pytest.raises(ConfigError, match=r"get\(KEY, DEFAULT\)"):
            apply(parse_transforms_text(text.replace(spec.config[0][1], bad)), shapes, config=cfg)
    with pytest.raises(ConfigError, match="head_dim must be an integer"):
        apply(spec, shapes, config={**cfg, "head_dim": "8"})


def test_a_profile_warns_for_a_model_type_it_does_not_list(tmp_path: Path) -> None:
    """hf-to-torchtitan-llama converts a Gemma (RMSNorm by 1 + w, embeddings scaled: not what
    torchtitan's llama3 computes) with exit 0, as before, but now says so on stderr naming the
    profile, the model_type and the listed ones; a Llama gets no such warning. verify, plan and
    --inverse (config from --model-config) say it too."""
    gemma, _ = saved(tmp_path, "GemmaConfig", head_dim=16)
    llama, _ = saved(tmp_path, "LlamaConfig")
    assert json.loads((gemma / "config.json").read_text())["model_type"] == "gemma"
    profile = ("--transforms", "hf-to-torchtitan-llama")
    warning = "profile hf-to-torchtitan-llama is made for model_type llama, mistral; the model config says "
    warning += "model_type 'gemma'"

    p = run("convert", str(gemma), str(tmp_path / "tt"), *profile, "--consolidate")
    assert p.returncode == 0, p.stderr
    assert f"warning: {gemma / 'config.json'}: {warning}" in p.stderr
    assert p.stderr.count("made for model_type") == 1
    p = run("verify", str(gemma), str(tmp_path / "tt"), *profile)
    assert p.returncode == 0 and warning in p.stderr, p.stderr
    p = run("plan", str(gemma), *profile, "--consolidate")
    assert p.returncode == 0 and warning in p.stderr, p.stderr
    back = ("--inverse", "--model-config", str(gemma / "config.json"), "--consolidate")
    p = run("convert", str(tmp_path / "tt"), str(tmp_path / "back"), *profile, *back)
    assert p.returncode == 0 and warning in p.stderr, p.stderr
    p = run("convert", str(gemma), str(tmp_path / "tt2"), *profile, "--consolidate", "--json")
    assert p.returncode == 0 and any(warning in w for w in json.loads(p.stdout)["warnings"]), p.stdout

    for cmd in (("convert", str(llama), str(tmp_path / "tt-llama"), *profile, "--consolidate"),
                ("verify", str(llama), str(tmp_path / "tt-llama"), *profile)):  # fmt: skip
        p = run(*cmd)
        assert p.returncode == 0, p.stderr
        assert "made for model_type" not in p.stderr and "warning" not in p.stderr, p.stderr
