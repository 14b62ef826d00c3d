"""Inputs found by a third independent red-team pass: the SPEC as a checklist, real producers.

Each test here failed before its fix; real files, real CLI subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.hostile.test_redteam2 import KILL_AT_FIRST_FINISHED

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _rank_files(root: Path) -> tuple[Path, dict[str, object]]:
    """Per-rank files without reshard metadata (as a training job writes them): each rank's
    ``torch.chunk`` rows of four square tensors. Which layout they were saved with is only what
    ``--source-layout`` says."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    full = {f"w{i}": torch.randn(8, 8, generator=g) for i in range(4)}
    src = root / "src"
    src.mkdir()
    for r in range(2):
        local = {k: v.chunk(2)[r].contiguous() for k, v in full.items()}
        save_file(local, str(src / f"rank-{r:05d}-of-00002.safetensors"))
    return src, full


@pytest.mark.parametrize("change", ["source-layout", "target-layout"])
def test_resume_with_other_options_keeps_no_file_of_the_first_run(tmp_path: Path, change: str) -> None:
    """``convert`` killed after its first finished file, then ``--resume`` with a corrected
    ``--source-layout`` (``_S(0, 2)`` -> ``S(0)``), or another ``--target-layout`` of the same
    mesh for ``--to dcp`` (``S(0)`` -> ``S(1)`` of square tensors): the files have the same
    names, sizes and headers, so the finished one was kept, written from the first run's
    reading of the source: exit 0, ``resumed_files: 1``, and an output that ``verify`` finds
    different from a clean run (values mixed from two conversions). Now the journal records the
    recipe, and a resume with another one writes every file again, with a warning."""
    src, _ = _rank_files(tmp_path)
    layouts = {}
    for name, text in {
        "s0": 'mesh: {tp: 2}\nplacements:\n  "*": {tp: S(0)}\n',
        "s1": 'mesh: {tp: 2}\nplacements:\n  "*": {tp: S(1)}\n',
        "strided": 'mesh: {tp: 2}\nplacements:\n  "*": {tp: "_S(0, 2)"}\n',
    }.items():
        layouts[name] = tmp_path / f"{name}.yaml"
        layouts[name].write_text(text)
    if change == "source-layout":
        first = ["--source-layout", layouts["strided"], "--consolidate", "--max-shard-size", "300"]
        then = ["--source-layout", layouts["s0"], "--consolidate", "--max-shard-size", "300"]
    else:
        first = ["--source-layout", layouts["s0"], "--to", "dcp", "--target-layout", layouts["s0"]]
        then = ["--source-layout", layouts["s0"], "--to", "dcp", "--target-layout", layouts["s1"]]
    dst, clean = tmp_path / "dst", tmp_path / "clean"
    args = ["convert", src, dst, "--quiet", *first]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_FIRST_FINISHED, *map(str, args)], timeout=120)
    assert killed.returncode == -9
    r = run_cli("convert", src, dst, *then, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_files"] == 0
    assert "converted with other options" in r.stderr
    assert run_cli("convert", src, clean, *then, "--quiet").returncode == 0
    v = run_cli("verify", dst, clean)
    assert v.returncode == 0, v.stdout + v.stderr
    # the same options again: the finished file is kept
    dst2 = tmp_path / "dst2"
    args = ["convert", src, dst2, "--quiet", *then]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_FIRST_FINISHED, *map(str, args)], timeout=120)
    assert killed.returncode == -9
    r = run_cli("convert", src, dst2, *then, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_files"] == 1
    assert "other options" not in r.stderr
    assert run_cli("verify", dst2, clean).returncode == 0


@pytest.mark.parametrize("kind", ["transposed", "zstd"])
def test_resume_of_a_dcp_source_read_through_a_spool(tmp_path: Path, kind: str) -> None:
    """A DCP checkpoint torch saved with a transposed chunk (``x.t()``) or zstd-compressed
    (``_extensions=[ZStandard()]``) is read through a spool file the reader makes under $TMPDIR,
    anew each run. It was counted as a source file, so every ``--resume`` was refused: "the source
    changed since the interrupted run (spool.bin: mtime_ns ... -> ...)", exit 2. The spool is
    not the source's now: the finished file is kept and the output equals the source."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(16, 16, generator=g) for i in range(4)}
    src = tmp_path / "src"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        if kind == "zstd":
            from torch.distributed.checkpoint._extension import ZStandard

            if not ZStandard.is_available():
                pytest.skip("torch's ZStandard extension needs the zstandard module")
            writer = FileSystemWriter(str(src), _extensions=[ZStandard()])
            dcp.save(state, storage_writer=writer, no_dist=True)
        else:
            state["t"] = torch.randn(8, 12, generator=g).t()
            dcp.save(state, checkpoint_id=str(src), no_dist=True)
    dst = tmp_path / "dst"
    args = ["convert", src, dst, "--consolidate", "--max-shard-size", "1100", "--quiet"]
    scratch = tmp_path / "tmp"  # a killed run cannot remove its spool: keep it out of $TMPDIR
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AT_FIRST_FINISHED, *map(str, args)], env=env, timeout=120
    )
    assert killed.returncode == -9
    r = run_cli(*args, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_files"] == 1
    v = run_cli("verify", src, dst)
    assert v.returncode == 0, v.stdout + v.stderr
