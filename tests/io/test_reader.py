"""read_box with a row cache (convert's reads): every box by pread, in bands when its rows do not fit."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from reshard.checkpoint import TensorSource
from reshard.errors import SourceChangedError
from reshard.intervals import Interval
from reshard.io.pages import PageWindow, SourceFiles
from reshard.io.reader import Piece, RowCache, read_box


def _source(tmp_path: Path, shape: tuple[int, ...], at: int = 24) -> tuple[np.ndarray, TensorSource, Path]:
    """A file holding a uint16 array of ``shape`` at byte ``at`` (odd bytes before it)."""
    arr = np.arange(int(np.prod(shape)), dtype=np.uint16).reshape(shape)
    p = tmp_path / "src.bin"
    p.write_bytes(b"\x07" * at + arr.tobytes())
    block = tuple((Interval(0, n),) for n in shape)
    src = TensorSource(
        name="t",
        dtype="U16",
        shape=shape,
        piece_files=(0,),
        piece_offsets=(at,),
        piece_blocks=(block,),
        signature=("t", shape),
    )
    return arr, src, p


@pytest.mark.parametrize("cache", [16, 64, 200, 1000, 1 << 16])
def test_boxes_read_by_pread_equal_the_array_whatever_the_cache(tmp_path: Path, cache: int) -> None:
    shape = (6, 5, 40)
    arr, src, p = _source(tmp_path, shape)
    files = SourceFiles([str(p)])
    seen: list[tuple[int, int]] = []
    files.seen = lambda fi, off, mv: seen.append((off, len(mv)))
    pages = PageWindow(files, 1 << 20)
    rows = RowCache(cache)
    rng = np.random.default_rng(cache)
    try:
        piece = Piece.of(files, src, 0)
        for _ in range(200):
            a = [int(rng.integers(0, n)) for n in shape]
            b = [int(rng.integers(x + 1, n + 1)) for x, n in zip(a, shape)]
            key = tuple(slice(x, y) for x, y in zip(a, b))
            got = read_box(pages, piece, key, rows)
            assert np.array_equal(got, arr[key]), key
        # every byte came through pread (shown to the hook), none from outside the array
        assert seen and all(24 <= off and off + n <= 24 + arr.nbytes for off, n in seen)
    finally:
        files.close()


def test_a_file_truncated_before_a_read_is_a_named_error(tmp_path: Path) -> None:
    arr, src, p = _source(tmp_path, (64, 64))
    files = SourceFiles([str(p)])
    try:
        piece = Piece.of(files, src, 0)
        os.truncate(p, 24 + arr.nbytes // 2)
        with pytest.raises(SourceChangedError, match="changed while it was being read") as e:
            read_box(PageWindow(files, 1 << 20), piece, (slice(40, 60), slice(0, 3)), RowCache(256))
        assert e.value.path == str(p)
    finally:
        files.close()
