"""Megatron-Core ``torch_dist``: a DCP checkpoint plus two files of Megatron's own.

``dist_checkpointing.save`` writes, beside ``.metadata`` and the ``.distcp`` files,
``metadata.json`` (which backends wrote it: what ``check_is_distributed_checkpoint`` and
``dist_checkpointing.load`` look for) and ``common.pt`` (the state that is not sharded, a
``torch.save`` pickle: ``args``, ``iteration``, or ``{}`` for a model's own
``sharded_state_dict()``). ``--to dcp`` writes them too (:func:`marker_files`):

* a ``torch_dist`` source converted under its own names: both copied as they are (never
  unpickled), so a TP-2 run's checkpoint resharded to TP-4 is still one Megatron loads;
* transforms whose target names are Megatron's (a profile with ``megatron_torch_dist:
  true``, ``hf-to-megatron-torch-dist``): Megatron's ``metadata.json`` and the
  ``torch.save({})`` of a model-only save, and the layers' ``_extra_state`` objects
  (:func:`extra_states`), which Megatron's loader asks for.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import SourceChangedError
from ..io.safe import open_regular
from ..plan import Plan

__all__ = [
    "CONFIG",
    "COMMON",
    "CONFIG_BYTES",
    "is_torch_dist",
    "empty_common",
    "extra_states",
    "marker_files",
]

CONFIG = "metadata.json"
COMMON = "common.pt"
CONFIG_BYTES = (
    b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
    b'"common_backend": "torch", "common_backend_version": 1}'
)
"""What megatron-core's ``save_config`` writes for a ``torch_dist`` save (``json.dump`` of its
``CheckpointingConfig``)."""

_CONFIG_MAX = 1 << 16  # a metadata.json is a hundred bytes; a larger one is not Megatron's


def is_torch_dist(directory: Path) -> bool:
    """Whether ``directory`` holds ``common.pt`` and a ``metadata.json`` naming the ``torch_dist``
    backend (what Megatron writes beside its DCP files)."""
    config = directory / CONFIG
    if not (directory / COMMON).is_file() or not config.is_file():
        return False
    try:
        with config.open("rb") as f:
            doc = json.loads(f.read(_CONFIG_MAX + 1))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


def empty_common() -> bytes:
    """``torch.save({})``'s archive, made without torch (:func:`_saved`). ``torch.load``
    (``weights_only`` too) gives ``{}``.

    >>> import zipfile, io; sorted(zipfile.ZipFile(io.BytesIO(empty_common())).namelist())
    ['common/byteorder', 'common/data.pkl', 'common/version']
    """
    return _saved({}, "common")


def _saved(obj: object, prefix: str) -> bytes:
    """``torch.save(obj)``'s archive for an ``obj`` of plain data, made without torch:
    ``data.pkl`` (protocol 2, as torch pickles), ``byteorder`` and ``version`` records,
    stored, with fixed times (the same bytes every run), under ``prefix``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in (
            ("data.pkl", pickle.dumps(obj, protocol=2)),
            ("byteorder", b"little"),
            ("version", b"3\n"),
        ):
            z.writestr(zipfile.ZipInfo(f"{prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


LAYERS = "decoder.layers."
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
)
"""The modules of a GPT layer whose ``_extra_state`` Megatron saves: the four linear layers
(every spec: local layers keep ``None``, TransformerEngine's its FP8 state), an MoE layer's
shared expert's two and, with TransformerEngine's spec (Megatron-LM's default), the
attention kernel."""
EXPERT_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
"""The routed experts' linear layers (stacked ``[L, E, ...]``), whose ``_extra_state`` Megatron
saves per layer and expert: ``..._extra_state/shard_<layer>.<expert>_<layers>.<experts>``."""


def extra_states(plan: Plan) -> list[tuple[str, bytes]]:
    """The ``_extra_state`` objects Megatron's ``dist_checkpointing.load`` asks for, for a
    ``--to dcp`` output of Megatron names (:func:`marker_files`' first case): one per module of
    :data:`EXTRA_STATE_MODULES` and layer, under Megatron's key (``ShardedObject.unique_key``:
    ``decoder.layers.<module>._extra_state/shard_<layer>_<layers>``), holding what a model
    without FP8 state saves (``torch.save([None])``: no FP8 scaling to carry over). Without them
    Megatron's default strictness (``assume_ok_unexpected``) fails on the missing keys; the
    attention kernel's, which the local spec does not ask for, is an unexpected key there,
    which that strictness ignores.

    The number of layers is the stacked ``decoder.layers.self_attention.linear_qkv.weight``'s
    first dim; a linear module's object is written when its weight is in the output; the
    routed experts' (:data:`EXPERT_MODULES`), one per layer and expert of their ``[L, E, ...]``.
    """
    if plan.transforms is None or not plan.transforms["spec"].get("megatron_torch_dist"):
        return []
    shapes = {t.name: t.shape for t in plan.tensors}
    qkv = shapes.get(f"{LAYERS}self_attention.linear_qkv.weight")
    if not qkv:
        return []
    count = qkv[0]
    blob = _saved([None], "archive")
    out = [
        (f"{LAYERS}{m}._extra_state/shard_{i}_{count}", blob)
        for m in EXTRA_STATE_MODULES
        if m.endswith("core_attention") or f"{LAYERS}{m}.weight" in shapes
        for i in range(count)
    ]
    for m in EXPERT_MODULES:
        shape = shapes.get(f"{LAYERS}{m}.weight")
        if shape is not None and len(shape) > 2:
            experts = shape[1]
            out += [
                (f"{LAYERS}{m}._extra_state/shard_{i}.{e}_{count}.{experts}", blob)
                for i in range(count)
                for e in range(experts)
            ]
    return out


Fill = Callable[[Callable[[bytes], object]], object]


def marker_files(plan: Plan) -> list[tuple[str, Fill]]:
    """Megatron's two files for a ``--to dcp`` output of ``plan``, as (name, what writes its
    bytes), or none (see the module docstring)."""
    if plan.transforms is not None:
        if not plan.transforms["spec"].get("megatron_torch_dist"):
            return []
        common = empty_common()
        return [(CONFIG, lambda write: write(CONFIG_BYTES)), (COMMON, lambda write: write(common))]
    src = Path(plan.source.path)
    if plan.source.format != "dcp" or not is_torch_dist(src):
        return []
    return [(name, _copy(src / name)) for name in (CONFIG, COMMON)]


def _copy(path: Path) -> Fill:
    def fill(write: Callable[[bytes], object]) -> None:
        fd, st = open_regular(path, what="Megatron file", error=SourceChangedError)
        try:
            left = st.st_size
            while left > 0:
                block = os.read(fd, min(left, 1 << 20))
                if not block:
                    raise SourceChangedError(f"{path}: shorter than when it was opened", path=str(path))
                write(block)
                left -= len(block)
        finally:
            os.close(fd)

    return fill
