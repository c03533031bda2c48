"""A coordinator that attaches to a broker that already has its devices (a restart, the
testbed's coordinator after ``testbed up`` enrolled them) recreates them once, so that
its grants then disconnect nobody ([Note: devices are created live])."""

from __future__ import annotations

import time
from pathlib import Path

from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.access.accounts import BrokerAccounts
from coordinator.local.owned import start_owned_broker
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import StageAssignment
from edge.wire.topics import job_events

pytestmark = needs_mosquitto


def test_a_second_coordinator_attaches_and_its_grants_disconnect_no_one(tmp_path: Path) -> None:
    owned = start_owned_broker(tmp_path / "broker")
    try:
        assert owned.accounts is not None
        device = MqttTransport(owned.accounts.enroll("pi-1").settings())
        device.connect(timeout=10)
        admin = MqttTransport(owned.settings())
        admin.connect(timeout=10)
        try:
            again = BrokerAccounts(tmp_path / "broker", owned.url, owned.accounts.ca_pem)
            again.attach(admin)  # pi-1 exists already: deleted and made again
            assert until(lambda: device.connected and device.reconnects == 1, 15)
            a = StageAssignment(
                job="j1",
                stage=0,
                num_stages=1,
                start=0,
                end=1,
                model="mlp",
                dataset="digits",
                steps=1,
                batch_size=8,
                microbatches=1,
            )
            seen: list[bytes] = []
            admin.subscribe(job_events("j1", "pi-1"), lambda _t, p: seen.append(bytes(p)))
            device.publish(job_events("j1", "pi-1"), b"before", 1)
            time.sleep(0.5)  # the broker judges it before the grant, not after
            again.grant("j1", [("pi-1", a)])
            device.publish(job_events("j1", "pi-1"), b"granted", 1)
            assert until(lambda: b"granted" in seen, 10)
            again.release("j1")
            time.sleep(0.5)
            device.publish(job_events("j1", "pi-1"), b"released", 1)
            time.sleep(0.5)
            assert seen == [b"granted"]
            assert device.reconnects == 1  # the grant and its release kicked no one
        finally:
            admin.close()
            device.close()
    finally:
        owned.stop()
