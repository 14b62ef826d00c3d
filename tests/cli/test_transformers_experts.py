"""The fused-experts profiles against transformers itself.

transformers >= 5 saves MoE experts one tensor per expert but holds them fused in memory
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]``, ``mlp.experts.down_proj`` ``[E, D, F]``), as its
loader's weight converters build them. The oracle: a tiny random Mixtral / Qwen3-MoE saved
with ``save_pretrained`` and loaded back with ``from_pretrained``; its ``state_dict()`` must be,
bit for bit, what ``reshard convert --transforms PROFILE`` writes from the saved files, and
``--inverse`` must give the saved files back byte for byte. Expert-parallel output of the
fused tensors is checked against torch's own split of the oracle's tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_convert_cli import run

transformers = pytest.importorskip("transformers", reason="the oracle is transformers' own loader")

FAMILIES = {
    "mixtral-to-transformers-experts": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3-moe-to-transformers-experts": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 12, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
}


def _saved(tmp_path: Path, profile: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random model saved per expert, and transformers' in-memory state dict of it."""
    cfg_cls, model_cls, extra = FAMILIES[profile]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # random values everywhere (norms start at ones)
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    src = tmp_path / "saved"
    model.save_pretrained(src)
    loaded = getattr(transformers, model_cls).from_pretrained(src)
    return src, {k: v.detach().clone() for k, v in loaded.state_dict().items()}


@pytest.mark.parametrize("profile", sorted(FAMILIES))
def test_fused_experts_equal_transformers_own_loading_and_invert(tmp_path: Path, profile: str) -> None:
    src, want = _saved(tmp_path, profile)
    saved = load_file(str(src / "model.safetensors"))
    assert any(".experts.0." in n for n in saved)  # per expert on disk, fused in memory
    out = tmp_path / "fused"
    p = run("convert", str(src), str(out), "--transforms", profile, "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    back = tmp_path / "back"
    p = run("convert", str(out), str(back), "--transforms", profile, "--inverse", "--consolidate")
    assert p.returncode == 0, p.stderr  # the fused output carries the model's config.json
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(saved)
    assert all(torch.equal(again[n], t) for n, t in saved.items())
    # straight to expert parallel: the fused experts S(0) over ep=2, the rest replicated
    (tmp_path / "ep.yaml").write_text(
        'mesh: {ep: 2}\nplacements:\n  "*.mlp.experts.*": {ep: S(0)}\n  "*": R\n'
    )
    ep = tmp_path / "ep"
    p = run(
        "convert", str(src), str(ep), "--transforms", profile, "--target-layout", str(tmp_path / "ep.yaml")
    )
    assert p.returncode == 0, p.stderr
    for r in range(2):
        local = load_file(str(ep / f"rank-{r:05d}-of-00002.safetensors"))
        for n, t in want.items():
            expect = t.chunk(2, 0)[r] if ".mlp.experts." in n else t
            assert torch.equal(local[n], expect), (r, n)
