"""The only places the conversion path needs torch: dtype casts and Partial reductions.

Imported lazily by ``execute`` so plain safetensors -> safetensors conversions
never pay for ``import torch``.
"""

from __future__ import annotations

from typing import Any

from .dtypes import TORCH_NAMES

__all__ = ["torch_dtype", "cast_reduce"]


def torch_dtype(name: str) -> Any:
    """The torch dtype of a safetensors dtype string."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


def cast_reduce(views: list[Any], src_dtype: str, dst_dtype: str, reduce_op: str | None, n: int) -> Any:
    """Reduce partial slabs (in rank order) and cast; returns a contiguous byte buffer.

    Args:
        views: one numpy array per partial group, raw items of ``src_dtype``.
        src_dtype: safetensors dtype of the source.
        dst_dtype: safetensors dtype to write.
        reduce_op: ``sum``, ``avg``, ``max``, ``min`` or None (one group).
        n: number of elements in the slab.
    """
    import torch

    sdt = torch_dtype(src_dtype)
    parts = [torch.frombuffer(memoryview(v.reshape(-1)), dtype=sdt, count=n) for v in views]
    acc = parts[0].clone() if len(parts) > 1 else parts[0]
    if len(parts) > 1:
        for p in parts[1:]:
            if reduce_op in ("sum", "avg"):
                acc += p
            elif reduce_op == "max":
                torch.maximum(acc, p, out=acc)
            elif reduce_op == "min":
                torch.minimum(acc, p, out=acc)
            else:
                raise AssertionError(f"unknown reduce op {reduce_op}")
        if reduce_op == "avg":
            # integer avg never gets here (plan.check_reduce refuses it, as torch does)
            assert acc.is_floating_point(), f"Partial(avg) of {src_dtype}"
            acc /= len(parts)
    out = acc.to(torch_dtype(dst_dtype)) if dst_dtype != src_dtype else acc
    return out.contiguous().view(torch.uint8).numpy()
