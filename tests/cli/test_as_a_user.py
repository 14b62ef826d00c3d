"""The CLI as a user meets it (issue 14): honest messages, verbatim names, pictures, --verify.

Real files written by safetensors/torch in the test, real ``reshard`` subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

RESHARD = str(Path(sys.executable).parent / "reshard")

FULL = {
    "model.layers.0.wq": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),
    "model.layers.0.wo": torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8),
    "model.norm": torch.ones(6, dtype=torch.float32),
}

TP_LAYOUT = """\
mesh: {tp: 4}
placements:
  "*.wq": {tp: S(0)}
  "*.wo": {tp: S(1)}
  "*": R
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RESHARD_DEBUG", "NO_COLOR")}
    return subprocess.run(
        [RESHARD, *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=120
    )


def save_hf(path: Path, tensors: dict[str, torch.Tensor] = FULL) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture()
def hf(tmp_path: Path) -> Path:
    return save_hf(tmp_path / "hf")


@pytest.fixture()
def layout(tmp_path: Path) -> Path:
    p = tmp_path / "tp.yaml"
    p.write_text(TP_LAYOUT)
    return p


# --- 3. HF weight files as transformers picks them ------------------------------------


def test_single_file_beats_index_and_inspect_and_convert_warn(tmp_path: Path) -> None:
    both = save_hf(tmp_path / "both")
    other = {k: v + 1 for k, v in FULL.items()}
    shard = "model-00001-of-00001.safetensors"
    save_file(other, str(both / shard), metadata={"format": "pt"})
    (both / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(other, shard)})
    )
    p = run("inspect", str(both))
    assert p.returncode == 0, p.stderr
    assert "warning:" in p.stderr and "reading model.safetensors, as transformers does" in p.stderr
    doc = json.loads(run("inspect", str(both), "--json").stdout)
    assert [f["name"] for f in doc["files"]] == ["model.safetensors"]
    assert any("holds both" in w for w in doc["warnings"])
    out = tmp_path / "out"
    p = run("convert", str(both), str(out), "--to", "hf")
    assert p.returncode == 0, p.stderr
    assert "holds both model.safetensors and model.safetensors.index.json" in p.stderr
    got = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in FULL.items())  # the single file's values


# --- 4. inspect --check claims only checks it made --------------------------------------


def test_check_without_manifest_says_no_checksums(hf: Path, tmp_path: Path) -> None:
    p = run("inspect", str(hf), "--check")
    assert p.returncode == 0, p.stderr
    assert "check: ok (full coverage, no checksums recorded (reshard.json absent))" in p.stderr
    assert "checksums match" not in p.stderr
    doc = json.loads(run("inspect", str(hf), "--check", "--json").stdout)
    assert doc["check"]["verified"] == ["full coverage", "no checksums recorded (reshard.json absent)"]

    out = tmp_path / "tp4"
    assert run("convert", str(hf), str(out), "--target-layout", str(tmp_path / "tp.yaml")).returncode == 2
    (tmp_path / "tp.yaml").write_text(TP_LAYOUT.replace('"*": R', '"*": R\n').replace("tp: 4", "tp: 2"))
    assert run("convert", str(hf), str(out), "--target-layout", str(tmp_path / "tp.yaml")).returncode == 0
    p = run("inspect", str(out), "--check")
    assert p.returncode == 0, p.stderr
    assert "check: ok (full coverage, replicas equal, checksums in reshard.json match)" in p.stderr


# --- 6. a placement that does not fit names tensor, file, line and rule -----------------


def test_placement_that_does_not_fit_names_tensor_file_line_rule(hf: Path, tmp_path: Path) -> None:
    lay = tmp_path / "bad.yaml"
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "*.wq": {tp: S(0)}\n  "*.wo": {tp: S(5)}\n  "*": R\n')
    dst = tmp_path / "o"
    p = run("convert", str(hf), str(dst), "--target-layout", str(lay), "--json")
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout)["error"]
    assert err["message"].startswith(f"{lay}:4: rule '*.wo': ")
    assert 'tensor "model.layers.0.wo" of shape [6, 8]' in err["message"]
    assert "S(5) does not fit a 2-d tensor" in err["message"]
    assert err["tensor"] == "model.layers.0.wo" and err["path"] == str(lay)
    assert not dst.exists() and "Traceback" not in p.stderr
    p = run("plan", str(hf), "--target-layout", str(lay))
    assert p.returncode == 2 and f"{lay}:4: rule '*.wo'" in p.stderr


# --- 5. user text shown verbatim -----------------------------------------------------

ODD = {
    "experts[gate].weight": torch.ones(4, 2),
    "a.[/bad].b": torch.zeros(2),
    "esc\x1b[31mred": torch.zeros(3),
    ":smile: [bold]x[/bold]": torch.zeros(1),
}


def test_inspect_all_shows_odd_names_verbatim(tmp_path: Path) -> None:
    src = save_hf(tmp_path / "odd[dir]", ODD)
    p = run("inspect", str(src), "--all")
    assert p.returncode == 0, p.stderr
    for name in ("experts[gate].weight", "a.[/bad].b", "esc\\x1b[31mred", ":smile: [bold]x[/bold]"):
        assert name in p.stderr, name
    assert "\x1b" not in p.stderr and "odd[dir]" in p.stderr
    p = run("plan", str(src), "--consolidate")
    assert p.returncode == 0, p.stderr
    assert "odd[dir]" in p.stderr


def test_error_and_rule_warnings_keep_brackets(tmp_path: Path) -> None:
    src = save_hf(tmp_path / "hf", ODD)
    lay = tmp_path / "odd.yaml"
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "*.[qkv]_proj": {tp: S(0)}\n  "*": R\n')
    p = run("convert", str(src), str(tmp_path / "o"), "--target-layout", str(lay))
    assert p.returncode == 0, p.stderr
    assert "rule '*.[qkv]_proj' matches no tensor" in p.stderr
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "experts[[]gate].weight": {tp: S(3)}\n  "*": R\n')
    p = run("convert", str(src), str(tmp_path / "o2"), "--target-layout", str(lay))
    assert p.returncode == 2
    assert "rule 'experts[[]gate].weight'" in p.stderr and 'tensor "experts[gate].weight"' in p.stderr
    p = run("convert", str(tmp_path / "no[/bad]\x1b[31m"), str(tmp_path / "o3"), "--consolidate")
    assert p.returncode == 2
    assert "no[/bad]\\x1b[31m: no such file or directory" in p.stderr and "\x1b" not in p.stderr


def test_convert_help_shows_workers_default() -> None:
    p = run("convert", "--help", env={"COLUMNS": "200"})
    assert p.returncode == 0
    assert "[default: cores, at most 4]" in p.stdout


# --- 7. convert --verify ----------------------------------------------------------------


def test_convert_verify_proves_output_equal(hf: Path, layout: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp4"
    p = run("convert", str(hf), str(out), "--target-layout", str(layout), "--verify", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and doc["verify"]["equal"] is True
    assert doc["verify"]["tensors"] == 3 and doc["verify"]["bytes_compared"] == sum(
        t.numel() * 4 for t in FULL.values()
    )
    p = run("convert", str(out), str(tmp_path / "back"), "--consolidate", "--verify")
    assert p.returncode == 0 and "verified: equal to the source" in p.stderr, p.stderr
    p = run("convert", str(out), str(tmp_path / "x"), "--consolidate", "--verify", "--dtype", "bf16")
    assert p.returncode == 2 and "--dtype changes the bits" in p.stderr


# --- 1. inspect/plan --show NAME ---------------------------------------------------------


def run_on_tty(*args: str, no_color: bool) -> str:
    """stdout of ``reshard ARGS`` on a pseudo-terminal, as a user sees it."""
    import pty

    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update({"TERM": "xterm-256color", "COLUMNS": "200"} | ({"NO_COLOR": "1"} if no_color else {}))
    proc = subprocess.Popen([RESHARD, *args], stdout=child, stderr=subprocess.DEVNULL, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(main)
    assert proc.returncode == 0
    return b"".join(chunks).decode()


def test_inspect_show_per_rank_layout_and_hf_pieces(hf: Path, layout: Path, tmp_path: Path) -> None:
    tp4 = tmp_path / "tp4"
    assert run("convert", str(hf), str(tp4), "--target-layout", str(layout)).returncode == 0
    p = run("inspect", str(tp4), "--show", "model.layers.0.wo")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "model.layers.0.wo: shape [6, 8] on mesh tp=4, placements (S(1))"
    assert "│ 0:6           │  0  │  1  │  2  │  3  │" in p.stdout
    assert "\x1b" not in p.stdout and "┃" not in p.stdout  # the picture, not the table
    p = run("inspect", str(hf), "--show", "model.layers.0.wq")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "model.layers.0.wq: shape [8, 6], 1 piece in 1 file"
    p = run("inspect", str(tp4), "--show", "model.layers.0.wx")
    assert p.returncode == 2 and "no tensor 'model.layers.0.wx'" in p.stderr
    assert "did you mean 'model.layers.0.wo'" in p.stderr or "did you mean 'model.layers.0.wq'" in p.stderr
    p = run("inspect", str(tp4), "--show", "model.norm", "--json")
    assert p.returncode == 2 and json.loads(p.stdout)["error"]["type"] == "UsageError"
    coloured = run_on_tty("inspect", str(tp4), "--show", "model.layers.0.wo", no_color=False)
    assert "\x1b[" in coloured and "0:6" in coloured
    bare = run_on_tty("inspect", str(tp4), "--show", "model.layers.0.wo", no_color=True)
    assert "\x1b" not in bare and "0:6" in bare


def test_plan_show_source_above_target(hf: Path, layout: Path, tmp_path: Path) -> None:
    tp4 = tmp_path / "tp4"
    assert run("convert", str(hf), str(tp4), "--target-layout", str(layout)).returncode == 0
    p = run("plan", str(tp4), "--target-mesh", "tp=2", "--show", "model.layers.0.wq")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "model.layers.0.wq: source"
    assert "model.layers.0.wq: target" in lines
    assert "shape [8, 6] on mesh tp=2, placements (S(0))" in lines
    assert "│ 4:8           │  1  │" in p.stdout and "│ 6:8           │  3  │" in p.stdout
    assert not list(tmp_path.glob("*/reshard.json.tmp"))
    p = run("plan", str(tp4), "--consolidate", "--show", "model.norm", "--json")
    assert p.returncode == 2 and "--show draws a picture" in json.loads(p.stdout)["error"]["message"]


# --- 2. hf outputs carry the model files ---------------------------------------------------


def test_model_files_are_checked_before_writing(hf: Path, layout: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"dtype": "float32",')  # broken
    (model / "tokenizer.json").write_text("{}")
    dst = tmp_path / "o"
    p = run("convert", str(hf), str(dst), "--to", "hf", "--config-from", str(model), "--dtype", "bf16")
    assert p.returncode == 2 and f"{model / 'config.json'}: not valid JSON" in p.stderr, p.stderr
    assert not dst.exists()
    (model / "config.json").unlink()
    p = run("convert", str(hf), str(dst), "--to", "hf", "--config-from", str(model))
    assert p.returncode == 2 and "no config.json there" in p.stderr and not dst.exists()
    p = run("convert", str(hf), str(dst), "--target-layout", str(layout), "--config-from", str(model))
    assert p.returncode == 2 and "this output is per-rank" in p.stderr and not dst.exists()
    (model / "config.json").write_text('{"torch_dtype": "float32"}')
    os.symlink(tmp_path / "tp.yaml", model / "vocab.txt")
    p = run(
        "convert", str(hf), str(dst), "--to", "hf", "--config-from", str(model), "--dtype", "fp16", "--json"
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["model_files"] == ["config.json", "tokenizer.json"]
    assert any("vocab.txt: not copied to the output: a symlink" in w for w in doc["warnings"])
    assert json.loads((dst / "config.json").read_text()) == {"torch_dtype": "float16"}


def test_model_file_copy_failure_exits_3_and_leaves_nothing(hf: Path, tmp_path: Path) -> None:
    """Weights (under 1 KiB) fit the file size limit, a 64 KiB tokenizer does not."""
    import resource
    import signal

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("x" * 65536)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))

    dst = tmp_path / "o"
    p = subprocess.run(
        [RESHARD, "convert", str(hf), str(dst), "--to", "hf", "--config-from", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    assert p.returncode == 3, p.stderr
    assert "copying tokenizer.json failed" in p.stderr
    assert not dst.exists()


# --- 8. scale-out as the README writes it ----------------------------------------------------


@pytest.mark.dist
def test_torchrun_module_form_with_verify_equals_one_process(hf: Path, layout: Path, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m reshard convert ... --verify`: the README's form."""
    from tests.dist.test_torchrun import assert_same_dirs, torchrun

    one = tmp_path / "one"
    assert run("convert", str(hf), str(one), "--target-layout", str(layout), "-q").returncode == 0
    dist = tmp_path / "dist"
    res = torchrun(
        2, "-m", "reshard", "convert", hf, dist, "--target-layout", layout, "--verify", teardown_abort_ok=True
    )
    assert_same_dirs(dist, one)
    assert "verified: equal to the source" in res.stderr + res.stdout
