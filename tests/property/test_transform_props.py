"""Random transform chains: parts executed by numpy equal torch ops; spec then inverse is the identity.

Chains are built one operation at a time from the tensors the chain has so far
(split/concat families, stacks of equal shapes, RoPE with a head count that
fits, pads, transposes, ties), over small shapes including empty dims.
"""

from __future__ import annotations

import tempfile
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard.convert import SourceSpec, TargetSpec, convert
from reshard.indexmap import (
    Seg,
    compose,
    compose_dim,
    identity_part,
    index_list_segs,
    localize,
    merge_parts,
    normalize_segs,
)
from reshard.intervals import IndexList, Interval
from reshard.transforms import (
    Concat,
    Drop,
    NamePattern,
    Op,
    Pad,
    Rename,
    RopePermute,
    Split,
    Stack,
    Tie,
    TransformedTensor,
    TransformSpec,
    Transpose,
    Unpad,
    Unstack,
    apply,
    inverse,
)
from tests.property.test_plan_props import check_per_rank, layout_yaml, write_per_rank
from tests.strategies import examples, meshes, placements
from tests.transform_ref import arange_sources, materialise, run_spec, seg_array, torch_apply

SIZES = (1, 2, 3, 4, 6, 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n else [1, 2]


@st.composite
def _split(draw: st.DrawFn, name: str, shape: tuple[int, ...], k: int) -> Op | None:
    if not shape:
        return None
    d = draw(st.integers(0, len(shape) - 1))
    g = draw(st.sampled_from(_divisors(shape[d])))
    per = shape[d] // g
    parts = draw(st.integers(2, 3))
    cuts = sorted(draw(st.lists(st.integers(0, per), min_size=parts - 1, max_size=parts - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, per])]
    return Split(
        NamePattern(name), tuple(f"p{k}_{i}" for i in range(parts)), d, g, tuple(s * g for s in sizes)
    )


def _families(state: dict[str, tuple[int, ...]]) -> list[tuple[int, list[str]]]:
    """(dim, tensors that agree on every other dim): candidates for concat along dim."""
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for n, s in sorted(state.items()):
        for d in range(len(s)):
            groups.setdefault((d, s[:d] + s[d + 1 :]), []).append(n)
    return [(d, names) for (d, _), names in sorted(groups.items()) if len(names) > 1]


@st.composite
def _concat(draw: st.DrawFn, state: dict[str, tuple[int, ...]], k: int) -> Op | None:
    fams = _families(state)
    if not fams:
        return None
    d, fam = draw(st.sampled_from(fams))
    members = draw(st.lists(st.sampled_from(fam), min_size=2, max_size=3, unique=True))
    shapes = [state[m] for m in members]
    common = [g for g in range(1, 7) if all(s[d] % g == 0 for s in shapes)]
    g = draw(st.sampled_from(common))
    return Concat(tuple(NamePattern(m) for m in members), f"c{k}", d, g, tuple(s[d] for s in shapes))


@st.composite
def _stack(draw: st.DrawFn, state: dict[str, tuple[int, ...]], k: int) -> list[Op]:
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for n, s in sorted(state.items()):
        by_shape.setdefault(s, []).append(n)
    shape, names = draw(st.sampled_from(sorted(by_shape.items())))
    members = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    pairs = tuple((NamePattern(m), f"s{k}.{e}") for e, m in enumerate(members))
    d = draw(st.integers(0, len(shape)))
    return [Rename(pairs), Stack(NamePattern(f"s{k}.{{e}}"), f"s{k}", "e", d, len(members))]


@st.composite
def _in_place(draw: st.DrawFn, name: str, shape: tuple[int, ...], k: int, lossy: bool) -> Op | None:
    kinds = ["pad", "rope", "transpose", "tie", "unstack"] + (["unpad", "drop"] if lossy else [])
    kind = draw(st.sampled_from(kinds))
    pat = NamePattern(name)
    if kind == "tie":
        return Tie(pat, f"tie{k}")
    if kind == "drop":
        return Drop(pat)
    if not shape:
        return None
    d = draw(st.integers(0, len(shape) - 1))
    n = shape[d]
    if kind == "pad":
        return Pad(pat, d, multiple=draw(st.integers(1, 4)), size=n)
    if kind == "unpad":
        return Unpad(pat, d, size=draw(st.integers(0, n)), padded_size=n)
    if kind == "unstack":
        return Unstack(pat, f"u{k}.{{e}}", "e", d, n) if 0 < n <= 4 else None
    if kind == "transpose":
        return Transpose(pat, (d, draw(st.integers(0, len(shape) - 1))))
    heads = [h for h in _divisors(n) if n % (2 * h) == 0] if n else [1]
    if not heads:
        return None
    return RopePermute(pat, draw(st.sampled_from(heads)), draw(st.sampled_from(["hf", "meta"])), d)


@st.composite
def chains(draw: st.DrawFn, lossy: bool = False) -> tuple[dict[str, tuple[int, ...]], TransformSpec]:
    count = draw(st.integers(1, 3))
    shapes = {
        f"t{i}": tuple(draw(st.lists(st.sampled_from(SIZES), min_size=0, max_size=3))) for i in range(count)
    }
    ops: list[Op] = []
    state = dict(shapes)
    for k in range(draw(st.integers(1, 8))):  # attempts; some draw an op that does not fit
        kind = draw(
            st.sampled_from(["split", "concat", "stack", "in_place", "in_place", "in_place", "rename"])
        )
        name = draw(st.sampled_from(sorted(state))) if state else None
        new: list[Op | None]
        if name is None:
            break
        if kind == "split":
            new = [draw(_split(name, state[name], k))]
        elif kind == "concat":
            new = [draw(_concat(state, k))]
        elif kind == "stack":
            new = list(draw(_stack(state, k)))
        elif kind == "rename":
            new = [Rename(((NamePattern(name), f"r{k}"),))]
        else:
            new = [draw(_in_place(name, state[name], k, lossy))]
        if any(op is None for op in new):
            continue
        ops.extend(op for op in new if op is not None)
        out = apply(TransformSpec(tuple(ops), allow_unused=True), shapes)
        state = {n: t.shape for n, t in out.items()}
    return shapes, TransformSpec(tuple(ops), allow_unused=True, source="chain")


@given(chains(lossy=True))
def test_parts_executed_by_numpy_equal_torch_ops(
    case: tuple[dict[str, tuple[int, ...]], TransformSpec],
) -> None:
    shapes, spec = case
    src = arange_sources(shapes)
    got = run_spec(spec, src)
    want = torch_apply(spec, {n: torch.from_numpy(a) for n, a in src.items()})
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == tuple(t.shape), name
        assert got[name].tobytes() == t.contiguous().numpy().tobytes(), name


@given(chains())
def test_spec_then_inverse_is_identity(case: tuple[dict[str, tuple[int, ...]], TransformSpec]) -> None:
    shapes, spec = case
    src = arange_sources(shapes)
    fwd = run_spec(spec, src)
    back = run_spec(inverse(spec), fwd)
    assert sorted(back) == sorted(src)
    for name in src:
        assert back[name].tobytes() == src[name].tobytes() and back[name].shape == src[name].shape, name
    # and as maps: composing the two resolutions leaves one identity part per tensor
    there = apply(spec, shapes)
    again = apply(inverse(spec), {n: t.shape for n, t in there.items()})
    inner = {n: t.parts for n, t in there.items()}
    for name, t in again.items():
        parts = merge_parts([c for p in t.parts for c in compose(p, inner)])
        want = (identity_part(name, shapes[name]),) if np.prod(shapes[name]) else ()
        assert parts == want, name


@st.composite
def segs(draw: st.DrawFn, extent: int) -> tuple[Seg, ...]:
    """A random bijection on range(extent) as strided segments (a permutation cut into progressions)."""
    perm = draw(st.permutations(range(extent)))
    out = [Seg(t, s, 1) for t, s in enumerate(perm)]
    return normalize_segs(out)


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(segs(n), segs(n))))
def test_compose_dim_is_function_composition(pair: tuple[tuple[Seg, ...], tuple[Seg, ...]]) -> None:
    outer, inner = pair
    f = dict(zip(seg_array(outer, False).tolist(), seg_array(outer, True).tolist()))
    g = dict(zip(seg_array(inner, False).tolist(), seg_array(inner, True).tolist()))
    h = compose_dim(outer, inner)
    got = dict(zip(seg_array(h, False).tolist(), seg_array(h, True).tolist()))
    assert got == {t: g[f[t]] for t in f}
    assert len(h) <= len(outer) * len(inner)


def _index_list(indices: list[int]) -> IndexList:
    out: list[Interval] = []
    for i in indices:
        if out and out[-1].stop == i:
            out[-1] = Interval(out[-1].start, i + 1)
        else:
            out.append(Interval(i, i + 1))
    return tuple(out)


@st.composite
def _cuts(draw: st.DrawFn, shape: tuple[int, ...], most: int) -> list[list[int]]:
    """Per dim, a chunk id per index (any pattern, like strided shards): the chunks tile the dim."""
    return [draw(st.lists(st.integers(0, most - 1), min_size=n, max_size=n)) for n in shape]


def _blocks(cuts: list[list[int]], most: int) -> list[tuple[IndexList, ...]]:
    per_dim = [[[i for i, c in enumerate(ids) if c == k] for k in range(most)] for ids in cuts]
    return [tuple(_index_list(ix) for ix in combo) for combo in product(*per_dim)]


@given(chains(lossy=True), st.data())
def test_localized_parts_fill_any_target_block_from_any_pieces(
    case: tuple[dict[str, tuple[int, ...]], TransformSpec], data: st.DataObject
) -> None:
    """The planner's step: target block x source pieces through the parts == slicing the full result."""
    shapes, spec = case
    src = arange_sources(shapes)
    pieces: dict[str, np.ndarray] = {}
    piece_blocks: dict[str, list[tuple[str, tuple[IndexList, ...]]]] = {}
    for name, shape in shapes.items():
        for k, blk in enumerate(_blocks(data.draw(_cuts(shape, 2)), 2)):
            key = f"{name}#{k}"
            pieces[key] = src[name][np.ix_(*[seg_array(index_list_segs(il), True) for il in blk])]
            piece_blocks.setdefault(name, []).append((key, blk))
    for name, t in apply(spec, shapes, dtypes={n: str(a.dtype) for n, a in src.items()}).items():
        full = materialise(t, src)
        block = _blocks(data.draw(_cuts(t.shape, 2)), 2)[0]
        local = [
            c
            for p in t.parts
            for key, blk in (piece_blocks[p.source] if p.source else [("zeros", None)])
            if (c := localize(p, block, blk, key)) is not None
        ]
        idx = [seg_array(index_list_segs(il), True) for il in block]
        shape = tuple(len(i) for i in idx)
        got = materialise(TransformedTensor(name, shape, t.dtype, tuple(local)), pieces)
        want = full[np.ix_(*idx)] if idx else full
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


# -- composed with placements: real files through convert, against torch ---------------------


@st.composite
def placed_chains(draw: st.DrawFn) -> tuple[Any, ...]:
    """A chain of transforms, a source mesh and layout per source tensor, a target mesh and layout
    per target tensor."""
    shapes, spec = draw(chains(lossy=True))
    targets = apply(spec, shapes)
    assume(targets)  # a chain that drops everything has no target layout to write
    ma, mb = draw(meshes(max_dims=2, max_ranks=4)), draw(meshes(max_dims=2, max_ranks=4))
    pa = {n: draw(placements(len(s), ma.ndim, allow_partial=False)) for n, s in shapes.items()}
    pb = {n: draw(placements(len(t.shape), mb.ndim, allow_partial=False)) for n, t in targets.items()}
    opts = draw(
        st.fixed_dictionaries(
            {"buffer_size": st.sampled_from([16, 40, 4096]), "workers": st.sampled_from([1, 2])}
        )
    )
    return shapes, spec, ma, pa, mb, pb, opts


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed_chains())
def test_transforms_composed_with_placements_match_torch(case: tuple[Any, ...]) -> None:
    """Random transforms between random source and target placements, streamed in one convert:
    each target rank file equals torch's split (``distribute_tensor``'s ``_split_tensor``) of the
    transform applied to the full tensors with torch ops."""
    shapes, spec, ma, pa, mb, pb, opts = case
    full = {n: torch.from_numpy(a) for n, a in arange_sources(shapes).items()}
    want = torch_apply(spec, full)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.yaml").write_text(layout_yaml(ma, pa))
        (root / "b.yaml").write_text(layout_yaml(mb, pb))
        (root / "t.yaml").write_text(yaml.safe_dump(spec.to_json()))
        write_per_rank(root / "A", ma, {k: [v] for k, v in full.items()}, pa)
        convert(
            SourceSpec(str(root / "A"), layout=str(root / "a.yaml")),
            root / "B",
            TargetSpec(layout=str(root / "b.yaml"), to="per-rank", transforms=str(root / "t.yaml")),
            **opts,
        )
        # fresh row-major strides (torch.stack of one-element tensors can leave 0 strides)
        dense = {n: torch.empty(t.shape, dtype=t.dtype).copy_(t) for n, t in want.items()}
        check_per_rank(root / "B", mb, dense, pb)
