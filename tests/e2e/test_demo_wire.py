"""What crosses the wire in the demo's job: no label, and no input.

The demo's session (:func:`coordinator.local.demo.demo_session`: the coordinator, its
secure broker and the four emulated agents) runs the demo's job, shortened, while a
client logged in with the coordinator's own account, which may read every topic,
keeps every message under the product's topics. Each message that is a tensor frame
is decoded: none is a labels frame and none holds a tensor shaped like the digits
the holders keep (a batch of 1x8x8 images), while the activations and gradients of
the plan's cuts did cross (so the spy saw the job). The plan is U-shaped: the holders
run the first and the last units, and the loss on their own labels.
"""

from __future__ import annotations

import pytest
from support.markers import needs_mosquitto
from support.wire import job_frames, wire_spy

from coordinator.local.demo import DemoFleet, demo_session, job_body
from edge.models.zoo import get_model
from edge.wire.frames import Kind

pytestmark = needs_mosquitto


@pytest.mark.slow
def test_the_demos_job_sends_no_label_and_no_input() -> None:
    fleet = DemoFleet.parse("rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop")
    with demo_session(fleet) as demo, wire_spy(demo.coordinator_login) as seen:
        demo.wait_online()
        job = demo.submit(job_body(steps=12, batch_size=48, microbatches="auto", lr=0.05))
        plan = demo.wait_plan(job)
        demo.wait_job(job)
        frames = job_frames(seen(), job)
    assert plan["u_shaped"] is True
    holders = plan["stages"][0]["devices"]
    assert plan["stages"][-1]["devices"] == holders and len(holders) == 3
    assert not any(row["what"] == "labels" for row in plan["egress"])
    kinds = {f.kind for f in frames}
    assert {Kind.ACTIVATION, Kind.GRADIENT} <= kinds, kinds  # the spy saw the job
    assert Kind.LABELS not in kinds
    image = get_model("cnn-digits").input_shape  # (1, 8, 8)
    shaped = [f for f in frames if tuple(f.tensor.shape[1:]) == tuple(image)]
    assert shaped == [], [(f.kind, tuple(f.tensor.shape)) for f in shaped[:3]]
