"""A built-in demo checkpoint: a small Llama-shaped model saved TP-4, per rank, by torch.

``python -m reshard.demo build DIR`` writes:

* ``DIR/tp4/rank-0000r-of-00004.safetensors``: each rank's local tensors exactly as
  ``distribute_tensor(full, mesh, placements).to_local()`` would hold them
  (computed with torch's own placement splitting, no process group needed),
  with no layout metadata, as a training job would leave them;
* ``DIR/reference/model.safetensors``: the full tensors, for checking.

The layout is ``configs/llama-tp.yaml`` (q/k/v/gate/up S(0), o/down S(1),
embeddings and lm_head S(0), norms R).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["llama_shapes", "build_demo", "main"]


def llama_shapes(
    layers: int = 4, hidden: int = 256, ffn: int = 688, vocab: int = 1000, kv_heads: int = 2, heads: int = 8
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face Llama state dict."""
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.up_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, ffn)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _torch_placements(texts: Any) -> list[Any]:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    from .placements import Partial as P
    from .placements import Shard as S
    from .placements import StridedShard as SS

    out: list[Any] = []
    for p in texts:
        if isinstance(p, S):
            out.append(Shard(p.dim))
        elif isinstance(p, SS):
            out.append(_StridedShard(p.dim, split_factor=int(p.split_factor)))
        elif isinstance(p, P):
            out.append(Partial(p.reduce_op))
        else:
            out.append(Replicate())
    return out


def torch_local(full: Any, mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: Any) -> Any:
    """The local tensor torch's own placement splitting gives ``coord`` (the oracle)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    local = full
    for m, p in enumerate(_torch_placements(placements)):
        if isinstance(p, (Shard, _StridedShard)):
            shards, _ = p._split_tensor(local, mesh_shape[m], with_padding=False)
            local = shards[coord[m]]
    return local.contiguous()


def build_demo(out: Path, *, layers: int = 4, tp: int = 4, seed: int = 0) -> dict[str, Path]:
    """Write the demo TP checkpoint and its reference; returns their paths."""
    import torch
    from safetensors.torch import save_file

    from .config import load_layout, resolve_preset
    from .mesh import Mesh

    cfg = load_layout(resolve_preset("llama-tp"))
    mesh = Mesh(("tp",), (tp,))
    cfg = cfg.with_mesh(mesh)
    gen = torch.Generator().manual_seed(seed)
    full = {
        name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        for name, shape in llama_shapes(layers=layers).items()
    }
    tp_dir = out / f"tp{tp}"
    ref_dir = out / "reference"
    tp_dir.mkdir(parents=True, exist_ok=True)
    ref_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(mesh.size):
        coord = mesh.coordinate(rank)
        local = {
            name: torch_local(t, mesh.shape, coord, cfg.placements_for(name)).clone()
            for name, t in full.items()
        }
        save_file(local, str(tp_dir / f"rank-{rank:05d}-of-{mesh.size:05d}.safetensors"))
    save_file(full, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return {"tp": tp_dir, "reference": ref_dir}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reshard.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the demo checkpoint")
    b.add_argument("out", type=Path)
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--tp", type=int, default=4)
    args = parser.parse_args(argv)
    paths = build_demo(args.out, layers=args.layers, tp=args.tp)
    sys.stderr.write(f"demo checkpoint: {paths['tp']} (reference: {paths['reference']})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
