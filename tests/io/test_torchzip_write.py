"""torchzip_write against torch itself: archives byte-equal to ``torch.save``, read back by ``torch.load``.

torch is the oracle: each case saves a real tensor with ``torch.save`` to a stream
(what DCP does per chunk) and compares bytes; the forced-zip64 cases, which torch
only writes past 4 GiB, are read back by ``torch.load(weights_only=True)`` and by
Python's ``zipfile`` with its CRC check. One case captures a real 4 GiB+ torch.save
without storing it (the data pages are never touched, so it costs little memory).
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zipfile
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.io.torchzip_write import ZIP64_LIMIT, chunk_archive, contiguous_strides, crc32_combine
from reshard.torch_ops import torch_dtype

DTYPES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "C64"]
DTYPES += ["F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "U16", "U32", "U64"]


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, bytes]:
    """A tensor of random bytes (0/1 for BOOL) and those raw bytes."""
    t = torch.empty(shape, dtype=torch_dtype(dtype))
    nbytes = t.numel() * t.element_size()
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2 if dtype == "BOOL" else 256, nbytes, dtype=np.uint8).tobytes()
    if nbytes:
        t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return t, raw


def torch_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def build(dtype: str, shape: tuple[int, ...], raw: bytes, **kw: int) -> bytes:
    a = chunk_archive(dtype, shape, **kw)
    out = a.prefix + raw + a.trailer(zlib.crc32(raw), raw[:8])
    assert len(a.prefix) == a.data_offset and a.data_offset % 64 == 0
    assert a.data_size == len(raw) and a.size == len(out)
    return out


def raw_of(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (2, 0, 3), (70_000,), (5, 1, 7)])
def test_byte_equal_to_torch_save(dtype: str, shape: tuple[int, ...]) -> None:
    t, raw = make_tensor(dtype, shape, seed=len(shape))
    ours = build(dtype, shape, raw)
    assert ours == torch_bytes(t)
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert back.stride() == t.stride() == contiguous_strides(shape)
    assert raw_of(back) == raw
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None


def test_data_starting_with_a_descriptor_signature() -> None:
    # torch folds such data into the serialization id; the trailer must too.
    raw = b"PK\x07\x08" + bytes(range(60))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert build("U8", (64,), raw) == torch_bytes(t)


def test_trailer_does_not_depend_on_more_than_the_first_bytes() -> None:
    a = chunk_archive("F32", (4,))
    assert len(a.trailer(0xDEADBEEF, b"PK\x07\x08" + b"\x01" * 4)) == a.size - a.data_offset - 16


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), max_size=4).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_property_byte_equal(dtype: str, shape: tuple[int, ...], seed: int) -> None:
    t, raw = make_tensor(dtype, shape, seed)
    assert build(dtype, shape, raw) == torch_bytes(t)


@pytest.mark.parametrize("limit", [1, 600, 705, 800, 900])
@pytest.mark.parametrize("dtype,shape", [("BF16", (3, 50)), ("F8_E4M3", (7,)), ("F32", (0, 2)), ("I64", ())])
def test_forced_zip64_reads_back(limit: int, dtype: str, shape: tuple[int, ...]) -> None:
    """Records at or past ``limit`` (size or offset) take zip64 fields, as past 4 GiB in torch."""
    t, raw = make_tensor(dtype, shape, seed=limit)
    ours = build(dtype, shape, raw, zip64_limit=limit)
    assert ours != torch_bytes(t)  # the zip64 branch really was taken
    zf = zipfile.ZipFile(io.BytesIO(ours))
    assert zf.testzip() is None
    assert zf.read("archive/data/0") == raw
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and raw_of(back) == raw


class _Capture(io.RawIOBase):
    """A write-only stream that keeps the small writes and only the length of the big one."""

    def __init__(self) -> None:
        self.small: list[tuple[int, bytes]] = []
        self.big: tuple[int, int] | None = None
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        m = memoryview(b)  # type: ignore[arg-type]
        if m.nbytes > 1 << 20:
            self.big = (self.pos, m.nbytes)
        else:
            self.small.append((self.pos, bytes(m)))
        self.pos += m.nbytes
        return m.nbytes


def _zeros_crc(n: int) -> int:
    block = bytes(1 << 24)
    crc = 0
    for _ in range(n >> 24):
        crc = zlib.crc32(block, crc)
    return zlib.crc32(block[: n & ((1 << 24) - 1)], crc)


@pytest.mark.slow
@pytest.mark.parametrize("n", [ZIP64_LIMIT + 101, ZIP64_LIMIT - 300])
def test_real_zip64_against_torch(n: int) -> None:
    """A >4 GiB record (and one that pushes the last records past 4 GiB) matches torch byte for byte."""
    cap = _Capture()
    torch.save(torch.empty(n, dtype=torch.uint8), cap)  # untouched pages read as zeros
    assert cap.big is not None
    a = chunk_archive("U8", (n,))
    before = b"".join(b for pos, b in cap.small if pos < cap.big[0])
    after = b"".join(b for pos, b in cap.small if pos > cap.big[0])
    assert a.prefix == before and cap.big == (a.data_offset, n)
    crc = _zeros_crc(n)
    assert struct.unpack_from("<I", after, 4)[0] == crc  # torch's data descriptor
    assert a.trailer(crc, bytes(8)) == after
    assert a.size == cap.pos


def test_no_torch_import() -> None:
    code = (
        "import sys, reshard.io.torchzip_write as m; m.chunk_archive('BF16', (2,));"
        " print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="F4"):
        chunk_archive("F4", (2,))


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32_combine_matches_zlib(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_combine_long_run() -> None:
    head, tail = b"PK\x07\x08 head", bytes(range(256)) * 40_000  # 10 MB second piece
    assert crc32_combine(zlib.crc32(head), zlib.crc32(tail), len(tail)) == zlib.crc32(head + tail)


def _joined_trailer(a: Any, crc32: int, head: bytes) -> bytes:
    """The trailer as the records' helpers build it, field by field (what ``trailer`` cuts up)."""
    from reshard.io import torchzip_write as z

    seen = list(a._seen)
    if len(head) >= 8 and head[:4] == b"PK\x07\x08":
        seen.append(struct.unpack_from("<I", head, 4)[0])
    if a.data_size:
        seen.append(crc32)
    seen.append(z._VERSION_CRC)
    sid = f"{z._NAME_HASH:020d}{z._fold(seen):020d}".encode()
    sid_crc = zlib.crc32(sid)
    parts = (z._descriptor(crc32, a._data), a._middle, sid, z._descriptor(sid_crc, a._sid), a._cd_head)
    cds = (z._cd_entry(a._data, crc32, a._limit), a._cd_version, z._cd_entry(a._sid, sid_crc, a._limit))
    return b"".join((*parts, *cds, a._end))


@given(
    st.sampled_from(["BF16", "F32", "U8", "F8_E4M3", "I64"]),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from([ZIP64_LIMIT, 0, 64, 700, 1500]),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=8) | st.binary(min_size=4, max_size=4).map(lambda b: b"PK\x07\x08" + b),
)
def test_trailer_equals_its_fields_joined(
    dtype: str, shape: list[int], limit: int, crc32: int, head: bytes
) -> None:
    """``trailer`` fills pieces cut once per archive; the same bytes as building each field
    (zip64 forced at low limits, empty chunks, heads that look like a descriptor)."""
    a = chunk_archive(dtype, tuple(shape), zip64_limit=limit)
    crc = crc32 if a.data_size else 0
    assert a.trailer(crc, head) == _joined_trailer(a, crc, head)
