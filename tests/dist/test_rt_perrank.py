"""Per-rank ``.pt`` checkpoints as their producers write them, converted to Hugging Face output
that transformers' ``from_pretrained`` loads as the original model.

* veRL FSDP2 (``save_verl_llama``: a transformers Llama with tied embeddings, ``fully_shard``,
  veRL's file names beside ``huggingface/`` holding the config): ``--consolidate`` with no
  ``--config-from`` takes the config from ``huggingface/`` (as veRL's own model merger does), the
  output split at ``--max-shard-size`` with its index, and ``--dtype bf16`` rewrites the config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.dist.test_torchrun import SCRIPTS, reshard, torchrun  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl_llama")
    torchrun(2, SCRIPTS / "save_verl_llama.py", out)
    return out


def logits(path: Path, **kw: object) -> tuple[object, object]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
    with torch.no_grad():
        return model.dtype, model(input_ids=torch.tensor([[1, 5, 9, 17, 33, 49]])).logits


def test_verl_checkpoint_to_hf_takes_the_config_from_its_huggingface_dir(verl: Path, tmp_path: Path) -> None:
    ckpt, out = verl / "ckpt", tmp_path / "hf"
    res = reshard("convert", ckpt, out, "--consolidate", "--max-shard-size", "3KB")
    assert "no config.json" not in res.stderr, res.stderr
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (ckpt / "huggingface" / name).read_bytes(), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert "lm_head.weight" in index["weight_map"]  # saved under both names, as the state dict holds it
    _, want = logits(verl / "orig")
    dtype, got = logits(out)
    assert dtype == torch.float32 and torch.equal(got, want)

    bf16 = tmp_path / "bf16"
    reshard("convert", ckpt, bf16, "--consolidate", "--dtype", "bf16", "--quiet")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    dtype, got = logits(bf16)  # no dtype argument: the rewritten config decides
    _, want = logits(verl / "orig", dtype=torch.bfloat16)
    assert dtype == torch.bfloat16 and torch.equal(got, want)
