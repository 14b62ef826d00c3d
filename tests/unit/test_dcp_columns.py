"""DCP files written a window of whole chunk archives at a time (execute._Writer.chunk_steps) are
the bytes the per-entry path writes (itself checked against torch's own DCP reader elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reshard.execute as ex
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target


def _source(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(40):  # many small chunks of a few geometries and dtypes
        sd[f"layers.{i}.w"] = torch.randn(8, 12, generator=gen).to(torch.bfloat16)
        sd[f"layers.{i}.o"] = torch.randn(12, 8, generator=gen)
        sd[f"layers.{i}.n"] = torch.arange(12, dtype=torch.int16) + i
    sd["big.w"] = torch.randn(256, 96, generator=gen)  # 96 KiB: over a small buffer's window
    sd["empty"] = torch.zeros(0, 4)
    sd["scalar"] = torch.tensor(2.5)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text(
        'mesh: {tp: 4}\nplacements:\n  "*.w": {tp: S(0)}\n  "*.o": {tp: S(1)}\n  "*": R\n'
    )
    return tmp_path / "model.safetensors"


def _write(plan, out: Path, workers: int, buffer_size: int) -> dict[str, bytes]:
    out.mkdir()
    ex.execute_plan(plan, out, workers=workers, buffer_size=buffer_size)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("layout", [False, True])
def test_chunk_windows_write_the_per_entry_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: bool
) -> None:
    src = _source(tmp_path)
    ck = open_source(SourceSpec(str(src)))
    spec = TargetSpec(layout=str(tmp_path / "l.yaml"), to="dcp") if layout else TargetSpec(to="dcp")
    plan = build_plan(ck, resolve_target(ck, spec))
    chunked = 0
    real = ex._Writer._copy_chunks

    def counting(self, *a, **k):  # type: ignore[no-untyped-def]
        nonlocal chunked
        chunked += 1
        return real(self, *a, **k)

    monkeypatch.setattr(ex._Writer, "_copy_chunks", counting)
    got = {
        (w, b): _write(plan, tmp_path / f"out-{w}-{b}", w, b)
        for w in (1, 2, 4)
        for b in (4096, 1 << 16, 1 << 20)
    }
    assert chunked > 0  # the window path ran
    monkeypatch.setattr(ex._GeometriesOf, "of_chunks", lambda self, f: None)  # entry by entry
    want = _write(plan, tmp_path / "per-entry", 1, 1 << 20)
    assert len(want) == (4 if layout else 1)
    for key, files in got.items():
        assert files == want, key
