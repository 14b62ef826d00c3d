"""The README's Python API example, --json examples and CI recipe are true: run them here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

README = Path(__file__).parents[2] / "README.md"
BIN = Path(sys.executable).parent


def block_after(marker: str) -> str:
    """The fenced code block following ``<!-- MARKER ... -->`` in the README."""
    text = README.read_text()
    m = re.search(r"<!-- " + re.escape(marker) + r"[^>]*-->\n```\w*\n(.*?)\n```", text, re.S)
    assert m is not None, f"no block after <!-- {marker} --> in README.md"
    return m.group(1)


def sh(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.fixture()
def demo(tmp_path: Path) -> Path:
    p = sh("python -m reshard.demo build demo", tmp_path)
    assert p.returncode == 0, p.stderr
    return tmp_path


def test_api_example_runs(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(demo)
    exec(compile(block_after("api-example"), "README.md:api-example", "exec"), {})
    assert (demo / "demo" / "tp8" / "reshard.json").is_file()
    assert len(list((demo / "demo" / "tp8").glob("rank-*-of-00008.safetensors"))) == 8


def test_import_reshard_and_api_lookup_stay_free_of_torch() -> None:
    code = "import sys, reshard; reshard.convert_checkpoint; assert 'torch' not in sys.modules, 'torch'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def same_shape(doc: Any, real: Any, where: str = "$") -> None:
    """Same keys at every level; lists compared by their first entries."""
    if isinstance(doc, dict):
        assert isinstance(real, dict), where
        assert sorted(doc) == sorted(real), f"{where}: README {sorted(doc)} != real {sorted(real)}"
        for k in doc:
            same_shape(doc[k], real[k], f"{where}.{k}")
    elif isinstance(doc, list) and doc and real:
        assert isinstance(real, list), where
        same_shape(doc[0], real[0], f"{where}[0]")


def test_json_examples_have_the_real_keys(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    save_file(
        {"layers.0.wq": torch.zeros(8, 4), "norm": torch.ones(4)},
        str(tmp_path / "hf" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", "dtype": "float32"}')
    (tmp_path / "tp2.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "*.wq": {tp: S(0)}\n  "*": R\n')
    real: dict[str, Any] = {}
    for cmd, args in {
        "convert": "convert hf tp2 --target-layout tp2.yaml --verify --json",
        "inspect": "inspect tp2 --check --json",
        "plan": "plan tp2 --consolidate --json",
    }.items():
        p = sh(f"reshard {args}", tmp_path)
        assert p.returncode == 0, p.stderr
        real[cmd] = json.loads(p.stdout)
    save_file(  # a difference, so verify's "differences" entries are compared too
        {"layers.0.wq": torch.eye(8, 4), "norm": torch.ones(4)},
        str(tmp_path / "hf" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    p = sh("reshard verify hf tp2 --json", tmp_path)
    assert p.returncode == 1, p.stderr
    real["verify"] = json.loads(p.stdout)
    for cmd, doc in real.items():
        example = json.loads(block_after(f"json-example: {cmd}"))
        assert example["command"] == cmd
        same_shape(example, doc, cmd)


def test_ci_recipe_runs_and_fails_on_a_difference(tmp_path: Path) -> None:
    job = yaml.safe_load(block_after("ci-example"))
    (steps,) = [j["steps"] for j in job["jobs"].values()]
    lines = [
        line
        for step in steps
        if "run" in step
        for line in step["run"].splitlines()
        if line.strip() and not line.startswith("pip ")  # installing is the CI machine's business
    ]
    assert lines[0] == "python -m reshard.demo build demo"
    assert any(line.startswith("reshard convert demo/tp4 ckpt-tp8") and "--verify" in line for line in lines)
    p = sh("\n".join(lines), tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "convert.json").read_text())["verify"]["equal"] is True
    assert len(list((tmp_path / "ckpt-tp8").glob("rank-*-of-00008.safetensors"))) == 8
    # a damaged output: the same checks fail the job
    rank = tmp_path / "ckpt-tp8" / "rank-00003-of-00008.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0x40
    rank.write_bytes(bytes(data))
    checks = [line for line in lines if line.startswith(("reshard verify", "reshard inspect"))]
    assert checks
    p = sh("\n".join(checks), tmp_path)
    assert p.returncode == 1, p.stderr
