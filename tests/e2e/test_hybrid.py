"""A hybrid pipeline: two edge agents over MQTT feeding a two-process server tier.

Four real agent processes and a real Mosquitto. The last two agents are server
tier (``edgetrain agent --server``): the coordinator (this process) hosts the
rendezvous store, their stages join one gloo process group, and the frames
between them travel over torch.distributed while the edge links (and the labels
from stage 0) stay on MQTT. The run equals single-device training within 1e-5.
The plans are explicit (4 stages, then 2) and every stage is checked to have run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.reference import assert_matches, train_reference

from coordinator.engine.options import RunOptions
from coordinator.engine.runners import Attempt, run_inprocess, run_on_agents, server_tier
from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.planner.score import Plan
from edge.problem import DeviceSpec
from edge.server.job_file import DistJob
from edge.server.launch import launch
from edge.transport.mqtt import MqttTransport


@pytest.fixture(scope="module")
def hybrid_fleet(
    module_broker: str, control: MqttTransport
) -> Iterator[tuple[LocalFleet, dict[str, DeviceSpec]]]:
    with LocalFleet(4, module_broker, threads=1, roles=AgentRoles(servers=2)) as fleet:
        yield fleet, fleet.wait_online(control, timeout=90)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_edge_agents_feed_a_gloo_server_tier(
    hybrid_fleet: tuple[LocalFleet, dict[str, DeviceSpec]], control: MqttTransport, schedule: str
) -> None:
    fleet, profiles = hybrid_fleet
    servers = server_tier(profiles)
    assert servers == {fleet.ids[2]: "cpu", fleet.ids[3]: "cpu"}  # announced by the agents
    spec = JobSpec(
        model="gpt-mini", steps=4, batch_size=16, microbatches=4, seed=2, schedule=schedule
    )
    cuts = [0, 1, 2, 4, 6]
    plan = Plan.of(*((fleet.ids[s], cuts[s], cuts[s + 1]) for s in range(4)))
    result = run_on_agents(spec, plan, control, options=RunOptions(servers=servers, timeout_s=300))
    assert len(result.plan.stages) == 4
    assert {(r.stage, r.device) for r in result.reports} == {(s, fleet.ids[s]) for s in range(4)}
    independent = train_reference("gpt-mini", steps=4, batch_size=16, seed=2)
    assert_matches(result.losses, result.weights, independent)
    reference = run_inprocess(spec, Plan.of(("local", 0, 6)))
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0
    )
    assert result.weights.keys() == reference.weights.keys()
    for key, ref in reference.weights.items():
        torch.testing.assert_close(result.weights[key], ref, rtol=1e-5, atol=1e-7, msg=key)
    # The servers joined the job's process group; the edge agents did not.
    for device in fleet.ids[2:]:
        assert f"joined the process group of job {result.job}" in fleet.log_path(device).read_text()
    for device in fleet.ids[:2]:
        assert "process group" not in fleet.log_path(device).read_text()


@pytest.mark.slow
def test_a_job_moves_from_the_server_tier_to_edge_agents(
    hybrid_fleet: tuple[LocalFleet, dict[str, DeviceSpec]],
    control: MqttTransport,
    tmp_path: Path,
) -> None:
    """Two steps on a gloo server tier, then the same job on to step 4 on two MQTT agents,
    restored from the state blobs the server tier wrote: it ends where 4 steps on one
    device end."""
    fleet, _ = hybrid_fleet
    spec = JobSpec(model="gpt-mini", steps=4, batch_size=16, microbatches=4, seed=4)
    servers = DistJob(
        job="movejob",
        model="gpt-mini",
        steps=2,
        batch_size=16,
        microbatches=4,
        seed=4,
        boundaries=[3],
        output=str(tmp_path / "server"),
    )
    launch(servers, threads=1)
    states = {
        s: (tmp_path / "server" / f"state-stage{s}.safetensors").read_bytes() for s in range(2)
    }
    plan = Plan.of((fleet.ids[0], 0, 3), (fleet.ids[1], 3, 6))
    result = run_on_agents(
        spec,
        plan,
        control,
        job="movejob",
        options=RunOptions(timeout_s=300),
        attempt=Attempt(first_step=2, restore=states),
    )
    assert len(result.plan.stages) == 2
    assert {(r.stage, r.device) for r in result.reports} == {(0, fleet.ids[0]), (1, fleet.ids[1])}
    reference = run_inprocess(spec, Plan.of(("local", 0, 6)))
    first = json.loads((tmp_path / "server" / "losses.json").read_text())["losses"]
    independent = train_reference("gpt-mini", steps=4, batch_size=16, seed=4)
    assert_matches(first + result.losses, result.weights, independent)
    torch.testing.assert_close(
        torch.tensor(first + result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0
    )
    for key, ref in reference.weights.items():
        torch.testing.assert_close(result.weights[key], ref, rtol=1e-5, atol=1e-7, msg=key)
