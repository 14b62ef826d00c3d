"""reshard.io.torchzip against Python's zipfile and torch.save archives; reshard.io.unpickle refusals."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.errors import HeaderError
from reshard.io.torchzip import STORED, crc32_range, read_record, read_torch_zip
from reshard.io.unpickle import UnsafePickleError, load_dcp_metadata, load_stored_tensor

JUNK = b"x" * 13  # the archive sits at an odd offset, as DCP chunks do


def _embed(tmp_path: Path, archive: bytes, tail: bytes = b"tail") -> tuple[Path, int, int]:
    p = tmp_path / "f.bin"
    p.write_bytes(JUNK + archive + tail)
    return p, len(JUNK), len(archive)


def _same_as_zipfile(p: Path, base: int, length: int) -> dict[str, bytes]:
    """Every record read through torchzip equals zipfile's reading of the same archive."""
    archive = p.read_bytes()[base : base + length]
    fd = os.open(p, os.O_RDONLY)
    try:
        tz = read_torch_zip(fd, str(p), base, length)
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            assert sorted(tz.records) == sorted(z.namelist())
            out = {}
            for info in z.infolist():
                rec = tz.records[info.filename]
                assert (rec.size, rec.crc32, rec.compress_type) == (info.file_size, info.CRC, STORED)
                data = read_record(fd, tz, rec)
                assert data == z.read(info.filename)
                assert crc32_range(fd, rec.offset, rec.size, str(p), block=7) == info.CRC
                out[info.filename] = data
            return out
    finally:
        os.close(fd)


def test_torch_save_archive_in_a_byte_range(tmp_path: Path) -> None:
    buf = io.BytesIO()
    t = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    torch.save(t, buf)
    p, base, length = _embed(tmp_path, buf.getvalue())
    records = _same_as_zipfile(p, base, length)
    assert records["archive/data/0"] == t.numpy().tobytes()
    st = load_stored_tensor(records["archive/data.pkl"], path="x")
    assert (st.key, st.dtype, st.size, st.stride, st.storage_nbytes) == ("0", "float32", (2, 5), (5, 1), 40)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.bfloat16, torch.bool])
def test_data_pkl_dtypes(dtype: torch.dtype) -> None:
    """v2 (typed storages) and v3 (UntypedStorage + dtype) rebuilds both give the dtype."""
    buf = io.BytesIO()
    torch.save(torch.zeros(3, 2).to(dtype).t(), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        st = load_stored_tensor(z.read("archive/data.pkl"), path="x")
    assert st.dtype == str(dtype).removeprefix("torch.")
    assert (st.size, st.stride) == ((2, 3), (1, 2))
    assert st.storage_nbytes == 6 * dtype.itemsize


def test_zip64_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zip64 end records and extra fields, as torch writes past 4 GiB, without writing 4 GiB."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)  # zipfile switches to zip64 records past it
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in [("archive/data.pkl", b"p" * 50), ("archive/data/0", bytes(range(256)) * 3)]:
            with z.open(name, "w", force_zip64=True) as f:
                f.write(data)
        z.writestr("archive/byteorder", b"little")
    archive = buf.getvalue()
    assert b"PK\x06\x06" in archive and b"PK\x06\x07" in archive  # really zip64
    p, base, length = _embed(tmp_path, archive)
    records = _same_as_zipfile(p, base, length)
    assert records["archive/data/0"] == bytes(range(256)) * 3


def test_archive_with_comment(tmp_path: Path) -> None:
    """torch writes no zip comment; an archive with one is found by scanning back for the end record."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"p")
        z.comment = b"a comment"
    p, base, length = _embed(tmp_path, buf.getvalue())
    assert _same_as_zipfile(p, base, length) == {"archive/data.pkl": b"p"}


def _archive(method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        z.writestr("archive/data.pkl", b"q" * 100)
    return buf.getvalue()


def test_bad_archives(tmp_path: Path) -> None:
    good = _archive()
    p, base, length = _embed(tmp_path, good[:-10], tail=b"")
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(HeaderError, match="no zip end-of-central-directory"):
            read_torch_zip(fd, str(p), base, length)
        with pytest.raises(HeaderError, match="too few"):
            read_torch_zip(fd, str(p), base, 5)
    finally:
        os.close(fd)
    p, base, length = _embed(tmp_path, _archive(zipfile.ZIP_DEFLATED))
    fd = os.open(p, os.O_RDONLY)
    try:
        tz = read_torch_zip(fd, str(p), base, length)
        with pytest.raises(HeaderError, match="is compressed"):
            read_record(fd, tz, tz.record("data.pkl"))
        with pytest.raises(HeaderError, match="has no record archive/data/0"):
            tz.record("data/0")
    finally:
        os.close(fd)
    bad = bytearray(good)
    bad[good.index(b"q" * 100)] ^= 1  # the data (a header byte, e.g. the time, may be "q" too)
    p, base, length = _embed(tmp_path, bytes(bad))
    fd = os.open(p, os.O_RDONLY)
    try:
        tz = read_torch_zip(fd, str(p), base, length)
        with pytest.raises(HeaderError, match="fails its CRC32 check"):
            read_record(fd, tz, tz.record("data.pkl"))
    finally:
        os.close(fd)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_unpicklers_refuse_other_globals() -> None:
    evil = pickle.dumps(_Evil())
    with pytest.raises(UnsafePickleError, match=r"m\.pkl: the DCP metadata pickle refers to posix\.system"):
        load_dcp_metadata(evil, path="m.pkl")
    with pytest.raises(UnsafePickleError, match=r"refers to posix\.system"):
        load_stored_tensor(evil, path="d.pkl")
    with pytest.raises(HeaderError, match="not a valid DCP metadata pickle"):
        load_dcp_metadata(b"\x80\x04garbage", path="m.pkl")
    with pytest.raises(HeaderError, match="not a valid DCP metadata"):
        load_dcp_metadata(pickle.dumps({"a": 1}), path="m.pkl")
    with pytest.raises(HeaderError, match="holds a dict, not one tensor"):
        load_stored_tensor(pickle.dumps({}), path="d.pkl")


def test_data_pkl_with_negative_offset_refused() -> None:
    """A storage offset before the record would make the piece start outside it."""
    buf = io.BytesIO()
    torch.save(torch.zeros(4), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = z.read("archive/data.pkl")
    ok = load_stored_tensor(data, path="d.pkl")
    assert ok.storage_offset == 0
    bad = data.replace(b"K\x00K\x04\x85", b"J\xff\xff\xff\xffK\x04\x85")  # BININT1 0 -> BININT -1
    assert bad != data
    with pytest.raises(HeaderError, match=r"d\.pkl: not a valid torch.save tensor pickle"):
        load_stored_tensor(bad, path="d.pkl")
