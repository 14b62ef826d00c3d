"""vLLM/SGLang ``sharded_state`` output against what its consumers expect, with real files written by
safetensors' torch API and real ``reshard`` subprocesses.

* vLLM and SGLang number the files by tensor-parallel rank only (``model-rank-{tp_rank}-part-*``;
  pipeline parallel is unsupported): an output on a mesh of more than one dim over 1 rank is
  written (reshard reads it back through its reshard.json) with a warning saying so; a one-dim mesh
  (or dims of size 1 beside it) gets none.
* Tensors larger than ``--max-shard-size``: one a part, the parts vLLM's ``save_model`` writes
  except its empty ``part-0`` (it saves the empty part when the first tensor alone is over the
  limit; reshard does not); vLLM's files, empty part included, read back to the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.cli.test_sharded_state_cli import LAYOUT, full_tensors, local_tensors, ok, parts_of, run, vllm_save
from tests.strategies import same_bits

TWO_D = """\
mesh: {dp: 2, tp: 2}
placements:
  "*.q_proj.weight": {tp: S(0), dp: S(1)}
  "*": R
"""


def test_sharded_state_on_a_mesh_of_two_dims_is_warned(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    save_file(full_tensors(), str(tmp_path / "hf" / "model.safetensors"))
    lay = tmp_path / "2d.yaml"
    lay.write_text(TWO_D)
    ss = tmp_path / "ss"
    p = run("convert", tmp_path / "hf", ss, "--to", "sharded-state", "--target-layout", lay, "--json")
    assert p.returncode == 0, p.stderr
    notes = [w for w in json.loads(p.stdout)["warnings"] if "tensor-parallel rank" in w]
    assert len(notes) == 1 and "dp=2,tp=2" in notes[0] and "vLLM" in notes[0], p.stdout
    ok("verify", tmp_path / "ss", tmp_path / "hf")  # still a checkpoint reshard reads
    for mesh in ("dp=1,tp=2", "dp=1,tp=4"):
        out = tmp_path / f"ss-{mesh}"
        p = run("convert", tmp_path / "ss", out, "--to", "sharded-state", "--target-mesh", mesh, "--json")
        assert p.returncode == 0, p.stderr
        assert not [w for w in json.loads(p.stdout)["warnings"] if "tensor-parallel rank" in w]


def test_tensors_over_max_shard_size_one_a_part_and_vllms_empty_part_0_is_read(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    full = full_tensors()
    save_file(full, str(hf / "model.safetensors"))
    lay = tmp_path / "tp.yaml"
    lay.write_text(LAYOUT)
    out = tmp_path / "ss"
    args = ("--to", "sharded-state", "--target-layout", lay, "--max-shard-size", "4B", "--quiet")
    ok("convert", hf, out, *args)
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    for r in range(4):
        vllm_save(dict(sorted(local_tensors(full, 4, r).items())), vllm, r, 4)
    n = len(full)
    for r in range(4):  # vLLM: an empty part 0, then one tensor a part; reshard: the same, from 0
        assert load_file(str(vllm / f"model-rank-{r}-part-0.safetensors")) == {}
        for part in range(n):
            mine = out / f"model-rank-{r}-part-{part}.safetensors"
            assert mine.read_bytes() == (vllm / f"model-rank-{r}-part-{part + 1}.safetensors").read_bytes()
    assert len(parts_of(out)) == 4 * n and len(parts_of(vllm)) == 4 * (n + 1)
    ok("convert", vllm, tmp_path / "back", "--source-layout", lay, "--consolidate", "--quiet")
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(got) == sorted(full) and all(same_bits(got[k], t) for k, t in full.items())
