"""Inputs found by a fourth independent red-team pass: real producers and consumers, hostile files.

Each test here failed before its fix; real files (torch's own writers, edited where the point is
a hostile file), real CLI subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _long1(n: int) -> bytes:
    """The pickle opcode LONG1 pushing ``n``."""
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _edit_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace the one occurrence of ``old`` in a ``torch.save`` archive's ``data.pkl``."""
    with zipfile.ZipFile(path) as z:
        recs = {n: z.read(n) for n in z.namelist()}
    pk = next(n for n in recs if n.endswith("/data.pkl"))
    assert recs[pk].count(old) == 1, recs[pk]
    recs[pk] = recs[pk].replace(old, new)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for n, data in recs.items():
            z.writestr(n, data)


@pytest.mark.parametrize("count", [1, 300])
def test_a_pt_tensor_of_more_than_int64_elements_exits_2(tmp_path: Path, count: int) -> None:
    """A ``.pt`` tensor whose size, edited to [2**40, 2**40] (stride 0, as ``expand`` saves it),
    is over 2**63 - 1 elements (``torch.load``: "numel: integer multiplication overflow"): exit 2
    naming the file. It was an ``OverflowError`` traceback from the spool (exit 1). ``count``
    tensors: 300 of one kind go through the pickle's item templates, 1 through the C unpickler."""
    src = tmp_path / "src"
    src.mkdir()
    sd = {f"w{i}": torch.ones(1).expand(3, 5) for i in range(count - 1)}
    sd["big"] = torch.ones(1).expand(7, 11)  # stride (0, 0): its 4 stored bytes span it all
    torch.save(sd, src / "model.pt")
    _edit_pickle(src / "model.pt", b"K\x07K\x0b\x86", _long1(2**40) + _long1(2**40) + b"\x86")
    with pytest.raises(RuntimeError, match="overflow"):
        torch.load(src / "model.pt", weights_only=True)
    out = tmp_path / "out"
    for args in (["inspect", src], ["inspect", src, "--check"], ["convert", src, out, "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert f"{src / 'model.pt'}: " in r.stderr and "[1099511627776, 1099511627776]" in r.stderr
        assert "over 9223372036854775807 elements" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["model_1000.pt", "checkpoint-500.pth", "epoch_3.pt"])
def test_one_pt_file_numbered_by_its_step_converts(tmp_path: Path, name: str) -> None:
    """A directory holding one ``torch.save(model.state_dict(), "model_1000.pt")`` (beside the
    optimizer's ``optimizer_1000.pt``): the number is a step, not a rank. It exited 2 with "no .pt
    file for rank(s) [0, 1, 2, 3, 4, 5, 6, 7]"; now it converts to what ``torch.load`` gives."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(4)
    sd = {"w": torch.randn(4, 6, generator=g).to(torch.bfloat16), "b": torch.arange(3)}
    torch.save(sd, src / name)
    if name.startswith("model_"):  # the optimizer's file beside it: the model is what converts
        torch.save({"state": {0: {"step": torch.tensor(1.0)}}}, src / name.replace("model", "optimizer"))
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--consolidate")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    assert run_cli("verify", src, out).returncode == 0


def test_pt_files_of_several_steps_say_what_they_found(tmp_path: Path) -> None:
    """``model_1000.pt`` and ``model_2000.pt``: still refused (two saves are no world of ranks),
    naming the files found and what to do, not only "no .pt file for rank(s) [0, ..., 7]"."""
    src = tmp_path / "src"
    src.mkdir()
    for step in (1000, 2000):
        torch.save({"w": torch.ones(2)}, src / f"model_{step}.pt")
    r = run_cli("inspect", src)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "(found model_1000.pt, model_2000.pt)" in r.stderr, r.stderr
    assert "give the one to convert as SRC" in r.stderr


@pytest.mark.parametrize(
    ("model", "others"),
    [
        ("model.pt", ["optimizer.pt"]),  # torch.save(model.state_dict()) beside the optimizer's
        ("pytorch_model_fsdp.bin", ["optimizer.bin", "scheduler.bin"]),  # accelerate FULL_STATE_DICT
    ],
)
def test_a_model_file_beside_its_optimizer_file_converts(
    tmp_path: Path, model: str, others: list[str]
) -> None:
    """A training loop's ``model.pt`` beside ``optimizer.pt`` (and accelerate's FSDP
    ``save_state`` with FULL_STATE_DICT: ``pytorch_model_fsdp.bin``, ``optimizer.bin``,
    ``scheduler.bin``): it exited 2 "no checkpoint found". The model file is what converts, equal
    to what ``torch.load`` gives; the others are not read."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    src.mkdir()
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(m.state_dict(), src / model)
    for name in others:
        torch.save(opt.state_dict() if name.startswith("optim") else {"last_epoch": 1}, src / name)
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--consolidate")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out / "model.safetensors"))
    want = torch.load(src / model, weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert run_cli("verify", src, out).returncode == 0


def test_an_hf_index_naming_an_empty_shard_file_says_so(tmp_path: Path) -> None:
    """``weight_map: {"w": ""}``: the shard path was the directory itself, and the error named the
    directory as "the safetensors file is a directory", not the index and the tensor."""
    import json

    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2), "v": torch.zeros(2)}, str(src / "model-00001-of-00001.safetensors"))
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "", "v": "model-00001-of-00001.safetensors"}}))
    for args in (["inspect", src], ["convert", src, tmp_path / "out", "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f'{index}: tensor "w" has an empty shard file name' in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
