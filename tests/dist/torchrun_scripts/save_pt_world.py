"""Run under ``torchrun --nproc-per-node 4``: per-rank ``torch.save`` files as veRL and others write them.

``python -m torch.distributed.run --standalone --nproc-per-node 4 save_pt_world.py OUT``

Writes, each in its own directory under ``OUT`` (and ``<dir>.safetensors``, by rank 0: every
tensor as torch holds it whole, ``full_tensor()`` of DTensors, the oracle):

- ``verl``: FSDP2 (``fully_shard`` on mesh ``("fsdp",)``) of a small model, veRL's file names:
  ``model_world_size_4_rank_{r}.pt`` (``model.state_dict()``: ``Shard(0)`` DTensors and a
  persistent buffer, a plain tensor), ``optim_world_size_4_rank_{r}.pt`` (after one Adam step),
  ``extra_state_world_size_4_rank_{r}.pt``;
- ``hsdp``: ``(Replicate(), Shard(0))`` on ``("ddp", "fsdp")``, ``rank_{r}.pt``;
- ``fsdp_tp``: FSDP2-over-TP placements on ``("dp", "tp")``: ``(_StridedShard(0, 2), Shard(0))``,
  ``(Shard(0), Shard(1))``, a DTensor on the ``mesh["tp"]`` sub-mesh, nested dicts and lists and
  non-tensor leaves, ``ckpt_{r}.pt``;
- ``accelerate``: accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` with
  ``use_dcp=False`` (FSDP2, ``SHARDED_STATE_DICT``): ``pytorch_model_fsdp_0_rank{r}.bin`` beside
  ``optimizer_0_rank{r}.bin`` (skipped without accelerate);
- ``plain``: ``torch.save`` of plain local tensors (``distribute_tensor(...).to_local()`` on a tp=4
  mesh, :data:`PLAIN_LAYOUT`), ``rank-{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

WORLD = 4

PLAIN_LAYOUT = """\
mesh: {tp: 4}
placements:
  "layers.*.wq": {tp: S(0)}
  "layers.*.wo": {tp: S(1)}
  "*": R
"""


def _full(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor leaf, whole (``full_tensor()`` of a DTensor), named as reshard names leaves."""
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    items = (
        state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
    )
    if items is None:
        if isinstance(state, DTensor):
            out[prefix] = state.full_tensor().contiguous()
        elif isinstance(state, Tensor):
            out[prefix] = state.contiguous()
        return out
    for k, v in items:
        out.update(_full(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _save(state: Any, out: Path, name: str, rank: int, file: str) -> None:
    import torch
    from safetensors.torch import save_file

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    torch.save(state, d / file)
    full = _full(state)  # collectives: every rank takes part
    if rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, str(out / f"{name}.safetensors"))


def _verl(out: Path, rank: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 5, bias=False))
    model.register_buffer("scale", torch.tensor([0.5]))  # a (1,) persistent buffer: replicated
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    _save(model.state_dict(), out, "verl", rank, f"model_world_size_{WORLD}_rank_{rank}.pt")
    torch.save(opt.state_dict(), out / "verl" / f"optim_world_size_{WORLD}_rank_{rank}.pt")
    torch.save(
        {"rng": torch.get_rng_state(), "step": 1},
        out / "verl" / f"extra_state_world_size_{WORLD}_rank_{rank}.pt",
    )


def _hsdp(out: Path, rank: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "fsdp"))
    g = torch.Generator().manual_seed(1)
    state = {
        "w": distribute_tensor(torch.randn(7, 3, generator=g), mesh, [Replicate(), Shard(0)]),
        "b": distribute_tensor(torch.randn(5, generator=g).to(torch.bfloat16), mesh, [Replicate(), Shard(0)]),
    }
    _save(state, out, "hsdp", rank, f"rank_{rank}.pt")


def _fsdp_tp(out: Path, rank: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(12, 4, generator=g).to(torch.float16)
    state = {
        "model": {
            "layers": [
                {
                    "gate_up": distribute_tensor(
                        gate_up, mesh, [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None
                    ),
                    "wo": distribute_tensor(
                        torch.randn(6, 8, generator=g), mesh, [Shard(0), Shard(1)], src_data_rank=None
                    ),
                    "tp_only": distribute_tensor(
                        torch.arange(10, dtype=torch.int64), mesh["tp"], [Shard(0)], src_data_rank=None
                    ),
                }
            ],
        },
        "step": 3,
        "name": "llama",
    }
    _save(state, out, "fsdp_tp", rank, f"ckpt_{rank}.pt")


def _accelerate(out: Path, rank: int) -> None:
    """What ``Accelerator.save_state`` writes for FSDP2 with ``SHARDED_STATE_DICT`` and
    ``use_dcp=False``, by accelerate's own functions (its plugin and accelerator stood in for)."""
    import logging
    from types import SimpleNamespace

    try:
        import accelerate.utils.fsdp_utils as fu
    except ImportError:
        return
    import torch
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import StateDictType, fully_shard

    fu.logger = logging.getLogger("accelerate-stand-in")  # its own logger needs an Accelerator
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 7), torch.nn.LayerNorm(7))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.arange(4)).sum().backward()
    opt.step()
    plugin = SimpleNamespace(
        fsdp_version=2,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        state_dict_config=SimpleNamespace(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=None,
    )
    acc = SimpleNamespace(process_index=rank, num_processes=WORLD, is_main_process=rank == 0)
    d = out / "accelerate"
    fu.save_fsdp_model(plugin, acc, model, str(d), use_dcp=False)
    fu.save_fsdp_optimizer(plugin, acc, opt, model, str(d), use_dcp=False)
    full = _full(model.state_dict())  # collectives: every rank takes part
    if rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, str(out / "accelerate.safetensors"))


def _plain(out: Path, rank: int) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(3)
    full = {
        "layers.0.wq": torch.randn(10, 3, generator=g),
        "layers.0.wo": torch.randn(3, 8, generator=g).to(torch.bfloat16),
        "norm": torch.ones(3),
    }
    pls = {"layers.0.wq": [Shard(0)], "layers.0.wo": [Shard(1)], "norm": [Replicate()]}
    local = {
        n: distribute_tensor(t, mesh, pls[n], src_data_rank=None).to_local().contiguous()
        for n, t in full.items()
    }
    state = {"layers": [{"wq": local["layers.0.wq"], "wo": local["layers.0.wo"]}], "norm": local["norm"]}
    d = out / "plain"
    d.mkdir(parents=True, exist_ok=True)
    torch.save(state, d / f"rank-{rank}.pt")
    if rank == 0:
        save_file(full, str(out / "plain.safetensors"))
        (out / "plain.yaml").write_text(PLAIN_LAYOUT)


def main(out: Path) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in (_verl, _hsdp, _fsdp_tp, _accelerate, _plain):
        case(out, rank)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(Path(sys.argv[1])))
