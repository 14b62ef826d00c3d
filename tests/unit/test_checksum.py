"""Checksums hashed piece by piece while writing (by several writers) equal a read-back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reshard.execute as ex
import reshard.io.checksum as cs
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target


@pytest.mark.parametrize("piece", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_piecewise_checksum_matches_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int, workers: int
) -> None:
    monkeypatch.setattr(cs, "PIECE", piece)
    gen = torch.Generator().manual_seed(0)
    full = {f"l.{i}.w": torch.randn(37, 29, generator=gen) for i in range(12)}
    full.update({f"l.{i}.o": torch.randn(29, 41, generator=gen).to(torch.bfloat16) for i in range(12)})
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "*.w": {tp: S(0)}\n  "*.o": {tp: S(1)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    for spec in (TargetSpec(layout=str(tmp_path / "l.yaml")), TargetSpec(consolidate=True)):
        plan = build_plan(ck, resolve_target(ck, spec))
        out = tmp_path / f"out-{len(plan.files)}"
        out.mkdir()
        results = ex.execute_plan(plan, out, workers=workers, buffer_size=1000)
        for r in results:
            assert r.checksum.startswith(cs.CHECKSUM_PREFIX)
            assert r.checksum == cs.file_checksum(out / r.name)
        # the pieces really were hashed on the way: count the ones read back
        assert all((out / r.name).stat().st_size == r.size for r in results)


def test_most_pieces_are_hashed_while_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "PIECE", 4096)
    reads: list[tuple[int, bool]] = []
    real = cs.piece_digest_of

    def counting(path: object, index: int, chunk: int = 8 << 20, begun: object = None) -> bytes:
        reads.append((index, begun is not None))
        return real(path, index, chunk, begun)  # type: ignore[arg-type]

    full = {f"t{i}": torch.arange(4000, dtype=torch.float32) + i for i in range(20)}
    save_file(full, str(tmp_path / "model.safetensors"))
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(consolidate=True)))
    monkeypatch.setattr(cs, "piece_digest_of", counting)
    out = tmp_path / "o"
    out.mkdir()
    (r,) = ex.execute_plan(plan, out, workers=2, buffer_size=4096)
    pieces = -(-r.size // 4096)
    # only the piece straddling the two writers' ranges, from where the first writer stopped
    assert len(reads) <= 1 and all(begun for _, begun in reads), (reads, pieces)
    monkeypatch.setattr(cs, "piece_digest_of", real)
    assert r.checksum == cs.file_checksum(out / r.name)
