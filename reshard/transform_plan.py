"""Planning through tensor transforms: a virtual source per target tensor (pure).

:func:`reshard.transforms.apply` resolves a transform spec into target tensors
whose :class:`~reshard.indexmap.Part` lists read the source tensors. Here each
such target becomes a :class:`TransformedSource`: a :class:`TensorSource`
whose pieces are *views* of the real source pieces, one per (part, real piece)
that meet, in the target's dim order: a stacked target's new dim is a size-1
dim of the view, an unstacked source's pinned dim is folded into the view's
byte offset, a transpose is a view with permuted strides. The planner matches
target blocks against these views through :func:`~reshard.indexmap.localize`
(strided segments expanded into unit runs), so :class:`~reshard.plan.Copy`
keeps its shape and the executor its two ways of moving bytes: runs contiguous
in both view and target are copied as they are (renames, concat/split, RoPE
rows, stacked experts), anything else is gathered through the strided view
(transposes, narrow columns). Zero parts (padding) are views with no file
(``piece_files[k] == -1``) that the executor fills with zeros.

A target tensor that is one source tensor read as is (a rename, or a tensor no
rule changes) keeps the source's own :class:`TensorSource` under its new name,
so it goes through the planner and executor exactly as without transforms.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint, CheckpointWarning, Signature, TensorSource
from .config import resolve_preset
from .dtypes import DTYPE_SIZES
from .errors import PlanError, UsageError
from .heads import HEAD_KEYS, Heads, heads_from
from .indexmap import Part, full_dims, localize, unit_segments
from .intervals import Block, Interval, block_shape, block_volume, box_span, full_block, row_major_strides
from .io.safe import MAX_LAYOUT_BYTES, read_document
from .plan import Copy, match_blocks
from .transforms import (
    Repeat,
    TransformedTensor,
    TransformSpec,
    Untie,
    apply,
    config_values,
    family_warning,
    load_hf_config,
    load_transforms,
    parse_transforms_text,
)
from .transforms import inverse as inverse_spec

__all__ = [
    "TransformedSource",
    "target_sources",
    "resolve_transforms",
    "match_any",
    "piece_strides",
    "file_at",
    "feeds",
    "Transforms",
    "unfused",
    "layout_transforms",
    "transforms_for",
    "parse_sets",
]


@dataclass(frozen=True, slots=True)
class TransformedSource(TensorSource):
    """A target tensor read as views of source pieces (see the module docstring).

    View ``k`` reads part ``parts[piece_parts[k]]`` from real piece ``piece_real[k]`` of
    ``inputs[piece_inputs[k]]`` (``-1``: a zero part, no file). ``piece_blocks[k]`` is the
    view's local block in target dim order, ``piece_strides[k]`` its element strides, and
    ``piece_files``/``piece_offsets`` the file and byte offset of its first element.
    """

    inputs: tuple[TensorSource, ...] = ()
    parts: tuple[Part, ...] = ()
    piece_inputs: tuple[int, ...] = ()
    piece_parts: tuple[int, ...] = ()
    piece_real: tuple[int, ...] = ()
    piece_strides: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class _Geometry:
    """The views of one signature, shared by every target tensor of that signature."""

    blocks: tuple[Block, ...]
    strides: tuple[tuple[int, ...], ...]
    inputs: tuple[int, ...]
    parts: tuple[int, ...]
    real: tuple[int, ...]
    deltas: tuple[int, ...]  # element offset of the view's first element in its real piece


_GEOMETRY: dict[Signature, _Geometry] = {}


def _is_identity(tt: TransformedTensor, sources: Mapping[str, TensorSource]) -> TensorSource | None:
    """The source ``tt`` is as is (one part reading all of it in order), or None."""
    if len(tt.parts) != 1:
        return None
    p = tt.parts[0]
    src = sources.get(p.source) if p.source is not None else None
    if src is None or p.fixed or src.shape != tt.shape or p.dims != full_dims(src.shape):
        return None
    return src


def _distinct_pieces(src: TensorSource) -> list[tuple[int, Block]]:
    """Non-empty pieces without replicas (the lowest index of each block), refusing Partial groups."""
    if src.piece_partials is not None and len(set(src.piece_partials)) > 1:
        raise PlanError(
            f'tensor "{src.name}" is saved as Partial sums: only renames apply to it; '
            "convert it to a plain layout first, then transform",
            tensor=src.name,
        )
    seen: set[Block] = set()
    out = []
    for k, blk in enumerate(src.piece_blocks):
        if blk not in seen and block_volume(blk):
            seen.add(blk)
            out.append((k, blk))
    return out


def _view(part: Part, real: Block, loc: Part) -> tuple[Block, tuple[int, ...], int]:
    """The view of a real piece in target dim order: its local block, element strides and offset."""
    rshape = block_shape(real)
    rstrides = row_major_strides(rshape)
    count = max(1, math.prod(rshape))
    shape, strides = [], []
    for d in part.dims:
        if d.src_dim is None:  # a new dim: size 1, any stride (one that keeps row windows sane)
            shape.append(1)
            strides.append(count)
        else:
            shape.append(rshape[d.src_dim])
            strides.append(rstrides[d.src_dim])
    delta = sum(i * rstrides[s] for s, i in loc.fixed)
    return full_block(shape), tuple(strides), delta


def _geometry(tt: TransformedTensor, inputs: Sequence[TensorSource], index: Mapping[str, int]) -> _Geometry:
    blocks: list[Block] = []
    strides: list[tuple[int, ...]] = []
    ins: list[int] = []
    pis: list[int] = []
    real: list[int] = []
    deltas: list[int] = []
    whole = full_block(tt.shape)
    for pi, p in enumerate(tt.parts):
        if p.source is None:
            blocks.append(whole)
            strides.append((0,) * len(tt.shape))
            ins.append(-1)
            pis.append(pi)
            real.append(-1)
            deltas.append(0)
            continue
        i = index[p.source]
        for k, blk in _distinct_pieces(inputs[i]):
            loc = localize(p, whole, blk, p.source)
            if loc is None:
                continue  # this piece holds nothing the part reads
            b, st, delta = _view(p, blk, loc)
            blocks.append(b)
            strides.append(st)
            ins.append(i)
            pis.append(pi)
            real.append(k)
            deltas.append(delta)
    return _Geometry(tuple(blocks), tuple(strides), tuple(ins), tuple(pis), tuple(real), tuple(deltas))


def _transformed(tt: TransformedTensor, sources: Mapping[str, TensorSource]) -> TransformedSource:
    names = list(dict.fromkeys(p.source for p in tt.parts if p.source is not None))
    index = {n: i for i, n in enumerate(names)}
    inputs = tuple(sources[n] for n in names)
    dtypes = {s.dtype for s in inputs}
    if len(dtypes) > 1:
        raise PlanError(
            f'tensor "{tt.name}" would combine source tensors of different dtypes '
            f"({', '.join(sorted(dtypes))})",
            tensor=tt.name,
        )
    dtype = next(iter(dtypes), None) or tt.dtype or "F32"  # no input: all zeros, or empty
    sig: Signature = (
        "transformed",
        tt.shape,
        tuple((s.signature, s.shape) for s in inputs),
        tuple((index.get(p.source, -1) if p.source else -1, p.dims, p.fixed) for p in tt.parts),
    )
    geo = _GEOMETRY.get(sig)
    if geo is None:
        if len(_GEOMETRY) > 65536:
            _GEOMETRY.clear()
        geo = _GEOMETRY[sig] = _geometry(tt, inputs, index)
    isz = DTYPE_SIZES[dtype]
    files = tuple(-1 if i < 0 else inputs[i].piece_files[k] for i, k in zip(geo.inputs, geo.real))
    offsets = tuple(
        0 if i < 0 else inputs[i].piece_offsets[k] + d * isz
        for i, k, d in zip(geo.inputs, geo.real, geo.deltas)
    )
    return TransformedSource(
        name=tt.name,
        dtype=dtype,
        shape=tt.shape,
        piece_files=files,
        piece_offsets=offsets,
        piece_blocks=geo.blocks,
        signature=sig,
        inputs=inputs,
        parts=tt.parts,
        piece_inputs=geo.inputs,
        piece_parts=geo.parts,
        piece_real=geo.real,
        piece_strides=geo.strides,
    )


def target_sources(
    transformed: Mapping[str, TransformedTensor], sources: Mapping[str, TensorSource]
) -> dict[str, TensorSource]:
    """Each target tensor as a source to plan from: the source itself when read as is, else a view.

    Raises:
        PlanError: a target would mix dtypes, or transforms a Partial source beyond a rename.
    """
    out: dict[str, TensorSource] = {}
    for name, tt in transformed.items():
        same = _is_identity(tt, sources)
        if same is not None:
            out[name] = same if same.name == name else dataclasses.replace(same, name=name)
        else:
            out[name] = _transformed(tt, sources)
    return out


def resolve_transforms(
    spec: TransformSpec,
    source: Checkpoint,
    config: Mapping[str, Any] | None,
    ties: list[tuple[TransformedTensor, TransformedTensor]] | None = None,
    repeats: list[Repeat] | None = None,
) -> dict[str, TransformedTensor]:
    """``apply`` the spec to the source checkpoint's tensors (shapes and dtypes checked).

    Raises:
        ConfigError: a rule does not fit (naming the rule, its line and the tensor).
    """
    tensors = source.tensors
    return apply(
        spec,
        {n: t.shape for n, t in tensors.items()},
        dtypes={n: t.dtype for n, t in tensors.items()},
        config=config,
        ties=ties,
        repeats=repeats,
    )


def _match_views(
    src: TransformedSource, dst_blocks: Sequence[Block]
) -> tuple[tuple[tuple[Copy, ...], ...], int]:
    views = []
    for k, (i, pi, real) in enumerate(zip(src.piece_inputs, src.piece_parts, src.piece_real)):
        part = src.parts[pi]
        views.append((k, part, None if i < 0 else src.inputs[i].piece_blocks[real]))
    out: list[tuple[Copy, ...]] = []
    for dblk in dst_blocks:
        need = block_volume(dblk)
        copies: list[Copy] = []
        got = 0
        if need:
            for k, part, sblk in views:
                loc = localize(part, dblk, sblk, src.name)
                if loc is not None:
                    c = Copy(k, tuple(unit_segments(d.segs) for d in loc.dims))
                    got += c.numel
                    copies.append(c)
        if got != need:
            what = "holes" if got < need else "conflicting overlaps"
            raise PlanError(
                f'tensor "{src.name}": the transformed source pieces leave {what} '
                f"({got} of {need} elements of a target block covered); run `reshard inspect --check` "
                "on the source",
                tensor=src.name,
            )
        out.append(tuple(copies))
    return tuple(out), 1


def match_any(src: TensorSource, dst_blocks: Sequence[Block]) -> tuple[tuple[tuple[Copy, ...], ...], int]:
    """:func:`~reshard.plan.match_blocks`, through the views of a :class:`TransformedSource`."""
    if isinstance(src, TransformedSource):
        return _match_views(src, dst_blocks)
    return match_blocks(src, dst_blocks)


def piece_strides(src: TensorSource, k: int) -> tuple[int, ...] | None:
    """Element strides of piece ``k`` (a view's own, else row-major); None for a zero part."""
    if isinstance(src, TransformedSource):
        return None if src.piece_files[k] < 0 else src.piece_strides[k]
    return row_major_strides(block_shape(src.piece_blocks[k]))


def file_at(src: TensorSource, index: Sequence[int]) -> int | None:
    """The file holding element ``index`` of ``src`` (index into the checkpoint's files; the
    lowest piece holding it, a view's real piece), or None (padding zeros, out of range)."""
    one: Block = tuple((Interval(i, i + 1),) for i in index)
    if isinstance(src, TransformedSource):
        for k, (i, pi, real) in enumerate(zip(src.piece_inputs, src.piece_parts, src.piece_real)):
            if (
                i >= 0
                and localize(src.parts[pi], one, src.inputs[i].piece_blocks[real], src.name) is not None
            ):
                return src.piece_files[k]
        return None
    for k, blk in enumerate(src.piece_blocks):
        if all(any(iv.start <= x < iv.stop for iv in il) for il, x in zip(blk, index, strict=True)):
            return src.piece_files[k]
    return None


def _region(part: Part, ndim: int) -> list[list[int]]:
    """The source index ranges ``[lo, hi)`` a part reads, per source dim (pinned dims: one index)."""
    box = [[0, 0] for _ in range(ndim)]
    for d in part.dims:
        if d.src_dim is not None and d.segs:
            box[d.src_dim] = [min(s.src for s in d.segs), max(s.src_last for s in d.segs) + 1]
    for s, i in part.fixed:
        box[s] = [i, i + 1]
    return box


def feeds(tt: TransformedTensor, sources: Mapping[str, TensorSource]) -> list[dict[str, Any]]:
    """Which source tensors fill a target tensor: per part, the source, the index ranges and bytes it reads.

    ``region`` is ``[lo, hi)`` per source dim (the hull of what the part reads: a RoPE
    permutation reads all of its rows, a grouped split every group's rows).
    """
    out: list[dict[str, Any]] = []
    for p in tt.parts:
        n = 1
        for d in p.dims:
            n *= sum(s.size for s in d.segs)
        if p.source is None:
            isz = DTYPE_SIZES[tt.dtype] if tt.dtype else 0
            out.append({"source": None, "region": None, "bytes": 0, "zeros": n * isz})
            continue
        src = sources[p.source]
        isz = DTYPE_SIZES[src.dtype]
        region = _region(p, len(src.shape))
        first, stop = box_span(
            row_major_strides(src.shape), [a for a, _ in region], [b - a for a, b in region]
        )
        out.append(
            {"source": p.source, "region": region, "byte_range": [first * isz, stop * isz], "bytes": n * isz}
        )
    return out


# -- the transforms of a conversion (from --transforms, --inverse, --model-config) -----------


@dataclass(frozen=True, slots=True)
class Transforms:
    """The transforms one conversion applies, with what resolves their size names.

    Attributes:
        spec: the spec as applied (already inverted with ``--inverse``).
        origin: the file or profile name it came from.
        inverse: whether ``spec`` is the inverse of ``origin``'s.
        config: the model's config.json values (size names), and where they came from.
        sets: ``--set KEY=VALUE`` values, already in ``spec``'s own config (recorded).
    """

    spec: TransformSpec
    origin: str
    inverse: bool = False
    config: Mapping[str, Any] | None = None
    config_path: str | None = None
    sets: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def resolve(self, source: Checkpoint) -> dict[str, TransformedTensor]:
        """The target tensors (``apply`` on the source's shapes and dtypes).

        Raises:
            ConfigError: a rule does not fit, leaves a source tensor unused, or names two
                targets alike (naming the rule).
        """
        return resolve_transforms(self.spec, source, self.config)

    def sources(self, source: Checkpoint) -> dict[str, TensorSource]:
        """The tensors to plan, by target name (:func:`target_sources`)."""
        return target_sources(self.resolve(source), source.tensors)

    def plan_inputs(self, source: Checkpoint) -> tuple[dict[str, TensorSource], dict[str, TransformedTensor]]:
        """:meth:`sources`, and the resolved target tensors (for ``plan``'s :func:`feeds`)."""
        tts = self.resolve(source)
        return target_sources(tts, source.tensors), tts

    def untied(self, source: Checkpoint) -> tuple[Checkpoint, Checkpoint, dict[str, str]] | None:
        """What ``untie`` rules drop and what they keep, as two checkpoints whose tensors pair
        up by the kept name (for ``verify_checkpoints``), and kept -> dropped names; None
        without ``untie``."""
        if not any(isinstance(op, Untie) for op in self.spec.ops):
            return None  # (no second resolution of the spec)
        ties: list[tuple[TransformedTensor, TransformedTensor]] = []
        resolve_transforms(self.spec, source, self.config, ties)
        if not ties:
            return None
        dropped = {k.name: dataclasses.replace(d, name=k.name) for d, k in ties}
        kept = {k.name: k for _, k in ties}
        return (
            dataclasses.replace(source, tensors=target_sources(dropped, source.tensors)),
            dataclasses.replace(source, tensors=target_sources(kept, source.tensors)),
            {k.name: d.name for d, k in ties},
        )

    def repeats(self, source: Checkpoint) -> list[Repeat]:
        """The copies of repeated chunks a ``split`` with ``shards`` reads once (vLLM's KV
        heads replicated over TP ranks), for ``verify`` to compare with the copy read."""
        out: list[Repeat] = []
        resolve_transforms(self.spec, source, self.config, repeats=out)
        return out

    def checkpoint(self, source: Checkpoint) -> Checkpoint:
        """``source`` seen through the transforms: its tensors under target names (for verify)."""
        return dataclasses.replace(source, tensors=self.sources(source))

    def heads(self) -> Heads | None:
        """The model's attention head counts as the transforms see them: ``--set`` values over
        the spec's ``config:`` entries over config.json (for the KV-heads check of the target)."""
        values = config_values(self.spec, self.config, HEAD_KEYS)
        own = {k for k, _ in self.spec.config}
        where = [f"--set {k}={values[k]}" for k in HEAD_KEYS if k in self.sets and k in values]
        if any(k in own and k not in self.sets for k in values):
            where.append(self.spec.source)
        if self.config_path is not None and any(k not in own for k in values):
            where.append(self.config_path)
        return heads_from(values, " over ".join(where))

    def family_note(self) -> str | None:
        """A warning naming the model config when its ``model_type`` is not one the spec's
        ``model_types`` lists (:func:`~reshard.transforms.family_warning`), else None."""
        note = family_warning(self.spec, self.config, self.origin)
        return None if note is None else f"{self.config_path}: {note}"

    def record(self) -> dict[str, Any]:
        """What ``reshard.json`` says about them (``inspect`` shows it)."""
        return {
            "origin": self.origin,
            "inverse": self.inverse,
            "model_config": self.config_path,
            **({"set": dict(self.sets)} if self.sets else {}),
            "spec": self.spec.to_json(),
        }


def unfused(targets: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
    """The target tensors read from one source tensor each (renamed, RoPE-permuted, split out
    of a fused one, unchanged): their rows are the model's heads in order. Tensors fused from
    several (vLLM's per-rank ``[q_r; k_r; v_r]``, KV heads repeated) are laid out by their own rule."""
    return {n: t for n, t in targets.items() if not isinstance(t, TransformedSource) or len(t.inputs) == 1}


def layout_transforms(layout: str) -> TransformSpec | None:
    """The ``transforms:`` section of a layout file or preset, or None when it has none.

    Raises:
        ConfigError: the file is not a regular file, too large, or its section is invalid.
    """
    path = resolve_preset(layout)
    raw = read_document(path, limit=MAX_LAYOUT_BYTES, what="layout file")
    text = raw.decode("utf-8", errors="replace")  # the layout loader reports bad UTF-8
    if re.search(r"^transforms\s*:", text, re.MULTILINE) is None:
        return None
    return parse_transforms_text(text, str(path))


def transforms_for(
    source: Checkpoint,
    *,
    transforms: str | None,
    layout: str | None = None,
    inverse: bool = False,
    model_config: str | None = None,
    allow_unused: bool = False,
    sets: Sequence[str] = (),
) -> Transforms | None:
    """The transforms of a conversion: ``--transforms`` or the target layout's section.

    The model config is ``model_config``, else the source directory's ``config.json``
    when there is one. ``sets`` (``--set KEY=VALUE``) override its values and the spec's
    own ``config:`` entries of those names. A config whose ``model_type`` the spec's
    ``model_types`` does not list adds a warning to ``source.warnings`` (the exit code is unchanged).

    Raises:
        UsageError: both ``--transforms`` and a layout section, transform-only options alone,
            or a ``--set`` that is not ``NAME=INTEGER``.
        ConfigError: the spec or the config cannot be read, or cannot be inverted.
    """
    in_layout = layout_transforms(layout) if layout else None
    if transforms is not None and in_layout is not None:
        raise UsageError(
            f"{layout} has a transforms: section and --transforms {transforms} gives another; use one"
        )
    if transforms is None and in_layout is None:
        if inverse or allow_unused or model_config or sets:
            raise UsageError(
                "--inverse, --allow-unused, --model-config and --set need --transforms FILE|PROFILE"
            )
        return None
    overrides = parse_sets(sets)
    spec = load_transforms(transforms, overrides) if transforms is not None else in_layout
    assert spec is not None
    origin = transforms if transforms is not None else str(layout)
    if inverse:
        spec = inverse_spec(spec)
    if allow_unused:
        spec = dataclasses.replace(spec, allow_unused=True)
    if overrides:
        spec = spec.with_values(overrides)
    path = model_config
    if path is None:
        src = Path(source.path)
        candidate = (src if src.is_dir() else src.parent) / "config.json"
        path = str(candidate) if candidate.is_file() else None
    config = load_hf_config(path) if path is not None else None
    tf = Transforms(spec, origin, inverse, config, path, overrides)
    note = tf.family_note()
    if note is not None:  # a model of a family the profile does not list: said, not refused
        w = CheckpointWarning(note, path=path)
        if w not in source.warnings:
            source.warnings.append(w)
    return tf


_SET = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?[0-9]{1,18})\s*")


def parse_sets(texts: Sequence[str]) -> dict[str, int]:
    """``--set KEY=VALUE`` options as integers by name (the last of a name wins).

    >>> parse_sets(["tp=4", "num_key_value_heads = 2"])
    {'tp': 4, 'num_key_value_heads': 2}

    Raises:
        UsageError: not ``NAME=INTEGER``.
    """
    out: dict[str, int] = {}
    for text in texts:
        m = _SET.fullmatch(text)
        if m is None:
            raise UsageError(
                f"--set {text!r}: write NAME=INTEGER, e.g. --set num_key_value_heads=2 or --set tp=4 "
                "(a size name the transforms use)"
            )
        out[m.group(1)] = int(m.group(2))
    return out
