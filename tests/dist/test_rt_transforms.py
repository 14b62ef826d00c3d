"""The torchtitan profiles against a training checkpoint torch itself wrote, FSDP over TP, in a gloo world.

Models: a tied Llama with one KV head and head_dim != hidden/heads, and a tied Qwen3-MoE with
head_dim != hidden/heads, both from ``save_pretrained``. A 4-rank world
(tests/dist/rt_transforms_worker.py) runs torchtitan's own ``from_hf`` on the saved tensors,
``distribute_tensor``s the result on a (fsdp=2, tp=2) mesh (``_StridedShard(0, 2)`` + ``Shard(0)``
for column-parallel tensors) and saves it with ``dcp.save``, plus every rank's ``to_local()``.

Checked: ``reshard convert HF --transforms PROFILE --target-layout (fsdp x tp)`` gives every rank
exactly torch's local tensors; ``reshard convert DCP --transforms PROFILE --inverse --consolidate``
gives the saved tensors back bit for bit, and the model loads with the same logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist.test_gloo import WORLD_TIMEOUT, _env, reshard_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchtitan.protocols.state_dict_adapter")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = Path(__file__).with_name("rt_transforms_worker.py")
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, tie_word_embeddings=True,
)  # fmt: skip
MODELS = {  # name: (worker family, profile, config class, config)
    "llama": ("llama", "hf-to-torchtitan-llama", "LlamaConfig", dict(num_key_value_heads=1, head_dim=32)),
    "qwen3_moe": (
        "qwen3",
        "hf-to-torchtitan-qwen3",
        "Qwen3MoeConfig",
        dict(num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
}
LAYOUT = """\
mesh: {fsdp: 2, tp: 2}
placements:
  "*.inner_experts.*": [S(0), S(1)]
  "layers.*.attention.wo.weight": [S(0), S(1)]
  "layers.*.feed_forward.w2.weight": [S(0), S(1)]
  "*norm.weight": [S(0), R]
  "*": ["_S(0, tp)", S(0)]
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rt_transforms")
    jobs = []
    for name, (family, _, cls, extra) in MODELS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**(COMMON | extra)))
        with torch.no_grad():  # random values everywhere (norms start at ones)
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        model.save_pretrained(root / "hf" / name)
        jobs.append(f"{family}={root / 'hf' / name}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["--max-restarts=0", str(WORKER), str(root / "torch"), *jobs]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=WORLD_TIMEOUT, env=_env())
    assert res.returncode == 0, f"world failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return root


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torchtitan_fsdp_tp_checkpoint_equals_torch_and_converts_back(
    world: Path, tmp_path: Path, name: str
) -> None:
    profile = MODELS[name][1]
    src, torch_dir = world / "hf" / name, world / "torch" / name
    (tmp_path / "fsdp-tp.yaml").write_text(LAYOUT)
    out = tmp_path / "ranks"
    p = reshard_cli("convert", str(src), str(out), "--transforms", profile, "--target-layout",
                    str(tmp_path / "fsdp-tp.yaml"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    for r in range(4):
        got = load_file(str(out / f"rank-{r:05d}-of-00004.safetensors"))
        want = load_file(str(torch_dir / "local" / f"rank-{r:05d}-of-00004.safetensors"))
        assert sorted(got) == sorted(want), r
        assert "lm_head.weight" in got  # tied: from_hf copies the embedding, so does the profile
        for n, t in want.items():
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), (r, n)

    back = tmp_path / "back"
    p = reshard_cli("convert", str(torch_dir / "dcp"), str(back), "--transforms", profile, "--inverse",
                    "--consolidate", "--config-from", str(src), "--model-config", str(src / "config.json"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    saved = load_file(str(src / "model.safetensors"))
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(saved)
    for n, t in saved.items():
        assert again[n].dtype == t.dtype and torch.equal(again[n], t), n
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    want_logits = transformers.AutoModelForCausalLM.from_pretrained(src)(ids).logits
    assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(back)(ids).logits, want_logits)
