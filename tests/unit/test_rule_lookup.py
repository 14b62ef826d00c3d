"""LayoutConfig's exact-name index: same first-match answers as trying every rule, at dict speed.

The oracle is a naive first match over the rules with :func:`fnmatch.fnmatchcase`
and :func:`re.fullmatch`, independent of reshard's compiled patterns.
"""

from __future__ import annotations

import fnmatch
import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard.config import REGEX_PREFIX, LayoutConfig, Rule
from reshard.errors import LayoutError
from reshard.mesh import Mesh

MESH = Mesh(("tp",), (2,))
ALPHABET = "ab._*?[]\\"

# Regex atoms (optionally quantified): any concatenation is a valid regex.
# Escaped ones re.escape would write (\.) and ones it would not (\_, \d).
# Escapes by number or name (Python's, which RE2 lacks: translated for it).
FRAGMENTS = ["a", "b", "_", ".", "\\.", "\\_", "\\*", "\\\\", "\\[", ".*", "[ab]", "(a|b)", "b?", "\\d"]
FRAGMENTS += ["\\u0061", "\\x62", "\\U0000005f", "\\N{FULL STOP}", "[\\u0061\\x5c]"]


def naive_first(rules: list[str], name: str) -> int | None:
    for i, pattern in enumerate(rules):
        if pattern.startswith(REGEX_PREFIX):
            if re.fullmatch(pattern[len(REGEX_PREFIX) :], name):
                return i
        elif fnmatch.fnmatchcase(name, pattern):
            return i
    return None


names_st = st.text(alphabet=ALPHABET, max_size=4)
patterns_st = st.one_of(
    st.text(alphabet="ab._\\]", min_size=1, max_size=4),  # literal globs
    st.text(alphabet=ALPHABET, min_size=1, max_size=4),  # globs, often with wildcards
    names_st.filter(bool).map(lambda n: REGEX_PREFIX + re.escape(n)),  # exact-name regexes
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3).map(lambda fs: REGEX_PREFIX + "".join(fs)),
)


def layout(patterns: list[str]) -> LayoutConfig:
    return LayoutConfig(MESH, tuple(Rule.from_json(p, "R") for p in patterns), "test")


@given(st.lists(patterns_st, min_size=1, max_size=12, unique=True), st.data())
def test_first_match_wins_as_trying_every_rule(patterns: list[str], data: st.DataObject) -> None:
    cfg = layout(patterns)
    unescaped = [re.sub(r"\\(.)", r"\1", p[len(REGEX_PREFIX) :]) for p in patterns]
    names = data.draw(st.lists(st.one_of(names_st, st.sampled_from(patterns + unescaped)), max_size=12))
    for name in names:
        want = naive_first(patterns, name)
        if want is None:
            with pytest.raises(LayoutError, match="matches no rule"):
                cfg.match(name)
        else:
            assert cfg.match(name) is cfg.rules[want], (name, patterns)
    used = {naive_first(patterns, n) for n in names}
    assert cfg.unused_rules(names) == [r for i, r in enumerate(cfg.rules) if i not in used]


def test_pattern_before_an_exact_rule_still_wins() -> None:
    cfg = layout(["re:a\\.b", "a.*", "a.b", "re:a\\.c", "*"])
    assert cfg.match("a.b").pattern == "re:a\\.b"
    assert cfg.match("a.c").pattern == "a.*"  # the literal re:a\.c comes after a.*
    assert cfg.match("b").pattern == "*"
    assert [r.pattern for r in cfg.unused_rules(["a.b", "a.c"])] == ["a.b", "re:a\\.c", "*"]


def test_regex_that_only_looks_literal_is_still_a_regex() -> None:
    # \d and \_ are not what re.escape writes: \d must stay a digit class.
    cfg = layout(["re:x\\d", "re:x\\_y", "*"])
    assert cfg.match("x7").pattern == "re:x\\d"
    assert cfg.match("xd").pattern == "*"
    assert cfg.match("x_y").pattern == "re:x\\_y"


def test_twenty_thousand_exact_rules_match_in_linear_time() -> None:
    """A self-describing checkpoint's one-rule-per-tensor layout (formats._exact_rules)."""
    names = [f"model.layers.{i // 10}.mlp.experts.{i % 10}.weight" for i in range(20_000)]
    rules = [
        Rule.from_json(REGEX_PREFIX + re.escape(n), ["S(0)" if i % 2 else "R"]) for i, n in enumerate(names)
    ]
    cfg = LayoutConfig(MESH, (*rules, Rule.from_json("*", "R")), "test")
    start = time.perf_counter()
    matched = [cfg.match(n) for n in reversed(names)]
    unused = cfg.unused_rules(names)
    elapsed = time.perf_counter() - start
    assert [r.pattern for r in matched] == [REGEX_PREFIX + re.escape(n) for n in reversed(names)]
    assert [r.pattern for r in unused] == ["*"]
    assert elapsed < 2.0, f"{elapsed:.2f} s for 20,000 names (trying every rule takes minutes)"


@given(
    st.text(alphabet="ab.*", min_size=1, max_size=9).filter(lambda p: "*" in p),
    st.lists(st.text(alphabet="ab.", max_size=9), min_size=1, max_size=8),
)
def test_star_globs_match_as_fnmatchcase(pattern: str, names: list[str]) -> None:
    """Globs whose only wildcard is * are matched by string methods: same answers, overlapping
    parts (``a*ab*b`` on ``aab``) and repeated stars included."""
    cfg = layout([pattern, "re:.*"])
    for name in names + [pattern.replace("*", ""), pattern.replace("*", "ab.")]:
        assert (cfg.match(name) is cfg.rules[0]) == fnmatch.fnmatchcase(name, pattern), (pattern, name)


# -- names that differ in their digits: the rule index remembers first matches per name with its
# digits zeroed, for the rules whose patterns mention no digit; the rules that do are tried on
# the name itself. The oracle above knows nothing of that.

DIGIT_NAMES = "a.0127"
DIGIT_GLOBS = "a.0127*?[]!-"
# atoms that tell digits apart (a digit, a class or range holding some, a repeat count) and ones
# that cannot (\d, \w, ., a class without digits)
DIGIT_FRAGMENTS = ["a", "\\.", "0", "1", "7", "\\d", "\\d+", "\\w", ".", "[0-5]", "[1-9]", "[a.]", "\\d{2}"]
DIGIT_FRAGMENTS += [".*"]
digit_patterns_st = st.one_of(
    st.text(alphabet=DIGIT_GLOBS, min_size=1, max_size=5),
    st.text(alphabet=DIGIT_NAMES, min_size=1, max_size=5).map(lambda n: REGEX_PREFIX + re.escape(n)),
    st.lists(st.sampled_from(DIGIT_FRAGMENTS), min_size=1, max_size=4).map(
        lambda fs: REGEX_PREFIX + "".join(fs)
    ),
)


def digit_variants(name: str) -> list[str]:
    """``name`` with its digits replaced: each by 0, each by 9, and runs lengthened (``1`` -> ``10``)."""
    return [
        re.sub("[0-9]", "0", name),
        re.sub("[0-9]", "9", name),
        re.sub("[0-9]", lambda m: m.group() + "0", name),
    ]


@given(st.lists(digit_patterns_st, min_size=1, max_size=8, unique=True), st.data())
def test_names_differing_in_digits_match_as_trying_every_rule(
    patterns: list[str], data: st.DataObject
) -> None:
    """One layout asked about many names that differ only in their digits (so later ones find
    earlier ones' canonical names remembered), with rules that do and do not mention digits."""
    cfg = layout(patterns)
    base = data.draw(st.lists(st.text(alphabet=DIGIT_NAMES, max_size=6), min_size=1, max_size=6))
    names = [v for n in base for v in [n, *digit_variants(n)]]
    for name in names + list(reversed(names)):
        want = naive_first(patterns, name)
        got = cfg._first(name)
        assert got == want, (name, patterns)
    used = {naive_first(patterns, n) for n in names}
    assert cfg.unused_rules(names) == [r for i, r in enumerate(cfg.rules) if i not in used]


def test_a_rule_mentioning_a_digit_wins_over_a_remembered_later_rule() -> None:
    cfg = layout(["*.layers.1.*", "re:.*\\.layers\\.1\\d\\..*", "*.experts.[0-1].w", "*"])
    names = ["m.layers.0.w", "m.layers.1.w", "m.layers.10.w", "m.layers.2.w"]
    first = {n: cfg.match(n).pattern for n in names}
    assert first == {
        "m.layers.0.w": "*",
        "m.layers.1.w": "*.layers.1.*",
        "m.layers.10.w": "re:.*\\.layers\\.1\\d\\..*",
        "m.layers.2.w": "*",
    }
    assert cfg.match("m.layers.3.experts.1.w").pattern == "*.experts.[0-1].w"
    assert cfg.match("m.layers.3.experts.2.w").pattern == "*"
    assert cfg.match("m.layers.1.experts.0.w").pattern == "*.layers.1.*"


def test_digit_free_rules_are_matched_once_per_canonical_name() -> None:
    """100k MoE names are a few canonical names: the patterns run once for each (not per name)."""
    calls: list[tuple[str, str]] = []

    class Counting:
        def __init__(self, pattern: str) -> None:
            self.pattern = pattern
            self.inner = re.compile(fnmatch.translate(pattern))

        def fullmatch(self, name: str) -> object:
            calls.append((self.pattern, name))
            return self.inner.fullmatch(name)

    rules = [Rule.from_json(p, "R") for p in ("*.down_proj.weight", "*norm.weight", "*.[gu]*_proj.weight")]
    for r in rules:
        object.__setattr__(r, "_regex", Counting(r.pattern))
    cfg = LayoutConfig(MESH, tuple(rules), "test")
    names = [
        f"model.layers.{i}.mlp.experts.{j}.{k}_proj.weight"
        for i in range(30)
        for j in range(20)
        for k in ("gate", "up", "down")
    ]
    assert [cfg.match(n).pattern for n in names] == [
        "*.down_proj.weight" if n.endswith("down_proj.weight") else "*.[gu]*_proj.weight" for n in names
    ]
    # each pattern tried once per canonical name: layer and expert numbers of 1 or 2 digits, 3 kinds
    assert len(set(calls)) == len(calls)
    assert len({n for _, n in calls}) == 2 * 2 * 3


def test_remembered_names_start_over_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard import config as config_mod

    monkeypatch.setattr(config_mod, "_MEMO_MAX", 3)
    patterns = ["a*", "b?", "*"]
    cfg = layout(patterns)
    names = ["a", "b1", "b", "ab", "c", "bb", "b12", "a9"] * 3
    assert [cfg._first(n) for n in names] == [naive_first(patterns, n) for n in names]
    assert len(cfg._index._memo) <= 3


def test_non_ascii_digits_and_surrogates_are_their_own_characters() -> None:
    """Only ASCII digits are zeroed: a name holding another script's digit (or a lone surrogate,
    which JSON headers can carry) is matched on that character itself."""
    patterns = ["*.1.*", "*.?.w", "*"]
    cfg = layout(patterns)
    for name in ["a.\u0661.w", "a.1.w", "a.\u0661\u0662.w", "a.\udc80.w", "a.7.w", "a.\u0967.x"]:
        assert cfg._first(name) == naive_first(patterns, name), name


def test_layouts_of_one_rules_tuple_share_their_index() -> None:
    """The source layout on the target mesh (--target-mesh) and with Own numbers bound reuse the
    names it already matched; a layout of other rules (--target-layout) has its own."""
    src = layout(["*.layers.1.*", "*"])
    on_eight = src.with_mesh(Mesh(("tp",), (8,)))
    assert on_eight._index is src._index and src.assign(["x"])._index is src._index
    other = layout(["*.layers.2.*", "*"])
    assert other._index is not src._index
    for name in ["m.layers.1.w", "m.layers.2.w", "m.layers.12.w"]:
        assert on_eight.match(name) == src.match(name)
    assert [other.match(n).pattern for n in ["m.layers.1.w", "m.layers.2.w"]] == ["*", "*.layers.2.*"]


PLACED = ["R", "S(0)", "S(1)"]
# digits, glob and regex characters, a "re:" prefix, a non-ASCII digit (not a \d of RE2)
name_parts = st.sampled_from(["a", ".", "0", "1", "12", "007", "*", "?", "[", "re:", "\u0663", "x"])


@given(
    st.dictionaries(
        st.lists(name_parts, min_size=1, max_size=6).map("".join),
        st.sampled_from(PLACED),
        min_size=1,
        max_size=40,
    )
)
def test_self_described_rules_give_every_tensor_its_own_placements(placed: dict[str, str]) -> None:
    """formats.per_rank.exact_rules: one rule per name shape, exact rules for the exceptions."""
    from types import SimpleNamespace

    from reshard.formats.per_rank import exact_rules
    from reshard.placements import parse_placement

    tensors = {n: SimpleNamespace(name=n, placements=(parse_placement(p),)) for n, p in placed.items()}
    cfg = exact_rules(SimpleNamespace(mesh=MESH, path="ck", tensors=tensors))
    for name, p in placed.items():
        assert [str(q) for q in cfg.placements_for(name)] == [p], name
        # and the naive first match over the same patterns agrees (Python's re for RE2's \d: ASCII here)
        first = naive_first([r.pattern.replace("\\d", "[0-9]") for r in cfg.rules], name)
        assert first is not None and str(cfg.rules[first].spec[0][1]) == p


def test_self_described_rules_are_one_per_name_shape() -> None:
    """100k expert tensors placed alike by shape: a few rules, not one per tensor."""
    from types import SimpleNamespace

    from reshard.formats.per_rank import exact_rules
    from reshard.placements import parse_placement

    r, s0 = parse_placement("R"), parse_placement("S(0)")
    tensors = {}
    for i in range(200):
        for j in range(64):
            n = f"model.layers.{i}.mlp.experts.{j}.up_proj.weight"
            tensors[n] = SimpleNamespace(name=n, placements=(s0,))
        n = f"model.layers.{i}.input_layernorm.weight"
        tensors[n] = SimpleNamespace(name=n, placements=(s0 if i == 7 else r,))
    cfg = exact_rules(SimpleNamespace(mesh=MESH, path="ck", tensors=tensors))
    assert [(ru.pattern, str(ru.spec[0][1])) for ru in cfg.rules] == [
        ("model.layers.7.input_layernorm.weight", "S(0)"),
        (r"re:model\.layers\.\d+\.mlp\.experts\.\d+\.up_proj\.weight", "S(0)"),
        (r"re:model\.layers\.\d+\.input_layernorm\.weight", "R"),
    ]
    assert all(cfg.placements_for(n) == t.placements for n, t in tensors.items())
