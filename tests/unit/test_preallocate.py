"""Output files get their blocks up front; a full disk fails before copying, with nothing left behind."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard.io.writer as ex
from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.errors import WriteError


def _failing(code: int):
    calls: list[int] = []

    def fn(fd: int, mode: int, off: int, size: int) -> int:
        calls.append(size)
        ctypes.set_errno(code)
        return -1

    fn.calls = calls  # type: ignore[attr-defined]
    return lambda: fn


def test_blocks_are_allocated_up_front(tmp_path: Path) -> None:
    if ex._fallocate() is None:
        pytest.skip("no fallocate(2) in this C library (not Linux)")
    p = tmp_path / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        ex.preallocate(fd, 3 << 20)
    finally:
        os.close(fd)
    st = p.stat()
    assert st.st_size == 3 << 20
    if st.st_blocks == 0:
        pytest.skip("this file system extends files without allocating (fallocate unsupported)")
    assert st.st_blocks * 512 >= 3 << 20  # allocated, not a sparse hole
    assert p.read_bytes() == bytes(3 << 20)  # allocated extents read as zeros


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS])
def test_unsupported_file_systems_just_extend_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    monkeypatch.setattr(ex, "_fallocate", _failing(code))
    p = tmp_path / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        ex.preallocate(fd, 12345)
    finally:
        os.close(fd)
    assert p.stat().st_size == 12345


def test_full_disk_fails_before_copying_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "w": {tp: S(1)}\n')
    fake = _failing(errno.ENOSPC)
    monkeypatch.setattr(ex, "_fallocate", fake)
    dst = tmp_path / "out"
    src, target = SourceSpec(str(tmp_path / "model.safetensors")), TargetSpec(layout=str(tmp_path / "l.yaml"))
    with pytest.raises(WriteError, match="No space left"):
        convert(src, dst, target)
    assert fake().calls  # type: ignore[attr-defined]
    assert not dst.exists() or not any(dst.iterdir())
    # and with room on the disk the same conversion goes through
    monkeypatch.undo()
    convert(src, dst, target)
    got = load_file(str(dst / "rank-00001-of-00002.safetensors"))
    assert torch.equal(got["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8)[:, 4:])
