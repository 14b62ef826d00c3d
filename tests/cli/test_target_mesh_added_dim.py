"""A --target-mesh dim the rules do not name replicates every tensor over it: convert and plan
warn, suggesting the dim that may have been meant (a misspelt ``dp_shard`` for ``fsdp`` wrote
4x the checkpoint with no word of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RESHARD = str(Path(sys.executable).parent / "reshard")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, check=False)


def test_an_added_dim_is_warned_about(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    q = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    save_file({"model.layers.0.self_attn.q_proj.weight": q}, str(hf / "model.safetensors"))
    want = (
        '--target-mesh adds dim "dp_shard" (size 4), which the rules of llama-fsdp-tp do not name '
        "(their mesh: fsdp=2,tp=4): every tensor is replicated over it, 4 copies of each; "
        'did you mean "fsdp"?'
    )
    args = ["--target-layout", "llama-fsdp-tp", "--target-mesh", "dp_shard=4,tp=2"]
    p = _run("plan", hf, *args, "--quiet")
    assert p.returncode == 0, p.stderr
    assert f"warning: {want}" in p.stderr
    p = _run("plan", hf, *args, "--json")
    assert want in json.loads(p.stdout)["warnings"]
    out = tmp_path / "out"
    p = _run("convert", hf, out, *args, "--json")
    assert p.returncode == 0, p.stderr
    assert want in json.loads(p.stdout)["warnings"]
    # what the warning says: 2 x 4 x 2 ranks, the dp_shard copies alike (fsdp=2 x tp=2 of q)
    files = sorted(out.glob("rank-*.safetensors"))
    assert len(files) == 16
    locals_ = [load_file(str(f))["model.layers.0.self_attn.q_proj.weight"] for f in files]
    for fsdp in range(2):
        for d in range(4):
            for tp in range(2):
                assert torch.equal(locals_[fsdp * 8 + d * 2 + tp], locals_[fsdp * 8 + tp])
    # sizes of the layout's own dims, or an added dim of size 1: no warning
    for ok in (["--target-mesh", "fsdp=4,tp=2"], ["--target-mesh", "dp=1,tp=2"]):
        p = _run("plan", hf, "--target-layout", "llama-fsdp-tp", *ok, "--json")
        assert p.returncode == 0, p.stderr
        assert not [w for w in json.loads(p.stdout)["warnings"] if "--target-mesh adds" in w]
    # the source's rules reused on a mesh with a new dim (self-described TP-2 -> tp=2 x dp=2)
    tp2 = tmp_path / "tp2"
    assert _run("convert", hf, tp2, "--target-layout", "llama-tp", "--target-mesh", "tp=2").returncode == 0
    p = _run("plan", tp2, "--target-mesh", "tp=2,dp=2", "--json")
    assert p.returncode == 0, p.stderr
    (w,) = [w for w in json.loads(p.stdout)["warnings"] if "--target-mesh adds" in w]
    assert w.startswith('--target-mesh adds dim "dp" (size 2), which the source\'s rules do not name')
