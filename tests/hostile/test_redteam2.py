"""Inputs found by a second independent red-team pass: real files, real CLI runs.

Each test here failed before its fix: a traceback or a wrong exit code where a user error
must exit 2 with a message naming the file, tensor or rule, and leave nothing in DST.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _hf(root: Path) -> Path:
    from safetensors.numpy import save_file

    np = pytest.importorskip("numpy")
    src = root / "src"
    src.mkdir()
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("below", [False, True])
def test_a_destination_through_a_loop_of_symlinks_exits_2(tmp_path: Path, below: bool) -> None:
    """DST a link in a loop (or a path below one): exit 2 naming it, not Python 3.11's
    ``RuntimeError: Symlink loop`` traceback from ``Path.resolve`` (exit 1)."""
    src = _hf(tmp_path)
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    dst = tmp_path / "loop1" / "x" if below else tmp_path / "loop1"
    r = run_cli("convert", src, dst, "--consolidate", "--json")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["error"]["path"] == str(dst)
    assert "Too many levels of symbolic links" in doc["error"]["message"], doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop1", "loop2", "src"]
