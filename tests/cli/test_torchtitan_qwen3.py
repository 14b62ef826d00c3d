"""HF Qwen3 / Qwen3-MoE as ``save_pretrained`` writes them -> torchtitan's names as a DCP
checkpoint (what torchtitan loads), through the CLI.

Oracles: torchtitan's own ``Qwen3StateDictAdapter.from_hf`` on the saved tensors (its
installed source, see tests/unit/test_transform_profiles.py), and torch's own DCP reader
(``dcp_to_torch_save``) for what reshard wrote; ``--inverse`` gives the saved tensors back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_convert_cli import run
from tests.unit.test_transform_profiles import torchtitan_qwen3_adapter

transformers = pytest.importorskip("transformers", reason="the source is transformers' own save_pretrained")


@pytest.mark.parametrize(("moe", "tied"), [(False, False), (True, False), (False, True)])
def test_qwen3_to_torchtitan_dcp_equals_torchtitans_from_hf(tmp_path: Path, moe: bool, tied: bool) -> None:
    """Dense and MoE Qwen3, and a tied one (Qwen3-0.6B's tie_word_embeddings: no lm_head in the
    saved files; torchtitan's from_hf with enable_weight_tying copies the embedding into it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    common = dict(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied,
    )  # fmt: skip
    if moe:  # layer 1 dense (mlp_only_layers), as Qwen3-MoE configs may have
        cfg = transformers.Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=12, decoder_sparse_step=1, mlp_only_layers=[1]
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    torch.manual_seed(0)
    with torch.no_grad():  # random values everywhere (norms start at ones)
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    src = tmp_path / "saved"
    model.save_pretrained(src)
    saved = load_file(str(src / "model.safetensors"))
    assert ("model.layers.0.mlp.experts.3.down_proj.weight" in saved) is moe
    assert ("lm_head.weight" in saved) is not tied
    sizes = {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16, "num_hidden_layers": 2}
    cfg = sizes | ({"num_experts": 4} if moe else {})
    adapter = torchtitan_qwen3_adapter(cfg, dense_layers=(1,), tied=tied)
    want = adapter.from_hf(dict(saved))

    dcp = tmp_path / "titan"
    p = run("convert", str(src), str(dcp), "--transforms", "hf-to-torchtitan-qwen3", "--to", "dcp")
    assert p.returncode == 0, p.stderr
    dcp_to_torch_save(str(dcp), str(tmp_path / "titan.pt"))
    got = torch.load(tmp_path / "titan.pt", weights_only=True)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    back = tmp_path / "back"
    p = run(
        "convert", str(dcp), str(back), "--transforms", "hf-to-torchtitan-qwen3", "--inverse",
        "--consolidate", "--config-from", str(src), "--model-config", str(src / "config.json"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(saved)
    for name, t in saved.items():
        assert torch.equal(again[name], t), name
