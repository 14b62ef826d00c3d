"""Reports for ``inspect`` and ``plan``: plain dicts (the --json documents) and rich renderings."""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, eq, itemgetter
from typing import Any, TypeVar

from .budget import Budget, memory_estimate
from .checkpoint import Checkpoint, Spooled, offset_columns
from .dtypes import DTYPE_SIZES
from .intervals import Block, block_shape, box_span, format_box
from .jsonout import Rows
from .plan import Plan, copy_boxes, natural_sorted
from .text import markup_safe, shown
from .transform_plan import feeds, piece_strides

__all__ = [
    "inspect_report",
    "render_inspect",
    "plan_report",
    "render_plan",
    "group_names",
    "human",
    "feed_text",
]

_MAX_RANGES = 32


def human(n: float) -> str:
    """Bytes for people: ``1.50 GiB``.

    >>> human(512), human(3 * 2**30 // 2)
    ('512 B', '1.50 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def inspect_report(ck: Checkpoint, *, lazy: bool = False) -> dict[str, Any]:
    """Format, mesh, files and per-tensor facts, from headers only.

    With ``lazy``, ``"tensors"`` is a :class:`~reshard.jsonout.Rows` making each row as it is
    iterated (``--json`` writes 200k rows a batch at a time), else a list.
    """
    order = natural_sorted(ck.tensors)
    tensors: Rows | list[dict[str, Any]] = Rows(len(order), functools.partial(_tensor_rows, ck, order))
    if not lazy:
        tensors = list(tensors)
    total, params = _totals(ck)
    doc: dict[str, Any] = {
        "path": ck.path,
        "format": ck.format,
        "mesh": ck.mesh.to_json() if ck.mesh is not None else None,
        "files": [{"name": os.path.basename(ck.files[i]), "size": ck.file_sizes[i]} for i in ck.own_files()],
        "file_bytes": ck.total_bytes,
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "bytes": total, "params": params},
        "warnings": [str(w) for w in ck.warnings],
        **({"note": _DCP_NOTE} if ck.format == "dcp" else {}),
    }
    if ck.manifest is not None and isinstance(ck.manifest.get("transforms"), dict):
        doc["transforms"] = ck.manifest["transforms"]  # what the conversion that wrote it applied
    if ck.non_tensors:  # only formats that have them (DCP, torch.save) add the key
        doc["non_tensors"] = [
            {
                "name": n.name,
                "size": n.size,
                "kind": n.kind,
                "file": os.path.basename(ck.files[n.file]) if n.file is not None else None,
                "copied_by_dcp": n.stored,  # (--to dcp)
            }
            for n in ck.non_tensors
        ]
    return doc


def _totals(ck: Checkpoint) -> tuple[int, int]:
    """The tensors' bytes and elements, summed per (shape, dtype) (a few per MoE checkpoint)."""
    total = params = 0
    for (shape, dtype), n in Counter(map(attrgetter("shape", "dtype"), ck.tensors.values())).items():
        numel = math.prod(shape)
        total += n * numel * DTYPE_SIZES[dtype]
        params += n * numel
    return total, params


def _tensor_rows(ck: Checkpoint, order: Sequence[str]) -> Iterator[dict[str, Any]]:
    """The report's row of each tensor of ``order`` (natural name order); no floats (jsonout)."""
    shapes: dict[int, tuple[list[list[int]], bool, object]] = {}  # local shapes, uniform, blocks
    # values shared by the rows of one geometry (a 200k-tensor report held 200k copies of each)
    lists: dict[int, tuple[object, list[Any] | None]] = {}

    def shared(value: Any) -> list[Any] | None:
        if value is None:
            return None
        hit = lists.get(id(value))
        if hit is None or hit[0] is not value:
            hit = lists[id(value)] = (value, [str(p) for p in value])
        return hit[1]

    by_shape: dict[int, tuple[tuple[int, ...], list[int], int]] = {}  # shape, as a list, numel
    dcp = ck.format == "dcp"
    # a DCP row's chunks (a dict each: 800k for 100k tensors on 8 ranks), by blocks and files
    boxes: dict[tuple[int, tuple[int, ...]], tuple[object, list[dict[str, str]]]] = {}
    names = [os.path.basename(f) for f in ck.files]
    spooled = ck.spooled  # a reader's spool: its pieces are named by the files they came from
    # per geometry and dtype: the row all its tensors share but for the name (a copy of it is
    # made per tensor, not a dict of eight values: 100k tensors, a few hundred geometries)
    rows: dict[tuple[int, int, str], tuple[object, object, object, dict[str, Any]]] = {}
    tensors = ck.tensors
    for name in order:
        t = tensors[name]
        same = rows.get((id(t.piece_blocks), id(t.placements), t.dtype))
        if (  # the ids of objects the template holds (a lazy mapping's tensors may be freed)
            same is None
            or same[0] is not t.piece_blocks
            or same[1] is not t.placements
            or same[2] is not t.shape
        ):
            shape = by_shape.get(id(t.shape))
            if shape is None or shape[0] is not t.shape:  # shapes are shared by the reader's tensors
                shape = by_shape[id(t.shape)] = (t.shape, list(t.shape), t.numel)
            geo = shapes.get(id(t.piece_blocks))
            if geo is None or geo[2] is not t.piece_blocks:  # tensors of one geometry share their blocks
                locals_ = [list(block_shape(b)) for b in t.piece_blocks]
                uniform = all(s == locals_[0] for s in locals_)
                geo = shapes[id(t.piece_blocks)] = (locals_, uniform, t.piece_blocks)
            template = {
                "name": t.name,
                "dtype": t.dtype,
                "shape": shape[1],
                "placements": shared(t.placements),
                "local_shapes": geo[0],
                "uniform": geo[1],
                "pieces": len(t.piece_blocks),
                "bytes": shape[2] * DTYPE_SIZES[t.dtype],
            }
            same = rows[id(t.piece_blocks), id(t.placements), t.dtype] = (
                t.piece_blocks,
                t.placements,
                t.shape,
                template,
            )
        row = same[3].copy()
        row["name"] = t.name
        if dcp and spooled and any(fi in spooled for fi in t.piece_files):
            chunks = [
                {"file": os.path.basename(ck.shown_file(fi, at)), "box": _block_text(b)}
                for fi, at, b in zip(t.piece_files, t.piece_offsets, t.piece_blocks, strict=True)
            ]
            row = {"chunks": chunks, **row}
        elif dcp:
            key = (id(t.piece_blocks), t.piece_files)
            hit = boxes.get(key)
            if hit is None or hit[0] is not t.piece_blocks:  # shared by the rows of one geometry
                chunks = [
                    {"file": names[fi], "box": _block_text(b)}
                    for fi, b in zip(t.piece_files, t.piece_blocks, strict=True)
                ]
                hit = boxes[key] = (t.piece_blocks, chunks)
            row = {"chunks": hit[1], **row}
        yield row


_DCP_NOTE = "DCP stores no placements: each tensor is shown as the boxes of its stored chunks"


def _block_text(block: Block) -> str:
    """A piece's global indices, ``[0:4)x[2:3)`` as :func:`~reshard.intervals.format_box` shows
    a box; ``[]`` for an empty dim (an empty chunk)."""
    if not block:
        return format_box(())
    return "x".join(",".join(str(iv) for iv in ilist) or "[]" for ilist in block)


_NUM = re.compile(r"(?<=\.)(\d+)(?=\.|$)")


def group_names(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Group names differing only in dotted numbers: ``layers.{0..79}.wq`` with its members.

    >>> [(p, len(m)) for p, m in group_names(["l.0.w", "l.1.w", "l.3.w", "emb"])]
    [('l.{0..1,3}.w', 3), ('emb', 1)]
    """
    return _grouped(names, names)


_T = TypeVar("_T")


def _grouped(names: Sequence[str], items: Sequence[_T]) -> list[tuple[str, list[_T]]]:
    """:func:`group_names` of ``names``, each name standing for the item of ``items`` at its index."""
    if len(names) >= _GROUP_BY_BYTES:
        found = _grouped_by_bytes(names, items)
        if found is not None:
            return found
    # key -> the first member's name, the members, their numbers' digits
    groups: dict[str, tuple[str, list[_T], list[str]]] = {}
    search = _NUM.search
    for n, item in zip(names, items, strict=True):
        m = search(n)
        if m is None:
            got = groups.get(n)
            if got is None:
                got = groups[n] = (n, [], [])
            got[1].append(item)
            continue
        lo, hi = m.span()
        key = n[:lo] + "#" + n[hi:]  # as _NUM.sub("#", n, count=1)
        got = groups.get(key)
        if got is None:
            got = groups[key] = (n, [], [])
        got[1].append(item)
        got[2].append(n[lo:hi])
    out = []
    for key, (first, members, digits) in groups.items():
        if len(members) == 1:
            out.append((first, members))
        elif not digits:  # names without a dotted number are their key
            out.extend((key, [item]) for item in members)
        else:
            out.append((key.replace("#", "{" + _ranges(list(map(int, digits))) + "}", 1), members))
    return out


_GROUP_BY_BYTES = 2048
"""Names from which :func:`_grouped` finds their numbers with numpy (the names as one byte array)."""


def _grouped_by_bytes(names: Sequence[str], items: Sequence[_T]) -> list[tuple[str, list[_T]]] | None:
    """:func:`_grouped` with each name's first dotted number found in the names' bytes by numpy
    and the keys made there (:func:`_number_keys`, a chunk of names at a time: bounded scratch
    memory), not by a regex search and two slices a name (100k names: 80 ms); None for names
    it does not take (non-ASCII, holding a newline, a number of over 18 digits)."""
    import numpy as np

    values = np.zeros(len(names), np.int64)  # each name's first dotted number
    matched = np.zeros(len(names), bool)  # whether it has one
    groups: dict[bytes, list[int]] = {}
    get = groups.get
    for start in range(0, len(names), _GROUP_CHUNK):
        made = _number_keys(names[start : start + _GROUP_CHUNK])
        if made is None:
            return None
        keys, named, value = made
        values[named + start] = value
        matched[named + start] = True
        for i, key in enumerate(keys, start):
            got = get(key)
            if got is None:
                groups[key] = [i]
            else:
                got.append(i)
    out: list[tuple[str, list[_T]]] = []
    for key, members in groups.items():
        if len(members) == 1:
            out.append((names[members[0]], [items[members[0]]]))
            continue
        idx = np.array(members)
        which = matched[idx]
        if not which.any():  # names without a dotted number are their key
            out.extend((names[i], [items[i]]) for i in members)
            continue
        # _ranges of the numbers: runs of consecutive ones, found by numpy
        vs = np.unique(values[idx[which]])
        cut = np.flatnonzero(np.diff(vs) != 1)
        firsts, lasts = vs[np.r_[0, cut + 1]].tolist(), vs[np.r_[cut, len(vs) - 1]].tolist()
        ranges = ",".join(str(a) if a == z else f"{a}..{z}" for a, z in zip(firsts, lasts))
        pattern = key.decode("ascii").replace("#", "{" + ranges + "}", 1)
        out.append((pattern, list(map(items.__getitem__, members))))
    return out


_GROUP_CHUNK = 16384
"""Names :func:`_number_keys` takes at a time (100k at once: 50 MiB of scratch arrays)."""


def _number_keys(names: Sequence[str]) -> tuple[list[bytes], Any, Any] | None:
    """Each name's group key (its first dotted number made ``#``, as ``_NUM.sub("#", name, count=1)``),
    which names have such a number and its value; None when the names are not all ASCII without
    a newline, or a number has over 18 digits.

    A digit run is a dotted number (as :data:`_NUM` matches) when a dot comes before it and a
    dot or the name's end after it: ASCII digits are all ``\\d`` matches there, and a match
    can neither start nor stop inside a run."""
    import numpy as np

    text = "\n".join(names)
    if not text.isascii() or text.count("\n") != len(names) - 1:
        return None
    b = np.frombuffer(text.encode("ascii"), np.uint8)
    del text
    padded = np.r_[np.uint8(0), b, np.uint8(0x0A)]  # the end is a name's end
    digit = (padded >= 0x30) & (padded <= 0x39)
    edges = np.flatnonzero(digit[1:] != digit[:-1])  # in b: run starts and stops, alternating
    del digit
    starts, stops = edges[0::2], edges[1::2]
    after = padded[stops + 1]
    dotted = np.flatnonzero((padded[starts] == 0x2E) & ((after == 0x2E) | (after == 0x0A)))
    del padded
    owner = np.searchsorted(np.flatnonzero(b == 0x0A), starts[dotted])  # the name of each
    named, first = np.unique(owner, return_index=True)  # each name's first dotted number
    lo, hi = starts[dotted[first]], stops[dotted[first]]
    widths = hi - lo
    if len(widths) and widths.max() > 18:  # beyond int64
        return None
    value = np.zeros(len(lo), np.int64)
    for k in range(int(widths.max(initial=0))):
        more = k < widths
        value[more] = value[more] * 10 + (b[lo[more] + k] - 0x30)
    # the keys: each number's first digit made "#", the others dropped
    keys = b.copy()
    keys[lo] = 0x23
    dropped = widths - 1
    if dropped.any():
        keep = np.ones(len(b), bool)
        ends = np.cumsum(dropped)
        at = np.arange(int(ends[-1])) - np.repeat(ends - dropped, dropped) + np.repeat(lo + 1, dropped)
        keep[at] = False
        keys = keys[keep]
    return keys.tobytes().split(b"\n"), named, value


def _ranges(values: Sequence[int]) -> str:
    vs = sorted(set(values))
    parts = []
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        parts.append(str(vs[i]) if i == j else f"{vs[i]}..{vs[j]}")
        i = j + 1
    return ",".join(parts)


def _local_text(t: dict[str, Any]) -> str:
    ls = t["local_shapes"]
    if t["uniform"]:
        return f"{ls[0]} x{len(ls)}" if len(ls) > 1 else str(ls[0])
    shown = ", ".join(str(s) for s in ls[:8])
    return shown + (" ..." if len(ls) > 8 else "")


def _chunks_text(t: dict[str, Any], group: bool) -> str:
    cs = t["chunks"]
    some = cs[:4] if group else cs
    text = "; ".join(f"{c['box']} {c['file']}" for c in some)
    return text + (f"; ... ({len(cs)} chunks)" if len(some) < len(cs) else "")


_NAME, _BYTES = itemgetter("name"), itemgetter("bytes")
_SIGNATURE = itemgetter("dtype", "shape", "placements", "local_shapes")


def _one_geometry(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether ``rows`` have equal dtypes, shapes, placements and local shapes, compared without
    making their texts: the rows of one geometry share these lists (:func:`_tensor_rows`), equal
    by identity at once. The lists hold ints and strings: equal lists show equal texts."""
    first = _SIGNATURE(rows[0])
    return all(map(eq, map(_SIGNATURE, rows), repeat(first)))


PLAIN_ROWS = 2000
"""Tables of more rows than this are printed as aligned plain text, not through rich's table:
rich lays out every cell of every row first (``inspect --all`` of 100k tensors: ~45 s)."""

_PLAIN_WIDTH = 64
"""Columns are padded to their widest cell up to this many characters (a longer cell is
written whole, moving the rest of its row)."""


def _plain_table(console: Any, headers: list[str], cells: Sequence[Sequence[str]]) -> None:
    """``cells`` (already :func:`shown`: no terminal codes) as aligned text lines under
    ``headers``, written to the console's file in one go."""
    widths = [min(_PLAIN_WIDTH, max(len(h), *(len(r[i]) for r in cells))) for i, h in enumerate(headers)]
    last = len(headers) - 1

    def line(row: Sequence[str]) -> str:
        return "  ".join(c if i == last else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(map(line, cells))
    console.file.write("\n".join(out) + "\n")


def render_inspect(doc: dict[str, Any], console: Any, *, group: bool = True) -> None:
    """Human table of an inspect report."""
    from rich.table import Table
    from rich.text import Text

    mesh = doc["mesh"]
    mesh_text = ",".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"])) if mesh else "-"
    console.print(
        f"[bold]{markup_safe(doc['path'])}[/]  format={doc['format']}  mesh={markup_safe(mesh_text)}  "
        f"files={len(doc['files'])} ({human(doc['file_bytes'])})",
        soft_wrap=True,
    )
    tf = doc.get("transforms")
    if isinstance(tf, dict):  # written by a conversion that applied transforms
        how = " --inverse" if tf.get("inverse") else ""
        console.print(f"transforms: {markup_safe(str(tf.get('origin')))}{how}", soft_wrap=True)
    table = Table(show_edge=False, pad_edge=False)
    for col in ("tensor", "count", "dtype", "shape", "placements", "local shape(s)", "bytes"):
        table.add_column(col, overflow="fold")
    tensors = doc["tensors"]
    if group:
        rows: list[tuple[str, list[dict[str, Any]]]] = []
        texts: dict[int, str] = {}  # by identity: rows of one geometry share these lists (100k rows)

        def text_of(x: object) -> str:
            got = texts.get(id(x))
            if got is None:
                got = texts[id(x)] = str(x)
            return got

        tensors = list(tensors)
        for pattern, ts in _grouped(list(map(_NAME, tensors)), tensors):
            if _one_geometry(ts):
                rows.append((pattern, ts))
                continue
            sig = {
                (t["dtype"], text_of(t["shape"]), text_of(t["placements"]), text_of(t["local_shapes"]))
                for t in ts
            }
            if len(sig) == 1:
                rows.append((pattern, ts))
            else:
                rows.extend((t["name"], [t]) for t in ts)
    else:
        rows = [(t["name"], [t]) for t in doc["tensors"]]
    cells: list[tuple[str, ...]] = [
        (
            shown(label),
            str(len(ts)) if len(ts) > 1 else "",
            t["dtype"],
            str(t["shape"]),
            shown(", ".join(t["placements"])) if t["placements"] else f"{t['pieces']} piece(s)",
            shown(_chunks_text(t, group)) if "chunks" in t else _local_text(t),
            human(sum(map(_BYTES, ts))),
        )
        for label, ts in rows
        for t in (ts[0],)
    ]
    if len(cells) > PLAIN_ROWS:
        _plain_table(console, [str(c.header) for c in table.columns], cells)
    else:
        for row in cells:
            table.add_row(*map(Text, row))
        console.print(table)
    tot = doc["totals"]
    console.print(f"{tot['tensors']} tensors, {tot['params']:,} elements, {human(tot['bytes'])}")
    if doc.get("note"):
        console.print(Text(shown(doc["note"])), soft_wrap=True)
    for n in doc.get("non_tensors", ()):
        where = f" in {n['file']}" if n["file"] else ""
        how = "copied as it is by --to dcp only" if n.get("copied_by_dcp") else "not converted"
        text = f"not a tensor ({how}): {n['name']} ({n['kind'] or 'item'}, {human(n['size'])}{where})"
        console.print(Text(shown(text)), soft_wrap=True)
    for w in doc["warnings"]:
        console.print(Text("warning: " + shown(w)), soft_wrap=True)


def _relative_spans(src: Any, copies: Any) -> list[tuple[int, int, int]]:
    """Per box of the copies: its piece and the byte span it reads, relative to the piece."""
    isz = DTYPE_SIZES[src.dtype]
    out = []
    for c in copies:
        strides = piece_strides(src, c.piece)
        if strides is None:
            continue  # zeros (transform padding): nothing read
        for s_st, _d, sz in copy_boxes(c):
            first, stop = box_span(strides, s_st, sz)
            out.append((c.piece, first * isz, stop * isz))
    return out


class _Geometry:
    """The tensors of one output tensor list sharing a geometry (``copies``, source blocks, dtype):
    their source piece offsets and files as arrays, so per output file their reads are array sums.

    Piece ``k`` of the group's tensor ``i`` is at ``values[i, picks[k]]`` (:func:`offset_columns`:
    64 rank files give a few columns, not 64) of file ``row[k]`` when every tensor's pieces lie in
    the same files (a reader's tuple per geometry), else of file ``files[i, k]``."""

    __slots__ = ("first", "values", "picks", "row", "files", "sources")

    def __init__(self, first: Any) -> None:
        self.first = first  # a TargetTensor of the group: its copies and blocks are everyone's
        self.sources: list[Any] = []  # the members' sources
        self.values: Any = None
        self.picks: Sequence[int] = ()
        self.row: tuple[int, ...] | None = None
        self.files: Any = None

    def arrays(self) -> None:
        import numpy as np  # lazy: only plan reports count reads

        srcs = self.sources
        k = len(srcs[0].piece_blocks)  # the group's sources share their blocks: as many offsets each
        self.values, self.picks = offset_columns(list(map(attrgetter("piece_offsets"), srcs)), k)
        files = srcs[0].piece_files
        if all(s.piece_files is files for s in srcs):
            self.row = files
        else:
            self.files = np.array([s.piece_files for s in srcs], dtype=np.int64)
        self.sources = []

    def offsets(self, k: int) -> Any:
        """Piece ``k``'s offsets, one per tensor (a view)."""
        return self.values[:, self.picks[k]]


def _geometries(tensors: Sequence[Any]) -> list[_Geometry]:
    """Group ``tensors`` by geometry: tensors of one geometry share their copies objects (the plan's
    matching cache), their source blocks (the reader's) and their dtype."""
    groups: dict[tuple[int, int, str], _Geometry] = {}
    for t in tensors:
        src = t.src
        key = (id(t.copies), id(src.piece_blocks), src.dtype)
        g = groups.get(key)
        if g is None:
            g = groups[key] = _Geometry(t)
        g.sources.append(src)
    out = list(groups.values())
    for g in out:
        g.arrays()
    return out


def _file_reads(
    geos: Sequence[_Geometry], rank: int, spooled: Mapping[int, Spooled]
) -> tuple[dict[int, int], dict[int, list[list[int]]], dict[int, int], int]:
    """For the output file of target rank ``rank`` holding the tensors of ``geos``: bytes read
    per source file index (as :meth:`Plan.file_reads` counts them, with zero parts under file -1),
    the first coalesced byte spans read per source file, their count, and the number of copies.

    A geometry whose pieces lie in the same files for every tensor adds its reads to its files'
    sums and its spans to its file's list as they come; the spans of one file are made into
    arrays and merged one file at a time (a 64-rank source consolidated: 3M spans, 50 MB at once).

    A piece in a reader's spool (``spooled``: a transposed or compressed DCP chunk, a strided
    ``torch.save`` tensor) is counted under the checkpoint file it was made from, its spans
    shown as the bytes of that file it was made from (read whole when the copy first reads it)."""
    import numpy as np

    sums: dict[int, int] = {}
    read_files: list[Any] = []  # geometries whose files vary per tensor: columns to sum
    read_bytes: list[Any] = []
    read_offsets: list[Any] = []  # with spooled pieces: the offsets of read_files' pieces
    per_file: dict[int, list[tuple[_Geometry, int, int, int]]] = {}  # file -> (geometry, piece, lo, hi)
    mixed: list[tuple[_Geometry, int, int, int]] = []
    copies_n = 0
    for g in geos:
        t = g.first
        src = t.src
        copies = t.copies[rank]
        n = len(g.values)
        copies_n += n * len(copies)
        isz = DTYPE_SIZES[src.dtype]
        row = g.row
        for c in copies:
            if row is not None and row[c.piece] not in spooled:
                fi = row[c.piece]
                sums[fi] = sums.get(fi, 0) + n * c.numel * isz
            else:
                read_files.append(g.files[:, c.piece] if row is None else np.full(n, row[c.piece]))
                read_bytes.append(np.full(n, c.numel * isz, dtype=np.int64))
                if spooled:
                    read_offsets.append(g.offsets(c.piece))
        for k, lo, hi in _relative_spans(src, copies):
            if row is not None:
                per_file.setdefault(row[k], []).append((g, k, lo, hi))
            else:
                mixed.append((g, k, lo, hi))
    if read_files:
        fis = np.concatenate(read_files)
        if spooled:
            fis = _own_files(fis, np.concatenate(read_offsets), spooled)
        for fi, total in _sums(fis, np.concatenate(read_bytes)).items():
            sums[fi] = sums.get(fi, 0) + total
    reads = dict(sorted(sums.items()))
    if mixed:  # the rare geometries of per-tensor files: each file's spans picked out of theirs
        files = np.concatenate([g.files[:, k] for g, k, _, _ in mixed])
        for fi in np.unique(files).tolist():
            per_file.setdefault(fi, [])

    def spans(fi: int) -> tuple[list[Any], list[Any]]:
        return _spans(per_file.get(fi, ()), mixed, fi)

    made = _spooled_spans({sfi: sp for sfi, sp in spooled.items() if sfi in per_file}, spans)
    ranges: dict[int, list[list[int]]] = {}
    totals: dict[int, int] = {}
    for fi in sorted((set(per_file) - set(spooled)) | set(made)):
        starts, stops = spans(fi)
        if fi in made:
            starts += made[fi][0]
            stops += made[fi][1]
        ranges[fi], totals[fi] = _merged(np.concatenate(starts), np.concatenate(stops))
    return reads, ranges, totals, copies_n


_Span = tuple[_Geometry, int, int, int]  # (geometry, piece, lo, hi): a span relative to the piece


def _spans(own: Sequence[_Span], mixed: Sequence[_Span], fi: int) -> tuple[list[Any], list[Any]]:
    """Starts and stops (arrays) of the spans read from file ``fi``: ``own`` (all its tensors'
    pieces there) and those of ``mixed`` (tensors whose files vary) whose piece lies there."""
    starts, stops = [], []
    for g, k, lo, hi in own:
        col = g.offsets(k)
        starts.append(col + lo)
        stops.append(col + hi)
    for g, k, lo, hi in mixed:
        col = g.offsets(k)[g.files[:, k] == fi]
        starts.append(col + lo)
        stops.append(col + hi)
    return starts, stops


def _spooled_spans(
    spooled: Mapping[int, Spooled], spans: Callable[[int], tuple[list[Any], list[Any]]]
) -> dict[int, tuple[list[Any], list[Any]]]:
    """Per checkpoint file: the byte spans the pieces read from the spools (``spans`` of a spool's
    file index) were made from (a piece's whole stored or compressed bytes)."""
    import numpy as np

    made: dict[int, tuple[list[Any], list[Any]]] = {}
    for sfi, sp in spooled.items():
        a = np.concatenate(spans(sfi)[0])
        at = np.searchsorted(np.asarray(sp.starts, dtype=np.int64), a, side="right") - 1
        ofs = np.asarray(sp.files, dtype=np.int64)[at]
        los = np.asarray(sp.origin_starts, dtype=np.int64)[at]
        his = np.asarray(sp.origin_stops, dtype=np.int64)[at]
        for fi in np.unique(ofs).tolist():
            m = ofs == fi
            got = made.setdefault(fi, ([], []))
            got[0].append(los[m])
            got[1].append(his[m])
    return made


def _own_files(files: Any, offsets: Any, spooled: Mapping[int, Spooled]) -> Any:
    """``files`` with each spooled piece's file replaced by the checkpoint file it was made from."""
    import numpy as np

    files = files.copy()
    for sfi, sp in spooled.items():
        m = files == sfi
        if m.any():
            at = np.searchsorted(np.asarray(sp.starts, dtype=np.int64), offsets[m], side="right") - 1
            files[m] = np.asarray(sp.files, dtype=np.int64)[at]
    return files


def _sums(keys: Any, values: Any) -> dict[int, int]:
    """``values`` summed per key (exact int64 sums), keys in increasing order."""
    import numpy as np

    if not len(keys):
        return {}
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    firsts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return dict(zip(keys[firsts].tolist(), np.add.reduceat(values, firsts).tolist()))


def _merged(a: Any, b: Any) -> tuple[list[list[int]], int]:
    """Spans ``[a, b)`` coalesced (touching spans merge): the first :data:`_MAX_RANGES` and the count."""
    import numpy as np

    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    # a run starts where a span begins past everything before it
    new = np.flatnonzero(np.r_[True, a[1:] > reach[:-1]])
    ends = np.r_[new[1:] - 1, len(a) - 1]
    first = np.stack([a[new[:_MAX_RANGES]], reach[ends[:_MAX_RANGES]]], axis=1)
    return first.tolist(), len(new)


def plan_report(plan: Plan, budget: Budget) -> dict[str, Any]:
    """What convert would do: per output file, what it reads and writes, and the peak memory."""
    files = []
    total_read = 0
    total_copies = 0
    geos: dict[int, tuple[Sequence[Any], list[_Geometry]]] = {}
    for f in plan.files:
        hit = geos.get(id(f.tensors))  # sibling rank files share their tensor list
        if hit is None or hit[0] is not f.tensors:
            hit = geos[id(f.tensors)] = (f.tensors, _geometries(f.tensors))
        reads, ranges, counts, copies = _file_reads(hit[1], f.local_rank, plan.source.spooled)
        read = sum(reads.values())
        total_read += read
        total_copies += copies
        files.append(
            {
                "name": f.name,
                "rank": f.rank,
                "bytes_written": f.size,
                "bytes_read": read,
                "copies": copies,
                "read_amplification": round(read / f.size, 4) if f.size else 0.0,
                "sources": [
                    {
                        "file": os.path.basename(plan.source.files[fi]),
                        "bytes": reads.get(fi, 0),
                        "ranges": ranges[fi],
                        "ranges_total": counts[fi],
                    }
                    for fi in sorted(ranges)
                ],
            }
        )
    written = plan.bytes_written
    return {
        "source": {
            "path": plan.source.path,
            "format": plan.source.format,
            "mesh": plan.source.mesh.to_json() if plan.source.mesh else None,
        },
        "target": {"format": plan.format, "mesh": plan.mesh.to_json(), "files": len(plan.files)},
        "tensors": len(plan.tensors),
        "files": files,
        "totals": {
            "bytes_read": total_read,
            "bytes_written": written,
            "copies": total_copies,
            "read_amplification": round(total_read / written, 4) if written else 0.0,
        },
        "workers": budget.workers,
        "buffer_size": budget.buffer,
        "peak_memory_estimate": memory_estimate(plan, budget),
        **_transforms_report(plan),
        "warnings": [str(w) for w in plan.source.warnings],
    }


def _transforms_report(plan: Plan) -> dict[str, Any]:
    """With transforms: what was applied, and per target tensor the source regions feeding it."""
    if plan.transforms is None:
        return {}
    sources = plan.source.tensors
    feeds_ = {n: feeds(tt, sources) for n, tt in (plan.transformed or {}).items()}
    return {"transforms": {**plan.transforms, "feeds": feeds_}}


def _render_feeds(doc: dict[str, Any], console: Any, most: int = 40) -> None:
    tf = doc.get("transforms")
    if tf is None:
        return
    feeds = tf["feeds"]
    how = " (inverted)" if tf["inverse"] else ""
    console.print(
        f"transforms: {markup_safe(tf['origin'])}{how}; target tensor <- source tensor [region] bytes"
    )
    for i, (name, parts) in enumerate(feeds.items()):
        if i == most:
            console.print(f"  ... {len(feeds) - most} more target tensors (--json lists them all)")
            break
        for j, f in enumerate(parts):
            head = shown(name) if j == 0 else " " * min(len(shown(name)), 8) + "+"
            console.print(f"  {markup_safe(head)} <- {markup_safe(feed_text(f))}", soft_wrap=True)


def feed_text(f: dict[str, Any]) -> str:
    """One part of :func:`~reshard.transform_plan.feeds` as ``plan`` prints it (plain text)."""
    if f["source"] is None:
        return f"zeros ({human(f['zeros'])})"
    region = ",".join(f"{a}:{b}" for a, b in f["region"])
    span = f["byte_range"]
    return f"{shown(f['source'])} [{region}] bytes {span[0]}..{span[1]} ({human(f['bytes'])})"


#: Output files ``plan`` shows a row each (the first ones and the last); ``--json`` lists every one.
PLAN_ROWS = 64


def render_plan(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    t = doc["target"]
    mesh = ",".join(f"{n}={s}" for n, s in zip(t["mesh"]["names"], t["mesh"]["shape"]))
    console.print(
        f"[bold]plan[/]: {markup_safe(doc['source']['path'])} ({doc['source']['format']}) -> "
        f"{t['format']} mesh={markup_safe(mesh)}, "
        f"{doc['tensors']} tensors"
    )
    table = Table(show_edge=False, pad_edge=False)
    for col in ("output file", "writes", "reads", "from", "copies", "read/write"):
        table.add_column(col)
    files = doc["files"]
    shown_files = files if len(files) <= PLAN_ROWS else [*files[: PLAN_ROWS - 1], None, files[-1]]
    for f in shown_files:
        if f is None:  # thousands of rank files: rendering every row took most of plan's time
            table.add_row(
                f"... {len(files) - PLAN_ROWS} more files (--json lists them all)", "", "", "", "", ""
            )
            continue
        srcs = ", ".join(s["file"] for s in f["sources"][:3]) + (" ..." if len(f["sources"]) > 3 else "")
        table.add_row(
            Text(shown(f["name"])),
            human(f["bytes_written"]),
            human(f["bytes_read"]),
            Text(shown(srcs)),
            str(f["copies"]),
            f"{f['read_amplification']:.2f}",
        )
    console.print(table)
    tot = doc["totals"]
    console.print(
        f"total: read {human(tot['bytes_read'])}, write {human(tot['bytes_written'])}, "
        f"{tot['copies']} copies, read amplification {tot['read_amplification']:.2f}, "
        f"peak memory ~{human(doc['peak_memory_estimate'])} ({doc['workers']} worker(s))"
    )
    _render_feeds(doc, console)
