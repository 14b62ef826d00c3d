"""Run under ``torchrun --nproc-per-node 4``: load_dtensors onto a tp=4 mesh, checked against torch.

``python -m torch.distributed.run --standalone --nproc-per-node 4 load_world.py MODEL LAYOUT OUT``

``MODEL`` is a consolidated ``model.safetensors`` of :func:`full_tensors` and ``LAYOUT``
the YAML :data:`LAYOUT_YAML`. Each rank:

1. ``load_dtensors(MODEL, mesh, LAYOUT)`` and compares every ``to_local()`` bit for bit
   with ``distribute_tensor(full, mesh, PLACEMENTS[name], src_data_rank=None).to_local()``,
   and the DTensor's shape, stride, dtype and placements;
2. ``load_dtensors(MODEL, mesh)`` (no layout: everything replicated) against the full tensors;
3. ``save_dtensors`` of the loaded DTensors into ``OUT/saved`` (the parent compares the
   files with ``reshard convert MODEL --target-layout LAYOUT``'s);
4. a Partial target placement and an unknown tensor pattern raise ReshardError on every rank.

Exits 1 (with the differences on stderr) when anything differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

WORLD = 4

LAYOUT_YAML = """\
mesh: {tp: 4}
placements:
  "w.s0": {tp: S(0)}
  "w.s1": [S(1)]
  "w.strided*": {tp: "_S(0, 2)"}
  "w.bool": S(0)
  "w.fp8": {tp: S(-1)}
  "*": R
"""


def full_tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return {
        "w.s0": torch.randn(10, 3, generator=g),  # 3,3,3,1
        "w.s1": torch.randn(4, 6, generator=g).to(torch.bfloat16),  # cols 2,2,2,0
        "w.strided": torch.randn(16, 2, generator=g),  # fused gate/up
        "w.strided_uneven": torch.randn(10, 3, generator=g).to(torch.float16),
        "w.bool": torch.tensor([True, False, False, True, True, False, True]),  # 2,2,2,1
        "w.fp8": (torch.randn(3, 9, generator=g) * 4).to(torch.float8_e4m3fn),  # cols 3,3,3,0
        "w.rep": torch.arange(5, dtype=torch.int64) - 2,
        "scalar": torch.tensor(0.25, dtype=torch.float64),
    }


def placements() -> dict[str, list[Any]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "w.s0": [Shard(0)],
        "w.s1": [Shard(1)],
        "w.strided": [_StridedShard(0, split_factor=2)],
        "w.strided_uneven": [_StridedShard(0, split_factor=2)],
        "w.bool": [Shard(0)],
        "w.fp8": [Shard(1)],
        "w.rep": [Replicate()],
        "scalar": [Replicate()],
    }


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def main(model: str, layout: str, out: Path) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from reshard import load_dtensors, save_dtensors
    from reshard.config import parse_layout_text
    from reshard.errors import ReshardError

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    full = full_tensors()
    problems: list[str] = []

    loaded = load_dtensors(model, mesh, layout)
    if list(loaded) != sorted(full):
        problems.append(f"names {list(loaded)}")
    for name, pls in placements().items():
        dt = loaded[name]
        want = distribute_tensor(full[name], mesh, pls, src_data_rank=None)
        if not isinstance(dt, DTensor):
            problems.append(f"{name}: not a DTensor")
            continue
        if tuple(dt.placements) != tuple(pls):
            problems.append(f"{name}: placements {dt.placements} != {pls}")
        if dt.shape != full[name].shape or dt.stride() != full[name].stride() or dt.dtype != full[name].dtype:
            problems.append(f"{name}: {dt.shape} {dt.stride()} {dt.dtype}")
        if not same_bits(dt.to_local(), want.to_local()):
            problems.append(f"{name}: local {tuple(dt.to_local().shape)} differs from distribute_tensor's "
                            f"{tuple(want.to_local().shape)}")

    replicated = load_dtensors(model, mesh)
    for name, t in full.items():
        dt = replicated[name]
        if tuple(dt.placements) != (Replicate(),) or not same_bits(dt.to_local(), t):
            problems.append(f"{name}: layout=None is not the full tensor, replicated")

    save_dtensors(loaded, out / "saved")

    for bad in ('mesh: {tp: 4}\nplacements:\n  "*": P(sum)\n', 'mesh: {tp: 4}\nplacements:\n  "w.s0": R\n'):
        try:
            load_dtensors(model, mesh, parse_layout_text(bad, "bad.yaml"))
        except ReshardError as e:
            if "P(sum)" not in e.message and "matches no rule" not in e.message:
                problems.append(f"unclear error: {e.message}")
        else:
            problems.append(f"no error for layout {bad!r}")

    from save_world import finish  # the script's directory is on sys.path

    return finish(problems)


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
