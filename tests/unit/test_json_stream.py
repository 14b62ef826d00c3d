"""Large --json documents written as they are made (reshard.jsonout): the text of the document
encoded whole, whatever the batches, and never more than a batch of rows made ahead."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import typer
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from reshard import cli
from reshard.api import inspect_checkpoint
from reshard.errors import HeaderError
from reshard.jsonout import Rows, write_compact

RESHARD = str(Path(sys.executable).parent / "reshard")


def whole(doc: dict[str, Any]) -> bytes:
    """The document encoded at once, as ``_emit`` did before it streamed: orjson's bytes when it
    takes the document and they are ASCII without DEL, the stdlib's compact text otherwise."""
    try:
        raw = orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        raw = None
    if raw is not None and raw.isascii() and b"\x7f" not in raw:
        return raw
    return json.dumps(doc, separators=(",", ":")).encode()


def streamed(doc: dict[str, Any], batch: int) -> bytes:
    out: list[bytes] = []
    write_compact(doc, lambda b: out.append(bytes(b)), batch=batch)
    return b"".join(out)


def rows(n: int, odd: dict[int, str] | None = None) -> Rows:
    def make() -> Iterator[dict[str, Any]]:
        for i in range(n):
            name = (odd or {}).get(i, f"layers.{i}.w")
            yield {"name": name, "shape": [i, 2], "even": i % 2 == 0, "p": None, "lists": [[i], []]}

    return Rows(n, make)


CASES = {
    "ascii": {"path": "/ckpt", "tensors": rows(50), "totals": {"tensors": 50, "bytes": 2**40}},
    "non-ascii row in the last batch": {"tensors": rows(50, {48: "experts.é.w"}), "after": 0.1 + 0.2},
    "non-ascii row in the first batch": {"tensors": rows(50, {0: "experts.é.w"}), "ratio": 1e-07},
    "non-ascii field after the rows": {"tensors": rows(50), "warnings": ["naïve"], "ratio": 1e22},
    "non-ascii field before the rows": {"path": "/ckpt/é", "amp": 1e-07, "tensors": rows(50)},
    "DEL in a row": {"tensors": rows(50, {30: "a\x7fb"}), "ratio": 1e-07},
    "int over 64 bits in a field": {"tensors": rows(50), "big": 2**70},
    "int over 64 bits in a row": {"tensors": Rows(2, lambda: iter([1, 2**70])), "ratio": 1e-07},
    # floats before the rows: their text depends on rows not made yet (made whole first)
    "floats before ascii rows": {"ratio": 1e-07, "tensors": rows(50), "after": 1e22},
    "floats before non-ascii rows": {"ratio": 1e-07, "tensors": rows(50, {49: "ü"}), "after": 1e22},
    "empty rows and lists": {"tensors": Rows(0, lambda: iter(())), "files": [], "sizes": list(range(30))},
    "control characters": {"tensors": rows(50, {7: 'a\n\t\x01\\"b'}), "note": "\x1b[0m"},
}


@pytest.mark.parametrize("batch", [1, 7, 50, 4096])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_text_is_the_whole_documents(case: str, batch: int) -> None:
    doc = {"schema": 1, **CASES[case]}
    want = whole({k: list(v) if isinstance(v, Rows) else v for k, v in doc.items()})
    assert streamed(doc, batch) == want
    if not any(isinstance(v, float) for v in doc.values()):  # orjson writes 1e-7, Python 1e-07
        assert want == json.dumps(json.loads(want), separators=(",", ":")).encode()


# JSON values without floats (what Rows may hold); strings from all of Unicode, lone surrogates
# too (orjson refuses them, the stdlib writes \\ud800)
_text = st.text(st.characters(exclude_categories=[]))
_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _text
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)


@given(items=st.lists(_values, max_size=30), batch=st.integers(1, 8), head=_values)
def test_rows_of_any_floatless_values(items: list[Any], batch: int, head: Any) -> None:
    doc = {"schema": 1, "head": head, "rows": Rows(len(items), lambda: iter(items)), "tail": head}
    assert streamed(doc, batch) == whole({**doc, "rows": items})
    assert streamed(doc, batch) == json.dumps({**doc, "rows": items}, separators=(",", ":")).encode()


def test_rows_are_made_a_batch_ahead_of_the_text_at_most() -> None:
    made = 0

    def make() -> Iterator[dict[str, Any]]:
        nonlocal made
        for i in range(10_000):
            made += 1
            yield {"name": f"layers.{i}.w", "shape": [i, 2]}

    written = 0
    ahead = []

    def write(b: bytes | memoryview) -> None:
        nonlocal written
        written += bytes(b).count(b'"name"')
        ahead.append(made - written)

    write_compact({"tensors": Rows(10_000, make)}, write, batch=300)
    assert written == made == 10_000
    assert max(ahead) == 300


def test_an_error_while_writing_does_not_add_a_second_document(capsys: pytest.CaptureFixture[str]) -> None:
    def make() -> Iterator[dict[str, Any]]:
        for i in range(cli._COMPACT_JSON_ITEMS + 10):
            if i == 9000:
                raise HeaderError("rank-00003.safetensors: gone while reading", path="rank-00003.safetensors")
            yield {"name": f"layers.{i}.w"}

    with pytest.raises(typer.Exit) as e, cli._errors(True):
        cli._emit({"ok": True, "tensors": Rows(cli._COMPACT_JSON_ITEMS + 10, make)})
    assert e.value.exit_code == 2
    out, err = capsys.readouterr()
    assert out.startswith('{"schema":1,"ok":true,"tensors":[') and out.count('"schema"') == 1
    assert "gone while reading" in err
    # the next command's error is a JSON document again
    with pytest.raises(typer.Exit), cli._errors(True):
        raise HeaderError("x.safetensors: bad", path="x.safetensors")
    assert json.loads(capsys.readouterr().out)["error"]["message"] == "x.safetensors: bad"


@pytest.mark.parametrize("odd", [None, "model.layers.9999.expérts.w"], ids=["ascii", "non-ascii"])
def test_inspect_json_of_a_checkpoint_over_the_compact_threshold(tmp_path: Path, odd: str | None) -> None:
    """A real per-rank checkpoint of 10k+ tensors, `reshard inspect --json` in a subprocess: the
    stdlib's compact text of the report (ASCII: orjson's bytes, the same text)."""
    n = cli._COMPACT_JSON_ITEMS + 50
    names = [f"model.layers.{i}.{'wo' if i % 3 else 'wq'}" for i in range(n)]
    if odd is not None:
        names[-1] = odd
    layout = tmp_path / "layout.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.wo": {tp: S(1)}\n  "*": {tp: S(0)}\n')
    ck = tmp_path / "ck"
    ck.mkdir()
    for r in range(2):
        part = {
            name: torch.full((2, 1) if name.endswith("wo") else (1, 2), r, dtype=torch.int8) for name in names
        }
        save_file(part, str(ck / f"rank-{r:05d}-of-00002.safetensors"))
    for check in (False, True):
        p = subprocess.run(
            [RESHARD, "inspect", str(ck), "--layout", str(layout), "--json", *(["--check"] if check else [])],
            capture_output=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        doc = inspect_checkpoint(ck, layout=str(layout), check=check)  # the report made whole
        assert len(doc["tensors"]) == n and doc["tensors"][0]["placements"] == ["S(0)"]
        full = {"schema": 1, "ok": True, "command": "inspect", **doc}
        assert p.stdout == json.dumps(full, separators=(",", ":")).encode() + b"\n"
        assert (b"exp\\u00e9rts" in p.stdout) == (odd is not None)
