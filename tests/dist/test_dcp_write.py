"""`reshard convert ... --to dcp` as a user runs it, judged by torch itself.

Oracles:
- torch's own ``dcp.save`` in a 4-rank gloo world (``dcp_helpers/dcp_write_world.py``):
  the CLI's ``.distcp`` files equal torch's byte for byte, its ``.metadata`` unpickles
  to the same tensors, chunks and storage entries;
- gloo worlds ``dcp.load`` the CLI's output into DTensors on other meshes and
  placements, and ``dcp_to_torch_save`` consolidates it, bit for bit equal to the source;
- a layout DCP cannot express exits 2 and writes nothing; a write killed mid-way
  leaves no ``.metadata``; ``--resume`` then completes byte-identically.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from reshard import formats
from reshard.io.checksum import file_checksum

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
st = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).resolve().parent / "dcp_helpers"))
import dcp_write_world as W  # noqa: E402

pytestmark = pytest.mark.dist

RESHARD = str(Path(sys.executable).with_name("reshard"))
HELPER = Path(W.__file__)

SHAPES: dict[str, tuple[tuple[int, ...], Any]] = {
    "lm_head.weight": ((12, 8), "bfloat16"),
    "model.embed_tokens.weight": ((16, 8), "bfloat16"),
    "model.layers.0.input_layernorm.weight": ((8,), "float32"),
    "model.layers.0.mlp.down_proj.weight": ((8, 12), "bfloat16"),
    "model.layers.0.mlp.up_proj.weight": ((12, 8), "float16"),
    "model.layers.0.self_attn.k_proj.weight": ((6, 8), "bfloat16"),  # tp=4: 2, 2, 2, 0 rows
    "model.layers.0.self_attn.o_proj.weight": ((8, 8), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), "bfloat16"),
    "model.norm.weight": ((8,), "bfloat16"),
    "step": ((), "float64"),
}


def run(*args: str, fsize_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``reshard`` script; ``fsize_limit``: writes past it fail (EFBIG)."""

    def limit() -> None:
        if fsize_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run(
        [RESHARD, *args], capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit
    )


def run_helper(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0, p.stdout + p.stderr


def full_tensors() -> dict[str, Any]:
    return {n: W.full_tensor(shape, dt, i) for i, (n, (shape, dt)) in enumerate(SHAPES.items())}


def same(a: Any, b: Any) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An hf checkpoint, its full tensors as a torch.save file, and a TP-2 per-rank copy."""
    root = tmp_path_factory.mktemp("dcp_sources")
    full = full_tensors()
    (root / "hf").mkdir()
    st.save_file(full, str(root / "hf" / "model.safetensors"))
    torch.save(full, root / "full.pt")
    p = run(
        "convert", str(root / "hf"), str(root / "tp2"), "--target-layout", "llama-tp", "--target-mesh", "tp=2"
    )
    assert p.returncode == 0, p.stderr
    return {"hf": root / "hf", "per-rank": root / "tp2", "full": root / "full.pt"}


def load_in_world(
    ckpt: Path, full: Path, mesh: list[int], pls2d: list[str], pls1d: list[str], out: Path
) -> None:
    """A gloo world of ``prod(mesh)`` ranks ``dcp.load``s ``ckpt`` into DTensors; every shard exact."""
    spec: dict[str, Any] = {"mesh": mesh, "full": str(full), "placements": {}}
    for name, (shape, _) in SHAPES.items():
        spec["placements"][name] = None if not shape else pls2d if len(shape) == 2 else pls1d
    out.mkdir()
    (out / "spec.json").write_text(json.dumps(spec))
    run_helper("load", str(ckpt), str(out / "spec.json"), str(out / "verdicts"))
    world = 1
    for s in mesh:
        world *= s
    for rank in range(world):
        verdict = json.loads((out / "verdicts" / f"load-{rank}.json").read_text())
        assert verdict["ok"], verdict
        assert verdict["checked"] == sorted(SHAPES)


def consolidated_by_torch(ckpt: Path, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(ckpt), str(tmp / "consolidated.pt"))
    return dict(torch.load(tmp / "consolidated.pt", weights_only=True))


def chunk_boxes(ckpt: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    return {
        n: [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks] for n, m in md.state_dict_metadata.items()
    }


# --------------------------------------------------------------------------- torch's own dcp.save


def test_cli_output_equals_torchs_own_dcp_save(tmp_path: Path) -> None:
    """hf -> dcp on torch's (dp=2, tp=2) mesh with FSDP2+TP, Shard, Replicate and plain tensors."""
    run_helper("save", str(tmp_path / "torch"))
    theirs_dir = tmp_path / "torch" / "ckpt"
    full = torch.load(tmp_path / "torch" / "full.pt", weights_only=True)
    (tmp_path / "hf").mkdir()
    st.save_file(full, str(tmp_path / "hf" / "model.safetensors"))
    rules = "".join(
        f'  "{n}": [{", ".join(f"{p!r}" for p in (pls or ["R", "R"]))}]\n'
        for n, (_, _, pls) in W.CASES.items()
    )
    (tmp_path / "l.yaml").write_text("mesh: {dp: 2, tp: 2}\nplacements:\n" + rules)
    out = tmp_path / "ours"
    p = run(
        "convert", str(tmp_path / "hf"), str(out), "--to", "dcp", "--target-layout", str(tmp_path / "l.yaml")
    )
    assert p.returncode == 0, p.stderr
    for rank in range(4):
        name = f"__{rank}_0.distcp"
        assert (out / name).read_bytes() == (theirs_dir / name).read_bytes(), name
    ours = pickle.loads((out / ".metadata").read_bytes())
    theirs = pickle.loads((theirs_dir / ".metadata").read_bytes())
    assert list(ours.state_dict_metadata.items()) == list(theirs.state_dict_metadata.items())
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert [(i.fqn, tuple(i.offset), i.index, v) for i, v in ours.storage_data.items()] == [
        (i.fqn, tuple(i.offset), i.index, v) for i, v in theirs.storage_data.items()
    ]
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["format"] == "dcp"
    assert sorted(manifest["files"]) == [f"__{r}_0.distcp" for r in range(4)]
    for name, info in manifest["files"].items():
        assert info["checksum"] == file_checksum(out / name)


# --------------------------------------------------------------------------- torch reads ours


@pytest.mark.parametrize("src", ["hf", "per-rank"])
def test_no_layout_one_chunk_per_tensor_split_files(
    sources: dict[str, Path], tmp_path: Path, src: str
) -> None:
    out = tmp_path / "dcp"
    p = run("convert", str(sources[src]), str(out), "--to", "dcp", "--max-shard-size", "2000", "--json")
    assert p.returncode == 0, p.stderr
    names = sorted(n.name for n in out.iterdir())
    distcp = [n for n in names if n.endswith(".distcp")]
    assert len(distcp) > 3 and all(n.startswith("__0_") for n in distcp)
    assert names == sorted([".metadata", "reshard.json", *distcp])
    for name, boxes in chunk_boxes(out).items():
        shape = SHAPES[name][0]
        assert boxes == [((0,) * len(shape), shape)], name
    full = torch.load(sources["full"], weights_only=True)
    got = consolidated_by_torch(out, tmp_path)
    assert set(got) == set(full) and all(same(got[n], full[n]) for n in full)
    if src == "hf":
        load_in_world(out, sources["full"], [2, 2], ["S(0)", "S(1)"], ["R", "S(0)"], tmp_path / "load")
        # one file, three threads: each writes a run of its chunks, trailers included
        one = tmp_path / "one"
        p = run("convert", str(sources[src]), str(one), "--to", "dcp", "--workers", "3", "--max-memory=96KiB")
        assert p.returncode == 0, p.stderr
        assert sorted(n.name for n in one.glob("*.distcp")) == ["__0_0.distcp"]
        assert (one / "__0_0.distcp").read_bytes() == b"".join(
            (out / n).read_bytes() for n in sorted(distcp, key=lambda n: int(n[4:-7]))
        )


@pytest.mark.parametrize("src", ["hf", "per-rank"])
def test_tp4_s0_loaded_on_2x2_with_s1(sources: dict[str, Path], tmp_path: Path, src: str) -> None:
    lay = tmp_path / "tp4.yaml"
    lay.write_text('mesh: {tp: 4}\nplacements:\n  "step": R\n  "*": {tp: S(0)}\n')
    out = tmp_path / "dcp"
    p = run("convert", str(sources[src]), str(out), "--to", "dcp", "--target-layout", str(lay))
    assert p.returncode == 0, p.stderr
    assert sorted(n.name for n in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    boxes = chunk_boxes(out)
    assert boxes["model.layers.0.self_attn.k_proj.weight"] == [
        ((0, 0), (2, 8)),
        ((2, 0), (2, 8)),
        ((4, 0), (2, 8)),
        ((6, 0), (0, 8)),  # an empty shard, as torch
    ]
    assert boxes["step"] == [((), ())]  # replicated: stored once
    load_in_world(out, sources["full"], [2, 2], ["R", "S(1)"], ["S(0)", "R"], tmp_path / "load")
    full = torch.load(sources["full"], weights_only=True)
    got = consolidated_by_torch(out, tmp_path)
    assert set(got) == set(full) and all(same(got[n], full[n]) for n in full)


@pytest.mark.parametrize("src", ["hf", "per-rank"])
def test_fsdp_tp_preset_loaded_on_tp4(sources: dict[str, Path], tmp_path: Path, src: str) -> None:
    out = tmp_path / "dcp"
    args = ["--to", "dcp", "--target-layout", "llama-fsdp-tp", "--target-mesh", "fsdp=2,tp=2"]
    p = run("convert", str(sources[src]), str(out), *args)
    assert p.returncode == 0, p.stderr
    # column-parallel: _StridedShard(0, 2) x Shard(0) leaves every rank one box of 3 rows of 12
    assert chunk_boxes(out)["model.layers.0.mlp.up_proj.weight"] == [
        ((0, 0), (3, 8)),
        ((6, 0), (3, 8)),
        ((3, 0), (3, 8)),
        ((9, 0), (3, 8)),
    ]
    load_in_world(out, sources["full"], [4], ["S(1)"], ["S(0)"], tmp_path / "load")


# --------------------------------------------------------------------------- refusals, interruptions


def test_layout_dcp_cannot_express_exits_2_and_writes_nothing(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    lay = tmp_path / "strided.yaml"
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "*.up_proj.weight": {tp: "_S(0, 2)"}\n  "*": R\n')
    out = tmp_path / "dcp"
    p = run("convert", str(sources["hf"]), str(out), "--to", "dcp", "--target-layout", str(lay))
    assert p.returncode == 2, p.stderr
    assert "model.layers.0.mlp.up_proj.weight" in p.stderr and "not one box" in p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_write_failure_exits_3_and_leaves_nothing(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    p = run(
        "convert",
        str(sources["hf"]),
        str(out),
        "--to",
        "dcp",
        "--target-mesh",
        "tp=4",
        "--target-layout",
        "llama-tp",
        fsize_limit=2000,
    )
    assert p.returncode == 3, p.stderr
    assert not out.exists() or not any(out.iterdir())


def test_killed_write_never_looks_finished_and_resume_completes(tmp_path: Path) -> None:
    """SIGKILL while the data files are written: no ``.metadata`` (torch) nor ``reshard.json``."""
    src = tmp_path / "hf"
    src.mkdir()
    big = {"big.weight": torch.arange(2048 * 4096, dtype=torch.float32).reshape(2048, 4096), **full_tensors()}
    st.save_file(big, str(src / "model.safetensors"))
    lay = tmp_path / "tp4.yaml"
    lay.write_text('mesh: {tp: 4}\nplacements:\n  "big.weight": {tp: S(1)}\n  "*": R\n')
    target = ["--to", "dcp", "--target-layout", str(lay), "--workers", "1", "--max-memory", "1MiB"]
    ref = tmp_path / "ref"
    assert run("convert", str(src), str(ref), *target).returncode == 0
    out = tmp_path / "out"
    # a finished checkpoint of something else is there; the new write is killed mid-way
    assert run("convert", str(src), str(out), "--to", "dcp").returncode == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if not n.startswith(".reshard")}
    assert ".metadata" in before
    proc = subprocess.Popen([RESHARD, "convert", str(src), str(out), *target, "--overwrite"])
    staging = out / ".reshard-staging"
    while proc.poll() is None and not list(staging.glob("*.tmp")) and not list(staging.glob("*.distcp")):
        pass
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the conversion finished before it could be killed"
    # the killed write never shows: DST still holds the previous, complete checkpoint
    after = {n: (out / n).read_bytes() for n in os.listdir(out) if not n.startswith(".reshard")}
    assert after == before
    got = {"step": torch.zeros((), dtype=torch.float64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(out), no_dist=True)
    # the new .metadata never appeared half-way: resume finishes byte-identical to a clean run
    p = run("convert", str(src), str(out), *target, "--resume", "--json")
    assert p.returncode == 0, p.stderr
    names = sorted(n for n in os.listdir(out) if not n.startswith(".reshard"))
    assert names == sorted(os.listdir(ref))
    for n in os.listdir(ref):
        assert (out / n).read_bytes() == (ref / n).read_bytes(), n


def test_copy_path_never_imports_torch(sources: dict[str, Path], tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from reshard.cli import app\n"
        f"sys.argv = ['reshard', 'convert', {str(sources['hf'])!r}, {str(tmp_path / 'o')!r}, '--to', 'dcp',"
        " '--target-layout', 'llama-fsdp-tp', '--target-mesh', 'fsdp=2,tp=2', '--quiet']\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "o" / ".metadata").exists()


@pytest.mark.skipif("dcp" not in {r.name for r in formats.readers()}, reason="needs the DCP reader")
def test_verify_against_source(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    args = ["--to", "dcp", "--target-layout", "llama-fsdp-tp", "--target-mesh", "fsdp=2,tp=2"]
    assert run("convert", str(sources["hf"]), str(out), *args).returncode == 0
    p = run("verify", str(sources["hf"]), str(out))
    assert p.returncode == 0, p.stdout + p.stderr
