"""The layout picture: cells against torch's own splitting, exact plain-text snapshots, colour rules.

The oracle: for each rank, torch's placement splitting (``Shard._split_tensor`` /
``_StridedShard._split_tensor``) of ``arange(numel).reshape(shape)`` gives the
elements that rank holds; every element's cell in the picture must list exactly
the ranks holding it (grouped cells: the union over their elements).
"""

from __future__ import annotations

import io
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from reshard.intervals import Interval
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.show import (
    MAX_COLS,
    MAX_ROWS,
    ShardGrid,
    grid_from_blocks,
    layout_text,
    plain,
    plan_text,
    rank_label,
    render_layout,
    render_pieces,
    shard_grid,
    should_color,
    source_picture,
)
from tests.strategies import examples, layouts, torch_local, torch_placements


def mesh(**dims: int) -> Mesh:
    return Mesh(tuple(dims), tuple(dims.values()))


def torch_holders(lay: TensorLayout) -> list[set[int]]:
    """For each element (row-major flat index), the ranks torch's splitting gives it to."""
    n = 1
    for s in lay.shape:
        n *= s
    full = torch.arange(n).reshape(lay.shape)
    tpls = torch_placements(lay.placements, len(lay.shape))
    out: list[set[int]] = [set() for _ in range(n)]
    for r, coord in enumerate(lay.mesh.coordinates()):
        for e in torch_local(full, lay.mesh.shape, coord, tpls).reshape(-1).tolist():
            out[e].add(r)
    return out


def unravel(e: int, shape: Sequence[int]) -> tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        idx.append(e % s)
        e //= s
    return tuple(reversed(idx))


def check_against_torch(lay: TensorLayout, grid: ShardGrid) -> None:
    holders = torch_holders(lay)
    union: dict[tuple[int, int], set[int]] = {}
    for e, who in enumerate(holders):
        assert who, f"torch gives element {e} to no rank"
        cell = grid.cell_of(unravel(e, lay.shape))
        union.setdefault(cell, set()).update(who)
        if not grid.grouped:
            assert set(grid.cells[cell[0]][cell[1]]) == who, (e, cell)
    # every cell is met by some element and lists exactly the union of its elements' ranks
    cells = {(i, j) for i in range(len(grid.rows)) for j in range(len(grid.cols))} if holders else set()
    assert set(union) == cells
    for (i, j), who in union.items():
        assert set(grid.cells[i][j]) == who
    idle = set(range(lay.mesh.size)) - set().union(*holders) if holders else set(range(lay.mesh.size))
    assert set(grid.idle) == idle


LLAMA_TP = TensorLayout.make((8, 4), mesh(tp=4), ["S(0)"])
FSDP_TP = TensorLayout.make((16, 4), mesh(fsdp=2, tp=4), ["_S(0, tp)", "S(0)"])
COLS_2 = TensorLayout.make((4, 6), mesh(tp=2), ["S(1)"])
REPL = TensorLayout.make((4, 6), mesh(tp=4), ["R"])
UNEVEN = TensorLayout.make((3, 2), mesh(tp=4), ["S(0)"])
ROWS_64 = TensorLayout.make((128, 4), mesh(world=64), ["S(0)"])
GRID_64 = TensorLayout.make((64, 64), mesh(dp=8, tp=8), ["S(0)", "S(1)"])
COLS_64 = TensorLayout.make((4, 256), mesh(tp=64), ["S(1)"])
STRIDED_64 = TensorLayout.make((128, 8), mesh(fsdp=8, tp=8), ["_S(0, tp)", "S(0)"])

CASES = {
    "llama-tp": LLAMA_TP,
    "fsdp-tp": FSDP_TP,
    "cols-2": COLS_2,
    "replicate": REPL,
    "uneven": UNEVEN,
    "rows-64": ROWS_64,
    "grid-64": GRID_64,
    "cols-64": COLS_64,
    "strided-64": STRIDED_64,
    "scalar-partial": TensorLayout.make((), mesh(dp=2, tp=2), ["P(sum)", "R"]),
    "1d-strided": TensorLayout.make((8,), mesh(tp=2), ["_S(0, 2)"]),
    "3d-moe": TensorLayout.make((8, 6, 4), mesh(ep=2, tp=2), ["S(0)", "S(1)"]),
    "3d-strided-uneven": TensorLayout.make((5, 7, 3), mesh(a=2, b=3), ["_S(1, 3)", "S(1)"]),
    "empty-cols": TensorLayout.make((5, 2), mesh(dp=2, tp=4), ["S(0)", "S(1)"]),
    "empty": TensorLayout.make((0, 4), mesh(tp=2), ["S(0)"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cells_agree_with_torch(name: str) -> None:
    check_against_torch(CASES[name], shard_grid(CASES[name]))


@pytest.mark.parametrize("name", list(CASES))
def test_ungrouped_cells_agree_with_torch(name: str) -> None:
    check_against_torch(CASES[name], shard_grid(CASES[name], max_rows=10**6, max_cols=10**6))


@settings(max_examples=examples(60))
@given(layouts(max_numel=512, mesh_kw={"max_ranks": 8}))
def test_random_layouts_agree_with_torch(lay: TensorLayout) -> None:
    check_against_torch(lay, shard_grid(lay, max_rows=10**6, max_cols=10**6))
    check_against_torch(lay, shard_grid(lay, max_rows=3, max_cols=2))


def test_grid_is_coarsest() -> None:
    """Neighbouring rows (and columns) never carry the same ranks: they would have been merged."""
    for lay in CASES.values():
        grid = shard_grid(lay, max_rows=10**6, max_cols=10**6)
        if len(grid.row_dims) <= 1:
            assert all(a != b for a, b in zip(grid.cells, grid.cells[1:]))
        cols = list(zip(*grid.cells))
        assert all(a != b for a, b in zip(cols, cols[1:]))


def snap(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def test_llama_tp_text() -> None:
    assert layout_text(LLAMA_TP, "model.layers.0.self_attn.q_proj.weight") == snap("""
        model.layers.0.self_attn.q_proj.weight: shape [8, 4] on mesh tp=4, placements (S(0))
        ┌───────────────┬─────┐
        │ dim 0 \\ dim 1 │ 0:4 │
        ├───────────────┼─────┤
        │ 0:2           │  0  │
        ├───────────────┼─────┤
        │ 2:4           │  1  │
        ├───────────────┼─────┤
        │ 4:6           │  2  │
        ├───────────────┼─────┤
        │ 6:8           │  3  │
        └───────────────┴─────┘
        """)


def test_fsdp_tp_text() -> None:
    # _S(0, 4) then S(0): rank (f, t) holds rows [4t + 2f, 4t + 2f + 2), interleaving fsdp into tp
    assert layout_text(FSDP_TP) == snap("""
        shape [16, 4] on mesh fsdp=2,tp=4, placements (_S(0, 4), S(0))
        ┌───────────────┬─────┐
        │ dim 0 \\ dim 1 │ 0:4 │
        ├───────────────┼─────┤
        │ 0:2           │  0  │
        ├───────────────┼─────┤
        │ 2:4           │  4  │
        ├───────────────┼─────┤
        │ 4:6           │  1  │
        ├───────────────┼─────┤
        │ 6:8           │  5  │
        ├───────────────┼─────┤
        │ 8:10          │  2  │
        ├───────────────┼─────┤
        │ 10:12         │  6  │
        ├───────────────┼─────┤
        │ 12:14         │  3  │
        ├───────────────┼─────┤
        │ 14:16         │  7  │
        └───────────────┴─────┘
        """)


def test_cols_and_replicate_text() -> None:
    assert layout_text(COLS_2) == snap("""
        shape [4, 6] on mesh tp=2, placements (S(1))
        ┌───────────────┬─────┬─────┐
        │ dim 0 \\ dim 1 │ 0:3 │ 3:6 │
        ├───────────────┼─────┼─────┤
        │ 0:4           │  0  │  1  │
        └───────────────┴─────┴─────┘
        """)
    assert layout_text(REPL) == snap("""
        shape [4, 6] on mesh tp=4, placements (R)
        ┌───────────────┬─────┐
        │ dim 0 \\ dim 1 │ 0:6 │
        ├───────────────┼─────┤
        │ 0:4           │ 0-3 │
        └───────────────┴─────┘
        """)


def test_uneven_text_lists_the_empty_rank() -> None:
    assert layout_text(UNEVEN) == snap("""
        shape [3, 2] on mesh tp=4, placements (S(0))
        ┌───────────────┬─────┐
        │ dim 0 \\ dim 1 │ 0:2 │
        ├───────────────┼─────┤
        │ 0:1           │  0  │
        ├───────────────┼─────┤
        │ 1:2           │  1  │
        ├───────────────┼─────┤
        │ 2:3           │  2  │
        └───────────────┴─────┘
        rank 3 holds nothing
        """)


def test_scalar_1d_and_3d_text() -> None:
    assert layout_text(CASES["scalar-partial"]) == snap("""
        shape [] on mesh dp=2,tp=2, placements (P(sum), R)
        ┌───────┐
        │ ranks │
        ├───────┤
        │  0-3  │
        └───────┘
        P(sum) over dp: each element is the sum of its ranks' values
        """)
    assert layout_text(CASES["1d-strided"]) == snap("""
        shape [8] on mesh tp=2, placements (_S(0, 2))
        ┌───────┬───────┐
        │ dim 0 │ ranks │
        ├───────┼───────┤
        │ 0:2   │   0   │
        ├───────┼───────┤
        │ 2:4   │   1   │
        ├───────┼───────┤
        │ 4:6   │   0   │
        ├───────┼───────┤
        │ 6:8   │   1   │
        └───────┴───────┘
        """)
    assert layout_text(CASES["3d-moe"]) == snap("""
        shape [8, 6, 4] on mesh ep=2,tp=2, placements (S(0), S(1))
        ┌──────────────────┬─────┐
        │ dims 0,1 \\ dim 2 │ 0:4 │
        ├──────────────────┼─────┤
        │ 0:4, 0:3         │  0  │
        ├──────────────────┼─────┤
        │ 0:4, 3:6         │  1  │
        ├──────────────────┼─────┤
        │ 4:8, 0:3         │  2  │
        ├──────────────────┼─────┤
        │ 4:8, 3:6         │  3  │
        └──────────────────┴─────┘
        """)
    assert layout_text(CASES["empty"]) == snap("""
        shape [0, 4] on mesh tp=2, placements (S(0))
        empty tensor: no elements to place
        """)


def test_64_ranks_grouped_text() -> None:
    text = layout_text(ROWS_64)
    lines = text.splitlines()
    assert lines[:4] == [
        "shape [128, 4] on mesh world=64, placements (S(0))",
        "┌───────────────┬───────┐",
        "│ dim 0 \\ dim 1 │  0:4  │",
        "├───────────────┼───────┤",
    ]
    assert lines[4] == "│ 0:8           │  0-3  │"
    assert lines[-3] == "│ 120:128       │ 60-63 │"
    assert lines[-1] == "grouped: a cell lists every rank holding part of it"
    assert layout_text(COLS_64).splitlines()[2:5] == [
        "│ dim 0 \\ dim 1 │ 0:32 │ 32:64 │ 64:96 │ 96:128 │ 128:160 │ 160:192 │ 192:224 │ 224:256 │",
        "├───────────────┼──────┼───────┼───────┼────────┼─────────┼─────────┼─────────┼─────────┤",
        "│ 0:4           │ 0-7  │ 8-15  │ 16-23 │ 24-31  │  32-39  │  40-47  │  48-55  │  56-63  │",
    ]


@pytest.mark.parametrize("name", ["rows-64", "grid-64", "cols-64", "strided-64"])
def test_64_ranks_stay_bounded(name: str) -> None:
    grid = shard_grid(CASES[name])
    assert len(grid.rows) <= MAX_ROWS and len(grid.cols) <= MAX_COLS
    lines = layout_text(CASES[name]).splitlines()
    assert len(lines) <= 2 * MAX_ROWS + 5
    assert max(len(line) for line in lines) <= 130


def test_long_rank_sets_are_shortened() -> None:
    assert rank_label(range(0, 64, 8)) == "0,…,56 (8)"
    assert rank_label([3, 9, 12]) == "3,9,12"
    assert rank_label(range(64), None) == "0-63"
    assert rank_label([]) == ""


def test_plan_text_shows_source_above_target() -> None:
    src = TensorLayout.make((4, 8), mesh(tp=2), ["S(1)"])
    dst = TensorLayout.make((4, 8), mesh(dp=2, tp=2), ["S(0)", "S(1)"])
    assert plan_text(src, dst, "w") == snap("""
        w: source
        shape [4, 8] on mesh tp=2, placements (S(1))
        ┌───────────────┬─────┬─────┐
        │ dim 0 \\ dim 1 │ 0:4 │ 4:8 │
        ├───────────────┼─────┼─────┤
        │ 0:4           │  0  │  1  │
        └───────────────┴─────┴─────┘

        w: target
        shape [4, 8] on mesh dp=2,tp=2, placements (S(0), S(1))
        ┌───────────────┬─────┬─────┐
        │ dim 0 \\ dim 1 │ 0:4 │ 4:8 │
        ├───────────────┼─────┼─────┤
        │ 0:2           │  0  │  1  │
        ├───────────────┼─────┼─────┤
        │ 2:4           │  2  │  3  │
        └───────────────┴─────┴─────┘
        """)


def test_colour_only_in_the_renderable() -> None:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, force_terminal=True, color_system="truecolor", width=200).print(render_layout(FSDP_TP))
    coloured = buf.getvalue()
    assert "\x1b[" in coloured
    # rank 0's cell has the palette's first colour (#4E79A7 = 78,121,167) as background
    assert "48;2;78;121;167" in coloured
    assert "\x1b" not in layout_text(FSDP_TP)


def test_should_color(monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert should_color(tty, {})
            assert not should_color(tty, {"NO_COLOR": "1"})
            assert should_color(tty, {"NO_COLOR": ""})  # no-color.org: only a non-empty value counts
            monkeypatch.setenv("NO_COLOR", "1")
            assert not should_color(tty)
        assert not should_color(io.StringIO(), {})
    finally:
        os.close(master)
        os.close(slave)


def test_pure_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from reshard.show import layout_text; from reshard.layout import TensorLayout;"
        "from reshard.mesh import Mesh; layout_text(TensorLayout.make((4,), Mesh(('tp',), (2,)), ['S(0)']));"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pieces_of_a_torch_written_checkpoint_draw_like_its_layout(tmp_path: Path) -> None:
    from reshard.config import load_layout, resolve_preset
    from reshard.demo import build_demo
    from reshard.formats import open_checkpoint

    tp_dir = build_demo(tmp_path, layers=1, tp=4)["tp"]
    ckpt = open_checkpoint(tp_dir, layout=load_layout(resolve_preset("llama-tp")))
    for name, placement in [
        ("model.layers.0.self_attn.o_proj.weight", "S(1)"),
        ("model.layers.0.self_attn.k_proj.weight", "S(0)"),
        ("model.norm.weight", "R"),
    ]:
        src = ckpt.tensors[name]
        lay = TensorLayout.make(src.shape, mesh(tp=4), [placement])
        pieces = grid_from_blocks(src.shape, src.piece_blocks)
        assert pieces == shard_grid(lay)
        check_against_torch(lay, pieces)
        text = plain(render_pieces(name, src.shape, src.piece_blocks, src.piece_files))
        assert text.splitlines()[0] == f"{name}: shape {list(src.shape)}, 4 pieces in 4 files"
        assert text.splitlines()[1:] == [
            line.replace("ranks", "files") for line in layout_text(lay).splitlines()[1:]
        ]


def test_pieces_sharing_a_file_are_labelled_by_file() -> None:
    # a DCP-like source: file 0 holds rows 0:2 and 4:6, file 1 rows 2:4 and 6:8
    rows = [(0, 2), (4, 6), (2, 4), (6, 8)]
    blocks = [((Interval(a, b),), (Interval(0, 3),)) for a, b in rows]
    text = plain(render_pieces("w", (8, 3), blocks, [0, 0, 1, 1], max_rows=2))
    assert text == snap("""
        w: shape [8, 3], 4 pieces in 2 files
        ┌───────────────┬─────┐
        │ dim 0 \\ dim 1 │ 0:3 │
        ├───────────────┼─────┤
        │ 0:4           │ 0,1 │
        ├───────────────┼─────┤
        │ 4:8           │ 0,1 │
        └───────────────┴─────┘
        grouped: a cell lists every file holding part of it
        """)
    assert plain(render_pieces("w", (8, 3), blocks, [0, 0, 1, 1])).splitlines()[4:11:2] == [
        "│ 0:2           │  0  │",
        "│ 2:4           │  1  │",
        "│ 4:6           │  0  │",
        "│ 6:8           │  1  │",
    ]


def test_source_picture_per_rank_hf_and_unknown_names(tmp_path: Path) -> None:
    from reshard.config import load_layout, resolve_preset
    from reshard.demo import build_demo
    from reshard.errors import TensorNotFoundError
    from reshard.formats import open_checkpoint

    paths = build_demo(tmp_path, layers=1, tp=4)
    ckpt = open_checkpoint(paths["tp"], layout=load_layout(resolve_preset("llama-tp")))
    name = "model.layers.0.mlp.down_proj.weight"
    lay = TensorLayout.make(ckpt.tensors[name].shape, mesh(tp=4), ["S(1)"])
    assert plain(source_picture(ckpt, name)) == layout_text(lay, name)

    hf = open_checkpoint(paths["reference"])
    assert plain(source_picture(hf, name)) == snap(f"""
        {name}: shape [256, 688], 1 piece in 1 file
        ┌───────────────┬───────┐
        │ dim 0 \\ dim 1 │ 0:688 │
        ├───────────────┼───────┤
        │ 0:256         │   0   │
        └───────────────┴───────┘
        """)
    target = TensorLayout.make((256, 688), mesh(tp=2), ["S(1)"])
    text = plan_text(source_picture(hf, name), target, name)
    assert text.startswith(f"{name}: source\n{name}: shape [256, 688], 1 piece in 1 file\n")
    assert f"{name}: target\n" + layout_text(target) in text

    with pytest.raises(TensorNotFoundError, match="no tensor 'model.layers.0.mlp.down_proj'") as e:
        source_picture(ckpt, "model.layers.0.mlp.down_proj")
    assert e.value.hint is not None and repr(name) in e.value.hint


def test_grouped_nd_rows_are_labelled_by_their_bounding_box_when_they_tile_it() -> None:
    lay = TensorLayout.make((3, 5, 2), mesh(ep=3, tp=5), ["S(0)", "S(1)"])
    check_against_torch(lay, shard_grid(lay, max_rows=4))
    assert layout_text(lay, max_rows=4) == snap("""
        shape [3, 5, 2] on mesh ep=3,tp=5, placements (S(0), S(1))
        ┌─────────────────────┬───────┐
        │ dims 0,1 \\ dim 2    │  0:2  │
        ├─────────────────────┼───────┤
        │ 0:1, 0:4            │  0-3  │
        ├─────────────────────┼───────┤
        │ 0:1, 4:5 … 1:2, 2:3 │  4-7  │
        ├─────────────────────┼───────┤
        │ 1:2, 3:4 … 2:3, 1:2 │ 8-11  │
        ├─────────────────────┼───────┤
        │ 2:3, 2:5            │ 12-14 │
        └─────────────────────┴───────┘
        grouped: a cell lists every rank holding part of it
        """)
