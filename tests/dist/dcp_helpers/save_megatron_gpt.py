"""Save real Megatron-Core ``GPTModel`` torch_dist checkpoints: ``model.sharded_state_dict()`` and
``dist_checkpointing.save``, on CPU in a 2-rank gloo world.

Run as a script: ``python save_megatron_gpt.py OUT.json HF_DIR MEG_DIR DIST_DIR [HF_DIR MEG_DIR DIST_DIR ...]``;
needs ``megatron-core`` (0.16) and ``transformers``. ``MEG_DIR/model.safetensors`` holds per-layer
Megatron names (what ``reshard convert HF MEG --transforms hf-to-megatron-gpt --consolidate`` writes).
For each triple, both ranks:

1. build the GPTModel of ``HF_DIR/config.json`` at TP=1 (``megatron_gpt_forward.build_model``: local
   spec, so the two per-layer norms are ``input_layernorm``/``pre_mlp_layernorm`` modules), load
   ``MEG_DIR``'s tensors into it (``strict``, apart from ``_extra_state``) and save its
   ``sharded_state_dict()`` to ``DIST_DIR`` (data-parallel 2: the two ranks are replicas);
2. rebuild it at TP=2, let Megatron itself load ``DIST_DIR`` into that model
   (``dist_checkpointing.load``: its own resharding) and save it again to ``DIST_DIR-tp2``.

OUT.json gets, per checkpoint directory, what its ``.metadata`` says (read by torch's own
``FileSystemReader``): ``{dir: {key: [shape, dtype, number of chunks] or "bytes"}}``, plus
``"tp2_equal"``: whether every tensor of the TP-2 model equals the TP-1 slice it should hold
(Megatron's own load, compared with the TP-1 state cut by hand).

Megatron's saver and model are written for CUDA: ``torch.cuda.current_device`` gives ``"cpu"``,
``torch.cuda.synchronize`` is a no-op, and the dropout RNG tracker (dropout is 0) forks nothing.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORLD = 2


def describe(ck: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ck)).read_metadata()
    out: dict[str, Any] = {}
    for key, m in sorted(md.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            out[key] = [list(m.size), str(m.properties.dtype).removeprefix("torch."), len(m.chunks)]
        else:
            out[key] = "bytes"
    return out


def _patch_cuda() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _init(tp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    mrandom.get_cuda_rng_tracker().reset()
    mrandom.get_cuda_rng_tracker().states_["model-parallel-rng"] = None


def _tp_slice(name: str, full: Any, tp: int, rank: int, fc1: bool) -> Any:
    """The TP-rank ``rank`` part Megatron's local-spec layers hold of the full tensor ``full``."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, 1)[rank]
    if fc1:  # SwiGLU: the rank holds [gate_r; up_r]
        import torch

        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return full.chunk(tp, 0)[rank]
    return full


def model_inputs(hf_dir: Path, meg_dir: Path) -> tuple[Any, dict[str, Any], bool, bool, int]:
    """The HF config, ``meg_dir``'s tensors under the local spec's names, and what ``build_model``
    takes from them: q/k/v biases, q/k layernorms, the padded vocab."""
    import transformers
    from megatron_gpt_forward import local_name
    from safetensors.torch import load_file

    c = transformers.AutoConfig.from_pretrained(hf_dir)
    state = {local_name(k): v for k, v in load_file(str(meg_dir / "model.safetensors")).items()}
    bias = "decoder.layers.0.self_attention.linear_qkv.bias" in state
    qk_norm = "decoder.layers.0.self_attention.q_layernorm.weight" in state
    return c, state, bias, qk_norm, state["embedding.word_embeddings.weight"].shape[0]


def one(hf_dir: Path, meg_dir: Path, dist_dir: Path, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron_gpt_forward import build_model

    c, state, bias, qk_norm, vocab = model_inputs(hf_dir, meg_dir)
    result: dict[str, Any] = {}

    _init(1)
    model = build_model(c, vocab, bias, qk_norm, tp=1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
    if rank == 0:
        dist_dir.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(dist_dir))
    dist.barrier()

    _init(2)
    tp2 = dist_dir.with_name(dist_dir.name + "-tp2")
    model = build_model(c, vocab, bias, qk_norm, tp=2)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(dist_dir))
    model.load_state_dict(loaded, strict=False)
    equal = True
    for name, t in model.state_dict().items():
        if name.endswith("._extra_state"):
            continue
        want = _tp_slice(name, state[name], 2, rank, name.endswith("linear_fc1.weight"))
        equal &= t.shape == want.shape and torch.equal(t, want)
    if rank == 0:
        tp2.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(tp2))
    dist.barrier()
    flags = [None] * WORLD
    dist.all_gather_object(flags, equal)
    if rank == 0:
        result = {str(dist_dir): describe(dist_dir), str(tp2): describe(tp2), "tp2_equal": all(flags)}
    return result


def worker(
    rank: int, out: str, triples: list[tuple[str, str, str]], rendezvous: str, each: Any = None
) -> None:
    """Both ranks: ``each(HF_DIR, MEG_DIR, DIST_DIR, rank)`` per triple (default: :func:`one`),
    rank 0 writing what it returns to ``out``."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    warnings.simplefilter("ignore")
    _patch_cuda()
    filesystem_async._results_queue = queue.Queue()  # the saves run in the rank (see save_megatron.py)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    ok = False
    try:
        doc: dict[str, Any] = {}
        for h, m, d in triples:
            doc[Path(h).name] = (each or one)(Path(h), Path(m), Path(d), rank)
        if rank == 0:
            Path(out).write_text(json.dumps(doc))
        ok = True
    except BaseException:
        Path(f"{out}.error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        Path(f"{out}.ok-{rank}").write_text("1" if ok else "0")
        dist.destroy_process_group()


def main(argv: list[str], each: Any = None) -> int:
    """Run :func:`worker` on ``argv``'s triples in a 2-rank gloo world (forked: ``each`` is passed as is)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing  # noqa: F401  # imported once, before the fork
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import torch.multiprocessing as mp
    import transformers  # noqa: F401

    out, rest = argv[1], argv[2:]
    triples = list(zip(rest[::3], rest[1::3], rest[2::3], strict=True))
    rendezvous = f"{out}.rendezvous"
    mp.start_processes(worker, args=(out, triples, rendezvous, each), nprocs=WORLD, join=True, start_method="fork")
    return 0 if all(Path(f"{out}.ok-{r}").read_text() == "1" for r in range(WORLD)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
