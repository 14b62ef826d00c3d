"""dcp-safetensors: files written by torch's own HuggingFaceStorageWriter in a real gloo world.

One 4-rank CPU world (``dcp_helpers/save_world.py``, mesh dp=2 x tp=2) saves
DTensors with uneven ``Shard(0)``, nested ``[S(0), S(0)]`` with an empty chunk,
``Shard(1)``, ``Replicate``, ``[Shard(0), Shard(1)]``, FSDP2-over-TP
``[_StridedShard(0, 2), Shard(0)]``, a 3-d f16, an int64 and a plain 0-d tensor,
once into one file per rank and once into two. The tests read those files back
through reshard (library and CLI) and compare with the full tensors, each rank's
``to_local()``, and torch's own ``consolidate_safetensors_files``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.errors import HeaderError, LayoutError, PlanError
from reshard.formats import detect_format, open_checkpoint
from reshard.intervals import Interval, normalize, overlapping_pairs

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
safe_open = pytest.importorskip("safetensors").safe_open

HERE = Path(__file__).resolve().parent
HELPER = HERE / "dcp_helpers" / "save_world.py"
RESHARD = Path(sys.executable).with_name("reshard")
WORLD = 4

LAYOUT = """\
mesh: {dp: 2, tp: 2}
placements:
  "w.uneven": {tp: S(0)}
  "w.nested_empty": [S(0), S(0)]
  "w.shard1": {tp: S(1)}
  "w.2d": {dp: S(0), tp: S(1)}
  "w.fsdp_tp": {dp: "_S(0, tp)", tp: S(0)}
  "w.int": {dp: S(0)}
  "w.f16_3d": {dp: S(2), tp: S(0)}
  "*": R
"""


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the 4-rank gloo world once; its outputs are shared by the tests below."""
    root = tmp_path_factory.mktemp("dcp_world")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(root)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def _bytes(t: Any) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_bit_equal(got: Any, want: Any, what: str) -> None:
    assert got.dtype == want.dtype, what
    assert tuple(got.shape) == tuple(want.shape), what
    assert _bytes(got) == _bytes(want), what


def full(world: Path) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(world / "full.pt", weights_only=True)
    return out


def rewrite(path: Path, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file after ``edit(tensors, sharding_info)`` changed them."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["DCP_SHARDING_INFO"])
    edit(tensors, info)
    meta["DCP_SHARDING_INFO"] = json.dumps(info)
    st.save_file(tensors, str(path), metadata=meta)


def file_holding(ckpt: Path, name: str, offsets: list[int]) -> Path:
    """The shard file holding ``name``'s chunk at ``offsets``."""
    for p in sorted(ckpt.glob("shard-*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        if info.get(name, {}).get("saved_offsets") == offsets:
            return p
    raise AssertionError(f"no chunk of {name} at {offsets}")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *args], capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------- torch's files


@pytest.mark.dist
def test_torch_writes_saved_offsets_only(world: Path) -> None:
    """What HuggingFaceStorageWriter(save_distributed=True) puts in each file's metadata."""
    names = sorted(p.name for p in (world / "ckpt").iterdir())
    assert names == [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in range(1, 5)]
    with safe_open(str(world / "ckpt" / names[3]), framework="pt") as f:
        meta = f.metadata()
    assert set(meta) == {"DCP_SHARDING_INFO", "DCP_VERSION", "format"}
    assert meta["DCP_VERSION"] == "1.0"
    info = json.loads(meta["DCP_SHARDING_INFO"])
    # the empty chunk of the last rank sits at the global size of its sharded dim
    assert info["w.nested_empty"] == {"saved_offsets": [3, 0]}
    assert info["step"] == {"saved_offsets": []}
    assert len(list((world / "ckpt_multi").iterdir())) == 2 * WORLD


@pytest.mark.dist
@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_multi"])
def test_open_detects_and_derives_shapes(world: Path, ckpt: str) -> None:
    path = world / ckpt
    assert detect_format(path) == "dcp-safetensors"
    ck = open_checkpoint(path)
    assert ck.format == "dcp-safetensors"
    assert ck.warnings == []
    assert len(ck.files) == (WORLD if ckpt == "ckpt" else 2 * WORLD)
    want = full(world)
    dtypes = {
        torch.float32: "F32",
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.int64: "I64",
        torch.float64: "F64",
    }
    assert sorted(ck.tensors) == sorted(want)
    for name, t in want.items():
        src = ck.tensors[name]
        assert src.shape == tuple(t.shape), name
        assert src.dtype == dtypes[t.dtype], name
    # replicated tensors are stored once (DCP dedups them); sharded ones once per chunk
    assert len(ck.tensors["w.rep"].piece_blocks) == 1
    assert len(ck.tensors["step"].piece_blocks) == 1
    assert len(ck.tensors["w.2d"].piece_blocks) == 4
    # the FSDP2-over-TP chunks are contiguous rows, recorded right
    rows = sorted(b[0] for b in ck.tensors["w.fsdp_tp"].piece_blocks)
    assert rows == [(Interval(i, i + 2),) for i in (0, 2, 4, 6)]


@pytest.mark.dist
@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_multi"])
def test_consolidate_bit_equal_to_full(world: Path, tmp_path: Path, ckpt: str) -> None:
    out = tmp_path / "hf"
    result = convert(SourceSpec(str(world / ckpt)), out, TargetSpec(consolidate=True))
    assert result["source"]["format"] == "dcp-safetensors"
    # the one warning: DCP directories carry no config.json for the hf output (see --config-from)
    (warning,) = result["warnings"]
    assert "no config.json; the hf output holds weights only" in warning
    got = st.load_file(str(out / "model.safetensors"))
    want = full(world)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert_bit_equal(got[name], t, name)


@pytest.mark.dist
def test_per_rank_equals_torch_chunks(world: Path, tmp_path: Path) -> None:
    layout = tmp_path / "dp2tp2.yaml"
    layout.write_text(LAYOUT)
    out = tmp_path / "per-rank"
    convert(SourceSpec(str(world / "ckpt")), out, TargetSpec(layout=str(layout)))
    for r in range(WORLD):
        got = st.load_file(str(out / f"rank-{r:05d}-of-{WORLD:05d}.safetensors"))
        want = torch.load(world / f"local-{r}.pt", weights_only=True)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert_bit_equal(got[name], t, f"rank {r} {name}")
    # the empty chunk of the last rank stays empty
    assert tuple(got["w.nested_empty"].shape) == (0, 4)


@pytest.mark.dist
def test_cli_convert_json(world: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli("convert", str(world / "ckpt"), str(out), "--consolidate", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True
    assert doc["source"]["format"] == "dcp-safetensors"
    assert doc["tensors"] == len(full(world))
    got = st.load_file(str(out / "model.safetensors"))
    for name, t in full(world).items():
        assert_bit_equal(got[name], t, name)


@pytest.mark.dist
def test_matches_torch_consolidation(world: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    # torch sizes elements with torch.finfo, so it consolidates floating tensors only;
    # and it writes a 0-d tensor as zeros (2.13), so scalars are left out too
    names = [n for n, t in full(world).items() if t.is_floating_point() and t.dim() > 0]
    torch_out = tmp_path / "torch"
    torch_out.mkdir()
    consolidate_safetensors_files(
        str(world / "ckpt"), str(torch_out), fqn_to_index_mapping=dict.fromkeys(names, 1)
    )
    ours = tmp_path / "ours"
    convert(SourceSpec(str(world / "ckpt")), ours, TargetSpec(consolidate=True))
    theirs = st.load_file(str(torch_out / "model-00001-of-00001.safetensors"))
    mine = st.load_file(str(ours / "model.safetensors"))
    assert sorted(theirs) == sorted(names)
    for name in names:
        assert_bit_equal(mine[name], theirs[name], name)


# --------------------------------------------------------------------------- holes


@pytest.mark.dist
def test_missing_chunk_is_a_plan_error(world: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(world / "ckpt", src)

    def drop(tensors: dict[str, Any], info: dict[str, Any]) -> None:
        del tensors["w.2d"], info["w.2d"]

    rewrite(file_holding(src, "w.2d", [0, 0]), drop)
    ck = open_checkpoint(src)  # coverage is the planner's job, not open's
    assert len(ck.tensors["w.2d"].piece_blocks) == 3
    assert ck.tensors["w.2d"].shape == (6, 8)
    with pytest.raises(PlanError, match=r'tensor "w\.2d".*holes') as ei:
        convert(SourceSpec(str(src)), tmp_path / "lib", TargetSpec(consolidate=True))
    assert ei.value.tensor == "w.2d"
    assert not (tmp_path / "lib").exists()

    out = tmp_path / "cli"
    proc = run_cli("convert", str(src), str(out), "--consolidate", "--json")
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False
    assert doc["error"]["type"] == "PlanError"
    assert doc["error"]["tensor"] == "w.2d"
    assert '"w.2d"' in doc["error"]["message"]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.dist
def test_edited_offsets_leave_a_hole(world: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(world / "ckpt", src)

    def move(tensors: dict[str, Any], info: dict[str, Any]) -> None:
        info["w.nested_empty"]["saved_offsets"] = [3, 0]  # row 1 claims to be row 3

    rewrite(file_holding(src, "w.nested_empty", [1, 0]), move)
    assert open_checkpoint(src).tensors["w.nested_empty"].shape == (4, 4)
    proc = run_cli("convert", str(src), str(tmp_path / "out"), "--consolidate")
    assert proc.returncode == 2
    assert "w.nested_empty" in proc.stderr
    assert "holes" in proc.stderr


# --------------------------------------------------------------------------- _StridedShard


@pytest.mark.dist
def test_strided_shard_chunks_are_flagged(world: Path, tmp_path: Path) -> None:
    results = json.loads((world / "result.json").read_text())
    # each rank holds rows {0,1,4,5} or {2,3,6,7} of 8: not a box. torch 2.13's default
    # planner refuses to save that; without its validation torch writes one box per rank
    # at the first row, [0:4) and [2:6), which overlap and lose rows 6-7.
    assert all(r["fused_local_shape"] == [4, 3] for r in results)
    assert all("overlapping chunks" in r["fused_default_planner"] for r in results)
    assert not any((world / "fused_refused").glob("*.safetensors"))

    ck = open_checkpoint(world / "fused")
    assert ck.tensors["fused"].shape == (6, 3)  # derived, and wrong: the full tensor has 8 rows
    (warning,) = ck.warnings
    assert warning.problem and warning.message.startswith('tensor "fused": stored boxes [0:4)x[0:3)')
    assert "[2:6)x[0:3)" in warning.message and "_StridedShard" in warning.message

    with pytest.raises(PlanError, match=r'tensor "fused"'):
        convert(SourceSpec(str(world / "fused")), tmp_path / "out", TargetSpec(consolidate=True))


def test_overlapping_pairs() -> None:
    iv = Interval

    def block(*box: Interval) -> Any:
        return tuple(normalize([x]) for x in box)

    a = block(iv(0, 4), iv(0, 3))
    b = block(iv(2, 6), iv(0, 3))
    side = block(iv(0, 4), iv(3, 6))
    empty = block(iv(4, 4), iv(0, 3))
    assert overlapping_pairs([a, b]) == [(0, 1)]
    assert overlapping_pairs([a, a, side, empty]) == []  # replicas, neighbours, empties
    assert overlapping_pairs([b, side, a]) == [(0, 2)]
    assert overlapping_pairs([(), ()]) == []


# --------------------------------------------------------------------------- bad files


def _save(path: Path, tensors: dict[str, Any], info: object, **meta: str) -> None:
    md = dict(meta)
    if info is not None:
        md["DCP_SHARDING_INFO"] = info if isinstance(info, str) else json.dumps(info)
    st.save_file(tensors, str(path), metadata=md)


def _f(*shape: int, dtype: Any = None) -> Any:
    return torch.zeros(*shape, dtype=dtype or torch.float32)


def test_handmade_boxes_convert(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _save(
        src / "shard-00001-model-00001-of-00001.safetensors",
        {"x": x[:, :1].contiguous()},
        {"x": {"saved_offsets": [0, 0]}},
    )
    _save(
        src / "shard-00002-model-00001-of-00001.safetensors",
        {"x": x[:, 1:].contiguous()},
        {"x": {"saved_offsets": [0, 1], "sizes": [3, 3]}},
    )
    ck = open_checkpoint(src)
    assert ck.tensors["x"].shape == (3, 4)
    assert ck.tensors["x"].signature[0] == "boxes"
    convert(SourceSpec(str(src)), tmp_path / "out", TargetSpec(consolidate=True))
    assert_bit_equal(st.load_file(str(tmp_path / "out" / "model.safetensors"))["x"], x, "x")


def test_global_shape_from_metadata_keeps_a_trailing_hole(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _save(
        src / "shard-00001-model-00001-of-00001.safetensors",
        {"x": _f(2, 4)},
        {"x": {"saved_offsets": [0, 0], "global_shape": [4, 4]}},
    )
    ck = open_checkpoint(src)
    assert ck.tensors["x"].shape == (4, 4)
    with pytest.raises(PlanError, match='tensor "x"'):
        convert(SourceSpec(str(src)), tmp_path / "out", TargetSpec(consolidate=True))


NAME = "shard-00001-model-00001-of-00001.safetensors"
NAME2 = "shard-00002-model-00001-of-00001.safetensors"


@pytest.mark.parametrize(
    ("files", "error", "message"),
    [
        pytest.param(
            {NAME: ({"x": _f(2)}, None)},
            HeaderError,
            rf"{NAME}: __metadata__ has no DCP_SHARDING_INFO",
            id="no-info",
        ),
        pytest.param(
            {NAME: ({"x": _f(2)}, "{not json")},
            HeaderError,
            r"DCP_SHARDING_INFO is not valid JSON",
            id="not-json",
        ),
        pytest.param(
            {NAME: ({"x": _f(2)}, [1, 2])},
            HeaderError,
            r"DCP_SHARDING_INFO must be a JSON object",
            id="not-object",
        ),
        pytest.param(
            {NAME: ({"x": _f(2), "y": _f(1)}, {"x": {"saved_offsets": [0]}})},
            HeaderError,
            rf'{NAME}: tensor "y" has no entry in DCP_SHARDING_INFO',
            id="tensor-without-info",
        ),
        pytest.param(
            {NAME: ({"x": _f(2, 2)}, {"x": {"saved_offsets": [0]}})},
            HeaderError,
            r'tensor "x" is stored with shape \[2, 2\] \(2-d\) but DCP_SHARDING_INFO gives 1',
            id="offsets-rank",
        ),
        pytest.param(
            {NAME: ({"x": _f(2)}, {"x": {"saved_offsets": [-1]}})},
            HeaderError,
            r'tensor "x": saved_offsets \[-1\] must be a list of non-negative integers',
            id="negative-offset",
        ),
        pytest.param(
            {NAME: ({"x": _f(2)}, {"x": {"offsets": [0]}})},
            HeaderError,
            r'tensor "x" has no saved_offsets',
            id="no-saved-offsets",
        ),
        pytest.param(
            {NAME: ({"x": _f(2, 3)}, {"x": {"saved_offsets": [2, 0], "global_shape": [3, 3]}})},
            LayoutError,
            r'tensor "x" is stored as box \[2:4\)x\[0:3\) .* exceeds its global shape \[3, 3\]',
            id="box-exceeds-shape",
        ),
        pytest.param(
            {NAME: ({"x": _f(2, 3)}, {"x": {"saved_offsets": [0, 0], "sizes": [3, 2]}})},
            LayoutError,
            r'tensor "x" is stored with shape \[2, 3\] but DCP_SHARDING_INFO says its chunk '
            r"has sizes \[3, 2\]",
            id="local-shape-mismatch",
        ),
        pytest.param(
            {
                NAME: ({"x": _f(2)}, {"x": {"saved_offsets": [0]}}),
                NAME2: ({"x": _f(2, dtype=torch.float16)}, {"x": {"saved_offsets": [2]}}),
            },
            LayoutError,
            rf'tensor "x" is F16 in {NAME2} but F32 in {NAME}',
            id="dtype-differs",
        ),
        pytest.param(
            {
                NAME: ({"x": _f(2)}, {"x": {"saved_offsets": [0]}}),
                "shard-00002-model-00001-of-00002.safetensors": (
                    {"x": _f(2)},
                    {"x": {"saved_offsets": [2]}},
                ),
            },
            HeaderError,
            r"mixes files of different saves",
            id="mixed-saves",
        ),
    ],
)
def test_bad_input(
    tmp_path: Path,
    files: dict[str, tuple[dict[str, Any], object]],
    error: type[Exception],
    message: str,
) -> None:
    for name, (tensors, info) in files.items():
        _save(tmp_path / name, tensors, info)
    with pytest.raises(error, match=message) as ei:
        open_checkpoint(tmp_path, fmt="dcp-safetensors")
    assert getattr(ei.value, "path", None)


@pytest.mark.dist
def test_check_claims_no_checksums_for_dcp(world: Path) -> None:
    """DCP safetensors record no checksums: inspect --check must not say it matched any."""
    proc = run_cli("inspect", str(world / "ckpt"), "--check")
    assert proc.returncode == 0, proc.stderr
    assert "check: ok (full coverage, no checksums recorded (reshard.json absent))" in proc.stderr
    assert "checksums match" not in proc.stderr
