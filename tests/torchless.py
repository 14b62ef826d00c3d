"""Run ``reshard convert`` in a fresh interpreter and check it never imported torch: the read
and copy paths of every format are pure (torch is only for casts, Partial reductions and
live DTensors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def convert_without_torch(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``reshard convert ARGS...`` in a new process that fails unless it exits 0 with torch never
    imported; the caller asserts on ``returncode`` (and its output)."""
    argv = ["reshard", "convert", *map(str, args)]
    code = (
        "import sys\nfrom reshard.cli import app\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
