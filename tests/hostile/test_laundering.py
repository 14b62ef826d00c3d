"""Convert does not launder: what ``inspect --check`` flags is refused, not copied under fresh checksums.

Each case exited 0 before: a flipped byte in a reshard-written source came out with new
checksums, a ``reshard.json`` contradicting its files converted, and two HF shards
disagreeing on a tensor were resolved silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

RESHARD = str(Path(sys.executable).parent / "reshard")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run([RESHARD, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def written(tmp_path: Path) -> Path:
    """A per-rank checkpoint reshard wrote (its reshard.json has checksums)."""
    g = torch.Generator().manual_seed(0)
    (tmp_path / "hf").mkdir()
    save_file(
        {f"l{i}.w": torch.randn(32, 16, generator=g) for i in range(3)},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    out = tmp_path / "tp2"
    p = run(
        "convert", str(tmp_path / "hf"), str(out), "--target-layout", "replicated", "--target-mesh", "tp=2"
    )
    assert p.returncode == 0, p.stderr
    return out


def test_a_flipped_source_byte_is_caught_before_commit(written: Path, tmp_path: Path) -> None:
    f = written / "rank-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10
    f.write_bytes(bytes(data))
    assert run("inspect", str(written), "--check").returncode == 1  # --check sees it
    dst = tmp_path / "out"
    p = run("convert", str(written), str(dst), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert "rank-00001-of-00002.safetensors" in p.stderr and "checksum" in p.stderr, p.stderr
    assert "--no-verify-source" in p.stderr and "Traceback" not in p.stderr
    assert not dst.exists()
    p = run("convert", str(written), str(dst), "--consolidate", "--no-verify-source")
    assert p.returncode == 0, p.stderr


def test_a_manifest_contradicting_its_files_is_refused(written: Path, tmp_path: Path) -> None:
    man = json.loads((written / "reshard.json").read_text())
    # a format version 1 manifest (earlier reshard listed every tensor) saying another shape
    del man["tensor_count"]
    man["reshard"]["format_version"] = 1
    man["tensors"] = {f"l{i}.w": {"dtype": "F32", "shape": [32, 16], "placements": ["R"]} for i in range(3)}
    man["tensors"]["l0.w"]["shape"] = [16, 32]
    (written / "reshard.json").write_text(json.dumps(man))
    dst = tmp_path / "out"
    p = run("convert", str(written), str(dst), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert "l0.w" in p.stderr and "inspect --check" in p.stderr and "Traceback" not in p.stderr
    assert not dst.exists()


def test_a_manifest_miscounting_its_tensors_is_refused(written: Path, tmp_path: Path) -> None:
    man = json.loads((written / "reshard.json").read_text())
    assert man["reshard"]["format_version"] == 2 and man["tensor_count"] == 3 and "tensors" not in man
    man["tensor_count"] = 2
    (written / "reshard.json").write_text(json.dumps(man))
    p = run("convert", str(written), str(tmp_path / "out"), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert "holds 2 tensors" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("same", [True, False])
def test_hf_shards_disagreeing_on_a_tensor(tmp_path: Path, same: bool) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(2)}, str(src / "model-00001-of-00002.safetensors"))
    stale = torch.zeros(4, 4) if same else torch.zeros(8, 2)
    save_file({"a": stale, "c": torch.ones(3)}, str(src / "model-00002-of-00002.safetensors"))
    wm = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    p = run("convert", str(src), str(tmp_path / "out"), "--consolidate")
    if same:
        assert p.returncode == 0, p.stderr
        assert 'tensor "a" is also in model-00001-of-00002.safetensors' in p.stderr
    else:
        assert p.returncode == 2, p.stderr
        assert (
            'tensor "a"' in p.stderr
            and "[8, 2]" in p.stderr
            and "[4, 4]" in p.stderr
            and "disagree" in p.stderr
        )
        assert not (tmp_path / "out").exists()


def _rchar() -> int:
    """Bytes this process has read with read/pread system calls (page cache included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("target", ["tp=4", "hf"])
def test_source_verification_reads_the_source_once(tmp_path: Path, target: str) -> None:
    """Verification hashes the bytes the copy reads: a verified conversion reads the source
    about once (headers and a little out-of-order data again), not twice (main: ~2x)."""
    from reshard.convert import SourceSpec, TargetSpec, convert

    g = torch.Generator().manual_seed(0)
    (tmp_path / "hf").mkdir()
    full = {f"l{i}.w": torch.randn(256, 1024, generator=g) for i in range(12)}  # 12 MiB
    save_file(full, str(tmp_path / "hf" / "model.safetensors"))
    layout = tmp_path / "l.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.w": {tp: S(0)}\n')
    src = tmp_path / "tp2"
    p = run("convert", str(tmp_path / "hf"), str(src), "--target-layout", str(layout))
    assert p.returncode == 0, p.stderr
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    spec = TargetSpec(consolidate=True) if target == "hf" else TargetSpec(mesh=target)
    reads = []
    for i, verify in enumerate([False, True, False, True]):
        before = _rchar()
        convert(SourceSpec(str(src)), tmp_path / f"out{i}", spec, workers=2, verify_source=verify)
        reads.append(_rchar() - before)
    extra = min(reads[1], reads[3]) - max(reads[0], reads[2])  # what verifying read besides the copy
    assert extra < 0.2 * size, (reads, size)
    # and it did verify: a flipped byte in the middle of a file is refused
    f = src / "rank-00000-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    p = run(
        "convert",
        str(src),
        str(tmp_path / "refused"),
        *(["--consolidate"] if target == "hf" else ["--target-mesh", target]),
    )
    assert p.returncode == 2 and "rank-00000-of-00002.safetensors" in p.stderr, p.stderr


@pytest.mark.parametrize("target", ["hf", "dcp"])
def test_renamed_tensors_are_read_in_source_order(tmp_path: Path, target: str) -> None:
    """Renames whose names sort in another order than the source's: the output lists the tensors
    in the order their bytes lie in the source, so verifying the source's recorded hash reads it
    once (in name order, every other tensor was ahead of the hash: half the source read twice),
    and the inverse profile gives the source's bytes back."""
    from safetensors import safe_open

    from reshard.convert import SourceSpec, TargetSpec, convert

    g = torch.Generator().manual_seed(0)
    (tmp_path / "raw").mkdir()
    full = {f"l.{i}.{p}": torch.randn(256, 1024, generator=g) for i in range(6) for p in "ab"}  # 12 MiB
    save_file(full, str(tmp_path / "raw" / "model.safetensors"))
    src = tmp_path / "hf"  # reshard's copy: its reshard.json records the file's hash
    p = run("convert", str(tmp_path / "raw"), str(src), "--consolidate")
    assert p.returncode == 0, p.stderr
    spec = tmp_path / "swap.yaml"  # l.{i}.b first: every b before every a, by name
    spec.write_text('transforms:\n  - rename:\n      "l.{i}.a": "y.{i}"\n      "l.{i}.b": "x.{i}"\n')
    size = (src / "model.safetensors").stat().st_size
    out = {
        "hf": TargetSpec(consolidate=True, transforms=str(spec)),
        "dcp": TargetSpec(to="dcp", transforms=str(spec)),
    }
    reads = []
    for i, verify in enumerate([False, True, False, True]):
        before = _rchar()
        # one worker, a 1 MiB window: spans ahead of the hash are held within it, the rest read again
        convert(
            SourceSpec(str(src)),
            tmp_path / f"out{i}",
            out[target],
            workers=1,
            verify_source=verify,
            window=1 << 20,
        )
        reads.append(_rchar() - before)
    extra = min(reads[1], reads[3]) - max(reads[0], reads[2])
    assert extra < 0.1 * size, (reads, size)  # name order: ~0.4x the source
    if target == "hf":
        with safe_open(str(tmp_path / "out1" / "model.safetensors"), "pt") as f:
            for i in range(6):  # the values, under the new names
                assert torch.equal(f.get_tensor(f"y.{i}"), full[f"l.{i}.a"])
                assert torch.equal(f.get_tensor(f"x.{i}"), full[f"l.{i}.b"])
        data = (tmp_path / "out1" / "model.safetensors").read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        starts = sorted((v["data_offsets"][0], n) for n, v in header.items() if n != "__metadata__")
        assert [n for _, n in starts] == [f"{c}.{i}" for i in range(6) for c in "yx"]  # l.i.a, l.i.b in turn
        back = tmp_path / "back"
        p = run(
            "convert",
            str(tmp_path / "out1"),
            str(back),
            "--transforms",
            str(spec),
            "--inverse",
            "--consolidate",
        )
        assert p.returncode == 0, p.stderr
        assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
