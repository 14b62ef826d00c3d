"""The template decoder of ``torch.save`` state dicts (:mod:`reshard.io.pt_pickle`) against the C
unpickler with the same allow-list (the reference path), on files torch writes in the test run.

- DTensors (``Shard``, ``Replicate``, a 2-D mesh with ``_StridedShard``, shared placements, a
  sub-mesh), plain tensors and parameters (views: offsets, strides), nested dicts, a module's
  ``OrderedDict`` state dict with its ``_metadata``, mixed dtypes: the same values, read by
  templates (the C unpickler runs a few items only);
- damaged pickles (a byte set, a range cut or repeated, a memo put renumbered): the fast path
  gives what the reference gives, or leaves the file to it (``Unsupported``), never anything else;
- an item that changes an older object (the mesh) makes the fast path leave the file, and the
  reference's values show why it must.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard.io import pt_pickle
from reshard.io.unpickle import _STAND_INS, StoredDTensor, _load_with_memo, load_torch_save

torch = pytest.importorskip("torch")

WRITE = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from collections import OrderedDict
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    out, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dts = [torch.bfloat16, torch.float32, torch.int64]
    sd = {}
    for i in range(120):
        p = f"model.layers.{i}."
        sd[p + "q.weight"] = DTensor.from_local(torch.full((4, 8), i, dtype=dts[i % 3]), mesh, [Shard(0)],
                                                run_check=False)
        sd[p + "o.weight"] = DTensor.from_local(torch.ones(8, 2), mesh, [Shard(1)], run_check=False)
        sd[p + "norm.weight"] = DTensor.from_local(torch.ones(8), mesh, [Replicate()], run_check=False)
    sd["lm_head.weight"] = DTensor.from_local(torch.ones(3, 8), mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size([10, 8]), stride=(8, 1))
    torch.save(sd, f"{out}/dtensors_1d.pt")

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    s0 = Shard(0)
    sd = {}
    for i in range(100):
        p = f"layers.{i}."
        ss = _StridedShard(0, split_factor=2)
        sd[p + "gate_up"] = DTensor.from_local(torch.ones(4, 8), mesh2, [ss, s0], run_check=False)
        sd[p + "wo"] = DTensor.from_local(torch.ones(4, 4), mesh2, [s0, Shard(1)], run_check=False)
        sd[p + "tp_only"] = DTensor.from_local(torch.ones(2), mesh2["tp"], [s0], run_check=False)
    torch.save(sd, f"{out}/dtensors_2d.pt")

    base = torch.arange(4000, dtype=torch.float32)
    sd = {}
    for i in range(150):
        if i < 6:  # views of one storage: its key a memo reference after the first (read by the C unpickler)
            sd[f"views.{i}"] = base[i : i + 12].view(3, 4)
        sd[f"cols.{i}"] = torch.ones(6, 4, dtype=torch.float16)[:, 1:3]
        sd[f"scalar.{i}"] = torch.tensor(float(i))
    sd["param"] = torch.nn.Parameter(torch.ones(5))
    torch.save(sd, f"{out}/plain.pt")

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)])
    msd = model.state_dict()
    assert isinstance(msd, OrderedDict) and hasattr(msd, "_metadata")
    torch.save({"model": msd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
                "step": 5, "name": "run", "extra": {"a": {"b": torch.zeros(2)}}}, f"{out}/nested.pt")
    torch.save(msd, f"{out}/module.pt")
    """
)

NAMES = ["dtensors_1d", "dtensors_2d", "plain", "nested", "module"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("pt_fast")
    subprocess.run(
        [sys.executable, "-c", WRITE, str(out), "1"], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    got = {}
    for name in NAMES:
        with zipfile.ZipFile(out / f"{name}.pt") as z:
            (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
            got[name] = z.read(pkl)
    return got


def reference(data: bytes) -> Any:
    return load_torch_save(data, path="f.pt", fast=False)


def decoder(data: bytes) -> pt_pickle._Decoder:
    return pt_pickle._Decoder(data, "f.pt", lambda b, m: _load_with_memo(b, m, "f.pt"), _STAND_INS)


def fast(data: bytes) -> Any:
    return pt_pickle.decode_state_pickle(data, "f.pt", lambda b, m: _load_with_memo(b, m, "f.pt"), _STAND_INS)


def outcome(fn: Any, data: bytes) -> tuple[str, Any]:
    try:
        return "ok", fn(data)
    except Exception as e:  # noqa: BLE001 - the verdict compared, whatever it is
        return type(e).__name__, str(e)


@pytest.mark.parametrize("name", NAMES)
def test_torch_files_read_as_the_c_unpickler_reads_them(files: dict[str, bytes], name: str) -> None:
    data = files[name]
    d = decoder(data)
    got = d.decode()
    want = reference(data)
    assert got == want
    assert type(got) is type(want)
    if name in ("nested", "module"):
        inner = got["model"] if name == "nested" else got
        ref = want["model"] if name == "nested" else want
        assert inner._metadata == ref._metadata and len(inner._metadata) == 101  # BUILD of the OrderedDict
    if name != "nested":  # hundreds of items: templates read all but the first few (the first 256 memo puts)
        assert d.templates and d.c_runs * 5 < d.items, (len(d.templates), d.c_runs, d.items)
    assert load_torch_save(data, path="f.pt") == want


def test_dtensor_values(files: dict[str, bytes]) -> None:
    got = decoder(files["dtensors_2d"]).decode()
    a, b, c = got["layers.7.gate_up"], got["layers.7.wo"], got["layers.7.tp_only"]
    assert isinstance(a, StoredDTensor) and a.placements == ("_S(0, 2)", "S(0)") and a.shape == (16, 8)
    assert b.placements == ("S(0)", "S(1)") and c.mesh.root is not None and c.mesh.names == ("tp",)
    keys = {v.local.key for v in got.values()}
    assert len(keys) == len(got)  # each its own storage record


def _memo_index_bounded(data: bytes) -> bool:
    """No memo put past 2**20 (the C unpickler sizes its memo array by the index: a damaged
    index would make the reference allocate gigabytes)."""
    import pickletools
    import warnings

    with warnings.catch_warnings():  # a damaged STRING opcode: pickletools warns of its escapes
        warnings.simplefilter("ignore")
        try:
            for op, arg, _ in pickletools.genops(data):
                if op.name in ("BINPUT", "LONG_BINPUT", "PUT") and isinstance(arg, int) and arg > 1 << 20:
                    return False
        except Exception:  # noqa: BLE001 - a damaged pickle: the ops before the damage were looked at
            pass
    return True


_PUT_ARGS: dict[str, list[int]] = {}


def _put_args(name: str, data: bytes) -> list[int]:
    """Byte positions of the memo put indices (LONG_BINPUT) past the first 256 puts."""
    import pickletools

    if name not in _PUT_ARGS:
        _PUT_ARGS[name] = [pos + 1 for op, arg, pos in pickletools.genops(data) if op.name == "LONG_BINPUT"]
    return _PUT_ARGS[name]


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.sampled_from(["dtensors_1d", "dtensors_2d", "plain", "module"]),
    st.sampled_from(["set", "put", "cut", "repeat"]),
    st.integers(0, 1 << 32),
    st.integers(1, 255),
    st.integers(1, 40),
    st.integers(0, 3000),
)
def test_damaged_pickles_are_read_as_the_reference_reads_them_or_left_to_it(
    files: dict[str, bytes], name: str, kind: str, at: int, delta: int, span: int, index: int
) -> None:
    good = files[name]
    b = bytearray(good)
    if kind == "put":  # a memo put renumbered (an index later items do not refer to, or one they do)
        puts = _put_args(name, good)
        i = puts[at % len(puts)]
        b[i : i + 4] = index.to_bytes(4, "little")
    else:
        i = at % len(b)
        if kind == "set":
            b[i] = (good[i] + delta) % 256
        else:
            j = min(len(b), i + span)
            b[i:j] = b"" if kind == "cut" else b[i:j] * 2
    bad = bytes(b)
    assume(_memo_index_bounded(bad))
    want = outcome(reference, bad)
    try:
        got = fast(bad)
    except pt_pickle.Unsupported:
        pass
    else:
        assert want == ("ok", got)
    assert outcome(lambda x: load_torch_save(x, path="f.pt"), bad) == want


def _newobj_put(data: bytes, cls: str) -> int:
    """The memo index of the first instance of ``cls`` (GLOBAL, ..., NEWOBJ, put)."""
    import pickletools

    seen = 0
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "GLOBAL" and arg == cls:
            seen = 1
        elif seen == 1 and op.name == "NEWOBJ":
            seen = 2
        elif seen == 2 and op.name in ("BINPUT", "LONG_BINPUT"):
            assert isinstance(arg, int)
            return arg
    raise AssertionError(cls)


def _key_op(key: str) -> bytes:
    raw = key.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def test_an_item_changing_an_older_object_leaves_the_file_to_the_reference(files: dict[str, bytes]) -> None:
    """An item (no memo puts: later indices stay the pickler's) that BUILDs the mesh every DTensor
    refers to: the C unpickler's later DTensors carry the new dim names, so the templates (learnt
    on the old mesh) must not read them."""
    good = files["dtensors_1d"]
    at = good.index(_key_op("model.layers.60.q.weight"))
    first = reference(good)["model.layers.0.q.weight"]
    mesh_idx = _newobj_put(good, "torch.distributed.device_mesh DeviceMesh")
    layout_idx = _newobj_put(good, "torch.distributed._mesh_layout _MeshLayout")
    evil = (
        b"X\x04\x00\x00\x00evil"
        + b"j" + mesh_idx.to_bytes(4, "little")
        + b"}X\x0f\x00\x00\x00_mesh_dim_namesX\x02\x00\x00\x00zz\x85"
        + b"X\x07\x00\x00\x00_layout" + b"j" + layout_idx.to_bytes(4, "little")
        + b"ub"
    )  # fmt: skip
    evil = evil.replace(b"}X", b"}(X", 1)
    bad = good[:at] + evil + good[at:]
    want = reference(bad)
    assert want["model.layers.61.q.weight"].mesh.names == ("zz",) != first.mesh.names
    with pytest.raises(pt_pickle.Unsupported):
        fast(bad)
    got = load_torch_save(bad, path="f.pt")
    assert type(got.pop("evil")) is type(want.pop("evil"))  # a record: equal by identity only
    assert got == want


def test_a_hostile_global_in_the_items_is_refused_naming_it(files: dict[str, bytes]) -> None:
    good = files["dtensors_1d"]
    at = good.index(_key_op("model.layers.60.q.weight"))
    bad = good[:at] + b"X\x04\x00\x00\x00evilcposix\nsystem\nX\x04\x00\x00\x00echo\x85R" + good[at:]
    from reshard.io.unpickle import UnsafePickleError

    with pytest.raises(UnsafePickleError, match=r"f\.pt: the torch\.save pickle refers to posix\.system"):
        load_torch_save(bad, path="f.pt")
    with pytest.raises(pt_pickle.Unsupported):
        fast(bad)


def test_protocols_other_than_2_go_to_the_reference(files: dict[str, bytes]) -> None:
    obj = {"a": 1, "b": [1, 2]}
    for protocol in (3, 4, 5):
        with pytest.raises(pt_pickle.Unsupported):
            fast(pickle.dumps(obj, protocol=protocol))
        assert load_torch_save(pickle.dumps(obj, protocol=protocol), path="f.pt") == obj
