"""DCP inputs and outputs found by the rt-dcp red-team pass: real torch files, real CLI runs.

Each test here failed before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.hostile.test_redteam2 import KILL_AT_FIRST_MOVE  # the swap's first move into DST: SIGKILL

RESHARD = Path(sys.executable).with_name("reshard")

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
st = pytest.importorskip("safetensors.torch")
CheckpointException = pytest.importorskip("torch.distributed.checkpoint.api").CheckpointException


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=120)


def torch_load(ckpt: Path, like: dict[str, Any]) -> dict[str, Any]:
    """``dcp.load`` (one process) of ``ckpt`` into tensors shaped as ``like``."""
    sd = {k: torch.full_like(v, 7) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def rank_local_dcp(dst: Path) -> None:
    """A checkpoint torch wrote with rank-local metadata only (``__0.metadata``, no ``.metadata``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"w": torch.arange(6.0).reshape(2, 3)}
        dcp.save(sd, checkpoint_id=str(dst), no_dist=True, use_collectives=False)
    assert (dst / "__0.metadata").is_file() and not (dst / ".metadata").exists()


@pytest.mark.parametrize("to", ["dcp", "hf"])
def test_overwriting_a_rank_local_dcp_checkpoint_removes_its_metadata(tmp_path: Path, to: str) -> None:
    """``convert --overwrite`` into a directory holding a torch checkpoint saved with
    ``use_collectives=False``: its ``__0.metadata`` stayed beside the new files (only
    ``.metadata`` and ``*.distcp`` were reshard's to remove). torch's loader falls back to it
    whenever ``.metadata`` is missing: during the swap of a later run, it described an old
    checkpoint over new ``__0_0.distcp`` bytes; after ``--to hf`` the directory read as both."""
    src = tmp_path / "src"
    src.mkdir()
    full = {"w": torch.arange(100.0, 112.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    st.save_file(full, str(src / "model.safetensors"))
    dst = tmp_path / "dst"
    rank_local_dcp(dst)
    r = run_cli("convert", src, dst, "--to", to, "--overwrite", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dst.glob("*.metadata")) == ([".metadata"] if to == "dcp" else [])
    if to == "dcp":
        got = torch_load(dst, full)
        assert all(torch.equal(got[k], full[k]) for k in full)
    assert run_cli("verify", dst, src).returncode == 0


def test_a_swap_killed_over_a_rank_local_checkpoint_is_no_checkpoint_to_torch(tmp_path: Path) -> None:
    """SIGKILL at the swap's first move into DST, over a torch checkpoint with rank-local
    metadata: DST held the old ``__0.metadata`` beside the new ``__0_0.distcp``, which
    ``dcp.load`` read as a checkpoint (the old one's chunk offsets over the new file's bytes)."""
    src = tmp_path / "src"
    src.mkdir()
    full = {"w": torch.arange(100.0, 112.0).reshape(3, 4)}
    st.save_file(full, str(src / "model.safetensors"))
    dst = tmp_path / "dst"
    rank_local_dcp(dst)
    args = ["convert", src, dst, "--to", "dcp", "--overwrite", "-q"]
    cmd = [sys.executable, "-c", KILL_AT_FIRST_MOVE, dst, *args]
    killed = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert not list(dst.glob("*.metadata")), os.listdir(dst)
    with pytest.raises(CheckpointException, match="metadata is None"):
        torch_load(dst, {"w": torch.zeros(2, 3)})
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert (dst / ".metadata").is_file(), os.listdir(dst)
    got = torch_load(dst, full)
    assert torch.equal(got["w"], full["w"])


def object_state() -> dict[str, Any]:
    """A tensor, a plain hyper-parameter and a tuple holding a tensor (a BYTE_IO item: DCP's
    flattening walks dicts and lists, not tuples)."""
    return {"w": torch.arange(3.0), "lr": 0.1, "pair": (torch.arange(4, dtype=torch.int16), "x")}


def test_a_zstd_compressed_object_holding_a_tensor_is_not_dropped(tmp_path: Path) -> None:
    """Stored uncompressed, the tuple's tensor converts as ``pair.0``; compressed with zstd the
    item was listed as a non-tensor of unknown kind and its tensor dropped, exit 0. Now convert
    refuses it unless excluded (its plain hyper-parameters still convert)."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    plain, zstd = tmp_path / "plain", tmp_path / "zstd"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(object_state(), checkpoint_id=str(plain), no_dist=True)
        dcp.save(
            object_state(),
            storage_writer=FileSystemWriter(str(zstd), _extensions=[ZStandard()]),
            no_dist=True,
        )
    r = run_cli("convert", plain, tmp_path / "hf-plain", "--consolidate", "-q")
    assert r.returncode == 0, r.stderr
    got = st.load_file(str(tmp_path / "hf-plain" / "model.safetensors"))
    assert sorted(got) == ["pair.0", "w"] and torch.equal(got["pair.0"], torch.arange(4, dtype=torch.int16))
    r = run_cli("convert", zstd, tmp_path / "hf", "--consolidate", "-q")
    assert r.returncode == 2, r.stderr
    assert 'item "pair"' in r.stderr and "zstd" in r.stderr and "--exclude 'pair'" in r.stderr
    assert not (tmp_path / "hf").exists()
    r = run_cli("inspect", zstd)
    assert r.returncode == 0 and "pair (object holding tensors" in r.stdout + r.stderr
    r = run_cli("convert", zstd, tmp_path / "hf", "--consolidate", "-q", "--exclude", "pair")
    assert r.returncode == 0, r.stderr
    assert sorted(st.load_file(str(tmp_path / "hf" / "model.safetensors"))) == ["w"]


def test_a_large_zstd_compressed_bytes_item_is_listed_not_refused(tmp_path: Path) -> None:
    """A BytesIO item (a data loader's state) compressed with zstd and larger than the 4 MiB an
    object is decompressed up to is raw bytes, not an object that may hold tensors: the
    checkpoint converts, the item listed."""
    pytest.importorskip("zstandard")
    import io

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    blob = os.urandom(5 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.arange(3.0), "dataloader": io.BytesIO(blob)},
            storage_writer=FileSystemWriter(str(tmp_path / "zstd"), _extensions=[ZStandard()]),
            no_dist=True,
        )
    r = run_cli("convert", tmp_path / "zstd", tmp_path / "hf", "--consolidate", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(st.load_file(str(tmp_path / "hf" / "model.safetensors"))) == ["w"]
    r = run_cli("inspect", tmp_path / "zstd")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "dataloader (object, 5." in out and "holding tensors" not in out


def test_a_damaged_object_item_is_not_taken_for_a_plain_object(tmp_path: Path) -> None:
    """One byte of a BYTE_IO item's zip directory changed (a record name): the item read as a
    plain object, so its tensor was dropped, exit 0, and ``inspect --check`` said ok."""
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(object_state(), checkpoint_id=str(ck), no_dist=True)
    md = dcp.FileSystemReader(str(ck)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "pair")
    data = bytearray((ck / info.relative_path).read_bytes())
    item = bytes(data[info.offset : info.offset + info.length])
    at = info.offset + item.rindex(b"PK\x01\x02") + 46  # the last central-directory entry's name
    data[at] ^= 0x10
    (ck / info.relative_path).write_bytes(data)
    r = run_cli("inspect", ck, "--check")
    assert r.returncode == 1, r.stderr
    assert 'item "pair" cannot be read' in r.stderr
    r = run_cli("convert", ck, tmp_path / "hf", "--consolidate", "-q")
    assert r.returncode == 2, r.stderr
    assert "--exclude 'pair'" in r.stderr and not (tmp_path / "hf").exists()


def test_a_large_zstd_compressed_object_holding_a_tensor_is_still_refused(tmp_path: Path) -> None:
    """Over the 4 MiB kept whole, an object's directory is still read (from its end): a tuple
    holding a 5 MiB tensor is refused as the small one is, not listed as an object."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.arange(3.0), "pair": (torch.randn(1 << 20, dtype=torch.float32) * 0 + 1, "x")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            state,
            storage_writer=FileSystemWriter(str(tmp_path / "zstd"), _extensions=[ZStandard()]),
            no_dist=True,
        )
    r = run_cli("convert", tmp_path / "zstd", tmp_path / "hf", "--consolidate", "-q")
    assert r.returncode == 2 and 'item "pair"' in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()
