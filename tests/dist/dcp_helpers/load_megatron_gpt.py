"""Load torch_dist checkpoints reshard wrote (``hf-to-megatron-torch-dist --to dcp``) with
Megatron-Core's own ``dist_checkpointing.load``, on CPU in a 2-rank gloo world.

Run as a script: ``python load_megatron_gpt.py OUT.json HF_DIR MEG_DIR DIST_DIR [HF_DIR MEG_DIR DIST_DIR ...]``;
needs ``megatron-core`` (0.16) and ``transformers``. ``MEG_DIR/model.safetensors`` holds the per-layer
Megatron names of the same weights (``hf-to-megatron-gpt``). For each triple, both ranks build the
GPTModel of ``HF_DIR/config.json`` at TP=2 (``megatron_gpt_forward.build_model``: local spec), check
that ``DIST_DIR`` is a distributed checkpoint to Megatron (``check_is_distributed_checkpoint``: its
``metadata.json``), and load it: ``dist_checkpointing.load(model.sharded_state_dict(), DIST_DIR,
strict="log_all")`` (the ``_extra_state`` objects, TransformerEngine's FP8 state, are not in an HF
model: Megatron leaves them as they are, as ``--dist-ckpt-strictness log_all`` does in training).
Every parameter must then equal the TP-rank slice of ``MEG_DIR``'s tensor that Megatron's own layers
hold (``save_megatron_gpt._tp_slice``).

Writes ``{family: {"distributed": bool, "equal": bool, "checked": int}}`` to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from save_megatron_gpt import WORLD, _init, _patch_cuda, _tp_slice  # noqa: E402


def one(hf_dir: Path, meg_dir: Path, dist_dir: Path, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint
    from megatron_gpt_forward import build_model, local_name
    from safetensors.torch import load_file

    c = transformers.AutoConfig.from_pretrained(hf_dir)
    state = {local_name(k): v for k, v in load_file(str(meg_dir / "model.safetensors")).items()}
    bias = "decoder.layers.0.self_attention.linear_qkv.bias" in state
    qk_norm = "decoder.layers.0.self_attention.q_layernorm.weight" in state
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    _init(2)
    model = build_model(c, vocab, bias, qk_norm, tp=2)
    with torch.no_grad():  # nothing of the HF weights before the load
        for p in model.parameters():
            p.zero_()
    distributed = check_is_distributed_checkpoint(str(dist_dir))
    # strict="log_all": keys of the model the checkpoint lacks are left as they are (its default,
    # "assume_ok_unexpected", raises on them: Missing key ... linear_proj._extra_state/shard_0_2)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(dist_dir), strict="log_all")
    model.load_state_dict(loaded, strict=False)
    equal, checked = True, 0
    for name, t in model.state_dict().items():
        if name.endswith("._extra_state"):
            continue
        want = _tp_slice(name, state[name], 2, rank, name.endswith("linear_fc1.weight"))
        equal &= t.shape == want.shape and torch.equal(t, want)
        checked += 1
    flags: list[Any] = [None] * WORLD
    dist.all_gather_object(flags, (equal, checked))
    return {
        "distributed": distributed,
        "equal": all(f[0] for f in flags),
        "checked": sum(f[1] for f in flags),
    }


def worker(rank: int, out: str, triples: list[tuple[str, str, str]], rendezvous: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    _patch_cuda()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    ok = False
    try:
        doc = {Path(h).name: one(Path(h), Path(m), Path(d), rank) for h, m, d in triples}
        if rank == 0:
            Path(out).write_text(json.dumps(doc))
        ok = True
    except BaseException:
        Path(f"{out}.error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        Path(f"{out}.ok-{rank}").write_text("1" if ok else "0")
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing  # noqa: F401  # imported once, before the fork
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import torch.multiprocessing as mp
    import transformers  # noqa: F401

    out, rest = argv[1], argv[2:]
    triples = list(zip(rest[::3], rest[1::3], rest[2::3], strict=True))
    rendezvous = f"{out}.rendezvous"
    mp.start_processes(worker, args=(out, triples, rendezvous), nprocs=WORLD, join=True, start_method="fork")
    return 0 if all(Path(f"{out}.ok-{r}").read_text() == "1" for r in range(WORLD)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
