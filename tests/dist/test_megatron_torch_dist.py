"""Real Megatron-Core ``GPTModel`` torch_dist checkpoints -> Hugging Face in one pass (``hf-to-megatron-torch-dist``).

Tiny random Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models (hidden 64, 2 layers, 4 heads over 2 KV groups, vocab 100, so Megatron's
embedding is padded to 128) are saved by transformers' ``save_pretrained``, converted to per-layer Megatron
names by ``hf-to-megatron-gpt`` and loaded into megatron-core 0.16's own ``GPTModel`` (local spec, CPU), which
``dist_checkpointing.save`` writes as ``torch_dist`` in a 2-rank gloo world at TP=1 (two DP replicas), then,
after Megatron's own ``dist_checkpointing.load`` into the TP=2 model, at TP=2
(``dcp_helpers/save_megatron_gpt.py``). Oracles: the saved HF files (byte for byte, and their logits through
``from_pretrained``), Megatron's own save of the model (for the forward direction), torch's
``dcp_to_torch_save``. Skipped without ``megatron-core`` or ``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_convert_cli import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (pip install megatron-core)", allow_module_level=True)
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.dist

HELPER = Path(__file__).resolve().parent / "dcp_helpers" / "save_megatron_gpt.py"
LOADER = Path(__file__).resolve().parent / "dcp_helpers" / "load_megatron_gpt.py"
LAYOUT = Path(__file__).resolve().parents[2] / "reshard" / "configs" / "llama-tp.yaml"
COMMON = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {"llama": ("LlamaConfig", {}), "qwen2": ("Qwen2Config", {}), "qwen3": ("Qwen3Config", {"head_dim": 32})}
PROFILE = ("--transforms", "hf-to-megatron-torch-dist")
MEGATRON_TP2 = """\
mesh: {tp: 2}
placements:
  "decoder.layers.self_attention.linear_qkv.weight": {tp: S(1)}
  "decoder.layers.self_attention.linear_proj.weight": {tp: S(2)}
  "decoder.layers.mlp.linear_fc2.weight": {tp: S(2)}
  "embedding.word_embeddings.weight": {tp: S(0)}
  "output_layer.weight": {tp: S(0)}
  "*": R
"""  # Megatron's TP-2 boxes (fc1's [gate; up] halves are not one S(1): replicated here)
LAYER_KEYS = {  # what GPTModel.sharded_state_dict() stacks on the layer axis; + Qwen3's q/k layernorms
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.self_attention.linear_proj.weight",
    "decoder.layers.mlp.linear_fc1.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.mlp.linear_fc2.weight",
}
OWN = {  # Qwen2's q/k/v biases in the fused bias, Qwen3's q/k layernorms
    "llama": set(),
    "qwen2": {"decoder.layers.self_attention.linear_qkv.bias"},
    "qwen3": {"decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.self_attention.k_layernorm.weight"},
}
EXTRA = {
    f"decoder.layers.{m}._extra_state/shard_{i}_2"
    for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    for i in range(2)
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per family: the HF dir and tensors, Megatron's torch_dist dirs at TP 1 and 2, and what their
    .metadata says."""
    root = tmp_path_factory.mktemp("megadist")
    out: dict[str, Any] = {}
    args: list[str] = []
    for family, (cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**(COMMON | extra)))
        with torch.no_grad():  # random values everywhere (norms start at ones)
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
        src, meg, dist = root / family, root / f"{family}-megatron", root / f"{family}-dist"
        model.save_pretrained(src)
        p = run("convert", str(src), str(meg), "--transforms", "hf-to-megatron-gpt", "--consolidate", "--quiet")
        assert p.returncode == 0, p.stderr
        out[family] = {
            "src": src, "meg": meg, "hf": load_file(str(src / "model.safetensors")), 1: dist, 2: root / f"{dist.name}-tp2",
        }  # fmt: skip
        args += [str(src), str(meg), str(dist)]
    for family, doc in gloo_helper(HELPER, root / "saved.json", args).items():
        c = out[family]
        c["tp2_equal"] = doc["tp2_equal"]
        c["meta"] = {tp: doc[str(c[tp])] for tp in (1, 2)}
    return out


def gloo_helper(script: Path, result: Path, args: list[str]) -> dict[str, Any]:
    """Run a helper's 2-rank gloo world on ``args`` (HF, Megatron, DCP directory triples); what it
    wrote to ``result``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(script), str(result), *args], capture_output=True, text=True, timeout=300, env=env
    )
    errors = "".join(p.read_text() for p in result.parent.glob(f"{result.name}.error-*"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:] + errors
    doc: dict[str, Any] = json.loads(result.read_text())
    return doc


def inverse(c: dict[str, Any], src: Path, dst: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run(
        "convert", str(src), str(dst), *PROFILE, "--inverse", "--model-config", str(c["src"] / "config.json"), *extra
    )


def torch_dcp(ck: Path, tmp: Path) -> dict[str, Any]:
    """What torch's own dcp_to_torch_save reads from a DCP directory (tensors only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(ck, tmp / f"{ck.name}.pt")
    got = torch.load(tmp / f"{ck.name}.pt", weights_only=False)
    return {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_what_gpt_model_saves(saved: dict[str, Any], family: str) -> None:
    """The facts the profile is written for, read from Megatron's own .metadata: per-layer tensors
    stacked [L, ...] under TransformerEngine's norm names (the local spec maps input_layernorm and
    pre_mlp_layernorm to them), fc1 as [gate; up] (two boxes per rank), vocab padded to 128, one
    _extra_state byte item per linear layer and layer; TP=2 only cuts the same tensors finer."""
    c = saved[family]
    assert c["tp2_equal"]  # Megatron's own TP=1 -> TP=2 load gives each rank its slice
    want = LAYER_KEYS | OWN[family]
    for tp in (1, 2):
        meta = c["meta"][tp]
        tensors = {k: v for k, v in meta.items() if v != "bytes"}
        assert set(tensors) == want | {
            "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        }, sorted(tensors)  # fmt: skip
        assert {k for k, v in meta.items() if v == "bytes"} == EXTRA
        hf = c["hf"]
        assert tensors["embedding.word_embeddings.weight"][0] == [128, 64]
        for key in want:
            assert tensors[key][0][0] == 2, key  # the layer axis
        qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"][0]
        q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
        assert qkv == [2, q.shape[0] + 2 * k.shape[0], 64]
        assert tensors["decoder.layers.mlp.linear_fc1.weight"][2] == 4 * tp  # [gate; up] boxes per layer and rank
        assert tensors["decoder.layers.self_attention.linear_proj.weight"][2] == 2 * tp


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_dist_to_hf_in_one_pass(saved: dict[str, Any], family: str, tp: int, tmp_path: Path) -> None:
    """--inverse unstacks the layers, splits the query groups and [gate; up], unpads the vocab and
    renames: the saved HF files come back byte for byte, with their config, and from_pretrained
    gives the model's logits; the _extra_state items are listed as not converted."""
    c = saved[family]
    out = tmp_path / "hf"
    p = inverse(c, c[tp], out, "--consolidate", "--config-from", str(c["src"]), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {n["name"] for n in doc["not_converted"]} == EXTRA
    assert_same(load_file(str(out / "model.safetensors")), c["hf"])
    assert (out / "config.json").read_bytes() == (c["src"] / "config.json").read_bytes()
    if tp == 1:  # the same bytes at TP 2: the logits once per family
        tokens = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = transformers.AutoModelForCausalLM.from_pretrained(c["src"]).eval()(tokens).logits
            got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits
        assert torch.equal(got, want)
    p = run("verify", str(c["src"]), str(c[tp]), *PROFILE)
    assert p.returncode == 0, p.stdout + p.stderr


def test_torch_dist_tp2_to_hf_names_at_tp2_dcp(saved: dict[str, Any], tmp_path: Path) -> None:
    """The same transforms composed with a TP-2 target layout, written as DCP, in one pass: torch
    reads back the HF tensors, q_proj cut in two boxes."""
    c = saved["qwen3"]
    out = tmp_path / "tp2"
    p = inverse(c, c[2], out, "--target-layout", str(LAYOUT), "--target-mesh", "tp=2", "--to", "dcp", "--quiet")
    assert p.returncode == 0, p.stderr
    assert_same(torch_dcp(out, tmp_path), c["hf"])
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    chunks = md["model.layers.1.self_attn.q_proj.weight"].chunks  # type: ignore[union-attr]
    assert sorted(tuple(ch.offsets) for ch in chunks) == [(0, 0), (64, 0)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_profile_writes_what_megatron_saves(saved: dict[str, Any], family: str, tmp_path: Path) -> None:
    """HF -> torch_dist names at TP 2 (--to dcp) in one pass: the tensors torch reads from it are
    those of Megatron's own save, at either TP."""
    c = saved[family]
    layout = tmp_path / "megatron-tp2.yaml"
    layout.write_text(MEGATRON_TP2)
    out = tmp_path / "dist"
    p = run("convert", str(c["src"]), str(out), *PROFILE, "--target-layout", str(layout), "--to", "dcp", "--quiet")
    assert p.returncode == 0, p.stderr
    got = torch_dcp(out, tmp_path)
    assert_same(got, torch_dcp(c[1], tmp_path))
    assert_same(got, torch_dcp(c[2], tmp_path))


def test_megatron_loads_the_forward_output(saved: dict[str, Any], tmp_path: Path) -> None:
    """Megatron-Core's own dist_checkpointing.load opens what HF -> torch_dist (--to dcp) writes:
    metadata.json and common.pt make the directory a torch_dist checkpoint to it, and at TP 2 every
    parameter of its GPTModel is the slice of the HF weights Megatron's layers hold. Loaded with
    Megatron's default strictness: the layers' _extra_state objects Megatron asks for are there
    (those its own save writes, plus the attention kernel's of TransformerEngine's spec), each
    holding what Megatron's local layers save, [None]."""
    from torch.distributed.checkpoint import FileSystemReader

    layout = tmp_path / "megatron-tp2.yaml"
    layout.write_text(MEGATRON_TP2)
    args: list[str] = []
    for family in sorted(FAMILIES):
        c = saved[family]
        out = tmp_path / family
        p = run("convert", str(c["src"]), str(out), *PROFILE, "--target-layout", str(layout), "--to", "dcp", "--quiet")
        assert p.returncode == 0, p.stderr
        megatron_config = json.loads((c[1] / "metadata.json").read_text())
        assert json.loads((out / "metadata.json").read_text()) == megatron_config  # Megatron's own words
        assert torch.load(out / "common.pt") == {} == torch.load(c[1] / "common.pt")
        md = FileSystemReader(str(out)).read_metadata().state_dict_metadata  # still a plain DCP to torch
        kernel = {f"decoder.layers.self_attention.core_attention._extra_state/shard_{i}_2" for i in range(2)}
        assert {k for k, v in md.items() if type(v).__name__ == "BytesStorageMetadata"} == EXTRA | kernel
        if family == "llama":  # what torch.load gives of each: Megatron's local layers' [None]
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_to_torch_save(out, tmp_path / "all.pt")
            got = torch.load(tmp_path / "all.pt", weights_only=True)
            assert {k: v for k, v in got.items() if "/shard_" in k} == dict.fromkeys(EXTRA | kernel, [None])
        check = run("inspect", str(out), "--check")
        assert check.returncode == 0, check.stderr  # reshard.json lists the two files with checksums
        args += [str(c["src"]), str(c["meg"]), str(out)]
    for family, doc in gloo_helper(LOADER, tmp_path / "loaded.json", args).items():
        assert doc["distributed"], family
        assert doc["equal"] and doc["checked"] > 20, (family, doc)


def test_a_torch_dist_checkpoint_resharded_stays_one_megatron_opens(saved: dict[str, Any], tmp_path: Path) -> None:
    """Megatron's own TP-1 save resharded by reshard (--to dcp, no transforms): its metadata.json
    and common.pt are copied as they are, byte for byte, beside the new files."""
    c = saved["llama"]
    layout = tmp_path / "megatron-tp2.yaml"
    layout.write_text(MEGATRON_TP2)
    out = tmp_path / "resharded"
    p = run("convert", str(c[1]), str(out), "--target-layout", str(layout), "--to", "dcp", "--quiet")
    assert p.returncode == 0, p.stderr
    for name in ("metadata.json", "common.pt"):
        assert (out / name).read_bytes() == (c[1] / name).read_bytes(), name
    assert_same(torch_dcp(out, tmp_path), torch_dcp(c[1], tmp_path))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "vocab_multiple=256"), "size 100 pads to 256"),  # the run padded to 128
        (("--set", "layers=3"), 'has 2 along dim 0, count: says 3'),
    ],
)
def test_a_mismatched_model_exits_2_writing_nothing(
    saved: dict[str, Any], tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    c = saved["llama"]
    out = tmp_path / "hf"
    p = inverse(c, c[1], out, "--consolidate", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "hf-to-megatron-torch-dist.yaml" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
