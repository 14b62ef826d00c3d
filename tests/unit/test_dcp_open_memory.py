"""Opening a DCP checkpoint holds its chunks as columns: a few machine integers a chunk, not
objects (a TP-8 checkpoint of 200k tensors has 1.6M chunks: as tuples of ints, 200 bytes each,
and 390 MiB for ``inspect --check``)."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.checkpoint import ColumnSlice, Crc32Slice, offset_columns
from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.formats.dcp import open_dcp

N = 600  # tensors: S(0) and S(1) ones, and replicated norms (one chunk each)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("dcp_mem")
    gen = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(N // 3):
        sd[f"layers.{i}.w"] = torch.randint(-99, 99, (32, 4), generator=gen, dtype=torch.int16)
        sd[f"layers.{i}.d"] = torch.randint(-99, 99, (4, 32), generator=gen, dtype=torch.int16)
        sd[f"layers.{i}.norm"] = torch.randint(-99, 99, (4,), generator=gen, dtype=torch.int16)
    src = tmp / "hf"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"))
    layout = tmp / "l.yaml"
    layout.write_text('mesh: {tp: 2}\nplacements:\n  "*.d": {tp: S(1)}\n  "*.norm": R\n  "*": {tp: S(0)}\n')
    out = {}
    for world in (2, 16):
        dst = tmp / f"tp{world}"
        convert(SourceSpec(str(src)), dst, TargetSpec(layout=str(layout), mesh=f"tp={world}", to="dcp"))
        out[world] = dst
    return out


def _held(path: Path) -> tuple[int, int]:
    """Bytes the opened checkpoint holds, and the peak of opening it."""
    gc.collect()
    tracemalloc.start()
    try:
        ck = open_dcp(path)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ck.tensors) == N
    return held, peak


def test_chunks_are_held_as_columns(saved: dict[int, Path]) -> None:
    held2, peak2 = _held(saved[2])
    held16, peak16 = _held(saved[16])
    chunks = (N // 3) * 2 * 14  # chunks more at TP-16 than at TP-2
    # as tuples: 76 bytes more per chunk held, 230 at the peak; as columns: 14 and 96 (121 in a
    # worker process that ran other tests first: the peak is the noisier figure)
    assert (held16 - held2) / chunks < 40, (held2, held16)
    assert (peak16 - peak2) / chunks < 170, (peak2, peak16)
    t = open_dcp(saved[16]).tensors["layers.0.w"]
    assert isinstance(t.piece_offsets, ColumnSlice) and isinstance(t.piece_crc32, Crc32Slice)
    assert len(t.piece_offsets) == 16 and None not in t.piece_crc32


def test_offset_columns_of_slices_are_the_offsets(saved: dict[int, Path]) -> None:
    """The slices' fast path of offset_columns gives what iterating the offsets gives."""
    ck = open_dcp(saved[16])
    for name in ("layers.{}.w", "layers.{}.d", "layers.{}.norm"):
        offsets = [ck.tensors[name.format(i)].piece_offsets for i in range(N // 3)]
        values, picks = offset_columns(offsets, len(offsets[0]))
        assert values[:, list(picks)].tolist() == [list(o) for o in offsets]
        tuples = [tuple(o) for o in offsets]
        values2, picks2 = offset_columns(tuples, len(offsets[0]))
        assert values2[:, list(picks2)].tolist() == values[:, list(picks)].tolist()
