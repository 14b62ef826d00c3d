"""The presets against transformers' own tensor and expert parallelism (the oracle), in real gloo worlds.

What the oracle does: tests/tiny_models.py builds tiny random Llama, Qwen3, Phi-3, Mixtral and
Qwen3-MoE models from configs and ``save_pretrained``s them (Hugging Face names; per-expert
tensors for the MoE models), and also saves each MoE model's in-memory ``state_dict()``
(transformers v5's stacked ``mlp.experts.gate_up_proj``/``down_proj``) as a second directory.
A 2-rank ``torchrun`` world (tests/dist/hf_tp_worker.py, gloo on CPU) loads every saved model
with ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(
tp_plan="auto", tp_size=2))`` -- transformers shards each parameter by the model class's
``base_model_tp_plan`` -- and saves each rank's ``to_local()`` of every state-dict entry. A
second world does the same with ``ep_size=2`` (``base_model_ep_plan``: whole experts per rank).

The ``reshard`` CLI, run as a subprocess, converts the same saved files with the presets at
the same sizes (``--target-layout llama-tp --target-mesh tp=2``, ``mixtral-moe --target-mesh
ep=2``), and every tensor of every rank file must equal transformers' local tensor bit for bit:
by name, or, for the per-expert files, after stacking the per-expert tensors as transformers
does (``gate_up_proj[e] = cat([gate_e, up_e])``), which checks the per-expert rules give every
rank exactly its slice of every expert.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests import tiny_models as M
from tests.dist.test_gloo import WORLD_TIMEOUT, _env, reshard_cli
from tests.strategies import same_bits

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' from_pretrained(tp_plan=...) needs accelerate")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = Path(__file__).with_name("hf_tp_worker.py")
WORLD = 2
EXPERTS = 4


def _run_world(mode: str, out: Path, dirs: list[Path]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += ["--max-restarts=0", str(WORKER), mode, str(out), *map(str, dirs)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=WORLD_TIMEOUT, env=_env())
    assert res.returncode == 0, f"{mode} world failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models under ``root/hf/FAMILY`` (and ``root/stacked/FAMILY``); transformers' rank files under
    ``root/oracle/{tp,ep}/{hf,stacked}-FAMILY``."""
    root = tmp_path_factory.mktemp("hf_tp")
    for fam in M.FAMILIES:
        M.build(fam, root / "hf" / fam, stacked=root / "stacked" / fam if fam in M.MOE else None)
    links = root / "links"
    links.mkdir()
    for kind in ("hf", "stacked"):
        for d in sorted((root / kind).iterdir()):
            (links / f"{kind}-{d.name}").symlink_to(d)
    _run_world("tp", root / "oracle", sorted(links.iterdir()))
    _run_world("ep", root / "oracle", [links / f"hf-{f}" for f in M.MOE])
    return root


def _rank(directory: Path, r: int) -> dict[str, Any]:
    return load_file(str(directory / f"rank-{r:05d}-of-{WORLD:05d}.safetensors"))


def _convert(src: Path, dst: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = reshard_cli("convert", str(src), str(dst), *args, "--json")
    assert p.returncode == 0, p.stderr
    return p


def _assert_matches_oracle(fam: str, got_dir: Path, want_dir: Path) -> None:
    """Every oracle tensor equals reshard's (by name, or rebuilt from per-expert tensors); none left over."""
    placements = json.loads((want_dir / "placements.json").read_text())
    for r in range(WORLD):
        got, want = _rank(got_dir, r), _rank(want_dir, r)
        used: set[str] = set()
        for name, w in want.items():
            g = got.get(name)
            if g is None:
                g = M.per_expert(fam, name, got, EXPERTS)
                used |= {n for n in got if ".experts." in n or n.endswith(".gate.weight")}
            else:
                used.add(name)
            assert g is not None, f"{fam} rank {r}: reshard has no {name}"
            assert same_bits(g, w), (
                f"{fam} rank {r} {name} ({placements[name]}): reshard {tuple(g.shape)} vs transformers "
                f"{tuple(w.shape)}"
            )
        assert used == set(got), f"{fam} rank {r}: not in transformers' state dict: {sorted(set(got) - used)}"


@pytest.mark.parametrize("fam", M.FAMILIES)
def test_llama_tp_gives_each_rank_what_transformers_tp_plan_gives_it(
    oracle: Path, tmp_path: Path, fam: str
) -> None:
    out = tmp_path / "tp2"
    _convert(oracle / "hf" / fam, out, "--target-layout", "llama-tp", "--target-mesh", "tp=2")
    _assert_matches_oracle(fam, out, oracle / "oracle" / "tp" / f"hf-{fam}")
    if fam in M.MOE:  # transformers' in-memory stacked experts: _S(1, 2) and S(2)
        stacked = tmp_path / "stacked-tp2"
        _convert(oracle / "stacked" / fam, stacked, "--target-layout", "llama-tp", "--target-mesh", "tp=2")
        _assert_matches_oracle(fam, stacked, oracle / "oracle" / "tp" / f"stacked-{fam}")
        placements = json.loads((oracle / "oracle" / "tp" / f"stacked-{fam}" / "placements.json").read_text())
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == ["_S(1, 2)"]
        assert placements["model.layers.0.mlp.experts.down_proj"] == ["S(2)"]


@pytest.mark.parametrize("fam", M.MOE)
def test_mixtral_moe_gives_each_rank_the_experts_transformers_ep_plan_gives_it(
    oracle: Path, tmp_path: Path, fam: str
) -> None:
    out = tmp_path / "ep2"
    _convert(oracle / "stacked" / fam, out, "--target-layout", "mixtral-moe", "--target-mesh", "ep=2")
    want_dir = oracle / "oracle" / "ep" / f"hf-{fam}"
    placements = json.loads((want_dir / "placements.json").read_text())
    experts = [n for n in placements if ".mlp.experts." in n]
    assert experts and all(placements[n] == ["S(0)"] for n in experts)
    for r in range(WORLD):
        got, want = _rank(out, r), _rank(want_dir, r)
        assert set(got) == set(want)
        for name in experts:  # the dense part is TP-sharded in that world; mixtral-moe replicates it
            assert got[name].shape[0] == EXPERTS // WORLD
            assert same_bits(got[name], want[name]), f"{fam} rank {r} {name}"


@pytest.mark.parametrize("fam", M.MOE)
def test_mixtral_moe_gives_each_rank_its_whole_per_expert_tensors_as_transformers_ep_plan(
    oracle: Path, tmp_path: Path, fam: str
) -> None:
    """Per-expert files (``Own(expert)``): rank r's file holds experts r*E/2 .. whole, and nothing else's."""
    out = tmp_path / "ep2"
    _convert(oracle / "hf" / fam, out, "--target-layout", "mixtral-moe", "--target-mesh", "ep=2")
    want_dir = oracle / "oracle" / "ep" / f"hf-{fam}"
    full = load_file(str(oracle / "hf" / fam / "model.safetensors"))
    per = EXPERTS // WORLD
    for r in range(WORLD):
        got, want = _rank(out, r), _rank(want_dir, r)
        mine = {
            n for n in full if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) // per == r
        }
        assert {n for n in got if ".experts." in n} == mine  # only its own experts, under global names
        assert all(same_bits(got[n], full[n]) for n in mine)
        assert set(got) == {n for n in full if ".experts." not in n} | mine
        for name in (n for n in want if ".mlp.experts." in n):
            stacked = M.per_expert(fam, name, {_local(n, r * per): t for n, t in got.items()}, per)
            assert same_bits(stacked, want[name]), f"{fam} rank {r} {name}"
    # read back (ranks missing tensors by design) and consolidated: the source, bit for bit
    back = tmp_path / "back"
    _convert(out, back, "--consolidate")
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(full) and all(same_bits(got[n], full[n]) for n in full)
    assert reshard_cli("inspect", str(out), "--check").returncode == 0
    assert reshard_cli("verify", str(out), str(oracle / "hf" / fam)).returncode == 0


def _local(name: str, first: int) -> str:
    """``...experts.{e}...`` renumbered from ``first`` (the rank's first expert) to 0."""
    head, sep, tail = name.partition(".experts.")
    if not sep or not tail[:1].isdigit():
        return name
    e, _, rest = tail.partition(".")
    return f"{head}.experts.{int(e) - first}.{rest}"
