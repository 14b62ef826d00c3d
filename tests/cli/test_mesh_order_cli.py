"""`--source-mesh` and `--target-mesh` with the same text number ranks the same way (issue 8).

The layout writes its mesh `{tp: 4, fsdp: 2}`; both options say `fsdp=2,tp=4`. Rank r
must hold what torch's DeviceMesh gives it: the coordinate of r in
`torch.arange(8).reshape(2, 4)` (init_device_mesh's row-major numbering over the
written order), then each dim's placement applied by torch's own splitting.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from reshard.demo import torch_local
from reshard.placements import parse_placement
from tests.cli.test_convert_cli import run

LAYOUT = """\
mesh: {tp: 4, fsdp: 2}
placements:
  "*.w": {fsdp: S(0), tp: S(1)}
  "*.v": {tp: S(0)}
  "*": R
"""

FULL = {
    "layers.0.w": torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12),
    "layers.0.v": torch.arange(8 * 3, dtype=torch.int32).reshape(8, 3),
    "norm": torch.arange(5, dtype=torch.float16),
}
PLACEMENTS = {"layers.0.w": ("S(0)", "S(1)"), "layers.0.v": ("R", "S(0)")}  # on (fsdp, tp)
MESH = "fsdp=2,tp=4"
WANT_MESH = {"names": ["fsdp", "tp"], "shape": [2, 4]}


def torch_coordinate(rank: int) -> tuple[int, ...]:
    """Where init_device_mesh("cpu", (2, 4), mesh_dim_names=("fsdp", "tp")) puts ``rank``."""
    mesh = torch.arange(8).reshape(2, 4)
    return tuple(int(c) for c in (mesh == rank).nonzero()[0])


def consolidated(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_source_mesh_reads_back_what_target_mesh_wrote(tmp_path: Path) -> None:
    layout = tmp_path / "l.yaml"
    layout.write_text(LAYOUT)
    (tmp_path / "hf").mkdir()
    save_file(FULL, str(tmp_path / "hf" / "model.safetensors"))
    out = tmp_path / "ranks"
    p = run("convert", str(tmp_path / "hf"), str(out), "--target-layout", str(layout), "--target-mesh", MESH)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "reshard.json").read_text())["mesh"] == WANT_MESH
    files = [out / f"rank-{r:05d}-of-00008.safetensors" for r in range(8)]
    for r, f in enumerate(files):
        got = load_file(str(f))
        for n, t in FULL.items():
            pls = [parse_placement(x) for x in PLACEMENTS.get(n, ("R", "R"))]
            assert torch.equal(got[n], torch_local(t, (2, 4), torch_coordinate(r), pls)), (r, n)

    # a training job's bare rank files: no reshard.json, no self-description in the headers
    (out / "reshard.json").unlink()
    for f in files:
        save_file(load_file(str(f)), str(f))
    back = ["--from", "per-rank", "--source-layout", str(layout)]
    p = run("convert", str(out), str(tmp_path / "hf2"), *back, "--source-mesh", MESH, "--consolidate")
    assert p.returncode == 0, p.stderr
    got = consolidated(tmp_path / "hf2")
    assert set(got) == set(FULL)
    for n, t in FULL.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n

    # per-rank to per-rank with the same text on both sides: rank r stays rank r
    same = ["--target-layout", str(layout), "--target-mesh", MESH]
    p = run("plan", str(out), *back, "--source-mesh", MESH, *same, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["source"]["mesh"] == doc["target"]["mesh"] == WANT_MESH
    p = run("convert", str(out), str(tmp_path / "again"), *back, "--source-mesh", MESH, *same)
    assert p.returncode == 0, p.stderr
    for f in files:
        got, want = load_file(str(tmp_path / "again" / f.name)), load_file(str(f))
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), f.name

    # the layout's own order (tp outer) is another numbering: the same files read back scrambled
    p = run("convert", str(out), str(tmp_path / "hf3"), *back, "--consolidate")
    assert p.returncode == 0, p.stderr
    assert not torch.equal(consolidated(tmp_path / "hf3")["layers.0.w"], FULL["layers.0.w"])
