"""Megatron-Core ``torch_dist`` checkpoints written by Megatron-Core itself, read by reshard.

``dcp_helpers/save_megatron.py`` saves, once per module, in a 4-rank gloo world (tp=2 x dp=2),
the sharded state dicts Megatron's own helpers make (stacked layers, SwiGLU, experts, the
distributed optimizer's ``dp_reshardable`` buckets, byte items, ``common.pt``) four ways: the
default strategy, a separation hint (``decoder.layers.mlp__{r}_{k}.distcp`` files), the
fully-parallel wrapper and the async request. Oracles: the tensors Megatron's own
``load_plain_tensors`` gives back, torch's ``dcp_to_torch_save``, and the full tensors the
ranks were cut from. Skipped without ``megatron-core`` (``pip install megatron-core``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from reshard.formats import detect_format, open_checkpoint

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (pip install megatron-core)", allow_module_level=True)

HERE = Path(__file__).resolve().parent
HELPER = HERE / "dcp_helpers" / "save_megatron.py"
RESHARD = Path(sys.executable).with_name("reshard")
MODES = ("plain", "hint", "fully_parallel", "async")
STACKED = "decoder.layers.self_attention.linear_qkv.weight"
EXPERTS = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
LAYOUT = """\
mesh: {tp: 2}
placements:
  "decoder.layers.self_attention.linear_qkv.weight": {tp: S(1)}
  "decoder.layers.self_attention.linear_proj.weight": {tp: S(2)}
  "decoder.layers.mlp.linear_fc2.weight": {tp: S(2)}
  "decoder.layers.mlp.experts.experts.*": {tp: S(1)}
  "embedding.word_embeddings.weight": {tp: S(0)}
  "output_layer.weight": {tp: S(0)}
  "*": R
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(root)], capture_output=True, text=True, timeout=300, env=env
    )
    errors = "".join(p.read_text() for p in root.glob("error-*.txt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + errors
    return root


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def raw(t: Any) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), k
        assert raw(g) == raw(w), k


def megatron_load(saved: Path, mode: str) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(saved / f"{mode}.mcore.pt", weights_only=True)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("mode", MODES)
def test_consolidate_bit_exact(saved: Path, tmp_path: Path, mode: str) -> None:
    src = saved / mode
    assert detect_format(src) == "dcp"
    out = tmp_path / "hf"
    proc = run_cli("convert", src, out, "--consolidate", "--verify", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    got = st.load_file(str(out / "model.safetensors"))
    want = megatron_load(saved, mode)
    assert len(want) == 14
    assert_same(got, want)  # what Megatron's own load_plain_tensors gives
    full: dict[str, Any] = torch.load(saved / "full.pt", weights_only=True)
    assert_same(got, full)  # and the tensors the ranks were cut from
    # byte items (TE extra state, the optimizer's per_bucket_numel) are listed, not converted
    assert {n["name"].split("/")[0] for n in doc["not_converted"]} == {
        "decoder.layers.self_attention.core_attention._extra_state",
        "optimizer.distributed.dp_group_idx_0.per_bucket_numel",
        "optimizer.distributed.dp_group_idx_1.per_bucket_numel",
    }
    assert any("common.pt" in w and "not converted" in w for w in doc["warnings"]), doc["warnings"]
    proc = run_cli("inspect", src, "--check")
    assert proc.returncode == 0, proc.stderr
    assert "check: ok" in proc.stderr


@pytest.mark.dist
def test_torch_reads_them_alike(saved: Path, tmp_path: Path) -> None:
    """torch's own dcp_to_torch_save of Megatron's checkpoint gives the same tensors as reshard."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for mode in ("plain", "hint"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(saved / mode, tmp_path / f"{mode}.pt")
        by_torch = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
        ck = open_checkpoint(saved / mode)
        assert_same({k: v for k, v in by_torch.items() if k in ck.tensors}, megatron_load(saved, mode))
        assert set(by_torch) == set(ck.tensors) | {n.name for n in ck.non_tensors}


@pytest.mark.dist
def test_boxes_as_megatron_writes_them(saved: Path) -> None:
    ck = open_checkpoint(saved / "plain")
    assert ck.format == "dcp"
    # stacked layers: [L, out, in], one box per layer and TP rank, offsets and sizes of rank 3
    qkv = ck.tensors[STACKED]
    assert (qkv.shape, qkv.dtype, len(qkv.piece_blocks)) == ((2, 12, 8), "F32", 4)
    # experts on two prepended axes: one [1, 1, 2F, H] box per layer and expert
    fc1 = ck.tensors[EXPERTS]
    assert (fc1.shape, fc1.dtype, len(fc1.piece_blocks)) == ((2, 4, 12, 8), "BF16", 8)
    # SwiGLU [gate; up]: two boxes per layer and TP rank
    assert len(ck.tensors["decoder.layers.mlp.linear_fc1.weight"].piece_blocks) == 8
    # dp_reshardable optimizer bucket: irregular 1-D spans, padding included, several a rank
    spans = sorted((b[0][0].start, b[0][0].stop) for b in ck.tensors[f"{BUCKET}.exp_avg"].piece_blocks)
    assert spans == [(0, 5), (5, 6), (6, 11), (11, 14), (14, 20), (20, 25)]
    # the uneven grid's empty last chunk
    assert ck.tensors["uneven"].shape == (7, 3)


@pytest.mark.dist
def test_separation_hint_file_names(saved: Path) -> None:
    """The async writer's separation hint writes {group}__{r}_{k}.distcp; .metadata names them."""
    ck = open_checkpoint(saved / "hint")
    names = {Path(f).name for f in ck.files}
    assert names >= {f"decoder.layers.mlp__{r}_1.distcp" for r in range(3)}, names
    for name, t in ck.tensors.items():
        files = {Path(ck.files[i]).name for i in t.piece_files}
        assert all(f.startswith("decoder.layers.mlp__") for f in files) == name.startswith(
            "decoder.layers.mlp"
        ), (name, files)
    proc = run_cli("plan", saved / "hint", "--consolidate", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "decoder.layers.mlp__0_1.distcp" in proc.stdout


@pytest.mark.dist
@pytest.mark.parametrize("to", ["per-rank", "dcp"])
def test_target_mesh(saved: Path, tmp_path: Path, to: str) -> None:
    layout = tmp_path / "meg-tp.yaml"
    layout.write_text(LAYOUT)
    out = tmp_path / "tp4"
    args = ["convert", saved / "fully_parallel", out, "--target-layout", layout, "--target-mesh", "tp=4"]
    proc = run_cli(*args, "--to", to, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert detect_format(out) == to
    got = open_checkpoint(out)
    # the four ranks' files; to dcp, one more with Megatron's byte items, copied as they are
    assert len(got.files) == 4 + (to == "dcp")
    if to == "dcp":
        src = open_checkpoint(saved / "fully_parallel")
        assert {n.name for n in got.non_tensors} == {n.name for n in src.non_tensors} != set()
    proc = run_cli("verify", saved / "plain", out)  # another writer's checkpoint of the same tensors
    assert proc.returncode == 0, proc.stderr
    if to == "dcp":  # torch reads reshard's output back to Megatron's tensors
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(out, tmp_path / "back.pt")
        # (the test's own file; its byte items are Megatron's objects, loaded by torch as such)
        back = torch.load(tmp_path / "back.pt", weights_only=False)
        assert {k for k, v in back.items() if not isinstance(v, torch.Tensor)} == {
            n.name for n in got.non_tensors
        }
        tensors = {k: v for k, v in back.items() if isinstance(v, torch.Tensor)}
        assert_same(tensors, megatron_load(saved, "plain"))


@pytest.mark.dist
def test_metadata_classes_allowed_by_name(saved: Path, tmp_path: Path) -> None:
    """Megatron's .metadata carries every rank's save plan (all_local_plans: torch's planner
    data classes, allowed by name); another planner class in its place is refused, exit 2."""
    data = (saved / "plain" / ".metadata").read_bytes()
    for name in (b"SavePlan", b"WriteItem", b"WriteItemType", b"TensorWriteData"):
        assert name in data
    ck = tmp_path / "ck"
    shutil.copytree(saved / "plain", ck)
    assert data.count(b"\x8c\x08SavePlan") == 1
    (ck / ".metadata").write_bytes(data.replace(b"\x8c\x08SavePlan", b"\x8c\x08LoadPlan"))
    for cmd in (["inspect", ck], ["convert", ck, tmp_path / "out", "--consolidate"]):
        proc = run_cli(*cmd)
        assert proc.returncode == 2, proc.stderr
        err = proc.stderr.replace("\n", " ")
        assert ".metadata" in err and "torch.distributed.checkpoint.planner.LoadPlan" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
@pytest.mark.parametrize("mode", MODES)
def test_metadata_read_by_the_fast_decoder(saved: Path, mode: str) -> None:
    """The save plans are checked and dropped by reshard's own pickle machine (bounded memory:
    tests/io/test_dcp_fast.py), which reads the .metadata as the C unpickler reads it; a byte set
    anywhere in the plans reads as the C unpickler reads it (the same values, or both refuse)."""
    from reshard.errors import HeaderError
    from reshard.io.unpickle import _MetaDecoder, _reference_metadata, load_dcp_metadata

    def values(read: Any, data: bytes) -> Any:
        try:
            md = read(data)
        except HeaderError:
            return "refused"
        return (list(md.entries.items()), list(md.storage), md.version, md.megatron)

    data = (saved / mode / ".metadata").read_bytes()
    fast = _MetaDecoder(data, "m").decode()
    assert fast.decoder == "fast" and fast.entries[STACKED]
    want = values(lambda d: _reference_metadata(d, "m"), data)
    assert values(lambda d: _MetaDecoder(d, "m").decode(), data) == want
    start = data.index(b"all_local_plans")
    for i in range(start, len(data), max(1, (len(data) - start) // 300)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        got = values(lambda d: load_dcp_metadata(d, path="m"), bytes(bad))
        assert got == values(lambda d: _reference_metadata(d, "m"), bytes(bad)), i
