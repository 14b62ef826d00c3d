"""DCP checkpoints written with reshard's pure modules, judged by torch itself.

A small harness (``write_checkpoint``) writes ``__{rank}_0.distcp`` files from raw
bytes with ``reshard.io.torchzip_write`` and ``.metadata`` with
``reshard.io.dcp_metadata``; which rank stores which box comes from
``reshard.formats.dcp_boxes``. Oracles:

- a 4-rank gloo world runs torch's own ``dcp.save`` on a (dp=2, tp=2) mesh
  (``dcp_helpers/dcp_write_world.py``): our boxes equal torch's
  ``compute_local_shape_and_global_offset``, our files equal torch's byte for
  byte, our ``.metadata`` unpickles to the same objects and names the same globals;
- ``dcp.load`` (single process, ``no_dist``) and ``dcp_to_torch_save`` read our
  checkpoint bit-identically;
- gloo worlds ``dcp.load`` our checkpoint into DTensors on other meshes/placements.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard.errors import LayoutError
from reshard.formats.dcp_boxes import dedup_owners, rank_box, save_items
from reshard.intervals import Box
from reshard.io.dcp_metadata import ChunkEntry, TensorEntry, encode_metadata
from reshard.io.header import DTYPE_SIZES
from reshard.io.torchzip_write import chunk_archive
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.dtypes import TORCH_NAMES

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

sys.path.insert(0, str(Path(__file__).resolve().parent / "dcp_helpers"))
import dcp_write_world as W  # noqa: E402

pytestmark = pytest.mark.dist

HELPER = Path(W.__file__)
ST_NAME = {v: k for k, v in TORCH_NAMES.items()}  # torch dtype name -> safetensors name


# --------------------------------------------------------------------------- harness


@dataclasses.dataclass(frozen=True)
class Source:
    """A full tensor as raw bytes: what a torch-free writer has."""

    dtype: str
    shape: tuple[int, ...]
    raw: bytes

    def box_bytes(self, box: Box) -> bytes:
        arr = np.frombuffer(self.raw, np.uint8).reshape(self.shape + (DTYPE_SIZES[self.dtype],))
        return arr[tuple(slice(iv.start, iv.stop) for iv in box)].tobytes()


def write_checkpoint(
    root: Path,
    sources: dict[str, Source],
    layouts: dict[str, TensorLayout],
    *,
    checkpoint_id: str | None = None,
    save_id: str | None = None,
) -> None:
    """Write a DCP checkpoint of ``sources`` laid out as ``dcp.save`` from ``layouts`` would."""
    names = list(sources)
    items = save_items([(n, layouts[n], DTYPE_SIZES[sources[n].dtype]) for n in names])
    owners = dedup_owners([it for _, _, it in items])
    world = max(lay.mesh.size for lay in layouts.values())
    chunks: dict[str, list[ChunkEntry]] = {n: [] for n in names}
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        mine = sorted(
            ((fqn, box) for (fqn, box, _), o in zip(items, owners) if o == rank),
            key=lambda fb: names.index(fb[0]),
        )
        fname = f"__{rank}_0.distcp"
        with open(root / fname, "wb") as f:
            for fqn, box in mine:
                src = sources[fqn]
                data = src.box_bytes(box)
                arch = chunk_archive(src.dtype, tuple(iv.size for iv in box))
                start = f.tell()
                f.write(arch.prefix + data + arch.trailer(zlib.crc32(data), data[:8]))
                assert f.tell() - start == arch.size
                entry = ChunkEntry(
                    tuple(iv.start for iv in box), tuple(iv.size for iv in box), fname, start, arch.size
                )
                chunks[fqn].append(entry)
    # torch records tensors in order of first appearance over the ranks' plans
    first = {fqn: min(o for (f, _, _), o in zip(items, owners) if f == fqn) for fqn in names}
    order = sorted(names, key=lambda n: (first[n], names.index(n)))
    tensors = [TensorEntry(n, sources[n].dtype, sources[n].shape, tuple(chunks[n])) for n in order]
    md = encode_metadata(tensors, checkpoint_id=checkpoint_id, save_id=save_id)
    (root / ".metadata").write_bytes(md)


def raw_of(t: Any) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def source_of(t: Any) -> Source:
    return Source(ST_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape), raw_of(t))


def run_helper(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def state(obj: Any) -> Any:
    """Everything an unpickled object holds, in order (dataclass ``==`` skips ``MetadataIndex.index``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__module__, type(obj).__qualname__, [(k, state(v)) for k, v in vars(obj).items()])
    if isinstance(obj, dict):  # equal dicts may differ in order (planner_data keeps state-dict order)
        return ("dict", sorted(((state(k), state(v)) for k, v in obj.items()), key=repr))
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return (type(obj).__name__, [state(x) for x in obj])
    return (type(obj).__qualname__, obj)


class GlobalsSeen(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


# --------------------------------------------------------------------------- torch's own dcp.save


@pytest.fixture(scope="module")
def torch_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_torch_save")
    run_helper("save", str(root))
    return root


def save_layouts() -> dict[str, TensorLayout]:
    mesh = Mesh(W.SAVE_NAMES, W.SAVE_MESH)
    return {
        name: TensorLayout.make(shape, mesh, pls if pls is not None else ["R", "R"])
        for name, (shape, _, pls) in W.CASES.items()
    }


def test_rank_box_matches_torch(torch_world: Path) -> None:
    layouts = save_layouts()
    for rank in range(4):
        torch_boxes = json.loads((torch_world / f"boxes-{rank}.json").read_text())
        assert set(torch_boxes) == {n for n, c in W.CASES.items() if c[2] is not None}
        for name, want in torch_boxes.items():
            box = rank_box(layouts[name], rank)
            assert box is not None, name
            assert [iv.start for iv in box] == want["offset"], (name, rank)
            assert [iv.size for iv in box] == want["shape"], (name, rank)


def test_files_and_metadata_equal_torchs(torch_world: Path, tmp_path: Path) -> None:
    ckpt = torch_world / "ckpt"
    theirs = pickle.loads((ckpt / ".metadata").read_bytes())
    full = torch.load(torch_world / "full.pt", weights_only=True)
    out = tmp_path / "ours"
    write_checkpoint(
        out,
        {n: source_of(full[n]) for n in W.CASES},
        save_layouts(),
        checkpoint_id=str(theirs.storage_meta.checkpoint_id),
        save_id=theirs.storage_meta.save_id,
    )
    for rank in range(4):
        name = f"__{rank}_0.distcp"
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name
    ours_md = (out / ".metadata").read_bytes()
    ours = pickle.loads(ours_md)
    assert state(ours) == state(theirs)
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    assert [(i.fqn, i.offset, i.index) for i in ours.storage_data] == [
        (i.fqn, i.offset, i.index) for i in theirs.storage_data
    ]
    mine, ref = GlobalsSeen(ours_md), GlobalsSeen((ckpt / ".metadata").read_bytes())
    mine.load()
    ref.load()
    assert mine.seen == ref.seen


def test_replicated_chunks_go_where_torch_puts_them(torch_world: Path) -> None:
    theirs = pickle.loads((torch_world / "ckpt" / ".metadata").read_bytes())
    layouts = save_layouts()
    items = save_items([(n, layouts[n], DTYPE_SIZES[ST_NAME[W.CASES[n][1]]]) for n in W.CASES])
    owners = dedup_owners([it for _, _, it in items])
    where = {(idx.fqn, tuple(idx.offset)): info.relative_path for idx, info in theirs.storage_data.items()}
    ours = {(f, tuple(iv.start for iv in box)): f"__{o}_0.distcp" for (f, box, _), o in zip(items, owners)}
    assert ours == where
    assert len({o for (f, _, _), o in zip(items, owners) if f == "d.rep"}) == 1


def test_not_one_box_is_refused() -> None:
    lay = TensorLayout.make((8, 2), Mesh(("dp", "tp"), (2, 2)), ["R", "_S(0, 2)"])
    assert rank_box(lay, 0) is None
    with pytest.raises(LayoutError, match='tensor "w".*not one box'):
        save_items([("w", lay, 4)])
    with pytest.raises(LayoutError, match="Partial"):
        rank_box(TensorLayout.make((4,), Mesh(("tp",), (2,)), ["P"]), 0)


# --------------------------------------------------------------------------- torch reads ours


def tp2_sources() -> dict[str, Source]:
    rng = np.random.default_rng(7)
    specs: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.w_bf16": ("BF16", (6, 4)),
        "model.w_f8": ("F8_E4M3", (4, 3)),
        "model.w_u16": ("U16", (5,)),
        "model.w_f32_odd": ("F32", (5, 3)),
        "model.w_one_row": ("I64", (1, 3)),  # rank 1 gets an empty chunk at offset (1, 0)
        "model.w_empty": ("F16", (0, 4)),
        "model.flag": ("BOOL", (4, 2)),
        "step": ("F64", ()),
    }
    out = {}
    for name, (dtype, shape) in specs.items():
        n = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        raw = rng.integers(0, 2 if dtype == "BOOL" else 256, n, dtype=np.uint8).tobytes()
        out[name] = Source(dtype, shape, raw)
    return out


def tp2_layouts(sources: dict[str, Source]) -> dict[str, TensorLayout]:
    mesh = Mesh(("tp",), (2,))
    return {n: TensorLayout.make(s.shape, mesh, ["S(0)"] if s.shape else ["R"]) for n, s in sources.items()}


def as_tensor(src: Source) -> Any:
    t = torch.empty(src.shape, dtype=getattr(torch, TORCH_NAMES[src.dtype]))
    if src.raw:
        t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(src.raw), dtype=torch.uint8))
    return t


@pytest.fixture(scope="module")
def ours_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_ours") / "ckpt"
    sources = tp2_sources()
    write_checkpoint(root, sources, tp2_layouts(sources), checkpoint_id=str(root))
    return root


def assert_same(got: Any, src: Source, what: str) -> None:
    assert str(got.dtype) == f"torch.{TORCH_NAMES[src.dtype]}", what
    assert tuple(got.shape) == src.shape, what
    assert raw_of(got) == src.raw, what


def test_layout_of_our_files(ours_tp2: Path) -> None:
    md = pickle.loads((ours_tp2 / ".metadata").read_bytes())
    assert sorted(p.name for p in ours_tp2.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    chunks = md.state_dict_metadata["model.w_one_row"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (1, 3)), ((1, 0), (0, 3))]
    assert len(md.state_dict_metadata["model.w_empty"].chunks) == 1  # both ranks' empty boxes are one
    step = [i for i in md.storage_data if i.fqn == "step"]
    assert [md.storage_data[i].relative_path for i in step] == ["__1_0.distcp"]  # rank 1 had fewer bytes


def test_dcp_load_no_dist(ours_tp2: Path) -> None:
    sources = tp2_sources()
    sd = {n: torch.zeros(s.shape, dtype=getattr(torch, TORCH_NAMES[s.dtype])) for n, s in sources.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(sd, checkpoint_id=str(ours_tp2), no_dist=True)
    for name, src in sources.items():
        assert_same(sd[name], src, name)


def test_dcp_to_torch_save(ours_tp2: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(ours_tp2), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    sources = tp2_sources()
    assert set(got) == set(sources)
    for name, src in sources.items():
        assert_same(got[name], src, name)


def test_chunks_read_by_torch_load_with_crc(ours_tp2: Path) -> None:
    """Every chunk, cut out of its file by ``.metadata``'s offsets, is a valid zip torch loads."""
    import zipfile

    md = pickle.loads((ours_tp2 / ".metadata").read_bytes())
    for idx, info in md.storage_data.items():
        blob = (ours_tp2 / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None, idx
        t = torch.load(io.BytesIO(blob), weights_only=True)
        chunk = md.state_dict_metadata[idx.fqn].chunks[idx.index]
        assert tuple(t.shape) == tuple(chunk.sizes) and tuple(chunk.offsets) == tuple(idx.offset)


@pytest.mark.parametrize(
    "mesh,placements",
    [
        ([2], {"2d": ["S(1)"], "1d": ["R"]}),
        ([2, 2], {"2d": ["S(1)", "S(0)"], "1d": ["S(0)", "R"]}),
    ],
    ids=["tp2-S1", "2x2-S1S0"],
)
def test_gloo_load_into_other_placements(
    ours_tp2: Path, tmp_path: Path, mesh: list[int], placements: dict[str, list[str]]
) -> None:
    sources = tp2_sources()
    torch.save({n: as_tensor(s) for n, s in sources.items()}, tmp_path / "full.pt")
    spec: dict[str, Any] = {"mesh": mesh, "full": str(tmp_path / "full.pt"), "placements": {}}
    for name, src in sources.items():
        kind = "2d" if len(src.shape) == 2 else "1d"
        spec["placements"][name] = None if not src.shape else placements[kind]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_helper("load", str(ours_tp2), str(tmp_path / "spec.json"), str(tmp_path / "out"))
    world = int(np.prod(mesh))
    for rank in range(world):
        verdict = json.loads((tmp_path / "out" / f"load-{rank}.json").read_text())
        assert verdict["ok"], verdict
        assert verdict["checked"] == sorted(sources)
