"""Worker for tests/dist/test_gloo.py, run under ``torchrun`` in a real gloo world on CPU.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/dist/gloo_worker.py save4 OUT
    python -m torch.distributed.run --standalone --nproc-per-node 8 \
        tests/dist/gloo_worker.py world8 OUT

Each rank builds the (deterministic) full tensors below, calls torch's own
``distribute_tensor(full, mesh, placements)`` and saves ``dt.to_local()`` into
``rank-{r:05d}-of-{W:05d}.safetensors``. The test process compares those files
with what ``reshard convert`` writes. Importing this module has no side effects
(pytest imports it for doctests); torch is imported only when run.
"""

from __future__ import annotations

import sys
from pathlib import Path

# name -> (shape, dtype name, seed); a seed of None means arange
TENSORS: dict[str, tuple[tuple[int, ...], str, int | None]] = {
    # case 1: tp=4 -> tp=8
    "s0_uneven": ((10, 3), "float32", 1),
    "s1_bf16": ((4, 6), "bfloat16", 2),
    "rep": ((5,), "int64", None),
    "few_rows": ((3, 2), "float32", 3),
    "fused": ((12, 2), "float32", 4),
    "scalar": ((), "float64", 5),
    # case 2: fsdp=2,tp=2 -> tp=4 and consolidated
    "w_fsdp_tp": ((10, 4), "float32", 6),
    "w_s0s1": ((5, 7), "bfloat16", 7),
    "w_even": ((8, 2), "int32", None),
    # case 3: (2, 2, 2) nested -> consolidated
    "n_nested": ((11, 6), "float32", 8),
    "n_strided": ((9, 4), "int64", None),
    "n_mixed": ((6, 13), "bfloat16", 9),
}

CASE1_MESH = {"tp": 4}
CASE1 = {
    "s0_uneven": ["S(0)"],
    "s1_bf16": ["S(1)"],
    "rep": ["R"],
    "few_rows": ["S(0)"],  # fewer rows than ranks: empty shards
    "fused": ["_S(0, 2)"],  # fused gate/up, uneven
    "scalar": ["R"],
}
CASE1_TARGET_MESH = {"tp": 8}

CASE2_MESH = {"fsdp": 2, "tp": 2}
CASE2 = {
    "w_fsdp_tp": ["_S(0, 2)", "S(0)"],  # FSDP over TP
    "w_s0s1": ["S(0)", "S(1)"],
    "w_even": ["S(0)", "R"],
}
CASE2_TARGET_MESH = {"tp": 4}
CASE2_TARGET = {
    "w_fsdp_tp": ["S(0)"],
    "w_s0s1": ["_S(1, 2)"],
    "w_even": ["S(1)"],
}

CASE3_MESH = {"a": 2, "b": 2, "c": 2}
CASE3 = {
    "n_nested": ["S(0)", "S(0)", "S(1)"],  # tensor dim 0 sharded by two mesh dims
    "n_strided": ["_S(0, 2)", "R", "S(0)"],
    "n_mixed": ["S(1)", "S(0)", "S(1)"],
}


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def full_tensor(name: str):  # type: ignore[no-untyped-def]
    import torch

    shape, dtype, seed = TENSORS[name]
    dt = getattr(torch, dtype)
    if seed is None:
        n = 1
        for s in shape:
            n *= s
        return torch.arange(n, dtype=dt).reshape(shape)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)


def torch_placements(texts: list[str]):  # type: ignore[no-untyped-def]
    """Text placements (as in the layout files) -> torch placement objects."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for t in texts:
        if t == "R":
            out.append(Replicate())
        elif t.startswith("_S("):
            d, sf = (int(x) for x in t[3:-1].split(","))
            out.append(_StridedShard(d, split_factor=sf))
        elif t.startswith("S("):
            out.append(Shard(int(t[2:-1])))
        else:
            raise ValueError(t)
    return out


def _distribute_and_save(mesh, specs: dict[str, list[str]], path: Path, prefix: list[str]) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    local = {}
    for name, texts in specs.items():
        pls = torch_placements(prefix + texts)
        # torch 2.13 refuses uneven _StridedShard scatters unless every rank splits locally
        src = None if any(isinstance(p, _StridedShard) for p in pls) else 0
        dt = distribute_tensor(full_tensor(name), mesh, pls, src_data_rank=src)
        local[name] = dt.to_local().contiguous()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(local, str(path))
    dist.barrier()


def main(argv: list[str]) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    phase, out = argv[0], Path(argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if phase == "save4":
            assert world == 4
            mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
            _distribute_and_save(mesh, CASE1, out / "case1" / "src" / rank_file(rank, 4), [])
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
            _distribute_and_save(mesh, CASE2, out / "case2" / "src" / rank_file(rank, 4), [])
        elif phase == "world8":
            assert world == 8
            mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
            _distribute_and_save(mesh, CASE1, out / "case1" / "expect_tp8" / rank_file(rank, 8), [])
            # the tp=4 target, replicated over an outer dim: ranks r and r + 4 hold tp rank r
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("rep", "tp"))
            path = out / "case2" / "expect_tp4" / rank_file(rank, 4) if rank < 4 else None
            _distribute_and_save(mesh, CASE2_TARGET, path, ["R"])
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
            _distribute_and_save(mesh, CASE3, out / "case3" / "src" / rank_file(rank, 8), [])
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
