"""Inputs found by a second independent red-team pass: real files, real CLI runs.

Each test here failed before its fix: a traceback or a wrong exit code where a user error
must exit 2 with a message naming the file, tensor or rule, and leave nothing in DST.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _hf(root: Path) -> Path:
    from safetensors.numpy import save_file

    np = pytest.importorskip("numpy")
    src = root / "src"
    src.mkdir()
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("below", [False, True])
def test_a_destination_through_a_loop_of_symlinks_exits_2(tmp_path: Path, below: bool) -> None:
    """DST a link in a loop (or a path below one): exit 2 naming it, not Python 3.11's
    ``RuntimeError: Symlink loop`` traceback from ``Path.resolve`` (exit 1)."""
    src = _hf(tmp_path)
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    dst = tmp_path / "loop1" / "x" if below else tmp_path / "loop1"
    r = run_cli("convert", src, dst, "--consolidate", "--json")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["error"]["path"] == str(dst)
    assert "Too many levels of symbolic links" in doc["error"]["message"], doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop1", "loop2", "src"]


def _pt_with_extra(path: Path, extra: bytes) -> Path:
    """A ``torch.save({"w": ...})`` file whose ``data.pkl`` also sets key ``"n"`` to what the
    pickle opcodes ``extra`` build (torch's own archive, only the pickle edited)."""
    import zipfile

    torch = pytest.importorskip("torch")
    path.mkdir()
    f = path / "model.pt"
    torch.save({"w": torch.ones(2)}, f)
    with zipfile.ZipFile(f) as z:
        recs = {n: z.read(n) for n in z.namelist()}
    pk = next(n for n in recs if n.endswith("/data.pkl"))
    assert recs[pk].endswith(b".")
    recs[pk] = recs[pk][:-1] + b"X\x01\x00\x00\x00n" + extra + b"s."  # BINUNICODE "n", ..., SETITEM
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
        for n, data in recs.items():
            z.writestr(n, data)
    return path


DEEP = b"]" * 100_000 + b"a" * 99_999  # EMPTY_LIST x 100k, APPEND x (100k - 1): [[[...]]]
CYCLE = b"]r\xff\x00\x00\x00j\xff\x00\x00\x00a"  # L = []; L.append(L)
# L0 = []; L(i+1) = [Li, Li], 60 times: a few hundred bytes naming 2**60 leaves
BOMB = b"]" + b"r\xfe\x00\x00\x000]j\xfe\x00\x00\x00aj\xfe\x00\x00\x00a" * 60


@pytest.mark.parametrize("kind", ["deep", "cycle"])
def test_a_pt_pickle_nested_past_the_recursion_limit_exits_2(tmp_path: Path, kind: str) -> None:
    """Lists nested 100,000 deep, or a list that holds itself, in a ``.pt``'s pickle: exit 2
    naming the file and the bound, not a RecursionError traceback (exit 1)."""
    src = _pt_with_extra(tmp_path / "src", DEEP if kind == "deep" else CYCLE)
    for args in (["inspect", src], ["convert", src, tmp_path / "out", "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert f"{src / 'model.pt'}: the torch.save pickle nests dicts and lists more than 256" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_pt_pickle_naming_2_to_the_60_leaves_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One list referred to twice at each of 60 levels: refused at the node bound (it walked
    2**60 leaves, for ever)."""
    from reshard.errors import HeaderError
    from reshard.formats import pt

    src = _pt_with_extra(tmp_path / "src", BOMB)
    monkeypatch.setattr(pt, "MAX_PT_NODES", 10_000)
    with pytest.raises(HeaderError, match="names more than 10,000 containers and values"):
        pt.read_pt(src / "model.pt")
    nested = _pt_with_extra(tmp_path / "ok", b"}X\x01\x00\x00\x00a]K\x01as")  # {"a": [1]}: fine
    assert sorted(pt.read_pt(nested / "model.pt").others) == ["n.a.0"]


def test_pt_keys_that_join_to_one_name_are_named_with_their_file(tmp_path: Path) -> None:
    """``{"a.b": t, "a": {"b": t2}}`` saved by torch: both are "a.b" once joined; the error names
    the file (it was 'duplicate tensor name "a.b"' with no file, and no path in --json)."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(3)}}, src / "model.pt")
    r = run_cli("convert", src, tmp_path / "out", "--consolidate", "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["path"] == str(src / "model.pt") and err["tensor"] == "a.b"
    want = f'{src / "model.pt"}: two tensors of the state dict are both named "a.b"'
    assert err["message"].startswith(want)
    assert not (tmp_path / "out").exists()


def _accelerate_state(root: Path, *, scheduler: bool) -> Path:
    """What accelerate's ``save_state`` leaves for FSDP with ``SHARDED_STATE_DICT``: the model and
    the optimizer in DCP sub-directories (``dcp.save({"model": ...})``, as its save_fsdp_model
    calls it), and beside them ``scheduler.bin`` (``torch.save`` of the scheduler's state dict)."""
    import warnings

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = root / "state"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        model_dir = str(state / "pytorch_model_fsdp_0")
        dcp.save({"model": model.state_dict()}, checkpoint_id=model_dir, no_dist=True)
        dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=str(state / "optimizer_0"), no_dist=True)
    if scheduler:
        torch.save(torch.optim.lr_scheduler.StepLR(opt, 3).state_dict(), state / "scheduler.bin")
    return state


def test_trainer_rng_states_beside_the_checkpoints_hint_at_them(tmp_path: Path) -> None:
    """HF Trainer's ``rng_state_{r}.pth`` (numpy's RNG state inside) beside accelerate's FSDP
    sub-directories: they are read as pt rank files and refused (a numpy global), and the error
    now says which sub-directory holds the model."""
    import random

    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    state = _accelerate_state(tmp_path, scheduler=False)
    for r in range(2):
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
        torch.save(rng, state / f"rng_state_{r}.pth")
    r = run_cli("convert", state, tmp_path / "hf", "--consolidate", "--json")
    assert r.returncode == 2, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["path"] == str(state / "rng_state_0.pth")
    assert err["hint"] == (
        "its sub-directories hold checkpoints: optimizer_0/ (dcp), pytorch_model_fsdp_0/ (dcp): "
        f"give one of them as the path (e.g. {state / 'pytorch_model_fsdp_0'})"
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("scheduler", [True, False])
def test_accelerate_save_state_directory_points_at_the_model(tmp_path: Path, scheduler: bool) -> None:
    """SRC the directory accelerate's ``save_state`` wrote: exit 2 naming the sub-directories that
    hold the checkpoints. With its ``scheduler.bin`` it was read as a one-file pt checkpoint of no
    tensors and converted to an empty model, exit 0; without, 'no checkpoint found'."""
    state = _accelerate_state(tmp_path, scheduler=scheduler)
    out = tmp_path / "hf"
    for args in (["inspect", state], ["convert", state, out, "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        assert "optimizer_0/ (dcp), pytorch_model_fsdp_0/ (dcp)" in r.stderr, r.stderr
        assert f"(e.g. {state / 'pytorch_model_fsdp_0'})" in r.stderr
        if scheduler:
            assert "scheduler.bin holds no tensors, only 8 other value(s)" in r.stderr
    assert not out.exists()
    r = run_cli("convert", state / "pytorch_model_fsdp_0", out, "--consolidate", "--quiet")
    assert r.returncode == 0, r.stderr
    if scheduler:
        r = run_cli("inspect", state / "scheduler.bin")
        assert r.returncode == 2 and "scheduler.bin: holds no tensors" in r.stderr, r.stderr


DROP = object()


def _edit_rank_metadata(path: Path, edit: dict[str, object]) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()["reshard"])
    meta.update(edit)
    meta = {k: v for k, v in meta.items() if v is not DROP}
    save_file(load_file(str(path)), str(path), metadata={"reshard": json.dumps(meta)})


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"coordinate": [1]}, "coordinate [1] is not rank 0's [0] on mesh tp=2"),  # rank 1's
        ({"coordinate": [5]}, "coordinate [5] is not rank 0's [0] on mesh tp=2"),
        ({"rank": "0"}, "rank '0' is not a rank of mesh tp=2"),
        ({"rank": 7}, "rank 7 is not a rank of mesh tp=2"),
        # the messages were the bare KeyError: "invalid reshard metadata ('9')", "(... ('mesh'))"
        ({"layout": "9"}, '"layout" code \'9\' names no entry of "placements" (it has 1)'),
        ({"mesh": DROP}, "no 'mesh' field"),
    ],
)
def test_rank_metadata_contradicting_itself_exits_2(
    tmp_path: Path, edit: dict[str, object], said: str
) -> None:
    """A per-rank file whose reshard metadata gives a coordinate that is not its rank's (or a rank
    that is no int of the mesh): exit 2 naming the file. The coordinate was not read (exit 0),
    a string rank was taken as a number."""
    src = _hf(tmp_path)
    tp2 = tmp_path / "tp2"
    layout = tmp_path / "tp2.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements: {"*": {tp: S(1)}}\n')
    assert run_cli("convert", src, tp2, "--target-layout", layout, "--quiet").returncode == 0
    (tp2 / "reshard.json").unlink()  # the files' own descriptions are what is read
    _edit_rank_metadata(tp2 / "rank-00000-of-00002.safetensors", edit)
    for args in (["inspect", tp2], ["convert", tp2, tmp_path / "hf", "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        assert f"{tp2 / 'rank-00000-of-00002.safetensors'}: invalid reshard metadata ({said})" in r.stderr
    assert not (tmp_path / "hf").exists()


KILL_AT_FIRST_MOVE = """\
import os, signal, sys
real, dst = os.replace, os.path.abspath(sys.argv[1])
def replace(a, b):
    real(a, b)
    if os.path.dirname(os.path.abspath(b)) == dst:  # the swap's first move into DST
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
sys.argv = ["reshard", *sys.argv[2:]]
from reshard.cli import main
main()
"""


@pytest.mark.parametrize("to", ["per-rank", "dcp"])
def test_killed_while_swapping_leaves_no_checkpoint_of_two_sources(tmp_path: Path, to: str) -> None:
    """``convert --overwrite`` SIGKILLed after its first move into DST. DST held the new rank 0
    beside the old rank 1 (a name the new checkpoint replaces was left until its turn), which
    ``inspect --check`` called ok and ``convert`` converted, exit 0: half of each source. Now the
    old files go first, the files naming the others (DCP's ``.metadata``) move in last, and a
    directory with a finished checkpoint in its staging directory is refused until a convert
    finishes the move."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.arange(24, dtype=np.float32).reshape(4, 6)}, str(a))
    save_file({"w": -np.arange(24, dtype=np.float32).reshape(4, 6) - 1}, str(b))
    layout = tmp_path / "tp2.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements: {"*": {tp: S(0)}}\n')
    dst = tmp_path / "dst"
    args = ["convert", dst, "--target-layout", layout, "--to", to, "--quiet"]
    assert run_cli(*args[:1], a, *args[1:]).returncode == 0
    old = {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()}
    cmd = [sys.executable, "-c", KILL_AT_FIRST_MOVE, dst, *args[:1], b, *args[1:], "--overwrite"]
    killed = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    for p in dst.iterdir():  # no file of the previous checkpoint is left beside the new ones
        assert not (p.is_file() and p.name in old and old[p.name] == p.read_bytes()), p.name
    assert not (dst / "reshard.json").exists() and not (dst / ".metadata").exists()
    out = tmp_path / "hf"
    for r in (run_cli("inspect", dst, "--check"), run_cli("convert", dst, out, "--consolidate")):
        assert r.returncode == 2, r.stderr
        assert f"{dst}: a reshard convert into this directory was interrupted while it moved" in r.stderr
    assert not out.exists()
    assert run_cli(*args[:1], b, *args[1:], "--overwrite").returncode == 0  # finishes, then writes
    assert run_cli("verify", dst, b).returncode == 0
    assert run_cli("inspect", dst, "--check").returncode == 0


@pytest.mark.parametrize(
    "pattern",
    ["re:(a+)+b", "*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*b", "{x}{y}{z}{w}{v}{u}b"],
)
def test_a_transform_pattern_that_backtracks_for_ever_is_linear(tmp_path: Path, pattern: str) -> None:
    """A ``--transforms`` rename whose pattern backtracks exponentially (or as n**22) on
    Python's ``re`` against a 200-character name: the plan ran for ever (killed after 60 s).
    Layout rules already ran on RE2; transform patterns now do where they could backtrack."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file(
        {"a" * 200: np.zeros(2, np.float32), "x.y": np.ones(2, np.float32)}, str(src / "model.safetensors")
    )
    spec = tmp_path / "t.yaml"
    spec.write_text(
        "transforms:\n"
        f"  - rename: {{from: {json.dumps(pattern)}, to: z, optional: true}}\n"
        "allow_unused: true\n"
    )
    r = subprocess.run(
        [str(RESHARD), "plan", src, "--consolidate", "--transforms", spec, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True


def test_transform_patterns_on_re2_capture_as_python_re() -> None:
    """RE2 gives the captures Python's ``re`` gives (leftmost, greedy ``*``) for the patterns it
    now runs, and a pattern repeating a {name} where that is not possible is refused."""
    import re

    from reshard.errors import ConfigError
    from reshard.transforms import NamePattern

    names = ["a.b.c.d", "model.layers.3.mlp.w1.weight", "x_y_z.w", "aaa.b", "ab" * 20, "a.weight.weight"]
    for text in [
        "*.*",
        "*.{a}.*",
        "{a}_{b}.*",
        "*{a}",
        "*.weight",
        "{a}.{b}*",
        "*_*",
        "re:(?P<p>.*)\\.(\\w+)",
    ]:
        pat = NamePattern(text)
        body = text[3:] if text.startswith("re:") else None
        if body is None:
            body = "".join(
                "(.*)" if t == "*" else f"(?P<{t[1:-1]}>[^.]+)" if t.startswith("{") else re.escape(t)
                for t in re.split(r"(\*|\{[a-z]+\})", text)
                if t
            )
        want = re.compile(body)
        for n in names:
            got, ref = pat.match(n), want.fullmatch(n)
            assert (got is None) == (ref is None), (text, n)
            if ref is not None:
                assert got is not None and got.groups() == ref.groups() and got.groupdict() == ref.groupdict()
    assert NamePattern("layers.{i}.x.{i}").match("layers.3.x.3") is not None  # dot-ended: on re
    with pytest.raises(ConfigError, match="repeats a {name}"):
        NamePattern("{i}_{i}")


@pytest.mark.parametrize("key", ["saved_offsets", "global_shape"])
def test_dcp_safetensors_offsets_past_int64_exit_2(tmp_path: Path, key: str) -> None:
    """A DCP_SHARDING_INFO whose saved_offsets (or global_shape) put a tensor past 2**63 - 1
    elements: exit 2 naming the file and tensor. ``inspect`` showed a shape
    [1180591620717411303427, 4], exit 0, and ``inspect --check`` called it a hole (exit 1)."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    info = (
        {"saved_offsets": [2**70, 0]}
        if key == "saved_offsets"
        else {"saved_offsets": [0, 0], "global_shape": [2**40, 2**40]}
    )
    for i, (part, off) in enumerate(((x[:1], [0, 0]), (x[1:], None))):
        meta = {"x": {"saved_offsets": off} if off is not None else info}
        save_file(
            {"x": np.ascontiguousarray(part)},
            str(src / f"shard-0000{i + 1}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps(meta), "DCP_VERSION": "1.0"},
        )
    bad = src / "shard-00002-model-00001-of-00001.safetensors"
    for args in (
        ["inspect", src],
        ["inspect", src, "--check"],
        ["convert", src, tmp_path / "o", "--consolidate"],
    ):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert f'{bad}: tensor "x": ' in r.stderr and "over 9223372036854775807 elements" in r.stderr, (
            r.stderr
        )
    assert not (tmp_path / "o").exists()


def test_dcp_metadata_size_past_int64_exits_2(tmp_path: Path) -> None:
    """A DCP ``.metadata`` (torch's own, its size edited) giving a tensor more than 2**63 - 1
    elements: exit 2 naming it. ``inspect`` showed 18,446,744,073,709,551,625 elements (exit 0)
    and ``--check`` called it a hole (exit 1)."""
    import dataclasses
    import pickle
    import warnings

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.ones(4, 3), "b": torch.arange(5)}, checkpoint_id=str(src), no_dist=True)
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["a"] = dataclasses.replace(
        md.state_dict_metadata["a"], size=torch.Size([4, 2**62])
    )
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for args in (
        ["inspect", src],
        ["inspect", src, "--check"],
        ["convert", src, tmp_path / "o", "--consolidate"],
    ):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert f'{src / ".metadata"}: tensor "a" has size [4, 4611686018427387904], over' in r.stderr, (
            r.stderr
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["deep", "bigint"])
def test_a_model_config_json_python_cannot_parse_exits_2(tmp_path: Path, kind: str) -> None:
    """``--model-config`` (or SRC/config.json, which --transforms reads by default) nesting
    100,000 objects deep, or holding a 5000-digit integer: exit 2 naming it, not a
    RecursionError / ValueError traceback (exit 1)."""
    src = _hf(tmp_path)
    text = '{"a":' * 100_000 + "1" + "}" * 100_000 if kind == "deep" else '{"a": ' + "9" * 5000 + "}"
    (src / "config.json").write_text(text)
    spec = tmp_path / "t.yaml"
    spec.write_text('transforms:\n  - rename: {"w": "v"}\n')
    out = tmp_path / "o"
    for extra in ([], ["--model-config", src / "config.json"]):
        r = run_cli("convert", src, out, "--consolidate", "--transforms", spec, *extra)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert f"{src / 'config.json'}: not" in r.stderr, r.stderr
    assert not out.exists()


KILL_AT_FIRST_FINISHED = """\
import os, signal, sys
import reshard.convert as c
record = c.record_finished
def finished(*args, **kwargs):
    record(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # one output file finished and journaled, the others not
c.record_finished = finished
sys.argv = ["reshard", *sys.argv[1:]]
from reshard.cli import main
main()
"""

DAMAGED = [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe not UTF-8", b'{"source": 5}', b'{"source": {"a": 5}}']


@pytest.mark.parametrize("line", range(len(DAMAGED)))
def test_resume_with_a_damaged_journal(tmp_path: Path, line: int) -> None:
    """``--resume`` onto a staging directory whose journal is damaged (nested past the recursion
    limit, not UTF-8, wrong types): a damaged first line (the source record) is refused as an
    unrecorded source (exit 2), a damaged later line is skipped; both were tracebacks (exit 1)."""
    src = _hf(tmp_path)
    layout = tmp_path / "tp2.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements: {"*": {tp: S(1)}}\n')
    dst = tmp_path / "dst"
    args = ["convert", src, dst, "--target-layout", layout, "--quiet"]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_FIRST_FINISHED, *map(str, args)], timeout=120)
    assert killed.returncode == -9
    journal = dst / ".reshard-staging" / ".reshard-progress.jsonl"
    lines = journal.read_bytes().splitlines()
    assert len(lines) == 2  # the source record and one finished file
    bad = DAMAGED[line]
    journal.write_bytes(bad + b"\n" + lines[1] + b"\n")
    r = run_cli(*args, "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the interrupted run did not record it" in r.stderr
    journal.write_bytes(lines[0] + b"\n" + bad + b"\n")  # a damaged finished-file line: skipped
    r = run_cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert run_cli("verify", dst, src).returncode == 0


def test_dtype_with_a_config_json_nested_past_the_recursion_limit_exits_2(tmp_path: Path) -> None:
    """``convert --dtype bf16`` rewrites the copied config.json's dtype: one nested 100,000 deep
    exits 2 naming it (a RecursionError traceback, exit 1), and nothing is left in DST."""
    src = _hf(tmp_path)
    (src / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    out = tmp_path / "o"
    r = run_cli("convert", src, out, "--consolidate", "--dtype", "bf16")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "config.json: nests arrays or objects deeper than Python can read" in r.stderr
    assert not out.exists()


def test_a_transform_making_a_tensor_past_int64_exits_2(tmp_path: Path) -> None:
    """A ``pad`` to ``padded_size: 10**23``: exit 2 naming the rule and tensor, not an
    ``OverflowError: int too big to convert`` traceback (exit 1) while the output header was laid out."""
    src = _hf(tmp_path)
    spec = tmp_path / "pad.yaml"
    spec.write_text('transforms:\n  - pad: {tensors: "w", dim: 0, padded_size: 100000000000000000000000}\n')
    for cmd in (["plan", src], ["convert", src, tmp_path / "o"]):
        r = run_cli(*cmd, "--consolidate", "--transforms", spec)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert (
            f'{spec}:2: transforms rule 1 (pad): "w" would have shape [100000000000000000000000, 4]'
            in r.stderr
        )
    assert not (tmp_path / "o").exists()


def test_a_stack_count_of_10_to_the_12_is_refused_without_making_its_range(tmp_path: Path) -> None:
    """``stack`` with ``count: 1000000000000`` and two layers: exit 2 naming the first missing
    indices. It built ``set(range(count))`` to find them: the plan was killed by the kernel for
    memory (exit 137)."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file(
        {f"layers.{i}.w": np.zeros((2, 3), np.float32) for i in range(2)}, str(src / "model.safetensors")
    )
    spec = tmp_path / "s.yaml"
    spec.write_text(
        'transforms:\n  - stack: {from: "layers.{i}.w", to: "w", index: i, count: 1000000000000}\n'
    )
    r = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -v 4000000; exec "$@"',
            "-",
            str(RESHARD),
            "plan",
            str(src),
            "--consolidate",
            "--transforms",
            str(spec),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "stacking needs indices 0..999999999999; missing [2, 3, 4, 5, 6, 7, 8, 9]" in r.stderr
