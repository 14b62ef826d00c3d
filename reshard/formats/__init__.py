"""The format registry: every readable and writable checkpoint format, in detection order.

A format is one module here defining ``READER`` (a :class:`~reshard.formats.base.Reader`)
and, when reshard writes it, ``WRITER`` (a :class:`~reshard.formats.base.Writer`), plus
one line in :data:`_FORMATS` below. ``--from``/``--to`` choices, their help, the README's
format list and :func:`detect_format` all come from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import Checkpoint
from ..errors import HeaderError, ReshardError, UsageError
from ..io.header import forget_shared
from ..io.staging import STAGE
from . import dcp, dcp_safetensors, dcp_writer, hf, per_rank, pt, sharded_state
from .base import NO, Probe, Reader, ReadOptions, Writer
from .manifest import MANIFEST, read_manifest

if TYPE_CHECKING:
    from ..config import LayoutConfig

__all__ = [
    "MANIFEST",
    "readers",
    "writers",
    "reader",
    "writer",
    "register",
    "unregister",
    "detect_format",
    "open_checkpoint",
    "read_manifest",
    "markdown",
]

# Detection priority: on equal confidence the earlier format wins.
_FORMATS = [dcp, dcp_safetensors, hf, per_rank, sharded_state, pt, dcp_writer]

_READERS: dict[str, Reader] = {}
_WRITERS: dict[str, Writer] = {}


def register(
    fmt_reader: Reader | None = None, fmt_writer: Writer | None = None, *, first: bool = False
) -> None:
    """Add a format at run time (a plugin, a test); ``first``: it wins detection ties."""
    global _READERS, _WRITERS
    if fmt_reader is not None:
        rest = {k: v for k, v in _READERS.items() if k != fmt_reader.name}
        _READERS = {fmt_reader.name: fmt_reader, **rest} if first else {**rest, fmt_reader.name: fmt_reader}
    if fmt_writer is not None:
        _WRITERS[fmt_writer.name] = fmt_writer


def unregister(name: str) -> None:
    """Remove a format registered at run time (both its reader and writer)."""
    _READERS.pop(name, None)
    _WRITERS.pop(name, None)


for _module in _FORMATS:
    register(getattr(_module, "READER", None), getattr(_module, "WRITER", None))


def readers() -> list[Reader]:
    """Every readable format, in detection priority order."""
    return list(_READERS.values())


def writers() -> list[Writer]:
    """Every writable format."""
    return list(_WRITERS.values())


def reader(name: str) -> Reader:
    """The reader of a format name (``--from``).

    Raises:
        UsageError: no such readable format.
    """
    r = _READERS.get(name)
    if r is None:
        raise UsageError(f"--from {name!r}: unknown format (use {', '.join(_READERS)})")
    return r


def writer(name: str) -> Writer:
    """The writer of a format name (``--to``).

    Raises:
        UsageError: no such writable format.
    """
    w = _WRITERS.get(name)
    if w is None:
        raise UsageError(f"--to {name!r}: use {' or '.join(_WRITERS)}")
    return w


def detect_format(path: Path) -> str:
    """Which format a path holds: ``reshard.json``'s word, else the most confident reader.

    Raises:
        UsageError: the path does not exist or holds no recognisable checkpoint.
    """
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory", path=str(path))
    probe = Probe.of(path)
    if not probe.is_file:
        manifest = read_manifest(path)
        if manifest is not None and manifest.get("format") in _READERS:
            return str(manifest["format"])
    best_name = _best_reader(probe)
    if best_name is not None:
        return best_name
    if probe.is_file:
        raise UsageError(f"{path}: not a .safetensors file or a checkpoint directory", path=str(path))
    inner = _checkpoint_subdirs(path)
    if inner:
        raise UsageError(
            f"{path}: no checkpoint in the directory itself, but {_listed(inner)}; give one of them as "
            f"the path (e.g. {_example(path, inner)})",
            path=str(path),
        )
    raise UsageError(
        f"{path}: no checkpoint found (expected "
        + "; ".join(f"{r.name}: {r.help}" for r in _READERS.values())
        + ")",
        path=str(path),
    )


#: Sub-directories looked into for :func:`_checkpoint_subdirs` (accelerate's ``save_state``
#: holds two or three, torchtitan's ``checkpoint/`` one per saved step).
_MAX_SUBDIRS = 64


def _checkpoint_subdirs(path: Path) -> list[tuple[str, str]]:
    """``(name, format)`` of the sub-directories of ``path`` a reader recognises, sorted by name
    (accelerate's ``save_state`` output: ``pytorch_model_fsdp_0/``, ``optimizer_0/``; torchtitan's
    ``checkpoint/step-N/``); [] when it has none, or more than :data:`_MAX_SUBDIRS`."""
    try:
        subs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    found = []
    for sub in subs[:_MAX_SUBDIRS]:
        try:
            probe = Probe.of(sub)
        except (OSError, UsageError):
            continue
        best_name = _best_reader(probe)
        if best_name is not None:
            found.append((sub.name, best_name))
    return found


def _best_reader(probe: Probe) -> str | None:
    """The name of the reader most sure it reads ``probe``, or None when none is."""
    best, best_name = NO, None
    for r in _READERS.values():
        score = r.detect(probe)
        if score > best:
            best, best_name = score, r.name
    return best_name


def _example(path: Path, inner: list[tuple[str, str]]) -> Path:
    """The sub-directory to name in the hint: the model's when one is named so."""
    return path / next((n for n, _ in inner if "model" in n.lower()), inner[0][0])


def _listed(inner: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{name}/ ({fmt})" for name, fmt in inner[:6]) + (", ..." if len(inner) > 6 else "")
    return f"its sub-director{'y holds a checkpoint' if len(inner) == 1 else 'ies hold checkpoints'}: {shown}"


def open_checkpoint(
    path: str | Path,
    *,
    fmt: str | None = None,
    layout: LayoutConfig | None = None,
    mesh_sizes: dict[str, int] | None = None,
) -> Checkpoint:
    """Open a checkpoint of any readable format.

    Args:
        path: a checkpoint directory, or one file.
        fmt: force a format (``--from``); default: :func:`detect_format`.
        layout: ``--source-layout``, for formats that do not describe their layout
            (or to override their description).
        mesh_sizes: override mesh dim sizes of the layout (``--source-mesh``).
    """
    p = Path(path)
    _refuse_interrupted_swap(p)
    detected = fmt is None
    if fmt is None:
        fmt = detect_format(p)
    r = reader(fmt)
    if not p.exists():
        raise UsageError(f"{p}: no such file or directory", path=str(p))
    try:
        ckpt = r.open(p, ReadOptions(layout, mesh_sizes))
    except ReshardError as e:
        # a pt guess from files beside the checkpoints (HF Trainer's rng_state_{r}.pth next to
        # accelerate's pytorch_model_fsdp_0/): say where the checkpoints are
        if detected and r.name == "pt" and e.hint is None and p.is_dir():
            inner = _checkpoint_subdirs(p)
            if inner:
                e.hint = f"{_listed(inner)}: give one of them as the path (e.g. {_example(p, inner)})"
        raise
    finally:
        forget_shared()
    if ckpt.manifest is None and p.is_dir():
        ckpt.manifest = read_manifest(p)
    if r.name in ("pt", "dcp"):  # names from pickles; safetensors headers are checked as decoded
        _check_names_encode(ckpt)
    if r.name == "pt" and not ckpt.tensors and ckpt.non_tensors:
        _no_tensors(p, ckpt)
    return ckpt


def _refuse_interrupted_swap(path: Path) -> None:
    """A directory a ``convert`` was swapping its new checkpoint into when it was killed: the
    staging directory holds the new checkpoint whole, DST part of it (read as it is, it was
    taken for a checkpoint)."""
    staged = path / STAGE / MANIFEST
    if path.is_dir() and staged.is_file():
        raise UsageError(
            f"{path}: a reshard convert into this directory was interrupted while it moved its new "
            f"checkpoint in ({STAGE}/ holds it whole; the files here are part of it); run the same "
            "convert again (with --overwrite) to finish the move, then read it",
            path=str(path),
        )


def _no_tensors(path: Path, ckpt: Checkpoint) -> None:
    """A ``torch.save`` file of no tensors at all (accelerate's ``scheduler.bin`` beside the model's
    sub-directories) is no checkpoint of weights: converting it wrote an empty model, exit 0."""
    names = ", ".join(n.name for n in ckpt.non_tensors[:3]) + (", ..." if len(ckpt.non_tensors) > 3 else "")
    what = f"{path}: {', '.join(Path(f).name for f in ckpt.files)}" if path.is_dir() else f"{path}:"
    inner = _checkpoint_subdirs(path) if path.is_dir() else []
    where = ""
    if inner:
        where = f"; {_listed(inner)}: give one of them as the path (e.g. {_example(path, inner)})"
    raise UsageError(
        f"{what} holds no tensors, only {len(ckpt.non_tensors)} other value(s) ({names}): "
        f"not a checkpoint of weights{where}",
        path=str(path),
    )


def _check_names_encode(ckpt: Checkpoint) -> None:
    """A pickled name holding an unpaired surrogate (``"a\\udcff"``) is no UTF-8 text: no
    safetensors header can name it (it failed as a traceback when the output header was made)."""
    names = list(ckpt.tensors)
    try:
        "\n".join(names).encode("utf-8")
    except UnicodeEncodeError:
        from ..text import shown

        bad = next(n for n in names if not n.isascii() and _unencodable(n))
        raise HeaderError(
            f"{ckpt.path}: tensor name {shown(bad)} holds an unpaired surrogate; no UTF-8 "
            "(safetensors) name can hold it: rename it with torch and re-save",
            path=str(ckpt.path),
            tensor=bad,
        ) from None


def _unencodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def markdown() -> str:
    """The README's format list (``python -m reshard.formats`` prints it)."""
    lines = ["Read (detected, in this order of priority; `--from` forces one):"]
    lines += [f"- **{r.name}**: {r.help}" for r in readers()]
    lines += ["", "Write (`--to`):"]
    lines += [f"- **{w.name}**: {w.help}" for w in writers()]
    return "\n".join(lines) + "\n"
