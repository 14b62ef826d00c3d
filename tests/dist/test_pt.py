"""``--from pt``: per-rank ``torch.save`` files written by torch in a real gloo world, read without
torch and without running pickled code, converted bit for bit to what torch holds (``full_tensor()``).

* veRL FSDP2 (``fully_shard``, ``Shard(0)`` on ``("fsdp",)``, veRL's file names next to its optimizer
  and extra-state files, a plain persistent buffer), HSDP ``(Replicate(), Shard(0))``, FSDP2-over-TP
  ``(_StridedShard(0, 2), Shard(0))`` with a sub-mesh DTensor, nested dicts/lists and non-tensor
  leaves, and plain local tensors with ``--source-layout``;
* inspect --check, verify, --target-mesh from the DTensors' own placements, no torch imported;
* a pickle that would run code exits 2 naming the file and the global, and runs nothing; a legacy
  (non-zip) ``torch.save`` file is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from tests.dist.test_torchrun import SCRIPTS, reshard, torchrun  # noqa: E402
from tests.dist.torchrun_scripts import save_pt_world as W  # noqa: E402
from tests.strategies import same_bits  # noqa: E402
from tests.torchless import convert_without_torch  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pt_world")
    torchrun(W.WORLD, SCRIPTS / "save_pt_world.py", out)
    return out


def assert_same_as_torch(hf_dir: Path, oracle: Path) -> None:
    got = load_file(str(hf_dir / "model.safetensors"))
    want = load_file(str(oracle))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_bits(got[name], t), name


@pytest.mark.parametrize("case", ["verl", "hsdp", "fsdp_tp"])
def test_dtensor_files_convert_to_what_torch_holds(world: Path, tmp_path: Path, case: str) -> None:
    reshard("convert", world / case, tmp_path / "hf", "--consolidate", "--quiet")
    assert_same_as_torch(tmp_path / "hf", world / f"{case}.safetensors")
    doc = json.loads(reshard("inspect", world / case, "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "pt"


def test_verl_files_describe_themselves(world: Path) -> None:
    doc = json.loads(reshard("inspect", world / "verl", "--json").stdout)
    assert doc["mesh"] == {"names": ["fsdp"], "shape": [4]}
    pls = {t["name"]: t["placements"] for t in doc["tensors"]}
    assert pls == {"0.weight": ["S(0)"], "0.bias": ["S(0)"], "1.weight": ["S(0)"], "scale": ["R"]}
    res = reshard("inspect", world / "verl")
    assert '"scale") are taken as replicated' in res.stderr  # the plain buffer: a warning


def test_fsdp_tp_placements_sub_mesh_and_non_tensor_leaves(world: Path, tmp_path: Path) -> None:
    doc = json.loads(reshard("inspect", world / "fsdp_tp", "--json").stdout)
    assert doc["mesh"] == {"names": ["dp", "tp"], "shape": [2, 2]}
    pls = {t["name"]: t["placements"] for t in doc["tensors"]}
    assert pls == {
        "model.layers.0.gate_up": ["_S(0, 2)", "S(0)"],
        "model.layers.0.wo": ["S(0)", "S(1)"],
        "model.layers.0.tp_only": ["R", "S(0)"],  # on mesh["tp"]: replicated over dp
    }
    assert {(n["name"], n["kind"]) for n in doc["non_tensors"]} == {("step", "int"), ("name", "str")}
    # the DTensors' own placements are the rules: a new mesh needs no layout
    reshard("convert", world / "fsdp_tp", tmp_path / "tp4", "--target-mesh", "dp=1,tp=4", "--quiet")
    reshard("convert", tmp_path / "tp4", tmp_path / "hf", "--consolidate", "--quiet")
    assert_same_as_torch(tmp_path / "hf", world / "fsdp_tp.safetensors")


def test_accelerate_use_dcp_false_rank_bin_files(world: Path, tmp_path: Path) -> None:
    """accelerate's FSDP2 ``save_state`` with ``use_dcp=False``: ``pytorch_model_fsdp_0_rank{r}.bin``
    beside ``optimizer_0_rank{r}.bin`` are read through the model files (the directory was 'no
    checkpoint found': .bin was not a rank-file suffix)."""
    src = world / "accelerate"
    if not src.exists():
        pytest.skip("accelerate is not installed")
    assert sorted(p.name for p in src.iterdir())[:2] == ["optimizer_0_rank0.bin", "optimizer_0_rank1.bin"]
    doc = json.loads(reshard("inspect", src, "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "pt" and doc["mesh"]["shape"] == [4]
    reshard("convert", src, tmp_path / "hf", "--consolidate", "--quiet")
    assert_same_as_torch(tmp_path / "hf", world / "accelerate.safetensors")


def test_target_mesh_adding_a_dim_to_the_dtensors_mesh(world: Path, tmp_path: Path) -> None:
    """A new dim on the DTensors' own rules is replicated, as for per-rank files (the rules were
    positional, one placement per source dim: exit 2 naming a rule of the "file metadata")."""
    reshard("convert", world / "fsdp_tp", tmp_path / "pp", "--target-mesh", "dp=2,tp=2,pp=2", "--quiet")
    doc = json.loads(reshard("inspect", tmp_path / "pp", "--json").stdout)
    assert doc["mesh"] == {"names": ["dp", "tp", "pp"], "shape": [2, 2, 2]}
    assert {t["name"]: t["placements"] for t in doc["tensors"]}["model.layers.0.wo"] == ["S(0)", "S(1)", "R"]
    reshard("convert", tmp_path / "pp", tmp_path / "hf", "--consolidate", "--quiet")
    assert_same_as_torch(tmp_path / "hf", world / "fsdp_tp.safetensors")


def test_plain_tensors_need_a_source_layout(world: Path, tmp_path: Path) -> None:
    res = reshard("convert", world / "plain", tmp_path / "x", "--consolidate", code=2)
    assert "pass --source-layout" in res.stderr and not (tmp_path / "x").exists()
    lay = world / "plain.yaml"
    reshard("convert", world / "plain", tmp_path / "hf", "--source-layout", lay, "--consolidate", "--quiet")
    assert_same_as_torch(tmp_path / "hf", world / "plain.safetensors")
    res = reshard(
        "convert",
        world / "plain",
        tmp_path / "y",
        "--source-layout",
        lay,
        "--source-mesh",
        "tp=2",
        "--consolidate",
        code=2,
    )
    assert "4 rank files but the mesh tp=2 has 2 ranks" in res.stderr


def test_the_copy_path_imports_no_torch(world: Path, tmp_path: Path) -> None:
    res = convert_without_torch(world / "fsdp_tp", tmp_path / "o", "--consolidate", "--quiet")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "model.safetensors").is_file()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_exits_2_and_runs_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "marker"
    for r in range(2):
        torch.save({"w": torch.ones(2)}, src / f"rank_{r}.pt")
    evil = src / "rank_1.pt"  # same archive, data.pkl replaced by a pickle calling os.system
    with zipfile.ZipFile(evil) as z:
        records = {n: z.read(n) for n in z.namelist()}
    records["rank_1/data.pkl"] = pickle.dumps({"w": _Evil(marker)}, protocol=2)
    with zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as z:
        for n, data in records.items():
            z.writestr(n, data)
    pickle.loads(records["rank_1/data.pkl"])  # the oracle: unpickled by pickle, it runs
    assert marker.exists()
    marker.unlink()
    res = reshard("convert", src, tmp_path / "out", "--consolidate", code=2)
    assert str(evil) in res.stderr and f"{os.system.__module__}.system" in res.stderr
    assert "nothing of it was run" in res.stderr and "Traceback" not in res.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    reshard("inspect", src, code=2)
    assert not marker.exists()


def test_a_legacy_torch_save_file_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for r in range(2):
        torch.save({"w": torch.ones(2)}, src / f"rank_{r}.pt", _use_new_zipfile_serialization=False)
    res = reshard("convert", src, tmp_path / "out", "--consolidate", code=2)
    assert "rank_0.pt: a legacy torch.save file" in res.stderr and "re-save it" in res.stderr


def test_load_dtensors_reads_pt_files(world: Path) -> None:
    """No layout: each DTensor is loaded with the placements it was saved with (checked in the ranks)."""
    torchrun(W.WORLD, SCRIPTS / "load_pt.py", world / "fsdp_tp", world / "fsdp_tp.safetensors")


def test_one_file_of_every_dtype_needs_no_layout(tmp_path: Path) -> None:
    """veRL with world_size 1 saves plain tensors: one file is a one-rank checkpoint."""
    src = tmp_path / "src"
    src.mkdir()
    names = ["float8_e4m3fn", "bfloat16", "float16", "float64", "uint16", "int64", "bool", "complex64"]
    g = torch.Generator().manual_seed(5)
    state = {n: (torch.randn(3, 2, generator=g) * 3).to(getattr(torch, n)) for n in names}
    state["t"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()  # a transposed view: as torch holds it
    torch.save({"model": state, "lr": 0.5}, src / "model_world_size_1_rank_0.pt")
    reshard("convert", src, tmp_path / "hf", "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(f"model.{n}" for n in [*names, "t"])
    for n, t in state.items():
        assert same_bits(got[f"model.{n}"], t.contiguous()), n


@pytest.mark.parametrize("name", ["model.pt", "pytorch_model.bin"])
def test_one_whole_state_dict_file_converts(tmp_path: Path, name: str) -> None:
    """``torch.save(model.state_dict())``: the file itself, or alone in its directory, is a world of one;
    tied weights (one storage, two names) and views at a storage offset come out as torch holds them."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied: both names save one storage
    state = model.state_dict()
    state["part"] = torch.arange(24, dtype=torch.bfloat16)[6:18].view(3, 4)  # a view into a bigger storage
    src = tmp_path / "src"
    src.mkdir()
    torch.save(state, src / name)
    for given in (src, src / name):
        out = tmp_path / f"hf-{given.name}"
        reshard("convert", given, out, "--consolidate", "--quiet")
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(state)
        for n, t in state.items():
            assert same_bits(got[n], t), n
    doc = json.loads(reshard("inspect", src / name, "--check", "--json").stdout)
    assert doc["format"] == "pt" and doc["ok"] is True
    reshard(
        "convert", src, tmp_path / "tp", "--target-layout", "replicated", "--target-mesh", "tp=2", "--quiet"
    )
    for r in range(2):
        got = load_file(str(tmp_path / "tp" / f"rank-{r:05d}-of-00002.safetensors"))
        assert sorted(got) == sorted(state) and all(same_bits(got[n], t) for n, t in state.items())
    (src / "other.pt").write_bytes((src / name).read_bytes())  # two whole files: which one is meant?
    if name == "pytorch_model.bin":  # transformers' name: the one from_pretrained reads
        reshard("convert", src, tmp_path / "x", "--consolidate", "--quiet")
        assert sorted(load_file(str(tmp_path / "x" / "model.safetensors"))) == sorted(state)
    else:
        res = reshard("convert", src, tmp_path / "x", "--consolidate", code=2)
        assert str(src) in res.stderr
    (tmp_path / "notes.txt").write_text("hello")
    res = reshard("inspect", tmp_path / "notes.txt", "--from", "pt", code=2)
    assert "notes.txt" in res.stderr and "torch.save" in res.stderr


def test_check_verifies_the_zip_crc32s(world: Path, tmp_path: Path) -> None:
    import shutil

    from reshard.formats.pt import read_pt

    bad = tmp_path / "hsdp"
    shutil.copytree(world / "hsdp", bad)
    f = bad / "rank_2.pt"  # its 4 rows fill their storage record: the record CRC32 is the piece's
    start = read_pt(f).header.entry("w").start  # the tensor's first byte, in place in the zip
    data = bytearray(f.read_bytes())
    data[start] ^= 0x40
    f.write_bytes(bytes(data))
    res = reshard("inspect", bad, "--check", code=1)
    assert 'rank_2.pt: tensor "w"' in res.stdout + res.stderr and "CRC32" in res.stdout + res.stderr


def test_a_layout_that_contradicts_a_dtensor_is_a_warning(world: Path, tmp_path: Path) -> None:
    """veRL's DTensors say ``S(0)`` on ``fsdp``; a --source-layout giving them ``S(1)`` was silently
    ignored (the DTensors' own placements win, rightly). Now a warning names the tensor and both;
    a layout that agrees (``Shard(-2)`` of a 2-d weight is its ``S(0)``) or has no rule for it
    (``0.*``) says nothing, and the output is torch's either way."""
    wrong, right = tmp_path / "wrong.yaml", tmp_path / "right.yaml"
    wrong.write_text('mesh: {fsdp: 4}\nplacements:\n  "*.weight": S(1)\n  "*": R\n')
    right.write_text('mesh: {fsdp: 4}\nplacements:\n  "1.weight": Shard(-2)\n  "scale": R\n')
    res = reshard("convert", world / "verl", tmp_path / "a", "--source-layout", wrong, "--consolidate")
    assert 'DTensor "0.weight" says it is [S(0)], but the layout gives it [S(1)] (and 2 more)' in res.stderr
    assert_same_as_torch(tmp_path / "a", world / "verl.safetensors")
    res = reshard("convert", world / "verl", tmp_path / "b", "--source-layout", right, "--consolidate")
    assert "says it is" not in res.stderr
    assert_same_as_torch(tmp_path / "b", world / "verl.safetensors")
