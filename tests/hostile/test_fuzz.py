"""Fuzz the parsers with mutated real documents: the only outcomes are success or a ReshardError.

Headers come from :func:`encode_header` (byte-equal to safetensors' writer), layouts
from the bundled presets, indexes and ``reshard.json`` layouts from their real shapes;
each is then mutated (JSON edits with absurd values, truncation, byte flips, inserted
hostile snippets) and fed to the parsing functions in-process. Any other exception,
or an example taking more than a few seconds, fails the test.

The example count follows the active Hypothesis profile, scaled down (60 under ``dev``
and ``ci``, 1200 under ``HYPOTHESIS_PROFILE=nightly``).
"""

from __future__ import annotations

import json
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.config import LayoutConfig, parse_layout_text
from reshard.errors import ReshardError
from reshard.io.header import DTYPE_SIZES, decode_header, encode_header, read_header
from reshard.io.safe import load_json
from reshard.mesh import Mesh, parse_mesh_spec

T = TypeVar("T")

EXAMPLES = max(10, settings().max_examples * 3 // 5)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the alarm below is the limit: shared CI machines make deadlines flaky
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SECONDS = 5

PRESETS = sorted((Path(__file__).resolve().parents[2] / "reshard" / "configs").glob("*.yaml"))

# Hostile text snippets; the huge ones are written out only when used.
SNIPPETS = [
    "9" * 5000,
    "-" + "9" * 30,
    "1e999",
    "NaN",
    "Infinity",
    "[" * 3000,
    "{" * 3000,
    "]" * 10,
    '"\\ud800"',
    '"\\u202e\\u001b[31m"',
    "18446744073709551616",
    "9223372036854775808",
    "0.5",
    "true",
    "null",
    '"abc"',
    "*a",
    "&a",
    "<<: *a",
    "!!python/object/apply:os.system ['true']",
    "!!binary aGk=",
    "'re:(a+)+$'",
    "'re:(?!x).*'",
    '"_S(0, 99999999999)"',
    "S(" + "9" * 50 + ")",
    "1000000000",
    "\t",
    "\x00",
    "\x1b[2J",
    "#",
    ": ",
    "- ",
    "|",
    ">",
    "%YAML 1.1",
    "---",
]

JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, 0])
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.just("abc"),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@contextmanager
def time_limit(seconds: float = SECONDS) -> Iterator[None]:
    """Fail an example that runs too long instead of hanging the run."""

    def boom(signum: int, frame: object) -> None:
        raise TimeoutError(f"example took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn: Callable[[], T]) -> T | ReshardError:
    """``fn()``, or the ReshardError it raised; any other exception propagates and fails."""
    with time_limit():
        try:
            return fn()
        except ReshardError as e:
            assert str(e) and len(str(e)) < 5000, "an error message must be short and say something"
            return e


# ----------------------------------------------------------------- mutations


@st.composite
def mutated_text(draw: st.DrawFn, base: str) -> str:
    """``base`` with a few random edits: truncation, replaced or inserted characters, snippets."""
    text = base
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        at = draw(st.integers(0, len(text)))
        if kind == "truncate":
            text = text[:at]
        elif kind == "flip" and text:
            at = min(at, len(text) - 1)
            text = text[:at] + draw(st.characters(codec="utf-8")) + text[at + 1 :]
        elif kind == "insert":
            text = text[:at] + draw(st.sampled_from(SNIPPETS) | st.text(max_size=6)) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
    return text


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@st.composite
def json_edited(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` with a value at a random path replaced by an absurd one, then serialized."""
    doc = json.loads(json.dumps(doc))
    paths = [p for p in _paths(doc) if p]
    if paths:
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(JSON_VALUES | st.just("@HUGE@"))
    return json.dumps(doc).replace('"@HUGE@"', "9" * 5000).encode()


@st.composite
def byte_mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


# ----------------------------------------------------------------- safetensors headers

TENSORS = st.lists(
    st.tuples(
        st.text("abc.0", min_size=1, max_size=6),
        st.sampled_from(sorted(DTYPE_SIZES)),
        st.lists(st.integers(0, 4), max_size=3),
    ),
    max_size=4,
    unique_by=lambda t: t[0],
)


def header_doc(tensors: list[tuple[str, str, list[int]]]) -> tuple[bytes, int]:
    prefix, header = encode_header(tensors, {"format": "pt"})
    return prefix[8:], header.data_start + header.data_size


@st.composite
def hostile_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    body, size = header_doc(draw(TENSORS))
    how = draw(st.sampled_from(["json", "bytes", "text"]))
    if how == "json":
        body = draw(json_edited(json.loads(body)))
    elif how == "bytes":
        body = draw(byte_mutated(body))
    else:
        body = draw(mutated_text(body.decode())).encode("utf-8", "surrogatepass")
    return body, draw(st.sampled_from([size, size - 1, size + 1, 0, 2**64]))


@FUZZ
@given(hostile_headers())
def test_decode_header_succeeds_or_raises_reshard_error(case: tuple[bytes, int]) -> None:
    body, size = case
    outcome(lambda: decode_header(body, path="x.safetensors", file_size=size))


@FUZZ
@given(hostile_headers(), st.integers(-8, 8))
def test_read_header_of_hostile_files(tmp_path_factory: Any, case: tuple[bytes, int], skew: int) -> None:
    body, size = case
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(body) + skew)) + body + b"\0" * max(0, size % 64))
    got = outcome(lambda: read_header(path))
    if not isinstance(got, ReshardError):
        assert got.data_start == 8 + len(body) + skew


# ----------------------------------------------------------------- layout files


@FUZZ
@given(st.sampled_from(PRESETS).map(lambda p: p.read_text()).flatmap(mutated_text))
def test_layout_text_succeeds_or_raises_reshard_error(text: str) -> None:
    got = outcome(lambda: parse_layout_text(text, "fuzz.yaml"))
    if isinstance(got, LayoutConfig):
        for name in ("model.layers.0.self_attn.q_proj.weight", "a" * 3000, "lm_head.weight"):
            outcome(lambda name=name: got.placements_for(name))


@FUZZ
@given(st.text(max_size=40))
def test_mesh_spec_succeeds_or_raises_reshard_error(spec: str) -> None:
    outcome(lambda: Mesh(("tp",), (2,)).with_sizes(parse_mesh_spec(spec)))


# ----------------------------------------------------------------- JSON documents

INDEX = {
    "metadata": {"total_size": 48},
    "weight_map": {
        "model.a": "model-00001-of-00002.safetensors",
        "model.b": "model-00002-of-00002.safetensors",
    },
}
RESHARD_JSON = {
    "mesh": {"names": ["fsdp", "tp"], "shape": [2, 2]},
    "rules": [["re:model\\.a", {"tp": "S(0)"}], ["*.b", ["R", "_S(0, 2)"]], ["*", "R"]],
}


@st.composite
def hostile_documents(draw: st.DrawFn) -> bytes:
    doc = draw(st.sampled_from([INDEX, RESHARD_JSON]))
    how = draw(st.sampled_from(["json", "bytes", "text"]))
    if how == "json":
        return draw(json_edited(doc))
    raw = json.dumps(doc).encode()
    if how == "bytes":
        return draw(byte_mutated(raw))
    return draw(mutated_text(raw.decode())).encode("utf-8", "surrogatepass")


@FUZZ
@given(hostile_documents())
def test_json_documents_succeed_or_raise_reshard_error(raw: bytes) -> None:
    doc = outcome(lambda: load_json(raw, path="reshard.json", what="reshard.json"))
    if not isinstance(doc, ReshardError):
        got = outcome(lambda: LayoutConfig.from_json(doc, "reshard.json"))
        if isinstance(got, LayoutConfig):
            outcome(lambda: got.placements_for("model.a"))
