"""The only places the conversion path needs torch: dtype casts and Partial reductions.

Imported lazily by ``execute`` so plain safetensors -> safetensors conversions
never pay for ``import torch``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["torch_dtype", "cast_reduce"]

_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def torch_dtype(name: str) -> Any:
    """The torch dtype of a safetensors dtype string."""
    import torch

    return getattr(torch, _TORCH_NAMES[name])


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
            if acc.is_floating_point():
                acc /= len(parts)
            else:
                acc = torch.div(acc, len(parts), rounding_mode="floor").to(sdt)
    out = acc.to(torch_dtype(dst_dtype)) if dst_dtype != src_dtype else acc
    return out.contiguous().view(torch.uint8).numpy()
