"""Run under ``torchrun --nproc-per-node 4``: load_dtensors of a pt checkpoint (``save_pt_world``'s
``fsdp_tp``) with no layout: each DTensor comes back with the placements it was saved with.

``python -m torch.distributed.run --standalone --nproc-per-node 4 load_pt.py CKPT ORACLE``

Each rank compares every ``to_local()`` bit for bit with ``distribute_tensor`` of the oracle's
full tensor (``ORACLE``: ``full_tensor()`` as torch saved it) on a ``("dp", "tp")`` mesh, and the
placements. Exits 1 (with the differences on stderr) when anything differs.
"""

from __future__ import annotations

import sys


def main(ckpt: str, oracle: str) -> int:
    import torch.distributed as dist
    from load_world import same_bits
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from reshard import load_dtensors

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = load_file(oracle)
    want_pls = {
        "model.layers.0.gate_up": (_StridedShard(0, split_factor=2), Shard(0)),
        "model.layers.0.wo": (Shard(0), Shard(1)),
        "model.layers.0.tp_only": (Replicate(), Shard(0)),
    }
    problems = []
    loaded = load_dtensors(ckpt, mesh)
    if sorted(loaded) != sorted(full):
        problems.append(f"names {sorted(loaded)}")
    for name, pls in want_pls.items():
        dt = loaded[name]
        want = distribute_tensor(full[name], mesh, list(pls), src_data_rank=None)
        if not isinstance(dt, DTensor) or tuple(dt.placements) != pls:
            problems.append(f"{name}: placements {getattr(dt, 'placements', None)} != {pls}")
        elif not same_bits(dt.to_local(), want.to_local()):
            problems.append(f"{name}: local block differs from distribute_tensor's")
    from save_world import finish  # the script's directory is on sys.path

    return finish(problems)


if __name__ == "__main__":
    from save_world import hard_exit  # the script's directory is on sys.path

    hard_exit(main(sys.argv[1], sys.argv[2]))
