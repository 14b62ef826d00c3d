"""The HF index's weight_map read pair by pair gives what strict JSON parsing gives, or leaves
the document to it: never a map the strict parser would refuse or read differently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard.errors import HeaderError
from reshard.formats.hf_extras import _weight_map_pairs, read_weight_index
from reshard.io.safe import load_json

_names = st.text(st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=12)
_ws = st.sampled_from(["", " ", "\n  ", "\t", "\r\n", "\u00a0", "\u2028"])  # the last two: not JSON's


@st.composite
def documents(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(_names, st.sampled_from(["a.safetensors", "b.safetensors", 'q"x']))))
    w = draw(_ws)
    body = f",{w}".join(
        f"{json.dumps(k, ensure_ascii=draw(st.booleans()))}{w}:{draw(_ws)}{json.dumps(v)}" for k, v in pairs
    )
    if draw(st.booleans()) and pairs:
        body += draw(st.sampled_from([",", ', "n": 1', ', "n": ["x"]', ", 3"]))  # not JSON / not strings
    meta = draw(st.sampled_from(['{"total_size": 5}', '{"weight_map": "x"}', '{"note": "weight_map"}', "{}"]))
    wm = f'"weight_map"{draw(_ws)}:{w}{{{w}{body}{w}}}'
    parts = [f'"metadata": {meta}', wm]
    if draw(st.booleans()):
        parts.reverse()
    return "{" + f",{w}".join(parts) + "}"


@given(documents())
def test_fast_reading_matches_strict_json(text: str) -> None:
    try:
        strict = load_json(text.encode(), what="HF index", path="i", error=HeaderError)
    except HeaderError:
        strict = None
    fast = _weight_map_pairs(text)
    if fast is None:
        return  # the strict parser decides (as read_weight_index does)
    weight_map, rest = fast
    assert strict is not None, text  # read fast only what strict JSON reads
    assert isinstance(strict, dict) and strict["weight_map"] == weight_map
    assert list(weight_map.items()) == list(strict["weight_map"].items())  # same order too
    other = load_json(rest.encode(), what="HF index", path="i", error=HeaderError)
    assert isinstance(other, dict) and other["weight_map"] == {}
    assert {k: v for k, v in other.items() if k != "weight_map"} == {
        k: v for k, v in strict.items() if k != "weight_map"
    }
    shards = {id(v) for v in weight_map.values()}
    assert len(shards) == len(set(weight_map.values()))  # one string per shard


def _index(tmp_path: Path, text: str, shards: tuple[str, ...] = ("a.safetensors",)) -> Path:
    for s in shards:
        (tmp_path / s).write_bytes(b"")
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"weight_map": {"w": "a.safetensors", "w": "a.safetensors"}}', 'duplicate key "w"'),
        ('{"weight_map": {"w": "a.safetensors",}}', "not valid JSON"),
        ('{"weight_map": {"w": 3}}', "weight_map must map tensor names to file names"),
        ('{"metadata": {"weight_map": {"w": "a.safetensors"}}}', "not a valid safetensors index"),
        ('{"weight_map": {"w": "../x.safetensors"}}', "points outside the checkpoint"),
        ('{"weight_map": {"w": "b.safetensors"}}', "listed in model.safetensors.index.json but missing"),
        ('{"weight_map": {"w": "a.safetensors"}, "metadata": NaN}', "non-standard constant"),
    ],
)
def test_bad_indexes_are_refused_as_before(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        read_weight_index(_index(tmp_path, text))


def test_a_200k_tensor_index_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """json.loads with a pairs hook held ~100 MiB for the 17 MB index of 200k tensors."""
    name = "model.layers.{}.mlp.experts.{}.gate_proj.weight"
    wm = {name.format(i // 3000, i % 3000): f"model-{i % 4:05d}-of-00004.safetensors" for i in range(200_000)}
    p = _index(
        tmp_path,
        json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}, indent=2),
        tuple(sorted(set(wm.values()))),
    )
    code = (
        "import resource, sys; from pathlib import Path\n"
        "from reshard.formats.hf_extras import read_weight_index\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"wm = read_weight_index(Path({str(p)!r}))\n"
        "print(len(wm), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) == 200_000
    assert int(out[1]) < 64, out  # MiB over the interpreter's; the strict path took ~100
    assert read_weight_index(p) == wm
