"""The format registry: a new read-only format is one module plus one registry line.

The toy format here is a directory of ``.npy`` files with an ``index.json`` naming the
tensor each file holds. Everything it needs is below (the "module") and the single
``formats.register(NPY_READER)`` call (the "registry line"); planning, converting,
verifying and ``inspect --check`` then work on it unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard import formats
from reshard.check import check_checkpoint
from reshard.checkpoint import Checkpoint, NonTensor, TensorSource
from reshard.convert import SourceSpec, TargetSpec, build_plan, convert, open_source, resolve_target
from reshard.errors import HeaderError
from reshard.formats.base import NO, YES, Probe, Reader, ReadOptions
from reshard.intervals import full_block
from reshard.report import inspect_report
from reshard.verify import verify_checkpoints

# --------------------------------------------------------------------------- the toy format module

_NPY_DTYPES = {
    "<f4": "F32",
    "<f2": "F16",
    "<f8": "F64",
    "<i8": "I64",
    "<i4": "I32",
    "|u1": "U8",
    "|b1": "BOOL",
}


def _npy_detect(probe: Probe) -> int:
    return YES if not probe.is_file and "index.json" in probe.names else NO


def _npy_open(path: Path, options: ReadOptions) -> Checkpoint:
    index = json.loads((path / "index.json").read_text())
    files, tensors = [], {}
    for i, (name, fname) in enumerate(sorted(index.items())):
        f = path / fname
        with open(f, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(fh)
            offset = fh.tell()
        if fortran or dtype.str not in _NPY_DTYPES:
            raise HeaderError(f"{f}: not a C-order array of a supported dtype", path=str(f))
        files.append(str(f))
        tensors[name] = TensorSource(
            name=name,
            dtype=_NPY_DTYPES[dtype.str],
            shape=tuple(shape),
            piece_files=(i,),
            piece_offsets=(offset,),
            piece_blocks=(full_block(tuple(shape)),),
            signature=("full", tuple(shape)),
        )
    return Checkpoint(
        path=str(path),
        format="npy-dir",
        files=tuple(files),
        file_sizes=tuple(Path(f).stat().st_size for f in files),
        tensors=tensors,
    )


NPY_READER = Reader(
    name="npy-dir", help="a directory of .npy files with index.json", detect=_npy_detect, open=_npy_open
)

# --------------------------------------------------------------------------- tests


@pytest.fixture
def npy_format() -> Iterator[None]:
    formats.register(NPY_READER)  # the one registry line
    try:
        yield
    finally:
        formats.unregister("npy-dir")


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(10, 6, generator=gen),
        "model.layers.0.w": torch.randn(6, 6, generator=gen).half(),
        "model.layers.0.b": torch.arange(6, dtype=torch.int64),
        "model.scale": torch.tensor(2.5, dtype=torch.float64),
    }


def _write_npy_dir(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    d.mkdir()
    index = {}
    for i, (name, t) in enumerate(tensors.items()):
        np.save(d / f"t{i}.npy", t.numpy())
        index[name] = f"t{i}.npy"
    (d / "index.json").write_text(json.dumps(index))


def test_a_registered_reader_plans_converts_verifies_and_checks(tmp_path: Path, npy_format: None) -> None:
    full = _tensors()
    _write_npy_dir(tmp_path / "npy", full)
    save_file(full, str(tmp_path / "ref.safetensors"))
    assert formats.detect_format(tmp_path / "npy") == "npy-dir"

    ck = open_source(SourceSpec(str(tmp_path / "npy")))
    assert ck.format == "npy-dir" and check_checkpoint(ck) == []
    plan = build_plan(ck, resolve_target(ck, TargetSpec(consolidate=True)))
    assert [f.name for f in plan.files] == [
        "model.safetensors"
    ] and plan.bytes_read == plan.bytes_written - len(plan.files[0].prefix)

    out = convert(SourceSpec(str(tmp_path / "npy")), tmp_path / "hf", TargetSpec(consolidate=True))
    assert out["source"]["format"] == "npy-dir"
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    ref = open_source(SourceSpec(str(tmp_path / "ref.safetensors")))
    assert verify_checkpoints(ck, ref)["equal"]

    # and the other way round: TP-2 per-rank output from it, via a layout
    (tmp_path / "l.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "*.weight": {tp: S(0)}\n  "*": R\n')
    convert(SourceSpec(str(tmp_path / "npy")), tmp_path / "tp2", TargetSpec(layout=str(tmp_path / "l.yaml")))
    assert verify_checkpoints(open_source(SourceSpec(str(tmp_path / "tp2"))), ref)["equal"]


def test_a_changed_byte_is_found(tmp_path: Path, npy_format: None) -> None:
    full = _tensors()
    _write_npy_dir(tmp_path / "npy", full)
    save_file(full, str(tmp_path / "ref.safetensors"))
    p = tmp_path / "npy" / "t0.npy"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x40
    p.write_bytes(bytes(data))
    doc = verify_checkpoints(
        open_source(SourceSpec(str(tmp_path / "npy"))),
        open_source(SourceSpec(str(tmp_path / "ref.safetensors"))),
    )
    assert [d["tensor"] for d in doc["differences"]] == ["model.embed.weight"]
    assert doc["differences"][0]["index"] == [9, 5]


def test_unregistered_formats_are_not_detected(tmp_path: Path) -> None:
    _write_npy_dir(tmp_path / "npy", _tensors())
    with pytest.raises(Exception, match="no checkpoint found"):
        formats.detect_format(tmp_path / "npy")


def test_detection_priority_breaks_ties(tmp_path: Path) -> None:
    # hf's index and per-rank names are both strong signs; the earlier registered format wins
    d = tmp_path / "both"
    d.mkdir()
    save_file({"x": torch.zeros(2)}, str(d / "rank-00000-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"x": "rank-00000-of-00001.safetensors"}})
    )
    assert [r.name for r in formats.readers()].index("hf") < [r.name for r in formats.readers()].index(
        "per-rank"
    )
    assert formats.detect_format(d) == "hf"


def test_cli_choices_and_readme_come_from_the_registry() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert formats.markdown() in readme, "README's format list is stale: paste `python -m reshard.formats`"
    from typer.testing import CliRunner

    from reshard.cli import app

    text = CliRunner().invoke(app, ["convert", "--help"], terminal_width=400).output
    for f in [*formats.readers(), *formats.writers()]:
        assert f.name in text


def _with_crc32_and_extras(path: Path, options: ReadOptions) -> Checkpoint:
    """The toy format, with the CRC32s recorded in ``crc.json`` and ``extra.bin`` as a non-tensor item."""
    ck = _npy_open(path, options)
    ck.format = "npy-crc"
    crcs = json.loads((path / "crc.json").read_text())
    for name, t in ck.tensors.items():
        ck.tensors[name] = dataclasses.replace(t, piece_crc32=(crcs[name],))
    extra = path / "extra.bin"
    ck.files += (str(extra),)
    ck.file_sizes += (extra.stat().st_size,)
    ck.non_tensors = (NonTensor("optimizer.step", extra.stat().st_size, len(ck.files) - 1, "bytes"),)
    return ck


def test_piece_crc32s_are_checked_and_non_tensors_listed(tmp_path: Path) -> None:
    full = _tensors()
    _write_npy_dir(tmp_path / "npy", full)
    (tmp_path / "npy" / "extra.bin").write_bytes(b"step=7")
    crcs = {name: zlib.crc32(t.numpy().tobytes()) for name, t in full.items()}
    (tmp_path / "npy" / "crc.json").write_text(json.dumps(crcs))
    formats.register(Reader("npy-crc", "npy with CRC32s", _npy_detect, _with_crc32_and_extras), first=True)
    try:
        ck = open_source(SourceSpec(str(tmp_path / "npy")))
        assert ck.format == "npy-crc" and check_checkpoint(ck) == []
        doc = inspect_report(ck)
        item = {"name": "optimizer.step", "size": 6, "kind": "bytes", "file": "extra.bin"}
        assert doc["non_tensors"] == [{**item, "copied_by_dcp": False}]  # (no offset: not one run)
        out = convert(SourceSpec(str(tmp_path / "npy")), tmp_path / "hf", TargetSpec(consolidate=True))
        assert any("optimizer.step" in w and "not converted" in w for w in out["warnings"])
        assert not any("--to dcp" in w for w in out["warnings"])  # no stored run: --to dcp drops it too
        assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == set(full)

        p = tmp_path / "npy" / "t1.npy"  # model.layers.0.w
        data = bytearray(p.read_bytes())
        data[-3] ^= 1
        p.write_bytes(bytes(data))
        problems = check_checkpoint(open_source(SourceSpec(str(tmp_path / "npy"))))
        assert [(q["kind"], q["tensor"]) for q in problems] == [("crc32", "model.layers.0.w")]
        assert "does not match the recorded" in problems[0]["message"]
    finally:
        formats.unregister("npy-crc")
