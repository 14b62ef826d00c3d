"""The planner covers every destination element exactly once, and conversions of real
files round-trip bit for bit against torch's own splitting (the oracle)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch as safetensors_torch
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from reshard.checkpoint import Checkpoint, TensorSource
from reshard.cli import app
from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.errors import PlanError
from reshard.formats import writer
from reshard.formats.per_rank import rank_file_name
from reshard.intervals import block_shape, block_volume, full_block
from reshard.io.header import DTYPE_SIZES
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.placements import Partial, Placement, Replicate, Shard, StridedShard
from reshard.plan import copy_boxes, make_plan, match_blocks, natural_key, natural_sorted
from tests.strategies import (
    examples,
    index_array,
    mesh_shapes,
    meshes,
    placements,
    same_bits,
    tensor_shapes,
    torch_local,
    torch_placements,
)

# --- pure planner properties -------------------------------------------------------


def source_from_layout(name: str, lay: TensorLayout, dtype: str = "F32") -> TensorSource:
    """A TensorSource as formats/per_rank.py builds it for a per-rank checkpoint."""
    coords = list(lay.mesh.coordinates())
    op = lay.partial_op
    return TensorSource(
        name=name,
        dtype=dtype,
        shape=lay.shape,
        piece_files=tuple(range(lay.mesh.size)),
        piece_offsets=tuple(1000 * r for r in range(lay.mesh.size)),
        piece_blocks=lay.blocks(),
        signature=("layout", lay.shape, lay.mesh.shape, lay.placements),
        piece_partials=tuple(lay.partial_index(c) for c in coords) if op else None,
        reduce_op=op,
        placements=lay.placements,
    )


@st.composite
def plan_cases(draw: st.DrawFn, *, max_ranks: int = 16, src_partial: bool = True):
    shape = draw(tensor_shapes(max_numel=1024))
    ma = draw(meshes(max_ranks=max_ranks))
    mb = draw(meshes(max_ranks=max_ranks))
    pa = draw(placements(len(shape), ma.ndim, allow_partial=src_partial))
    pb = draw(placements(len(shape), mb.ndim, allow_partial=False))
    return TensorLayout.make(shape, ma, pa), TensorLayout.make(shape, mb, pb)


def _check_cover(src: TensorSource, dst_blocks, copies, groups: int) -> None:
    """Every element of every destination block is filled exactly once per partial group,
    from a source element with the same global index."""
    for r, dblk in enumerate(dst_blocks):
        dshape = block_shape(dblk)
        counts = np.zeros((groups, *dshape), dtype=np.int64)
        dst_idx = [index_array(il) for il in dblk]
        for c in copies[r]:
            sblk = src.piece_blocks[c.piece]
            if src.piece_partials is not None:
                # the copy's group is the rank of the piece's partial group among all groups
                gids = sorted(
                    {g for g, b in zip(src.piece_partials, src.piece_blocks, strict=True) if block_volume(b)}
                )
                assert gids[c.group] == src.piece_partials[c.piece]
            src_idx = [index_array(il) for il in sblk]
            for s0, d0, size in copy_boxes(c):
                for d in range(len(dshape)):
                    assert src_idx[d][s0[d] : s0[d] + size[d]] == dst_idx[d][d0[d] : d0[d] + size[d]], (
                        f"rank {r} dim {d}: copy maps different global indices"
                    )
                sl = tuple(slice(a, a + n) for a, n in zip(d0, size, strict=True))
                counts[(c.group, *sl)] += 1
        assert (counts == 1).all(), (
            f"destination rank {r}: element covered {counts.min()}..{counts.max()} times"
        )


@settings(max_examples=examples(150))
@given(plan_cases())
@example(
    (
        TensorLayout.make((12, 2), Mesh(("tp",), (4,)), ["_S(0, 2)"]),
        TensorLayout.make((12, 2), Mesh(("tp",), (8,)), ["_S(0, 2)"]),
    )
)
@example(
    (
        TensorLayout.make((10, 4), Mesh(("fsdp", "tp"), (2, 2)), ["_S(0, 2)", "S(0)"]),
        TensorLayout.make((10, 4), Mesh(("tp",), (4,)), ["S(1)"]),
    )
)
def test_match_blocks_covers_every_destination_element_once(case):
    la, lb = case
    src = source_from_layout("t", la)
    copies, groups = match_blocks(src, lb.blocks())
    assert len(copies) == lb.mesh.size
    if math.prod(la.shape) > 0:
        k = math.prod(s for p, s in zip(la.placements, la.mesh.shape, strict=True) if isinstance(p, Partial))
        assert groups == k
    _check_cover(src, lb.blocks(), copies, groups)


@settings(max_examples=examples(60))
@given(plan_cases(src_partial=False), st.data())
def test_match_blocks_refuses_a_source_with_a_hole(case, data):
    la, _ = case
    blocks = la.blocks()
    distinct = sorted({b for b in blocks if block_volume(b)}, key=repr)
    if not distinct:
        return  # an empty tensor has no holes to make
    drop = data.draw(st.sampled_from(distinct))
    keep = [k for k, b in enumerate(blocks) if b != drop]
    src = TensorSource(
        name="t",
        dtype="F32",
        shape=la.shape,
        piece_files=tuple(keep),
        piece_offsets=tuple(0 for _ in keep),
        piece_blocks=tuple(blocks[k] for k in keep),
        signature=("holey", la.shape, tuple(keep)),
    )
    with pytest.raises(PlanError, match="holes"):
        match_blocks(src, [full_block(la.shape)])


@settings(max_examples=examples(60))
@given(plan_cases(src_partial=False))
def test_make_plan_lays_out_each_rank_file(case):
    la, lb = case
    tensors = {
        "a.w": source_from_layout("a.w", la, "F32"),
        "b.w": source_from_layout("b.w", la, "BF16"),
    }
    ckpt = Checkpoint(path="mem", format="per-rank", files=(), file_sizes=(), tensors=tensors, mesh=la.mesh)
    plan = make_plan(ckpt, lb.mesh, lambda name: lb.placements, writer=writer("per-rank"))
    assert [f.name for f in plan.files] == [rank_file_name(r, lb.mesh.size) for r in range(lb.mesh.size)]
    for r, f in enumerate(plan.files):
        assert f.rank == r
        pos = len(f.prefix)
        for e in sorted(f.entries, key=lambda e: e.start):
            assert e.start == pos, "tensor data is packed with no gaps after the header"
            assert e.nbytes == block_volume(lb.blocks()[r]) * DTYPE_SIZES[e.tensor.dtype]
            pos += e.nbytes
        assert pos == f.size
        assert {e.tensor.name for e in f.entries} == set(tensors)
    for t in plan.tensors:
        _check_cover(t.src, t.layout.blocks(), t.copies, t.groups)


# --- real files ----------------------------------------------------------------------


def placement_text(p: Placement, mesh: Mesh, named_sf: bool) -> str:
    """Text form; with ``named_sf`` a split factor equal to a mesh dim's size is written
    as that dim's name (``_S(0, d1)``), which the layout resolves on its mesh."""
    if named_sf and isinstance(p, StridedShard) and p.split_factor in mesh.shape:
        return f"_S({p.dim}, {mesh.names[mesh.shape.index(p.split_factor)]})"
    return str(p)


def layout_yaml(mesh: Mesh, pls: dict[str, tuple[Placement, ...]], *, named_sf: bool = False) -> str:
    sizes = ", ".join(f"{n}: {s}" for n, s in zip(mesh.names, mesh.shape, strict=True))
    lines = [f"mesh: {{{sizes}}}", "placements:"]
    for name, p in pls.items():
        texts = [placement_text(x, mesh, named_sf) for x in p]
        lines.append(f"  {json.dumps(name)}: {json.dumps(texts)}")
    return "\n".join(lines) + "\n"


def write_per_rank(
    directory: Path,
    mesh: Mesh,
    values: dict[str, list[torch.Tensor]],
    pls: dict[str, tuple[Placement, ...]],
) -> None:
    """Per-rank files; ``values[name][g]`` is partial group g's value (one group if no Partial)."""
    directory.mkdir(parents=True)
    for r, coord in enumerate(mesh.coordinates()):
        out = {}
        for name, vals in values.items():
            lay = TensorLayout.make(tuple(vals[0].shape), mesh, pls[name])
            full = vals[lay.partial_index(coord)]
            tp = torch_placements(pls[name], full.ndim)
            out[name] = torch_local(full, mesh.shape, coord, tp).contiguous()
        safetensors_torch.save_file(out, str(directory / rank_file_name(r, mesh.size)))


def check_per_rank(directory: Path, mesh: Mesh, full: dict[str, torch.Tensor], pls) -> None:
    names = sorted(p.name for p in directory.glob("*.safetensors"))
    assert names == [rank_file_name(r, mesh.size) for r in range(mesh.size)]
    for r, coord in enumerate(mesh.coordinates()):
        got = safetensors_torch.load_file(str(directory / rank_file_name(r, mesh.size)))
        assert set(got) == set(full)
        for name, t in full.items():
            want = torch_local(t, mesh.shape, coord, torch_placements(pls[name], t.ndim))
            assert same_bits(got[name], want), f"{directory.name} rank {r} coord {coord} tensor {name}"


def check_consolidated(directory: Path, full: dict[str, torch.Tensor]) -> None:
    got = safetensors_torch.load_file(str(directory / "model.safetensors"))
    assert set(got) == set(full)
    for name, t in full.items():
        assert same_bits(got[name], t), f"{directory.name} tensor {name}"


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def exec_options() -> st.SearchStrategy[dict[str, int]]:
    """Executor options that must not change a byte of output: slab buffer size
    (at least the largest item size) and worker threads."""
    return st.fixed_dictionaries(
        {
            "buffer_size": st.sampled_from([256 * 1024, 8, 16, 24, 40, 64, 4096]),
            "workers": st.sampled_from([1, 3]),
        }
    )


@st.composite
def round_trip_cases(draw: st.DrawFn):
    ma = draw(meshes(max_ranks=8))
    mb = draw(meshes(max_ranks=8))
    sx = draw(tensor_shapes(max_numel=256))
    sy = draw(tensor_shapes(max_numel=256))
    pa = {
        "x": draw(placements(len(sx), ma.ndim, allow_partial=False)),
        "y": draw(placements(len(sy), ma.ndim, allow_partial=False)),
    }
    pb = {
        "x": draw(placements(len(sx), mb.ndim, allow_partial=False)),
        "y": draw(placements(len(sy), mb.ndim, allow_partial=False)),
    }
    seed = draw(st.integers(0, 2**16))
    opts = draw(exec_options())
    return ma, mb, sx, sy, pa, pb, seed, opts, draw(st.booleans())


RT_EXAMPLES = [
    (
        Mesh(("tp",), (4,)),
        Mesh(("tp",), (8,)),
        (10, 3),
        (12, 2),
        {"x": (Shard(0),), "y": (StridedShard(0, 2),)},
        {"x": (Shard(0),), "y": (StridedShard(0, 2),)},
        0,
    ),
    (
        Mesh(("fsdp", "tp"), (2, 2)),
        Mesh(("d0", "d1", "d2"), (2, 1, 3)),
        (13, 7),
        (3,),
        {"x": (StridedShard(0, 2), Shard(0)), "y": (Shard(-1), Replicate())},
        {"x": (Shard(1), Replicate(), StridedShard(-2, 3)), "y": (Replicate(), Shard(0), Shard(0))},
        1,
    ),
]
RT_EXAMPLES = [(*c, {"buffer_size": 16, "workers": 1}, True) for c in RT_EXAMPLES]


@settings(
    max_examples=examples(40),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(round_trip_cases())
@example(RT_EXAMPLES[0])
@example(RT_EXAMPLES[1])
def test_round_trip_real_files_against_torch(case):
    ma, mb, sx, sy, pa, pb, seed, opts, named_sf = case
    g = torch.Generator().manual_seed(seed)
    full = {
        "x": torch.arange(math.prod(sx), dtype=torch.int64).reshape(sx),
        "y": torch.randn(sy, generator=g).to(torch.bfloat16),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.yaml").write_text(layout_yaml(ma, pa, named_sf=named_sf))
        (root / "b.yaml").write_text(layout_yaml(mb, pb, named_sf=named_sf))
        write_per_rank(root / "A", ma, {k: [v] for k, v in full.items()}, pa)

        convert(
            SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
            root / "B",
            TargetSpec(layout=str(root / "b.yaml"), to="per-rank"),
            **opts,
        )
        check_per_rank(root / "B", mb, full, pb)

        # B describes itself: no layout file needed
        convert(SourceSpec(str(root / "B")), root / "HF", TargetSpec(consolidate=True), **opts)
        check_consolidated(root / "HF", full)

        # back to A: the original tensors, and byte-identical files on a second run
        # (with the default executor options: they must not matter either)
        convert(
            SourceSpec(str(root / "B")),
            root / "A1",
            TargetSpec(layout=str(root / "a.yaml"), to="per-rank"),
            **opts,
        )
        check_per_rank(root / "A1", ma, full, pa)
        convert(
            SourceSpec(str(root / "B")),
            root / "A2",
            TargetSpec(layout=str(root / "a.yaml"), to="per-rank"),
        )
        assert file_bytes(root / "A1") == file_bytes(root / "A2")


@st.composite
def target_mesh_cases(draw: st.DrawFn):
    ma = draw(meshes(max_ranks=8))
    mb_shape = draw(mesh_shapes(min_dims=ma.ndim, max_dims=ma.ndim, max_ranks=8))
    shape = draw(tensor_shapes(max_numel=256))
    pa = draw(placements(len(shape), ma.ndim, allow_partial=False))
    return ma, Mesh(ma.names, mb_shape), shape, pa, draw(st.booleans())


@settings(
    max_examples=examples(30),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(target_mesh_cases())
@example(
    (
        Mesh(("fsdp", "tp"), (2, 2)),
        Mesh(("fsdp", "tp"), (2, 4)),
        (10, 4),
        (StridedShard(0, 2), Shard(0)),
        True,
    )
)
@example(
    (
        Mesh(("fsdp", "tp"), (2, 4)),
        Mesh(("fsdp", "tp"), (1, 3)),
        (13,),
        (Shard(0), StridedShard(0, 2)),
        True,
    )
)
def test_target_mesh_reuses_the_source_rules(case):
    """``--target-mesh`` = the source's rules on the resized mesh; a split factor named
    after a mesh dim (``_S(0, tp)``) follows that dim's new size."""
    ma, mb, shape, pa, named_sf = case
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    text = layout_yaml(ma, {"w": pa}, named_sf=named_sf)
    texts = [placement_text(p, ma, named_sf) for p in pa]
    lay_b = TensorLayout.make(shape, mb, texts)  # named split factors bound on the new mesh
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.yaml").write_text(text)
        write_per_rank(root / "A", ma, {"w": [full]}, {"w": pa})
        spec = ",".join(f"{n}={s}" for n, s in zip(mb.names, mb.shape, strict=True))
        convert(
            SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
            root / "B",
            TargetSpec(mesh=spec, to="per-rank"),
        )
        check_per_rank(root / "B", mb, {"w": full}, {"w": lay_b.placements})


# --- Partial sources -------------------------------------------------------------------


@st.composite
def partial_cases(draw: st.DrawFn):
    op = draw(st.sampled_from(["sum", "avg", "max", "min"]))
    ma = draw(meshes(max_ranks=8))
    shape = draw(tensor_shapes(max_numel=256))
    pls = list(draw(placements(len(shape), ma.ndim, reduce_ops=[op])))
    m = draw(st.integers(0, ma.ndim - 1))
    pls[m] = Partial(op)  # at least one Partial mesh dim
    mb = draw(meshes(max_ranks=8))
    pb = draw(placements(len(shape), mb.ndim, allow_partial=False))
    dtype = draw(st.sampled_from([torch.int64, torch.float32]))
    seed = draw(st.integers(0, 2**16))
    return op, ma, shape, tuple(pls), mb, pb, dtype, seed, draw(exec_options())


def partial_values(full: torch.Tensor, k: int, op: str, g: torch.Generator) -> list[torch.Tensor]:
    """k partial values whose reduction by ``op`` is exactly ``full`` (small integers)."""
    noise = [torch.randint(0, 6, tuple(full.shape), generator=g).to(full.dtype) for _ in range(k)]
    if op == "max":
        return [full] + [full - n for n in noise[1:]]
    if op == "min":
        return [full] + [full + n for n in noise[1:]]
    # sum: parts add up to full; avg: parts add up to k * full (exact: small integers)
    target = full if op == "sum" else full * k
    rest = [n - 2 for n in noise[1:]]
    return [target - sum(rest, torch.zeros_like(full))] + rest


@settings(
    max_examples=examples(40),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(partial_cases())
@example(
    (
        "sum",
        Mesh(("tp",), (4,)),
        (5, 3),
        (Partial("sum"),),
        Mesh(("tp",), (1,)),
        (Replicate(),),
        torch.int64,
        0,
        {"buffer_size": 8, "workers": 1},
    )
)
@example(
    (
        "max",
        Mesh(("dp", "tp"), (2, 2)),
        (7,),
        (Partial("max"), Shard(0)),
        Mesh(("tp",), (3,)),
        (Shard(0),),
        torch.float32,
        0,
        {"buffer_size": 16, "workers": 3},
    )
)
@example(
    (
        "avg",
        Mesh(("dp", "tp"), (3, 2)),
        (4, 5),
        (Partial("avg"), StridedShard(1, 2)),
        Mesh(("tp",), (2,)),
        (Shard(1),),
        torch.float32,
        0,
        {"buffer_size": 256 * 1024, "workers": 1},
    )
)
def test_partial_source_reduces_to_the_full_tensor(case):
    op, ma, shape, pls, mb, pb, dtype, seed, opts = case
    g = torch.Generator().manual_seed(seed)
    full = torch.arange(math.prod(shape)).reshape(shape).to(dtype) - 3
    k = math.prod(s for p, s in zip(pls, ma.shape, strict=True) if isinstance(p, Partial))
    parts = partial_values(full, k, op, g)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.yaml").write_text(layout_yaml(ma, {"w": pls}))
        (root / "b.yaml").write_text(layout_yaml(mb, {"w": pb}))
        write_per_rank(root / "A", ma, {"w": parts}, {"w": pls})
        if op == "avg" and not dtype.is_floating_point and k > 1:  # torch refuses it: so does reshard
            with pytest.raises(PlanError, match=r"Partial\(avg\)"):
                convert(
                    SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
                    root / "HF",
                    TargetSpec(consolidate=True),
                    **opts,
                )
            return
        convert(
            SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
            root / "HF",
            TargetSpec(consolidate=True),
            **opts,
        )
        check_consolidated(root / "HF", {"w": full})
        convert(
            SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
            root / "B",
            TargetSpec(layout=str(root / "b.yaml"), to="per-rank"),
            **opts,
        )
        check_per_rank(root / "B", mb, {"w": full}, {"w": pb})


def _refused(tmp_path: Path, src_pls: tuple[Placement, ...], layout_text: str | None, *extra: str) -> None:
    mesh = Mesh(("tp",), (2,))
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    (tmp_path / "a.yaml").write_text(layout_yaml(mesh, {"w": src_pls}))
    write_per_rank(tmp_path / "A", mesh, {"w": [full, full]}, {"w": src_pls})
    args = [
        "convert",
        str(tmp_path / "A"),
        str(tmp_path / "B"),
        "--source-layout",
        str(tmp_path / "a.yaml"),
    ]
    if layout_text is not None:
        (tmp_path / "b.yaml").write_text(layout_text)
        args += ["--target-layout", str(tmp_path / "b.yaml")]
    res = CliRunner().invoke(app, args + list(extra))
    assert res.exit_code == 2, res.output
    assert "Partial" in res.output
    dst = tmp_path / "B"
    assert not dst.exists() or not any(dst.iterdir()), "nothing may be written"


@pytest.mark.parametrize("target", ["P(sum)", "Partial(max)", "P", "Partial()"])
def test_partial_target_layout_is_refused_with_exit_code_2(tmp_path, target):
    _refused(tmp_path, (Shard(0),), f'mesh: {{tp: 2}}\nplacements:\n  "w": [{json.dumps(target)}]\n')


def test_partial_source_rules_reused_on_a_target_mesh_are_refused_with_exit_code_2(tmp_path):
    # --target-mesh reuses the source rules, P(sum) included: a Partial target
    _refused(tmp_path, (Partial("sum"),), None, "--target-mesh", "tp=4")


def test_partial_target_is_refused_by_the_planner():
    lay = TensorLayout.make((4,), Mesh(("tp",), (2,)), ["S(0)"])
    src = source_from_layout("w", lay)
    ckpt = Checkpoint(
        path="mem", format="per-rank", files=(), file_sizes=(), tensors={"w": src}, mesh=lay.mesh
    )
    with pytest.raises(PlanError, match="Partial"):
        make_plan(ckpt, Mesh(("tp",), (2,)), lambda name: ["P(sum)"], writer=writer("per-rank"))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.text(alphabet="a._-/Z~ 0123456789", max_size=10), min_size=0, max_size=40),
    st.integers(0, 2**32 - 1),
)
def test_natural_sorted_is_the_natural_key_order(names, seed):
    """The byte-key sort of many names (numpy) is ``sorted(key=natural_key)``: digit runs of
    different widths, leading zeros (equal numbers keep their order), text parts that are
    prefixes of others ('.' sorts below digits as text, above them as the end of a part)."""
    import random

    rng = random.Random(seed)
    noise = ("".join(rng.choice("ab.0123456789_") for _ in range(rng.randint(0, 9))) for _ in range(3000))
    many = names + list(noise)
    rng.shuffle(many)
    assert natural_sorted(many) == sorted(many, key=natural_key)
    assert natural_sorted(names) == sorted(names, key=natural_key)
    import reshard.plan as plan_module

    chunk = plan_module._KEY_CHUNK
    plan_module._KEY_CHUNK = rng.randint(1, 900)  # keyed in chunks: every key padded to the widest run of all
    try:
        assert natural_sorted(many) == sorted(many, key=natural_key)
    finally:
        plan_module._KEY_CHUNK = chunk
