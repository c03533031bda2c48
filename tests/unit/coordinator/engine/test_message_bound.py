"""The largest message of a job, which a broker started for it takes and nothing larger."""

from __future__ import annotations

import safetensors.torch

from coordinator.engine.spec import JobSpec, largest_message_bytes
from edge.models.zoo import get_model
from edge.wire.frames import Codec, Kind, encode_frame


def test_the_bound_covers_a_stage_state_and_every_frame_and_stays_small() -> None:
    spec = JobSpec(model="cnn-digits", steps=1, batch_size=64, microbatches=4)
    bound = largest_message_bytes(spec)
    model = get_model("cnn-digits")
    net = model.build()
    weights = safetensors.torch.save({k: v.contiguous() for k, v in net.state_dict().items()})
    assert bound >= 3 * len(weights)  # weights plus AdamW's two moments
    x = model.example_input(16, 0)
    for i in range(model.num_units):  # every activation a stage could send, fp32
        x = model.build_segment(i, i + 1)(x)
        frame = encode_frame(Kind.ACTIVATION, "j1", 0, 0, x.detach().float(), Codec.FP32)
        assert bound >= len(frame)
    assert bound < 8 << 20  # a few MiB, not MQTT's 256


def test_a_model_that_cannot_be_profiled_gets_mqtts_limit() -> None:
    spec = JobSpec(model="mlp", steps=1, batch_size=8, microbatches=1)
    broken = spec.model_copy(update={"model": "no_such_module_xyz:build"})
    assert largest_message_bytes(broken) == 268_435_455
