"""``--max-memory`` holds as documented: buffers plus the mapped-page window stay within it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import reshard.execute as ex
from reshard.budget import DEFAULT_BUFFER, RELEASE_EVERY, budget_for
from reshard.cli import app
from reshard.io.reader import DENSE

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("max_memory", [36 * KiB, 100 * KiB, 1 * MiB, 8 * MiB, 64 * MiB, 1 << 30])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_buffers_and_window_stay_within_the_budget(max_memory: int, workers: int) -> None:
    total = max(max_memory, 36 * KiB * workers)  # documented to hold from 36 KiB per worker
    b = budget_for(total, workers)
    assert b.workers * ((1 + DENSE) * b.buffer + b.window) <= total
    assert 4 * KiB <= b.buffer <= DEFAULT_BUFFER and 0 <= b.window <= RELEASE_EVERY


def test_the_documented_cases() -> None:
    # the case: 8 MiB with 4 workers held 9 MiB of buffers plus up to 32 MiB of mapped pages
    b = budget_for(8 * MiB, 4)
    assert (b.buffer, b.window) == (64 * KiB, 2 * MiB - 9 * 64 * KiB)
    assert 4 * (9 * b.buffer + b.window) == 8 * MiB
    # the default is unchanged: 256 KiB buffers and an 8 MiB window for 1 to 4 workers
    for w in (1, 2, 4):
        assert budget_for(64 * MiB, w) == type(b)(w, DEFAULT_BUFFER, RELEASE_EVERY)


def test_convert_uses_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window and buffer the CLI computes are the ones the executor's workers get."""
    save_file({"w": torch.randn(64, 1024)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 16}\nplacements:\n  "*": {tp: S(1)}\n')
    seen: list[tuple[int, int]] = []
    real = ex._Buffers.__init__

    def spy(self: ex._Buffers, budget: int, sources: object, window: int) -> None:
        seen.append((budget, window))
        real(self, budget, sources, window)  # type: ignore[arg-type]

    monkeypatch.setattr(ex._Buffers, "__init__", spy)
    args = ["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "out"), "--target-layout"]
    r = CliRunner().invoke(
        app, [*args, str(tmp_path / "l.yaml"), "--max-memory", "8MiB", "--workers", "4", "-q"]
    )
    assert r.exit_code == 0, r.output
    b = budget_for(8 * MiB, 4)
    assert seen and set(seen) == {(b.buffer, b.window)}
