"""Inputs found by an independent red-team pass: real files (torch's own writers), real CLI runs.

Each test here failed before its fix: a traceback or a wrong exit code where a user error
must exit 2 with a message naming the file, tensor or rule, and leave nothing in DST.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _dcp_saved(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    src = root / "dcp"
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        sd = {"a": torch.randn(4, 3, generator=g), "b": torch.arange(5)}
        dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    return src


@pytest.mark.parametrize("kind", ["dot", "subdir", "fifo"])
def test_dcp_data_file_that_is_not_a_regular_file_exits_2(tmp_path: Path, kind: str) -> None:
    """A ``.metadata`` naming a directory (``"."`` or a sub-directory) or a FIFO as the data
    file of a chunk: exit 2 naming it, not an ``OSError`` traceback from ``mmap``."""
    src = _dcp_saved(tmp_path)
    rel = {"dot": ".", "subdir": "sub", "fifo": "pipe.distcp"}[kind]
    if kind == "subdir":
        (src / "sub").mkdir()
    if kind == "fifo":
        os.mkfifo(src / rel)
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)  # torch's own Metadata, written back by pickle as torch writes it
    for k, v in md.storage_data.items():
        if k.fqn == "a":
            md.storage_data[k] = dataclasses.replace(v, relative_path=rel)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    out = tmp_path / "out"
    for args in (["inspect", src], ["inspect", src, "--check"], ["convert", src, out, "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert "not a regular file" in r.stderr and ".metadata" in r.stderr, r.stderr
    assert not out.exists()


def test_one_file_pt_to_a_multi_rank_mesh_and_a_bare_tensor(tmp_path: Path) -> None:
    """``torch.save`` of one state dict (a world of one, mesh ``world=1``) to ``--target-mesh tp=2``
    adds a dim (it exited 2: the file's rules were positional, one placement for a 2-dim mesh);
    ``torch.save(tensor)`` holds one tensor named ``""`` (it exited 2: "rule '': a rule pattern
    must be a non-empty string"). Both convert to what ``torch.load`` gives, bit for bit."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(4, 6, generator=g).to(torch.bfloat16), "n": {"b": torch.arange(5)}}
    (tmp_path / "sd").mkdir()
    torch.save(sd, tmp_path / "sd" / "model.pt")
    r = run_cli("convert", tmp_path / "sd", tmp_path / "tp2", "--target-mesh", "tp=2")
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "tp2").glob("rank-*.safetensors"))) == 2
    assert run_cli("verify", tmp_path / "sd", tmp_path / "tp2").returncode == 0
    assert run_cli("convert", tmp_path / "tp2", tmp_path / "hf", "--consolidate").returncode == 0
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == {"w", "n.b"}
    assert torch.equal(got["w"].view(torch.int16), sd["w"].view(torch.int16))
    assert torch.equal(got["n.b"], sd["n"]["b"])

    bare = torch.randn(3, 5, generator=g)
    (tmp_path / "bare").mkdir()
    torch.save(bare, tmp_path / "bare" / "t.pt")
    r = run_cli("convert", tmp_path / "bare", tmp_path / "bare_hf", "--consolidate")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "bare_hf" / "model.safetensors"))
    assert list(got) == [""] and torch.equal(got[""].view(torch.int32), bare.view(torch.int32))


def test_verify_where_every_tensor_differs_in_dtype_or_shape(tmp_path: Path) -> None:
    """``verify model model-fp32``: no tensor pair has a comparable dtype and shape (it crashed:
    ``TypeError: ufunc 'invert'`` on an empty float64 array, exit 1 with a traceback)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 3, generator=g)
    for name, sd in {
        "bf16": {"w": w.to(torch.bfloat16), "v": w[0].to(torch.bfloat16)},
        "f32": {"w": w, "v": w[0].clone()},
        "shape": {"w": w.reshape(3, 4).to(torch.bfloat16)},
    }.items():
        (tmp_path / name).mkdir()
        save_file(sd, str(tmp_path / name / "model.safetensors"))
    for b, kinds in (("f32", {"dtype"}), ("shape", {"shape", "missing"})):
        r = run_cli("verify", tmp_path / "bf16", tmp_path / b, "--json")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        doc = json.loads(r.stdout)
        assert doc["equal"] is False and {d["kind"] for d in doc["differences"]} == kinds


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["convert", "SRC", "OUT", "--consolidate", "--workers", "0"], "--workers"),
        (["convert", "SRC", "OUT", "--consolidate", "--no-such-option"], "--no-such-option"),
        (["inspect"], "Missing argument"),
        (["verify", "SRC"], "Missing argument"),
    ],
)
def test_json_usage_errors_the_parser_finds_are_one_json_document(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """SPEC 4: with ``--json``, exactly one JSON document on stdout, also when the option parser
    refuses the command line (stdout was empty: only a panel on stderr)."""
    from safetensors.torch import save_file

    (tmp_path / "src").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "src" / "model.safetensors"))
    argv = [{"SRC": str(tmp_path / "src"), "OUT": str(tmp_path / "out")}.get(a, a) for a in args]
    r = run_cli(*argv, "--json")
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"]["type"] == "UsageError"
    assert message in doc["error"]["message"] and message in r.stderr
    assert not (tmp_path / "out").exists()


def _rewrite_description(path: Path, edit: object) -> None:
    """Rewrite a per-rank file's ``reshard`` metadata through ``edit(dict) -> dict``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["reshard"] = json.dumps(edit(json.loads(meta["reshard"])))  # type: ignore[operator]
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("count", [1, 300])  # 300 uneven tensors: a description over 4 KiB
def test_rank_files_describing_the_tensors_otherwise_than_rank_0_exit_2(tmp_path: Path, count: int) -> None:
    """Only rank 0's description is read; a rank file whose own says ``S(0)`` where rank 0's
    says ``P(sum)`` (files of two checkpoints mixed, or edited) was converted by rank 0's word
    (the shards summed) and passed ``inspect --check``. Now exit 2 naming the file and the
    tensor, nothing written; a large description (kept past rank 0 as a digest) too."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    (tmp_path / "hf").mkdir()
    sd = {f"w{i}": torch.randn(7, 4, generator=g) for i in range(count)}
    sd["n"] = torch.randn(4, generator=g)
    save_file(sd, str(tmp_path / "hf" / "m.safetensors"))
    lay = tmp_path / "lay.yaml"
    lay.write_text('mesh: {tp: 2}\nplacements:\n  "w*": {tp: S(0)}\n  "*": R\n')
    src = tmp_path / "tp2"
    assert run_cli("convert", tmp_path / "hf", src, "--target-layout", lay).returncode == 0
    (src / "reshard.json").unlink()  # the files' own descriptions, as for files copied elsewhere
    assert run_cli("inspect", src, "--check").returncode == 0

    def partial(d: dict) -> dict:  # type: ignore[type-arg]
        d["placements"] = [["P(sum)"] if p == ["S(0)"] else p for p in d["placements"]]
        return d

    _rewrite_description(src / "rank-00000-of-00002.safetensors", partial)
    out = tmp_path / "out"
    for args in (["inspect", src], ["inspect", src, "--check"], ["convert", src, out, "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "rank-00001-of-00002.safetensors" in r.stderr and '"w0"' in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["dcp", "pt"])
def test_a_dtype_safetensors_has_no_name_for_is_named_as_such(tmp_path: Path, fmt: str) -> None:
    """``complex128`` (or ``float4_e2m1fn_x2``): the refusal named torch's dtype as "a class a DCP
    metadata (a torch.save) does not use", as if the file were hostile; it says what it is."""
    src = tmp_path / "src"
    sd = {"freqs": torch.randn(3, dtype=torch.complex128), "w": torch.ones(2)}
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    else:
        src.mkdir()
        torch.save(sd, src / "model.pt")
    r = run_cli("convert", src, tmp_path / "out", "--consolidate")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "safetensors has no such dtype" in r.stderr, r.stderr
    assert 'tensor "freqs" is torch.complex128 [3]' in r.stderr, r.stderr
    assert "--exclude 'freqs'" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["dcp", "pt", "dcp-object"])
def test_a_tensor_of_a_dtype_safetensors_lacks_can_be_left_out(tmp_path: Path, fmt: str) -> None:
    """A torch-written checkpoint holding one complex128 tensor was refused whole, even with
    ``--exclude`` naming it (the reader refused at the pickle): now it is listed as an item
    (inspect exits 0, naming it), ``convert``/``plan`` refuse it unless excluded, ``verify``
    never calls it equal unseen, and ``--exclude`` converts the rest bit for bit."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sd = {"freqs": torch.randn(3, dtype=torch.complex128), "w": w, "c": torch.ones(2, dtype=torch.complex64)}
    if fmt.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        # dcp-object: a nested dict stored whole, as one pickled object holding the tensors
        state, flat = ({"m": sd}, False) if fmt == "dcp-object" else (sd, True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = DefaultSavePlanner(flatten_state_dict=flat)
            dcp.save(state, checkpoint_id=str(src), no_dist=True, planner=planner)
    else:
        src.mkdir()
        torch.save(sd, src / "model.pt")
    p = "m." if fmt == "dcp-object" else ""
    r = run_cli("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(t["name"] for t in doc["tensors"]) == [f"{p}c", f"{p}w"]
    [item] = [n for n in doc["non_tensors"] if n["name"] == f"{p}freqs"]
    assert item["kind"] == "tensor of a dtype safetensors lacks", item
    assert any(f'"{p}freqs" is torch.complex128' in w for w in doc["warnings"]), doc["warnings"]
    r = run_cli("plan", src, "--consolidate")
    assert r.returncode == 2 and f"--exclude '{p}freqs'" in r.stderr, r.stderr
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--consolidate", "--exclude", f"{p}freqs")
    assert r.returncode == 0, r.stderr
    assert "freqs" not in r.stderr, r.stderr  # its warning went with it
    got = load_file(next(out.glob("*.safetensors")))
    assert sorted(got) == [f"{p}c", f"{p}w"]
    assert torch.equal(got[f"{p}w"], w) and torch.equal(got[f"{p}c"], sd["c"])
    r = run_cli("verify", src, out)
    assert r.returncode == 1 and f'tensor "{p}freqs" of A' in r.stderr, r.stderr
    r = run_cli("verify", src, out, "--exclude", f"{p}freqs")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("fmt", ["pt", "dcp"])
def test_quantized_tensors_are_listed_and_can_be_left_out(tmp_path: Path, fmt: str) -> None:
    """A ``torch.save`` file holding a quantized tensor was refused whole (its pickle names
    ``torch._utils._rebuild_qtensor`` and ``torch.per_tensor_affine``, outside the allow-list):
    now per-tensor and per-channel quantized tensors are listed as items of a dtype
    safetensors lacks, as DCP's were, and ``--exclude`` converts the rest bit for bit."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    with warnings.catch_warnings():  # quantized tensor creation is deprecated
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4, 3), 0.1, 2, torch.qint8)
        scales, zeros = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3])
        qc = torch.quantize_per_channel(torch.randn(4, 3), scales, zeros, 0, torch.quint8)
        sd = {"q": q, "w": w} if fmt == "dcp" else {"q": q, "qc": qc, "w": w}
        if fmt == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(sd, checkpoint_id=str(src), no_dist=True)
        else:
            src.mkdir()
            torch.save(sd, src / "model.pt")
    odd = sorted(set(sd) - {"w"})
    r = run_cli("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [t["name"] for t in doc["tensors"]] == ["w"]
    kinds = {n["name"]: n["kind"] for n in doc["non_tensors"]}
    assert kinds == dict.fromkeys(odd, "tensor of a dtype safetensors lacks"), kinds
    warned = doc["warnings"]
    assert any('"q" is torch.qint8 [4, 3]' in m and "dequantize" in m for m in warned), warned
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--consolidate")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    r = run_cli("convert", src, out, "--consolidate", *[a for n in odd for a in ("--exclude", n)])
    assert r.returncode == 0, r.stderr
    got = load_file(next(out.glob("*.safetensors")))
    assert list(got) == ["w"] and torch.equal(got["w"], w)


@pytest.mark.parametrize(
    "odd",
    ["freqs[0]", "rope\n\x1b[31mred", "it's *", "bidi\u202eqkv", "re:freqs"],
    ids=["glob-chars", "controls", "quote-and-star", "bidi", "re-prefix"],
)
def test_the_exclude_hint_pasted_into_a_shell_leaves_out_that_tensor_only(tmp_path: Path, odd: str) -> None:
    """The ``--exclude`` a refusal suggests was the name in quotes: for a name with glob
    characters it matched other names or none, for one with control characters it printed
    escaped and, pasted, matched nothing. Now the hint, run by a real shell, converts all
    but that one tensor (decoys differ from it in the very characters it escapes)."""
    import shlex

    from safetensors.torch import load_file

    src = tmp_path / "src"
    src.mkdir()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    decoys = {"freqs0": w, "rope\n\x1b[31mred2": w + 1, "it's x": w + 2, "bidi.qkv": w + 3, "freqs": w + 4}
    torch.save({odd: torch.randn(3, dtype=torch.complex128), **decoys}, src / "model.pt")
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--consolidate", "--quiet")
    assert r.returncode == 2 and not out.exists(), r.stderr
    hint = r.stderr[r.stderr.index("--exclude ") :].split(" converts the rest")[0]
    assert hint.isprintable(), hint
    paths = " ".join(shlex.quote(str(p)) for p in (RESHARD, "convert", src, out))
    cmd = f"{paths} --consolidate --quiet {hint}"
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (hint, r.stderr)
    got = load_file(next(out.glob("*.safetensors")))
    assert sorted(got) == sorted(decoys), (hint, sorted(got))
    assert all(torch.equal(got[k], v) for k, v in decoys.items())


def test_hf_shards_without_their_index_are_named_as_such(tmp_path: Path) -> None:
    """Several .safetensors files with no index fall to the per-rank reader's guess, which said
    "no rank files found" of HF shards whose index was not copied; it now says what is missing."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    for i in (1, 2):
        save_file({f"w{i}": torch.ones(2)}, str(src / f"model-0000{i}-of-00002.safetensors"))
    r = run_cli("convert", src, tmp_path / "out", "--consolidate")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no model.safetensors.index.json" in r.stderr and "model-00001-of-00002" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_split_with_a_negative_size_says_so(tmp_path: Path) -> None:
    """``sizes: [5, -1]`` of 4 rows was refused as "sizes [5, -1] add up to 4, but ... has 4"."""
    from safetensors.torch import save_file

    (tmp_path / "src").mkdir()
    save_file({"c": torch.ones(4, 3)}, str(tmp_path / "src" / "model.safetensors"))
    spec = tmp_path / "t.yaml"
    spec.write_text('transforms:\n  - split: {from: "c", to: ["c1", "c2"], sizes: [5, -1]}\n')
    r = run_cli("convert", tmp_path / "src", tmp_path / "out", "--transforms", spec, "--consolidate")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "t.yaml:2" in r.stderr and "negative" in r.stderr and "add up to" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_destination_whose_lock_cannot_be_created_exits_2(tmp_path: Path) -> None:
    """Creating ``DST/.reshard.lock`` failing (a directory of that name here; a read-only file
    system or an unwritable DST alike: ``mount -o ro`` gave the same traceback) was an
    ``OSError`` traceback, exit 1. Exit 2 naming it, the directory left as it was."""
    from safetensors.torch import save_file

    (tmp_path / "src").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "src" / "model.safetensors"))
    dst = tmp_path / "dst"
    (dst / ".reshard.lock").mkdir(parents=True)
    for extra in ([], ["--overwrite"], ["--resume"]):
        r = run_cli("convert", tmp_path / "src", dst, "--consolidate", *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert ".reshard.lock" in r.stderr and "is a directory" in r.stderr, r.stderr
    assert [p.name for p in dst.iterdir()] == [".reshard.lock"]


def _file_size_limit(limit: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("kind", ["zstd", "transposed"])
def test_a_spool_that_cannot_grow_is_exit_3_not_sigbus(tmp_path: Path, kind: str) -> None:
    """The DCP reader spools zstd chunks and row-major copies of transposed ones under $TMPDIR.
    Out of room there (a full tmpfs; here a file-size limit), a transposed chunk's spool,
    grown by ftruncate and filled through a map, was SIGBUS (exit 135, the spool directory
    left behind), a zstd one's short write was taken for the whole block (the chunk then read
    as "damaged", exit 2). Now exit 3 naming the spool and TMPDIR, and the spool removed.
    (The spool is made when the copy first reads it: the target is TP-4, files of 60 KB each,
    so the output fits under the limit and the spool's 240 KB do not.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    if kind == "zstd" and not ZStandard.is_available():
        pytest.skip("no zstandard module")
    src, tmp = tmp_path / "src", tmp_path / "tmp"
    tmp.mkdir()
    g = torch.Generator().manual_seed(4)
    t = torch.randn(300, 200, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "zstd":
            writer = FileSystemWriter(str(src), _extensions=[ZStandard()])
            dcp.save({"t": t}, storage_writer=writer, no_dist=True)
        else:
            dcp.save({"t": t.t()}, checkpoint_id=str(src), no_dist=True)
    layout = tmp_path / "tp4.yaml"
    layout.write_text('mesh: {tp: 4}\nplacements:\n  "*": {tp: S(0)}\n')
    r = subprocess.run(
        [str(RESHARD), "convert", str(src), str(tmp_path / "out"), "--target-layout", str(layout)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TMPDIR=str(tmp)),
        preexec_fn=lambda: _file_size_limit(100_000),  # the spool needs 240 KB
    )
    assert r.returncode == 3 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert "spool" in r.stderr and "TMPDIR" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and list(tmp.iterdir()) == []


def test_names_and_paths_that_are_not_utf8(tmp_path: Path) -> None:
    """A DST path with a non-UTF-8 byte (the lock file records argv: UnicodeEncodeError traceback,
    the new DST left behind); a safetensors header naming a tensor ``"a\\udcff"`` (safetensors
    refuses it: "lone leading surrogate"; reshard read it, then failed as a traceback writing
    it); a ``torch.save`` key ``"a\\udcff"`` (the same traceback). Exit 0, 2, 2."""
    import struct

    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    dst = os.fsencode(tmp_path) + b"/dst\xff"
    r = subprocess.run(
        [os.fsencode(RESHARD), b"convert", os.fsencode(src), dst, b"--consolidate"], capture_output=True
    )
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert os.path.exists(dst + b"/model.safetensors")

    lone = tmp_path / "lone"
    lone.mkdir()
    head = b'{"a\\udcff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    head += b" " * (-len(head) % 8)
    (lone / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(8))
    (tmp_path / "pt").mkdir()
    torch.save({"a\udcff": torch.ones(2), "b": torch.zeros(1)}, tmp_path / "pt" / "model.pt")
    for bad in (lone, tmp_path / "pt"):
        r2 = run_cli("convert", bad, tmp_path / "out", "--consolidate")
        assert r2.returncode == 2 and "Traceback" not in r2.stderr, r2.stderr
        assert "surrogate" in r2.stderr, r2.stderr
        assert not (tmp_path / "out").exists()
