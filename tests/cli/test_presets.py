"""Presets against the names real families' ``save_pretrained`` writes; layouts against config.json.

Tiny random Llama, Qwen3, Phi-3, Mixtral and Qwen3-MoE models are built by transformers from
configs (tests/tiny_models.py, nothing downloaded). Every tensor of each saved file must match
the rule meant for it -- a sharded tensor never falls through to ``"*": R`` -- and the ``reshard``
CLI, run as a subprocess, refuses a fused GQA ``qkv_proj`` under ``_S(0, 3)`` (exit 2, nothing
written), converts a multi-head one exactly as torch's chunks of q, k and v give it, and warns
when k/v rows are sharded over more ranks than ``num_key_value_heads``. The values each rank
gets under ``llama-tp`` and ``mixtral-moe`` are checked against transformers' own TP/EP in
tests/dist/test_hf_tp_plans.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.config import LayoutConfig, Own, load_layout, resolve_preset
from tests import tiny_models as M
from tests.cli.test_as_a_user import run

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# What each tensor is, by name -> the placement transformers' TP plan gives it (tp=4).
INTENT = [
    (r".*\.self_attn\.(q|k|v|qkv)_proj\.weight", "S(0)"),  # colwise, colwise_gather_output (Phi-3)
    (r".*\.mlp\.(gate|up|gate_up)_proj\.weight", "S(0)"),
    (r".*\.experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight", "S(0)"),  # packed_colwise, per expert
    (r".*\.(self_attn\.o_proj|mlp\.down_proj)\.weight", "S(1)"),  # rowwise
    (r".*\.experts\.\d+\.(w2|down_proj)\.weight", "S(1)"),
    (r".*\.mlp\.experts\.gate_up_proj", "_S(1, 2)"),  # stacked (in-memory names)
    (r".*\.mlp\.experts\.down_proj", "S(2)"),
    (r"(model\.embed_tokens|lm_head)\.weight", "S(0)"),  # embedding_rowwise, colwise_gather_output
    (r".*(norm|\.(mlp|block_sparse_moe)\.gate)\.weight", "R"),  # norms, MoE router
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for fam in M.FAMILIES:
        M.build(fam, root / fam, stacked=root / f"{fam}-stacked" if fam in M.MOE else None)
    M.build("phi3", root / "phi3-mha", kv_heads=4)
    M.build("phi3", root / "phi3-kv1", kv_heads=1)  # qkv 64 + 16 + 16 rows: fits _S(0, 3) on 2 ranks
    return root


def names(directory: Path) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def intent(name: str) -> str:
    hits = [p for pattern, p in INTENT if re.fullmatch(pattern, name)]
    assert len(hits) == 1, f"{name}: {hits}"
    return hits[0]


@pytest.mark.parametrize("fam", [*M.FAMILIES, "mixtral-stacked", "qwen3_moe-stacked"])
def test_llama_tp_gives_every_saved_tensor_its_intended_rule(models: Path, fam: str) -> None:
    cfg = load_layout(resolve_preset("llama-tp"))
    saved = names(models / fam)
    for name in saved:
        want = intent(name)
        assert [str(p) for p in cfg.placements_for(name)] == [want], name
        if want != "R":
            assert cfg.match(name).pattern != "*", name
    if fam.endswith("-stacked"):
        assert sum(".mlp.experts." in n for n in saved) == 4  # two layers, gate_up_proj + down_proj
    assert cfg.unused_rules(saved) == [], "optional rules are not reported"


@pytest.mark.parametrize("fam", M.MOE)
def test_mixtral_moe_takes_every_expert_tensor_by_expert(models: Path, fam: str) -> None:
    cfg = load_layout(resolve_preset("mixtral-moe"))
    per_expert = [n for n in names(models / fam) if re.fullmatch(r".*\.experts\.\d+\..*", n)]
    assert len(per_expert) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for name in per_expert:
        assert cfg.match(name).own == ("ep", Own("expert")), name
    for name in names(models / f"{fam}-stacked"):
        want = ["S(0)"] if ".mlp.experts." in name else ["R"]
        assert [str(p) for p in cfg.placements_for(name)] == want, name
        if want != ["R"]:
            assert cfg.match(name).pattern != "*", name


def test_llama_tp_fused_covers_phi3(models: Path) -> None:
    cfg: LayoutConfig = load_layout(resolve_preset("llama-tp-fused"))
    fused = {n: [str(p) for p in cfg.placements_for(n)] for n in names(models / "phi3") if "_proj" in n}
    assert fused == {
        "model.layers.0.self_attn.qkv_proj.weight": ["_S(0, 3)"],
        "model.layers.1.self_attn.qkv_proj.weight": ["_S(0, 3)"],
        "model.layers.0.mlp.gate_up_proj.weight": ["_S(0, 2)"],
        "model.layers.1.mlp.gate_up_proj.weight": ["_S(0, 2)"],
        "model.layers.0.self_attn.o_proj.weight": ["S(1)"],
        "model.layers.1.self_attn.o_proj.weight": ["S(1)"],
        "model.layers.0.mlp.down_proj.weight": ["S(1)"],
        "model.layers.1.mlp.down_proj.weight": ["S(1)"],
    }


@pytest.mark.parametrize(("preset", "mesh"), [("llama-tp", "tp=2"), ("llama-fsdp-tp", "fsdp=2,tp=2")])
def test_dense_llama_gets_no_unused_rule_warning_from_its_presets(
    models: Path, tmp_path: Path, preset: str, mesh: str
) -> None:
    """Rules for tensors a saved Llama does not have (stacked experts, the catch-all ``"*"``
    when every tensor has its own rule) are optional in the presets meant for it."""
    out = str(tmp_path / "out")
    p = run("convert", str(models / "llama"), out, "--target-layout", preset, "--target-mesh", mesh, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["warnings"] == []


def test_fsdp_shards_do_not_count_as_cutting_kv_heads_but_tp_ones_do(models: Path, tmp_path: Path) -> None:
    """FSDP x TP on a model of 2 KV heads: k/v rows cut 2 x 4 ways, of which the tp dim's 4
    cut heads in use (FSDP gathers before computing): warned as 4 ways, not 8."""
    p = run("plan", str(models / "llama"), "--target-layout", "llama-fsdp-tp", "--target-mesh", "fsdp=2,tp=4",
            "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    kv = [w for w in json.loads(p.stdout)["warnings"] if "key/value heads" in w]
    assert kv and all(" 4 ways, which exceeds the 2 key/value heads" in w for w in kv), kv


# -- fused QKV with grouped-query attention (item: never cut unequal q/k/v into thirds) ----------


QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize("command", ["convert", "plan"])
def test_gqa_qkv_under_equal_thirds_is_refused_naming_tensor_rule_and_sizes(
    models: Path, tmp_path: Path, command: str
) -> None:
    out = tmp_path / "out"
    args = [command, str(models / "phi3"), *([str(out)] if command == "convert" else [])]
    p = run(*args, "--target-layout", "llama-tp-fused", "--target-mesh", "tp=2")
    assert p.returncode == 2, p.stderr
    msg = " ".join(p.stderr.split())
    assert f'tensor "{QKV}" of shape [128, 64]' in msg
    assert re.search(
        r"llama-tp-fused\.yaml:\d+: rule '\*\.self_attn\.qkv_proj\.weight' places it _S\(0, 3\)", msg
    )
    assert "q 64 + k 32 + v 32 (from " in msg and "config.json" in msg
    assert "transforms split" in msg and "Traceback" not in p.stderr
    assert not out.exists()


def test_gqa_qkv_without_config_json_is_refused_as_unknown(models: Path, tmp_path: Path) -> None:
    src = tmp_path / "weights-only"
    src.mkdir()
    shutil.copy(models / "phi3" / "model.safetensors", src)
    p = run(
        "convert",
        str(src),
        str(tmp_path / "out"),
        "--target-layout",
        "llama-tp-fused",
        "--target-mesh",
        "tp=2",
    )
    assert p.returncode == 2
    assert "the q/k/v sizes are unknown" in " ".join(p.stderr.split())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("with_config", [True, False])
def test_mha_qkv_under_equal_thirds_gives_each_rank_its_q_k_v_rows(
    models: Path, tmp_path: Path, with_config: bool
) -> None:
    src = models / "phi3-mha"
    if not with_config:  # then the [3 * hidden, hidden] shape says the parts are equal
        src = tmp_path / "weights-only"
        src.mkdir()
        shutil.copy(models / "phi3-mha" / "model.safetensors", src)
    out = tmp_path / "out"
    p = run(
        "convert", str(src), str(out), "--target-layout", "llama-tp-fused", "--target-mesh", "tp=2", "--json"
    )
    assert p.returncode == 0, p.stderr
    full = load_file(str(src / "model.safetensors"))
    for r in range(2):
        got = load_file(str(out / f"rank-{r:05d}-of-00002.safetensors"))
        for layer in range(2):
            qkv = full[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
            want = torch.cat([part.chunk(2)[r] for part in qkv.chunk(3)])
            assert torch.equal(got[f"model.layers.{layer}.self_attn.qkv_proj.weight"], want)
            gate_up = full[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
            want = torch.cat([part.chunk(2)[r] for part in gate_up.chunk(2)])
            assert torch.equal(got[f"model.layers.{layer}.mlp.gate_up_proj.weight"], want)


# -- more ranks than KV heads ------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "warned"), [(2, False), (4, True), (3, True)])
def test_kv_rows_sharded_beyond_the_kv_heads_warn(
    models: Path, tmp_path: Path, tp: int, warned: bool
) -> None:
    p = run(
        "convert", str(models / "llama"), str(tmp_path / "out"),
        "--target-layout", "llama-tp", "--target-mesh", f"tp={tp}", "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    warnings = [w for w in json.loads(p.stdout)["warnings"] if "key/value heads" in w]
    if not warned:
        assert warnings == []
        return
    why = "exceeds" if tp > 2 else "does not divide"
    assert len(warnings) == 1
    assert re.search(
        rf"llama-tp\.yaml:\d+: rule .* shards \"model\.layers\.0\.self_attn\.k_proj\.weight\" {tp} ways, "
        rf"which {why} the 2 key/value heads \(num_key_value_heads, from .*config\.json\)",
        warnings[0],
    ), warnings[0]
    assert "key/value heads" in p.stderr


# -- whole-tensor assignment: per-expert tensors on the ep rank owning their expert -----------


def rank_file(directory: Path, r: int, world: int) -> dict[str, torch.Tensor]:
    return load_file(str(directory / f"rank-{r:05d}-of-{world:05d}.safetensors"))


def expert_of(name: str) -> int | None:
    m = re.search(r"\.experts\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("fam", M.MOE)
def test_mixtral_moe_deals_whole_experts_to_ep_ranks_and_reads_back(
    models: Path, tmp_path: Path, fam: str
) -> None:
    src = models / fam
    full = load_file(str(src / "model.safetensors"))
    ep2, ep4, back = tmp_path / "ep2", tmp_path / "ep4", tmp_path / "back"
    p = run("convert", str(src), str(ep2), "--target-layout", "mixtral-moe", "--target-mesh", "ep=2")
    assert p.returncode == 0, p.stderr
    p = run("convert", str(ep2), str(ep4), "--target-mesh", "ep=4", "--json")  # ep2's reshard.json rules
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["warnings"] == []  # its unused (stacked-expert) rule is not the user's
    for out, world in ((ep2, 2), (ep4, 4)):
        for r in range(world):
            got = rank_file(out, r, world)
            want = {n for n in full if expert_of(n) is None or expert_of(n) // (4 // world) == r}
            assert set(got) == want, (world, r)  # 4 experts: 2 per rank at ep=2, 1 at ep=4
            assert all(torch.equal(got[n], full[n]) for n in want)
        assert run("inspect", str(out), "--check").returncode == 0
    with safe_open(str(ep2 / "rank-00001-of-00002.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["reshard"])
    # version 3: the file describes its own tensors only (one code each), a reader joins the files'
    held = {n for n in full if expert_of(n) is None or expert_of(n) // 2 == 1}
    assert meta["format_version"] == 3 and len(meta["layout"]) == len(held) and meta["shapes"] == {}
    assert meta["placements"] == [["Own(1)"], ["R"]] or meta["placements"] == [["R"], ["Own(1)"]]
    assert len(json.dumps(meta)) < 200 + 2 * len(held)  # not a description of every tensor
    doc = json.loads(run("inspect", str(ep2), "--json", "--all").stdout)
    described = {t["name"]: t["placements"] for t in doc["tensors"]}
    assert set(described) == set(full)
    assert described[next(n for n in full if expert_of(n) == 3)] == ["Own(1)"]
    p = run("convert", str(ep4), str(back), "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--target-mesh", "ep=3"],
            r"Own\(expert\) deals 4 numbers over the 3 ranks of ep, which does not divide",
        ),
        (["--to", "sharded-state"], r"whole-tensor assignment \(Own\) is written by --to per-rank only"),
    ],
)
def test_mixtral_moe_refuses_what_it_cannot_deal(
    models: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "out"
    p = run("convert", str(models / "mixtral"), str(out), "--target-layout", "mixtral-moe", *args)
    assert p.returncode == 2, p.stderr
    assert re.search(message, " ".join(p.stderr.split())), p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_a_tensor_missing_on_a_rank_is_still_an_error_unless_own_leaves_it_out(
    models: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    out = tmp_path / "tp2"
    p = run(
        "convert", str(models / "llama"), str(out), "--target-layout", "llama-tp", "--target-mesh", "tp=2"
    )
    assert p.returncode == 0, p.stderr
    path = out / "rank-00001-of-00002.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        kept = {n: f.get_tensor(n) for n in f.keys() if n != "model.norm.weight"}
    save_file(kept, str(path), metadata=meta)
    p = run("convert", str(out), str(tmp_path / "back"), "--consolidate")
    assert p.returncode == 2
    assert 'tensor "model.norm.weight" is missing (it is in rank-00000-of-00002.safetensors)' in p.stderr


def test_gqa_qkv_read_as_equal_thirds_is_refused_too(models: Path, tmp_path: Path) -> None:
    """Local shapes [48, 64] fit _S(0, 3) of 96 rows on 2 ranks: only the head counts tell it is wrong."""
    tp2 = tmp_path / "tp2"
    src = models / "phi3-kv1"
    p = run("convert", str(src), str(tp2), "--target-layout", "llama-tp", "--target-mesh", "tp=2")
    assert p.returncode == 0, p.stderr
    shutil.copy(src / "config.json", tp2)  # the head counts, next to the rank files
    out = tmp_path / "out"
    p = run(
        "convert", str(tp2), str(out), "--consolidate",
        "--source-layout", "llama-tp-fused", "--source-mesh", "tp=2",
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "q 64 + k 16 + v 16" in " ".join(p.stderr.split()) and not out.exists()


def test_a_foreign_ep_checkpoint_reads_with_own_in_its_source_layout(models: Path, tmp_path: Path) -> None:
    """Rank files without reshard's metadata (as another framework saves them, experts under global
    names): ``--source-layout mixtral-moe`` deals the experts to ranks from the names held."""
    from safetensors.torch import save_file

    ep2, bare, back = tmp_path / "ep2", tmp_path / "bare", tmp_path / "back"
    p = run(
        "convert",
        str(models / "mixtral"),
        str(ep2),
        "--target-layout",
        "mixtral-moe",
        "--target-mesh",
        "ep=2",
    )
    assert p.returncode == 0, p.stderr
    bare.mkdir()
    for r in range(2):  # rank 0 holds experts 0-1, rank 1 experts 2-3, every other tensor whole
        save_file(rank_file(ep2, r, 2), str(bare / f"model_rank{r}.safetensors"))
    layout = ["--source-layout", "mixtral-moe", "--source-mesh", "ep=2"]
    p = run("convert", str(bare), str(back), "--consolidate", *layout)
    assert p.returncode == 0, p.stderr
    full = load_file(str(models / "mixtral" / "model.safetensors"))
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)
    (bare / "model_rank1.safetensors").unlink()
    save_file(rank_file(ep2, 0, 2), str(bare / "model_rank1.safetensors"))  # rank 1 with rank 0's experts
    p = run("convert", str(bare), str(tmp_path / "bad"), "--consolidate", *layout)
    assert p.returncode == 2, p.stderr  # experts 0-1 on both ranks: rank 1's do not fit Own(0)
    assert re.search(
        r'tensor "model\.layers\.0\.block_sparse_moe\.experts\.[01]\.w1\.weight": local shapes', p.stderr
    )
