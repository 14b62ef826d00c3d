"""The reader's spool is made as the copy reads it: a zstd-compressed DCP chunk, a transposed DCP
chunk and a ``.pt`` view get a region of the spool when the checkpoint is opened, filled when a
command first reads it. ``inspect`` and ``plan`` decompress and write nothing under ``$TMPDIR``;
``convert --include`` makes only the selected tensors' regions; a damaged chunk is an error
naming its file and tensor when it is read (exit 2, nothing committed), a ``crc32`` problem for
``inspect --check``.

torch writes every checkpoint (``dcp.save`` with ``ZStandard()``, ``torch.save``); torch's own
reader is the oracle. Each command runs in a subprocess that reports, after the command and
before the process's exit removes the spool, what is under ``$TMPDIR`` (allocated bytes) and the
bytes the process wrote (``/proc/self/io``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from tests.strategies import same_bits  # noqa: E402

# Runs the CLI in-process (``app``: no os._exit, so the spool is still there afterwards), then
# writes what is under TMPDIR and the bytes written to $REPORT.
_WRAP = """
import json, os, sys
from reshard.cli import app
code = 0
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
tmp = os.environ["TMPDIR"]
found = {}
for d, dirs, fs in os.walk(tmp):
    for n in dirs + fs:
        p = os.path.join(d, n)
        found[os.path.relpath(p, tmp)] = os.stat(p).st_blocks * 512 if n in fs else -1
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
with open(os.environ["REPORT"], "w") as f:
    json.dump({"code": code, "tmp": found, "wchar": int(io["wchar"])}, f)
"""


def run(tmp_path: Path, *args: str | Path, code: int = 0) -> tuple[dict[str, Any], str]:
    """Run ``reshard ARGS`` with TMPDIR an empty directory; (report, stderr)."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    assert not any(tmp.iterdir())
    report = tmp_path / "report.json"
    env = dict(os.environ, TMPDIR=str(tmp), REPORT=str(report))
    r = subprocess.run(
        [sys.executable, "-c", _WRAP, *map(str, args)], capture_output=True, text=True, timeout=180, env=env
    )
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(report.read_text())
    assert doc["code"] == code, r.stdout + r.stderr
    assert not any(tmp.iterdir()), "the spool is removed when the process exits"
    report.unlink()
    return doc, r.stderr


def spool_bytes(doc: dict[str, Any]) -> int:
    """Bytes allocated to the spool files (regions made), checking no other file is left."""
    files = {k: v for k, v in doc["tmp"].items() if v >= 0}
    assert all(k.endswith("/spool.bin") for k in files), files  # (fills' temporaries are gone)
    return sum(files.values())


MODEL = {f"model.layers.{i}.w": (256, 512) for i in range(3)}
OPTIM = {f"optim.layers.{i}.exp_avg": (256, 512) for i in range(3)}


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    sd = {k: torch.randn(*s, generator=g) for k, s in {**MODEL, **OPTIM}.items()}
    sd["model.t"] = torch.randn(64, 96, generator=g).t()  # permuted inside a compressed archive
    return sd


def _nbytes(names: Any) -> int:
    return sum(4 * a * b for a, b in names.values())


@pytest.fixture(scope="module")
def zstd_dcp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        pytest.skip("torch's ZStandard extension needs the zstandard module")
    src = tmp_path_factory.mktemp("lazy") / "zstd"
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(src), _extensions=[ZStandard()]), no_dist=True)
    return src, {k: v.contiguous() for k, v in sd.items()}


@pytest.fixture(scope="module")
def pt_views(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    src = tmp_path_factory.mktemp("lazy_pt") / "model.pt"
    g = torch.Generator().manual_seed(6)
    sd = {
        "w.t": torch.randn(512, 384, generator=g).t(),  # 768 KB, spooled
        "w.stepped": torch.randn(600, 300, generator=g)[::2],  # 360 KB, spooled
        "plain": torch.randn(100, 100, generator=g),
    }
    torch.save(sd, src)
    want = torch.load(src, weights_only=True)
    return src, {k: v.contiguous() for k, v in want.items()}


@pytest.mark.parametrize("kind", ["zstd", "pt"])
def test_inspect_and_plan_make_nothing(
    kind: str, zstd_dcp: tuple[Path, dict[str, Any]], pt_views: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """inspect (text and --json) and plan of a checkpoint whose tensors all go through the spool:
    nothing under TMPDIR (not even its directory), and a few KB written (the checkpoint's data
    are MBs: decompressing or copying them spooled as much before)."""
    src, want = zstd_dcp if kind == "zstd" else pt_views
    data = sum(v.numel() * v.element_size() for v in want.values())
    assert data > 1 << 20
    for args in (["inspect", src], ["inspect", src, "--json"], ["plan", src, "--consolidate"]):
        doc, _ = run(tmp_path, *args)
        assert doc["tmp"] == {}, (args, doc)
        assert doc["wchar"] < 256 << 10, (args, doc)
    doc, _ = run(tmp_path, "inspect", src, "--check")
    assert spool_bytes(doc) >= data - (100 * 100 * 4 if kind == "pt" else 0)  # every region made


def test_convert_makes_only_the_selected_chunks(
    zstd_dcp: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """convert --include 'model.*' decompresses the model's chunks alone (the spool holds their
    bytes, not the optimizer's); the whole convert makes every region once. Both outputs hold
    torch's values."""
    src, want = zstd_dcp
    model = _nbytes(MODEL) + 64 * 96 * 4
    doc, _ = run(
        tmp_path, "convert", src, tmp_path / "model", "--consolidate", "--include", "model.*", "--quiet"
    )
    got = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert sorted(got) == sorted(k for k in want if k.startswith("model."))
    for k, v in got.items():
        assert same_bits(v, want[k]), k
    assert model <= spool_bytes(doc) < model + (64 << 10)  # (a few pages of rounding)
    doc, _ = run(tmp_path, "convert", src, tmp_path / "all", "--consolidate", "--quiet")
    assert spool_bytes(doc) >= model + _nbytes(OPTIM)
    got = load_file(str(tmp_path / "all" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    doc, _ = run(tmp_path, "verify", src, tmp_path / "all", "--include", "optim.*")
    assert _nbytes(OPTIM) <= spool_bytes(doc) < _nbytes(OPTIM) + (64 << 10)


def test_convert_of_unselected_views_makes_no_spool(
    pt_views: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A .pt file's views are copied row-major only when read: --exclude them, and no spool is made."""
    src, want = pt_views
    doc, _ = run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", "--exclude", "w.*", "--quiet")
    assert doc["tmp"] == {}
    assert same_bits(load_file(str(tmp_path / "out" / "model.safetensors"))["plain"], want["plain"])
    doc, _ = run(tmp_path, "convert", src, tmp_path / "t", "--consolidate", "--include", "w.t", "--quiet")
    assert 512 * 384 * 4 <= spool_bytes(doc) < 512 * 384 * 4 + (64 << 10)
    assert same_bits(load_file(str(tmp_path / "t" / "model.safetensors"))["w.t"], want["w.t"])


def _recompress_with_a_flipped_byte(src: Path, fqn: str) -> tuple[str, int]:
    """Flip one byte of tensor ``fqn``'s stored data inside its zstd-compressed archive, which is
    recompressed and padded (a skippable zstd frame) to its old length, so .metadata still holds:
    the stream is sound, the inner record's CRC32 is not. (relative path, offset) of the item."""
    import io
    import zipfile

    import zstandard
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(src)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = src / info.relative_path
    blob = path.read_bytes()
    comp = blob[info.offset : info.offset + info.length]
    archive = bytearray(zstandard.ZstdDecompressor().stream_reader(comp, read_across_frames=True).read())
    with zipfile.ZipFile(io.BytesIO(bytes(archive))) as z:
        rec = next(i for i in z.infolist() if "/data/" in i.filename)
        start = rec.header_offset + 30 + len(rec.filename.encode()) + len(rec.extra)
    archive[start + 100] ^= 0x40
    for level in (19, 15, 9, 3, 1):
        new = zstandard.ZstdCompressor(level=level).compress(bytes(archive))
        pad = len(comp) - len(new)
        if pad == 0 or pad >= 8:
            break
    else:
        pytest.skip("no zstd level gives a frame that fits the old length")
    if pad:
        new += struct.pack("<II", 0x184D2A50, pad - 8) + b"\0" * (pad - 8)
    assert len(new) == len(comp)
    path.write_bytes(blob[: info.offset] + new + blob[info.offset + info.length :])
    return info.relative_path, info.offset


def test_a_damaged_chunk_is_named_when_read(zstd_dcp: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A zstd chunk whose inner record fails its CRC32 (the stream itself is sound): inspect
    (which reads no chunk) is fine; convert reading it exits 2 naming the .distcp file, its
    bytes and the tensor, and commits nothing; convert leaving it out succeeds; inspect --check
    lists it as a crc32 problem (exit 1)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(zstd_dcp[0], src)
    rel, offset = _recompress_with_a_flipped_byte(src, "optim.layers.1.exp_avg")
    run(tmp_path, "inspect", src)
    where = f"{src / rel} (bytes {offset}.."
    doc, err = run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", code=2)
    assert where in err and 'tensor "optim.layers.1.exp_avg"' in err and "CRC32" in err, err
    assert not (tmp_path / "out").exists()
    run(tmp_path, "convert", src, tmp_path / "model", "--consolidate", "--include", "model.*", "--quiet")
    run(tmp_path, "inspect", src, "--check", "--json", code=1)
    r = subprocess.run(
        [str(Path(sys.executable).with_name("reshard")), "inspect", src, "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    (problem,) = json.loads(r.stdout)["check"]["problems"]
    assert problem["kind"] == "crc32" and problem["tensor"] == "optim.layers.1.exp_avg"
    assert problem["path"] == str(src / rel) and where in problem["message"]


def test_a_damaged_view_is_named_when_read(tmp_path: Path) -> None:
    """A .pt view whose record fails its CRC32: convert exits 2 naming the file and tensor, with
    nothing committed; inspect (which copies nothing) exits 0."""
    import zipfile

    src = tmp_path / "model.pt"
    torch.save({"w": torch.randn(64, 32).t(), "b": torch.randn(8)}, src)
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("data/0")))
    raw = bytearray(src.read_bytes())
    raw[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100] ^= 0x40
    src.write_bytes(bytes(raw))
    run(tmp_path, "inspect", src)
    _, err = run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", code=2)
    assert f'{src}: tensor "w": data record' in err and "CRC32" in err, err
    assert not (tmp_path / "out").exists()


def test_a_region_is_made_once_whichever_thread_asks(tmp_path: Path) -> None:
    """Eight threads reading one region: its fill runs once, the others wait for it and read its
    bytes; a fill that fails fails every read of it with the same error, once."""
    from reshard.errors import HeaderError
    from reshard.io.spool import LazySpool

    sp = LazySpool("reshard-test-")
    calls: list[int] = []
    gate = threading.Event()

    def fill(s: LazySpool, at: int) -> None:
        calls.append(at)
        gate.wait(5)  # every thread is asking by now
        os.pwrite(s.open(), b"x" * 4096, at)

    def bad(s: LazySpool, at: int) -> None:
        calls.append(at)
        raise HeaderError("damaged", path="f", tensor="t")

    a = sp.reserve(4096, (0, 0, 10), fill)
    b = sp.reserve(100, (0, 10, 20), bad)
    errors: list[BaseException] = []

    def read(lo: int, hi: int) -> None:
        try:
            sp.ensure(lo, hi)
        except HeaderError as e:
            errors.append(e)

    threads = [threading.Thread(target=read, args=(a + i, a + i + 1)) for i in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert calls == [a] and sp.path.read_bytes()[a : a + 4096] == b"x" * 4096
    threads = [threading.Thread(target=read, args=(b, b + 100)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [a, b] and len(errors) == 4 and all(e is errors[0] for e in errors)
    sp.ensure(a, a + 4096)  # made: nothing to do
    assert sp.filled == 1
    sp.close()


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_zstd_chunk_is_written_once_from_the_stream(
    zstd_dcp: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A full convert writes each zstd chunk's bytes once, into its spool region, straight from the
    decompressed stream: the bytes the process writes, less the output's, are the chunks' bytes
    (and the small transposed chunk's temporary archive), not twice them (a temporary archive
    per chunk, then its copy into the region)."""
    src, want = zstd_dcp
    data = sum(v.numel() * v.element_size() for v in want.values())
    doc, _ = run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    spooled = doc["wchar"] - _tree_bytes(tmp_path / "out")
    assert data <= spooled < data + 2 * 64 * 96 * 4 + (256 << 10), (spooled, data)


def _damage_zstd_frame(src: Path, fqn: str, at: float) -> tuple[str, int]:
    """Overwrite tensor ``fqn``'s zstd stream with 0xFF bytes from fraction ``at`` of it to its end
    (a block header of reserved type: the decompressor fails there); (relative path, offset)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(src)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = src / info.relative_path
    raw = bytearray(path.read_bytes())
    lo = info.offset + max(int(info.length * at), 16)
    raw[lo : info.offset + info.length] = b"\xff" * (info.offset + info.length - lo)
    path.write_bytes(bytes(raw))
    return info.relative_path, info.offset


def test_a_stream_damaged_within_the_chunk_is_named(
    zstd_dcp: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A zstd stream that fails half-way through its chunk's data record (the region partly
    written): convert exits 2 naming the .distcp file, its bytes and the tensor, and commits
    nothing; a convert leaving the tensor out holds torch's values."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(zstd_dcp[0], src)
    rel, offset = _damage_zstd_frame(src, "model.layers.2.w", 0.5)
    run(tmp_path, "inspect", src)
    _, err = run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", "--quiet", code=2)
    assert f"{src / rel} (bytes {offset}.." in err and 'tensor "model.layers.2.w"' in err, err
    assert "zstd stream is damaged" in err, err
    assert not (tmp_path / "out").exists()
    run(
        tmp_path,
        "convert",
        src,
        tmp_path / "rest",
        "--consolidate",
        "--exclude",
        "model.layers.2.w",
        "--quiet",
    )
    got = load_file(str(tmp_path / "rest" / "model.safetensors"))
    want = zstd_dcp[1]
    assert sorted(got) == sorted(k for k in want if k != "model.layers.2.w")
    assert all(same_bits(got[k], want[k]) for k in got)


def test_an_empty_zstd_chunk_is_checked(tmp_path: Path) -> None:
    """A tensor of no element saved through ZStandard still has a compressed archive (its data.pkl
    says dtype and shape): inspect --check decompresses and checks it like any other. Sound, the
    check is clean and convert gives torch's tensors; its stream damaged, inspect (which reads no
    chunk) passes and inspect --check exits 2 naming the file and tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        pytest.skip("torch's ZStandard extension needs the zstandard module")
    src = tmp_path / "src"
    sd = {"empty": torch.empty(0, 4), "w": torch.randn(16, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(src), _extensions=[ZStandard()]), no_dist=True)
    run(tmp_path, "inspect", src, "--check")
    run(tmp_path, "convert", src, tmp_path / "out", "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["empty"].shape == (0, 4) and same_bits(got["w"], sd["w"])
    rel, offset = _damage_zstd_frame(src, "empty", 0.3)
    run(tmp_path, "inspect", src)
    _, err = run(tmp_path, "inspect", src, "--check", code=2)
    assert f"{src / rel} (bytes {offset}.." in err and 'tensor "empty"' in err, err
