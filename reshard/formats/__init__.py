"""Checkpoint formats: detect one and turn a directory into a :class:`Checkpoint`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import ConfigError, HeaderError, LayoutError, UsageError
from ..mesh import Mesh
from .dcp import is_dcp, open_dcp
from .hf import INDEX, SINGLE, open_hf
from .per_rank import RANK_FILE, open_per_rank

__all__ = ["FORMATS", "MANIFEST", "detect_format", "open_checkpoint", "read_manifest"]

FORMATS = ("per-rank", "hf", "dcp-safetensors", "dcp")
MANIFEST = "reshard.json"
DCP_FILE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The directory's ``reshard.json``, or None when absent."""
    p = directory / MANIFEST
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise HeaderError(f"{p}: not valid JSON ({e})", path=str(p)) from None
    return data


def detect_format(path: Path) -> str:
    """Which format a path holds.

    Raises:
        UsageError: the path does not exist or holds no recognisable checkpoint.
    """
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory", path=str(path))
    if path.is_file():
        if path.name.endswith(".safetensors"):
            return "hf"
        raise UsageError(f"{path}: not a .safetensors file or a checkpoint directory", path=str(path))
    manifest = read_manifest(path)
    if manifest is not None and manifest.get("format") in FORMATS:
        return str(manifest["format"])
    if is_dcp(path):
        return "dcp"
    names = [p.name for p in path.iterdir() if p.is_file()]
    st = [n for n in names if n.endswith(".safetensors")]
    if any(DCP_FILE.match(n) for n in st):
        return "dcp-safetensors"
    if INDEX in names or SINGLE in names:
        return "hf"
    if any(RANK_FILE.match(n) for n in st):
        return "per-rank"
    if len(st) == 1:
        return "hf"
    if len(st) > 1:
        return "per-rank"
    raise UsageError(
        f"{path}: no safetensors checkpoint found (expected rank-*-of-*.safetensors, "
        f"{SINGLE}, {INDEX} or shard-*-model-*.safetensors)",
        path=str(path),
    )


def open_checkpoint(
    path: str | Path,
    *,
    fmt: str | None = None,
    layout: Any = None,
    mesh_sizes: dict[str, int] | None = None,
) -> Checkpoint:
    """Open a checkpoint of any readable format.

    Args:
        path: a checkpoint directory, or one ``.safetensors`` file.
        fmt: force a format (``per-rank``, ``hf``, ``dcp-safetensors``, ``dcp``).
        layout: a :class:`reshard.config.LayoutConfig` for per-rank files that do not
            describe themselves (or to override their description).
        mesh_sizes: override mesh dim sizes of the layout (``--source-mesh``).
    """
    from ..config import LayoutConfig

    p = Path(path)
    if fmt is None:
        fmt = detect_format(p)
    elif fmt not in FORMATS:
        raise UsageError(f"--from {fmt!r}: unknown format (use {', '.join(FORMATS)})")
    elif not p.exists():
        raise UsageError(f"{p}: no such file or directory", path=str(p))
    if fmt == "hf":
        ckpt = open_hf(p)
    elif fmt == "dcp":
        ckpt = open_dcp(p)
    elif fmt == "dcp-safetensors":
        from .dcp_safetensors import open_dcp_safetensors

        ckpt = open_dcp_safetensors(p)
    else:
        if not p.is_dir():
            raise UsageError(f"{p}: a per-rank checkpoint is a directory", path=str(p))
        mesh: Mesh | None = None
        cfg = layout
        if cfg is not None:
            mesh = cfg.mesh.with_sizes(mesh_sizes) if mesh_sizes else cfg.mesh
            cfg = cfg.with_mesh(mesh)
        elif mesh_sizes:
            raise ConfigError(
                "--source-mesh needs --source-layout (or a self-describing checkpoint has its mesh)"
            )
        ckpt = open_per_rank(
            p,
            mesh=mesh,
            placements_for=cfg.placements_for if cfg is not None else None,
            layout_source=getattr(cfg, "source", "the layout"),
        )
        manifest = read_manifest(p)
        ckpt.manifest = manifest
        if cfg is None and manifest is not None and "rules" in manifest:
            try:
                cfg = LayoutConfig.from_json(
                    {"mesh": manifest["mesh"], "rules": manifest["rules"]}, source=str(p / MANIFEST)
                )
            except (ConfigError, KeyError, TypeError) as e:
                raise LayoutError(
                    f"{p / MANIFEST}: invalid layout rules ({e})", path=str(p / MANIFEST)
                ) from None
        if cfg is None:
            cfg = _exact_rules(ckpt)
        ckpt.layout = cfg
        return ckpt
    if ckpt.manifest is None and p.is_dir():
        ckpt.manifest = read_manifest(p)
    return ckpt


def _exact_rules(ckpt: Checkpoint) -> Any:
    """One exact-name rule per tensor, from a self-described checkpoint's placements."""
    from ..config import LayoutConfig

    assert ckpt.mesh is not None
    rules = [
        ["re:" + re.escape(t.name), [str(p) for p in (t.placements or ())]] for t in ckpt.tensors.values()
    ]
    return LayoutConfig.from_json(
        {"mesh": ckpt.mesh.to_json(), "rules": rules}, source=f"{ckpt.path} (file metadata)"
    )
