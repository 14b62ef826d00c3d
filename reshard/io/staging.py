"""Write a checkpoint beside the one it replaces, then swap: never neither.

A conversion writes every file, its index and ``reshard.json`` into
``DST/.reshard-staging/``. Only when that directory holds a finished checkpoint
(its ``reshard.json``, written last) does :meth:`Stage.swap` replace the
previous checkpoint in ``DST``: remove the old ``reshard.json`` (DST is now
unfinished), remove the old checkpoint's other files (also those a new file
replaces by name), rename the new files in, the files naming the others (DCP's
``.metadata``, the HF index) after them, ``reshard.json`` last. A failure (a
full disk) before the swap leaves the previous checkpoint untouched. An
interruption during the swap leaves the new checkpoint finished in the staging
directory, and the next run in ``DST`` completes the swap first
(:meth:`Stage.recover`); readers refuse ``DST`` until then. ``--resume`` keeps the
staging directory's finished files.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import UsageError
from .writer import is_temp

__all__ = ["STAGE", "Stage", "refuse_non_files"]

STAGE = ".reshard-staging"


def refuse_non_files(directory: Path, names: Iterable[str]) -> None:
    """Refuse output names that exist in ``directory`` as links or directories.

    Raises:
        UsageError: naming the first such entry.
    """
    for name in names:
        try:
            st = os.stat(directory / name, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            what = "a symbolic link"
        elif not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        else:
            continue
        raise UsageError(
            f"{directory / name}: is {what} where reshard writes an output file; reshard replaces "
            "only regular files it wrote: remove it or choose another destination",
            path=str(directory / name),
        )


class Stage:
    """``DST/.reshard-staging``: where a run writes before the swap.

    Args:
        dst: the destination directory (locked by the caller).
        marker: the name written last that marks a finished checkpoint (``reshard.json``).
    """

    def __init__(self, dst: Path, marker: str) -> None:
        self.dst = dst
        self.dir = dst / STAGE
        self.marker = marker

    def _exists(self) -> bool:
        try:
            st = os.stat(self.dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(
                f"{self.dir}: is not a directory reshard made (a link or a file); remove it",
                path=str(self.dir),
            )
        return True

    def prepare(self, *, keep: bool) -> None:
        """Create the staging directory; ``keep`` (``--resume``): keep its finished files."""
        if self._exists() and not keep:
            shutil.rmtree(self.dir)
        self.dir.mkdir(exist_ok=True)
        self.remove_temporaries()

    def remove_temporaries(self) -> None:
        """Remove this directory's temporaries (a killed run's; no other run holds the lock)."""
        if self._exists():
            for name in os.listdir(self.dir):
                if is_temp(name):
                    (self.dir / name).unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove the staging directory and everything in it."""
        if self._exists():
            shutil.rmtree(self.dir, ignore_errors=True)

    def recover(self, owned: Callable[[str], bool], skip: Callable[[str], bool]) -> bool:
        """Finish a swap an earlier run was interrupted in; True when there was one."""
        if not (self._exists() and (self.dir / self.marker).is_file()):
            return False
        self.swap(owned, skip)
        return True

    def swap(self, owned: Callable[[str], bool], skip: Callable[[str], bool]) -> None:
        """Replace DST's checkpoint by the staged one (see the module doc for the order).

        Args:
            owned: whether a name in DST is a checkpoint file reshard may remove.
            skip: staged names not to move (the resume journals).
        """
        # data files first, then what names them (DCP's .metadata, the HF index), reshard.json last
        names = sorted(
            (n for n in os.listdir(self.dir) if not (is_temp(n) or skip(n) or n == self.marker)),
            key=lambda n: (n.startswith(".") or n.endswith(".json"), n),
        )
        refuse_non_files(self.dst, names)
        (self.dst / self.marker).unlink(missing_ok=True)
        # every previous file goes, also those the new checkpoint replaces by name: an interruption
        # must not leave DST holding new files beside old ones of one name set (rank 0 new, rank
        # 1 old: a checkpoint that reads as whole, of two sources)
        for name in os.listdir(self.dst):
            if owned(name) and (self.dst / name).is_file():
                (self.dst / name).unlink()
        for name in [*names, self.marker]:
            os.replace(self.dir / name, self.dst / name)
        _fsync_dir(self.dst)
        shutil.rmtree(self.dir, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable (the directory entry), where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
