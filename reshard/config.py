"""Layout files (YAML) -> frozen dataclasses: a mesh and ordered placement rules (pure).

A layout file names a mesh and says, per tensor-name pattern, how tensors are
placed on it (SPEC §2)::

    mesh: {fsdp: 2, tp: 4}            # ordered; sizes are defaults, --*-mesh overrides
    placements:                       # ordered rules, first match wins
      "*.mlp.gate_up_proj.weight": {tp: "_S(0, 2)"}
      "*.self_attn.[qkv]_proj.weight": {tp: S(0)}
      "*.o_proj.weight": [R, S(1)]
      "re:model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.experts\\\\..*": {fsdp: S(0), tp: S(1)}
      "*": R

Patterns are shell globs over the whole tensor name (``*`` crosses dots,
``[qkv]`` classes work, as :func:`fnmatch.fnmatchcase`), or a regex after
``re:`` matched against the whole name. Regexes are written in Python syntax but
run on RE2 (``google-re2``), whose time is linear in the name: ``re:(a+)+$`` cannot
hang. Lookarounds and backreferences, which need backtracking, are refused, and
``\\d`` and ``\\w`` are ASCII-only. YAML is read with ``yaml.SafeLoader`` only, and
from its node tree, so duplicate keys (which YAML drops silently) are caught and
every error names the file and line. A layout file is bounded before it is
believed: a regular file (not a FIFO or ``/dev/zero``) of at most
:data:`~reshard.io.safe.MAX_LAYOUT_BYTES`, expanding (through YAML aliases) to at
most :data:`MAX_LAYOUT_NODES` nodes.

>>> cfg = parse_layout_text('''
... mesh: {fsdp: 2, tp: 4}
... placements:
...   "*.q_proj.weight": {fsdp: "_S(0, tp)", tp: S(0)}
...   "*": R
... ''', "demo.yaml")
>>> [str(p) for p in cfg.placements_for("model.layers.0.self_attn.q_proj.weight")]
['_S(0, 4)', 'S(0)']
>>> cfg.match("model.norm.weight").line
5
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypedDict, cast

import yaml

from .errors import ConfigError, LayoutError
from .io.safe import MAX_LAYOUT_BYTES, read_document
from .mesh import Mesh
from .placements import Placement, Replicate, StridedShard, owned, parse_placement

__all__ = [
    "Own",
    "Rule",
    "RuleSpec",
    "LayoutJson",
    "LayoutConfig",
    "load_layout",
    "parse_layout_text",
    "resolve_preset",
    "list_presets",
    "REGEX_PREFIX",
    "MAX_LAYOUT_NODES",
    "MAX_LAYOUT_DEPTH",
]

REGEX_PREFIX = "re:"


class _LayoutJsonRequired(TypedDict):
    mesh: dict[str, list[object]]
    rules: list[list[object]]


class LayoutJson(_LayoutJsonRequired, total=False):
    """A layout as JSON (``reshard.json``'s ``mesh`` and ``rules``; ``optional`` when some rules are)."""

    optional: list[str]


RuleSpec: TypeAlias = tuple[tuple[str | None, Placement], ...]

_OWN = re.compile(r"\s*Own\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*(,\s*local\s*)?\)\s*")


@dataclass(frozen=True, slots=True)
class Own:
    """Whole-tensor assignment on one mesh dim: ``{ep: Own(expert)}`` (expert parallelism).

    The tensor is held whole, by the ranks of that mesh dim owning the number the rule's
    ``re:`` pattern captures in group ``capture``: the E numbers of tensors whose names
    differ only there are dealt in contiguous blocks of E/size (rank c owns
    ``[c*E/size, (c+1)*E/size)``, as Megatron and vLLM place experts). ``local``: in rank
    files the number is the tensor's index on its owning rank (``n - c*E/size``), as Megatron
    and vLLM name local experts (:meth:`LayoutConfig.file_names`, :meth:`LayoutConfig.global_names`).

    >>> Own.parse("Own(expert, local)")
    Own(capture='expert', local=True)
    >>> str(Own("expert")), Own.parse("S(0)") is None
    ('Own(expert)', True)
    """

    capture: str
    local: bool = False

    @classmethod
    def parse(cls, value: object) -> Own | None:
        """``Own(NAME)`` or ``Own(NAME, local)``; None for anything else (a placement)."""
        m = _OWN.fullmatch(value) if isinstance(value, str) else None
        return cls(m.group(1), m.group(2) is not None) if m else None

    def __str__(self) -> str:
        return f"Own({self.capture}, local)" if self.local else f"Own({self.capture})"


_KINDS = ("positional", "named", "all")
_TOP_KEYS = ("mesh", "placements", "optional", "name", "description")
# A layout's transforms section: read by reshard.transform_plan.layout_transforms (a target layout's
# is applied by convert, a source layout's refused), skipped here
_TRANSFORM_KEYS = ("model_types", "config", "transforms", "allow_unused")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")

#: Deepest nesting of YAML collections accepted; a layout nests 3 levels.
MAX_LAYOUT_DEPTH = 64

#: Most YAML nodes a layout may expand to, counting each use of an alias: a
#: 1 MiB file without aliases has fewer; an alias bomb (each level repeating the
#: previous one) stops here instead of growing until killed.
MAX_LAYOUT_NODES = 500_000


class Matcher(Protocol):
    def fullmatch(self, string: str) -> object | None: ...


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``pattern: placements`` entry of a layout file.

    Attributes:
        pattern: as written; a shell glob over the full tensor name, or
            ``"re:<regex>"`` matched with :func:`re.fullmatch`.
        spec: ``((None, p0), (None, p1), ...)`` for a positional list,
            ``(("tp", p), ...)`` for a ``{dim: placement}`` mapping, or
            ``((None, p),)`` for a bare placement string (``kind == "all"``).
        kind: ``"positional"``, ``"named"`` or ``"all"``.
        line: 1-based line of the rule's key in its YAML file; 0 when not from a
            file. Not compared: rules read back from ``reshard.json`` equal the originals.

    >>> r = Rule.from_json("*.[qkv]_proj.weight", {"tp": "S(0)"})
    >>> r.matches("model.layers.0.self_attn.k_proj.weight"), r.matches("model.norm.weight")
    (True, False)
    >>> [str(p) for p in r.placements(Mesh(("fsdp", "tp"), (2, 4)))]
    ['R', 'S(0)']
    >>> r.to_json()
    {'tp': 'S(0)'}
    """

    pattern: str
    spec: RuleSpec
    kind: str
    # Where it was written, not what it says: two rules differing only in line are equal.
    line: int = field(default=0, compare=False)
    # (mesh dim, Own): a whole-tensor assignment on that dim; its spec entry holds R.
    own: tuple[str, Own] | None = None
    # Compiled once: matches() runs for every tensor of a checkpoint.
    _regex: Matcher = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConfigError(f"a rule pattern must be a non-empty string, got {self.pattern!r}")
        if self.kind not in _KINDS:
            raise ConfigError(f"rule kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if isinstance(self.line, bool) or not isinstance(self.line, int) or self.line < 0:
            raise ConfigError(f"rule line must be an integer >= 0, got {self.line!r}")
        spec: RuleSpec = tuple((name, p) for name, p in self.spec)
        object.__setattr__(self, "spec", spec)
        for entry in spec:
            if not isinstance(entry[1], Placement):
                raise ConfigError(f"rule spec entries must be (dim name or None, placement), got {entry!r}")
        _check_spec_names(self.kind, spec)
        object.__setattr__(self, "_regex", _compile(self.pattern))
        if self.own is not None:
            _check_own(self.pattern, self.kind, self.own)

    @classmethod
    def from_json(cls, pattern: str, value: object, *, line: int = 0) -> Rule:
        """Build a rule from its YAML/JSON value (the inverse of :meth:`to_json`).

        Args:
            pattern: glob or ``re:`` regex.
            value: a placement string (``"R"``), a list of them (one per mesh
                dim), or a ``{dim name: placement}`` mapping.
            line: line in the source file, 0 if none.

        Returns:
            The rule.

        Raises:
            ConfigError: a bad value, placement string or pattern.
        """
        if isinstance(value, str):
            return cls(pattern, ((None, _parse_value(value)),), "all", line)
        if isinstance(value, (list, tuple)):
            return cls(pattern, tuple((None, _parse_value(v)) for v in value), "positional", line)
        if isinstance(value, Mapping):
            spec: list[tuple[str | None, Placement]] = []
            own: tuple[str, Own] | None = None
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"mesh dim names must be strings, got {k!r}")
                o = Own.parse(v)
                own = (k, o) if o is not None else own
                spec.append((k, Replicate() if o is not None else _parse_value(v)))
            return cls(pattern, tuple(spec), "named", line, own)
        raise ConfigError(
            f"placements must be a string (R), a list ([R, S(1)]) or a mapping ({{tp: S(0)}}), got {value!r}"
        )

    @property
    def is_regex(self) -> bool:
        """Whether the pattern is a ``re:`` regex rather than a glob."""
        return self.pattern.startswith(REGEX_PREFIX)

    def matches(self, name: str) -> bool:
        """Whether the whole tensor name matches this rule's pattern."""
        return self._regex.fullmatch(name) is not None

    def placements(self, mesh: Mesh) -> tuple[Placement, ...]:
        """This rule's placements on ``mesh``, one per mesh dim, in mesh order.

        Split factors given as a mesh-dim name (``_S(0, tp)``) are bound to that
        dim's size in ``mesh``.

        Args:
            mesh: the mesh the tensor lives on.

        Returns:
            One placement per mesh dim.

        Raises:
            ConfigError: the rule does not fit the mesh (wrong number of
                positional placements, an unknown dim name, or a sharded bare
                placement on a multi-dim mesh).
        """
        dims = ", ".join(mesh.names)
        out: list[Placement]
        if self.kind == "named":
            by_name = dict(self.spec)
            for name in by_name:
                if name not in mesh.names:
                    raise ConfigError(
                        f"names mesh dim {name!r}, but the mesh has dims {dims}; "
                        f"use one of those names or add {name!r} to the mesh"
                    )
            out = [by_name.get(name, Replicate()) for name in mesh.names]
        elif self.kind == "positional":
            if len(self.spec) != mesh.ndim:
                given = "[" + ", ".join(str(p) for _, p in self.spec) + "]"
                raise ConfigError(
                    f"gives {len(self.spec)} placement{'s' if len(self.spec) != 1 else ''} {given} "
                    f"but the mesh has {mesh.ndim} dim{'s' if mesh.ndim != 1 else ''} ({dims}); "
                    f"give one per mesh dim, or use the {{dim: placement}} form, "
                    f"e.g. {{{mesh.names[-1]}: {self.spec[-1][1]}}}"
                )
            out = [p for _, p in self.spec]
        else:
            p = self.spec[0][1]
            if isinstance(p, Replicate):
                out = [p] * mesh.ndim
            elif mesh.ndim == 1:
                out = [p]
            else:
                raise ConfigError(
                    f"{p} on a {mesh.ndim}-d mesh ({dims}) is ambiguous; "
                    f"write {{{mesh.names[-1]}: {p}}} to say which dim"
                )
        sizes = dict(zip(mesh.names, mesh.shape, strict=True))
        return tuple(q.resolve(sizes) if isinstance(q, StridedShard) else q for q in out)

    def to_json(self) -> str | list[str] | dict[str, str]:
        """The YAML/JSON value of this rule, with placements in their short text form."""
        if self.kind == "all":
            return str(self.spec[0][1])
        if self.kind == "positional":
            return [str(p) for _, p in self.spec]
        own = dict([self.own]) if self.own is not None else {}
        return {str(name): str(own.get(str(name), p)) for name, p in self.spec}


@dataclass(frozen=True, slots=True)
class _Captured:
    """The number an ``Own(...)`` rule captures in a tensor name, and where."""

    rule: int  # index of the rule
    group: str  # the name with the number replaced by ``{}``: tensors differing only there
    number: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class LayoutConfig:
    """A mesh and ordered placement rules; the first rule matching a tensor name wins.

    Every rule is checked against ``mesh`` on construction, so a rule that
    cannot fit the mesh fails early, naming the file and line.

    Attributes:
        mesh: the mesh (sizes are defaults; see :meth:`with_mesh`).
        rules: the rules, in file order.
        source: where the rules came from, for messages.
        optional: patterns of rules for tensors only some models have (a preset
            covering several families): matching nothing is not worth a warning.
    """

    mesh: Mesh
    rules: tuple[Rule, ...]
    source: str = "<layout>"
    optional: frozenset[str] = frozenset()
    # Own(capture) rules bound to a checkpoint's names (:meth:`assign`): name -> (number, count in
    # its group, start and end of the number in the name).
    numbers: Mapping[str, tuple[int, int, int, int]] = field(default_factory=dict, compare=False, repr=False)
    # Matching index, derived from rules (:class:`_RuleIndex`): shared by the layouts of the same
    # rules (with_mesh, assign), so a source layout reused on the target mesh matches each name once.
    _index: _RuleIndex = field(init=False, repr=False, compare=False)
    # Each rule's placements on this layout's own mesh (every rule is resolved on it at construction).
    _own_mesh: tuple[tuple[Placement, ...], ...] = field(init=False, repr=False, compare=False)
    # Each rule's placements per mesh, resolved once (100k tensors: 100k lookups, not 100k resolutions).
    _resolved: dict[tuple[int, int], tuple[Mesh, tuple[Placement, ...]]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ConfigError(f"{self.source}: mesh must be a Mesh, got {self.mesh!r}", path=self.source)
        object.__setattr__(self, "rules", tuple(self.rules))
        seen: dict[str, Rule] = {}
        own_mesh: list[tuple[Placement, ...]] = []
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise ConfigError(f"{self.source}: rules must be Rule values, got {rule!r}", path=self.source)
            first = seen.get(rule.pattern)
            if first is not None:
                where = f" (first on line {first.line})" if first.line else ""
                raise ConfigError(
                    f"{self._where(rule)}pattern appears twice{where}; the second can never match, "
                    "so merge them into one rule",
                    path=self.source,
                )
            seen[rule.pattern] = rule
            own_mesh.append(self._placements(rule, self.mesh, None))
        object.__setattr__(self, "_own_mesh", tuple(own_mesh))
        object.__setattr__(self, "optional", frozenset(self.optional))
        missing = sorted(self.optional - seen.keys())
        if missing:
            raise ConfigError(
                f"{self.source}: optional names {missing[0]!r}, which is not a pattern under placements:; "
                "list patterns exactly as written there",
                path=self.source,
            )
        object.__setattr__(self, "_index", _RuleIndex.of(self.rules))

    def _where(self, rule: Rule) -> str:
        line = f":{rule.line}" if rule.line else ""
        return f"{self.source}{line}: rule {rule.pattern!r}: "

    def _placements(self, rule: Rule, mesh: Mesh, tensor: str | None) -> tuple[Placement, ...]:
        # by identity (rules live as long as this layout; the entry holds its mesh): hashing a
        # Mesh per tensor was a tenth of the rule lookups of a 100k-tensor plan
        hit = self._resolved.get((id(rule), id(mesh)))
        if hit is not None and hit[0] is mesh:
            return hit[1]
        try:
            out = rule.placements(mesh)
            self._resolved[(id(rule), id(mesh))] = (mesh, out)
            return out
        except ConfigError as e:
            raise ConfigError(f"{self._where(rule)}{e.message}", path=self.source, tensor=tensor) from None

    def _first(self, name: str) -> int | None:
        """Index of the first rule matching ``name``."""
        return self._index.first(name)

    def match(self, name: str) -> Rule:
        """The first rule whose pattern matches ``name``.

        Raises:
            LayoutError: no rule matches.
        """
        i = self._first(name)
        if i is None:
            raise self._no_rule(name)
        return self.rules[i]

    def _no_rule(self, name: str) -> LayoutError:
        return LayoutError(
            f'tensor "{name}" matches no rule in {self.source}; add a rule for it, '
            f'or "*": R to replicate everything else',
            tensor=name,
            path=self.source,
        )

    def rule_location(self, name: str) -> str:
        """``FILE:LINE: rule 'PATTERN'`` of the rule giving ``name`` its placements, for messages.

        Raises:
            LayoutError: no rule matches.
        """
        return self._where(self.match(name))[:-2]

    def placements_for(self, name: str, mesh: Mesh | None = None) -> tuple[Placement, ...]:
        """Placements of tensor ``name`` on ``mesh`` (default: this layout's mesh).

        Raises:
            LayoutError: no rule matches ``name``.
            ConfigError: the matching rule does not fit ``mesh``.
        """
        i = self._index.first(name)
        if i is None:
            raise self._no_rule(name)
        rule = self.rules[i]
        if rule.own is None and (mesh is None or mesh is self.mesh):
            return self._own_mesh[i]
        mesh = self.mesh if mesh is None else mesh
        out = self._placements(rule, mesh, name)
        return out if rule.own is None else self._owned(rule, name, mesh, out)

    def _owned(self, rule: Rule, name: str, mesh: Mesh, out: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """``out`` with the rule's ``Own(capture)`` dim set to ``Own(owner)`` for tensor ``name``."""
        assert rule.own is not None
        dim, own = rule.own
        where = self._where(rule)
        bound = self.numbers.get(name)
        if bound is None:
            raise LayoutError(
                f'tensor "{name}": {where}{own} needs the checkpoint\'s tensor names to deal numbers to '
                "ranks (LayoutConfig.assign); this command cannot place it",
                tensor=name,
                path=self.source,
            )
        number, count = bound[:2]
        size = mesh.shape[mesh.names.index(dim)]
        if count % size:
            raise LayoutError(
                f'tensor "{name}": {where}{own} deals {count} numbers over the {size} ranks of {dim}, '
                f"which does not divide them; use a {dim} size dividing {count}",
                tensor=name,
                path=self.source,
            )
        i = mesh.names.index(dim)
        return (*out[:i], owned(number // (count // size)), *out[i + 1 :])

    def with_mesh(self, mesh: Mesh) -> LayoutConfig:
        """The same rules on another mesh (e.g. ``--target-mesh tp=8``).

        Raises:
            ConfigError: a rule does not fit ``mesh``.
        """
        return LayoutConfig(mesh, self.rules, self.source, self.optional, self.numbers)

    def assign(self, names: Iterable[str]) -> LayoutConfig:
        """These rules with their ``Own(capture)`` assignments bound to the tensors ``names``.

        Per rule, tensors whose names differ only in the captured number form a group (the
        experts of one layer and projection); a group's numbers must be 0..E-1. Rank ``c`` of
        the mesh dim then owns numbers ``[c*E/size, (c+1)*E/size)``.

        Raises:
            LayoutError: a group's numbers are not 0..E-1 (naming the rule and a tensor).
        """
        owning = [i for i, r in enumerate(self.rules) if r.own is not None]
        if not owning:
            return self
        groups: dict[tuple[int, str], dict[str, _Captured]] = {}
        for name in names:
            hit = self._captured(name)
            if hit is not None:
                groups.setdefault((hit.rule, hit.group), {})[name] = hit
        numbers: dict[str, tuple[int, int, int, int]] = {}
        # one tuple per distinct value (a few per expert number), not one per tensor (200k: 14 MiB)
        shared: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}
        for (i, group), members in groups.items():
            found = sorted({c.number for c in members.values()})
            count = len(found)
            if found != list(range(count)):
                raise LayoutError(
                    f"{self._where(self.rules[i])}the tensors {group.replace('{}', '*')} are numbered "
                    f"{found[:8]}, not 0..{count - 1}: Own(...) deals numbers "
                    "0..E-1 to ranks in contiguous blocks",
                    tensor=next(iter(members)),
                    path=self.source,
                )
            for name, c in members.items():
                value = (c.number, count, c.start, c.stop)
                numbers[name] = shared.setdefault(value, value)
        return LayoutConfig(self.mesh, self.rules, self.source, self.optional, numbers)

    def _captured(self, name: str, *, local: bool = False) -> _Captured | None:
        """The number an ``Own(...)`` rule (a ``local`` one only, if asked) captures in ``name``.

        Raises:
            LayoutError: the capture is not a number.
        """
        i = self._first(name)
        rule = self.rules[i] if i is not None else None
        if rule is None or rule.own is None or (local and not rule.own[1].local):
            return None
        assert i is not None
        m = re.fullmatch(rule.pattern[len(REGEX_PREFIX) :], name)
        assert m is not None  # the rule matched it
        cap = rule.own[1].capture
        key, (start, stop) = m.group(cap), m.span(cap)
        if not (key.isascii() and key.isdigit()):
            raise LayoutError(
                f'tensor "{name}": {self._where(rule)}captures {key!r} for {rule.own[1]}; '
                "the group must capture a number, e.g. (?P<expert>\\d+)",
                tensor=name,
                path=self.source,
            )
        return _Captured(i, name[:start] + "{}" + name[stop:], int(key), start, stop)

    def _own_dim(self, name: str, mesh: Mesh) -> tuple[int, int]:
        """The mesh dim index and size of the ``Own`` rule giving ``name`` its placements."""
        own = self.match(name).own
        assert own is not None
        i = mesh.names.index(own[0])
        return i, mesh.shape[i]

    def file_names(self, mesh: Mesh | None = None) -> dict[str, str]:
        """Tensor name -> its name in its owner's rank files, for the tensors an ``Own(NAME, local)``
        rule renumbers (bound by :meth:`assign`): number ``n`` of a group of E, owned by rank
        ``c = n // (E/size)``, is named ``n - c*E/size`` there. Names that stay are left out.
        """
        mesh = self.mesh if mesh is None else mesh
        out: dict[str, str] = {}
        if not any(r.own is not None and r.own[1].local for r in self.rules):
            return out  # no rule renumbers: no name lookups (100k experts: 100k of them)
        for name, (number, count, start, stop) in self.numbers.items():
            own = self.match(name).own
            if own is None or not own[1].local:
                continue
            size = self._own_dim(name, mesh)[1]
            if count % size == 0 and number % (count // size) != number:
                out[name] = f"{name[:start]}{number % (count // size)}{name[stop:]}"
        return out

    def global_names(self, held: Sequence[Iterable[str]], mesh: Mesh | None = None) -> list[dict[str, str]]:
        """Per rank, the names its files hold under ``Own(NAME, local)`` numbers -> their global names.

        ``held[r]`` are rank ``r``'s names (flat rank on ``mesh``). Every rank must hold numbers
        0..k-1 of each group, the same k everywhere; number ``j`` on the rank at coordinate ``c``
        of the rule's dim is ``c*k + j`` (the inverse of :meth:`file_names`). Names that stay
        are left out.

        Raises:
            LayoutError: a capture is not a number, or the ranks' numbers are not 0..k-1 alike.
        """
        mesh = self.mesh if mesh is None else mesh
        found: list[dict[str, _Captured]] = []
        per_group: dict[tuple[int, str], list[list[int]]] = {}
        for r, names in enumerate(held):
            mine = {n: c for n in names if (c := self._captured(n, local=True)) is not None}
            found.append(mine)
            for c in mine.values():
                per_group.setdefault((c.rule, c.group), [[] for _ in held])[r].append(c.number)
        counts = {key: self._local_count(key, ranks) for key, ranks in per_group.items()}
        out: list[dict[str, str]] = [{} for _ in held]
        if len(held) != mesh.size:
            return out  # the rank count is reported by the reader
        for r, mine in enumerate(found):
            for name, c in mine.items():
                dim = self._own_dim(name, mesh)[0]
                number = mesh.coordinate(r)[dim] * counts[(c.rule, c.group)] + c.number
                if number != c.number:
                    out[r][name] = f"{name[: c.start]}{number}{name[c.stop :]}"
        return out

    def _local_count(self, key: tuple[int, str], ranks: Sequence[Sequence[int]]) -> int:
        """k, when every rank holds numbers 0..k-1 of the group ``key`` (rule index, name with ``{}``)."""
        rule = self.rules[key[0]]
        assert rule.own is not None
        want = sorted(ranks[0])
        for r, numbers in enumerate(ranks):
            got = sorted(numbers)
            if got != list(range(len(got))) or len(got) != len(want):
                raise LayoutError(
                    f"{self._where(rule)}rank {r} holds the tensors {key[1].replace('{}', '*')} numbered "
                    f"{got[:8]}, rank 0 {want[:8]}: {rule.own[1]} needs every rank to hold rank-local "
                    "numbers 0..k-1, the same k on each",
                    path=self.source,
                )
        return len(want)

    def unused_rules(self, names: Iterable[str]) -> list[Rule]:
        """Rules that are the first match of none of ``names`` (worth a warning), except optional ones.

        Names no rule matches are ignored here; :meth:`match` reports them.
        """
        used: set[int] = set()
        for name in names:
            i = self._first(name)
            if i is not None:
                used.add(i)
                if len(used) == len(self.rules):
                    break
        return [r for i, r in enumerate(self.rules) if i not in used and r.pattern not in self.optional]

    def to_json(self) -> LayoutJson:
        """``{"mesh": {"names": [...], "shape": [...]}, "rules": [[pattern, value], ...]}``.

        ``"optional": [pattern, ...]`` is added when some rules are optional.
        """
        out: LayoutJson = {
            "mesh": self.mesh.to_json(),
            "rules": [[r.pattern, r.to_json()] for r in self.rules],
        }
        if self.optional:
            out["optional"] = [r.pattern for r in self.rules if r.pattern in self.optional]
        return out

    @classmethod
    def from_json(cls, data: object, source: str = "<reshard.json>") -> LayoutConfig:
        """Read back :meth:`to_json` output.

        ``mesh`` may also be an ordered ``{name: size}`` mapping and ``rules`` a
        ``{pattern: value}`` mapping, as in a layout file.

        Raises:
            ConfigError: ``data`` is not in that shape.
        """
        pre = f"{source}: "
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{pre}layout must be an object with mesh and rules, got {type(data).__name__}",
                path=source,
            )
        try:
            mesh = _mesh_from_json(data.get("mesh"))
        except ConfigError as e:
            raise ConfigError(f"{pre}{e.message}", path=source) from None
        rules_data = data.get("rules")
        if isinstance(rules_data, Mapping):
            pairs: list[object] = [[k, v] for k, v in rules_data.items()]
        elif isinstance(rules_data, list):
            pairs = list(rules_data)
        else:
            raise ConfigError(
                f"{pre}rules must be a list of [pattern, placements] pairs, got {rules_data!r}",
                path=source,
            )
        rules = [_rule_from_json(pair, pre, source) for pair in pairs]
        optional = data.get("optional", [])
        if not isinstance(optional, list) or not all(isinstance(p, str) for p in optional):
            raise ConfigError(f"{pre}optional must be a list of rule patterns, got {optional!r}", path=source)
        return cls(mesh, tuple(rules), source, frozenset(optional))


# -- patterns ------------------------------------------------------------------


_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_ASCII_DIGIT = re.compile("[0-9]")
_MEMO_MAX = 4096
"""Canonical names :class:`_RuleIndex` remembers; past this many it starts over (a checkpoint's
names mostly differ in their numbers only: a few dozen canonical names)."""


class _RuleIndex:
    """First-match lookup over a layout's rules, shared by the layouts of one rules tuple.

    Literal patterns map name -> first rule index (a self-describing checkpoint brings one
    exact-name rule per tensor: trying every rule on every name is quadratic); the rest are
    tried in order.

    Rules whose pattern holds no ASCII digit cannot tell digits apart: every character test
    such a pattern makes (a literal other than a digit; ``*``, ``?`` and ``.``; a class, whose
    ranges between non-digits hold all ten digits or none; ``\\d``, ``\\w``, ``\\s``, a
    word boundary; their negations) gives one answer for all ten digits, so a name matches
    it exactly when the name with each digit replaced by ``0`` (same length: ``?`` and
    ``.`` count characters) does. Their first match is therefore remembered per canonical
    name, and the 100k names ``layers.{i}.experts.{j}.w`` of a checkpoint take a few rule
    matches, not 100k. Rules whose pattern mentions a digit (``layers.0.*``, ``[1-9]``,
    ``{2}``) are tried on the name itself, ahead of the remembered one.

    >>> idx = _RuleIndex((Rule.from_json("*.0.w", "R"), Rule.from_json("*.w", "R")))
    >>> idx.first("l.0.w"), idx.first("l.10.w"), idx.first("l.1.w"), idx.first("x")
    (0, 1, 1, None)
    """

    __slots__ = ("rules", "_free", "_digits", "_memo", "__weakref__")

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules  # keeps the tuple's id its own while this index lives
        digits = [_ASCII_DIGIT.search(r.pattern) is not None for r in rules]
        free = [i for i, d in enumerate(digits) if not d]
        mentioning = [i for i, d in enumerate(digits) if d]
        self._free = _Lookup(rules, free) if free else None
        self._digits = _Lookup(rules, mentioning) if mentioning else None
        self._memo: dict[bytes, int] = {}

    @classmethod
    def of(cls, rules: tuple[Rule, ...]) -> _RuleIndex:
        """The index of ``rules``: the one already made for this very tuple (a layout on
        another mesh, or with ``Own`` numbers bound), else a new one."""
        idx = _INDEXES.get(id(rules))
        if idx is None or idx.rules is not rules:
            idx = _INDEXES[id(rules)] = cls(rules)
        return idx

    def first(self, name: str) -> int | None:
        """Index of the first rule matching ``name``, or None."""
        free, digits = self._free, self._digits
        if free is None:
            return digits.first(name, len(self.rules)) if digits is not None else None
        key = name.encode("utf-8", "surrogatepass").translate(_ZEROS)
        hit = self._memo.get(key)
        if hit is None:  # -1: no digit-free rule matches
            found = free.first(key.decode("utf-8", "surrogatepass"), len(self.rules))
            hit = -1 if found is None else found
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            self._memo[key] = hit
        if digits is not None:  # an earlier rule mentioning a digit wins
            earlier = digits.first(name, len(self.rules) if hit < 0 else hit)
            if earlier is not None:
                return earlier
        return None if hit < 0 else hit


_INDEXES: weakref.WeakValueDictionary[int, _RuleIndex] = weakref.WeakValueDictionary()
"""Rule indexes by the id of their rules tuple (each holds its tuple), alive while a layout uses them."""


class _Lookup:
    """First match among some rules (by index into the layout's rules)."""

    __slots__ = ("_exact", "_patterns")

    def __init__(self, rules: tuple[Rule, ...], which: Sequence[int]) -> None:
        exact: dict[str, int] = {}
        # (index, its matcher's fullmatch) of the other rules; None for "*", which matches every name
        patterns: list[tuple[int, Callable[[str], object] | None]] = []
        for i in which:
            rule = rules[i]
            literal = _literal(rule.pattern)
            if literal is None:
                patterns.append((i, None if rule.pattern == "*" else rule._regex.fullmatch))
            else:
                exact.setdefault(literal, i)
        self._exact = exact
        self._patterns = _grouped(patterns, rules)

    def first(self, name: str, stop: int) -> int | None:
        """Index (below ``stop``) of the first of these rules matching ``name``: the exact hit
        unless an earlier pattern matches."""
        hit = self._exact.get(name)
        if hit is not None and hit < stop:
            stop = hit
        else:
            hit = None
        for i, fullmatch, group in self._patterns:
            if i >= stop:
                break
            if group is not None:  # consecutive re: rules: the first of them matching
                first = group.first(name)
                if first is not None:
                    return first if first < stop else hit
            elif fullmatch is None or fullmatch(name) is not None:
                return i
        return hit


def _grouped(
    patterns: list[tuple[int, Callable[[str], object] | None]], rules: tuple[Rule, ...]
) -> tuple[tuple[int, Callable[[str], object] | None, _Re2Group | None], ...]:
    """``patterns`` with each run of consecutive ``re:`` rules as one entry: an RE2 set of them
    all, one match a name instead of one per rule (an expert-parallel preset's rules tried
    on 100k names, four times each), answering the index of the first rule matching."""
    out: list[tuple[int, Callable[[str], object] | None, _Re2Group | None]] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) > 1:
            group = _Re2Group([cast(_Re2, rules[i]._regex) for i in run], list(run))
            out.append((run[0], None, group))
        elif run:
            out.append((run[0], rules[run[0]]._regex.fullmatch, None))
        run.clear()

    for i, fullmatch in patterns:
        if fullmatch is not None and isinstance(rules[i]._regex, _Re2):
            run.append(i)
            continue
        flush()
        out.append((i, fullmatch, None))
    flush()
    return tuple(out)


class _Re2Group:
    """Several ``re:`` rules' RE2 patterns in one set: the index of the first matching a name."""

    __slots__ = ("_matchers", "_set", "_indices")

    def __init__(self, matchers: Sequence[_Re2], indices: list[int]) -> None:
        import re2

        self._matchers = list(matchers)
        self._set = re2.Set.FullMatchSet(_re2_options())
        for m in matchers:
            self._set.Add(m._body)  # each compiled on its own already (_Re2): no errors here
        self._set.Compile()
        self._indices = indices

    def first(self, name: str) -> int | None:
        found = self._set.Match(name)
        return self._indices[min(found)] if found else None

    def __reduce__(self) -> tuple[type[_Re2Group], tuple[list[_Re2], list[int]]]:
        return (_Re2Group, (self._matchers, self._indices))  # an RE2 set cannot be pickled


class _Exact:
    """Matches one name: a literal pattern compiles no regex (``reshard.json`` brings one per tensor)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def fullmatch(self, string: str) -> object | None:
        return True if string == self.text else None


class _Stars:
    """A glob whose only wildcard is ``*`` (``*.down_proj.weight``, ``*``), matched by string
    methods as :func:`fnmatch.fnmatchcase` would: the first part starts the name, the last ends
    it, and the parts between are found in order, each as early as it occurs (the earliest
    place leaves the most room for the rest). A tenth of a regex match per tensor name.

    >>> m = _Stars("l.*.w*.weight")
    >>> bool(m.fullmatch("l.0.w1.weight")), bool(m.fullmatch("l.0.weight")), bool(_Stars("*").fullmatch(""))
    (True, False, True)
    """

    __slots__ = ("_first", "_middle", "_last", "_least")

    def __init__(self, pattern: str) -> None:
        first, *middle, last = pattern.split("*")
        self._first, self._middle, self._last = first, tuple(middle), last
        self._least = len(pattern) - len(middle) - 1  # the characters that are not stars

    def fullmatch(self, string: str) -> object | None:
        if len(string) < self._least or not string.startswith(self._first) or not string.endswith(self._last):
            return None
        at, end = len(self._first), len(string) - len(self._last)
        for part in self._middle:
            i = string.find(part, at, end)
            if i < 0:
                return None
            at = i + len(part)
        return True


class _Re2:
    """Whole-name matching by RE2: time linear in the name, whatever the pattern.

    A one-pattern ``re2.Set`` answers match/no-match without building a match
    object: ~1.4 us a name against ~7 us for ``re2.compile(...).fullmatch``.
    """

    __slots__ = ("_body", "_set")

    def __init__(self, body: str) -> None:
        import re2  # lazy: only layouts with re: rules load it

        body = self._body = _re2_escapes(body)
        options = _re2_options()
        try:
            re2.compile(body, options)  # for its message: Set.Add only says "failed"
            self._set = re2.Set.FullMatchSet(options)
            self._set.Add(body)
            self._set.Compile()
        except re2.error as e:
            why = _re2_reason(e)
            raise ConfigError(
                f"regex after 're:' is not supported: {why}; re: rules run on RE2, which guarantees "
                "linear-time matching and so has no lookarounds ((?=, (?!, (?<=, (?<!), backreferences "
                "(\\1, (?P=name)), atomic groups or possessive repeats; rewrite the rule without them, "
                "e.g. as several rules (the first match wins)"
            ) from None

    def fullmatch(self, string: str) -> object | None:
        return True if self._set.Match(string) else None

    def __reduce__(self) -> tuple[type[_Re2], tuple[str]]:
        return (_Re2, (self._body,))  # an RE2 set cannot be pickled: compile again


_PY_ESCAPE = re.compile(r"\\(\\|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|N\{[^}]*\})")


def _re2_escapes(body: str) -> str:
    r"""``body`` with Python's escapes of a character by number or name, which RE2 lacks,
    written as RE2's ``\x{...}`` (the syntax check is Python's, so ``re:a\u202eb`` was
    accepted, then refused by RE2 with a message about lookarounds). An escaped backslash
    stays as it is.

    >>> print(_re2_escapes(r"a\u202e[\U0001F600]\N{DIGIT ONE}\\u1234"))
    a\x{202e}[\x{1f600}]\x{31}\\u1234
    """
    if "\\" not in body:
        return body
    import unicodedata

    def sub(m: re.Match[str]) -> str:
        esc = m.group(1)
        if esc == "\\":
            return m.group(0)
        try:
            code = ord(unicodedata.lookup(esc[2:-1])) if esc[0] == "N" else int(esc[1:], 16)
        except KeyError:  # no such character name: left for RE2 to refuse
            return m.group(0)
        return f"\\x{{{code:x}}}"

    return _PY_ESCAPE.sub(sub, body)


def _re2_reason(e: Exception) -> object:
    """What an ``re2.error`` says is wrong with a pattern (its message comes as bytes)."""
    return e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else e


def _re2_options() -> Any:
    """RE2 options for whole-name matching: no captures, and errors not also printed to stderr."""
    import re2

    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    return options


def _compile(pattern: str) -> Matcher:
    if pattern == REGEX_PREFIX:
        raise ConfigError('the regex after "re:" is empty; write e.g. "re:model\\.layers\\.\\d+\\..*"')
    literal = _literal(pattern)
    if literal is not None:
        return _Exact(literal)
    if pattern.startswith(REGEX_PREFIX):
        body = pattern[len(REGEX_PREFIX) :]
        try:
            with warnings.catch_warnings():  # "possible nested set" FutureWarnings are not errors
                warnings.simplefilter("ignore")
                re.compile(body)  # Python's syntax and messages first: rules are written for it
        except re.error as e:
            raise ConfigError(
                f"invalid regex after 're:': {e.msg} at position {e.pos}; "
                "fix the regex (it is matched against the whole tensor name)"
            ) from None
        return _Re2(body)
    if "*" in pattern and "?" not in pattern and "[" not in pattern:
        return _Stars(pattern)
    # fnmatch.translate gives fnmatchcase semantics (`*` crosses dots, [..] classes), and
    # its `*` groups are atomic, so a glob cannot backtrack catastrophically either.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return re.compile(fnmatch.translate(pattern))


def _literal(pattern: str) -> str | None:
    r"""The one name ``pattern`` matches, if it is a literal; else None.

    A glob without ``*?[`` is literal (:func:`fnmatch.translate` escapes the
    rest). A ``re:`` pattern is literal when it is exactly ``re.escape`` of its
    unescaped text, as the exact-name rules of self-describing checkpoints are.

    >>> _literal("model.norm.weight"), _literal("*.weight"), _literal("re:a\\.b"), _literal("re:a.b")
    ('model.norm.weight', None, 'a.b', None)
    """
    if not pattern.startswith(REGEX_PREFIX):
        return None if any(c in pattern for c in "*?[") else pattern
    body = pattern[len(REGEX_PREFIX) :]
    text = re.sub(r"\\(.)", r"\1", body, flags=re.DOTALL)
    return text if re.escape(text) == body else None


def _parse_value(value: object) -> Placement:
    """parse_placement with friendlier messages for what YAML typically does to them."""
    if value is None:
        raise ConfigError("missing placement; write e.g. R, S(0) or _S(0, 2)")
    try:
        return parse_placement(value)
    except ConfigError as e:
        msg = e.message
        if isinstance(value, str) and value.count("(") != value.count(")"):
            msg += (
                "; a comma inside {...} or [...] splits a YAML value, so quote placements "
                'with commas: {tp: "_S(0, 2)"}'
            )
        raise ConfigError(msg) from None


# -- YAML ----------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "mapping"
    if isinstance(node, yaml.SequenceNode):
        return "list"
    return "scalar"


class _Parser:
    """Builds a LayoutConfig from a SafeLoader node tree, remembering lines."""

    def __init__(self, loader: yaml.SafeLoader, source: str) -> None:
        self.loader = loader
        self.source = source

    def error(self, node: yaml.Node | int | None, message: str) -> ConfigError:
        line = node if isinstance(node, int) else (_line(node) if node is not None else 0)
        where = f"{self.source}:{line}: " if line else f"{self.source}: "
        return ConfigError(where + message, path=self.source)

    def plain(self, node: yaml.Node) -> None:
        """Refuse tagged collections (``!!python/...``): we walk them without constructing."""
        if node.tag not in _PLAIN_TAGS:
            raise self.error(
                node,
                f"unsupported YAML tag {node.tag!r}; a layout file holds plain mappings, lists and strings",
            )

    def value(self, node: yaml.Node) -> object:
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as e:
            raise _yaml_error(e, self.source) from None
        except ValueError:  # int() refusing a scalar of thousands of digits
            raise self.error(node, f"the number {_short(node, None)} is too long") from None

    def mapping(self, node: yaml.MappingNode, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """(key text, key node, value node) in order; duplicate keys are an error."""
        self.plain(node)
        try:
            self.loader.flatten_mapping(node)  # resolve `<<` merge keys
        except yaml.MarkedYAMLError as e:
            raise _yaml_error(e, self.source) from None
        out: list[tuple[str, yaml.Node, yaml.Node]] = []
        first: dict[str, int] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise self.error(k, f"{what} keys must be plain strings, got a {_kind(k)}")
            key = str(k.value)
            if key in first:
                raise self.error(
                    k,
                    f"{what} key {key!r} appears twice (first on line {first[key]}); "
                    "YAML would silently keep only the last one, so remove or merge one of them",
                )
            first[key] = _line(k)
            out.append((key, k, v))
        return out

    def layout(self, root: yaml.Node | None) -> LayoutConfig:
        if root is None:
            raise self.error(None, "layout file is empty; it needs mesh: and placements: (see configs/)")
        if not isinstance(root, yaml.MappingNode):
            raise self.error(
                root,
                f"the top level must be a mapping with keys mesh: and placements:, got a {_kind(root)}",
            )
        top = {key: (k, v) for key, k, v in self.mapping(root, "top-level")}
        for key, (k, v) in top.items():
            if key in _TRANSFORM_KEYS:
                continue
            if key not in _TOP_KEYS:
                close = difflib.get_close_matches(key, _TOP_KEYS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(
                    k, f"unknown top-level key {key!r}; {hint}allowed keys: {', '.join(_TOP_KEYS)}"
                )
            if key in ("name", "description") and not isinstance(self.value(v), str):
                raise self.error(v, f"{key} must be a string")
        if "mesh" not in top:
            raise self.error(root, "missing mesh:; add e.g. mesh: {fsdp: 2, tp: 4} (dim name -> size)")
        if "placements" not in top:
            raise self.error(root, 'missing placements:; add ordered pattern -> placement rules, e.g. "*": R')
        mesh = self.mesh(*top["mesh"])
        rules = self.rules(*top["placements"])
        optional = self.optional(rules, top["optional"][1]) if "optional" in top else frozenset[str]()
        return LayoutConfig(mesh, rules, self.source, optional)

    def optional(self, rules: tuple[Rule, ...], node: yaml.Node) -> frozenset[str]:
        """``optional:``, a list of patterns written under ``placements:`` (no warning when unused)."""
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, f"optional must be a list of rule patterns, got a {_kind(node)}")
        self.plain(node)
        patterns = {r.pattern for r in rules}
        out: set[str] = set()
        for item in node.value:
            value = self.value(item) if isinstance(item, yaml.ScalarNode) else None
            if not isinstance(value, str) or value not in patterns:
                close = difflib.get_close_matches(str(value), sorted(patterns), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(
                    item,
                    f"optional lists {_short(item, value)}, which is not a pattern under placements:; "
                    f"{hint}copy the pattern exactly as written there",
                )
            out.add(value)
        return frozenset(out)

    def mesh(self, key: yaml.Node, node: yaml.Node) -> Mesh:
        example = "e.g. mesh: {fsdp: 2, tp: 4}"
        if not isinstance(node, yaml.MappingNode):
            raise self.error(
                node, f"mesh must be a mapping of dim name to size, {example}; got a {_kind(node)}"
            )
        items = self.mapping(node, "mesh")
        if not items:
            raise self.error(node, f"mesh is empty; name at least one dim, {example}")
        names: list[str] = []
        sizes: list[int] = []
        for name, k, v in items:
            if not _NAME.match(name):
                raise self.error(k, f"mesh dim name {name!r} is not an identifier; use e.g. tp, fsdp, ep")
            # Length first: int() of thousands of digits is slow, and refused past 4300.
            size = self.value(v) if not isinstance(v, yaml.ScalarNode) or len(v.value) <= 16 else None
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self.error(
                    v, f"mesh dim {name!r} must have a positive integer size, got {_short(v, size)}"
                )
            names.append(name)
            sizes.append(size)
        try:
            return Mesh(tuple(names), tuple(sizes))
        except ConfigError as e:
            raise self.error(node, e.message) from None

    def rules(self, key: yaml.Node, node: yaml.Node) -> tuple[Rule, ...]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(
                node,
                "placements must be an ordered mapping of pattern -> placement, "
                f'e.g. "*.o_proj.weight": {{tp: S(1)}}; got a {_kind(node)}',
            )
        items = self.mapping(node, "placements")
        if not items:
            raise self.error(node, 'placements is empty; add at least one rule, e.g. "*": R')
        return tuple(self.rule(pattern, k, v) for pattern, k, v in items)

    def placement(self, pattern: str, node: yaml.Node) -> Placement:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(
                node,
                f"rule {pattern!r}: a placement must be a string such as R or S(0), got a {_kind(node)}",
            )
        value = self.value(node)
        try:
            return _parse_value(value)
        except ConfigError as e:
            raise self.error(node, f"rule {pattern!r}: {e.message}") from None

    def rule(self, pattern: str, key: yaml.Node, node: yaml.Node) -> Rule:
        spec: list[tuple[str | None, Placement]] = []
        own: tuple[str, Own] | None = None
        if isinstance(node, yaml.MappingNode):
            kind = "named"
            for dim, _, v in self.mapping(node, f"rule {pattern!r}: mesh dim"):
                o = Own.parse(self.value(v)) if isinstance(v, yaml.ScalarNode) else None
                if o is not None and own is not None:
                    raise self.error(v, f"rule {pattern!r}: Own(...) is given twice; assign on one mesh dim")
                own = (dim, o) if o is not None else own
                spec.append((dim, Replicate() if o is not None else self.placement(pattern, v)))
        elif isinstance(node, yaml.SequenceNode):
            kind = "positional"
            self.plain(node)
            for v in node.value:
                spec.append((None, self.placement(pattern, v)))
        else:
            kind = "all"
            spec.append((None, self.placement(pattern, node)))
        try:
            return Rule(pattern, tuple(spec), kind, _line(key), own)
        except ConfigError as e:
            raise self.error(key, f"rule {pattern!r}: {e.message}") from None


def _short(node: yaml.Node, value: object) -> str:
    """A bounded rendering of a bad YAML value for a message."""
    raw = str(node.value) if isinstance(node, yaml.ScalarNode) and len(node.value) > 16 else None
    text = repr(value if raw is None else raw)  # raw: not constructed, it may be a huge int
    if len(text) <= 40:
        return text
    return f"{text[:37]}... ({len(raw if raw is not None else text)} characters)"


# One left-to-right pass: a quoted string (an unterminated one runs to the end, so
# nothing is scanned twice), a comment, or a bracket.
_FLOW_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|\'[^\']*(?:\'\'[^\']*)*\'?|(?<!\S)#[^\n]*|[\[\]{}]')


def _flow_depth(text: str, limit: int) -> bool:
    """Whether ``[``/``{`` nest at most ``limit`` deep outside quotes and comments.

    Checked before parsing: PyYAML's scanner takes quadratic time in the flow
    nesting depth (``[[[[...`` of 5000 levels takes seconds), so depth is bounded
    on the text, in one linear pass.
    """
    depth = 0
    for m in _FLOW_TOKEN.finditer(text):
        c = m.group()
        if c == "[" or c == "{":
            depth += 1
            if depth > limit:
                return False
        elif depth and (c == "]" or c == "}"):
            depth -= 1
    return True


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in ``root`` counting every use of an alias, stopping once past ``limit``.

    Iterative, and stops early: an alias bomb expands exponentially, so only
    ``limit`` steps are ever taken.
    """
    count = 0
    stack: list[yaml.Node] = [root]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append(k)
                stack.append(v)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return count


def _yaml_error(e: yaml.YAMLError, source: str) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    what = f"{problem} ({context})" if context else str(problem)
    hint = "fix the YAML syntax"
    if context and "alias" in context:
        hint = 'a key starting with * must be quoted, e.g. "*": R or "*.norm.weight": R'
    elif "escape" in str(problem):
        hint = "in double quotes write \\\\ for a regex backslash, or use single quotes: 're:a\\.b'"
    elif "\t" in str(problem) or "'\\t'" in str(problem):
        hint = "indent with spaces, not tabs"
    where = f"{source}:{mark.line + 1}: " if mark is not None else f"{source}: "
    return ConfigError(f"{where}invalid YAML: {what}; {hint}", path=source)


def parse_layout_text(text: str, source: str = "<layout>") -> LayoutConfig:
    """Parse the text of a layout file.

    Args:
        text: YAML with ``mesh:`` and ``placements:`` (SPEC §2).
        source: the file name used in messages.

    Returns:
        The layout, every rule checked against the file's mesh.

    Raises:
        ConfigError: the text is not a valid layout; the message starts with
            ``"{source}:{line}: "`` when the line is known.
    """
    if not _flow_depth(text, MAX_LAYOUT_DEPTH):
        raise ConfigError(
            f"{source}: layout file nests [ ] or {{ }} more than {MAX_LAYOUT_DEPTH} levels deep; "
            "a layout needs 3",
            path=source,
        )
    try:
        loader = yaml.SafeLoader(text)  # the reader refuses control characters here already
    except yaml.reader.ReaderError as e:
        raise ConfigError(
            f"{source}: invalid YAML: character #x{e.character:04x} at position {e.position} is not "
            f"allowed ({e.reason}); a layout file is plain text",
            path=source,
        ) from None
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError as e:
            raise _yaml_error(e, source) from None
        except RecursionError:  # the composer recurses once per nesting level
            raise ConfigError(f"{source}: layout file is nested too deeply", path=source) from None
        if root is not None and _expanded_size(root, MAX_LAYOUT_NODES) > MAX_LAYOUT_NODES:
            raise ConfigError(
                f"{source}: layout file expands to more than {MAX_LAYOUT_NODES} YAML nodes "
                "(through aliases such as *name); a layout needs a few per rule, so this looks "
                "like an alias bomb",
                path=source,
            )
        return _Parser(loader, source).layout(root)
    finally:
        loader.dispose()


def load_layout(path: str | os.PathLike[str]) -> LayoutConfig:
    """Read and parse a layout file (use :func:`resolve_preset` for preset names).

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is over
            :data:`~reshard.io.safe.MAX_LAYOUT_BYTES`, or is not a valid layout.
    """
    source = os.fspath(path)
    if not os.path.exists(source):
        presets = ", ".join(list_presets()) or "none found"
        raise ConfigError(
            f"{source}: layout file not found; check the path, or use a preset ({presets})",
            path=source,
        )
    # Regular files only (a FIFO would hang, /dev/zero never ends), at most MAX_LAYOUT_BYTES.
    raw = read_document(source, limit=MAX_LAYOUT_BYTES, what="layout file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: cannot read the layout file: not UTF-8 text ({e.reason} at byte {e.start})",
            path=source,
        ) from None
    return parse_layout_text(text, source)


# -- presets -------------------------------------------------------------------


def _preset_dirs() -> list[Path]:
    """Where presets live: ``reshard/configs`` (package data; the checkout's ``configs/`` links there)."""
    here = Path(__file__).resolve().parent / "configs"
    return [here] if here.is_dir() else []


def list_presets() -> list[str]:
    """Names of the bundled layout presets (``configs/*.yaml``), sorted."""
    names: set[str] = set()
    for d in _preset_dirs():
        names.update(p.stem for p in d.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return sorted(names)


def resolve_preset(name_or_path: str) -> Path:
    """A layout file path: ``name_or_path`` itself if it exists, else a bundled preset.

    >>> resolve_preset("llama-tp").name
    'llama-tp.yaml'

    Args:
        name_or_path: a path, or a preset name with or without ``.yaml``.

    Returns:
        The path of the layout file.

    Raises:
        ConfigError: neither a file nor a preset; the message lists the presets.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    stem = name_or_path
    for suffix in (".yaml", ".yml"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    if stem and "/" not in stem and os.sep not in stem:
        for d in _preset_dirs():
            for suffix in (".yaml", ".yml"):
                candidate = d / f"{stem}{suffix}"
                if candidate.is_file():
                    return candidate
    presets = ", ".join(list_presets()) or "none found"
    raise ConfigError(
        f"{name_or_path}: no such layout file or preset; pass a path to a YAML layout file "
        f"or one of the presets: {presets}",
        path=name_or_path,
    )


# -- JSON forms of rules and meshes ----------------------------------------------


def _check_spec_names(kind: str, spec: RuleSpec) -> None:
    """A rule's dim names fit its kind: identifiers given once (named), none otherwise."""
    names = [name for name, _ in spec]
    if kind == "named":
        if not spec:
            raise ConfigError(
                "the {dim: placement} mapping is empty; "
                "name at least one mesh dim, e.g. {tp: S(0)}, "
                "or write R to replicate"
            )
        for name in names:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ConfigError(
                    f"mesh dim name {name!r} is not an identifier; use a dim name from mesh:, "
                    "or a list [R, S(0)] to give placements by position"
                )
        dups = sorted({n for n in names if names.count(n) > 1 and n is not None})
        if dups:
            raise ConfigError(f"mesh dim {dups[0]!r} is given twice; give each dim one placement")
        return
    if any(name is not None for name in names):
        raise ConfigError(f"a {kind} rule has no dim names, got {names!r}")
    if kind == "all" and len(spec) != 1:
        raise ConfigError(f"an 'all' rule holds exactly one placement, got {len(spec)}")
    if kind == "positional" and not spec:
        raise ConfigError("the placement list is empty; give one placement per mesh dim")


def _check_own(pattern: str, kind: str, own: tuple[str, Own]) -> None:
    """``Own(NAME)`` sits in a ``{dim: ...}`` rule whose ``re:`` pattern has a group ``(?P<NAME>...)``."""
    dim, o = own
    if kind != "named":
        raise ConfigError(f"{o} names no mesh dim; write it in the mapping form, e.g. {{ep: {o}}}")
    groups = re.compile(pattern[len(REGEX_PREFIX) :]).groupindex if pattern.startswith(REGEX_PREFIX) else {}
    if o.capture not in groups:
        raise ConfigError(
            f"{o} on {dim} needs the number it assigns by from the tensor name: write a re: pattern "
            f"with a named group, e.g. 're:.*\\.experts\\.(?P<{o.capture}>\\d+)\\..*'"
        )


def _mesh_from_json(mesh_data: object) -> Mesh:
    """``{"names": [...], "shape": [...]}`` or an ordered ``{name: size}`` mapping."""
    if isinstance(mesh_data, Mapping) and set(mesh_data) == {"names", "shape"}:
        names, shape = mesh_data["names"], mesh_data["shape"]
        if (
            not isinstance(names, list)
            or not isinstance(shape, list)
            or not all(isinstance(n, str) for n in names)
        ):
            raise ConfigError(f"mesh names must be a list of strings and shape a list, got {mesh_data!r}")
        return Mesh(tuple(names), tuple(shape))
    if isinstance(mesh_data, Mapping) and mesh_data and all(isinstance(n, str) for n in mesh_data):
        return Mesh(tuple(mesh_data), tuple(mesh_data.values()))
    raise ConfigError(f'mesh must be {{"names": [...], "shape": [...]}}, got {mesh_data!r}')


def _rule_from_json(pair: object, pre: str, source: str) -> Rule:
    """One ``[pattern, placements]`` pair of a layout's JSON form."""
    if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str):
        raise ConfigError(f"{pre}each rule must be a [pattern, placements] pair, got {pair!r}", path=source)
    try:
        return Rule.from_json(pair[0], pair[1])
    except ConfigError as e:
        raise ConfigError(f"{pre}rule {pair[0]!r}: {e.message}", path=source) from None
