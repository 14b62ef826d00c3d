"""What makes an HF output load as a model, and which weight files HF reads (pure file logic, no torch).

* :func:`model_files` / :func:`scan_model_files`: the non-weight files of a Hugging Face
  model directory (config, generation config, tokenizer, chat template, processor
  configs, ``*.py`` for ``trust_remote_code``, license) that an ``hf`` output copies,
  so ``AutoModelForCausalLM.from_pretrained(out)`` works; the same for the directory
  ``--config-from DIR`` names for per-rank and DCP sources.
* :func:`copy_model_files`: copies them atomically, rewriting ``config.json``'s dtype
  when ``--dtype`` cast the weights.
* :func:`hf_weight_files`: which weight files a directory's model is, in transformers'
  order: ``model.safetensors`` before ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigError, HeaderError, ReshardError, UsageError, WriteError
from ..io.safe import MAX_JSON_BYTES, expect_object, load_json, read_document
from ..io.writer import create_exclusive, temp_name

__all__ = [
    "SINGLE",
    "INDEX",
    "MAX_MODEL_FILE",
    "ModelFiles",
    "HfWeights",
    "scan_model_files",
    "model_files",
    "copy_model_files",
    "config_dtype_name",
    "rewrite_config_dtype",
    "config_dtype_mismatch",
    "hf_weight_files",
    "read_weight_index",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

MAX_MODEL_FILE = 256 * 2**20
"""Largest non-weight file copied (the biggest tokenizer.json files are ~35 MB)."""

_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".py", ".tiktoken", ".md")
"""Config, tokenizer (json, txt vocabularies, sentencepiece .model, tiktoken), chat
templates, remote code, model card. Weights (.safetensors, .bin, .pt, .pth, .distcp,
.gguf, ...) never match."""

_PREFIXES = ("LICENSE", "NOTICE", "USE_POLICY")
"""License files model repos ship (Llama's LICENSE, USE_POLICY.md) travel with the weights."""

_NOT_MODEL = frozenset({"reshard.json", "trainer_state.json"})
"""reshard's own manifest (formats.MANIFEST; not imported, formats/__init__ imports
this package's readers) and training state, never part of a model."""

_DTYPE_KEYS = ("dtype", "torch_dtype")
"""transformers >= 4.56 writes ``dtype``; older versions ``torch_dtype``."""

_CONFIG_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "fp32": "float32",
    "f32": "float32",
}
"""``--dtype`` spellings (and safetensors codes, lower-cased) -> the name transformers writes."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The files to copy, and those left out with the reason (the CLI warns about them)."""

    files: tuple[Path, ...]
    skipped: tuple[tuple[Path, str], ...]


class HfWeights(NamedTuple):
    """Weight files of an HF directory: ``weight_map`` is the index's (None without an index)."""

    files: list[Path]
    weight_map: dict[str, str] | None
    warning: str | None


def _wanted(name: str) -> bool:
    if name.startswith(".") or name in _NOT_MODEL or name.endswith(".index.json"):
        return False
    return name.endswith(_SUFFIXES) or name.startswith(_PREFIXES)


def _hub_blob(path: Path) -> Path | None:
    """The blob a Hugging Face hub cache link points to, or None.

    The hub cache keeps ``models--org--name/snapshots/REV/config.json`` as a symlink
    to ``models--org--name/blobs/HASH``: the one kind of link followed, and only
    into that repo's own ``blobs/``.
    """
    snap = path.parent
    if snap.parent.name != "snapshots":
        return None
    target = path.resolve()
    if target.parent != (snap.parent.parent / "blobs").resolve():
        return None
    return target


def _source(path: Path) -> tuple[Path | None, str]:
    """The regular file to read for ``path`` (None and why when there is none)."""
    try:
        st = path.lstat()
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        blob = _hub_blob(path)
        if blob is None:
            return None, "a symlink (not followed); copy it yourself if the model needs it"
        path, st = blob, blob.stat()
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file"
    if st.st_size > MAX_MODEL_FILE:
        return None, f"larger than {MAX_MODEL_FILE // 2**20} MiB; copy it yourself if the model needs it"
    return path, ""


def scan_model_files(src_dir: str | os.PathLike[str], *, dtype: str | None = None) -> ModelFiles:
    """The non-weight files of a model directory (top level only), and those left out.

    With ``dtype`` set, ``config.json`` is parsed now, so a broken one fails before
    any weight is written.

    Raises:
        UsageError: ``src_dir`` is not a directory.
        ConfigError: ``config.json`` is not a JSON object (only with ``dtype``).
    """
    root = Path(src_dir)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory (expected a Hugging Face model directory)", path=str(root))
    files: list[Path] = []
    skipped: list[tuple[Path, str]] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not _wanted(entry.name) or entry.is_dir(follow_symlinks=False):
            continue
        path = root / entry.name
        real, why = _source(path)
        if real is None:
            skipped.append((path, why))
        else:
            files.append(path)
    if dtype is not None:
        config = [f for f in files if f.name == "config.json"]
        for f in config:
            rewrite_config_dtype(_read_text(f), dtype, where=str(f))
    return ModelFiles(tuple(files), tuple(skipped))


def model_files(src_dir: str | os.PathLike[str]) -> list[Path]:
    """The files :func:`scan_model_files` keeps (see there)."""
    return list(scan_model_files(src_dir).files)


def config_dtype_name(dtype: str) -> str:
    """``bf16``/``BF16``/``bfloat16`` -> ``bfloat16`` (the value transformers writes).

    Raises:
        UsageError: not one of the cast targets.
    """
    key = dtype.strip().lower()
    if key in _CONFIG_DTYPES.values():
        return key
    if key in _CONFIG_DTYPES:
        return _CONFIG_DTYPES[key]
    raise UsageError(f"--dtype {dtype!r}: use bf16, fp16 or fp32")


def _set_dtype(obj: dict[str, Any], name: str) -> None:
    for key in _DTYPE_KEYS:
        if key in obj and (obj[key] is None or isinstance(obj[key], str)):
            obj[key] = name
    for key, value in obj.items():
        # sub-configs of composite models (text_config, vision_config, ...) carry their own
        if key.endswith("_config") and isinstance(value, dict):
            _set_dtype(value, name)


_WEIGHT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_CAST_OPTION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def config_dtype_mismatch(files: list[Path] | tuple[Path, ...], dtypes: set[str]) -> str | None:
    """A warning when the ``config.json`` among ``files`` names a dtype other than the weights'
    (``dtypes``: the output tensors' safetensors dtypes, of which exactly one floating-point
    one): transformers' ``from_pretrained(dtype="auto")`` would cast them to the config's.
    None when they agree, or the config names none, or cannot be read (copying reports that).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text('{"dtype": "bfloat16"}')
    >>> note = config_dtype_mismatch([d / "config.json"], {"F32", "I64"})
    >>> note.split(": ", 1)[1].split("; ")[1]
    'pass --dtype bf16 to write them so, or edit config.json'
    >>> config_dtype_mismatch([d / "config.json"], {"BF16"}) is None
    True
    """
    cfg = next((Path(p) for p in files if Path(p).name == "config.json"), None)
    floats = {d for d in dtypes if d in _WEIGHT_DTYPES or d.startswith("F8")}
    if cfg is None or len(floats) != 1:
        return None
    (weights,) = floats
    try:
        obj = json.loads(_read_text(cfg))
    except (ValueError, RecursionError, ReshardError):
        return None
    if not isinstance(obj, dict):
        return None
    key = next((k for k in _DTYPE_KEYS if isinstance(obj.get(k), str)), None)
    if key is None or obj[key] == _WEIGHT_DTYPES.get(weights) or obj[key] == "auto":
        return None
    named = obj[key]
    cast = _CAST_OPTION.get(named)
    fix = f"pass --dtype {cast} to write them so, or edit config.json" if cast else "edit config.json"
    return (
        f'{cfg}: its {key} is "{named}" but the weights written are {weights}: transformers\' '
        f'from_pretrained(dtype="auto") casts them to {named}; {fix}'
    )


def rewrite_config_dtype(text: str, dtype: str, *, where: str = "config.json") -> str:
    """``config.json`` text with its ``dtype`` / ``torch_dtype`` set to ``dtype``.

    Key order and everything else stay; the text is re-dumped as transformers writes
    it (``indent=2``, ASCII, trailing newline), so a transformers-written file only
    changes on its dtype lines. A file with neither key is returned re-dumped unchanged.

    >>> print(rewrite_config_dtype('{"a": 1, "torch_dtype": "float32"}', "bf16"), end="")
    {
      "a": 1,
      "torch_dtype": "bfloat16"
    }

    Raises:
        ConfigError: not a JSON object.
    """
    name = config_dtype_name(dtype)
    try:
        obj = json.loads(text, object_pairs_hook=dict)
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: not a JSON object; cannot set its dtype for --dtype", path=where)
        _set_dtype(obj, name)
        return json.dumps(obj, indent=2) + "\n"
    except ConfigError:
        raise
    except RecursionError:  # loading, walking or dumping {"a": {"a": ...}} past the recursion limit
        raise ConfigError(
            f"{where}: nests arrays or objects deeper than Python can read; cannot set its dtype for --dtype",
            path=where,
        ) from None
    except ValueError as e:
        raise ConfigError(
            f"{where}: not valid JSON ({e}); cannot set its dtype for --dtype", path=where
        ) from None


def _read_text(path: Path) -> str:
    real, why = _source(path)
    if real is None:
        raise UsageError(f"{path}: {why}", path=str(path))
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MODEL_FILE + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", path=str(path)) from None


def _copy_one(path: Path, dst: Path, dtype: str | None) -> Path:
    """Copy one file to a fresh temporary in ``dst`` (never through a link), then rename it into place."""
    real, why = _source(path)
    if real is None:
        raise UsageError(f"{path}: {why}", path=str(path))
    tmp = dst / temp_name(path.name)  # fresh: a user's NAME.tmp is neither removed nor written through
    out_fd = create_exclusive(tmp)
    try:
        with os.fdopen(out_fd, "wb") as out:
            if dtype is not None and path.name == "config.json":
                out.write(rewrite_config_dtype(_read_text(path), dtype, where=str(path)).encode())
            else:
                with os.fdopen(os.open(real, os.O_RDONLY | os.O_NOFOLLOW), "rb") as src:
                    shutil.copyfileobj(src, out, 2**20)
        final = dst / path.name
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def copy_model_files(
    files: list[Path] | tuple[Path, ...], dst_dir: str | os.PathLike[str], *, dtype: str | None = None
) -> list[Path]:
    """Copy ``files`` into ``dst_dir`` under their names, each atomically (a fresh temporary + rename).

    With ``dtype`` (``--dtype``: bf16, fp16, fp32) ``config.json``'s dtype is rewritten to
    match the cast weights. On failure the files this call placed are removed.

    Returns:
        The written paths.

    Raises:
        UsageError / ConfigError: a source file went missing, became a link, or (with
            ``dtype``) ``config.json`` is not a JSON object; nothing is left behind.
        WriteError: writing failed (disk full, permissions); nothing is left behind.
    """
    dst = Path(dst_dir)
    if dtype is not None:
        config_dtype_name(dtype)
    done: list[Path] = []
    name = ""
    try:
        for path in files:
            name = Path(path).name
            done.append(_copy_one(Path(path), dst, dtype))
    except BaseException as e:
        for p in done:
            p.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise WriteError(
                f"{dst}: copying {name} failed ({e.strerror or e}); the model files copied were removed",
                path=str(dst),
            ) from e
        raise
    return done


_WS = "[ \t\n\r]*"  # JSON's whitespace (not str.isspace's)
_MAP_KEY = re.compile(f'"weight_map"{_WS}:{_WS}\\{{')
_MAP_PAIR = re.compile(f'{_WS}"([^"\\\\\\x00-\\x1f]*)"{_WS}:{_WS}"([^"\\\\\\x00-\\x1f]*)"{_WS}([,}}])')
_MAP_END = re.compile(f"{_WS}\\}}")


def _weight_map_pairs(text: str) -> tuple[dict[str, str], str] | None:
    """The index's ``weight_map`` read pair by pair, and the document with it emptied (to parse
    as the rest is parsed); None when the text is not that plain (an escape, a second
    ``"weight_map"``, a value that is not a string, a repeated name): the strict parser decides.

    ``json.loads`` of a 200k-tensor index (17 MB) holds a list of 200k pairs and a string per
    value besides the map: 100 MiB at its peak. Here the names are the only strings made per
    tensor, and every value is its shard's one string.
    """
    if "\\" in text or text.count('"weight_map"') != 1:
        return None
    m = _MAP_KEY.search(text)
    if m is None:
        return None
    out: dict[str, str] = {}
    shards: dict[str, str] = {}
    pos, pairs = m.end(), 0
    end = _MAP_END.match(text, pos)
    if end is None:
        match, setdefault = _MAP_PAIR.match, shards.setdefault
        while True:
            p = match(text, pos)
            if p is None:
                return None
            k, v, sep = p.groups()
            out[k] = setdefault(v, v)
            pairs += 1
            pos = p.end()
            if sep == "}":
                break
        if pairs != len(out):
            return None
    else:
        pos = end.end()
    return out, text[: m.start()] + '"weight_map": {}' + text[pos:]


def read_weight_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a transformers index (``model.safetensors.index.json``, or the legacy
    ``pytorch_model.bin.index.json``): tensor name -> shard file name, every shard checked present.

    Raises:
        HeaderError: not a JSON object with a ``weight_map`` of strings, a shard name pointing
            outside the directory, or shards it names that are missing (all of them named).
    """
    # bounded, regular-file-only, strict JSON (duplicate keys refused): io.safe
    raw = read_document(index, limit=MAX_JSON_BYTES, what="HF index", error=HeaderError)
    try:
        fast = _weight_map_pairs(raw.decode("utf-8"))
    except UnicodeDecodeError:
        fast = None
    if fast is not None:
        del raw
        weight_map, rest = fast
        data = load_json(rest.encode("utf-8"), what="HF index", path=str(index), error=HeaderError)
        if not isinstance(data, dict) or data.get("weight_map") != {}:
            what = "safetensors index" if index.name == INDEX else "weight index"
            raise HeaderError(f"{index}: not a valid {what} (weight_map)", path=str(index))
        data["weight_map"] = weight_map
    else:
        data = load_json(raw, what="HF index", path=str(index), error=HeaderError)
    try:
        weight_map = expect_object(data, path=str(index), field="the HF index", error=HeaderError)[
            "weight_map"
        ]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as e:
        what = "safetensors index" if index.name == INDEX else "weight index"
        raise HeaderError(f"{index}: not a valid {what} ({e})", path=str(index)) from None
    shards: dict[str, str] = {}
    for k, v in weight_map.items():  # one string per shard, not one per tensor (200k: 16 MB)
        weight_map[k] = shards.setdefault(v, v)
    names = sorted(shards)
    if names and not names[0]:  # "" is the directory itself: refused before it is opened as a shard
        tensor = next(k for k, v in weight_map.items() if not v)
        raise HeaderError(
            f'{index}: tensor "{tensor}" has an empty shard file name', path=str(index), tensor=tensor
        )
    for n in names:
        if "/" in n or n.startswith("."):
            where = "points outside the checkpoint" if n.startswith(("/", ".")) else "is in a sub-directory"
            raise HeaderError(
                f"{index}: shard name {n!r} {where}; shards are read from the index's own directory "
                "only (name each file as it sits beside the index)",
                path=str(index),
            )
    missing = [n for n in names if not (index.parent / n).exists()]
    if missing:
        counts = {n: 0 for n in missing}
        for f in weight_map.values():
            if f in counts:
                counts[f] += 1
        shown = ", ".join(f"{n} ({counts[n]} tensor(s))" for n in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise HeaderError(
            f"{index.parent / missing[0]}: listed in {index.name} but missing"
            + (f" (missing: {shown}{more})" if len(missing) > 1 else f" ({counts[missing[0]]} tensor(s))")
            + "; copy the missing shard(s) in, or download the checkpoint again",
            path=str(index.parent / missing[0]),
        )
    return weight_map


def hf_weight_files(directory: str | os.PathLike[str]) -> HfWeights:
    """The weight files of an HF directory, chosen as transformers' ``from_pretrained`` does.

    transformers (``modeling_utils._get_resolved_checkpoint_files``) takes
    ``model.safetensors`` when it is a file, else ``model.safetensors.index.json``;
    with both present the index and its shards are ignored, and a warning says so.
    Without either, one lone ``*.safetensors`` file is the model.

    Raises:
        HeaderError: a broken index, or no weights to read (naming what was found).
    """
    root = Path(directory)
    single, index = root / SINGLE, root / INDEX
    if single.is_file():
        warning = None
        if index.exists():
            warning = (
                f"{root}: holds both {SINGLE} and {INDEX}; reading {SINGLE}, as transformers does "
                f"(the index and its shards are ignored; remove {SINGLE} to read the shards)"
            )
        return HfWeights([single], None, warning)
    if index.exists():
        weight_map = read_weight_index(index)
        return HfWeights([root / n for n in sorted(set(weight_map.values()))], weight_map, None)
    cands = sorted(root.glob("*.safetensors"))
    if len(cands) == 1:
        return HfWeights(cands, None, None)
    found = ", ".join(p.name for p in cands[:4]) if cands else "no .safetensors file"
    hint = None
    if (root / "pytorch_model.bin").exists() or (root / "pytorch_model.bin.index.json").exists():
        hint = "it holds transformers' pickle weights (pytorch_model.bin): read it with --from pt"
    raise HeaderError(f"{root}: no {SINGLE} or {INDEX} found ({found})", path=str(root), hint=hint)
