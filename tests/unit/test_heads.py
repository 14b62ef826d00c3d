"""reshard.heads: head counts from real config.json files, and the Owned placement's blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.errors import ConfigError, LayoutError
from reshard.heads import Heads, read_heads
from reshard.intervals import Interval
from reshard.layout import TensorLayout, infer_global_shape
from reshard.mesh import Mesh
from reshard.placements import Owned, parse_placement


def write(tmp_path: Path, config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}, (32, 8, 128)),
        ({"num_attention_heads": 16, "hidden_size": 1024}, (16, 16, 64)),  # MHA: kv defaults to heads
        (
            {"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 1024},
            (16, 4, 128),
        ),
        (
            {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}},
            (8, 2, 64),
        ),
    ],
)
def test_read_heads(tmp_path: Path, config: dict[str, object], want: tuple[int, int, int]) -> None:
    heads = read_heads(write(tmp_path, config))
    assert heads is not None and (heads.heads, heads.kv_heads, heads.head_dim) == want
    assert heads.source == str(tmp_path / "config.json")


def test_read_heads_without_counts_or_file(tmp_path: Path) -> None:
    assert read_heads(tmp_path) is None
    assert read_heads(write(tmp_path, {"hidden_size": 64})) is None
    assert read_heads(write(tmp_path, {"num_attention_heads": True, "hidden_size": 64})) is None
    with pytest.raises(ConfigError, match="config.json"):
        read_heads(write(tmp_path, [1, 2]))


def test_gqa_rows() -> None:
    assert Heads(4, 1, 64, "c").qkv_rows == (256, 64, 64)


def test_owned_gives_the_whole_tensor_to_one_coordinate_and_composes_with_shard() -> None:
    mesh = Mesh(("fsdp", "ep"), (2, 2))
    lay = TensorLayout.make((5, 3), mesh, ["S(0)", "Own(1)"])
    assert lay.assigned
    blocks = {c: lay.block(c) for c in mesh.coordinates()}
    assert blocks[(0, 1)] == ((Interval(0, 3),), (Interval(0, 3),))  # torch.chunk(5, 2): 3 + 2 rows
    assert blocks[(1, 1)] == ((Interval(3, 5),), (Interval(0, 3),))
    assert blocks[(0, 0)][0] == () and blocks[(1, 0)][0] == ()
    assert [lay.holds(c) for c in mesh.coordinates()] == [False, True, False, True]
    shapes = [lay.local_shape(c) for c in mesh.coordinates()]
    assert shapes == [(0, 3), (3, 3), (0, 3), (2, 3)]
    assert infer_global_shape(shapes, mesh, ["S(0)", "Own(1)"]) == (5, 3)
    assert parse_placement("Owned(owner=2)") == Owned(2) and str(Owned(2)) == "Own(2)"


@pytest.mark.parametrize(
    ("shape", "placements", "message"),
    [
        ((4,), ["Own(2)"], "Own\\(2\\) does not fit: the mesh dim has 2 coordinates"),
        ((), ["Own(0)"], "0-d tensor"),
    ],
)
def test_owned_refusals(shape: tuple[int, ...], placements: list[str], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        TensorLayout.make(shape, Mesh(("ep",), (2,)), placements)
    with pytest.raises(ConfigError, match="Own takes one owner coordinate"):
        parse_placement("Own(1, 2)")
