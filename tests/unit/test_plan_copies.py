"""The copy counts convert and plan report, counted once per shared tensor list, equal the
per-tensor sum, for sibling rank files (one list) and hf shards (a list each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from reshard.plan import plan_copies


@pytest.mark.parametrize(
    "target",
    [
        TargetSpec(mesh="tp=4"),  # sibling rank files share one tensor list
        TargetSpec(consolidate=True, max_shard_size="3KB"),  # hf shards: a tensor list each
    ],
)
def test_plan_copies_is_the_per_tensor_sum(tmp_path: Path, target: TargetSpec) -> None:
    gen = torch.Generator().manual_seed(0)
    full = {f"l{i}.{k}": torch.randn(8, 12, generator=gen) for i in range(5) for k in ("a", "b", "n")}
    save_file(full, str(tmp_path / "model.safetensors"))
    rules = '  "*.a": {tp: S(0)}\n  "*.b": {tp: S(1)}\n  "*": {tp: R}\n'
    (tmp_path / "l.yaml").write_text(f"mesh: {{tp: 2}}\nplacements:\n{rules}")
    tp2 = tmp_path / "tp2"
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    from reshard.execute import execute_plan
    from reshard.formats.manifest import manifest_for, write_manifest

    plan = build_plan(ck, resolve_target(ck, TargetSpec(layout=str(tmp_path / "l.yaml"))))
    tp2.mkdir()
    execute_plan(plan, tp2)
    write_manifest(tp2, manifest_for(plan, [], listed=False))
    src = open_source(SourceSpec(str(tp2)))
    plan = build_plan(src, resolve_target(src, target))
    naive = sum(len(t.copies[f.local_rank]) for f in plan.files for t in f.tensors)
    assert plan_copies(plan) == naive == sum(f.copies for f in plan.files)
    assert naive > len(plan.files)  # S(1) pieces cut from two source ranks: more than one each
