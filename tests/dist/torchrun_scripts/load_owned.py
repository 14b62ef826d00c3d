"""Run under ``torchrun --nproc-per-node 4``: load_dtensors of ``Own(...)`` layouts, checked against torch.

``python -m torch.distributed.run --standalone --nproc-per-node 4 load_owned.py MODEL EP4 LAYOUT1 LAYOUT2``

``MODEL`` is a consolidated ``model.safetensors`` of :func:`full_tensors`, ``EP4`` the per-rank
checkpoint ``reshard convert MODEL --target-layout LAYOUT1`` wrote, ``LAYOUT1``/``LAYOUT2`` the
YAMLs :data:`EP_YAML` and :data:`EP_FSDP_YAML`. Each rank checks that it gets exactly the tensors
it owns, bit for bit:

1. ``load_dtensors(MODEL, ep mesh of 4, LAYOUT1)`` and ``load_dtensors(EP4, same mesh)`` (the
   checkpoint's own rules): expert ``e`` of ``E`` (4 of w1, 8 of w2) only on rank ``e // (E/4)``,
   as the whole ``torch.Tensor`` (``Own`` on the only dim), w2 under its rank-local number
   (``Own(expert, local)``); the router a ``DTensor`` replicated as ``distribute_tensor`` gives it;
2. ``load_dtensors(MODEL, (ep=2, fsdp=2) mesh, LAYOUT2)``: owned experts as ``DTensor`` on
   ``mesh["fsdp"]``, ``to_local()`` equal to ``distribute_tensor(full, mesh["fsdp"], [Shard(d)])``'s;
3. LAYOUT2 on an unnamed (2, 2) DeviceMesh: a UsageError asking for mesh_dim_names.

Exits 1 (with the differences on stderr) when anything differs.
"""

from __future__ import annotations

import sys
from typing import Any

WORLD = 4

EP_YAML = r"""mesh: {ep: 4}
placements:
  're:layers\.\d+\.experts\.(?P<expert>\d+)\.w1\.weight': {ep: Own(expert)}
  're:layers\.\d+\.experts\.(?P<expert>\d+)\.w2\.weight': {ep: "Own(expert, local)"}
  "*": R
"""

EP_FSDP_YAML = r"""mesh: {ep: 2, fsdp: 2}
placements:
  're:layers\.\d+\.experts\.(?P<expert>\d+)\.w1\.weight': {ep: Own(expert), fsdp: S(0)}
  're:layers\.\d+\.experts\.(?P<expert>\d+)\.w2\.weight': {ep: "Own(expert, local)", fsdp: S(1)}
  "*": {fsdp: S(0)}
"""

W1, W2 = 4, 8  # experts of w1 and w2


def full_tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(11)
    out = {"layers.0.router.weight": torch.randn(5, 3, generator=g)}
    for e in range(W1):
        out[f"layers.0.experts.{e}.w1.weight"] = torch.randn(5, 3, generator=g)  # fsdp rows 3, 2
    for e in range(W2):
        out[f"layers.0.experts.{e}.w2.weight"] = torch.randn(3, 7, generator=g).to(torch.bfloat16)
    return out


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def owned(ep: int, size: int) -> dict[str, tuple[str, int]]:
    """Name this ep coordinate's tensors get -> (global name, tensor dim fsdp shards)."""
    out = {"layers.0.router.weight": ("layers.0.router.weight", 0)}
    for e in range(ep * W1 // size, (ep + 1) * W1 // size):
        out[f"layers.0.experts.{e}.w1.weight"] = (f"layers.0.experts.{e}.w1.weight", 0)
    per = W2 // size
    for e in range(ep * per, (ep + 1) * per):
        out[f"layers.0.experts.{e - ep * per}.w2.weight"] = (f"layers.0.experts.{e}.w2.weight", 1)
    return out


def check_ep(loaded: dict[str, Any], mesh: Any, rank: int, what: str) -> list[str]:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    full = full_tensors()
    want = owned(rank, WORLD)
    problems = [] if sorted(loaded) == sorted(want) else [f"{what}: names {sorted(loaded)} != {sorted(want)}"]
    for name, (source, _) in want.items():
        got = loaded.get(name)
        if name.endswith("router.weight"):
            ref = distribute_tensor(full[source], mesh, [Replicate()], src_data_rank=None)
            ok = isinstance(got, DTensor) and tuple(got.placements) == (Replicate(),)
            ok = ok and same_bits(got.to_local(), ref.to_local())
        else:  # owned on the only mesh dim: the whole tensor
            ok = got is not None and not isinstance(got, DTensor) and same_bits(got, full[source])
        if not ok:
            problems.append(f"{what}: {name} ({source}) is not the expected tensor: {type(got).__name__}")
    return problems


def check_ep_fsdp(loaded: dict[str, Any], mesh: Any) -> list[str]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = full_tensors()
    ep = int(mesh.get_coordinate()[0])
    sub = mesh["fsdp"]
    want = owned(ep, 2)
    problems = [] if sorted(loaded) == sorted(want) else [f"ep x fsdp: names {sorted(loaded)}"]
    for name, (source, dim) in want.items():
        got = loaded.get(name)
        # the router: "*": {fsdp: S(0)} on the whole mesh; an owned expert: its fsdp rule on mesh["fsdp"]
        on, pls = (mesh, [Replicate(), Shard(0)]) if name.endswith("router.weight") else (sub, [Shard(dim)])
        ref = distribute_tensor(full[source], on, pls, src_data_rank=None)
        ok = isinstance(got, DTensor) and got.device_mesh == on and tuple(got.placements) == tuple(pls)
        ok = ok and got.shape == full[source].shape and same_bits(got.to_local(), ref.to_local())
        if not ok:
            problems.append(f"ep x fsdp: {name} ({source}) differs from distribute_tensor on {on}")
    return problems


def main(model: str, ep4: str, layout1: str, layout2: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from reshard import load_dtensors
    from reshard.errors import UsageError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    problems: list[str] = []

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    problems += check_ep(load_dtensors(model, mesh, layout1), mesh, rank, "ep=4 from HF")
    problems += check_ep(load_dtensors(ep4, mesh), mesh, rank, "ep=4 from its rank files")

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "fsdp"))
    problems += check_ep_fsdp(load_dtensors(model, mesh2, layout2), mesh2)

    from save_world import expect_error, finish  # the script's directory is on sys.path

    unnamed = init_device_mesh("cpu", (2, 2))
    problems += expect_error(
        lambda: load_dtensors(model, unnamed, layout2),
        UsageError,
        "mesh_dim_names",
        "no error for Own on an unnamed DeviceMesh",
    )

    return finish(problems)


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(*sys.argv[1:5]))
