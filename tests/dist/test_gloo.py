"""Real multi-process gloo worlds on CPU: torch's ``distribute_tensor`` is the reference.

World 1 (4 ranks) saves per-rank checkpoints of a tp=4 mesh and of an
fsdp=2,tp=2 mesh (FSDP over TP). The ``reshard`` CLI, run as a real
subprocess, converts them. World 2 (8 ranks) calls ``distribute_tensor`` for the
target layouts (tp=8; tp=4 replicated over an outer dim) and saves its local
tensors, which must equal the CLI's output files bit for bit; it also saves a
3-D (2, 2, 2) checkpoint with one tensor dim sharded by two mesh dims, which
the CLI consolidates. Consolidated files must equal the full tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from tests.dist import gloo_worker as W
from tests.strategies import same_bits, torch_local, torch_placements

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("gloo_worker.py")
WORLD_TIMEOUT = 120  # seconds; each world takes ~10-20 s on 2 cores


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RESHARD_DEBUG", None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_world(nproc: int, phase: str, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(WORKER),
        phase,
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=WORLD_TIMEOUT, env=_env())
    assert res.returncode == 0, f"{phase} world failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"


def reshard_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("reshard")
    cmd = (
        [str(exe)]
        if exe.exists()
        else [sys.executable, "-c", "from reshard.cli import main; main()"]
    )
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=_env())


def convert(*args: str) -> dict:
    res = reshard_cli("convert", *args, "--json")
    assert res.returncode == 0, (
        f"reshard convert {' '.join(args)} failed ({res.returncode}):\n{res.stderr}"
    )
    doc = json.loads(res.stdout)
    assert doc["ok"] is True
    return doc


def layout_yaml(mesh: dict[str, int], rules: dict[str, list[str]]) -> str:
    sizes = ", ".join(f"{n}: {s}" for n, s in mesh.items())
    lines = [f"mesh: {{{sizes}}}", "placements:"]
    lines += [f"  {json.dumps(name)}: {json.dumps(pls)}" for name, pls in rules.items()]
    return "\n".join(lines) + "\n"


def rank_file(rank: int, world: int) -> str:
    return W.rank_file(rank, world)




def assert_same_files(got_dir: Path, want_dir: Path, world: int, names) -> None:
    for r in range(world):
        got = load_file(str(got_dir / rank_file(r, world)))
        want = load_file(str(want_dir / rank_file(r, world)))
        assert set(got) == set(want) == set(names)
        for name in names:
            assert same_bits(got[name], want[name]), (
                f"rank {r} {name}: reshard {tuple(got[name].shape)} "
                f"vs distribute_tensor {tuple(want[name].shape)}"
            )


def assert_consolidated(directory: Path, names) -> None:
    got = load_file(str(directory / "model.safetensors"))
    assert set(got) == set(names)
    for name in names:
        assert same_bits(got[name], W.full_tensor(name)), name


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Run world 1, the CLI conversions, then world 2; return the directory."""
    out = tmp_path_factory.mktemp("gloo")
    run_world(4, "save4", out)

    c1 = out / "case1"
    (c1 / "tp4.yaml").write_text(layout_yaml(W.CASE1_MESH, W.CASE1))
    convert(
        str(c1 / "src"),
        str(c1 / "tp8"),
        "--source-layout",
        str(c1 / "tp4.yaml"),
        "--target-mesh",
        "tp=8",
    )

    c2 = out / "case2"
    (c2 / "fsdp_tp.yaml").write_text(layout_yaml(W.CASE2_MESH, W.CASE2))
    (c2 / "tp4.yaml").write_text(layout_yaml(W.CASE2_TARGET_MESH, W.CASE2_TARGET))
    convert(
        str(c2 / "src"),
        str(c2 / "tp4"),
        "--source-layout",
        str(c2 / "fsdp_tp.yaml"),
        "--target-layout",
        str(c2 / "tp4.yaml"),
    )
    convert(
        str(c2 / "src"),
        str(c2 / "hf"),
        "--source-layout",
        str(c2 / "fsdp_tp.yaml"),
        "--consolidate",
    )

    run_world(8, "world8", out)

    c3 = out / "case3"
    (c3 / "abc.yaml").write_text(layout_yaml(W.CASE3_MESH, W.CASE3))
    convert(
        str(c3 / "src"), str(c3 / "hf"), "--source-layout", str(c3 / "abc.yaml"), "--consolidate"
    )
    return out


def _check_oracle(
    directory: Path, mesh_dims: dict[str, int], rules: dict[str, list[str]], prefix=()
) -> None:
    mesh = Mesh(tuple(mesh_dims), tuple(mesh_dims.values()))
    for r, coord in enumerate(mesh.coordinates()):
        got = load_file(str(directory / rank_file(r, mesh.size)))
        for name, texts in rules.items():
            full = W.full_tensor(name)
            lay = TensorLayout.make(tuple(full.shape), mesh, list(prefix) + texts)
            want = torch_local(full, mesh.shape, coord, torch_placements(lay.placements, full.ndim))
            assert same_bits(got[name], want), f"{directory} rank {r} {name}"


def test_distribute_tensor_agrees_with_the_split_oracle(worlds):
    """The property tests' oracle (torch's _split_tensor) is what distribute_tensor really does."""
    _check_oracle(worlds / "case1" / "src", W.CASE1_MESH, W.CASE1)
    _check_oracle(worlds / "case2" / "src", W.CASE2_MESH, W.CASE2)
    _check_oracle(worlds / "case1" / "expect_tp8", W.CASE1_TARGET_MESH, W.CASE1)
    _check_oracle(worlds / "case3" / "src", W.CASE3_MESH, W.CASE3)
    # the empty shards really are empty: 3 rows over 4 and 8 ranks
    assert load_file(str(worlds / "case1" / "src" / rank_file(3, 4)))["few_rows"].shape == (0, 2)
    assert load_file(str(worlds / "case1" / "expect_tp8" / rank_file(7, 8)))["few_rows"].shape == (
        0,
        2,
    )


def test_tp4_to_tp8_matches_distribute_tensor(worlds):
    c1 = worlds / "case1"
    assert sorted(p.name for p in (c1 / "tp8").glob("*.safetensors")) == [
        rank_file(r, 8) for r in range(8)
    ]
    assert_same_files(c1 / "tp8", c1 / "expect_tp8", 8, W.CASE1)


def test_fsdp_tp_to_tp4_matches_distribute_tensor(worlds):
    c2 = worlds / "case2"
    assert_same_files(c2 / "tp4", c2 / "expect_tp4", 4, W.CASE2_TARGET)


def test_fsdp_tp_consolidates_to_the_full_tensors(worlds):
    assert_consolidated(worlds / "case2" / "hf", W.CASE2)


def test_3d_nested_sharding_consolidates_to_the_full_tensors(worlds):
    assert_consolidated(worlds / "case3" / "hf", W.CASE3)


def test_tp8_output_describes_itself(worlds):
    """The tp=8 output converts back to tp=4 with no layout file and equals world 1's files."""
    c1 = worlds / "case1"
    convert(str(c1 / "tp8"), str(c1 / "back_tp4"), "--target-mesh", "tp=4")
    assert_same_files(c1 / "back_tp4", c1 / "src", 4, W.CASE1)
