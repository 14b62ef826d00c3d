"""``reshard verify`` and ``reshard inspect --check``: exit codes and JSON documents."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from reshard.cli import app
from reshard.io.header import read_header

LAYOUT = """\
mesh: {tp: 4}
placements:
  "*.w": {tp: S(0)}
  "*.o": {tp: S(1)}
  "*": R
"""

runner = CliRunner()
RESHARD = Path(sys.executable).with_name("reshard")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    (root / "hf0").mkdir()
    save_file(
        {
            "l0.w": torch.randn(10, 6, generator=g),
            "l0.o": torch.randn(6, 7, generator=g),
            "norm": torch.randn(7, generator=g),
        },
        str(root / "hf0" / "model.safetensors"),
    )
    (root / "tp4.yaml").write_text(LAYOUT)
    for args in (
        [
            "convert",
            str(root / "hf0"),
            str(root / "tp4"),
            "--target-layout",
            str(root / "tp4.yaml"),
        ],
        ["convert", str(root / "tp4"), str(root / "tp3"), "--target-mesh", "tp=3"],
        ["convert", str(root / "tp3"), str(root / "hf"), "--consolidate"],
    ):
        r = runner.invoke(app, [*args, "--quiet"])
        assert r.exit_code == 0, r.output
    return {n: root / n for n in ("hf0", "tp4", "tp3", "hf")}


def _flip_l0o(d: Path) -> None:
    """Flip one bit of l0.o at rank 1's local (3, 1), i.e. global (3, 3)."""
    f = d / "rank-00001-of-00004.safetensors"
    h = read_header(f)
    off = h.data_start + h.entry("l0.o").start + (3 * 2 + 1) * 4
    with open(f, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ 0x80]))


@pytest.fixture
def flipped(ckpts: dict[str, Path], tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(ckpts["tp4"], d)
    _flip_l0o(d)
    return d


@pytest.mark.parametrize(("a", "b"), [("tp4", "tp3"), ("tp3", "hf"), ("hf0", "tp4")])
def test_verify_equal_exit_0(ckpts: dict[str, Path], a: str, b: str) -> None:
    r = runner.invoke(app, ["verify", str(ckpts[a]), str(ckpts[b]), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1 and doc["ok"] is True and doc["equal"] is True
    assert doc["tensors"] == 3
    assert doc["bytes_compared"] == (60 + 42 + 7) * 4


def test_verify_difference_exit_1(ckpts: dict[str, Path], flipped: Path) -> None:
    r = runner.invoke(app, ["verify", str(ckpts["tp3"]), str(flipped), "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["equal"] is False
    (d,) = doc["differences"]
    assert (d["tensor"], d["kind"], d["index"]) == ("l0.o", "values", [3, 3])
    r = runner.invoke(app, ["verify", str(ckpts["hf"]), str(flipped)])
    assert r.exit_code == 1
    assert r.stdout == ""
    assert 'tensor "l0.o": values differ, first at index [3, 3]' in r.stderr


def test_verify_bad_input_exit_2(ckpts: dict[str, Path], tmp_path: Path) -> None:
    r = runner.invoke(app, ["verify", str(ckpts["tp4"]), str(tmp_path / "nope"), "--json"])
    assert r.exit_code == 2
    assert json.loads(r.stdout)["ok"] is False


def test_verify_real_subprocess(ckpts: dict[str, Path], flipped: Path) -> None:
    ok = subprocess.run(
        [str(RESHARD), "verify", str(ckpts["tp4"]), str(ckpts["hf"])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "equal: 3 tensors" in ok.stderr
    bad = subprocess.run(
        [str(RESHARD), "verify", str(flipped), str(ckpts["hf0"]), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1, bad.stderr
    assert json.loads(bad.stdout)["differences"][0]["index"] == [3, 3]


def test_inspect_check_good_exit_0(ckpts: dict[str, Path]) -> None:
    r = runner.invoke(app, ["inspect", str(ckpts["tp4"]), "--check", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True
    assert doc["check"] == {
        "ok": True,
        "problems": [],
        "verified": ["full coverage", "replicas equal", "checksums in reshard.json match"],
    }


def test_inspect_check_flipped_exit_1(flipped: Path) -> None:
    r = runner.invoke(app, ["inspect", str(flipped), "--check", "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False
    (p,) = doc["check"]["problems"]
    assert p["kind"] == "checksum"
    assert p["path"] == str(flipped / "rank-00001-of-00004.safetensors")
    r = runner.invoke(app, ["inspect", str(flipped), "--check"])
    assert r.exit_code == 1
    assert "rank-00001-of-00004.safetensors: checksum" in r.stderr


def test_inspect_check_replica_exit_1(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "rep"
    shutil.copytree(ckpts["tp4"], d)
    f = d / "rank-00003-of-00004.safetensors"
    h = read_header(f)
    off = h.data_start + h.entry("norm").start + 2 * 4
    data = bytearray(f.read_bytes())
    data[off] ^= 0x01
    f.write_bytes(bytes(data))
    man = json.loads((d / "reshard.json").read_text())
    del man["files"]
    (d / "reshard.json").write_text(json.dumps(man))
    r = runner.invoke(app, ["inspect", str(d), "--check", "--json"])
    assert r.exit_code == 1, r.output
    (p,) = json.loads(r.stdout)["check"]["problems"]
    assert (p["kind"], p["tensor"], p["region"], p["index"]) == ("replica", "norm", [[0, 7]], [2])


def _flip_norm_replica(d: Path, rank: int) -> None:
    """Flip a bit of rank ``rank``'s copy of the replicated ``norm`` at index 2."""
    f = d / f"rank-{rank:05d}-of-00004.safetensors"
    h = read_header(f)
    off = h.data_start + h.entry("norm").start + 2 * 4
    with open(f, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ 0x01]))


def test_verify_compares_every_replica(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # the copy verify reads (rank 0) equals B; rank 3's copy of `norm` does not: the checkpoint
    # holds no one value for `norm`, so verify says so (before: "equal", exit 0)
    d = tmp_path / "rep"
    shutil.copytree(ckpts["tp4"], d)
    _flip_norm_replica(d, 3)
    for a, b, side in ((d, ckpts["hf0"], "A"), (ckpts["tp3"], d, "B")):
        r = runner.invoke(app, ["verify", str(a), str(b), "--json"])
        assert r.exit_code == 1, r.output
        doc = json.loads(r.stdout)
        assert doc["equal"] is False and doc["tensors"] == 3
        (diff,) = doc["differences"]
        assert (diff["tensor"], diff["kind"], diff["index"]) == ("norm", "replica", [2])
        assert diff["path"] == str(d / "rank-00003-of-00004.safetensors")
        assert diff["other"] == str(d / "rank-00000-of-00004.safetensors")
        assert diff["message"].startswith(f"in {side} ({d}): ")
    # a real subprocess names the files in its message; --exclude leaves the tensor out
    bad = subprocess.run(
        [str(RESHARD), "verify", str(d), str(ckpts["hf"])], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 1, bad.stderr
    assert "rank-00003-of-00004.safetensors and rank-00000-of-00004.safetensors" in bad.stderr
    r = runner.invoke(app, ["verify", str(d), str(ckpts["hf"]), "--exclude", "norm"])
    assert r.exit_code == 0, r.output


def test_inspect_missing_rank_file_exit_2(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "missing"
    shutil.copytree(ckpts["tp4"], d)
    (d / "rank-00002-of-00004.safetensors").unlink()
    r = runner.invoke(app, ["inspect", str(d), "--check", "--json"])
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert "rank-00002-of-00004.safetensors" in doc["error"]["message"]


def test_an_interrupted_verify_says_interrupted_not_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import reshard.verify

    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(reshard.verify, "verify_checkpoints", interrupted)
    out = CliRunner().invoke(app, ["verify", str(tmp_path), str(tmp_path)])
    assert out.exit_code == 130
    assert "interrupted" in out.output and "--resume" not in out.output
