"""Fault injection: a conversion killed anywhere, or out of disk, loses nothing (issue 15, phase 2).

* SIGKILL at random moments (seeded), per-rank and hf outputs: ``reshard.json`` exists
  only for a complete checkpoint, and ``--resume`` then gives files byte-identical to
  a clean run.
* A full file system (a 1.6 MB tmpfs): exit 3, nothing of the run left, the source
  untouched, and with ``--overwrite`` the previous checkpoint intact (it was lost before).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

RESHARD = str(Path(sys.executable).parent / "reshard")
ENV = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}


def model(path: Path, rows: int, cols: int) -> Path:
    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {f"layers.{i}.w": torch.randn(rows, cols, generator=g) for i in range(6)},
        str(path / "model.safetensors"),
    )
    return path


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != ".reshard.lock"}


TARGETS = {
    "per-rank": ["--target-layout", "LAYOUT"],
    "hf": ["--consolidate", "--max-shard-size", "600KB"],
}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    (root / "tp4.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "*.0.w": {tp: S(0)}\n  "*": {tp: S(1)}\n')
    return model(root / "src", 256, 256)


def _args(src: Path, dst: Path, fmt: str) -> list[str]:
    extra = [a.replace("LAYOUT", str(src.parent / "tp4.yaml")) for a in TARGETS[fmt]]
    return ["convert", str(src), str(dst), *extra, "--max-memory", "256KiB", "--quiet"]


@pytest.mark.parametrize("fmt", sorted(TARGETS))
def test_sigkill_anywhere_then_resume_matches_a_clean_run(src: Path, tmp_path: Path, fmt: str) -> None:
    clean = tmp_path / "clean"
    t0 = time.monotonic()
    assert subprocess.run([RESHARD, *_args(src, clean, fmt)], env=ENV, timeout=120).returncode == 0
    took = time.monotonic() - t0
    want = snapshot(clean)
    for seed in range(6):
        dst = tmp_path / f"killed{seed}"
        proc = subprocess.Popen([RESHARD, *_args(src, dst, fmt)], env=ENV)
        time.sleep(random.Random(seed).uniform(0.3, took))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if dst.exists() and (dst / "reshard.json").exists():
            assert snapshot(dst) == want, f"seed {seed}: reshard.json beside an incomplete checkpoint"
        flag = "--resume" if dst.exists() else "--overwrite"
        p = subprocess.run([RESHARD, *_args(src, dst, fmt), flag], env=ENV, capture_output=True, text=True)
        assert p.returncode == 0, (seed, p.stderr)
        assert snapshot(dst) == want, f"seed {seed}: resumed output differs from a clean run"
        assert sorted(os.listdir(dst)) == sorted(want), sorted(os.listdir(dst))
        shutil.rmtree(dst)


def test_an_interrupted_swap_is_finished_by_the_next_run(src: Path, tmp_path: Path) -> None:
    clean, dst = tmp_path / "clean", tmp_path / "dst"
    assert subprocess.run([RESHARD, *_args(src, clean, "hf")], env=ENV, timeout=120).returncode == 0
    # killed in the middle of the swap: old reshard.json gone, two new files moved in, the rest staged
    shutil.copytree(clean, dst / ".reshard-staging")
    (dst / "model-00001-of-00099.safetensors").write_bytes(b"an old shard")
    for name in sorted(os.listdir(clean))[:2]:
        os.replace(dst / ".reshard-staging" / name, dst / name)
    p = subprocess.run([RESHARD, *_args(src, dst, "hf"), "--resume"], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert snapshot(dst) == snapshot(clean)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}); needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint(src: Path, tiny_fs: Path) -> None:
    dst = tiny_fs / "out"
    before_src = snapshot(src)
    args = [RESHARD, "convert", str(src), str(dst), "--consolidate", "--quiet"]
    assert subprocess.run(args, env=ENV, timeout=120).returncode == 0  # 1.5 MB: fits once
    previous = snapshot(dst)
    layout = str(src.parent / "tp4.yaml")
    p = subprocess.run(
        [RESHARD, "convert", str(src), str(dst), "--target-layout", layout, "--overwrite"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 3, p.stderr
    assert "No space left on device" in p.stderr and "Traceback" not in p.stderr
    assert snapshot(dst) == previous, "the previous checkpoint was damaged"
    assert sorted(os.listdir(dst)) == sorted(previous), os.listdir(dst)
    assert snapshot(src) == before_src
    # a fresh DST on the full disk: nothing left at all
    p = subprocess.run(
        [RESHARD, "convert", str(src), str(tiny_fs / "other"), "--target-layout", layout],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 3, p.stderr
    assert not (tiny_fs / "other").exists()


TRUNCATE = """
import os, sys
from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.errors import ReshardError
src, dst, layout = sys.argv[1:4]
f = os.path.join(src, "model.safetensors")

def progress(n):  # another job rewrites the source while it is read
    if os.path.getsize(f) > 4096:
        os.truncate(f, 4096)

try:
    convert(SourceSpec(src), dst, TargetSpec(layout=layout), progress=progress, buffer_size=4096)
except ReshardError as e:
    print(e.message, file=sys.stderr)
    sys.exit(e.exit_code)
"""


@pytest.mark.parametrize("placement", ["S(1)", "S(0)"])
def test_a_source_truncated_while_read_is_exit_2_not_sigbus(tmp_path: Path, placement: str) -> None:
    # S(1) over 16 ranks: narrow columns of wide rows, read through the memory map; S(0): pread
    src = model(tmp_path / "src", 256, 2048)
    layout = tmp_path / "l.yaml"
    layout.write_text(f'mesh: {{tp: 16}}\nplacements:\n  "*": {{tp: {placement}}}\n')
    dst = tmp_path / "dst"
    p = subprocess.run(
        [sys.executable, "-c", TRUNCATE, str(src), str(dst), str(layout)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "model.safetensors" in p.stderr and "changed while" in p.stderr, p.stderr
    assert not dst.exists()


def _staging_started(dst: Path, proc: subprocess.Popen[str], timeout: float = 60) -> bool:
    """Wait until the conversion writes its first temporary (it is reading the source then)."""
    stage = dst / ".reshard-staging"
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if any(p.name.endswith(".tmp") for p in stage.iterdir()):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    return False


def test_a_source_truncated_by_another_process_mid_run_never_sigbus(tmp_path: Path) -> None:
    """Another process (this test) truncates the source while a CLI conversion reads it
    (narrow column shards of wide rows: the bands path), at many moments: never SIGBUS
    (exit 135, or -7 seen from here), always exit 2 naming the file with nothing written,
    or (truncated after the last read) a whole, correct checkpoint."""
    g = torch.Generator().manual_seed(1)
    full = {f"layers.{i}.w": torch.randn(384, 4096, generator=g) for i in range(8)}  # 48 MiB
    orig = tmp_path / "orig.safetensors"
    save_file(full, str(orig))
    layout = tmp_path / "l.yaml"
    layout.write_text('mesh: {tp: 32}\nplacements:\n  "*": {tp: S(1)}\n')
    rng = random.Random(15)
    codes = []
    for i in range(16):
        src, dst = tmp_path / f"src{i}", tmp_path / f"dst{i}"
        src.mkdir()
        f = src / "model.safetensors"
        shutil.copyfile(orig, f)
        cmd = [RESHARD, "convert", str(src), str(dst), "--target-layout", str(layout), "--workers", "2"]
        proc = subprocess.Popen(
            [*cmd, "--max-memory", "8MiB", "--quiet"], stderr=subprocess.PIPE, text=True, env=ENV
        )
        started = _staging_started(dst, proc)
        time.sleep(rng.random() * 0.3)
        os.truncate(f, rng.randrange(4096, f.stat().st_size // 2))
        _, err = proc.communicate(timeout=120)
        codes.append(proc.returncode)
        assert proc.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), err
        if proc.returncode == 0:  # every byte was read before the truncation
            assert started
            for r in range(0, 32, 7):
                got = load_file(str(dst / f"rank-{r:05d}-of-00032.safetensors"))
                assert all(torch.equal(got[k], v.chunk(32, 1)[r]) for k, v in full.items())
            continue
        assert proc.returncode == 2, (proc.returncode, err)
        assert str(f) in err and "changed while" in err, err
        assert not dst.exists() or not any(dst.iterdir()), list(dst.iterdir())
    assert 2 in codes, codes  # some truncations came mid-run
