"""Rank files that list the same names in the same order, but whose entries differ (uneven
shards leave some ranks empty), are paired by position, giving the sources the name-by-name
pairing gives; files whose names differ still go by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard.formats.per_rank as pr
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from reshard.execute import execute_plan
from reshard.formats.manifest import manifest_for, write_manifest


def _uneven(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    gen = torch.Generator().manual_seed(4)
    full = {f"l.{i}.w": torch.randn(3 + i % 2, 5, generator=gen) for i in range(6)}  # 3 or 4 rows
    full |= {f"l.{i}.d": torch.randn(5, 2 + i % 3, generator=gen) for i in range(6)}
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "*.d": {tp: S(1)}\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    out = tmp_path / "tp4"
    out.mkdir()
    execute_plan(plan, out)
    write_manifest(out, manifest_for(plan, [], listed=False))  # self-described rank files
    return full, out


def test_uneven_rank_files_are_paired_by_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full, src = _uneven(tmp_path)
    shapes = {load_file(str(p))["l.0.w"].shape for p in sorted(src.glob("*.safetensors"))}
    assert (0, 5) in shapes  # 3 rows in 4: torch leaves the last rank empty, so headers differ
    used = []
    real = pr._positional_sources
    monkeypatch.setattr(pr, "_positional_sources", lambda *a: used.append(1) or real(*a))
    by_position = open_source(SourceSpec(str(src)))
    assert used == [1]
    monkeypatch.setattr(pr, "_positional_order", lambda files: None)
    by_name = open_source(SourceSpec(str(src)))
    assert list(by_position.tensors) == list(by_name.tensors)
    assert all(by_position.tensors[n] == by_name.tensors[n] for n in by_name.tensors)
    # and the tensors read back are torch's
    out = tmp_path / "hf"
    out.mkdir()
    execute_plan(build_plan(by_position, resolve_target(by_position, TargetSpec(consolidate=True))), out)
    got = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(got[n], t) for n, t in full.items())


def test_rank_files_with_other_names_go_by_name(tmp_path: Path) -> None:
    _, src = _uneven(tmp_path)
    files = pr.RankFiles.one_per_rank(sorted(src.glob("*.safetensors")))
    assert pr._positional_order(files) is not None
    last = sorted(src.glob("*.safetensors"))[-1]
    sd = load_file(str(last))
    save_file(dict(reversed(list(sd.items()))) | {"extra": torch.zeros(1)}, str(last))
    files = pr.RankFiles.one_per_rank(sorted(src.glob("*.safetensors")))
    assert pr._positional_order(files) is None
