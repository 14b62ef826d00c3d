"""Write torch DCP (``.distcp``) checkpoints with torch itself, for the torch-free reader's tests.

Run as a script (``python save_dcp.py OUT``). Writes under OUT, each next to
``<name>.ref.pt``: the flattened full tensors torch saved (``{fqn: tensor}``,
DCP's own ``flatten_state_dict`` of the full state dict), the oracle.

Single process (``dcp.save(no_dist=True)``):

- ``plain/``: f32, bf16, f16, float8_e4m3fn, uint16, int64, bool, 0-d tensors
  and non-tensor items (``extra.lr``, ``extra.name``);
- ``zstd/``: the same through ``FileSystemWriter(_extensions=[ZStandard()])``;
- ``safetensors/``: the same through ``serialization_format=SAFETENSORS`` (the
  non-tensor items as zips, then one safetensors blob);
- ``transposed/``: ``x.t()`` and ``x.permute(2, 0, 1)`` views (saved with their strides);
- ``megatron/``: a Megatron-Core ``torch_dist``-shaped checkpoint crafted to
  the documented structure (``MCoreMetadata``, stacked ``[L, ...]`` and
  ``[L, E, ...]`` tensors whose chunk offsets have more dims than their sizes),
  each chunk a real ``torch.save`` archive.

A 4-rank gloo world on a ``(dp=2, tp=2)`` mesh:

- ``fsdp_tp/``: an FSDP2-over-TP model (``fully_shard`` over
  ``parallelize_module``) with AdamW state after one step, saved as
  ``{"model": ..., "optimizer": ...}`` from ``get_state_dict`` (``exp_avg``,
  ``exp_avg_sq``, 0-d ``step``, ``param_groups`` as non-tensor items), plus an
  uneven ``Shard(0)`` of 3 rows over 4 ranks (an empty chunk);
- ``rank_local/``: the same state saved with ``use_collectives=False``
  (one ``__{rank}.metadata`` per rank, no ``.metadata``).
"""

from __future__ import annotations

import io
import os
import sys
import traceback
from pathlib import Path
from typing import Any

WORLD = 4


def _flat_full(sd: dict[str, Any]) -> dict[str, Any]:
    """DCP's flattened FQNs -> full plain tensors (DTensors gathered)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(sd)
    out = {}
    for k, v in flat.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().clone().contiguous()
    return out


def plain_state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(6, 5, generator=g),
            "bf": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "h": torch.randn(2, 3, 4, generator=g).to(torch.float16),
            "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
            "u16": (torch.arange(11) * 5000).to(torch.uint16),
            "i64": torch.arange(4, dtype=torch.int64) - 2,
            "mask": torch.tensor([True, False, True]),
            "scale": torch.tensor(0.25),
        },
        "extra": {"lr": 0.1, "name": "run-1"},
    }


def single(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = plain_state()
    dcp.save(sd, checkpoint_id=str(out / "plain"), no_dist=True)
    torch.save(_flat_full(sd), out / "plain.ref.pt")
    if ZStandard.is_available():  # needs the zstandard or pyzstd module
        writer = FileSystemWriter(str(out / "zstd"), _extensions=[ZStandard()])
        dcp.save(sd, storage_writer=writer, no_dist=True)
        torch.save(_flat_full(sd), out / "zstd.ref.pt")
    dcp.save(  # non-tensor items as zips, then one safetensors blob of the tensors
        sd,
        storage_writer=FileSystemWriter(
            str(out / "safetensors"), serialization_format=SerializationFormat.SAFETENSORS
        ),
        no_dist=True,
    )
    torch.save(_flat_full(sd), out / "safetensors.ref.pt")
    g = torch.Generator().manual_seed(5)
    views = {
        "t": torch.randn(30, 70, generator=g).t(),  # strides (1, 70)
        "p": torch.randn(3, 40, 50, generator=g).to(torch.bfloat16).permute(2, 0, 1),
        "col": torch.randn(1, 6, generator=g).t(),  # (6, 1) with stride (1, 6): row-major anyway
    }
    dcp.save(views, checkpoint_id=str(out / "transposed"), no_dist=True)
    torch.save({k: v.contiguous() for k, v in views.items()}, out / "transposed.ref.pt")


# --------------------------------------------------------------------------- Megatron


def megatron(out: Path) -> None:
    """A ``torch_dist`` checkpoint as Megatron-Core writes it, crafted with torch's own classes."""
    import pickle
    import types

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    mod = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")

    class MCoreMetadata(Metadata):  # the class Megatron-Core <= 0.14 pickles
        mcore_data: dict[str, Any] = {}

    MCoreMetadata.__module__ = mod.__name__
    MCoreMetadata.__qualname__ = "MCoreMetadata"
    mod.MCoreMetadata = MCoreMetadata  # type: ignore[attr-defined]
    parts = mod.__name__.split(".")
    for i in range(1, len(parts)):  # pickle imports the module, so its parents must exist
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[mod.__name__] = mod

    L, E, TP = 2, 2, 2
    g = torch.Generator().manual_seed(3)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    full = {
        qkv: torch.randn(L, 6, 4, generator=g).to(torch.bfloat16),
        fc1: torch.randn(L, E, 4, 3, generator=g),
        "embedding.word_embeddings.weight": torch.randn(8, 4, generator=g),
    }
    # (fqn, offsets, sizes as stored in .metadata, the local tensor's shape in its archive)
    items: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for layer in range(L):
        for r in range(TP):  # checkpointable path: offsets rank 3, sizes rank 2
            items.append((qkv, (layer, 3 * r, 0), (3, 4)))
    for layer in range(L):
        for e in range(E):
            if e == 0:  # legacy path: (1,)*p + local shape
                items.append((fc1, (layer, e, 0, 0), (1, 1, 4, 3)))
            else:
                items.append((fc1, (layer, e, 0, 0), (4, 3)))
    items.append(("embedding.word_embeddings.weight", (0, 0), (8, 4)))
    storage: dict[Any, Any] = {}
    chunks: dict[str, list[Any]] = {k: [] for k in full}
    with open(out / "megatron" / "__0_0.distcp", "wb") as f:
        for i, (fqn, offs, sizes) in enumerate(items):
            t = full[fqn]
            sl = tuple(slice(o, o + s) for o, s in zip(offs[len(offs) - len(sizes) :], sizes, strict=True))
            lead = tuple(offs[: len(offs) - len(sizes)])
            local = t[lead][sl] if lead else t[sl]
            buf = io.BytesIO()
            torch.save(local.clone().reshape(sizes), buf)
            start = f.tell()
            f.write(buf.getvalue())
            chunks[fqn].append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
            storage[MetadataIndex(fqn, offs, i)] = _StorageInfo("__0_0.distcp", start, len(buf.getvalue()))
    sdm = {
        fqn: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.size(), chunks[fqn])
        for fqn, t in full.items()
    }
    md = MCoreMetadata(state_dict_metadata=sdm, storage_data=storage)  # type: ignore[arg-type]
    md.mcore_data = {k: {"nd_reformulated_orig_global_shape": None} for k in full}
    with open(out / "megatron" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    torch.save(full, out / "megatron.ref.pt")


# --------------------------------------------------------------------------- gloo world


def _model() -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(4, 8, bias=False)
            self.down = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down(torch.relu(self.up(x)))

    return Block()


def worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    root = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=WORLD)
    ok = False
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _model()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        g = torch.Generator().manual_seed(11)
        uneven = torch.randn(3, 2, generator=g)
        sd = {
            "model": msd,
            "optimizer": osd,
            "extra": {"uneven": distribute_tensor(uneven, mesh, [Shard(0), Shard(0)], src_data_rank=None)},
        }
        dcp.save(sd, checkpoint_id=str(root / "fsdp_tp"))
        dcp.save(sd, checkpoint_id=str(root / "rank_local"), use_collectives=False)
        ref = _flat_full(sd)
        if rank == 0:
            torch.save(ref, root / "fsdp_tp.ref.pt")
            torch.save(ref, root / "rank_local.ref.pt")
        ok = True
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        (root / f"ok-{rank}").write_text("1" if ok else "0")
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.multiprocessing as mp

    out = Path(argv[1]).resolve()
    (out / "megatron").mkdir(parents=True, exist_ok=True)
    single(out)
    megatron(out)
    mp.start_processes(worker, args=(str(out),), nprocs=WORLD, join=True, start_method="fork")
    return 0 if all((out / f"ok-{r}").read_text() == "1" for r in range(WORLD)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
