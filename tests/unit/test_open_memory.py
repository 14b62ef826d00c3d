"""Opening a checkpoint of many rank files holds memory per tensor, not per tensor and rank: a
64-rank checkpoint of small tensors costs about what a 4-rank one does (its piece offsets were
64 ints per tensor, and rank 0's description of its uneven tensors one object per tensor)."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.budget import budget_for
from reshard.bulk import Geometries
from reshard.check import check_checkpoint
from reshard.checkpoint import Checkpoint, FewOffsets
from reshard.convert import SourceSpec, TargetSpec, build_plan, convert, open_source, resolve_target
from reshard.execute import entry_runs
from reshard.formats.per_rank import RankFiles, _named_sources, open_per_rank
from reshard.io.header import read_header
from reshard.report import plan_report
from reshard.verify import verify_checkpoints

N = 1500  # tensors: 3-row S(0) and 2-column S(1) ones (uneven: some ranks hold none), replicated norms


def _hf(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(N // 3):
        sd[f"layers.{i}.w"] = torch.randint(-99, 99, (3, 4), generator=gen, dtype=torch.int16)
        sd[f"layers.{i}.d"] = torch.randint(-99, 99, (4, 2), generator=gen, dtype=torch.int16)
        sd[f"layers.{i}.norm"] = torch.randint(-99, 99, (4,), generator=gen, dtype=torch.int16)
    src = tmp_path / "hf"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"))
    (tmp_path / "l.yaml").write_text(
        'mesh: {tp: 4}\nplacements:\n  "*.d": {tp: S(1)}\n  "*.norm": R\n  "*": {tp: S(0)}\n'
    )
    return src


def _per_tensor(path: Path) -> tuple[float, float, Checkpoint]:
    """Bytes held per tensor by the opened checkpoint, and at the peak of opening it (the rank
    files alone: detecting the format and reading reshard.json cost the same for any count)."""
    gc.collect()
    tracemalloc.start()
    try:
        ck = open_per_rank(path, mesh=None, placements_for=None)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held / len(ck.tensors), peak / len(ck.tensors), ck


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("ranks")
    src = _hf(tmp)
    out = {}
    for world in (4, 64):
        dst = tmp / f"tp{world}"
        convert(SourceSpec(str(src)), dst, TargetSpec(layout=str(tmp / "l.yaml"), mesh=f"tp={world}"))
        out[world] = dst
    return out


def test_64_rank_files_hold_memory_per_tensor(ranks: dict[int, Path]) -> None:
    held4, peak4, _ = _per_tensor(ranks[4])
    held64, peak64, ck = _per_tensor(ranks[64])
    assert len(ck.tensors) == N
    # 64 ranks held 1.1 KB per tensor (4 ranks: 560 B) and 2 KB at the peak of opening (4: 1.4 KB)
    assert held64 < held4 + 200, (held4, held64)
    assert peak64 < peak4 + 300, (peak4, peak64)
    t = ck.tensors["layers.0.w"]
    assert isinstance(t.piece_offsets, FewOffsets)
    # the rank files share one tuple of picks; each tensor holds its distinct offsets alone
    offsets = [s.piece_offsets for s in ck.tensors.values()]
    assert len({id(o.picks) for o in offsets if isinstance(o, FewOffsets)}) == 1
    # 3 entry sections (ranks 0-1, 2 and 3-63 hold rows); rank numbers of 1 and 2 digits: 4 data starts
    assert len(t.piece_offsets.values) == 4


def test_few_offsets_are_the_offsets_the_name_pairing_gives(ranks: dict[int, Path]) -> None:
    ck = open_source(SourceSpec(str(ranks[64])))
    paths = sorted(ranks[64].glob("rank-*.safetensors"))
    files = RankFiles.one_per_rank(paths)
    assert ck.mesh is not None
    ts = ck.tensors
    by_name = _named_sources(files, ck.mesh, lambda n, _: (ts[n].shape, ts[n].placements or ()))
    for name, t in by_name.items():
        got = ck.tensors[name].piece_offsets
        assert tuple(got) == t.piece_offsets and got == t.piece_offsets and hash(got) == hash(t.piece_offsets)
        assert [got[k] for k in range(len(got))] == list(t.piece_offsets)


def test_commands_read_the_few_offsets_as_their_tuples(ranks: dict[int, Path], tmp_path: Path) -> None:
    """Consolidating, planning, verifying and checking the 64-rank checkpoint: torch's tensors, and
    the figures its offsets give as tuples."""
    ck = open_source(SourceSpec(str(ranks[64])))
    tuples = {n: dataclasses.replace(t, piece_offsets=tuple(t.piece_offsets)) for n, t in ck.tensors.items()}
    as_tuples = dataclasses.replace(ck, tensors=tuples)
    budget = budget_for(64 << 20, 2)
    target = resolve_target(ck, TargetSpec(consolidate=True))
    report = plan_report(build_plan(ck, target), budget)
    assert report == plan_report(build_plan(as_tuples, target), budget)
    out = tmp_path / "hf"
    convert(SourceSpec(str(ranks[64])), out, TargetSpec(consolidate=True), workers=2)
    got = load_file(str(out / "model.safetensors"))
    want = load_file(str(ranks[64].parent / "hf" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
    assert verify_checkpoints(ck, open_source(SourceSpec(str(out))))["equal"]
    assert check_checkpoint(ck) == []


def test_rank_files_of_one_entry_section_share_the_picks(tmp_path: Path) -> None:
    """Replicated tensors on 16 ranks: every file lists the same entries (the uniform pairing);
    a tensor holds one offset per data start, and reads back as torch's."""
    src = _hf(tmp_path)
    (tmp_path / "r.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "*": R\n')
    dst = tmp_path / "tp16"
    convert(SourceSpec(str(src)), dst, TargetSpec(layout=str(tmp_path / "r.yaml"), mesh="tp=16"))
    ck = open_source(SourceSpec(str(dst)))
    offsets = [t.piece_offsets for t in ck.tensors.values()]
    assert all(isinstance(o, FewOffsets) and len(o) == 16 for o in offsets)
    assert len({id(o.picks) for o in offsets if isinstance(o, FewOffsets)}) == 1
    starts = {read_header(p).data_start for p in dst.glob("rank-*.safetensors")}
    assert all(len(o.values) == len(starts) for o in offsets if isinstance(o, FewOffsets))
    out = tmp_path / "hf2"
    convert(SourceSpec(str(dst)), out, TargetSpec(consolidate=True))
    got, want = load_file(str(out / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


def test_offsets_as_arrays_stay_a_few_columns(ranks: dict[int, Path]) -> None:
    """The plan report and the executor's columns of a 64-rank source cost per tensor what a
    4-rank one's do (they made an array of every rank's offsets: 64 ints per tensor and more)."""
    per_tensor = {}
    for world in (4, 64):
        ck = open_source(SourceSpec(str(ranks[world])))
        plan = build_plan(ck, resolve_target(ck, TargetSpec(consolidate=True)))
        budget = budget_for(64 << 20, 2)
        plan_report(plan, budget)  # lazy imports, caches
        (f,) = plan.files
        gc.collect()
        tracemalloc.start()
        try:
            plan_report(plan, budget)
            _, report_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            geos = Geometries(f.tensors, entry_runs)
            for g, first in enumerate(geos.firsts):
                for k in range(len(first.src.piece_blocks)):
                    geos.column(g, k)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        per_tensor[world] = (report_peak / N, held / N)
    # 64 ranks: the report's peak was 660 B per tensor (4 ranks: 180 B), the columns 570 B (60 B)
    assert per_tensor[64][0] < per_tensor[4][0] + 150, per_tensor
    assert per_tensor[64][1] < per_tensor[4][1] + 100, per_tensor
