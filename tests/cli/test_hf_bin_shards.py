"""transformers' legacy sharded pickle weights: ``pytorch_model-0000i-of-0000N.bin`` with
``pytorch_model.bin.index.json``, read as one consolidated checkpoint (``--from pt``, detected).

transformers < 5 wrote them with ``save_pretrained(dir, safe_serialization=False, max_shard_size=...)``:
the state dict split by ``huggingface_hub.split_torch_state_dict_into_shards`` and each shard
``torch.save``d, tied weights kept under both names in one shard (one storage). transformers 5 only
writes safetensors, so the files here come from ``huggingface_hub.save_torch_state_dict(...,
safe_serialization=False)``, the same split and ``torch.save`` (checked once against transformers
4.57.1's ``save_pretrained``: byte-identical shards; its index adds ``total_parameters``).
transformers 5's ``from_pretrained`` still loads them: it is the oracle, with ``model.state_dict()``.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.test_as_a_user import run
from tests.io.test_hf_extras import needs_transformers, offline  # noqa: F401
from tests.strategies import same_bits
from tests.torchless import convert_without_torch

pytestmark = needs_transformers

Legacy = tuple[Path, Any, dict[str, Any]]
IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 127]])


def save_legacy(path: Path, *, seed: int = 0, trainer_files: bool = True) -> tuple[Any, dict[str, Any]]:
    """A tiny tied-embedding Llama saved as transformers < 5 saved it with safe_serialization=False,
    in >= 3 shards, beside what a Trainer checkpoint holds (training_args.bin, optimizer.pt,
    scheduler.pt, per-process rng_state_{r}.pth, trainer_state.json)."""
    import numpy as np
    import transformers
    from huggingface_hub import save_torch_state_dict

    from tests.tiny_models import config

    cfg = config("llama")
    cfg.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    state = model.state_dict()
    save_torch_state_dict(state, path, safe_serialization=False, max_shard_size="60KB")
    if trainer_files:
        args = transformers.TrainingArguments(output_dir=str(path / "run"), report_to=[])
        torch.save(args, path / "training_args.bin")
        torch.save({"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}, path / "optimizer.pt")
        torch.save({"last_epoch": 3, "_step_count": 4}, path / "scheduler.pt")
        for r in range(2):
            rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
            torch.save(rng, path / f"rng_state_{r}.pth")
        (path / "trainer_state.json").write_text('{"global_step": 4}')
    return model, {k: v.detach().clone() for k, v in state.items()}


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    p = run(*args)
    assert p.returncode == 0, f"reshard {' '.join(args)} -> {p.returncode}\n{p.stderr}"
    return p


def refused(*args: str) -> str:
    p = run(*args)
    assert p.returncode == 2, f"reshard {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr
    return p.stderr


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    src = tmp_path_factory.mktemp("legacy") / "ckpt"
    model, state = save_legacy(src)
    return src, model, state


def test_detected_and_inspected_as_one_consolidated_checkpoint(legacy: Legacy) -> None:
    src, _, state = legacy
    shards = sorted(p.name for p in src.glob("pytorch_model-*-of-*.bin"))
    assert len(shards) >= 3 and (src / "pytorch_model.bin.index.json").is_file()
    doc = json.loads(ok("inspect", str(src), "--check", "--json").stdout)
    assert doc["format"] == "pt" and doc["ok"] is True
    assert doc["mesh"] == {"names": ["world"], "shape": [1]}
    assert sorted(f["name"] for f in doc["files"]) == shards  # not optimizer.pt, rng_state_*
    got = {t["name"]: (t["shape"], t["placements"]) for t in doc["tensors"]}
    assert got == {n: (list(t.shape), ["R"]) for n, t in state.items()}
    assert doc.get("non_tensors", []) == []


@pytest.mark.slow
def test_converts_bit_for_bit_and_loads_as_the_same_model(legacy: Legacy, tmp_path: Path) -> None:
    import transformers

    src, model, state = legacy
    hf = tmp_path / "hf"
    ok("convert", str(src), str(hf), "--consolidate", "--quiet")
    got = load_file(str(hf / "model.safetensors"))
    assert sorted(got) == sorted(state)  # tied: lm_head.weight and embed_tokens both, as saved
    for n, t in state.items():
        assert same_bits(got[n], t), n
    assert (hf / "config.json").is_file()  # the model files travel; training_args.bin does not
    assert not (hf / "training_args.bin").exists() and not (hf / "optimizer.pt").exists()
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        again = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()(input_ids=IDS).logits
        legacy_load = transformers.AutoModelForCausalLM.from_pretrained(str(src)).eval()(input_ids=IDS).logits
    assert torch.equal(again, want) and torch.equal(legacy_load, want)

    tp2 = tmp_path / "tp2"
    ok("convert", str(src), str(tp2), "--target-layout", "llama-tp", "--target-mesh", "tp=2", "--quiet")
    doc = json.loads(ok("inspect", str(tp2), "--json").stdout)
    placements = {t["name"]: t["placements"] for t in doc["tensors"]}
    assert placements["model.layers.0.self_attn.q_proj.weight"] == ["S(0)"]
    assert placements["model.layers.0.self_attn.o_proj.weight"] == ["S(1)"]
    for r in range(2):
        local = load_file(str(tp2 / f"rank-{r:05d}-of-00002.safetensors"))
        assert sorted(local) == sorted(state)
        for n, t in state.items():
            (p,) = placements[n]
            want_local = t if p == "R" else torch.chunk(t, 2, dim=int(p[2:-1]))[r]
            assert same_bits(local[n], want_local), (r, n)
    ok("verify", str(src), str(tp2))
    plan = json.loads(ok("plan", str(src), "--consolidate", "--json").stdout)
    assert plan["source"]["format"] == "pt"


def test_the_read_path_imports_no_torch(legacy: Legacy, tmp_path: Path) -> None:
    src, _, _ = legacy
    res = convert_without_torch(src, tmp_path / "o", "--consolidate")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "model.safetensors").is_file()


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_shard_the_index_names_missing_exits_2_naming_it(legacy: Legacy, tmp_path: Path) -> None:
    src = copy_of(legacy[0], tmp_path / "ckpt")
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (src / gone).unlink()
    err = refused("convert", str(src), str(tmp_path / "out"), "--consolidate")
    assert gone in err and "pytorch_model.bin.index.json but missing" in err
    assert not (tmp_path / "out").exists()
    refused("inspect", str(src))


def test_a_tensor_the_index_names_in_no_file_exits_2_naming_it(legacy: Legacy, tmp_path: Path) -> None:
    src = copy_of(legacy[0], tmp_path / "ckpt")
    path = src / "pytorch_model.bin.index.json"
    index = json.loads(path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first
    path.write_text(json.dumps(index))
    err = refused("convert", str(src), str(tmp_path / "out"), "--consolidate")
    assert '"model.layers.9.mlp.up_proj.weight" is missing' in err and first in err
    assert "no shard holds it" in err

    # an index of another save: a tensor it places in a shard that does not hold it (another one does)
    index = json.loads(path.read_text())
    del index["weight_map"]["model.layers.9.mlp.up_proj.weight"]
    names = sorted(set(index["weight_map"].values()))
    moved = next(n for n, f in index["weight_map"].items() if f == names[-1])
    index["weight_map"][moved] = names[0]
    path.write_text(json.dumps(index))
    err = refused("inspect", str(src))
    assert f'"{moved}" is missing' in err and f"{names[-1]} holds it" in err


def test_a_tensor_no_index_names_is_ignored_with_a_warning(legacy: Legacy, tmp_path: Path) -> None:
    src = copy_of(legacy[0], tmp_path / "ckpt")
    path = src / "pytorch_model.bin.index.json"
    index = json.loads(path.read_text())
    dropped = "model.norm.weight"
    home = index["weight_map"].pop(dropped)
    path.write_text(json.dumps(index))
    doc = json.loads(ok("inspect", str(src), "--json").stdout)
    assert dropped not in {t["name"] for t in doc["tensors"]}
    assert doc["warnings"] == [f'{home}: tensor "{dropped}" not in pytorch_model.bin.index.json; ignored']


def test_pytorch_model_bin_among_trainer_files_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """One ``pytorch_model.bin`` beside training_args.bin, optimizer.pt, rng_state_{r}.pth: the model
    (the rng_state files were taken for two ranks, the other .bin files made it ambiguous)."""
    src = tmp_path / "ckpt"
    model, state = save_legacy(src)
    for f in src.glob("pytorch_model*"):
        f.unlink()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    hf = tmp_path / "hf"
    ok("convert", str(src), str(hf), "--consolidate", "--quiet")
    got = load_file(str(hf / "model.safetensors"))
    assert sorted(got) == sorted(state) and all(same_bits(got[n], t) for n, t in state.items())
    # with the shards too, pytorch_model.bin is what from_pretrained reads: a warning says so
    save_legacy_shards = tmp_path / "sharded"
    save_legacy(save_legacy_shards, trainer_files=False)
    for f in save_legacy_shards.glob("pytorch_model-*"):
        (src / f.name).write_bytes(f.read_bytes())
    (src / "pytorch_model.bin.index.json").write_bytes(
        (save_legacy_shards / "pytorch_model.bin.index.json").read_bytes()
    )
    doc = json.loads(ok("inspect", str(src), "--json").stdout)
    assert [f["name"] for f in doc["files"]] == ["pytorch_model.bin"]
    assert "reading pytorch_model.bin, as transformers does" in doc["warnings"][0]


def test_rank_files_and_accelerate_rank_bins_are_still_per_rank(tmp_path: Path) -> None:
    """Names with rank numbers stay per-rank .pt sets; shard numbers (-00001-of-00003) are no ranks."""
    for name in ("rank_{r}.pt", "pytorch_model_fsdp_0_rank{r}.bin"):
        d = tmp_path / name.split("{")[0]
        d.mkdir()
        for r in range(2):
            torch.save({"w": torch.full((2, 3), float(r))}, d / name.format(r=r))
        args = ("inspect", str(d), "--layout", "replicated", "--source-mesh", "world=2", "--json")
        doc = json.loads(ok(*args).stdout)
        assert doc["format"] == "pt"
        assert [f["name"] for f in doc["files"]] == [name.format(r=r) for r in (0, 1)]
    d = tmp_path / "shards-without-index"
    d.mkdir()
    for i in range(1, 4):
        torch.save({f"w{i}": torch.ones(2)}, d / f"pytorch_model-{i:05d}-of-00003.bin")
    err = refused("inspect", str(d))
    assert str(d) in err
