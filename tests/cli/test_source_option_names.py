"""Errors met opening a source name the options of the command that met them.

``inspect`` takes ``--layout``, ``verify`` ``--layout-a``/``--layout-b`` (and ``--mesh-a``/
``--mesh-b``), ``convert`` and ``plan`` ``--source-layout``: a message telling an ``inspect``
user to pass ``--source-layout`` sent them to an option that command refuses. And per-rank
files named ``rank-0.safetensors`` (``save_file`` per rank, no description) without a layout
said "none has one rank number in its name", which they plainly have.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

RESHARD = str(Path(sys.executable).parent / "reshard")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("names")
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(8, 6, generator=g), "n": torch.randn(6, generator=g)}
    (base / "hf").mkdir()
    save_file(full, str(base / "hf" / "model.safetensors"))
    for d, name in (("loose", "rank-{r}.safetensors"), ("strict", "rank-{r:05d}-of-00004.safetensors")):
        (base / d).mkdir()
        for r in range(4):
            local = {"w": full["w"].chunk(4, 0)[r].contiguous(), "n": full["n"]}
            save_file(local, str(base / d / name.format(r=r)))
    (base / "l.yaml").write_text('mesh: {tp: 4}\nplacements:\n  "w": {tp: S(0)}\n  "n": {tp: R}\n')
    (base / "l2.yaml").write_text('mesh: {tp: 2}\nplacements:\n  "w": {tp: S(0)}\n  "n": {tp: R}\n')
    return base


@pytest.mark.parametrize("kind", ["loose", "strict"])
def test_each_command_names_its_own_layout_option(ckpts: Path, kind: str) -> None:
    src = ckpts / kind
    cases = [
        (["inspect", src], "--layout FILE"),
        (["inspect", src, "--check"], "--layout FILE"),
        (["verify", src, ckpts / "hf"], "--layout-a FILE"),
        (["verify", ckpts / "hf", src], "--layout-b FILE"),
        (["plan", src, "--consolidate"], "--source-layout FILE"),
        (["convert", src, ckpts / f"out-{kind}", "--consolidate"], "--source-layout FILE"),
    ]
    for args, option in cases:
        r = _run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "not describe" in r.stderr and option in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
        if option != "--source-layout FILE":
            assert "--source-layout" not in r.stderr, (args, r.stderr)
    assert not (ckpts / f"out-{kind}").exists()
    if kind == "loose":  # not "no rank number in its name": it names the files it took for ranks
        r = _run("inspect", src)
        assert "4 files named as ranks (rank-0.safetensors, rank-1.safetensors" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["loose", "strict"])
def test_the_options_the_messages_name_work(ckpts: Path, kind: str) -> None:
    src, hf, lay = ckpts / kind, ckpts / "hf", ckpts / "l.yaml"
    assert _run("inspect", src, "--layout", lay, "--check").returncode == 0
    r = _run("verify", src, hf, "--layout-a", lay)
    assert r.returncode == 0 and "equal: 2 tensors" in r.stderr, r.stdout + r.stderr
    assert _run("verify", hf, src, "--layout-b", lay).returncode == 0
    # --mesh-a resizes A's layout as --source-mesh does: a 2-rank layout read on the 4 files
    r = _run("verify", src, hf, "--layout-a", ckpts / "l2.yaml", "--mesh-a", "tp=4")
    assert r.returncode == 0, r.stdout + r.stderr
    bad = _run("verify", src, hf, "--layout-a", lay, "--mesh-a", "tp=")
    assert bad.returncode == 2 and "--mesh-a" in bad.stderr and "--source-mesh" not in bad.stderr, bad.stderr
