"""verify_checkpoints and check_checkpoint on tiny real checkpoints and hand-built ones."""

from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from reshard import check as check_mod
from reshard.check import check_checkpoint
from reshard.checkpoint import Checkpoint, CheckpointWarning, TensorSource
from reshard.config import load_layout
from reshard.convert import SourceSpec, TargetSpec, convert, open_source
from reshard.errors import PlanError, ReshardError
from reshard.formats import open_checkpoint
from reshard.intervals import Interval, coverage_holes, global_index
from reshard.io.header import read_header
from reshard.verify import verify_checkpoints

I = Interval  # noqa: E741

TP4 = """\
mesh: {tp: 4}
placements:
  "*.w": {tp: S(0)}
  "*.o": {tp: S(1)}
  "*": R
"""

FSDP_TP = """\
mesh: {fsdp: 2, tp: 2}
placements:
  "*.w": {fsdp: "_S(0, tp)", tp: S(0)}
  "*.o": {fsdp: S(0), tp: S(1)}
  "*.r": {tp: S(0)}
  "*": R
"""


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    nan_o = torch.randn(3, 5, generator=g)
    nan_o[1, 2] = float("nan")
    nan_o[2, 0] = -0.0
    return {
        "l0.w": torch.randn(10, 6, generator=g),
        "l0.o": torch.randn(6, 7, generator=g),
        "l1.w": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "nan.o": nan_o,
        "norm": torch.randn(7, generator=g),
        "l0.r": torch.randn(5, 4, generator=g),
        "step": torch.tensor(12345, dtype=torch.int64),
        "empty.w": torch.zeros(0, 4),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    (root / "hf0").mkdir()
    save_file(_tensors(), str(root / "hf0" / "model.safetensors"))
    (root / "tp4.yaml").write_text(TP4)
    (root / "fsdp_tp.yaml").write_text(FSDP_TP)
    convert(SourceSpec(str(root / "hf0")), root / "tp4", TargetSpec(layout=str(root / "tp4.yaml")))
    convert(SourceSpec(str(root / "tp4")), root / "tp3", TargetSpec(mesh="tp=3"))
    convert(SourceSpec(str(root / "tp3")), root / "hf", TargetSpec(consolidate=True))
    convert(
        SourceSpec(str(root / "tp4")),
        root / "fsdp_tp",
        TargetSpec(layout=str(root / "fsdp_tp.yaml")),
    )
    return {n: root / n for n in ("hf0", "tp4", "tp3", "hf", "fsdp_tp")}


def _open(p: Path) -> Checkpoint:
    return open_source(SourceSpec(str(p)))


def _copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _flip(path: Path, tensor: str, local_index: int, byte: int = 0, xor: int = 0x01) -> None:
    """Flip bits of one byte of element ``local_index`` (row-major) of ``tensor`` in a file."""
    h = read_header(path)
    e = h.entry(tensor)
    off = h.data_start + e.start + local_index * e.itemsize + byte
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ xor]))


def _rank(d: Path, r: int, w: int) -> Path:
    return d / f"rank-{r:05d}-of-{w:05d}.safetensors"


TOTAL_BYTES = sum(t.numel() * t.element_size() for t in _tensors().values())


# --------------------------------------------------------------------------- verify


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("hf0", "tp4"),
        ("tp4", "tp3"),
        ("tp3", "hf"),
        ("tp4", "fsdp_tp"),
        ("fsdp_tp", "hf0"),
        ("hf", "hf0"),
    ],
)
@pytest.mark.parametrize("max_bytes", [1, 64 << 20])
def test_verify_equal_across_layouts(ckpts: dict[str, Path], a: str, b: str, max_bytes: int) -> None:
    doc = verify_checkpoints(_open(ckpts[a]), _open(ckpts[b]), max_bytes=max_bytes)
    assert doc["equal"] is True
    assert doc["differences"] == []
    assert doc["tensors"] == len(_tensors())
    assert doc["bytes_compared"] == TOTAL_BYTES
    assert doc["a"]["path"] == str(ckpts[a])
    assert doc["b"]["format"] in ("hf", "per-rank")
    json.dumps(doc)


def test_verify_reports_the_flipped_element(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp4"], tmp_path)
    # l0.o [6, 7] is S(1) over tp=4: rank 1 holds columns 2:4, local (3, 1) is global (3, 3)
    _flip(_rank(bad, 1, 4), "l0.o", 3 * 2 + 1, byte=3)
    for a, b in [(ckpts["tp3"], bad), (bad, ckpts["hf"])]:
        doc = verify_checkpoints(_open(a), _open(b))
        assert doc["equal"] is False
        (d,) = doc["differences"]
        assert d["tensor"] == "l0.o"
        assert d["kind"] == "values"
        assert d["index"] == [3, 3]
        assert int(d["a_bits"], 16) ^ int(d["b_bits"], 16) == 0x01000000
        assert "[3, 3]" in d["message"]


def test_verify_reports_the_smallest_differing_index(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp4"], tmp_path)
    _flip(_rank(bad, 1, 4), "l0.o", 3 * 2 + 1)  # global (3, 3), rank 1's region is compared first
    _flip(_rank(bad, 2, 4), "l0.o", 0)  # global (0, 4)
    _flip(_rank(bad, 3, 4), "l0.w", 0)  # l0.w: rows 9:10 on rank 3 -> global (9, 0)
    doc = verify_checkpoints(_open(ckpts["tp3"]), _open(bad), max_bytes=8)
    by = {d["tensor"]: d for d in doc["differences"]}
    assert by["l0.o"]["index"] == [0, 4]
    assert by["l0.w"]["index"] == [9, 0]
    # strided layout: the element sits in a multi-interval block
    doc = verify_checkpoints(_open(bad), _open(ckpts["fsdp_tp"]), max_bytes=8)
    assert {d["tensor"]: d["index"] for d in doc["differences"]} == {"l0.o": [0, 4], "l0.w": [9, 0]}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tensor compared in several slabs (the mask buffer reused from slab to slab):
    consolidated, and TP-4 column-sharded (gathered on read)."""
    root = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(1)
    (root / "hf").mkdir()
    save_file({"big.o": torch.randn(600, 300, generator=g)}, str(root / "hf" / "model.safetensors"))
    (root / "tp4.yaml").write_text(TP4)
    convert(SourceSpec(str(root / "hf")), root / "tp4", TargetSpec(layout=str(root / "tp4.yaml")))
    return {"hf": root / "hf", "tp4": root / "tp4"}


@pytest.mark.parametrize("max_bytes", [1 << 20, 64 << 20])
@pytest.mark.parametrize(
    "flips",
    [
        [(10, 299)],  # in the first slab only (at 1 MiB: about 390 rows a slab)
        [(500, 7)],  # in a later slab only
        [(480, 0), (20, 150)],  # both: the smaller index wins
    ],
)
def test_verify_large_tensor_in_slabs(
    big: dict[str, Path], tmp_path: Path, max_bytes: int, flips: list[tuple[int, int]]
) -> None:
    same = verify_checkpoints(_open(big["tp4"]), _open(big["hf"]), max_bytes=max_bytes)
    assert same["equal"] and same["bytes_compared"] == 600 * 300 * 4
    bad = _copy(big["tp4"], tmp_path)
    for row, col in flips:  # S(1) over 4: rank r holds columns 75r:75r+75
        _flip(_rank(bad, col // 75, 4), "big.o", row * 75 + col % 75)
    want = min(list(rc) for rc in flips)
    for a, b in ((bad, big["hf"]), (big["hf"], bad)):
        doc = verify_checkpoints(_open(a), _open(b), max_bytes=max_bytes)
        (d,) = doc["differences"]
        assert (d["tensor"], d["kind"], d["index"]) == ("big.o", "values", want)


def test_verify_scalar_and_bf16(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["hf"], tmp_path)
    _flip(bad / "model.safetensors", "step", 0)
    _flip(bad / "model.safetensors", "l1.w", 4 * 3 + 2, byte=1)
    doc = verify_checkpoints(_open(ckpts["tp4"]), _open(bad))
    by = {d["tensor"]: d for d in doc["differences"]}
    assert by["step"]["index"] == []
    assert by["step"]["a_bits"] == "0x0000000000003039"
    assert by["step"]["b_bits"] == "0x0000000000003038"
    assert by["l1.w"]["index"] == [4, 2]
    assert len(by["l1.w"]["a_bits"]) == 6  # 0x + 4 hex digits


def _hf(path: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return _open(path)


def test_verify_compares_bits(tmp_path: Path) -> None:
    nan = torch.tensor([1.0, 0.0, float("nan")])
    a = _hf(tmp_path / "a", {"x": nan, "y": nan.clone()})
    neg = nan.clone()
    neg[1] = -0.0
    payload = nan.clone()
    payload.view(torch.int32)[2] += 1
    b = _hf(tmp_path / "b", {"x": neg, "y": payload})
    doc = verify_checkpoints(a, b)
    assert [(d["tensor"], d["index"]) for d in doc["differences"]] == [("x", [1]), ("y", [2])]
    assert doc["differences"][0]["b_bits"] == "0x80000000"
    same = verify_checkpoints(a, _hf(tmp_path / "c", {"x": nan.clone(), "y": nan.clone()}))
    assert same["equal"] is True


def test_verify_names_dtypes_shapes(tmp_path: Path) -> None:
    a = _hf(
        tmp_path / "a",
        {
            "only_a": torch.zeros(2),
            "same": torch.ones(3),
            "dt": torch.zeros(2, 3),
            "sh": torch.zeros(2, 3),
        },
    )
    b = _hf(
        tmp_path / "b",
        {
            "only_b": torch.zeros(2),
            "same": torch.ones(3),
            "dt": torch.zeros(2, 3, dtype=torch.bfloat16),
            "sh": torch.zeros(3, 2),
        },
    )
    doc = verify_checkpoints(a, b)
    assert doc["equal"] is False
    assert doc["tensors"] == 3
    assert doc["bytes_compared"] == 12
    got = {d["tensor"]: d for d in doc["differences"]}
    assert {n: d["kind"] for n, d in got.items()} == {
        "only_a": "missing",
        "only_b": "extra",
        "dt": "dtype",
        "sh": "shape",
    }
    assert got["only_a"]["message"] == 'tensor "only_a" is in A but missing in B'
    assert got["dt"]["message"] == 'tensor "dt": dtype F32 in A, BF16 in B'
    assert got["sh"]["message"] == 'tensor "sh": shape [2, 3] in A, [3, 2] in B'


def _partial(tmp_path: Path, x: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> Checkpoint:
    d = tmp_path / "partial"
    d.mkdir()
    save_file({"p": x, "r": r}, str(_rank(d, 0, 2)))
    save_file({"p": y, "r": r}, str(_rank(d, 1, 2)))
    (tmp_path / "partial.yaml").write_text('mesh: {dp: 2}\nplacements:\n  "p": {dp: P(sum)}\n  "*": R\n')
    return open_checkpoint(d, layout=load_layout(tmp_path / "partial.yaml"))


def test_verify_reduces_partial_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    x, y, r = (
        torch.randn(4, 3, generator=g),
        torch.randn(4, 3, generator=g),
        torch.randn(5, generator=g),
    )
    part = _partial(tmp_path, x, y, r)
    summed = _hf(tmp_path / "sum", {"p": x + y, "r": r})
    assert verify_checkpoints(part, summed)["equal"] is True
    assert verify_checkpoints(summed, part, max_bytes=1)["equal"] is True
    assert verify_checkpoints(part, part)["equal"] is True
    off = (x + y).clone()
    off[2, 1] = torch.nextafter(off[2, 1], torch.tensor(10.0))
    doc = verify_checkpoints(part, _hf(tmp_path / "off", {"p": off, "r": r}))
    assert [(d["tensor"], d["index"]) for d in doc["differences"]] == [("p", [2, 1])]
    assert check_checkpoint(part) == []


def _big(tmp_path: Path) -> tuple[Checkpoint, Checkpoint]:
    g = torch.Generator().manual_seed(2)
    (tmp_path / "big").mkdir()
    save_file(
        {"m.w": torch.randn(256, 512, generator=g), "m.o": torch.randn(512, 256, generator=g)},
        str(tmp_path / "big" / "model.safetensors"),
    )
    (tmp_path / "l.yaml").write_text(FSDP_TP)
    convert(
        SourceSpec(str(tmp_path / "big")),
        tmp_path / "big2",
        TargetSpec(layout=str(tmp_path / "l.yaml")),
    )
    return _open(tmp_path / "big"), _open(tmp_path / "big2")


def test_verify_and_check_memory_is_bounded(tmp_path: Path) -> None:
    a, b = _big(tmp_path)  # 1 MiB of tensors; strided pieces make A's regions gathers
    budget = 64 << 10
    tracemalloc.start()
    try:
        doc = verify_checkpoints(a, b, max_bytes=budget)
        doc2 = verify_checkpoints(b, a, max_bytes=budget)
        problems = check_checkpoint(b, max_bytes=budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert doc["equal"] and doc2["equal"] and problems == []
    assert doc["bytes_compared"] == 1 << 20
    assert peak < 2 * budget, peak


def test_verify_refuses_a_checkpoint_with_holes(tmp_path: Path) -> None:
    ok, holed = _holed(tmp_path)
    with pytest.raises(PlanError, match="holes"):
        verify_checkpoints(ok, holed)
    with pytest.raises(PlanError, match="holes"):
        verify_checkpoints(holed, ok)


def test_global_index() -> None:
    blk = ((I(0, 2), I(6, 8)), (I(3, 6),))
    assert global_index(blk, [0, 0]) == [0, 3]
    assert global_index(blk, [2, 2]) == [6, 5]
    assert global_index((), []) == []


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize("name", ["hf0", "tp4", "tp3", "hf", "fsdp_tp"])
def test_check_good_checkpoints(ckpts: dict[str, Path], name: str) -> None:
    assert check_checkpoint(_open(ckpts[name]), max_bytes=3) == []


def test_check_missing_rank_file_fails_at_open(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp4"], tmp_path)
    _rank(bad, 2, 4).unlink()
    with pytest.raises(ReshardError, match="rank-00002-of-00004.safetensors") as e:
        _open(bad)
    assert e.value.exit_code == 2


def test_check_flipped_byte_fails_checksum(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp4"], tmp_path)
    _flip(_rank(bad, 1, 4), "l0.o", 5)
    (p,) = check_checkpoint(_open(bad))
    assert p["kind"] == "checksum"
    assert p["path"] == str(_rank(bad, 1, 4))
    assert "rank-00001-of-00004.safetensors" in p["message"]
    assert p["tensor"] is None and p["region"] is None


def test_check_differing_replica(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp4"], tmp_path)
    _flip(_rank(bad, 2, 4), "norm", 5)
    _flip(_rank(bad, 3, 4), "step", 0, byte=7)
    problems = check_checkpoint(_open(bad))
    kinds = sorted((p["kind"], Path(p["path"]).name) for p in problems)
    assert kinds == [
        ("checksum", "rank-00002-of-00004.safetensors"),
        ("checksum", "rank-00003-of-00004.safetensors"),
        ("replica", "rank-00002-of-00004.safetensors"),
        ("replica", "rank-00003-of-00004.safetensors"),
    ]
    rep = {p["tensor"]: p for p in problems if p["kind"] == "replica"}
    assert rep["norm"]["region"] == [[0, 7]]
    assert rep["norm"]["index"] == [5]
    assert rep["norm"]["other"] == str(_rank(bad, 0, 4))
    assert "rank-00002-of-00004.safetensors" in rep["norm"]["message"]
    assert rep["step"]["region"] == [] and rep["step"]["index"] == []
    # without checksums only the replicas are left
    man = json.loads((bad / "reshard.json").read_text())
    del man["files"]
    (bad / "reshard.json").write_text(json.dumps(man))
    assert [p["kind"] for p in check_checkpoint(_open(bad), max_bytes=1)] == ["replica", "replica"]


def test_check_differing_replica_in_strided_layout(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # l0.r [5, 4] is S(0) over tp=2 and replicated over fsdp=2: ranks 1 = (0, 1) and
    # 3 = (1, 1) both hold rows 3:5; rank 3's local (1, 2) is global (4, 2)
    bad = _copy(ckpts["fsdp_tp"], tmp_path)
    _flip(_rank(bad, 3, 4), "l0.r", 1 * 4 + 2)
    problems = [p for p in check_checkpoint(_open(bad)) if p["kind"] == "replica"]
    assert [(p["tensor"], p["index"], p["region"]) for p in problems] == [("l0.r", [4, 2], [[3, 5], [0, 4]])]
    assert problems[0]["path"] == str(_rank(bad, 3, 4))
    assert problems[0]["other"] == str(_rank(bad, 1, 4))


def test_check_manifest_files(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["tp3"], tmp_path)
    man = json.loads((bad / "reshard.json").read_text())
    man["files"]["rank-00009-of-00003.safetensors"] = {"size": 1, "checksum": "xxh3_128-64MiB:00"}
    man["files"]["rank-00001-of-00003.safetensors"]["size"] += 1
    del man["files"]["rank-00002-of-00003.safetensors"]
    assert man["reshard"]["format_version"] == 2 and man["tensor_count"] == len(_tensors())
    # format version 1 (earlier reshard) listed every tensor: still checked against the files
    del man["tensor_count"]
    man["reshard"]["format_version"] = 1
    man["tensors"] = {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in _open(bad).tensors.items()}
    man["tensors"]["norm"]["dtype"] = "BF16"
    man["tensors"]["ghost"] = {"dtype": "F32", "shape": [1]}
    (bad / "reshard.json").write_text(json.dumps(man))
    problems = check_checkpoint(_open(bad))
    got = sorted((p["kind"], Path(p["path"]).name, p["tensor"]) for p in problems)
    assert got == [
        ("manifest", "reshard.json", "ghost"),
        ("manifest", "reshard.json", "norm"),
        ("missing-file", "rank-00009-of-00003.safetensors", None),
        ("size", "rank-00001-of-00003.safetensors", None),
        ("unlisted-file", "rank-00002-of-00003.safetensors", None),
    ]
    missing = next(p for p in problems if p["kind"] == "missing-file")
    assert "listed in reshard.json but missing" in missing["message"]


def test_check_warnings(ckpts: dict[str, Path]) -> None:
    ck = _open(ckpts["hf0"])
    ck.warnings.extend(
        [
            CheckpointWarning("shard-1: chunks of x misleading", problem=True),
            CheckpointWarning("tensor y ignored"),
        ]
    )
    (p,) = check_checkpoint(ck)
    assert p == {
        "kind": "warning",
        "message": "shard-1: chunks of x misleading",
        "path": None,
        "tensor": None,
        "region": None,
    }


def _raw_file(path: Path, data: bytes) -> int:
    """A safetensors file holding ``data`` as one U8 tensor; returns the data's absolute offset."""
    save_file({"raw": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, str(path))
    return read_header(path).data_start


def _source(
    name: str,
    shape: tuple[int, ...],
    pieces: list[tuple[int, tuple[Any, ...]]],
    partials: tuple[int, ...] | None = None,
    dtype: str = "F32",
) -> TensorSource:
    return TensorSource(
        name=name,
        dtype=dtype,
        shape=shape,
        piece_files=tuple(0 for _ in pieces),
        piece_offsets=tuple(off for off, _ in pieces),
        piece_blocks=tuple(blk for _, blk in pieces),
        signature=("hand", name),
        piece_partials=partials,
        reduce_op="sum" if partials else None,
    )


def _holed(tmp_path: Path) -> tuple[Checkpoint, Checkpoint]:
    """A [6, 4] F32 tensor 0..23 whole, and the same with rows 2:4 in no piece."""
    data = struct.pack("<24f", *range(24))
    base = _raw_file(tmp_path / "data.safetensors", data)
    rows = 4 * 4
    whole = _source("t", (6, 4), [(base, ((I(0, 6),), (I(0, 4),)))])
    holed = _source(
        "t",
        (6, 4),
        [
            (base, ((I(0, 2),), (I(0, 4),))),
            (base + 4 * rows, ((I(4, 6),), (I(0, 4),))),
        ],
    )

    def ck(t: TensorSource) -> Checkpoint:
        f = tmp_path / "data.safetensors"
        return Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), {"t": t})

    return ck(whole), ck(holed)


def test_check_hole(tmp_path: Path) -> None:
    _, holed = _holed(tmp_path)
    (p,) = check_checkpoint(holed)
    assert p["kind"] == "hole"
    assert p["tensor"] == "t"
    assert p["region"] == [[2, 4], [0, 4]]
    assert "region [2:4)x[0:4) is in no piece (8 elements)" in p["message"]


def test_check_hole_in_a_partial_group_and_many_holes(tmp_path: Path) -> None:
    base = _raw_file(tmp_path / "d.safetensors", bytes(4 * 40))
    full = ((I(0, 40),),)
    odd = (
        (
            I(0, 1),
            I(2, 3),
            I(4, 5),
            I(6, 7),
            I(8, 9),
            I(10, 11),
            I(12, 13),
            I(14, 15),
            I(16, 17),
            I(18, 19),
            I(20, 40),
        ),
    )
    t = _source("p", (40,), [(base, full), (base, odd)], partials=(0, 1))
    f = tmp_path / "d.safetensors"
    ck = Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), {"p": t})
    problems = check_checkpoint(ck)
    assert [p["region"] for p in problems[:8]] == [[[i, i + 1]] for i in range(1, 17, 2)]
    assert all("partial group 1" in p["message"] for p in problems)
    assert len(problems) == 9
    assert problems[8]["region"] is None and "2 more hole region(s)" in problems[8]["message"]


def test_check_overlaps_and_bounds(tmp_path: Path) -> None:
    # piece A holds rows 0:4 of an [6, 2] tensor, piece B rows 2:6; they share rows 2:4
    vals = [float(i) for i in range(8)]
    a = struct.pack("<8f", *vals)
    b_same = struct.pack("<8f", *(vals[4:] + [8.0, 9.0, 10.0, 11.0]))
    b_diff = struct.pack("<8f", *(vals[4:7] + [-7.0, 8.0, 9.0, 10.0, 11.0]))
    base = _raw_file(tmp_path / "d.safetensors", a + b_same + b_diff)
    f = tmp_path / "d.safetensors"

    def ck(*ts: TensorSource) -> Checkpoint:
        return Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), {t.name: t for t in ts})

    top = ((I(0, 4),), (I(0, 2),))
    bottom = ((I(2, 6),), (I(0, 2),))
    same = _source("same", (6, 2), [(base, top), (base + 32, bottom)])
    diff = _source("diff", (6, 2), [(base, top), (base + 64, bottom)])
    (p,) = check_checkpoint(ck(same, diff), max_bytes=1)
    assert p["kind"] == "overlap"
    assert p["tensor"] == "diff"
    assert p["index"] == [3, 1]
    assert p["region"] == [[2, 4], [0, 2]]
    past = _source("past", (6, 2), [(base + 64, top), (base + 80, bottom)])
    (p,) = check_checkpoint(ck(past))
    assert p["kind"] == "bounds" and p["tensor"] == "past" and p["path"] == str(f)
    outside = _source("out", (3, 2), [(base, top)])
    (p,) = check_checkpoint(ck(outside))
    assert p["kind"] == "outside"


def test_check_shares_geometry_between_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _raw_file(tmp_path / "d.safetensors", bytes(4 * 64))
    f = tmp_path / "d.safetensors"
    blocks = [((I(16 * r, 16 * (r + 1)),), (I(0, 4),)) for r in range(4)]
    tensors = {}
    for i in range(2000):
        t = _source(f"layers.{i}.w", (64, 4), [(base, blk) for blk in blocks])
        tensors[t.name] = TensorSource(
            t.name,
            t.dtype,
            t.shape,
            t.piece_files,
            t.piece_offsets,
            t.piece_blocks,
            ("layout", (64, 4), (4,), "S(0)"),
        )
    ck = Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), tensors)
    calls = []
    real = check_mod._geometry

    def counting(t: TensorSource) -> Any:
        calls.append(t.name)
        return real(t)

    monkeypatch.setattr(check_mod, "_geometry", counting)
    assert check_checkpoint(ck) == []
    assert calls == ["layers.0.w"]


def test_coverage_holes() -> None:
    assert coverage_holes((), [()]) == []
    assert coverage_holes((), []) == [()]
    assert coverage_holes((0, 5), []) == []
    assert coverage_holes((4,), []) == [(I(0, 4),)]
    # four column shards of a [3, 8] tensor, the third missing
    cols = [((I(0, 3),), (I(2 * c, 2 * c + 2),)) for c in (0, 1, 3)]
    assert coverage_holes((3, 8), cols) == [(I(0, 3), I(4, 6))]
    # a 2x2 grid missing its bottom-right tile, plus a strided block
    grid = [((I(0, 2),), (I(0, 2),)), ((I(0, 2),), (I(2, 4),)), ((I(2, 4),), (I(0, 2),))]
    assert coverage_holes((4, 4), grid) == [(I(2, 4), I(2, 4))]
    strided = [((I(0, 1), I(2, 3)),), ((I(1, 2),),)]
    assert coverage_holes((4,), strided) == [(I(3, 4),)]
    # overlapping blocks still cover
    assert coverage_holes((5,), [((I(0, 3),),), ((I(2, 5),),)]) == []


def test_verify_batches_many_tensors_and_keeps_name_order(tmp_path: Path) -> None:
    """Hundreds of small tensors compared in batches (row shards, whole tensors): every
    difference is found with its first index, and differences come in name order, whatever
    order the files hold the tensors in."""
    g = torch.Generator().manual_seed(1)
    full = {f"m.{i}.w": torch.randint(-99, 99, (8, 4), generator=g, dtype=torch.int16) for i in range(300)}
    save_file(full, str(tmp_path / "a.safetensors"))
    (tmp_path / "hf").mkdir()
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "hf" / "model.safetensors")
    lay = tmp_path / "tp.yaml"
    lay.write_text('mesh: {tp: 4}\nplacements:\n  "*": {tp: S(0)}\n')
    convert(SourceSpec(str(tmp_path / "hf")), tmp_path / "tp4", TargetSpec(layout=str(lay)))
    bad = dict(full)
    bad["m.200.w"] = bad["m.200.w"].clone()
    bad["m.200.w"][5, 2] += 1  # rank 2's rows
    bad["m.7.w"] = bad["m.7.w"].clone()
    bad["m.7.w"][0, 1] += 1
    bad["m.30.w"] = bad["m.30.w"].to(torch.int32)
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    for max_bytes in (1 << 20, 4096, 64):
        doc = verify_checkpoints(_open(tmp_path / "tp4"), _open(tmp_path / "bad"), max_bytes=max_bytes)
        assert [(d["tensor"], d["kind"], d.get("index")) for d in doc["differences"]] == [
            ("m.7.w", "values", [0, 1]),
            ("m.30.w", "dtype", None),
            ("m.200.w", "values", [5, 2]),
        ]
        assert doc["tensors"] == 300
        assert 297 * 64 < doc["bytes_compared"] <= 299 * 64  # a differing tensor: up to its difference
        ok = verify_checkpoints(_open(tmp_path / "tp4"), _open(tmp_path / "hf"), max_bytes=max_bytes)
        assert ok["equal"] and ok["bytes_compared"] == 300 * 64


def test_check_manifest_tensor_count(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Format version 2 counts the tensors the files describe: a count the files contradict is reported."""
    bad = _copy(ckpts["tp3"], tmp_path)
    assert check_checkpoint(_open(bad)) == []
    man = json.loads((bad / "reshard.json").read_text())
    assert "tensors" not in man
    man["tensor_count"] += 1
    (bad / "reshard.json").write_text(json.dumps(man))
    (p,) = check_checkpoint(_open(bad))
    assert p["kind"] == "manifest" and f"holds {len(_tensors()) + 1} tensors" in p["message"]


def test_check_problems_in_file_order(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # checksum problems come in the order reshard.json lists the files, among the files' other
    # problems, before the tensors'
    bad = _copy(ckpts["tp4"], tmp_path)
    for r in (0, 2, 3):
        _flip(_rank(bad, r, 4), "l0.o", 1)
    _flip(_rank(bad, 3, 4), "norm", 2)
    man = json.loads((bad / "reshard.json").read_text())
    man["files"]["rank-00001-of-00004.safetensors"]["size"] += 1
    man["tensor_count"] += 1
    (bad / "reshard.json").write_text(json.dumps(man))
    problems = check_checkpoint(_open(bad), max_bytes=64)
    assert [(p["kind"], Path(p["path"]).name) for p in problems] == [
        ("checksum", "rank-00000-of-00004.safetensors"),
        ("size", "rank-00001-of-00004.safetensors"),
        ("checksum", "rank-00002-of-00004.safetensors"),
        ("checksum", "rank-00003-of-00004.safetensors"),
        ("manifest", "reshard.json"),
        ("replica", "rank-00003-of-00004.safetensors"),
    ]


def test_verify_file_order(ckpts: dict[str, Path]) -> None:
    # verify reads B's tensors in file order (then A's extra names); a tensor without pieces first
    from dataclasses import replace

    from reshard import verify as verify_mod

    a, b = _open(ckpts["tp4"]), _open(ckpts["hf"])
    ts = list(b.tensors.values())

    def reference(b: Checkpoint) -> list[str]:
        def first(t: TensorSource) -> tuple[int, int]:
            return (t.piece_files or (-1,))[0], (t.piece_offsets or (-1,))[0]

        return sorted(b.tensors, key=lambda n: first(b.tensors[n]))

    got, tbs = verify_mod._file_order(a, b)
    assert tbs == [b.tensors[n] for n in got]
    assert got == reference(b) and len(set(got)) == len(got) == len(ts)
    assert [b.tensors[n].piece_offsets[0] for n in got] == sorted(t.piece_offsets[0] for t in ts)
    last = ts[-1]
    empty = replace(last, name="extra", piece_files=(), piece_offsets=())
    bare = {t.name: t for t in ts[:-1]} | {"extra": empty}
    b2 = replace(b, tensors={"z": replace(ts[0], name="z"), **bare})
    a2 = replace(a, tensors={**a.tensors, "only.in.a": next(iter(a.tensors.values()))})
    got, tbs = verify_mod._file_order(a2, b2)
    assert tbs == [*(b2.tensors[n] for n in got[:-2]), None, None]
    assert got == [*reference(b2), last.name, "only.in.a"]
    assert got[0] == "extra"
