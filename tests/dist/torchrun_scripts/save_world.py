"""Run under ``torchrun --nproc-per-node 4``: DTensors on a (fsdp=2, tp=2) mesh -> save_dtensors.

``python -m torch.distributed.run --standalone --nproc-per-node 4 save_world.py OUT``

Every rank builds the same full tensors (:func:`full_tensors`, fixed seed), distributes
them with ``distribute_tensor(..., src_data_rank=None)`` (each rank keeps its own
slice, no communication) and calls :func:`reshard.save_dtensors` into ``OUT/ckpt``.
The state dict also holds a Partial DTensor (rank fsdp=0 holds the value, fsdp=1
zeros, so the sum is exact), a DTensor on the 1-D ``fsdp`` sub-mesh (as FSDP2 leaves
non-TP parameters) and a plain tensor. The ranks then load the checkpoint back with
:func:`reshard.load_dtensors` (:func:`check_round_trip`; exit 1 on a difference). The
parent test checks the directory with ``reshard inspect --check`` and consolidates it
against :func:`full_tensors`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

WORLD = 4
MESH_SHAPE = (2, 2)
MESH_NAMES = ("fsdp", "tp")


def full_tensors() -> dict[str, Any]:
    """The logical tensors (identical on every rank and in the parent)."""
    import torch

    g = torch.Generator().manual_seed(2024)
    return {
        "a.uneven_s0": torch.randn(7, 3, generator=g),  # [S(0), R]: fsdp rows 4 + 3
        "a.nested_s0": torch.randn(5, 2, generator=g),  # [S(0), S(0)]: rows 2,1 | 1,1
        "b.s1": torch.randn(4, 5, generator=g).to(torch.bfloat16),  # [R, S(1)]: cols 3 + 2
        "c.rep": torch.randn(3, 5, generator=g).to(torch.float16),  # [R, R]
        "d.fsdp_tp": torch.randn(8, 4, generator=g),  # [_S(0, 2), S(0)]: FSDP2 over TP
        "e.2d_int": torch.arange(30, dtype=torch.int64).reshape(6, 5) * 7 - 3,  # [S(0), S(1)]
        "f.bool": torch.tensor([True, False, True, True, False]),  # [R, S(0)]: 3 + 2
        "g.partial": torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5,  # [P(sum), S(1)]
        "h.fsdp_only": torch.randn(6, 2, generator=g),  # on mesh["fsdp"]: S(0)
        "step": torch.tensor(41.0, dtype=torch.float64),  # a plain tensor: R
    }


def placements() -> dict[str, list[Any]]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "a.uneven_s0": [Shard(0), Replicate()],
        "a.nested_s0": [Shard(0), Shard(0)],
        "b.s1": [Replicate(), Shard(1)],
        "c.rep": [Replicate(), Replicate()],
        "d.fsdp_tp": [_StridedShard(0, split_factor=2), Shard(0)],
        "e.2d_int": [Shard(0), Shard(1)],
        "f.bool": [Replicate(), Shard(0)],
        "g.partial": [Partial("sum"), Shard(1)],
    }


# what reshard records for each tensor (str forms of its placements on the fsdp x tp mesh)
SAVED_PLACEMENTS = {
    "a.uneven_s0": ["S(0)", "R"],
    "a.nested_s0": ["S(0)", "S(0)"],
    "b.s1": ["R", "S(1)"],
    "c.rep": ["R", "R"],
    "d.fsdp_tp": ["_S(0, 2)", "S(0)"],
    "e.2d_int": ["S(0)", "S(1)"],
    "f.bool": ["R", "S(0)"],
    "g.partial": ["P(sum)", "S(1)"],
    "h.fsdp_only": ["S(0)", "R"],  # saved from the fsdp sub-mesh
    "step": ["R", "R"],  # a plain tensor
}


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    def bits(t: Any) -> Any:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bool(torch.equal(bits(a), bits(b)))


def check_round_trip(ckpt: Path, mesh: Any, state: dict[str, Any]) -> list[str]:
    """load_dtensors of the saved checkpoint gives back each rank's tensors; Partial is reduced."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard import load_dtensors
    from reshard.config import LayoutConfig
    from reshard.errors import ReshardError

    full = full_tensors()
    rules = [[n, ["R", "S(1)"] if n == "g.partial" else t] for n, t in SAVED_PLACEMENTS.items()]
    cfg = LayoutConfig.from_json({"mesh": {"names": list(MESH_NAMES), "shape": list(MESH_SHAPE)},
                                  "rules": rules})
    loaded = load_dtensors(ckpt, mesh, cfg)
    want = {name: t.to_local() for name, t in state.items()
            if name not in ("g.partial", "h.fsdp_only", "step")}
    want["step"] = full["step"]
    want["g.partial"] = distribute_tensor(full["g.partial"], mesh, [Replicate(), Shard(1)],
                                          src_data_rank=None).to_local()
    want["h.fsdp_only"] = distribute_tensor(full["h.fsdp_only"], mesh, [Shard(0), Replicate()],
                                            src_data_rank=None).to_local()
    problems = [f"{name}: loaded local differs" for name, w in want.items()
                if not _same_bits(loaded[name].to_local(), w)]
    for name, t in state.items():
        if name not in ("g.partial", "h.fsdp_only", "step") and loaded[name].placements != t.placements:
            problems.append(f"{name}: placements {loaded[name].placements} != {t.placements}")
    try:  # the checkpoint's own rules place g.partial as P(sum): refused as a target
        load_dtensors(ckpt, mesh)
        problems.append("layout=None loaded a Partial target")
    except ReshardError as e:
        if "P(sum)" not in e.message or "g.partial" not in e.message:
            problems.append(f"unclear error: {e.message}")
    return problems


def main(out: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from reshard import save_dtensors

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    full = full_tensors()
    state: dict[str, Any] = {}
    for name, pls in placements().items():
        if name == "g.partial":
            # Partial cannot be distributed; build it: fsdp=0 holds the value, fsdp=1 zeros
            col = distribute_tensor(full[name], mesh["tp"], [Shard(1)], src_data_rank=None).to_local()
            local = col if mesh.get_coordinate()[0] == 0 else torch.zeros_like(col)
            state[name] = DTensor.from_local(local, mesh, pls, run_check=False,
                                             shape=full[name].shape, stride=full[name].stride())
        else:
            state[name] = distribute_tensor(full[name], mesh, pls, src_data_rank=None)
    state["h.fsdp_only"] = distribute_tensor(full["h.fsdp_only"], mesh["fsdp"], [Shard(0)],
                                             src_data_rank=None)
    state["step"] = full["step"]
    save_dtensors(state, out / "ckpt")
    problems = check_round_trip(out / "ckpt", mesh, state)
    return finish(problems)


def expect_error(call: Any, error: type[BaseException], words: str, absent: str) -> list[str]:
    """``call()`` must raise ``error`` with ``words`` in its message: the problems found
    (``absent`` when it raises nothing)."""
    try:
        call()
    except error as e:
        message = getattr(e, "message", str(e))
        return [] if words in message else [f"unclear error: {message}"]
    return [absent]


def finish(problems: list[str]) -> int:
    """Report this rank's problems on stderr, leave the process group; the exit code (1 if any)."""
    import torch.distributed as dist

    for p in problems:
        sys.stderr.write(f"rank {dist.get_rank()}: {p}\n")
    dist.destroy_process_group()
    return 1 if problems else 0


def hard_exit(code: int) -> None:
    """Flush and leave without interpreter teardown: a torchrun worker that used gloo
    sometimes aborts in C++ static destruction after its work is done ("terminate called
    without an active exception", exit -6; torch 2.13, even after destroy_process_group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    hard_exit(main(Path(sys.argv[1])))
