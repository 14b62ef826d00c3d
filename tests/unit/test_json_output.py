"""Large --json documents: orjson's bytes where they are the stdlib's text, the stdlib's otherwise."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reshard.cli import _COMPACT_JSON_ITEMS, _emit


def _large(extra: dict[str, Any]) -> dict[str, Any]:
    rows = [{"name": f"layers.{i}.w", "shape": [i, 2], "uniform": i % 2 == 0, "p": None} for i in range(10)]
    return {"ok": True, "tensors": rows * (_COMPACT_JSON_ITEMS // 10 + 1), **extra}


@pytest.mark.parametrize(
    "extra",
    [
        {"ratio": 0.3, "amp": 1.0625},  # ASCII: orjson's bytes straight to stdout
        {"name": "experts.é.w"},  # the stdlib escapes non-ASCII: its text
        {"big": 2**70},  # over 64 bits: orjson refuses, the stdlib writes it
    ],
)
def test_large_documents_print_the_stdlib_compact_text(
    capsys: pytest.CaptureFixture[str], extra: dict[str, Any]
) -> None:
    doc = _large(extra)
    _emit(doc)
    assert capsys.readouterr().out == json.dumps({"schema": 1, **doc}, separators=(",", ":")) + "\n"


def test_large_documents_floats_parse_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """orjson writes 1e-7 where Python writes 1e-07: the same number (reports round to 4 places)."""
    doc = _large({"tiny": 1e-07, "huge": 1e22, "sum": 0.1 + 0.2})
    _emit(doc)
    assert json.loads(capsys.readouterr().out) == {"schema": 1, **doc}


def test_small_documents_stay_indented(capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"ok": True, "tensors": [1, 2]}
    _emit(doc)
    assert capsys.readouterr().out == json.dumps({"schema": 1, **doc}, indent=2) + "\n"
