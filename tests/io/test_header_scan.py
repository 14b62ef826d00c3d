"""The compact-header scanner of reshard.io.header: the same headers and the same errors as the decoder.

Headers as safetensors (and reshard) write them are split with a regular expression instead
of being JSON-decoded (``_scanned_entries``); anything else goes to the decoder. Every test
here decodes the same bytes both ways (the decoder alone: ``_scanned_entries`` patched to
decline) and wants the same entries, metadata and sizes, or the same error (message, path,
tensor); safetensors' own reader is the oracle for the files it writes.
"""

from __future__ import annotations

import gc
import json
import re
import struct
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

import reshard.io.header as header_mod
from reshard.errors import HeaderError
from reshard.io.header import DTYPE_SIZES, MAX_INT64, decode_header, encode_header, read_header

P = "model.safetensors"
F32 = '{"dtype":"F32","shape":[%s],"data_offsets":[%s]}'

TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "F32": torch.float32,
    "I64": torch.int64,
    "F64": torch.float64,
    "C64": torch.complex64,
}


# ----------------------------------------------------------------------------- helpers


def outcome(raw: bytes) -> str:
    """What decoding ``raw`` gives, as text that tells every field and type apart (``1`` from
    ``True``, a list from a tuple): the header, or the error's message, path and tensor."""
    header_mod._SHARED = None  # decode it: no match with the header decoded before
    try:
        h = decode_header(raw, path=P)
    except HeaderError as exc:
        return repr(("error", exc.message, exc.path, exc.tensor, exc.hint))
    rows = [(e.name, e.dtype, e.shape, e.start, e.stop) for e in h.entries]
    return repr(("ok", rows, h.metadata, h.data_start, h.data_size))


def decoded_outcome(raw: bytes) -> str:
    """:func:`outcome` with the scanner declining every header: the decoder alone."""
    with mock.patch.object(header_mod, "_scanned_entries", lambda text: None):
        return outcome(raw)


@contextmanager
def chunk(size: int) -> Iterator[None]:
    with mock.patch.object(header_mod, "_SCAN_CHUNK", size):
        yield


def scanned(raw: bytes) -> bool:
    """Whether the scanner takes ``raw`` (rather than leaving it to the decoder)."""
    return header_mod._scanned_entries(raw.decode("utf-8")) is not None


def assert_same(raw: bytes, *, chunks: tuple[int, ...] = (1 << 20, 1, 40)) -> str:
    """Decoding ``raw`` scanned (whole, and in pieces of a few characters) gives what the decoder does."""
    want = decoded_outcome(raw)
    for size in chunks:
        with chunk(size):
            assert outcome(raw) == want, size
    return want


def padded(text: str) -> bytes:
    raw = text.encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def compact(
    tensors: list[tuple[str, str, list[int]]],
    metadata: dict[str, str] | None = None,
    starts: list[int] | None = None,
) -> str:
    """A compact header of ``tensors`` in this order (``dtype`` as given, known or not), each at
    the next offset unless ``starts`` says where."""
    members = []
    if metadata is not None:
        members.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":"), ensure_ascii=False))
    at = 0
    for i, (name, dtype, shape) in enumerate(tensors):
        n = DTYPE_SIZES.get(dtype, 1)
        for d in shape:
            n *= d
        a = at if starts is None else starts[i]
        shape_text = ",".join(map(str, shape))
        members.append(
            json.dumps(name, ensure_ascii=False)
            + f':{{"dtype":{json.dumps(dtype)},"shape":[{shape_text}],"data_offsets":[{a},{a + n}]}}'
        )
        at = a + n
    return "{" + ",".join(members) + "}"


# ----------------------------------------------------------------------------- strategies

PLAIN_NAMES = st.text(st.characters(codec="utf-8", exclude_characters='"\\', min_codepoint=0x20), max_size=8)
ODD_NAMES = st.sampled_from(
    ["", "a", "w.0", "x]},", 'q"', "b\\", "\x00", "\x1f", "\x7f", "é", "\u2028", "__metadata__", "\U0001f600"]
)
DTYPES = st.sampled_from([*DTYPE_SIZES, "F4", "X9", "F32 "])
SHAPES = st.lists(st.integers(0, 5), max_size=3)
TENSORS = st.lists(st.tuples(st.one_of(PLAIN_NAMES, ODD_NAMES), DTYPES, SHAPES), max_size=6)
METADATA = st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3))
SNIPPETS = st.sampled_from(
    [
        " ",
        "\t",
        "\n",
        ",",
        "}",
        "{",
        "]",
        "[",
        ":",
        '"',
        ']},"',
        "0",
        "1",
        "2",
        "4",
        "00",
        "01",
        "-1",
        "1.0",
        "1e3",
        "9" * 19,
        "9" * 20,
        str(MAX_INT64),
        str(MAX_INT64 + 1),
        "null",
        "true",
        "NaN",
        "\\u0041",
        "\\",
        "\x00",
        "é",
        "\xff",
        '"__metadata__":{}',
        '"__metadata__":null',
        '"a":' + F32 % ("1", "0,4"),
        '"a":' + F32 % ("", "0,4"),
        '"z":' + F32 % ("0", "0,0"),
        '"dtype":"F32"',
        '"extra":1',
    ]
)


def sizes_of(tensors: list[tuple[str, str, list[int]]]) -> list[int]:
    sizes = []
    for _, dtype, shape in tensors:
        n = DTYPE_SIZES.get(dtype, 1)
        for d in shape:
            n *= d
        sizes.append(n)
    return sizes


def renumbered(x: str, how: int) -> str:
    """Digits ``x`` changed one of several ways (some still valid JSON, most wrong for a header)."""
    n = int(x)
    changed = [str(n + 1), str(max(n - 1, 0)), "0" + x, x + "0", str(MAX_INT64 + 1), "9" * 20]
    changed += ["-" + x, x + ".0"]
    return changed[how]


KINDS = ["none", "number", "rename", "replace", "delete", "repeat", "swap", "truncate"]


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A compact header, then maybe edited: a number or a name changed, a snippet in place of a
    slice, a slice cut out, an entry repeated or two swapped, the text cut short or followed by more."""
    tensors = draw(TENSORS)
    metadata = draw(METADATA)
    text = compact(tensors, metadata)
    kind = draw(st.sampled_from(KINDS))
    if kind == "number":
        numbers = list(re.finditer("[0-9]+", text))
        if numbers:
            m = draw(st.sampled_from(numbers))
            text = text[: m.start()] + renumbered(m.group(), draw(st.integers(0, 7))) + text[m.end() :]
    elif kind == "rename" and tensors:
        i = draw(st.integers(0, len(tensors) - 1))
        others = [t[0] for t in tensors] + ["__metadata__", "a\\", "a\x01", 'a"b', "a]},"]
        renamed = list(tensors)
        renamed[i] = (draw(st.sampled_from(others)), *tensors[i][1:])
        text = compact(renamed, metadata)
    elif kind in ("replace", "delete", "truncate"):
        a = draw(st.integers(0, len(text)))
        b = draw(st.integers(a, min(len(text), a + 12)))
        if kind == "replace":
            text = text[:a] + draw(SNIPPETS) + text[b:]
        elif kind == "delete":
            text = text[:a] + text[b:]
        else:
            text = text[:a]
    elif kind == "repeat" and tensors:
        i = draw(st.integers(0, len(tensors) - 1))
        text = compact([*tensors, tensors[i]], metadata)
    elif kind == "swap" and len(tensors) > 1:
        i, j = draw(st.permutations(range(len(tensors))))[:2]
        reordered = list(tensors)
        reordered[i], reordered[j] = reordered[j], reordered[i]
        sizes = sizes_of(tensors)
        starts = [sum(sizes[:k]) for k in range(len(tensors))]
        starts[i], starts[j] = starts[j], starts[i]
        text = compact(reordered, metadata, starts=starts)  # listed out of order, laid out as before
    raw = text.encode("utf-8")
    if draw(st.booleans()):
        raw += draw(st.sampled_from([b" " * 7, b"\t\n\r ", b"  x", b"\xff", b"}"]))
    return raw


FUZZ = settings(max_examples=max(100, settings().max_examples * 3), deadline=None)


# ----------------------------------------------------------------------------- properties


@FUZZ
@given(mutated_headers())
def test_scanned_headers_decode_as_the_decoder_does(raw: bytes) -> None:
    """Any header, well formed or not: the same entries and metadata, or the same error."""
    assert_same(raw)


@settings(deadline=None)
@given(
    st.lists(
        st.tuples(PLAIN_NAMES, st.sampled_from(sorted(DTYPE_SIZES)), SHAPES),
        max_size=8,
        unique_by=lambda t: t[0],
    ),
    METADATA,
)
def test_writer_shaped_headers_are_scanned(tensors: list[tuple[str, str, list[int]]], metadata: Any) -> None:
    """Headers the reference writer makes (encode_header is byte-equal to it) take the scanner,
    and give what the decoder gives."""
    tensors = [t for t in tensors if t[0] != "__metadata__"]
    prefix, header = encode_header(tensors, metadata)
    raw = prefix[8:]
    assert scanned(raw)
    assert_same(raw)
    assert decode_header(raw) == header


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6).filter(
            lambda s: s != "__metadata__"
        ),
        st.tuples(st.sampled_from(sorted(TORCH_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
        max_size=6,
    ),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
)
def test_files_safetensors_writes_read_as_safe_open_reads_them(
    tmp_path: Path, specs: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None
) -> None:
    """safetensors' writer and reader are the oracle: the same names, dtypes, shapes, metadata and
    bytes at each tensor's offsets; names free of quotes and backslashes take the scanner."""
    gen = torch.Generator().manual_seed(len(specs))
    tensors = {}
    for name, (dtype, shape) in specs.items():
        n = 1
        for d in shape:
            n *= d
        size = n * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        raw = torch.randint(0, 2 if dtype == "BOOL" else 256, (size,), dtype=torch.uint8, generator=gen)
        tensors[name] = raw.view(TORCH_DTYPES[dtype]).reshape(shape)
    blob = save(tensors, metadata=metadata)
    path = tmp_path / "m.safetensors"
    path.write_bytes(blob)
    raw_header = blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]]
    header_mod._SHARED = None
    if not tensors and metadata == {}:  # safetensors 0.8 writes '{},"__metadata__":{}}' and refuses it
        with pytest.raises(SafetensorError):
            safe_open(str(path), "pt")
        with pytest.raises(HeaderError, match="Extra data"):
            read_header(path)
        return
    h = read_header(path)
    plain = all('"' not in k and "\\" not in k and all(ord(c) >= 0x20 for c in k) for k in specs)
    assert scanned(raw_header) == plain
    assert_same(raw_header)
    with safe_open(str(path), "pt") as f:
        assert sorted(h.names) == sorted(f.keys())
        assert h.metadata == f.metadata()
        for e in h.entries:
            t = f.get_tensor(e.name)
            assert (e.dtype, e.shape) == (f.get_slice(e.name).get_dtype(), tuple(t.shape))
            want = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            assert blob[h.data_start + e.start : h.data_start + e.stop] == want


# ----------------------------------------------------------------------------- hostile, by hand


def entry(name: str, shape: str, offsets: str, dtype: str = "F32") -> str:
    return f'"{name}":{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":[{offsets}]}}'


def header_of(*members: str) -> bytes:
    return padded("{" + ",".join(members) + "}")


def error_of(raw: bytes) -> str:
    header_mod._SHARED = None
    with pytest.raises(HeaderError) as info:
        decode_header(raw, path=P)
    return info.value.message


IMPOSSIBLE = f"over {MAX_INT64} (int64)"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (header_of(entry("a", "1", "0,4"), entry("a", "1", "4,8")), 'duplicate key "a" in header'),
        (
            header_of('"__metadata__":{"x":"1","x":"2"}', entry("a", "1", "0,4")),
            'duplicate key "x" in header',
        ),
        (
            header_of(entry("a", "1", "0,4"), '"__metadata__":' + F32 % ("1", "4,8")),
            '__metadata__ value for "shape" must be a string, got array [1]',
        ),
        (header_of(entry("a", "1", "00,4")), "header is not valid JSON: Expecting ',' delimiter (char 49)"),
        (header_of(entry("a", "01", "0,4")), "header is not valid JSON: Expecting ',' delimiter (char 30)"),
        (
            header_of(entry("a", "1", "0," + "9" * 20)),
            f'tensor "a" has impossible data_offsets [0, {"9" * 20}]: {IMPOSSIBLE}',
        ),
        (
            header_of(entry("a", "0", f"{MAX_INT64 + 1},{MAX_INT64 + 1}")),
            f'tensor "a" has impossible data_offsets [{MAX_INT64 + 1}, {MAX_INT64 + 1}]: {IMPOSSIBLE}',
        ),
        (
            header_of(entry("a", f"0,{MAX_INT64 + 1}", "0,0")),
            f'tensor "a" has impossible shape [0, {MAX_INT64 + 1}]: a dim or the product of the dims so far '
            f"exceeds {MAX_INT64} (int64; safetensors and torch refuse it)",
        ),
        (
            header_of(entry("a", f"{1 << 60}", f"0,{1 << 63}", dtype="I64")),  # 19 digits, over int64
            f'tensor "a" has impossible data_offsets [0, {1 << 63}]: {IMPOSSIBLE}',
        ),
        (
            header_of(entry("a", "1", "2,4"), entry("b", "1", "4,8")),
            'tensor "a" has data_offsets [2, 4] but shape [1] of F32 needs 4 bytes',
        ),
        (
            header_of(entry("a", "1", "0,4"), entry("b", "1", "6,8"), entry("c", "1", "8,12")),
            'tensor "b" has data_offsets [6, 8] but shape [1] of F32 needs 4 bytes',
        ),
        (
            header_of(entry("a", "2,3", "0,10")),
            'tensor "a" has data_offsets [0, 10] but shape [2, 3] of F32 needs 24 bytes',
        ),
        (
            header_of(entry("a", "1", "0,4", dtype="F4")),
            'tensor "a" has unsupported dtype "F4": sub-byte dtypes (F4, F6_E2M3, F6_E3M2) are not supported',
        ),
        (header_of(entry("a", "1", "0,4", dtype="X9")), 'tensor "a" has unknown dtype "X9"'),
        (
            header_of(entry("a", "4", "0,16"), entry("b", "4", "8,24")),
            'tensors "a" [0, 16] and "b" [8, 24] overlap',
        ),
        (
            header_of(entry("a", "4", "0,16"), entry("b", "2", "24,32")),
            'gap in data section: bytes [16, 24) between tensor "a" and tensor "b" '
            "are not covered by any tensor",
        ),
        (
            header_of(entry("b", "2", "8,16")),
            'gap in data section: bytes [0, 8) before tensor "b" are not covered by any tensor',
        ),
        (header_of(entry("a", "1", "0,4")) + b"x", "header is not valid JSON: Extra data (char 56)"),
        (("{" + entry("a", "1", "0,4"))[:47].encode(), "header is not valid JSON: Expecting value (char 47)"),
        (
            header_of(entry("a", "1", "0,4"), ""),
            "header is not valid JSON: Expecting property name enclosed in double quotes (char 54)",
        ),
        (
            header_of(entry("a\x01", "1", "0,4")),
            "header is not valid JSON: Invalid control character at (char 3)",
        ),
        (header_of(entry("a\\", "1", "0,4")), None),
        (("{" + entry("a", "1", "0,4")).encode() + b"\xff}", "header is not valid UTF-8 (byte 53)"),
    ],
)
def test_hostile_compact_headers(raw: bytes, message: str | None) -> None:
    """Compact headers the scanner must not take, each refused as the decoder refuses it."""
    assert assert_same(raw).startswith("('error'")
    if message is not None:
        assert error_of(raw) == f"{P}: {message}"


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b"{}  \t\n\r ",
        b'{"__metadata__":{}}',
        b'{"__metadata__":{"a":"b"}}   ',
        b'{"__metadata__":null,' + entry("a", "1", "0,4").encode() + b"}",
        header_of(entry("b", "0", "0,0"), entry("a", "0", "0,0"), entry("c", "1", "0,4")),
        header_of(entry("c", "1", "0,4"), entry("b", "0", "4,4", dtype="I8"), entry("a", "0", "4,4")),
        header_of(entry("b", "1", "4,8"), entry("a", "1", "0,4")),
        header_of(entry("", "1", "0,4")),
        header_of(entry("a\\u0022\\\\", "1", "0,4")),
        header_of(entry("a", "1", "-0,4")),
        header_of(entry("a", "1", "0,4"), entry("b", "1", "4,8")).replace(b'"shape"', b'"sh\\u0061pe"', 1),
        header_of(entry("x]},", "1", "0,4"), entry("y", "1", "4,8")),
        header_of(entry("é\u2028\U0001f600", "", "0,4")),
        header_of(entry("a", "1", "0,4") + " "),
        (b"{" + entry("a", "1", "0,4").encode() + b"}\t\n"),
    ],
)
def test_unusual_but_valid_compact_headers(raw: bytes) -> None:
    """Valid headers at the scanner's edges: no entries, null metadata, tensors of no bytes (sorted
    as the writer sorts them), entries out of order, odd names, JSON whitespace."""
    assert assert_same(raw).startswith("('ok'")


def test_zero_size_tensors_keep_the_writers_order() -> None:
    raw = header_of(entry("b", "0", "0,0"), entry("a", "0", "0,0", dtype="I8"), entry("c", "0", "0,0"))
    assert scanned(raw)
    assert decode_header(raw).names == ("b", "c", "a")  # F32 before I8, then by name


# ----------------------------------------------------------------------------- large headers


def big(n: int) -> tuple[bytes, list[tuple[str, str, list[int]]]]:
    specs = [(f"model.layers.{i // 64}.mlp.experts.{i % 64}.w", "I16", [8, 192 - i % 3]) for i in range(n)]
    prefix, _ = encode_header(specs, {"format": "pt"})
    return prefix[8:], specs


def test_a_header_of_many_pieces_is_scanned_whole() -> None:
    raw, specs = big(20_000)  # 1.4 MB: two pieces at the default size
    assert len(raw) > header_mod._SCAN_CHUNK and scanned(raw)
    got = assert_same(raw, chunks=(1 << 20, 4096))
    assert got.startswith("('ok'")
    h = decode_header(raw)
    assert len(h.entries) == len(specs)
    assert len({id(e.shape) for e in h.entries}) == 3  # one tuple per distinct shape
    assert all(e.dtype is h.entries[0].dtype for e in h.entries)


LATE = 19_000  # an entry in the second piece of big(20_000)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda name, rest: '"model.layers.0.mlp.experts.0.w"' + rest,
            'duplicate key "model.layers.0.mlp.experts.0.w"',
        ),
        (
            lambda name, rest: name + rest.replace('data_offsets":[', 'data_offsets":[0', 1),
            "Expecting ',' delimiter",
        ),
        (lambda name, rest: name + rest.replace("[8,", "[8, ", 1), None),
        (lambda name, rest: name[:-1] + ']},"' + rest, None),
        (lambda name, rest: name[:-2] + '\\u0077"' + rest, None),
    ],
    ids=["duplicate", "leading-zero", "space", "boundary-in-name", "escape"],
)
def test_a_fault_late_in_a_large_header_is_the_decoders(edit: Any, message: str | None) -> None:
    """A duplicate name, a bad number, whitespace or an odd name in the second piece of a large
    header: what the first piece gave is dropped, and the decoder's answer is the answer."""
    raw, specs = big(20_000)
    text = raw.decode()
    name = json.dumps(specs[LATE][0])
    at = text.index(name)
    end = text.index("}", at) + 1
    assert at > header_mod._SCAN_CHUNK
    edited = (text[:at] + edit(name, text[at + len(name) : end]) + text[end:]).encode()
    got = assert_same(edited, chunks=(1 << 20, 4096))
    if message is None:
        assert got.startswith("('ok'")
    else:
        assert message in error_of(edited)


def test_scanning_peaks_below_decoding() -> None:
    """The scanner holds a piece's strings at a time, not a dict of the whole header."""
    raw, _ = big(30_000)

    def peak(decode: Any) -> int:
        header_mod._SHARED = None
        tracemalloc.start()
        try:
            decode(raw)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert scanned(raw)
    with mock.patch.object(header_mod, "_scanned_entries", lambda text: None):
        decoded = peak(decode_header)
    assert peak(decode_header) < decoded


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        decode_header(header_of(entry("a", "1", "0,4")))
        assert gc.isenabled() is enabled
        with pytest.raises(HeaderError):
            decode_header(header_of(entry("a", "1", "0,4"), entry("a", "1", "4,8")))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
