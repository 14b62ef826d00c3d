"""``dcp.save(state, planner=DefaultSavePlanner(flatten_state_dict=False))``: every nested dict of the
state dict is stored as one ``torch.save``'d object (``BytesStorageMetadata``), its tensors inside it.

What torch 2.13 stores, checked here on torch's own saves: a top-level tensor stays a DCP tensor; a
dict (a model's ``state_dict()``, an optimizer's ``state``/``param_groups``, any nesting) is one
object. reshard reads such an object's ``data.pkl`` with the restricted unpickler (nothing runs) and
its tensors in place, named ``<item>.<keys>``. The oracle is torch's ``dcp_to_torch_save`` of the
directory, flattened by DCP's own ``flatten_state_dict``: the same names, the same bits. An object
reshard cannot read (a class outside the allow-list, a transposed view, a DTensor split over ranks,
of which dcp.save stored one rank's shard) stays an "object holding tensors": ``convert`` exits 2
saying why and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.dist.test_torchrun import SCRIPTS, reshard, torchrun
from tests.strategies import same_bits
from tests.torchless import convert_without_torch

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.dist


@dataclasses.dataclass
class RunConfig:  # a class the restricted unpickler does not allow
    lr: float = 0.1


def save_unflattened(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state, checkpoint_id=str(path), no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False)
        )


def torch_flat(path: Path, tmp: Path) -> dict[str, Any]:
    """torch's reading: dcp_to_torch_save, then DCP's own flattening; tensors only."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path), str(tmp))
    flat, _ = flatten_state_dict(torch.load(tmp, weights_only=False))
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def cases() -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    storage = torch.arange(40, dtype=torch.int64)
    return {
        "model": {"model": model.state_dict()},
        "train": {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3},
        "nested": {
            "model": {"layers": {"0": {"w": torch.randn(5, 2)}, "1": {"w": torch.randn(5, 2)}}, "n": 2},
            "bias": torch.zeros(4, dtype=torch.float16),  # top level: a DCP tensor
        },
        "views": {"obj": {"part": storage[10:22].view(3, 4), "same": storage, "tied": storage}},
    }


@pytest.mark.parametrize("case", ["model", "train", "nested", "views"])
def test_tensors_inside_objects_convert_as_torch_reads_them(tmp_path: Path, case: str) -> None:
    src = tmp_path / "dcp"
    save_unflattened(cases()[case], src)
    want = torch_flat(src, tmp_path / "full.pt")
    doc = json.loads(reshard("inspect", src, "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "dcp"
    assert all(n["kind"] != "object holding tensors" for n in doc.get("non_tensors", []))
    out = tmp_path / "hf"
    reshard("convert", src, out, "--consolidate", "--quiet")
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_bits(got[name], t), name
    reshard("verify", src, out)
    reshard("plan", src, "--consolidate", "--quiet")


def test_leaves_inside_an_object_are_not_offered_to_dcp(tmp_path: Path) -> None:
    """The non-tensor leaves of a pickled object (the optimizer's param_groups) are not stored
    runs: the warning does not say ``--to dcp`` carries them, and ``--to dcp`` copies only the
    item that is one (``step``, an item of its own)."""
    src = tmp_path / "dcp"
    save_unflattened(cases()["train"], src)
    doc = json.loads(reshard("convert", src, tmp_path / "hf", "--consolidate", "--json").stdout)
    left = [w for w in doc["warnings"] if "not converted" in w]
    assert doc["not_converted"] and left and not any("--to dcp" in w for w in left), doc["warnings"]
    doc = json.loads(reshard("convert", src, tmp_path / "out", "--to", "dcp", "--json").stdout)
    assert [n["name"] for n in doc["copied_items"]] == ["step"], doc
    left = doc["not_converted"]
    assert left and all(n["name"].startswith("optim.param_groups.") for n in left), left


def test_the_object_read_path_imports_no_torch(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    save_unflattened(cases()["train"], src)
    res = convert_without_torch(src, tmp_path / "o", "--consolidate", "--quiet")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("what", ["class", "transposed"])
def test_an_object_reshard_cannot_read_is_refused_saying_why(tmp_path: Path, what: str) -> None:
    inner: dict[str, Any] = {"w": torch.ones(2, 3)}
    if what == "class":
        inner["cfg"] = RunConfig()
    else:
        inner["wt"] = torch.arange(6.0).view(2, 3).t()
    src = tmp_path / "dcp"
    save_unflattened({"model": inner, "step": torch.arange(3)}, src)
    doc = json.loads(reshard("inspect", src, "--json").stdout)
    assert {n["name"]: n["kind"] for n in doc["non_tensors"]} == {"model": "object holding tensors"}
    res = reshard("convert", src, tmp_path / "out", "--consolidate", code=2)
    assert f'{src}: item "model" is a pickled object holding tensors' in res.stderr
    assert ("RunConfig" in res.stderr) if what == "class" else ("not row-major" in res.stderr)
    assert "DefaultSavePlanner" in res.stderr and "--exclude 'model'" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()
    reshard("convert", src, tmp_path / "rest", "--consolidate", "--exclude", "model", "--quiet")
    assert list(load_file(str(tmp_path / "rest" / "model.safetensors"))) == ["step"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unflattened_world")
    torchrun(2, SCRIPTS / "save_dcp_unflattened.py", out, teardown_abort_ok=True)
    return out


def test_a_replicated_dtensor_inside_an_object_is_read_whole(world: Path, tmp_path: Path) -> None:
    want = torch.load(world / "replicated.full.pt")
    reshard("convert", world / "replicated", tmp_path / "hf", "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_bits(got[name], t), name


def test_a_sharded_dtensor_inside_an_object_is_refused(world: Path, tmp_path: Path) -> None:
    """dcp.save stored one rank's object: half of "model.w". torch's own dcp_to_torch_save gives that
    rank's DTensor back; reshard says the other shards are not in the checkpoint."""
    src = world / "sharded"
    res = reshard("inspect", src, "--check", code=1)
    assert 'holds DTensor "model.w" placed S(0) on mesh [2]' in res.stdout + res.stderr
    res = reshard("convert", src, tmp_path / "out", "--consolidate", code=2)
    assert 'item "model" is a pickled object holding tensors' in res.stderr
    assert "only that rank's shard of it is in the checkpoint" in res.stderr
