"""The shortcuts that make opening and planning 100k tensors cheap give what the plain code gives.

* :func:`reshard.checkpoint.tensor_source` and the planner's targets: built by slot assignment,
  they are the frozen dataclass values their constructors make.
* ``check_metadata``'s bounds, tested per geometry on arrays: the problems the per-tensor walk
  (the oracle, forced by turning the array test off) names, in its order.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import check as check_mod
from reshard.check import check_metadata
from reshard.checkpoint import Checkpoint, TensorSource, tensor_source
from reshard.formats import writer
from reshard.intervals import Interval
from reshard.layout import TensorLayout
from reshard.mesh import Mesh
from reshard.plan import TargetTensor, make_plan

I = Interval  # noqa: E741

FIELDS = (
    "model.layers.0.w",
    "BF16",
    (4, 2),
    (0, 1),
    (128, 136),
    (((I(0, 2),), (I(0, 2),)), ((I(2, 4),), (I(0, 2),))),
    ("layout", (4, 2), (2,), "S(0)"),
    (0, 1),
    "sum",
    None,
    (7, None),
)


def test_tensor_source_is_the_frozen_dataclass_value() -> None:
    made, plain = tensor_source(*FIELDS), TensorSource(*FIELDS)
    assert type(made) is TensorSource
    assert made == plain and hash(made) == hash(plain) and repr(made) == repr(plain)
    assert tuple(getattr(made, f.name) for f in dataclasses.fields(TensorSource)) == FIELDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.name = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(made)) == plain
    assert dataclasses.replace(made, name="x") == dataclasses.replace(plain, name="x")
    assert tensor_source(*FIELDS[:7]) == TensorSource(*FIELDS[:7])  # the defaults


def test_planned_targets_are_the_frozen_dataclass_values() -> None:
    mesh = Mesh(("tp",), (2,))
    lay = TensorLayout.make((4, 2), mesh, ["S(0)"])
    src = TensorSource(
        "w", "F32", (4, 2), (0, 1), (8, 8), lay.blocks(), ("layout", (4, 2), (2,), lay.placements)
    )
    ck = Checkpoint("x", "hand", ("a", "b"), (40, 40), {"w": src}, mesh=mesh)
    plan = make_plan(ck, Mesh(("tp",), (4,)), lambda name: ["S(1)"], writer=writer("per-rank"), dtype="BF16")
    (t,) = plan.tensors
    assert type(t) is TargetTensor
    assert t == TargetTensor(*(getattr(t, f.name) for f in dataclasses.fields(TargetTensor)))
    assert (t.name, t.src, t.dtype, t.groups, t.reduce_op) == ("w", src, "BF16", 1, None)
    assert t.layout.placement_strs() == ["S(1)"] and len(t.copies) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "other"  # type: ignore[misc]
    assert hash(t) == hash(dataclasses.replace(t))


# -- check_metadata: bounds per geometry on arrays, against the per-tensor walk


def _file(path: Path, size: int) -> str:
    path.write_bytes(bytes(size))
    return str(path)


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.lists(st.tuples(st.integers(-8, 120), st.integers(-8, 120)), min_size=1, max_size=12),
    sizes=st.tuples(st.integers(0, 140), st.integers(0, 140)),
    dtypes=st.lists(st.sampled_from(["F32", "U8", "F16", "Q7"]), min_size=1, max_size=12),
    missing=st.booleans(),
)
def test_check_metadata_bounds_match_the_per_tensor_walk(
    tmp_path_factory: pytest.TempPathFactory,
    offsets: list[tuple[int, int]],
    sizes: tuple[int, int],
    dtypes: list[str],
    missing: bool,
) -> None:
    d = tmp_path_factory.mktemp("ck")
    files = (_file(d / "a", sizes[0]), str(d / "gone") if missing else _file(d / "b", sizes[1]))
    blocks = (((I(0, 2),), (I(0, 3),)), ((I(2, 4),), (I(0, 3),)))  # one object: one geometry per dtype
    shared_files = (0, 1)
    tensors = {}
    for i, off in enumerate(offsets):
        name = f"layers.{i}.w"
        tensors[name] = TensorSource(
            name, dtypes[i % len(dtypes)], (4, 3), shared_files, off, blocks, ("layout", (4, 3), (2,), "S(0)")
        )
    ck = Checkpoint(str(d), "hand", files, (sizes[0], sizes[1]), tensors)
    got = check_metadata(ck)
    real = check_mod._bounds_hold
    try:
        check_mod._bounds_hold = lambda ck, sizes: False  # type: ignore[assignment]
        want = check_metadata(ck)
    finally:
        check_mod._bounds_hold = real
    assert got == want
    assert (got == []) == all(
        0 <= o and o + 6 * {"F32": 4, "U8": 1, "F16": 2, "Q7": 10**9}[tensors[f"layers.{i}.w"].dtype] <= s
        for i, off in enumerate(offsets)
        for o, s in zip(off, sizes)
    ) or missing


def test_check_metadata_names_the_one_tensor_past_the_end(tmp_path: Path) -> None:
    """Many tensors of one geometry, one of them past its file's end: the array test fails, and
    the walk names that tensor alone."""
    f = _file(tmp_path / "a", 4000)
    blocks = (((I(0, 2),),),)
    tensors = {
        f"t{i}": TensorSource(f"t{i}", "F32", (2,), (0,), (8 * i,), blocks, ("s",)) for i in range(499)
    }
    tensors["t499"] = TensorSource("t499", "F32", (2,), (0,), (3996,), blocks, ("s",))
    tensors["t500"] = TensorSource("t500", "F32", (2,), (0,), (-1,), blocks, ("s",))
    problems = check_metadata(Checkpoint(str(tmp_path), "hand", (f,), (4000,), tensors))
    assert [(p["kind"], p["tensor"]) for p in problems] == [("bounds", "t499"), ("bounds", "t500")]
    assert "bytes [3996, 4004) run past the end of the file (4000 bytes)" in problems[0]["message"]


@pytest.mark.parametrize(
    "twin, cls", [("reshard.checkpoint._Unfrozen", TensorSource), ("reshard.plan._Target", TargetTensor)]
)
def test_slot_twins_set_every_field(twin: str, cls: type) -> None:
    """A field added to the dataclass and not to its twin would be left unset: the twin's slots and
    parameters are the dataclass's fields, in order."""
    import importlib
    import inspect

    module, name = twin.rsplit(".", 1)
    made = getattr(importlib.import_module(module), name)
    fields = [f.name for f in dataclasses.fields(cls)]
    assert list(made.__slots__) == list(cls.__slots__) == fields
    assert list(inspect.signature(made.__init__).parameters)[1:] == fields


def test_check_metadata_with_tuples_of_each_tensor(tmp_path: Path) -> None:
    """A reader making each tensor's tuples (DCP chunks) groups nothing: the walk names the problem."""
    f = _file(tmp_path / "a", 1600)
    tensors = {}
    for i in range(200):
        blocks = (((I(0, 2),),),)  # new objects each time round
        off = 1596 if i == 150 else 8 * i
        tensors[f"t{i}"] = TensorSource(f"t{i}", "F32", (2,), tuple([0]), tuple([off]), blocks, ("boxes", i))
    ck = Checkpoint(str(tmp_path), "hand", (f,), (1600,), tensors)
    assert not check_mod._bounds_hold(ck, [1600])
    problems = check_metadata(ck)
    assert [(p["kind"], p["tensor"]) for p in problems] == [("bounds", "t150")]
