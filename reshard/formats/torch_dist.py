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
  ``torch.save({})`` of a model-only save.
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

__all__ = ["CONFIG", "COMMON", "CONFIG_BYTES", "is_torch_dist", "empty_common", "marker_files"]

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
    """``torch.save({})``'s archive, made without torch: ``data.pkl`` (protocol 2, as torch
    pickles), ``byteorder`` and ``version`` records, stored, with fixed times (the same bytes
    every run). ``torch.load`` (``weights_only`` too) gives ``{}``.

    >>> import zipfile, io; sorted(zipfile.ZipFile(io.BytesIO(empty_common())).namelist())
    ['common/byteorder', 'common/data.pkl', 'common/version']
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in (
            ("data.pkl", pickle.dumps({}, protocol=2)),
            ("byteorder", b"little"),
            ("version", b"3\n"),
        ):
            z.writestr(zipfile.ZipInfo(f"common/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


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
