"""inspect's grouping and rows: ``group_names`` as the one-regex-substitution definition groups,
rows of one geometry made from one template (each its own name, dtype and bytes), and a group
shown as one row only when its rows agree (shared lists or merely equal ones)."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from reshard import report
from reshard.convert import SourceSpec, open_source
from reshard.report import (
    _GROUP_BY_BYTES,
    _grouped_by_bytes,
    _ranges,
    group_names,
    inspect_report,
    render_inspect,
)

_NUM = re.compile(r"(?<=\.)(\d+)(?=\.|$)")


def _reference(names: list[str]) -> list[tuple[str, list[str]]]:
    """group_names as first written: a substitution and a search per name."""
    groups: dict[str, list[str]] = {}
    nums: dict[str, list[int]] = {}
    for n in names:
        key = _NUM.sub("#", n, count=1)
        groups.setdefault(key, []).append(n)
        m = _NUM.search(n)
        if m:
            nums.setdefault(key, []).append(int(m.group(1)))
    out = []
    for key, members in groups.items():
        if len(members) == 1 or key not in nums:
            out.extend((name, [name]) for name in members)
            continue
        out.append((key.replace("#", "{" + _ranges(nums[key]) + "}", 1), members))
    return out


def test_group_names_matches_the_substitution_definition() -> None:
    rng = random.Random(0)
    # dots, digits, a literal '#' (a key of its own), an Arabic-Indic digit, a newline
    alphabet = [".", "1", "2", "#", "a", "10", ".0", "\n", "\u0663"]
    for _ in range(5000):
        made = ["".join(rng.choices(alphabet, k=rng.randint(0, 6))) for _ in range(rng.randint(0, 12))]
        names = list(dict.fromkeys(made))
        assert group_names(names) == _reference(names), names
        if names and all(n.isascii() and "\n" not in n for n in names):  # numpy's way, on few names
            assert _grouped_by_bytes(names, names) == _reference(names), names
    # enough names for numpy's way: layers, experts, numbers at the end, unnumbered, repeated
    many = [f"m.layers.{i}.experts.{j}.w" for i in range(200) for j in (0, 1, 2, 5, 7, 8, 9, 10, 11)]
    many += [f"m.{i}" for i in range(0, 3000, 7)] + ["emb", "emb", "x.1.y.2", "x.1.y.3", "l.#.w", "l.3.w"]
    many += [f"big.{10**17 + i}.w" for i in range(3)] + ["a.0.b", "a.01.b", "a.00.b"]
    assert len(many) >= _GROUP_BY_BYTES and _grouped_by_bytes(many, many) is not None
    assert group_names(many) == _reference(many)
    assert group_names([*many, "huge.1234567890123456789.w"]) == _reference(
        [*many, "huge.1234567890123456789.w"]
    )
    assert group_names([*many, "caf\u00e9.1.w"]) == _reference([*many, "caf\u00e9.1.w"])
    names = ["l.#.w", "l.3.w", "l.4.w", "emb", "l.7", "l.9", "x.1.y.2", "x.1.y.3"]
    assert group_names(names) == _reference(names)
    assert group_names(names)[0] == ("l.{3..4}.w", ["l.#.w", "l.3.w", "l.4.w"])  # the literal "#" joins


def test_numpys_way_in_chunks_of_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few names (a group's members in several, a non-ASCII name in the last)."""
    monkeypatch.setattr(report, "_GROUP_CHUNK", 7)
    names = [f"l.{i}.{w}" for i in range(12) for w in ("w", "v", "3")] + ["emb", "a.b", "l.x.1", "l.y.1"]
    assert _grouped_by_bytes(names, names) == _reference(names)
    assert _grouped_by_bytes([*names, "caf\u00e9.1"], [*names, "caf\u00e9.1"]) is None


def test_rows_of_one_geometry_keep_each_tensors_dtype_and_bytes(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(6):  # one shape, dtypes alternating: one geometry, two templates
        dtype = torch.float32 if i % 2 else torch.bfloat16
        tensors[f"l.{i}.w"] = torch.randn(4, 3, generator=gen).to(dtype)
    tensors["n"] = torch.randn(5, generator=gen)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    rows = inspect_report(ck)["tensors"]
    assert [r["name"] for r in rows] == [*(f"l.{i}.w" for i in range(6)), "n"]
    for r in rows:
        t = tensors[r["name"]]
        assert r["dtype"] == {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype]
        assert r["bytes"] == t.numel() * t.element_size()
        assert r["shape"] == list(t.shape)
        keys = ["name", "dtype", "shape", "placements", "local_shapes", "uniform", "pieces", "bytes"]
        assert list(r) == keys  # the --json key order
    text = _render(inspect_report(ck))
    assert "l.{0..5}.w" not in text  # two dtypes: a row each
    assert "l.0.w" in text and "l.5.w" in text


def _row(name: str, dtype: str = "F32", placements: list[str] | None = None) -> dict[str, object]:
    return {
        "name": name,
        "dtype": dtype,
        "shape": [8, 4],  # a new list per row: equal, not shared
        "placements": placements if placements is not None else ["S(0)"],
        "local_shapes": [[2, 4]] * 4,
        "uniform": True,
        "pieces": 4,
        "bytes": 128,
    }


def _render(doc: dict[str, object]) -> str:
    out = io.StringIO()
    render_inspect(doc, Console(file=out, width=160, highlight=False, emoji=False))
    return out.getvalue()


def _doc(rows: list[dict[str, object]]) -> dict[str, object]:
    return {
        "path": "p",
        "format": "per-rank",
        "mesh": None,
        "files": [],
        "file_bytes": 0,
        "tensors": rows,
        "totals": {"tensors": len(rows), "bytes": 128 * len(rows), "params": 0},
        "warnings": [],
    }


def test_rows_with_equal_lists_group_and_differing_ones_do_not() -> None:
    equal = _render(_doc([_row(f"l.{i}.w") for i in range(3)]))
    assert "l.{0..2}.w" in equal and "384 B" in equal
    mixed = _render(_doc([_row("l.0.w"), _row("l.1.w", placements=["R"]), _row("l.2.w")]))
    assert "l.{0..2}.w" not in mixed and "l.1.w" in mixed
    dtypes = _render(_doc([_row("l.0.w"), _row("l.1.w", dtype="BF16")]))
    assert "l.{0..1}.w" not in dtypes and "BF16" in dtypes


def test_a_table_of_many_rows_is_plain_aligned_text_with_every_row_and_no_terminal_codes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rich lays out every cell first: `inspect --all` of 100k tensors took ~45 s
    monkeypatch.setattr(report, "PLAIN_ROWS", 5)
    rows = [_row(f"l.{i}.w") for i in range(8)] + [_row("evil\x1b]0;pwned\x07.w", placements=["R"])]
    doc = _doc(rows)
    out = io.StringIO()
    render_inspect(doc, Console(file=out, width=160, highlight=False, emoji=False), group=False)
    text = out.getvalue()
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("tensor"))
    assert lines[header].split() == [
        "tensor",
        "count",
        "dtype",
        "shape",
        "placements",
        "local",
        "shape(s)",
        "bytes",
    ]
    body = lines[header + 2 : header + 2 + len(rows)]
    assert [line.split()[0] for line in body] == [f"l.{i}.w" for i in range(8)] + ["evil\\x1b]0;pwned\\x07.w"]
    assert "\x1b" not in text and "\x07" not in text
    col = lines[header].index("dtype")  # aligned: every row's dtype under the header's
    assert all(line[col : col + 3] == "F32" for line in body)
    assert all(line.endswith("128 B") for line in body)
    assert "9 tensors" in text
    # at the threshold or below: rich's table, as before
    monkeypatch.setattr(report, "PLAIN_ROWS", 100)
    assert "┃" in _render(doc) or "│" in _render(doc)
