"""``convert --resume``: keep output files an interrupted run finished and verified, redo the rest.

Each finished file is recorded in ``DST/.reshard-progress.jsonl`` (name, size,
checksum) as soon as it is renamed into place; ``reshard.json`` replaces the
journal when the conversion completes. A file is kept only when it is in the
journal, its size and checksum still match, and its header is the one the
current plan would write (same options, same source).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .io.checksum import file_checksum
from .io.writer import FileResult
from .plan import OutFile, Plan

__all__ = ["JOURNAL", "record_finished", "finished_files"]

JOURNAL = ".reshard-progress.jsonl"


def record_finished(dst: Path, result: FileResult, rank: int = 0) -> None:
    """Append one finished file to the journal (one line, flushed; one journal per torchrun rank)."""
    line = json.dumps({"name": result.name, "size": result.size, "checksum": result.checksum})
    name = JOURNAL if rank == 0 else f"{JOURNAL}.{rank}"
    with open(dst / name, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _journal(dst: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for p in sorted(dst.glob(JOURNAL + "*")):
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                out[str(rec["name"])] = rec
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from an interrupted run
    return out


def _header_matches(path: Path, f: OutFile) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(f.prefix)) == f.prefix


def finished_files(
    plan: Plan, dst: Path, files: list[OutFile] | None = None
) -> tuple[list[FileResult], list[OutFile]]:
    """Split ``files`` (default: all the plan's) into (kept results, files still to write)."""
    journal = _journal(dst)
    done: list[FileResult] = []
    todo: list[OutFile] = []
    for f in plan.files if files is None else files:
        p = dst / f.name
        rec = journal.get(f.name)
        if (
            rec is not None
            and p.is_file()
            and p.stat().st_size == f.size == rec.get("size")
            and _header_matches(p, f)
            and file_checksum(p) == rec.get("checksum")
        ):
            done.append(FileResult(f.name, f.size, str(rec["checksum"])))
        else:
            p.unlink(missing_ok=True)
            todo.append(f)
    return done, todo
