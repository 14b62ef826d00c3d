"""Safetensors dtypes: item sizes, which are floating point, and the reference writer's order (pure).

An explicit table, never inferred: the planner, the readers and the writers all
size items from it.
"""

from __future__ import annotations

__all__ = ["DTYPE_SIZES", "FLOAT_DTYPES", "DTYPE_RANK", "SUBBYTE_DTYPES", "TORCH_NAMES"]

#: Every whole-byte safetensors dtype (safetensors 0.8) and its item size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

#: The real floating-point dtypes (C64 is complex and not included).
FLOAT_DTYPES: frozenset[str] = frozenset(
    {
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "F16",
        "BF16",
        "F32",
        "F64",
    }
)

#: Sub-byte dtypes safetensors knows but this codec rejects: their byte size is
#: not ``numel * itemsize`` and slices need not fall on byte boundaries.
SUBBYTE_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")

# Declaration order of the Rust ``safetensors::Dtype`` enum (derived ``Ord``).
# The reference writer sorts tensors by this rank, descending, then by name.
_RUST_DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
DTYPE_RANK = {name: rank for rank, name in enumerate(_RUST_DTYPE_ORDER)}
"""Position of each dtype in the Rust ``Dtype`` enum: the reference writer lays out
tensors by this rank, descending, then by name."""

# safetensors dtype name -> torch dtype attribute (torch.<name>)
TORCH_NAMES: dict[str, str] = {
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
