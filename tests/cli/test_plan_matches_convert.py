"""`reshard plan` figures are what `convert` then does.

Workers do not change a byte; no torch on the copy path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.demo import build_demo

RESHARD = str(Path(sys.executable).parent / "reshard")
ROOT = Path(__file__).resolve().parents[2]
LAYOUT = str(ROOT / "configs" / "llama-tp.yaml")


def reshard(*args: str) -> tuple[int, str, str, int]:
    """Run the CLI; returns (exit code, stdout, stderr, peak RSS bytes of that process)."""
    p = subprocess.Popen([RESHARD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err, 0


_MEASURE = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "_, status, ru = os.wait4(p.pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), ru.ru_maxrss * 1024)\n"
)


def peak_rss(*args: str) -> int:
    """Peak RSS of `reshard ARGS`, forked from a small interpreter: a child forked from this
    test process (torch imported) would start its high-water mark at our size."""
    p = subprocess.run(
        [sys.executable, "-c", _MEASURE, RESHARD, *args], capture_output=True, text=True, timeout=120
    )
    code, rss = p.stdout.split()
    assert code == "0", p.stderr
    return int(rss)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    build_demo(out, layers=2)
    return out / "tp4"


@pytest.mark.parametrize(
    "target",
    [
        ["--target-mesh", "tp=8"],
        ["--consolidate"],
        ["--target-mesh", "tp=3"],
        ["--consolidate", "--dtype", "fp32"],
    ],
)
def test_plan_figures_match_the_conversion(demo: Path, tmp_path: Path, target: list[str]) -> None:
    code, out, err, _ = reshard("plan", str(demo), "--source-layout", LAYOUT, *target, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert not any(tmp_path.iterdir()), "plan must not write"
    code, out, err, _ = reshard(
        "convert", str(demo), str(tmp_path / "o"), "--source-layout", LAYOUT, *target, "--json"
    )
    assert code == 0, err
    done = json.loads(out)
    assert [f["name"] for f in plan["files"]] == [f["name"] for f in done["files"]]
    for pf, df in zip(plan["files"], done["files"]):
        assert pf["bytes_written"] == df["size"] == (tmp_path / "o" / df["name"]).stat().st_size
    assert plan["totals"]["bytes_written"] == done["bytes_written"]
    # bytes the executor actually moved, counted as it moved them
    assert plan["totals"]["bytes_read"] == done["bytes_read"]
    assert plan["totals"]["copies"] == done["copies"]
    # the peak-memory estimate bounds what the process used, and is not wildly above it
    rss = peak_rss("convert", str(demo), str(tmp_path / "o2"), "--source-layout", LAYOUT, *target, "--quiet")
    est = plan["peak_memory_estimate"]
    assert rss <= est <= 2 * rss, (rss, est)


def test_workers_do_not_change_a_byte(demo: Path, tmp_path: Path) -> None:
    outs = []
    for w in (1, 2, 3):
        o = tmp_path / f"w{w}"
        code, _, err, _ = reshard(
            "convert",
            str(demo),
            str(o),
            "--source-layout",
            LAYOUT,
            "--target-mesh",
            "tp=8",
            "--workers",
            str(w),
            "--max-memory",
            "1MiB",
        )
        assert code == 0, err
        outs.append(o)
    names = sorted(os.listdir(outs[0]))
    for o in outs[1:]:
        assert sorted(os.listdir(o)) == names
        for n in names:
            assert (o / n).read_bytes() == (outs[0] / n).read_bytes(), (o, n)


def test_copy_path_never_imports_torch(demo: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from reshard.cli import app\n"
        f"sys.argv = ['reshard', 'convert', {str(demo)!r}, {str(tmp_path / 'o')!r}, "
        f"'--source-layout', {LAYOUT!r}, '--target-mesh', 'tp=8', '--quiet']\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        f"sys.argv = ['reshard', 'inspect', {str(tmp_path / 'o')!r}, '--check', '--quiet']\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported by inspect'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
