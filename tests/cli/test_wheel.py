"""The built wheel works on its own: presets ship as package data, `reshard --version` answers.

The wheel is built from this checkout and installed (without dependencies) into a fresh
virtual environment; the dependencies come from this environment through a `.pth` file that
lists a directory of links to every installed package except reshard itself, so nothing of the
checkout or of its editable install can be imported by the fresh one.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import reshard

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _deps_dir(tmp: Path) -> Path:
    """Links to every package of this environment but reshard (and its editable-install hooks)."""
    links = tmp / "deps"
    links.mkdir()
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            name = entry.name
            if name.startswith(("reshard", "__editable__", "_reshard")) or name.endswith(".pth"):
                continue
            if not (links / name).exists():
                (links / name).symlink_to(entry)
    return links


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    wheels = tmp / "wheels"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # pip must not see a checkout
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    (whl,) = wheels.glob("reshard-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(whl)],
        check=True,
        capture_output=True,
        env=env,
    )
    (sp,) = (env_dir / "lib").glob("python*/site-packages")
    (sp / "deps.pth").write_text(str(_deps_dir(tmp)) + "\n")
    return env_dir / "bin"


def _run(bin_dir: Path, cwd: Path, exe: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a program of the fresh environment, with nothing of this checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(bin_dir / exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_version(fresh: Path, tmp_path: Path) -> None:
    r = _run(fresh, tmp_path, "reshard", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"reshard {reshard.__version__}"


def test_preset_by_name_from_another_directory(fresh: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    q = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    o = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.o_proj.weight": o},
        str(hf / "model.safetensors"),
    )
    r = _run(
        fresh,
        tmp_path,
        "reshard",
        "convert",
        "hf",
        "tp2",
        "--target-layout",
        "llama-tp",
        "--target-mesh",
        "tp=2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1
    # the imported package is the wheel's, not this checkout
    where = _run(fresh, tmp_path, "python", "-c", "import reshard; print(reshard.__file__)").stdout
    assert str(ROOT) not in where and "site-packages" in where
    r1 = load_file(str(tmp_path / "tp2" / "rank-00001-of-00002.safetensors"))
    np.testing.assert_array_equal(r1["model.layers.0.self_attn.q_proj.weight"], q[4:])
    np.testing.assert_array_equal(r1["model.layers.0.self_attn.o_proj.weight"], o[:, 4:])
