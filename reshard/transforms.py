"""Tensor transforms between model formats: the ``transforms:`` section of a layout (pure).

A transform spec is an ordered list of operations on tensor names and index
maps, named after what they do (transformers' ``WeightConverter`` is the
naming model): ``rename``, ``drop``, ``concat``/``split`` (with ``groups`` for
Megatron's per-group QKV and per-rank gate/up interleaves), ``stack``/
``unstack`` (experts, layers), ``rope_permute`` (Meta interleaved <-> HF
rotate-half), ``pad``/``unpad`` (vocab padding), ``tie``/``untie`` and
``transpose``. Every operation moves elements without changing them, so
:func:`apply` resolves a whole chain to :class:`~reshard.indexmap.Part` lists
that read the source tensors directly; :func:`inverse` gives the spec that goes
back.

>>> spec = parse_transforms_text('''
... config: {heads: 2}
... transforms:
...   - rope_permute: {tensors: "layers.{l}.wq", heads: heads, to: hf}
...   - rename: {"layers.{l}.wq": "model.layers.{l}.q_proj.weight", "norm": "model.norm.weight"}
... ''')
>>> out = apply(spec, {"layers.0.wq": (8, 3), "norm": (3,)})
>>> sorted(out), out["model.layers.0.q_proj.weight"].shape
(['model.layers.0.q_proj.weight', 'model.norm.weight'], (8, 3))
>>> [(s.dst, s.src, s.size, s.src_step) for s in out["model.layers.0.q_proj.weight"].parts[0].dims[0].segs]
[(0, 0, 2, 2), (2, 1, 2, 2), (4, 4, 2, 2), (6, 5, 2, 2)]
>>> [type(op).__name__ for op in inverse(spec).ops]
['Rename', 'RopePermute']
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from .config import _Parser, _re2_escapes, _re2_reason, _yaml_error
from .errors import ConfigError
from .indexmap import DimMap, Part, Seg, compose, full_dims, identity_part, merge_parts, part_numel
from .io.safe import MAX_LAYOUT_BYTES, read_document

__all__ = [
    "Expr",
    "NamePattern",
    "Rename",
    "Drop",
    "Concat",
    "Split",
    "Stack",
    "Unstack",
    "RopePermute",
    "Pad",
    "Unpad",
    "Tie",
    "Untie",
    "Transpose",
    "Op",
    "TransformSpec",
    "TransformedTensor",
    "Repeat",
    "apply",
    "config_values",
    "inverse",
    "parse_transforms_text",
    "load_transforms",
    "chained",
    "load_hf_config",
    "resolve_profile",
    "list_profiles",
]

Expr: TypeAlias = "int | str"
"""A size: an integer, or an arithmetic expression over config names (``kv_heads*head_dim``)."""

# -- expressions -----------------------------------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


_CALLS: dict[str, Callable[..., int]] = {"min": min, "max": max}


@functools.lru_cache(maxsize=1024, typed=True)  # per tensor of every rule: parsed once (True is not 1)
def _parse_expr(expr: Expr) -> ast.expr:
    if isinstance(expr, bool) or not isinstance(expr, (int, str)):
        raise ConfigError(f"a size must be an integer or an expression such as heads*head_dim, got {expr!r}")
    try:
        node = ast.parse(str(expr), mode="eval").body
    except SyntaxError:
        raise ConfigError(
            f"size expression {expr!r} is not valid; use integers, names, + - * / // %"
        ) from None
    for sub in ast.walk(node):
        if (
            not isinstance(
                sub,
                (
                    ast.BinOp,
                    ast.UnaryOp,
                    ast.USub,
                    ast.Constant,
                    ast.Name,
                    ast.Load,
                    ast.Div,
                    ast.Call,
                    *_BINOPS,
                ),
            )
            or (
                isinstance(sub, ast.Constant)
                and (isinstance(sub.value, bool) or not isinstance(sub.value, int))
            )
            or (
                isinstance(sub, ast.Call)
                and (
                    not isinstance(sub.func, ast.Name)
                    or sub.func.id not in (*_CALLS, "get")
                    or sub.keywords
                    or not sub.args
                    or (
                        sub.func.id == "get" and (len(sub.args) != 2 or not isinstance(sub.args[0], ast.Name))
                    )
                )
            )
        ):
            raise ConfigError(
                f"size expression {expr!r} may only use integers, config names, + - * / // %, "
                "min(..) and max(..), and get(KEY, DEFAULT)"
            )
    return node


class _Env:
    """Integer values of config names: the spec's ``config:`` (expressions), then config.json."""

    def __init__(self, own: Mapping[str, Expr], external: Mapping[str, Any]) -> None:
        self.own = own
        self.external = external
        self.stack: list[str] = []
        # values found (the names' values are fixed for a run): 100k tensors evaluate a rule's
        # sizes 100k times
        self._values: dict[tuple[type, Expr], int] = {}

    def name(self, key: str) -> int:
        if key in self.own:
            if key in self.stack:
                raise ConfigError(f"config names refer to each other in a cycle: {' -> '.join(self.stack)}")
            self.stack.append(key)
            try:
                return self.eval(self.own[key])
            finally:
                self.stack.pop()
        v = self.external.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        known = sorted(set(self.own) | {k for k, x in self.external.items() if isinstance(x, int)})
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"unknown size name {key!r}; {hint}define it under config: in the spec, "
            "or pass the model's config.json"
        )

    def flag(self, key: str) -> bool:
        """A yes/no value (``tie_word_embeddings``): the spec's ``config:`` or ``--set`` (an
        expression, non-zero is yes), else config.json's (true/false, or an integer); a name
        neither gives is no (transformers' Llama-family default)."""
        if key in self.own:
            return self.name(key) != 0
        v = self.external.get(key)
        if v is None or isinstance(v, bool):
            return bool(v)
        if isinstance(v, int):
            return v != 0
        raise ConfigError(f"{key} must be true or false in the model's config, got {v!r}")

    def eval(self, expr: Expr) -> int:
        key = (type(expr), expr)
        v = self._values.get(key)
        if v is None:
            v = self._values[key] = self._node(_parse_expr(expr), expr)
        return v

    def _node(self, n: ast.expr, expr: Expr) -> int:
        if isinstance(n, ast.Constant):
            assert isinstance(n.value, int)  # _parse_expr admits only integer constants
            return n.value
        if isinstance(n, ast.Name):
            return self.name(n.id)
        if isinstance(n, ast.UnaryOp):
            return -self._node(n.operand, expr)
        if isinstance(n, ast.Call):  # min(..) / max(..) / get(KEY, DEFAULT), checked by _parse_expr
            assert isinstance(n.func, ast.Name)
            if n.func.id == "get":  # KEY (head_dim) when given, else DEFAULT (a config may lack it)
                key = n.args[0]
                assert isinstance(key, ast.Name)
                if key.id in self.own and key.id not in self.stack:
                    return self.name(key.id)  # a --set value, or another entry of the spec
                v = self.external.get(key.id)
                if v is None:
                    return self._node(n.args[1], expr)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigError(f"{key.id} must be an integer in the model's config, got {v!r}")
                return v
            return _CALLS[n.func.id](self._node(a, expr) for a in n.args)
        assert isinstance(n, ast.BinOp)
        a, b = self._node(n.left, expr), self._node(n.right, expr)
        if isinstance(n.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ConfigError(f"size expression {expr!r} divides by zero")
        if isinstance(n.op, ast.Div):
            if a % b:
                raise ConfigError(f"size expression {expr!r}: {a} / {b} is not a whole number")
            return a // b
        return _BINOPS[type(n.op)](a, b)


# -- names -----------------------------------------------------------------------

_TOKEN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}|\*")
_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}|\\([1-9][0-9]*)")


@dataclass(frozen=True, slots=True)
class NamePattern:
    """A tensor-name pattern: ``{name}`` captures one dotted component, ``*`` anything; or ``re:REGEX``.

    Matching never backtracks for long: a pattern whose captures are each ended by a ``.`` (or
    the name's end) and that holds at most one ``*`` runs on Python's ``re`` (each capture has
    one way to match); any other, and every ``re:``, runs on RE2 (``google-re2``), in time linear
    in the name (``re:(a+)+b`` or ``*a*a*a*b`` against a long name ran for ever on ``re``). A
    repeated ``{name}`` needs the first kind.

    >>> m = NamePattern("layers.{layer}.experts.{e}.*").match("layers.3.experts.7.w1.weight")
    >>> m.groupdict(), m.groups()
    ({'layer': '3', 'e': '7'}, ('3', '7', 'w1.weight'))
    """

    text: str
    regex: Any = field(init=False, repr=False, compare=False)  # re.Pattern, or RE2's compiled pattern

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ConfigError(f"a tensor-name pattern must be a non-empty string, got {self.text!r}")
        if self.text.startswith("re:"):
            try:
                re.compile(self.text[3:])  # Python's syntax and messages first: rules are written for it
            except re.error as e:
                raise ConfigError(f"invalid regex {self.text!r}: {e.msg} at position {e.pos}") from None
            rx = _re2(self.text[3:], self.text)
        else:
            out: list[str] = []
            seen: set[str] = set()
            pos, stars, safe = 0, 0, True
            for m in _TOKEN.finditer(self.text):
                out.append(re.escape(self.text[pos : m.start()]))
                name = m.group(1)
                if name is None:
                    out.append("(.*)")
                    stars += 1
                elif name in seen:
                    out.append(f"(?P={name})")
                else:
                    seen.add(name)
                    out.append(f"(?P<{name}>[^.]+)")
                pos = m.end()
                # a capture must end at a '.' (or the name's end): else where it stops is a choice
                safe = safe and (pos == len(self.text) or self.text[pos] == ".")
            out.append(re.escape(self.text[pos:]))
            body = "".join(out)
            if safe and stars <= 1:
                rx = re.compile(body)
            elif "(?P=" in body:
                raise ConfigError(
                    f"pattern {self.text!r} repeats a {{name}}, so each capture must end at a '.' "
                    "(or the name's end) and it may hold one * at most; write it with fewer captures"
                )
            else:
                rx = _re2(body, self.text)
        object.__setattr__(self, "regex", rx)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.regex.groupindex)

    @property
    def invertible(self) -> bool:
        """Whether it is also a template: only ``{name}`` captures (no ``*``, no regex)."""
        return not self.text.startswith("re:") and "*" not in self.text

    def match(self, name: str) -> re.Match[str] | None:
        """The full match (RE2's match object where RE2 runs it: the same group/groups/groupdict)."""
        m: re.Match[str] | None = self.regex.fullmatch(name)
        return m

    def check_template(self, template: str, what: str) -> None:
        """Refuse a template that refers to captures this pattern does not have."""
        for m in _REF.finditer(template):
            if m.group(1) is not None and m.group(1) not in self.names:
                raise ConfigError(
                    f"{what} {template!r} uses {{{m.group(1)}}}, but {self.text!r} captures "
                    f"{', '.join(sorted(self.names)) or 'nothing'}"
                )
            if m.group(2) is not None and int(m.group(2)) > self.regex.groups:
                raise ConfigError(
                    f"{what} {template!r} uses \\{m.group(2)}, but {self.text!r} has fewer groups"
                )


def _re2(body: str, text: str) -> Any:
    """``body`` compiled by RE2 (linear-time matching, captures as Python's ``re`` gives them)."""
    import re2  # lazy: only patterns that could backtrack for long load it

    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(_re2_escapes(body), options)
    except re2.error as e:
        why = _re2_reason(e)
        raise ConfigError(
            f"pattern {text!r} is not supported: {why}; transform patterns run on RE2, which "
            "guarantees linear-time matching and so has no lookarounds, backreferences, atomic "
            "groups or possessive repeats; rewrite it without them"
        ) from None


def _fill(template: str, m: re.Match[str], extra: Mapping[str, str] | None = None) -> str:
    """``template`` with ``{name}`` and ``\\N`` replaced by ``m``'s captures (``extra`` first)."""

    def one(r: re.Match[str]) -> str:
        if r.group(1) is not None:
            key = r.group(1)
            return extra[key] if extra and key in extra else str(m.group(key))
        return str(m.group(int(r.group(2))))

    return _REF.sub(one, template)


def _template_names(template: str) -> frozenset[str]:
    return frozenset(m.group(1) for m in _REF.finditer(template) if m.group(1) is not None)


# -- the state an operation sees ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransformedTensor:
    """A target tensor: its shape, dtype (None when unknown) and the parts that fill it."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """A chunk a ``split`` with ``shards`` reads once although its source holds it in several
    groups (vLLM's KV heads, repeated over the TP ranks): ``first`` is the split target as read
    (each chunk from its first group), ``other`` the same target read from copy ``copy`` (1 ..
    ``count - 1``) of every chunk; both are parts reading the source tensors, for ``verify``
    to compare (replicas that must be equal, like a Replicate placement's).

    Attributes:
        first: the target as the split reads it (named as the split names it).
        other: the target read from copy ``copy`` instead.
        copy: which copy ``other`` reads (0 is ``first``'s).
        count: how many copies the source holds of each chunk.
        fused: the tensor split (its name at the split).
    """

    first: TransformedTensor
    other: TransformedTensor
    copy: int
    count: int
    fused: str


@dataclass(frozen=True, slots=True)
class _Out:
    """One output of an operation; ``parts`` read the operation's input tensors by name."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None
    parts: tuple[Part, ...]
    alias: str | None = None  # the output is exactly this input (rename, tie)


@dataclass(frozen=True, slots=True)
class _Step:
    outputs: tuple[_Out, ...]
    consumed: frozenset[str]
    used: frozenset[str] = frozenset()
    ties: tuple[tuple[TransformedTensor, TransformedTensor], ...] = ()  # untie: (dropped, kept)
    repeats: tuple[Repeat, ...] = ()  # split with shards: the copies it does not read


State: TypeAlias = Mapping[str, TransformedTensor]


def _matches(pattern: NamePattern, state: State) -> list[tuple[str, re.Match[str]]]:
    out = []
    for name in sorted(state):
        m = pattern.match(name)
        if m is not None:
            out.append((name, m))
    return out


def _dim(d: int, ndim: int, name: str) -> int:
    if not -ndim <= d < ndim:
        raise ConfigError(f'dim {d} is out of range for tensor "{name}" with {ndim} dims', tensor=name)
    return d % ndim


def _same_dtype(names: Sequence[str], state: State) -> str | None:
    kinds = {state[n].dtype for n in names} - {None}
    if len(kinds) > 1:
        listed = ", ".join(f"{n} {state[n].dtype}" for n in names)
        raise ConfigError(f"cannot combine tensors of different dtypes ({listed})", tensor=names[0])
    return next(iter(kinds), None)


def _with_dim(shape: tuple[int, ...], d: int, n: int) -> tuple[int, ...]:
    return shape[:d] + (n,) + shape[d + 1 :]


def _remap(shape: Sequence[int], d: int, segs: tuple[Seg, ...], source: str | None) -> Part:
    """A part reading ``source`` as is except along dim ``d``, mapped by ``segs``."""
    dims = tuple(
        DimMap(None if source is None else t, segs if t == d else ((Seg(0, 0, n),) if n else ()))
        for t, n in enumerate(shape)
    )
    return Part(source, dims)


def _group_segs(
    sizes: Sequence[int], groups: int, i: int, shards: Sequence[int] | None = None
) -> tuple[Seg, ...]:
    """Where part ``i`` of a grouped concat lives: per group g, ``[p0_g, p1_g, ...]`` along the dim.

    Part ``i`` is cut into ``shards[i]`` chunks (default: ``groups``), and group g holds chunk
    ``g // (groups / shards[i])``: a chunk repeated in consecutive groups (vLLM's KV heads
    replicated over TP ranks). Returns segments from the fused index (``dst``) to part ``i``'s
    index (``src``).
    """
    cuts = [groups] * len(sizes) if shards is None else list(shards)
    chunks = [n // k for n, k in zip(sizes, cuts)]
    total, off, c, rep = sum(chunks), sum(chunks[:i]), chunks[i], groups // cuts[i]
    if c == 0:
        return ()
    if c == 1 and groups > 1 and rep == 1:
        return (Seg(off, 0, groups, total, 1),)  # alternating rows: one strided segment
    return tuple(Seg(g * total + off, (g // rep) * c, c) for g in range(groups))


def _split_segs(
    sizes: Sequence[int], groups: int, i: int, shards: Sequence[int] | None, copy: int = 0
) -> tuple[Seg, ...]:
    """The inverse of :func:`_group_segs`: part ``i``'s index -> fused index, each repeated
    chunk read from the first group holding it (or from its ``copy``-th)."""
    segs = _group_segs(sizes, groups, i, shards)
    if shards is not None and groups // shards[i] > 1:
        total = sum(n // k for n, k in zip(sizes, shards))
        segs = tuple(s for s in segs if (s.dst // total) % (groups // shards[i]) == copy)
    return _invert_segs(segs)


def _fused_size(sizes: Sequence[int], groups: int, shards: Sequence[int] | None) -> int:
    """Along the fused dim: ``sum(sizes)``, more when ``shards`` repeat chunks."""
    return sum(sizes) if shards is None else groups * sum(n // k for n, k in zip(sizes, shards))


def _invert_segs(segs: Sequence[Seg]) -> tuple[Seg, ...]:
    return tuple(
        sorted((Seg(s.src, s.dst, s.size, s.src_step, s.dst_step) for s in segs), key=lambda s: s.dst)
    )


class _Base:
    """What every operation has: its YAML name (``OP``) and an inverse."""

    __slots__ = ()
    OP = ""

    def inverse(self) -> Op | None:
        """The operation that undoes this one (None: nothing to undo)."""
        raise NotImplementedError


def _not_invertible(what: str, text: str) -> ConfigError:
    return ConfigError(
        f"{what} {text!r} cannot be inverted: use only {{name}} captures (no * or re:) "
        "so the reverse names can be built"
    )


# -- operations ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rename(_Base):
    """Rename tensors: each tensor takes the first matching ``(pattern, template)`` pair."""

    pairs: tuple[tuple[NamePattern, str], ...]
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "rename"

    def __post_init__(self) -> None:
        for pat, tpl in self.pairs:
            pat.check_template(tpl, "rename target")

    def run(self, state: State, env: _Env) -> _Step:
        outs, consumed = [], set()
        for name in sorted(state):
            for pat, tpl in self.pairs:
                m = pat.match(name)
                if m is not None:
                    t = state[name]
                    outs.append(_Out(_fill(tpl, m), t.shape, t.dtype, (), alias=name))
                    consumed.add(name)
                    break
        return _Step(tuple(outs), frozenset(consumed))

    def inverse(self) -> Op:
        pairs = []
        for pat, tpl in self.pairs:
            if not pat.invertible or _template_names(tpl) != pat.names or "\\" in tpl:
                raise _not_invertible("rename pattern", pat.text)
            pairs.append((NamePattern(tpl), pat.text))
        return Rename(tuple(pairs), self.optional, self.line)


@dataclass(frozen=True, slots=True)
class Drop(_Base):
    """Drop tensors (e.g. ``rotary_emb.inv_freq``); one way only."""

    tensors: NamePattern
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "drop"

    def run(self, state: State, env: _Env) -> _Step:
        return _Step((), frozenset(n for n, _ in _matches(self.tensors, state)))

    def inverse(self) -> Op | None:
        """Nothing to undo for an ``optional`` drop (buffers such as ``inv_freq``); else an error."""
        if self.optional:
            return None
        raise ConfigError(
            "drop cannot be undone (it loses tensors); mark it optional: true if the dropped tensors "
            "are derived buffers the reverse direction need not restore"
        )


def _eval_sizes(sizes: tuple[Expr, ...] | None, env: _Env) -> list[int] | None:
    return None if sizes is None else [env.eval(s) for s in sizes]


@dataclass(frozen=True, slots=True)
class Concat(_Base):
    """Fuse tensors along ``dim``; with ``groups`` G, per group ``[a_g, b_g, ...]`` (Megatron QKV).

    ``sources[0]`` is matched; the other entries are templates filled with its captures.
    """

    sources: tuple[NamePattern, ...]
    target: str
    dim: int = 0
    groups: Expr = 1
    sizes: tuple[Expr, ...] | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    shards: tuple[Expr, ...] | None = None  # per input, its chunk count (default: groups)
    OP = "concat"

    def __post_init__(self) -> None:
        _check_many(len(self.sources), self.sizes, "from")
        _check_many(len(self.sources), self.shards, "from", "shards")
        for tpl in (*(p.text for p in self.sources[1:]), self.target):
            self.sources[0].check_template(tpl, "name")

    def run(self, state: State, env: _Env) -> _Step:
        outs, consumed = [], set()
        for name, m in _matches(self.sources[0], state):
            names = [name] + [_fill(p.text, m) for p in self.sources[1:]]
            for n in names:
                if n not in state:
                    raise ConfigError(f'tensor "{n}" is missing (needed with "{name}")', tensor=n)
            shapes = [state[n].shape for n in names]
            d = _dim(self.dim, len(shapes[0]), name)
            g, sizes, cuts = env.eval(self.groups), [s[d] for s in shapes], _eval_sizes(self.shards, env)
            _check_parts(names, shapes, d, sizes, g, _eval_sizes(self.sizes, env), cuts)
            parts = tuple(
                _remap(shapes[0], d, _group_segs(sizes, g, i, cuts), n) for i, n in enumerate(names)
            )
            shape = _with_dim(shapes[0], d, _fused_size(sizes, g, cuts))
            outs.append(_Out(_fill(self.target, m), shape, _same_dtype(names, state), parts))
            consumed.update(names)
        return _Step(tuple(outs), frozenset(consumed))

    def inverse(self) -> Op:
        if not self.sources[0].invertible:
            raise _not_invertible("concat pattern", self.sources[0].text)
        if self.sizes is None:
            raise ConfigError("concat without sizes: cannot be inverted; add sizes: so the split knows them")
        return Split(
            NamePattern(self.target),
            tuple(p.text for p in self.sources),
            self.dim,
            self.groups,
            self.sizes,
            self.optional,
            self.line,
            self.shards,
        )


def _check_many(count: int, sizes: Sequence[Expr] | None, what: str, field_: str = "sizes") -> None:
    if count < 2:
        raise ConfigError(f"{what}: needs a list of at least two tensor names")
    if sizes is not None and len(sizes) != count:
        raise ConfigError(f"{field_}: has {len(sizes)} entries but {what}: names {count} tensors")


def _check_parts(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    d: int,
    sizes: Sequence[int],
    groups: int,
    want: Sequence[int] | None,
    shards: Sequence[int] | None = None,
) -> None:
    """Shapes agree off ``dim``; sizes match ``want`` and divide into ``groups`` (or ``shards``,
    each dividing ``groups``)."""
    for n, s in zip(names, shapes):
        if len(s) != len(shapes[0]) or _with_dim(s, d, 0) != _with_dim(shapes[0], d, 0):
            raise ConfigError(
                f'tensor "{n}" has shape {list(s)}, which does not fit "{names[0]}" {list(shapes[0])} '
                f"except along dim {d}",
                tensor=n,
            )
    if want is not None and list(want) != list(sizes):
        raise ConfigError(f"sizes {list(want)} do not match the tensors' sizes {list(sizes)} along dim {d}")
    if shards is None and (groups < 1 or any(n % groups for n in sizes)):
        raise ConfigError(f"sizes {list(sizes)} along dim {d} do not divide into groups: {groups}")
    for size, k in zip(sizes, shards or ()):
        if k < 1 or groups < 1 or groups % k or size % k:
            raise ConfigError(
                f"shards {list(shards or ())} do not fit: each must divide groups: {groups} and its "
                f"tensor's size along dim {d} (sizes {list(sizes)})"
            )


@dataclass(frozen=True, slots=True)
class Split(_Base):
    """Split a tensor along ``dim`` into ``sizes`` (equal parts when omitted); ``groups`` as in concat."""

    source: NamePattern
    targets: tuple[str, ...]
    dim: int = 0
    groups: Expr = 1
    sizes: tuple[Expr, ...] | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    shards: tuple[Expr, ...] | None = None  # as in concat; a repeated chunk is read once
    OP = "split"

    def __post_init__(self) -> None:
        _check_many(len(self.targets), self.sizes, "to")
        _check_many(len(self.targets), self.shards, "to", "shards")
        if self.shards is not None and self.sizes is None:
            raise ConfigError("split with shards: needs sizes: (the sizes of the tensors it splits into)")
        for t in self.targets:
            self.source.check_template(t, "split target")

    def run(self, state: State, env: _Env) -> _Step:
        outs, consumed, repeats = [], set(), []
        for name, m in _matches(self.source, state):
            t = state[name]
            d = _dim(self.dim, len(t.shape), name)
            n, k = t.shape[d], len(self.targets)
            sizes = _eval_sizes(self.sizes, env)
            if sizes is None:
                if n % k:
                    raise ConfigError(
                        f'"{name}" has {n} along dim {d}, not divisible into {k} equal parts; give sizes:',
                        tensor=name,
                    )
                sizes = [n // k] * k
            g, cuts = env.eval(self.groups), _eval_sizes(self.shards, env)
            if cuts is not None:  # the fused size needs whole chunks
                _check_parts([name], [t.shape], d, sizes, g, None, cuts)
            fused = _fused_size(sizes, g, cuts)
            if min(sizes) < 0:
                raise ConfigError(f'sizes {sizes} of "{name}": a size is negative', tensor=name)
            if fused != n:
                how = "add up to" if cuts is None else f"in {g} groups of shards {cuts} make"
                raise ConfigError(
                    f'sizes {sizes} {how} {fused}, but "{name}" has {n} along dim {d}', tensor=name
                )
            _check_parts([name], [t.shape], d, sizes, g, None, cuts)
            for i, tpl in enumerate(self.targets):
                target, shape = _fill(tpl, m), _with_dim(t.shape, d, sizes[i])
                out = _Out(
                    target, shape, t.dtype, (_remap(t.shape, d, _split_segs(sizes, g, i, cuts), name),)
                )
                outs.append(out)
                count = 1 if cuts is None else g // cuts[i]
                first = _composed(out, state) if count > 1 else None
                for c in range(1, count):  # the copies not read, for verify to compare
                    assert first is not None
                    segs = _split_segs(sizes, g, i, cuts, c)
                    other = _Out(target, shape, t.dtype, (_remap(t.shape, d, segs, name),))
                    repeats.append(Repeat(first, _composed(other, state), c, count, name))
            consumed.add(name)
        return _Step(tuple(outs), frozenset(consumed), repeats=tuple(repeats))

    def inverse(self) -> Op:
        if not self.source.invertible:
            raise _not_invertible("split pattern", self.source.text)
        if self.sizes is None:
            raise ConfigError("split without sizes: cannot be inverted; add sizes:")
        return Concat(
            tuple(NamePattern(t) for t in self.targets),
            self.source.text,
            self.dim,
            self.groups,
            self.sizes,
            self.optional,
            self.line,
            self.shards,
        )


@dataclass(frozen=True, slots=True)
class Stack(_Base):
    """Stack tensors that differ only in the ``{index}`` capture along a new ``dim`` (experts, layers)."""

    source: NamePattern
    target: str
    index: str
    dim: int = 0
    count: Expr | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "stack"

    def __post_init__(self) -> None:
        if self.index not in self.source.names:
            raise ConfigError(f"index: {self.index!r} is not a {{capture}} of {self.source.text!r}")
        if self.index in _template_names(self.target):
            raise ConfigError(f"to: {self.target!r} must not use the index {{{self.index}}}")
        self.source.check_template(self.target, "stack target")

    def run(self, state: State, env: _Env) -> _Step:
        groups: dict[str, dict[int, str]] = {}
        for name, m in _matches(self.source, state):
            e = m.group(self.index)
            if not e.isdigit():
                raise ConfigError(f'"{name}": index {{{self.index}}} is {e!r}, not a number', tensor=name)
            members = groups.setdefault(_fill(self.target, m), {})
            if int(e) in members:
                raise ConfigError(f'"{name}" and "{members[int(e)]}" both give index {int(e)}', tensor=name)
            members[int(e)] = name
        outs = []
        for target, members in sorted(groups.items()):
            outs.append(self._stack(target, members, state, env))
        return _Step(tuple(outs), frozenset(n for ms in groups.values() for n in ms.values()))

    def _stack(self, target: str, members: dict[int, str], state: State, env: _Env) -> _Out:
        count = len(members) if self.count is None else env.eval(self.count)
        extra = sorted(e for e in members if not 0 <= e < count)
        missing: list[int] = []  # the first few: count may be 10**12 (a set of its range was)
        if len(members) - len(extra) != max(count, 0):
            missing = [e for e in itertools.islice((e for e in range(count) if e not in members), 8)]
        if missing or extra:
            what = [f"missing {missing[:8]}"] if missing else []
            what += [f"unexpected {extra[:8]}"] if extra else []
            raise ConfigError(
                f'"{target}": stacking needs indices 0..{count - 1}; {", ".join(what)}', tensor=target
            )
        names = [members[e] for e in range(count)]
        shape = state[names[0]].shape
        for n in names:
            if state[n].shape != shape:
                raise ConfigError(
                    f'"{n}" has shape {list(state[n].shape)}, "{names[0]}" {list(shape)}; '
                    "stacked tensors must have equal shapes",
                    tensor=n,
                )
        d = _dim(self.dim, len(shape) + 1, target)
        parts = []
        full = full_dims(shape)
        for e, n in enumerate(names):
            parts.append(Part(n, full[:d] + (DimMap(None, (Seg(e, 0, 1),)),) + full[d:]))
        return _Out(target, shape[:d] + (count,) + shape[d:], _same_dtype(names, state), tuple(parts))

    def inverse(self) -> Op:
        if not self.source.invertible:
            raise _not_invertible("stack pattern", self.source.text)
        return Unstack(
            NamePattern(self.target),
            self.source.text,
            self.index,
            self.dim,
            self.count,
            self.optional,
            self.line,
        )


@dataclass(frozen=True, slots=True)
class Unstack(_Base):
    """Split ``dim`` of each matching tensor into one tensor per index, named with ``{index}``."""

    source: NamePattern
    target: str
    index: str
    dim: int = 0
    count: Expr | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "unstack"

    def __post_init__(self) -> None:
        if self.index not in _template_names(self.target):
            raise ConfigError(f"to: {self.target!r} must use the index {{{self.index}}}")
        if self.index in self.source.names:
            raise ConfigError(f"from: {self.source.text!r} must not capture the index {{{self.index}}}")
        for key in _template_names(self.target) - {self.index}:
            if key not in self.source.names:
                raise ConfigError(f"to: {self.target!r} uses {{{key}}}, which from: does not capture")

    def run(self, state: State, env: _Env) -> _Step:
        outs, consumed = [], set()
        for name, m in _matches(self.source, state):
            t = state[name]
            d = _dim(self.dim, len(t.shape), name)
            if self.count is not None and env.eval(self.count) != t.shape[d]:
                raise ConfigError(
                    f'"{name}" has {t.shape[d]} along dim {d}, count: says {env.eval(self.count)}',
                    tensor=name,
                )
            shape = t.shape[:d] + t.shape[d + 1 :]
            for e in range(t.shape[d]):
                dims = tuple(DimMap(s, (Seg(0, 0, k),) if k else ()) for s, k in enumerate(t.shape) if s != d)
                outs.append(
                    _Out(
                        _fill(self.target, m, {self.index: str(e)}),
                        shape,
                        t.dtype,
                        (Part(name, dims, ((d, e),)),),
                    )
                )
            consumed.add(name)
        return _Step(tuple(outs), frozenset(consumed))

    def inverse(self) -> Op:
        if not self.source.invertible:
            raise _not_invertible("unstack pattern", self.source.text)
        return Stack(
            NamePattern(self.target),
            self.source.text,
            self.index,
            self.dim,
            self.count,
            self.optional,
            self.line,
        )


class _InPlace(_Base):
    """An operation that rewrites each matching tensor under its own name."""

    __slots__ = ()
    tensors: NamePattern  # a field of each subclass

    def run(self, state: State, env: _Env) -> _Step:
        outs = []
        for name, _ in _matches(self.tensors, state):
            t = state[name]
            shape, parts = self.one(name, t.shape, env)
            outs.append(_Out(name, shape, t.dtype, parts))
        return _Step(tuple(outs), frozenset(o.name for o in outs))

    def one(self, name: str, shape: tuple[int, ...], env: _Env) -> tuple[tuple[int, ...], tuple[Part, ...]]:
        raise NotImplementedError


_ROPE_TO = ("hf", "meta")


@dataclass(frozen=True, slots=True)
class RopePermute(_InPlace):
    """RoPE q/k row permutation within each head along ``dim``.

    ``to: hf`` is torchtitan's ``_permute`` (Meta interleaved pairs -> HF
    rotate-half halves: ``w.view(h, hd/2, 2, ...).transpose(1, 2)``); ``to:
    meta`` is ``_reverse_permute``.
    """

    tensors: NamePattern
    heads: Expr
    to: str = "hf"
    dim: int = 0
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "rope_permute"

    def __post_init__(self) -> None:
        if self.to not in _ROPE_TO:
            raise ConfigError(f"to: must be hf (Meta -> HF) or meta (HF -> Meta), got {self.to!r}")

    def one(self, name: str, shape: tuple[int, ...], env: _Env) -> tuple[tuple[int, ...], tuple[Part, ...]]:
        d = _dim(self.dim, len(shape), name)
        h, rows = env.eval(self.heads), shape[d]
        if h < 1 or rows % h or (rows // h) % 2:
            raise ConfigError(
                f'"{name}" has {rows} rows along dim {d}: not {h} heads of an even head_dim', tensor=name
            )
        hd, half = rows // h, rows // h // 2
        if 0 in shape:
            return shape, ()
        segs = []
        for head in range(h):
            for i2 in (0, 1):
                base = head * hd
                if self.to == "hf":  # HF row base + i2*half + i1 <- Meta row base + 2*i1 + i2
                    segs.append(Seg(base + i2 * half, base + i2, half, 1, 2))
                else:
                    segs.append(Seg(base + i2, base + i2 * half, half, 2, 1))
        return shape, (_remap(shape, d, tuple(sorted(segs, key=lambda s: s.dst)), name),)

    def inverse(self) -> Op:
        return RopePermute(
            self.tensors,
            self.heads,
            _ROPE_TO[1 - _ROPE_TO.index(self.to)],
            self.dim,
            self.optional,
            self.line,
        )


def _padded(n: int, multiple: int | None, padded_size: int | None, name: str) -> int:
    if multiple is not None:
        if multiple < 1:
            raise ConfigError(f"multiple: must be >= 1, got {multiple}")
        return math.ceil(n / multiple) * multiple
    assert padded_size is not None
    if padded_size < n:
        raise ConfigError(f'padded_size: {padded_size} is smaller than "{name}"\'s {n}', tensor=name)
    return padded_size


@dataclass(frozen=True, slots=True)
class Pad(_InPlace):
    """Pad ``dim`` with zeros to a ``multiple`` (or to ``padded_size``); ``size`` checks the input."""

    tensors: NamePattern
    dim: int = 0
    multiple: Expr | None = None
    padded_size: Expr | None = None
    size: Expr | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "pad"

    def __post_init__(self) -> None:
        if (self.multiple is None) == (self.padded_size is None):
            raise ConfigError("give exactly one of multiple: and padded_size:")

    def one(self, name: str, shape: tuple[int, ...], env: _Env) -> tuple[tuple[int, ...], tuple[Part, ...]]:
        d = _dim(self.dim, len(shape), name)
        n = shape[d]
        if self.size is not None and env.eval(self.size) != n:
            raise ConfigError(
                f'"{name}" has {n} along dim {d}, size: says {env.eval(self.size)}', tensor=name
            )
        mult = None if self.multiple is None else env.eval(self.multiple)
        p = _padded(n, mult, None if self.padded_size is None else env.eval(self.padded_size), name)
        out = _with_dim(shape, d, p)
        parts = [_remap(shape, d, (Seg(0, 0, n),), name)] if n and 0 not in shape else []
        if p > n and 0 not in out:
            parts.append(_remap(out, d, (Seg(n, 0, p - n),), None))
        return out, tuple(parts)

    def inverse(self) -> Op:
        if self.size is None:
            raise ConfigError("pad without size: cannot be inverted; add size: (the unpadded size)")
        return Unpad(
            self.tensors, self.dim, self.size, self.multiple, self.padded_size, self.optional, self.line
        )


@dataclass(frozen=True, slots=True)
class Unpad(_InPlace):
    """Keep the first ``size`` indices of ``dim``; ``multiple``/``padded_size`` check the input."""

    tensors: NamePattern
    dim: int = 0
    size: Expr = 0
    multiple: Expr | None = None
    padded_size: Expr | None = None
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "unpad"

    def one(self, name: str, shape: tuple[int, ...], env: _Env) -> tuple[tuple[int, ...], tuple[Part, ...]]:
        d = _dim(self.dim, len(shape), name)
        n, keep = shape[d], env.eval(self.size)
        if not 0 <= keep <= n:
            raise ConfigError(f'"{name}" has {n} along dim {d}, cannot unpad to size {keep}', tensor=name)
        if self.multiple is not None or self.padded_size is not None:
            mult = None if self.multiple is None else env.eval(self.multiple)
            want = _padded(keep, mult, None if self.padded_size is None else env.eval(self.padded_size), name)
            if want != n:
                msg = f'"{name}" has {n} along dim {d}, but size {keep} pads to {want}'
                if mult is not None:
                    msg += f" (a multiple of {mult})"
                    fits = [m for m in (2**k for k in range(31)) if m <= n and -(-keep // m) * m == n]
                    if fits and isinstance(self.multiple, str) and self.multiple.isidentifier():
                        # Megatron pads to make_vocab_size_divisible_by x TP: say which multiple fits
                        m = fits[-1]
                        msg += f"; {n} is {keep} padded to a multiple of {m}: give --set {self.multiple}={m}"
                raise ConfigError(msg, tensor=name)
        out = _with_dim(shape, d, keep)
        return out, ((_remap(shape, d, (Seg(0, 0, keep),), name),) if 0 not in out else ())

    def inverse(self) -> Op:
        if self.multiple is None and self.padded_size is None:
            raise ConfigError("unpad without multiple: or padded_size: cannot be inverted; add one")
        return Pad(
            self.tensors, self.dim, self.multiple, self.padded_size, self.size, self.optional, self.line
        )


@dataclass(frozen=True, slots=True)
class Transpose(_InPlace):
    """Swap two dims (HF ``[E, H, 2F]`` expert layouts); copies become element runs, not rows."""

    tensors: NamePattern
    dims: tuple[int, int] = (0, 1)
    optional: bool = False
    line: int = field(default=0, compare=False)
    OP = "transpose"

    def one(self, name: str, shape: tuple[int, ...], env: _Env) -> tuple[tuple[int, ...], tuple[Part, ...]]:
        a, b = (_dim(x, len(shape), name) for x in self.dims)
        order = list(range(len(shape)))
        order[a], order[b] = order[b], order[a]
        out = tuple(shape[s] for s in order)
        dims = tuple(DimMap(s, (Seg(0, 0, shape[s]),) if shape[s] else ()) for s in order)
        return out, (Part(name, dims),)

    def inverse(self) -> Op:
        return self


@dataclass(frozen=True, slots=True)
class Tie(_Base):
    """Make ``to`` a copy of ``from`` (import of tied embeddings); ``from`` stays."""

    source: NamePattern
    target: str
    optional: bool = False
    line: int = field(default=0, compare=False)
    when: str | None = None
    """A yes/no config name (``tie_word_embeddings``): the rule applies only when it is yes."""
    OP = "tie"

    def __post_init__(self) -> None:
        self.source.check_template(self.target, "tie target")

    def run(self, state: State, env: _Env) -> _Step:
        outs = [
            _Out(_fill(self.target, m), state[n].shape, state[n].dtype, (), alias=n)
            for n, m in _matches(self.source, state)
        ]
        return _Step(tuple(outs), frozenset(), frozenset(o.alias for o in outs if o.alias))

    def inverse(self) -> Op:
        if not self.source.invertible:
            raise _not_invertible("tie pattern", self.source.text)
        return Untie(NamePattern(self.target), self.source.text, self.optional, self.line, self.when)


@dataclass(frozen=True, slots=True)
class Untie(_Base):
    """Drop ``tensor``, a tied copy of ``same_as`` (export of tied embeddings)."""

    tensor: NamePattern
    same_as: str
    optional: bool = False
    line: int = field(default=0, compare=False)
    when: str | None = None
    """As :attr:`Tie.when`."""
    OP = "untie"

    def __post_init__(self) -> None:
        self.tensor.check_template(self.same_as, "same_as")

    def run(self, state: State, env: _Env) -> _Step:
        dropped = []
        for n, m in _matches(self.tensor, state):
            keep = _fill(self.same_as, m)
            if keep not in state or (state[keep].shape, state[keep].dtype) != (
                state[n].shape,
                state[n].dtype,
            ):
                got = "missing" if keep not in state else f"{list(state[keep].shape)} {state[keep].dtype}"
                raise ConfigError(
                    f'"{n}" ({list(state[n].shape)} {state[n].dtype}) is not tied to "{keep}" ({got})',
                    tensor=n,
                )
            dropped.append(n)
        ties = tuple((state[n], state[_fill(self.same_as, m)]) for n, m in _matches(self.tensor, state))
        return _Step((), frozenset(dropped), ties=ties)

    def inverse(self) -> Op:
        if not self.tensor.invertible:
            raise _not_invertible("untie pattern", self.tensor.text)
        return Tie(NamePattern(self.same_as), self.tensor.text, self.optional, self.line, self.when)


Op: TypeAlias = (
    "Rename | Drop | Concat | Split | Stack | Unstack | RopePermute | Pad | Unpad | Tie | Untie | Transpose"
)


# -- the spec ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransformSpec:
    """An ordered list of operations, the config names their sizes use, and where it came from.

    Attributes:
        ops: the operations, applied in order.
        config: name -> integer or expression (over other names or config.json keys).
        allow_unused: let tensors no operation touches pass through unchanged
            (otherwise they are an error: a profile that misses a tensor is wrong).
        source: the file, for messages.
        model_types: the config.json ``model_type`` values (model families) the spec is made
            for; a model of another family is a warning (:func:`family_warning`). Empty: any.
        megatron_torch_dist: its names are Megatron-Core's ``torch_dist`` ones: ``--to dcp``
            also writes the two files that make the directory a checkpoint Megatron's
            ``dist_checkpointing.load`` opens (``metadata.json``, ``common.pt``). Not inverted.
    """

    ops: tuple[Op, ...]
    config: tuple[tuple[str, Expr], ...] = ()
    allow_unused: bool = False
    source: str = "<transforms>"
    model_types: tuple[str, ...] = ()
    megatron_torch_dist: bool = False

    def to_json(self) -> dict[str, Any]:
        """The spec as plain data in the YAML's shape (``yaml.safe_dump`` it to get a profile back).

        Used to record the transforms a conversion applied, and to show an inverse spec.
        """
        out: dict[str, Any] = {}
        if self.model_types:
            out["model_types"] = list(self.model_types)
        if self.config:
            out["config"] = dict(self.config)
        out["transforms"] = [_op_json(op) for op in self.ops]
        if self.allow_unused:
            out["allow_unused"] = True
        if self.megatron_torch_dist:
            out["megatron_torch_dist"] = True
        return out

    def with_values(self, values: Mapping[str, int]) -> TransformSpec:
        """This spec with ``values`` as its own ``config:`` entries (``--set``): they win over
        the entries of those names it has and over the model's config.json."""
        kept = tuple((k, v) for k, v in self.config if k not in values)
        return dataclasses.replace(self, config=kept + tuple(values.items()))

    def where(self, i: int) -> str:
        op = self.ops[i]
        line = f":{op.line}" if op.line else ""
        return f"{self.source}{line}: transforms rule {i + 1} ({op.OP}): "


_ATTRS: dict[str, tuple[str, ...]] = {  # op: its attributes, in YAML field order
    "drop": ("tensors",),
    "concat": ("sources", "target", "dim", "groups", "sizes", "shards"),
    "split": ("source", "targets", "dim", "groups", "sizes", "shards"),
    "stack": ("source", "target", "index", "dim", "count"),
    "unstack": ("source", "target", "index", "dim", "count"),
    "rope_permute": ("tensors", "heads", "to", "dim"),
    "pad": ("tensors", "dim", "multiple", "padded_size", "size"),
    "unpad": ("tensors", "dim", "size", "multiple", "padded_size"),
    "tie": ("source", "target", "when"),
    "untie": ("tensor", "same_as", "when"),
    "transpose": ("tensors", "dims"),
}
_YAML_KEY = {"sources": "from", "source": "from", "target": "to", "targets": "to"}


def _plain(v: Any) -> Any:
    if isinstance(v, NamePattern):
        return v.text
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _op_json(op: Op) -> dict[str, Any]:
    if isinstance(op, Rename):
        pairs = [(p.text, t) for p, t in op.pairs]
        body: dict[str, Any] = {"from": pairs[0][0], "to": pairs[0][1]} if len(pairs) == 1 else dict(pairs)
    else:
        values = {attr: getattr(op, attr) for attr in _ATTRS[op.OP]}
        body = {_YAML_KEY.get(a, a): _plain(v) for a, v in values.items() if v is not None}
    if op.optional:
        body["optional"] = True
    return {op.OP: body}


MAX_INT64 = (1 << 63) - 1  # the most elements (and the largest dim) a tensor may have


def _advance(
    state: dict[str, TransformedTensor], step: _Step, touched: set[str]
) -> dict[str, TransformedTensor]:
    """The state after one operation: consumed tensors replaced by the outputs, parts composed."""
    new = {k: v for k, v in state.items() if k not in step.consumed}
    made: dict[str, str] = {}
    for o in step.outputs:
        origin = o.alias or (o.parts[0].source if o.parts and o.parts[0].source else "zeros")
        if o.name in made or o.name in new:
            first = made.get(o.name, "an existing tensor of that name")
            raise ConfigError(
                f'two tensors would be named "{o.name}" (from "{origin}" and {first!r}); '
                "make the target names distinct",
                tensor=o.name,
            )
        made[o.name] = origin
        if o.alias is None and (max(o.shape, default=0) > MAX_INT64 or math.prod(o.shape) > MAX_INT64):
            raise ConfigError(  # a pad's padded_size, say: no safetensors header or torch holds it
                f'"{o.name}" would have shape {list(o.shape)}, over {MAX_INT64} elements (int64)',
                tensor=o.name,
            )
        if o.alias is not None:
            t = state[o.alias]
            new[o.name] = TransformedTensor(o.name, t.shape, t.dtype, t.parts)
        else:
            new[o.name] = _composed(o, state)
    touched.update(made)
    touched.update(step.used)
    return new


def _composed(o: _Out, state: State) -> TransformedTensor:
    """Output ``o`` with its parts (reading tensors of ``state``) composed with theirs.

    Composing depends on the parts' index maps and on which parts read the same tensor, not
    on the tensors' names: outputs alike but for names (the 64 experts of each of 500 layers
    stacked, or unstacked) are composed once, and the others take the result with their own
    names.
    """
    middle: dict[str, int] = {}
    outer = _numbered(o.parts, middle)
    inner = [_structure(state[n].parts) for n in middle]
    ids: dict[str, int] = {}  # the tensors the middle ones read, numbered as first met
    same = tuple(ids.setdefault(n, len(ids)) for _, names in inner for n in names)
    key = (outer, tuple(k for k, _ in inner), same)
    made = _COMPOSED.get(key)
    if made is None:
        parts = merge_parts([c for p in o.parts for c in compose(p, {n: state[n].parts for n in middle})])
        assert sum(part_numel(p) for p in parts) == math.prod(o.shape), o.name
        if all(p.source is None or p.source in ids for p in parts):
            if len(_COMPOSED) >= _COMPOSED_MAX:
                _COMPOSED.clear()
            _COMPOSED[key] = _numbered(parts, ids)  # every name numbered already: ids stays as is
        return TransformedTensor(o.name, o.shape, o.dtype, parts)
    order = list(ids)
    parts = tuple(Part.of_checked(None if i < 0 else order[i], dims, fixed) for dims, fixed, i in made)
    return TransformedTensor(o.name, o.shape, o.dtype, parts)


def _structure(parts: tuple[Part, ...]) -> tuple[tuple[object, ...], list[str]]:
    """``parts`` with the tensors they read numbered as first met, and those tensors (remembered
    for the parts tuple itself: the 64 experts unstacked from one tensor read its parts)."""
    hit = _STRUCTURES.get(id(parts))
    if hit is not None and hit[0] is parts:
        return hit[1], hit[2]
    names: dict[str, int] = {}
    key = _numbered(parts, names)
    if len(_STRUCTURES) >= _COMPOSED_MAX:
        _STRUCTURES.clear()
    _STRUCTURES[id(parts)] = (parts, key, list(names))  # holds parts: its id stays its own
    return key, list(names)


def _numbered(parts: Sequence[Part], names: dict[str, int]) -> tuple[tuple[Any, ...], ...]:
    """Each part as (dims, pins, number of the tensor it reads: -1 for zeros), numbering the
    tensors ``names`` does not hold yet as first met (``names`` gets them)."""
    return tuple(
        (p.dims, p.fixed, -1 if p.source is None else names.setdefault(p.source, len(names))) for p in parts
    )


_STRUCTURES: dict[int, tuple[tuple[Part, ...], tuple[object, ...], list[str]]] = {}
_COMPOSED: dict[
    tuple[object, ...], tuple[tuple[tuple[DimMap, ...], tuple[tuple[int, int], ...], int], ...]
] = {}
""":func:`_composed`'s results by the shape of their inputs, names as numbers (pure: index maps only)."""
_COMPOSED_MAX = 4096


def apply(
    spec: TransformSpec,
    shapes: Mapping[str, Sequence[int]],
    *,
    dtypes: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
    ties: list[tuple[TransformedTensor, TransformedTensor]] | None = None,
    repeats: list[Repeat] | None = None,
) -> dict[str, TransformedTensor]:
    """Resolve ``spec`` on source tensors into target tensors whose parts read the sources.

    Args:
        spec: the transforms.
        shapes: source tensor name -> shape.
        dtypes: source tensor name -> dtype, to check that fused tensors agree.
        config: values for size names (a model's config.json), after the spec's ``config:``.
        ties: when given, gets ``(dropped, kept)`` per tensor an ``untie`` drops, both as
            parts reading the sources, for the caller to compare their values.
        repeats: when given, gets the copies of repeated chunks a ``split`` with ``shards``
            does not read (:class:`Repeat`), for the caller to compare with those it reads.

    Returns:
        Target tensor name -> :class:`TransformedTensor`, sorted by name.

    Raises:
        ConfigError: a rule does not fit the tensors (naming the rule, its line
            and the tensor), matches nothing (unless ``optional: true``), names
            two tensors alike, or a tensor is left untouched (unless ``allow_unused``).
    """
    env = _Env(dict(spec.config), config or {})
    state = {
        n: TransformedTensor(
            n, tuple(s), (dtypes or {}).get(n), (identity_part(n, s),) if math.prod(s) else ()
        )
        for n, s in shapes.items()
    }
    touched: set[str] = set()
    for i, op in enumerate(spec.ops):
        try:
            when = getattr(op, "when", None)
            if when is not None and not env.flag(when):
                continue  # a rule for some models only (tied embeddings), this one not
            step = op.run(state, env)
            if not step.consumed and not step.outputs and not op.optional:
                raise ConfigError(
                    "matches no tensor; fix the pattern, or add optional: true if that is expected"
                )
            state = _advance(state, step, touched)
            if ties is not None:
                ties.extend(step.ties)
            if repeats is not None:
                repeats.extend(step.repeats)
        except ConfigError as e:
            raise ConfigError(spec.where(i) + e.message, path=spec.source, tensor=e.tensor) from None
    left = sorted(n for n in state if n not in touched)
    if left and not spec.allow_unused:
        more = f" and {len(left) - 5} more" if len(left) > 5 else ""
        raise ConfigError(
            f"{spec.source}: no transform rule touches {', '.join(repr(n) for n in left[:5])}{more}; "
            "add a rule for them (a rename keeps or changes the name), or set allow_unused: true "
            "(--allow-unused)",
            path=spec.source,
            tensor=left[0],
        )
    return {n: state[n] for n in sorted(state)}


def config_values(
    spec: TransformSpec, config: Mapping[str, Any] | None, keys: Iterable[str]
) -> dict[str, int]:
    """The integers ``keys`` name as the spec's size expressions see them: its own ``config:``
    entries first (``--set`` values among them), then ``config`` (config.json); keys that
    neither gives are left out.

    >>> spec = TransformSpec((), (("num_key_value_heads", 2),))
    >>> model = {"num_key_value_heads": 8, "hidden_size": 64}
    >>> config_values(spec, model, ["num_key_value_heads", "hidden_size"])
    {'num_key_value_heads': 2, 'hidden_size': 64}

    Raises:
        ConfigError: a ``config:`` entry of one of ``keys`` cannot be evaluated.
    """
    env = _Env(dict(spec.config), config or {})
    out: dict[str, int] = {}
    for key in keys:
        v = env.name(key) if key in env.own else env.external.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            out[key] = v
    return out


def inverse(spec: TransformSpec) -> TransformSpec:
    """The spec that undoes ``spec``: each operation's inverse, in reverse order.

    Raises:
        ConfigError: an operation cannot be undone (``drop``, a regex rename,
            a ``concat`` without ``sizes``, ...), naming the rule.
    """
    ops: list[Op] = []
    for i in range(len(spec.ops) - 1, -1, -1):
        try:
            op = spec.ops[i].inverse()
        except ConfigError as e:
            raise ConfigError(spec.where(i) + e.message, path=spec.source) from None
        if op is not None:
            ops.append(op)
    return TransformSpec(
        tuple(ops), spec.config, spec.allow_unused, f"inverse of {spec.source}", spec.model_types
    )


def family_warning(spec: TransformSpec, config: Mapping[str, Any] | None, profile: str) -> str | None:
    """A warning when the model's config.json names a ``model_type`` the spec does not list.

    A profile's renames and fusions may fit a family they were not made for and still be wrong for
    it (Gemma's RMSNorm scales by ``1 + w`` and its embeddings by ``sqrt(hidden_size)``: a Llama
    profile converts it with exit 0). None when the spec lists no families, there is no config,
    it has no ``model_type``, or the family is listed.

    >>> spec = TransformSpec((), model_types=("llama", "mistral"))
    >>> family_warning(spec, {"model_type": "gemma"}, "hf-to-torchtitan-llama")[:74]
    'profile hf-to-torchtitan-llama is made for model_type llama, mistral; the '
    >>> family_warning(spec, {"model_type": "llama"}, "p") is None
    True
    """
    kind = config.get("model_type") if config is not None else None
    if not spec.model_types or not isinstance(kind, str) or kind in spec.model_types:
        return None
    return (
        f"profile {profile} is made for model_type {', '.join(spec.model_types)}; the model config says "
        f"model_type {kind!r}: the tensors convert by name, but the target framework may expect "
        "transforms this profile does not make (norm offsets, scaled embeddings, another RoPE layout); "
        "check the result before using it"
    )


# -- YAML ------------------------------------------------------------------------

_OPTIONAL = ("optional",)
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # op: (required, optional) fields
    "rename": (("from", "to"), _OPTIONAL),
    "drop": (("tensors",), _OPTIONAL),
    "concat": (("from", "to"), ("dim", "groups", "sizes", "shards", *_OPTIONAL)),
    "split": (("from", "to"), ("dim", "groups", "sizes", "shards", *_OPTIONAL)),
    "stack": (("from", "to", "index"), ("dim", "count", *_OPTIONAL)),
    "unstack": (("from", "to", "index"), ("dim", "count", *_OPTIONAL)),
    "rope_permute": (("tensors", "heads"), ("to", "dim", *_OPTIONAL)),
    "pad": (("tensors",), ("dim", "multiple", "padded_size", "size", *_OPTIONAL)),
    "unpad": (("tensors", "size"), ("dim", "multiple", "padded_size", *_OPTIONAL)),
    "tie": (("from", "to"), ("when", *_OPTIONAL)),
    "untie": (("tensor", "same_as"), ("when", *_OPTIONAL)),
    "transpose": (("tensors",), ("dims", *_OPTIONAL)),
}
_TOP = (
    "name", "description", "model_types", "config", "transforms", "allow_unused", "megatron_torch_dist",
    "mesh", "placements",
)  # fmt: skip


def _str(v: object, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{what} must be a tensor name or pattern (a string), got {v!r}")
    return v


def _strs(v: object, what: str) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise ConfigError(f"{what} must be a list of tensor names, got {v!r}")
    return tuple(_str(x, what) for x in v)


def _int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{what} must be an integer, got {v!r}")
    return v


def _expr(v: object) -> Expr:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"a size must be an integer or an expression such as heads*head_dim, got {v!r}")
    _parse_expr(v)
    return v


def _opt_expr(f: Mapping[str, object], key: str) -> Expr | None:
    return None if f.get(key) is None else _expr(f[key])


def _sizes(f: Mapping[str, object], key: str = "sizes") -> tuple[Expr, ...] | None:
    v = f.get(key)
    if v is None:
        return None
    if not isinstance(v, list):
        raise ConfigError(f"{key}: must be a list, e.g. [heads*head_dim, kv_heads*head_dim], got {v!r}")
    return tuple(_expr(x) for x in v)


def _rename_pairs(f: Mapping[str, object]) -> tuple[tuple[NamePattern, str], ...]:
    if set(f) - {"optional"} == {"from", "to"}:
        return ((NamePattern(_str(f["from"], "from:")), _str(f["to"], "to:")),)
    return tuple(
        (NamePattern(_str(k, "a rename key")), _str(v, f"rename of {k!r}"))
        for k, v in f.items()
        if k != "optional"
    )


def _when(f: Mapping[str, Any]) -> str | None:
    v = f.get("when")
    if v is None:
        return None
    if not isinstance(v, str) or not v.isidentifier():
        raise ConfigError(f"when: must be a config name such as tie_word_embeddings, got {v!r}")
    return v


def _build(op: str, f: Mapping[str, Any], line: int) -> Op:
    """One operation from its YAML fields (already checked for unknown and missing keys)."""
    opt, dim = f.get("optional", False), _int(f.get("dim", 0), "dim:")
    if not isinstance(opt, bool):
        raise ConfigError(f"optional: must be true or false, got {opt!r}")
    if op == "rename":
        return Rename(_rename_pairs(f), opt, line)
    if op == "drop":
        return Drop(NamePattern(_str(f["tensors"], "tensors:")), opt, line)
    if op in ("concat", "split"):
        groups = _expr(f.get("groups", 1))
        if op == "concat":
            pats = tuple(NamePattern(x) for x in _strs(f["from"], "from:"))
            return Concat(pats, _str(f["to"], "to:"), dim, groups, _sizes(f), opt, line, _sizes(f, "shards"))
        src = NamePattern(_str(f["from"], "from:"))
        return Split(src, _strs(f["to"], "to:"), dim, groups, _sizes(f), opt, line, _sizes(f, "shards"))
    if op in ("stack", "unstack"):
        cls = Stack if op == "stack" else Unstack
        src = NamePattern(_str(f["from"], "from:"))
        return cls(
            src, _str(f["to"], "to:"), _str(f["index"], "index:"), dim, _opt_expr(f, "count"), opt, line
        )
    if op == "tie":
        return Tie(NamePattern(_str(f["from"], "from:")), _str(f["to"], "to:"), opt, line, _when(f))
    if op == "untie":
        tensor, same_as = NamePattern(_str(f["tensor"], "tensor:")), _str(f["same_as"], "same_as:")
        return Untie(tensor, same_as, opt, line, _when(f))
    tensors = NamePattern(_str(f["tensors"], "tensors:"))
    if op == "rope_permute":
        return RopePermute(tensors, _expr(f["heads"]), _str(f.get("to", "hf"), "to:"), dim, opt, line)
    if op == "pad":
        return Pad(
            tensors,
            dim,
            _opt_expr(f, "multiple"),
            _opt_expr(f, "padded_size"),
            _opt_expr(f, "size"),
            opt,
            line,
        )
    if op == "unpad":
        return Unpad(
            tensors, dim, _expr(f["size"]), _opt_expr(f, "multiple"), _opt_expr(f, "padded_size"), opt, line
        )
    dims = f.get("dims", [0, 1])
    if not isinstance(dims, list) or len(dims) != 2:
        raise ConfigError(f"dims: must be two dims, e.g. [0, 1], got {dims!r}")
    return Transpose(tensors, (_int(dims[0], "dims:"), _int(dims[1], "dims:")), opt, line)


class _TransformParser(_Parser):
    """Reads ``config:``, ``transforms:`` and ``allow_unused:`` (a layout's other keys are left alone)."""

    def spec(self, root: yaml.Node | None) -> TransformSpec:
        if not isinstance(root, yaml.MappingNode):
            raise self.error(root, "a transforms file is a mapping with a transforms: list")
        top = {key: (k, v) for key, k, v in self.mapping(root, "top-level")}
        for key, (k, _) in top.items():
            if key not in _TOP:
                close = difflib.get_close_matches(key, _TOP, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(k, f"unknown top-level key {key!r}; {hint}allowed keys: {', '.join(_TOP)}")
        if "transforms" not in top:
            raise self.error(
                root, "missing transforms:; add a list of operations, e.g. - rename: {from: a, to: b}"
            )
        config: list[tuple[str, Expr]] = []
        if "config" in top:
            node = top["config"][1]
            if not isinstance(node, yaml.MappingNode):
                raise self.error(node, "config: must map names to integers or expressions, e.g. {heads: 32}")
            for key, _, v in self.mapping(node, "config"):
                try:
                    config.append((key, _expr(self.value(v))))
                except ConfigError as e:
                    raise self.error(v, f"config {key!r}: {e.message}") from None
        allow = self.value(top["allow_unused"][1]) if "allow_unused" in top else False
        if not isinstance(allow, bool):
            raise self.error(top["allow_unused"][1], "allow_unused: must be true or false")
        kinds: tuple[str, ...] = ()
        if "model_types" in top:
            node = top["model_types"][1]
            value = self.value(node)
            if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
                raise self.error(
                    node, "model_types: must be a list of config.json model_type values, e.g. [llama, qwen2]"
                )
            kinds = tuple(value)
        megatron = self.value(top["megatron_torch_dist"][1]) if "megatron_torch_dist" in top else False
        if not isinstance(megatron, bool):
            raise self.error(top["megatron_torch_dist"][1], "megatron_torch_dist: must be true or false")
        return TransformSpec(
            self.ops(top["transforms"][1]), tuple(config), allow, self.source, kinds, megatron
        )

    def ops(self, node: yaml.Node) -> tuple[Op, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(
                node, "transforms: must be a list of operations, e.g. - rename: {from: a, to: b}"
            )
        self.plain(node)
        return tuple(self.op(i, item) for i, item in enumerate(node.value))

    def op(self, i: int, node: yaml.Node) -> Op:
        where = f"transforms rule {i + 1}: "
        if not isinstance(node, yaml.MappingNode) or len(node.value) != 1:
            raise self.error(node, where + f"write one operation per list item, one of {', '.join(_FIELDS)}")
        ((name, k, v),) = self.mapping(node, "operation")
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, _FIELDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise self.error(k, where + f"unknown operation {name!r}; {hint}known: {', '.join(_FIELDS)}")
        where = f"transforms rule {i + 1} ({name}): "
        if not isinstance(v, yaml.MappingNode):
            raise self.error(v, where + "its fields must be a mapping, e.g. {from: a, to: b}")
        fields = {key: self.value(val) for key, _, val in self.mapping(v, name)}
        required, optional = _FIELDS[name]
        if name != "rename" or "from" in fields or "to" in fields:
            for key in fields:
                if key not in required + optional:
                    close = difflib.get_close_matches(key, required + optional, n=1)
                    hint = f"did you mean {close[0]!r}? " if close else ""
                    raise self.error(
                        v, where + f"unknown field {key!r}; {hint}fields: {', '.join(required + optional)}"
                    )
            missing = [key for key in required if key not in fields]
            if missing:
                raise self.error(v, where + f"missing {', '.join(m + ':' for m in missing)}")
        try:
            return _build(name, fields, _line_of(k))
        except ConfigError as e:
            raise self.error(k, where + e.message) from None


def _line_of(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def parse_transforms_text(text: str, source: str = "<transforms>") -> TransformSpec:
    """Parse the ``transforms:`` (and ``config:``) section of a layout or profile YAML.

    Raises:
        ConfigError: the text is not a valid spec; the message names the file, line and rule.
    """
    loader = yaml.SafeLoader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError as e:
            raise _yaml_error(e, source) from None
        return _TransformParser(loader, source).spec(root)
    finally:
        loader.dispose()


def _read(path: str | os.PathLike[str], what: str) -> str:
    """A small text document: regular files only (a FIFO is refused at once), bounded in size."""
    raw = read_document(path, limit=MAX_LAYOUT_BYTES, what=what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{os.fspath(path)}: cannot read the {what}: not UTF-8 text ({e.reason} at byte {e.start})",
            path=os.fspath(path),
        ) from None


def load_transforms(path: str | os.PathLike[str], given: Collection[str] = ()) -> TransformSpec:
    """Read a transforms file or profile (a path, or a bundled profile name: :func:`resolve_profile`);
    ``A,B`` (no file of that name) is ``A`` then ``B``, composed (:func:`chained`; ``given``: the
    size names ``--set`` gives, which the chained profiles may disagree on)."""
    text = os.fspath(path)
    if "," in text and not Path(text).exists():
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise ConfigError(
                f"--transforms {text}: a chain names a profile or file between each comma "
                "(e.g. phi3-to-llama,hf-to-torchtitan-llama)",
                path=text,
            )
        return chained([load_transforms(part) for part in parts], given)
    p = resolve_profile(text)
    return parse_transforms_text(_read(p, "transforms file"), os.fspath(p))


def chained(specs: Sequence[TransformSpec], given: Collection[str] = ()) -> TransformSpec:
    """One spec doing each of ``specs`` in turn (``--transforms phi3-to-llama,hf-to-torchtitan-llama``:
    Phi-3's fused projections split, then torchtitan's permutation and names, in one pass).

    Operations run in order over the tensors the earlier ones made, so the chain is their
    concatenation. A tensor no operation touches is unused unless every spec allows that; the
    model families are the first spec's (the source's); config names shared by two specs must
    say the same, unless ``given`` (``--set``, which then overrides them all) names them.

    Raises:
        ConfigError: two specs give one config name different values.
    """
    config: dict[str, Expr] = {}
    for spec in specs:
        for key, value in spec.config:
            if key in config and config[key] != value and key not in given:
                raise ConfigError(
                    f"{spec.source}: config {key}: {value} differs from {config[key]} in an earlier "
                    "profile of the chain; give one value with --set",
                    path=spec.source,
                )
            config.setdefault(key, value)
    return TransformSpec(
        tuple(op for spec in specs for op in spec.ops),
        tuple(config.items()),
        all(spec.allow_unused for spec in specs),
        " then ".join(spec.source for spec in specs),
        specs[0].model_types if specs else (),
        specs[-1].megatron_torch_dist if specs else False,  # the names the chain ends with
    )


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model's ``config.json`` as a dict (its integer keys feed size expressions).

    Nested ``text_config`` keys (multimodal models) are merged in when the top level lacks them.
    """
    source = os.fspath(path)
    try:
        data = json.loads(_read(path, "model config"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e.msg}, line {e.lineno})", path=source) from None
    except RecursionError:  # [[[[...]]]] past Python's recursion limit (1 MiB holds 500k levels)
        raise ConfigError(
            f"{source}: not a model config.json: it nests arrays or objects deeper than Python can read",
            path=source,
        ) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise ConfigError(f"{source}: not valid JSON ({e})", path=source) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a model config.json is a JSON object", path=source)
    nested = data.get("text_config")
    return {**nested, **data} if isinstance(nested, dict) else data


def _profile_dir() -> Path:
    return Path(__file__).resolve().parent / "configs" / "transforms"


def list_profiles() -> list[str]:
    """Names of the bundled transform profiles (``reshard/configs/transforms/*.yaml``)."""
    d = _profile_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def resolve_profile(name_or_path: str) -> Path:
    """A transforms file: ``name_or_path`` if it exists, else the bundled profile of that name.

    >>> resolve_profile("hf-to-torchtitan-llama").name
    'hf-to-torchtitan-llama.yaml'

    Raises:
        ConfigError: neither a file nor a profile; the message lists the profiles.
    """
    p = Path(name_or_path)
    if p.exists():
        return p
    stem = name_or_path.removesuffix(".yaml")
    candidate = _profile_dir() / f"{stem}.yaml"
    if "/" not in stem and candidate.is_file():
        return candidate
    raise ConfigError(
        f"{name_or_path}: no such transforms file or profile; "
        f"profiles: {', '.join(list_profiles()) or 'none'}",
        path=name_or_path,
    )
