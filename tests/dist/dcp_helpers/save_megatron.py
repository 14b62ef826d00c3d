"""Write Megatron-Core ``torch_dist`` checkpoints with Megatron-Core itself, in a 4-rank gloo world.

Run as a script (``python save_megatron.py OUT``); needs ``megatron-core`` (0.16). The ranks
form a ``tp=2 x dp=2`` grid (tp = rank % 2). Their sharded state dicts are made by Megatron's
own helpers, as its models make them (``make_sharded_tensors_for_checkpoint`` with the TP
axis map and the layer's prepended offset, ``apply_swiglu_sharded_factory`` for SwiGLU
``linear_fc1``), plus what its models and distributed optimizer build by hand:

- ``decoder.layers.*``: 2 layers stacked on a prepended axis ``[L, ...]`` (QKV and fc1
  column-parallel, proj and fc2 row-parallel, layer norms replicated over TP and DP),
  ``linear_fc1`` in SwiGLU's ``[gate; up]`` layout (two boxes per rank);
- ``decoder.layers.mlp.experts.experts.linear_fc1.weight``: ``[L, E, 2F, H]`` (two
  prepended axes), 4 experts over EP=2 (the dp axis), replicated over TP; bf16;
- ``embedding.word_embeddings.weight`` (bf16, vocab-parallel) and ``output_layer.weight``;
- ``optimizer.distributed.dp_group_idx_{tp}.gbuf_idx_0.dtype_(torch.float32, torch.float32)
  .bucket_idx_0.{param,exp_avg}``: the distributed optimizer's ``dp_reshardable`` state
  (1-D buckets, one irregular ShardedTensor per parameter span and per padding span,
  several per rank: its ``CheckpointableShardedTensor`` / ``LocalShardsContainer`` path);
- ``uneven``: an irregular grid with an empty last chunk;
- ShardedObjects (``..._extra_state``, ``per_bucket_numel``) as DCP byte items, and
  common state (``iteration``, ``args``) in ``common.pt``.

Saved four ways, each into OUT/<name>/ next to ``<name>.mcore.pt``, the tensors
``dist_checkpointing.load_plain_tensors`` (Megatron's own load) gives back:

- ``plain``: ``dist_checkpointing.save`` with its default ``torch_dist`` strategy;
- ``hint``: ``TorchDistSaveShardedStrategy(separation_hint="decoder.layers.mlp")``: the
  hinted tensors in ``decoder.layers.mlp__{r}_{k}.distcp`` files;
- ``fully_parallel``: ``FullyParallelSaveStrategyWrapper`` (the save spread over replicas);
- ``async``: ``save(..., async_sharded_save=True)`` and the returned request's
  ``execute_sync()`` (the async writer's path, run in the rank).

``full.pt`` holds the full tensors the ranks were cut from (the SwiGLU and optimizer ones as
Megatron lays them out on disk). Megatron's saver is written for CUDA: on a CPU-only torch
``torch.cuda.synchronize`` (after host copies) becomes a no-op and ``torch.cuda.current_device``
gives ``"cpu"`` (the device of its one-element failure flag). Its writer hands results back
through a spawn-context ``Manager`` queue meant for its async process; the saves here run in
the rank, so a plain queue carries the same results (a spawned manager costs each rank a
second torch import).
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import sys
import traceback
from pathlib import Path
from typing import Any

WORLD = 4
TP = 2
L, H, F, E, V = 2, 8, 6, 4, 16
MODES = ("plain", "hint", "fully_parallel", "async")
BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
# the optimizer bucket: parameter spans (start, end) over the DP-sharded buffer, padded to 2 x 14
SPANS = ((0, 5), (6, 11), (14, 20), (20, 25))
UNPADDED, PADDED = 25, 28
UNEVEN_ROWS = ((0, 1), (1, 3), (3, 7), (7, 7))


def full_tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {
        "embedding.word_embeddings.weight": torch.randn(V, H, generator=g).to(torch.bfloat16),
        "output_layer.weight": torch.randn(V, H, generator=g),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(L, 12, H, generator=g),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(L, H, generator=g),
        "decoder.layers.self_attention.linear_proj.weight": torch.randn(L, H, H, generator=g),
        # [gate_0; gate_1; up_0; up_1] (tp=2): Megatron's on-disk SwiGLU layout
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(L, 2 * F, H, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(L, H, F, generator=g),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": torch.randn(L, E, 2 * F, H, generator=g).to(
            torch.bfloat16
        ),
        "uneven": torch.randn(7, 3, generator=g),
    }
    for tp in range(TP):
        for s in ("param", "exp_avg"):
            out[f"{BUCKET.format(tp)}.{s}"] = torch.randn(UNPADDED, generator=g)
    return out


def _layer_local(full: dict[str, Any], layer: int, tp: int) -> dict[str, Any]:
    """Layer ``layer``'s module state dict on TP rank ``tp`` (keys relative to ``decoder.layers.``)."""
    import torch

    p = "decoder.layers."
    fc1 = full[p + "mlp.linear_fc1.weight"][layer]
    gate, up = fc1.chunk(2, 0)  # the rank's fc1 holds [gate_tp; up_tp]
    return {
        "self_attention.linear_qkv.weight": full[p + "self_attention.linear_qkv.weight"][layer].chunk(TP, 0)[tp],
        "self_attention.linear_qkv.layer_norm_weight": full[p + "self_attention.linear_qkv.layer_norm_weight"][
            layer
        ],
        "self_attention.linear_proj.weight": full[p + "self_attention.linear_proj.weight"][layer].chunk(TP, 1)[tp],
        "mlp.linear_fc1.weight": torch.cat([gate.chunk(TP, 0)[tp], up.chunk(TP, 0)[tp]]),
        "mlp.linear_fc2.weight": full[p + "mlp.linear_fc2.weight"][layer].chunk(TP, 1)[tp],
        "self_attention.core_attention._extra_state": io.BytesIO(b"te-extra-state-%d" % layer),
    }


def sharded_state_dict(rank: int, tp_group: Any, dp_group: Any) -> dict[str, Any]:
    import torch
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    tp, dp = rank % TP, rank // TP
    full = full_tensors()
    groups = {"tp_group": tp_group, "dp_cp_group": dp_group}
    sd: dict[str, Any] = {}
    axis_map = {
        "self_attention.linear_qkv.weight": 0,
        "self_attention.linear_proj.weight": 1,
        "mlp.linear_fc1.weight": 0,
        "mlp.linear_fc2.weight": 1,
    }
    for layer in range(L):
        offsets = ((0, layer, L),)  # TransformerBlock's prepended layer axis
        local = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _layer_local(full, layer, tp).items()}
        layer_sd = make_sharded_tensors_for_checkpoint(local, "decoder.layers.", axis_map, offsets, **groups)
        k = "decoder.layers.mlp.linear_fc1.weight"
        layer_sd[k] = apply_swiglu_sharded_factory(layer_sd[k], offsets)
        sd[f"decoder.layers.{layer}"] = layer_sd
        for le in range(E // 2):  # EP=2 over dp; replicated over TP
            e = dp * (E // 2) + le
            key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
            sd[f"decoder.layers.{layer}.mlp.experts.local_experts.{le}.linear_fc1.weight"] = (
                ShardedTensor.from_rank_offsets(
                    key, full[key][layer, e].clone(), (0, layer, L), (1, e, E), replica_id=(0, tp, 0),
                    prepend_axis_num=2,
                )
            )  # fmt: skip
    for key, axis in (("embedding.word_embeddings.weight", 0), ("output_layer.weight", 0)):
        sd[key] = make_tp_sharded_tensor_for_checkpoint(full[key].chunk(TP, axis)[tp].clone(), key, axis, **groups)
    key = "decoder.final_layernorm.weight"
    sd[key] = make_sharded_tensors_for_checkpoint({key: full[key].clone()}, "", **groups)[key]
    # the distributed optimizer's dp_reshardable buckets (distrib_optimizer.py
    # sharded_param_state_dp_reshardable): per DP rank a local buffer of PADDED // 2, one
    # ShardedTensor per parameter span and per padding span, none past the unpadded size
    local_numel = PADDED // 2
    bucket = BUCKET.format(tp)
    for s in ("param", "exp_avg"):
        t = full[f"{bucket}.{s}"]
        cuts = sorted({0, local_numel, *(x - dp * local_numel for span in SPANS for x in span)})
        cuts = [c for c in cuts if 0 <= c <= local_numel]
        for a, b in zip(cuts, cuts[1:]):
            start = dp * local_numel + a
            if start >= UNPADDED:
                continue
            b = min(b, UNPADDED - dp * local_numel)
            data = t[start : dp * local_numel + b].clone()
            sd[f"optimizer.{s}.{a}"] = ShardedTensor(
                f"{bucket}.{s}", data, data.dtype, tuple(data.shape), (UNPADDED,), (start,),
                axis_fragmentations=None, flattened_range=None, allow_shape_mismatch=False,
                replica_id=(0, 0, 0),
            )  # fmt: skip
    sd["optimizer.per_bucket_numel"] = ShardedObject(
        f"optimizer.distributed.dp_group_idx_{tp}.per_bucket_numel", {(torch.float32, torch.float32): [PADDED]},
        (1,), (0,), replica_id=(0, 0, dp),
    )  # fmt: skip
    rows = UNEVEN_ROWS[rank]
    data = full["uneven"][rows[0] : rows[1]].clone()
    sd["uneven"] = ShardedTensor("uneven", data, data.dtype, tuple(data.shape), (7, 3), (rows[0], 0), None)
    sd["iteration"] = 5
    sd["args"] = argparse.Namespace(num_layers=L, hidden_size=H, tensor_model_parallel_size=TP)
    return sd


def worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if not torch.cuda.is_available():  # see the module docstring
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    root = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=WORLD)
    ok = False
    try:
        dp_size = WORLD // TP
        tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(dp_size)]
        dp_groups = [dist.new_group([d * TP + t for d in range(dp_size)]) for t in range(TP)]
        tp_group, dp_group = tp_groups[rank // TP], dp_groups[rank % TP]
        for mode in MODES:
            ck = root / mode
            if rank == 0:
                ck.mkdir()
            dist.barrier()
            filesystem_async._results_queue = queue.Queue()
            sd = sharded_state_dict(rank, tp_group, dp_group)
            if mode == "async":
                request = dist_checkpointing.save(sd, str(ck), async_sharded_save=True)
                assert request is not None
                request.execute_sync()
            else:
                strategy = {
                    "plain": None,
                    "hint": TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="decoder.layers.mlp"),
                    "fully_parallel": FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1)),
                }[mode]
                dist_checkpointing.save(sd, str(ck), sharded_strategy=strategy)
            dist.barrier()
            loaded = dist_checkpointing.load_plain_tensors(str(ck))
            if rank == 0:
                torch.save(
                    {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, root / f"{mode}.mcore.pt"
                )
        if rank == 0:
            torch.save(full_tensors(), root / "full.pt")
        ok = True
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        (root / f"ok-{rank}").write_text("1" if ok else "0")
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # imported before the fork, once; the module itself imports nothing heavy at the top, so
    # a process started with spawn (Megatron's writer uses some) does not import torch again
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.transformer.mlp  # noqa: F401
    import torch.multiprocessing as mp

    out = Path(argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(worker, args=(str(out),), nprocs=WORLD, join=True, start_method="fork")
    return 0 if all((out / f"ok-{r}").read_text() == "1" for r in range(WORLD)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
