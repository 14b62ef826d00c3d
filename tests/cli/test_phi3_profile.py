"""HF Phi-3 as ``save_pretrained`` writes it -> Llama's names with the ``phi3-to-llama`` profile,
through the CLI.

Oracle: transformers' own models. The converted tensors go into a ``LlamaForCausalLM`` built from
the same sizes (``load_state_dict(strict=True)``: every name and shape must fit) and its logits
are compared with the ``Phi3ForCausalLM`` that was saved. ``--inverse`` must give the saved file
back byte for byte, and a TP-2 ``llama-tp`` target in the same pass must hold on each rank
``torch.chunk`` of the split tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_convert_cli import run

transformers = pytest.importorskip("transformers", reason="the source is transformers' own save_pretrained")

ROPE_THETA = 500.0  # not the default, so a config that dropped it would show in the logits
EPS = 1e-6


def phi3(tmp_path: Path, kv_heads: int, head_dim: int | None) -> tuple[Any, Path]:
    """A tiny random Phi-3 (hidden 64, 2 layers, 4 heads) saved by save_pretrained."""
    extra = {} if head_dim is None else {"head_dim": head_dim}
    cfg = transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=EPS, **extra,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 1.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random values everywhere (norms start at ones)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    src = tmp_path / "phi3"
    model.save_pretrained(src)
    return model, src


def llama_like(phi: Any) -> Any:
    """A LlamaForCausalLM of the Phi-3 config's sizes, rope_theta, rms_norm_eps and tying (no scaling)."""
    c = phi.config
    extra = {"head_dim": c.head_dim} if getattr(c, "head_dim", None) else {}
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"]}, **extra,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def split_saved(saved: dict[str, torch.Tensor], phi: Any) -> dict[str, torch.Tensor]:
    """The saved tensors split by torch as Phi3Attention slices qkv and Phi3MLP chunks gate_up."""
    c = phi.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    sizes = [c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_key_value_heads * hd]
    want = {}
    for name, t in saved.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            for x, part in zip("qkv", torch.split(t, sizes), strict=True):
                want[name.replace("qkv_proj", f"{x}_proj")] = part
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            want[name.replace("gate_up_proj", "gate_proj")] = gate
            want[name.replace("gate_up_proj", "up_proj")] = up
        else:
            want[name] = t
    return want


def logits(model: Any, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    if state is not None:
        model.load_state_dict(state, strict=True)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    ("kv_heads", "head_dim"), [(2, None), (4, None), (2, 8)], ids=["gqa", "mha", "gqa-head_dim-8"]
)
def test_phi3_to_llama_gives_phi3s_logits_in_llama_and_inverts_byte_identically(
    tmp_path: Path, kv_heads: int, head_dim: int | None
) -> None:
    """GQA (2 KV heads of 4), full MHA, and a config.json head_dim (8, not hidden/heads = 16).

    The logits are compared within 1e-6, not exactly: the weights are the same numbers, but Phi-3
    runs one matmul over the fused rows and Llama three (two for gate/up), and nothing promises the
    CPU GEMM sums each output in the same order for the two shapes (here they agree exactly; the
    logits are ~1 in size, so 1e-6 is a few float32 ulps; a wrong split moves them by ~0.1, see
    the swapped gate/up below)."""
    phi, src = phi3(tmp_path, kv_heads, head_dim)
    saved = load_file(str(src / "model.safetensors"))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} < set(saved)

    out = tmp_path / "llama"
    p = run("convert", str(src), str(out), "--transforms", "phi3-to-llama", "--consolidate")
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr  # model_type phi3 is the profile's, no --allow-unused needed
    got = load_file(str(out / "model.safetensors"))
    want = split_saved(saved, phi)
    assert sorted(got) == sorted(want)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in got)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    ref = logits(phi)
    llama = llama_like(phi)
    diff = (logits(llama, got) - ref).abs().max().item()
    assert diff <= 1e-6, diff
    # the comparison sees a wrong split: layer 0's gate and up swapped
    swapped = dict(got)
    g, u = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    swapped[g], swapped[u] = got[u], got[g]
    assert (logits(llama, swapped) - ref).abs().max().item() > 1e-2

    back = tmp_path / "back"
    p = run("convert", str(out), str(back), "--transforms", "phi3-to-llama", "--inverse", "--consolidate")
    assert p.returncode == 0, p.stderr  # out got the Phi-3 config.json: it names the sizes
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_phi3_to_llama_tp2_in_one_pass_and_back(tmp_path: Path) -> None:
    """Split and sharded by llama-tp at TP 2 in one pass: per rank, q/k/v/gate/up, embed_tokens and
    lm_head are torch.chunk(.., 2, 0) of the split tensors, o_proj/down_proj chunk(.., 2, 1), norms whole."""
    phi, src = phi3(tmp_path, 2, None)
    saved = load_file(str(src / "model.safetensors"))
    want = split_saved(saved, phi)

    tp2 = tmp_path / "tp2"
    args = ["--transforms", "phi3-to-llama", "--target-layout", "llama-tp", "--target-mesh", "tp=2"]
    p = run("convert", str(src), str(tp2), *args)
    assert p.returncode == 0, p.stderr
    for r in range(2):
        got = load_file(str(tp2 / f"rank-{r:05d}-of-00002.safetensors"))
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                part = t.chunk(2, dim=1)[r]
            elif t.dim() == 2:
                part = t.chunk(2, dim=0)[r]
            else:
                part = t
            assert torch.equal(got[name], part), (r, name)
        assert got["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)  # one KV head per rank

    # per-rank files carry no config.json: without one the inverse names the size it lacks
    inv = ["--transforms", "phi3-to-llama", "--inverse", "--consolidate"]
    p = run("convert", str(tp2), str(tmp_path / "bad"), *inv)
    assert p.returncode == 2 and "intermediate_size" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "bad").exists()
    back = tmp_path / "back"
    p = run("convert", str(tp2), str(back), *inv, "--model-config", str(src / "config.json"))
    assert p.returncode == 0, p.stderr
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_phi3_to_torchtitan_in_one_pass_equals_two_and_inverts(tmp_path: Path) -> None:
    """``--transforms phi3-to-llama,hf-to-torchtitan-llama`` chains the profiles in one pass: the
    same tensors as the two passes (phi3-to-llama, then hf-to-torchtitan-llama, each checked by
    its own oracle: transformers' logits, torchtitan's adapter), at TP-2 as consolidated; its
    ``--inverse`` gives the saved Phi-3 file back byte for byte."""
    phi, src = phi3(tmp_path, 2, None)
    chain = "phi3-to-llama,hf-to-torchtitan-llama"
    one = tmp_path / "one"
    p = run("convert", str(src), str(one), "--transforms", chain, "--consolidate")
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr  # phi3, the chain's source family
    mid, two = tmp_path / "llama", tmp_path / "two"
    p = run("convert", str(src), str(mid), "--transforms", "phi3-to-llama", "--consolidate")
    assert p.returncode == 0, p.stderr
    p = run("convert", str(mid), str(two), "--transforms", "hf-to-torchtitan-llama", "--consolidate")
    assert p.returncode == 0, p.stderr
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert sorted(a) == sorted(b) and "layers.0.attention.qkv_linear.wq.weight" in a
    for name, t in b.items():
        assert a[name].dtype == t.dtype and torch.equal(a[name].view(torch.uint8), t.view(torch.uint8)), name
    # the torchtitan-named files back to Phi-3 in one pass (their config.json names the sizes)
    back = tmp_path / "back"
    p = run("convert", str(one), str(back), "--transforms", chain, "--inverse", "--consolidate")
    assert p.returncode == 0, p.stderr
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    # sharded in the same pass: each rank of the chain at TP-2 is torch.chunk of the one-pass tensor
    layout = tmp_path / "tt-tp.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.wq.weight": {tp: S(0)}\n  "*": {tp: R}\n')
    tp = tmp_path / "tp2"
    p = run("convert", str(src), str(tp), "--transforms", chain, "--target-layout", str(layout))
    assert p.returncode == 0, p.stderr
    for r in range(2):
        got = load_file(str(tp / f"rank-0000{r}-of-00002.safetensors"))
        want = a["layers.1.attention.qkv_linear.wq.weight"].chunk(2)[r]
        assert torch.equal(got["layers.1.attention.qkv_linear.wq.weight"], want)
    # profiles that give one size name different values are refused, naming it
    other = tmp_path / "other.yaml"
    other.write_text(
        "config:\n  heads: 3\ntransforms:\n  - drop: {tensors: nothing, optional: true}\nallow_unused: true\n"
    )
    no = tmp_path / "no"
    chain2 = ("--transforms", f"phi3-to-llama,{other}", "--consolidate")
    p = run("convert", str(src), str(no), *chain2)
    assert p.returncode == 2 and "config heads" in p.stderr and "--set" in p.stderr, p.stderr
    # ... and, as it says, --set gives the one value (here the model's 4 heads)
    p = run("convert", str(src), str(no), *chain2, "--set", "heads=4")
    assert p.returncode == 0, p.stderr
    split = split_saved(load_file(str(src / "model.safetensors")), phi)
    assert load_file(str(no / "model.safetensors")).keys() == split.keys()
    shutil.rmtree(no)
    p = run("convert", str(src), str(no), "--transforms", "phi3-to-llama,", "--consolidate")
    assert p.returncode == 2 and "between each comma" in p.stderr, p.stderr
    assert not no.exists()
