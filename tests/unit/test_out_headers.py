"""Output headers laid out lazily by the planner are the reference writer's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from reshard.io.header import encode_header


# names JSON must escape take the per-name quoting; the others are quoted by one join
@pytest.mark.parametrize("odd", [[], ['q"uote.w', "back\\slash", "tab\tand\x7fdel", "\u2028sep"]])
def test_lazy_headers_equal_encode_header(tmp_path: Path, odd: list[str]) -> None:
    tensors = {
        "b.w": torch.zeros(7, 3, dtype=torch.bfloat16),
        "a.w": torch.zeros(5, dtype=torch.float32),
        "é.ünï": torch.zeros(2, 2, dtype=torch.int64),
        "flag": torch.zeros(3, dtype=torch.bool),
        "s": torch.tensor(1.0, dtype=torch.float64),
        **{name: torch.arange(3, dtype=torch.int16) for name in odd},
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 3}\nplacements:\n  "*.w": {tp: S(0)}\n  "*": R\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    for spec in (TargetSpec(layout=str(tmp_path / "l.yaml")), TargetSpec(consolidate=True)):
        plan = build_plan(ck, resolve_target(ck, spec))
        for f in plan.files:
            specs = [(e.tensor.name, e.tensor.dtype, _shape(e)) for e in f.entries]
            meta_key, meta_val = next(iter(json.loads(f.prefix[8:].decode())["__metadata__"].items()))
            want, header = encode_header(specs, {meta_key: meta_val})
            assert f.prefix == want
            assert [e.start - len(f.prefix) for e in f.entries] == [x.start for x in header.entries]
            assert f.size == len(want) + header.data_size
            if f.rank is None:  # consolidated: the reference writer's own file is the oracle
                save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={meta_key: meta_val})
                assert f.prefix == (tmp_path / "ref.safetensors").read_bytes()[: len(f.prefix)]


def _shape(e: object) -> list[int]:
    from reshard.intervals import block_shape

    t = e.tensor  # type: ignore[attr-defined]
    return list(block_shape(t.layout.blocks()[e.rank]))  # type: ignore[attr-defined]


def test_rank_files_share_one_copy_of_the_per_tensor_description(tmp_path: Path) -> None:
    """Unevenly split tensors put every global shape in each rank file's metadata: the planned
    files hold that text once (64 ranks x 100k tensors held 64 copies, 947 MiB), and a reader
    keeps past rank 0 only what it compares across ranks."""
    from reshard.formats.per_rank import RankFiles, open_per_rank, self_description

    w = torch.arange(7 * 3, dtype=torch.int16).reshape(7, 3)
    tensors = {f'layers.{i}.w\u00e9"q': w.clone() for i in range(300)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    # per file, its largest fixed run other than the entries (second to last)
    biggest = [max((b for _, b in f.layout.fixed[:-2]), key=len) for f in plan.files]
    assert len(biggest[0]) > 300 * 20  # the global shapes, one per tensor
    assert all(b is biggest[0] for b in biggest)  # one object, not one per file

    out = tmp_path / "out"
    from typer.testing import CliRunner

    from reshard.cli import app

    src, layout = str(tmp_path / "model.safetensors"), str(tmp_path / "l.yaml")
    assert CliRunner().invoke(app, ["convert", src, str(out), "--target-layout", layout]).exit_code == 0
    paths = sorted(out.glob("rank-*.safetensors"))
    files = RankFiles.one_per_rank(paths)
    texts = [(h.metadata or {})["reshard"] for h in files.headers]
    assert len(texts[0]) > 300 * 20 and all(len(t) < 200 for t in texts[1:])
    for r, (h, p) in enumerate(zip(files.headers, paths)):
        d = self_description(h, p, tensors=False)
        assert d is not None and d["rank"] == r and d["coordinate"] == [r]
    got = open_per_rank(out, mesh=None, placements_for=None)
    assert {n: t.shape for n, t in got.tensors.items()} == {n: (7, 3) for n in tensors}


def test_expert_parallel_files_share_their_description_and_layouts(tmp_path: Path) -> None:
    """Own(expert) files (format 3: each describes its own tensors, one code each; format 1 described
    every tensor in every file, four times the entries' size at 200k tensors): the planner makes one
    layout per owner, not per tensor; a reader joins the files' descriptions."""
    from typer.testing import CliRunner

    from reshard.cli import app
    from reshard.formats.per_rank import RankFiles, open_per_rank
    from reshard.plan import distinct_layouts

    w = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
    tensors = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w{k}.weight": w.clone()
        for i in range(3)
        for e in range(8)
        for k in (1, 2, 3)
    }
    tensors["model.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout="mixtral-moe", mesh="ep=4")))
    assert len(distinct_layouts(t.layout for t in plan.tensors)) == 4 + 1  # an owner each, and R

    out = tmp_path / "ep4"
    src = str(tmp_path / "model.safetensors")
    run = CliRunner().invoke(
        app, ["convert", src, str(out), "--target-layout", "mixtral-moe", "--target-mesh", "ep=4"]
    )
    assert run.exit_code == 0, run.output
    files = RankFiles.one_per_rank(sorted(out.glob("rank-*.safetensors")))
    texts = [(h.metadata or {})["reshard"] for h in files.headers]
    for r, t in enumerate(texts):  # 18 experts' tensors and the norm: a code each, no shapes
        meta = json.loads(t)
        assert meta["format_version"] == 3 and len(meta["layout"]) == 19 and meta["shapes"] == {}, t
        assert sorted(map(tuple, meta["placements"])) == [(f"Own({r})",), ("R",)]
        assert len(t) < 200
    got = open_per_rank(out, mesh=None, placements_for=None)
    assert {n: (t.shape, [str(p) for p in t.placements or ()]) for n, t in got.tensors.items()} == {
        n: ((6, 4), [f"Own({int(n.split('.')[5]) // 2})"]) if "experts" in n else ((4,), ["R"])
        for n in tensors
    }


def _ep4(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 4-rank Own(expert) output of 2 layers x 8 experts x 3 projections and a norm."""
    from typer.testing import CliRunner

    from reshard.cli import app

    w = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
    tensors = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w{k}.weight": w + e
        for i in range(2)
        for e in range(8)
        for k in (1, 2, 3)
    }
    tensors["model.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    out = tmp_path / "ep4"
    args = ["convert", str(tmp_path / "model.safetensors"), str(out), "--target-layout", "mixtral-moe"]
    run = CliRunner().invoke(app, [*args, "--target-mesh", "ep=4"])
    assert run.exit_code == 0, run.output
    (out / "reshard.json").unlink()  # its checksums would refuse the files edited below
    return out, tensors


def _meta(path: Path) -> dict[str, Any]:
    """The file's reshard metadata, decoded."""
    head = path.read_bytes()
    header = json.loads(head[8 : 8 + int.from_bytes(head[:8], "little")])
    meta: dict[str, Any] = json.loads(header["__metadata__"]["reshard"])
    return meta


def _rewrite(path: Path, meta: dict[str, object]) -> None:
    from safetensors.torch import load_file

    save_file(load_file(str(path)), str(path), metadata={"reshard": json.dumps(meta, separators=(",", ":"))})


def test_format_1_expert_parallel_files_still_read(tmp_path: Path) -> None:
    """Files an earlier reshard wrote for Own layouts (format 1: every file describes every tensor)
    read as before: the reader of the current format keeps the old one."""
    from reshard.formats.per_rank import open_per_rank

    out, tensors = _ep4(tmp_path)
    every = {
        n: {
            "shape": list(t.shape),
            "placements": [f"Own({int(n.split('.')[5]) // 2})"] if "experts" in n else ["R"],
        }
        for n, t in tensors.items()
    }
    for path in sorted(out.glob("rank-*.safetensors")):
        meta = _meta(path)
        old = {k: meta[k] for k in ("mesh", "rank", "coordinate")}
        _rewrite(path, {"format_version": 1, **old, "tensors": every})
    got = open_per_rank(out, mesh=None, placements_for=None)
    assert {n: [str(p) for p in t.placements or ()] for n, t in got.tensors.items()} == {
        n: d["placements"] for n, d in every.items()
    }


@pytest.mark.parametrize("damage", ["norm placed", "version 2", "expert twice"])
def test_format_3_files_that_disagree_are_refused(tmp_path: Path, damage: str) -> None:
    """A replicated tensor two files describe differently, a file of another format version, or a
    file describing a tensor another file owns: not one checkpoint (exit 2 naming the file)."""
    from reshard.errors import ReshardError
    from reshard.formats.per_rank import open_per_rank

    out, _ = _ep4(tmp_path)
    path = sorted(out.glob("rank-*.safetensors"))[2]
    meta = _meta(path)
    if damage == "norm placed":  # the norm (the file's last entry, by name) described S(0)
        meta["placements"].append(["S(0)"])
        meta["layout"] = meta["layout"][:-1] + "2"
    elif damage == "version 2":
        meta["format_version"] = 2
    else:  # its experts said to be rank 0's: rank 0 holds the same names
        meta["placements"] = [["Own(0)"] if p == ["Own(2)"] else p for p in meta["placements"]]
    _rewrite(path, meta)
    with pytest.raises(ReshardError, match=path.name):  # (the last: rank 0 lacks rank 2's experts)
        open_per_rank(out, mesh=None, placements_for=None)
