"""The ``reshard`` command line: thin Typer commands over the library.

stdout carries results only (``--json``: exactly one document with ``"schema": 1``);
progress, tables, warnings and errors go to stderr. Exit codes: 0 ok, 1 a
difference found (verify, --check), 2 bad usage or input, 3 failure while
writing, 130 interrupted.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .errors import ReshardError, UsageError
from .formats import readers, writers
from .formats.base import Reader, Writer

if TYPE_CHECKING:
    from rich.console import Console

    from .budget import Budget
    from .check import Problem
    from .convert import SourceSpec, TargetSpec

__all__ = ["app", "main"]

_COMPACT_JSON_ITEMS = 10_000
"""``--json`` documents listing more items than this are printed compact (one line)."""

app = typer.Typer(
    name="reshard",
    help="Convert model checkpoints between parallel layouts (TP, FSDP x TP, consolidated HF), "
    "streaming, in bounded memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        sys.stdout.write(f"reshard {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Convert model checkpoints between parallel layouts, streaming, in bounded memory."""


@functools.cache
def console() -> Console:
    """rich's stderr console, made on first use: `convert --quiet` never imports rich (~20 ms)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False, width=None if sys.stderr.isatty() else 160)


def _say(prefix: str, text: object) -> None:
    """``prefix`` (rich markup) then ``text`` verbatim: names, paths and messages come from files."""
    from .text import markup_safe

    console().print(prefix + markup_safe(str(text)), soft_wrap=True)


def _format_help(what: str, formats: Sequence[Reader | Writer]) -> str:
    return what + " " + "; ".join(f"{f.name}: {f.help}" for f in formats) + "."


SourceLayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--source-layout", help="Layout YAML (or preset name) the source was saved with.", metavar="FILE"
    ),
]
SourceMeshOpt = Annotated[
    str | None, typer.Option("--source-mesh", help="Override source mesh sizes, e.g. tp=4.", metavar="SPEC")
]
TargetLayoutOpt = Annotated[
    str | None, typer.Option("--target-layout", help="Layout YAML (or preset name) to write.", metavar="FILE")
]
TargetMeshOpt = Annotated[
    str | None,
    typer.Option(
        "--target-mesh",
        help="Target mesh sizes, e.g. tp=8 or fsdp=2,tp=4; unnamed dims keep "
        "their size, tp=1 collapses a dim.",
        metavar="SPEC",
    ),
]
ConsolidateOpt = Annotated[
    bool, typer.Option("--consolidate", help="Write one consolidated HF checkpoint (same as --to hf).")
]
ToOpt = Annotated[
    str | None,
    typer.Option(
        "--to",
        metavar="[" + "|".join(w.name for w in writers()) + "]",
        help=_format_help("Output format (default: per-rank for a multi-rank target, else hf):", writers()),
        show_default=False,
    ),
]
FromOpt = Annotated[
    str | None,
    typer.Option(
        "--from",
        metavar="[" + "|".join(r.name for r in readers()) + "]",
        help=_format_help("Force the input format (default: detected):", readers()),
        show_default=False,
    ),
]
DtypeOpt = Annotated[
    str | None, typer.Option("--dtype", help="Cast floating tensors to bf16, fp16 or fp32.", metavar="DTYPE")
]
MaxShardOpt = Annotated[
    str, typer.Option("--max-shard-size", help="Split hf output files at this size.", metavar="SIZE")
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        help="Threads writing output files \\[default: cores, at most 4].",
        show_default=False,
    ),
]


TransformsOpt = Annotated[
    str | None,
    typer.Option(
        "--transforms",
        help="Rename, fuse/split, stack, permute or pad tensors on the way: a transforms YAML or a "
        "bundled profile (hf-to-torchtitan-llama, hf-to-torchtitan-qwen3, hf-to-megatron-gpt, "
        "hf-to-megatron-torch-dist, mixtral-/qwen2-moe-/qwen3-moe-to-megatron-torch-dist, "
        "hf-to-vllm, phi3-to-llama, mixtral-experts-stack, ...); A,B applies A then B in one pass "
        "(phi3-to-llama,hf-to-torchtitan-llama). A --target-layout may carry a transforms: section "
        "instead.",
        metavar="FILE|PROFILE[,...]",
    ),
]
InverseOpt = Annotated[
    bool, typer.Option("--inverse", help="Apply the inverse of the transforms (e.g. torchtitan -> HF).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="NAME=INTEGER: a size name for the transforms (e.g. tp=4, num_key_value_heads=2), over "
        "the model config and the spec's own config: (repeatable).",
        metavar="NAME=INT",
        show_default=False,
    ),
]
ModelConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--model-config",
        help="config.json whose integer keys name sizes in the transforms (head counts, vocab) "
        "\\[default: SRC/config.json when present].",
        metavar="FILE",
        show_default=False,
    ),
]
AllowUnusedOpt = Annotated[
    bool,
    typer.Option("--allow-unused", help="Let tensors no transform rule touches pass through unchanged."),
]


def _budget(workers: int | None, max_memory: str) -> Budget:
    """Worker threads (one per core by default) and each one's buffers under ``--max-memory``."""
    from .budget import budget_for, default_workers
    from .convert import parse_size

    total = parse_size(max_memory, option="--max-memory")
    return budget_for(total, workers if workers is not None else default_workers())


IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        help="Keep only entries whose full name matches (glob, * crosses dots; or re:REGEX); repeatable.",
        metavar="GLOB",
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude",
        help="Drop entries whose full name matches, e.g. 'optimizer.*'; repeatable.",
        metavar="GLOB",
    ),
]


def _source(
    path: str,
    from_: str | None,
    layout: str | None,
    mesh: str | None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> SourceSpec:
    from .convert import SourceSpec

    return SourceSpec(path, from_, layout, mesh, tuple(include or ()), tuple(exclude or ()))


def _target(
    layout: str | None,
    mesh: str | None,
    to: str | None,
    consolidate: bool,
    dtype: str | None,
    max_shard_size: str,
    config_from: str | None = None,
    transforms: tuple[str | None, bool, str | None, bool, tuple[str, ...]] = (None, False, None, False, ()),
) -> TargetSpec:
    from .convert import TargetSpec

    return TargetSpec(layout, mesh, to, consolidate, dtype, max_shard_size, config_from, *transforms)


MaxMemoryOpt = Annotated[
    str,
    typer.Option(
        "--max-memory",
        help="Bound on reshard's buffers and mapped source pages, shared by the workers. Each worker's "
        "share S = SIZE/workers holds a write buffer B = S/32 (4 KiB to 256 KiB), a row cache of 8 B, "
        "and at most S - 9 B (up to 8 MiB) of mapped source pages before they are released; held "
        "exactly once S >= 36 KiB. Not counted: the interpreter (~36 MiB), torch for casts and "
        "Partial reductions (~224 MiB), one more B per Partial group or cast, output headers "
        "(`reshard plan` estimates the total).",
        metavar="SIZE",
    ),
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the checkpoint in a non-empty DST.")]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Keep finished, verified output files and redo the rest.")
]
NoVerifySourceOpt = Annotated[
    bool,
    typer.Option(
        "--no-verify-source",
        help="Do not check the source's bytes against the checksums in its reshard.json "
        "(checked by default, beside the copy).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or tables on stderr.")]
ShowOpt = Annotated[
    str | None,
    typer.Option(
        "--show",
        help="Draw which rank (or file) holds which part of tensor NAME, on stdout, instead of the "
        "table; plain text when NO_COLOR is set or stdout is not a terminal. Not with --json.",
        metavar="NAME",
    ),
]


def _picture(picture: Any) -> None:
    """A ``--show`` picture on stdout: coloured on a terminal, else plain text (no escape codes)."""
    from .show import plain, should_color

    if should_color(sys.stdout):
        from rich.console import Console

        Console(highlight=False, emoji=False).print(picture)
    else:
        sys.stdout.write(plain(picture))


def _no_json_show(show: str | None, json_: bool) -> None:
    if show is not None and json_:
        raise UsageError("--show draws a picture and --json prints data: use one at a time")


def _emit(doc: dict[str, Any]) -> None:
    from . import jsonout

    full = {"schema": 1, **doc}
    if jsonout.items(full) <= _COMPACT_JSON_ITEMS:  # indented for people
        sys.stdout.write(json.dumps(jsonout.materialized(full), indent=2))
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    # a large document (100k tensors) compact, written as it is made: orjson's bytes as they
    # are (no str copy), the rows of inspect made batch by batch
    out = getattr(sys.stdout, "buffer", None)
    sys.stdout.flush()
    _STDOUT.started = True
    if out is not None:
        jsonout.write_compact(full, out.write)
        out.write(b"\n")
        out.flush()
        return
    jsonout.write_compact(full, lambda raw: sys.stdout.write(bytes(raw).decode("ascii")))
    sys.stdout.write("\n")
    sys.stdout.flush()


class _STDOUT:
    """Whether this command began writing a JSON document: an error after that cannot add a
    second one (stdout carries exactly one)."""

    started = False


@contextmanager
def _errors(as_json: bool, *, writes: bool = False) -> Iterator[None]:
    """The one table from exceptions to messages and exit codes (``writes``: the command writes
    a checkpoint, which Ctrl-C leaves resumable)."""
    _STDOUT.started = False
    try:
        yield
    except ReshardError as e:
        if os.environ.get("RESHARD_DEBUG"):
            traceback.print_exc()
        code = e.exit_code
        if as_json and not _STDOUT.started:  # else the message on stderr only
            _emit({"ok": False, "error": e.to_json(), "exit_code": code})
        _say("[bold red]error:[/] ", e.message)
        if e.hint:
            _say("hint: ", e.hint)
        raise typer.Exit(code) from None
    except KeyboardInterrupt:
        console().print(
            "interrupted; finished output files were kept: run the same convert with --resume to finish"
            if writes
            else "interrupted"
        )
        raise typer.Exit(130) from None


@contextmanager
def _options_named(**names: str) -> Iterator[None]:
    """Errors met opening a source that tell the user to pass ``convert``'s source options
    (``--source-layout``, ``--source-mesh``) name this command's own ones (``names``: each old
    option, with ``_`` for ``-``, to its replacement)."""
    try:
        yield
    except ReshardError as e:
        for old, new in names.items():
            old = "--" + old.replace("_", "-")
            e.message = e.message.replace(old, new)
            e.hint = e.hint.replace(old, new) if e.hint else e.hint
        raise


def _show_progress(as_json: bool, quiet: bool) -> bool:
    return not (as_json or quiet) and console().is_terminal


@contextmanager
def _progress(enabled: bool, label: str) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def advance(n: int) -> None:
            bar.advance(task, n)

        def set_total(total: int) -> None:
            bar.update(task, total=total)

        advance.set_total = set_total  # type: ignore[attr-defined]
        yield advance


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Source checkpoint directory (or .safetensors file).")],
    dst: Annotated[str, typer.Argument(help="Output directory (created; must be empty unless --overwrite).")],
    source_layout: SourceLayoutOpt = None,
    source_mesh: SourceMeshOpt = None,
    target_layout: TargetLayoutOpt = None,
    target_mesh: TargetMeshOpt = None,
    consolidate: ConsolidateOpt = False,
    to: ToOpt = None,
    from_: FromOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    dtype: DtypeOpt = None,
    max_shard_size: MaxShardOpt = "5GB",
    workers: WorkersOpt = None,
    max_memory: MaxMemoryOpt = "64MiB",
    config_from: Annotated[
        str | None,
        typer.Option(
            "--config-from",
            help="hf output: copy config.json, generation config, tokenizer and other non-weight files "
            "from this model directory (default: the source directory, when it has a config.json).",
            metavar="DIR",
        ),
    ] = None,
    transforms: TransformsOpt = None,
    inverse: InverseOpt = False,
    model_config: ModelConfigOpt = None,
    allow_unused: AllowUnusedOpt = False,
    set_: SetOpt = None,
    overwrite: OverwriteOpt = False,
    resume: ResumeOpt = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="After writing, prove the output equal to the source, bit for bit (exit 1 if not).",
        ),
    ] = False,
    no_verify_source: NoVerifySourceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint to another layout or format.

    Examples:

      reshard convert ckpt-tp4 ckpt-tp8 --target-mesh tp=8

      reshard convert ckpt-tp4 hf-out --consolidate --dtype bf16

      reshard convert hf-model ckpt-tp4 --target-layout configs/llama-tp.yaml

      reshard convert dcp-step-1000 hf-out --consolidate --exclude 'optimizer.*'

      reshard convert ckpt-tp4 ckpt-tp8 --target-mesh tp=8 --verify

      reshard convert hf-model tt-tp8 --transforms hf-to-torchtitan-llama --target-layout tt-tp.yaml
    """
    from .api import verify_output
    from .convert import convert as run

    with _errors(json_, writes=True):
        if verify and dtype is not None:
            raise UsageError(
                "--verify proves the output bit-identical to the source; --dtype changes the bits"
            )
        budget = _budget(workers, max_memory)
        with _progress(_show_progress(json_, quiet), "converting") as prog:

            def on_plan(plan: Any) -> None:
                if prog is not None:
                    prog.set_total(plan.bytes_written)  # type: ignore[attr-defined]

            tspec = _target(
                target_layout,
                target_mesh,
                to,
                consolidate,
                dtype,
                max_shard_size,
                config_from,
                (transforms, inverse, model_config, allow_unused, tuple(set_ or ())),
            )
            result = run(
                _source(src, from_, source_layout, source_mesh, include, exclude),
                dst,
                tspec,
                workers=budget.workers,
                buffer_size=budget.buffer,
                window=budget.window,
                overwrite=overwrite,
                resume=resume,
                verify_source=not no_verify_source,
                progress=prog,
                on_plan=on_plan,
            )
        if verify:
            result["verify"] = verify_output(
                _source(src, from_, source_layout, source_mesh, include, exclude), dst, tspec
            )
        _report_convert(result, json_, quiet)
    if verify and not result["verify"]["equal"]:
        raise typer.Exit(1)


def _report_convert(result: dict[str, Any], json_: bool, quiet: bool) -> None:
    from .dist import coordinator

    if not coordinator().is_main:
        return  # under torchrun, rank 0 reports for everyone
    for w in result["warnings"]:
        _say("warning: ", w)
    checked = result.get("verify")
    for d in checked["differences"] if checked else ():
        _say("[red]differs:[/] ", d["message"])
    if json_:
        _emit({"ok": checked["equal"] if checked else True, "command": "convert", **result})
    elif not quiet:
        d = result["destination"]
        items = result.get("copied_items") or ()
        copied = f" and {len(items)} non-tensor item(s) as they were" if items else ""
        _say(
            f"wrote {len(result['files'])} {d['format']} file(s), "
            f"{result['tensors']} tensors{copied}, {_human(result['bytes_written'])} to ",
            d["path"],
        )
    if checked and not json_ and (not quiet or not checked["equal"]):
        if checked["equal"]:
            _say("verified: ", f"equal to the source ({_human(checked['bytes_compared'])} compared)")
        else:
            _say("[red]verify:[/] ", f"{len(checked['differences'])} difference(s) from the source")


@app.command()
def inspect(
    ckpt: Annotated[str, typer.Argument(help="Checkpoint directory (or .safetensors file).")],
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout", help="Layout YAML for per-rank files that do not describe themselves.", metavar="FILE"
        ),
    ] = None,
    mesh: SourceMeshOpt = None,
    from_: FromOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    check: Annotated[
        bool, typer.Option("--check", help="Also prove coverage, replicas and checksums (reads data).")
    ] = False,
    all_: Annotated[bool, typer.Option("--all", help="One row per tensor (no grouping of layers).")] = False,
    show: ShowOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show a checkpoint's format, mesh and tensors (headers only unless --check).

    Examples:

      reshard inspect ckpt-tp4

      reshard inspect ckpt-tp4 --check --json

      reshard inspect ckpt-tp4 --show model.layers.0.self_attn.q_proj.weight
    """
    from .convert import open_source
    from .report import inspect_report, render_inspect

    with _errors(json_):
        _no_json_show(show, json_)
        with _options_named(source_layout="--layout"):
            ck = open_source(_source(ckpt, from_, layout, mesh, include, exclude))
        if show is not None:
            from .show import source_picture

            _picture(source_picture(ck, show))
            for w in ck.warnings:
                _say("warning: ", w)
            if not check:
                return
        # --json: rows made as they are written; --quiet: no table, so rows never made
        doc = inspect_report(ck, lazy=json_ or quiet)
        problems: list[Problem] = []
        if check:
            from .check import check_checkpoint, checks_made

            problems = check_checkpoint(ck)
            doc["check"] = {"ok": not problems, "problems": problems, "verified": checks_made(ck)}
        if json_:
            _emit({"ok": not problems, "command": "inspect", **doc})
        else:
            if not quiet:
                render_inspect(doc, console(), group=not all_)
            if check:
                if problems:
                    for p in problems:
                        _say("[red]problem:[/] ", p["message"])
                    console().print(f"check: {len(problems)} problem(s) found")
                elif not quiet:
                    console().print(f"check: ok ({', '.join(doc['check']['verified'])})")
        if problems:
            raise typer.Exit(1)


@app.command()
def plan(
    src: Annotated[str, typer.Argument(help="Source checkpoint directory (or .safetensors file).")],
    source_layout: SourceLayoutOpt = None,
    source_mesh: SourceMeshOpt = None,
    target_layout: TargetLayoutOpt = None,
    target_mesh: TargetMeshOpt = None,
    consolidate: ConsolidateOpt = False,
    to: ToOpt = None,
    from_: FromOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    dtype: DtypeOpt = None,
    max_shard_size: MaxShardOpt = "5GB",
    workers: WorkersOpt = None,
    max_memory: MaxMemoryOpt = "64MiB",
    transforms: TransformsOpt = None,
    inverse: InverseOpt = False,
    model_config: ModelConfigOpt = None,
    allow_unused: AllowUnusedOpt = False,
    set_: SetOpt = None,
    show: ShowOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show what convert would do, without writing anything.

    Examples:

      reshard plan ckpt-tp4 --target-mesh tp=8

      reshard plan ckpt-tp4 --consolidate --json

      reshard plan ckpt-tp4 --target-mesh tp=8 --show model.layers.0.mlp.down_proj.weight
    """
    from .convert import build_plan, open_source, resolve_target
    from .report import plan_report, render_plan

    with _errors(json_):
        _no_json_show(show, json_)
        budget = _budget(workers, max_memory)
        ck = open_source(_source(src, from_, source_layout, source_mesh, include, exclude))
        tspec = _target(
            target_layout,
            target_mesh,
            to,
            consolidate,
            dtype,
            max_shard_size,
            None,
            (transforms, inverse, model_config, allow_unused, tuple(set_ or ())),
        )
        p = build_plan(ck, resolve_target(ck, tspec))
        if show is not None and p.transformed is not None:
            from .show import tensor_not_found, transform_picture

            tt = p.transformed.get(show)  # a target name
            if tt is None:
                raise tensor_not_found(f"{ck.path} (through the transforms)", show, list(p.transformed))
            after = next(t.layout for t in p.tensors if t.name == show)
            _picture(transform_picture(ck, tt, after))
            return
        if show is not None:
            from .show import render_plan as plan_picture
            from .show import source_picture

            before = source_picture(ck, show)  # an unknown name fails here, with suggestions
            after = next(t.layout for t in p.tensors if t.name == show)
            _picture(plan_picture(before, after, show))
            return
        doc = plan_report(p, budget)
        if json_:
            _emit({"ok": True, "command": "plan", **doc})
        elif not quiet:
            render_plan(doc, console())
        if not json_:
            for w in doc["warnings"]:
                _say("warning: ", w)


@app.command()
def verify(
    a: Annotated[str, typer.Argument(help="First checkpoint.")],
    b: Annotated[str, typer.Argument(help="Second checkpoint.")],
    layout_a: Annotated[
        str | None,
        typer.Option("--layout-a", help="Layout of A if it does not describe itself.", metavar="FILE"),
    ] = None,
    layout_b: Annotated[
        str | None,
        typer.Option("--layout-b", help="Layout of B if it does not describe itself.", metavar="FILE"),
    ] = None,
    mesh_a: Annotated[
        str | None,
        typer.Option("--mesh-a", help="Override A's mesh sizes, e.g. tp=4.", metavar="SPEC"),
    ] = None,
    mesh_b: Annotated[
        str | None,
        typer.Option("--mesh-b", help="Override B's mesh sizes, e.g. tp=4.", metavar="SPEC"),
    ] = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    transforms: Annotated[
        str | None,
        typer.Option(
            "--transforms",
            help="Compare A seen through these transforms (file or profile; A,B chains them) with B: "
            "across names and fused forms.",
            metavar="FILE|PROFILE[,...]",
        ),
    ] = None,
    inverse: InverseOpt = False,
    model_config: ModelConfigOpt = None,
    allow_unused: AllowUnusedOpt = False,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Prove two checkpoints hold the same tensors, bit for bit, whatever their layouts.

    Exit 0 when equal, 1 when they differ.

    Examples:

      reshard verify ckpt-tp4 ckpt-tp8

      reshard verify ckpt-tp4 hf-out --json

      reshard verify hf-model tt-tp8 --transforms hf-to-torchtitan-llama
    """
    from .convert import SourceSpec, open_source
    from .verify import verify_checkpoints, with_repeats, with_replicas

    with _errors(json_):
        from .select import select_pair, without_excluded

        with _options_named(source_layout="--layout-a", source_mesh="--mesh-a"):
            ca = open_source(SourceSpec(a, None, layout_a, mesh_a))
        with _options_named(source_layout="--layout-b", source_mesh="--mesh-b"):
            cb = open_source(SourceSpec(b, None, layout_b, mesh_b))
        from .transform_plan import transforms_for

        matched: list[str] = []
        if transforms and exclude:
            ca, matched = without_excluded(ca, exclude)

        tf = transforms_for(
            ca,
            transforms=transforms,
            inverse=inverse,
            model_config=model_config,
            allow_unused=allow_unused,
            sets=set_ or (),
        )
        source = ca
        if tf is not None:
            ca = tf.checkpoint(ca)
        ca, cb, unmatched = select_pair(ca, cb, include or (), exclude or (), matched)
        for w in unmatched:
            _say("warning: ", w)  # the patterns are the user's: printed verbatim
        family = tf.family_note() if tf is not None else None
        if family is not None:  # model_type and paths come from files: printed verbatim
            _say("warning: ", family)
        doc = with_replicas(verify_checkpoints(ca, cb), ca, cb)
        if tf is not None:  # the copies a split reads once (vLLM's replicated KV heads), as replicas
            selected = include or exclude
            repeats = [r for r in tf.repeats(source) if not selected or r.first.name in ca.tensors]
            doc = with_repeats(doc, source, repeats)
        if json_:
            _emit({"ok": doc["equal"], "command": "verify", **doc})
        else:
            for d in doc["differences"]:
                _say("[red]differs:[/] ", d["message"])
            if doc["equal"]:
                if not quiet:
                    console().print(
                        f"equal: {doc['tensors']} tensors, {_human(doc['bytes_compared'])} compared"
                    )
            else:
                console().print(f"{len(doc['differences'])} difference(s)")
        if not doc["equal"]:
            raise typer.Exit(1)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _fixed_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at its default 128 KiB instead of letting it grow.

    glibc raises the threshold each time a mapped block is freed (up to 32 MiB); after that,
    big short-lived blocks (a 200k-tensor header's 23 MB of text, its 14 MB entries text)
    come from the heap, and the heap's high-water stays in RSS. Set explicitly, the threshold
    stays put and such blocks are mapped and handed back when freed (200k tensors: peak RSS
    269-284 -> 246-269 MiB per command; the same time). Other C libraries: nothing done.

    The heap's top is trimmed only past 1 MiB free (default 128 KiB, which the threshold
    fixes too): the copy's numpy temporaries (up to 96 KiB, made and freed per window) were
    handed back and faulted in again each time, and the system time of a 100k-tensor
    conversion doubled (16 MiB was no faster, and kept 7-10 MiB more in RSS).
    """
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _app_json() -> int:
    """``app()`` for a ``--json`` command line: a usage error the option parser finds (a missing
    argument, an unknown option, ``--workers 0``) is still one JSON document on stdout, as the
    errors reshard finds are, not a panel on stderr alone."""
    # click's ClickException (typer vendors click from 0.28 on, so it is not imported by name)
    click_error: type[Exception] = next(
        c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
    )
    try:
        rv = app(standalone_mode=False)  # returns a typer.Exit's code, raises parse errors
    except click_error as e:
        err = UsageError(e.format_message())  # type: ignore[attr-defined]
        code = int(getattr(e, "exit_code", 2))
        _emit({"ok": False, "error": err.to_json(), "exit_code": code})
        _say("[bold red]error:[/] ", err.message)
        return code
    except typer.Abort:
        _say("", "Aborted!")
        return 1
    return rv if isinstance(rv, int) else 0


def main() -> None:
    """Console-script entry point."""
    # reshard makes no BLAS calls; numpy's OpenBLAS would start a thread per core that spins
    # while our writers need those cores (measured: ~6% of a conversion's CPU samples)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    code = 0
    # A 100k-tensor checkpoint makes millions of small objects that live until the command
    # ends: the cyclic collector's passes over them cost as much as the work (measured: header
    # decoding 2x slower). A command is short-lived and makes no cycles worth collecting.
    if os.environ.get("RESHARD_GC") != "1":
        gc.disable()
    _fixed_mmap_threshold()
    try:
        if "--json" in sys.argv[1:]:
            code = _app_json()
        else:
            app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if "torch.distributed" in sys.modules:
        # under torchrun: tear the process group down while the interpreter is whole (gloo can
        # abort in the finalizers skipped below)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without tearing the interpreter down: every file is written and closed by now, and
    # freeing the millions of objects of a 100k-tensor command one by one took 0.1-0.2 s
    from .io.pages import remove_scratch

    remove_scratch()  # os._exit skips atexit: the DCP reader's spool would stay in $TMPDIR
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
