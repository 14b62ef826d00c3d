"""Transform specs: each operation against torch ops, the YAML, inverse specs and error messages.

The numpy reference executor (tests/transform_ref.py) materialises targets
from the resolved parts; torch does the same transform on full tensors.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.errors import ConfigError
from reshard.indexmap import Seg, identity_part
from reshard.transforms import (
    TransformSpec,
    apply,
    inverse,
    load_hf_config,
    load_transforms,
    parse_transforms_text,
)
from tests.transform_ref import arange_sources, run_spec, torch_apply


def spec_of(text: str) -> TransformSpec:
    return parse_transforms_text(textwrap.dedent(text), "spec.yaml")


def check(
    spec: TransformSpec, shapes: dict[str, tuple[int, ...]], config: dict[str, int] | None = None
) -> dict:
    """numpy-through-parts equals torch on full tensors, bit for bit; returns the numpy result."""
    src = arange_sources(shapes)
    got = run_spec(spec, src, config)
    want = torch_apply(spec, {n: torch.from_numpy(a) for n, a in src.items()}, config)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == tuple(want[name].shape), name
        assert got[name].tobytes() == want[name].contiguous().numpy().tobytes(), name
    return got


def test_pure_modules_do_not_import_torch() -> None:
    import subprocess

    code = "import sys, reshard.transforms, reshard.indexmap; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_megatron_qkv_groups_match_bridge_merge() -> None:
    """concat with groups = Megatron-Bridge merge_qkv_weights: per group [q heads, k, v]."""
    heads, kv, hd, d = 8, 2, 4, 3
    spec = spec_of("""
        config: {heads: 8, kv_heads: 2, head_dim: 4}
        transforms:
          - concat:
              from: ["l.{i}.q", "l.{i}.k", "l.{i}.v"]
              to: "l.{i}.qkv"
              groups: kv_heads
              sizes: [heads*head_dim, kv_heads*head_dim, kv_heads*head_dim]
    """)
    src = arange_sources({"l.0.q": (heads * hd, d), "l.0.k": (kv * hd, d), "l.0.v": (kv * hd, d)})
    got = run_spec(spec, src)["l.0.qkv"]
    q, k, v = (torch.from_numpy(src[f"l.0.{x}"]) for x in "qkv")
    # Megatron-Bridge merge_qkv_weights: view per group, cat along the in-group dim
    want = torch.cat([q.view(kv, heads // kv * hd, d), k.view(kv, hd, d), v.view(kv, hd, d)], dim=1).reshape(
        -1, d
    )
    assert np.array_equal(got, want.numpy())
    parts = apply(spec, {n: a.shape for n, a in src.items()})["l.0.qkv"].parts
    assert [len(p.dims[0].segs) for p in parts] == [kv, kv, kv]  # 3 * groups block copies
    back = run_spec(inverse(spec), {"l.0.qkv": got})
    assert all(np.array_equal(back[n], src[n]) for n in src)


def test_alternating_gate_up_rows_are_one_strided_segment() -> None:
    """gpt-oss: gate = gate_up[::2], up = gate_up[1::2]; each is a single strided segment."""
    spec = spec_of("""
        config: {ffn: 5}
        transforms:
          - split: {from: "e.gate_up", to: ["e.gate", "e.up"], groups: ffn, sizes: [ffn, ffn]}
    """)
    src = arange_sources({"e.gate_up": (10, 3)})
    got = run_spec(spec, src)
    assert np.array_equal(got["e.gate"], src["e.gate_up"][::2])
    assert np.array_equal(got["e.up"], src["e.gate_up"][1::2])
    out = apply(spec, {"e.gate_up": (10, 3)})
    assert out["e.up"].parts[0].dims[0].segs == (Seg(0, 1, 5, 1, 2),)
    check(inverse(spec), {"e.gate": (5, 3), "e.up": (5, 3)}, None)


def test_rope_permute_matches_torchtitan_formula() -> None:
    """to: hf is w.view(h, hd/2, 2, D).transpose(1, 2); to: meta undoes it; 2 segments per head."""
    h, hd, d = 3, 6, 5
    spec = spec_of("""
        transforms:
          - rope_permute: {tensors: "wq", heads: 3, to: hf}
    """)
    src = arange_sources({"wq": (h * hd, d)})
    w = torch.from_numpy(src["wq"])
    want = w.view(h, hd // 2, 2, d).transpose(1, 2).reshape(h * hd, d)
    assert np.array_equal(run_spec(spec, src)["wq"], want.numpy())
    meta = run_spec(inverse(spec), {"wq": want.numpy()})["wq"]
    assert np.array_equal(meta, src["wq"])
    assert len(apply(spec, {"wq": (h * hd, d)})["wq"].parts[0].dims[0].segs) == 2 * h


def test_stack_unstack_experts() -> None:
    spec = spec_of("""
        transforms:
          - stack: {from: "layers.{l}.experts.{e}.w1", to: "layers.{l}.experts.w1", index: e, count: 3}
    """)
    shapes = {f"layers.{layer}.experts.{e}.w1": (4, 2) for layer in range(2) for e in range(3)}
    got = check(spec, shapes)
    assert got["layers.1.experts.w1"].shape == (3, 4, 2)
    check(inverse(spec), {f"layers.{i}.experts.w1": (3, 4, 2) for i in range(2)})
    dim1 = spec_of("""
        transforms:
          - unstack: {from: "x", to: "x.{e}", index: e, dim: 1}
    """)
    assert sorted(check(dim1, {"x": (2, 3, 4)})) == ["x.0", "x.1", "x.2"]


def test_pad_unpad_vocab() -> None:
    spec = spec_of("""
        config: {vocab: 10}
        transforms:
          - pad: {tensors: "*embed*", dim: 0, multiple: 4, size: vocab}
    """)
    got = check(spec, {"embed": (10, 3)})
    assert got["embed"].shape == (12, 3) and not got["embed"][10:].any()
    back = run_spec(inverse(spec), got)
    assert np.array_equal(back["embed"], arange_sources({"embed": (10, 3)})["embed"])
    check(spec_of("transforms: [{unpad: {tensors: w, size: 2, dim: 1}}]"), {"w": (3, 5)})


def test_an_unpad_whose_multiple_does_not_fit_says_which_does() -> None:
    """Megatron pads the vocab to make_vocab_size_divisible_by x TP: a 100-row vocab saved at 256
    rows, read with the profile's 128, names the multiple that fits and the --set to give."""
    spec = spec_of("""
        config: {vocab: 100, vocab_multiple: 128}
        transforms:
          - unpad: {tensors: emb, dim: 0, multiple: vocab_multiple, size: vocab}
    """)
    with pytest.raises(ConfigError) as e:
        apply(spec, {"emb": (256, 4)})
    assert "has 256 along dim 0, but size 100 pads to 128 (a multiple of 128)" in str(e.value)
    assert "give --set vocab_multiple=256" in str(e.value)
    fixed = spec_of("""
        config: {vocab: 100, vocab_multiple: 256}
        transforms:
          - unpad: {tensors: emb, dim: 0, multiple: vocab_multiple, size: vocab}
    """)
    assert apply(fixed, {"emb": (256, 4)})["emb"].shape == (100, 4)


def test_tie_untie_rename_transpose_drop() -> None:
    spec = spec_of("""
        transforms:
          - tie: {from: "model.embed_tokens.weight", to: "lm_head.weight"}
          - rename: {"re:model\\\\.(.*)": "\\\\1", "lm_head.weight": "output.weight"}
          - transpose: {tensors: "output.weight", dims: [1, 0]}
          - drop: {tensors: "*.inv_freq", optional: true}
    """)
    got = check(spec, {"model.embed_tokens.weight": (5, 3), "model.l.inv_freq": (2,)})
    assert sorted(got) == ["embed_tokens.weight", "output.weight"]
    assert np.array_equal(got["output.weight"], got["embed_tokens.weight"].T)
    untie = spec_of("""
        transforms:
          - untie: {tensor: lm_head.weight, same_as: embed.weight}
          - rename: {from: embed.weight, to: embed.weight}
    """)
    assert sorted(run_spec(untie, arange_sources({"lm_head.weight": (2, 2), "embed.weight": (2, 2)}))) == [
        "embed.weight"
    ]


def test_split_targets_may_drop_captures() -> None:
    """Templates use a subset of the pattern's captures; unknown captures are refused up front."""
    spec = spec_of("transforms: [{split: {from: 'a.{i}.{j}', to: ['b.{i}', 'c.{j}']}}]")
    assert sorted(apply(spec, {"a.0.1": (4,)})) == ["b.0", "c.1"]
    with pytest.raises(ConfigError, match="uses \\{k\\}, but 'x.{i}' captures i"):
        spec_of("transforms: [{concat: {from: ['x.{i}', 'y.{k}'], to: 'z.{i}'}}]")


def test_chain_collapses_to_direct_reads() -> None:
    """split -> rope -> concat composes into parts that read the original tensor only."""
    spec = spec_of("""
        transforms:
          - split: {from: qk, to: [q, k], sizes: [8, 4]}
          - rope_permute: {tensors: q, heads: 2, to: hf}
          - rope_permute: {tensors: k, heads: 1, to: hf}
          - concat: {from: [q, k], to: qk, sizes: [8, 4]}
    """)
    out = apply(spec, {"qk": (12, 3)})
    assert {p.source for p in out["qk"].parts} == {"qk"}
    check(spec, {"qk": (12, 3)})
    ident = apply(inverse(spec), {"qk": (12, 3)})
    assert ident["qk"].parts != (identity_part("qk", (12, 3)),)  # the inverse alone permutes
    check(inverse(spec), {"qk": (12, 3)})


def test_identity_round_trip_parts() -> None:
    """spec then inverse(spec), composed, is the identity map with one part per tensor."""
    from reshard.indexmap import compose, merge_parts

    spec = spec_of("""
        config: {g: 2}
        transforms:
          - split: {from: "a.{i}", to: ["b.{i}", "c.{i}"], groups: g, sizes: [4, 2]}
          - pad: {tensors: "c.{i}", multiple: 4, size: 2}
          - stack: {from: "b.{i}", to: "b", index: i}
    """)
    shapes = {"a.0": (6, 2), "a.1": (6, 2)}
    fwd = apply(spec, shapes)
    back = apply(inverse(spec), {n: t.shape for n, t in fwd.items()})
    inner = {n: t.parts for n, t in fwd.items()}
    for name, t in back.items():
        parts = merge_parts([c for p in t.parts for c in compose(p, inner)])
        assert parts == (identity_part(name, shapes[name]),), name


ERRORS = [
    (
        "transforms: [{split: {from: w, to: [a, b], sizes: [3, 4]}}]",
        {"w": (8, 2)},
        'spec.yaml:1: transforms rule 1 (split): sizes [3, 4] add up to 7, but "w" has 8 along dim 0',
    ),
    (
        "transforms: [{rename: {from: '{x}.w', to: w}}]",
        {"a.w": (1,), "b.w": (1,)},
        'transforms rule 1 (rename): two tensors would be named "w"',
    ),
    (
        "transforms: [{rename: {from: a, to: b}}]",
        {"a": (1,), "c": (1,)},
        "spec.yaml: no transform rule touches 'c'; add a rule for them",
    ),
    (
        "transforms: [{rename: {from: zz, to: b}}]",
        {"a": (1,)},
        "transforms rule 1 (rename): matches no tensor; fix the pattern, or add optional: true",
    ),
    (
        "transforms: [{concat: {from: ['{i}.q', '{i}.k'], to: '{i}.qk'}}]",
        {"0.q": (2,)},
        'transforms rule 1 (concat): tensor "0.k" is missing (needed with "0.q")',
    ),
    (
        "transforms: [{stack: {from: 'x.{e}', to: x, index: e}}]",
        {"x.0": (2,), "x.2": (2,)},
        'transforms rule 1 (stack): "x": stacking needs indices 0..1; missing [1], unexpected [2]',
    ),
    (
        "config: {a: b, b: a}\ntransforms: [{pad: {tensors: w, multiple: a}}]",
        {"w": (3,)},
        "config names refer to each other in a cycle",
    ),
    (
        "transforms: [{rope_permute: {tensors: w, heads: 2}}]",
        {"w": (6, 2)},
        '"w" has 6 rows along dim 0: not 2 heads of an even head_dim',
    ),
    (
        "transforms: [{split: {from: w, to: [a, b], sizes: [heads, 2]}}]",
        {"w": (4,)},
        "unknown size name 'heads'; define it under config:",
    ),
]


@pytest.mark.parametrize(("text", "shapes", "message"), ERRORS)
def test_errors_name_the_rule(text: str, shapes: dict[str, tuple[int, ...]], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        apply(spec_of(text), shapes)
    assert message in str(e.value)
    assert e.value.path == "spec.yaml"


def test_concat_dtypes_must_agree() -> None:
    spec = spec_of("transforms: [{concat: {from: [a, b], to: c}}]")
    with pytest.raises(ConfigError, match="different dtypes \\(a F32, b BF16\\)"):
        apply(spec, {"a": (2,), "b": (2,)}, dtypes={"a": "F32", "b": "BF16"})


YAML_ERRORS = [
    ("transforms:\n  - renme: {from: a, to: b}\n",
     "spec.yaml:2: transforms rule 1: unknown operation 'renme'; did you mean 'rename'?"),
    ("transforms:\n  - split: {from: a, to: [b, c], dims: 0}\n", "spec.yaml:2: transforms rule 1 (split): "
     "unknown field 'dims'; did you mean 'dim'?"),
    ("transforms:\n  - stack: {from: a, to: b}\n", "transforms rule 1 (stack): missing index:"),
    ("transforms:\n  - stack: {from: 'x.{e}', to: 'y.{e}', index: e}\n", "must not use the index {e}"),
    ("transforms:\n  - rename: {from: 'a.{i}', to: 'b.{j}'}\n", "uses {j}, but 'a.{i}' captures i"),
    ("transforms:\n  - split: {from: a, to: [b, c], sizes: [__import__('os'), 1]}\n",
     "may only use integers, config names"),
    ("transforms: []\nmesh: {tp: 2}\nconfig: {h: [1]}\n", "spec.yaml:3: config 'h': a size must be"),
    ("transfroms: []\n", "unknown top-level key 'transfroms'; did you mean 'transforms'?"),
    ("transforms:\n  - drop: {tensors: a, optional: 1}\n", "optional: must be true or false, got 1"),
    ("transforms:\n  - split: {from: a, to: [b, c], sizes: [abs(1), 1]}\n", "min(..) and max(..)"),
    ("transforms:\n  - split: {from: a, to: [b, c], sizes: [min(x=1), 1]}\n", "min(..) and max(..)"),
    ("transforms:\n  - split: {from: a, to: [b, c], shards: [1, 1]}\n", "split with shards: needs sizes:"),
    ("transforms:\n  - concat: {from: [a, b], to: c, shards: [1]}\n", "shards: has 1 entries but from:"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), YAML_ERRORS)
def test_yaml_errors_name_file_line_and_rule(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_transforms_text(text, "spec.yaml")
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("transforms: [{drop: {tensors: a}}]", "rule 1 (drop): drop cannot be undone"),
        ("transforms: [{unpad: {tensors: a, size: 3}}]", "unpad without multiple: or padded_size:"),
        ("transforms: [{concat: {from: [a, b], to: c}}]", "concat without sizes: cannot be inverted"),
        ("transforms: [{rename: {from: 're:a(.*)', to: 'b\\1'}}]", "cannot be inverted: use only {name}"),
        ("transforms: [{pad: {tensors: a, multiple: 8}}]", "pad without size: cannot be inverted"),
    ],
)
def test_inverse_refuses_lossy_rules(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        inverse(spec_of(text))


def test_layout_file_with_transforms_section_loads_as_layout_and_as_spec(tmp_path: Path) -> None:
    """A layout carrying transforms is both: its rules load as a layout, its section as a spec."""
    from reshard.config import parse_layout_text
    from reshard.transform_plan import layout_transforms

    text = "mesh: {tp: 2}\nplacements: {'*': R}\nconfig: {h: 2}\ntransforms: [{drop: {tensors: x}}]\n"
    assert parse_layout_text(text, "l.yaml").mesh.size == 2
    assert len(parse_transforms_text(text, "l.yaml").ops) == 1
    (tmp_path / "l.yaml").write_text(text, encoding="utf-8")
    spec = layout_transforms(str(tmp_path / "l.yaml"))
    assert spec is not None and len(spec.ops) == 1
    (tmp_path / "plain.yaml").write_text("mesh: {tp: 2}\nplacements: {'*': R}\n", encoding="utf-8")
    assert layout_transforms(str(tmp_path / "plain.yaml")) is None


def test_sizes_from_model_config_json(tmp_path: Path) -> None:
    """Size names resolve through config: expressions to config.json keys (text_config merged)."""
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"num_attention_heads": 2, "hidden_size": 8}}), encoding="utf-8"
    )
    cfg = load_hf_config(tmp_path / "config.json")
    spec = spec_of("""
        config: {head_dim: hidden_size // num_attention_heads}
        transforms:
          - split: {from: w, to: [a, b], sizes: [head_dim, hidden_size - head_dim]}
    """)
    assert {n: t.shape for n, t in apply(spec, {"w": (8, 1)}, config=cfg).items()} == {
        "a": (4, 1),
        "b": (4, 1),
    }
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_hf_config(tmp_path / "bad.json")


def test_unknown_profile_lists_the_profiles() -> None:
    with pytest.raises(ConfigError, match="no such transforms file or profile; profiles: hf-to-megatron-gpt"):
        load_transforms("hf-to-nowhere")


@pytest.mark.parametrize(
    "profile", ["hf-to-torchtitan-llama", "hf-to-megatron-gpt", "hf-to-vllm", "mixtral-experts-stack"]
)
def test_to_json_dumps_back_to_the_same_spec(profile: str) -> None:
    """to_json -> YAML -> parse gives the same operations, for a profile and for its inverse."""
    import yaml

    for spec in (load_transforms(profile), inverse(load_transforms(profile))):
        again = parse_transforms_text(yaml.safe_dump(spec.to_json(), sort_keys=False), "dumped.yaml")
        assert (again.ops, again.config, again.allow_unused) == (spec.ops, spec.config, spec.allow_unused)
        assert again.model_types == spec.model_types and spec.model_types
    text = yaml.safe_dump(inverse(load_transforms("hf-to-megatron-gpt")).to_json(), sort_keys=False)
    assert "split:" in text and "unpad:" in text


def test_every_profile_lists_the_model_types_it_is_made_for() -> None:
    """Each shipped profile names the config.json model_type values its tests and oracles cover;
    the inverse keeps them (its model config is the same HF config.json)."""
    from reshard.transforms import list_profiles

    for name in list_profiles():
        spec = load_transforms(name)
        assert spec.model_types and all(k == k.lower() and " " not in k for k in spec.model_types), name
        assert inverse(spec).model_types == spec.model_types, name
    assert load_transforms("hf-to-torchtitan-llama").model_types == ("llama", "mistral")
    assert "gemma" not in load_transforms("hf-to-megatron-gpt").model_types


def test_model_types_a_mismatch_is_a_warning_and_bad_values_are_refused(tmp_path: Path) -> None:
    """model_types: [..] is checked against config.json's model_type: another family gives a
    warning naming the profile, the model_type and the listed ones; absent keys warn nothing."""
    from reshard.config import parse_layout_text
    from reshard.transforms import family_warning

    spec = spec_of("""
        model_types: [llama, mistral]
        transforms: [{drop: {tensors: x}}]
        """)
    assert spec.model_types == ("llama", "mistral")
    note = family_warning(spec, {"model_type": "gemma"}, "mine.yaml")
    assert note is not None and "profile mine.yaml is made for model_type llama, mistral" in note
    assert "model_type 'gemma'" in note
    for config in ({"model_type": "mistral"}, {}, None, {"model_type": 3}):
        assert family_warning(spec, config, "mine.yaml") is None
    assert family_warning(spec_of("transforms: [{drop: {tensors: x}}]"), {"model_type": "gemma"}, "p") is None
    for bad in ("[]", "llama", "[llama, 3]", "['']", "{a: b}"):
        with pytest.raises(ConfigError, match=r"spec.yaml:1:.*model_types: must be a list"):
            spec_of(f"model_types: {bad}\ntransforms: [{{drop: {{tensors: x}}}}]\n")
    text = "mesh: {tp: 2}\nplacements: {'*': R}\nmodel_types: [llama]\ntransforms: [{drop: {tensors: x}}]\n"
    assert parse_layout_text(text, "l.yaml").mesh.size == 2  # a layout with a transforms section
    assert parse_transforms_text(text, "l.yaml").model_types == ("llama",)


def test_megatron_torch_dist_is_a_flag_of_the_forward_spec_only() -> None:
    """megatron_torch_dist: true (what makes --to dcp add Megatron's two files) is kept in the
    recorded spec, dropped by the inverse (its names are HF's), taken from a chain's last spec,
    and anything but a boolean is refused naming the file and line."""
    from reshard.transforms import chained

    spec = spec_of("megatron_torch_dist: true\ntransforms: [{rename: {a: b}}]\n")
    assert spec.megatron_torch_dist and spec.to_json()["megatron_torch_dist"] is True
    assert not inverse(spec).megatron_torch_dist and "megatron_torch_dist" not in inverse(spec).to_json()
    plain = spec_of("transforms: [{rename: {b: c}}]")
    assert not plain.megatron_torch_dist and "megatron_torch_dist" not in plain.to_json()
    assert chained([plain, spec]).megatron_torch_dist and not chained([spec, plain]).megatron_torch_dist
    for bad in ("yes-please", "1", "[true]"):
        with pytest.raises(ConfigError, match=r"spec.yaml:1:.*megatron_torch_dist: must be true or false"):
            spec_of(f"megatron_torch_dist: {bad}\ntransforms: [{{drop: {{tensors: x}}}}]\n")
    shipped = load_transforms("hf-to-megatron-torch-dist")
    assert shipped.megatron_torch_dist and not load_transforms("hf-to-megatron-gpt").megatron_torch_dist


def test_concat_shards_repeat_chunks_and_split_reads_the_first_copy() -> None:
    """groups 4, b cut into 2 chunks each held by two groups: [a0 b0 a1 b0 a2 b1 a3 b1] (torch.cat)."""
    spec = spec_of("""
        config: {n: 2}
        transforms:
          - concat: {from: [a, b], to: f, groups: 4, sizes: [8, 4], shards: [4, "max(1, min(n, 4))"]}
        """)
    a, b = torch.arange(8 * 3).reshape(8, 3), 100 + torch.arange(4 * 3).reshape(4, 3)
    got = run_spec(spec, {"a": a.numpy(), "b": b.numpy()})
    ca, cb = torch.chunk(a, 4), torch.chunk(b, 2)
    want = torch.cat([x for g in range(4) for x in (ca[g], cb[g // 2])])
    assert torch.equal(torch.from_numpy(got["f"]), want)
    back = run_spec(inverse(spec), got)
    assert torch.equal(torch.from_numpy(back["a"]), a) and torch.equal(torch.from_numpy(back["b"]), b)
    with pytest.raises(ConfigError, match=r"shards \[4, 3\] do not fit: each must divide groups: 4"):
        apply(spec.with_values({"n": 3}), {"a": (8, 3), "b": (4, 3)})


class _NoMemo(dict):  # type: ignore[type-arg]
    def get(self, *_a: object) -> None:  # type: ignore[override]
        return None

    def __setitem__(self, *_a: object) -> None:
        pass


@pytest.mark.parametrize("stacked", [False, True])
def test_remembered_compositions_equal_composing_each_output(
    stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs alike but for names are composed once (transforms._composed): the parts of every
    output are those composing it on its own gives, and torch agrees on the values; a tensor
    read twice by one output (concat of x with itself) is not taken for two tensors."""
    import reshard.transforms as tr

    base = """
        config: {ffn: 4}
        transforms:
          - concat:
              from: ["layers.{l}.experts.{e}.gate", "layers.{l}.experts.{e}.up"]
              to: "layers.{l}.experts.{e}.gate_up"
              sizes: [ffn, ffn]
          - stack: {from: "layers.{l}.experts.{e}.gate_up", to: "layers.{l}.experts.gate_up", index: e}
    """
    spec = spec_of(base + '      - concat: {from: ["twice.{k}", "twice.{k}"], to: "doubled.{k}"}\n')
    shapes: dict[str, tuple[int, ...]] = {
        f"layers.{i}.experts.{e}.{w}": (4, 3) for i in range(3) for e in range(5) for w in ("gate", "up")
    }
    shapes |= {"twice.0": (2, 3), "twice.1": (2, 3)}
    if stacked:  # the inverse: unstack and split, 5 outputs reading each stacked tensor
        shapes = {f"layers.{i}.experts.gate_up": (5, 8, 3) for i in range(3)}
        spec = inverse(spec_of(base))
    tr._COMPOSED.clear()
    remembered = apply(spec, shapes)
    monkeypatch.setattr(tr, "_COMPOSED", _NoMemo())
    each = apply(spec, shapes)
    assert remembered == each
    if stacked:
        check(spec, shapes)
        return
    check(spec_of(base), {n: s for n, s in shapes.items() if not n.startswith("twice")})
    src = arange_sources(shapes)  # the torch reference pops each input once: concat x with x by hand
    got = run_spec(spec, src, None)
    assert got["doubled.1"].tobytes() == np.concatenate([src["twice.1"]] * 2).tobytes()


def test_a_tie_when_a_config_value_says_so() -> None:
    """``when: tie_word_embeddings``: the tie (and its inverse untie) applies only when the
    config value is true; absent is false; the spec round-trips through JSON with it."""
    spec = parse_transforms_text(
        "transforms:\n  - rename: {from: emb, to: tok}\n"
        "  - tie: {from: tok, to: head, when: tie_word_embeddings}\n"
    )
    shapes = {"emb": (4, 2)}
    assert sorted(apply(spec, shapes, config={"tie_word_embeddings": True})) == ["head", "tok"]
    assert sorted(apply(spec, shapes, config={"tie_word_embeddings": False})) == ["tok"]
    assert sorted(apply(spec, shapes)) == ["tok"]  # not in the config: untied
    assert sorted(apply(spec, shapes, config={"tie_word_embeddings": 1})) == ["head", "tok"]
    back = inverse(spec)
    tied = {"tie_word_embeddings": True}
    assert sorted(apply(back, {"tok": (4, 2), "head": (4, 2)}, config=tied)) == ["emb"]
    assert parse_transforms_text(json.dumps(spec.to_json())).ops == spec.ops
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false"):
        apply(spec, shapes, config={"tie_word_embeddings": "yes"})
    with pytest.raises(ConfigError, match="when: must be a config name"):
        parse_transforms_text("transforms:\n  - tie: {from: a, to: b, when: 3}\n")
