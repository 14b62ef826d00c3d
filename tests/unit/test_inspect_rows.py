"""inspect's rows of a DCP checkpoint: each chunk's box and file, the lists shared by tensors of
one geometry (a TP-8 DCP of 100k tensors held 800k chunk dicts: 440 MiB for ``inspect --check``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from reshard.cli import app
from reshard.convert import SourceSpec, open_source
from reshard.report import _block_text, inspect_report


def test_dcp_rows_give_each_chunk_and_share_them_by_geometry(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    full = {f"l.{i}.w": torch.randn(8, 6, generator=gen) for i in range(6)}
    full |= {f"l.{i}.v": torch.randn(6, 8, generator=gen) for i in range(6)}
    full["n"] = torch.randn(6, generator=gen)
    save_file(full, str(tmp_path / "model.safetensors"))
    rules = '  "*.v": {tp: S(1)}\n  "n": {tp: R}\n  "*": {tp: S(0)}\n'
    (tmp_path / "l.yaml").write_text(f"mesh: {{tp: 4}}\nplacements:\n{rules}")
    out = tmp_path / "dcp"
    args = ["convert", str(tmp_path / "model.safetensors"), str(out), "--to", "dcp"]
    assert CliRunner().invoke(app, [*args, "--target-layout", str(tmp_path / "l.yaml")]).exit_code == 0
    ck = open_source(SourceSpec(str(out)))
    rows = {r["name"]: r for r in inspect_report(ck)["tensors"]}
    for name, t in ck.tensors.items():  # every chunk's file and box, in the tensor's piece order
        want = [
            {"file": os.path.basename(ck.files[fi]), "box": _block_text(b)}
            for fi, b in zip(t.piece_files, t.piece_blocks, strict=True)
        ]
        assert rows[name]["chunks"] == want, name
    assert len(rows["l.0.w"]["chunks"]) == 4 and len(rows["n"]["chunks"]) == 1
    assert rows["l.0.w"]["chunks"] != rows["l.0.v"]["chunks"]  # rows vs columns
    assert ck.tensors["l.0.w"].piece_files == ck.tensors["l.5.w"].piece_files  # each rank its file
    assert rows["l.0.w"]["chunks"] is rows["l.5.w"]["chunks"]  # so one list for the geometry
