"""The torchrun path, in real multi-process gloo worlds on CPU (tiny tensors).

* ``save_dtensors``: 4 ranks on an (fsdp=2, tp=2) mesh save uneven ``Shard(0)``, nested
  ``[S(0), S(0)]``, ``Shard(1)``, ``Replicate``, FSDP2-over-TP ``_StridedShard(0, 2)``,
  ``Partial``, an fsdp-sub-mesh DTensor and a plain tensor; ``reshard inspect --check``
  accepts the directory and ``reshard convert --consolidate`` gives the full tensors.
* ``load_dtensors``: 4 ranks load a consolidated ``model.safetensors`` onto a tp=4 mesh
  with a layout YAML; every ``to_local()`` equals ``distribute_tensor``'s, checked in the
  ranks (``torchrun_scripts/load_world.py``); their ``save_dtensors`` of what they loaded
  equals ``reshard convert --target-layout`` byte for byte.
* ``reshard convert`` under ``torchrun --nproc-per-node 2`` (the console script): the
  ranks split the output files, and the output directory is byte-identical to a
  one-process conversion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from reshard.dist import share_by_bytes  # noqa: E402
from reshard.errors import UsageError  # noqa: E402
from reshard.io.checksum import file_checksum  # noqa: E402
from reshard.layout import TensorLayout  # noqa: E402
from reshard.mesh import Mesh  # noqa: E402
from tests.dist.torchrun_scripts import load_world as L  # noqa: E402
from tests.dist.torchrun_scripts import save_world as S  # noqa: E402
from tests.strategies import same_bits, torch_local, torch_placements  # noqa: E402

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).with_name("torchrun_scripts")
BIN = Path(sys.executable).parent
TIMEOUT = 120  # seconds per world; each takes ~5-10 s on 2 cores


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RESHARD_DEBUG", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# torch 2.13: a torchrun worker that used gloo collectives rarely aborts in C++ teardown,
# after its work is done (even after destroy_process_group); seen in ~1-5% of worlds.
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(
    nproc: int, *args: str | Path, teardown_abort_ok: bool = False
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone`` (a free rendezvous port per run), failing the test on a non-zero exit.

    With ``teardown_abort_ok``, a world whose only failure is that teardown abort (no
    Python traceback in any rank) passes: the caller then checks every output file.
    """
    exe = BIN / "torchrun"
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    teardown_only = (
        TEARDOWN_ABORT in res.stderr and "(SIGABRT)" in res.stderr and "]: Traceback" not in res.stderr
    )
    ok = res.returncode == 0 or (teardown_abort_ok and teardown_only)
    assert ok, f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return res


def reshard_exe() -> list[str]:
    exe = BIN / "reshard"
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from reshard.cli import main; main()"]


def reshard(*args: str | Path, code: int = 0) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [*reshard_exe(), *map(str, args)], capture_output=True, text=True, timeout=TIMEOUT, env=_env()
    )
    assert res.returncode == code, f"reshard {' '.join(map(str, args))} -> {res.returncode}:\n{res.stderr}"
    return res


def assert_same_dirs(got: Path, want: Path) -> None:
    """Same file names, every file byte for byte (reshard.json and the hf index included)."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


# --------------------------------------------------------------------------- save_dtensors


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("save_world")
    torchrun(S.WORLD, SCRIPTS / "save_world.py", out)
    return out / "ckpt"


WANT_PLACEMENTS = S.SAVED_PLACEMENTS


def test_save_dtensors_writes_a_checked_self_describing_checkpoint(saved: Path) -> None:
    world = S.WORLD
    assert sorted(p.name for p in saved.iterdir()) == [rank_file(r, world) for r in range(world)] + [
        "reshard.json"
    ]
    doc = json.loads(reshard("inspect", saved, "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == "per-rank"
    assert doc["mesh"] == {"names": list(S.MESH_NAMES), "shape": list(S.MESH_SHAPE)}
    assert {t["name"]: t["placements"] for t in doc["tensors"]} == WANT_PLACEMENTS

    manifest = json.loads((saved / "reshard.json").read_text())
    assert manifest["format"] == "per-rank"
    assert manifest["reshard"]["format_version"] == 1
    assert manifest["mesh"] == doc["mesh"]
    full = S.full_tensors()
    assert manifest["tensors"]["b.s1"] == {"dtype": "BF16", "shape": [4, 5], "placements": ["R", "S(1)"]}
    assert {n: t["placements"] for n, t in manifest["tensors"].items()} == WANT_PLACEMENTS
    shapes = {n: list(t.shape) for n, t in full.items()}
    assert {n: t["shape"] for n, t in manifest["tensors"].items()} == shapes
    assert list(manifest["files"]) == [rank_file(r, world) for r in range(world)]
    for name, info in manifest["files"].items():
        assert info == {"size": (saved / name).stat().st_size, "checksum": file_checksum(saved / name)}

    mesh = Mesh(S.MESH_NAMES, S.MESH_SHAPE)
    for r, coord in enumerate(mesh.coordinates()):
        with safe_open(str(saved / rank_file(r, world)), "pt") as f:
            meta = json.loads(f.metadata()["reshard"])
        assert meta["format_version"] == 2 and meta["rank"] == r and meta["coordinate"] == list(coord)
        assert meta["mesh"] == doc["mesh"]
        # every local tensor is what torch's own placement splitting gives this coordinate
        got = load_file(str(saved / rank_file(r, world)))
        for name, texts in WANT_PLACEMENTS.items():
            if name == "g.partial":
                continue
            lay = TensorLayout.make(tuple(full[name].shape), mesh, texts)
            pls = torch_placements(lay.placements, full[name].ndim)
            want = torch_local(full[name], mesh.shape, coord, pls)
            assert same_bits(got[name], want), f"rank {r} {name}"


def test_save_dtensors_consolidates_to_the_full_tensors(saved: Path, tmp_path: Path) -> None:
    reshard("convert", saved, tmp_path / "hf", "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    full = S.full_tensors()
    assert sorted(got) == sorted(full)
    for name, t in full.items():  # g.partial: the sum of the two fsdp partials
        assert same_bits(got[name], t), name


# --------------------------------------------------------------------------- load_dtensors


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A consolidated model.safetensors (in its own directory) and the tp=4 layout next to it."""
    root = tmp_path_factory.mktemp("model")
    (root / "hf").mkdir()
    save_file(L.full_tensors(), str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (root / "tp4.yaml").write_text(L.LAYOUT_YAML)
    return root


@pytest.fixture(scope="module")
def loaded(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("load_world")
    # the ranks compare with distribute_tensor themselves and exit 1 on any difference
    torchrun(L.WORLD, SCRIPTS / "load_world.py", model / "hf" / "model.safetensors", model / "tp4.yaml", out)
    return out


def test_load_dtensors_matches_distribute_tensor(loaded: Path) -> None:
    assert (loaded / "saved" / "reshard.json").is_file()


def test_saving_loaded_dtensors_equals_reshard_convert(loaded: Path, model: Path, tmp_path: Path) -> None:
    """save_dtensors writes the very rank files `reshard convert --target-layout` writes."""
    reshard("convert", model / "hf", tmp_path / "tp4", "--target-layout", model / "tp4.yaml", "--quiet")
    for r in range(L.WORLD):
        name = rank_file(r, L.WORLD)
        assert (loaded / "saved" / name).read_bytes() == (tmp_path / "tp4" / name).read_bytes(), name
    reshard("inspect", loaded / "saved", "--check", "--json")


# --------------------------------------------------------------------------- convert under torchrun


@pytest.fixture(scope="module")
def tp2(model: Path) -> Path:
    """A self-describing per-rank tp=2 checkpoint, written by a one-process conversion."""
    src = model / "tp2"
    reshard(
        "convert",
        model / "hf",
        src,
        "--target-layout",
        model / "tp4.yaml",
        "--target-mesh",
        "tp=2",
        "--quiet",
    )
    return src


def test_convert_under_torchrun_equals_one_process(tp2: Path, tmp_path: Path) -> None:
    reshard("convert", tp2, tmp_path / "single", "--target-mesh", "tp=4", "--quiet")
    # the console script itself (`torchrun -m reshard.cli` would import the module and do nothing)
    torchrun(
        2,
        *reshard_exe(),
        "convert",
        tp2,
        tmp_path / "dist",
        "--target-mesh",
        "tp=4",
        "--quiet",
        teardown_abort_ok=True,
    )
    assert_same_dirs(tmp_path / "dist", tmp_path / "single")
    reshard("verify", tmp_path / "dist", tp2)


def test_convert_under_torchrun_shares_the_files(tp2: Path, tmp_path: Path) -> None:
    """Each rank writes its share (balanced by bytes), none twice; rank 0 the index and manifest."""
    args = ("convert", tp2, "--consolidate", "--max-shard-size", "150B", "--quiet")
    reshard(args[0], args[1], tmp_path / "single", *args[2:])
    log = tmp_path / "log"
    log.mkdir()
    torchrun(2, SCRIPTS / "convert_shares.py", log, args[0], args[1], tmp_path / "dist", *args[2:])
    assert_same_dirs(tmp_path / "dist", tmp_path / "single")

    files = json.loads((tmp_path / "single" / "reshard.json").read_text())["files"]
    names = list(files)
    assert len(names) >= 3 and (tmp_path / "dist" / "model.safetensors.index.json").is_file()
    shares = share_by_bytes([files[n]["size"] for n in names], 2)
    for r in range(2):
        written = (log / f"rank-{r}.txt").read_text(encoding="utf-8").split()
        assert written and sorted(written) == sorted(names[i] for i in shares[r])


def test_save_dtensors_without_torchrun_writes_a_one_rank_checkpoint(tmp_path: Path) -> None:
    """Outside torchrun (no process group) plain tensors make a world=1 checkpoint."""
    from reshard import save_dtensors

    full = L.full_tensors()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / rank_file(0, 2)).write_bytes(b"stale")  # another world's file: removed
    save_dtensors(full, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [rank_file(0, 1), "reshard.json"]
    doc = json.loads(reshard("inspect", tmp_path / "ckpt", "--check", "--json").stdout)
    assert doc["ok"] is True and doc["mesh"] == {"names": ["world"], "shape": [1]}
    got = load_file(str(tmp_path / "ckpt" / rank_file(0, 1)))
    assert sorted(got) == sorted(full) and all(same_bits(got[n], t) for n, t in full.items())
    with pytest.raises(UsageError, match=r'"step" \(int\) is not a tensor'):
        save_dtensors({"w": full["w.s0"], "step": 3}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- sharded-state


def test_load_dtensors_reads_sharded_state(model: Path, tmp_path: Path) -> None:
    """vLLM-named files with ``source_layout=``, and reshard's own sharded-state output without a layout."""
    mesh = Mesh(("tp",), (L.WORLD,))
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    full, pls = L.full_tensors(), L.placements()
    for r, coord in enumerate(mesh.coordinates()):
        local = {name: torch_local(t, mesh.shape, coord, pls[name]).clone() for name, t in full.items()}
        names = sorted(local)  # two parts per rank, as vLLM's max_size would split them
        save_file({n: local[n] for n in names[:4]}, str(vllm / f"model-rank-{r}-part-0.safetensors"))
        save_file({n: local[n] for n in names[4:]}, str(vllm / f"model-rank-{r}-part-1.safetensors"))
    reshard(
        "convert",
        model / "hf",
        tmp_path / "ss",
        "--to",
        "sharded-state",
        "--target-layout",
        model / "tp4.yaml",
        "--quiet",
    )
    torchrun(L.WORLD, SCRIPTS / "load_sharded_state.py", vllm, tmp_path / "ss", model / "tp4.yaml")


# --------------------------------------------------------------------------- load_dtensors with Own


def test_load_dtensors_gives_each_rank_the_tensors_it_owns(tmp_path: Path) -> None:
    """Own(expert) layouts: each rank gets exactly its experts, bit for bit (checked in the ranks
    against the full tensors and distribute_tensor on the fsdp sub-mesh), from a consolidated
    file and from the per-rank files `reshard convert` writes for the same layout."""
    from tests.dist.torchrun_scripts import load_owned as O

    (tmp_path / "hf").mkdir()
    save_file(O.full_tensors(), str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "ep.yaml").write_text(O.EP_YAML)
    (tmp_path / "ep_fsdp.yaml").write_text(O.EP_FSDP_YAML)
    reshard("convert", tmp_path / "hf", tmp_path / "ep4", "--target-layout", tmp_path / "ep.yaml", "--quiet")
    # rank 1's file: experts 1 (w1) and 2, 3 (w2, as local 0, 1) only
    assert sorted(load_file(str(tmp_path / "ep4" / rank_file(1, 4)))) == [
        "layers.0.experts.0.w2.weight",
        "layers.0.experts.1.w1.weight",
        "layers.0.experts.1.w2.weight",
        "layers.0.router.weight",
    ]
    torchrun(
        O.WORLD,
        SCRIPTS / "load_owned.py",
        tmp_path / "hf" / "model.safetensors",
        tmp_path / "ep4",
        tmp_path / "ep.yaml",
        tmp_path / "ep_fsdp.yaml",
    )
