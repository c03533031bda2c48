"""From a plan to stage assignments: link codecs, precision and the server tier.

tests/integration/test_server_group.py forms the server tier's group (a real store).
"""

from __future__ import annotations

import pytest

from coordinator.engine.runners import server_tier
from coordinator.engine.spec import JobSpec, make_assignments
from coordinator.planner import Plan
from edge.problem import DeviceSpec

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
