"""Windows.gather_entries and Windows.gather (convert's and verify's short reads) against a
byte-by-byte reference: every layout of pieces, any window size, by pread only."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from reshard.checkpoint import TensorSource
from reshard.errors import SourceChangedError
from reshard.formats import open_checkpoint
from reshard.intervals import Interval
from reshard.io.pages import SourceFiles
from reshard.io.reader import Spans, Windows
from reshard.verify import verify_checkpoints

SIZE = 6000  # bytes of each source file


def _files(tmp: Path, count: int) -> list[str]:
    rng = np.random.default_rng(7)
    paths = []
    for i in range(count):
        p = tmp / f"f{i}.bin"
        if not p.exists():
            p.write_bytes(rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes())
        paths.append(str(p))
    return paths


def _tensor(files: tuple[int, ...], offsets: tuple[int, ...]) -> TensorSource:
    block = ((Interval(0, 1),),)
    return TensorSource("t", "U8", (1,), files, offsets, block * len(files), ("t",))


@st.composite
def _layouts(draw: Any) -> dict[str, Any]:
    """Entries of one geometry: one or two runs (two source files, like TP-4 -> HF), rows or not,
    their pieces evenly spaced, alternating with other tensors (the spacing broken once or not),
    or anywhere; placed evenly or in any order in the buffer."""
    n = draw(st.integers(1, 40))
    rows = draw(st.sampled_from([1, 1, 2, 5]))
    ss = n + draw(st.integers(0, 9)) if rows > 1 else 0
    ds = n + draw(st.integers(0, 3)) if rows > 1 else 0
    span = (rows - 1) * ss + n
    rext = (rows - 1) * ds + n  # a run's extent in the entry
    nruns = draw(st.integers(1, 2))
    runs = tuple((r * rext, r, draw(st.integers(0, 5)), n, rows, ss, ds) for r in range(nruns))
    ext = nruns * rext
    count = draw(st.integers(1, 80))
    order = draw(st.sampled_from(["even", "alternate", "any"]))
    files = [draw(st.integers(0, 2)) for _ in range(nruns)]
    room = SIZE - span - 5
    if order == "any":
        offsets = [[draw(st.integers(0, room)) for _ in range(nruns)] for _ in range(count)]
        files_of = [[draw(st.integers(0, 2)) for _ in range(nruns)] for _ in range(count)]
    else:
        step = draw(st.integers(-span - 40, span + 40))
        gap = draw(st.integers(span, span + 30)) if order == "alternate" else 0
        k = count if order == "even" else (count + 1) // 2
        least = max(0, -step * (k - 1))
        base = draw(st.integers(least, max(least, room - gap - max(0, step * (k - 1)))))
        at = [base + (i if order == "even" else i // 2) * step + (i % 2) * gap for i in range(count)]
        if draw(st.booleans()):  # from one entry on, further on (a layer's norms between its experts)
            cut, shift = draw(st.integers(0, count)), draw(st.integers(1, 30))
            at = [a + (shift if i >= cut else 0) for i, a in enumerate(at)]
        offsets = [[a] * nruns for a in at]
        files_of = [files] * count
        # a long step may not fit the file (base's range clamps at 0): such layouts read past the end
        assume(all(0 <= a <= room for a in at))
    slots = list(range(count))
    if draw(st.booleans()):
        slots = draw(st.permutations(slots))
    pstep = ext + draw(st.integers(0, 7))
    return {
        "runs": runs,
        "at": [3 + s * pstep for s in slots],
        "srcs": [(tuple(f), tuple(o)) for f, o in zip(files_of, offsets)],
        "size": 3 + count * pstep + 5,
    }


def _expected(data: list[bytes], lay: dict[str, Any]) -> bytearray:
    out = bytearray(lay["size"])
    for at, (files, offsets) in zip(lay["at"], lay["srcs"]):
        for d, k, s, n, rows, ss, ds in lay["runs"]:
            for r in range(rows):
                lo = offsets[k] + s + r * ss
                out[at + d + r * ds : at + d + r * ds + n] = data[files[k]][lo : lo + n]
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lay=_layouts(), window=st.sampled_from([0, 16, 64, 256, 4096]), slots=st.sampled_from([1, 2, 13]))
@example(
    lay={
        "runs": ((0, 0, 0, 8, 1, 0, 0),),
        "at": [0, 8, 16],
        "srcs": [((0,), (o,)) for o in (0, 8, 16)],
        "size": 24,
    },
    window=16,
    slots=2,
)  # back to back on both sides: one read
def test_gather_entries_equal_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lay: dict[str, Any], window: int, slots: int
) -> None:
    def gather(sources: SourceFiles, buf: bytearray) -> None:
        srcs = [_tensor(f, o) for f, o in lay["srcs"]]
        Windows(sources, window, slots).gather_entries(lay["runs"], lay["at"], srcs, buf)

    _check_gather(tmp_path, monkeypatch, lay, gather)


def _check_gather(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lay: dict[str, Any],
    gather: Callable[[SourceFiles, bytearray], None],
) -> None:
    """``gather(sources, buf)`` fills ``buf`` as the byte-by-byte reference does, by pread only,
    showing every read to the ``seen`` hook."""
    paths = _files(tmp_path, 3)
    data = [Path(p).read_bytes() for p in paths]
    seen: list[tuple[int, int, int]] = []
    sources = SourceFiles(paths, seen=lambda fi, off, buf: seen.append((fi, off, len(buf))))
    monkeypatch.setattr(SourceFiles, "map", lambda *a: pytest.fail("a source read through a map"))
    try:
        buf = bytearray(lay["size"])
        gather(sources, buf)
    finally:
        sources.close()
    assert buf == _expected(data, lay)
    assert seen and all(0 <= off and off + n <= SIZE and n > 0 for _, off, n in seen)  # shown every read


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lay=_layouts(),
    span=st.sampled_from([0, 16, 64, 256, 4096]),
    slots=st.sampled_from([1, 2, 8]),
    shared=st.booleans(),
)
def test_spans_gather_equals_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lay: dict[str, Any], span: int, slots: int, shared: bool
) -> None:
    """The column path's copy (one call per run and source file, pieces in file order) moves
    the same bytes as the reference, whatever the windows."""

    def gather(sources: SourceFiles, buf: bytearray) -> None:
        w = Spans(sources, span, slots)
        # whole windows of every file (siblings read them too) or only the bytes wanted
        w.shared = frozenset(range(8)) if shared else frozenset()
        at = np.array(lay["at"], dtype=np.int64)
        jobs = []
        for d, k, s, n, rows, ss, ds in lay["runs"]:
            files = np.array([f[k] for f, _ in lay["srcs"]])
            lo = np.array([o[k] for _, o in lay["srcs"]], dtype=np.int64) + s
            for fi in np.unique(files).tolist():
                sel = files == fi
                jobs.append((fi, lo[sel], at[sel] + d, n, rows, ss, ds))
        w.gather(jobs, buf)

    _check_gather(tmp_path, monkeypatch, lay, gather)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spans=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 2000), st.integers(0, 60), st.integers(1, 4)),
        min_size=1,
        max_size=30,
    ),
    window=st.sampled_from([0, 32, 4096]),
)
def test_gather_spans_equal_the_reference(tmp_path: Path, spans: list[tuple[int, ...]], window: int) -> None:
    """Single spans (runs of entries larger than the buffer): rows, neighbours joined."""
    paths = _files(tmp_path, 2)
    data = [Path(p).read_bytes() for p in paths]
    flat: list[int] = []
    out = bytearray(4000)
    want = bytearray(4000)
    pos = 1
    for fi, lo, n, rows in spans:
        ss = n + 3
        flat += (fi, lo, n, rows, ss, pos, n)
        for r in range(rows):
            want[pos + r * n : pos + (r + 1) * n] = data[fi][lo + r * ss : lo + r * ss + n]
        pos += rows * n
    sources = SourceFiles(paths)
    try:
        Windows(sources, window).gather(flat, out)
    finally:
        sources.close()
    assert out == want


def test_windows_are_shared_and_read_each_byte_once(tmp_path: Path) -> None:
    """Two walks over the same bytes (sibling files, other geometries) read each window once."""
    paths = _files(tmp_path, 1)
    reads: list[int] = []
    sources = SourceFiles(paths, seen=lambda fi, off, buf: reads.append(len(buf)))
    w = Windows(sources, 1024, 13)
    runs = ((0, 0, 0, 10, 1, 0, 0),)
    for first in (0, 10):  # two siblings: the even and the odd 10-byte pieces
        srcs = [_tensor((0,), (first + 20 * i,)) for i in range(250)]
        buf = bytearray(2500)
        w.gather_entries(runs, [10 * i for i in range(250)], srcs, buf)
        data = Path(paths[0]).read_bytes()
        assert buf == b"".join(data[first + 20 * i : first + 20 * i + 10] for i in range(250))
    sources.close()
    # five windows of 1 KiB on the grid, each read once by the two walks; a piece across a grid
    # line is read on its own (one per line here: 1020 and 2040, 3060 and 4080 bytes are 20 apart)
    assert sorted(reads) == [10] * 4 + [1024] * 5


def test_a_source_truncated_between_gathers_is_named(tmp_path: Path) -> None:
    paths = _files(tmp_path, 1)
    sources = SourceFiles(paths)
    w = Windows(sources, 256)
    runs = ((0, 0, 0, 8, 1, 0, 0),)
    w.gather_entries(runs, [0, 8], [_tensor((0,), (0,)), _tensor((0,), (16,))], bytearray(16))
    os.truncate(paths[0], 3000)
    with pytest.raises(SourceChangedError, match="f0.bin"):
        srcs = [_tensor((0,), (4000 + 16 * i,)) for i in range(20)]
        w.gather_entries(runs, [8 * i for i in range(20)], srcs, bytearray(160))
    sources.close()


def test_verify_finds_a_difference_in_a_word_shared_by_two_tensors(tmp_path: Path) -> None:
    """Batches are compared eight bytes at a time: a differing byte in the tail of a word that
    starts in another tensor is still reported for its own tensor."""
    full = {f"t{i:03d}": torch.arange(i, i + 3, dtype=torch.uint8) for i in range(40)}  # 3 bytes each
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(full, str(tmp_path / "a" / "model.safetensors"))
    bad = dict(full)
    bad["t006"] = torch.tensor([6, 7, 99], dtype=torch.uint8)  # byte 20 of the batch: word 2 starts in t005
    save_file(bad, str(tmp_path / "b" / "model.safetensors"))
    doc = verify_checkpoints(open_checkpoint(str(tmp_path / "a")), open_checkpoint(str(tmp_path / "b")))
    assert [(d["tensor"], d.get("index")) for d in doc["differences"]] == [("t006", [2])]
    assert doc["bytes_compared"] == 40 * 3


def test_spans_extend_a_held_window_instead_of_reading_it_again(tmp_path: Path) -> None:
    """Siblings in lockstep ask for spans from one first byte to their own rows, each longer than
    the last: the slot holding the last one is extended by the bytes after it (up to a span),
    so every byte is read once."""
    paths = _files(tmp_path, 2)
    data = Path(paths[0]).read_bytes()
    reads: list[tuple[int, int, int]] = []
    sources = SourceFiles(paths, seen=lambda fi, off, buf: reads.append((fi, off, len(buf))))
    try:
        w = Spans(sources, 1024, 2)
        for hi in (300, 600, 700, 1100):
            held, at = w.locate(0, 100, hi)
            assert bytes(held[at : at + hi - 100]) == data[100:hi]
        assert reads == [(0, 100, 200), (0, 300, 300), (0, 600, 100), (0, 700, 400)]
        held, at = w.locate(0, 500, 900)  # inside: a hit
        assert bytes(held[at : at + 400]) == data[500:900] and len(reads) == 4
        held, at = w.locate(0, 400, 1300)  # more than a span from the slot's start: read anew
        assert bytes(held[at : at + 900]) == data[400:1300] and reads[-1] == (0, 400, 900)
        held, at = w.locate(1, 0, 50)  # another file: its own slot
        assert bytes(held[at : at + 50]) == Path(paths[1]).read_bytes()[:50]
    finally:
        sources.close()


def test_a_few_pieces_far_apart_are_read_alone_or_taken_from_a_held_window(tmp_path: Path) -> None:
    """A layer's norms (a few small pieces, far apart) are not worth the windows between them:
    each is taken from a window already held, else read on its own."""
    paths = _files(tmp_path, 1)
    data = Path(paths[0]).read_bytes()
    reads: list[tuple[int, int]] = []
    sources = SourceFiles(paths, seen=lambda fi, off, buf: reads.append((off, len(buf))))
    try:
        w = Spans(sources, 1024, 2)
        w.shared = frozenset({0})
        dense = np.arange(0, 1000, 100, dtype=np.int64)  # ten pieces in the first window
        buf = bytearray(100)
        assert w.gather([(0, dense, np.arange(0, 100, 10, dtype=np.int64), 10, 1, 0, 0)], buf, check=True)
        assert buf == b"".join(data[o : o + 10] for o in range(0, 1000, 100))
        assert reads == [(0, 1024)]  # a whole window: the siblings want the bytes between
        far = np.array([150, 2000, 4500], dtype=np.int64)
        out = bytearray(30)
        assert w.gather([(0, far, np.array([20, 0, 10], dtype=np.int64), 10, 1, 0, 0)], out, check=True)
        assert out == data[2000:2010] + data[4500:4510] + data[150:160]
        assert reads == [(0, 1024), (2000, 10), (4500, 10)]  # 150: from the window held
    finally:
        sources.close()
