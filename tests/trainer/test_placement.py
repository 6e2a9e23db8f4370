"""The placement planner: which GPU runs what, and refusals that say what to change."""

from __future__ import annotations

import pytest

from mesh.errors import InvalidArgument
from trainer.placement import plan


def test_eight_gpus_tp2_auto_is_three_replicas_and_two_trainer_gpus() -> None:
    placed = plan(8, "auto", tensor_parallel=2)
    assert placed.inference == ((0, 1), (2, 3), (4, 5))
    assert placed.trainer == (6, 7)
    assert placed.reference is None
    assert placed.visible_devices() == {
        "inference-0": "0,1",
        "inference-1": "2,3",
        "inference-2": "4,5",
        "trainer": "6,7",
    }


def test_a_reference_of_its_own_takes_the_last_gpu_and_stacked_sits_beside_inference() -> None:
    own = plan(8, "auto", tensor_parallel=2, reference="own")
    assert own.inference == ((0, 1), (2, 3)) and own.trainer == (4, 5, 6) and own.reference == (7,)
    assert own.visible_devices()["reference"] == "7"
    stacked = plan(8, 6, tensor_parallel=1, reference="stacked")
    assert len(stacked.inference) == 6 and stacked.trainer == (6, 7)
    assert stacked.reference == (0,) and stacked.reference_stacked
    assert "reference" not in stacked.visible_devices()


def test_gpus_a_tp_group_cannot_use_go_to_training() -> None:
    placed = plan(7, "auto", tensor_parallel=4)
    assert placed.inference == ((0, 1, 2, 3),) and placed.trainer == (4, 5, 6)


def test_the_cpu_plan() -> None:
    placed = plan(0, reference="stacked")
    assert placed.cpu and placed.inference == ((),) and placed.trainer == ()
    assert placed.reference_stacked


@pytest.mark.parametrize(
    ("args", "advice"),
    [
        ((8, 8, 1), "at most 7"),
        ((8, 6, 4), "multiple of tensor_parallel = 4"),
        ((2, "auto", 2), "lower tensor_parallel"),
        ((3, "auto", 2, "own"), "stack the reference"),
        ((0, 2, 1), "use auto"),
        ((0, "auto", 2), "set it to 1"),
        ((-1, "auto", 1), "0 (CPU) or more"),
    ],
)
def test_refusals_say_what_to_change(args: tuple[object, ...], advice: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        plan(*args)  # type: ignore[arg-type]
    assert advice in info.value.message
    assert info.value.reason_name == "PLACEMENT_INVALID"
