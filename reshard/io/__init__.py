"""File input/output: safetensors header codec and related helpers."""

from __future__ import annotations

__all__: list[str] = []
