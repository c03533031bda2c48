"""The wire contract's MQTT topic names, all under ``edgetrain/v1/``.

Device topics: ``devices/{id}/status`` (retained; last-will ``offline``),
``devices/{id}/profile`` (retained), ``devices/{id}/heartbeat`` and
``devices/{id}/cmd``. Job topics: the stage frames (``jobs/{job}/stage/{s}/fwd|bwd``,
:mod:`edge.wire.frames`) and ``jobs/{job}/events``, and besides them, all
carrying safetensors bytes (:mod:`edge.runtime.checkpoint`), never a pickle:

- ``jobs/{job}/weights/{s}`` (:func:`job_weights`): stage ``s``'s trained
  weights at the end of the job; QoS 1.
- ``jobs/{job}/replica/{s}`` (:func:`job_replica`): stage ``s``'s state
  (weights and optimizer state) every ``replicate_every`` steps, for the
  coordinator and for the device of stage ``s + 1`` (stage 0 for the last
  stage), which keeps the newest; QoS 1, not retained.
- ``jobs/{job}/restore/{s}`` (:func:`job_restore`): the state a new stage
  ``s`` starts from, published by the coordinator, **retained**, before the
  assignment that says ``restore`` (and best cleared, with an empty retained
  message, once the stage is ready).

A state's ``step`` is the number of steps done: the state at the start of step
``step`` ([Note: the step of a state] in :mod:`edge.runtime.checkpoint`).
"""

from __future__ import annotations

import re

__all__ = [
    "TOPIC_ROOT",
    "device_cmd",
    "device_heartbeat",
    "device_profile",
    "device_status",
    "job_events",
    "job_replica",
    "job_restore",
    "job_weights",
    "parse_stage_topic",
    "stage_topic",
    "valid_job_id",
]

TOPIC_ROOT = "edgetrain/v1"

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,16}")  # fullmatch: "$" would allow a final "\n"


def valid_job_id(job: str) -> bool:
    """Job ids are 1-16 characters of ``[A-Za-z0-9_-]``: they fit the frame header."""
    return _JOB_ID.fullmatch(job) is not None


def device_status(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/status"


def device_profile(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/profile"


def device_cmd(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/cmd"


def device_heartbeat(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/heartbeat"


def stage_topic(job: str, stage: int, channel: str) -> str:
    """Frames *for* stage ``stage``: ``fwd`` (activations, labels) or ``bwd`` (gradients)."""
    return f"{TOPIC_ROOT}/jobs/{job}/stage/{stage}/{channel}"


def job_events(job: str) -> str:
    return f"{TOPIC_ROOT}/jobs/{job}/events"


def job_weights(job: str, stage: int) -> str:
    """A stage's trained weights at the end of a job (safetensors bytes)."""
    return f"{TOPIC_ROOT}/jobs/{job}/weights/{stage}"


def job_replica(job: str, stage: int) -> str:
    """Stage ``stage``'s state every ``replicate_every`` steps (QoS 1, not retained)."""
    return f"{TOPIC_ROOT}/jobs/{job}/replica/{stage}"


def job_restore(job: str, stage: int) -> str:
    """The state a restored stage ``stage`` starts from (retained, set by the coordinator)."""
    return f"{TOPIC_ROOT}/jobs/{job}/restore/{stage}"


_STAGE_TOPIC = re.compile(rf"{TOPIC_ROOT}/jobs/({_JOB_ID.pattern})/stage/(0|[1-9][0-9]*)/(fwd|bwd)")


def parse_stage_topic(topic: str) -> tuple[str, int, str] | None:
    """``(job, stage, channel)`` of a stage topic, or ``None`` for any other topic."""
    m = _STAGE_TOPIC.fullmatch(topic)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None
