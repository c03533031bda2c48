"""The demo's fleet on links that bind: every device's link shaped to 10 Mbit/s.

The demo's session (:func:`coordinator.local.demo.demo_session`) starts the four
emulated agents with ``--link-mbps 10``; each shapes its frames to it and announces it.
The demo's job with ``codec: auto`` is planned there as the U with its holders'
activations compressed, and a client with the coordinator's account sees every
activation and gradient cross in its link's chosen codec. The exact job (fp32
links) is planned as the engine's prediction says: where the holders alone are
faster, on them ([Note: the split that does not pay]; which way it goes at 10 Mbit/s
moves with the unit times the agents measure, so the unit tests of
coordinator/engine/links.py pin the decision on catalogue profiles). The
coordinator's links what-if (``POST /api/v1/jobs/{id}/links``) plans the exact job at
10 Mbit/s as its plan was planned and priced, splits it at 1000, puts the rate where
it stops splitting where the ladder says, and refuses a job on no local data with a
409.
"""

from __future__ import annotations

import pytest
from support.markers import needs_mosquitto
from support.wire import job_frames, wire_spy

from coordinator.local.demo import DemoFleet, demo_session, job_body
from edge.wire.frames import Codec, Kind

pytestmark = needs_mosquitto

MBPS = 10.0


@pytest.mark.slow
def test_on_slow_links_the_auto_codec_splits_compressed_and_the_what_if_is_the_plan() -> None:
    fleet = DemoFleet.parse("rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop", link_mbps=MBPS)
    with demo_session(fleet) as demo, wire_spy(demo.coordinator_login) as seen:
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
        frames = job_frames(seen(), auto)
    # Every agent shaped its link to 10 Mbit/s and said so.
    assert sorted(d["profile"]["bandwidth_mbps"] for d in devices) == [MBPS] * 4
    # The exact job: the holders alone, or the U with exact links.
    holders = home["stages"][0]["devices"]
    assert len(holders) == 3
    if len(home["stages"]) > 1:
        assert home["u_shaped"] is True and home["stages"][-1]["devices"] == holders
        assert all(row["codec"] in ("fp32", "raw") for row in home["egress"])
    # With codec auto: the U, its links compressed, as the frames on the wire show.
    # The holders' activations (16 kB a sample) bind; the U's link back to them (the
    # laptop's 64 numbers a sample) may stay exact.
    assert split["u_shaped"] is True
    coded = [row["codec"] for row in split["egress"] if row["what"].startswith("activations")]
    assert len(coded) == 2 and coded[0] in ("bf16", "int8"), split["egress"]
    crossed = {f.codec for f in frames if f.kind in (Kind.ACTIVATION, Kind.GRADIENT)}
    assert crossed == {Codec.parse(c) for c in coded}, (crossed, coded)
    # The what-if: at 1000 Mbit/s the exact job splits; at its own rate it is the
    # plan the job got, priced the same; the bisected rate is where the ladder flips.
    fast, slow = links["ladder"]
    assert (fast["mbps"], fast["split"]) == (1000, True)
    assert (slow["mbps"], slow["stages"]) == (MBPS, len(home["stages"]))
    assert slow["split"] == (len(home["stages"]) > 1)
    assert slow["predicted_sps"] == pytest.approx(home["throughput_sps"], rel=1e-9)
    below = links["split_stops_paying_below_mbps"]
    assert below == 0.0 if slow["split"] else MBPS < below <= 1000
    assert refused.status_code == 409 and "no local data" in refused.json()["detail"]
