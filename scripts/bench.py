#!/usr/bin/env python3
"""Benchmark reshard against `cp -r` of the same bytes (and the naive torch approach).

Generates a synthetic Llama-like bf16 checkpoint, TP-4, per-rank (row-sharded
q/k/v/gate/up, column-sharded o/down, vocab-sharded embeddings, replicated
norms), then runs, alternating, for several rounds:

  cp       cp -r of the source directory
  tp4-tp8  reshard convert SRC OUT --target-mesh tp=8
  tp4-hf   reshard convert SRC OUT --consolidate
  hf-tp8   reshard convert HF OUT --target-layout llama-tp --target-mesh tp=8
  hf-tt8   reshard convert HF OUT --transforms hf-to-torchtitan-llama (TP-8, torchtitan names;
           not a default job: --jobs hf-tt8)
  naive-*  load everything with torch, cat, chunk, save_file (one round; --naive-rounds)

and with --dcp, on a DCP safetensors checkpoint of the same tensors that torch's
HuggingFaceStorageWriter writes from 4 gloo ranks:

  dcp-hf        reshard convert DCP OUT --consolidate
  torch-dcp-hf  torch's consolidate_safetensors_files (one round; --naive-rounds)

With --tensors N, the checkpoint is instead N small int16 tensors, the shape of a
mixture-of-experts model (--mix s0: 16x256 tensors all S(0); --mix moe: 64 experts per
layer of gate/up S(0) 32x192, down S(1) 192x32, and replicated norms), and the jobs also
take the commands whose cost grows with the tensor count:

  inspect   reshard inspect TP8 --json        plan    reshard plan SRC --target-mesh tp=8
  check     reshard inspect TP8 --check       verify  reshard verify TP8 HF
  hf-ep8    (--mix moe, not a default job: --jobs hf-ep8) reshard convert HF OUT --target-layout
            mixtral-moe --target-mesh ep=8: each expert whole on one of 8 ranks (Own(expert)),
            an incomplete last layer excluded

(TP8: the self-described TP-8 checkpoint reshard wrote from SRC)

With --big-tensor, the checkpoint is instead a few big bf16 tensors in one HF file (a
262144 x 4096 embedding, 2 GiB, column-split S(1): rows of 1/8 width; a 131072 x 4096
lm_head S(0); a 32768 x 8192 gate_up _S(0, 2); norms R): memory must stay bounded by the
buffers, not by a tensor. `cp` is then `cp -r` of the HF file, and the jobs are

  big-hf-tp8     reshard convert HF OUT --target-layout BIG (TP-8)
  big-tp8-hf     reshard convert TP8 OUT --consolidate
  big-hf-dcp8    reshard convert HF OUT --to dcp (the _S(0, 2) tensor S(1): DCP holds one box a rank)
  big-dcp8-hf    reshard convert DCP8 OUT --consolidate
  big-check      reshard inspect DCP8 --check (8 files of 128-256 MiB chunks, CRC32 each)
  big-verify     reshard verify TP8 HF

plus an in-process phase split (µs per tensor per rank file: header parsing, planning,
copying) that should not grow with N (e.g. --tensors 10000, 100000, 200000).

With --pt, on veRL-style per-rank torch.save files of the same tensors (DTensors on a
("tp",) mesh, model_world_size_4_rank_{r}.pt, written by 4 gloo ranks):

  pt-hf         reshard convert PT OUT --consolidate
  torch-pt-hf   torch.load each file, cat the local tensors, save_file (one round; --naive-rounds)

and with --distcp, on torch DCP's default format (`.metadata` + `__{rank}_0.distcp`) of the
same tensors, written by dcp.save (FileSystemWriter) from 4 gloo ranks (DTensors on ("tp",)):

  distcp-hf         reshard convert DISTCP OUT --consolidate
  torch-distcp-hf   torch: dcp_to_torch_save (one process, the whole model in RAM), torch.load,
                    save_file (one round; --naive-rounds)

and with --dcp-write, writing DCP (torch Distributed Checkpoint, .metadata + .distcp):

  hf-dcp8        reshard convert HF OUT --to dcp --target-layout llama-tp --target-mesh tp=8
  torch-hf-dcp8  torch: 8 gloo ranks read HF tensor by tensor, distribute_tensor, dcp.save
                 (one round; --naive-rounds)

With --ranks N (e.g. 64), checkpoints of N ranks are made once (TP-N per-rank files and a
DCP of N ranks, from the HF file) and the jobs are the ones whose cost grows with the rank count
(`cp` stays `cp -r` of the TP-4 source, the same bytes):

  hf-tpN    reshard convert HF OUT --target-layout L --target-mesh tp=N
  tpN-hf    reshard convert TPN OUT --consolidate      tpN-tp8   ... TPN OUT --target-mesh tp=8
  tp8-tpN   reshard convert TP8 OUT --target-mesh tp=N
  hf-dcpN   reshard convert HF OUT --to dcp --target-layout L --target-mesh tp=N
  dcpN-hf   reshard convert DCPN OUT --consolidate
  inspectN / checkN / verifyN / planN   inspect --json, inspect --check, verify TPN HF,
            plan TPN --target-mesh tp=8

(the layout's sharded dims need not divide by N: torch.chunk's rule, trailing shards empty).

It prints one table: median wall time and spread, GB/s, peak RSS of the
child process (os.wait4), the ratio to `cp` measured in the same rounds, and the
median CPU seconds (user + system) of the child.
Everything runs in the page cache unless --cold (then sources are evicted
with posix_fadvise(DONTNEED) after a sync before each run).

Usage: python scripts/bench.py --size-gb 2 [--rounds 5] [--workers 1] [--dir /tmp/reshard-bench]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reshard.io.header import encode_header  # noqa: E402

VOCAB, HIDDEN, FFN, KV = 32000, 2048, 5632, 512
BIG = [  # --big-tensor: (name, shape, placement on tp); bf16
    ("model.embed_tokens.weight", (262144, 4096), "S(1)"),
    ("lm_head.weight", (131072, 4096), "S(0)"),
    ("model.layers.0.mlp.gate_up_proj.weight", (32768, 8192), '"_S(0, 2)"'),
    ("model.layers.0.input_layernorm.weight", (4096,), "R"),
    ("model.norm.weight", (4096,), "R"),
]
TP = 4


def layer_shapes(layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape, shard dim or None)."""
    out: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,), None),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN), 0),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN), 0),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1),
            (p + "post_attention_layernorm.weight", (HIDDEN,), None),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN), 0),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN), 0),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN), 1),
        ]
    out += [("model.norm.weight", (HIDDEN,), None), ("lm_head.weight", (VOCAB, HIDDEN), 0)]
    return out


def nbytes(shape: tuple[int, ...]) -> int:
    n = 2
    for s in shape:
        n *= s
    return n


def generate_big(hf: Path) -> None:
    """The --big-tensor HF file (pseudo-random bf16 bits, written 64 MiB at a time) and its layouts."""
    import numpy as np

    hf.mkdir(parents=True)
    prefix, header = encode_header([(n, "BF16", shape) for n, shape, _ in BIG])
    rng = np.random.default_rng(7)
    with open(hf / "model.safetensors", "wb") as f:
        f.write(prefix)
        for e in header.entries:
            left = e.nbytes
            while left:
                k = min(left, 64 << 20)
                f.write(rng.integers(0, 1 << 16, k // 2, dtype=np.uint16).tobytes())
                left -= k
    rules = "".join(f'  "{n}": {{tp: {pl}}}\n' for n, _, pl in BIG)
    (hf.parent / "big-layout.yaml").write_text("mesh: {tp: 8}\nplacements:\n" + rules)
    (hf.parent / "big-dcp-layout.yaml").write_text(
        "mesh: {tp: 8}\nplacements:\n" + rules.replace('"_S(0, 2)"', "S(1)")
    )


def layers_for(size_gb: float) -> int:
    fixed = 2 * nbytes((VOCAB, HIDDEN))
    per = sum(nbytes(s) for _, s, _ in layer_shapes(1)) - fixed - nbytes((HIDDEN,))
    return max(1, round((size_gb * 1e9 - fixed) / per))


def generate(src: Path, layers: int) -> None:
    """Write the TP-4 per-rank source with pseudo-random bf16 bits (no torch)."""
    import numpy as np

    src.mkdir(parents=True)
    tensors = layer_shapes(layers)
    index = {name: (i, d) for i, (name, _, d) in enumerate(tensors)}
    for r in range(TP):
        specs = []
        for name, shape, d in tensors:
            local = list(shape)
            if d is not None:
                local[d] = shape[d] // TP
            specs.append((name, "BF16", local))
        prefix, header = encode_header(specs)
        with open(src / f"rank-{r:05d}-of-{TP:05d}.safetensors", "wb") as f:
            f.write(prefix)
            for e in header.entries:  # in file order (the header sorts them)
                # a replicated tensor holds the same bits on every rank (inspect --check proves it)
                i, d = index[e.name]
                rng = np.random.default_rng([i, r if d is not None else TP])
                f.write(rng.integers(0, 1 << 16, e.nbytes // 2, dtype=np.uint16).tobytes())
    layout = ROOT / "configs" / "llama-tp.yaml"
    shutil.copy(layout, src.parent / "layout.yaml")


NAIVE_TP8 = r"""
import sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
import os, re
os.makedirs(dst, exist_ok=True)
ranks = [load_file(f"{src}/rank-{r:05d}-of-00004.safetensors") for r in range(4)]
def dim(n):
    if re.search(r"(q|k|v|gate|up)_proj|embed_tokens|lm_head", n): return 0
    if re.search(r"(o|down)_proj", n): return 1
    return None
full = {n: (torch.cat([r[n] for r in ranks], dim(n)) if dim(n) is not None else ranks[0][n])
        for n in ranks[0]}
del ranks
W = int(sys.argv[3])
if W == 1:
    save_file(full, f"{dst}/model.safetensors")
else:
    for r in range(W):
        save_file({n: (t.chunk(W, dim(n))[r].contiguous() if dim(n) is not None else t)
                   for n, t in full.items()},
                  f"{dst}/rank-{r:05d}-of-{W:05d}.safetensors")
"""


GEN_DCP = r"""
import os, re, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor
import torch.multiprocessing as mp

def dim(n):
    if re.search(r"(q|k|v|gate|up)_proj|embed_tokens|lm_head", n): return 0
    if re.search(r"(o|down)_proj", n): return 1
    return None

def worker(rank, src, out):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    dist.init_process_group("gloo", init_method=f"file://{out}.rendezvous", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    local = load_file(f"{src}/rank-{rank:05d}-of-00004.safetensors")
    sd = {n: DTensor.from_local(t, mesh, [Shard(dim(n))] if dim(n) is not None else [Replicate()],
                                run_check=False) for n, t in local.items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    dist.destroy_process_group()

mp.start_processes(worker, args=(sys.argv[1], sys.argv[2]), nprocs=4, join=True, start_method="fork")
"""

GEN_PT = r"""
import os, re, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.multiprocessing as mp

def dim(n):
    if re.search(r"(q|k|v|gate|up)_proj|embed_tokens|lm_head", n): return 0
    if re.search(r"(o|down)_proj", n): return 1
    return None

def worker(rank, src, out):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    dist.init_process_group("gloo", init_method=f"file://{out}.rendezvous", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    local = load_file(f"{src}/rank-{rank:05d}-of-00004.safetensors")
    sd = {n: DTensor.from_local(t, mesh, [Shard(dim(n))] if dim(n) is not None else [Replicate()],
                                run_check=False) for n, t in local.items()}
    os.makedirs(out, exist_ok=True)
    torch.save(sd, f"{out}/model_world_size_4_rank_{rank}.pt")
    dist.destroy_process_group()

mp.start_processes(worker, args=(sys.argv[1], sys.argv[2]), nprocs=4, join=True, start_method="fork")
"""

GEN_DISTCP = GEN_PT.replace(
    'os.makedirs(out, exist_ok=True)\n    torch.save(sd, f"{out}/model_world_size_4_rank_{rank}.pt")',
    "import torch.distributed.checkpoint as dcp\n    dcp.save(sd, checkpoint_id=out)",
)
assert GEN_DISTCP != GEN_PT

TORCH_DISTCP_HF = r"""
import os, sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
dcp_to_torch_save(src, f"{dst}/full.pt")
sd = torch.load(f"{dst}/full.pt", weights_only=True, mmap=True)
save_file(sd, f"{dst}/model.safetensors")
os.remove(f"{dst}/full.pt")
"""

TORCH_PT_HF = r"""
import os, sys, torch
import torch.distributed.tensor  # registers DTensor for weights_only loading
from torch.distributed.tensor import Shard
from safetensors.torch import save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
ranks = [torch.load(f"{src}/model_world_size_4_rank_{r}.pt", weights_only=True, mmap=True) for r in range(4)]
full = {}
for n, dt in ranks[0].items():
    p = dt.placements[0]
    full[n] = torch.cat([r[n].to_local() for r in ranks], p.dim) if isinstance(p, Shard) else dt.to_local()
del ranks
save_file(full, f"{dst}/model.safetensors")
"""

TORCH_DCP8 = r"""
import os, re, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor
import torch.multiprocessing as mp

def dim(n):
    if re.search(r"(q|k|v|gate|up)_proj|embed_tokens|lm_head", n): return 0
    if re.search(r"(o|down)_proj", n): return 1
    return None

RDV = f"file://{sys.argv[2]}.rendezvous-{os.getpid()}"

def worker(rank, src, out):
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=RDV, rank=rank, world_size=8)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    sd = {}
    with safe_open(f"{src}/model.safetensors", "pt") as f:
        for n in f.keys():  # one full tensor at a time; each rank keeps its shard (no communication)
            pl = [Shard(dim(n))] if dim(n) is not None else [Replicate()]
            d = distribute_tensor(f.get_tensor(n), mesh, pl, src_data_rank=None)
            sd[n] = torch.distributed.tensor.DTensor.from_local(
                d.to_local().clone(), mesh, pl, run_check=False, shape=d.shape, stride=d.stride())
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()

mp.start_processes(worker, args=(sys.argv[1], sys.argv[2]), nprocs=8, join=True, start_method="fork")
"""

TORCH_CONSOLIDATE = r"""
import os, sys
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
names = set()
for f in os.listdir(src):
    if f.endswith(".safetensors"):
        with safe_open(os.path.join(src, f), "np") as h:
            names.update(h.keys())
consolidate_safetensors_files(src, dst, fqn_to_index_mapping=dict.fromkeys(sorted(names), 1))
"""


EXPERTS = 64
MOE_LAYOUT = """mesh: {tp: 4}
placements:
  "*.down_proj.weight": {tp: S(1)}
  "*norm.weight": {tp: R}
  "*": {tp: S(0)}
"""


def moe_tensors(n: int, mix: str) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``n`` (name, global shape, shard dim or None) of a synthetic MoE checkpoint."""
    if mix == "s0":
        return [(f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w.weight", (16, 256), 0) for i in range(n)]
    out: list[tuple[str, tuple[int, ...], int | None]] = []
    layer = 0
    while len(out) < n:
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (192,), None),
            (p + "post_attention_layernorm.weight", (192,), None),
        ]
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (32, 192), 0),
                (q + "up_proj.weight", (32, 192), 0),
                (q + "down_proj.weight", (192, 32), 1),
            ]
        layer += 1
    return out[:n]


def generate_moe(src: Path, n: int, mix: str) -> None:
    """Write the TP-4 per-rank MoE source: int16 tensors, a few distinct byte patterns (fast)."""
    import numpy as np

    src.mkdir(parents=True)
    tensors = moe_tensors(n, mix)
    rng = np.random.default_rng(0)
    for r in range(TP):
        specs = []
        for name, shape, d in tensors:
            local = list(shape)
            if d is not None:
                local[d] = shape[d] // TP
            specs.append((name, "I16", local))
        prefix, header = encode_header(specs)
        pool = rng.integers(-30000, 30000, size=1 << 20, dtype=np.int16).tobytes()
        with open(src / f"rank-{r:05d}-of-{TP:05d}.safetensors", "wb") as f:
            f.write(prefix)
            chunk = bytearray()
            for i, e in enumerate(header.entries):
                at = (i * 2 * 977) % (len(pool) - e.nbytes)
                chunk += pool[at : at + e.nbytes] if "norm" not in e.name else bytes(e.nbytes)
                if len(chunk) > 1 << 22:
                    f.write(chunk)
                    chunk.clear()
            f.write(chunk)
    (src.parent / "layout.yaml").write_text(
        MOE_LAYOUT if mix == "moe" else 'mesh: {tp: 4}\nplacements:\n  "*": {tp: S(0)}\n'
    )


PHASES = r"""
import json, sys, time, shutil
from pathlib import Path
from reshard.io.header import read_header
from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
import gc; gc.disable()  # as the CLI runs
from reshard.execute import execute_plan
src, lay, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
files = sorted(Path(src).glob("*.safetensors"))
t0 = time.perf_counter(); n = len(read_header(files[0]).entries); parse = time.perf_counter() - t0
t0 = time.perf_counter()
ck = open_source(SourceSpec(src, layout=lay))
opened = time.perf_counter() - t0
t0 = time.perf_counter()
plan = build_plan(ck, resolve_target(ck, TargetSpec(mesh="tp=8")))
planned = time.perf_counter() - t0
out.mkdir()
t0 = time.perf_counter(); execute_plan(plan, out, workers=1); copied = time.perf_counter() - t0
us = 1e6 / n
print(json.dumps({"tensors": n, "parse_us": parse * us, "open_us": opened * us / len(files),
                  "plan_us": planned * us / 8, "copy_us": copied * us / 8}))
"""


def generate_pt(base: Path, src: Path) -> Path:
    """The veRL-style per-rank .pt checkpoint of the TP-4 source, written once by torch."""
    pt_dir = base / "src-pt"
    if not (base / "generated-pt").exists():
        shutil.rmtree(pt_dir, ignore_errors=True)
        sys.stderr.write(f"writing the per-rank .pt checkpoint with torch (4 gloo ranks) in {pt_dir} ...\n")
        subprocess.run([sys.executable, "-c", GEN_PT, str(src), str(pt_dir)], check=True)
        (base / "generated-pt").write_text("")
    return pt_dir


# jobs whose source is not the TP-4 directory: their ratio is to `cp -r` of their own source
CP_OF = {"distcp-hf": "cp-distcp", "torch-distcp-hf": "cp-distcp", "pt-hf": "cp-pt", "torch-pt-hf": "cp-pt"}


def generate_distcp(base: Path, src: Path) -> Path:
    """The torch DCP (.distcp) checkpoint of the TP-4 source, written once by dcp.save."""
    out = base / "src-distcp"
    if not (base / "generated-distcp").exists():
        shutil.rmtree(out, ignore_errors=True)
        sys.stderr.write(f"writing the DCP (.distcp) checkpoint with torch (4 gloo ranks) in {out} ...\n")
        subprocess.run([sys.executable, "-c", GEN_DISTCP, str(src), str(out)], check=True)
        (base / "generated-distcp").write_text("")
    return out


LAST_CPU = [0.0]


def run(cmd: list[str], cold: list[Path] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process; its CPU seconds (user + system)
    are left in ``LAST_CPU[0]`` (less skewed than wall time on a machine shared with other work)."""
    if cold:
        os.sync()
        for d in cold:
            for p in d.iterdir():
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err}")
    LAST_CPU[0] = ru.ru_utime + ru.ru_stime
    return wall, ru.ru_maxrss * 1024


# -- transforms (issue 13): HF -> torchtitan names at TP-8, q/k rows RoPE-permuted on the way --

TT_LAYOUT = """\
mesh: {tp: 8}
placements:
  "layers.*.attention.qkv_linear.w[qkv].weight": S(0)
  "layers.*.attention.wo.weight": S(1)
  "layers.*.feed_forward.w[13].weight": S(0)
  "layers.*.feed_forward.w2.weight": S(1)
  "tok_embeddings.weight": S(0)
  "lm_head.weight": S(0)
  "*": R
"""


def transform_job(reshard: str, base: Path, hf: Path, w: list[str]) -> list[str]:
    """``hf-tt8``: reshard convert HF OUT --transforms hf-to-torchtitan-llama at TP-8 (the model
    config names the head counts: 128-wide heads of HIDDEN and KV)."""
    cfg = {"num_attention_heads": HIDDEN // 128, "num_key_value_heads": KV // 128, "hidden_size": HIDDEN}
    (base / "model-config.json").write_text(json.dumps(cfg))
    (base / "tt-layout.yaml").write_text(TT_LAYOUT)
    return [
        reshard,
        "convert",
        str(hf),
        "OUT",
        "--transforms",
        "hf-to-torchtitan-llama",
        "--model-config",
        str(base / "model-config.json"),
        "--target-layout",
        str(base / "tt-layout.yaml"),
        "--quiet",
        *w,
    ]


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--generate-only":
        generate(Path(sys.argv[2]), int(sys.argv[3]))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "--generate-only":
        generate_moe(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--generate-big":
        generate_big(Path(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=0, help="a synthetic MoE checkpoint of this many tensors")
    ap.add_argument("--mix", choices=["s0", "moe"], default="s0", help="with --tensors: the layout mix")
    ap.add_argument(
        "--big-tensor", action="store_true", help="a few big tensors (a 2 GiB embedding S(1), ...) instead"
    )
    ap.add_argument("--rounds", type=int, default=5, help="0: only generate the data (with --keep)")
    ap.add_argument("--naive-rounds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0, help="reshard --workers (0: its default)")
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between runs (see MACHINE-NOTES)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/reshard-bench"))
    ap.add_argument("--jobs", default="", help="comma-separated (default: all that apply)")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument(
        "--dcp",
        action="store_true",
        help="also DCP safetensors (torch HuggingFaceStorageWriter, 4 ranks) -> consolidated: "
        "reshard (job dcp-hf) against torch's consolidate_safetensors_files (naive rounds)",
    )
    ap.add_argument(
        "--pt",
        action="store_true",
        help="also veRL-style per-rank .pt files (DTensors, 4 gloo ranks) -> consolidated: "
        "reshard (job pt-hf) against torch.load + cat + save_file (naive rounds)",
    )
    ap.add_argument(
        "--dcp-write",
        action="store_true",
        help="also HF -> DCP TP-8: reshard (job hf-dcp8) against torch's dcp.save (naive rounds)",
    )
    ap.add_argument(
        "--distcp",
        action="store_true",
        help="also torch DCP .distcp (dcp.save, 4 gloo ranks) -> consolidated: reshard (job distcp-hf) "
        "against dcp_to_torch_save + save_file (naive rounds)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="also TP-N and DCP-N checkpoints of N ranks, and the jobs that read or write them "
        "(hf-tpN, tpN-hf, tpN-tp8, tp8-tpN, hf-dcpN, dcpN-hf, inspectN, checkN, verifyN, planN)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    reshard = str(Path(sys.executable).parent / "reshard")
    # byte-compile the package as a wheel install would (an editable install does not, and
    # with PYTHONDONTWRITEBYTECODE=1 every run would compile it again: ~30 ms of start-up)
    compileall.compile_dir(str(ROOT / "reshard"), quiet=1)
    base = args.dir
    src = base / "src-tp4"
    hf = base / "src-hf"
    tp8 = base / "src-tp8"
    layers = layers_for(args.size_gb)
    what = f"moe-{args.tensors}-{args.mix}" if args.tensors else str(layers)
    if args.big_tensor:
        what, src = "big", hf  # cp -r of the HF file
    marker = base / f"generated-v3-{what}"
    if args.big_tensor and not marker.exists():
        shutil.rmtree(base, ignore_errors=True)
        sys.stderr.write(f"generating the big-tensor HF checkpoint in {hf} ...\n")
        subprocess.run([sys.executable, __file__, "--generate-big", str(hf)], check=True)
        for out_dir, extra in (
            (tp8, ["--target-layout", str(base / "big-layout.yaml")]),
            (base / "src-dcp8", ["--to", "dcp", "--target-layout", str(base / "big-dcp-layout.yaml")]),
        ):
            subprocess.run([reshard, "convert", str(hf), str(out_dir), *extra, "--quiet"], check=True)
        marker.write_text("")
    if not marker.exists():
        shutil.rmtree(base, ignore_errors=True)
        sys.stderr.write(f"generating the TP-4 checkpoint ({what}) in {src} ...\n")
        # in a child process: the parent stays small, so children forked from it report their own peak RSS
        gen = [str(args.tensors), args.mix] if args.tensors else [str(layers)]
        subprocess.run([sys.executable, __file__, "--generate-only", str(src), *gen], check=True)
        subprocess.run(
            [
                reshard,
                "convert",
                str(src),
                str(hf),
                "--source-layout",
                str(base / "layout.yaml"),
                "--consolidate",
                "--quiet",
            ],
            check=True,
        )
        if args.tensors:  # the self-described TP-8 output that inspect, check and verify read
            subprocess.run(
                [
                    reshard,
                    "convert",
                    str(src),
                    str(tp8),
                    "--source-layout",
                    str(base / "layout.yaml"),
                    "--target-mesh",
                    "tp=8",
                    "--quiet",
                ],
                check=True,
            )
        marker.write_text("")
    n = args.ranks
    tpn, dcpn = base / f"src-tp{n}", base / f"src-dcp{n}"
    if n and not (base / f"generated-ranks-{n}").exists():
        sys.stderr.write(f"writing the {n}-rank checkpoints in {tpn}, {dcpn} ...\n")
        lay_n = ["--target-layout", str(base / "layout.yaml"), "--quiet"]
        for out_dir, extra in (
            (tpn, ["--target-mesh", f"tp={n}"]),
            (dcpn, ["--to", "dcp", "--target-mesh", f"tp={n}"]),
            (tp8, ["--target-mesh", "tp=8"]),
        ):
            if not out_dir.exists():
                subprocess.run([reshard, "convert", str(hf), str(out_dir), *extra, *lay_n], check=True)
        (base / f"generated-ranks-{n}").write_text("")
    dcp_dir = base / "src-dcp"
    if args.dcp and not (base / "generated-dcp").exists():
        shutil.rmtree(dcp_dir, ignore_errors=True)
        sys.stderr.write(
            f"writing the DCP safetensors checkpoint with torch (4 gloo ranks) in {dcp_dir} ...\n"
        )
        subprocess.run([sys.executable, "-c", GEN_DCP, str(src), str(dcp_dir)], check=True)
        (base / "generated-dcp").write_text("")
    pt_dir = generate_pt(base, src) if args.pt else base / "src-pt"
    distcp_dir = generate_distcp(base, src) if args.distcp else base / "src-distcp"
    size = sum(p.stat().st_size for p in src.iterdir())
    lay = str(base / "layout.yaml")
    w = ["--workers", str(args.workers)] if args.workers > 0 else []
    workers_text = str(args.workers) if args.workers > 0 else f"default ({min(4, os.cpu_count() or 1)})"
    jobs = {
        "cp": (["cp", "-r", str(src), "OUT"], [src]),
        "tp4-tp8": (
            [
                reshard,
                "convert",
                str(src),
                "OUT",
                "--source-layout",
                lay,
                "--target-mesh",
                "tp=8",
                "--quiet",
                *w,
            ],
            [src],
        ),
        "tp4-hf": (
            [reshard, "convert", str(src), "OUT", "--source-layout", lay, "--consolidate", "--quiet", *w],
            [src],
        ),
        "hf-tp8": (
            [
                reshard,
                "convert",
                str(hf),
                "OUT",
                "--target-layout",
                lay,
                "--target-mesh",
                "tp=8",
                "--quiet",
                *w,
            ],
            [hf],
        ),
        "dcp-hf": ([reshard, "convert", str(dcp_dir), "OUT", "--consolidate", "--quiet", *w], [dcp_dir]),
        "inspect": ([reshard, "inspect", str(tp8), "--json"], [tp8]),
        "plan": ([reshard, "plan", str(src), "--source-layout", lay, "--target-mesh", "tp=8"], [src]),
        "check": ([reshard, "inspect", str(tp8), "--check", "--quiet"], [tp8]),
        "verify": ([reshard, "verify", str(tp8), str(hf), "--quiet"], [tp8, hf]),
        "hf-dcp8": (
            [
                reshard,
                "convert",
                str(hf),
                "OUT",
                "--to",
                "dcp",
                "--target-layout",
                "llama-tp",
                "--target-mesh",
                "tp=8",
                "--quiet",
                *w,
            ],
            [hf],
        ),
        "cp-distcp": (["cp", "-r", str(distcp_dir), "OUT"], [distcp_dir]),
        "cp-pt": (["cp", "-r", str(pt_dir), "OUT"], [pt_dir]),
        "distcp-hf": (
            [reshard, "convert", str(distcp_dir), "OUT", "--consolidate", "--quiet", *w],
            [distcp_dir],
        ),
        "pt-hf": ([reshard, "convert", str(pt_dir), "OUT", "--consolidate", "--quiet", *w], [pt_dir]),
    }
    jobs["hf-tt8"] = (transform_job(reshard, base, hf, w), [hf])
    dcp8 = base / "src-dcp8"
    big = ["--target-layout", str(base / "big-layout.yaml")]
    big_dcp = ["--to", "dcp", "--target-layout", str(base / "big-dcp-layout.yaml")]
    jobs["big-hf-tp8"] = ([reshard, "convert", str(hf), "OUT", *big, "--quiet", *w], [hf])
    jobs["big-tp8-hf"] = ([reshard, "convert", str(tp8), "OUT", "--consolidate", "--quiet", *w], [tp8])
    jobs["big-hf-dcp8"] = ([reshard, "convert", str(hf), "OUT", *big_dcp, "--quiet", *w], [hf])
    jobs["big-dcp8-hf"] = ([reshard, "convert", str(dcp8), "OUT", "--consolidate", "--quiet", *w], [dcp8])
    jobs["big-check"] = ([reshard, "inspect", str(dcp8), "--check", "--quiet"], [dcp8])
    jobs["big-verify"] = ([reshard, "verify", str(tp8), str(hf), "--quiet"], [tp8, hf])
    if args.tensors and args.mix == "moe":  # expert parallel: each expert whole on one of 8 ranks
        per_layer = 2 + 3 * EXPERTS
        cut = ["--exclude", f"model.layers.{args.tensors // per_layer}.*"] if args.tensors % per_layer else []
        ep = ["--target-layout", "mixtral-moe", "--target-mesh", "ep=8", *cut, "--quiet", *w]
        jobs["hf-ep8"] = ([reshard, "convert", str(hf), "OUT", *ep], [hf])
    if n:
        to_n = ["--target-mesh", f"tp={n}", "--quiet", *w]
        jobs[f"hf-tp{n}"] = ([reshard, "convert", str(hf), "OUT", "--target-layout", lay, *to_n], [hf])
        jobs[f"tp{n}-hf"] = ([reshard, "convert", str(tpn), "OUT", "--consolidate", "--quiet", *w], [tpn])
        jobs[f"tp{n}-tp8"] = (
            [reshard, "convert", str(tpn), "OUT", "--target-mesh", "tp=8", "--quiet", *w],
            [tpn],
        )
        jobs[f"tp8-tp{n}"] = ([reshard, "convert", str(tp8), "OUT", *to_n], [tp8])
        jobs[f"hf-dcp{n}"] = (
            [reshard, "convert", str(hf), "OUT", "--to", "dcp", "--target-layout", lay, *to_n],
            [hf],
        )
        jobs[f"dcp{n}-hf"] = ([reshard, "convert", str(dcpn), "OUT", "--consolidate", "--quiet", *w], [dcpn])
        jobs[f"inspect{n}"] = ([reshard, "inspect", str(tpn), "--json"], [tpn])
        jobs[f"check{n}"] = ([reshard, "inspect", str(tpn), "--check", "--quiet"], [tpn])
        jobs[f"verify{n}"] = ([reshard, "verify", str(tpn), str(hf), "--quiet"], [tpn, hf])
        jobs[f"plan{n}"] = ([reshard, "plan", str(tpn), "--target-mesh", "tp=8"], [tpn])
    default_jobs = "tp4-tp8,tp4-hf,hf-tp8" + (",inspect,plan,check,verify" if args.tensors else "")
    if n:
        default_jobs = ",".join(
            j.replace("N", str(n))
            for j in "hf-tpN,tpN-hf,tpN-tp8,tp8-tpN,hf-dcpN,dcpN-hf,inspectN,checkN,verifyN,planN".split(",")
        )
    if args.big_tensor:
        default_jobs = "big-hf-tp8,big-tp8-hf,big-hf-dcp8,big-dcp8-hf,big-check,big-verify"
    chosen = (
        ["cp"] + [j for j in (args.jobs or default_jobs).split(",") if j] + (["dcp-hf"] if args.dcp else [])
    )
    chosen += ["hf-dcp8"] if args.dcp_write and "hf-dcp8" not in chosen else []
    chosen += ["cp-pt", "pt-hf"] if args.pt else []
    chosen += ["cp-distcp", "distcp-hf"] if args.distcp else []
    chosen = list(dict.fromkeys(chosen))  # a job named twice (e.g. --jobs cp,pt-hf --pt) runs once a round
    times: dict[str, list[float]] = {j: [] for j in chosen}
    rss: dict[str, list[int]] = {j: [] for j in chosen}
    cpu: dict[str, list[float]] = {}
    out = base / "out"
    for rnd in range(args.rounds):
        for j in chosen:
            shutil.rmtree(out, ignore_errors=True)
            time.sleep(args.pause)
            cmd = [str(out) if c == "OUT" else c for c in jobs[j][0]]
            t, m = run(cmd, jobs[j][1] if args.cold else None)
            times[j].append(t)
            rss[j].append(m)
            cpu.setdefault(j, []).append(LAST_CPU[0])
            sys.stderr.write(f"round {rnd + 1}/{args.rounds} {j}: {t:.3f} s, {m / 2**20:.0f} MiB\n")
    phases = None
    if args.tensors:
        shutil.rmtree(out, ignore_errors=True)
        got = subprocess.run(
            [sys.executable, "-c", PHASES, str(src), lay, str(out)],
            check=True,
            capture_output=True,
            text=True,
        )
        phases = json.loads(got.stdout)
        sys.stderr.write(f"phases (us per tensor per rank file): {phases}\n")
    slow = (
        []
        if args.tensors or args.big_tensor
        else [
            ("naive-tp4-tp8", [sys.executable, "-c", NAIVE_TP8, str(src), "OUT", "8"]),
            ("naive-tp4-hf", [sys.executable, "-c", NAIVE_TP8, str(src), "OUT", "1"]),
        ]
    )
    if args.dcp:
        slow.append(("torch-dcp-hf", [sys.executable, "-c", TORCH_CONSOLIDATE, str(dcp_dir), "OUT"]))
    if args.dcp_write:
        slow.append(("torch-hf-dcp8", [sys.executable, "-c", TORCH_DCP8, str(hf), "OUT"]))
    if args.distcp:
        slow.append(("torch-distcp-hf", [sys.executable, "-c", TORCH_DISTCP_HF, str(distcp_dir), "OUT"]))
    if args.pt:
        slow.append(("torch-pt-hf", [sys.executable, "-c", TORCH_PT_HF, str(pt_dir), "OUT"]))
    for name, slow_cmd in slow:
        for _ in range(args.naive_rounds):
            shutil.rmtree(out, ignore_errors=True)
            time.sleep(args.pause)
            t, m = run([str(out) if c == "OUT" else c for c in slow_cmd])
            times.setdefault(name, []).append(t)
            rss.setdefault(name, []).append(m)
            cpu.setdefault(name, []).append(LAST_CPU[0])
            sys.stderr.write(f"{name}: {t:.3f} s, {m / 2**20:.0f} MiB\n")
    shutil.rmtree(out, ignore_errors=True)
    # ratios per round against cp in the same round
    rows = []
    for j, ts in times.items():
        if not ts:  # --rounds 0: the data made, nothing timed
            continue
        med = statistics.median(ts)
        base_job = CP_OF.get(j, "cp")
        if j in chosen:
            ratios = [t / c for t, c in zip(ts, times[base_job])]
            ratio = statistics.median(ratios)
        else:
            ratio = med / statistics.median(times[base_job])
        rows.append(
            {
                "job": j,
                "runs": len(ts),
                "median_s": round(med, 3),
                "spread_s": round(max(ts) - min(ts), 3),
                "gb_per_s": round(size / med / 1e9, 2),
                "peak_rss_mib": round(max(rss[j]) / 2**20, 1),
                "cpu_s": round(statistics.median(cpu[j]), 3),
                "ratio_to_cp": round(ratio, 2),
            }
        )
    cache = "cold (sources evicted before each run)" if args.cold else "warm page cache"
    if args.json:
        print(
            json.dumps(
                {
                    "size_bytes": size,
                    "layers": layers,
                    "tensors": args.tensors,
                    "mix": args.mix,
                    "workers": workers_text,
                    "cache": cache,
                    "rows": rows,
                    "phases": phases,
                },
                indent=2,
            )
        )
    else:
        kind = f"TP-4 bf16 ({layers} layers)"
        if args.tensors:
            kind = f"TP-4 {args.tensors} int16 tensors ({args.mix})"
        if args.big_tensor:
            kind = "HF, a few big bf16 tensors (--big-tensor)"
        print(
            f"checkpoint: {size / 1e9:.2f} GB {kind}, {cache}, workers={workers_text}, rounds={args.rounds}"
        )
        if phases:
            print(
                "us per tensor per rank file: "
                + ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "tensors")
            )
        print(
            f"{'job':<15}{'runs':>5}{'median s':>10}{'spread s':>10}{'GB/s':>8}"
            f"{'peak RSS MiB':>14}{'x cp':>7}{'CPU s':>8}"
        )
        for r in rows:
            print(
                f"{r['job']:<15}{r['runs']:>5}{r['median_s']:>10.3f}{r['spread_s']:>10.3f}"
                f"{r['gb_per_s']:>8.2f}{r['peak_rss_mib']:>14.1f}{r['ratio_to_cp']:>7.2f}{r['cpu_s']:>8.2f}"
            )
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
