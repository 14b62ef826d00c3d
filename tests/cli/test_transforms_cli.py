"""`reshard convert/plan/verify --transforms` as a user runs them: real safetensors files, real
subprocesses, torch ops on full tensors followed by torch's own placement splitting as the oracle.

The expected local tensors are ``torch_local(transformed_full, mesh, coord, placements)``, which
splits with ``Shard._split_tensor`` / ``_StridedShard._split_tensor`` (what ``distribute_tensor``
does); the transformed full tensors come from torch ops (cat, stack, view+transpose, pad) in
``tests.transform_ref.torch_apply`` or written out here.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.demo import torch_local
from reshard.placements import parse_placement
from reshard.transforms import load_transforms
from tests.cli.test_convert_cli import run
from tests.transform_ref import torch_apply
from tests.unit.test_transform_profiles import LLAMA, llama_hf

TT_LAYOUT = """\
mesh: {{tp: {tp}}}
placements:
  "layers.*.attention.qkv_linear.w[qkv].weight": S(0)
  "layers.*.attention.wo.weight": S(1)
  "layers.*.feed_forward.w[13].weight": S(0)
  "layers.*.feed_forward.w2.weight": S(1)
  "tok_embeddings.weight": S(0)
  "lm_head.weight": S(0)
  "*": R
"""

MEGATRON_LAYOUT = """\
mesh: {tp: 2}
placements:
  "*.linear_qkv.weight": S(0)
  "*.linear_fc1.weight": _S(0, 2)
  "*.linear_proj.weight": S(1)
  "*.linear_fc2.weight": S(1)
  "embedding.word_embeddings.weight": S(0)
  "output_layer.weight": S(0)
  "*": R
"""

MOE_LAYOUT = """\
mesh: {ep: 2, tp: 2}
placements:
  "*.experts.w[13]": [S(0), S(1)]
  "*.experts.w2": [S(0), S(2)]
  "*": R
"""


def _layout_placements(text: str, name: str) -> list[str]:
    """The placements a (tiny, test-local) layout gives ``name`` (first matching glob)."""
    import fnmatch

    import yaml

    rules = yaml.safe_load(text)["placements"]
    for pattern, value in rules.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value if isinstance(value, list) else [value]
    raise AssertionError(name)


def save_hf(directory: Path, sd: dict[str, torch.Tensor], cfg: dict[str, int]) -> Path:
    directory.mkdir(parents=True)
    save_file(sd, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    return directory


def check_ranks(directory: Path, mesh: tuple[int, ...], want: dict[str, torch.Tensor], layout: str) -> None:
    """Every rank file holds, per tensor, exactly torch's split of the transformed full tensor."""
    coords = (
        [(r,) for r in range(mesh[0])] if len(mesh) == 1 else [(a, b) for a in range(2) for b in range(2)]
    )
    n = len(coords)
    for r, coord in enumerate(coords):
        got = load_file(str(directory / f"rank-{r:05d}-of-{n:05d}.safetensors"))
        assert sorted(got) == sorted(want), r
        for name, full in want.items():
            pls = [parse_placement(p) for p in _layout_placements(layout, name)]
            expect = torch_local(full, mesh, coord, pls)
            assert got[name].dtype == full.dtype and torch.equal(got[name], expect), (r, name)


@pytest.fixture()
def hf(tmp_path: Path) -> Path:
    return save_hf(tmp_path / "hf", llama_hf(), LLAMA)


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_to_torchtitan_tp_matches_torch_then_verifies_and_records(
    hf: Path, tmp_path: Path, tp: int
) -> None:
    layout = TT_LAYOUT.format(tp=tp)
    (tmp_path / "tt.yaml").write_text(layout)
    out = tmp_path / f"tt{tp}"
    p = run("convert", str(hf), str(out), "--transforms", "hf-to-torchtitan-llama", "--target-layout",
            str(tmp_path / "tt.yaml"), "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    want = torch_apply(load_transforms("hf-to-torchtitan-llama"), llama_hf(), LLAMA)
    assert "layers.1.attention.qkv_linear.wq.weight" in want and len(want) == 21
    check_ranks(out, (tp,), want, layout)
    # reshard.json records the transforms; inspect shows them
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["transforms"]["origin"] == "hf-to-torchtitan-llama"
    assert manifest["transforms"]["spec"] == load_transforms("hf-to-torchtitan-llama").to_json()
    doc = json.loads(run("inspect", str(out), "--json").stdout)
    assert doc["transforms"]["origin"] == "hf-to-torchtitan-llama" and doc["transforms"]["inverse"] is False
    assert "transforms: hf-to-torchtitan-llama" in run("inspect", str(out)).stderr
    # verify across names and the RoPE permutation
    p = run("verify", str(hf), str(out), "--transforms", "hf-to-torchtitan-llama", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tensors"] == 21
    # without the transforms the names differ: exit 1, every tensor missing or extra
    p = run("verify", str(hf), str(out), "--json")
    assert p.returncode == 1
    assert {d["kind"] for d in json.loads(p.stdout)["differences"]} == {"missing", "extra"}


def test_verify_with_transforms_finds_a_changed_value(hf: Path, tmp_path: Path) -> None:
    (tmp_path / "tt.yaml").write_text(TT_LAYOUT.format(tp=2))
    out = tmp_path / "tt"
    assert run("convert", str(hf), str(out), "--transforms", "hf-to-torchtitan-llama",
               "--target-layout", str(tmp_path / "tt.yaml")).returncode == 0  # fmt: skip
    sd = llama_hf()
    sd["model.layers.1.self_attn.k_proj.weight"][3, 5] += 1.0  # row 3 of k: permuted by RoPE
    other = save_hf(tmp_path / "hf2", sd, LLAMA)
    p = run("verify", str(other), str(out), "--transforms", "hf-to-torchtitan-llama", "--json")
    assert p.returncode == 1, p.stderr
    diffs = json.loads(p.stdout)["differences"]
    assert [d["tensor"] for d in diffs] == ["layers.1.attention.qkv_linear.wk.weight"]
    # torchtitan's _reverse_permute puts HF row 3 (first half of head 0, hd 8) at row 6
    assert diffs[0]["index"] == [6, 5]


def test_plan_shows_which_source_tensors_feed_each_target(hf: Path, tmp_path: Path) -> None:
    (tmp_path / "tt.yaml").write_text(TT_LAYOUT.format(tp=2))
    args = ["--transforms", "hf-to-torchtitan-llama", "--target-layout", str(tmp_path / "tt.yaml")]
    p = run("plan", str(hf), *args, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    feeds = doc["transforms"]["feeds"]
    assert feeds["layers.0.attention.qkv_linear.wk.weight"] == [
        {
            "source": "model.layers.0.self_attn.k_proj.weight",
            "region": [[0, 16], [0, 32]],
            "byte_range": [0, 16 * 32 * 4],
            "bytes": 16 * 32 * 4,
        }
    ]
    assert feeds["tok_embeddings.weight"][0]["source"] == "model.embed_tokens.weight"
    assert not (tmp_path / "out").exists()
    text = run("plan", str(hf), *args).stderr
    assert (
        "layers.0.attention.qkv_linear.wq.weight <- model.layers.0.self_attn.q_proj.weight [0:32,0:32]"
        in text
    )
    # the plan's bytes are what convert writes
    c = run("convert", str(hf), str(tmp_path / "out"), *args, "--json")
    assert json.loads(c.stdout)["bytes_written"] == doc["totals"]["bytes_written"]


def _row_runs(text: str) -> list[tuple[int, int, str]]:
    """The ``rows: holders`` of the first table of a ``--show`` picture (one column)."""
    out = []
    for line in text.split("\n\n")[0].splitlines():
        m = re.match(r"│ (\d+):(\d+) +│ +([\d,\-]+) +│$", line)
        if m:
            out.append((int(m[1]), int(m[2]), m[3]))
    return out


def test_plan_show_draws_a_fused_target_by_the_source_tensors_feeding_it(hf: Path, tmp_path: Path) -> None:
    """Megatron's grouped QKV: which rows come from q, k and v, by torch's own grouped cat of labels."""
    (tmp_path / "meg.yaml").write_text(
        'mesh: {tp: 2}\nplacements:\n  "*.linear_qkv.weight": S(0)\n  "*": R\n'
    )
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    args = ["--transforms", "hf-to-megatron-gpt", "--target-layout", str(tmp_path / "meg.yaml")]
    p = run("plan", str(hf), *args, "--show", name)
    assert p.returncode == 0, p.stderr
    hf_full = llama_hf()
    labels = {
        f"model.layers.0.self_attn.{x}_proj.weight": torch.full_like(
            hf_full[f"model.layers.0.self_attn.{x}_proj.weight"], i
        )
        for i, x in enumerate("qkv")
    }
    rows = megatron_full({**hf_full, **labels})[name][:, 0].tolist()  # each row's source number
    want = []
    for i, r in enumerate(rows):
        if want and want[-1][2] == str(int(r)):
            want[-1] = (want[-1][0], i + 1, want[-1][2])
        else:
            want.append((i, i + 1, str(int(r))))
    assert _row_runs(p.stdout) == want
    doc = json.loads(run("plan", str(hf), *args, "--json").stdout)
    for i, f in enumerate(doc["transforms"]["feeds"][name]):  # plan's regions and byte ranges, numbered
        region = ",".join(f"{a}:{b}" for a, b in f["region"])
        span = f"bytes {f['byte_range'][0]}..{f['byte_range'][1]}"
        assert f"source {i}: {f['source']} [{region}] {span}" in p.stdout
    target = p.stdout.split(f"{name}: target")[1]
    assert _row_runs(target.lstrip("\n").split("\n", 1)[1]) == [(0, 32, "0"), (32, 64, "1")]  # S(0) on tp=2
    assert "source 2\nmodel.layers.0.self_attn.v_proj.weight: shape [16, 32]" in p.stdout


def test_plan_show_through_transforms_draws_padding_and_names_unknown_targets(
    hf: Path, tmp_path: Path
) -> None:
    args = ["--transforms", "hf-to-vllm", "--target-mesh", "tp=2", "--target-layout", "llama-tp"]
    p = run("plan", str(hf), *args, "--show", "model.embed_tokens.weight")
    assert p.returncode == 0, p.stderr
    assert _row_runs(p.stdout) == [(0, 50, "0"), (50, 64, "1")]  # vocab 50 padded to 64 with zeros
    assert f"1: zeros ({(64 - 50) * 32 * 4 / 1024:.2f} KiB)" in p.stdout
    p = run("plan", str(hf), *args, "--show", "model.layers.0.self_attn.q_proj.weight")  # a source name
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "did you mean 'model.layers.0.self_attn.qkv_proj.weight'" in " ".join(p.stderr.split())


def megatron_full(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-Core GPT tensors from HF ones, with torch ops (Megatron-Bridge's merge_qkv_weights)."""
    g, hd, d = 2, 8, 32
    out: dict[str, torch.Tensor] = {}
    for i in range(2):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.view(g, -1, d), k.view(g, hd, d), v.view(g, hd, d)], dim=1
        ).reshape(-1, d)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
    pad = torch.nn.functional.pad
    out["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"], (0, 0, 0, 128 - 50))
    out["output_layer.weight"] = pad(hf["lm_head.weight"], (0, 0, 0, 128 - 50))
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    return out


def test_megatron_tp2_fused_qkv_to_hf_consolidated_in_one_pass(hf: Path, tmp_path: Path) -> None:
    """Megatron TP-2 (per-group fused QKV cut by S(0), per-rank [gate_i; up_i] as _S(0, 2), padded
    vocab) -> HF q/k/v, gate/up, unpadded vocab, consolidated: one convert."""
    full = megatron_full(llama_hf())
    src = tmp_path / "meg"
    src.mkdir()
    for r in range(2):
        local = {
            n: torch_local(
                t, (2,), (r,), [parse_placement(x) for x in _layout_placements(MEGATRON_LAYOUT, n)]
            )
            for n, t in full.items()
        }
        save_file(
            {n: t.contiguous() for n, t in local.items()}, str(src / f"rank-{r:05d}-of-00002.safetensors")
        )
    (tmp_path / "meg.yaml").write_text(MEGATRON_LAYOUT)
    p = run("convert", str(src), str(tmp_path / "out"), "--source-layout", str(tmp_path / "meg.yaml"),
            "--transforms", "hf-to-megatron-gpt", "--inverse", "--model-config", str(hf / "config.json"),
            "--consolidate", "--config-from", str(hf))  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = llama_hf()
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    # and the other way, HF -> Megatron TP-2 with the same layout, equals torch's split
    p = run("convert", str(hf), str(tmp_path / "meg2"), "--transforms", "hf-to-megatron-gpt",
            "--target-layout", str(tmp_path / "meg.yaml"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    check_ranks(tmp_path / "meg2", (2,), full, MEGATRON_LAYOUT)


def moe_hf(experts: int = 4) -> dict[str, torch.Tensor]:
    sd = llama_hf()
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[f"model.layers.{i}.mlp.{name}.weight"]
        sd[f"model.layers.{i}.block_sparse_moe.gate.weight"] = torch.randn(experts, 32, generator=g)
        for e in range(experts):
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            sd[p + "w1.weight"] = torch.randn(24, 32, generator=g).to(torch.bfloat16)
            sd[p + "w3.weight"] = torch.randn(24, 32, generator=g).to(torch.bfloat16)
            sd[p + "w2.weight"] = torch.randn(32, 24, generator=g).to(torch.bfloat16)
    return sd


def test_hf_per_expert_to_stacked_experts_ep_tp_sharded(tmp_path: Path) -> None:
    sd = moe_hf()
    src = save_hf(tmp_path / "moe", sd, {**LLAMA, "num_local_experts": 4})
    (tmp_path / "ep.yaml").write_text(MOE_LAYOUT)
    p = run("convert", str(src), str(tmp_path / "ep"), "--transforms", "mixtral-experts-stack",
            "--target-layout", str(tmp_path / "ep.yaml"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    want = {n: t for n, t in sd.items() if ".experts." not in n}
    for i in range(2):
        p_ = f"model.layers.{i}.block_sparse_moe.experts."
        for w in ("w1", "w2", "w3"):
            want[p_ + w] = torch.stack([sd[f"{p_}{e}.{w}.weight"] for e in range(4)])
    check_ranks(tmp_path / "ep", (2, 2), want, MOE_LAYOUT)
    # and back, from the EP x TP ranks to per-expert HF tensors, consolidated
    p = run("convert", str(tmp_path / "ep"), str(tmp_path / "back"), "--transforms", "mixtral-experts-stack",
            "--inverse", "--model-config", str(src / "config.json"), "--consolidate")  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(got) == sorted(sd)
    for n, t in sd.items():
        assert torch.equal(got[n], t), n


@pytest.mark.parametrize(
    "profile", ["hf-to-torchtitan-llama", "hf-to-megatron-gpt", "hf-to-vllm", "mixtral-experts-stack"]
)
def test_profile_round_trip_through_the_cli_is_byte_identical(tmp_path: Path, profile: str) -> None:
    """A -> B -> A with --inverse: the same files, byte for byte (A written by reshard itself)."""
    moe = profile == "mixtral-experts-stack"
    cfg = {**LLAMA, "num_local_experts": 4} if moe else LLAMA
    raw = save_hf(tmp_path / "raw", moe_hf() if moe else llama_hf(), cfg)
    a = tmp_path / "a"
    assert run("convert", str(raw), str(a), "--consolidate").returncode == 0
    b = tmp_path / "b"
    p = run("convert", str(a), str(b), "--transforms", profile, "--consolidate")
    assert p.returncode == 0, p.stderr
    assert sorted(load_file(str(b / "model.safetensors"))) != sorted(load_file(str(a / "model.safetensors")))
    back = tmp_path / "back"
    p = run("convert", str(b), str(back), "--transforms", profile, "--inverse", "--consolidate")
    assert p.returncode == 0, p.stderr  # B got A's config.json: it names the sizes
    assert (back / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()


def test_transforms_section_in_the_target_layout(hf: Path, tmp_path: Path) -> None:
    spec = tmp_path / "x.yaml"  # a layout file carrying the profile's config: and transforms:
    profile = Path(load_transforms("hf-to-torchtitan-llama").source).read_text()
    spec.write_text(TT_LAYOUT.format(tp=2) + profile)
    p = run("convert", str(hf), str(tmp_path / "out"), "--target-layout", str(spec))
    assert p.returncode == 0, p.stderr
    want = torch_apply(load_transforms("hf-to-torchtitan-llama"), llama_hf(), LLAMA)
    check_ranks(tmp_path / "out", (2,), want, TT_LAYOUT.format(tp=2))
    # the same section given twice is refused
    p = run("convert", str(hf), str(tmp_path / "o2"), "--target-layout", str(spec),
            "--transforms", "hf-to-torchtitan-llama")  # fmt: skip
    assert p.returncode == 2 and "use one" in p.stderr
    assert not (tmp_path / "o2").exists()
    # as a source layout it is refused (transforms go to the target)
    p = run(
        "convert", str(tmp_path / "out"), str(tmp_path / "o3"), "--source-layout", str(spec), "--consolidate"
    )
    assert p.returncode == 2 and "--target-layout" in p.stderr
    assert not (tmp_path / "o3").exists()


L0 = "model.layers.{i}."
BAD = {
    "sizes": (
        f"transforms:\n  - concat:\n      from: ['{L0}mlp.gate_proj.weight', '{L0}mlp.up_proj.weight']\n"
        "      to: 'layers.{i}.w13'\n      sizes: [24, 20]\nallow_unused: true\n",
        "rule 1 (concat)",
    ),
    "duplicate": (
        f"transforms:\n  - rename: {{'{L0}mlp.gate_proj.weight': w, '{L0}mlp.up_proj.weight': w}}\n"
        "allow_unused: true\n",
        'two tensors would be named "w"',
    ),
    "unused": (
        "transforms:\n  - rename: {from: model.norm.weight, to: norm.weight}\n",
        "no transform rule touches",
    ),
    "unmatched": (
        "transforms:\n  - rename: {from: 'nothing.{i}', to: 'x.{i}'}\nallow_unused: true\n",
        "rule 1 (rename): matches no tensor",
    ),
    "heads": (
        f"config: {{heads: 3}}\ntransforms:\n  - rope_permute: {{tensors: '{L0}self_attn.q_proj.weight', "
        "heads: heads}\nallow_unused: true\n",
        "rule 1 (rope_permute)",
    ),
    "missing-partner": (
        f"transforms:\n  - concat:\n      from: ['{L0}mlp.gate_proj.weight', '{L0}mlp.gone.weight']\n"
        "      to: 'w13.{i}'\nallow_unused: true\n",
        "model.layers.0.mlp.gone.weight",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_specs_exit_2_naming_the_rule_and_write_nothing(hf: Path, tmp_path: Path, case: str) -> None:
    text, message = BAD[case]
    (tmp_path / "bad.yaml").write_text(text)
    dst = tmp_path / "out"
    for cmd in (["convert", str(hf), str(dst), "--consolidate"], ["plan", str(hf), "--consolidate"]):
        p = run(*cmd, "--transforms", str(tmp_path / "bad.yaml"))
        assert p.returncode == 2, (case, p.stderr)
        assert message in p.stderr and "Traceback" not in p.stderr, (case, p.stderr)
        assert "bad.yaml" in p.stderr or case == "duplicate", p.stderr
        assert not dst.exists()


def test_unused_tensors_pass_only_with_allow_unused(hf: Path, tmp_path: Path) -> None:
    (tmp_path / "some.yaml").write_text(
        "transforms:\n  - rename: {from: model.norm.weight, to: norm.weight}\n"
    )
    dst = tmp_path / "out"
    p = run("convert", str(hf), str(dst), "--consolidate", "--transforms", str(tmp_path / "some.yaml"))
    assert p.returncode == 2 and "allow_unused" in p.stderr and not dst.exists()
    p = run("convert", str(hf), str(dst), "--consolidate", "--transforms", str(tmp_path / "some.yaml"),
            "--allow-unused")  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = load_file(str(dst / "model.safetensors"))
    want = llama_hf()
    want["norm.weight"] = want.pop("model.norm.weight")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], t) for n, t in want.items())


def test_usage_errors_exit_2_and_write_nothing(hf: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    cases = [
        (["--consolidate", "--inverse"], "need --transforms"),
        (["--consolidate", "--transforms", "no-such-profile"], "profiles: hf-to-megatron-gpt"),
        (["--consolidate", "--transforms", "hf-to-torchtitan-llama", "--model-config", str(tmp_path / "no")],
         "no: no such file"),
        (["--target-mesh", "tp=2", "--transforms", "hf-to-torchtitan-llama"], "--target-layout"),
    ]  # fmt: skip
    (tmp_path / "drop.yaml").write_text(
        "transforms:\n  - drop: {tensors: lm_head.weight}\nallow_unused: true\n"
    )
    cases.append(
        (["--consolidate", "--transforms", str(tmp_path / "drop.yaml"), "--inverse"], "cannot be undone")
    )
    for args, message in cases:
        p = run("convert", str(hf), str(dst), *args)
        assert p.returncode == 2 and message in p.stderr, (args, p.stderr)
        assert not dst.exists()
    # the source's own config.json is the default: a torchtitan dir has none, so the sizes are unknown
    (tmp_path / "tt.yaml").write_text(TT_LAYOUT.format(tp=2))
    tt = tmp_path / "tt"
    assert run("convert", str(hf), str(tt), "--transforms", "hf-to-torchtitan-llama",
               "--target-layout", str(tmp_path / "tt.yaml")).returncode == 0  # fmt: skip
    p = run(
        "convert", str(tt), str(dst), "--transforms", "hf-to-torchtitan-llama", "--inverse", "--consolidate"
    )
    assert p.returncode == 2 and "num_key_value_heads" in p.stderr and "config.json" in p.stderr
    assert not dst.exists()


def test_convert_verify_and_the_python_api_follow_the_transforms(hf: Path, tmp_path: Path) -> None:
    from reshard.api import compare_checkpoints, convert_checkpoint, plan_conversion

    (tmp_path / "tt.yaml").write_text(TT_LAYOUT.format(tp=2))
    out = tmp_path / "tt"
    p = run("convert", str(hf), str(out), "--transforms", "hf-to-torchtitan-llama",
            "--target-layout", str(tmp_path / "tt.yaml"), "--verify", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["verify"]["equal"] is True
    assert compare_checkpoints(hf, out, transforms="hf-to-torchtitan-llama")["equal"]
    assert not compare_checkpoints(hf, out)["equal"]
    back = convert_checkpoint(
        out, tmp_path / "back", consolidate=True, transforms="hf-to-torchtitan-llama", inverse=True,
        model_config=str(hf / "config.json"), verify=True,
    )  # fmt: skip
    assert back["verify"]["equal"] and back["tensors"] == 21
    doc = plan_conversion(hf, target_layout=str(tmp_path / "tt.yaml"), transforms="hf-to-torchtitan-llama")
    assert doc["transforms"]["feeds"]["norm.weight"][0]["source"] == "model.norm.weight"


def test_untie_compares_the_dropped_copy_and_refuses_a_broken_tie(tmp_path: Path) -> None:
    """untie drops lm_head as a copy of the embeddings: only when the values are equal."""
    spec = tmp_path / "untie.yaml"
    spec.write_text(
        "transforms:\n  - untie: {tensor: lm_head.weight, same_as: model.embed_tokens.weight}\n"
        "allow_unused: true\n"
    )
    sd = llama_hf()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["lm_head.weight"][7, 3] = -sd["lm_head.weight"][7, 3]  # a tie that diverged
    broken = save_hf(tmp_path / "broken", sd, LLAMA)
    p = run("convert", str(broken), str(tmp_path / "o1"), "--transforms", str(spec), "--consolidate")
    assert p.returncode == 2, p.stderr
    assert 'untie drops "lm_head.weight" as a copy of "model.embed_tokens.weight"' in p.stderr
    assert "[7, 3]" in p.stderr and not (tmp_path / "o1").exists()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    tied = save_hf(tmp_path / "tied", sd, LLAMA)
    p = run("convert", str(tied), str(tmp_path / "o2"), "--transforms", str(spec), "--consolidate")
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "o2" / "model.safetensors"))
    assert "lm_head.weight" not in got and len(got) == len(sd) - 1


def test_a_fifo_as_transforms_or_model_config_exits_2_at_once(hf: Path, tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for args in (["--transforms", str(fifo)], ["--transforms", "hf-to-vllm", "--model-config", str(fifo)]):
        p = run("plan", str(hf), "--consolidate", *args)  # run() times out instead of hanging
        assert p.returncode == 2 and "FIFO" in p.stderr, (args, p.stderr)


VLLM_LAYOUT = """\
mesh: {tp: 2}
placements:
  "*.qkv_proj.weight": _S(0, 3)
  "*.gate_up_proj.weight": _S(0, 2)
  "*.o_proj.weight": S(1)
  "*.down_proj.weight": S(1)
  "model.embed_tokens.weight": S(0)
  "lm_head.weight": S(0)
  "*": R
"""

HF_TP4 = """\
mesh: {tp: 4}
placements:
  "*.[qkv]_proj.weight": S(0)
  "*.gate_proj.weight": S(0)
  "*.up_proj.weight": S(0)
  "*.o_proj.weight": S(1)
  "*.down_proj.weight": S(1)
  "model.embed_tokens.weight": S(0)
  "lm_head.weight": S(0)
  "*": R
"""


def test_fused_qkv_strided_tp2_splits_into_q_k_v_sharded_tp4_in_one_pass(tmp_path: Path) -> None:
    """vLLM-style qkv_proj [q; k; v] (equal sizes) cut _S(0, 3) over TP-2, gate_up _S(0, 2), vocab
    padded to 64 -> HF q/k/v, gate/up each S(0) over TP-4, vocab unpadded: one convert."""
    cfg = {**LLAMA, "num_key_value_heads": LLAMA["num_attention_heads"]}
    hf = llama_hf(cfg)
    fused = torch_apply(load_transforms("hf-to-vllm"), hf, cfg)
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape == (96, 32)
    src = tmp_path / "vllm"
    src.mkdir()
    for r in range(2):
        local = {
            n: torch_local(t, (2,), (r,), [parse_placement(x) for x in _layout_placements(VLLM_LAYOUT, n)])
            for n, t in fused.items()
        }
        save_file(
            {n: t.contiguous() for n, t in local.items()}, str(src / f"rank-{r:05d}-of-00002.safetensors")
        )
    (tmp_path / "vllm.yaml").write_text(VLLM_LAYOUT)
    (tmp_path / "hf4.yaml").write_text(HF_TP4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = run("convert", str(src), str(tmp_path / "tp4"), "--source-layout", str(tmp_path / "vllm.yaml"),
            "--transforms", "hf-to-vllm", "--inverse", "--model-config", str(tmp_path / "config.json"),
            "--target-layout", str(tmp_path / "hf4.yaml"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    check_ranks(tmp_path / "tp4", (4,), hf, HF_TP4)


def test_hf_to_torchtitan_tp2_equals_torchtitans_own_adapter_split(hf: Path, tmp_path: Path) -> None:
    """Oracle: torchtitan's Llama3StateDictAdapter.from_hf on the full tensors, then torch's
    split per rank; and back, to_hf of those tensors against reshard's consolidated HF."""
    from tests.unit.test_transform_profiles import torchtitan_llama3_adapter

    adapter = torchtitan_llama3_adapter(LLAMA)
    titan = {n: t.contiguous() for n, t in adapter.from_hf(llama_hf()).items()}
    layout = TT_LAYOUT.format(tp=2)
    (tmp_path / "tt.yaml").write_text(layout)
    p = run("convert", str(hf), str(tmp_path / "tt"), "--transforms", "hf-to-torchtitan-llama",
            "--target-layout", str(tmp_path / "tt.yaml"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    check_ranks(tmp_path / "tt", (2,), titan, layout)
    p = run("convert", str(tmp_path / "tt"), str(tmp_path / "hf2"), "--transforms", "hf-to-torchtitan-llama",
            "--inverse", "--model-config", str(hf / "config.json"), "--consolidate")  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    want = adapter.to_hf(titan)
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n], t.contiguous()), n


VLLM_TP4 = """\
mesh: {tp: 4}
placements:
  "*.self_attn.qkv_proj.weight": S(0)
  "*.mlp.gate_up_proj.weight": S(0)
  "*.self_attn.o_proj.weight": S(1)
  "*.mlp.down_proj.weight": S(1)
  "model.embed_tokens.weight": S(0)
  "lm_head.weight": S(0)
  "*": R
"""


def test_hf_to_vllm_sharded_state_tp4_with_replicated_kv_heads_and_back(hf: Path, tmp_path: Path) -> None:
    """--set tp=4 (2 KV heads: each held by two ranks): vLLM's own sharded-state files, each rank's
    qkv_proj = [q_r; k_(r//2); v_(r//2)] by torch.chunk and cat; back to HF byte for byte."""
    from tests.unit.test_transform_profiles import vllm_rank_qkv

    (tmp_path / "vllm.yaml").write_text(VLLM_TP4)
    out, back = tmp_path / "vllm", tmp_path / "back"
    args = ["--transforms", "hf-to-vllm", "--set", "tp=4"]
    p = run("convert", str(hf), str(out), *args, "--target-layout", str(tmp_path / "vllm.yaml"),
            "--to", "sharded-state")  # fmt: skip
    assert p.returncode == 0, p.stderr
    full = load_file(str(hf / "model.safetensors"))
    for r in range(4):
        got = load_file(str(out / f"model-rank-{r}-part-0.safetensors"))
        for i in range(2):
            pre = f"model.layers.{i}."
            q, k, v = (full[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
            assert torch.equal(got[pre + "self_attn.qkv_proj.weight"], vllm_rank_qkv(q, k, v, 2, 4, r)), (
                r,
                i,
            )
            gate_up = torch.cat(
                [torch.chunk(full[pre + f"mlp.{x}_proj.weight"], 4)[r] for x in ("gate", "up")]
            )
            assert torch.equal(got[pre + "mlp.gate_up_proj.weight"], gate_up), (r, i)
        padded = torch.nn.functional.pad(full["model.embed_tokens.weight"], (0, 0, 0, 64 - 50))
        assert torch.equal(got["model.embed_tokens.weight"], torch.chunk(padded, 4)[r])
    manifest = json.loads((out / "reshard.json").read_text())
    assert (
        manifest["transforms"]["set"] == {"tp": 4}
        and {"tp": 4}.items() <= manifest["transforms"]["spec"]["config"].items()
    )
    p = run("convert", str(out), str(back), *args, "--inverse", "--consolidate",
            "--model-config", str(hf / "config.json"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    a = tmp_path / "a"  # the HF model as reshard writes it (the same header metadata)
    assert run("convert", str(hf), str(a), "--consolidate").returncode == 0
    assert (back / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()
    p = run("verify", str(hf), str(out), *args)  # HF seen through the transforms = the vLLM files
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["--set", "tp=3"], "heads / tp': 4 / 3 is not a whole number"),
        (["--set", "tp"], "--set 'tp': write NAME=INTEGER"),
        (["--set", "tp=two"], "--set 'tp=two': write NAME=INTEGER"),
    ],
)
def test_set_values_that_do_not_fit_exit_2_naming_the_rule(
    hf: Path, tmp_path: Path, sets: list[str], message: str
) -> None:
    (tmp_path / "vllm.yaml").write_text(VLLM_TP4.replace("tp: 4", "tp: 3"))
    dst = tmp_path / "out"
    p = run("convert", str(hf), str(dst), "--transforms", "hf-to-vllm", *sets,
            "--target-layout", str(tmp_path / "vllm.yaml"))  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert message in " ".join(p.stderr.split()) and "Traceback" not in p.stderr and not dst.exists()
    p = run("plan", str(hf), "--consolidate", "--set", "tp=2")
    assert p.returncode == 2 and "need --transforms" in p.stderr


def test_the_python_api_takes_set_values(hf: Path, tmp_path: Path) -> None:
    from reshard.api import compare_checkpoints, convert_checkpoint

    (tmp_path / "vllm.yaml").write_text(VLLM_TP4)
    out = tmp_path / "vllm"
    convert_checkpoint(
        hf, out, transforms="hf-to-vllm", sets=["tp=4"], target_layout=str(tmp_path / "vllm.yaml")
    )
    assert compare_checkpoints(hf, out, transforms="hf-to-vllm", sets=["tp=4"])["equal"]
    logical = compare_checkpoints(hf, out, transforms="hf-to-vllm")  # tp 1: [q; k; v], another order
    assert not logical["equal"]
    assert {d["tensor"] for d in logical["differences"]} == {
        f"model.layers.{i}.{t}.weight" for i in range(2) for t in ("self_attn.qkv_proj", "mlp.gate_up_proj")
    }


# -- the KV-heads warning with transforms: the head counts they use, --set included ---------

NOOP = """\
transforms:
  - drop: {tensors: "model.layers.{i}.self_attn.rotary_emb.inv_freq", optional: true}
allow_unused: true
"""


def kv_warnings(p: subprocess.CompletedProcess[str]) -> list[str]:
    assert p.returncode == 0, p.stderr
    return [w for w in json.loads(p.stdout)["warnings"] if "key/value heads" in w]


@pytest.mark.parametrize(
    ("in_config", "sets", "warned"),
    [
        (4, [], None),  # 4 KV heads in config.json: TP-4 keeps whole heads
        (4, ["--set", "num_key_value_heads=2"], "--set num_key_value_heads=2"),  # --set wins
        (2, [], "config.json"),
        (2, ["--set", "num_key_value_heads=4"], None),
    ],
)
def test_kv_heads_warning_takes_set_values_over_config_json(
    tmp_path: Path, in_config: int, sets: list[str], warned: str | None
) -> None:
    """TP-4 over k/v rows warns when the KV-head count the transforms use (``--set`` over
    config.json) is below 4, whatever config.json says."""
    src = save_hf(tmp_path / "hf", llama_hf(), {**LLAMA, "num_key_value_heads": in_config})
    (tmp_path / "noop.yaml").write_text(NOOP)
    p = run("convert", str(src), str(tmp_path / "out"), "--transforms", str(tmp_path / "noop.yaml"), *sets,
            "--target-layout", "llama-tp", "--target-mesh", "tp=4", "--json")  # fmt: skip
    got = kv_warnings(p)
    if warned is None:
        assert got == []
        return
    assert len(got) == 1, got
    heads = 2
    assert re.search(
        rf'shards "model\.layers\.0\.self_attn\.k_proj\.weight" 4 ways, which exceeds the {heads} key/value '
        rf"heads \(num_key_value_heads, from [^)]*{re.escape(warned)}",
        got[0],
    ), got[0]
    assert "key/value heads" in p.stderr


def test_kv_heads_warning_through_vllm_files_and_back(hf: Path, tmp_path: Path) -> None:
    """HF -> vLLM TP-4 (2 KV heads): qkv_proj fused by the transforms with whole KV heads repeated
    per rank, no warning. vLLM -> HF k/v split back out and sharded S(0) over TP-4: a warning,
    with the count the transforms use: --set num_key_value_heads=2 where config.json says 4."""
    (tmp_path / "vllm.yaml").write_text(VLLM_TP4)
    vllm = tmp_path / "vllm"
    p = run("convert", str(hf), str(vllm), "--transforms", "hf-to-vllm", "--set", "tp=4",
            "--target-layout", str(tmp_path / "vllm.yaml"), "--to", "sharded-state", "--json")  # fmt: skip
    assert kv_warnings(p) == []
    # config.json says 4 KV heads: rank files of one KV head each fit that too (4 distinct heads)
    lying = tmp_path / "config.json"
    lying.write_text(json.dumps({**LLAMA, "num_key_value_heads": 4}))
    back = ["convert", str(vllm), str(tmp_path / "back"), "--transforms", "hf-to-vllm", "--inverse",
            "--set", "tp=4", "--model-config", str(lying), "--target-layout", "llama-tp",
            "--target-mesh", "tp=4", "--json", "--overwrite"]  # fmt: skip
    assert kv_warnings(run(*back)) == []
    got = kv_warnings(run(*back, "--set", "num_key_value_heads=2"))
    assert len(got) == 1 and "the 2 key/value heads (num_key_value_heads, from --set" in got[0], got
    assert "model.layers.0.self_attn.k_proj.weight" in got[0]
    assert kv_warnings(run(*back[:-4], "--target-mesh", "tp=2", "--json", "--overwrite",
                           "--set", "num_key_value_heads=2")) == []  # fmt: skip


def test_the_python_api_warns_with_set_values(tmp_path: Path) -> None:
    from reshard.api import convert_checkpoint

    src = save_hf(tmp_path / "hf", llama_hf(), {**LLAMA, "num_key_value_heads": 4})
    (tmp_path / "noop.yaml").write_text(NOOP)
    kw: dict[str, Any] = {"transforms": str(tmp_path / "noop.yaml"), "target_layout": "llama-tp"}
    kw["target_mesh"] = "tp=4"
    plain = convert_checkpoint(src, tmp_path / "a", **kw)
    assert not [w for w in plain["warnings"] if "key/value heads" in w]
    got = convert_checkpoint(src, tmp_path / "b", sets=["num_key_value_heads=2"], **kw)["warnings"]
    assert [w for w in got if "the 2 key/value heads (num_key_value_heads, from --set" in w]


# -- vLLM files read back: the replicated KV copies not read are compared, as replicas --------


def flip_bit(path: Path, tensor: str, row: int, col: int) -> None:
    """Flip the lowest bit of element [row, col] of an F32 2-d tensor in a safetensors file."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8 : 8 + n])[tensor]
    assert entry["dtype"] == "F32"
    data[8 + n + entry["data_offsets"][0] + (row * entry["shape"][1] + col) * 4] ^= 1
    path.write_bytes(bytes(data))


def test_verify_compares_the_kv_copies_vllm_ranks_hold(hf: Path, tmp_path: Path) -> None:
    """2 KV heads at TP-4: ranks 2j and 2j+1 both hold KV head j. Reading the files back takes
    rank 2j's copy; verify compares rank 2j+1's with it and names both files when they differ."""
    (tmp_path / "vllm.yaml").write_text(VLLM_TP4)
    vllm = tmp_path / "vllm"
    tp4 = ["--transforms", "hf-to-vllm", "--set", "tp=4"]
    p = run("convert", str(hf), str(vllm), *tp4, "--target-layout", str(tmp_path / "vllm.yaml"),
            "--to", "sharded-state")  # fmt: skip
    assert p.returncode == 0, p.stderr
    back = ["verify", str(vllm), str(hf), *tp4, "--inverse", "--model-config", str(hf / "config.json")]
    p = run(*back, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    # rank 3's qkv_proj = [q_3 (8 rows); k_1 (8 rows); v_1 (8 rows)]: row 8 + 3 is k_proj row 8 + 3
    flip_bit(vllm / "model-rank-3-part-0.safetensors", "model.layers.1.self_attn.qkv_proj.weight", 8 + 3, 5)
    p = run(*back, "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False
    (d,) = doc["differences"]
    assert d["kind"] == "replica" and d["tensor"] == "model.layers.1.self_attn.k_proj.weight"
    assert d["index"] == [8 + 3, 5]
    assert Path(d["path"]).name == "model-rank-3-part-0.safetensors"
    assert Path(d["other"]).name == "model-rank-2-part-0.safetensors"
    assert "model-rank-3-part-0.safetensors" in d["message"] and "model-rank-2-part-0" in d["message"]
    p = run(*back)
    assert p.returncode == 1 and "model.layers.1.self_attn.k_proj.weight" in p.stderr, p.stderr
    p = run(*back, "--exclude", "*.k_proj.weight")  # not selected: not compared
    assert p.returncode == 0, p.stdout + p.stderr
    p = run("verify", str(hf), str(vllm), *tp4)  # HF seen as vLLM files: every copy compared already
    assert p.returncode == 1 and "qkv_proj" in p.stderr, p.stderr
    from reshard.api import compare_checkpoints

    got = compare_checkpoints(vllm, hf, transforms="hf-to-vllm", sets=["tp=4"], inverse=True,
                              model_config=str(hf / "config.json"))  # fmt: skip
    assert not got["equal"] and [x["kind"] for x in got["differences"]] == ["replica"]


def test_verify_with_transforms_drops_excluded_source_tensors_first(tmp_path: Path) -> None:
    """A checkpoint cut mid-layer (an expert's w3 missing) stacks once that layer is excluded:
    convert drops it before the transforms, and so must verify, with no 'matches nothing' warning."""
    sd = moe_hf()
    del sd["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    src = save_hf(tmp_path / "moe", sd, {**LLAMA, "num_local_experts": 4})
    cut = ("--transforms", "mixtral-experts-stack", "--exclude", "model.layers.1.*")
    p = run("convert", str(src), str(tmp_path / "out"), *cut, "--consolidate")
    assert p.returncode == 0, p.stderr
    p = run("verify", str(src), str(tmp_path / "out"), *cut)
    assert p.returncode == 0, p.stderr
    assert "matches nothing" not in p.stderr and "equal:" in p.stderr
    p = run("verify", str(src), str(tmp_path / "out"), "--transforms", "mixtral-experts-stack")
    assert p.returncode == 2 and "missing [3]" in p.stderr  # without it, the cut layer cannot stack
    bad = (*cut, "--exclude", "nothing.*")  # an exclusion matching nowhere is still said
    p = run("verify", str(src), str(tmp_path / "out"), *bad)
    assert p.returncode == 0 and 'warning: --exclude "nothing.*" matches nothing' in p.stdout + p.stderr


def test_hf_to_vllm_fuses_the_biases_of_a_transformers_qwen2(tmp_path: Path) -> None:
    """A Qwen2 that transformers saved: at TP-2 each rank's qkv_proj.bias is vLLM's [q_r; k_r; v_r]
    of the model's own biases (they were left as three tensors vLLM does not have)."""
    pytest.importorskip("transformers")
    from tests import tiny_models

    tiny_models.build("qwen2", tmp_path / "qwen2")
    hf = load_file(str(tmp_path / "qwen2" / "model.safetensors"))
    args = ["--transforms", "hf-to-vllm", "--set", "tp=2", "--target-layout", "llama-tp"]
    args += ["--target-mesh", "tp=2"]
    p = run("convert", str(tmp_path / "qwen2"), str(tmp_path / "vllm"), *args)
    assert p.returncode == 0, p.stderr
    for r in range(2):
        got = load_file(str(tmp_path / "vllm" / f"rank-{r:05d}-of-00002.safetensors"))
        for i in range(2):
            at = f"model.layers.{i}.self_attn."
            q, k, v = (hf[at + f"{x}_proj.bias"] for x in "qkv")
            assert not any(f"{at}{x}_proj.bias" in got for x in "qkv")
            want = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])  # 2 KV heads: one a rank
            assert torch.equal(got[at + "qkv_proj.bias"], want), (r, i)
