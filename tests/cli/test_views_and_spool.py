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


RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(
    *args: str | Path, code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r


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
    """``Spool.strided`` with tiles of 64 bytes gives ``.contiguous()``'s bytes."""
    from reshard.io.spool import Spool, strided_span

    x = make(torch.Generator().manual_seed(1))
    storage = x.untyped_storage()
    src = tmp_path / "storage.bin"
    raw = bytes(storage)
    src.write_bytes(b"\xee" * 13 + raw)
    isz = x.element_size()
    assert x.storage_offset() * isz + strided_span(x.shape, x.stride()) * isz <= len(raw)
    sp = Spool("reshard-test-")
    fd = os.open(src, os.O_RDONLY)
    try:
        first = 13 + x.storage_offset() * isz
        at = sp.strided(fd, first, tuple(x.shape), tuple(x.stride()), isz, (0, first, 0), tile_bytes=64)
        assert sp.path is not None
        got = sp.path.read_bytes()[at : at + x.numel() * isz]
    finally:
        os.close(fd)
        sp.close()
    c = x.contiguous()
    assert got == bytes(c.untyped_storage())[: c.numel() * isz]
