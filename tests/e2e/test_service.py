"""The coordinator's core without HTTP: registry, job manager and store, real agents.

The job asks for two stages (``stages=2``), so the plan is a real pipeline over
both agents; a second one asks for three, and a third has a fault on a stage its
plan lacks: both fail at planning, saying why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import LocalFleet
from coordinator.service.events import EventBus
from coordinator.service.manager import JobManager
from coordinator.service.registry import DeviceRegistry
from coordinator.service.store.sqlite import Store
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

pytestmark = needs_mosquitto


@pytest.mark.slow
def test_a_submitted_job_is_planned_run_and_stored_and_survives_a_restart(tmp_path: Path) -> None:
    with mosquitto_broker() as broker:
        control = MqttTransport(MqttSettings(url=broker.url))
        control.connect(timeout=10)
        store = Store(tmp_path)
        bus = EventBus()
        events = bus.subscribe()
        registry = DeviceRegistry(store, bus, control, heartbeat_timeout_s=3.0)
        registry.start()
        manager = JobManager(store, bus, registry, control)
        manager.start()
        try:
            with LocalFleet(2, broker.url, threads=1) as fleet:
                assert until(lambda: len(registry.available()) == 2, 60)
                spec = JobSpec(model="cnn-digits", steps=8, batch_size=16, microbatches=4, stages=2)
                job = manager.submit(spec)
                assert until(lambda: store.get_job(job).state in ("completed", "failed"), 120)
                record = store.get_job(job)
                assert record.state == "completed", record.reason
                assert record.plan is not None and record.plan["feasible"] is True
                devices = [s["device"] for s in record.plan["stages"]]
                assert len(devices) == 2 and set(devices) == set(fleet.ids), record.plan
                steps = store.job_steps(job)
                assert {s.step for s in steps} == set(range(8))
                assert {(s.stage, s.device) for s in steps} == {
                    (i, st["device"]) for i, st in enumerate(record.plan["stages"])
                }
                weights = safetensors.torch.load_file(str(store.model_path(job)))
                assert set(weights) == set(get_model("cnn-digits").build().state_dict())
                kinds = {e.kind for e in events.get(0.1)}
                assert {"device", "job", "step"} <= kinds

                three = manager.submit(spec.model_copy(update={"stages": 3, "steps": 2}))
                assert until(lambda: store.get_job(three).state in ("completed", "failed"), 60)
                reason = store.get_job(three).reason
                assert reason is not None and reason.startswith("stages=3 needs 3 devices"), reason

                # A fault on a stage the plan lacks would never fire: the job fails at
                # planning, naming it (the API refuses this one at submission; a plan the
                # planner makes shorter than the devices allowed reaches the manager).
                update = {"stages": 1, "steps": 2, "faults": ("slow:1@1:2",), "replicate_every": 1}
                lacking = manager.submit(spec.model_copy(update=update))
                assert until(lambda: store.get_job(lacking).state in ("completed", "failed"), 60)
                record = store.get_job(lacking)
                why = "fault slow:1@1:2: the plan has 1 stage (stage 0), no stage 1"
                assert record.state == "failed" and record.reason == why
                assert record.plan is not None and len(record.plan["stages"]) == 1

                # A device that vanishes is marked offline.
                victim = fleet.ids[0]
                fleet.kill(victim)
                assert until(lambda: registry.get(victim).state == "offline", 20)
        finally:
            manager.stop()
            registry.stop()
            control.close()
            store.close()
    # A new coordinator on the same data directory still knows the devices and the job.
    again = Store(tmp_path)
    try:
        assert again.get_job(job).state == "completed"
        assert len(again.job_steps(job)) == len(steps)
        assert {d.id for d in again.list_devices()} >= set(fleet.ids)
    finally:
        again.close()
