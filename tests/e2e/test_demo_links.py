"""The demo's fleet on links that bind: every device's link shaped to 10 Mbit/s.

The demo's session (:func:`coordinator.local.demo.demo_session`) starts the four
emulated agents with ``--link-mbps 10``; each shapes its frames to it and announces it.
There the demo's exact job (fp32 links) is planned on the holders alone: the U's
activations would cost more than the laptop saves ([Note: the split that does not
pay]). The same job with ``codec: auto`` is planned as the U with its links
compressed, and a client with the coordinator's account sees its activations and
gradients cross in the chosen codec. The coordinator's links what-if
(``POST /api/v1/jobs/{id}/links``) prices the job at 10 Mbit/s exactly as its plan
was priced, puts the rate where the exact job stops splitting above 10 Mbit/s and
below 1000, and refuses a job on no local data with a 409.
"""

from __future__ import annotations

import threading

import pytest
from support.markers import needs_mosquitto

from coordinator.local.demo import DemoFleet, demo_session, job_body
from edge.transport.mqtt import MqttTransport
from edge.wire.frames import MAGIC, Codec, Kind, decode_frame
from edge.wire.topics import TOPIC_ROOT

pytestmark = needs_mosquitto

MBPS = 10.0


@pytest.mark.slow
def test_on_slow_links_the_exact_job_stays_home_and_the_auto_codec_splits_compressed() -> None:
    fleet = DemoFleet.parse("rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop", link_mbps=MBPS)
    lock, seen = threading.Lock(), []

    def keep(topic: str, payload: bytes) -> None:
        with lock:
            seen.append((topic, bytes(payload)))

    with demo_session(fleet) as demo:
        spy = MqttTransport(demo.coordinator_login)
        spy.connect(timeout=30)
        try:
            spy.subscribe(f"{TOPIC_ROOT}/#", keep)
            demo.wait_online()
            devices = demo.api.get("/api/v1/devices").json()["data"]
            exact = demo.submit(job_body(steps=8, batch_size=48, microbatches="auto", lr=0.05))
            home = demo.wait_plan(exact)
            demo.wait_job(exact)
            auto = demo.submit(job_body(8, 48, "auto", 0.05, codec="auto"))
            split = demo.wait_plan(auto)
            demo.wait_job(auto)
            links = demo.links(exact, [1000, MBPS])
            other = demo.submit({"model": "mlp", "steps": 1, "batch_size": 8, "microbatches": 1})
            refused = demo.api.post(f"/api/v1/jobs/{other}/links")
            demo.wait_job(other)
        finally:
            spy.close()
    # Every agent shaped its link to 10 Mbit/s and said so.
    assert sorted(d["profile"]["bandwidth_mbps"] for d in devices) == [MBPS] * 4
    # The exact job: the holders alone (the search's score or the engine's prediction).
    assert len(home["stages"]) == 1 and len(home["stages"][0]["devices"]) == 3
    # With codec auto: the U, its links compressed, as the frames on the wire show.
    assert split["u_shaped"] is True
    coded = [row["codec"] for row in split["egress"] if row["what"].startswith("activations")]
    assert coded and all(c in ("bf16", "int8") for c in coded), split["egress"]
    with lock:
        frames = [decode_frame(p) for t, p in seen if f"/jobs/{auto}/" in t and p[:4] == MAGIC]
    crossed = [f for f in frames if f.kind in (Kind.ACTIVATION, Kind.GRADIENT)]
    assert crossed and {f.codec for f in crossed} <= {Codec.BF16, Codec.INT8}
    assert {Codec.parse(c) for c in coded} <= {f.codec for f in crossed}
    # The what-if: at 1000 Mbit/s the exact job splits; at its own rate it is the
    # plan the job got, priced the same.
    fast, slow = links["ladder"]
    assert (fast["mbps"], fast["split"]) == (1000, True)
    assert (slow["mbps"], slow["split"], slow["stages"]) == (MBPS, False, 1)
    assert slow["predicted_sps"] == pytest.approx(home["throughput_sps"], rel=1e-9)
    assert MBPS < links["split_stops_paying_below_mbps"] < 1000
    assert refused.status_code == 409 and "no local data" in refused.json()["detail"]
