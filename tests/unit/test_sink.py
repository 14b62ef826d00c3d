"""Sink gathers small pieces written back to back into few writes, with the same bytes, digests
and CRC32s as writing each piece on its own."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

from reshard.io.checksum import file_checksum, finish_checksum
from reshard.io.writer import Sink


def test_small_pieces_are_gathered_and_written_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    pieces: list[tuple[int, bytes]] = []
    off = 0
    for i in range(3000):  # zip-record-sized pieces, a few large ones (written at once), one gap
        n = rng.choice([30, 300, 1500]) if i % 100 else rng.choice([70_000, 200_000])
        if i == 1700:
            off += 123  # a gap: the gathered bytes before it are written first
        pieces.append((off, rng.randbytes(n)))
        off += n
    size = off
    writes = [0]
    real = os.pwrite

    def counting(fd: int, data: object, at: int) -> int:
        writes[0] += 1
        return real(fd, data, at)  # type: ignore[arg-type]

    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    monkeypatch.setattr(os, "pwrite", counting)
    sink = Sink(fd)
    crcs = []
    for at, data in pieces:
        sink.start_crc(8)
        sink.submit(data, at)
        crcs.append(sink.end_crc())
    digests = sink.close(size)
    monkeypatch.setattr(os, "pwrite", real)
    os.close(fd)
    expected = bytearray(size)
    for at, data in pieces:
        expected[at : at + len(data)] = data
    assert path.read_bytes() == expected
    assert writes[0] < len(pieces) // 4  # gathered: not a write per piece
    assert crcs == [(zlib.crc32(d), d[:8]) for _, d in pieces]  # CRC32s as each piece went by
    # the pieces hashed on the way (before the gap) give the file's checksum with the rest read back
    assert finish_checksum(path, size, digests) == file_checksum(path)


def test_a_piece_two_writers_share_is_read_back_from_where_the_first_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file written in parts: the piece straddling two writers' ranges is hashed by the first up
    to its end and only the rest is read back (it was read back whole: HF -> TP-8 of a 2 GB Llama,
    each of 8 files split between two workers, read 0.5 GB of its own output again)."""
    from reshard.io import checksum

    monkeypatch.setattr(checksum, "PIECE", 4096)
    rng = random.Random(3)
    data = rng.randbytes(5 * 4096 + 700)
    cut = 2 * 4096 + 1000  # the second writer's range starts inside piece 2
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, len(data))
    first, second = Sink(fd), Sink(fd, cut)
    for at in range(0, cut, 600):
        first.submit(data[at : min(cut, at + 600)], at)
    second.submit(data[cut:], cut)
    digests = {**first.close(len(data)), **second.close(len(data))}
    os.close(fd)
    assert sorted(digests) == [0, 1, 3, 4, 5] and sorted(first.partial) == [2]
    assert first.partial[2][1] == cut and second.partial == {}
    want = file_checksum(path)
    with open(path, "r+b") as f:  # the bytes the first writer hashed, changed: not read again
        f.seek(2 * 4096)
        f.write(bytes(cut - 2 * 4096))
    assert finish_checksum(path, len(data), digests, partial=first.partial) == want
    assert finish_checksum(path, len(data), digests) != want  # read back whole, it would differ
