"""Output headers laid out lazily by the planner are the reference writer's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.convert import SourceSpec, TargetSpec, build_plan, open_source, resolve_target
from reshard.io.header import encode_header


# names JSON must escape take the per-name quoting; the others are quoted by one join
@pytest.mark.parametrize("odd", [[], ['q"uote.w', "back\\slash", "tab\tand\x7fdel", "\u2028sep"]])
def test_lazy_headers_equal_encode_header(tmp_path: Path, odd: list[str]) -> None:
    tensors = {
        "b.w": torch.zeros(7, 3, dtype=torch.bfloat16),
        "a.w": torch.zeros(5, dtype=torch.float32),
        "é.ünï": torch.zeros(2, 2, dtype=torch.int64),
        "flag": torch.zeros(3, dtype=torch.bool),
        "s": torch.tensor(1.0, dtype=torch.float64),
        **{name: torch.arange(3, dtype=torch.int16) for name in odd},
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "l.yaml").write_text('mesh: {tp: 3}\nplacements:\n  "*.w": {tp: S(0)}\n  "*": R\n')
    ck = open_source(SourceSpec(str(tmp_path / "model.safetensors")))
    for spec in (TargetSpec(layout=str(tmp_path / "l.yaml")), TargetSpec(consolidate=True)):
        plan = build_plan(ck, resolve_target(ck, spec))
        for f in plan.files:
            specs = [(e.tensor.name, e.tensor.dtype, _shape(e)) for e in f.entries]
            meta_key, meta_val = next(iter(json.loads(f.prefix[8:].decode())["__metadata__"].items()))
            want, header = encode_header(specs, {meta_key: meta_val})
            assert f.prefix == want
            assert [e.start - len(f.prefix) for e in f.entries] == [x.start for x in header.entries]
            assert f.size == len(want) + header.data_size
            if f.rank is None:  # consolidated: the reference writer's own file is the oracle
                save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={meta_key: meta_val})
                assert f.prefix == (tmp_path / "ref.safetensors").read_bytes()[: len(f.prefix)]


def _shape(e: object) -> list[int]:
    from reshard.intervals import block_shape

    t = e.tensor  # type: ignore[attr-defined]
    return list(block_shape(t.layout.blocks()[e.rank]))  # type: ignore[attr-defined]
