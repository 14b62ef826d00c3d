"""The import graph: no cycles (function-level imports included) and no edge up the layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2] / "reshard"

# lowest first; a module may import its own layer or any lower one (docs/ARCHITECTURE.md)
LAYERS = [
    {"version", "errors", "dtypes", "intervals", "text", "jsonout"},
    {"io.safe"},
    {"placements", "mesh"},
    {"layout", "config", "checkpoint", "indexmap"},
    {"transforms"},
    {"heads"},
    {"plan", "select", "transform_plan"},
    {
        "io",
        "io.header",
        "io.torchzip",
        "io.zipstream",
        "io.torchsave",
        "io.unpickle",
        "io.pt_pickle",
        "io.checksum",
        "io.pages",
        "io.spool",
        "io.reader",
        "io.views",
        "io.readhash",
        "io.writer",
        "io.lock",
        "io.staging",
        "torch_ops",
    },
    {"io.pickle_emit", "io.torchzip_write", "io.dcp_metadata"},
    {"formats.base", "formats.safetensors", "formats.manifest", "formats.hf_extras"},
    {"formats.dcp_boxes", "formats.torch_dist"},
    {"formats.per_rank", "formats.hf", "formats.dcp_safetensors", "formats.dcp", "formats.dcp_writer"},
    {"formats.sharded_state", "formats.pt", "formats"},
    {"budget", "bulk", "execute", "resume", "compare", "bulkcheck", "verify", "check", "report", "show"},
    {"dist", "convert"},
    {"cli", "demo", "api", "__main__", "formats.__main__", ""},
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix("__init__").rstrip(".")] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [
                    a.name.removeprefix("reshard").lstrip(".")
                    for a in node.names
                    if a.name.startswith("reshard")
                ]
            elif node.level:
                base = pkg.split(".") if pkg else []
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
                targets = [
                    f"{mod}.{a.name}".lstrip(".") if f"{mod}.{a.name}".lstrip(".") in mods else mod
                    for a in node.names
                ]
            elif (node.module or "").startswith("reshard"):
                targets = [node.module.removeprefix("reshard").lstrip(".")]  # type: ignore[union-attr]
            else:
                continue
            edges[m].update(t for t in targets if t in mods and t != m)
    return edges


def test_no_import_cycles() -> None:
    edges = _edges(_modules())

    def reach(a: str) -> set[str]:
        seen: set[str] = set()
        todo = [a]
        while todo:
            for b in edges[todo.pop()]:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    cycles = sorted((a, b) for a in edges for b in edges[a] if a in reach(b))
    assert cycles == []


def test_imports_only_go_down_the_layers() -> None:
    mods = _modules()
    layer = {m: i for i, ms in enumerate(LAYERS) for m in ms}
    assert sorted(set(mods) - set(layer)) == [], "place new modules in LAYERS (docs/ARCHITECTURE.md)"
    up = sorted((a, b) for a, bs in _edges(mods).items() for b in bs if layer[b] > layer[a])
    assert up == []
