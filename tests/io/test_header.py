"""Tests for reshard.io.header: byte equality with safetensors, round trips, strict errors."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # the package is not installed into the venv
    sys.path.insert(0, str(_ROOT))

import reshard.io.header as header_mod  # noqa: E402
from reshard.errors import HeaderError, ReshardError, TensorNotFoundError  # noqa: E402
from reshard.io.header import (  # noqa: E402
    DTYPE_SIZES,
    FLOAT_DTYPES,
    Header,
    TensorEntry,
    decode_header,
    encode_header,
    read_header,
)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
}
ALL_DTYPES = sorted(TORCH_DTYPES)


# ----------------------------------------------------------------------------- helpers


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor with random bit patterns (0/1 for BOOL)."""
    tdtype = TORCH_DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    gen = torch.Generator().manual_seed(seed)
    high = 2 if dtype == "BOOL" else 256
    raw = torch.randint(0, high, (numel * DTYPE_SIZES[dtype],), generator=gen, dtype=torch.uint8)
    return raw.view(tdtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def specs_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    rev = {v: k for k, v in TORCH_DTYPES.items()}
    return [(name, rev[t.dtype], list(t.shape)) for name, t in tensors.items()]


def our_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    prefix, header = encode_header(specs_of(tensors), metadata)
    return prefix + b"".join(raw_bytes(tensors[e.name]) for e in header.entries)


def split(blob: bytes) -> tuple[bytes, int]:
    """(raw JSON header bytes, file size) of a serialized safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + n], len(blob)


def assert_same_as_reference(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    ref = save(tensors, metadata=metadata)
    ours = our_file(tensors, metadata)
    assert ours == ref
    raw, size = split(ref)
    decoded = decode_header(raw, path="ref.safetensors", file_size=size)
    assert decoded == encode_header(specs_of(tensors), metadata)[1]


def write(tmp_path: Path, blob: bytes, name: str = "model.safetensors") -> str:
    p = tmp_path / name
    p.write_bytes(blob)
    return str(p)


def entry_json(dtype: str, shape: list[int], start: int, stop: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, stop]}


def hdr(obj: object) -> bytes:
    return json.dumps(obj).encode()


P = "model.safetensors"


# ----------------------------------------------------------------------------- tables


def test_dtype_sizes_match_torch() -> None:
    assert set(DTYPE_SIZES) == set(TORCH_DTYPES)
    for name, tdtype in TORCH_DTYPES.items():
        assert DTYPE_SIZES[name] == tdtype.itemsize, name


def test_float_dtypes_match_torch() -> None:
    expected = {n for n, t in TORCH_DTYPES.items() if t.is_floating_point}
    assert expected == FLOAT_DTYPES


# ----------------------------------------------------------------------------- byte equality


@pytest.mark.parametrize("metadata", [None, {"k": "v"}, {}])
def test_all_dtypes_byte_identical(metadata: dict[str, str] | None) -> None:
    tensors = {f"t.{d.lower()}": make_tensor(d, (2, 3), seed=i) for i, d in enumerate(ALL_DTYPES)}
    assert_same_as_reference(tensors, metadata)


@pytest.mark.parametrize(
    "tensors",
    [
        {},
        {"a": make_tensor("F32", ())},
        {"a": make_tensor("F32", (0,))},
        {"a": make_tensor("BF16", (2, 0, 3)), "b": make_tensor("F64", (0,))},
        {
            "z": make_tensor("F32", (0,)),
            "a": make_tensor("F16", (0,)),
            "m": make_tensor("U8", (5,)),
        },
        {
            "w": make_tensor("BF16", (4, 4)),
            "b": make_tensor("BF16", (4,)),
            "a": make_tensor("BF16", ()),
        },
        {
            "x": make_tensor("F8_E4M3", (3,)),
            "y": make_tensor("BOOL", (7,)),
            "z": make_tensor("I8", (1,)),
        },
        {
            "c": make_tensor("C64", (2,)),
            "u": make_tensor("U64", (1,)),
            "f": make_tensor("F64", (1,)),
        },
        {
            "": make_tensor("F32", (1,)),
            "é": make_tensor("F32", ()),
            '\x01\n"\\/\u2028😀': make_tensor("I32", (2,)),
        },
        {f"layer.{i}.weight": make_tensor("F16", (i, 2), seed=i) for i in range(12)},
    ],
    ids=lambda t: ",".join(f"{k!r}" for k in t)[:40] or "empty",
)
@pytest.mark.parametrize("metadata", [None, {"k": "v"}])
def test_byte_identical_cases(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
    assert_same_as_reference(tensors, metadata)


def test_single_metadata_key_with_escapes() -> None:
    tensors = {"a": make_tensor("F32", (3,))}
    assert_same_as_reference(tensors, {'format\t"pt"': "é\x00/\u2028"})


names_st = st.text(st.characters(codec="utf-8"), max_size=6).filter(lambda s: s != "__metadata__")
tensor_st = st.tuples(
    st.sampled_from(ALL_DTYPES),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**16),
)
metadata_st: st.SearchStrategy[dict[str, str] | None] = st.one_of(
    st.none(),
    st.just({"k": "v"}),
    st.just({}),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), min_size=1, max_size=1),
)


@settings(max_examples=50, deadline=None)
@given(spec=st.dictionaries(names_st, tensor_st, max_size=6), metadata=metadata_st)
def test_byte_identical_property(
    spec: dict[str, tuple[str, tuple[int, ...], int]], metadata: dict[str, str] | None
) -> None:
    if not spec and metadata == {}:
        metadata = None  # the reference writes invalid JSON here, see test below
    tensors = {name: make_tensor(d, shape, seed) for name, (d, shape, seed) in spec.items()}
    assert_same_as_reference(tensors, metadata)


def test_no_tensors_and_empty_metadata_stays_valid_json() -> None:
    # safetensors 0.8 (serde_json map with a zero length hint) writes the invalid
    # '{},"__metadata__":{}}' here; we write valid JSON and reject the reference bytes.
    ref = save({}, metadata={})
    assert ref[8:].rstrip() == b'{},"__metadata__":{}}'
    prefix, header = encode_header([], {})
    assert prefix[8:] == b'{"__metadata__":{}}     '
    assert decode_header(prefix[8:]) == header
    raw, _ = split(ref)
    with _raises("<bytes>: header is not valid JSON: Extra data (char 2)"):
        decode_header(raw)


def test_encode_header_shape() -> None:
    prefix, header = encode_header([("b", "F16", [2]), ("a", "U64", [3])], {"k": "v"})
    assert len(prefix) % 8 == 0
    (n,) = struct.unpack("<Q", prefix[:8])
    assert n == len(prefix) - 8
    assert prefix[8:9] == b"{"
    assert prefix[8:].startswith(b'{"__metadata__":{"k":"v"},"a":')
    assert header.data_start == len(prefix)
    assert header.names == ("a", "b")
    assert header.entries == (
        TensorEntry("a", "U64", (3,), 0, 24),
        TensorEntry("b", "F16", (2,), 24, 28),
    )
    assert header.metadata == {"k": "v"}
    assert header.data_size == 28
    assert decode_header(prefix[8:], file_size=len(prefix) + 28) == header


def test_encode_accepts_torch_size_and_metadata_order_kept() -> None:
    prefix, header = encode_header([("a", "F32", torch.Size([2, 1]))], {"z": "1", "a": "2"})
    assert b'"__metadata__":{"z":"1","a":"2"}' in prefix
    assert header.entry("a").shape == (2, 1)


# ----------------------------------------------------------------------------- read_header


@pytest.mark.parametrize("metadata", [None, {"k": "v"}, {"format": "pt", "x": ""}])
def test_read_header_roundtrip(tmp_path: Path, metadata: dict[str, str] | None) -> None:
    tensors = {
        "w": make_tensor("BF16", (4, 3)),
        "b": make_tensor("F32", (3,)),
        "s": make_tensor("I64", ()),
        "e": make_tensor("F16", (0, 5)),
        "m": make_tensor("BOOL", (2,)),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    header = read_header(path)
    blob = path.read_bytes()
    assert header.metadata == metadata
    assert header.data_start + header.data_size == len(blob)
    if metadata is None or len(metadata) <= 1:
        assert header == encode_header(specs_of(tensors), metadata)[1]
    for e in header.entries:
        data = blob[header.data_start + e.start : header.data_start + e.stop]
        assert data == raw_bytes(tensors[e.name])
        assert e.nbytes == e.numel * e.itemsize
    assert header.names == ("s", "b", "w", "e", "m")
    assert read_header(str(path)) == header


def test_read_header_never_reads_tensor_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"big": make_tensor("U8", (4096,))}
    path = write(tmp_path, save(tensors))
    reads: list[int] = []
    real_open = open

    class Spy:
        def __init__(self, f: Any) -> None:
            self._f = f

        def read(self, n: int = -1) -> bytes:
            assert n >= 0, "read() without a size"
            data: bytes = self._f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def __enter__(self) -> Spy:
            return self

        def __exit__(self, *exc: object) -> None:
            self._f.close()

    monkeypatch.setattr(header_mod, "open", lambda p, m: Spy(real_open(p, m)), raising=False)
    header = read_header(path)
    assert sum(reads) == header.data_start
    assert header.data_size == 4096


# ----------------------------------------------------------------------------- file errors


def _raises(message: str) -> Any:
    return pytest.raises(HeaderError, match="^" + re.escape(message) + "$")


def test_missing_file(tmp_path: Path) -> None:
    p = str(tmp_path / "nope.safetensors")
    with _raises(f"{p}: no such file") as info:
        read_header(p)
    assert info.value.path == p
    assert isinstance(info.value, ReshardError)


def test_file_shorter_than_length_prefix(tmp_path: Path) -> None:
    p = write(tmp_path, b"\x01\x02\x03")
    with _raises(f"{p}: file is too short to be safetensors: 3 bytes, need at least 8"):
        read_header(p)


def test_header_length_larger_than_file(tmp_path: Path) -> None:
    p = write(tmp_path, struct.pack("<Q", 1000) + b"{}")
    with _raises(f"{p}: header length 1000 is larger than the file: only 2 bytes follow the length prefix"):
        read_header(p)


def test_header_length_absurd(tmp_path: Path) -> None:
    p = write(tmp_path, struct.pack("<Q", 2**63) + b"{}")
    with _raises(f"{p}: header length {2**63} is over the 100000000-byte limit"):
        read_header(p)


def test_truncated_file(tmp_path: Path) -> None:
    blob = save({"a": make_tensor("F32", (2, 3)), "b": make_tensor("I8", (4,))})
    p = write(tmp_path, blob[:-3])
    with _raises(f"{p}: file is truncated: header says 28 data bytes, file has 25"):
        read_header(p)


def test_trailing_garbage(tmp_path: Path) -> None:
    blob = save({"a": make_tensor("F32", (2, 3))})
    p = write(tmp_path, blob + b"junk")
    with _raises(
        f"{p}: file has 4 trailing bytes after the data section: header says 24 data bytes, file has 28"
    ):
        read_header(p)


def test_file_with_only_header_no_data(tmp_path: Path) -> None:
    prefix, _ = encode_header([("a", "F32", [2])])
    p = write(tmp_path, prefix)
    with _raises(f"{p}: file is truncated: header says 8 data bytes, file has 0"):
        read_header(p)


def test_empty_checkpoint_is_valid(tmp_path: Path) -> None:
    p = write(tmp_path, save({}))
    header = read_header(p)
    assert header.entries == ()
    assert header.data_size == 0
    assert header.metadata is None


# ----------------------------------------------------------------------------- header errors


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "header is empty"),
        (b'{"a": ', "header is not valid JSON: Expecting value (char 6)"),
        (b"\xff{}", "header is not valid UTF-8 (byte 0)"),
        (b"[1, 2]", "header must be a JSON object, got array"),
        (b'"x"', "header must be a JSON object, got string"),
        (b"  {}", "header must start with '{'"),
        (b'{"a": NaN}', "header is not valid JSON: non-standard constant NaN"),
        (
            b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {}}',
            'duplicate key "a" in header',
        ),
        (b'{"__metadata__": ["x"]}', "__metadata__ must be an object of strings, got array"),
        (
            b'{"__metadata__": {"step": 3}}',
            '__metadata__ value for "step" must be a string, got integer 3',
        ),
        (b'{"a": [1]}', 'tensor "a" must be an object, got array'),
        (b'{"a": {"dtype": "F32", "shape": []}}', 'tensor "a" is missing "data_offsets"'),
        (
            hdr({"a": {**entry_json("F32", [], 0, 4), "extra": 1}}),
            'tensor "a" has unexpected key "extra"',
        ),
        (hdr({"a": entry_json("F12", [1], 0, 4)}), 'tensor "a" has unknown dtype "F12"'),
        (
            hdr({"a": {**entry_json("F32", [1], 0, 4), "dtype": 4}}),
            'tensor "a" has dtype 4: must be a string',
        ),
        (
            hdr({"a": entry_json("F4", [2], 0, 1)}),
            'tensor "a" has unsupported dtype "F4": sub-byte dtypes (F4, F6_E2M3, F6_E3M2) are not supported',
        ),
        (
            hdr({"a": entry_json("F32", [2, -1], 0, 4)}),
            'tensor "a" has invalid shape [2, -1]: must be a list of non-negative integers',
        ),
        (
            hdr({"a": entry_json("F32", [True], 0, 4)}),
            'tensor "a" has invalid shape [true]: must be a list of non-negative integers',
        ),
        (
            hdr({"a": {**entry_json("F32", [1], 0, 4), "data_offsets": [0, 4, 8]}}),
            'tensor "a" has invalid data_offsets [0, 4, 8]: must be [begin, end] with non-negative integers',
        ),
        (
            hdr({"a": {**entry_json("F32", [1], 0, 4), "data_offsets": [0.0, 4]}}),
            'tensor "a" has invalid data_offsets [0.0, 4]: must be [begin, end] with non-negative integers',
        ),
        (
            hdr({"a": entry_json("F32", [0], 4, 0)}),
            'tensor "a" has data_offsets [4, 0] with begin after end',
        ),
        (
            hdr({"a.weight": entry_json("F32", [2, 3], 0, 10)}),
            'tensor "a.weight" has data_offsets [0, 10] but shape [2, 3] of F32 needs 24 bytes',
        ),
        (
            hdr({"a": entry_json("F32", [4], 0, 16), "b": entry_json("F32", [4], 8, 24)}),
            'tensors "a" [0, 16] and "b" [8, 24] overlap',
        ),
        (
            hdr({"a": entry_json("F32", [4], 0, 16), "b": entry_json("F32", [4], 0, 16)}),
            'tensors "a" [0, 16] and "b" [0, 16] overlap',
        ),
        (
            hdr({"a": entry_json("F32", [4], 0, 16), "z": entry_json("U8", [0], 8, 8)}),
            'tensors "a" [0, 16] and "z" [8, 8] overlap',
        ),
        (
            hdr({"a": entry_json("F32", [4], 0, 16), "b": entry_json("F32", [2], 24, 32)}),
            'gap in data section: bytes [16, 24) between tensor "a" and tensor "b" '
            "are not covered by any tensor",
        ),
        (
            hdr({"b": entry_json("F32", [2], 8, 16)}),
            'gap in data section: bytes [0, 8) before tensor "b" are not covered by any tensor',
        ),
    ],
)
def test_decode_errors(raw: bytes, message: str) -> None:
    with _raises(f"{P}: {message}") as info:
        decode_header(raw, path=P)
    assert info.value.path == P


def test_decode_error_names_tensor() -> None:
    raw = hdr({"a.weight": entry_json("F32", [2, 3], 0, 10)})
    with pytest.raises(HeaderError) as info:
        decode_header(raw, path=P)
    assert info.value.tensor == "a.weight"


def test_decode_file_size_checks() -> None:
    raw = hdr({"a": entry_json("F32", [2], 0, 8)})
    start = 8 + len(raw)
    assert decode_header(raw, file_size=start + 8).data_size == 8
    with _raises("<bytes>: file is truncated: header says 8 data bytes, file has 7"):
        decode_header(raw, file_size=start + 7)
    with _raises(
        "<bytes>: file has 1 trailing bytes after the data section: header says 8 data bytes, file has 9"
    ):
        decode_header(raw, file_size=start + 9)


def test_decode_sorts_by_offset_and_accepts_padding() -> None:
    raw = hdr(
        {
            "b": entry_json("F16", [2], 8, 12),
            "__metadata__": {"k": "v"},
            "a": entry_json("F32", [2], 0, 8),
            "e": entry_json("U8", [0], 12, 12),
        }
    )
    header = decode_header(raw + b"   ")
    assert header.names == ("a", "b", "e")
    assert header.data_start == 8 + len(raw) + 3
    assert header.metadata == {"k": "v"}
    assert decode_header(b'{"__metadata__": null}').metadata is None


# ----------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        (
            [("a", "F32", [1]), ("a", "F16", [1])],
            None,
            'cannot encode header: duplicate tensor name "a"',
        ),
        (
            [("a", "F32", [1])],
            {"k": 1},
            'cannot encode header: metadata value for "k" must be a string, got int 1',
        ),
        ([("a", "F99", [1])], None, 'cannot encode header: tensor "a" has unknown dtype "F99"'),
        (
            [("a", "F32", [2, -1])],
            None,
            'cannot encode header: tensor "a" has invalid shape [2, -1]: must be non-negative integers',
        ),
        (
            [("a", "F32", [1.5])],
            None,
            'cannot encode header: tensor "a" has invalid shape [1.5]: must be non-negative integers',
        ),
        (
            [("__metadata__", "F32", [1])],
            None,
            'cannot encode header: "__metadata__" is reserved and cannot name a tensor',
        ),
    ],
)
def test_encode_errors(tensors: list[tuple[str, str, list[Any]]], metadata: Any, message: str) -> None:
    with _raises(message):
        encode_header(tensors, metadata)


# ----------------------------------------------------------------------------- Header API


def test_header_entry_lookup() -> None:
    _, header = encode_header([("layer.0.weight", "F32", [2, 2]), ("layer.0.bias", "F32", [2])])
    e = header.entry("layer.0.weight")
    assert (e.dtype, e.shape, e.nbytes, e.itemsize, e.numel) == ("F32", (2, 2), 16, 4, 4)
    with pytest.raises(
        TensorNotFoundError, match=re.escape('tensor "layer.0.weigth" is not in this file')
    ) as info:
        header.entry("layer.0.weigth")
    assert info.value.tensor == "layer.0.weigth"
    assert info.value.hint is not None and "layer.0.weight" in info.value.hint


def test_header_is_hashable_and_comparable() -> None:
    _, a = encode_header([("x", "I32", [1])], {"k": "v"})
    _, b = encode_header([("x", "I32", [1])], {"k": "v"})
    assert a == b and hash(a) == hash(b)
    _, c = encode_header([("x", "I32", [1])], {"k": "w"})
    assert a != c


def test_header_pickles() -> None:
    _, header = encode_header([("a", "F32", [2]), ("b", "U8", [])], {"k": "v"})
    clone = pickle.loads(pickle.dumps(header))
    assert clone == header
    assert clone.entry("b") == TensorEntry("b", "U8", (), 8, 9)


def test_header_rejects_duplicate_entries() -> None:
    e = TensorEntry("x", "U8", (1,), 0, 1)
    with pytest.raises(HeaderError, match="duplicate tensor name"):
        Header((e, e), None, 8)


def test_empty_header_properties() -> None:
    prefix, header = encode_header([])
    assert prefix == b"\x08" + b"\x00" * 7 + b"{}      "
    assert header.data_size == 0 and header.names == ()


# ----------------------------------------------------------------------------- purity


def test_import_does_not_pull_in_torch_or_numpy() -> None:
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    code = (
        "import sys, reshard.io.header; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'numpy' not in sys.modules, 'numpy imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=_ROOT, env=env, check=True)


# --------------------------------------------------------------------------- sibling rank files


def _rank_file(path: Path, rank: int, tensors: dict[str, torch.Tensor], meta: bool = True) -> Path:
    save_file(tensors, str(path), metadata={"rank": str(rank), "x": "y" * rank} if meta else None)
    return path


def test_sibling_files_share_entries_and_keep_their_metadata(tmp_path: Path) -> None:
    """Rank files whose entry sections are byte-identical share one decoding; each keeps its
    own metadata and data start (safetensors' own reader agrees on every tensor)."""
    from safetensors import safe_open

    tensors = {f"w{i}": torch.arange(6, dtype=torch.int16).reshape(2, 3) + i for i in range(5)}
    paths = [_rank_file(tmp_path / f"r{r}.safetensors", r, tensors) for r in range(3)]
    headers = [read_header(p) for p in paths]
    assert all(h.entries is headers[0].entries for h in headers)
    for r, (p, h) in enumerate(zip(paths, headers)):
        assert h.metadata == {"rank": str(r), "x": "y" * r}
        assert h.data_start == 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]
        with safe_open(str(p), "pt") as f:
            for e in h.entries:
                raw = p.read_bytes()[h.data_start + e.start : h.data_start + e.stop]
                assert raw == f.get_tensor(e.name).numpy().tobytes()
        assert h.entry("w3").shape == (2, 3)


def test_sibling_with_bad_metadata_or_no_opening_brace_is_refused(tmp_path: Path) -> None:
    """A header whose entries match the last decoded ones is still refused when what differs is bad."""
    tensors = {"a": torch.zeros(2, dtype=torch.float32)}
    good = _rank_file(tmp_path / "good.safetensors", 0, tensors)
    read_header(good)
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = raw[8 : 8 + n]
    section = head[head.index(b',"a"') :]
    for bad_head in (b'{"__metadata__":{"rank":1}', b'{"__metadata__":[1]', b""):
        body = bad_head + section
        if not bad_head:
            body = section  # starts with ','
        body += b" " * (-len(body) % 8)
        p = tmp_path / "bad.safetensors"
        p.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
        with pytest.raises(HeaderError):
            read_header(p)
        read_header(good)  # the shared section again


def test_sibling_with_a_member_before_the_shared_section_is_decoded_whole(tmp_path: Path) -> None:
    """A header that ends with the last decoded section but holds another member before it is
    not that sibling: its own entries (here a zero-size tensor ahead of the section) are all read."""
    tensors = {"a": torch.zeros(2, dtype=torch.float32)}
    good = _rank_file(tmp_path / "good.safetensors", 0, tensors)
    read_header(good)
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = raw[8 : 8 + n].rstrip(b" ")
    section = head[head.index(b',"a"') :]
    extra = b'{"__metadata__":{"rank":"1"},"zz":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    body = extra + section
    body += b" " * (-len(body) % 8)
    p = tmp_path / "extra.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    h = read_header(p)
    assert sorted(h.names) == ["a", "zz"]
    assert h.metadata == {"rank": "1"}


def test_sibling_without_metadata_after_one_with_it(tmp_path: Path) -> None:
    """Sections of files with and without metadata never match each other: both decode right."""
    tensors = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(1, 2)}
    with_meta = read_header(_rank_file(tmp_path / "m.safetensors", 1, tensors))
    without = read_header(_rank_file(tmp_path / "n.safetensors", 0, tensors, meta=False))
    assert without.metadata is None and with_meta.metadata == {"rank": "1", "x": "y"}
    assert [(e.name, e.start) for e in without.entries] == [(e.name, e.start) for e in with_meta.entries]


def test_sibling_section_of_the_same_length_with_other_bytes_is_decoded_whole(tmp_path: Path) -> None:
    """Sections are compared byte for byte: one as long whose shape differs is its own."""
    first = read_header(_rank_file(tmp_path / "a.safetensors", 0, {"a": torch.zeros(2, 3)}))
    other = read_header(_rank_file(tmp_path / "b.safetensors", 1, {"a": torch.zeros(3, 2)}))
    assert other.entries is not first.entries and other.entry("a").shape == (3, 2)
    again = read_header(_rank_file(tmp_path / "c.safetensors", 2, {"a": torch.zeros(3, 2)}))
    assert again.entries is other.entries and again.metadata == {"rank": "2", "x": "yy"}
