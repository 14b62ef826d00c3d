"""vLLM/SGLang ``sharded_state`` checkpoints (``model-rank-{rank}-part-{part}.safetensors``), read and
written, with real files written by safetensors' torch API and real ``reshard`` subprocesses.

* HF -> sharded-state TP-4 -> HF is byte-identical; every part file is byte-identical to
  ``save_file`` of the local tensors torch's own placement splitting gives (what vLLM writes).
* ``--max-shard-size`` splits each rank into parts as vLLM's ``save_model`` does.
* Files saved the way vLLM saves them (per-rank parts, no metadata) are read with
  ``--source-layout``/``--source-mesh``; without a layout (and no reshard.json) exit 2.
* inspect / inspect --check / plan / verify, and a written directory re-read from its reshard.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.demo import torch_local
from reshard.placements import parse_placement
from tests.strategies import same_bits

LAYOUT = """\
mesh: {tp: 4}
placements:
  "*.q_proj.weight": {tp: S(0)}
  "*.o_proj.weight": {tp: S(1)}
  "*.gate_up.weight": {tp: "_S(0, 2)"}
  "*embed_tokens.weight": {tp: S(0)}
  "*": R
"""

PLACEMENTS = {
    "model.layers.0.q_proj.weight": "S(0)",
    "model.layers.0.o_proj.weight": "S(1)",
    "model.layers.0.gate_up.weight": "_S(0, 2)",
    "model.embed_tokens.weight": "S(0)",
}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),  # 3,3,3,1
        "model.layers.0.q_proj.weight": torch.randn(8, 6, generator=g),
        "model.layers.0.o_proj.weight": torch.randn(6, 8, generator=g).to(torch.float16),
        "model.layers.0.gate_up.weight": torch.arange(16 * 3, dtype=torch.int32).reshape(16, 3),
        "model.layers.0.norm.weight": torch.ones(6, dtype=torch.float32),
        "model.step": torch.tensor(7, dtype=torch.int64),
    }


def local_tensors(full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local tensors, as torch's placement splitting gives them."""
    return {
        n: torch_local(t, (tp,), (rank,), [parse_placement(PLACEMENTS.get(n, "R"))]).clone()
        for n, t in full.items()
    }


def vllm_save(state: dict[str, torch.Tensor], out: Path, rank: int, max_size: int | None) -> None:
    """What vLLM's ShardedStateLoader.save_model does with one rank's state dict."""
    part, total, chunk = 0, 0, {}
    for key, t in state.items():
        size = t.nelement() * t.element_size()
        if max_size is not None and total + size > max_size:
            save_file(chunk, str(out / f"model-rank-{rank}-part-{part}.safetensors"))
            part, total, chunk = part + 1, 0, {}
        chunk[key] = t
        total += size
    if chunk:
        save_file(chunk, str(out / f"model-rank-{rank}-part-{part}.safetensors"))


RESHARD = str(Path(sys.executable).parent / "reshard")


def run(*args: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def ok(*args: Any) -> subprocess.CompletedProcess[str]:
    p = run(*args)
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture()
def hf(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    save_file(full_tensors(), str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "tp.yaml").write_text(LAYOUT)
    return tmp_path / "hf"


def parts_of(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("model-rank-"))


def test_hf_to_sharded_state_tp4_to_hf_is_byte_identical(hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "ss"
    ok("convert", hf, out, "--to", "sharded-state", "--target-layout", tmp_path / "tp.yaml", "--quiet")
    assert parts_of(out) == [f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    full = full_tensors()
    for r in range(4):  # what vLLM's save_file of the rank's state dict writes, byte for byte
        want = tmp_path / f"want-{r}.safetensors"
        save_file(local_tensors(full, 4, r), str(want))
        assert (out / f"model-rank-{r}-part-0.safetensors").read_bytes() == want.read_bytes(), r
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["format"] == "sharded-state" and manifest["mesh"] == {"names": ["tp"], "shape": [4]}
    assert manifest["tensors"]["model.layers.0.gate_up.weight"]["placements"] == ["_S(0, 2)"]

    ok("convert", out, tmp_path / "back", "--consolidate", "--quiet")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    ok("verify", out, hf)


def test_max_shard_size_splits_each_rank_into_parts(hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "ss"
    ok(
        "convert",
        hf,
        out,
        "--to",
        "sharded-state",
        "--target-layout",
        tmp_path / "tp.yaml",
        "--max-shard-size",
        "60B",
        "--quiet",
    )
    full = full_tensors()
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    for r in range(4):  # the same parts vLLM's save_model makes (hf tensors are in name order)
        vllm_save(dict(sorted(local_tensors(full, 4, r).items())), vllm, r, 60)
    names = parts_of(vllm)
    assert parts_of(out) == names and any("-part-2." in n for n in names)
    for n in names:
        assert (out / n).read_bytes() == (vllm / n).read_bytes(), n
    ok("convert", out, tmp_path / "back", "--consolidate", "--quiet")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


@pytest.fixture()
def vllm_tp2(tmp_path: Path) -> Path:
    """Files as vLLM writes them at TP-2 (several parts per rank, no reshard.json)."""
    src = tmp_path / "vllm"
    src.mkdir()
    full = full_tensors()
    for r in range(2):
        vllm_save(local_tensors(full, 2, r), src, r, 100)
    (tmp_path / "tp.yaml").write_text(LAYOUT)
    return src


def test_vllm_files_read_with_a_source_layout(vllm_tp2: Path, tmp_path: Path) -> None:
    lay = tmp_path / "tp.yaml"
    assert len(parts_of(vllm_tp2)) > 2
    ok(
        "convert",
        vllm_tp2,
        tmp_path / "hf",
        "--source-layout",
        lay,
        "--source-mesh",
        "tp=2",
        "--consolidate",
        "--quiet",
    )
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    full = full_tensors()
    assert sorted(got) == sorted(full)
    for n, t in full.items():
        assert same_bits(got[n], t), n

    doc = json.loads(
        ok("inspect", vllm_tp2, "--layout", lay, "--source-mesh", "tp=2", "--check", "--json").stdout
    )
    assert doc["ok"] is True and doc["format"] == "sharded-state"
    # --layout's mesh says tp=4: four ranks expected, two found
    p = run("convert", vllm_tp2, tmp_path / "x", "--source-layout", lay, "--consolidate")
    assert p.returncode == 2 and "2 rank files but the mesh tp=4 has 4 ranks" in p.stderr


def test_vllm_files_without_a_layout_exit_2(vllm_tp2: Path, tmp_path: Path) -> None:
    p = run("convert", vllm_tp2, tmp_path / "x", "--consolidate")
    assert p.returncode == 2 and "store no placements; pass --source-layout" in p.stderr
    assert not (tmp_path / "x").exists()
    p = run("inspect", vllm_tp2)  # inspect's own options: --layout (and --source-mesh)
    assert p.returncode == 2 and "pass --layout FILE" in p.stderr and "--source-layout" not in p.stderr


def test_missing_rank_and_repeated_tensor_exit_2(vllm_tp2: Path, tmp_path: Path) -> None:
    lay = tmp_path / "tp.yaml"
    first = sorted(vllm_tp2.glob("model-rank-1-part-0.safetensors"))[0]
    dup = vllm_tp2 / "model-rank-1-part-9.safetensors"
    dup.write_bytes(first.read_bytes())
    p = run(
        "convert", vllm_tp2, tmp_path / "x", "--source-layout", lay, "--source-mesh", "tp=2", "--consolidate"
    )
    assert p.returncode == 2 and "model-rank-1-part-9.safetensors" in p.stderr and "also in" in p.stderr
    dup.unlink()
    for f in vllm_tp2.glob("model-rank-0-part-*"):
        f.unlink()
    p = run("inspect", vllm_tp2, "--layout", lay)
    assert p.returncode == 2 and "rank(s) [0]" in p.stderr


def test_inspect_plan_verify_and_reuse_of_reshard_json(hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "ss"
    ok("convert", hf, out, "--to", "sharded-state", "--target-layout", tmp_path / "tp.yaml", "--quiet")
    doc = json.loads(ok("inspect", out, "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "sharded-state"
    assert {t["name"]: t["placements"] for t in doc["tensors"]}["model.layers.0.o_proj.weight"] == ["S(1)"]
    plan = json.loads(
        ok(
            "plan", out, "--to", "sharded-state", "--target-mesh", "tp=2", "--max-shard-size", "60B", "--json"
        ).stdout
    )
    assert plan["source"]["format"] == plan["target"]["format"] == "sharded-state"
    names = [f["name"] for f in plan["files"]]  # part by part, the ranks of a part side by side
    assert names[:4] == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
        "model-rank-0-part-1.safetensors",
        "model-rank-1-part-1.safetensors",
    ]

    # no layout given: reshard.json's rules on a new mesh
    ok("convert", out, tmp_path / "tp2", "--to", "sharded-state", "--target-mesh", "tp=2", "--quiet")
    assert parts_of(tmp_path / "tp2") == [f"model-rank-{r}-part-0.safetensors" for r in range(2)]
    full = full_tensors()
    for r in range(2):
        got = load_file(str(tmp_path / "tp2" / f"model-rank-{r}-part-0.safetensors"))
        want = local_tensors(full, 2, r)
        assert sorted(got) == sorted(want) and all(same_bits(got[n], want[n]) for n in want)
    ok("verify", tmp_path / "tp2", hf)

    # a replicated tensor that differs on one rank: --check finds it; a changed shard: verify (exit 1)
    bad = tmp_path / "bad"
    ok("convert", out, bad, "--to", "sharded-state", "--target-mesh", "tp=4", "--quiet")
    f = bad / "model-rank-2-part-0.safetensors"
    t = load_file(str(f))
    t["model.layers.0.norm.weight"][0] = 5.0
    save_file(t, str(f))
    p = run("inspect", bad, "--check")
    assert p.returncode == 1 and "model.layers.0.norm.weight" in p.stdout + p.stderr
    t["model.layers.0.norm.weight"][0] = 1.0
    t["model.layers.0.q_proj.weight"][1, 2] += 1.0
    save_file(t, str(f))
    p = run("verify", bad, hf)
    assert p.returncode == 1 and "model.layers.0.q_proj.weight" in p.stdout + p.stderr
