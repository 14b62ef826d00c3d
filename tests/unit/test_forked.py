"""reshard.forked: work split over forked children, results and errors back in the parent.

Each case runs in a fresh interpreter (a subprocess): the pytest process may have threads
(pytest-xdist's), and :func:`reshard.forked.usable` rightly refuses to fork then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import save_file

ROOT = Path(__file__).parents[2]
RESHARD = str(Path(sys.executable).parent / "reshard")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(script: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", "from reshard.forked import *\nimport json, os, sys\n" + script],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jobs_run_in_children_and_results_come_back_in_order() -> None:
    got = _run(
        "r = run_split([lambda i=i: (i, os.getpid(), os.getppid()) for i in range(3)])\n"
        "print(json.dumps({'r': r, 'me': os.getpid()}))"
    )
    me = got["me"]
    r = got["r"]
    assert [x[0] for x in r] == [0, 1, 2]  # type: ignore[index,union-attr]
    assert r[0][1] == me  # type: ignore[index]
    assert {x[1] for x in r[1:]}.isdisjoint({me}) and all(x[2] == me for x in r[1:])  # type: ignore[index,union-attr]
    assert len({x[1] for x in r}) == 3  # type: ignore[union-attr]


def test_a_childs_error_is_raised_in_the_parent_with_its_attributes() -> None:
    got = _run(
        "from reshard.errors import HeaderError\n"
        "def bad():\n"
        "    raise HeaderError('broken header', path='/x/f.safetensors', tensor='w', hint='fix it')\n"
        "try:\n"
        "    run_split([lambda: 1, bad, lambda: 3])\n"
        "except HeaderError as e:\n"
        "    print(json.dumps({'type': type(e).__name__, 'msg': str(e), 'path': e.path, 'tensor': e.tensor,\n"
        "                      'hint': e.hint, 'code': e.exit_code}))\n"
    )
    assert got == {
        "type": "HeaderError",
        "msg": "broken header",
        "path": "/x/f.safetensors",
        "tensor": "w",
        "hint": "fix it",
        "code": 2,
    }


def test_an_unpicklable_error_or_result_still_comes_back_as_a_message() -> None:
    got = _run(
        "class Odd(Exception):\n"
        "    def __init__(self):\n"
        "        super().__init__('odd'); self.f = lambda: 0\n"
        "def bad():\n"
        "    raise Odd()\n"
        "out = {}\n"
        "for name, job in (('error', bad), ('result', lambda: (lambda: 0))):\n"
        "    try:\n"
        "        run_split([lambda: 1, job])\n"
        "    except Exception as e:\n"
        "        out[name] = [type(e).__name__, str(e)]\n"
        "print(json.dumps(out))\n"
    )
    assert got["error"] == ["ReshardError", "Odd: odd"]
    assert "pickle" in str(got["result"]).lower()  # the result's pickling error, named


def test_a_child_that_dies_is_an_error_and_no_child_is_left() -> None:
    got = _run(
        "import signal\n"
        "from reshard.errors import ReshardError\n"
        "try:\n"
        "    run_split([lambda: 1, lambda: os.kill(os.getpid(), signal.SIGKILL)])\n"
        "    out = 'no error'\n"
        "except ReshardError as e:\n"
        "    out = str(e)\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG); left = True\n"
        "except ChildProcessError:\n"
        "    left = False\n"
        "print(json.dumps({'out': out, 'left': left}))\n"
    )
    assert "ended without a result" in got["out"] and "-9" in got["out"]  # type: ignore[operator]
    assert got["left"] is False


def test_the_parents_own_failure_kills_and_reaps_the_children() -> None:
    got = _run(
        "import time\n"
        "def slow():\n"
        "    time.sleep(60); return 1\n"
        "def bad():\n"
        "    raise ValueError('parent failed')\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    run_split([bad, slow, slow])\n"
        "except ValueError as e:\n"
        "    msg = str(e)\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG); left = True\n"
        "except ChildProcessError:\n"
        "    left = False\n"
        "print(json.dumps({'msg': msg, 'left': left, 'fast': time.monotonic() - t < 30}))\n"
    )
    assert got == {"msg": "parent failed", "left": False, "fast": True}


def test_with_another_thread_or_torch_or_no_fork_nothing_is_forked() -> None:
    got = _run(
        "import threading\n"
        "ev = threading.Event(); th = threading.Thread(target=ev.wait); th.start()\n"
        "r = run_split([os.getpid, os.getpid])\n"
        "ev.set(); th.join()\n"
        "os.environ['RESHARD_NO_FORK'] = '1'\n"
        "r2 = run_split([os.getpid, os.getpid])\n"
        "del os.environ['RESHARD_NO_FORK']\n"
        "r3 = run_split([os.getpid, os.getpid])\n"
        "import torch\n"
        "r4 = run_split([os.getpid, os.getpid])\n"
        "print(json.dumps([len(set(x)) for x in (r, r2, r3, r4)]))\n"
    )
    assert got == [1, 1, 2, 1]  # threads, RESHARD_NO_FORK, (forked), torch imported


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two HF files of 9000 small tensors (over verify's split threshold), differing in the
    first and the last tensor: each in another process's part."""
    import numpy as np

    base = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(3)
    ts = {f"layers.{i}.w": rng.integers(-100, 100, size=(4, 8), dtype=np.int16) for i in range(9000)}
    (base / "a").mkdir()
    (base / "b").mkdir()
    save_file(ts, str(base / "a" / "model.safetensors"))
    ts["layers.0.w"] = ts["layers.0.w"].copy()
    ts["layers.0.w"][1, 2] += 1
    ts["layers.8999.w"] = ts["layers.8999.w"].copy()
    ts["layers.8999.w"][3, 7] += 1
    save_file(ts, str(base / "b" / "model.safetensors"))
    return base / "a", base / "b"


def test_verify_split_over_processes_finds_differences_in_every_part(many: tuple[Path, Path]) -> None:
    a, b = many
    cmd = [RESHARD, "verify", str(a), str(b), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert [(d["tensor"], d["index"]) for d in doc["differences"]] == [
        ("layers.0.w", [1, 2]),
        ("layers.8999.w", [3, 7]),
    ]
    assert doc["tensors"] == 9000 and doc["bytes_compared"] == 9000 * 64
    # the same verdict in one process
    one = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "RESHARD_NO_FORK": "1"})
    assert one.returncode == 1 and json.loads(one.stdout) == doc
    # and the CLI did fork once (two parts) where two CPUs are free, not at all without them
    count = (
        "import os, sys\nn = [0]\nfork = os.fork\n"
        "def counted():\n    n[0] += 1\n    return fork()\n"
        "os.fork = counted\nfrom reshard.cli import app\nsys.argv = ['reshard', *sys.argv[1:]]\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\nprint('forks', n[0], file=sys.stderr)\n"
    )
    for env, want in ((ENV, min(2, len(os.sched_getaffinity(0))) - 1), ({**ENV, "RESHARD_NO_FORK": "1"}, 0)):
        run = subprocess.run([sys.executable, "-c", count, *cmd[1:]], capture_output=True, text=True, env=env)
        assert f"forks {want}" in run.stderr, run.stderr


def test_verify_parts_hold_about_the_same_bytes() -> None:
    from reshard.checkpoint import Checkpoint
    from reshard.verify import _parts

    class T:
        def __init__(self, n: int) -> None:
            self.numel, self.dtype = n, "F32"

    sizes = [1 << 26] + [1 << 10] * 9999  # one big tensor first, then many small
    ck = Checkpoint(
        path="x",
        format="hf",
        files=(),
        file_sizes=(),
        tensors={f"t{i}": T(n) for i, n in enumerate(sizes)},  # type: ignore[misc]
    )
    names = list(ck.tensors)
    assert _parts(ck, names, 1) == [(0, 10000)]
    parts = _parts(ck, names, 2)
    assert parts[0][0] == 0 and parts[-1][1] == 10000 and len(parts) == 2
    assert parts[0] == (0, 1)  # the big tensor is half the bytes on its own
    three = _parts(ck, names, 3)
    assert len(three) == 3 and [p[0] for p in three[1:]] == [p[1] for p in three[:-1]]


def test_ctrl_c_reaches_parent_and_children_and_none_is_left() -> None:
    """Ctrl-C (SIGINT to the process group) while a child works: the parent raises
    KeyboardInterrupt, the child ends, nothing is left running or unreaped."""
    got = _run(
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "os.setpgrp()\n"
        "def parent():\n"
        "    time.sleep(0.5)\n"
        "    os.killpg(os.getpgrp(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "def child():\n"
        "    time.sleep(60); return 1\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    run_split([parent, child])\n"
        "    out = 'finished'\n"
        "except KeyboardInterrupt:\n"
        "    out = 'interrupted'\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG); left = True\n"
        "except ChildProcessError:\n"
        "    left = False\n"
        "print(json.dumps({'out': out, 'left': left, 'fast': time.monotonic() - t < 20}))\n"
    )
    assert got == {"out": "interrupted", "left": False, "fast": True}


def test_an_interrupted_verify_says_interrupted_not_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    import reshard.verify
    from reshard.cli import app

    save_file({"w": __import__("numpy").zeros(4, "float32")}, str(tmp_path / "model.safetensors"))

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(reshard.verify, "verify_checkpoints", interrupted)
    out = CliRunner().invoke(app, ["verify", str(tmp_path), str(tmp_path)])
    assert out.exit_code == 130
    assert "interrupted" in out.output and "--resume" not in out.output
