"""From a plan to stage assignments: link codecs, precision and the server tier.

tests/integration/test_server_group.py forms the server tier's group (a real store).
"""

from __future__ import annotations

import pytest

from coordinator.engine.assignments import make_assignments
from coordinator.engine.runners import server_tier
from coordinator.engine.spec import DataPlacement, JobSpec
from coordinator.planner import Plan
from coordinator.planner.score import Stage
from edge.problem import DeviceSpec
from edge.wire.messages import StageAssignment
from edge.wire.topics import stage_access

SPEC = JobSpec(model="gpt-mini", steps=2, batch_size=8, microbatches=2)


def _plan(codecs: tuple[str, ...] | None = None) -> Plan:
    stages = Plan.of(("a", 0, 2), ("b", 2, 4), ("c", 4, 6)).stages
    return Plan(stages, codecs)


def test_every_link_uses_the_job_codec_without_a_planner_choice() -> None:
    out = make_assignments("j1", SPEC.model_copy(update={"codec": "fp16"}), _plan())
    assert [(a.codec_in, a.codec_out) for a in out] == [("fp16", "fp16")] * 3


def test_each_link_uses_the_codec_the_planner_chose_both_ways() -> None:
    spec = SPEC.model_copy(update={"codec": "auto", "precision": "bf16"})
    out = make_assignments("j1", spec, _plan(("int8", "fp32")))
    # Stage 0 sends int8 activations to stage 1, which sends its gradients back in int8.
    assert [a.codec_out for a in out[:2]] == ["int8", "fp32"]
    assert [a.codec_in for a in out[1:]] == ["int8", "fp32"]
    assert all(a.precision == "bf16" for a in out)


def test_auto_without_a_choice_is_fp32_and_a_wrong_count_is_refused() -> None:
    spec = SPEC.model_copy(update={"codec": "auto"})
    assert {a.codec_out for a in make_assignments("j1", spec, _plan())} == {"fp32"}
    with pytest.raises(ValueError, match="1 link codecs for 2 links"):
        make_assignments("j1", spec, _plan(("int8",)))


def _device(name: str, **details: object) -> DeviceSpec:
    return DeviceSpec(
        id=name,
        gflops=10,
        memory_bytes=1e9,
        bandwidth_mbps=100,
        latency_ms=1,
        details=details or None,
    )


def test_server_tier_is_what_the_agents_announced() -> None:
    profiles = {
        "pi": _device("pi"),
        "gpu": _device("gpu", server=True, torch_device="cuda:1"),
        "box": _device("box", server=True),
    }
    assert server_tier(profiles) == {"gpu": "cuda:1", "box": "cpu"}


LOCAL = JobSpec(
    model="cnn-digits",
    steps=2,
    batch_size=24,
    microbatches=2,
    data={"name": "digits", "labels": "local"},  # type: ignore[arg-type]
)
U = Plan(
    (
        Stage.group(["h0", "h1"], 0, 1),
        Stage.group(["lap"], 1, 3),
        Stage.group(["h0", "h1"], 3, 4),
    ),
    u_shaped=True,
)


def test_labels_local_the_holders_read_at_both_ends_and_nobody_sends_labels() -> None:
    out = make_assignments("j1", LOCAL, U, shares=[[2 / 3, 1 / 3], [1.0], [2 / 3, 1 / 3]])
    assert [(a.stage, a.member, a.local_data) for a in out] == [
        (0, 0, "digits"),
        (0, 1, "digits"),
        (1, 0, None),
        (2, 0, "digits"),
        (2, 1, "digits"),
    ]
    assert all(a.labels_local for a in out)
    assert out[0].group_samples == ((8, 4), (12,), (8, 4))
    # What the broker grants: stage 0 may send the tail nothing, the tail only gradients.
    first = stage_access("j1", 0, 3, "h0", group_sizes=[2, 1, 2], labels_local=True)
    assert not [t for t in first.publish if "/stage/2/" in t]
    central = stage_access("j1", 0, 3, "h0", group_sizes=[2, 1, 2])
    assert [t for t in central.publish if "/stage/2/" in t]  # the labels, when not local


@pytest.mark.parametrize(
    ("plan", "shares", "message"),
    [
        (
            Plan((Stage.group(["h0", "h1"], 0, 1), Stage.group(["lap"], 1, 4))),
            None,
            'labels "local" needs a U-shaped plan',
        ),
        (
            Plan((*U.stages[:2], Stage.group(["h1", "h0"], 3, 4)), u_shaped=True),
            None,
            'labels "local" needs a U-shaped plan',
        ),
        (U, [[2 / 3, 1 / 3], [1.0], [0.5, 0.5]], "samples of a microbatch differ at the two"),
    ],
)
def test_labels_local_refuses_a_plan_that_is_not_a_u_of_the_same_shares(
    plan: Plan, shares: list[list[float]] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_assignments("j1", LOCAL, plan, shares=shares)


def test_a_u_is_for_labels_local_only_and_local_labels_not_with_fault_tolerance() -> None:
    central = LOCAL.model_copy(update={"data": DataPlacement(name="digits")})
    with pytest.raises(ValueError, match='a U-shaped plan is for labels "local" only'):
        make_assignments("j1", central, U)
    with pytest.raises(ValueError, match="cannot be combined with fault tolerance"):
        JobSpec.model_validate({**LOCAL.model_dump(), "replicate_every": 2})
    a = make_assignments("j1", LOCAL, U, shares=[[0.5, 0.5], [1.0], [0.5, 0.5]])[1]
    with pytest.raises(ValueError, match="reads local data"):
        StageAssignment.model_validate({**a.model_dump(), "labels_local": False, "stage": 2})
    with pytest.raises(ValueError, match="the first and last stages need local_data"):
        StageAssignment.model_validate({**a.model_dump(), "local_data": None})
