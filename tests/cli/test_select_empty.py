"""--include/--exclude that keep nothing: exit 2 naming the patterns, nothing written.

A typo in a pattern used to write an empty checkpoint (exit 0), and let ``verify`` and
``inspect --check`` pass having compared nothing: a CI step that cannot fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

RESHARD = str(Path(sys.executable).parent / "reshard")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sel") / "hf"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {"model.w": torch.randn(4, 6, generator=g), "model.norm": torch.randn(6, generator=g)},
        str(d / "model.safetensors"),
    )
    return d


@pytest.mark.parametrize(
    "sel",
    [
        ["--include", "modle.*"],  # a typo
        ["--exclude", "*"],
        ["--include", "model.*", "--exclude", "re:model\\..*"],
    ],
)
def test_a_selection_that_keeps_nothing_exits_2(hf: Path, tmp_path: Path, sel: list[str]) -> None:
    out = tmp_path / "out"
    for args in (
        ["convert", hf, out, "--target-mesh", "tp=2", "--target-layout", "llama-tp"],
        ["convert", hf, out, "--to", "dcp"],
        ["plan", hf, "--target-mesh", "tp=2", "--target-layout", "llama-tp"],
        ["inspect", hf],
        ["inspect", hf, "--check"],
        ["verify", hf, hf],
    ):
        p = _run(*args, *sel)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert f'"{sel[1]}"' in p.stderr and f"keep no entry of {hf} (2 entries)" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not out.exists()
        j = _run(*args, *sel, "--json")
        assert j.returncode == 2
        doc = json.loads(j.stdout)
        assert doc["ok"] is False and "keep no entry" in doc["error"]["message"]


def test_a_selection_that_keeps_something_still_works(hf: Path, tmp_path: Path) -> None:
    # one pattern matching nothing is still a warning, as before
    p = _run("inspect", hf, "--include", "model.w", "--include", "nothing.*", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [t["name"] for t in doc["tensors"]] == ["model.w"]
    assert doc["warnings"] == [f'--include "nothing.*" matches nothing in {hf}']
    # verify: a side keeping something against one keeping nothing is a difference, not an error
    other = tmp_path / "other"
    other.mkdir()
    save_file({"x.w": torch.zeros(2)}, str(other / "model.safetensors"))
    p = _run("verify", hf, other, "--include", "model.w", "--json")
    assert p.returncode == 1, p.stderr
    assert [d["kind"] for d in json.loads(p.stdout)["differences"]] == ["missing"]


def test_a_selection_of_non_tensor_items_only_converts_nothing(tmp_path: Path) -> None:
    """A DCP checkpoint (torch's own dcp.save) with only its non-tensor items selected: inspect
    lists them; convert and plan exit 2 (they wrote a checkpoint of 0 tensors, exit 0)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            {"model": {"w": torch.ones(4, 4)}, "lr_scheduler": {"last_epoch": 3}},
            checkpoint_id=str(src),
            no_dist=True,
        )
    sel = ["--include", "lr_scheduler.*"]
    p = _run("inspect", src, *sel, "--json")
    assert p.returncode == 0, p.stderr
    assert [n["name"] for n in json.loads(p.stdout)["non_tensors"]] == ["lr_scheduler.last_epoch"]
    out = tmp_path / "out"
    for args in (["convert", src, out, "--consolidate"], ["plan", src, "--consolidate"]):
        p = _run(*args, *sel)
        assert p.returncode == 2, (args, p.stderr)
        assert "keep no tensor of its 1, only non-tensor items (lr_scheduler.last_epoch)" in p.stderr
        assert "Traceback" not in p.stderr and not out.exists()
    assert _run("convert", src, out, "--consolidate", "--include", "model.*").returncode == 0


def test_a_checkpoint_of_no_tensors_converts_nothing(tmp_path: Path) -> None:
    """An HF index whose weight_map is empty (its shard's tensor unlisted): convert and plan exit 2
    (they wrote an empty checkpoint, exit 0); inspect still shows it."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": torch.zeros(2)}, str(src / "model-00001-of-00001.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    out = tmp_path / "out"
    for args in (
        ["convert", src, out, "--target-layout", "llama-tp", "--target-mesh", "tp=2"],
        ["convert", src, out, "--to", "dcp"],
        ["plan", src, "--consolidate"],
    ):
        p = _run(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert f"{src}: the hf checkpoint holds no tensors: nothing to convert" in p.stderr
        assert not out.exists()
    assert _run("inspect", src).returncode == 0


def test_a_dcp_object_holding_tensors_is_not_dropped(tmp_path: Path) -> None:
    """torch's dcp.save with DefaultSavePlanner(flatten_state_dict=False) stores a nested dict
    as one pickled object: its tensors are not DCP tensors. convert dropped them (exit 0, a
    warning); now they are read from the object as "model.w" (objects reshard cannot read are
    refused: tests/dist/test_dcp_unflattened.py). A plain object is still just listed."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    src = tmp_path / "dcp"
    state = {"model": {"w": torch.ones(4, 4)}, "step": torch.arange(3), "sched": {"last_epoch": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state, checkpoint_id=str(src), no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False)
        )
    p = _run("inspect", src, "--json")
    assert p.returncode == 0, p.stderr
    kinds = {n["name"]: n["kind"] for n in json.loads(p.stdout)["non_tensors"]}
    assert kinds == {"sched": "object"}
    out = tmp_path / "out"
    p = _run("convert", src, out, "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == ["model.w", "step"] and torch.equal(got["model.w"], torch.ones(4, 4))
    p = _run("convert", src, tmp_path / "rest", "--consolidate", "--exclude", "model.*")
    assert p.returncode == 0, p.stderr
    assert list(load_file(str(tmp_path / "rest" / "model.safetensors"))) == ["step"]
