"""``save_dtensors`` of a tensor on the meta device (a shape, no data): a ReshardError naming it, on
every rank of a world, not torch's "Cannot copy out of meta tensor" from the middle of the write
(which left the other ranks waiting at the next collective)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.test_torchrun import SCRIPTS, torchrun

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.dist


def test_a_meta_tensor_is_named(tmp_path: Path) -> None:
    from reshard import save_dtensors
    from reshard.errors import UsageError

    state = {"a": torch.ones(2), "lm_head.weight": torch.empty(3, 4, dtype=torch.bfloat16, device="meta")}
    with pytest.raises(UsageError) as e:
        save_dtensors(state, tmp_path / "ckpt")
    assert e.value.tensor == "lm_head.weight"
    assert '"lm_head.weight" is a tensor on the meta device (bfloat16 [3, 4])' in e.value.message
    assert "to_empty" in e.value.message
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_meta_dtensor_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    torchrun(2, SCRIPTS / "save_meta.py", tmp_path, teardown_abort_ok=True)
    mine = (tmp_path / "rank1.txt").read_text()
    other = (tmp_path / "rank0.txt").read_text()
    assert mine.startswith('UsageError: save_dtensors: "w" is a DTensor on the meta device (float32 [4, 6])')
    assert other.startswith("ReshardError: save_dtensors failed on rank 1 (UsageError)") and '"w"' in other
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
