"""Sibling output files written in lockstep read each source row once, and write the same bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard.execute as ex
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from reshard.io.pages import SourceFiles
from reshard.io.reader import RowCache


def _column_sharded_plan(tmp_path: Path, world: int = 8):
    gen = torch.Generator().manual_seed(1)
    full = {
        "o": torch.randn(64, 256, generator=gen).to(torch.bfloat16),  # columns: every rank cuts each row
        "q": torch.randn(64, 32, generator=gen),  # rows: contiguous runs
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    rules = '  "o": {tp: S(1)}\n  "q": {tp: S(0)}\n'
    (tmp_path / "l.yaml").write_text(f"mesh: {{tp: {world}}}\nplacements:\n{rules}")
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    return full, build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))


def _write_tp8(plan, out: Path) -> Path:
    out.mkdir()
    ex.execute_plan(plan, out, workers=1)
    from reshard.formats.manifest import manifest_for, write_manifest

    write_manifest(out, manifest_for(plan, [], listed=False))  # self-described: the files say it all
    return out


def _run(
    plan, out: Path, monkeypatch: pytest.MonkeyPatch, group: int, workers: int, buffer_size: int = 4096
) -> int:
    """Bytes read from the source by pread while executing ``plan`` (contiguous runs included)."""
    monkeypatch.setattr(ex, "GROUP_FILES", group)
    read = [0]
    real = os.preadv

    def counting(fd: int, buffers: list, offset: int) -> int:
        n = real(fd, buffers, offset)
        read[0] += n
        return n

    monkeypatch.setattr(os, "preadv", counting)  # every source read is a pread
    out.mkdir()
    ex.execute_plan(plan, out, workers=workers, buffer_size=buffer_size)
    monkeypatch.setattr(os, "preadv", real)
    return read[0]


def test_lockstep_reads_each_row_once_and_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)  # "o" gathered as a large column shard would be
    monkeypatch.setattr(ex, "_WINDOW", 0)  # "q" read exactly (short reads are windowed otherwise)
    monkeypatch.setattr(ex, "_SPAN", 0)  # (the column path's too)
    monkeypatch.setattr(ex, "_RUNS", {})
    full, plan = _column_sharded_plan(tmp_path)
    o_bytes = full["o"].numel() * 2
    q_bytes = full["q"].numel() * 4
    one_by_one = _run(plan, tmp_path / "single", monkeypatch, group=1, workers=1)
    lockstep = _run(plan, tmp_path / "lockstep", monkeypatch, group=8, workers=1)
    two_groups = _run(plan, tmp_path / "two", monkeypatch, group=8, workers=2)
    # one file at a time, each rank reads the whole rows of "o" for its 1/8 of them
    assert one_by_one == 8 * o_bytes + q_bytes
    # in lockstep the first rank reads the rows, the seven others take them from there
    assert lockstep == o_bytes + q_bytes
    # two workers split every file's entries between them, each writing all 8 files in lockstep:
    # still once (two groups of 4 files read the rows of "o" twice)
    assert two_groups == o_bytes + q_bytes
    for r in range(8):
        name = f"rank-{r:05d}-of-00008.safetensors"
        single = (tmp_path / "single" / name).read_bytes()
        assert (tmp_path / "lockstep" / name).read_bytes() == single
        assert (tmp_path / "two" / name).read_bytes() == single
        got = load_file(str(tmp_path / "lockstep" / name))
        assert torch.equal(got["o"], full["o"].chunk(8, 1)[r])
        assert torch.equal(got["q"], full["q"].chunk(8, 0)[r])


def test_dcp_ranks_written_in_parts_by_two_workers_read_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF -> DCP TP-8 with two workers: each writes a part of every rank's archives, the 8 files
    in lockstep, as for per-rank files (two groups of 4 files read the rows of "o" twice, and
    each group's reads ran half a tensor ahead of the other's, so a source's recorded hashes
    held 400 MB of a 2 GB Llama aside); the archives are the same bytes."""
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)
    monkeypatch.setattr(ex, "_WINDOW", 0)
    monkeypatch.setattr(ex, "_SPAN", 0)
    monkeypatch.setattr(ex, "_RUNS", {})
    gen = torch.Generator().manual_seed(3)
    full = {f"l{i}.o": torch.randn(64, 256, generator=gen).to(torch.bfloat16) for i in range(4)}
    full |= {f"l{i}.q": torch.randn(64, 32, generator=gen) for i in range(4)}
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 8}\nplacements:\n  "*.o": {tp: S(1)}\n  "*.q": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"), to="dcp")))
    o_bytes = sum(t.numel() * 2 for n, t in full.items() if n.endswith(".o"))
    q_bytes = sum(t.numel() * 4 for n, t in full.items() if n.endswith(".q"))
    calls: list[int] = []
    real = ex._write_parts
    monkeypatch.setattr(ex, "_write_parts", lambda *a: calls.append(1) or real(*a))
    one = _run(plan, tmp_path / "one", monkeypatch, group=8, workers=1)
    two = _run(plan, tmp_path / "two", monkeypatch, group=8, workers=2)
    assert calls == [1]  # the two workers wrote the files in parts
    assert one == two == o_bytes + q_bytes
    for f in plan.files:
        assert (tmp_path / "two" / f.name).read_bytes() == (tmp_path / "one" / f.name).read_bytes()


def test_64_ranks_in_lockstep_read_each_column_sharded_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF -> TP-64: the 64 ranks that cut each row of a column-sharded tensor are written in
    lockstep by one worker (with two, by two groups of 32: more files than span slots are not
    written in parts), so its rows are read once per group, not once per group of 8 siblings
    (8 times: 8.1 GB read for a 2 GB Llama)."""
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)  # "o" gathered as a large column shard would be
    monkeypatch.setattr(ex, "_WINDOW", 0)
    monkeypatch.setattr(ex, "_SPAN", 0)
    monkeypatch.setattr(ex, "_RUNS", {})
    full, plan = _column_sharded_plan(tmp_path, world=64)
    o_bytes = full["o"].numel() * 2
    q_bytes = full["q"].numel() * 4
    one = _run(plan, tmp_path / "one", monkeypatch, group=ex.GROUP_FILES, workers=1)
    two = _run(plan, tmp_path / "two", monkeypatch, group=ex.GROUP_FILES, workers=2)
    assert one == o_bytes + q_bytes
    assert two == 2 * o_bytes + q_bytes  # two groups of 32 files: each reads all of o's rows
    for r in range(64):
        name = f"rank-{r:05d}-of-00064.safetensors"
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
        got = load_file(str(tmp_path / "one" / name))
        assert torch.equal(got["o"], full["o"].chunk(64, 1)[r])
        assert torch.equal(got["q"], full["q"].chunk(64, 0)[r])


def test_siblings_reading_their_own_rank_files_read_each_byte_about_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP-16 -> TP-4 of many small tensors: each target rank reads 4 source rank files no
    sibling reads. Their spans are read as asked, not in whole windows kept for siblings that
    never come (16 files' windows through 8 slots: every batch read whole windows, read over
    by the next sibling's before the rest was taken: TP-64 -> TP-8 of a 10k-tensor MoE read
    18.9 GB for a 0.13 GB output)."""
    gen = torch.Generator().manual_seed(7)
    full = {f"e{i:04d}": torch.randn(16, 32, generator=gen) for i in range(1500)}
    full |= {f"n{i:04d}": torch.randn(32, generator=gen) for i in range(0, 1500, 100)}  # replicated
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 16}\nplacements:\n  "n*": R\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    tp16 = _write_tp8(plan, tmp_path / "tp16")
    src = open_source(SourceSpec(str(tp16)))
    to4 = build_plan(src, resolve_target(src, TargetSpec(mesh="tp=4")))
    monkeypatch.setattr(ex, "_SPAN", 16 << 10)  # 8 slots of 16 KiB, fewer than 4 siblings x 4 files
    real = ex._Writer._copy_columns
    tries = [0, 0]

    def counting(self, *args):  # type: ignore[no-untyped-def]
        ok = real(self, *args)
        tries[ok] += 1
        return ok

    monkeypatch.setattr(ex._Writer, "_copy_columns", counting)
    read = _run(to4, tmp_path / "tp4", monkeypatch, group=ex.GROUP_FILES, workers=1, buffer_size=16 << 10)
    size = sum(p.stat().st_size for p in tp16.glob("*.safetensors"))
    assert read <= 1.25 * size, (read, size)
    refused, copied = tries
    assert refused <= copied // 4, tries  # batches are not halved to keep windows no sibling reads
    for r in range(4):
        got = load_file(str(tmp_path / "tp4" / f"rank-{r:05d}-of-00004.safetensors"))
        assert got.keys() == full.keys()
        assert all(torch.equal(got[k], v.chunk(4, 0)[r] if k[0] == "e" else v) for k, v in full.items())


def test_siblings_spans_from_one_norm_to_their_own_rows_are_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF -> TP-64 of a few tensors: a rank's batch is the replicated norm and its rows of b and
    c, 63 other ranks' rows apart (too few pieces to read whole windows for the siblings). Each
    sibling's span, from the norm to its rows, is longer than the last one's: the window holding
    the last one is extended, not read again from the norm (which read the 64 spans, 48 times
    the tensors: a 2 GB Llama's q/k/v 3.6 times over)."""
    gen = torch.Generator().manual_seed(9)
    full = {
        "a.norm": torch.randn(1024, generator=gen),  # replicated, first in the file
        "b": torch.randn(64, 1024, generator=gen),  # a rank's row: 4 KiB, 256 KiB apart
        "c": torch.randn(64, 1024, generator=gen),
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 64}\nplacements:\n  "a.norm": R\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    wanted = sum(t.numel() * 4 for t in full.values())
    read = _run(plan, tmp_path / "out", monkeypatch, group=ex.GROUP_FILES, workers=1, buffer_size=64 << 10)
    assert read == wanted
    two = _run(plan, tmp_path / "two", monkeypatch, group=ex.GROUP_FILES, workers=2, buffer_size=64 << 10)
    assert two <= 2 * wanted, (two, wanted)  # two groups of 32
    for r in range(64):
        name = f"rank-{r:05d}-of-00064.safetensors"
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
        got = load_file(str(tmp_path / "out" / name))
        assert torch.equal(got["b"], full["b"][r : r + 1]) and torch.equal(got["c"], full["c"][r : r + 1])
        assert torch.equal(got["a.norm"], full["a.norm"])


@pytest.mark.parametrize("buffer_size", [1 << 20, 4096, 100, 16])
def test_small_column_shards_are_copied_as_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffer_size: int
) -> None:
    """Column shards of small tensors (at most _STRIDED_MAX bytes a rank) are queued as strided
    rows, read by pread of their span, and column shards written whole as interleaved rows: the same
    bytes as gathering them, whatever the buffer size (a buffer smaller than a shard, or than
    one row, splits it or falls back to gathering)."""
    full, plan = _column_sharded_plan(tmp_path)
    (tmp_path / "hf").mkdir()
    tp8 = open_source(SourceSpec(str(_write_tp8(plan, tmp_path / "tp8"))))
    whole = build_plan(tp8, resolve_target(tp8, TargetSpec(consolidate=True)))
    for name, p in (("hf-rows", whole), ("hf-gathered", whole)):
        if name == "hf-gathered":
            monkeypatch.setattr(ex, "_STRIDED_MAX", 0)
        monkeypatch.setattr(ex, "_RUNS", {})
        (tmp_path / name).mkdir()
        ex.execute_plan(p, tmp_path / name, workers=1, buffer_size=buffer_size)
    rows_hf = (tmp_path / "hf-rows" / "model.safetensors").read_bytes()
    assert rows_hf == (tmp_path / "hf-gathered" / "model.safetensors").read_bytes()
    got = load_file(str(tmp_path / "hf-rows" / "model.safetensors"))
    assert all(torch.equal(got[k], full[k]) for k in full)
    monkeypatch.setattr(ex, "_STRIDED_MAX", 65536)
    monkeypatch.setattr(ex, "_RUNS", {})
    (tmp_path / "rows").mkdir()
    ex.execute_plan(plan, tmp_path / "rows", workers=1, buffer_size=buffer_size)
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)
    monkeypatch.setattr(ex, "_RUNS", {})
    (tmp_path / "gathered").mkdir()
    ex.execute_plan(plan, tmp_path / "gathered", workers=1, buffer_size=buffer_size)
    for r in range(8):
        name = f"rank-{r:05d}-of-00008.safetensors"
        assert (tmp_path / "rows" / name).read_bytes() == (tmp_path / "gathered" / name).read_bytes()
        got = load_file(str(tmp_path / "rows" / name))
        assert torch.equal(got["o"], full["o"].chunk(8, 1)[r])


@pytest.mark.parametrize("window", [0, 96, 1 << 18])
def test_short_reads_go_through_file_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """Many small tensors: their bytes come from a few windows of each source file (one pread
    each) instead of one pread per tensor, and the output is the same whatever the window size
    (0: every read exact; 96 bytes: windows smaller than most reads, refilled all the time)."""
    gen = torch.Generator().manual_seed(3)
    shards = [
        {f"e{i}": torch.randn(4, 6, generator=gen) for i in range(300)}
        | {f"d{i}": torch.randn(6, 4, generator=gen) for i in range(300)}
        for _ in range(2)
    ]
    src = tmp_path / "tp2"
    src.mkdir()
    for r, sd in enumerate(shards):
        save_file(sd, str(src / f"rank-{r:05d}-of-00002.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "d*": {tp: S(1)}\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(src), layout=str(tmp_path / "l.yaml")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(mesh="tp=4")))
    monkeypatch.setattr(ex, "_WINDOW", window)
    monkeypatch.setattr(ex, "_SPAN", window)  # (the column path's windows)
    calls = [0, 0]
    real = os.preadv

    def counting(fd: int, buffers: list, offset: int) -> int:
        calls[0] += 1
        n = real(fd, buffers, offset)
        calls[1] += n
        return n

    monkeypatch.setattr(os, "preadv", counting)
    (tmp_path / "out").mkdir()
    ex.execute_plan(plan, tmp_path / "out", workers=1)
    monkeypatch.setattr(os, "preadv", real)
    if window == 1 << 18:  # 1200 source tensors (600 strided) into 4 files: a handful of windows each
        assert calls[0] < 60, calls[0]
        # the four files in lockstep read each source byte about once between them
        assert calls[1] <= 1.1 * sum(p.stat().st_size for p in src.iterdir()), calls[1]
    for r in range(4):
        got = load_file(str(tmp_path / "out" / f"rank-{r:05d}-of-00004.safetensors"))
        for i in range(300):
            e = torch.cat([shards[0][f"e{i}"], shards[1][f"e{i}"]], 0).chunk(4, 0)[r]
            d = torch.cat([shards[0][f"d{i}"], shards[1][f"d{i}"]], 1).chunk(4, 1)[r]
            assert torch.equal(got[f"e{i}"], e) and torch.equal(got[f"d{i}"], d), i


def test_strided_box_runs() -> None:
    """Which boxes become runs of rows: contiguous in the target, rows along one outer dim."""
    # a column slice of a (6, 8) piece into a (6, 2) block: 6 rows of 2 items, 8 apart
    assert ex._box_run((6, 8), (6, 2), (0, 4), (0, 0), (6, 2), 2) == (0, 8, 4, 6, 16, 4)
    assert ex._box_run((6, 8), (6, 8), (2, 0), (2, 0), (3, 8), 2) == (32, 32, 48, 1, 0, 0)  # contiguous
    assert ex._box_run((4, 6, 8), (4, 6, 2), (0, 0, 4), (0, 0, 0), (4, 6, 2), 2) is None  # two outer dims
    got = ex._box_run((2, 6, 8), (1, 6, 2), (1, 0, 4), (0, 0, 0), (1, 6, 2), 4)
    assert got == (0, 48 * 4 + 16, 8, 6, 32, 8)
    # a (6, 2) piece into columns 2:4 of a (6, 4) block: rows written 8 bytes apart
    assert ex._box_run((6, 2), (6, 4), (0, 0), (0, 2), (6, 2), 2) == (4, 0, 4, 6, 4, 8)
    # both strided: columns 4:6 of (6, 8) into columns 2:4 of (6, 4)
    assert ex._box_run((6, 8), (6, 4), (0, 4), (0, 2), (6, 2), 2) == (4, 8, 4, 6, 16, 8)
    assert ex._box_run((100, 1000), (100, 500), (0, 0), (0, 0), (100, 500), 2) is None  # over _STRIDED_MAX


def test_groups_are_consecutive_balanced_and_bounded() -> None:
    class F:
        def __init__(self, i: int) -> None:
            self.i = i

    files = [F(i) for i in range(20)]
    groups = ex._groups(files, 2, most=8)  # type: ignore[arg-type]
    assert [f.i for g in groups for f in g] == list(range(20))  # every file once, in order
    assert len(groups) == 3 and all(len(g) <= 8 for g in groups)
    # 64 ranks, 2 workers: two groups of 32 (each tensor's rows read twice, not 8 times)
    assert [len(g) for g in ex._groups([F(i) for i in range(64)], 2)] == [32, 32]  # type: ignore[arg-type]
    assert [len(g) for g in ex._groups([F(i) for i in range(200)], 1)] == [50] * 4  # type: ignore[arg-type]
    assert [len(g) for g in ex._groups(files[:8], 2)] == [4, 4]  # type: ignore[arg-type]
    assert [len(g) for g in ex._groups(files[:3], 4)] == [1, 1, 1]  # type: ignore[arg-type]
    assert [len(g) for g in ex._groups(files[:5], 2, most=1)] == [1] * 5  # type: ignore[arg-type]


def test_read_window_hits_misses_and_limits(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64  # 16 KiB
    p = tmp_path / "src"
    p.write_bytes(data)
    src = SourceFiles([str(p), str(p)])
    try:
        b = RowCache(8 * 64 + 64)  # a writer's row cache for a 64-byte buffer: 576 bytes
        at = b.read(src, 0, 130, 140, 128, 256)  # miss: the whole window [128, 256) is read
        assert b.window == (0, 128, 256) and at == 2
        assert bytes(b.buf[at : at + 10]) == data[130:140]
        assert b.read(src, 0, 200, 256, 0, 0) == 72  # hit: inside the window, nothing read
        assert b.read(src, 1, 200, 256, 200, 256) == 0 and b.window == (1, 200, 256)  # other file: miss
        # a window larger than the scratch falls back to the span itself
        at = b.read(src, 0, 1000, 1500, 0, 4096)
        assert b.window == (0, 1000, 1500) and bytes(b.buf[at : at + 500]) == data[1000:1500]
        assert b.read(src, 0, 0, 4096, 0, 4096) is None  # even the span does not fit
    finally:
        src.close()


def test_rope_permuted_rows_are_read_once_not_a_window_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RoPE permutation alternates rows half a head apart; each file keeps several windows,
    so the rows are read about once (one window a file re-read a whole window per row: 28x at
    2 GB), and the bytes are torch's permutation split by torch."""
    monkeypatch.setattr(ex, "_RUNS", {})
    monkeypatch.setattr(ex, "_WINDOW", 8192)  # a window: half a head
    heads, hd, d = 4, 64, 128  # 256-byte rows of f16; half a head: 32 rows = 8 KiB
    w = torch.randn(heads * hd, d, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    save_file({"wq": w}, str(tmp_path / "model.safetensors"))
    (tmp_path / "t.yaml").write_text(
        f"transforms:\n  - rope_permute: {{tensors: wq, heads: {heads}, to: meta}}\n"
    )
    (tmp_path / "l.yaml").write_text("mesh: {tp: 2}\nplacements:\n  wq: {tp: S(0)}\n")
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    spec = TargetSpec(layout=str(tmp_path / "l.yaml"), transforms=str(tmp_path / "t.yaml"))
    plan = build_plan(ck, resolve_target(ck, spec))
    read = _run(plan, tmp_path / "out", monkeypatch, group=1, workers=1, buffer_size=1 << 20)
    assert read <= 2 * w.numel() * 2  # about once (windows overlap a little at their ends)
    # meta order: within each head, rows (0, hd/2, 1, hd/2+1, ...), as torchtitan's permute
    meta = w.view(heads, 2, hd // 2, d).transpose(1, 2).reshape(heads * hd, d)
    for r, part in enumerate(torch.chunk(meta, 2)):
        got = load_file(str(tmp_path / "out" / f"rank-{r:05d}-of-00002.safetensors"))["wq"]
        assert torch.equal(got, part)


def test_dcp_ranks_holding_different_tensors_still_read_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP rank files hold different replicated tensors (each saved by one rank, as dcp.save
    does), so the siblings' steps do not line up by count: they are lined up by the plan's
    tensor order, and the column-sharded tensors after them are still read once between the
    ranks (round robin by steps read a Llama's columns 2.2x over)."""
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)
    monkeypatch.setattr(ex, "_WINDOW", 0)
    monkeypatch.setattr(ex, "_SPAN", 0)
    monkeypatch.setattr(ex, "_RUNS", {})
    gen = torch.Generator().manual_seed(2)
    full: dict[str, torch.Tensor] = {}
    for layer in range(6):  # a Llama layer's tensors in name order: norms replicated
        p = f"model.layers.{layer}."
        full[p + "input_layernorm.weight"] = torch.randn(64, generator=gen)
        full[p + "mlp.down_proj.weight"] = torch.randn(64, 512, generator=gen)  # columns
        full[p + "mlp.up_proj.weight"] = torch.randn(128, 64, generator=gen)  # rows
        full[p + "post_attention_layernorm.weight"] = torch.randn(64, generator=gen)
        full[p + "self_attn.o_proj.weight"] = torch.randn(64, 512, generator=gen)  # columns
    save_file(full, str(tmp_path / "model.safetensors"))
    rules = '  "*.down_proj.weight": {tp: S(1)}\n  "*.o_proj.weight": {tp: S(1)}\n  "*norm*": {tp: R}\n'
    (tmp_path / "l.yaml").write_text(f'mesh: {{tp: 8}}\nplacements:\n{rules}  "*": {{tp: S(0)}}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"), to="dcp")))
    lists = {tuple(e.tensor.name for e in f.layout.entries) for f in plan.files}
    assert len(lists) > 1  # the ranks do hold different tensors
    cols = sum(t.numel() * 4 for n, t in full.items() if n.endswith(("down_proj.weight", "o_proj.weight")))
    rest = sum(t.numel() * 4 for t in full.values()) - cols
    lockstep = _run(plan, tmp_path / "lockstep", monkeypatch, group=8, workers=1)
    single = _run(plan, tmp_path / "single", monkeypatch, group=1, workers=1)
    assert single == 8 * cols + rest
    assert lockstep == cols + rest
    for f in plan.files:
        assert (tmp_path / "lockstep" / f.name).read_bytes() == (tmp_path / "single" / f.name).read_bytes()


def test_a_batch_that_had_to_be_halved_caps_the_next_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One source file of many small tensors cut into 8 rank files: a batch of target entries
    reads 8 times its size of source windows, more than the slots keep for the siblings, so
    it is refused and halved. The size that fitted caps the next batches (a refusal costs as
    much as a copy and gathers nothing), so refusals are a few per file, not one or more per
    batch; and the bytes are those of batches never capped (each refused batch retried)."""
    gen = torch.Generator().manual_seed(5)
    full = {f"e{i}": torch.randn(16, 32, generator=gen) for i in range(1500)}
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 8}\nplacements:\n  "*": {tp: S(0)}\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    monkeypatch.setattr(ex, "_SPAN", 16 << 10)  # 8 slots of 16 KiB: 16 KiB of target a batch
    real = ex._Writer._copy_columns
    tries = [0, 0]

    def counting(self, *args):  # type: ignore[no-untyped-def]
        ok = real(self, *args)
        tries[ok] += 1
        return ok

    monkeypatch.setattr(ex._Writer, "_copy_columns", counting)
    (tmp_path / "capped").mkdir()
    ex.execute_plan(plan, tmp_path / "capped", workers=1, buffer_size=64 << 10)
    refused, copied = tries
    assert copied > 8 * 8, tries  # many batches a file
    assert refused <= copied // 4, tries
    monkeypatch.setattr(ex, "_REGROW", 10**9)  # and with every batch tried at its full size first
    monkeypatch.setattr(ex._Writer, "_batches", _uncapped_batches)
    (tmp_path / "full").mkdir()
    ex.execute_plan(plan, tmp_path / "full", workers=1, buffer_size=64 << 10)
    for r in range(8):
        name = f"rank-{r:05d}-of-00008.safetensors"
        assert (tmp_path / "capped" / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
        got = load_file(str(tmp_path / "capped" / name))
        assert all(torch.equal(got[k], v.chunk(8, 0)[r]) for k, v in full.items())


def _uncapped_batches(self, tensors, lo, hi, bad, alone, batch_end, copy):  # type: ignore[no-untyped-def]
    """The batching before caps: every batch first tried at ``batch_end``, halved while refused."""
    import numpy as np

    i = lo
    while i < hi:
        b = int(np.searchsorted(bad, i))
        if b < len(bad) and bad[b] == i:
            yield from alone(i)
            i += 1
            continue
        j = max(i + 1, batch_end(i, b))
        self._flush()
        while not copy(i, j):
            j = i + (j - i) // 2
        yield
        i = j
    self._flush()


def test_consolidating_many_column_shards_takes_large_slabs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP-16 -> one file of a column-split tensor: each slab costs a read_box (and a pread) per
    rank, so slabs are as large as the column buffer (4 write buffers), written in write-buffer
    pieces: 4x fewer read_box calls (TP-64 -> HF of the 2 GB Llama: 2.2 -> 1.0 s of CPU), and
    the same bytes as slabs of one buffer."""
    (tmp_path / "a").mkdir()
    full, plan = _column_sharded_plan(tmp_path / "a", world=16)
    tp16 = _write_tp8(plan, tmp_path / "tp16")
    ck = open_source(SourceSpec(str(tp16)))
    hf = build_plan(ck, resolve_target(ck, TargetSpec(consolidate=True)))
    calls = [0]
    real = ex.read_box

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ex, "read_box", counting)
    monkeypatch.setattr(ex, "_STRIDED_MAX", 0)  # "o" gathered slab by slab, as a large tensor is
    outs = {}
    for wide in (8, 10**9):  # 10**9: never wide (slabs of one write buffer)
        monkeypatch.setattr(ex, "_WIDE", wide)
        calls[0] = 0
        out = tmp_path / f"hf{wide}"
        out.mkdir()
        ex.execute_plan(hf, out, workers=1, buffer_size=1024)
        outs[wide] = (calls[0], (out / "model.safetensors").read_bytes())
    (wide_calls, wide_bytes), (narrow_calls, narrow_bytes) = outs[8], outs[10**9]
    assert wide_bytes == narrow_bytes
    assert torch.equal(load_file(str(tmp_path / "hf8" / "model.safetensors"))["o"], full["o"])
    assert 0 < wide_calls <= narrow_calls // 3, (wide_calls, narrow_calls)
