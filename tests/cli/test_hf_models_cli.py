"""`reshard convert --to hf` outputs load as models: transformers is the oracle.

Tiny Llama (dense) and Mixtral (MoE) models are built and saved by transformers in the
test; the CLI converts them HF -> TP-4 per-rank -> HF (``--config-from`` the original
directory), and HF -> HF ``--dtype bf16``. ``AutoModelForCausalLM.from_pretrained`` of
each output must give the source model's logits bit for bit (bf16: the source loaded
with ``dtype=torch.bfloat16``), and the tokenizer must tokenize as the source's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli.test_as_a_user import run
from tests.io.test_hf_extras import build_model, logits, needs_transformers, offline  # noqa: F401

TP4 = """\
mesh: {tp: 4}
placements:
  "*.self_attn.[qkv]_proj.weight": {tp: S(0)}
  "*.self_attn.o_proj.weight": {tp: S(1)}
  "*.mlp.[gu][ap]*_proj.weight": {tp: S(0)}
  "*.mlp.down_proj.weight": {tp: S(1)}
  "*.experts.*.w[13].weight": {tp: S(0)}
  "*.experts.*.w2.weight": {tp: S(1)}
  "model.embed_tokens.weight": {tp: S(0)}
  "lm_head.weight": {tp: S(0)}
  "*": R
"""

MODEL_FILES = [
    "README.md",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hf_to_tp4_to_hf_and_bf16_load_as_the_source_model(tmp_path: Path, kind: str) -> None:
    import transformers

    src = tmp_path / "src"
    build_model(kind, src)
    assert sorted(p.name for p in src.iterdir()) == sorted([*MODEL_FILES, "model.safetensors"])
    lay = tmp_path / "tp4.yaml"
    lay.write_text(TP4)
    tp4 = tmp_path / "tp4"
    p = run("convert", str(src), str(tp4), "--target-layout", str(lay), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model_files"] == []  # per-rank output: weights only
    assert not (tp4 / "config.json").exists()
    sharded = json.loads(run("inspect", str(tp4), "--json").stdout)["tensors"]
    assert any(t["placements"] == ["S(1)"] for t in sharded) and any(
        t["placements"] == ["S(0)"] for t in sharded
    )

    back = tmp_path / "back"
    p = run("convert", str(tp4), str(back), "--consolidate", "--config-from", str(src), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model_files"] == MODEL_FILES
    for n in MODEL_FILES:
        assert (back / n).read_bytes() == (src / n).read_bytes(), n
    _, want = logits(src)
    dtype, got = logits(back)
    assert dtype == torch.float32 and torch.equal(got, want)

    bf16 = tmp_path / "bf16"
    p = run("convert", str(src), str(bf16), "--to", "hf", "--dtype", "bf16")
    assert p.returncode == 0, p.stderr
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    dtype, got = logits(bf16)  # no dtype argument: the rewritten config decides
    _, want = logits(src, dtype=torch.bfloat16)
    assert dtype == torch.bfloat16 and torch.equal(got, want)
    a = transformers.AutoTokenizer.from_pretrained(str(src))
    b = transformers.AutoTokenizer.from_pretrained(str(bf16))
    assert b("w3 w7 w99 nope")["input_ids"] == a("w3 w7 w99 nope")["input_ids"] == [3, 7, 99, 0]

    bare = tmp_path / "bare"
    p = run("convert", str(tp4), str(bare), "--consolidate")
    assert p.returncode == 0, p.stderr
    assert "no config.json; the hf output holds weights only" in p.stderr and "--config-from DIR" in p.stderr
    assert sorted(x.name for x in bare.iterdir()) == ["model.safetensors", "reshard.json"]


@pytest.mark.parametrize(("config_dtype", "extra", "warned"), [
    ("bfloat16", [], True),  # bf16 in config.json, F32 weights: from_pretrained would cast them
    ("float32", [], False),
    ("bfloat16", ["--dtype", "bf16"], False),  # cast to it: config and weights agree
    ("auto", [], False),
])  # fmt: skip
def test_a_config_naming_another_dtype_than_the_weights_is_warned(
    tmp_path: Path, config_dtype: str, extra: list[str], warned: bool
) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.randn(4, 4), "step": torch.tensor([3])}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": config_dtype}, indent=2))
    p = run("convert", str(src), str(tmp_path / "out"), "--consolidate", "--json", *extra)
    assert p.returncode == 0, p.stderr
    notes = [w for w in json.loads(p.stdout)["warnings"] if "from_pretrained" in w]
    assert len(notes) == warned, notes
    if warned:
        assert f'dtype is "{config_dtype}" but the weights written are F32' in notes[0]
        assert "pass --dtype bf16" in notes[0] and "config.json" in notes[0]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == ("bfloat16" if extra else config_dtype)
