"""Gloo worlds for tests/dist/test_dcp_objects.py: a training state saved by FSDP2 on 2 ranks,
loaded, strictly, by FSDP2 on 4.

``python optim_world.py save OUT``: 2 CPU ranks, FSDP2 over a small MLP, AdamW with
hyper-parameters other than the defaults, one step; ``dcp.save`` of
``{"model", "optimizer", "train"}`` (``get_state_dict``: ``param_groups`` and ``train``'s
int and str are non-tensor ``BYTE_IO`` items) into ``OUT/plain`` and, zstd-compressed,
``OUT/zstd``. Rank 0 writes the full tensors and the hyper-parameters to ``OUT/ref.pt``.

``python optim_world.py load CKPT REF OUT``: 4 CPU ranks build the model and optimizer afresh
(another seed, other hyper-parameters), ``dcp.load`` CKPT into their state dict with the
default planner (strict: every key of the state dict must be in the checkpoint), set it,
and compare the full parameters, optimizer states and hyper-parameters with ``REF``;
verdicts go to ``OUT/load-{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

HYPER = {"lr": 0.0123, "betas": (0.8, 0.95), "weight_decay": 0.03, "eps": 1e-7}


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(sd)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items() if hasattr(v, "shape")
    }


def _world(rank: int, world: int, root: Path, job: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=world)
    ok = False
    try:
        job(rank)
        ok = True
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        (root / f"ok-{rank}").write_text("1" if ok else "0")
        dist.destroy_process_group()


def save(rank: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(out)

    def job(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model = _model(0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        torch.manual_seed(1)
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd, "train": {"step": 7, "tag": "run-a"}}
        dcp.save(sd, checkpoint_id=str(root / "plain"))
        if ZStandard.is_available():
            dcp.save(sd, storage_writer=FileSystemWriter(str(root / "zstd"), _extensions=[ZStandard()]))
        full = _full(sd)
        if rank == 0:
            torch.save(full, root / "ref.pt")

    _world(rank, 2, root, job)


def load(rank: int, ckpt: str, ref_path: str, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(out)

    def job(rank: int) -> None:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        model = _model(5)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        msd, osd = get_state_dict(model, opt)  # (makes the optimizer's state)
        sd = {"model": msd, "optimizer": osd, "train": {"step": 0, "tag": ""}}
        dcp.load(sd, checkpoint_id=ckpt)  # the default planner: strict
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        ref = torch.load(ref_path, weights_only=True)
        got = _full(dict(zip(("model", "optimizer"), get_state_dict(model, opt))))
        bad = sorted(
            k
            for k, v in ref.items()
            if k.startswith(("model.", "optimizer."))
            and not (
                k in got
                and got[k].dtype == v.dtype
                and torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
            )
        )
        group = opt.param_groups[0]
        verdict = {
            "tensors": len(ref),
            "bad": bad,
            "hyper": {k: (list(group[k]) if k == "betas" else group[k]) for k in HYPER},
            "train": sd["train"],
        }
        (root / f"load-{rank}.json").write_text(json.dumps(verdict))

    _world(rank, 4, root, job)


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.multiprocessing as mp

    if argv[1] == "save":
        out = Path(argv[2]).resolve()
        out.mkdir(parents=True, exist_ok=True)
        mp.start_processes(save, args=(str(out),), nprocs=2, join=True, start_method="fork")
        world = 2
    else:
        out = Path(argv[4]).resolve()
        out.mkdir(parents=True, exist_ok=True)
        mp.start_processes(load, args=(argv[2], argv[3], str(out)), nprocs=4, join=True, start_method="fork")
        world = 4
    return 0 if all((out / f"ok-{r}").read_text() == "1" for r in range(world)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
