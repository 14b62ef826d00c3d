"""Per-rank self-description: version 2 is compact, and files of version 1 and 2 read the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.formats import open_checkpoint
from reshard.formats.per_rank import rank_metadata, tensors_text
from reshard.io.header import encode_header, read_header
from reshard.mesh import Mesh

FULL = {
    "even.w": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),  # S(0), even
    "odd.w": torch.arange(7 * 5, dtype=torch.int16).reshape(7, 5),  # S(0), uneven: shape listed
    "col.w": torch.arange(4 * 12, dtype=torch.bfloat16).reshape(4, 12),  # S(1) on dp x tp, even
    "norm": torch.arange(5, dtype=torch.float64),  # R
}
LAYOUT = """mesh: {dp: 2, tp: 2}
placements:
  "col.w": {dp: S(1), tp: S(1)}
  "*.w": {tp: S(0)}
  "*": R
"""


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "reshard", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("meta")
    save_file(FULL, str(root / "model.safetensors"))
    (root / "l.yaml").write_text(LAYOUT)
    out = root / "v2"
    r = _cli("convert", root / "model.safetensors", out, "--target-layout", root / "l.yaml", "--quiet")
    assert r.returncode == 0, r.stderr
    return out


def _meta(path: Path) -> dict[str, object]:
    meta = read_header(path).metadata
    assert meta is not None
    return dict(json.loads(meta["reshard"]))


def test_version_2_lists_placements_once_and_only_uneven_shapes(v2: Path) -> None:
    files = sorted(v2.glob("rank-*.safetensors"))
    assert len(files) == 4
    for r, f in enumerate(files):
        meta = _meta(f)
        assert meta["format_version"] == 2 and meta["rank"] == r
        assert meta["placements"] == [["R", "R"], ["R", "S(0)"], ["S(1)", "S(1)"]]
        # data order: F64 norm, F32 even.w, BF16 col.w, I16 odd.w (dtype, then name)
        assert meta["layout"] == "0121"
        assert meta["shapes"] == {"odd.w": [7, 5]}  # 7 rows on tp=2 do not split evenly
        header = read_header(f)
        entries_bytes = header.data_start - 8 - len(json.dumps(header.metadata, separators=(",", ":")))
        assert len(header.metadata["reshard"]) < entries_bytes + 200  # type: ignore[index]


def _as_version_1(src: Path, dst: Path, omit: str = "") -> None:
    """The same checkpoint with version 1 metadata (each tensor's shape and placements listed,
    but for tensor ``omit``)."""
    dst.mkdir()
    ck = open_checkpoint(src)
    assert ck.mesh is not None
    text = tensors_text(
        (t.name, t.shape, [str(p) for p in t.placements or ()]) for t in ck.tensors.values() if t.name != omit
    )
    for r, f in enumerate(sorted(src.glob("rank-*.safetensors"))):
        local = load_file(str(f))
        prefix, header = encode_header(
            [(n, h.dtype, h.shape) for n, h in ((e.name, e) for e in read_header(f).entries)],
            rank_metadata(ck.mesh, r, (1, text)),
        )
        raw = f.read_bytes()
        old = read_header(f)
        with open(dst / f.name, "wb") as out:
            out.write(prefix)
            for e in header.entries:
                o = old.entry(e.name)
                out.write(raw[old.data_start + o.start : old.data_start + o.stop])
        assert set(load_file(str(dst / f.name))) == set(local)


def test_version_1_and_2_read_the_same(v2: Path, tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    _as_version_1(v2, v1)
    assert _meta(v1 / "rank-00000-of-00004.safetensors")["format_version"] == 1
    a, b = open_checkpoint(v1), open_checkpoint(v2)
    assert a.mesh == b.mesh == Mesh(("dp", "tp"), (2, 2))
    for name, t in b.tensors.items():
        s = a.tensors[name]
        assert (s.shape, s.placements, s.piece_blocks) == (t.shape, t.placements, t.piece_blocks)
        assert s.shape == tuple(FULL[name].shape)
    for d in (v1, v2):
        out = tmp_path / f"hf-{d.name}"
        r = _cli("convert", d, out, "--consolidate", "--quiet")
        assert r.returncode == 0, r.stderr
        got = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(got[n], FULL[n]) for n in FULL)


def test_a_tensor_its_metadata_does_not_describe_is_named(v2: Path, tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    _as_version_1(v2, v1, omit="odd.w")
    r = _cli("inspect", v1)
    assert r.returncode == 2, r.stderr
    assert 'tensor "odd.w" is not described in the reshard metadata' in r.stderr
    assert "rank-00000-of-00004.safetensors" in r.stderr


def test_version_2_with_a_wrong_layout_is_refused(v2: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sorted(v2.glob("rank-*.safetensors")):
        header = read_header(f)
        meta = _meta(f)
        meta["layout"] = "012"  # one code short
        prefix, new = encode_header(
            [(e.name, e.dtype, e.shape) for e in header.entries], {"reshard": json.dumps(meta)}
        )
        raw = f.read_bytes()
        (bad / f.name).write_bytes(prefix + raw[header.data_start :])
    r = _cli("inspect", bad)
    assert r.returncode == 2
    assert "rank-00000-of-00004.safetensors: invalid reshard metadata" in r.stderr
    assert "one code per tensor" in r.stderr and "Traceback" not in r.stderr
