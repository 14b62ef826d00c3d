"""Load torch_dist checkpoints reshard wrote (``hf-to-megatron-torch-dist --to dcp``) with
Megatron-Core's own ``dist_checkpointing.load``, on CPU in a 2-rank gloo world.

Run as a script: ``python load_megatron_gpt.py OUT.json HF_DIR MEG_DIR DIST_DIR [HF_DIR MEG_DIR DIST_DIR ...]``;
needs ``megatron-core`` (0.16) and ``transformers``. ``MEG_DIR/model.safetensors`` holds the per-layer
Megatron names of the same weights (``hf-to-megatron-gpt``). For each triple, both ranks build the
GPTModel of ``HF_DIR/config.json`` at TP=2 (``megatron_gpt_forward.build_model``: local spec), check
that ``DIST_DIR`` is a distributed checkpoint to Megatron (``check_is_distributed_checkpoint``: its
``metadata.json``), and load it: ``dist_checkpointing.load(model.sharded_state_dict(), DIST_DIR)``
with Megatron's default strictness (``assume_ok_unexpected``: a key of the model the checkpoint
lacks fails, such as a layer's ``_extra_state`` object, which reshard writes as ``[None]``).
Every parameter must then equal the TP-rank slice of ``MEG_DIR``'s tensor that Megatron's own layers
hold (``save_megatron_gpt._tp_slice``).

Writes ``{family: {"distributed": bool, "equal": bool, "checked": int}}`` to OUT.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from save_megatron_gpt import WORLD, _init, _tp_slice, main, model_inputs  # noqa: E402


def one(hf_dir: Path, meg_dir: Path, dist_dir: Path, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint
    from megatron_gpt_forward import build_model

    c, state, bias, qk_norm, vocab = model_inputs(hf_dir, meg_dir)
    _init(2)
    model = build_model(c, vocab, bias, qk_norm, tp=2)
    with torch.no_grad():  # nothing of the HF weights before the load
        for p in model.parameters():
            p.zero_()
    distributed = check_is_distributed_checkpoint(str(dist_dir))
    # Megatron's default strictness: a missing key (linear_proj._extra_state/shard_0_2) would raise
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(dist_dir))
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


if __name__ == "__main__":
    sys.exit(main(sys.argv, one))
