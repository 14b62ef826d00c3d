"""Layout files: presets, matching, placements per mesh, JSON round trip, and errors."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reshard.config import (
    LayoutConfig,
    Own,
    Rule,
    list_presets,
    load_layout,
    parse_layout_text,
    resolve_preset,
)
from reshard.errors import ConfigError, LayoutError
from reshard.mesh import Mesh
from reshard.placements import Partial, Replicate, Shard, StridedShard

REPO = Path(__file__).resolve().parents[2]

LAYER_PARTS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
LLAMA_NAMES = [
    "model.embed_tokens.weight",
    *(f"model.layers.{i}.{part}" for i in range(3) for part in LAYER_PARTS),
    "model.norm.weight",
    "lm_head.weight",
]


def strs(placements: tuple[object, ...]) -> list[str]:
    return [str(p) for p in placements]


def write(tmp_path: Path, text: str, name: str = "layout.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def line_of(path: Path, needle: str) -> int:
    """1-based line of the first line containing `needle`."""
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_layout(path)
    assert info.value.path == str(path)
    return info.value.message


def assert_error_at(path: Path, needle: str, *words: str) -> str:
    """load_layout(path) fails with a message starting 'path:line: ' and holding `words`."""
    msg = load_error(path)
    prefix = f"{path}:{line_of(path, needle)}: "
    assert msg.startswith(prefix), (msg, prefix)
    for word in words:
        assert word in msg, (word, msg)
    return msg


# -- presets -------------------------------------------------------------------


PRESETS = ["llama-tp", "llama-tp-fused", "llama-fsdp-tp", "mixtral-moe", "replicated"]


def test_presets_listed() -> None:
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_with_header_and_catch_all(name: str) -> None:
    path = resolve_preset(name)
    assert path == REPO / "reshard" / "configs" / f"{name}.yaml"
    assert path.read_text(encoding="utf-8").startswith("#"), "presets start with a comment header"
    cfg = load_layout(path)
    assert cfg.source == str(path)
    assert cfg.rules[-1].pattern == "*"
    assert cfg.rules[-1].kind == "all" and isinstance(cfg.rules[-1].spec[0][1], Replicate)
    # Every Llama tensor gets a placement per mesh dim; nothing is unmatched.
    for tensor in LLAMA_NAMES:
        assert len(cfg.placements_for(tensor)) == cfg.mesh.ndim


LLAMA_TP = {
    "model.embed_tokens.weight": ["S(0)"],
    "model.layers.0.self_attn.q_proj.weight": ["S(0)"],
    "model.layers.1.self_attn.k_proj.weight": ["S(0)"],
    "model.layers.2.self_attn.v_proj.weight": ["S(0)"],
    "model.layers.0.self_attn.q_proj.bias": ["S(0)"],
    "model.layers.0.self_attn.v_proj.bias": ["S(0)"],
    "model.layers.0.self_attn.o_proj.weight": ["S(1)"],
    "model.layers.0.self_attn.o_proj.bias": ["R"],
    "model.layers.0.mlp.gate_proj.weight": ["S(0)"],
    "model.layers.0.mlp.up_proj.weight": ["S(0)"],
    "model.layers.0.mlp.up_proj.bias": ["S(0)"],
    "model.layers.0.mlp.down_proj.weight": ["S(1)"],
    "model.layers.0.input_layernorm.weight": ["R"],
    "model.layers.0.post_attention_layernorm.weight": ["R"],
    "model.layers.0.self_attn.rotary_emb.inv_freq": ["R"],
    "model.norm.weight": ["R"],
    "lm_head.weight": ["S(0)"],
}


def test_llama_tp_uses_every_rule_on_llama() -> None:
    cfg = load_layout(resolve_preset("llama-tp"))
    assert cfg.unused_rules(LLAMA_NAMES) == []


LLAMA_TP_FUSED = {
    "model.layers.0.mlp.gate_up_proj.weight": ["_S(0, 2)"],
    "model.layers.0.self_attn.qkv_proj.weight": ["_S(0, 3)"],
    "model.layers.0.self_attn.o_proj.weight": ["S(1)"],
    "model.layers.0.mlp.down_proj.weight": ["S(1)"],
    "model.embed_tokens.weight": ["S(0)"],
    "lm_head.weight": ["S(0)"],
    "model.layers.0.input_layernorm.weight": ["R"],
    "model.norm.weight": ["R"],
}


def test_llama_tp_fused_strided_is_not_shard() -> None:
    cfg = load_layout(resolve_preset("llama-tp-fused.yaml"))
    (p,) = cfg.placements_for("model.layers.3.mlp.gate_up_proj.weight")
    assert p == StridedShard(0, 2) and p != Shard(0)


LLAMA_FSDP_TP = {
    "model.embed_tokens.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.self_attn.q_proj.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.self_attn.k_proj.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.self_attn.v_proj.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.mlp.gate_proj.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.mlp.up_proj.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.self_attn.o_proj.weight": ["S(0)", "S(1)"],
    "model.layers.0.mlp.down_proj.weight": ["S(0)", "S(1)"],
    "model.layers.0.input_layernorm.weight": ["S(0)", "R"],
    "model.layers.0.post_attention_layernorm.weight": ["S(0)", "R"],
    "model.norm.weight": ["S(0)", "R"],
    "lm_head.weight": ["_S(0, 4)", "S(0)"],
    "model.layers.0.self_attn.rotary_emb.inv_freq": ["R", "R"],
}


def test_fsdp_tp_split_factor_is_a_dim_name_bound_to_the_mesh() -> None:
    cfg = load_layout(resolve_preset("llama-fsdp-tp"))
    q = "model.layers.0.self_attn.q_proj.weight"
    # Stored unresolved, so it follows the mesh...
    assert cfg.match(q).spec[0] == ("fsdp", StridedShard(0, "tp"))
    assert cfg.match(q).to_json() == {"fsdp": "_S(0, tp)", "tp": "S(0)"}
    # ...bound to tp's size on each mesh it is used with.
    wide = cfg.with_mesh(Mesh(("fsdp", "tp"), (2, 8)))
    assert wide.placements_for(q) == (StridedShard(0, 8), Shard(0))
    assert cfg.placements_for(q, Mesh(("fsdp", "tp"), (4, 2))) == (StridedShard(0, 2), Shard(0))
    assert cfg.placements_for(q) == (StridedShard(0, 4), Shard(0))


def test_fsdp_tp_every_rule_but_catch_all_used_on_llama() -> None:
    """The catch-all takes no tensor of a saved Llama; it is optional, so not worth a warning."""
    cfg = load_layout(resolve_preset("llama-fsdp-tp"))
    assert [r.pattern for r in cfg.unused_rules(LLAMA_NAMES)] == []
    assert [r.pattern for r in cfg.rules if not any(cfg.match(n) is r for n in LLAMA_NAMES)] == ["*"]


MIXTRAL = {
    "model.layers.0.mlp.experts.gate_up_proj": ["S(0)"],
    "model.layers.11.mlp.experts.down_proj": ["S(0)"],
    "model.layers.0.mlp.experts.w1.weight": ["S(0)"],
    "model.layers.0.mlp.experts.w2": ["S(0)"],
    "model.layers.0.block_sparse_moe.experts.w3.weight": ["S(0)"],
    "model.layers.0.block_sparse_moe.gate.weight": ["R"],
    "model.layers.0.mlp.gate.weight": ["R"],
    "model.layers.0.self_attn.q_proj.weight": ["R"],
    "model.embed_tokens.weight": ["R"],
    "lm_head.weight": ["R"],
}


def test_mixtral_per_expert_tensors_are_dealt_to_ep_ranks_in_contiguous_blocks() -> None:
    cfg = load_layout(resolve_preset("mixtral-moe"))
    names = [
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}.weight"
        for layer in range(2)
        for e in range(8)
        for w in (1, 2, 3)
    ]
    rule = cfg.match(names[0])
    assert rule.own == ("ep", Own("expert")) and rule.to_json() == {"ep": "Own(expert)"}
    with pytest.raises(LayoutError, match=r"needs the checkpoint's tensor names") as e:
        cfg.placements_for(names[0])
    assert e.value.tensor == names[0] and "mixtral-moe.yaml:" in e.value.message
    bound = cfg.assign([*names, "model.norm.weight"])
    for n in names:  # 8 experts over ep=4: experts 2c and 2c+1 on rank c
        expert = int(n.split(".experts.")[1].split(".")[0])
        assert [str(p) for p in bound.placements_for(n)] == [f"Own({expert // 2})"], n
    two = bound.with_mesh(Mesh(("ep",), (2,)))
    assert [str(p) for p in two.placements_for(names[-1])] == ["Own(1)"]
    with pytest.raises(LayoutError, match=r"deals 8 numbers over the 3 ranks of ep, which does not divide"):
        bound.with_mesh(Mesh(("ep",), (3,))).placements_for(names[0])
    with pytest.raises(LayoutError, match=r"numbered \[0, 1, 3\], not 0..2"):
        cfg.assign([f"m.mlp.experts.{e}.w1.weight" for e in (0, 1, 3)])


def test_mixtral_expert_rule_is_first() -> None:
    cfg = load_layout(resolve_preset("mixtral-moe"))
    assert cfg.match("model.layers.0.mlp.experts.gate_up_proj") is cfg.rules[0]
    assert cfg.match("model.layers.0.mlp.experts.gate_up_proj_extra") is cfg.rules[-1]


PRESET_CASES = [
    (preset, mesh, tensor, expected)
    for preset, mesh, table in (
        ("llama-tp", Mesh(("tp",), (4,)), LLAMA_TP),
        ("llama-tp-fused", Mesh(("tp",), (4,)), LLAMA_TP_FUSED),
        ("llama-fsdp-tp", Mesh(("fsdp", "tp"), (2, 4)), LLAMA_FSDP_TP),
        ("mixtral-moe", Mesh(("ep",), (4,)), MIXTRAL),
    )
    for tensor, expected in table.items()
]


@pytest.mark.parametrize(("preset", "mesh", "tensor", "expected"), PRESET_CASES)
def test_preset_placements(preset: str, mesh: Mesh, tensor: str, expected: list[str]) -> None:
    cfg = load_layout(resolve_preset(preset))
    assert cfg.mesh == mesh
    assert strs(cfg.placements_for(tensor)) == expected


def test_replicated() -> None:
    cfg = load_layout(resolve_preset("replicated"))
    assert cfg.mesh == Mesh(("world",), (1,))
    for tensor in LLAMA_NAMES:
        assert cfg.placements_for(tensor) == (Replicate(),)
    assert cfg.placements_for("x", Mesh(("fsdp", "tp"), (2, 4))) == (Replicate(), Replicate())


# -- matching ------------------------------------------------------------------


def layout(text: str, source: str = "t.yaml") -> LayoutConfig:
    return parse_layout_text(textwrap.dedent(text), source)


@pytest.mark.parametrize(
    ("pattern", "name", "hit"),
    [
        ("*.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", True),  # * crosses dots
        ("*.q_proj.weight", "q_proj.weight", False),  # the dot is literal and required
        ("*q_proj.weight", "q_proj.weight", True),
        ("*.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale", False),  # whole name
        ("*.q_proj.weight", "model.layers.0.self_attn.q_proj.weightXq_proj.weight", False),
        ("model.*.weight", "model.layers.0.mlp.up_proj.weight", True),
        ("*.[qkv]_proj.weight", "a.k_proj.weight", True),
        ("*.[qkv]_proj.weight", "a.o_proj.weight", False),
        ("*.[!qkv]_proj.weight", "a.o_proj.weight", True),
        ("layers.?.w", "layers.7.w", True),
        ("layers.?.w", "layers.17.w", False),
        ("*.Q_PROJ.weight", "a.q_proj.weight", False),  # case-sensitive
        ("lm_head.weight", "lm_head.weight", True),
        ("lm_head.weight", "lm_headXweight", False),  # . is not a wildcard in a glob
        ("re:.*\\.q_proj\\.weight", "model.layers.0.self_attn.q_proj.weight", True),
        ("re:q_proj", "model.q_proj.weight", False),  # fullmatch, not search
        ("re:model\\.layers\\.\\d+\\.mlp\\..*", "model.layers.12.mlp.up_proj.weight", True),
        ("re:model\\.layers\\.\\d+\\.mlp\\..*", "model.layers.x.mlp.up_proj.weight", False),
        ("re:a|b", "a", True),  # alternation is fully anchored as a whole
        ("re:a|b", "ab", False),
        ("re:lm_head.weight", "lm_headXweight", True),  # regex . is a wildcard
    ],
)
def test_rule_matches(pattern: str, name: str, hit: bool) -> None:
    rule = Rule.from_json(pattern, "R")
    assert rule.matches(name) is hit
    assert rule.is_regex is pattern.startswith("re:")


def test_first_match_wins() -> None:
    cfg = layout(
        """\
        mesh: {tp: 4}
        placements:
          "model.layers.0.*": S(1)
          "*.weight": S(0)
          "*": R
        """
    )
    assert strs(cfg.placements_for("model.layers.0.mlp.up_proj.weight")) == ["S(1)"]
    assert strs(cfg.placements_for("model.layers.1.mlp.up_proj.weight")) == ["S(0)"]
    assert strs(cfg.placements_for("model.layers.1.mlp.up_proj.bias")) == ["R"]
    assert cfg.match("model.layers.1.mlp.up_proj.weight").line == 4


def test_no_rule_matches() -> None:
    cfg = layout('mesh: {tp: 2}\nplacements:\n  "*.weight": S(0)\n', "my.yaml")
    with pytest.raises(LayoutError) as info:
        cfg.placements_for("model.norm.bias")
    assert str(info.value) == (
        'tensor "model.norm.bias" matches no rule in my.yaml; add a rule for it, '
        'or "*": R to replicate everything else'
    )
    assert info.value.tensor == "model.norm.bias"
    assert info.value.path == "my.yaml"


def test_unused_rules_first_match_semantics() -> None:
    cfg = layout(
        """\
        mesh: {tp: 4}
        placements:
          "*.weight": S(0)
          "*.q_proj.weight": S(1)
          "*.bias": R
          "re:never": R
          "*": R
        """
    )
    names = ["a.q_proj.weight", "a.bias", "unmatched?"]
    # "*.q_proj.weight" matches a name but is shadowed by "*.weight".
    assert [r.pattern for r in cfg.unused_rules(names)] == ["*.q_proj.weight", "re:never"]
    assert [r.line for r in cfg.unused_rules(names)] == [4, 6]
    assert cfg.unused_rules([]) == list(cfg.rules)
    assert cfg.unused_rules(iter(["x.weight", "x.bias", "x", "re:never"])) == [
        cfg.rules[1],
        cfg.rules[3],
    ]


def test_many_names() -> None:
    cfg = load_layout(resolve_preset("llama-tp"))
    names = [f"model.layers.{i}.{part}" for i in range(2000) for part in LAYER_PARTS]
    placements = [cfg.placements_for(n) for n in names]
    assert placements.count((Shard(0),)) == 2000 * 5
    assert placements.count((Shard(1),)) == 2000 * 2


# -- rule forms ----------------------------------------------------------------


MESH2 = Mesh(("fsdp", "tp"), (2, 4))
MESH1 = Mesh(("tp",), (4,))


def test_named_positional_and_bare_forms() -> None:
    cfg = layout(
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "a": {tp: S(0)}
          "b": {fsdp: S(0), tp: S(1)}
          "c": {tp: S(1), fsdp: "_S(0, 2)"}
          "d": [R, S(1)]
          "e":
            - S(0)
            - Shard(1)
          "f": R
          "g": Replicate()
        """
    )
    kinds = {r.pattern: r.kind for r in cfg.rules}
    assert kinds == {
        "a": "named",
        "b": "named",
        "c": "named",
        "d": "positional",
        "e": "positional",
        "f": "all",
        "g": "all",
    }
    assert cfg.placements_for("a") == (Replicate(), Shard(0))  # unnamed dims: Replicate
    assert cfg.placements_for("b") == (Shard(0), Shard(1))
    assert cfg.placements_for("c") == (StridedShard(0, 2), Shard(1))  # mesh order, not key order
    assert cfg.placements_for("d") == (Replicate(), Shard(1))
    assert cfg.placements_for("e") == (Shard(0), Shard(1))
    assert cfg.placements_for("f") == (Replicate(), Replicate())
    assert cfg.placements_for("g") == (Replicate(), Replicate())
    assert cfg.match("a").spec == (("tp", Shard(0)),)
    assert cfg.match("d").spec == ((None, Replicate()), (None, Shard(1)))
    assert cfg.match("f").spec == ((None, Replicate()),)
    assert [r.line for r in cfg.rules] == [3, 4, 5, 6, 7, 10, 11]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("R", Replicate()),
        ("Replicate()", Replicate()),
        ("S(0)", Shard(0)),
        ("Shard(-1)", Shard(-1)),
        ('"_S(0, 2)"', StridedShard(0, 2)),
        ('"_StridedShard(0, sf=2)"', StridedShard(0, 2)),
        ('"StridedShard(1, sf=4)"', StridedShard(1, 4)),
        ("P(sum)", Partial("sum")),
        ("Partial()", Partial("sum")),
        ("Partial(avg)", Partial("avg")),
    ],
)
def test_placement_text_forms(text: str, expected: object) -> None:
    cfg = layout(f'mesh: {{tp: 4}}\nplacements:\n  "*": {{tp: {text}}}\n')
    assert cfg.placements_for("x") == (expected,)


def test_bare_sharded_placement_on_1d_mesh() -> None:
    cfg = layout('mesh: {tp: 4}\nplacements:\n  "*": S(0)\n')
    assert cfg.placements_for("x") == (Shard(0),)
    assert cfg.placements_for("x", Mesh(("world",), (8,))) == (Shard(0),)


def test_rule_placements_errors() -> None:
    bare = Rule.from_json("*", "S(0)")
    with pytest.raises(
        ConfigError,
        match=r"S\(0\) on a 2-d mesh \(fsdp, tp\) is ambiguous; "
        r"write \{tp: S\(0\)\} to say which dim",
    ):
        bare.placements(MESH2)
    positional = Rule.from_json("*", ["R", "S(1)"])
    with pytest.raises(ConfigError) as info:
        positional.placements(MESH1)
    assert "gives 2 placements [R, S(1)] but the mesh has 1 dim (tp)" in info.value.message
    assert "{dim: placement}" in info.value.message
    named = Rule.from_json("*", {"pp": "S(0)"})
    with pytest.raises(ConfigError) as info:
        named.placements(MESH2)
    assert "'pp'" in info.value.message and "fsdp, tp" in info.value.message
    strided = Rule.from_json("*", {"tp": "_S(0, ep)"})
    with pytest.raises(ConfigError, match="'ep'"):
        strided.placements(MESH2)
    assert Rule.from_json("*", "P(max)").placements(MESH1) == (Partial("max"),)


def test_rule_validation() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        Rule("", ((None, Replicate()),), "all")
    with pytest.raises(ConfigError, match="kind"):
        Rule("*", ((None, Replicate()),), "bogus")
    with pytest.raises(ConfigError, match="exactly one"):
        Rule("*", ((None, Replicate()), (None, Replicate())), "all")
    with pytest.raises(ConfigError, match="given twice"):
        Rule("*", (("tp", Replicate()), ("tp", Shard(0))), "named")
    with pytest.raises(ConfigError, match="not an identifier"):
        Rule("*", ((None, Replicate()),), "named")
    with pytest.raises(ConfigError, match="placement"):
        Rule("*", ((None, "R"),), "all")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="placements must be a string"):
        Rule.from_json("*", 3)
    with pytest.raises(ConfigError, match="missing placement"):
        Rule.from_json("*", {"tp": None})


def test_rule_equality_ignores_line_and_pickles() -> None:
    a = Rule.from_json("*.w", {"tp": "S(0)"}, line=7)
    b = Rule.from_json("*.w", {"tp": "S(0)"})
    assert a == b and hash(a) == hash(b) and a.line == 7
    assert "_regex" not in repr(a)
    c = pickle.loads(pickle.dumps(a))
    assert c == a and c.line == 7 and c.matches("x.w")
    cfg = load_layout(resolve_preset("llama-fsdp-tp"))
    assert pickle.loads(pickle.dumps(cfg)) == cfg


# -- JSON ------------------------------------------------------------------------


def test_rule_to_json_forms() -> None:
    cfg = layout(
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "a": {tp: "StridedShard(0, sf=tp)", fsdp: Shard(-1)}
          "b": [Replicate(), "Partial(avg)"]
          "c": Replicate()
        """
    )
    assert [r.to_json() for r in cfg.rules] == [
        {"tp": "_S(0, tp)", "fsdp": "S(-1)"},
        ["R", "P(avg)"],
        "R",
    ]


@pytest.mark.parametrize("name", PRESETS)
def test_json_round_trip(name: str) -> None:
    cfg = load_layout(resolve_preset(name))
    data = json.loads(json.dumps(cfg.to_json()))
    assert data["mesh"] == {"names": list(cfg.mesh.names), "shape": list(cfg.mesh.shape)}
    assert [pair[0] for pair in data["rules"]] == [r.pattern for r in cfg.rules]
    back = LayoutConfig.from_json(data, source="out/reshard.json")
    assert back == LayoutConfig(cfg.mesh, cfg.rules, "out/reshard.json", cfg.optional)
    assert [r.kind for r in back.rules] == [r.kind for r in cfg.rules]
    assert back.to_json() == cfg.to_json()
    for tensor in LLAMA_NAMES:
        assert back.placements_for(tensor) == cfg.placements_for(tensor)
    assert [r.own for r in back.rules] == [r.own for r in cfg.rules]


def test_from_json_accepts_layout_file_shapes() -> None:
    back = LayoutConfig.from_json({"mesh": {"fsdp": 2, "tp": 4}, "rules": {"*.w": {"tp": "S(0)"}, "*": "R"}})
    assert back.mesh == MESH2
    assert back.placements_for("a.w") == (Replicate(), Shard(0))
    assert back.source == "<reshard.json>"


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "layout must be an object"),
        ({"rules": []}, "mesh must be"),
        ({"mesh": {"names": ["tp"], "shape": [0]}, "rules": []}, "size >= 1"),
        ({"mesh": {"names": [1], "shape": [2]}, "rules": []}, "list of strings"),
        ({"mesh": {"tp": 2}, "rules": "R"}, "list of [pattern, placements] pairs"),
        ({"mesh": {"tp": 2}, "rules": [["*"]]}, "pair"),
        ({"mesh": {"tp": 2}, "rules": [["*", "S(x)"]]}, "rule '*': placement 'S(x)'"),
        ({"mesh": {"tp": 2}, "rules": [["*", ["R", "R"]]]}, "rule '*': gives 2 placements"),
    ],
)
def test_from_json_errors(data: object, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        LayoutConfig.from_json(data, source="d/reshard.json")
    assert info.value.message.startswith("d/reshard.json: ")
    assert words in info.value.message
    assert info.value.path == "d/reshard.json"


# -- meshes ---------------------------------------------------------------------


def test_with_mesh_checks_rules_eagerly(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*.w": {tp: S(0)}
          "*.o": [S(0), S(1)]
          "*": R
        """,
    )
    cfg = load_layout(path)
    wide = cfg.with_mesh(Mesh(("fsdp", "tp"), (1, 8)))
    assert wide.mesh == Mesh(("fsdp", "tp"), (1, 8)) and wide.rules == cfg.rules
    assert wide.placements_for("a.o") == (Shard(0), Shard(1))
    # Renamed outer dim: named and positional rules still fit.
    assert cfg.with_mesh(Mesh(("dp", "tp"), (2, 2))).placements_for("a.w") == (
        Replicate(),
        Shard(0),
    )
    # No tp dim: the first rule that cannot fit fails, naming file and line.
    with pytest.raises(ConfigError) as info:
        cfg.with_mesh(Mesh(("fsdp",), (8,)))
    assert info.value.message.startswith(f"{path}:3: rule '*.w': names mesh dim 'tp'")
    assert "fsdp" in info.value.message
    # A third dim breaks the positional rule.
    with pytest.raises(ConfigError) as info:
        cfg.with_mesh(Mesh(("fsdp", "tp", "ep"), (2, 4, 2)))
    assert info.value.message.startswith(f"{path}:4: rule '*.o': gives 2 placements")


def test_placements_for_other_mesh_error_names_rule_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*.w": {tp: S(0)}
          "*.o": [S(0), S(1)]
          "*": R
        """,
    )
    cfg = load_layout(path)
    with pytest.raises(ConfigError) as info:
        cfg.placements_for("a.o", Mesh(("tp",), (8,)))
    msg = info.value.message
    assert msg.startswith(f"{path}:4: rule '*.o': gives 2 placements [S(0), S(1)]")
    assert "use the {dim: placement} form" in msg
    assert info.value.tensor == "a.o"
    with pytest.raises(ConfigError) as info:
        cfg.placements_for("a.w", Mesh(("ep",), (8,)))
    assert info.value.message.startswith(f"{path}:3: rule '*.w': names mesh dim 'tp'")


def test_programmatic_layout_messages_have_no_line() -> None:
    rules = (Rule.from_json("*", {"tp": "S(0)"}),)
    with pytest.raises(ConfigError) as info:
        LayoutConfig(Mesh(("fsdp",), (2,)), rules, "api")
    assert info.value.message.startswith("api: rule '*': names mesh dim 'tp'")
    with pytest.raises(ConfigError, match="appears twice"):
        LayoutConfig(MESH1, rules * 2)


# -- file errors ----------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    msg = load_error(path)
    assert msg.startswith(f"{path}: layout file not found")
    assert "llama-tp" in msg  # lists presets


def test_directory_and_binary(tmp_path: Path) -> None:
    assert "is a directory" in load_error(tmp_path)
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"mesh: {tp: 2}\n\xff\xfe\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}: cannot read the layout file: not UTF-8")


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "# only a comment\n")
    assert load_error(path).startswith(f"{path}: layout file is empty")


def test_invalid_yaml_uses_problem_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {tp: 2}
        placements:
          "*.w": [S(0),
          "*": R
          bad: : :
        """,
    )
    msg = load_error(path)
    assert msg.startswith(f"{path}:") and "invalid YAML" in msg
    line = int(msg[len(str(path)) + 1 :].split(":", 1)[0])
    assert 3 <= line <= 5


def test_unquoted_star_key(tmp_path: Path) -> None:
    path = write(tmp_path, "mesh: {tp: 2}\nplacements:\n  *: R\n")
    assert_error_at(path, "*: R", "invalid YAML", 'must be quoted, e.g. "*": R')


def test_bad_escape_in_double_quoted_regex(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements:\n  "re:a\\.b": R\n')
    assert_error_at(path, "re:a", "invalid YAML", "escape", "single quotes")


def test_tab_indent(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements:\n\t"*": R\n')
    assert_error_at(path, "\t", "invalid YAML", "spaces, not tabs")


def test_two_documents(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements: {"*": R}\n---\nmesh: {tp: 4}\n')
    assert_error_at(path, "---", "invalid YAML", "single document")


def test_unsafe_tag_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements:\n  "*": !!python/object/apply:os.getcwd []\n')
    assert_error_at(path, "python/object", "unsupported YAML tag", "python/object/apply:os.getcwd")
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements:\n  "*": !!python/name:os.getcwd R\n', "b.yaml")
    assert_error_at(path, "python/name", "invalid YAML", "could not determine a constructor")
    path = write(tmp_path, 'mesh: !!omap [tp: 2]\nplacements: {"*": R}\n', "c.yaml")
    assert_error_at(path, "omap", "mesh must be a mapping")


@pytest.mark.parametrize("text", ["- mesh\n- placements\n", "just text\n", "42\n"])
def test_top_level_not_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    assert_error_at(path, text.splitlines()[0], "top level must be a mapping", "mesh:", "placements:")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacement:\n  "*": R\n')
    assert_error_at(path, "placement:", "unknown top-level key 'placement'", "did you mean 'placements'")


def test_name_and_description_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, 'name: demo\ndescription: a demo\nmesh: {tp: 2}\nplacements: {"*": R}\n')
    assert load_layout(path).placements_for("x") == (Replicate(),)
    bad = write(tmp_path, 'name: [a]\nmesh: {tp: 2}\nplacements: {"*": R}\n', "bad.yaml")
    assert_error_at(bad, "name:", "name must be a string")


def test_duplicate_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 2}\nplacements: {"*": R}\nmesh: {tp: 4}\n')
    assert_error_at(path, "mesh: {tp: 4}", "'mesh' appears twice (first on line 1)")


@pytest.mark.parametrize(
    ("text", "needle", "words"),
    [
        ('placements: {"*": R}\n', "placements", ["missing mesh:", "mesh: {fsdp: 2, tp: 4}"]),
        ('mesh: [2, 4]\nplacements: {"*": R}\n', "mesh:", ["mesh must be a mapping", "got a list"]),
        ('mesh: 4\nplacements: {"*": R}\n', "mesh:", ["mesh must be a mapping", "got a scalar"]),
        ('mesh: {}\nplacements: {"*": R}\n', "mesh:", ["mesh is empty"]),
        ('mesh:\n  tp: 0\nplacements: {"*": R}\n', "tp: 0", ["'tp'", "positive integer size", "0"]),
        ('mesh:\n  tp: -2\nplacements: {"*": R}\n', "tp: -2", ["positive integer size"]),
        ('mesh:\n  tp: two\nplacements: {"*": R}\n', "tp: two", ["positive integer size", "'two'"]),
        ('mesh:\n  tp: true\nplacements: {"*": R}\n', "tp: true", ["positive integer size"]),
        ('mesh:\n  tp: 2.5\nplacements: {"*": R}\n', "tp: 2.5", ["positive integer size"]),
        ('mesh:\n  tp: 2\n  2d: 2\nplacements: {"*": R}\n', "2d", ["'2d' is not an identifier"]),
        ('mesh:\n  tp: 2\n  tp: 4\nplacements: {"*": R}\n', "tp: 4", ["'tp' appears twice"]),
        ('mesh:\n  [a]: 2\nplacements: {"*": R}\n', "[a]", ["mesh keys must be plain strings"]),
    ],
)
def test_mesh_errors(tmp_path: Path, text: str, needle: str, words: list[str]) -> None:
    assert_error_at(write(tmp_path, text), needle, *words)


@pytest.mark.parametrize(
    ("text", "needle", "words"),
    [
        ("mesh: {tp: 2}\n", "mesh", ["missing placements:", '"*": R']),
        ("mesh: {tp: 2}\nplacements: [R]\n", "placements", ["ordered mapping", "got a list"]),
        ("mesh: {tp: 2}\nplacements: R\n", "placements", ["ordered mapping", "got a scalar"]),
        ("mesh: {tp: 2}\nplacements: {}\n", "placements", ["placements is empty", '"*": R']),
        ("mesh: {tp: 2}\nplacements:\n", "placements", ["ordered mapping"]),
    ],
)
def test_placements_section_errors(tmp_path: Path, text: str, needle: str, words: list[str]) -> None:
    assert_error_at(write(tmp_path, text), needle, *words)


def test_bad_placement_string_names_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*.o_proj.weight":
            - R
            - Sh(1)
          "*": R
        """,
    )
    assert_error_at(path, "Sh(1)", "rule '*.o_proj.weight'", "unknown placement 'Sh(1)'", "S(d)")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("{tp: S(x)}", ["placement 'S(x)'", "integer"]),
        ("{tp: Partial(prod)}", ["'prod'", "sum"]),
        ("{tp: 3}", ["must be a string"]),
        ("{tp: }", ["missing placement"]),
        ("", ["missing placement"]),
        ("{tp: [S(0)]}", ["must be a string such as R or S(0), got a list"]),
        ("[R, [S(0)]]", ["got a list"]),
    ],
)
def test_bad_placement_values(tmp_path: Path, value: str, words: list[str]) -> None:
    path = write(tmp_path, f'mesh: {{fsdp: 2, tp: 4}}\nplacements:\n  "*.w": {value}\n')
    assert_error_at(path, "*.w", "rule '*.w'", *words)


def test_unquoted_comma_in_flow_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 4}\nplacements:\n  "*.gate_up": {tp: _S(0, 2)}\n')
    assert_error_at(path, "gate_up", "'_S(0'", 'quote placements with commas: {tp: "_S(0, 2)"}')


def test_positional_wrong_length_at_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*.q_proj.weight": {tp: S(0)}
          "*.o_proj.weight": [S(1)]
          "*": R
        """,
    )
    assert_error_at(
        path,
        "o_proj",
        "rule '*.o_proj.weight': gives 1 placement [S(1)] but the mesh has 2 dims (fsdp, tp)",
        "{dim: placement}",
        "{tp: S(1)}",
    )


def test_empty_positional_list(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 4}\nplacements:\n  "x": []\n  "*": R\n')
    assert_error_at(path, '"x"', "rule 'x'", "list is empty")


def test_named_dim_not_in_mesh_at_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*": R
          "*.experts.*": {ep: S(0)}
        """,
    )
    assert_error_at(path, "experts", "rule '*.experts.*'", "names mesh dim 'ep'", "fsdp, tp")


def test_named_dim_not_identifier(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 4}\nplacements:\n  "x": {0: S(0)}\n')
    assert_error_at(path, '"x"', "rule 'x'", "'0' is not an identifier", "list")


def test_duplicate_dim_in_named_rule(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {tp: 4}\nplacements:\n  "x":\n    tp: S(0)\n    tp: S(1)\n')
    assert_error_at(path, "tp: S(1)", "'tp' appears twice (first on line 4)")


def test_bare_shard_on_2d_mesh_at_load(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {fsdp: 2, tp: 4}\nplacements:\n  "*.w": S(0)\n  "*": R\n')
    assert_error_at(path, "*.w", "rule '*.w': S(0) on a 2-d mesh", "write {tp: S(0)} to say which dim")


def test_split_factor_names_missing_dim(tmp_path: Path) -> None:
    path = write(tmp_path, 'mesh: {fsdp: 2}\nplacements:\n  "*.w": {fsdp: "_S(0, tp)"}\n')
    assert_error_at(path, "*.w", "rule '*.w'", "'tp'", "fsdp")


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("'re:model.layers.(\\d+.*'", ["invalid regex after 're:'", "missing ), unterminated"]),
        ("'re:*'", ["invalid regex after 're:'", "nothing to repeat"]),
        ("'re:'", ['the regex after "re:" is empty']),
    ],
)
def test_invalid_regex(tmp_path: Path, pattern: str, words: list[str]) -> None:
    path = write(tmp_path, f"mesh: {{tp: 4}}\nplacements:\n  {pattern}: R\n")
    assert_error_at(path, "re:", "rule", *words)


def test_duplicate_pattern(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {tp: 4}
        placements:
          "*.w": {tp: S(0)}
          "*.b": R
          "*.w": {tp: S(1)}
        """,
    )
    msg = load_error(path)
    assert msg.startswith(f"{path}:5: ")
    assert "'*.w' appears twice (first on line 3)" in msg
    assert "silently" in msg


def test_regex_in_double_quotes_and_single_quotes_agree(tmp_path: Path) -> None:
    a = write(tmp_path, 'mesh: {tp: 2}\nplacements:\n  "re:a\\\\.\\\\d+": S(0)\n', "a.yaml")
    b = write(tmp_path, "mesh: {tp: 2}\nplacements:\n  're:a\\.\\d+': S(0)\n", "b.yaml")
    ra, rb = load_layout(a).rules[0], load_layout(b).rules[0]
    assert ra.pattern == rb.pattern == "re:a\\.\\d+"
    assert ra.matches("a.12") and not ra.matches("ab12")


def test_merge_keys_and_anchors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        mesh: {fsdp: 2, tp: 4}
        placements:
          "*.w": &col {fsdp: "_S(0, tp)", tp: S(0)}
          "*.b": *col
          "*": R
        """,
    )
    cfg = load_layout(path)
    assert cfg.placements_for("x.b") == cfg.placements_for("x.w") == (StridedShard(0, 4), Shard(0))


def test_parse_layout_text_default_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_layout_text("mesh: {tp: 2}\n")
    assert info.value.message.startswith("<layout>:1: missing placements:")


# -- presets by name -------------------------------------------------------------


def test_resolve_preset(tmp_path: Path) -> None:
    assert resolve_preset("llama-tp") == REPO / "reshard" / "configs" / "llama-tp.yaml"
    assert resolve_preset("llama-tp.yaml") == REPO / "reshard" / "configs" / "llama-tp.yaml"
    own = write(tmp_path, 'mesh: {tp: 2}\nplacements: {"*": R}\n', "llama-tp.yaml")
    assert resolve_preset(str(own)) == own  # an existing path wins
    with pytest.raises(ConfigError) as info:
        resolve_preset("llama-tq")
    msg = info.value.message
    assert msg.startswith("llama-tq: no such layout file or preset")
    for name in PRESETS:
        assert name in msg
    with pytest.raises(ConfigError, match="no such layout file"):
        resolve_preset(str(tmp_path / "missing" / "llama-tp.yaml"))


# -- purity ---------------------------------------------------------------------


def test_import_does_not_pull_torch() -> None:
    code = "import reshard.config, sys; assert 'torch' not in sys.modules; assert 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# -- optional rules and whole-tensor assignment -----------------------------------


def test_optional_rules_are_not_reported_unused() -> None:
    cfg = layout("""\
        mesh: {tp: 2}
        placements:
          "*.experts.gate_up_proj": {tp: "_S(1, 2)"}
          "*.q_proj.weight": {tp: S(0)}
          "*.k_proj.weight": {tp: S(0)}
          "*": R
        optional: ["*.experts.gate_up_proj"]
        """)
    assert cfg.optional == {"*.experts.gate_up_proj"}
    assert [r.pattern for r in cfg.unused_rules(["a.q_proj.weight", "norm"])] == ["*.k_proj.weight"]
    assert cfg.with_mesh(Mesh(("tp",), (4,))).optional == cfg.optional
    assert LayoutConfig.from_json(cfg.to_json()).optional == cfg.optional
    assert "optional" not in load_layout(resolve_preset("replicated")).to_json()


@pytest.mark.parametrize(
    ("optional", "message"),
    [
        ('["*.k_proj"]', r"t.yaml:5: optional lists '\*.k_proj', which is not a pattern.*mean '\*.q_proj'"),
        ("{a: 1}", r"t.yaml:5: optional must be a list of rule patterns, got a mapping"),
        ("[[1]]", r"t.yaml:5: optional lists"),
    ],
)
def test_optional_must_name_rule_patterns(optional: str, message: str) -> None:
    text = f'mesh: {{tp: 2}}\nplacements:\n  "*.q_proj": {{tp: S(0)}}\n  "*": R\noptional: {optional}\n'
    with pytest.raises(ConfigError, match=message):
        parse_layout_text(text, "t.yaml")


def test_own_needs_a_named_group_in_a_regex_and_a_mesh_dim() -> None:
    needs = r"t.yaml:3: rule '\*.experts.\*': Own\(expert\) on ep needs .*named group"
    with pytest.raises(ConfigError, match=needs):
        parse_layout_text('mesh: {ep: 2}\nplacements:\n  "*.experts.*": {ep: Own(expert)}\n', "t.yaml")
    with pytest.raises(ConfigError, match=r"Own\(expert\) names no mesh dim"):
        Rule("re:e\\.(?P<expert>\\d+)", ((None, Replicate()),), "all", 0, ("ep", Own("expert")))
    cfg = layout(r"""
        mesh: {fsdp: 2, ep: 4}
        placements:
          're:l\.(?P<layer>\d+)\.experts\.(?P<e>\d+)\.w1': {fsdp: S(0), ep: "Own(e, local)"}
          "*": R
        """)
    rule = cfg.rules[0]
    assert rule.own == ("ep", Own("e", local=True))
    assert rule.to_json() == {"fsdp": "S(0)", "ep": "Own(e, local)"}
    assert cfg.placements_for("l.0.other") == (Replicate(), Replicate())
    names = [f"l.{layer}.experts.{e}.w1" for layer in (0, 1) for e in range(8)]
    bound = cfg.assign(names)
    assert [str(p) for p in bound.placements_for("l.1.experts.7.w1")] == ["S(0)", "Own(3)"]
    local = bound.file_names()  # expert e on ep rank e // 2 is local e % 2; 0 and 1 keep their names
    assert local == {
        n: re.sub(r"\.(\d+)\.w1", lambda m: f".{int(m[1]) % 2}.w1", n)
        for n in names
        if int(n.split(".")[3]) > 1
    }
    held = [[f"l.{layer}.experts.{j}.w1" for layer in (0, 1) for j in (0, 1)]] * 8  # rank = fsdp * 4 + ep
    back = bound.global_names(held)
    assert back[5] == {
        "l.0.experts.0.w1": "l.0.experts.2.w1",
        "l.0.experts.1.w1": "l.0.experts.3.w1",
        "l.1.experts.0.w1": "l.1.experts.2.w1",
        "l.1.experts.1.w1": "l.1.experts.3.w1",
    }
    assert back[0] == {} and back[4] == {}
    with pytest.raises(
        LayoutError, match=r"rank 3 holds the tensors l.0.experts.\*.w1 numbered \[0\], rank 0 \[0, 1\]"
    ):
        bound.global_names(
            [*held[:3], ["l.0.experts.0.w1", "l.1.experts.0.w1", "l.1.experts.1.w1"], *held[4:]]
        )
