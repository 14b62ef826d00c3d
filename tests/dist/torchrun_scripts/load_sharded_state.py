"""Run under ``torchrun --nproc-per-node 4``: load_dtensors of sharded-state directories.

``python -m torch.distributed.run --standalone --nproc-per-node 4 load_sharded_state.py VLLM RESHARD LAYOUT``

``VLLM`` holds ``model-rank-{r}-part-{p}.safetensors`` files as vLLM saves them (tp=4, the
layout :data:`load_world.LAYOUT_YAML`, no reshard.json); ``RESHARD`` is the same checkpoint
written by ``reshard convert --to sharded-state`` (with its reshard.json). Each rank loads

1. ``VLLM`` with ``source_layout=LAYOUT`` and ``layout=LAYOUT``,
2. ``RESHARD`` with no layout at all (its reshard.json's rules),

and compares every ``to_local()`` bit for bit with ``distribute_tensor``'s, and the
placements; without ``source_layout`` the vLLM files must raise a ReshardError.
Exits 1 (with the differences on stderr) when anything differs.
"""

from __future__ import annotations

import sys
from typing import Any


def _compare(loaded: dict[str, Any], mesh: Any, what: str) -> list[str]:
    from load_world import full_tensors, placements, same_bits  # the script's directory is on sys.path
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full_tensors()
    problems = []
    if sorted(loaded) != sorted(full):
        problems.append(f"{what}: names {list(loaded)}")
    for name, pls in placements().items():
        dt = loaded[name]
        want = distribute_tensor(full[name], mesh, pls, src_data_rank=None)
        if not isinstance(dt, DTensor) or tuple(dt.placements) != tuple(pls):
            problems.append(f"{what} {name}: {type(dt).__name__} {getattr(dt, 'placements', None)} != {pls}")
        elif dt.shape != full[name].shape or not same_bits(dt.to_local(), want.to_local()):
            problems.append(f"{what} {name}: local block differs from distribute_tensor's")
    return problems


def main(vllm: str, resharded: str, layout: str) -> int:
    import torch.distributed as dist
    from load_world import WORLD
    from torch.distributed.device_mesh import init_device_mesh

    from reshard import load_dtensors
    from reshard.errors import ReshardError

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    problems = _compare(load_dtensors(vllm, mesh, layout, source_layout=layout), mesh, "vllm")
    problems += _compare(load_dtensors(resharded, mesh), mesh, "reshard")
    from save_world import expect_error, finish  # the script's directory is on sys.path

    problems += expect_error(
        lambda: load_dtensors(vllm, mesh, layout),
        ReshardError,
        "--source-layout",
        "vLLM files loaded without a source layout",
    )

    return finish(problems)


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
