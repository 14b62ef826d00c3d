"""The one rule by which --source-mesh and --target-mesh override a layout's mesh (Mesh.with_sizes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from reshard.convert import SourceSpec, TargetSpec, open_source, resolve_target
from reshard.mesh import Mesh, parse_mesh_spec

DIMS = ("pp", "dp", "fsdp", "ep", "tp", "cp")


@pytest.mark.parametrize(
    ("layout", "override", "want"),
    [
        ("tp=4,fsdp=2", "fsdp=2,tp=4", "fsdp=2,tp=4"),  # every dim named: the written order
        ("fsdp=2,tp=4", "tp=8", "fsdp=2,tp=8"),
        ("fsdp=2,tp=4", "tp=1", "fsdp=2,tp=1"),  # collapsed, still a dim
        ("tp=4", "fsdp=2,tp=4", "fsdp=2,tp=4"),  # a new dim written before tp goes before it
        ("tp=4", "tp=4,ep=2", "tp=4,ep=2"),  # ... written after the last named dim goes after it
        ("tp=4", "ep=2", "tp=4,ep=2"),  # no layout dim named: appended innermost
        ("pp=2,tp=4", "fsdp=2,tp=4", "pp=2,fsdp=2,tp=4"),  # pp not named: stays outermost
        ("fsdp=2,dp=3,tp=4", "tp=2,fsdp=4", "tp=2,dp=3,fsdp=4"),  # dp keeps its position
    ],
)
def test_examples(layout: str, override: str, want: str) -> None:
    base = parse_mesh_spec(layout)
    mesh = Mesh(tuple(base), tuple(base.values()))
    assert str(mesh.with_sizes(parse_mesh_spec(override))) == want


@st.composite
def mesh_and_override(draw: st.DrawFn) -> tuple[Mesh, dict[str, int]]:
    names = draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=4, unique=True))
    shape = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
    mesh = Mesh(tuple(names), tuple(shape))
    keys = draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=5, unique=True))
    return mesh, {k: draw(st.integers(1, 4)) for k in keys}


@given(mesh_and_override())
def test_rule_properties(case: tuple[Mesh, dict[str, int]]) -> None:
    mesh, sizes = case
    out = mesh.with_sizes(sizes)
    own = dict(zip(mesh.names, mesh.shape, strict=True))
    written = list(sizes)
    named = [n for n in written if n in mesh.names]
    # every dim of either, once, with the override's size where it names one
    assert dict(zip(out.names, out.shape, strict=True)) == {**own, **sizes}
    assert len(out.names) == len(set(mesh.names) | set(sizes))
    # the override's dims appear in its written order
    assert [n for n in out.names if n in sizes] == written
    # dims it does not name keep their position among the layout's dims
    slots = ["*" if n in sizes else n for n in mesh.names]
    assert ["*" if n in sizes else n for n in out.names if n in mesh.names] == slots
    # a new dim sits with the next layout dim written after it (else the last one before it)
    for k, n in enumerate(written):
        if n in mesh.names:
            continue
        after = [m for m in written[k:] if m in mesh.names]
        before = [m for m in written[:k] if m in mesh.names]
        if after:
            run = written[k : written.index(after[0]) + 1]
            assert list(out.names[out.names.index(n) :][: len(run)]) == run
        elif before:
            run = written[written.index(before[-1]) : k + 1]
            assert list(out.names[: out.names.index(n) + 1][-len(run) :]) == run
    if not named:  # appended innermost
        assert out.names == mesh.names + tuple(written)
    if set(mesh.names) <= set(sizes):  # names every dim: exactly the written order
        assert out.names == tuple(written)


def test_source_and_target_options_give_the_same_mesh(tmp_path: Path) -> None:
    """open_source (--source-mesh) and resolve_target (--target-mesh) share the rule."""
    layout = tmp_path / "l.yaml"
    layout.write_text('mesh: {tp: 4, fsdp: 2}\nplacements:\n  "*": R\n')
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(8):
        save_file({"w": np.zeros(2, np.float32)}, str(ranks / f"rank-{r:05d}-of-00008.safetensors"))
    src = open_source(SourceSpec(str(ranks), "per-rank", str(layout), "fsdp=2,tp=4"))
    target = resolve_target(src, TargetSpec(str(layout), "fsdp=2,tp=4"))
    assert src.mesh == target.mesh == Mesh(("fsdp", "tp"), (2, 4))
    assert src.layout is not None and src.layout.mesh == src.mesh
    again = resolve_target(src, TargetSpec(None, "fsdp=2,tp=4"))  # the source's rules, re-meshed
    assert again.mesh == src.mesh
