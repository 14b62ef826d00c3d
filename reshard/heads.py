"""A target layout checked against the model's attention heads from ``config.json``.

Two ways a layout can be wrong for a model without any placement being malformed:

* a fused QKV tensor (``self_attn.qkv_proj``: rows ``[q; k; v]``) placed ``_S(0, 3)``
  cuts three *equal* parts, which are q, k and v only when the model has as many
  key/value heads as query heads. With grouped-query attention (e.g. 256 + 64 + 64
  rows) the cut falls inside q, and every rank silently gets the wrong rows. That
  is refused (:class:`~reshard.errors.LayoutError`, exit 2) unless the sizes are
  known to be equal: from ``config.json``'s head counts when the source directory
  has one, else from the shape ``[3 * hidden, hidden]`` of a multi-head weight.
* sharding the key/value rows over more ranks than there are key/value heads (or a
  number not dividing them) splits heads across ranks, where transformers and vLLM
  replicate whole KV heads instead: a warning.

With transforms the target tensors are checked, against the head counts the transforms
use (``--set`` over the spec's ``config:`` over config.json: ``Transforms.heads``).

>>> Heads(heads=4, kv_heads=1, head_dim=64, source="config.json").qkv_rows
(256, 64, 64)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint, CheckpointWarning, TensorSource
from .config import LayoutConfig
from .errors import LayoutError
from .mesh import Mesh
from .placements import Placement, Shard, StridedShard

__all__ = ["Heads", "HEAD_KEYS", "heads_from", "read_heads", "check_heads", "check_tensor_heads"]

# Hugging Face / vLLM fused projection rows [q; k; v] (Phi-3, vLLM's qkv_proj).
_FUSED_QKV = re.compile(r"(?:.*\.)?qkv_proj\.(weight|bias)")
# Tensors whose dim-0 rows are key/value heads.
_KV_ROWS = re.compile(r"(?:.*\.)?(?:k_proj|v_proj|qkv_proj)\.weight")
_SPLIT_HINT = (
    "split the fused tensor into q_proj/k_proj/v_proj with a transforms split "
    "(sizes: [heads*head_dim, kv_heads*head_dim, kv_heads*head_dim]; docs/TRANSFORMS.md) and shard "
    "each S(0), or shard the fused rows as one block with S(0) (transformers' own Phi-3 plan, "
    "the llama-tp preset)"
)


@dataclass(frozen=True, slots=True)
class Heads:
    """Attention head counts of a model, from its ``config.json`` (and ``--set`` values).

    Attributes:
        heads: ``num_attention_heads``.
        kv_heads: ``num_key_value_heads`` (``heads`` when absent: multi-head attention).
        head_dim: ``head_dim``, else ``hidden_size // num_attention_heads``.
        source: where they come from, for messages (the config.json path, ``--set ...``).
    """

    heads: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v in a fused ``[q; k; v]`` projection."""
        return (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)


#: The config.json keys :func:`heads_from` reads.
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")


def _positive(config: Mapping[str, object], key: str) -> int | None:
    v = config.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def heads_from(config: Mapping[str, object], source: str) -> Heads | None:
    """The head counts in ``config`` (config.json's keys), or None when it has none.

    >>> heads_from({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}, "c")
    Heads(heads=8, kv_heads=2, head_dim=64, source='c')
    """
    heads = _positive(config, "num_attention_heads")
    if heads is None:
        return None
    kv = _positive(config, "num_key_value_heads") or heads
    hidden = _positive(config, "hidden_size")
    head_dim = _positive(config, "head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        return None
    return Heads(heads, kv, head_dim, source)


def read_heads(directory: str | Path) -> Heads | None:
    """The head counts in ``directory/config.json``, or None (no file, or no head counts in it).

    Raises:
        ConfigError: the file exists but is not a JSON object.
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    from .transforms import load_hf_config  # lazy: a 1400-line module, needed only with a config.json

    return heads_from(load_hf_config(path), str(path))


def _model_dir(ckpt: Checkpoint) -> Path:
    p = Path(ckpt.path)
    return p if p.is_dir() else p.parent


DATA_PARALLEL = frozenset({"dp", "ddp", "fsdp", "hsdp", "zero", "dp_shard", "dp_replicate", "dp_shard_cp"})
"""Mesh dim names of data parallelism: FSDP gathers a parameter whole before computing with it,
so its shards cut no head in use (torchtitan's and accelerate's names, and the usual short ones)."""


def _sharding_degree(placements: tuple[Placement, ...], mesh: Mesh, dim: int) -> int:
    """How many ways the mesh dims sharding tensor dim ``dim`` split it, but for data-parallel
    ones (:data:`DATA_PARALLEL`)."""
    n = 1
    for p, size, name in zip(placements, mesh.shape, mesh.names, strict=True):
        if isinstance(p, (Shard, StridedShard)) and p.dim == dim and name not in DATA_PARALLEL:
            n *= size
    return n


def _fused_parts(
    name: str, shapes: dict[str, tuple[int, ...]], heads: Heads | None
) -> tuple[int, ...] | None:
    """Rows of q, k, v in fused ``name``: from config.json, else from a ``[3h, h]`` weight, else None."""
    if heads is not None:
        return heads.qkv_rows
    weight = shapes.get(name[: -len("bias")] + "weight") if name.endswith(".bias") else shapes[name]
    if weight is not None and len(weight) == 2 and weight[0] == 3 * weight[1]:
        return (weight[1],) * 3
    return None


def _thirds(placements: tuple[Placement, ...], ndim: int) -> StridedShard | None:
    """The ``_S(0, 3)`` among ``placements``: the one cutting a fused tensor into q, k and v."""
    for p in placements:
        if isinstance(p, StridedShard) and p.split_factor == 3 and p.dim % max(ndim, 1) == 0:
            return p
    return None


def _check_fused(
    name: str, shapes: dict[str, tuple[int, ...]], rules: LayoutConfig, mesh: Mesh, heads: Heads | None
) -> None:
    shape = shapes[name]
    p = _thirds(rules.placements_for(name, mesh), len(shape))
    if p is None:
        return
    rows = shape[0] if shape else 0
    parts = _fused_parts(name, shapes, heads)
    if parts is not None and sum(parts) == rows and len(set(parts)) == 1:
        return
    if parts is None:
        known = (
            "the q/k/v sizes are unknown (no config.json with num_attention_heads next to the "
            "source, and the shape is not [3*hidden, hidden])"
        )
    else:
        src = heads.source if heads is not None else "the shape"
        known = f"its rows are q {parts[0]} + k {parts[1]} + v {parts[2]} (from {src})"
    raise LayoutError(
        f'tensor "{name}" of shape {list(shape)}: {rules.rule_location(name)} places it {p}, which '
        f"cuts it into 3 equal parts ({rows}/3 rows each), but {known}; {_SPLIT_HINT}",
        tensor=name,
        path=rules.source,
    )


def _kv_warning(name: str, rules: LayoutConfig, mesh: Mesh, heads: Heads) -> CheckpointWarning | None:
    degree = _sharding_degree(rules.placements_for(name, mesh), mesh, 0)
    if degree <= 1 or (degree <= heads.kv_heads and heads.kv_heads % degree == 0):
        return None
    why = "exceeds" if degree > heads.kv_heads else "does not divide"
    return CheckpointWarning(
        f'{rules.rule_location(name)} shards "{name}" {degree} ways, which {why} the '
        f"{heads.kv_heads} key/value heads (num_key_value_heads, from {heads.source}): ranks hold parts of "
        "heads, where transformers and vLLM keep whole KV heads (replicated when tp > num_key_value_heads); "
        f"use a tensor-parallel degree dividing {heads.kv_heads}, or replicate k/v",
        path=rules.source,
        tensor=name,
    )


def check_heads(source: Checkpoint, rules: LayoutConfig | None, mesh: Mesh) -> list[CheckpointWarning]:
    """Check target ``rules`` on ``mesh`` against ``source``'s tensors and its ``config.json`` heads.

    Returns:
        Warnings: key/value rows sharded over more ranks than KV heads (once, for the first such tensor).

    Raises:
        LayoutError: a fused QKV tensor placed as equal strided parts that are not q, k and v.
        ConfigError: ``config.json`` exists but cannot be parsed.
    """
    return check_tensor_heads(source.tensors, rules, mesh, lambda: read_heads(_model_dir(source)))


def check_tensor_heads(
    tensors: Mapping[str, TensorSource],
    rules: LayoutConfig | None,
    mesh: Mesh,
    heads_of: Callable[[], Heads | None],
) -> list[CheckpointWarning]:
    """:func:`check_heads` on ``tensors`` (e.g. the target tensors of transforms), with the head
    counts ``heads_of()`` gives (called only when some tensor name is a q/k/v projection)."""
    if rules is None:
        return []
    # every name either pattern matches holds "k_proj." or "v_proj." (qkv_proj. too): substring
    # tests first, regexes for the few that pass (100k expert names hold gate_/up_/down_proj.)
    names = [
        n
        for n in tensors
        if ("k_proj." in n or "v_proj." in n) and (_FUSED_QKV.fullmatch(n) or _KV_ROWS.fullmatch(n))
    ]
    if not names:
        return []
    heads = heads_of()
    shapes = {n: tensors[n].shape for n in names}
    for name in names:
        if _FUSED_QKV.fullmatch(name):
            _check_fused(name, shapes, rules, mesh, heads)
    if heads is not None:
        for name in names:
            w = _kv_warning(name, rules, mesh, heads) if _KV_ROWS.fullmatch(name) else None
            if w is not None:
                return [w]
    return []
