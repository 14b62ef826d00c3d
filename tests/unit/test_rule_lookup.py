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
FRAGMENTS = ["a", "b", "_", ".", "\\.", "\\_", "\\*", "\\\\", "\\[", ".*", "[ab]", "(a|b)", "b?", "\\d"]


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
