"""Read-only work split over forked processes: the other CPUs of a machine, without threads.

Comparing and checking 100k tensors is Python work per tensor, which threads cannot spread
over CPUs (the GIL). A forked child starts with the parent's opened checkpoints and plans
as they are (no pickling, no second parse), does its share and sends back a small result
(differences found, counts) through a pipe. Only work that writes nothing is split this
way: a child killed or failing leaves nothing behind, and the parent reports its error as
its own.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import ReshardError

__all__ = ["cpus", "run_split", "usable"]

T = TypeVar("T")

_MAX = 4
"""At most this many processes: the work split this way reads page-cached bytes and compares
them; past a few processes memory bandwidth, not CPUs, is what limits it."""


def cpus() -> int:
    """The CPUs this process may run on (its affinity), at most :data:`_MAX`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(_MAX, n))


def usable() -> bool:
    """Whether forking is safe here: Linux, no other thread running (a child of a
    multi-threaded process may inherit a lock some other thread held at the fork), torch not
    imported (its OpenMP pool does not survive a fork: a child's first parallel op can hang;
    reshard imports torch only for reductions, casts and torchrun), and not disabled by
    ``RESHARD_NO_FORK=1``."""
    return (
        sys.platform == "linux"
        and hasattr(os, "fork")
        and threading.active_count() == 1
        and "torch" not in sys.modules
        and os.environ.get("RESHARD_NO_FORK", "") in ("", "0")
    )


def run_split(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Results of ``jobs`` in order: ``jobs[0]`` run here, each other in a forked child.

    A job's result must pickle (it comes back through a pipe). An exception a child raises
    is raised here as the parent's (the first in job order, after every child has ended);
    a child that dies without a result (killed, out of memory) is a :class:`ReshardError`.
    Without :func:`usable` forking, or with one job, all run here in turn.
    """
    if len(jobs) <= 1 or not usable():
        return [job() for job in jobs]
    children: list[tuple[int, int]] = []  # (pid, read end of its pipe)
    try:
        for job in jobs[1:]:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child (its coverage is not collected)
                os.close(r)
                _child(job, w)
            os.close(w)
            children.append((pid, r))
        first = jobs[0]()
        answers = []
        while children:
            pid, r = children.pop(0)
            try:
                answers.append(_collect(pid, r))
            except BaseException:
                _kill(pid)
                raise
    finally:
        for pid, r in children:  # the parent's own job failed (or was interrupted)
            _kill(pid)
            os.close(r)
    results: list[T] = [first]
    for kind, value in answers:
        if kind == "error":
            raise _rebuilt(value)
        results.append(value)
    return results


def _child(job: Callable[[], Any], w: int) -> None:  # pragma: no cover - runs in the child
    """Run ``job``, write its pickled outcome to ``w``, and leave without the parent's exit
    handlers or buffered output (``os._exit``)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the parent reports it
        try:
            data = pickle.dumps(("ok", job()), pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
            data = pickle.dumps(("error", _portable(e)), pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:  # noqa: BLE001 - nothing may escape the child
        code = 1
    finally:
        os._exit(code)


def _portable(e: BaseException) -> tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]:
    """``e`` as (type, args, attributes) that rebuild it without calling its ``__init__``;
    an exception that does not pickle becomes a :class:`ReshardError` with its message."""
    value = (type(e), e.args, dict(vars(e)))
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any unpicklable part
        return (ReshardError, (f"{type(e).__name__}: {e}",), {"message": f"{type(e).__name__}: {e}"})
    return value


def _rebuilt(value: tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]) -> BaseException:
    cls, args, attrs = value
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(attrs)
    return e


def _collect(pid: int, r: int) -> tuple[str, Any]:
    """The outcome a child sent, after it has ended."""
    chunks = []
    try:
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        sig = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        raise ReshardError(
            f"a worker process ended without a result (exit status {sig}): out of memory or killed?",
            hint="run again; RESHARD_NO_FORK=1 does the work in one process",
        )
    kind, value = pickle.loads(data)
    return kind, value


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
