"""One library call per command: ``reshard convert | inspect | plan | verify`` as functions.

:func:`convert_checkpoint`, :func:`inspect_checkpoint`, :func:`plan_conversion` and
:func:`compare_checkpoints` (named apart from the modules ``reshard.convert``,
``reshard.plan`` and ``reshard.verify``, which ``reshard.NAME`` would otherwise be).

Each returns the body of the command's ``--json`` document (the same keys, without
``schema``/``ok``/``command``) and raises :class:`reshard.errors.ReshardError` where the
command would exit 2 or 3. ``import reshard`` re-exports them lazily, so it stays free
of torch and of this module until one is called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .budget import budget_for, default_workers
from .check import check_checkpoint, checks_made
from .convert import SourceSpec, TargetSpec, build_plan, open_source, parse_size, resolve_target
from .convert import convert as _convert
from .errors import UsageError
from .report import inspect_report, plan_report
from .transform_plan import transforms_for
from .verify import verify_checkpoints, with_repeats, with_replicas

__all__ = [
    "convert_checkpoint",
    "inspect_checkpoint",
    "plan_conversion",
    "compare_checkpoints",
    "verify_output",
]

PathLike = str | os.PathLike[str]


def _target(**kw: Any) -> TargetSpec:
    return TargetSpec(
        layout=kw["target_layout"],
        mesh=kw["target_mesh"],
        to=kw["to"],
        consolidate=kw["consolidate"],
        dtype=kw["dtype"],
        max_shard_size=kw["max_shard_size"],
        config_from=kw.get("config_from"),
        transforms=kw.get("transforms"),
        inverse=kw.get("inverse", False),
        model_config=kw.get("model_config"),
        allow_unused=kw.get("allow_unused", False),
        sets=tuple(kw.get("sets", ())),
    )


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    *,
    target_mesh: str | None = None,
    target_layout: str | None = None,
    to: str | None = None,
    consolidate: bool = False,
    dtype: str | None = None,
    source_layout: str | None = None,
    source_mesh: str | None = None,
    config_from: str | None = None,
    max_shard_size: str = "5GB",
    workers: int | None = None,
    max_memory: str = "64MiB",
    overwrite: bool = False,
    resume: bool = False,
    verify: bool = False,
    transforms: str | None = None,
    inverse: bool = False,
    model_config: str | None = None,
    allow_unused: bool = False,
    sets: Sequence[str] = (),
) -> dict[str, Any]:
    """``reshard convert SRC DST ...``; options as the CLI's (``target_mesh="tp=8"``: ``--target-mesh tp=8``).

    With ``verify=True`` the result has ``"verify"`` (:func:`verify_output`); a difference
    does not raise: check ``result["verify"]["equal"]``.
    """
    if verify and dtype is not None:
        raise UsageError("--verify proves the output bit-identical to the source; --dtype changes the bits")
    source = SourceSpec(str(src), None, source_layout, source_mesh)
    budget = budget_for(parse_size(max_memory, option="--max-memory"), workers or default_workers())
    target = _target(**locals())
    result = _convert(
        source,
        dst,
        target,
        workers=budget.workers,
        buffer_size=budget.buffer,
        window=budget.window,
        overwrite=overwrite,
        resume=resume,
    )
    if verify:
        result["verify"] = verify_output(source, dst, target)
    return result


def verify_output(source: SourceSpec, dst: PathLike, target: TargetSpec | None = None) -> dict[str, Any]:
    """``convert --verify``: the written ``dst`` against the source, bit for bit (rank 0 under torchrun);
    with the target's transforms, the source seen through them."""
    from .dist import coordinator

    if not coordinator().is_main:
        return {"equal": True}
    ck = open_source(source)
    if target is not None:
        tf = transforms_for(
            ck,
            transforms=target.transforms,
            layout=target.layout,
            inverse=target.inverse,
            model_config=target.model_config,
            allow_unused=target.allow_unused,
            sets=target.sets,
        )
        ck = tf.checkpoint(ck) if tf is not None else ck
    return dict(verify_checkpoints(ck, open_source(SourceSpec(str(dst)))))


def inspect_checkpoint(path: PathLike, *, layout: str | None = None, check: bool = False) -> dict[str, Any]:
    """``reshard inspect PATH [--check]``: format, mesh, files, tensors; with ``check``, ``"check"``."""
    ck = open_source(SourceSpec(str(path), None, layout, None))
    doc = inspect_report(ck)
    if check:
        problems = check_checkpoint(ck)
        doc["check"] = {"ok": not problems, "problems": problems, "verified": checks_made(ck)}
    return doc


def plan_conversion(
    src: PathLike,
    *,
    target_mesh: str | None = None,
    target_layout: str | None = None,
    to: str | None = None,
    consolidate: bool = False,
    dtype: str | None = None,
    source_layout: str | None = None,
    max_shard_size: str = "5GB",
    workers: int | None = None,
    max_memory: str = "64MiB",
    transforms: str | None = None,
    inverse: bool = False,
    model_config: str | None = None,
    allow_unused: bool = False,
    sets: Sequence[str] = (),
) -> dict[str, Any]:
    """``reshard plan SRC ...``: what :func:`convert_checkpoint` would read and write; writes nothing."""
    ck = open_source(SourceSpec(str(src), None, source_layout, None))
    budget = budget_for(parse_size(max_memory, option="--max-memory"), workers or default_workers())
    return plan_report(build_plan(ck, resolve_target(ck, _target(**locals()))), budget)


def compare_checkpoints(
    a: PathLike,
    b: PathLike,
    *,
    layout_a: str | None = None,
    layout_b: str | None = None,
    transforms: str | None = None,
    inverse: bool = False,
    model_config: str | None = None,
    allow_unused: bool = False,
    sets: Sequence[str] = (),
) -> dict[str, Any]:
    """``reshard verify A B``: ``"equal"`` when both hold the same tensors bit for bit
    (with ``transforms``: A seen through them, and the copies a split reads once compared
    with the copy read).

    Otherwise ``"differences"`` lists them (missing, extra, dtype, shape, values, replica).
    """
    ca = open_source(SourceSpec(str(a), None, layout_a, None))
    cb = open_source(SourceSpec(str(b), None, layout_b, None))
    tf = transforms_for(
        ca,
        transforms=transforms,
        inverse=inverse,
        model_config=model_config,
        allow_unused=allow_unused,
        sets=sets,
    )
    if tf is None:
        return dict(with_replicas(verify_checkpoints(ca, cb), ca, cb))
    seen = tf.checkpoint(ca)
    return dict(with_repeats(with_replicas(verify_checkpoints(seen, cb), seen, cb), ca, tf.repeats(ca)))
