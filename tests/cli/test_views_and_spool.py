"""Tensors a checkpoint stores as views (``x.t()``, ``big[::3]``, ``big[4:7]``, ``x.permute``) read
as torch holds them, and the reader's spool of their row-major copies never shown as a file of
the checkpoint. torch writes every file (``torch.save``, ``dcp.save``); torch is the oracle
(``torch.load(weights_only=True)`` then ``.contiguous()``); real CLI subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from tests.strategies import same_bits  # noqa: E402

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(
    *args: str | Path, code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r


def _views() -> dict[str, Any]:
    """A state dict of views as a training script may hold them (none made contiguous)."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(24, 10, generator=g)
    cube = torch.randn(4, 6, 5, generator=g).to(torch.bfloat16)
    return {
        "layers.0.t": torch.randn(10, 6, generator=g).t(),  # a transposed 2-D view: strides (1, 6)
        "layers.0.stepped": big[::3],  # every third row: strides (30, 1), gaps between rows
        "layers.0.offset": big[4:10],  # row-major at storage offset 40 of big's storage
        "layers.0.cols": big[2:20:2, 1:9:3],  # stepped in both dims, at an offset
        "layers.0.permuted": cube.permute(2, 0, 1),  # a 3-D permute, bfloat16
        "layers.0.column": big[:, 7],  # one column: stride 10
        "layers.0.expanded": torch.randn(6, 1, generator=g).expand(6, 4),  # stride 0: 6 stored elements
        "plain": torch.arange(12, dtype=torch.int32).reshape(4, 3),
    }


@pytest.fixture(scope="module")
def pt_views(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    src = tmp_path_factory.mktemp("pt_views") / "src"
    src.mkdir()
    torch.save(_views(), src / "model.pt")
    want = torch.load(src / "model.pt", weights_only=True)  # what torch holds
    assert not want["layers.0.t"].is_contiguous() and not want["layers.0.stepped"].is_contiguous()
    return src, {k: v.contiguous() for k, v in want.items()}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_bits(got[name], t), name


def test_torch_save_views_convert_to_hf_as_torch_holds_them(
    pt_views: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Each view exited 2 ("stored with strides [1, 6], not row-major") when the file was opened."""
    src, want = pt_views
    run_cli("convert", src / "model.pt", tmp_path / "hf", "--consolidate", "--quiet")
    _same(load_file(str(tmp_path / "hf" / "model.safetensors")), want)
    doc = json.loads(run_cli("inspect", src, "--check", "--json").stdout)
    assert doc["ok"] is True
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shapes == {k: list(v.shape) for k, v in want.items()}


def test_torch_save_views_convert_to_tp2_and_back(
    pt_views: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """TP-2 (every tensor S(0), rank r holding torch.chunk's part r), then back to one file."""
    src, want = pt_views
    layout = tmp_path / "tp.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*": {tp: S(0)}\n')
    run_cli("convert", src, tmp_path / "tp", "--target-layout", layout, "--quiet")
    for r in range(2):
        got = load_file(str(tmp_path / "tp" / f"rank-{r:05d}-of-00002.safetensors"))
        _same(got, {k: v.chunk(2)[r].contiguous() for k, v in want.items()})
    run_cli("convert", tmp_path / "tp", tmp_path / "hf", "--consolidate", "--quiet")
    _same(load_file(str(tmp_path / "hf" / "model.safetensors")), want)


def test_an_excluded_view_is_not_needed(pt_views: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """``--exclude`` of views: the rest converts, the views are left out."""
    src, want = pt_views
    run_cli("convert", src, tmp_path / "hf", "--consolidate", "--exclude", "layers.0.*", "--quiet")
    _same(load_file(str(tmp_path / "hf" / "model.safetensors")), {"plain": want["plain"]})


def test_reports_name_the_pt_file_not_the_spool(
    pt_views: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """inspect counts the .pt file alone; plan reads only it, within its bytes."""
    src, want = pt_views
    size = (src / "model.pt").stat().st_size
    doc = json.loads(run_cli("inspect", src, "--json").stdout)
    assert doc["files"] == [{"name": "model.pt", "size": size}] and doc["file_bytes"] == size
    plan = run_cli("plan", src, "--consolidate", "--json").stdout
    assert "spool" not in plan
    (out,) = json.loads(plan)["files"]
    assert [s["file"] for s in out["sources"]] == ["model.pt"]
    assert out["bytes_read"] == sum(v.numel() * v.element_size() for v in want.values())
    assert all(0 <= a < b <= size for a, b in out["sources"][0]["ranges"])


def test_a_damaged_view_record_is_a_problem(tmp_path: Path) -> None:
    """A view's record is copied, not read in place: its CRC32 is checked as it is copied, and a
    flipped byte in it makes inspect --check exit 1 naming the file and the tensor."""
    import zipfile

    src = tmp_path / "model.pt"
    torch.save({"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).t()}, src)
    run_cli("inspect", src, "--check")
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("data/0")))
    raw = bytearray(src.read_bytes())
    raw[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100] ^= 0x40
    src.write_bytes(bytes(raw))
    r = run_cli("inspect", src, "--check", code=1)
    out = r.stdout + r.stderr
    assert f'{src}: tensor "w": data record' in out and "CRC32" in out, out


# --------------------------------------------------------------------------- DCP's spool


@pytest.fixture(scope="module", params=["transposed", "zstd"])
def dcp_views(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(16, 8, generator=g),
        "t": torch.randn(8, 12, generator=g).t(),  # saved with its strides: spooled row-major
        "p": torch.randn(3, 4, 5, generator=g).permute(1, 2, 0),
    }
    src = tmp_path_factory.mktemp("dcp_views") / request.param
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        if request.param == "zstd":  # compressed: every chunk is spooled
            from torch.distributed.checkpoint._extension import ZStandard

            if not ZStandard.is_available():
                pytest.skip("torch's ZStandard extension needs the zstandard module")
            dcp.save(
                state, storage_writer=FileSystemWriter(str(src), _extensions=[ZStandard()]), no_dist=True
            )
        else:
            dcp.save(state, checkpoint_id=str(src), no_dist=True)
    return src


def _storage(src: Path) -> dict[str, list[tuple[int, int]]]:
    """Per data file, the byte range of each item torch's .metadata gives (torch reads it)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(src)).read_metadata()
    out: dict[str, list[tuple[int, int]]] = {}
    for info in md.storage_data.values():
        out.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    return out


def test_dcp_spool_is_not_a_file_of_the_checkpoint(dcp_views: Path) -> None:
    """inspect showed files=2 with spool.bin, its bytes in file_bytes and the transposed chunks in
    spool.bin; plan listed spool.bin among the files it reads. Now the .distcp files alone."""
    data = sorted(p.name for p in dcp_views.iterdir() if p.name.endswith(".distcp"))
    sizes = {n: (dcp_views / n).stat().st_size for n in data}
    r = run_cli("inspect", dcp_views, "--json")
    assert "spool" not in r.stdout
    doc = json.loads(r.stdout)
    assert doc["files"] == [{"name": n, "size": sizes[n]} for n in data]
    assert doc["file_bytes"] == sum(sizes.values())
    chunks = {t["name"]: t["chunks"] for t in doc["tensors"]}
    assert {c["file"] for cs in chunks.values() for c in cs} <= set(data)
    assert chunks["t"] == [{"file": data[0], "box": "[0:12)x[0:8)"}]
    r = run_cli("inspect", dcp_views)
    text = r.stdout + r.stderr  # (people's tables go to stderr)
    assert f"files={len(data)} " in text and "spool" not in text


@pytest.mark.parametrize(
    "target", [["--consolidate"], ["--target-mesh", "tp=2", "--target-layout", "replicated"]]
)
def test_dcp_plan_reads_the_distcp_files(dcp_views: Path, target: list[str], tmp_path: Path) -> None:
    """plan names the chunk's own .distcp file and a range inside one of its stored items."""
    items = _storage(dcp_views)
    r = run_cli("plan", dcp_views, *target, "--json")
    assert "spool" not in r.stdout
    doc = json.loads(r.stdout)
    for f in doc["files"]:
        assert f["bytes_read"] == 4 * (16 * 8 + 12 * 8 + 4 * 5 * 3)
        assert sum(s["bytes"] for s in f["sources"]) == f["bytes_read"]
        for s in f["sources"]:
            assert s["file"] in items
            for a, b in s["ranges"]:  # coalesced: a run of whole items or a part of one
                assert any(lo <= a < hi for lo, hi in items[s["file"]]), (a, b)
                assert any(lo < b <= hi for lo, hi in items[s["file"]]), (a, b)
    r = run_cli("plan", dcp_views, *target)
    assert "__0_0.distcp" in r.stderr and "spool" not in r.stdout + r.stderr
    run_cli("convert", dcp_views, tmp_path / "out", *target, "--quiet")
    assert run_cli("verify", dcp_views, tmp_path / "out").returncode == 0


# --------------------------------------------------------------------------- the spool's copy


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(37, 29, generator=g).t(),
        lambda g: torch.randn(40, 9, generator=g)[::3],
        lambda g: torch.randn(6, 7, 8, generator=g).permute(2, 0, 1)[1:7:2],
        lambda g: torch.randn(500, 64, generator=g)[:, 5],  # a column: many pages, few bytes
        lambda g: torch.randn(3, 1, generator=g).expand(3, 50),  # stride 0 (torch.load keeps it)
        lambda g: torch.randn(10, 10, generator=g).to(torch.complex128).t(),  # 16-byte elements
    ],
)
def test_spool_copies_strided_tensors_tile_by_tile(tmp_path: Path, make: Any) -> None:
    """``LazySpool.write_strided`` with tiles of 64 bytes gives ``.contiguous()``'s bytes."""
    from reshard.io.spool import LazySpool, strided_span

    x = make(torch.Generator().manual_seed(1))
    storage = x.untyped_storage()
    src = tmp_path / "storage.bin"
    raw = bytes(storage)
    src.write_bytes(b"\xee" * 13 + raw)
    isz = x.element_size()
    assert x.storage_offset() * isz + strided_span(x.shape, x.stride()) * isz <= len(raw)
    sp = LazySpool("reshard-test-")
    fd = os.open(src, os.O_RDONLY)
    try:
        first = 13 + x.storage_offset() * isz
        shape, stride = tuple(x.shape), tuple(x.stride())
        sp.reserve(5, (0, 0, 5), lambda s, at: os.pwrite(s.open(), b"12345", at))  # a region before it

        def fill(s: LazySpool, at: int) -> None:
            s.write_strided(at, fd, first, shape, stride, isz, tile_bytes=64)

        at = sp.reserve(x.numel() * isz, (0, first, 0), fill)
        assert at == 64 and not sp.path.exists()  # reserved: nothing made
        sp.ensure(at, at + 1)
        assert sp.filled == 1 and sp.path.stat().st_size == sp.size == at + x.numel() * isz
        got = sp.path.read_bytes()[at : at + x.numel() * isz]
    finally:
        os.close(fd)
        sp.close()
    c = x.contiguous()
    assert got == bytes(c.untyped_storage())[: c.numel() * isz]
