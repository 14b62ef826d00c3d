"""torch DCP (``.distcp``) checkpoints written by torch itself, read by reshard without torch.

``dcp_helpers/save_dcp.py`` writes, once per module: single-process saves of
many dtypes, 0-d tensors and non-tensor items (plain, zstd-compressed,
SAFETENSORS-serialised, a transposed view), a Megatron-Core ``torch_dist``-shaped
checkpoint crafted to the documented structure, and a 4-rank gloo world's
FSDP2+TP model with AdamW state and an uneven ``Shard(0)`` with an empty chunk
(with global and with rank-local metadata). Each has ``<name>.ref.pt``: the
full tensors under DCP's flattened FQNs. The tests convert through the real
CLI and compare bit for bit; damaged and hostile files must exit 2 (or 1 for
``inspect --check``) naming the file, and run nothing.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from reshard.formats import detect_format, open_checkpoint
from reshard.select import select_checkpoint

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

HERE = Path(__file__).resolve().parent
HELPER = HERE / "dcp_helpers" / "save_dcp.py"
RESHARD = Path(sys.executable).with_name("reshard")
READABLE = ["plain", "zstd", "safetensors", "transposed", "megatron", "fsdp_tp", "rank_local"]
PARAM_GROUPS = {
    "amsgrad", "betas", "capturable", "decoupled_weight_decay", "differentiable", "eps", "foreach",
    "fused", "lr", "maximize", "params", "weight_decay",
}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_read")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(root)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def ref(saved: Path, name: str) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(saved / f"{name}.ref.pt", weights_only=True)
    return out


def raw(t: Any) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), k
        assert raw(g) == raw(w), k


# --------------------------------------------------------------------------- reading and converting


@pytest.mark.dist
@pytest.mark.parametrize("name", READABLE)
def test_convert_to_hf_bit_exact(saved: Path, tmp_path: Path, name: str) -> None:
    src = saved / name
    if name == "zstd" and not src.exists():
        pytest.skip("torch's ZStandard extension needs the zstandard module (pip install zstandard)")
    assert detect_format(src) == "dcp"
    out = tmp_path / "hf"
    proc = run_cli("convert", src, out, "--consolidate", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["source"]["format"] == "dcp"
    items = open_checkpoint(src).non_tensors
    assert doc["not_converted"] == [{"name": n.name, "size": n.size, "kind": n.kind} for n in items]
    assert (not items) or any("not converted" in w for w in doc["warnings"])
    assert_same(st.load_file(str(out / "model.safetensors")), ref(saved, name))
    assert detect_format(out) == "hf"
    proc = run_cli("verify", src, out)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("inspect", src, "--check", "--from", "dcp")
    assert proc.returncode == 0, proc.stderr
    assert "check: ok" in proc.stderr


@pytest.mark.dist
def test_fsdp_tp_optimizer_state(saved: Path) -> None:
    """Model and Adam state are tensors under DCP's FQNs; param_groups are listed, not dropped."""
    ck = open_checkpoint(saved / "fsdp_tp")
    assert ck.format == "dcp"
    assert set(ck.tensors) == set(ref(saved, "fsdp_tp"))
    for p in ("up.weight", "down.weight"):
        for s in ("exp_avg", "exp_avg_sq"):
            t = ck.tensors[f"optimizer.state.{p}.{s}"]
            assert t.piece_blocks == ck.tensors[f"model.{p}"].piece_blocks
        assert ck.tensors[f"optimizer.state.{p}.step"].shape == ()
    # FSDP2 over TP: _StridedShard(0, 2) x Shard(0) local tensors are one box each, on 4 ranks
    up = ck.tensors["model.up.weight"]
    assert sorted((b[0][0].start, b[0][0].stop) for b in up.piece_blocks) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert {n.name for n in ck.non_tensors} == {f"optimizer.param_groups.0.{k}" for k in PARAM_GROUPS}
    assert all(n.kind == "object" and n.size > 0 for n in ck.non_tensors)
    plain = open_checkpoint(saved / "plain")
    assert [(n.name, n.kind, plain.files[n.file or 0].endswith(".distcp")) for n in plain.non_tensors] == [
        ("extra.lr", "object", True),
        ("extra.name", "object", True),
    ]


@pytest.mark.dist
def test_few_open_files(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one descriptor at a time (as with more rank files than the fd limit) the reading is the same."""
    import reshard.formats.dcp as dcp_mod

    want = open_checkpoint(saved / "fsdp_tp")
    monkeypatch.setattr(dcp_mod, "_MAX_OPEN", 1)
    got = open_checkpoint(saved / "fsdp_tp")
    assert got.tensors == want.tensors and got.non_tensors == want.non_tensors and got.files == want.files


@pytest.mark.dist
def test_inspect_json_lists_boxes_and_objects(saved: Path) -> None:
    proc = run_cli("inspect", saved / "fsdp_tp", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "no placements" in doc["note"]
    by = {t["name"]: t for t in doc["tensors"]}
    # Shard(0) x Shard(0) of 3 rows over 4 ranks: the last chunk is empty at offset 3
    assert sorted(c["box"] for c in by["extra.uneven"]["chunks"]) == [
        "[0:1)x[0:2)",
        "[1:2)x[0:2)",
        "[2:3)x[0:2)",
        "[]x[0:2)",
    ]
    assert by["optimizer.state.up.weight.step"]["chunks"][0]["box"] == "(scalar)"
    items = doc["non_tensors"]
    assert {o["name"] for o in items} == {f"optimizer.param_groups.0.{k}" for k in PARAM_GROUPS}
    assert all(o["size"] > 0 and o["file"].endswith(".distcp") for o in items)
    text = run_cli("inspect", saved / "fsdp_tp").stderr
    assert "no placements" in text
    assert text.count("optimizer.param_groups.0.amsgrad") == 1, "each non-tensor item is listed once"


@pytest.mark.dist
def test_rank_local_metadata_merged(saved: Path) -> None:
    assert not (saved / "rank_local" / ".metadata").exists()
    assert len(list((saved / "rank_local").glob("__*.metadata"))) == 4
    ck = open_checkpoint(saved / "rank_local")
    # every rank wrote its replicated 0-d step: four replicas of one box
    assert len(ck.tensors["optimizer.state.up.weight.step"].piece_blocks) == 4


@pytest.mark.dist
def test_megatron_prepend_axes(saved: Path) -> None:
    ck = open_checkpoint(saved / "megatron")
    qkv = ck.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert (qkv.shape, qkv.dtype, len(qkv.piece_blocks)) == ((2, 6, 4), "BF16", 4)
    fc1 = ck.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (2, 2, 4, 3)


@pytest.mark.dist
def test_per_rank_target_plan_and_verify(saved: Path, tmp_path: Path) -> None:
    layout = tmp_path / "tp2.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.step": R\n  "*.up.weight*": {tp: S(0)}\n  "*": R\n')
    proc = run_cli("plan", saved / "fsdp_tp", "--target-layout", layout, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"]["files"] == 2
    out = tmp_path / "tp2"
    proc = run_cli("convert", saved / "fsdp_tp", out, "--target-layout", layout, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert detect_format(out) == "per-rank"
    proc = run_cli("verify", saved / "fsdp_tp", out)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.dist
def test_copy_path_imports_no_torch(saved: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from reshard.cli import app\n"
        "for i, src in enumerate(sys.argv[2:]):\n"
        "    try:\n"
        "        app(['convert', src, sys.argv[1] + str(i), '--consolidate', '--quiet'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    names = ("fsdp_tp", "zstd", "safetensors", "megatron", "transposed")
    srcs = [str(saved / n) for n in names if (saved / n).exists()]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "o"), *srcs], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.dist
def test_select_model_only(saved: Path) -> None:
    ck = open_checkpoint(saved / "fsdp_tp")
    kept, warnings = select_checkpoint(ck, exclude=["optimizer.*", "lr_scheduler.*"])
    assert sorted(kept.tensors) == ["extra.uneven", "model.down.weight", "model.up.weight"]
    assert kept.non_tensors == ()
    assert [str(w) for w in warnings] == [f'--exclude "lr_scheduler.*" matches nothing in {ck.path}']
    kept, warnings = select_checkpoint(ck, include=[r"re:optimizer\.state\..*\.step"])
    assert sorted(kept.tensors) == ["optimizer.state.down.weight.step", "optimizer.state.up.weight.step"]
    assert warnings == []


# --------------------------------------------------------------------------- refusals


def _copy(saved: Path, name: str, tmp_path: Path) -> Path:
    if not (saved / name).exists():
        pytest.skip(f"{name} was not written (zstd: pip install zstandard)")
    dst = tmp_path / name
    shutil.copytree(saved / name, dst)
    return dst


def _refused(proc: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr.replace("\n", " ")


@pytest.mark.dist
def test_permuted_chunks_tile_by_tile(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Transposed/permuted chunks are rewritten row-major when first read (not at open), in many
    small tiles here."""
    import reshard.formats.dcp as dcp_mod
    from reshard.io.pages import SourceFiles

    monkeypatch.setattr(dcp_mod, "_SPOOL_TILE", 256)
    ck = open_checkpoint(saved / "transposed")
    want = ref(saved, "transposed")
    assert not os.path.exists(ck.files[-1]), "the spool is made when first read"
    sources = SourceFiles(ck.files, ck.file_sizes)
    try:
        for name in ("t", "p"):
            t = ck.tensors[name]
            assert t.piece_files == (len(ck.files) - 1,), "a spooled copy"
            assert t.piece_crc32 == (None,)
            buf = bytearray(len(raw(want[name])))
            sources.pread(t.piece_files[0], memoryview(buf), t.piece_offsets[0])
            assert bytes(buf) == raw(want[name]), name
    finally:
        sources.close()
    assert ck.tensors["col"].piece_files == (0,), "row-major already: read in place"
    assert not any(w.problem for w in ck.warnings)


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.dist
def test_malicious_metadata(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "plain", tmp_path)
    marker = tmp_path / "MARKER"
    (ck / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    for cmd in (["inspect", ck], ["convert", ck, tmp_path / "out", "--consolidate"]):
        err = _refused(run_cli(*cmd))
        assert ".metadata" in err and "posix.system" in err
    assert not marker.exists()


@pytest.mark.dist
def test_malicious_chunk_pickle(saved: Path, tmp_path: Path) -> None:
    """A chunk archive whose data.pkl would run a command: refused, naming the file and the class."""
    ck = _copy(saved, "plain", tmp_path)
    marker = tmp_path / "MARKER"
    md = pickle.loads((ck / ".metadata").read_bytes())  # our own file: trusted
    key = next(k for k in md.storage_data if k.fqn == "model.w")
    info = md.storage_data[key]
    blob = (ck / info.relative_path).read_bytes()
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Touch(marker), protocol=2))
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", b"\0" * 120)
    patched = blob[: info.offset] + evil.read_bytes() + blob[info.offset + info.length :]
    (ck / info.relative_path).write_bytes(patched)
    delta = evil.stat().st_size - info.length
    for v in md.storage_data.values():
        if v.offset > info.offset:
            v.offset += delta
    info.length = evil.stat().st_size
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    err = _refused(run_cli("convert", ck, tmp_path / "out", "--consolidate"))
    assert "__0_0.distcp" in err and "posix.system" in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
def test_truncated_file(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "plain", tmp_path)
    f = ck / "__0_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    err = _refused(run_cli("inspect", ck))
    assert "__0_0.distcp" in err and "truncated" in err


@pytest.mark.dist
def test_crc_mismatch_caught_by_check(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "plain", tmp_path)
    t = open_checkpoint(ck).tensors["model.w"]
    with open(ck / "__0_0.distcp", "r+b") as f:
        f.seek(t.piece_offsets[0] + 7)
        b = f.read(1)
        f.seek(t.piece_offsets[0] + 7)
        f.write(bytes([b[0] ^ 0x40]))
    proc = run_cli("inspect", ck, "--check", "--json")
    assert proc.returncode == 1, proc.stderr
    problems = json.loads(proc.stdout)["check"]["problems"]
    assert [(p["kind"], p["tensor"]) for p in problems] == [("crc32", "model.w")]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["plain", "fsdp_tp"])
def test_crc_mismatch_caught_by_convert(saved: Path, tmp_path: Path, name: str) -> None:
    """convert checks every chunk's CRC32 as it copies: a flipped byte exits 2 naming the file and
    the tensor, nothing written; --no-verify-source converts it as it is."""
    ck = _copy(saved, name, tmp_path)
    ckpt = open_checkpoint(ck)
    fqn = "model.w" if name == "plain" else sorted(n for n in ckpt.tensors if n.startswith("model."))[0]
    t = ckpt.tensors[fqn]
    k = len(t.piece_offsets) - 1
    path = Path(ckpt.files[t.piece_files[k]])
    with open(path, "r+b") as f:
        f.seek(t.piece_offsets[k])
        b = f.read(1)
        f.seek(t.piece_offsets[k])
        f.write(bytes([b[0] ^ 0x40]))
    for target in (["--consolidate"], ["--to", "per-rank", "--target-layout", str(_layout(tmp_path))]):
        err = _refused(run_cli("convert", ck, tmp_path / "out", *target, "--quiet"))
        assert str(path) in err and f'tensor "{fqn}"' in err and "CRC32" in err, err
        assert "--no-verify-source" in err
        assert not (tmp_path / "out").exists()
    proc = run_cli("convert", ck, tmp_path / "out", "--consolidate", "--no-verify-source", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "reshard.json").is_file()


def _layout(tmp_path: Path) -> Path:
    p = tmp_path / "tp2.yaml"
    p.write_text('mesh: {tp: 2}\nplacements:\n  "*": {tp: R}\n')
    return p


@pytest.mark.dist
def test_unknown_transform_refused(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "zstd", tmp_path)
    md = pickle.loads((ck / ".metadata").read_bytes())
    for v in md.storage_data.values():
        v.transform_descriptors = ["stream.lz4/1"]
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    err = _refused(run_cli("inspect", ck))
    assert "stream.lz4/1" in err and "stream.zstd/1" in err


@pytest.mark.dist
def test_cli_include_exclude(saved: Path, tmp_path: Path) -> None:
    src = saved / "fsdp_tp"
    sel = ["--exclude", "optimizer.*", "--exclude", "lr_scheduler.*"]
    out = tmp_path / "model"
    proc = run_cli("convert", src, out, "--consolidate", *sel, "--json")
    assert proc.returncode == 0, proc.stderr
    assert 'warning: --exclude "lr_scheduler.*" matches nothing' in proc.stderr
    want = {k: v for k, v in ref(saved, "fsdp_tp").items() if not k.startswith("optimizer.")}
    assert_same(st.load_file(str(out / "model.safetensors")), want)
    warnings = json.loads(proc.stdout)["warnings"]
    assert warnings[0] == f'--exclude "lr_scheduler.*" matches nothing in {src}'
    assert len(warnings) == 2 and "no config.json" in warnings[1]  # hf output without model files
    assert run_cli("verify", src, out).returncode == 1  # the optimizer state is missing in out
    proc = run_cli("verify", src, out, *sel)
    assert proc.returncode == 0, proc.stderr
    assert "matches nothing in" in proc.stderr and "optimizer" not in proc.stderr
    # another input format: the hf output, with an re: include
    proc = run_cli("inspect", out, "--include", r"re:model\..*", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [t["name"] for t in json.loads(proc.stdout)["tensors"]] == ["model.down.weight", "model.up.weight"]
    proc = run_cli("plan", src, "--consolidate", "--include", "*.step", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors"] == 2
    err = _refused(run_cli("inspect", src, "--include", "re:("))
    assert '--include "re:("' in err


@pytest.mark.dist
def test_damaged_zstd_chunk(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "zstd", tmp_path)
    md = pickle.loads((ck / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.w")
    with open(ck / info.relative_path, "r+b") as f:
        f.seek(info.offset + 30)
        b = f.read(4)
        f.seek(info.offset + 30)
        f.write(bytes(x ^ 0xFF for x in b))
    assert run_cli("inspect", ck).returncode == 0  # reads no chunk: the spool is made when read
    err = _refused(run_cli("convert", ck, tmp_path / "out", "--consolidate"))
    assert f"{info.relative_path} (bytes {info.offset}.." in err and "zstd stream is damaged" in err
    assert 'tensor "model.w"' in err and not (tmp_path / "out").exists()  # found at copy time
    err = _refused(run_cli("inspect", ck, "--check"))
    assert f"{info.relative_path} (bytes {info.offset}.." in err and "zstd stream is damaged" in err


@pytest.mark.dist
def test_zstd_without_a_zstd_module(saved: Path, tmp_path: Path) -> None:
    """No zstandard/pyzstd importable: exit 2 saying what to install, nothing written."""
    src = _copy(saved, "zstd", tmp_path)
    code = (
        "import sys\n"
        "sys.modules['zstandard'] = sys.modules['pyzstd'] = None  # import fails as if not installed\n"
        "from reshard.cli import app\n"
        "app(['convert', sys.argv[1], sys.argv[2], '--consolidate'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    err = _refused(proc)
    assert "stream.zstd/1" in err and "pip install zstandard" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
@pytest.mark.parametrize("name", ["transposed", "zstd"])
def test_spool_removed_under_torchrun(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """`torchrun ... reshard convert` of a checkpoint the reader spools (permuted or zstd chunks):
    every rank's spool directory is gone when it exits (the CLI leaves with os._exit there, which
    skips atexit), and the output equals one process's."""
    from tests.dist.test_torchrun import assert_same_dirs, reshard_exe, torchrun

    src = _copy(saved, name, tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    proc = run_cli("convert", src, tmp_path / "single", "--consolidate", "--max-shard-size", "2KB", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []  # one process: removed at exit
    args = ("convert", src, tmp_path / "dist", "--consolidate", "--max-shard-size", "2KB", "--quiet")
    torchrun(2, *reshard_exe(), *args, teardown_abort_ok=True)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("reshard-")] == []  # torchelastic's stay
    assert_same_dirs(tmp_path / "dist", tmp_path / "single")


# --------------------------------------------------------------------------- pieces as torch stored them


def _torch_items(ck: Path) -> dict[str, list[tuple[str, int, int, tuple[int, ...]]]]:
    """Per tensor, its storage items as torch's own metadata classes read them (``pickle.loads``
    of our own files, torch imported): ``(relative_path, offset, length, chunk offsets)``."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # Megatron-Core's subclass (the module is not installed): its Metadata fields
            return Metadata if name == "MCoreMetadata" else super().find_class(module, name)

    out: dict[str, list[tuple[str, int, int, tuple[int, ...]]]] = {}
    files = [ck / ".metadata"] if (ck / ".metadata").exists() else sorted(ck.glob("__*.metadata"))
    for mf in files:
        md = Unpickler(io.BytesIO(mf.read_bytes())).load()
        for key, info in md.storage_data.items():
            if isinstance(md.state_dict_metadata[key.fqn], TensorStorageMetadata):
                item = (info.relative_path, info.offset, info.length, tuple(key.offset))
                out.setdefault(key.fqn, []).append(item)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", ["plain", "megatron", "fsdp_tp", "rank_local"])
def test_pieces_are_the_chunks_torch_stored(saved: Path, name: str) -> None:
    """Each tensor's pieces (held as columns: offsets and CRC32s slices of two arrays) are its
    storage items as torch reads them, one to one: the same file and box, the bytes torch.load
    gives for the item's archive, and their CRC32. FSDP2 x TP (_StridedShard) model and AdamW
    state on a (dp, tp) mesh, rank-local metadata merged, Megatron's prepended axes."""
    import zlib

    from reshard.checkpoint import ColumnSlice, Crc32Slice

    ck = saved / name
    want = _torch_items(ck)
    got = open_checkpoint(ck)
    assert set(want) == set(got.tensors)
    blobs = {p.name: p.read_bytes() for p in ck.iterdir() if p.suffix == ".distcp"}
    for fqn, items in want.items():
        t = got.tensors[fqn]
        assert isinstance(t.piece_offsets, ColumnSlice) and isinstance(t.piece_crc32, Crc32Slice)
        assert len(t.piece_offsets) == len(t.piece_files) == len(t.piece_blocks) == len(items), fqn
        matched = []
        for k, at in enumerate(t.piece_offsets):
            fname = Path(got.files[t.piece_files[k]]).name
            hits = [i for i, (p, off, n, _) in enumerate(items) if p == fname and off <= at < off + n]
            assert len(hits) == 1, (fqn, k)
            path, off, n, offsets = items[hits[0]]
            matched.append(hits[0])
            chunk = torch.load(io.BytesIO(blobs[path][off : off + n]), weights_only=True)
            data = raw(chunk)
            assert blobs[path][at : at + len(data)] == data, (fqn, k)
            assert t.piece_crc32[k] in (None, zlib.crc32(data)), (fqn, k)
            box = t.piece_blocks[k]
            assert len(box) == len(t.shape)
            starts = [dim[0].start if dim else None for dim in box]
            tail = offsets[len(offsets) - len(box) :]  # Megatron: offsets of more dims than sizes
            assert all(s is None or s == o for s, o in zip(starts, tail, strict=True)), (fqn, k)
            assert math.prod(sum(iv.stop - iv.start for iv in dim) for dim in box) == chunk.numel(), (fqn, k)
        assert sorted(matched) == list(range(len(items))), fqn
        assert t.piece_offsets == tuple(t.piece_offsets) and list(t.piece_crc32) == [
            t.piece_crc32[k] for k in range(len(items))
        ]


def _edit_metadata(ck: Path, edit: Any) -> None:
    md = pickle.loads((ck / ".metadata").read_bytes())  # our own file: trusted
    edit(md)
    (ck / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.dist
def test_chunk_without_storage_item_is_a_problem(saved: Path, tmp_path: Path) -> None:
    """A chunk .metadata lists but stores nowhere: a warning naming the tensor and the chunk;
    inspect --check exits 1 with it; the other tensors read as before."""
    ck = _copy(saved, "fsdp_tp", tmp_path)

    def drop(md: Any) -> None:
        key = next(k for k in md.storage_data if k.fqn == "model.up.weight" and k.offset[0] == 2)
        del md.storage_data[key]

    _edit_metadata(ck, drop)
    got = open_checkpoint(ck)
    warned = [w for w in got.warnings if w.problem]
    assert [(w.tensor, "chunk at offsets [2, 0] has no storage entry" in w.message) for w in warned] == [
        ("model.up.weight", True)
    ]
    assert len(got.tensors["model.up.weight"].piece_offsets) == 3
    whole = open_checkpoint(saved / "fsdp_tp").tensors
    assert {n: t for n, t in got.tensors.items() if n != "model.up.weight"} == {
        n: t for n, t in whole.items() if n != "model.up.weight"
    }
    proc = run_cli("inspect", ck, "--check", "--json")
    assert proc.returncode == 1, proc.stderr
    kinds = {(p["kind"], p["tensor"]) for p in json.loads(proc.stdout)["check"]["problems"]}
    assert ("warning", "model.up.weight") in kinds


@pytest.mark.dist
def test_rank_local_chunk_without_storage_item(saved: Path, tmp_path: Path) -> None:
    """With rank-local metadata, the warning names the rank's metadata file that lost the item."""
    ck = _copy(saved, "rank_local", tmp_path)
    mf = ck / "__1.metadata"
    md = pickle.loads(mf.read_bytes())
    key = next(k for k in md.storage_data if k.fqn == "model.up.weight")
    del md.storage_data[key]
    mf.write_bytes(pickle.dumps(md))
    warned = [w for w in open_checkpoint(ck).warnings if w.problem]
    assert [(w.tensor, Path(w.path or "").name) for w in warned] == [("model.up.weight", "__1.metadata")]
    assert "has no storage entry" in warned[0].message


def _move_chunk(md: Any, fqn: str, old: int, new: int) -> None:
    """Move the chunk of ``fqn`` at row ``old`` to row ``new``, in the chunk list and its storage key."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for c in md.state_dict_metadata[fqn].chunks:
        if c.offsets[0] == old:
            c.offsets = torch.Size([new, *c.offsets[1:]])
    key = next(k for k in md.storage_data if k.fqn == fqn and k.offset[0] == old)
    info = md.storage_data.pop(key)
    md.storage_data[MetadataIndex(fqn, torch.Size([new, *key.offset[1:]]), key.index)] = info


@pytest.mark.dist
def test_overlapping_chunks_warned(saved: Path, tmp_path: Path) -> None:
    """Chunks whose boxes overlap: a warning naming both boxes and files; --check exits 1."""
    ck = _copy(saved, "fsdp_tp", tmp_path)
    _edit_metadata(ck, lambda md: _move_chunk(md, "model.up.weight", 2, 1))
    got = open_checkpoint(ck)
    warned = [w for w in got.warnings if w.tensor == "model.up.weight"]
    assert len(warned) == 1 and "overlap" in warned[0].message and "[1:3)" in warned[0].message
    assert ".distcp" in warned[0].message
    assert run_cli("inspect", ck, "--check").returncode == 1


@pytest.mark.dist
def test_chunk_outside_its_tensor_refused(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, "fsdp_tp", tmp_path)
    _edit_metadata(ck, lambda md: _move_chunk(md, "model.up.weight", 2, 7))
    err = _refused(run_cli("inspect", ck))
    assert "model.up.weight" in err and ".distcp" in err
