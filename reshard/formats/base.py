"""The two halves of a checkpoint format: a :class:`Reader` and a :class:`Writer`.

A format is one module under ``reshard/formats/`` that defines ``READER`` (and,
when reshard can write it, ``WRITER``) and one line in the registry,
:mod:`reshard.formats`. Nothing else in reshard knows a format by name except the
CLI's defaults (``--consolidate`` means ``hf``; a multi-rank target defaults to
``per-rank``).

Reader: ``detect(probe) -> confidence`` and ``open(path, options) -> Checkpoint``.
The checkpoint lists every tensor as pieces (a row-major block of the global
tensor at an absolute byte offset of one file); everything downstream (plan,
convert, verify, ``inspect --check``, ``load_dtensors``) works on that.

Writer: ``files(tensors, mesh, options) -> [OutFile]`` lays out each output file
(fixed bytes, tensor entries at absolute offsets, optional CRC32 patches) and
``complete(dst, plan, results)`` writes what makes a finished directory (an
index, a ``.metadata``, and :func:`reshard.formats.manifest.complete_with_manifest` last).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import Checkpoint
from ..errors import UsageError
from ..io.safe import file_kind
from ..mesh import Mesh
from ..plan import OutFile, Plan, TargetTensor, WriteOptions

if TYPE_CHECKING:
    from ..config import LayoutConfig
    from ..io.writer import FileResult

__all__ = ["NO", "MAYBE", "YES", "Probe", "ReadOptions", "Reader", "Writer"]

#: Detection confidences. The registry takes the highest; on a tie the earlier format wins.
NO = 0
MAYBE = 1
"""The path could hold this format (a fallback, e.g. "one .safetensors file")."""
YES = 2
"""The path holds files named as only this format names them."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What detection looks at: the path, and the names of the files in it (listed once).

    Attributes:
        path: the path given on the command line.
        is_file: whether ``path`` is a file (then ``names`` is just its name).
        names: names of the regular files in the directory, sorted.
    """

    path: Path
    is_file: bool
    names: tuple[str, ...]

    @classmethod
    def of(cls, path: Path) -> Probe:
        """Probe ``path``.

        Raises:
            UsageError: ``path`` is neither a regular file nor a directory (a FIFO,
                ``/dev/zero``): reading it would block or never end.
        """
        kind = file_kind(path.stat().st_mode)
        if kind is not None and not path.is_dir():
            raise UsageError(f"{path}: is {kind}, not a checkpoint file or directory", path=str(path))
        if path.is_file():
            return cls(path, True, (path.name,))
        return cls(path, False, tuple(sorted(p.name for p in path.iterdir() if p.is_file())))

    def with_suffix(self, suffix: str) -> list[str]:
        """File names ending in ``suffix`` (e.g. ``.safetensors``)."""
        return [n for n in self.names if n.endswith(suffix)]


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What the user said about the source.

    Attributes:
        layout: ``--source-layout``, for formats that do not describe their layout.
        mesh_sizes: ``--source-mesh`` sizes overriding the layout's mesh.
    """

    layout: LayoutConfig | None = None
    mesh_sizes: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Reader:
    """How to recognise a format and open it as a :class:`~reshard.checkpoint.Checkpoint`.

    Attributes:
        name: the ``--from`` value and the ``Checkpoint.format`` it reports.
        help: one line for ``--help`` and the README.
        detect: confidence (:data:`NO`, :data:`MAYBE`, :data:`YES`) that a path holds it.
        open: open the path. Raises a :class:`~reshard.errors.ReshardError` naming the
            file and what to do on bad input; reads headers only, never tensor data.
    """

    name: str
    help: str
    detect: Callable[[Probe], int]
    open: Callable[[Path, ReadOptions], Checkpoint]


@dataclass(frozen=True, slots=True)
class Writer:
    """How to write a format: its output files, and how a finished directory is completed.

    Attributes:
        name: the ``--to`` value (and ``format`` in ``reshard.json``).
        help: one line for ``--help`` and the README.
        files: the output files for planned tensors on the target mesh; each file's
            :meth:`~reshard.plan.OutFile.lay_out` says where each byte goes.
        complete: called once on the main process after every file is in place, with
            the results in plan order: write index files, then ``reshard.json`` last
            (:func:`reshard.formats.manifest.complete_with_manifest`).
        consolidated: one consolidated checkpoint: every tensor whole (``--consolidate``).
        lockstep: the files are sibling ranks holding the same tensors cut differently;
            a worker then writes up to 8 of them slab by slab, sharing source reads.
        owns: file names (exact), name suffixes (starting with ``.``) or shell patterns
            (with ``*``) of the files this format writes, or that a checkpoint of its
            format holds (DCP's rank-local ``__0.metadata``); ``--overwrite`` and failure
            cleanup remove them.
        marks: files ``complete`` writes (before ``reshard.json``) whose presence tells
            other tools the checkpoint is finished (DCP's ``.metadata``): removed before
            any output file is written (``--resume`` too) and on failure, so an
            interrupted directory never looks finished.
        objects: ``complete`` carries over the source's non-tensor items that are one stored
            run (:attr:`~reshard.checkpoint.NonTensor.offset`), as they are (DCP's ``BYTE_IO``
            items: optimizer hyper-parameters, a step counter); other writers list them as
            not converted.
    """

    name: str
    help: str
    files: Callable[[Sequence[TargetTensor], Mesh, WriteOptions], list[OutFile]]
    complete: Callable[[Path, Plan, Sequence[FileResult]], None]
    consolidated: bool = False
    lockstep: bool = False
    owns: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()
    objects: bool = False
