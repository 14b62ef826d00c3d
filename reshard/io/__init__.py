"""Bytes in one place: the safetensors header codec (:mod:`.header`), reading a box of a source
piece (:mod:`.reader`, over the open files and released page windows of :mod:`.pages`),
writing output files (:mod:`.writer`) and their checksums (:mod:`.checksum`)."""

from __future__ import annotations

__all__: list[str] = []
