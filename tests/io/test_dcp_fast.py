"""The DCP reader's fast paths against the reference ones, and torch as the oracle.

- ``.metadata``: :class:`~reshard.io.unpickle._MetaDecoder` (item templates, a memo of strings
  and classes) gives what the C unpickler with the same allow-list gives, on torch's pickles
  (protocols 2-5) and reshard's, and on damaged ones (a byte set, a range cut or repeated):
  the same values, or both refuse; in bounded memory.
- chunk archives: :class:`~reshard.io.torchzip.ArchiveReader` parses each layout once and
  gives every archive the records and CRC32s a full parse gives; a damaged archive in a run
  of one layout is caught as a full parse catches it.
- a checkpoint ``dcp.save`` wrote with many small tensors: read as torch wrote it (convert
  bit for bit against torch's tensors), a flipped byte in one chunk found and named.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path, PosixPath
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard.errors import HeaderError
from reshard.io import torchzip
from reshard.io.dcp_metadata import ChunkEntry, TensorEntry, encode_metadata
from reshard.io.torchzip import ArchiveReader, read_record, read_torch_zip
from reshard.io.unpickle import (
    DcpMetadata,
    _Compact,
    _MetaDecoder,
    _reference_metadata,
    _StorageAcc,
    _Unsupported,
    load_dcp_metadata,
    load_stored_tensor,
)

torch = pytest.importorskip("torch")
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

RESHARD = Path(sys.executable).with_name("reshard")
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint16, torch.int64, torch.bool]
# with dtypes safetensors lacks (read as such, listed and refused unless excluded by the reader)
DTYPES += [torch.complex128, torch.float4_e2m1fn_x2]


def values(md: DcpMetadata) -> tuple[Any, ...]:
    return (list(md.entries.items()), list(md.storage), md.version, md.megatron)


def outcome(read: Any, data: bytes) -> tuple[str, Any]:
    try:
        return ("ok", values(read(data)))
    except HeaderError:
        return ("refused", None)


def fast(data: bytes) -> DcpMetadata:
    """The fast decoder alone (no fallback): it must read these pickles itself."""
    return _MetaDecoder(data, "m").decode()


def reference(data: bytes) -> DcpMetadata:
    return _reference_metadata(data, "m")


@st.composite
def torch_metadata(draw: st.DrawFn) -> Metadata:
    """torch's own classes, as ``dcp.save`` builds them: 0-3 dim tensors (empty boxes too) split in
    1-3 chunks over up to 3 files, a non-tensor item, flat or nested planner paths."""
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    nested = draw(st.booleans())
    at = draw(st.sampled_from([0, 2**31, 5 * 2**30]))  # file offsets past 2 GiB and 4 GiB: LONG1
    for i in range(draw(st.integers(0, 60))):
        fqn = f"model.layers.{i // 3}.{draw(st.sampled_from(['w', 'bias', 'weight_scale']))}{i}"
        nd = draw(st.integers(0, 3))
        shape = [draw(st.sampled_from([0, 1, 3, 8, 300, 70000])) for _ in range(nd)]
        n = draw(st.integers(1, 3)) if nd and shape[0] >= 3 else 1
        chunks = []
        for c in range(n):
            offs, sizes = [0] * nd, list(shape)
            if n > 1:
                step = shape[0] // n
                offs[0], sizes[0] = c * step, step if c < n - 1 else shape[0] - c * step
            chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
        props = TensorProperties(dtype=draw(st.sampled_from(DTYPES)))
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
        for c, ch in enumerate(chunks):
            length = draw(st.integers(0, 70000))
            storage[MetadataIndex(fqn, ch.offsets, c)] = _StorageInfo(f"__{c}_0.distcp", at, length)
            at += length
        planner[fqn] = ("model", fqn) if nested else (fqn,)
    if draw(st.booleans()):
        sdm["optim.lr"] = BytesStorageMetadata()
        storage[MetadataIndex("optim.lr")] = _StorageInfo("__0_0.distcp", at, 1261)
        planner["optim.lr"] = ("optim", "lr")
    meta = StorageMeta(PosixPath("/ckpt/a"), "save-id")
    return Metadata(sdm, planner, storage, meta, draw(st.sampled_from(["1.0.0", None])))


@st.composite
def reshard_tensors(draw: st.DrawFn) -> list[TensorEntry]:
    """reshard's own writer: up to 700 tensors (memo indexes past 255 and 65535), every int size."""
    ints = st.sampled_from([0, 1, 75, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40])
    out = []
    for k in range(draw(st.sampled_from([0, 1, 5, 300, 700]))):
        nd = draw(st.integers(0, 3))
        shape = tuple(draw(ints) for _ in range(nd))
        chunks = tuple(
            ChunkEntry(
                tuple(draw(ints) for _ in range(nd)),
                tuple(draw(ints) for _ in range(nd)),
                draw(st.sampled_from(["__0_0.distcp", "__1_0.distcp"])),
                draw(ints),
                draw(ints),
            )
            for _ in range(draw(st.integers(0, 2)))
        )
        out.append(TensorEntry(f"t.{k}.w", draw(st.sampled_from(["BF16", "I16", "F32"])), shape, chunks))
    return out


# --------------------------------------------------------------------------- .metadata


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(torch_metadata(), st.sampled_from([2, 3, 4, 5]))
def test_torch_pickles_read_fast_as_the_c_unpickler_reads_them(md: Metadata, protocol: int) -> None:
    data = pickle.dumps(md, protocol=protocol)
    got = fast(data)
    assert got.decoder == "fast"
    assert values(got) == values(reference(data))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(reshard_tensors())
def test_reshard_pickles_read_fast_as_the_c_unpickler_reads_them(tensors: list[TensorEntry]) -> None:
    """Memo puts whose index bytes look like ints, past 255 (BINPUT -> LONG_BINPUT), big offsets."""
    data = encode_metadata(tensors, save_id="s")
    want = outcome(reference, data)
    if want[0] == "ok":  # (offsets past 2**63 are refused by both)
        assert values(fast(data)) == want[1]
    assert outcome(lambda d: load_dcp_metadata(d, path="m"), data) == want


def _memo_index_bounded(data: bytes) -> bool:
    """No memo put past 2**20 (the C unpickler sizes its memo array by the index: a damaged
    index would make the reference allocate gigabytes)."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("BINPUT", "LONG_BINPUT", "PUT") and isinstance(arg, int) and arg > 1 << 20:
                return False
    except Exception:  # noqa: BLE001 - a damaged pickle: the ops before the damage were looked at
        pass
    return True


def _put_args(data: bytes) -> set[int]:
    """Byte positions of the arguments of BINPUT / LONG_BINPUT opcodes."""
    out: set[int] = set()
    for op, _, pos in pickletools.genops(data):
        if op.name == "BINPUT":
            out.add(pos + 1)
        elif op.name == "LONG_BINPUT":
            out.update(range(pos + 1, pos + 5))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(torch_metadata(), st.sampled_from([2, 4, 5]), st.data())
def test_damaged_pickles_read_as_the_c_unpickler_reads_them(md: Metadata, protocol: int, data: Any) -> None:
    """A byte set anywhere, a range cut or repeated (protocol 4/5: MEMOIZE, FRAME): the same values
    or both refuse. Protocol 2: one byte set anywhere but a BINPUT index (the decoder does not
    read the index of a memo put nothing later refers to: a damaged one reads as written)."""
    good = pickle.dumps(md, protocol=protocol)
    assume(len(good) > 40)
    b = bytearray(good)
    i = data.draw(st.integers(0, len(b) - 1))
    kind = data.draw(st.sampled_from(["set", "cut", "repeat"] if protocol >= 4 else ["set"]))
    if kind == "set":
        assume(protocol >= 4 or i not in _put_args(good))
        b[i] = data.draw(st.integers(0, 255).filter(lambda v: v != good[i]))
    else:
        j = min(len(b), i + data.draw(st.integers(1, 24)))
        b[i:j] = b"" if kind == "cut" else b[i:j] * 2
    bad = bytes(b)
    assume(_memo_index_bounded(bad))
    assert outcome(lambda d: load_dcp_metadata(d, path="m"), bad) == outcome(reference, bad)


def test_hostile_class_inside_the_items_is_refused() -> None:
    """A global outside the allow-list in the middle of the items: the fast decoder leaves the file
    to the C unpickler, which refuses it naming the class."""

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("echo pwned",))

    sdm = {
        f"w{i}": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
        )
        for i in range(50)
    }
    good = Metadata(dict(sdm), {}, {}, None, "1.0.0")
    sdm["w25"] = Evil()  # type: ignore[assignment]
    evil = Metadata(sdm, {}, {}, None, "1.0.0")
    for protocol in (2, 4):
        assert fast(pickle.dumps(good, protocol=protocol)).decoder == "fast"
        with pytest.raises(HeaderError, match=r"m: the DCP metadata pickle refers to posix\.system"):
            load_dcp_metadata(pickle.dumps(evil, protocol=protocol), path="m")
        with pytest.raises(_Unsupported):
            fast(pickle.dumps(evil, protocol=protocol))


def test_metadata_memory_is_bounded() -> None:
    """20k tensors: the decoder keeps strings and values, not the pickle's object graph (the C
    unpickler's memo holds every object to the end: ~2.5 KB a tensor)."""
    tensors = [
        TensorEntry(f"model.layers.{i // 64}.experts.{i % 64}.w", "I16", (32, 192), (
            ChunkEntry((0, 0), (16, 192), "__0_0.distcp", i * 20000, 7500),
            ChunkEntry((16, 0), (16, 192), "__1_0.distcp", i * 20000, 7500),
        ))
        for i in range(20000)
    ]  # fmt: skip
    data = encode_metadata(tensors, save_id="s")
    tracemalloc.start()
    try:
        md = load_dcp_metadata(data, path="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert md.decoder == "fast" and len(md.storage) == 40000
    assert peak < 20000 * 800, peak  # the values: ~0.3 KB a tensor (its name, two storage rows)
    assert len({id(m) for m in md.entries.values()}) == 1  # one TensorMeta for one geometry


def _gathered_metadata(n: int, norms: int = 0) -> Metadata:
    """``dcp.save`` from 4 ranks of DTensors: rank 0 gathers each rank's plan, so every
    ``MetadataIndex`` and planner key holds a name string of its own (the pickle writes it again
    instead of a memo get of the ``state_dict_metadata`` key). ``norms``: every so many tensors,
    a replicated 1-d one (one chunk, on one rank)."""
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    paths = [f"__{r}_0.distcp" for r in range(4)]  # each rank's file: one string
    at = 0
    for i in range(n):
        if norms and i % norms == norms - 1:
            fqn = f"model.layers.{i // 192}.norm{i}.weight"
            chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([192]))
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.int16), torch.Size([192]), [chunk])
            storage[MetadataIndex("".join(list(fqn)), torch.Size([0]), 0)] = _StorageInfo(
                paths[i % 4], at, 1961
            )
            at += 1961
            planner["".join(list(fqn))] = (fqn,)
            continue
        fqn = f"model.layers.{i // 192}.mlp.experts.{i % 64}.{['gate', 'up', 'down'][i % 3]}_proj.weight"
        cols = i % 3 == 2
        shape = (192, 32) if cols else (32, 192)
        box = [((0, 8 * r), (192, 8)) if cols else ((8 * r, 0), (8, 192)) for r in range(4)]
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in box]  # each its own
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.int16), torch.Size(shape), chunks)
        for r, ch in enumerate(chunks):
            # equal values, other objects (as unpickled from rank r's plan)
            own, offsets = "".join(list(fqn)), torch.Size(list(ch.offsets))
            storage[MetadataIndex(own, offsets, r)] = _StorageInfo(paths[r], at, 3800 + i % 7)
            at += 3800 + i % 7
        planner["".join(list(fqn))] = (fqn,)
    return Metadata(sdm, planner, storage, StorageMeta(PosixPath("/ckpt"), "id"), "1.0.0")


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_gathered_metadata_reads_as_the_c_unpickler_reads_it(protocol: int) -> None:
    data = pickle.dumps(_gathered_metadata(300), protocol=protocol)
    got = fast(data)
    assert got.decoder == "fast"
    assert values(got) == values(reference(data))


def test_gathered_metadata_memory_is_bounded() -> None:
    """The names of their own are read by the item templates, not op by op by the machine (whose
    memo kept every object of the 4 ranks' rows: 100k tensors of a 4-rank ``dcp.save`` were 13 s
    and 700 MiB to open)."""
    data = pickle.dumps(_gathered_metadata(5000), protocol=4)
    tracemalloc.start()
    try:
        md = load_dcp_metadata(data, path="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert md.decoder == "fast" and len(md.storage) == 20000
    # one string a name: the rows share the state_dict_metadata key's (but the few the machine
    # reads: an item across a protocol-4 frame's end, the first of each batch of 1000)
    assert len({id(f) for f in md.storage.fqns}) < 5000 * 1.02
    assert peak < 5000 * 1500, peak


def _storage_frames(data: bytes) -> list[int]:
    """Where the FRAME opcodes of ``storage_data`` are (after its first item)."""
    first = data.index(b"MetadataIndex")
    return [p for op, _, p in pickletools.genops(data) if op.name == "FRAME" and p > first + 200]


def test_storage_items_across_frames_are_read_by_the_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython's pickler starts a protocol-4 frame between two opcodes of an item (1 storage item
    in 40): the item reader reads it from its bytes with the FRAME opcode left out (the same
    values), not the machine, opcode by opcode (which took 10-20 us an opcode)."""
    data = pickle.dumps(_gathered_metadata(2000), protocol=4)
    assert len(_storage_frames(data)) > 10
    by_machine: list[int] = []  # items the machine built (the others come as _Compact values)
    vm_items = _StorageAcc.vm_items

    def counted(acc: _StorageAcc, items: list[Any]) -> None:
        by_machine.append(sum(type(k) is not _Compact for k in items[::2]))
        vm_items(acc, items)

    monkeypatch.setattr(_StorageAcc, "vm_items", counted)
    got = fast(data)
    assert got.decoder == "fast"
    assert values(got) == values(reference(data))
    # the first few only (templates are learnt from them); the frames' 15 items too before
    assert sum(by_machine) <= 8, by_machine


def test_items_across_frames_that_a_template_does_not_take_go_to_the_machine() -> None:
    """1-d items among 2-d ones: the 2-d template's lazy name match runs on into the next item
    (its length check then refuses it), also for an item across a frame's end: the machine
    reads such an item, and the rest of the pickle stays the item reader's (the fast decoder)."""
    for n in range(1200, 1400, 29):
        data = pickle.dumps(_gathered_metadata(n, norms=7), protocol=4)
        got = fast(data)
        assert got.decoder == "fast"
        assert values(got) == values(reference(data))


@pytest.mark.parametrize("shift", [1, 2, 3, 5, 9])
def test_frame_cut_inside_an_opcode_of_an_item_reads_as_the_c_unpickler(shift: int) -> None:
    """A FRAME opcode moved ``shift`` bytes on, into the middle of an opcode of a storage item
    (a frame ending inside an opcode: the C unpickler refuses it): both refuse or read alike."""
    good = pickle.dumps(_gathered_metadata(300), protocol=4)
    frames = _storage_frames(good)
    assert frames
    for at in frames[:3]:
        prev = max(p for p in [0, *(q for q in frames if q < at)] if good[p] == 0x95 or p == 0)
        n_prev = int.from_bytes(good[prev + 1 : prev + 9], "little") if prev else None
        n = int.from_bytes(good[at + 1 : at + 9], "little")
        head, body = good[:at], good[at + 9 :]
        bad = bytearray(head + body[:shift] + b"\x95" + (n - shift).to_bytes(8, "little") + body[shift:])
        if n_prev is not None:  # the frame before grows by the bytes moved into it
            bad[prev + 1 : prev + 9] = (n_prev + shift).to_bytes(8, "little")
        assert outcome(lambda d: load_dcp_metadata(d, path="m"), bytes(bad)) == outcome(reference, bytes(bad))


def _megatron_metadata(n: int, ranks: int = 4) -> Metadata:
    """What Megatron-Core 0.16's ``torch_dist`` saver pickles from ``ranks`` ranks: torch's
    ``Metadata`` plus ``all_local_plans``, every rank's save plan, whose write items share the
    chunks (and rank 0's properties and names) of ``state_dict_metadata`` (memo gets back into
    it); the other ranks' names and properties are their own (gathered), as are byte items."""
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    items: list[list[Any]] = [[] for _ in range(ranks)]
    paths = [f"__{r}_0.distcp" for r in range(ranks)]  # each rank's file: one string
    at = 0
    for i in range(n):
        fqn = f"decoder.layers.{i // 8}.mlp.experts.{i % 8}.{['fc1', 'fc2'][i % 2]}.weight"
        props = TensorProperties(dtype=torch.bfloat16 if i % 5 else torch.float32)
        shape = torch.Size([8 * ranks, 96 + 32 * (i % 3)])
        chunks = [
            ChunkStorageMetadata(torch.Size([8 * r, 0]), torch.Size([8, shape[1]])) for r in range(ranks)
        ]
        sdm[fqn] = TensorStorageMetadata(props, shape, chunks)
        for r, ch in enumerate(chunks):
            name = fqn if r == 0 else "".join(list(fqn))
            own = props if r == 0 else TensorProperties(dtype=props.dtype)
            index = MetadataIndex(name, torch.Size(list(ch.offsets)))
            items[r].append(
                WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(ch, own, shape))
            )
            storage[MetadataIndex(name, torch.Size(list(ch.offsets)), r)] = _StorageInfo(paths[r], at, 1500)
            at += 1500
        if i % 1000 == 7:  # a byte item (Megatron's _extra_state), rank 0 writes it
            key = fqn.replace("weight", "_extra_state")
            sdm[key] = BytesStorageMetadata()
            items[0].append(WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO, BytesIOWriteData(9)))
            storage[MetadataIndex(key)] = _StorageInfo(paths[0], at, 9)
            at += 9
    md = Metadata(sdm, None, storage, StorageMeta(PosixPath("/ckpt"), "id"), "1.0.0")
    md.all_local_plans = [SavePlan(its) for its in items]  # type: ignore[attr-defined]
    return md


@pytest.mark.parametrize("protocol", [4, 5])
def test_megatron_plans_read_fast_as_the_c_unpickler_reads_them(protocol: int) -> None:
    data = pickle.dumps(_megatron_metadata(2100), protocol=protocol)
    got = fast(data)
    assert got.decoder == "fast"
    assert values(got) == values(reference(data))
    assert len(got.storage) == 2100 * 4 + 3


def test_megatron_plans_protocol_2_is_left_to_the_c_unpickler() -> None:
    """Protocol 2/3 plans: the decoder does not count BINPUT indexes, so it cannot tell a get of
    an object it did not keep from a get of nothing; the C path reads them."""
    data = pickle.dumps(_megatron_metadata(30), protocol=2)
    with pytest.raises(_Unsupported):
        fast(data)
    assert values(load_dcp_metadata(data, path="m")) == values(reference(data))


def test_megatron_plans_memory_is_bounded() -> None:
    """20k chunks with their save plans: the plans' write items are checked and dropped, not
    built (the C unpickler keeps them and all of state_dict_metadata's objects they refer to)."""
    data = pickle.dumps(_megatron_metadata(5000), protocol=4)
    tracemalloc.start()
    try:
        md = load_dcp_metadata(data, path="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert md.decoder == "fast" and len(md.storage) == 20000 + 5
    assert peak < 5000 * 1500, peak


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 40), st.sampled_from([4, 5]), st.data())
def test_damaged_megatron_plans_read_as_the_c_unpickler_reads_them(n: int, protocol: int, data: Any) -> None:
    """A byte set, a range cut or repeated, mostly in the plans: the same values or both refuse."""
    good = pickle.dumps(_megatron_metadata(n), protocol=protocol)
    start = good.index(b"all_local_plans")
    i = data.draw(st.integers(start if data.draw(st.integers(0, 9)) else 0, len(good) - 1))
    b = bytearray(good)
    kind = data.draw(st.sampled_from(["set", "cut", "repeat"]))
    if kind == "set":
        b[i] = data.draw(st.integers(0, 255).filter(lambda v: v != good[i]))
    else:
        j = min(len(b), i + data.draw(st.integers(1, 24)))
        b[i:j] = b"" if kind == "cut" else b[i:j] * 2
    bad = bytes(b)
    assume(_memo_index_bounded(bad))
    assert outcome(lambda d: load_dcp_metadata(d, path="m"), bad) == outcome(reference, bad)


def _memo(data: bytes) -> dict[int, Any]:
    """The memo after loading ``data`` (pickle.py's unpickler, reshard's stand-ins)."""
    from reshard.io.unpickle import DCP_METADATA_GLOBALS

    class Up(pickle._Unpickler):  # type: ignore[name-defined,misc]
        def find_class(self, module: str, name: str) -> Any:
            return DCP_METADATA_GLOBALS[(module, name)]

    up = Up(io.BytesIO(data))
    up.load()
    return dict(up.memo)


@pytest.mark.parametrize("which", [0, 57])  # the first chunk (the machine built it), a later one
@pytest.mark.parametrize("where", ["before", "inside"])  # the plans list's batch
def test_plans_changing_state_dict_metadata_are_read_as_the_c_unpickler_reads_them(
    which: int, where: str
) -> None:
    """Opcodes that get a chunk of state_dict_metadata (which the decoder may not have kept) and
    build it anew, fill it, call it or hash it: the C path's verdict (refused, or read)."""
    from reshard.io.unpickle import _ChunkStorageMetadata, _TensorProperties, _TensorStorageMetadata

    framed = pickle.dumps(_megatron_metadata(40), protocol=4)
    frames = [p for op, _, p in pickletools.genops(framed) if op.name == "FRAME"]
    good = b"".join(framed[a + 9 : b] for a, b in zip(frames, [*frames[1:], len(framed)]))  # no FRAME
    good = framed[: frames[0]] + good
    assert values(fast(good)) == values(reference(good))
    memo = _memo(good)
    chunk = sorted(k for k, v in memo.items() if isinstance(v, _ChunkStorageMetadata))[which]
    props = sorted(k for k, v in memo.items() if isinstance(v, _TensorProperties))[which]
    size = next(k for k, v in memo.items() if getattr(v, "name", "") == "torch.Size")
    key = next(k for k, v in memo.items() if v == "sizes")
    sdm = next(
        k for k, v in memo.items() if isinstance(v, dict) and "decoder.layers.0.mlp.experts.0.fc1.weight" in v
    )
    tensor = min(k for k, v in memo.items() if isinstance(v, _TensorStorageMetadata))
    at = good.index(b"all_local_plans") + len(b"all_local_plans") + 3  # key, MEMOIZE, EMPTY_LIST, MEMOIZE
    assert good[at - 2 : at + 1] == b"]\x94("
    at += where == "inside"

    def get(i: int) -> bytes:
        return b"j" + i.to_bytes(4, "little")

    new_sizes = b"}(" + get(key) + get(size) + b"K\x07K\x05\x86\x85Ru"
    hostile = {
        "build": (get(chunk) + new_sizes + b"b0", "refused"),  # sizes only: its offsets are gone
        "rebuild properties": (get(props) + b"(\x89t" + b"b0", "refused"),  # no dtype
        "setitem": (get(chunk) + b"K\x01K\x02s0", "refused"),
        "append": (get(chunk) + b"K\x01a0", "refused"),
        "call": (get(chunk) + b")R0", "refused"),
        "hash": (b"}" + get(chunk) + b"K\x01s0", "ok"),
        # one entry more in state_dict_metadata: a get of its dict and a SETITEM
        "fill state_dict_metadata": (get(sdm) + b"\x8c\x02zz" + get(tensor) + b"s0", "changed"),
    }
    want_ok = values(reference(good))
    for name, (ops, verdict) in hostile.items():
        bad = good[:at] + ops + good[at:]
        want = outcome(reference, bad)
        assert want[0] == ("ok" if verdict == "changed" else verdict), name
        assert want == ("refused", None) or (want == ("ok", want_ok)) == (verdict == "ok"), name
        assert outcome(lambda d: load_dcp_metadata(d, path="m"), bad) == want, name
        if verdict == "refused":
            with pytest.raises(_Unsupported):
                fast(bad)


# --------------------------------------------------------------------------- chunk archives


def _archives(tmp_path: Path, tensors: list[Any]) -> tuple[Path, list[tuple[int, int]]]:
    """``torch.save`` archives back to back, as in a ``.distcp`` file (odd offsets)."""
    blob = bytearray(b"x" * 13)
    spans = []
    for t in tensors:
        buf = io.BytesIO()
        torch.save(t, buf)
        spans.append((len(blob), len(buf.getvalue())))
        blob += buf.getvalue()
    p = tmp_path / "__0_0.distcp"
    p.write_bytes(bytes(blob))
    return p, spans


def _tensors(n: int) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    shapes = [((32, 12), torch.int16), ((12, 32), torch.int16), ((40,), torch.bfloat16), ((), torch.float32)]
    out = []
    for i in range(n):
        shape, dt = shapes[i % len(shapes)]
        out.append((torch.randn(shape, generator=g) * 100).to(dt))
    return out


class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        return read_torch_zip(*args, **kw)


def _full_parse(fd: int, path: str, base: int, length: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    tz = read_torch_zip(fd, path, base, length)
    checked = {s: read_record(fd, tz, tz.record(s)) for s in ("data.pkl", "byteorder")}
    return tz.records, checked


def test_archive_layouts_are_learnt_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 archives of 4 layouts: 4 full parses; every archive's records and CRC32s are a full
    parse's, and the CRC32s are those of its bytes."""
    p, spans = _archives(tmp_path, _tensors(300))
    counting = _Counting()
    monkeypatch.setattr(torchzip, "read_torch_zip", counting)
    fd = os.open(p, os.O_RDONLY)
    try:
        ar = ArchiveReader(fd, str(p), p.stat().st_size)
        blob = p.read_bytes()
        hint = None
        for base, length in spans:
            got = ar.read(base, length, hint)
            assert got is not None
            lay, crcs = got
            hint = lay
            records, checked = _full_parse(fd, str(p), base, length)
            assert {n: (r.offset - base, r.size, r.compress_type) for n, r in records.items()} == {
                n: (r.offset, r.size, r.compress_type) for n, r in lay.records.items()
            }
            assert lay.checked == checked
            for name, crc in zip(lay.varying, crcs, strict=True):
                rec = records[name]
                assert (
                    int.from_bytes(crc, "little")
                    == rec.crc32
                    == zlib.crc32(blob[rec.offset : rec.offset + rec.size])
                )
        ar.close()
    finally:
        os.close(fd)
    assert counting.calls == 4


@pytest.mark.parametrize("damage", ["data.pkl", "data", "directory", "other pickle"])
def test_damaged_archive_in_a_run_of_one_layout(tmp_path: Path, damage: str) -> None:
    """Archive 101 of 200 (all of one layout) damaged: read as a full parse reads it."""
    tensors = _tensors(200)
    p, spans = _archives(tmp_path, tensors)
    blob = bytearray(p.read_bytes())
    base, length = spans[101]
    tz_bytes = bytes(blob[base : base + length])
    if damage == "other pickle":  # a valid data.pkl of another shape, its CRC32 right: another layout
        other = tensors[101].reshape(tuple(reversed(tensors[101].shape)))
        buf = io.BytesIO()
        torch.save(other.clone(), buf)
        assert len(buf.getvalue()) == length
        blob[base : base + length] = buf.getvalue()
    else:
        at = {
            "data.pkl": tz_bytes.index(b"_rebuild_tensor") + 3,
            "data": tz_bytes.index(b"archive/data/0") + 200,
            "directory": tz_bytes.rindex(b"PK\x01\x02") + 20,  # a compressed size in the directory
        }[damage]
        blob[base + at] ^= 0x10
    p.write_bytes(bytes(blob))
    fd = os.open(p, os.O_RDONLY)
    try:
        ar = ArchiveReader(fd, str(p), len(blob))
        for b, n in spans[:101]:
            ar.read(b, n)
        try:
            records, checked = _full_parse(fd, str(p), base, length)
        except HeaderError as e:
            with pytest.raises(type(e)) as got_e:
                ar.read(base, length)
            assert str(got_e.value) == str(e) and f"{p} (archive at byte {base})" in str(e)
            assert damage in ("data.pkl", "directory"), e
            return
        got = ar.read(base, length)
        assert got is not None
        lay, crcs = got
        assert {n: (r.offset - base, r.size) for n, r in records.items()} == {
            n: (r.offset, r.size) for n, r in lay.records.items()
        }
        assert lay.checked == checked
        rec = records["archive/data/0"]
        stored = int.from_bytes(crcs[lay.varying.index("archive/data/0")], "little")
        assert stored == rec.crc32
        if damage == "data":  # the bytes fail the CRC32 the archive gives: convert and check see it
            assert stored != zlib.crc32(blob[rec.offset : rec.offset + rec.size])
        else:
            assert damage == "other pickle"
            shape = load_stored_tensor(lay.checked["data.pkl"], path="x").size
            assert shape == tuple(reversed(tensors[101].shape))
        ar.close()
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- a checkpoint torch wrote


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``dcp.save`` (one process) of 1200 small tensors of a few shapes and dtypes, a transposed
    view, a 0-d tensor and a non-tensor item."""
    import warnings

    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp_many") / "ck"
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {}
    for i in range(1200):
        shape, dt = [((32, 24), torch.int16), ((24, 32), torch.bfloat16), ((24,), torch.float32)][i % 3]
        state[f"model.layers.{i // 48}.experts.{i % 48}.w"] = (torch.randn(shape, generator=g) * 50).to(dt)
    state["model.t"] = torch.randn(6, 5, generator=g).t()
    state["model.step"] = torch.tensor(7.0)
    state["extra.lr"] = 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RESHARD), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_torch_saved_checkpoint_converts_bit_for_bit(
    many: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from reshard.formats import open_checkpoint

    root, want = many
    ck = open_checkpoint(root)
    assert len(ck.tensors) == len(want)
    proc = _cli("convert", root, tmp_path / "hf", "--consolidate")
    assert proc.returncode == 0, proc.stderr
    got: dict[str, Any] = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got.update(load_file(f))
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g, w.contiguous()), k


def test_torch_saved_checkpoint_opens_as_the_reference_readers_open_it(
    many: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same Checkpoint with the fast paths off: the C unpickler, and every archive parsed in
    full (no layout kept)."""
    from reshard.formats.dcp import open_dcp
    from reshard.io import unpickle

    root, _ = many

    def fields(ck: Any) -> Any:
        return (
            [f if "reshard-dcp-" not in f else "spool" for f in ck.files],  # (a fresh spool each)
            ck.file_sizes,
            [str(w) for w in ck.warnings],
            ck.non_tensors,
            {
                n: (
                    t.dtype,
                    t.shape,
                    t.piece_files,
                    t.piece_offsets,
                    t.piece_blocks,
                    t.signature,
                    t.piece_crc32,
                )
                for n, t in ck.tensors.items()
            },
        )

    fast_ck = fields(open_dcp(root))

    def no_fast(self: Any) -> Any:
        raise unpickle._Unsupported

    monkeypatch.setattr(unpickle._MetaDecoder, "decode", no_fast)
    monkeypatch.setattr(torchzip, "_MAX_LAYOUTS", 0)
    assert fields(open_dcp(root)) == fast_ck


def _copy(root: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "ck"
    shutil.copytree(root, out)
    return out


def test_flipped_byte_in_one_chunk_of_many(many: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Chunk 700 of 1200 (one layout with hundreds of others): a data byte fails its CRC32
    (``inspect --check``: that tensor only); a data.pkl byte: exit 2 naming the file and tensor."""
    from reshard.formats import open_checkpoint

    ck = _copy(many[0], tmp_path)
    names = sorted(open_checkpoint(ck).tensors)
    t = open_checkpoint(ck).tensors[names[700]]
    f = ck / "__0_0.distcp"
    blob = bytearray(f.read_bytes())
    blob[t.piece_offsets[0] + 5] ^= 0x01
    f.write_bytes(bytes(blob))
    proc = _cli("inspect", ck, "--check", "--json")
    assert proc.returncode == 1, proc.stderr
    problems = json.loads(proc.stdout)["check"]["problems"]
    assert [(p["kind"], p["tensor"]) for p in problems] == [("crc32", names[700])]
    blob[t.piece_offsets[0] + 5] ^= 0x01
    t2 = open_checkpoint(ck).tensors[names[703]]
    pkl = bytes(blob).rindex(b"_rebuild_tensor", 0, t2.piece_offsets[0])
    blob[pkl + 2] ^= 0x01
    f.write_bytes(bytes(blob))
    proc = _cli("inspect", ck)
    assert proc.returncode == 2
    assert "__0_0.distcp" in proc.stderr and names[703] in proc.stderr and "CRC32" in proc.stderr


def test_convert_checks_each_chunk_crc_in_columns(many: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """``convert`` checks every chunk's CRC32 as it reads: the regions are columns, not an object
    and an error text each (a 4-rank ``dcp.save`` of 100k tensors: 400k chunks, 85 MiB of them);
    a flipped byte is still named by tensor and piece."""
    from reshard.check import source_hashes
    from reshard.formats import open_checkpoint

    ck = open_checkpoint(many[0])
    tracemalloc.start()
    try:
        hashes = source_hashes(ck, 0)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert hashes and held < 1202 * 100, held  # a few dozen bytes a chunk
    bad = _copy(many[0], tmp_path)
    names = sorted(ck.tensors)
    t = ck.tensors[names[700]]
    f = bad / "__0_0.distcp"
    blob = bytearray(f.read_bytes())
    blob[t.piece_offsets[0] + 5] ^= 0x01
    f.write_bytes(bytes(blob))
    proc = _cli("convert", bad, tmp_path / "out", "--consolidate")
    assert proc.returncode == 2, proc.stderr
    assert f'tensor "{names[700]}" piece [0:' in proc.stderr and "CRC32" in proc.stderr, proc.stderr
