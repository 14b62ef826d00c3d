r"""``--include`` / ``--exclude``: keep a subset of a checkpoint's entries by name (pure).

Patterns are the layout rules' patterns (:func:`reshard.config._compile`): a
shell glob over the whole name where ``*`` crosses dots (``optimizer.*``), or a
``re:`` regex matched with ``re.fullmatch``. An entry is kept when no include
pattern is given or one matches it, and no exclude pattern matches it. Entries
are the tensors and the non-tensor items (DCP ``BYTE_IO``) alike. A pattern
that matches no entry is a warning, not an error: the same command line can
serve checkpoints with and without optimizer state. Patterns that together keep
no entry of a checkpoint that has some are an error (exit 2): a typo would
otherwise write an empty checkpoint, or let ``verify`` and ``inspect --check``
pass having compared nothing.

>>> selected(["model.w", "optimizer.state.w.exp_avg"], exclude=["optimizer.*", "lr_scheduler.*"])
(['model.w'], [('--exclude', 'lr_scheduler.*')])
>>> selected(["a.0.w", "a.1.w", "b"], include=[r"re:a\.\d+\.w"])[0]
['a.0.w', 'a.1.w']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from .checkpoint import UNREADABLE, Checkpoint, CheckpointWarning
from .config import Matcher, _compile
from .errors import ConfigError, UsageError

__all__ = ["select_checkpoint", "select_pair", "selected", "without_excluded"]


def _patterns(option: str, patterns: Sequence[str]) -> list[tuple[str, Matcher]]:
    out = []
    for p in patterns:
        try:
            out.append((p, _compile(p)))
        except ConfigError as e:
            raise UsageError(f'{option} "{p}": {e.message}') from None
    return out


def selected(
    names: Iterable[str], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> tuple[list[str], list[tuple[str, str]]]:
    """The names kept, in order, and the ``(option, pattern)`` pairs that matched no name.

    Raises:
        UsageError: a pattern is not a valid glob or ``re:`` regex.
    """
    inc = _patterns("--include", include)
    exc = _patterns("--exclude", exclude)
    used: set[tuple[str, str]] = set()
    kept = []
    for name in names:
        hit_inc = [("--include", p) for p, rx in inc if rx.fullmatch(name)]
        hit_exc = [("--exclude", p) for p, rx in exc if rx.fullmatch(name)]
        used.update(hit_inc, hit_exc)
        if (not inc or hit_inc) and not hit_exc:
            kept.append(name)
    unused = [("--include", p) for p, _ in inc] + [("--exclude", p) for p, _ in exc]
    return kept, [u for u in unused if u not in used]


LEFT_OUT = "(left out by --include/--exclude)"
"""Key of a filtered checkpoint's manifest copy: how many of the tensors ``tensor_count`` counts
its files hold but the patterns left out (not a key ``reshard.json`` can have: it is never written)."""


def _unmatched(unused: Sequence[tuple[str, str]], where: str) -> list[CheckpointWarning]:
    return [CheckpointWarning(f'{opt} "{p}" matches nothing in {where}') for opt, p in unused]


def select_checkpoint(
    ckpt: Checkpoint, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> tuple[Checkpoint, list[CheckpointWarning]]:
    """``ckpt`` with only the tensors and non-tensor items the patterns keep.

    Returns:
        The filtered checkpoint (``ckpt`` itself when no pattern is given; else a
        copy, whose manifest lists only the kept tensors and whose warnings
        include the returned ones) and a warning per pattern that matched nothing.

    Raises:
        UsageError: a pattern is not a valid glob or ``re:`` regex, or the patterns keep no
            entry of a checkpoint that has some.
    """
    out, unused = _select(ckpt, include, exclude)
    _refuse_empty((ckpt,), (out,), include, exclude)
    warnings = _unmatched(unused, ckpt.path)
    out.warnings.extend(warnings)
    return out, warnings


def without_excluded(ckpt: Checkpoint, exclude: Sequence[str]) -> tuple[Checkpoint, list[str]]:
    """``ckpt`` less what ``exclude`` matches, without warnings, and the patterns that matched
    (``verify --transforms``: A's own entries go before the transforms, as ``convert`` drops
    them, e.g. an incomplete last layer; the patterns then filter both sides after them).

    Raises:
        UsageError: a pattern is not a valid glob or ``re:`` regex.
    """
    out, unused = _select(ckpt, (), exclude)
    return out, [p for p in exclude if ("--exclude", p) not in unused]


def select_pair(
    a: Checkpoint,
    b: Checkpoint,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    matched: Sequence[str] = (),
) -> tuple[Checkpoint, Checkpoint, list[CheckpointWarning]]:
    """Both checkpoints filtered alike (``verify``); a pattern warns only when it matches in neither
    (nor is one of the exclusions ``matched`` already, see :func:`without_excluded`).

    Raises:
        UsageError: a pattern is not a valid glob or ``re:`` regex, or the patterns keep no
            entry of either checkpoint.
    """
    sa, ua = _select(a, include, exclude)
    sb, ub = _select(b, include, exclude)
    _refuse_empty((a, b), (sa, sb), include, exclude)
    done = {("--exclude", p) for p in matched}
    return sa, sb, _unmatched([u for u in ua if u in ub and u not in done], f"{a.path} or {b.path}")


def _entries(ckpt: Checkpoint) -> int:
    return len(ckpt.tensors) + len(ckpt.non_tensors)


def _refuse_empty(
    given: Sequence[Checkpoint], kept: Sequence[Checkpoint], include: Sequence[str], exclude: Sequence[str]
) -> None:
    """Raise when the patterns keep no entry of any of ``given`` (as ``kept``) though one has some."""
    if any(map(_entries, kept)) or not any(map(_entries, given)):
        return
    opts = " ".join([*(f'--include "{p}"' for p in include), *(f'--exclude "{p}"' for p in exclude)])
    where = " or ".join(f"{c.path} ({_entries(c)} entries)" for c in given)
    raise UsageError(
        f"{opts} keep no entry of {where}: nothing to do. "
        f"`reshard inspect {given[0].path}` lists the names (patterns match the whole name; "
        "`*` crosses dots; `re:` for a regex)",
        path=given[0].path,
    )


def _select(
    ckpt: Checkpoint, include: Sequence[str], exclude: Sequence[str]
) -> tuple[Checkpoint, list[tuple[str, str]]]:
    if not include and not exclude:
        return ckpt, []
    kept, unused = selected([*ckpt.tensors, *(n.name for n in ckpt.non_tensors)], include, exclude)
    keep = set(kept)
    odd = {n.name for n in ckpt.non_tensors if n.kind == UNREADABLE}
    tensors = {k: v for k, v in ckpt.tensors.items() if k in keep}
    dropped = len(ckpt.tensors) - len(tensors)
    manifest = ckpt.manifest
    if manifest is not None and isinstance(manifest.get("tensors"), dict):
        listed = manifest["tensors"]
        assert isinstance(listed, dict)
        manifest = {**manifest, "tensors": {k: v for k, v in listed.items() if k in keep}}
    if manifest is not None and "tensor_count" in manifest:  # version 2 counts them: the check adds these
        manifest = {**manifest, LEFT_OUT: dropped}
    out = dataclasses.replace(
        ckpt,
        tensors=tensors,
        non_tensors=tuple(n for n in ckpt.non_tensors if n.name in keep),
        manifest=manifest,
        # a tensor of a dtype reshard cannot convert, left out: its warning (which says to leave
        # it out) goes with it
        warnings=[w for w in ckpt.warnings if w.tensor is None or w.tensor in keep or w.tensor not in odd],
        left_out=ckpt.left_out + dropped,
    )
    return out, unused
