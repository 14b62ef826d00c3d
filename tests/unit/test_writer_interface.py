"""The writer interface: fixed bytes between entries and CRC32 patches, as container formats need.

The toy writer here lays out each target rank's file as a sequence of records
``b"REC!" + crc32 (4 bytes, patched after the data is written) + nbytes (8 bytes)``,
each followed by one tensor's block, then a trailer naming the tensors, the way a
torch.save zip (local header, data, central directory with CRC32s) is laid out.
The executor must write the fixed bytes, compute each entry's CRC32 while writing,
apply the patches from ``finish`` and checksum the patched file, whether a file is
written by one thread, in lockstep with its siblings, or split between threads.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard.io.checksum as cs
from reshard import formats
from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.formats.base import Writer
from reshard.formats.manifest import manifest_for, write_manifest
from reshard.formats.per_rank import rank_file_name
from reshard.io.writer import FileResult
from reshard.mesh import Mesh
from reshard.plan import FileLayout, OutEntry, OutFile, Plan, TargetTensor, WriteOptions, local_nbytes

_REC = 16


class RecordFile(OutFile):
    __slots__ = ()
    needs_crc32 = True

    def lay_out(self) -> FileLayout:
        fixed: list[tuple[int, bytes]] = []
        entries = []
        pos = 0
        for t in self.tensors:
            n = local_nbytes(t, self.local_rank)
            fixed.append((pos, b"REC!" + b"\0\0\0\0" + struct.pack("<Q", n)))
            entries.append(OutEntry(t, self.local_rank, pos + _REC, n))
            pos += _REC + n
        trailer = json.dumps([t.name for t in self.tensors]).encode()
        fixed.append((pos, trailer))
        return FileLayout(tuple(fixed), tuple(entries), pos + len(trailer))

    def finish(self, crc32s: Sequence[int]) -> Sequence[tuple[int, bytes]]:
        return [(e.start - _REC + 4, struct.pack("<I", c)) for e, c in zip(self.entries, crc32s)]


def _files(tensors: Sequence[TargetTensor], mesh: Mesh, options: WriteOptions) -> list[OutFile]:
    return [RecordFile(rank_file_name(r, mesh.size) + ".rec", r, list(tensors)) for r in range(mesh.size)]


def _complete(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    write_manifest(dst, manifest_for(plan, results))


@pytest.fixture(params=[False, True], ids=["separate", "lockstep"])
def records(request: pytest.FixtureRequest) -> Iterator[None]:
    formats.register(
        fmt_writer=Writer("records", "toy records", _files, _complete, lockstep=request.param, owns=(".rec",))
    )
    try:
        yield
    finally:
        formats.unregister("records")


def _read_records(p: Path) -> tuple[dict[str, bytes], list[int], list[int]]:
    data = p.read_bytes()
    names = json.loads(data[data.rindex(b"[") :])
    out, crcs, want = {}, [], []
    pos = 0
    for name in names:
        assert data[pos : pos + 4] == b"REC!"
        (crc,) = struct.unpack("<I", data[pos + 4 : pos + 8])
        (n,) = struct.unpack("<Q", data[pos + 8 : pos + 16])
        out[name] = data[pos + 16 : pos + 16 + n]
        crcs.append(crc)
        want.append(zlib.crc32(out[name]))
        pos += 16 + n
    return out, crcs, want


@pytest.mark.parametrize("tp", [1, 2])  # one file and 3 workers: the file is split between threads
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("piece", [64, 1 << 20])
def test_fixed_bytes_and_crc32_patches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: None, workers: int, piece: int, tp: int
) -> None:
    monkeypatch.setattr(cs, "PIECE", piece)  # small pieces: patches land in pieces hashed on the way
    gen = torch.Generator().manual_seed(1)
    full = {
        "a.w": torch.randn(12, 10, generator=gen),
        "b.w": torch.randn(10, 6, generator=gen).half(),
        "c": torch.arange(7, dtype=torch.int64),
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    layout = tmp_path / "l.yaml"
    layout.write_text(
        f'mesh: {{tp: {tp}}}\nplacements:\n  "a.w": {{tp: S(1)}}\n  "b.w": {{tp: S(0)}}\n  "*": R\n'
    )
    src = SourceSpec(str(tmp_path / "model.safetensors"))
    convert(src, tmp_path / "ref", TargetSpec(layout=str(layout), to="per-rank"), buffer_size=64)
    out = tmp_path / "rec"
    doc = convert(src, out, TargetSpec(layout=str(layout), to="records"), workers=workers, buffer_size=64)
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["format"] == "records" and len(doc["files"]) == tp
    for r in range(tp):
        name = rank_file_name(r, tp)
        got, crcs, want = _read_records(out / (name + ".rec"))
        assert crcs == want
        ref = load_file(str(tmp_path / "ref" / name))
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert got[k] == v.contiguous().view(torch.uint8).numpy().tobytes()
        assert manifest["files"][name + ".rec"]["checksum"] == cs.file_checksum(out / (name + ".rec"))
    assert not list(out.glob("*.tmp"))
