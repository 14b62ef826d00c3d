"""ReadHashes: the hashes of spans read in any order, on any threads, equal the files' own."""

from __future__ import annotations

import os
import random
import threading
import zlib
from pathlib import Path

import pytest

from reshard.errors import SourceChangedError
from reshard.io import checksum
from reshard.io.checksum import file_checksum
from reshard.io.readhash import ReadHashes, Region, xxh3_regions


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    """64 KiB checksum pieces, so a test file of a few hundred KiB has several."""
    monkeypatch.setattr(checksum, "PIECE", 1 << 16)
    import reshard.io.readhash as rh

    monkeypatch.setattr(rh, "PIECE", 1 << 16)
    monkeypatch.setattr(rh, "_GAP", 4096)
    monkeypatch.setattr(rh, "_BLOCK", 4096)  # spans of 1 KiB and more are held in pool blocks
    return 1 << 16


def _spans(size: int, rng: random.Random, coverage: float) -> list[tuple[int, int]]:
    """Random spans (some overlapping, some repeated) covering about ``coverage`` of the file."""
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(40))})
    spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if rng.random() < coverage]
    spans += [(a, min(size, a + rng.randrange(1, 9000))) for a in (rng.randrange(size) for _ in range(5))]
    rng.shuffle(spans)
    return spans


def _feed(h: ReadHashes, data: bytes, spans: list[tuple[int, int]], threads: int) -> None:
    def run(part: list[tuple[int, int]]) -> None:
        for a, b in part:
            h.feed(0, a, memoryview(data)[a:b])

    ts = [threading.Thread(target=run, args=(spans[k::threads],)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


@pytest.mark.parametrize("seed", range(12))
def test_any_read_order_gives_the_file_checksum(tmp_path: Path, small_pieces: int, seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 5 * small_pieces))
    p = tmp_path / "f"
    p.write_bytes(data)
    want = file_checksum(p)
    hold = rng.choice([0, 8192, 1 << 20])  # nothing held, a little, everything
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), want)}, hold)
    _feed(h, data, _spans(len(data), rng, rng.choice([0.3, 1.0])), rng.choice([1, 3]))
    assert h.problems() == []
    assert h._held == 0  # every held span given back
    assert len(h._blocks) <= hold // 4096  # pool blocks reused, never more than the budget holds

    # one flipped byte: the file is named
    i = rng.randrange(len(data))
    p.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), want)}, hold)
    _feed(h, p.read_bytes(), _spans(len(data), rng, 1.0), 2)
    (bad,) = h.problems()
    assert bad.path == str(p) and "does not match" in bad.message


def test_full_coverage_in_order_reads_nothing_back(tmp_path: Path, small_pieces: int) -> None:
    data = os.urandom(3 * small_pieces + 100)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 0)
    for a in range(0, len(data), 5000):
        h.feed(0, a, memoryview(data)[a : a + 5000])
    assert h.problems() == [] and h.read_back == 0


def test_a_second_reader_ahead_in_a_small_file_is_held_not_joined(tmp_path: Path) -> None:
    """Two workers consolidating a 6 MiB file: a span read before the one just behind it, or
    1.5 MiB ahead of the bytes hashed so far, is held, not joined by reading the bytes between
    again (with a fixed 2 MiB join distance, how much was read twice depended on which thread
    got there first). Only the header, which the copy never reads, is read back."""
    header, step = 1000, 256 << 10
    data = os.urandom(header + 24 * step)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 64 << 20, {0: header})
    order = list(range(header, len(data), step))
    for a in [order[6], order[1], order[0], *order[2:6], *order[7:]]:
        h.feed(0, a, memoryview(data)[a : a + step])
    assert h.read_back == header and h._held == 0  # finished during the copy, nothing held
    assert h.problems() == [] and h.read_back == header


def test_a_header_the_copy_never_reads_is_read_at_once(tmp_path: Path, small_pieces: int) -> None:
    """The first span after a long header (a 100k-tensor file's) is joined to the region's
    start straight away, not held with every span after it while the cursor waits at 0."""
    header = small_pieces // 3
    data = os.urandom(2 * small_pieces)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 1 << 20, {0: header})
    for a in range(header, len(data), 5000):
        h.feed(0, a, memoryview(data)[a : a + 5000])
        assert h._held == 0
    assert h.read_back == header and h.problems() == [] and h.read_back == header


@pytest.mark.parametrize("seed", range(6))
def test_piece_crc32s_named_by_tensor(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(200_000))
    p = tmp_path / "f"
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    regions = [
        Region(a, b, zlib.crc32(data[a:b]), f'tensor "t{k}" piece [0:{b - a}]', f"t{k}")
        for k, (a, b) in enumerate(zip(cuts[::2], cuts[1::2]))
    ]
    bad = regions[rng.randrange(len(regions))]
    data[rng.randrange(bad.start, bad.stop)] ^= 0x40
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), regions, None)}, rng.choice([0, 1 << 20]))
    _feed(h, bytes(data), _spans(len(data), rng, 0.7), 2)
    (got,) = h.problems()
    assert got.tensor == bad.tensor and bad.what in got.message and "CRC32" in got.message


def test_a_file_shorter_than_its_record_is_a_named_error(tmp_path: Path, small_pieces: int) -> None:
    data = os.urandom(2 * small_pieces)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 0)
    os.truncate(p, small_pieces)
    with pytest.raises(SourceChangedError, match="ended early") as e:
        h.problems()
    assert e.value.path == str(p)


def test_held_spans_in_pool_blocks_hash_as_read(tmp_path: Path, small_pieces: int) -> None:
    """Spans far ahead of the cursor, longer than a block, are held in reused blocks (split
    across several) and hashed in order when the cursor gets there: nothing is read back."""
    data = os.urandom(2 * small_pieces)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 256 << 10)
    step = 10_000  # 2.4 blocks a span
    order = list(range(0, len(data), step))
    for a in order[1:] + order[:1]:  # the first span last: everything else is held until then
        h.feed(0, a, memoryview(data)[a : a + step])
    assert h.problems() == [] and h.read_back == 0
    assert h._held == 0 and 0 < len(h._blocks) <= 64


def test_spans_held_at_the_same_offset_twice(tmp_path: Path, small_pieces: int) -> None:
    """A span read twice ahead of the cursor (two workers reading the same rows), once whole
    in blocks and once short at one of its blocks' offsets, is held twice and ordered."""
    data = os.urandom(small_pieces)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 1 << 20)
    x = 20_000
    h.feed(0, x, memoryview(data)[x : x + 3 * 4096])  # three blocks: offsets x, x+4096, x+8192
    h.feed(0, x + 4096, memoryview(data)[x + 4096 : x + 4096 + 1000])  # short, at the second
    h.feed(0, x + 8192, memoryview(data)[x + 8192 : x + 8192 + 2000])  # in a block, at the third
    h.feed(0, 0, memoryview(data)[:x])
    h.feed(0, x + 3 * 4096, memoryview(data)[x + 3 * 4096 :])
    assert h.problems() == [] and h.read_back == 0 and h._held == 0


def test_a_span_held_while_the_cursor_span_is_hashed_is_taken_on(
    tmp_path: Path, small_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's span arriving while an in-order span is being hashed (outside the lock)
    is held, and the hashing thread takes it on when it is done: nothing read back."""
    import xxhash

    import reshard.io.readhash as rh

    data = os.urandom(small_pieces)
    p = tmp_path / "f"
    p.write_bytes(data)
    h = ReadHashes({0: (str(p), xxh3_regions(len(data)), file_checksum(p))}, 1 << 20)
    cut = 10_000
    calls: list[int] = []

    class Racing:
        """An xxh3 hasher whose first update lets 'another thread' feed the next span."""

        def __init__(self) -> None:
            self.h = xxhash.xxh3_128()

        def update(self, b: object) -> None:
            if not calls:
                calls.append(1)
                h.feed(0, cut, memoryview(data)[cut:])  # busy: held for the owner
            self.h.update(b)

        def digest(self) -> bytes:
            return self.h.digest()

    monkeypatch.setattr(rh, "_xxh3", Racing)
    h.feed(0, 0, memoryview(data)[:cut])
    assert calls and h._held == 0  # the held span was taken on at once
    assert h.problems() == [] and h.read_back == 0
