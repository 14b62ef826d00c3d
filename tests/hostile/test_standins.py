"""A hostile pickle cannot change the stand-ins reshard's restricted unpicklers share between files.

``find_class`` answers every allowed global with one object for the whole process (the
``torch.FloatStorage`` stand-in, a rebuild function, a placement class). Before, a pickle could
``BUILD`` state onto one: a rank file ending in ``BUILD {"dtype": "int32"}`` on
``torch.FloatStorage`` made every later file of the command read its float32 tensors as int32
(``convert`` of a two-rank checkpoint wrote int32 weights and exited 0), and slot state set a
rebuild function's ``__defaults__``. Now every change to a stand-in (``BUILD`` with a dict or
slot state, ``SETITEM(S)``, ``APPEND(S)``, ``ADDITEMS``), through every reader (the C
unpickler, the pt item templates, the fast DCP ``.metadata`` decoder), is refused as an unsafe
pickle naming the file and the global, and leaves the stand-in as it was.
"""

from __future__ import annotations

import io
import pickletools
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reshard.io import pt_pickle
from reshard.io.unpickle import (
    _STAND_INS,
    DCP_METADATA_GLOBALS,
    TORCH_SAVE_STATE_GLOBALS,
    TORCH_SAVE_TENSOR_GLOBALS,
    UnsafePickleError,
    _load_with_memo,
    load_dcp_metadata,
    load_stored_tensor,
    load_torch_save,
)
from tests.dist.test_torchrun import reshard

torch = pytest.importorskip("torch")


def _x(s: str) -> bytes:
    raw = s.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


#: opcodes that change the object under them, each leaving the stack as it found it (``0``: POP)
CHANGES: dict[str, Callable[[bytes], bytes]] = {
    "BUILD": lambda g: g + b"}" + _x("dtype") + _x("int32") + b"sb0",
    "BUILD slots": lambda g: g + b"N}" + _x("__defaults__") + b"K\x01\x85s\x86b0",
    "BUILD __class__": lambda g: (
        g + b"N}" + _x("__class__") + _global("collections", "OrderedDict") + b"s\x86b0"
    ),
    "SETITEM": lambda g: g + _x("k") + _x("v") + b"s0",
    "SETITEMS": lambda g: g + b"(" + _x("k") + _x("v") + b"u0",
    "APPEND": lambda g: g + _x("v") + b"a0",
    "APPENDS": lambda g: g + b"(" + _x("v") + b"e0",
    "ADDITEMS": lambda g: g + b"(" + _x("v") + b"\x900",
}
HOW = {
    "BUILD slots": "BUILD",
    "BUILD __class__": "BUILD",
    "SETITEM": "SETITEM(S)",
    "SETITEMS": "SETITEM(S)",
    "APPEND": "APPEND(S)",  # the C unpickler calls extend, else append, for both
    "APPENDS": "APPEND(S)",
}


def insert_before_stop(pkl: bytes, extra: bytes) -> bytes:
    """``pkl`` with ``extra`` run just before its STOP (the protocol-4 frame holding STOP grown to fit)."""
    ops = list(pickletools.genops(pkl))
    stop = ops[-1][2]
    assert ops[-1][0].name == "STOP" and isinstance(stop, int)
    out = bytearray(pkl[:stop] + extra + pkl[stop:])
    frames = [pos for op, _arg, pos in ops if op.name == "FRAME"]
    if frames:
        at = frames[-1]
        assert isinstance(at, int)
        n = int.from_bytes(pkl[at + 1 : at + 9], "little")
        if at + 9 <= stop < at + 9 + n:
            out[at + 1 : at + 9] = (n + len(extra)).to_bytes(8, "little")
    return bytes(out)


def fingerprint(v: Any, depth: int = 0) -> Any:
    """Everything a pickle could have changed of a stand-in: its attributes, slots, a function's
    defaults and class, a wrapped function's own (by identity)."""
    parts: list[Any] = [type(v)]
    d = getattr(v, "__dict__", None)
    if d is not None:
        parts.append(sorted((str(k), id(x)) for k, x in d.items()))
    for s in getattr(type(v), "__slots__", ()):
        parts.append((s, id(getattr(v, s, None))))
    for a in ("__defaults__", "__kwdefaults__", "__code__"):
        parts.append(id(getattr(v, a, None)))
    fn = getattr(type(v), "__slots__", ()) and getattr(v, "fn", None)
    if fn is not None and depth == 0:
        parts.append(fingerprint(fn, 1))
    return parts


def all_stand_ins() -> dict[tuple[str, str], Any]:
    return {
        k: fingerprint(v)
        for table in (DCP_METADATA_GLOBALS, TORCH_SAVE_STATE_GLOBALS, TORCH_SAVE_TENSOR_GLOBALS)
        for k, v in table.items()
    }


def torch_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


@pytest.fixture(scope="module")
def pt_pkl() -> bytes:
    return torch_pickle({"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)})


@pytest.fixture(scope="module")
def dcp_meta(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4, 2), "b": torch.zeros(3)}, checkpoint_id=str(out))
    return (out / ".metadata").read_bytes()


def _refused(load: Callable[[bytes], Any], data: bytes, glob: str, how: str) -> None:
    before = all_stand_ins()
    with pytest.raises(UnsafePickleError) as e:
        load(data)
    msg = str(e.value)
    assert msg.startswith("bad.pt: ") or msg.startswith(".metadata: "), msg
    assert f"tries to change {glob} ({how} on it)" in msg and "nothing of it was run" in msg, msg
    assert all_stand_ins() == before  # nothing of any stand-in changed


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("key", sorted(TORCH_SAVE_STATE_GLOBALS), ids="{0[0]}.{0[1]}".format)
def test_a_torch_save_pickle_cannot_change_a_stand_in(
    pt_pkl: bytes, key: tuple[str, str], change: str
) -> None:
    bad = insert_before_stop(pt_pkl, CHANGES[change](_global(*key)))
    glob, how = f"{key[0]}.{key[1]}", HOW.get(change, change)
    _refused(lambda b: load_torch_save(b, path="bad.pt"), bad, glob, how)
    _refused(lambda b: load_torch_save(b, path="bad.pt", fast=False), bad, glob, how)
    if key in TORCH_SAVE_TENSOR_GLOBALS:  # a DCP chunk's data.pkl
        one = insert_before_stop(torch_pickle(torch.ones(2)), CHANGES[change](_global(*key)))
        _refused(lambda b: load_stored_tensor(b, path="bad.pt"), one, glob, how)


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("key", sorted(DCP_METADATA_GLOBALS), ids="{0[0]}.{0[1]}".format)
def test_a_dcp_metadata_pickle_cannot_change_a_stand_in(
    dcp_meta: bytes, key: tuple[str, str], change: str
) -> None:
    """The fast decoder leaves the pickle to the C unpickler, which refuses it."""
    bad = insert_before_stop(dcp_meta, CHANGES[change](_global(*key)))
    _refused(
        lambda b: load_dcp_metadata(b, path=".metadata"), bad, f"{key[0]}.{key[1]}", HOW.get(change, change)
    )


def test_a_file_cannot_change_how_the_next_is_read(pt_pkl: bytes) -> None:
    """Before: the clean file read after the hostile one had its float32 tensor as int32."""
    want = load_torch_save(pt_pkl, path="clean.pt")
    assert want["w"].dtype == "float32" and want["b"].dtype == "bfloat16"
    for glob, change in [
        (("torch", "FloatStorage"), "BUILD"),
        (("torch", "FloatStorage"), "BUILD __class__"),
        (("torch._utils", "_rebuild_tensor_v2"), "BUILD slots"),
        (("torch.distributed.tensor", "DTensor"), "BUILD __class__"),
    ]:
        bad = CHANGES[change](_global(*glob))
        for hostile in (pt_pkl[:2] + bad + pt_pkl[2:], insert_before_stop(pt_pkl, bad)):
            for _ in range(2):
                with pytest.raises(UnsafePickleError, match=f"{glob[0]}.{glob[1]}"):
                    load_torch_save(hostile, path="bad.pt")
                assert load_torch_save(pt_pkl, path="clean.pt") == want
                assert load_torch_save(pt_pkl, path="clean.pt", fast=False) == want


def test_the_item_templates_leave_a_changing_item_to_the_c_path() -> None:
    """A 400-tensor file (item templates in use) with an item that BUILDs onto torch.FloatStorage
    between two ordinary items: the template decoder gives it up, the C path refuses it."""
    sd = {f"layers.{i}.w": torch.full((2, 2), float(i)) for i in range(400)}
    pkl = torch_pickle(sd)
    at = pkl.index(_x("layers.300.w"))
    item = (
        _x("evil") + _global("torch", "FloatStorage") + CHANGES["BUILD"](b"")[:-1]
    )  # the value: the stand-in
    bad = pkl[:at] + item + pkl[at:]
    with pytest.raises(pt_pickle.Unsupported):
        pt_pickle.decode_state_pickle(bad, "bad.pt", lambda b, m: _load_with_memo(b, m, "bad.pt"), _STAND_INS)
    _refused(lambda b: load_torch_save(b, path="bad.pt"), bad, "torch.FloatStorage", "BUILD")
    got = load_torch_save(pkl, path="clean.pt")
    assert {t.dtype for t in got.values()} == {"float32"} and len(got) == 400


def _two_ranks(src: Path, change: bytes, *, at_start: bool) -> Path:
    """Two rank files of torch.save-d float32 tensors; rank_0.pt's data.pkl also runs ``change``."""
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    for r in range(2):
        torch.save(
            {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}, src / f"rank_{r}.pt"
        )
    evil = src / "rank_0.pt"
    with zipfile.ZipFile(evil) as z:
        records = {n: z.read(n) for n in z.namelist()}
    pkl = records["rank_0/data.pkl"]
    records["rank_0/data.pkl"] = pkl[:2] + change + pkl[2:] if at_start else insert_before_stop(pkl, change)
    with zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as z:
        for n, data in records.items():
            z.writestr(n, data)
    return evil


@pytest.mark.parametrize(
    ("glob", "change", "at_start"),
    [
        # before: convert exited 0 writing int32 weights (rank_1.pt, read after, agreed with rank_0.pt)
        (("torch", "FloatStorage"), "BUILD", True),
        # before: exit 2 blaming the clean rank_1.pt ('tensor "w" is I32 but F32 in rank_0.pt')
        (("torch", "FloatStorage"), "BUILD", False),
        # before: exit 0, the function's __defaults__ changed for the rest of the run
        (("torch._utils", "_rebuild_tensor_v2"), "BUILD slots", False),
    ],
)
def test_one_bad_rank_file_is_refused_by_the_cli(
    tmp_path: Path, glob: tuple[str, str], change: str, at_start: bool
) -> None:
    src = tmp_path / "src"
    evil = _two_ranks(src, CHANGES[change](_global(*glob)), at_start=at_start)
    opts = ["--source-layout", "replicated", "--source-mesh", "tp=2"]
    res = reshard("convert", src, tmp_path / "out", *opts, "--consolidate", "--quiet", code=2)
    want = f"{evil}: the torch.save pickle tries to change {glob[0]}.{glob[1]} (BUILD on it)"
    assert want in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    res = reshard("inspect", src, "--layout", "replicated", "--source-mesh", "tp=2", code=2)
    assert want in res.stderr


def test_a_bad_dcp_metadata_is_refused_by_the_cli(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4, 2)}, checkpoint_id=str(src))
    meta = src / ".metadata"
    meta.write_bytes(
        insert_before_stop(
            meta.read_bytes(), CHANGES["BUILD slots"](_global("torch.serialization", "_get_layout"))
        )
    )
    res = reshard("inspect", src, code=2)  # before: exit 0, _get_layout's __defaults__ changed
    assert f"{meta}: the DCP metadata pickle tries to change torch.serialization._get_layout" in res.stderr
