"""Output files in safetensors form, shared by the writers of safetensors-based formats.

A :class:`SafetensorsFile` holds one target rank's blocks (or the whole tensors of a
consolidated file) in the reference writer's order, its header built by
:func:`reshard.io.header.header_prefix`, so files are byte-identical to
``safetensors.torch.save_file`` of the same tensors and metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

from ..dtypes import DTYPE_RANK, DTYPE_SIZES
from ..intervals import block_shape
from ..io.header import header_prefix
from ..layout import TensorLayout
from ..plan import FileLayout, OutEntry, OutFile, TargetTensor, local_nbytes

__all__ = ["SafetensorsFile", "header_order", "metadata_text", "split_parts"]


class SafetensorsFile(OutFile):
    """A safetensors output file: the header, then each tensor's block back to back."""

    __slots__ = ("_meta",)

    def __init__(
        self, name: str, rank: int | None, tensors: Sequence[TargetTensor], meta: str | None
    ) -> None:
        """``tensors`` in header order (:func:`header_order`); ``meta`` the JSON text of ``__metadata__``
        (None: no ``__metadata__``, as ``save_file`` without metadata writes)."""
        super().__init__(name, rank, tensors)
        self._meta = meta

    def lay_out(self) -> FileLayout:
        r = self.local_rank
        items = []
        texts: dict[tuple[int, str], tuple[str, int]] = {}  # tensors of one geometry share a layout
        for t in self.tensors:
            text = texts.get((id(t.layout), t.dtype))
            if text is None:
                text = texts[(id(t.layout), t.dtype)] = _local_texts(t.layout, t.dtype)[r]
            items.append((_quoted(t.name), t.dtype, text[0], text[1]))
        prefix, starts = header_prefix(items, self._meta)
        base = len(prefix)
        entries = tuple(OutEntry(t, r, base + a, it[3]) for t, a, it in zip(self.tensors, starts, items))
        size = base + sum(it[3] for it in items)
        return FileLayout(((0, prefix),), entries, size)


def metadata_text(metadata: dict[str, str]) -> str:
    """The JSON text of a ``__metadata__`` object, as the reference writer writes it."""
    return json.dumps(metadata, ensure_ascii=False, separators=(",", ":"))


def header_order(tensors: Sequence[TargetTensor]) -> list[TargetTensor]:
    """The reference writer's order: dtype rank (Rust enum) descending, then name."""
    return sorted(tensors, key=lambda t: (-DTYPE_RANK[t.dtype], t.name))


def split_parts(tensors: Sequence[TargetTensor], rank: int, max_size: int) -> list[list[TargetTensor]]:
    """Rank ``rank``'s tensors in order, in files of at most ``max_size`` bytes: a new file when the
    next tensor would take this one over (as Hugging Face's and vLLM's savers split); a tensor
    larger than ``max_size`` gets a file of its own, and no file is empty."""
    parts: list[list[TargetTensor]] = [[]]
    acc = 0
    for t in tensors:
        n = local_nbytes(t, rank)
        if parts[-1] and acc + n > max_size:
            parts.append([])
            acc = 0
        parts[-1].append(t)
        acc += n
    return parts


_QUOTED: dict[str, str] = {}


def _quoted(name: str) -> str:
    q = _QUOTED.get(name)
    if q is None:
        q = json.dumps(name, ensure_ascii=False)
        if len(_QUOTED) < 1_000_000:
            _QUOTED[name] = q
    return q


@lru_cache(maxsize=65536)
def _local_texts(layout: TensorLayout, dtype: str) -> tuple[tuple[str, int], ...]:
    """Per rank: the local shape as header text, and the local bytes (shared by equal layouts)."""
    isz = DTYPE_SIZES[dtype]
    out = []
    for blk in layout.blocks():
        shp = block_shape(blk)
        n = isz
        for x in shp:
            n *= x
        out.append((",".join(map(str, shp)), n))
    return tuple(out)
