"""Inputs found by a fourth independent red-team pass: real producers and consumers, hostile files.

Each test here failed before its fix; real files (torch's own writers, edited where the point is
a hostile file), real CLI subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

RESHARD = Path(sys.executable).with_name("reshard")


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def _long1(n: int) -> bytes:
    """The pickle opcode LONG1 pushing ``n``."""
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _edit_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace the one occurrence of ``old`` in a ``torch.save`` archive's ``data.pkl``."""
    with zipfile.ZipFile(path) as z:
        recs = {n: z.read(n) for n in z.namelist()}
    pk = next(n for n in recs if n.endswith("/data.pkl"))
    assert recs[pk].count(old) == 1, recs[pk]
    recs[pk] = recs[pk].replace(old, new)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for n, data in recs.items():
            z.writestr(n, data)


@pytest.mark.parametrize("count", [1, 300])
def test_a_pt_tensor_of_more_than_int64_elements_exits_2(tmp_path: Path, count: int) -> None:
    """A ``.pt`` tensor whose size, edited to [2**40, 2**40] (stride 0, as ``expand`` saves it),
    is over 2**63 - 1 elements (``torch.load``: "numel: integer multiplication overflow"): exit 2
    naming the file. It was an ``OverflowError`` traceback from the spool (exit 1). ``count``
    tensors: 300 of one kind go through the pickle's item templates, 1 through the C unpickler."""
    src = tmp_path / "src"
    src.mkdir()
    sd = {f"w{i}": torch.ones(1).expand(3, 5) for i in range(count - 1)}
    sd["big"] = torch.ones(1).expand(7, 11)  # stride (0, 0): its 4 stored bytes span it all
    torch.save(sd, src / "model.pt")
    _edit_pickle(src / "model.pt", b"K\x07K\x0b\x86", _long1(2**40) + _long1(2**40) + b"\x86")
    with pytest.raises(RuntimeError, match="overflow"):
        torch.load(src / "model.pt", weights_only=True)
    out = tmp_path / "out"
    for args in (["inspect", src], ["inspect", src, "--check"], ["convert", src, out, "--consolidate"]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert f"{src / 'model.pt'}: " in r.stderr and "[1099511627776, 1099511627776]" in r.stderr
        assert "over 9223372036854775807 elements" in r.stderr, r.stderr
    assert not out.exists()
