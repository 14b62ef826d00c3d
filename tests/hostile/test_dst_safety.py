"""The destination is never lost, never written through links, never shared (issue 15, phase 2).

Every case failed on the code before: ``--overwrite`` with a full disk lost the previous
checkpoint, links planted in DST were written through, two runs shared one DST,
``--overwrite`` removed a user's ``draft.tmp``, ``--resume`` mixed two sources, and
Ctrl-C waited for every file with two writer threads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.io.lock import DirLock

RESHARD = str(Path(sys.executable).parent / "reshard")
STAGE = ".reshard-staging"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run([RESHARD, *args], capture_output=True, text=True, env=env, timeout=timeout)


def model(path: Path, rows: int = 64, cols: int = 48, seed: int = 0) -> Path:
    """A small HF checkpoint of a few float32 tensors."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{i}.w": torch.randn(rows, cols, generator=g) for i in range(4)}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and not p.is_symlink()}


def test_links_planted_under_old_temporary_names_are_not_written_through(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / "dst"
    assert (
        run(
            "convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated"
        ).returncode
        == 0
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = {
        "rank-00000-of-00002.safetensors.tmp": elsewhere / "a",
        "reshard.json.tmp": elsewhere / "b",
    }
    for name, target in planted.items():
        (dst / name).symlink_to(target)
    for flag in ("--overwrite", "--resume"):
        p = run("convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated", flag)
        assert p.returncode == 0, p.stderr
        assert not any(elsewhere.iterdir()), f"{flag}: wrote through a link: {os.listdir(elsewhere)}"
        assert (dst / "reshard.json").is_file()
    # the journal name too, inside the staging directory of an interrupted run
    (dst / STAGE).mkdir()
    (dst / STAGE / ".reshard-progress.jsonl").symlink_to(elsewhere / "c")
    p = run(
        "convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated", "--resume"
    )
    assert p.returncode == 0, p.stderr
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_output_names_taken_by_links_or_directories_are_refused(tmp_path: Path, kind: str) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    name = dst / "rank-00000-of-00002.safetensors"
    if kind == "symlink":
        name.symlink_to(victim)
    else:
        name.mkdir()
    p = run(
        "convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated", "--overwrite"
    )
    assert p.returncode == 2, p.stderr
    assert f"is a {kind.replace('link', 'bolic link')}" in p.stderr and "Traceback" not in p.stderr
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(dst)) == [name.name]


def test_overwrite_removes_only_files_reshard_owns(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "draft.tmp").write_text("my notes")
    (dst / "README.txt").write_text("keep me")
    (dst / "model.safetensors").write_bytes(b"old weights")
    p = run("convert", str(src), str(dst), "--consolidate", "--overwrite")
    assert p.returncode == 0, p.stderr
    assert (dst / "draft.tmp").read_text() == "my notes"
    assert (dst / "README.txt").read_text() == "keep me"
    assert sorted(os.listdir(dst)) == ["README.txt", "draft.tmp", "model.safetensors", "reshard.json"]


def test_a_second_run_into_a_locked_destination_is_refused_and_removes_nothing(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    lock = DirLock(dst).acquire()  # a first run, in the middle of its work
    try:
        (dst / STAGE).mkdir()
        (dst / STAGE / "rank-00000-of-00002.safetensors").write_bytes(b"first run's")
        before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
        for flag in ("--overwrite", "--resume"):
            p = run(
                "convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated", flag
            )
            assert p.returncode == 2, p.stderr
            assert "another reshard run" in p.stderr and f"pid {os.getpid()}" in p.stderr, p.stderr
            assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
    finally:
        lock.release()
    assert not (dst / ".reshard.lock").exists()
    # a lock file left by a killed run (no holder) does not block
    (dst / ".reshard.lock").write_text("pid 1 on nowhere: reshard convert\n")
    p = run(
        "convert", str(src), str(dst), "--target-mesh", "tp=2", "--target-layout", "replicated", "--overwrite"
    )
    assert p.returncode == 0, p.stderr
    assert not (dst / ".reshard.lock").exists() and not (dst / STAGE).exists()


def _interrupted(src: Path, dst: Path, target: TargetSpec, after: int) -> None:
    """Run a conversion in this process, interrupted (as by Ctrl-C) after ``after`` bytes."""
    seen = [0]

    def progress(n: int) -> None:
        seen[0] += n
        if seen[0] >= after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(SourceSpec(str(src)), dst, target, progress=progress, buffer_size=4096)
    assert not (dst / "reshard.json").exists()


def test_resume_refuses_a_source_that_changed_since_the_interrupted_run(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / "dst"
    target = TargetSpec(consolidate=True, max_shard_size="13KB")  # one 12 KiB tensor a file
    _interrupted(src, dst, target, after=3 * 64 * 48 * 4)
    assert any(n.endswith(".safetensors") for n in os.listdir(dst / STAGE)), os.listdir(dst / STAGE)
    model(src, seed=1)  # another job rewrote the source: same names and sizes, other bytes
    p = run("convert", str(src), str(dst), "--consolidate", "--max-shard-size", "13KB", "--resume")
    assert p.returncode == 2, p.stderr
    assert "source changed" in p.stderr and "model.safetensors" in p.stderr and "--overwrite" in p.stderr
    assert not (dst / "reshard.json").exists()
    # an unchanged source resumes
    clean = tmp_path / "clean"
    assert run("convert", str(src), str(clean), "--consolidate", "--max-shard-size", "13KB").returncode == 0
    _interrupted(src, tmp_path / "dst2", target, after=3 * 64 * 48 * 4)
    p = run(
        "convert",
        str(src),
        str(tmp_path / "dst2"),
        "--consolidate",
        "--max-shard-size",
        "13KB",
        "--resume",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed_files"] >= 1
    assert snapshot(tmp_path / "dst2") == snapshot(clean)


def test_ctrl_c_stops_promptly_with_two_writer_threads(tmp_path: Path) -> None:
    # 256 MiB cut into 16 column slices through small buffers: seconds of work even on a quiet
    # machine, so the interrupt lands mid-write
    src = model(tmp_path / "src", rows=8192, cols=2048)
    dst = tmp_path / "dst"
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    layout = tmp_path / "s1.yaml"
    layout.write_text('mesh: {tp: 16}\nplacements:\n  "*": {tp: S(1)}\n')
    args = [
        "convert",
        str(src),
        str(dst),
        "--target-layout",
        str(layout),
        "--workers",
        "2",
        "--max-memory",
        "256KiB",
    ]

    def sigint_default() -> None:
        # a child inherits an ignored SIGINT (earlier tests' worlds can leave the runner so),
        # and Python then installs no KeyboardInterrupt handler: start it as a shell would
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [RESHARD, *args, "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if (dst / STAGE).is_dir() and any(n.endswith(".tmp") for n in os.listdir(dst / STAGE)):
            break
        time.sleep(0.002)
    assert proc.poll() is None, "finished before the first temporary appeared"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert took < 1.5, f"took {took:.2f} s to stop"
    left = os.listdir(dst / STAGE) if (dst / STAGE).exists() else []
    assert not [n for n in left if n.endswith(".tmp")], left
    assert len([n for n in left if n.endswith(".safetensors")]) < 16
    assert not (dst / "reshard.json").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--max-memory", "nan"),
        ("--max-memory", "inf"),
        ("--max-shard-size", "inf"),
        ("--max-shard-size", "nan"),
        ("--max-shard-size", "1e30GB"),
    ],
)
def test_non_finite_sizes_are_refused(tmp_path: Path, option: str, value: str) -> None:
    src = model(tmp_path / "src")
    p = run("convert", str(src), str(tmp_path / "dst"), "--consolidate", option, value)
    assert p.returncode == 2, p.stderr
    assert option in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "dst").exists()


def test_destination_name_over_name_max_is_a_named_error(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    dst = tmp_path / ("x" * 300) / "out"
    p = run("convert", str(src), str(dst), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert "File name too long" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "fifo-index", "zero-shard", "fifo-manifest"])
def test_devices_and_fifos_in_the_source_are_refused_at_once(tmp_path: Path, case: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    fmt: list[str] = []
    if case == "dev-zero":
        src = Path("/dev/zero")
    elif case == "fifo":
        src = tmp_path / "pipe"
        os.mkfifo(src)
    elif case == "fifo-index":
        os.mkfifo(src / "model.safetensors.index.json")
        fmt = ["--from", "hf"]
    elif case == "zero-shard":
        (src / "model.safetensors").symlink_to("/dev/zero")
        fmt = ["--from", "hf"]
    else:
        model(src)
        os.mkfifo(src / "reshard.json")
    p = run("convert", str(src), str(tmp_path / "dst"), "--consolidate", *fmt, timeout=20)
    assert p.returncode == 2, p.stderr
    assert "not a regular file" in p.stderr or "not a checkpoint" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("meta", "expect"),
    [
        (
            '{"format_version":1,"mesh":{"names":["tp"],"shape":"abc"},"rank":0,"tensors":{}}',
            "reshard.mesh.shape",
        ),
        (
            '{"format_version":1,"mesh":{"names":["tp"],"shape":[1]},"rank":0,"tensors":{"w":{"shape":"x"}}}',
            'reshard.tensors["w"].shape',
        ),
        (
            '{"format_version":1,"mesh":{"names":["tp"],"shape":[1]},"rank":0,"tensors":{"w":[]}}',
            "must be an object",
        ),
        (
            '{"format_version":1,"mesh":{"names":["tp"],"shape":[99999999999]},"rank":0,"tensors":{}}',
            "over the limit",
        ),
        ('{"format_version":1,"a":1,"a":2}', "duplicate key"),
    ],
)
def test_bad_per_rank_self_descriptions_are_named(tmp_path: Path, meta: str, expect: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(2)}, str(src / "rank-00000-of-00001.safetensors"), metadata={"reshard": meta})
    p = run("inspect", str(src), timeout=20)
    assert p.returncode == 2, p.stderr
    assert expect in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_huge_rank_number_in_a_file_name_is_bounded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(2)}, str(src / "rank-99999999999-of-99999999999.safetensors"))
    p = run("inspect", str(src), timeout=20)
    assert p.returncode == 2, p.stderr
    assert "over the limit" in p.stderr and "Traceback" not in p.stderr


def test_resume_with_nothing_to_resume_replaces_only_a_retry_of_the_same_conversion(tmp_path: Path) -> None:
    # --resume used to act as --overwrite on any DST without an interrupted run: another
    # tool's rank files there (a user's only copy) were deleted, exit 0
    src = model(tmp_path / "src")
    other = model(tmp_path / "other", seed=3)
    dst = tmp_path / "dst"
    dst.mkdir()
    tp = ["--target-layout", "replicated"]
    # a checkpoint of another tool: rank files with no reshard.json
    for r in range(2):
        (dst / f"rank-0000{r}-of-00002.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    before = snapshot(dst)
    p = run("convert", str(src), str(dst), "--target-mesh", "tp=2", *tp, "--resume")
    assert p.returncode == 2, p.stderr
    assert "nothing to resume" in p.stderr and "--overwrite" in p.stderr and "Traceback" not in p.stderr
    assert "rank-00000-of-00002.safetensors" in p.stderr
    assert snapshot(dst) == before
    # reshard's own finished output of another conversion (tp=4, or hf) is not replaced either
    done = tmp_path / "done"
    assert run("convert", str(src), str(done), "--target-mesh", "tp=4", *tp).returncode == 0
    before = snapshot(done)
    for args in (["--target-mesh", "tp=2", *tp], ["--consolidate"]):
        p = run("convert", str(src), str(done), *args, "--resume")
        assert p.returncode == 2, (args, p.stderr)
        assert snapshot(done) == before
    # a retried step (same conversion, finished) runs again; a DST of only a user's notes is fine
    p = run("convert", str(src), str(done), "--target-mesh", "tp=4", *tp, "--resume")
    assert p.returncode == 0, p.stderr
    assert snapshot(done) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("keep me")
    assert run("convert", str(src), str(notes), "--consolidate", "--resume").returncode == 0
    assert (notes / "README.txt").read_text() == "keep me" and (notes / "model.safetensors").is_file()
    # --overwrite still replaces the other tool's files
    p = run("convert", str(src), str(dst), "--target-mesh", "tp=2", *tp, "--overwrite")
    assert p.returncode == 0, p.stderr
