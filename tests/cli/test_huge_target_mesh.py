"""A huge target mesh: ``plan SRC --target-mesh world=1048576`` planned a million rank files (hours,
gigabytes: 32,768 ranks took 80 s, most of it rendering a table row per file). Now a target of more
than MAX_TARGET_RANKS (65,536) ranks exits 2 at once naming the mesh and the limit; ``plan`` shows
at most 64 file rows (``--json`` lists every file), and 1,024 ranks plan as before."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from reshard.convert import MAX_TARGET_RANKS
from reshard.report import PLAN_ROWS
from tests.cli.test_as_a_user import run, save_hf


def test_a_mesh_over_the_target_limit_exits_2_at_once(tmp_path: Path) -> None:
    src = save_hf(tmp_path / "hf")
    layout = tmp_path / "tp.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.wq": {tp: S(0)}\n  "*": R\n')
    for args in (
        ["plan", str(src), "--target-layout", str(layout), "--target-mesh", "tp=1048576"],
        ["plan", str(src), "--target-layout", str(layout), "--target-mesh", f"tp={MAX_TARGET_RANKS + 1}"],
        [
            "convert",
            str(src),
            str(tmp_path / "out"),
            "--target-layout",
            str(layout),
            "--target-mesh",
            "tp=2048,dp=64",
        ],
    ):
        start = time.monotonic()
        p = run(*args)
        assert p.returncode == 2, p.stderr
        assert time.monotonic() - start < 30  # a refusal, not a plan of a million files
        assert "ranks is over the limit of 65,536 target ranks (MAX_TARGET_RANKS)" in p.stderr
        assert "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_a_thousand_ranks_plan_with_a_short_table(tmp_path: Path) -> None:
    src = save_hf(tmp_path / "hf", {"w": torch.arange(4096, dtype=torch.float32).reshape(1024, 4)})
    layout = tmp_path / "s0.yaml"
    layout.write_text('mesh: {world: 2}\nplacements:\n  "*": {world: S(0)}\n')
    p = run("plan", str(src), "--target-layout", str(layout), "--target-mesh", "world=1024")
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stderr.splitlines() if line.startswith("rank-")]  # for people: stderr
    assert len(rows) == PLAN_ROWS and rows[-1].startswith("rank-01023-of-01024.safetensors")
    assert f"... {1024 - PLAN_ROWS} more files (--json lists them all)" in p.stderr
    p = run("plan", str(src), "--target-layout", str(layout), "--target-mesh", "world=1024", "--json")
    doc = json.loads(p.stdout)
    assert len(doc["files"]) == 1024 and doc["totals"]["copies"] == 1024
