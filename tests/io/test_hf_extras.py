"""HF outputs that load as models; HF weight files chosen as transformers chooses them.

transformers is the oracle: tiny Llama and Mixtral models are built and saved by
``save_pretrained`` in the test, "converted" the way the CLI does (weights
through the safetensors library, optionally cast to bf16, plus
:func:`copy_model_files`), and ``AutoModelForCausalLM.from_pretrained(out)`` must
give the source model's logits bit for bit (the bf16 output: the source loaded
with ``dtype=torch.bfloat16``). Everything runs offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.errors import ConfigError, HeaderError, UsageError, WriteError
from reshard.formats.hf_extras import (
    INDEX,
    SINGLE,
    copy_model_files,
    hf_weight_files,
    model_files,
    rewrite_config_dtype,
    scan_model_files,
)

try:  # a test-only dependency: the file logic is tested without it
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# --- which files --------------------------------------------------------------------


def touch(path: Path, text: str = "x") -> Path:
    path.write_text(text)
    return path


def test_model_files_keeps_config_tokenizer_code_and_no_weights(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    keep = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "modeling_custom.py",
        "LICENSE",
        "README.md",
    ]
    drop = [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        INDEX,
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "optimizer.pt",
        "rng_state.pth",
        "__0_0.distcp",
        ".metadata",
        ".gitattributes",
        "reshard.json",
        "trainer_state.json",
        "config.json.tmp",
    ]
    for n in keep + drop:
        touch(src / n)
    (src / "sub").mkdir()
    touch(src / "sub" / "config.json")
    (src / "dir.json").mkdir()  # a directory with a wanted name is not a file
    victim = touch(tmp_path / "secret.txt", "secret")
    os.symlink(victim, src / "evil.json")
    os.mkfifo(src / "pipe.txt")
    with open(src / "huge.json", "wb") as f:  # sparse: no disk used
        f.truncate(300 * 2**20)
    scan = scan_model_files(src)
    assert [p.name for p in scan.files] == sorted(keep)
    assert all(p.parent == src for p in scan.files)
    reasons = {p.name: why for p, why in scan.skipped}
    assert set(reasons) == {"evil.json", "pipe.txt", "huge.json"}
    assert "symlink" in reasons["evil.json"]
    assert reasons["pipe.txt"] == "not a regular file"
    assert "larger than 256 MiB" in reasons["huge.json"]
    assert model_files(src) == list(scan.files)


def test_hub_cache_links_into_own_blobs_are_followed(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    touch(repo / "blobs" / "f00d", '{"model_type": "llama", "dtype": "float32"}')
    os.symlink("../../blobs/f00d", snap / "config.json")
    outside = touch(tmp_path / "elsewhere.json", "{}")
    os.symlink(outside, snap / "tokenizer.json")
    scan = scan_model_files(snap)
    assert [p.name for p in scan.files] == ["config.json"]
    assert [p.name for p, _ in scan.skipped] == ["tokenizer.json"]
    out = tmp_path / "out"
    out.mkdir()
    [written] = copy_model_files(scan.files, out, dtype="bf16")
    assert not written.is_symlink()
    assert json.loads(written.read_text()) == {"model_type": "llama", "dtype": "bfloat16"}


def test_scan_rejects_non_directory_and_bad_config_early(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a directory"):
        scan_model_files(tmp_path / "missing")
    touch(tmp_path / "config.json", "{not json")
    assert [p.name for p in scan_model_files(tmp_path).files] == ["config.json"]  # no dtype: not parsed
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        scan_model_files(tmp_path, dtype="bf16")


# --- copying ------------------------------------------------------------------------


def test_copy_never_writes_through_planted_links(tmp_path: Path) -> None:
    src = tmp_path / "src"
    dst = tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    touch(src / "tokenizer.json", "tok")
    touch(src / "config.json", '{"torch_dtype": "float32"}')
    victim = touch(tmp_path / "victim", "keep me")
    os.symlink(victim, dst / "tokenizer.json.tmp")  # a stale tmp that is a link
    os.symlink(victim, dst / "config.json")  # an existing output that is a link
    copy_model_files(model_files(src), dst)
    assert victim.read_text() == "keep me"
    assert not (dst / "config.json").is_symlink()
    assert (dst / "config.json").read_text() == '{"torch_dtype": "float32"}'  # no dtype: bytes as they were
    assert (dst / "tokenizer.json").read_text() == "tok"
    # a name reshard does not own is neither written through nor removed (temporaries are fresh names)
    assert (dst / "tokenizer.json.tmp").is_symlink()
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "tokenizer.json", "tokenizer.json.tmp"]


def test_copy_failure_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for n in ("a.json", "b.json", "c.json"):
        touch(src / n)
    files = model_files(src)
    (src / "c.json").unlink()  # gone between scan and copy
    dst = tmp_path / "dst"
    dst.mkdir()
    with pytest.raises(UsageError, match=r"c\.json: cannot be read"):
        copy_model_files(files, dst)
    assert list(dst.iterdir()) == []
    with pytest.raises(WriteError, match="copying a.json failed") as e:
        copy_model_files(files[:1], tmp_path / "no-such-dir")
    assert e.value.exit_code == 3


def test_rewrite_config_dtype_changes_only_dtype() -> None:
    text = json.dumps(
        {
            "b": 1e-06,
            "dtype": "float32",
            "a": [1, 2],
            "torch_dtype": None,
            "text_config": {"dtype": "float32", "vocab": {"dtype": 7}},
            "label2id": {"dtype": 3},
        },
        indent=2,
    )
    out = json.loads(rewrite_config_dtype(text + "\n", "fp16"), object_pairs_hook=list)
    assert out == [
        ("b", 1e-06),
        ("dtype", "float16"),
        ("a", [1, 2]),
        ("torch_dtype", "float16"),
        ("text_config", [("dtype", "float16"), ("vocab", [("dtype", 7)])]),
        ("label2id", [("dtype", 3)]),
    ]
    same = json.dumps({"model_type": "x"}, indent=2) + "\n"
    assert rewrite_config_dtype(same, "bf16") == same
    with pytest.raises(ConfigError, match="not a JSON object"):
        rewrite_config_dtype("[1]", "bf16")
    with pytest.raises(UsageError, match="use bf16, fp16 or fp32"):
        rewrite_config_dtype(same, "int8")
    assert json.loads(rewrite_config_dtype('{"dtype": "float32"}', "BF16"))["dtype"] == "bfloat16"


# --- transformers loads the output --------------------------------------------------


def tiny_config(kind: str) -> Any:
    common: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)


def save_tokenizer(path: Path) -> Any:
    """A word-level tokenizer built offline with the tokenizers library, plus a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    fast.save_pretrained(path)
    return fast


def build_model(kind: str, path: Path) -> None:
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MixtralForCausalLM
    model = cls(tiny_config(kind))
    model.save_pretrained(path)
    save_tokenizer(path)
    touch(path / "README.md", "# tiny\n")


def convert_like_cli(src: Path, out: Path, dtype: str | None) -> None:
    """What `reshard convert SRC OUT --to hf [--dtype bf16]` does, without the CLI
    (the CLI itself: tests/cli/test_hf_models_cli.py)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    scan = scan_model_files(src, dtype=dtype)
    assert scan.skipped == ()
    tensors = load_file(str(src / SINGLE))
    if dtype is not None:
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    copy_model_files(scan.files, out, dtype=dtype)


def logits(path: Path, **kw: Any) -> tuple[Any, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 127]])
    with torch.no_grad():
        return model.dtype, model(input_ids=ids).logits


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hf_output_loads_as_the_same_model(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    build_model(kind, src)
    names = [p.name for p in model_files(src)]
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert not any(n.endswith(".safetensors") for n in names)

    same = tmp_path / "fp32"
    convert_like_cli(src, same, None)
    for n in names:
        assert (same / n).read_bytes() == (src / n).read_bytes(), n
    dtype, got = logits(same)
    _, want = logits(src)
    assert dtype == torch.float32
    assert torch.equal(got, want)

    bf16 = tmp_path / "bf16"
    convert_like_cli(src, bf16, "bf16")
    src_text = (src / "config.json").read_text()
    out_text = (bf16 / "config.json").read_text()
    changed = [(a, b) for a, b in zip(src_text.splitlines(), out_text.splitlines()) if a != b]
    assert changed == [('  "dtype": "float32",', '  "dtype": "bfloat16",')]
    assert len(src_text) - len(out_text) == len('"float32"') - len('"bfloat16"')
    dtype, got = logits(bf16)  # no dtype argument: the rewritten config decides
    _, want = logits(src, dtype=torch.bfloat16)
    assert dtype == torch.bfloat16
    assert torch.equal(got, want)

    a = transformers.AutoTokenizer.from_pretrained(str(src))
    b = transformers.AutoTokenizer.from_pretrained(str(bf16))
    text = "w3 w7 w99 nope w127"
    assert b(text)["input_ids"] == a(text)["input_ids"] == [3, 7, 99, 0, 127]
    chat = [{"role": "user", "content": "w5 w6"}]
    assert b.apply_chat_template(chat, tokenize=False) == a.apply_chat_template(chat, tokenize=False)


# --- which weight files -------------------------------------------------------------


@needs_transformers
def test_single_file_wins_over_index_as_in_transformers(tmp_path: Path) -> None:
    """A directory with both: transformers loads model.safetensors; so does hf_weight_files."""
    from safetensors.torch import load_file, save_file

    one = tmp_path / "one"
    two = tmp_path / "two"
    for i, p in enumerate((one, two)):
        torch.manual_seed(i)
        transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(p)
    both = tmp_path / "both"
    both.mkdir()
    (both / "config.json").write_bytes((one / "config.json").read_bytes())
    save_file(load_file(str(one / SINGLE)), str(both / SINGLE), metadata={"format": "pt"})
    # model two as an index with one shard
    shard = "model-00001-of-00001.safetensors"
    tensors = load_file(str(two / SINGLE))
    save_file(tensors, str(both / shard), metadata={"format": "pt"})
    (both / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, shard)}))

    files, weight_map, warning = hf_weight_files(both)
    assert files == [both / SINGLE] and weight_map is None
    assert warning is not None and SINGLE in warning and INDEX in warning
    _, got = logits(both)
    _, want_one = logits(one)
    _, want_two = logits(two)
    assert torch.equal(got, want_one) and not torch.equal(got, want_two)

    (both / SINGLE).unlink()
    files, weight_map, warning = hf_weight_files(both)
    assert files == [both / shard] and warning is None
    assert weight_map == dict.fromkeys(tensors, shard)
    _, got = logits(both)
    assert torch.equal(got, want_two)


def test_hf_weight_files_errors(tmp_path: Path) -> None:
    touch(tmp_path / "pytorch_model.bin")
    with pytest.raises(HeaderError, match="no model.safetensors or model.safetensors.index.json") as e:
        hf_weight_files(tmp_path)
    assert e.value.hint is not None and "pickle" in e.value.hint
    touch(tmp_path / "weights.safetensors")
    assert hf_weight_files(tmp_path) == ([tmp_path / "weights.safetensors"], None, None)
    touch(tmp_path / INDEX, '{"weight_map": {"w": "../x.safetensors"}}')
    with pytest.raises(HeaderError, match="points outside the checkpoint"):
        hf_weight_files(tmp_path)
    touch(tmp_path / INDEX, '{"weight_map": {"w": "sub/x.safetensors"}}')
    with pytest.raises(HeaderError, match="'sub/x.safetensors' is in a sub-directory; shards are read from"):
        hf_weight_files(tmp_path)
    touch(tmp_path / INDEX, '{"weight_map": {"w": "gone.safetensors"}}')
    with pytest.raises(HeaderError, match="listed in model.safetensors.index.json but missing"):
        hf_weight_files(tmp_path)
    touch(tmp_path / INDEX, '{"weight_map": [1]}')
    with pytest.raises(HeaderError, match="not a valid safetensors index"):
        hf_weight_files(tmp_path)
