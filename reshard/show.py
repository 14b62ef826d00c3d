"""A picture of a layout: which rank holds which part of a tensor (``inspect/plan --show``).

Like torch's ``visualize_sharding`` (``torch/distributed/tensor/debug``), but for any
placement composition: a ``_StridedShard`` rank holds several disjoint intervals per
dim, replicas share a cell, and 0-d to n-d tensors are drawn.

The grid along each tensor dim is cut at every boundary of every rank's intervals,
then neighbouring slices held by the same ranks are merged again: the coarsest grid
that still separates every rank's block. Ranks that hold no element (an uneven
``Shard`` leaves trailing ranks empty) are listed under the picture instead.

Which dims go where:

* 0-d: one cell;
* 1-d: one row per slice of dim 0 (a column, like torch's picture);
* n-d (n >= 2): columns are slices of the last dim; the leading dims are flattened
  into the rows, each row a box of them (``0:4, 8:16``), in row-major order.

Big meshes stay readable: past ``max_rows`` rows (16) or ``max_cols`` columns (8,
terminals are wider than tall but cells are wide) consecutive slices are grouped,
and a grouped cell lists every rank holding part of it (``0-3``).

The picture is a rich renderable (one colour per rank: the lowest rank of a cell
picks it from a palette) and, for ``NO_COLOR`` or output that is not a terminal,
plain text without escape codes (:func:`plain`).
"""

from __future__ import annotations

import difflib
import io
import itertools
import math
import os
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from .checkpoint import Checkpoint
from .errors import TensorNotFoundError
from .indexmap import Seg
from .intervals import Block, Box, IndexList, Interval, normalize
from .layout import TensorLayout
from .placements import Partial
from .transforms import TransformedTensor

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = [
    "ShardGrid",
    "grid_from_blocks",
    "shard_grid",
    "render_grid",
    "render_pieces",
    "rank_label",
    "render_layout",
    "render_plan",
    "source_picture",
    "transform_picture",
    "plain",
    "layout_text",
    "plan_text",
    "should_color",
    "MAX_ROWS",
    "MAX_COLS",
]

MAX_ROWS = 16
"""Rows drawn before consecutive row slices are grouped."""

MAX_COLS = 8
"""Columns drawn before consecutive column slices are grouped."""

MAX_LABEL = 14
"""Longest rank label in a cell; longer sets are shortened to ``first,…,last (n)``."""

PALETTE = (
    "#4E79A7",
    "#F28E2B",
    "#E15759",
    "#76B7B2",
    "#59A14F",
    "#EDC948",
    "#B07AA1",
    "#FF9DA7",
    "#9C755F",
    "#BAB0AC",
    "#86BCB6",
    "#D37295",
)
"""Cell backgrounds (Tableau 10 and two more), cycled by rank."""

_Slices = tuple[tuple[Interval, int], ...]
"""Merged slices of one dim: (interval, bitmask of the ranks holding it)."""


@dataclass(frozen=True, slots=True)
class ShardGrid:
    """The cells of a picture and the holders of each.

    Holders are indices into the blocks the grid was made from (ranks, for a
    layout). ``rows[i]`` is the tuple of boxes (over ``row_dims``) that row ``i``
    covers: one box, or several consecutive ones when rows were grouped; ``cols[j]``
    likewise over ``col_dims``. ``cells[i][j]`` is the ascending holders of any
    element of the cell (exactly the holders of each of its elements when not
    grouped). ``idle`` are the holders of no element at all.
    """

    shape: tuple[int, ...]
    row_dims: tuple[int, ...]
    col_dims: tuple[int, ...]
    rows: tuple[tuple[Box, ...], ...]
    cols: tuple[tuple[Box, ...], ...]
    cells: tuple[tuple[tuple[int, ...], ...], ...]
    idle: tuple[int, ...]

    @property
    def grouped(self) -> bool:
        return any(len(r) > 1 for r in self.rows) or any(len(c) > 1 for c in self.cols)

    @property
    def empty(self) -> bool:
        return not self.rows or not self.cols

    def cell_of(self, index: Sequence[int]) -> tuple[int, int]:
        """(row, column) of the cell holding the element at global ``index``."""
        row = _find(self.rows, [index[d] for d in self.row_dims])
        col = _find(self.cols, [index[d] for d in self.col_dims])
        return row, col


def _find(groups: Sequence[tuple[Box, ...]], idx: Sequence[int]) -> int:
    for i, boxes in enumerate(groups):
        if any(all(iv.start <= x < iv.stop for iv, x in zip(box, idx)) for box in boxes):
            return i
    raise IndexError(f"index {list(idx)} is outside the grid")


def _dim_slices(blocks: Sequence[Block], n: int, d: int, holders: Sequence[int]) -> _Slices:
    """Dim ``d`` (size ``n``) cut at every interval boundary of the holders, equal neighbours merged.

    Only holders of elements count: a rank with an empty extent along another
    dim is in no cell, so its boundaries would only split cells needlessly.
    """
    cuts = sorted({0, n} | {x for r in holders for iv in blocks[r][d] for x in (iv.start, iv.stop)})
    masks = [0] * (len(cuts) - 1)
    for r in holders:
        for iv in blocks[r][d]:
            for k in range(bisect_left(cuts, iv.start), bisect_left(cuts, iv.stop)):
                masks[k] |= 1 << r
    out: list[tuple[Interval, int]] = []
    for k, m in enumerate(masks):
        if out and out[-1][1] == m:
            out[-1] = (Interval(out[-1][0].start, cuts[k + 1]), m)
        else:
            out.append((Interval(cuts[k], cuts[k + 1]), m))
    return tuple(out)


def _axis(per_dim: Sequence[_Slices], everyone: int) -> list[tuple[Box, int]]:
    """The boxes of an axis made of these dims (row-major product) and their holder masks."""
    out: list[tuple[Box, int]] = []
    for combo in itertools.product(*per_dim):
        mask = everyone
        for _, m in combo:
            mask &= m
        out.append((tuple(iv for iv, _ in combo), mask))
    return out


def _group(axis: list[tuple[Box, int]], limit: int) -> list[tuple[tuple[Box, ...], int]]:
    """At most ``limit`` groups of consecutive entries; a group's mask is the union."""
    k = max(1, -(-len(axis) // limit))
    out: list[tuple[tuple[Box, ...], int]] = []
    for i in range(0, len(axis), k):
        part = axis[i : i + k]
        mask = 0
        for _, m in part:
            mask |= m
        out.append((tuple(b for b, _ in part), mask))
    return out


def _bits(mask: int) -> tuple[int, ...]:
    return tuple(r for r in range(mask.bit_length()) if mask >> r & 1)


def grid_from_blocks(
    shape: Sequence[int], blocks: Sequence[Block], *, max_rows: int = MAX_ROWS, max_cols: int = MAX_COLS
) -> ShardGrid:
    """The picture's cells when holder ``i`` holds ``blocks[i]`` of a tensor of ``shape``.

    Works for any blocks (a layout's ranks, a checkpoint's pieces); see the module
    docstring for which dims become rows and columns.
    """
    shape = tuple(shape)
    holders = [r for r, b in enumerate(blocks) if all(il for il in b)]
    everyone = sum(1 << r for r in holders)
    ndim = len(shape)
    col_dims: tuple[int, ...] = (ndim - 1,) if ndim >= 2 else ()
    row_dims = tuple(range(ndim - len(col_dims)))
    slices = [_dim_slices(blocks, shape[d], d, holders) for d in range(ndim)]
    rows = _group(_axis([slices[d] for d in row_dims], everyone), max_rows)
    cols = _group(_axis([slices[d] for d in col_dims], everyone), max_cols)
    held = set(holders)
    return ShardGrid(
        shape=shape,
        row_dims=row_dims,
        col_dims=col_dims,
        rows=tuple(b for b, _ in rows),
        cols=tuple(b for b, _ in cols),
        cells=tuple(tuple(_bits(rm & cm) for _, cm in cols) for _, rm in rows),
        idle=tuple(r for r in range(len(blocks)) if r not in held),
    )


def shard_grid(lay: TensorLayout, *, max_rows: int = MAX_ROWS, max_cols: int = MAX_COLS) -> ShardGrid:
    """The picture's cells for ``lay``: holders are global ranks."""
    return grid_from_blocks(lay.shape, lay.blocks(), max_rows=max_rows, max_cols=max_cols)


def rank_label(ranks: Sequence[int], max_len: int | None = MAX_LABEL) -> str:
    """Ranks as short text: runs of three or more as ``a-b``, others by commas.

    >>> rank_label([0, 1, 2, 3]), rank_label([0, 2]), rank_label([0, 1, 5, 6, 7])
    ('0-3', '0,2', '0,1,5-7')
    >>> rank_label(range(0, 64, 8))
    '0,…,56 (8)'
    """
    rs = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i : j + 1])
        i = j + 1
    text = ",".join(parts)
    if max_len is not None and len(text) > max_len and len(parts) > 2:
        text = f"{rs[0]},…,{rs[-1]} ({len(rs)})"
    return text


def _box_label(box: Box) -> str:
    return ", ".join(f"{iv.start}:{iv.stop}" for iv in box)


def _group_label(boxes: tuple[Box, ...]) -> str:
    """A group's boxes as their bounding box when they tile it (always, for one dim), else first … last."""
    bound = tuple(
        Interval(min(b[d].start for b in boxes), max(b[d].stop for b in boxes)) for d in range(len(boxes[0]))
    )
    if sum(math.prod(iv.size for iv in b) for b in boxes) == math.prod(iv.size for iv in bound):
        return _box_label(bound)  # disjoint boxes as large as their bounding box tile it
    return f"{_box_label(boxes[0])} … {_box_label(boxes[-1])}"


def _dims_label(dims: Sequence[int]) -> str:
    return ("dim " if len(dims) == 1 else "dims ") + ",".join(str(d) for d in dims)


def _title(lay: TensorLayout, name: str | None) -> str:
    head = f"{name}: " if name else ""
    placements = ", ".join(lay.placement_strs())
    return f"{head}shape {list(lay.shape)} on mesh {lay.mesh}, placements ({placements})"


def _notes(grid: ShardGrid, noun: str, owner: Sequence[int] | None) -> list[str]:
    notes: list[str] = []
    if grid.idle and not grid.empty:
        idle = sorted({owner[i] for i in grid.idle} if owner is not None else grid.idle)
        who = rank_label(idle, None)
        notes.append(f"{noun} {who} holds nothing" if len(idle) == 1 else f"{noun}s {who} hold nothing")
    if grid.grouped:
        notes.append(f"grouped: a cell lists every {noun} holding part of it")
    return notes


def _cell_style(first: int) -> str:
    bg = PALETTE[first % len(PALETTE)]
    r, g, b = (int(bg[i : i + 2], 16) for i in (1, 3, 5))
    fg = "#000000" if r * 0.299 + g * 0.587 + b * 0.114 > 150 else "#FFFFFF"
    return f"{fg} on {bg}"


def render_grid(
    grid: ShardGrid,
    title: str,
    *,
    noun: str = "rank",
    owner: Sequence[int] | None = None,
    notes: Sequence[str] = (),
) -> RenderableType:
    """A grid as a rich renderable: title, table, notes.

    ``owner[i]`` is the number shown for holder ``i`` (e.g. the file a checkpoint
    piece lies in); by default the holder itself. ``noun`` names what the numbers are.
    """
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [Text(title)]
    if grid.empty:
        parts.append(Text("empty tensor: no elements to place"))
    else:
        parts.append(_table(grid, noun, owner))
    parts.extend(Text(n) for n in [*_notes(grid, noun, owner), *notes])
    return Group(*parts)


def render_layout(lay: TensorLayout, name: str | None = None, **grid_kw: int) -> RenderableType:
    """The picture of ``lay``: which rank holds which cells.

    ``grid_kw`` go to :func:`shard_grid` (``max_rows``, ``max_cols``).
    """
    notes: list[str] = []
    op = lay.partial_op
    if op is not None:
        dims = [n for n, p in zip(lay.mesh.names, lay.placements) if isinstance(p, Partial)]
        notes.append(f"P({op}) over {', '.join(dims)}: each element is the {op} of its ranks' values")
    return render_grid(shard_grid(lay, **grid_kw), _title(lay, name), notes=notes)


def render_pieces(
    name: str, shape: Sequence[int], blocks: Sequence[Block], files: Sequence[int], **grid_kw: int
) -> RenderableType:
    """The picture of a stored tensor's pieces (``inspect --show`` without a layout, e.g. DCP):
    piece ``k`` holds ``blocks[k]`` and lies in file number ``files[k]``."""
    grid = grid_from_blocks(shape, blocks, **grid_kw)
    n, m = len(blocks), len(set(files))
    title = f"{name}: shape {list(shape)}, {n} piece{'s' * (n != 1)} in {m} file{'s' * (m != 1)}"
    return render_grid(grid, title, noun="file", owner=files)


def _table(grid: ShardGrid, noun: str, owner: Sequence[int] | None) -> RenderableType:
    from rich import box
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SQUARE, show_lines=True, padding=0, highlight=False)
    if grid.row_dims:
        corner = _dims_label(grid.row_dims)
        if grid.col_dims:
            corner += " \\ " + _dims_label(grid.col_dims)
        table.add_column(Padding(Text(corner), (0, 1)), no_wrap=True)
    for c in grid.cols:
        header = Text(_group_label(c) if grid.col_dims else f"{noun}s", justify="center")
        table.add_column(Padding(header, (0, 1)), justify="center", no_wrap=True)
    for r, cells in zip(grid.rows, grid.cells):
        row: list[RenderableType] = [Padding(Text(_group_label(r)), (0, 1))] if grid.row_dims else []
        for holders in cells:
            shown = sorted({owner[h] for h in holders}) if owner is not None else list(holders)
            label = Text(rank_label(shown), justify="center")
            row.append(Padding(label, (0, 1), style=_cell_style(shown[0]) if shown else "", expand=True))
        table.add_row(*row)
    return table


def source_picture(ckpt: Checkpoint, name: str, **grid_kw: int) -> RenderableType:
    """``inspect --show NAME``: the tensor's layout when the checkpoint knows its mesh and
    placements (per-rank), else its stored pieces labelled by file (hf, DCP).

    Raises:
        TensorNotFoundError: no tensor ``name``; the message suggests close names.
    """
    src = ckpt.tensors.get(name)
    if src is None:
        raise tensor_not_found(ckpt.path, name, list(ckpt.tensors))
    if ckpt.mesh is not None and src.placements is not None:
        return render_layout(TensorLayout.make(src.shape, ckpt.mesh, src.placements), name, **grid_kw)
    return render_pieces(name, src.shape, src.piece_blocks, src.piece_files, **grid_kw)


def _dst_intervals(segs: Sequence[Seg]) -> IndexList:
    """The target indices of a dim map as ascending intervals (a strided segment: one per index)."""
    ivs = [
        iv
        for s in segs
        for iv in (
            (Interval(s.dst, s.dst + s.size),)
            if s.dst_step == 1
            else tuple(Interval(i, i + 1) for i in range(s.dst, s.dst_last + 1, s.dst_step))
        )
    ]
    return normalize(sorted(ivs, key=lambda iv: iv.start))


def tensor_not_found(where: str, name: str, names: Sequence[str]) -> TensorNotFoundError:
    """No tensor ``name`` among ``names``: the error, suggesting close names."""
    close = difflib.get_close_matches(name, list(names), n=3)
    hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else "list them with reshard inspect"
    return TensorNotFoundError(f"{where}: no tensor {name!r}", path=where, tensor=name, hint=hint)


def transform_picture(
    ckpt: Checkpoint, tt: TransformedTensor, target: TensorLayout, *, most: int = 4
) -> RenderableType:
    """``plan --show NAME`` through transforms: the target tensor cut by the source tensors that
    fill it (a cell shows their numbers; ``plan``'s region and byte range of each below), its
    layout on the target mesh, then the first ``most`` sources' own pictures (:func:`source_picture`).
    """
    from rich.console import Group
    from rich.text import Text

    from .report import feed_text  # plan's wording of each part
    from .transform_plan import feeds

    names = list(dict.fromkeys(p.source for p in tt.parts if p.source is not None))
    number = {n: i for i, n in enumerate(names)}
    owner = [len(names) if p.source is None else number[p.source] for p in tt.parts]
    blocks = [tuple(_dst_intervals(d.segs) for d in p.dims) for p in tt.parts]
    legend = [
        f"{'source ' if f['source'] is not None else ''}{k}: {feed_text(f)}"
        for k, f in zip(owner, feeds(tt, ckpt.tensors))
    ]
    n = len(names)
    title = f"{tt.name}: shape {list(tt.shape)}, filled from {n} source tensor{'s' * (n != 1)}"
    grid = grid_from_blocks(tt.shape, blocks)
    out: list[RenderableType] = [render_grid(grid, title, noun="source", owner=owner, notes=legend)]
    out += [Text(""), Text(f"{tt.name}: target"), render_layout(target)]
    for name in names[:most]:
        out += [Text(""), Text(f"source {number[name]}"), source_picture(ckpt, name)]
    if n > most:
        out.append(Text(f"... and {n - most} more source tensors (reshard plan --json lists them all)"))
    return Group(*out)


def render_plan(
    src: TensorLayout | RenderableType, dst: TensorLayout | RenderableType, name: str | None = None
) -> RenderableType:
    """Source above target, for ``plan --show NAME``: one above the other stays narrow.

    Either side is a layout or an already rendered picture (:func:`source_picture`).
    """
    from rich.console import Group
    from rich.text import Text

    head = f"{name}: " if name else ""
    return Group(
        Text(f"{head}source"),
        render_layout(src) if isinstance(src, TensorLayout) else src,
        Text(""),
        Text(f"{head}target"),
        render_layout(dst) if isinstance(dst, TensorLayout) else dst,
    )


def plain(renderable: RenderableType, width: int = 200) -> str:
    """Render without colour or escape codes (``NO_COLOR``, pipes, snapshots); lines right-stripped."""
    from rich.console import Console

    buf = io.StringIO()
    Console(
        file=buf, width=width, color_system=None, force_terminal=False, highlight=False, legacy_windows=False
    ).print(renderable)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def layout_text(lay: TensorLayout, name: str | None = None, **grid_kw: int) -> str:
    """:func:`render_layout` as plain text."""
    return plain(render_layout(lay, name, **grid_kw))


def plan_text(
    src: TensorLayout | RenderableType, dst: TensorLayout | RenderableType, name: str | None = None
) -> str:
    """:func:`render_plan` as plain text."""
    return plain(render_plan(src, dst, name))


def should_color(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Colour only on a terminal and when ``NO_COLOR`` is unset or empty (no-color.org)."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
