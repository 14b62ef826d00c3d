"""reshard: convert model checkpoints between parallel layouts, streaming, in bounded memory.

The conversion path never imports torch; the live-DTensor API
(:func:`load_dtensors`, :func:`save_dtensors`) does, lazily.
"""

from __future__ import annotations

from typing import Any

from .version import __version__

__all__ = ["__version__", "load_dtensors", "save_dtensors"]


def __getattr__(name: str) -> Any:
    if name in ("load_dtensors", "save_dtensors"):
        from . import dist

        return getattr(dist, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
