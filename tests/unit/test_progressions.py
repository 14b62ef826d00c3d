"""Rows that form progressions (a RoPE permutation's) copied as strided runs, and entries of
interleaved runs larger than the write buffer copied a buffer of whole rows at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import reshard.execute as ex
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from tests.strategies import examples
from tests.unit.test_lockstep import _run


def _rows(runs: list[ex.Run] | tuple[ex.Run, ...]) -> list[tuple[int, int, int, int]]:
    """Every row of ``runs`` as (target offset, piece, source offset, bytes), sorted."""
    return sorted((d + j * ds, k, s + j * ss, n) for d, k, s, n, rows, ss, ds in runs for j in range(rows))


@st.composite
def permuted_rows(draw: st.DrawFn) -> tuple[list[ex.Run], int]:
    """One-row runs of ``n`` bytes filling a target entry from rows of a source piece in some
    order: RoPE's per-head interleave, its inverse, or a random permutation."""
    n = draw(st.sampled_from([2, 4, 12]))
    heads, half = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    hd = 2 * half
    kind = draw(st.sampled_from(["meta", "hf", "random"]))
    order: list[int] = []
    for h in range(heads):
        if kind == "meta":  # target row 2i + k <- source row k*half + i
            order += [h * hd + k * half + i for i in range(half) for k in (0, 1)]
        else:
            order += [h * hd + 2 * i + k for k in (0, 1) for i in range(half)]
    if kind == "random":
        order = draw(st.permutations(order))
    return [(t * n, 0, s * n, n, 1, 0, 0) for t, s in enumerate(order)], n


@settings(max_examples=examples(200), deadline=None)
@given(permuted_rows(), st.integers(0, 64))
def test_progressions_and_chunks_keep_every_row(case: tuple[list[ex.Run], int], extra: int) -> None:
    """Folding rows into strided runs and cutting an entry into buffers of whole rows move the
    same bytes from the same places: each row once, each chunk within the buffer."""
    runs, n = case
    folded = ex._progressions(list(runs))
    assert _rows(folded) == _rows(runs)
    assert all(r[4] == 1 or (r[5] >= n and r[6] >= n) for r in folded)
    nbytes = n * len(runs)
    cap = n + extra
    chunks = ex._chunks(folded, nbytes, cap)
    assert chunks is not None
    at, back = 0, []
    for start, part, size in chunks:
        assert start == at and 0 < size <= cap
        assert all(0 <= d and d + (rows - 1) * ds + m <= size for d, _, _, m, rows, _, ds in part)
        back += [(start + d, k, s, m) for d, k, s, m in _rows(part)]
        at += size
    assert at == nbytes and sorted(back) == _rows(runs)


def test_a_rope_head_folds_into_two_runs_and_a_strided_row_larger_than_the_buffer_is_gathered() -> None:
    half, n = 8, 16
    order = [k * half + i for i in range(half) for k in (0, 1)]
    meta = [(t * n, 0, s * n, n, 1, 0, 0) for t, s in enumerate(order)]
    folded = ex._progressions(meta)
    assert folded == [(0, 0, 0, n, half, n, 2 * n), (n, 0, half * n, n, half, n, 2 * n)]
    assert ex._chunks(folded, 2 * half * n, n - 1) is None  # a row does not fit: the gather path
    contiguous = [(0, 0, 0, 100, 1, 0, 0)]  # one contiguous run is cut anywhere
    cut = ex._chunks(contiguous, 100, 32) or ()
    assert [(a, size) for a, _, size in cut] == [(0, 32), (32, 32), (64, 32), (96, 4)]


@pytest.mark.parametrize("to", ["meta", "hf"])
@pytest.mark.parametrize("workers", [1, 2])
def test_rope_blocks_larger_than_the_buffer_are_copied_in_buffers_of_whole_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, workers: int
) -> None:
    """A TP-2 block of a RoPE-permuted q (16 KiB) with a 2 KiB write buffer: a buffer of whole
    rows at a time through the queue (never the per-box gather path), the source read once a
    rank file, and the bytes are torch's permutation split by torch."""
    monkeypatch.setattr(ex, "_RUNS", {})
    monkeypatch.setattr(ex, "_CHUNKS", {})

    def no_gather(*args: object, **kwargs: object) -> None:
        raise AssertionError("gathered box by box")

    monkeypatch.setattr(ex._Writer, "_gather", no_gather)
    heads, hd, d = 4, 32, 64  # 128-byte rows of f16; a head 4 KiB
    w = torch.randn(heads * hd, d, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    save_file({"wq": w}, str(tmp_path / "model.safetensors"))
    rule = f"rope_permute: {{tensors: wq, heads: {heads}, to: {to}}}"
    (tmp_path / "t.yaml").write_text(f"transforms:\n  - {rule}\n")
    (tmp_path / "l.yaml").write_text("mesh: {tp: 2}\nplacements:\n  wq: {tp: S(0)}\n")
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    spec = TargetSpec(layout=str(tmp_path / "l.yaml"), transforms=str(tmp_path / "t.yaml"))
    plan = build_plan(ck, resolve_target(ck, spec))
    read = _run(plan, tmp_path / "out", monkeypatch, group=1, workers=workers, buffer_size=2048)
    assert read <= 2 * (tmp_path / "model.safetensors").stat().st_size  # a rank file: the source once
    if to == "meta":  # torchtitan's _reverse_permute: rows (0, hd/2, 1, hd/2 + 1, ...) of each head
        want = w.view(heads, 2, hd // 2, d).transpose(1, 2).reshape(heads * hd, d)
    else:  # torchtitan's _permute
        want = w.view(heads, hd // 2, 2, d).transpose(1, 2).reshape(heads * hd, d)
    for r, part in enumerate(torch.chunk(want, 2)):
        got = load_file(str(tmp_path / "out" / f"rank-{r:05d}-of-00002.safetensors"))["wq"]
        assert torch.equal(got, part)
