"""reshard: convert model checkpoints between parallel layouts, streaming, in bounded memory.

The conversion path never imports torch; the live-DTensor API
(:func:`load_dtensors`, :func:`save_dtensors`) does, lazily. :func:`convert_checkpoint`,
:func:`inspect_checkpoint`, :func:`plan_conversion` and :func:`compare_checkpoints` are
the commands as functions (:mod:`reshard.api`), also imported on first use.
"""

from __future__ import annotations

from typing import Any

from .version import __version__

__all__ = [
    "__version__",
    "load_dtensors",
    "save_dtensors",
    "convert_checkpoint",
    "inspect_checkpoint",
    "plan_conversion",
    "compare_checkpoints",
]

_API = ("convert_checkpoint", "inspect_checkpoint", "plan_conversion", "compare_checkpoints")
"""One call per command (:mod:`reshard.api`)."""


def __getattr__(name: str) -> Any:
    if name in ("load_dtensors", "save_dtensors"):
        from . import dist

        return getattr(dist, name)
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
