#!/usr/bin/env python3
"""Planning at scale: a synthetic N-tensor per-rank checkpoint (no files) planned for a W-rank target.

Usage: python scripts/bench_plan.py [--tensors 100000] [--source-tp 8] [--target-tp 64]
Prints the time to build the source description, to plan, and the plan's size
(copies and output-file entries).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reshard.checkpoint import Checkpoint, TensorSource  # noqa: E402
from reshard.formats import writer  # noqa: E402
from reshard.layout import TensorLayout  # noqa: E402
from reshard.mesh import Mesh  # noqa: E402
from reshard.plan import make_plan  # noqa: E402

KINDS = [  # (suffix, shape, source/target placement)
    ("self_attn.q_proj.weight", (4096, 4096), "S(0)"),
    ("self_attn.k_proj.weight", (1024, 4096), "S(0)"),
    ("self_attn.v_proj.weight", (1024, 4096), "S(0)"),
    ("self_attn.o_proj.weight", (4096, 4096), "S(1)"),
    ("mlp.gate_proj.weight", (14336, 4096), "S(0)"),
    ("mlp.up_proj.weight", (14336, 4096), "S(0)"),
    ("mlp.down_proj.weight", (4096, 14336), "S(1)"),
    ("input_layernorm.weight", (4096,), "R"),
    ("post_attention_layernorm.weight", (4096,), "R"),
    ("mlp.experts.gate_up_proj", (8, 8192, 4096), "_S(1, 2)"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--source-tp", type=int, default=8)
    ap.add_argument("--target-tp", type=int, default=64)
    args = ap.parse_args()
    src_mesh = Mesh(("tp",), (args.source_tp,))
    t0 = time.perf_counter()
    tensors = {}
    rule = {}
    for i in range(args.tensors):
        suffix, shape, pl = KINDS[i % len(KINDS)]
        name = f"model.layers.{i // len(KINDS)}.{suffix}"
        lay = TensorLayout.make(shape, src_mesh, [pl])
        tensors[name] = TensorSource(
            name=name,
            dtype="BF16",
            shape=lay.shape,
            piece_files=tuple(range(src_mesh.size)),
            piece_offsets=tuple(range(src_mesh.size)),
            piece_blocks=lay.blocks(),
            signature=("layout", lay.shape, src_mesh.shape, lay.placements),
            placements=lay.placements,
        )
        rule[name] = [pl]
    ck = Checkpoint(
        "synthetic",
        "per-rank",
        tuple(f"r{r}" for r in range(src_mesh.size)),
        (0,) * src_mesh.size,
        tensors,
        mesh=src_mesh,
    )
    t1 = time.perf_counter()
    plan = make_plan(ck, Mesh(("tp",), (args.target_tp,)), rule.__getitem__, writer=writer("per-rank"))
    t2 = time.perf_counter()
    copies = sum(len(c) for t in plan.tensors for c in t.copies)
    entries = len(plan.tensors) * len(plan.files)
    print(
        f"{args.tensors} tensors, tp={args.source_tp} -> tp={args.target_tp}: "
        f"source description {t1 - t0:.2f} s, plan {t2 - t1:.2f} s, "
        f"{len(plan.files)} files, {entries} file entries, {copies} copies, "
        f"{len({id(t.copies) for t in plan.tensors})} distinct copy templates"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
