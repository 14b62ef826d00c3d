"""``--to dcp`` carries a DCP source's non-tensor items over: a training state resumes strictly.

An FSDP2 training state (model, AdamW state, ``param_groups`` with hyper-parameters other
than the defaults, an int and a str under ``train``) saved by ``dcp.save`` from 2 gloo
ranks, plain and zstd-compressed (``dcp_helpers/optim_world.py``), is converted by the CLI
to a DCP for 4 ranks; 4 gloo ranks running FSDP2 ``dcp.load`` it with torch's default
planner, which refuses a checkpoint missing any key of the state dict (before, reshard left
the ``BYTE_IO`` items out and the load needed ``allow_partial_load``, keeping the new
optimizer's learning rate), and get the saved tensors bit for bit and the saved
hyper-parameters and values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
WORLD = HERE / "dcp_helpers" / "optim_world.py"
RESHARD = Path(sys.executable).with_name("reshard")
ITEMS = 14  # 12 param_groups entries, train.step, train.tag
LAYOUT = """mesh: {dp: 4}
placements:
  "optimizer.state.*.step": {dp: R}
  "*": {dp: S(0)}
"""


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("optim")
    proc = subprocess.run(
        [sys.executable, str(WORLD), "save", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, (
        proc.stdout + proc.stderr + "".join(p.read_text() for p in root.glob("error-*.txt"))
    )
    (root / "l4.yaml").write_text(LAYOUT)
    return root


def _convert(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RESHARD), "convert", *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("src", ["plain", "zstd"])
def test_a_training_state_resumes_strictly_on_another_mesh(saved: Path, tmp_path: Path, src: str) -> None:
    if not (saved / src).exists():
        pytest.skip("torch's ZStandard extension needs the zstandard or pyzstd module")
    out = tmp_path / "dp4"
    p = _convert(saved / src, out, "--to", "dcp", "--target-layout", saved / "l4.yaml")
    assert p.returncode == 0, p.stderr
    assert "not converted" not in p.stderr and f"{ITEMS} non-tensor item(s) as they were" in p.stderr
    load = subprocess.run(
        [sys.executable, str(WORLD), "load", str(out), str(saved / "ref.pt"), str(tmp_path / "load")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    errors = "".join(p.read_text() for p in (tmp_path / "load").glob("error-*.txt"))
    assert load.returncode == 0, load.stderr[-3000:] + errors
    for rank in range(4):
        got = json.loads((tmp_path / "load" / f"load-{rank}.json").read_text())
        assert got["tensors"] == 16 and got["bad"] == [], got
        assert got["hyper"] == {"lr": 0.0123, "betas": [0.8, 0.95], "weight_decay": 0.03, "eps": 1e-7}, got
        assert got["train"] == {"step": 7, "tag": "run-a"}, got
    # the items' own bytes, as torch stored them (zstd too: their descriptors go with them)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    theirs, ours = FileSystemReader(str(saved / src)), FileSystemReader(str(out))
    a, b = theirs.read_metadata(), ours.read_metadata()
    names = {k for k, v in a.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert len(names) == ITEMS
    assert names == {k for k, v in b.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for name in names:
        x, y = a.storage_data[MetadataIndex(name)], b.storage_data[MetadataIndex(name)]
        assert (x.transform_descriptors or None) == (y.transform_descriptors or None)
        assert (saved / src / x.relative_path).read_bytes()[x.offset : x.offset + x.length] == (
            out / y.relative_path
        ).read_bytes()[y.offset : y.offset + y.length]
    check = subprocess.run([str(RESHARD), "inspect", str(out), "--check"], capture_output=True, text=True)
    shown = check.stdout + check.stderr
    assert check.returncode == 0 and "copied as it is by --to dcp only" in shown, shown


def test_other_formats_list_them_and_exclude_leaves_them_out(saved: Path, tmp_path: Path) -> None:
    p = _convert(saved / "plain", tmp_path / "hf", "--consolidate", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert len(doc["not_converted"]) == ITEMS and doc["copied_items"] == []
    assert any("--to dcp carries them over" in w for w in doc["warnings"])
    out = tmp_path / "dcp"
    p = _convert(saved / "plain", out, "--to", "dcp", "--exclude", "train.*", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert len(doc["copied_items"]) == ITEMS - 2 and doc["not_converted"] == []
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    objects = {k for k, v in md.items() if isinstance(v, BytesStorageMetadata)}
    assert len(objects) == ITEMS - 2 and not any(k.startswith("train.") for k in objects)
    # torch's own loader, into a plain state dict: the values as they were saved
    import torch.distributed.checkpoint as dcp

    sd = {"optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert sd["optimizer"]["param_groups"][0] == {"lr": 0.0123, "betas": (0.8, 0.95)}
