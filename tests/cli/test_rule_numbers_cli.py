"""Rules that tell tensors apart by the numbers in their names place them as torch does.

The rule index remembers each name's first match with its digits zeroed, for the rules whose
patterns mention no digit (``reshard.config._RuleIndex``): ``layers.1`` and ``layers.10`` share
that canonical name. Rules naming numbers (``*.layers.1.*``, ``experts.1?``, ``[0-1]``,
``\\d{2}``) must still place exactly their tensors, reading with one layout and writing with
another whose rules differ. The oracle: a plain first match (fnmatch, re) over the rules, and
torch's own placement splitting for the data.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.demo import torch_local
from reshard.placements import parse_placement

RESHARD = str(Path(sys.executable).parent / "reshard")

SOURCE_RULES = [  # on tp=2
    ("*.layers.1.*", "R"),
    ("*.experts.1?.w", "S(1)"),
    ("*", "S(0)"),
]
TARGET_RULES = [  # on tp=4
    ("re:.*\\.layers\\.1\\d\\..*", "S(1)"),
    ("*.experts.[0-1].w", "R"),
    ("re:.*\\.experts\\.\\d{2}\\.w", "S(1)"),
    ("*", "S(0)"),
]


def layout_text(tp: int, rules: list[tuple[str, str]]) -> str:
    lines = [f"mesh: {{tp: {tp}}}", "placements:"]
    lines += [f"  {json.dumps(pattern)}: {{tp: {json.dumps(p)}}}" for pattern, p in rules]
    return "\n".join(lines) + "\n"


def first_match(rules: list[tuple[str, str]], name: str) -> str:
    for pattern, p in rules:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return p
        elif fnmatch.fnmatchcase(name, pattern):
            return p
    raise AssertionError(f"no rule for {name}")


def local(full: torch.Tensor, tp: int, rank: int, placement: str) -> torch.Tensor:
    return torch_local(full, (tp,), (rank,), [parse_placement(placement)])


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    full = {}
    for i in range(12):
        full[f"model.layers.{i}.attn.w"] = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 100 * i
        for j in range(12):
            full[f"model.layers.{i}.experts.{j}.w"] = (
                torch.arange(48, dtype=torch.float32).reshape(8, 6) + 1000 * i + 10 * j
            )
    return full


@pytest.fixture(scope="module")
def source(model: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("numbers")
    (root / "src.yaml").write_text(layout_text(2, SOURCE_RULES))
    (root / "dst.yaml").write_text(layout_text(4, TARGET_RULES))
    tp2 = root / "tp2"
    tp2.mkdir()
    for r in range(2):
        shards = {n: local(t, 2, r, first_match(SOURCE_RULES, n)).clone() for n, t in model.items()}
        save_file(shards, str(tp2 / f"rank-{r:05d}-of-00002.safetensors"))
    return tp2


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RESHARD, *args], capture_output=True, text=True, timeout=120)


def test_numbered_rules_read_and_write_as_torch_places_them(
    model: dict[str, torch.Tensor], source: Path, tmp_path: Path
) -> None:
    src_layout, dst_layout = str(source.parent / "src.yaml"), str(source.parent / "dst.yaml")
    p = run("convert", str(source), str(tmp_path / "tp4"), "--source-layout", src_layout,
            "--target-layout", dst_layout, "--quiet")  # fmt: skip
    assert p.returncode == 0, p.stderr
    placed = {first_match(TARGET_RULES, n) for n in model}
    assert placed == {"R", "S(0)", "S(1)"}  # every kind of rule placed some tensor
    for r in range(4):
        got = load_file(str(tmp_path / "tp4" / f"rank-{r:05d}-of-00004.safetensors"))
        assert set(got) == set(model)
        for name, full in model.items():
            want = local(full, 4, r, first_match(TARGET_RULES, name))
            assert torch.equal(got[name], want), (name, r)
    p = run("inspect", str(tmp_path / "tp4"), "--json")
    assert p.returncode == 0, p.stderr
    rows = {t["name"]: t["placements"] for t in json.loads(p.stdout)["tensors"]}
    assert rows == {n: [first_match(TARGET_RULES, n)] for n in model}


def test_numbered_source_rules_read_back_whole(
    model: dict[str, torch.Tensor], source: Path, tmp_path: Path
) -> None:
    p = run("convert", str(source), str(tmp_path / "hf"), "--source-layout", str(source.parent / "src.yaml"),
            "--consolidate", "--quiet")  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(model)
    for name, full in model.items():
        assert torch.equal(got[name], full), name
