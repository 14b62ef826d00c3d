"""``convert --resume``: keep output files an interrupted run finished and verified, redo the rest.

The journal ``.reshard-progress.jsonl`` lives in the staging directory
(:mod:`reshard.io.staging`). Its first line records the source's identity (file
names, sizes, mtimes, and checksums where the source's ``reshard.json`` has
them) and the conversion's recipe (:func:`recipe`: how the source is read, the
transforms, the target layout, format and dtype); each finished file is appended
(name, size, checksum) as soon as it is renamed into place. A resume onto a source
that changed since is refused: the kept files were made from other bytes. A resume
with another recipe (a corrected ``--source-layout``, other ``--transforms``, a
target layout placing a square tensor ``S(1)`` instead of ``S(0)``: files of the same
names and headers holding other values) keeps no file: it redoes them all, with a
warning. A file is kept only when the recipe is the same, it is in the journal, its
size and checksum still match, and its header is the one the current plan would write.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint
from .errors import UsageError
from .io.checksum import file_checksum
from .io.pages import is_scratch
from .io.writer import FileResult
from .plan import OutFile, Plan
from .text import shown

__all__ = [
    "JOURNAL",
    "is_journal",
    "source_identity",
    "recipe",
    "start_journal",
    "record_finished",
    "finished_files",
]

JOURNAL = ".reshard-progress.jsonl"


def is_journal(name: str) -> bool:
    """Whether ``name`` is a resume journal (rank 0's, or another torchrun rank's)."""
    return name == JOURNAL or name.startswith(JOURNAL + ".")


def _append(path: Path, line: str) -> None:
    """Append one line, flushed to disk; never through a link planted at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def source_identity(ckpt: Checkpoint) -> dict[str, dict[str, Any]]:
    """Per source file name: size, mtime (ns) and, where its ``reshard.json`` lists one, checksum.

    A file the reader made under ``$TMPDIR`` (the DCP reader's spool of decompressed or
    row-major chunks, made anew by every run) is not the source's: it is left out.
    """
    listed = (ckpt.manifest or {}).get("files")
    out: dict[str, dict[str, Any]] = {}
    for f in ckpt.files:
        if is_scratch(f):
            continue
        st = os.stat(f)
        rec: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        info = listed.get(Path(f).name) if isinstance(listed, dict) else None
        if isinstance(info, dict) and isinstance(info.get("checksum"), str):
            rec["checksum"] = info["checksum"]
        out[Path(f).name] = rec
    return out


def recipe(plan: Plan, dtype: str | None) -> str:
    """A digest of what, besides the source's bytes, decides the output's bytes: the source's
    format and rules (``--source-layout``/``--source-mesh`` for files that do not describe
    themselves), the transforms, the target format, mesh, rules and ``--dtype``."""
    src = plan.source
    doc = {
        "from": src.format,
        "source_rules": src.layout.to_json() if src.layout is not None else None,
        "to": plan.format,
        "mesh": plan.mesh.to_json(),
        "rules": plan.rules.to_json() if plan.rules is not None else None,
        "transforms": plan.transforms,
        "dtype": dtype,
    }
    text = json.dumps(doc, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _recorded(stage: Path) -> tuple[dict[str, Any], object] | None:
    """The interrupted run's (source identity, recipe); ``({}, None)`` when its record is damaged."""
    p = stage / JOURNAL
    if not p.is_file():
        return None
    first = p.read_bytes().partition(b"\n")[0]
    try:  # a damaged journal (not UTF-8, not JSON, nested past the recursion limit) recorded nothing
        rec = json.loads(first.decode("utf-8"))
    except (ValueError, RecursionError):
        return {}, None
    source = rec.get("source") if isinstance(rec, dict) else None
    if not isinstance(source, dict) or not all(isinstance(v, dict) for v in source.values()):
        return {}, None
    return source, rec.get("recipe")


def _changes(old: dict[str, Any], new: dict[str, dict[str, Any]]) -> list[str]:
    out = [f"{shown(n)} is new" for n in new if n not in old]
    out += [f"{shown(n)} is gone" for n in old if n not in new]
    for n, rec in new.items():
        was = old.get(n)
        if isinstance(was, dict):
            out += [
                f"{shown(n)}: {key} {was.get(key)} -> {rec.get(key)}"
                for key in ("size", "checksum", "mtime_ns")
                if was.get(key) != rec.get(key)
            ][:1]
    return out


def start_journal(
    stage: Path, identity: dict[str, dict[str, Any]], *, resume: bool, made_by: str = ""
) -> str | None:
    """Begin (or, resuming, check) the journal of a run writing into ``stage``.

    ``made_by`` is the run's :func:`recipe`. Resuming with another recipe starts a new
    journal, so no finished file is kept: the message saying so is returned (else None).

    Raises:
        UsageError: resuming onto a source that changed since the interrupted run.
    """
    old = _recorded(stage) if resume else None
    note = None
    if old is not None:
        source, was = old
        changed = _changes(source, identity) if source else ["the interrupted run did not record it"]
        if changed:
            raise UsageError(
                f"{stage.parent}: the source changed since the interrupted run ({'; '.join(changed[:3])}); "
                "the files kept would mix two sources: rerun with --overwrite instead of --resume",
                path=str(stage.parent),
            )
        if was == made_by:
            return None
        note = (
            f"{stage.parent}: the interrupted run converted with other options (source layout, "
            "transforms, target layout, format or dtype); its finished files are not kept: every "
            "file is written again"
        )
    for p in stage.glob(JOURNAL + "*"):
        p.unlink()
    _append(stage / JOURNAL, json.dumps({"source": identity, "recipe": made_by}, sort_keys=True))
    return note


def record_finished(stage: Path, result: FileResult, rank: int = 0) -> None:
    """Append one finished file to the journal (one line, flushed; one journal per torchrun rank)."""
    line = json.dumps({"name": result.name, "size": result.size, "checksum": result.checksum})
    _append(stage / (JOURNAL if rank == 0 else f"{JOURNAL}.{rank}"), line)


def _journal(stage: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for p in sorted(stage.glob(JOURNAL + "*")):
        for line in p.read_bytes().splitlines():
            try:
                rec = json.loads(line.decode("utf-8"))
                out[str(rec["name"])] = rec
            except (ValueError, KeyError, TypeError, RecursionError):
                continue  # the source record, or a torn (or damaged) line
    return out


def _header_matches(path: Path, f: OutFile) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(f.prefix)) == f.prefix


def finished_files(
    plan: Plan, stage: Path, files: list[OutFile] | None = None
) -> tuple[list[FileResult], list[OutFile]]:
    """Split ``files`` (default: all the plan's) into (kept results, files still to write)."""
    journal = _journal(stage)
    done: list[FileResult] = []
    todo: list[OutFile] = []
    for f in plan.files if files is None else files:
        p = stage / f.name
        rec = journal.get(f.name)
        if (
            rec is not None
            and p.is_file()
            and not p.is_symlink()
            and p.stat().st_size == f.size == rec.get("size")
            and _header_matches(p, f)
            and file_checksum(p) == rec.get("checksum")
        ):
            done.append(FileResult(f.name, f.size, str(rec["checksum"])))
        else:
            p.unlink(missing_ok=True)
            todo.append(f)
    return done, todo
