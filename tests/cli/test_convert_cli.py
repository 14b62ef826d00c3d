"""`reshard convert` as a user runs it: real files, real subprocesses, exit codes, nothing half-written."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.demo import torch_local
from reshard.io.header import read_header
from reshard.placements import parse_placement

LAYOUT = """\
mesh: {tp: 4}
placements:
  "*.wq": {tp: S(0)}
  "*.wo": {tp: S(1)}
  "*.gate_up": {tp: "_S(0, 2)"}
  "*": R
"""

FULL = {
    "layers.0.wq": torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6),
    "layers.0.wo": (torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10) * 0.5).to(torch.bfloat16),
    "layers.0.gate_up": torch.arange(12 * 3, dtype=torch.int32).reshape(12, 3),
    "layers.0.norm": torch.ones(6, dtype=torch.float16),
    "tiny": torch.arange(3, dtype=torch.int64),  # fewer rows than ranks when sharded
    "scalar": torch.tensor(7.5, dtype=torch.float64),
}

PLACEMENTS = {
    "layers.0.wq": ["S(0)"],
    "layers.0.wo": ["S(1)"],
    "layers.0.gate_up": ["_S(0, 2)"],
}


RESHARD = str(Path(sys.executable).parent / "reshard")


def run(*args: str, fsize_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed `reshard` console script as a user would."""

    def limit() -> None:  # runs in the child: cap file sizes so writes fail with EFBIG
        if fsize_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run(
        [RESHARD, *args], capture_output=True, text=True, env=env, timeout=120, preexec_fn=limit
    )


@pytest.fixture()
def tp4(tmp_path: Path) -> Path:
    src = tmp_path / "tp4"
    src.mkdir()
    for r in range(4):
        local = {
            n: torch_local(t, (4,), (r,), [parse_placement(p) for p in PLACEMENTS.get(n, ["R"])]).clone()
            for n, t in FULL.items()
        }
        save_file(local, str(src / f"rank-{r:05d}-of-00004.safetensors"))
    (tmp_path / "tp.yaml").write_text(LAYOUT)
    return src


def test_tp4_to_tp8_to_hf_round_trip_matches_torch(tp4: Path, tmp_path: Path) -> None:
    lay = str(tmp_path / "tp.yaml")
    p = run(
        "convert", str(tp4), str(tmp_path / "tp8"), "--source-layout", lay, "--target-mesh", "tp=8", "--json"
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == 1 and doc["ok"] and len(doc["files"]) == 8
    for r in range(8):
        got = load_file(str(tmp_path / "tp8" / f"rank-{r:05d}-of-00008.safetensors"))
        for n, t in FULL.items():
            want = torch_local(t, (8,), (r,), [parse_placement(x) for x in PLACEMENTS.get(n, ["R"])])
            assert got[n].dtype == t.dtype and torch.equal(got[n], want), (r, n)
    # self-describing output: consolidate with no layout file
    p = run("convert", str(tmp_path / "tp8"), str(tmp_path / "hf"), "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(FULL)
    for n, t in FULL.items():
        assert torch.equal(got[n], t), n
    manifest = json.loads((tmp_path / "hf" / "reshard.json").read_text())
    assert manifest["format"] == "hf"
    assert (
        manifest["files"]["model.safetensors"]["size"]
        == (tmp_path / "hf" / "model.safetensors").stat().st_size
    )


def test_outputs_are_deterministic(tp4: Path, tmp_path: Path) -> None:
    lay = str(tmp_path / "tp.yaml")
    for d in ("a", "b"):
        assert (
            run(
                "convert", str(tp4), str(tmp_path / d), "--source-layout", lay, "--target-mesh", "tp=3"
            ).returncode
            == 0
        )
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b"))
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n


def test_dtype_cast_and_sharded_hf(tp4: Path, tmp_path: Path) -> None:
    lay = str(tmp_path / "tp.yaml")
    out = tmp_path / "hf"
    p = run(
        "convert",
        str(tp4),
        str(out),
        "--source-layout",
        lay,
        "--consolidate",
        "--dtype",
        "bf16",
        "--max-shard-size",
        "300B",
    )
    assert p.returncode == 0, p.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("model-") for f in files)
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(load_file(str(out / f)))
    for n, t in FULL.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[n].dtype == want.dtype and torch.equal(got[n], want), n


def _assert_nothing_written(dst: Path) -> None:
    assert not dst.exists() or not any(dst.iterdir())


@pytest.mark.parametrize(
    "damage, expect",
    [
        ("missing-rank", "rank-00002-of-00004.safetensors"),
        ("truncated", "truncated"),
        ("corrupt-header", "rank-00001-of-00004.safetensors"),
        ("missing-tensor", '"layers.0.wq"'),
        ("dtype", "all ranks must hold the same dtype"),
        ("shape", '"layers.0.wq"'),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tp4: Path, tmp_path: Path, damage: str, expect: str) -> None:
    f1 = tp4 / "rank-00001-of-00004.safetensors"
    if damage == "missing-rank":
        (tp4 / "rank-00002-of-00004.safetensors").unlink()
    elif damage == "truncated":
        data = f1.read_bytes()
        f1.write_bytes(data[:-5])
    elif damage == "corrupt-header":
        data = bytearray(f1.read_bytes())
        data[9] = ord("!")
        f1.write_bytes(bytes(data))
    else:
        t = load_file(str(f1))
        if damage == "missing-tensor":
            del t["layers.0.wq"]
        elif damage == "dtype":
            t["layers.0.norm"] = t["layers.0.norm"].to(torch.float32)
        else:
            t["layers.0.wq"] = torch.zeros(2, 6)
        save_file(t, str(f1))
    dst = tmp_path / "out"
    p = run(
        "convert", str(tp4), str(dst), "--source-layout", str(tmp_path / "tp.yaml"), "--target-mesh", "tp=2"
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert expect in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    _assert_nothing_written(dst)


def test_rank_count_differs_from_mesh(tp4: Path, tmp_path: Path) -> None:
    p = run(
        "convert",
        str(tp4),
        str(tmp_path / "o"),
        "--source-layout",
        str(tmp_path / "tp.yaml"),
        "--source-mesh",
        "tp=8",
        "--consolidate",
    )
    assert p.returncode == 2
    assert "4 rank files but the mesh tp=8 has 8 ranks" in p.stderr


def test_rule_that_cannot_apply_names_tensor_file_and_layout(tp4: Path, tmp_path: Path) -> None:
    lay = tmp_path / "wrong.yaml"
    lay.write_text('mesh: {tp: 4}\nplacements:\n  "*": {tp: S(1)}\n')  # S(1) on the 1-d norm
    dst = tmp_path / "o"
    p = run("convert", str(tp4), str(dst), "--source-layout", str(lay), "--consolidate", "--json")
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)["error"]
    assert err["tensor"] is not None and f'"{err["tensor"]}"' in err["message"]
    assert "S(1) does not fit a 1-d tensor" in err["message"] and str(lay) in err["message"]
    assert err["path"].endswith(".safetensors")
    assert "Traceback" not in p.stderr and not dst.exists()


def test_tensor_matching_no_rule(tp4: Path, tmp_path: Path) -> None:
    lay = tmp_path / "strict.yaml"
    lay.write_text('mesh: {tp: 4}\nplacements:\n  "*.wq": {tp: S(0)}\n')
    p = run("convert", str(tp4), str(tmp_path / "o"), "--source-layout", str(lay), "--consolidate", "--json")
    assert p.returncode == 2
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and "matches no rule" in doc["error"]["message"]
    assert doc["error"]["tensor"] is not None


def test_destination_rules(tp4: Path, tmp_path: Path) -> None:
    lay = str(tmp_path / "tp.yaml")
    p = run("convert", str(tp4), str(tp4 / "inside"), "--source-layout", lay, "--consolidate")
    assert p.returncode == 2 and "inside the source" in p.stderr
    assert not (tp4 / "inside").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    p = run("convert", str(tp4), str(busy), "--source-layout", lay, "--consolidate")
    assert p.returncode == 2 and "--overwrite" in p.stderr
    p = run("convert", str(tp4), str(busy), "--source-layout", lay, "--consolidate", "--overwrite")
    assert p.returncode == 0, p.stderr
    assert (busy / "model.safetensors").exists() and (busy / "keep.txt").exists()


def test_partial_target_refused(tp4: Path, tmp_path: Path) -> None:
    lay = tmp_path / "p.yaml"
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "*": P(sum)\n')
    p = run(
        "convert",
        str(tp4),
        str(tmp_path / "o"),
        "--source-layout",
        str(tmp_path / "tp.yaml"),
        "--target-layout",
        str(lay),
    )
    assert p.returncode == 2 and "Partial target" in p.stderr
    _assert_nothing_written(tmp_path / "o")


def test_non_float_cast_is_left_alone_and_said(tp4: Path, tmp_path: Path) -> None:
    p = run(
        "convert",
        str(tp4),
        str(tmp_path / "o"),
        "--source-layout",
        str(tmp_path / "tp.yaml"),
        "--consolidate",
        "--dtype",
        "fp16",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    h = read_header(tmp_path / "o" / "model.safetensors")
    assert h.entry("layers.0.gate_up").dtype == "I32"
    assert h.entry("layers.0.wq").dtype == "F16"


def test_usage_errors(tp4: Path, tmp_path: Path) -> None:
    p = run("convert", str(tp4), str(tmp_path / "o"), "--source-layout", str(tmp_path / "tp.yaml"))
    assert p.returncode == 2 and "--target-mesh" in p.stderr
    p = run("convert", str(tmp_path / "nope"), str(tmp_path / "o"), "--consolidate")
    assert p.returncode == 2 and "no such file" in p.stderr
    p = run("convert", str(tp4), str(tmp_path / "o"), "--consolidate")
    assert p.returncode == 2 and "--source-layout" in p.stderr
    p = run(
        "convert",
        str(tp4),
        str(tmp_path / "o"),
        "--source-layout",
        str(tmp_path / "tp.yaml"),
        "--target-mesh",
        "tp=x",
    )
    assert p.returncode == 2 and "NAME=SIZE" in p.stderr


def test_write_failure_exits_3_and_removes_partial_files(tp4: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    p = run(
        "convert",
        str(tp4),
        str(dst),
        "--source-layout",
        str(tmp_path / "tp.yaml"),
        "--target-mesh",
        "tp=2",
        fsize_limit=700,
    )
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "partial files were removed" in p.stderr and "Traceback" not in p.stderr
    assert not dst.exists() or not any(dst.iterdir())


def test_resume_keeps_verified_files_and_redoes_the_rest(tp4: Path, tmp_path: Path) -> None:
    lay = str(tmp_path / "tp.yaml")
    ref = tmp_path / "ref"
    assert run("convert", str(tp4), str(ref), "--source-layout", lay, "--target-mesh", "tp=4").returncode == 0
    # an interrupted run: two files finished in the staging directory (journal written, its
    # first line the source's identity), one torn temporary, no reshard.json
    out = tmp_path / "out"
    stage = out / ".reshard-staging"
    stage.mkdir(parents=True)
    import shutil

    from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
    from reshard.io.checksum import file_checksum
    from reshard.resume import recipe, source_identity

    ck = open_source(SourceSpec(str(tp4), layout=lay))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(mesh="tp=4")))
    lines = [json.dumps({"source": source_identity(ck), "recipe": recipe(plan, None)})]
    for r in (0, 1):
        name = f"rank-{r:05d}-of-00004.safetensors"
        shutil.copy(ref / name, stage / name)
        lines.append(
            json.dumps(
                {"name": name, "size": (stage / name).stat().st_size, "checksum": file_checksum(stage / name)}
            )
        )
    (stage / ".reshard-progress.jsonl").write_text("\n".join(lines) + "\n")
    # rank 1 was damaged after it finished: resume must redo it
    data = bytearray((stage / "rank-00001-of-00004.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (stage / "rank-00001-of-00004.safetensors").write_bytes(bytes(data))
    (stage / ".reshard-1-00ff-rank-00002-of-00004.safetensors.tmp").write_bytes(b"torn")
    p = run(
        "convert", str(tp4), str(out), "--source-layout", lay, "--target-mesh", "tp=4", "--resume", "--json"
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed_files"] == 1
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))
    for n in os.listdir(ref):
        assert (out / n).read_bytes() == (ref / n).read_bytes(), n


ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]


def test_every_safetensors_dtype_is_carried_byte_exactly(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    full = {}
    for i, dt in enumerate(ALL_DTYPES):
        raw = torch.randint(
            0, 256, (11, 5 * torch.empty(0, dtype=dt).element_size()), generator=gen, dtype=torch.uint8
        )
        full[f"t{i}.w"] = raw.view(dt) if dt != torch.bool else (raw % 2).to(torch.bool)
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "t1*": {tp: S(0)}\n  "*": {tp: S(1)}\n')
    assert (
        run(
            "convert",
            str(tmp_path / "model.safetensors"),
            str(tmp_path / "tp4"),
            "--target-layout",
            str(tmp_path / "l.yaml"),
        ).returncode
        == 0
    )
    p = run("convert", str(tmp_path / "tp4"), str(tmp_path / "tp3"), "--target-mesh", "tp=3")
    assert p.returncode == 0, p.stderr
    p = run("convert", str(tmp_path / "tp3"), str(tmp_path / "hf"), "--consolidate")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "hf" / "model.safetensors").read_bytes()[8:] != b""
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for n, t in full.items():
        assert got[n].dtype == t.dtype, n
        assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
    # and the whole file is the reference writer's bytes
    ref = tmp_path / "ref.safetensors"
    save_file(full, str(ref), metadata={"format": "pt"})
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == ref.read_bytes()


def test_rule_matching_nothing_is_a_warning(tp4: Path, tmp_path: Path) -> None:
    lay = tmp_path / "extra.yaml"
    lay.write_text(LAYOUT.replace('  "*": R\n', '  "*.never": {tp: S(0)}\n  "*": R\n'))
    p = run("convert", str(tp4), str(tmp_path / "o"), "--source-layout", str(lay), "--consolidate", "--json")
    assert p.returncode == 0, p.stderr
    warnings = json.loads(p.stdout)["warnings"]
    assert warnings[0] == f"{lay}:6: rule '*.never' matches no tensor"
    assert len(warnings) == 2 and "no config.json" in warnings[1]  # hf output without model files
    assert "matches no tensor" in p.stderr


def test_exclude_from_a_checkpoint_reshard_wrote(tp4: Path, tmp_path: Path) -> None:
    """--exclude on a source whose reshard.json counts its tensors: the count of what is kept is
    compared, so a sound checkpoint converts, and one whose files lost a tensor is still refused."""
    lay = str(tmp_path / "tp.yaml")
    assert (
        run("convert", str(tp4), str(tmp_path / "hf"), "--source-layout", lay, "--consolidate").returncode
        == 0
    )
    assert "tensor_count" in json.loads((tmp_path / "hf" / "reshard.json").read_text())
    for cmd in (
        (
            "convert",
            str(tmp_path / "hf"),
            str(tmp_path / "tp2"),
            "--target-layout",
            lay,
            "--target-mesh",
            "tp=2",
        ),
        ("inspect", str(tmp_path / "hf"), "--check"),
        ("verify", str(tmp_path / "hf"), str(tp4), "--layout-b", lay),
    ):
        p = run(*cmd, "--exclude", "layers.0.w*")
        assert p.returncode == 0, (cmd, p.stderr)
    got = load_file(str(tmp_path / "tp2" / "rank-00001-of-00002.safetensors"))
    assert sorted(got) == ["layers.0.gate_up", "layers.0.norm", "scalar", "tiny"]
    # the files lose a tensor the manifest counts: refused with or without --exclude
    ref = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del ref["tiny"]
    save_file(ref, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    p = run("inspect", str(tmp_path / "hf"), "--check", "--exclude", "layers.0.w*")
    assert p.returncode == 1 and "holds 6 tensors, but the files hold 5" in p.stderr, p.stderr


@pytest.mark.parametrize(
    ("to", "files"),
    [
        ("per-rank", ["rank-00000-of-00001.safetensors"]),
        ("sharded-state", ["model-rank-0-part-0.safetensors"]),
        ("dcp", [".metadata", "__0_0.distcp"]),
        ("hf", ["model.safetensors"]),
    ],
)
def test_to_format_alone_writes_one_rank_in_every_format(tmp_path: Path, to: str, files: list[str]) -> None:
    """``convert HF OUT --to FORMAT`` with no target layout or mesh: every tensor whole on one rank,
    in that format. ``--to per-rank`` and ``--to sharded-state`` said "say what to convert to"
    (exit 2) where ``--to dcp`` wrote a one-rank checkpoint."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file(FULL, str(src / "model.safetensors"))
    out = tmp_path / f"out-{to}"
    p = run("convert", str(src), str(out), "--to", to, "--quiet")
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in out.iterdir()) == sorted([*files, "reshard.json"])
    doc = json.loads(run("inspect", str(out), "--check", "--json").stdout)
    assert doc["ok"] is True and doc["format"] == to
    assert doc["mesh"] in (None, {"names": ["world"], "shape": [1]})
    assert all(t["pieces"] == 1 and t["local_shapes"] == [t["shape"]] for t in doc["tensors"])
    v = run("verify", str(src), str(out))
    assert v.returncode == 0, v.stdout + v.stderr
    if to != "dcp":  # torch reads the rank's file as the whole model
        (f,) = files
        got = load_file(str(out / f))
        assert sorted(got) == sorted(FULL) and all(torch.equal(got[n], t) for n, t in FULL.items())


def test_no_target_at_all_names_the_options(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    save_file(FULL, str(src / "model.safetensors"))
    p = run("convert", str(src), str(tmp_path / "o"))
    assert p.returncode == 2, p.stderr
    for option in ("--target-layout", "--target-mesh", "--consolidate", "--to FORMAT"):
        assert option in p.stderr
    assert not (tmp_path / "o").exists()
