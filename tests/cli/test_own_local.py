"""``Own(NAME, local)``: experts dealt whole to EP ranks and named by their rank-local index.

Megatron and vLLM name the experts of an EP rank 0..E/ep-1: global expert ``i`` lives on EP
rank ``c = i // (E/ep)`` as local expert ``i - c*E/ep``. The oracle is plain Python and
torch on the full tensors (``expected_rank``): which names a rank holds, under which local
name, split over the other mesh dims by ``torch.chunk``. Real safetensors files, the
``reshard`` CLI as a subprocess; round trips come back byte for byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.cli.test_as_a_user import run

EXPERT = re.compile(r"(.*\.experts\.)(\d+)(\..*)")

LAYOUT = """\
mesh: {mesh}
placements:
  're:.*\\.experts\\.(?P<expert>\\d+)\\.(w1|w2|w3)\\.weight': {rule}
  "*": R
"""


def model(experts: int, layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(experts)
    out = {"model.norm.weight": torch.randn(8, generator=g)}
    for layer in range(layers):
        out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = torch.randn(experts, 8, generator=g)
        for e in range(experts):
            for w, shape in (("w1", (6, 8)), ("w2", (8, 6)), ("w3", (6, 8))):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                out[name] = torch.randn(*shape, generator=g).to(
                    torch.bfloat16 if w == "w2" else torch.float32
                )
    return out


def expected_rank(
    full: dict[str, torch.Tensor], experts: int, ep: int, ep_coord: int, fsdp: tuple[int, int] = (1, 0)
) -> dict[str, torch.Tensor]:
    """What the rank at (fsdp coordinate, ep coordinate) holds: its experts under local numbers,
    each cut by torch.chunk over fsdp (dim 0), and every other tensor whole."""
    per = experts // ep
    out = {}
    for name, t in full.items():
        m = EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        elif int(m.group(2)) // per == ep_coord:
            local = f"{m.group(1)}{int(m.group(2)) - ep_coord * per}{m.group(3)}"
            out[local] = torch.chunk(t, fsdp[0], dim=0)[fsdp[1]]
    return out


def rank_files(out: Path) -> list[Path]:
    return sorted(out.glob("rank-*.safetensors"))


def write(tmp_path: Path, experts: int, mesh: str, rule: str) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    full = model(experts)
    src = tmp_path / "hf"
    src.mkdir()
    save_file(full, str(src / "model.safetensors"), metadata={"format": "pt"})
    layout = tmp_path / "ep.yaml"
    layout.write_text(LAYOUT.format(mesh=mesh, rule=rule))
    return src, layout, full


def check_ep(out: Path, full: dict[str, torch.Tensor], experts: int, ep: int) -> None:
    files = rank_files(out)
    assert len(files) == ep
    for c, path in enumerate(files):
        want = expected_rank(full, experts, ep, c)
        got = load_file(str(path))
        assert set(got) == set(want), (c, sorted(set(got) ^ set(want))[:4])
        for n in want:
            assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), (c, n)


@pytest.mark.parametrize(("experts", "ep"), [(4, 2), (12, 4)])
def test_hf_to_ep_names_experts_by_rank_local_number_and_comes_back_byte_for_byte(
    tmp_path: Path, experts: int, ep: int
) -> None:
    src, layout, full = write(tmp_path, experts, f"{{ep: {ep}}}", '{ep: "Own(expert, local)"}')
    out, back = tmp_path / "ep", tmp_path / "back"
    p = run("convert", str(src), str(out), "--target-layout", str(layout))
    assert p.returncode == 0, p.stderr
    check_ep(out, full, experts, ep)
    last = rank_files(out)[-1]
    with safe_open(str(last), "pt") as f:
        metadata = f.metadata()
    meta = json.loads(metadata["reshard"])
    per = experts // ep
    assert meta["local_names"]["model.layers.0.block_sparse_moe.experts.0.w1.weight"] == (
        f"model.layers.0.block_sparse_moe.experts.{(ep - 1) * per}.w1.weight"
    )
    # version 3: the file describes its own entries (one code each); a reader joins the files'
    assert meta["format_version"] == 3 and len(meta["layout"]) == len(
        expected_rank(full, experts, ep, ep - 1)
    )
    doc = json.loads(run("inspect", str(out), "--json", "--all").stdout)
    assert {t["name"] for t in doc["tensors"]} == set(full)  # every tensor, under its global name
    # the file is what safetensors itself writes for those local tensors and that metadata
    oracle = tmp_path / "oracle.safetensors"
    save_file(expected_rank(full, experts, ep, ep - 1), str(oracle), metadata=metadata)
    assert last.read_bytes() == oracle.read_bytes()
    assert run("inspect", str(out), "--check").returncode == 0
    # back to HF from the rank files alone (their metadata says how local names map back)
    p = run("convert", str(out), str(back), "--consolidate")
    assert p.returncode == 0, p.stderr
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert run("verify", str(src), str(out)).returncode == 0


def test_ep_local_to_another_ep_size_uses_the_recorded_rules(tmp_path: Path) -> None:
    src, layout, full = write(tmp_path, 8, "{ep: 2}", '{ep: "Own(expert, local)"}')
    ep2, ep4 = tmp_path / "ep2", tmp_path / "ep4"
    assert run("convert", str(src), str(ep2), "--target-layout", str(layout)).returncode == 0
    p = run("convert", str(ep2), str(ep4), "--target-mesh", "ep=4")
    assert p.returncode == 0, p.stderr
    check_ep(ep4, full, 8, 4)


def test_fsdp_by_ep_splits_each_local_expert_over_fsdp(tmp_path: Path) -> None:
    src, layout, full = write(tmp_path, 4, "{fsdp: 2, ep: 2}", '{fsdp: S(0), ep: "Own(expert, local)"}')
    out = tmp_path / "out"
    p = run("convert", str(src), str(out), "--target-layout", str(layout))
    assert p.returncode == 0, p.stderr
    for rank, path in enumerate(rank_files(out)):  # rank = fsdp * 2 + ep
        want = expected_rank(full, 4, 2, rank % 2, (2, rank // 2))
        got = load_file(str(path))
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), rank


def test_foreign_rank_files_with_local_names_read_with_the_layout(tmp_path: Path) -> None:
    """Rank files another framework saved (no reshard metadata, experts 0..E/ep-1 on every rank)."""
    src, layout, full = write(tmp_path, 4, "{ep: 2}", '{ep: "Own(expert, local)"}')
    bare, back = tmp_path / "bare", tmp_path / "back"
    bare.mkdir()
    for c in range(2):
        save_file(
            {n: t.contiguous() for n, t in expected_rank(full, 4, 2, c).items()},
            str(bare / f"model_rank{c}.safetensors"),
        )
    args = ["--source-layout", str(layout), "--source-mesh", "ep=2"]
    p = run("convert", str(bare), str(back), "--consolidate", *args)
    assert p.returncode == 0, p.stderr
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)
    # rank 1 holding one expert fewer than rank 0: the local numbers cannot be dealt
    one = expected_rank(full, 4, 2, 1)
    save_file({n: t for n, t in one.items() if ".experts.1." not in n}, str(bare / "model_rank1.safetensors"))
    bad = tmp_path / "bad"
    p = run("convert", str(bare), str(bad), "--consolidate", *args)
    assert p.returncode == 2, p.stderr
    assert re.search(
        r"rank 1 holds the tensors .*experts\.\*\.w1\.weight numbered \[0\], rank 0 \[0, 1\]", p.stderr
    )
    assert "Traceback" not in p.stderr and not bad.exists()


@pytest.mark.parametrize(
    ("mesh", "rule", "message"),
    [
        (
            "{ep: 3}",
            '{ep: "Own(expert, local)"}',
            r"Own\(expert, local\) deals 4 numbers over the 3 ranks of ep",
        ),
        (
            "{ep: 2}",
            '{ep: "Own(w, local)"}',
            r"captures 'w1' for Own\(w, local\); the group must capture a number",
        ),
    ],
)
def test_what_cannot_be_dealt_is_refused(tmp_path: Path, mesh: str, rule: str, message: str) -> None:
    src, layout, _ = write(tmp_path, 4, mesh, rule)
    if "Own(w" in rule:
        layout.write_text(
            LAYOUT.format(mesh=mesh, rule=rule).replace(r"(?P<expert>\d+)\.(w1|w2|w3)", r"(\d+)\.(?P<w>w\d)")
        )
    out = tmp_path / "out"
    p = run("convert", str(src), str(out), "--target-layout", str(layout))
    assert p.returncode == 2, p.stderr
    assert re.search(message, " ".join(p.stderr.split())), p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_stacked_experts_to_local_per_expert_rank_files_in_one_pass(tmp_path: Path) -> None:
    """[E, ...] stacked experts unstacked by the inverse of mixtral-experts-stack straight into
    EP rank files with local names (E from --set), then back to HF equal to the original."""
    full = {n: t.float() for n, t in model(4).items()}  # stack needs one dtype per group
    src, stacked, out, back = (tmp_path / d for d in ("hf", "stacked", "ep", "back"))
    src.mkdir()
    save_file(full, str(src / "model.safetensors"))
    (tmp_path / "ep.yaml").write_text(LAYOUT.format(mesh="{ep: 2}", rule='{ep: "Own(expert, local)"}'))
    tf = ["--transforms", "mixtral-experts-stack", "--set", "experts=4"]
    assert run("convert", str(src), str(stacked), *tf, "--consolidate").returncode == 0
    p = run("convert", str(stacked), str(out), *tf, "--inverse", "--target-layout", str(tmp_path / "ep.yaml"))
    assert p.returncode == 0, p.stderr
    check_ep(out, full, 4, 2)
    assert json.loads((out / "reshard.json").read_text())["transforms"]["set"] == {"experts": 4}
    assert run("convert", str(out), str(back), "--consolidate").returncode == 0
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)


@pytest.mark.parametrize(
    ("local_names", "message"),
    [
        ({"no.such.entry": "model.norm.weight"}, "local_names maps 'no.such.entry'"),
        ([1, 2], "reshard.local_names"),
        ({"model.layers.0.block_sparse_moe.experts.0.w1.weight": "model.norm.weight"}, "also in"),
    ],
)
def test_bad_local_names_in_rank_metadata_exit_2(tmp_path: Path, local_names: object, message: str) -> None:
    src, layout, _ = write(tmp_path, 4, "{ep: 2}", '{ep: "Own(expert, local)"}')
    out = tmp_path / "ep"
    assert run("convert", str(src), str(out), "--target-layout", str(layout)).returncode == 0
    path = rank_files(out)[1]
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    meta = json.loads(metadata["reshard"])
    meta["local_names"] = local_names
    save_file(load_file(str(path)), str(path), metadata={**metadata, "reshard": json.dumps(meta)})
    (out / "reshard.json").unlink()  # its checksums would refuse the edited file first
    p = run("convert", str(out), str(tmp_path / "back"), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr and not (tmp_path / "back").exists()
