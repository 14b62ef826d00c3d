"""Gloo worlds for tests/dist/test_dcp_write_bytes.py: torch's own dcp.save, and dcp.load of our files.

``python dcp_write_world.py save OUT``: 4 CPU ranks on a ``(dp=2, tp=2)`` mesh save
the DTensors of :func:`cases` with ``dcp.save`` (default ``FileSystemWriter``) into
``OUT/ckpt``. Each rank records, per tensor, torch's
``compute_local_shape_and_global_offset`` in ``OUT/boxes-{rank}.json``; rank 0
saves the full tensors to ``OUT/full.pt``.

``python dcp_write_world.py load CKPT SPEC OUT``: ``SPEC`` (json) gives a mesh shape,
per tensor the placements to load into, and the path of the full tensors. Each
rank builds zero DTensors with those placements, ``dcp.load``s ``CKPT`` into them,
and compares its local shard bit for bit with ``distribute_tensor(full)``'s; the
verdicts go to ``OUT/load-{rank}.json``.

Run as a subprocess of the tests, so the forked ranks start from a plain interpreter.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

SAVE_MESH = (2, 2)
SAVE_NAMES = ("dp", "tp")

# fqn -> (shape, torch dtype name, placements on the (dp, tp) mesh; None = plain tensor)
CASES: dict[str, tuple[tuple[int, ...], str, list[str] | None]] = {
    "a.s0": ((6, 4), "float32", ["R", "S(0)"]),
    "b.fsdp_tp": ((8, 4), "bfloat16", ["_S(0,2)", "S(0)"]),
    "c.rs1": ((4, 6), "float16", ["R", "S(1)"]),
    "d.rep": ((3, 5), "float32", ["R", "R"]),
    "e.empty": ((3, 2), "int64", ["S(0)", "S(0)"]),
    "f.s0s1": ((5, 7), "float32", ["S(0)", "S(1)"]),
    "g.scalar": ((), "float64", ["R", "R"]),
    "h.plain": ((3,), "int32", None),
    "i.f8": ((4, 4), "float8_e4m3fn", ["S(0)", "R"]),
    "j.u16": ((4,), "uint16", ["R", "S(0)"]),
    "k.bool": ((2, 3), "bool", ["S(1)", "R"]),
}


def parse(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    text = text.replace(" ", "")
    if text == "R":
        return Replicate()
    if text.startswith("_S("):
        dim, sf = text[3:-1].split(",")
        return _StridedShard(int(dim), split_factor=int(sf))
    return Shard(int(text[2:-1]))


def full_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    """Random bytes reinterpreted as ``dtype`` (0/1 for bool), the same on every rank."""
    import torch

    dt = getattr(torch, dtype)
    t = torch.empty(shape, dtype=dt)
    n = t.numel() * t.element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2 if dtype == "bool" else 256, (n,), dtype=torch.uint8, generator=g)
    if n:
        t.reshape(-1).view(torch.uint8).copy_(raw)
    return t


def save_worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    root = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rdv'}", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", SAVE_MESH, mesh_dim_names=SAVE_NAMES)
        full = {k: full_tensor(shape, dt, i) for i, (k, (shape, dt, _)) in enumerate(CASES.items())}
        sd: dict[str, Any] = {}
        boxes: dict[str, Any] = {}
        for name, (shape, _, pls) in CASES.items():
            if pls is None:
                sd[name] = full[name].clone()
                continue
            placements = [parse(p) for p in pls]
            sd[name] = distribute_tensor(full[name], mesh, placements, src_data_rank=None)
            local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            boxes[name] = {"shape": list(local), "offset": list(offset)}
        if rank == 0:
            torch.save(full, root / "full.pt")
        dcp.save(sd, checkpoint_id=str(root / "ckpt"))
        (root / f"boxes-{rank}.json").write_text(json.dumps(boxes))
    finally:
        dist.destroy_process_group()


def load_worker(rank: int, ckpt: str, spec_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    spec = json.loads(Path(spec_path).read_text())
    world = 1
    for s in spec["mesh"]:
        world *= s
    root = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rdv'}", rank=rank, world_size=world)
    verdict: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        mesh = init_device_mesh("cpu", tuple(spec["mesh"]))
        full = torch.load(spec["full"], weights_only=True)
        sd: dict[str, Any] = {}
        for name, pls in spec["placements"].items():
            zeros = torch.zeros_like(full[name])
            sd[name] = (
                zeros
                if pls is None
                else distribute_tensor(zeros, mesh, [parse(p) for p in pls], src_data_rank=None)
            )
        dcp.load(sd, checkpoint_id=ckpt)
        bad = []
        for name, pls in spec["placements"].items():
            got = sd[name].to_local() if isinstance(sd[name], DTensor) else sd[name]
            want = full[name]
            if pls is not None:  # src_data_rank=None: shard locally (gloo cannot scatter f8/u16)
                want = distribute_tensor(want, mesh, [parse(p) for p in pls], src_data_rank=None)
            want = want.to_local() if isinstance(want, DTensor) else want
            same = got.dtype == want.dtype and got.shape == want.shape
            if same and got.numel():
                same = torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
            if not same:
                bad.append(name)
        verdict.update(ok=not bad, bad=bad, checked=sorted(spec["placements"]))
    except BaseException:
        verdict["error"] = traceback.format_exc()
        raise
    finally:
        (root / f"load-{rank}.json").write_text(json.dumps(verdict))
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.multiprocessing as mp

    if argv[1] == "save":
        out = Path(argv[2]).resolve()
        out.mkdir(parents=True, exist_ok=True)
        mp.start_processes(save_worker, args=(str(out),), nprocs=4, join=True, start_method="fork")
        return 0
    ckpt, spec, out_dir = argv[2], argv[3], Path(argv[4]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    world = 1
    for s in json.loads(Path(spec).read_text())["mesh"]:
        world *= s
    args = (ckpt, spec, str(out_dir))
    mp.start_processes(load_worker, args=args, nprocs=world, join=True, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
