"""The batched paths of verify and inspect --check (reshard/compare.py, reshard/bulkcheck.py)
find every difference the per-tensor paths find, with the same verdicts.

``max_bytes=1`` turns batching off (every tensor then goes through the per-tensor code
that predates it), so each verdict here is also checked against that path; the values
differing are checked against torch reading the files.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard import compare as compare_mod
from reshard.check import check_checkpoint
from reshard.checkpoint import Checkpoint, TensorSource
from reshard.compare import Batch, Group, batches
from reshard.convert import SourceSpec, TargetSpec, convert, open_source
from reshard.intervals import Interval
from reshard.io.header import read_header
from reshard.io.pages import SourceFiles
from reshard.verify import verify_checkpoints

I = Interval  # noqa: E741

TP4 = """\
mesh: {tp: 4}
placements:
  "*.down_proj.weight": {tp: S(1)}
  "*norm.weight": R
  "m.step": R
  "*": {tp: S(0)}
"""

FSDP_TP = """\
mesh: {fsdp: 2, tp: 2}
placements:
  "*.gate_proj.weight": {fsdp: "_S(0, tp)", tp: S(0)}
  "*.down_proj.weight": {fsdp: S(0), tp: S(1)}
  "*.up_proj.weight": {tp: S(0)}
  "*": R
"""


def _moe() -> dict[str, torch.Tensor]:
    """A small mixture of experts: gate/up [8, 12] (S(0)), down [12, 8] (S(1)), norms (R),
    int16 but one layer in bf16; a NaN and a -0.0, a scalar, an empty tensor."""
    g = torch.Generator().manual_seed(3)
    t: dict[str, torch.Tensor] = {}
    for layer in range(4):
        t[f"m.layers.{layer}.input_layernorm.weight"] = torch.randn(12, generator=g)
        for e in range(6):
            for proj, shape in (("gate", (8, 12)), ("up", (8, 12)), ("down", (12, 8))):
                x = torch.randn(*shape, generator=g)
                x = x.to(torch.bfloat16) if layer == 2 else (x * 1000).to(torch.int16)
                t[f"m.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = x
        t[f"m.layers.{layer}.post_attention_layernorm.weight"] = torch.randn(12, generator=g)
    nan = torch.randn(8, 4, generator=g)
    nan[3, 1] = float("nan")
    nan[5, 2] = -0.0
    t["m.nan.weight"] = nan
    t["m.step"] = torch.tensor(12345, dtype=torch.int64)
    t["m.empty.weight"] = torch.zeros(0, 8)
    return t


TOTAL = sum(x.numel() * x.element_size() for x in _moe().values())


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    (root / "hf").mkdir()
    save_file(_moe(), str(root / "hf" / "model.safetensors"))
    (root / "tp4.yaml").write_text(TP4)
    (root / "fsdp.yaml").write_text(FSDP_TP)
    convert(SourceSpec(str(root / "hf")), root / "tp4", TargetSpec(layout=str(root / "tp4.yaml")))
    convert(SourceSpec(str(root / "tp4")), root / "tp8", TargetSpec(mesh="tp=8"))
    convert(SourceSpec(str(root / "tp4")), root / "fsdp", TargetSpec(layout=str(root / "fsdp.yaml")))
    return {n: root / n for n in ("hf", "tp4", "tp8", "fsdp")}


def _open(p: Path) -> Checkpoint:
    return open_source(SourceSpec(str(p)))


def _verify(a: Path, b: Path) -> dict[str, Any]:
    """The verdict, checked equal to the per-tensor path's (and to small batches' one): all of
    it, but the bytes compared of a tensor that differs (up to the slab holding its first
    difference: slabs follow ``max_bytes``)."""
    doc = verify_checkpoints(_open(a), _open(b))
    for max_bytes in (1, 2048):
        other = verify_checkpoints(_open(a), _open(b), max_bytes=max_bytes)
        if doc["equal"]:
            assert other == doc
        else:
            assert {**other, "bytes_compared": 0} == {**doc, "bytes_compared": 0}
    return dict(doc)


def _check(p: Path) -> list[Any]:
    problems = check_checkpoint(_open(p))
    assert check_checkpoint(_open(p), max_bytes=8) == problems  # replicas compared tensor by tensor
    return list(problems)


def _flip_at(path: Path, offset: int, xor: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ xor]))


def _flip(path: Path, tensor: str, local_index: int, byte: int = 0, xor: int = 0x01) -> None:
    h = read_header(path)
    e = h.entry(tensor)
    _flip_at(path, h.data_start + e.start + local_index * e.itemsize + byte, xor)


def _rank(d: Path, r: int, w: int) -> Path:
    return d / f"rank-{r:05d}-of-{w:05d}.safetensors"


def _no_checksums(d: Path) -> None:
    man = json.loads((d / "reshard.json").read_text())
    del man["files"]
    (d / "reshard.json").write_text(json.dumps(man))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[list[int], int, int] | None:
    """torch's answer: the first index whose bits differ, and both items' bits."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia, ib = a.contiguous().view(ints).reshape(-1), b.contiguous().view(ints).reshape(-1)
    where = (ia != ib).nonzero()
    if not len(where):
        return None
    i = int(where[0])
    mask = (1 << (8 * a.element_size())) - 1
    index = [int(x) for x in torch.unravel_index(torch.tensor(i), a.shape)] if a.dim() else []
    return index, int(ia[i]) & mask, int(ib[i]) & mask


PAIRS = [("tp8", "hf"), ("hf", "tp8"), ("tp4", "tp8"), ("tp8", "tp4"), ("fsdp", "hf"), ("tp8", "fsdp")]


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_batched_verify_equal(moe: dict[str, Path], a: str, b: str) -> None:
    doc = _verify(moe[a], moe[b])
    assert doc["equal"] is True and doc["differences"] == []
    assert doc["bytes_compared"] == TOTAL
    assert doc["tensors"] == len(_moe())


def test_every_flipped_byte_of_a_consolidated_file_is_found(moe: dict[str, Path], tmp_path: Path) -> None:
    """Flipped bits at the first and the last data byte and at 16 random places of the HF file
    (whichever tensor holds them, whatever its dtype): verify against TP-8 (B the HF copy, then
    A) reports that tensor alone, at the index and with the bits torch finds."""
    bad = tmp_path / "bad"
    shutil.copytree(moe["hf"], bad)
    f = bad / "model.safetensors"
    h = read_header(f)
    rng = random.Random(7)
    size = f.stat().st_size
    offsets = [h.data_start, size - 1, *(rng.randrange(h.data_start, size) for _ in range(16))]
    original = load_file(str(moe["hf"] / "model.safetensors"))
    for off in offsets:
        xor = 1 << rng.randrange(8)
        _flip_at(f, off, xor)
        try:
            flipped = load_file(str(f))
            (name,) = [n for n in original if _first_difference(original[n], flipped[n]) is not None]
            index, bits_a, bits_b = _first_difference(original[name], flipped[name])  # type: ignore[misc]
            for a, b, swap in ((moe["tp8"], bad, False), (bad, moe["tp8"], True)):
                doc = verify_checkpoints(_open(a), _open(b))
                (d,) = doc["differences"]
                if not swap:  # the per-tensor path agrees
                    assert verify_checkpoints(_open(a), _open(b), max_bytes=1)["differences"] == [d]
                assert (d["tensor"], d["kind"], d["index"]) == (name, "values", index), off
                want = (bits_b, bits_a) if swap else (bits_a, bits_b)
                assert (int(d["a_bits"], 16), int(d["b_bits"], 16)) == want
        finally:
            _flip_at(f, off, xor)
    assert _verify(moe["tp8"], bad)["equal"]


def test_last_byte_of_the_last_tensor_of_a_rank_file(moe: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(moe["tp8"], bad)
    f = _rank(bad, 0, 8)
    h = read_header(f)
    last = max(h.entries, key=lambda e: e.start)
    _flip_at(f, f.stat().st_size - 1, 0x80)
    assert h.data_start + last.stop == f.stat().st_size
    local = load_file(str(_rank(moe["tp8"], 0, 8)))[last.name]
    want = [int(x) for x in torch.unravel_index(torch.tensor(local.numel() - 1), local.shape)]
    (d,) = _verify(moe["hf"], bad)["differences"]
    assert d["tensor"] == last.name
    assert d["index"] == want  # rank 0 holds the first rows (S(0)) or columns (S(1)), or all (R)


def test_strided_s1_piece(moe: dict[str, Path], tmp_path: Path) -> None:
    """down_proj [12, 8] is S(1) over tp=8: rank 5 holds column 5; its local (7, 0) is global (7, 5)."""
    bad = tmp_path / "bad"
    shutil.copytree(moe["tp8"], bad)
    name = "m.layers.3.mlp.experts.4.down_proj.weight"
    _flip(_rank(bad, 5, 8), name, 7, byte=1, xor=0x40)
    hf = load_file(str(moe["hf"] / "model.safetensors"))[name]
    for a, b in ((moe["hf"], bad), (bad, moe["hf"]), (moe["tp4"], bad), (bad, moe["fsdp"])):
        (d,) = _verify(a, b)["differences"]
        assert (d["tensor"], d["index"]) == (name, [7, 5])
        bits = int(hf.view(torch.int16)[7, 5]) & 0xFFFF
        assert bits ^ 0x4000 in (int(d["a_bits"], 16), int(d["b_bits"], 16))
        assert bits in (int(d["a_bits"], 16), int(d["b_bits"], 16))


def test_nan_payload_and_negative_zero_in_a_batch(moe: dict[str, Path], tmp_path: Path) -> None:
    t = _moe()
    t["m.nan.weight"].view(torch.int32)[3, 1] += 1  # another NaN
    zero = _moe()
    post, inp = "m.layers.0.post_attention_layernorm.weight", "m.layers.0.input_layernorm.weight"
    zero[post][0], t[post][0] = -0.0, 0.0
    zero[inp][4], t[inp][4] = 0.0, -0.0
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(zero, str(tmp_path / "a" / "model.safetensors"))
    save_file(t, str(tmp_path / "b" / "model.safetensors"))
    doc = _verify(tmp_path / "a", tmp_path / "b")
    got = {d["tensor"]: (d["index"], d["a_bits"], d["b_bits"]) for d in doc["differences"]}
    assert got["m.nan.weight"][0] == [3, 1]
    assert got[post] == ([0], "0x80000000", "0x00000000")
    assert got[inp] == ([4], "0x00000000", "0x80000000")
    assert len(got) == 3
    assert _verify(tmp_path / "a", tmp_path / "a")["equal"]


def test_a_replicas_rank3_copy(moe: dict[str, Path], tmp_path: Path) -> None:
    """A norm is R over tp=4: verify reads the first copy; inspect --check compares the others
    (here without checksums, which would catch the flip anyway)."""
    bad = tmp_path / "bad"
    shutil.copytree(moe["tp4"], bad)
    _no_checksums(bad)
    name = "m.layers.3.post_attention_layernorm.weight"  # the last replicated tensor
    _flip(_rank(bad, 3, 4), name, 11, byte=3)
    _flip(_rank(bad, 2, 4), "m.step", 0, byte=7)
    problems = _check(bad)
    got = [
        (p["kind"], p["tensor"], p["index"], Path(p["path"]).name, Path(p["other"]).name) for p in problems
    ]
    assert got == [
        ("replica", name, [11], "rank-00003-of-00004.safetensors", "rank-00000-of-00004.safetensors"),
        ("replica", "m.step", [], "rank-00002-of-00004.safetensors", "rank-00000-of-00004.safetensors"),
    ]
    assert _verify(moe["hf"], bad)["equal"]  # the copy verify reads is the first


def test_check_many_flips_agree_with_the_per_tensor_path(moe: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(moe["fsdp"], bad)
    _no_checksums(bad)
    rng = random.Random(11)
    for r in range(4):
        f = _rank(bad, r, 4)
        h = read_header(f)
        for _ in range(6):
            _flip_at(f, rng.randrange(h.data_start, f.stat().st_size))
    problems = _check(bad)
    assert problems and {p["kind"] for p in problems} == {"replica"}
    assert _check(moe["fsdp"]) == []


# --------------------------------------------------------------------------- the batch itself


def _raw(path: Path, data: bytes) -> tuple[SourceFiles, int]:
    save_file({"raw": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, str(path))
    return SourceFiles([str(path)]), read_header(path).data_start


def _piece(name: str, offsets: list[int], n: int) -> TensorSource:
    return TensorSource(
        name,
        "U8",
        (n,),
        tuple(0 for _ in offsets),
        tuple(offsets),
        tuple(((I(0, n),),) for _ in offsets),
        ("raw", n),
    )


def test_batch_compares_items_of_odd_sizes_to_the_last_byte(tmp_path: Path) -> None:
    """15 items of 3 bytes (45: the buffers end in a part word): side 0 reads bytes 0..44 of the
    file, side 1 bytes 100..144; a flipped byte is in exactly one item, the last byte included."""
    import numpy as np

    data = bytearray(range(45)) + bytes(55) + bytearray(range(45))
    for flip in (None, 0, 44, 41, 20):
        d = bytearray(data)
        if flip is not None:
            d[100 + flip] ^= 0x10
        files, base = _raw(tmp_path / f"f{flip}.safetensors", bytes(d))
        srcs = [_piece(f"t{i}", [base + 3 * i, base + 100 + 3 * i], 3) for i in range(15)]
        runs = (((0, 0, 0, 3, 1, 0, 0),), ((0, 1, 0, 3, 1, 0, 0),))
        got = Batch((files, files), 48).compare([Group(runs, 3, (srcs, srcs), np.arange(15) * 3)])
        assert got == ([] if flip is None else [(0, flip // 3)])


def test_batch_hands_back_items_whose_spans_do_not_fit(tmp_path: Path) -> None:
    """Side 0 of each item is two 4-byte pieces 300 bytes apart (read as one span: less than
    GAP apart): with a 32-byte batch the window cannot hold them, so the batch halves, then
    hands each item back, equal or not, for the caller to compare alone."""
    import numpy as np

    rng = random.Random(5)
    data = bytearray(rng.randbytes(2048))
    for i in range(4):  # side 1 (8 bytes at 1500 + 8i) holds what side 0 holds
        data[1500 + 8 * i : 1508 + 8 * i] = data[16 * i : 16 * i + 4] + data[300 + 16 * i : 304 + 16 * i]
    data[1500 + 8 * 2 + 5] ^= 0x04  # but item 2
    files, base = _raw(tmp_path / "f.safetensors", bytes(data))
    srcs = [_piece(f"t{i}", [base + 16 * i, base + 300 + 16 * i, base + 1500 + 8 * i], 8) for i in range(4)]
    runs = (((0, 0, 0, 4, 1, 0, 0), (4, 1, 0, 4, 1, 0, 0)), ((0, 2, 0, 8, 1, 0, 0),))
    group = Group(runs, 8, (srcs, srcs), np.arange(4) * 8)
    assert Batch((files, files), 32).compare([group]) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert Batch((files, files), 4096).compare([group]) == [(0, 2)]


def test_progressions_of_alternating_groups() -> None:
    """An expert's gate and up alternate with its down: every second item is a progression."""
    import numpy as np

    steps = [10, 20] * 20
    x = np.cumsum([0, *steps])[:, None]
    y = 3 * x
    cut = compare_mod._progressions(x, y)
    assert [(first, step) for first, _, step in cut] == [(0, 2), (1, 2)]
    assert sum(count for _, count, _ in cut) == len(x)
    assert compare_mod._progressions(x[:1], y[:1]) == [(0, 1, 1)]


def test_batches_cut_greedily() -> None:
    assert batches([3, 3, 3, 5, 1, 9], 6) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert batches([], 6) == []


def test_check_bounds_of_many_tensors(tmp_path: Path) -> None:
    """Many tensors of one geometry, one running past the end of the file, one at an offset
    past int64: those alone are reported, as the per-tensor path words it."""
    data = struct.pack("<64f", *range(64))
    files, base = _raw(tmp_path / "d.safetensors", data)
    f = tmp_path / "d.safetensors"
    blocks = ((I(0, 2),),), ((I(2, 4),),)
    ts = {}
    for i in range(40):
        off = {33: f.stat().st_size - 8, 34: 1 << 70}.get(i, base + 16 * (i % 16))
        ts[f"w.{i}"] = TensorSource(f"w.{i}", "F32", (4,), (0, 0), (off, off + 8), blocks, ("b", 4))
    ck = Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), ts)
    problems = check_checkpoint(ck)
    assert check_checkpoint(ck, max_bytes=8) == problems
    assert [(p["kind"], p["tensor"]) for p in problems] == [("bounds", "w.33")] + [("bounds", "w.34")] * 2


def test_signatures_not_shared_between_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that makes a new signature tuple per tensor (DCP's readers do): tensors are
    grouped by value, matched and checked once per geometry, and batched all the same."""
    from reshard import bulkcheck
    from reshard import check as check_mod
    from reshard import verify as verify_mod

    rng = random.Random(2)
    data = rng.randbytes(300 * 256)
    bad = bytearray(data)
    bad[123 * 256 + 77] ^= 0x20  # tensor 123, byte 77: element 19 = (4, 3)
    _, base = _raw(tmp_path / "a.safetensors", data)
    _raw(tmp_path / "b.safetensors", bytes(bad))
    rows = tuple(((I(4 * r, 4 * r + 4),), (I(0, 4),)) for r in range(4))
    whole = (((I(0, 16),), (I(0, 4),)),)

    def ckpt(f: Path, blocks: Any, step: int) -> Checkpoint:
        ts = {}
        for i in range(300):
            offs = tuple(base + 256 * i + step * k for k in range(len(blocks)))
            sig = ("hand", (16, 4), str(len(blocks)))  # a new tuple (and str) per tensor
            ts[f"t.{i}"] = TensorSource(f"t.{i}", "F32", (16, 4), (0,) * len(blocks), offs, blocks, sig)
        return Checkpoint(str(tmp_path), "hand", (str(f),), (f.stat().st_size,), ts)

    calls: list[str] = []
    real_geometry, real_match = check_mod._geometry, verify_mod._match
    monkeypatch.setattr(check_mod, "_geometry", lambda t: calls.append("g") or real_geometry(t))
    monkeypatch.setattr(verify_mod, "_match", lambda *a: calls.append("m") or real_match(*a))
    real_bounds = bulkcheck._in_bounds
    monkeypatch.setattr(bulkcheck, "_in_bounds", lambda *a: calls.append("b") or real_bounds(*a))
    a, b = ckpt(tmp_path / "a.safetensors", rows, 64), ckpt(tmp_path / "b.safetensors", whole, 0)
    doc = verify_checkpoints(a, b)
    assert [(d["tensor"], d["index"]) for d in doc["differences"]] == [("t.123", [4, 3])]
    assert check_checkpoint(a) == [] and check_checkpoint(b) == []
    assert calls == ["m", "g", "b", "g", "b"]  # one geometry: one match, one bounds check each
    assert verify_checkpoints(a, b, max_bytes=1)["differences"] == doc["differences"]


def test_cli_subprocess_finds_the_strided_flip_and_the_replica(moe: dict[str, Path], tmp_path: Path) -> None:
    """The same two differences through the real command line: exit 1 and the JSON documents."""
    import subprocess
    import sys

    bad = tmp_path / "bad"
    shutil.copytree(moe["tp8"], bad)
    _no_checksums(bad)
    name = "m.layers.3.mlp.experts.4.down_proj.weight"
    _flip(_rank(bad, 5, 8), name, 7, byte=1, xor=0x40)
    _flip(_rank(bad, 3, 8), "m.layers.1.input_layernorm.weight", 9)

    def run(*args: str) -> tuple[int, Any]:
        r = subprocess.run(
            [sys.executable, "-m", "reshard", *args, "--json"], capture_output=True, text=True, cwd=tmp_path
        )
        return r.returncode, json.loads(r.stdout)

    code, doc = run("verify", str(moe["hf"]), str(bad))
    assert code == 1 and doc["ok"] is False
    # verify reads rank 0's copy of the norm, and compares the other copies with it
    assert [(d["tensor"], d["kind"], d["index"]) for d in doc["differences"]] == [
        ("m.layers.1.input_layernorm.weight", "replica", [9]),
        (name, "values", [7, 5]),
    ]
    code, doc = run("inspect", str(bad), "--check")
    assert code == 1
    assert [(p["kind"], p["tensor"], p["index"], Path(p["path"]).name) for p in doc["check"]["problems"]] == [
        ("replica", "m.layers.1.input_layernorm.weight", [9], "rank-00003-of-00008.safetensors")
    ]
    assert run("verify", str(moe["tp8"]), str(moe["hf"]))[0] == 0
