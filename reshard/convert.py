"""Library entry points behind the CLI: open a source, resolve a target, plan, convert."""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .budget import DEFAULT_BUFFER, RELEASE_EVERY, Budget
from .check import check_metadata, source_hashes
from .checkpoint import (
    HOLDS_TENSORS,
    UNREADABLE,
    Checkpoint,
    CheckpointWarning,
    NonTensor,
    TensorSource,
    stored_objects,
)
from .config import LayoutConfig, load_layout, resolve_preset
from .dist import Coordinator, coordinator
from .errors import ConfigError, HeaderError, ReshardError, SourceChangedError, UsageError, WriteError
from .execute import ProgressFn, execute_plan
from .formats import MANIFEST, open_checkpoint, read_manifest, writer, writers
from .formats.base import Writer
from .formats.hf_extras import config_dtype_mismatch, copy_model_files, scan_model_files
from .io.lock import LOCK, DirLock
from .io.readhash import ReadHashes
from .io.staging import STAGE, Stage, refuse_non_files
from .io.writer import FileResult, is_temp
from .mesh import Mesh, parse_mesh_spec
from .placements import Placement
from .plan import Plan, WriteOptions, distinct_layouts, make_plan, match_blocks, plan_copies
from .resume import finished_files, is_journal, recipe, record_finished, source_identity, start_journal
from .text import name_pattern
from .transform_plan import Transforms, layout_transforms, match_any, transforms_for, unfused

__all__ = [
    "SourceSpec",
    "TargetSpec",
    "open_source",
    "resolve_target",
    "MAX_TARGET_RANKS",
    "build_plan",
    "model_files_for",
    "convert",
    "parse_size",
    "DTYPES",
    "CONSOLIDATED",
    "SHARDED",
]

CONSOLIDATED = "hf"
"""The writer ``--consolidate`` means, and the default for a one-rank target."""
SHARDED = "per-rank"
"""The default writer for a multi-rank target."""
SHARDED_STATE = "sharded-state"
"""vLLM/SGLang ``model-rank-{rank}-part-{part}``: their rank is the tensor-parallel rank."""

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
    if not math.isfinite(value) or value * mult >= 2**63:
        raise ConfigError(f"{option} {text!r}: must be a finite size below 8 EiB, such as 5GB")
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
    config_from: str | None = None
    """hf output: the model directory whose config, tokenizer and other non-weight files to copy
    (default: the source directory, when it has a ``config.json``)."""
    transforms: str | None = None
    """A transforms file or bundled profile (``reshard/configs/transforms``) applied on the way."""
    inverse: bool = False
    """Apply the inverse of the transforms (e.g. torchtitan -> HF with the HF -> torchtitan profile)."""
    model_config: str | None = None
    """The model's ``config.json`` for size names (default: the source's, when it has one)."""
    allow_unused: bool = False
    """Let source tensors no transform rule touches pass through unchanged."""
    sets: tuple[str, ...] = ()
    """``KEY=VALUE`` overrides of the size names the transforms use (``--set``)."""


def _load_layout(text: str) -> LayoutConfig:
    return load_layout(resolve_preset(text))


def open_source(spec: SourceSpec) -> Checkpoint:
    """Open the source checkpoint named by ``spec``."""
    layout = _load_layout(spec.layout) if spec.layout else None
    if spec.layout and layout_transforms(spec.layout) is not None:
        raise UsageError(
            f"{spec.layout}: its transforms apply on the way to a target; give this file as "
            "--target-layout (or --transforms), not as the source's layout",
            path=spec.layout,
        )
    sizes = parse_mesh_spec(spec.mesh, option="--source-mesh") if spec.mesh else None
    ckpt = open_checkpoint(spec.path, fmt=spec.fmt, layout=layout, mesh_sizes=sizes)
    if layout is not None:
        from .heads import check_heads  # lazy, as in build_plan

        ckpt.warnings.extend(rule_warnings(layout, ckpt.tensors))
        if ckpt.layout is not None and ckpt.mesh is not None:
            check_heads(ckpt, ckpt.layout, ckpt.mesh)  # a fused GQA qkv read as equal thirds; KV: as saved
    if spec.include or spec.exclude:
        from .select import select_checkpoint

        ckpt, _ = select_checkpoint(ckpt, spec.include, spec.exclude)
    return ckpt


def _refuse_inconsistent(ckpt: Checkpoint) -> None:
    """Refuse a source whose metadata contradicts itself (what ``inspect --check`` finds
    without reading data): converting it would launder the lie into a fresh checkpoint.

    Raises:
        HeaderError: naming the first problem.
    """
    problems = check_metadata(ckpt)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise HeaderError(
            f"{first['message']}{more}; nothing was converted",
            path=first["path"],
            tensor=first["tensor"],
            hint=f"run `reshard inspect --check {ckpt.path}` to see every problem",
        )


def _refuse_broken_ties(ckpt: Checkpoint, target: Target) -> None:
    """An ``untie`` drops a tensor as a copy of another: refuse when it is not one (tied
    copies can diverge, torchtitan PR #3764), before anything is written. Reads both.

    Raises:
        ConfigError: naming both tensors and the first differing index.
    """
    tf = target.transforms
    pair = tf.untied(ckpt) if tf is not None else None
    if tf is None or pair is None:
        return
    from .verify import verify_checkpoints

    dropped, kept, names = pair
    for d in verify_checkpoints(dropped, kept)["differences"]:
        at = f" (first at index {d['index']})" if "index" in d else ""
        raise ConfigError(
            f'{tf.origin}: untie drops "{names[d["tensor"]]}" as a copy of "{d["tensor"]}", but their '
            f"values differ{at}; nothing was converted",
            tensor=names[d["tensor"]],
            hint="use drop: instead if the copy is meant to be discarded",
        )


def _source_hashes(ckpt: Checkpoint, budget: Budget) -> ReadHashes | None:
    """The source's recorded hashes to check while copying (None: nothing recorded).

    Spans read ahead of a hash are held within each worker's page window: the memory
    ``--max-memory`` gives to mapped source pages, which ``convert`` no longer maps
    (:mod:`reshard.budget`); the rest is read back after the copy.
    """
    hashes = source_hashes(ckpt, budget.window * budget.workers)
    return hashes if hashes else None


def _verified(hashes: ReadHashes) -> None:
    """Raise if a source file's bytes do not have their recorded hash (before anything is committed).

    Raises:
        SourceChangedError: naming the file (and the tensor, for a piece's CRC32).
    """
    problems = hashes.problems()
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SourceChangedError(
            f"{first.message}{more}; the copy would carry those bytes under fresh checksums, so "
            "nothing was converted",
            path=first.path,
            tensor=first.tensor,
            hint="restore the file; or pass --no-verify-source to convert it as it is",
        )


def _carried(ckpt: Checkpoint, writer: Writer) -> tuple[list[NonTensor], list[NonTensor]]:
    """The source's non-tensor items the writer copies as they are (``--to dcp``: its ``BYTE_IO``
    items), and the rest, left out."""
    carried = stored_objects(ckpt) if writer.objects else []
    names = {n.name for n in carried}
    return carried, [n for n in ckpt.non_tensors if n.name not in names]


def _not_converted(ckpt: Checkpoint, left: Sequence[NonTensor]) -> None:
    """Warn that non-tensor items are left out (``inspect`` lists them itself, so only convert warns)."""
    if left:
        names = ", ".join(n.name for n in left[:3]) + (" ..." if len(left) > 3 else "")
        how = " (--to dcp carries them over)" if all(n.stored for n in left) else ""
        ckpt.warnings.append(
            CheckpointWarning(f"{ckpt.path}: {len(left)} non-tensor item(s) ({names}) are not converted{how}")
        )


@dataclass(frozen=True, slots=True)
class Target:
    writer: Writer
    mesh: Mesh
    rules: LayoutConfig | None
    dtype: str | None
    options: WriteOptions
    transforms: Transforms | None = None  # applied on the way (--transforms, a layout's section)

    @property
    def fmt(self) -> str:
        return self.writer.name


#: Most ranks a target mesh may have (one output file each; reading is bounded by the wider
#: :data:`reshard.mesh.MAX_WORLD_SIZE`). Planning is linear in the ranks: 8,192 take ~5 s.
MAX_TARGET_RANKS = 1 << 16


def resolve_target(source: Checkpoint, spec: TargetSpec) -> Target:
    """Decide the target format, mesh and rules (SPEC §4 convert).

    Raises:
        UsageError: the options contradict each other or say nothing about the target.
    """
    dtype = _target_dtype(spec.dtype)
    options = WriteOptions(max_shard_size=parse_size(spec.max_shard_size))
    to = writer(spec.to) if spec.to is not None else None
    if spec.consolidate:
        if to is not None and not to.consolidated:
            raise UsageError(
                f"--consolidate writes {CONSOLIDATED} files; it cannot be combined with --to {to.name}"
            )
        to = writer(CONSOLIDATED)
    sizes = parse_mesh_spec(spec.mesh, option="--target-mesh") if spec.mesh else None
    if to is not None and to.consolidated and (spec.layout or sizes):
        if sizes and all(v == 1 for v in sizes.values()) and not spec.layout:
            sizes = None
        else:
            raise UsageError(
                f"{to.name} output is one consolidated checkpoint; drop --target-layout/--target-mesh, "
                f"or write --to {SHARDED}"
            )
    tf = transforms_for(
        source,
        transforms=spec.transforms,
        layout=spec.layout,
        inverse=spec.inverse,
        model_config=spec.model_config,
        allow_unused=spec.allow_unused,
        sets=spec.sets,
    )
    if to is not None and (to.consolidated or (not spec.layout and not sizes)):
        # --to FORMAT with no target layout or mesh: every tensor whole on one rank, in that
        # format (SPEC §4: "else --consolidate"), whichever the format (per-rank, dcp, ...)
        return Target(to, Mesh.single(), None, dtype, options, tf)
    mesh, rules = _target_rules(source, spec.layout, sizes, tf is not None)
    w = to or writer(SHARDED if mesh.size > 1 else CONSOLIDATED)
    if w.consolidated:
        return Target(w, Mesh.single(), None, dtype, options, tf)
    if mesh.size > MAX_TARGET_RANKS:
        raise UsageError(
            f"target mesh {mesh}: {mesh.size:,} ranks is over the limit of {MAX_TARGET_RANKS:,} target "
            "ranks (MAX_TARGET_RANKS): reshard writes a file for every target rank and plans each one "
            "(32,768 ranks: ~25 s and ~360 MiB to plan a 21-tensor model), so a mesh this size is "
            "almost surely a typo; check --target-mesh and the layout's mesh"
        )
    if w.name == SHARDED_STATE and sum(n > 1 for n in mesh.shape) > 1:
        source.warnings.append(
            CheckpointWarning(
                f"{SHARDED_STATE} output on mesh {mesh}: vLLM and SGLang number these files by "
                "tensor-parallel rank only (model-rank-{tp_rank}-part-*), so they load only a "
                "one-dim (tp) mesh's files; these are numbered by global rank (reshard reads them "
                "back through reshard.json)"
            )
        )
    return Target(w, mesh, rules, dtype, options, tf)


def _target_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    dtype = DTYPES.get(text.lower())
    if dtype is None:
        raise UsageError(f"--dtype {text!r}: use bf16, fp16 or fp32")
    return dtype


def _target_rules(
    source: Checkpoint, layout: str | None, sizes: dict[str, int] | None, transforms: bool = False
) -> tuple[Mesh, LayoutConfig]:
    """The target mesh and rules: ``--target-layout``, else the source's rules on ``--target-mesh``."""
    if layout:
        cfg = _load_layout(layout)
        mesh = cfg.mesh.with_sizes(sizes) if sizes else cfg.mesh
        source.warnings.extend(_added_dims(cfg.mesh, sizes, f"the rules of {layout}"))
        return mesh, cfg.with_mesh(mesh)
    if sizes:
        base = source.layout
        if base is not None and transforms:
            raise UsageError(
                "--target-mesh alone reuses the source's placement rules, which name the source's "
                "tensors; with --transforms give --target-layout FILE with rules for the target names"
            )
        if base is None:
            raise UsageError(
                f"{source.path}: the source ({source.format}) has no placement rules to reuse; "
                "give --target-layout FILE (or --consolidate)",
                path=source.path,
            )
        mesh = base.mesh.with_sizes(sizes)
        source.warnings.extend(_added_dims(base.mesh, sizes, "the source's rules"))
        return mesh, base.with_mesh(mesh)
    raise UsageError(
        "say what to convert to: --target-layout FILE, --target-mesh tp=8, --consolidate, or "
        "--to FORMAT alone (every tensor whole on one rank)"
    )


def _added_dims(mesh: Mesh, sizes: dict[str, int] | None, rules: str) -> list[CheckpointWarning]:
    """A warning per dim ``--target-mesh`` adds to the rules' ``mesh`` with a size above 1: no
    rule names it, so every tensor is copied to each of its ranks (a misspelt dim name writes
    that many times the checkpoint)."""
    import difflib

    out = []
    for name, n in (sizes or {}).items():
        if name in mesh.names or n <= 1:
            continue
        close = difflib.get_close_matches(name, mesh.names, n=1, cutoff=0.3)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        out.append(
            CheckpointWarning(
                f'--target-mesh adds dim "{name}" (size {n}), which {rules} do not name (their mesh: '
                f"{mesh}): every tensor is replicated over it, {n} copies of each{hint}"
            )
        )
    return out


VERL_HF_DIR = "huggingface"
"""veRL's checkpoint directory keeps the model's config and tokenizer in this sub-directory."""


def model_files_for(source: Checkpoint, target: Target, config_from: str | None) -> list[Path]:
    """The non-weight files an hf output gets, scanned before anything is written.

    From ``--config-from DIR``, else from the source directory when it has a ``config.json``,
    else from its ``huggingface/`` sub-directory when that has one (veRL's checkpoints).
    Files left out, and an hf output that will hold weights only, are warnings on ``source``.

    Raises:
        UsageError: ``--config-from`` for a non-hf output, or a DIR without ``config.json``.
        ConfigError: ``config.json`` cannot be parsed (with ``--dtype``, whose dtype it gets).
    """
    if target.fmt != CONSOLIDATED:
        if config_from is not None:
            raise UsageError(f"--config-from gives hf output its model files; this output is {target.fmt}")
        return []
    src = Path(source.path)
    root = Path(config_from) if config_from is not None else (src if src.is_dir() else src.parent)
    if config_from is None and not (root / "config.json").is_file() and (root / VERL_HF_DIR).is_dir():
        # veRL's checkpoint directory keeps the model's config and tokenizer in huggingface/
        # (fsdp_checkpoint_manager.py), where its own model merger takes them from
        root = root / VERL_HF_DIR
    if config_from is None and not (root / "config.json").is_file():
        source.warnings.append(
            CheckpointWarning(
                f"{source.path}: no config.json; the hf output holds weights only (transformers cannot "
                "load it as a model): give --config-from DIR (the original model directory)",
                path=source.path,
            )
        )
        return []
    scan = scan_model_files(root, dtype=target.dtype)
    if not any(p.name == "config.json" for p in scan.files):
        raise UsageError(
            f"--config-from {root}: no config.json there; name the model's Hugging Face directory",
            path=str(root),
        )
    for p, why in scan.skipped:
        source.warnings.append(CheckpointWarning(f"{p}: not copied to the output: {why}", path=str(p)))
    return list(scan.files)


def rule_warnings(cfg: LayoutConfig, names: Iterable[str]) -> list[CheckpointWarning]:
    """SPEC §2: a rule that matches nothing is a warning."""
    return [
        CheckpointWarning(
            f"{cfg.source}{':' + str(r.line) if r.line else ''}: rule {r.pattern!r} matches no tensor",
            path=cfg.source,
        )
        for r in cfg.unused_rules(names)
    ]


def _checked_rules(
    source: Checkpoint,
    rules: LayoutConfig,
    mesh: Mesh,
    targets: Mapping[str, TensorSource] | None,
    tf: Transforms | None = None,
) -> LayoutConfig:
    """Target ``rules`` bound to the target tensor names (the source's, or ``targets`` after
    transforms ``tf``) for ``Own(...)`` assignments, their warnings (rules matching nothing, KV
    heads split by the mesh: with transforms, their head counts, ``--set`` ones included) added
    to ``source``'s."""
    from .heads import check_heads, check_tensor_heads  # lazy: reads config.json only when needed

    names = source.tensors if targets is None else targets
    base = source.layout  # its own rules on another mesh (--target-mesh): not the user's to fix
    reused = base is not None and rules.rules == base.rules and rules.source == base.source
    warnings = [] if reused else rule_warnings(rules, names)
    rules = rules.assign(names)
    if targets is None or tf is None:
        heads = check_heads(source, rules, mesh)
    else:
        heads = check_tensor_heads(unfused(targets), rules, mesh, tf.heads)
    for w in [*warnings, *heads]:
        if w not in source.warnings:
            source.warnings.append(w)
    return rules


def _with_file_names(target: Target, rules: LayoutConfig | None) -> WriteOptions:
    """The target's options, with the rank-local names ``Own(NAME, local)`` rules give tensors."""
    renamed = rules.file_names(target.mesh) if rules is not None and target.fmt == SHARDED else None
    return dataclasses.replace(target.options, file_names=renamed) if renamed else target.options


def build_plan(source: Checkpoint, target: Target) -> Plan:
    if not source.tensors and source.left_out:  # only non-tensor items kept: an empty output
        kept = ", ".join(n.name for n in source.non_tensors[:3])
        raise UsageError(
            f"{source.path}: --include/--exclude keep no tensor of its {source.left_out}, only "
            f"non-tensor items ({kept}), which are not converted: nothing to convert",
            path=source.path,
        )
    odd = next((n.name for n in source.non_tensors if n.kind == UNREADABLE), None)
    if odd is not None:  # converting the rest would drop it
        why = next((w.message for w in source.warnings if w.tensor == odd), None)
        raise UsageError(
            why
            or f'{source.path}: tensor "{odd}" has a dtype reshard cannot convert; '
            f"--exclude {name_pattern(odd)}",
            path=source.path,
            tensor=odd,
        )
    hidden = [n.name for n in source.non_tensors if n.kind == HOLDS_TENSORS]
    if hidden:  # converting the rest would drop them
        why = next((w.message for w in source.warnings if w.tensor == hidden[0]), None)
        raise UsageError(
            f'{source.path}: item "{hidden[0]}" is a pickled object holding tensors (what dcp.save '
            "writes with DefaultSavePlanner(flatten_state_dict=False)) that reshard cannot read"
            + (f" ({why})" if why else "")
            + ", so converting would drop them. Re-save it with the default planner "
            "(dcp.save(state_dict, checkpoint_id=DIR), which stores each tensor as a DCP tensor), "
            f"or --exclude {name_pattern(hidden[0])} to convert the rest",
            path=source.path,
            tensor=hidden[0],
        )
    if not source.tensors:  # e.g. an HF index whose weight_map is empty: never an empty output
        items = f" (only {len(source.non_tensors)} non-tensor item(s))" if source.non_tensors else ""
        raise UsageError(
            f"{source.path}: the {source.format} checkpoint holds no tensors{items}: nothing to convert",
            path=source.path,
        )
    rules = target.rules
    tf = target.transforms
    tensors, transformed = (None, None) if tf is None else tf.plan_inputs(source)
    if rules is not None:
        rules = _checked_rules(source, rules, target.mesh, tensors, tf)

    whole: list[Placement | str] = ["R"] * target.mesh.ndim  # no target layout: every tensor whole
    placements_for: Callable[[str], Sequence[Placement | str]] = (
        rules.placements_for if rules is not None else lambda name: whole
    )
    plan = make_plan(
        source,
        target.mesh,
        placements_for,
        writer=target.writer,
        dtype=target.dtype,
        options=_with_file_names(target, rules),
        rules=rules,
        sources=tensors,
        match=match_blocks if tf is None else match_any,
        transforms=None if tf is None else tf.record(),
    )
    plan.transformed = transformed
    owned = None
    if target.fmt != SHARDED:  # whole-tensor assignment: tested once per geometry, then found
        if any(lay.assigned for lay in distinct_layouts(t.layout for t in plan.tensors)):
            owned = next(t for t in plan.tensors if t.layout.assigned)
    if owned is not None:
        raise UsageError(
            f'tensor "{owned.name}" is placed {owned.layout.placement_strs()} by '
            f"{rules.rule_location(owned.name) if rules else 'the layout'}: whole-tensor assignment "
            f"(Own) is written by --to {SHARDED} only, whose rank files leave out the tensors a rank "
            "does not own",
            tensor=owned.name,
        )
    return plan


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(
    src: Path, dst: Path, *, overwrite: bool, resume: bool = False, check_empty: bool = True
) -> None:
    """Refuse a DST inside SRC, a SRC inside DST, and a non-empty DST without --overwrite."""
    try:
        _check_destination(src, dst, overwrite=overwrite, resume=resume, check_empty=check_empty)
    except OSError as e:  # a name over NAME_MAX, a loop of links, no permission
        raise UsageError(
            f"{dst}: cannot use it as the destination ({e.strerror or e})", path=str(dst)
        ) from None


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # Python before 3.13 reports a loop of links as RuntimeError, not OSError
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None


def _check_destination(src: Path, dst: Path, *, overwrite: bool, resume: bool, check_empty: bool) -> None:
    s = _resolve(src)
    d = _resolve(dst)
    src_dir = s if s.is_dir() else s.parent
    # a single-file source: only its own directory is off limits (outputs would mix with it)
    if d == src_dir or (s.is_dir() and _is_within(d, src_dir)):
        raise UsageError(f"{dst}: the destination is inside the source {src}; choose another directory")
    if _is_within(src_dir, d):
        raise UsageError(f"{dst}: the destination contains the source {src}; choose another directory")
    if d.exists() and not d.is_dir():
        raise UsageError(f"{dst}: exists and is not a directory")
    if check_empty and d.exists() and any(p.name != LOCK for p in d.iterdir()) and not (overwrite or resume):
        raise UsageError(
            f"{dst}: directory is not empty; pass --overwrite to replace its checkpoint "
            "(or --resume to finish an interrupted conversion)",
            path=str(dst),
        )


def _refuse_nothing_to_resume(dst: Path, plan: Plan) -> None:
    """``--resume`` without ``--overwrite`` onto a DST holding no interrupted conversion (no
    staging directory) replaces only a finished reshard checkpoint of this plan's format and
    file names (a retried step); any other checkpoint there is refused as without ``--resume``.

    Raises:
        UsageError: DST holds files of another checkpoint (named), or another conversion's.
    """
    if (dst / STAGE).exists() or not dst.is_dir():
        return
    present = sorted(p.name for p in dst.iterdir() if p.name != LOCK and _owned(p.name))
    if not present:
        return
    want = {f.name for f in plan.files}
    try:
        man = read_manifest(dst) or {}
    except ReshardError:  # not reshard's manifest: another checkpoint's files
        man = {}
    listed = man.get("files")
    same = isinstance(listed, dict) and man.get("format") == plan.format and want <= set(listed)
    if not same:
        what = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise UsageError(
            f"{dst}: nothing to resume there (no interrupted conversion), and it holds another "
            f"checkpoint ({what}); pass --overwrite to replace it, or choose another directory",
            path=str(dst),
        )


def _owned(name: str) -> bool:
    """Whether ``--overwrite`` may remove a file of this name from DST: a checkpoint file a
    writer makes, ``reshard.json``, reshard's own temporaries and journals (never a user's
    ``draft.tmp``)."""
    if name == MANIFEST or is_temp(name) or is_journal(name):
        return True
    for w in writers():
        if name in w.marks:
            return True
        for pattern in w.owns:
            if name == pattern or (pattern.startswith(".") and name.endswith(pattern)):
                return True
            if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
                return True
    return False


@contextmanager
def _claimed(dst: Path, main: bool) -> Iterator[None]:
    """DST created if needed and locked for the run (:class:`~reshard.io.lock.DirLock`).

    A DST this run created is removed again when the run leaves it empty (a failure).
    Under torchrun only the main process creates and locks it.
    """
    if not main:
        yield
        return
    created = not os.path.lexists(dst)
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"{dst}: cannot create the destination directory ({e.strerror or e})", path=str(dst)
        ) from None
    lock = DirLock(dst)
    try:
        lock.acquire()
        try:
            yield
        finally:
            lock.release()
    finally:
        if created:
            with suppress(OSError):
                dst.rmdir()  # only when empty: never another run's files


def convert(
    source: SourceSpec,
    dst: str | os.PathLike[str],
    target: TargetSpec,
    *,
    workers: int = 1,
    buffer_size: int = DEFAULT_BUFFER,
    window: int = RELEASE_EVERY,
    overwrite: bool = False,
    resume: bool = False,
    verify_source: bool = True,
    progress: ProgressFn | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> dict[str, Any]:
    """Convert ``source`` into ``dst``; returns the summary (the ``--json`` document body).

    Args:
        workers: writer threads; buffer_size, window: each one's write buffer and
            mapped-page release window (:func:`reshard.budget.budget_for`).

    Raises:
        ReshardError: bad input (nothing written) or, as WriteError, a failure while writing
            (the files this run made are removed).
    """
    src_path = Path(source.path)
    dst_path = Path(dst)
    if not src_path.exists():
        raise UsageError(f"{src_path}: no such file or directory", path=str(src_path))
    check_destination(src_path, dst_path, overwrite=overwrite, resume=resume, check_empty=False)
    with _claimed(dst_path, coordinator().is_main):
        check_destination(src_path, dst_path, overwrite=overwrite, resume=resume)
        ckpt = open_source(source)
        tgt = resolve_target(ckpt, target)
        carried, left = _carried(ckpt, tgt.writer)
        _not_converted(ckpt, left)
        plan = build_plan(ckpt, tgt)
        extras = model_files_for(ckpt, tgt, target.config_from)
        if on_plan is not None:
            on_plan(plan)
        _refuse_inconsistent(ckpt)
        _refuse_broken_ties(ckpt, tgt)
        if resume and not overwrite:
            _refuse_nothing_to_resume(dst_path, plan)
        run = _Run(plan, tgt.writer, dst_path, Budget(workers, buffer_size, window), progress, resume)
        run.hashes = _source_hashes(ckpt, run.budget) if verify_source and coordinator().is_main else None
        run.extras, run.extras_dtype = extras, tgt.dtype
        if extras and tgt.dtype is None:
            note = config_dtype_mismatch(extras, {t.dtype for t in plan.tensors})
            if note is not None:
                ckpt.warnings.append(CheckpointWarning(note, path=str(dst_path)))
        ordered, kept = run.guarded()
        if run.note is not None:
            ckpt.warnings.append(CheckpointWarning(run.note, path=str(dst_path)))
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
        "copies": plan_copies(plan),
        "resumed_files": kept,
        "model_files": [p.name for p in extras],
        "warnings": [str(w) for w in ckpt.warnings],
        # items that cannot go into safetensors (DCP BYTE_IO): listed, not copied; --to dcp
        # copies them as they are
        "not_converted": [{"name": n.name, "size": n.size, "kind": n.kind} for n in left],
        "copied_items": [{"name": n.name, "size": n.size, "kind": n.kind} for n in carried],
    }


class _Run:
    """One conversion's writing: every file into the staging directory, the writer's
    ``complete``, then the swap into DST (:mod:`reshard.io.staging`); cleanup on failure.

    Under torchrun every rank plans the same and writes its share of the files; rank 0
    completes the directory.
    """

    def __init__(
        self, plan: Plan, w: Writer, dst: Path, budget: Budget, progress: ProgressFn | None, resume: bool
    ) -> None:
        self.plan = plan
        self.writer = w
        self.dst = dst
        self.budget = budget
        self.progress = progress
        self.resume = resume
        self.coord: Coordinator = coordinator()
        self.stage = Stage(dst, MANIFEST)
        self.staged = False  # this run made (or took over) the staging directory
        self.hashes: ReadHashes | None = None  # the source's recorded hashes, fed as the copy reads
        self.extras: Sequence[Path] = ()
        self.extras_dtype: str | None = None
        self.note: str | None = None  # resuming with other options: no finished file kept

    def guarded(self) -> tuple[list[FileResult], int]:
        """Write everything; on failure remove what this run wrote. Returns results and files kept."""
        self.coord.barrier()  # every rank has checked DST before anyone writes into it
        try:
            return self._write()
        except ReshardError:
            self._cleanup(keep=self.resume)
            raise
        except OSError as e:
            self._cleanup(keep=self.resume)
            raise WriteError(
                f"{self.dst}: writing failed ({e.strerror or e}); partial files were removed",
                path=str(getattr(e, "filename", None) or self.dst),
            ) from e
        except KeyboardInterrupt:
            # keep finished files and the journal: `--resume` picks up from here
            self._cleanup(keep=True)
            raise
        except BaseException:
            self._cleanup(keep=self.resume)
            raise

    def _prepare(self) -> None:
        """Main process: refuse links/directories under output names, finish an interrupted
        swap, make the staging directory and start (or check) the resume journal."""
        names = [f.name for f in self.plan.files] + [MANIFEST]
        names += [n for n in self.writer.owns if not n.startswith(".") and "*" not in n]
        refuse_non_files(self.dst, names)
        self.stage.recover(_owned, is_journal)
        self.staged = True
        self.stage.prepare(keep=self.resume)
        self.note = start_journal(
            self.stage.dir,
            source_identity(self.plan.source),
            resume=self.resume,
            made_by=recipe(self.plan, self.extras_dtype),  # extras_dtype: the target --dtype
        )

    def _write(self) -> tuple[list[FileResult], int]:
        coord, plan, stage = self.coord, self.plan, self.stage
        if coord.is_main:
            self._prepare()
        coord.barrier()
        done: list[FileResult] = []
        mine = coord.share(list(plan.files))
        if self.resume:
            done, mine = finished_files(plan, stage.dir, mine)
        results = coord.gather(self._execute(mine))
        done = coord.gather(done) if self.resume else done
        by_name = {r.name: r for r in done + results}
        ordered = [by_name[f.name] for f in plan.files]
        if coord.is_main:
            if self.hashes is not None:
                _verified(self.hashes)  # a source whose bytes changed is never committed
            # weights are in place; the model files go before the index and reshard.json,
            # which mark the directory complete
            copy_model_files(list(self.extras), stage.dir, dtype=self.extras_dtype)
            self.writer.complete(stage.dir, plan, ordered)
            stage.swap(_owned, is_journal)
        coord.barrier()
        return ordered, len(done)

    def _execute(self, mine: Sequence[Any]) -> list[FileResult]:
        """This rank's files; under torchrun a failure on one rank stops them all."""
        coord = self.coord
        failure: BaseException | None = None
        try:
            results = execute_plan(
                self.plan,
                self.stage.dir,
                workers=self.budget.workers,
                buffer_size=self.budget.buffer,
                window=self.budget.window,
                progress=self.progress,
                files=mine,
                seen=self.hashes.feed if self.hashes is not None else None,
                on_file_done=lambda r: record_finished(self.stage.dir, r, coord.rank),
            )
        except (ReshardError, OSError) as e:
            if coord.world == 1:
                raise
            failure, results = e, []
        failures = coord.gather([(coord.rank, str(failure))] if failure is not None else [])
        if failure is not None:
            raise failure
        if failures:
            rank, message = failures[0]
            raise WriteError(f"rank {rank} failed while writing: {message}; partial files were removed")
        return results

    def _cleanup(self, *, keep: bool) -> None:
        """Remove what this run wrote: its staging directory (with --resume or after Ctrl-C,
        only its temporaries: finished files stay for the next try). DST's previous
        checkpoint is never touched before the swap."""
        if not (self.staged and self.coord.is_main):
            return
        if keep:
            self.stage.remove_temporaries()
        else:
            self.stage.discard()
