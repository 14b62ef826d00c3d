"""A numpy reference executor for transform parts (tests only, not in the package).

It materialises each target tensor from full source arrays by walking the
parts' index maps with numpy fancy indexing, and counts how often every target
element is written: each must be written exactly once (tiling). The tests
compare its output with the same transform done by torch ops on full tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from reshard.indexmap import Part, Seg
from reshard.transforms import TransformedTensor, TransformSpec, apply

__all__ = ["seg_array", "materialise", "run_spec", "arange_sources", "torch_apply"]


def seg_array(segs: tuple[Seg, ...], src: bool) -> np.ndarray:
    """Target (``src=False``) or source indices of a dim map, in segment order."""
    if not segs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(
        [
            (s.src if src else s.dst)
            + (s.src_step if src else s.dst_step) * np.arange(s.size, dtype=np.int64)
            for s in segs
        ]
    )


def _fill_part(out: np.ndarray, hits: np.ndarray, part: Part, sources: Mapping[str, np.ndarray]) -> None:
    t_idx = [seg_array(d.segs, src=False) for d in part.dims]
    grid = np.ix_(*t_idx) if t_idx else ()
    hits[grid] += 1
    if part.source is None:
        out[grid] = 0
        return
    src = sources[part.source]
    index: list[Any] = [None] * src.ndim
    for s, i in part.fixed:
        index[s] = i
    walked = sorted((d.src_dim, t) for t, d in enumerate(part.dims) if d.src_dim is not None)
    mesh = np.ix_(*[seg_array(part.dims[t].segs, src=True) for _, t in walked]) if walked else ()
    for (s, _), ix in zip(walked, mesh):
        index[s] = ix
    assert all(x is not None for x in index), "a source dim is neither walked nor fixed"
    vals = np.asarray(src[tuple(index)])
    # vals has the walked dims in source order: put them in target order, new dims of size 1
    vals = np.transpose(vals, np.argsort([t for _, t in walked]))
    vals = vals.reshape(tuple(len(x) if d.src_dim is not None else 1 for x, d in zip(t_idx, part.dims)))
    out[grid] = np.broadcast_to(vals, tuple(len(x) for x in t_idx))


def materialise(t: TransformedTensor, sources: Mapping[str, np.ndarray]) -> np.ndarray:
    """The target tensor ``t`` built from full source arrays; asserts every element is written once."""
    dtype = np.dtype(t.dtype or next((sources[p.source].dtype for p in t.parts if p.source), "float32"))
    out = np.full(t.shape, -1, dtype=dtype) if dtype.kind in "iu" else np.full(t.shape, np.nan, dtype=dtype)
    hits = np.zeros(t.shape, dtype=np.int64)
    for p in t.parts:
        _fill_part(out, hits, p, sources)
    assert (hits == 1).all(), f"{t.name}: elements written {sorted(set(hits.ravel().tolist()))} times"
    return out


def run_spec(
    spec: TransformSpec, sources: Mapping[str, np.ndarray], config: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """Apply ``spec`` to full source arrays through the parts (the reference for the streaming path)."""
    dtypes = {n: str(a.dtype) for n, a in sources.items()}
    out = apply(spec, {n: a.shape for n, a in sources.items()}, dtypes=dtypes, config=config)
    return {n: materialise(t, sources) for n, t in out.items()}


def arange_sources(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Sources whose every element is distinct across all tensors (so a misplaced element shows)."""
    out, base = {}, 0
    for name in sorted(shapes):
        n = int(np.prod(shapes[name], dtype=np.int64))
        out[name] = (np.arange(n, dtype=np.int64) + base).reshape(shapes[name])
        base += n
    return out


def torch_apply(
    spec: TransformSpec, tensors: Mapping[str, Any], config: Mapping[str, Any] | None = None
) -> dict:
    """The same transforms done by torch ops on full tensors (cat, split, stack, unbind, view+transpose, pad).

    Names are matched with the spec's own patterns; the tensor work is torch's.
    """
    import torch

    from reshard import transforms as tr

    env = tr._Env(dict(spec.config), config or {})
    state = dict(tensors)
    for op in spec.ops:
        new = dict(state)
        when = getattr(op, "when", None)  # a tie for tied models only: the config's yes/no
        if when is not None and not env.flag(when):
            continue
        if isinstance(op, tr.Rename):
            for name in sorted(state):
                for pat, tpl in op.pairs:
                    m = pat.match(name)
                    if m is not None:
                        del new[name]
                        new[tr._fill(tpl, m)] = state[name]
                        break
        elif isinstance(op, (tr.Drop, tr.Untie)):
            for name in sorted(state):
                if (op.tensors if isinstance(op, tr.Drop) else op.tensor).match(name):
                    del new[name]
        elif isinstance(op, tr.Tie):
            for name in sorted(state):
                m = op.source.match(name)
                if m:
                    new[tr._fill(op.target, m)] = state[name].clone()
        elif isinstance(op, tr.Concat):
            for name in sorted(state):
                m = op.sources[0].match(name)
                if m is None:
                    continue
                names = [name] + [tr._fill(p.text, m) for p in op.sources[1:]]
                xs = [new.pop(n) for n in names]
                d, g = op.dim % xs[0].dim(), env.eval(op.groups)
                grouped = [x.reshape(*x.shape[:d], g, x.shape[d] // g, *x.shape[d + 1 :]) for x in xs]
                y = torch.cat(grouped, dim=d + 1)
                total = sum(x.shape[d] for x in xs)
                new[tr._fill(op.target, m)] = y.reshape(*xs[0].shape[:d], total, *xs[0].shape[d + 1 :])
        elif isinstance(op, tr.Split):
            for name in sorted(state):
                m = op.source.match(name)
                if m is None:
                    continue
                x = new.pop(name)
                d, g = op.dim % x.dim(), env.eval(op.groups)
                sizes = (
                    [env.eval(s) for s in op.sizes]
                    if op.sizes
                    else [x.shape[d] // len(op.targets)] * len(op.targets)
                )
                xg = x.reshape(*x.shape[:d], g, x.shape[d] // g, *x.shape[d + 1 :])
                for tpl, piece, n in zip(
                    op.targets, torch.split(xg, [s // g for s in sizes], dim=d + 1), sizes
                ):
                    new[tr._fill(tpl, m)] = piece.reshape(*x.shape[:d], n, *x.shape[d + 1 :])
        elif isinstance(op, tr.Stack):
            groups: dict[str, dict[int, str]] = {}
            for name in sorted(state):
                m = op.source.match(name)
                if m:
                    groups.setdefault(tr._fill(op.target, m), {})[int(m.group(op.index))] = name
            for target, members in groups.items():
                xs = [new.pop(members[e]) for e in sorted(members)]
                new[target] = torch.stack(xs, dim=op.dim % (xs[0].dim() + 1))
        elif isinstance(op, tr.Unstack):
            for name in sorted(state):
                m = op.source.match(name)
                if m:
                    x = new.pop(name)
                    for e, piece in enumerate(torch.unbind(x, dim=op.dim % x.dim())):
                        new[tr._fill(op.target, m, {op.index: str(e)})] = piece
        else:
            for name in sorted(state):
                if op.tensors.match(name):
                    new[name] = _torch_in_place(op, state[name], env)
        state = new
    return state


def _torch_in_place(op: Any, x: Any, env: Any) -> Any:
    import torch

    from reshard import transforms as tr

    if isinstance(op, tr.Transpose):
        return x.transpose(*op.dims).contiguous()
    d = op.dim % x.dim()
    if isinstance(op, tr.RopePermute):
        h = env.eval(op.heads)
        w = x.movedim(d, 0)
        rest = tuple(w.shape[1:])
        if op.to == "hf":  # torchtitan _permute
            w = w.reshape(h, w.shape[0] // h // 2, 2, *rest).transpose(1, 2)
        else:  # torchtitan _reverse_permute
            w = w.reshape(h, 2, w.shape[0] // h // 2, *rest).transpose(1, 2)
        return w.reshape(x.shape[d], *rest).movedim(0, d).contiguous()
    if isinstance(op, tr.Pad):
        n = x.shape[d]
        p = (
            -(-n // env.eval(op.multiple)) * env.eval(op.multiple)
            if op.multiple is not None
            else env.eval(op.padded_size)
        )
        zeros = torch.zeros(*x.shape[:d], p - n, *x.shape[d + 1 :], dtype=x.dtype)
        return torch.cat([x, zeros], dim=d)
    assert isinstance(op, tr.Unpad)
    return x.narrow(d, 0, env.eval(op.size)).contiguous()
