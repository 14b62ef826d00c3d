"""Library entry points behind the CLI: open a source, resolve a target, plan, convert."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .checkpoint import Checkpoint
from .config import LayoutConfig, load_layout, resolve_preset
from .errors import ConfigError, ReshardError, UsageError, WriteError
from .execute import DEFAULT_BUFFER, FileResult, execute_plan
from .formats import MANIFEST, open_checkpoint
from .formats.hf import INDEX
from .mesh import Mesh, parse_mesh_spec
from .plan import HF, PER_RANK, Plan, make_plan

__all__ = [
    "SourceSpec",
    "TargetSpec",
    "open_source",
    "resolve_target",
    "build_plan",
    "convert",
    "parse_size",
    "DTYPES",
    "manifest_for",
]

DTYPES = {
    "bf16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "fp32": "F32",
    "f32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
}


def parse_size(text: str, *, option: str = "--max-shard-size") -> int:
    """``5GB`` -> 5_000_000_000; ``512MiB`` -> 536_870_912; plain numbers are bytes.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size("100")
    (5000000000, 2097152, 100)
    """
    t = text.strip().upper().replace(" ", "")
    units = [
        ("KIB", 2**10),
        ("MIB", 2**20),
        ("GIB", 2**30),
        ("TIB", 2**40),
        ("KB", 10**3),
        ("MB", 10**6),
        ("GB", 10**9),
        ("TB", 10**12),
        ("B", 1),
    ]
    num, mult = t, 1
    for suffix, factor in units:
        if t.endswith(suffix):
            num, mult = t[: -len(suffix)], factor
            break
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected a size such as 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise ConfigError(f"{option} {text!r}: must be positive")
    return int(value * mult)


@dataclass(frozen=True, slots=True)
class SourceSpec:
    path: str
    fmt: str | None = None
    layout: str | None = None
    mesh: str | None = None
    include: tuple[str, ...] = ()  # --include / --exclude patterns (reshard.select)
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TargetSpec:
    layout: str | None = None
    mesh: str | None = None
    to: str | None = None
    consolidate: bool = False
    dtype: str | None = None
    max_shard_size: str = "5GB"


def _load_layout(text: str) -> LayoutConfig:
    return load_layout(resolve_preset(text))


def open_source(spec: SourceSpec) -> Checkpoint:
    """Open the source checkpoint named by ``spec``."""
    layout = _load_layout(spec.layout) if spec.layout else None
    sizes = parse_mesh_spec(spec.mesh, option="--source-mesh") if spec.mesh else None
    ckpt = open_checkpoint(spec.path, fmt=spec.fmt, layout=layout, mesh_sizes=sizes)
    if layout is not None:
        ckpt.warnings.extend(rule_warnings(layout, ckpt.tensors))
    if spec.include or spec.exclude:
        from .select import select_checkpoint

        ckpt, _ = select_checkpoint(ckpt, spec.include, spec.exclude)
    return ckpt


def merge_mesh(base: Mesh, sizes: dict[str, int]) -> Mesh:
    """``base`` with the named dims resized; new dims go before the first base dim named after them.

    >>> str(merge_mesh(Mesh(("tp",), (4,)), {"fsdp": 2, "tp": 4}))
    'fsdp=2,tp=4'
    >>> str(merge_mesh(Mesh(("fsdp", "tp"), (2, 4)), {"tp": 8}))
    'fsdp=2,tp=8'
    """
    names = list(base.names)
    shape = list(base.shape)
    pending: list[tuple[str, int]] = []
    for name, size in sizes.items():
        if name in names:
            i = names.index(name)
            shape[i] = size
            for n, s in reversed(pending):
                names.insert(i, n)
                shape.insert(i, s)
            pending = []
        else:
            pending.append((name, size))
    for n, s in pending:
        names.append(n)
        shape.append(s)
    return Mesh(tuple(names), tuple(shape))


@dataclass(frozen=True, slots=True)
class Target:
    fmt: str
    mesh: Mesh
    rules: LayoutConfig | None
    dtype: str | None
    max_shard_size: int


def resolve_target(source: Checkpoint, spec: TargetSpec) -> Target:
    """Decide the target format, mesh and rules (SPEC §4 convert).

    Raises:
        UsageError: the options contradict each other or say nothing about the target.
    """
    dtype = None
    if spec.dtype is not None:
        dtype = DTYPES.get(spec.dtype.lower())
        if dtype is None:
            raise UsageError(f"--dtype {spec.dtype!r}: use bf16, fp16 or fp32")
    max_shard = parse_size(spec.max_shard_size)
    to = spec.to
    if to is not None and to not in (PER_RANK, HF):
        raise UsageError(f"--to {to!r}: use per-rank or hf")
    if spec.consolidate:
        if to == PER_RANK:
            raise UsageError("--consolidate writes hf files; it cannot be combined with --to per-rank")
        to = HF
    sizes = parse_mesh_spec(spec.mesh, option="--target-mesh") if spec.mesh else None
    if to == HF and (spec.layout or sizes):
        if sizes and all(v == 1 for v in sizes.values()) and not spec.layout:
            sizes = None
        else:
            raise UsageError(
                "hf output is one consolidated checkpoint; drop --target-layout/--target-mesh, "
                "or write --to per-rank"
            )
    if to == HF:
        return Target(HF, Mesh.single(), None, dtype, max_shard)
    if spec.layout:
        cfg = _load_layout(spec.layout)
        mesh = merge_mesh(cfg.mesh, sizes) if sizes else cfg.mesh
        rules = cfg.with_mesh(mesh)
    elif sizes:
        base = source.layout
        if base is None:
            raise UsageError(
                f"{source.path}: the source ({source.format}) has no placement rules to reuse; "
                "give --target-layout FILE (or --consolidate)",
                path=source.path,
            )
        mesh = merge_mesh(base.mesh, sizes)
        rules = base.with_mesh(mesh)
    else:
        raise UsageError("say what to convert to: --target-layout FILE, --target-mesh tp=8, or --consolidate")
    fmt = to or (PER_RANK if mesh.size > 1 else HF)
    if fmt == HF:
        return Target(HF, Mesh.single(), None, dtype, max_shard)
    return Target(PER_RANK, mesh, rules, dtype, max_shard)


def rule_warnings(cfg: LayoutConfig, names: Any) -> list[str]:
    """SPEC §2: a rule that matches nothing is a warning."""
    return [
        f"{cfg.source}{':' + str(r.line) if r.line else ''}: rule {r.pattern!r} matches no tensor"
        for r in cfg.unused_rules(names)
    ]


def build_plan(source: Checkpoint, target: Target) -> Plan:
    rules = target.rules
    if rules is not None and rules is not source.layout:
        for w in rule_warnings(rules, source.tensors):
            if w not in source.warnings:
                source.warnings.append(w)

    def placements_for(name: str) -> Any:
        assert rules is not None
        return rules.placements_for(name)

    return make_plan(
        source,
        target.mesh,
        placements_for,
        fmt=target.fmt,
        dtype=target.dtype,
        max_shard_size=target.max_shard_size,
        rules=rules,
    )


def manifest_for(plan: Plan, results: list[FileResult]) -> dict[str, Any]:
    """The ``reshard.json`` of a finished conversion."""
    rules = plan.rules.to_json()["rules"] if plan.rules is not None else [["*", "R"]]
    return {
        "reshard": {"format_version": 1, "version": __version__},
        "format": plan.format,
        "mesh": plan.mesh.to_json(),
        "rules": rules,
        "tensors": {
            t.name: {"dtype": t.dtype, "shape": list(t.shape), "placements": t.layout.placement_strs()}
            for t in plan.tensors
        },
        "files": {r.name: {"size": r.size, "checksum": r.checksum} for r in results},
    }


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(src: Path, dst: Path, *, overwrite: bool, resume: bool = False) -> None:
    """Refuse a DST inside SRC, a SRC inside DST, and a non-empty DST without --overwrite."""
    s = src.resolve()
    d = dst.resolve()
    src_dir = s if s.is_dir() else s.parent
    # a single-file source: only its own directory is off limits (outputs would mix with it)
    if d == src_dir or (s.is_dir() and _is_within(d, src_dir)):
        raise UsageError(f"{dst}: the destination is inside the source {src}; choose another directory")
    if _is_within(src_dir, d):
        raise UsageError(f"{dst}: the destination contains the source {src}; choose another directory")
    if d.exists() and not d.is_dir():
        raise UsageError(f"{dst}: exists and is not a directory")
    if d.exists() and any(d.iterdir()) and not (overwrite or resume):
        raise UsageError(
            f"{dst}: directory is not empty; pass --overwrite to replace its checkpoint "
            "(or --resume to finish an interrupted conversion)",
            path=str(dst),
        )


_OURS = (".safetensors", ".safetensors.tmp", MANIFEST, INDEX, ".tmp", ".reshard-progress.jsonl")


def _clear_outputs(dst: Path) -> None:
    for p in dst.iterdir():
        if p.is_file() and (p.name.endswith(_OURS) or p.name in (MANIFEST, INDEX)):
            p.unlink()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def convert(
    source: SourceSpec,
    dst: str | os.PathLike[str],
    target: TargetSpec,
    *,
    workers: int = 1,
    buffer_size: int = DEFAULT_BUFFER,
    overwrite: bool = False,
    resume: bool = False,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> dict[str, Any]:
    """Convert ``source`` into ``dst``; returns the summary (the ``--json`` document body).

    Raises:
        ReshardError: bad input (nothing written) or, as WriteError, a failure while writing
            (the files this run made are removed).
    """
    src_path = Path(source.path)
    dst_path = Path(dst)
    if not src_path.exists():
        raise UsageError(f"{src_path}: no such file or directory", path=str(src_path))
    check_destination(src_path, dst_path, overwrite=overwrite, resume=resume)
    ckpt = open_source(source)
    tgt = resolve_target(ckpt, target)
    plan = build_plan(ckpt, tgt)
    if on_plan is not None:
        on_plan(plan)
    from .dist import coordinator

    # under torchrun every rank plans the same; each writes its share of the files
    coord = coordinator()
    created_dir = not dst_path.exists()
    coord.barrier()  # every rank has checked DST before anyone writes into it
    done: list[FileResult] = []
    todo = list(plan.files)
    try:
        from .resume import JOURNAL, finished_files, record_finished

        if coord.is_main:
            dst_path.mkdir(parents=True, exist_ok=True)
            (dst_path / MANIFEST).unlink(missing_ok=True)
            if not resume:
                _clear_outputs(dst_path)
        coord.barrier()
        mine = coord.share(todo)
        if resume:
            done, mine = finished_files(plan, dst_path, mine)
        failure: BaseException | None = None
        try:
            results = execute_plan(
                plan,
                dst_path,
                workers=workers,
                buffer_size=buffer_size,
                progress=progress,
                files=mine,
                on_file_done=lambda r: record_finished(dst_path, r, coord.rank),
            )
        except (ReshardError, OSError) as e:
            if coord.world == 1:
                raise
            failure, results = e, []
        # under torchrun a failure on one rank stops them all (nobody waits on a dead peer)
        failures = coord.gather([(coord.rank, str(failure))] if failure is not None else [])
        if failure is not None:
            raise failure
        if failures:
            rank, message = failures[0]
            raise WriteError(f"rank {rank} failed while writing: {message}; partial files were removed")
        results = coord.gather(results)
        done = coord.gather(done) if resume else done
        by_name = {r.name: r for r in done + results}
        ordered = [by_name[f.name] for f in plan.files]
        if coord.is_main:
            if plan.index is not None and len(plan.files) > 1:
                _write_json(dst_path / INDEX, plan.index)
            _write_json(dst_path / MANIFEST, manifest_for(plan, ordered))
            for j in dst_path.glob(JOURNAL + "*"):
                j.unlink(missing_ok=True)
        coord.barrier()
    except ReshardError:
        _cleanup(dst_path, plan, created_dir, keep=resume)
        raise
    except OSError as e:
        _cleanup(dst_path, plan, created_dir, keep=resume)
        raise WriteError(
            f"{dst_path}: writing failed ({e.strerror or e}); partial files were removed",
            path=str(getattr(e, "filename", None) or dst_path),
        ) from e
    except KeyboardInterrupt:
        # keep finished files and the journal: `--resume` picks up from here
        _cleanup(dst_path, plan, created_dir, keep=True)
        raise
    except BaseException:
        _cleanup(dst_path, plan, created_dir, keep=resume)
        raise
    return {
        "source": {
            "path": str(src_path),
            "format": ckpt.format,
            "mesh": ckpt.mesh.to_json() if ckpt.mesh else None,
        },
        "destination": {"path": str(dst_path), "format": plan.format, "mesh": plan.mesh.to_json()},
        "tensors": len(plan.tensors),
        "files": [{"name": r.name, "size": r.size, "checksum": r.checksum} for r in ordered],
        "bytes_written": plan.bytes_written,
        "bytes_read": sum(r.bytes_read for r in ordered),
        "copies": sum(f.copies for f in plan.files),
        "resumed_files": len(done),
        "warnings": list(ckpt.warnings),
        # non-tensor items (DCP BYTE_IO) cannot go into safetensors: listed, not copied
        "not_converted": [{"name": o.name, "bytes": o.length} for o in ckpt.objects.values()],
    }


def _cleanup(dst: Path, plan: Plan, created_dir: bool, *, keep: bool) -> None:
    """Remove what this run wrote (with --resume, keep finished files for the next try)."""
    if not dst.exists():
        return
    for f in plan.files:
        (dst / (f.name + ".tmp")).unlink(missing_ok=True)
        if not keep:
            (dst / f.name).unlink(missing_ok=True)
    if not keep:
        from .resume import JOURNAL

        (dst / JOURNAL).unlink(missing_ok=True)
        (dst / INDEX).unlink(missing_ok=True)
        (dst / MANIFEST).unlink(missing_ok=True)
        if created_dir:
            shutil.rmtree(dst, ignore_errors=True)
