"""The wire contract's MQTT topic names, all under ``edgetrain/v1/``.

Device topics: ``devices/{id}/status`` (retained; last-will ``offline``),
``devices/{id}/profile`` (retained), ``devices/{id}/heartbeat``,
``devices/{id}/cmd``, ``devices/{id}/probe`` (:func:`device_probe`: the device
publishes tensor frames to itself there, once, to time its transport's CPU per
byte; :mod:`edge.profiling.fixed_costs`) and ``devices/{id}/units`` (:func:`device_units`:
its answers to a ``time-units`` command). Job topics: the stage frames
(``jobs/{job}/stage/{s}/fwd|bwd``,
:mod:`edge.wire.frames`; for member ``m > 0`` of a group
``jobs/{job}/stage/{s}/member/{m}/fwd|bwd``, and a group's gradient sum:
the reduce-scatter's ``.../reduce/{sender}`` under each receiving member's
topics, one per sending member, and the all-gather's
``jobs/{job}/stage/{s}/gather/{sender}``, which names no receiver: the sender
publishes once and every other member of the stage reads it, the broker fanning
it out; [Note: groups on the wire] in :mod:`edge.wire.groups`) and
``jobs/{job}/events/{device}``, each device's own
(so a broker ACL, not a payload, says who sent an event), and besides them, all
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

Who may use which topic is part of the contract too: :func:`stage_access` lists
the topics one stage publishes and reads, which is what a broker's ACL grants a
device while it holds that stage (``coordinator.access``); device ids are
restricted (:func:`valid_device_id`) so that they can never be wildcards.

A state's ``step`` is the number of steps done: the state at the start of step
``step`` ([Note: the step of a state] in :mod:`edge.runtime.checkpoint`).

Tested in tests/unit/edge/wire/test_protocol.py (topics, job and device ids) and
tests/unit/edge/wire/test_group_contract.py (each stage's own topics, stage_access).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TOPIC_ROOT",
    "StageAccess",
    "device_cmd",
    "device_heartbeat",
    "device_probe",
    "device_profile",
    "device_status",
    "device_units",
    "job_events",
    "job_events_all",
    "job_replica",
    "job_restore",
    "job_weights",
    "parse_events_topic",
    "parse_stage_topic",
    "stage_access",
    "stage_topic",
    "valid_device_id",
    "valid_job_id",
]

TOPIC_ROOT = "edgetrain/v1"
_BY_SENDER = ("reduce", "gather")  # a group's channels: one topic per sending member

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,16}")  # fullmatch: "$" would allow a final "\n"


_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def valid_job_id(job: str) -> bool:
    """Job ids are 1-16 characters of ``[A-Za-z0-9_-]``: they fit the frame header."""
    return _JOB_ID.fullmatch(job) is not None


def valid_device_id(device: str) -> bool:
    """Device ids are 1-64 characters of ``[A-Za-z0-9_.-]``, starting with a letter or
    digit: never a topic wildcard or level separator, so a device's topics (and the ACL
    rules naming them) match that device only."""
    return _DEVICE_ID.fullmatch(device) is not None


def device_status(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/status"


def device_profile(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/profile"


def device_cmd(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/cmd"


def device_heartbeat(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/heartbeat"


def device_probe(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/probe"


def device_units(device: str) -> str:
    """Where a device answers :class:`~edge.wire.messages.TimeUnits` (its own: the broker's
    ACL, not the payload, says who timed)."""
    return f"{TOPIC_ROOT}/devices/{device}/units"


def stage_topic(
    job: str, stage: int, channel: str, member: int = 0, sender: int | None = None
) -> str:
    """Frames *for* member ``member`` of stage ``stage``: ``fwd`` (activations, labels),
    ``bwd`` (gradients) or, in a group, ``reduce`` (the gradient chunks that member
    ``sender`` of the stage sends it: one topic per sender, so the broker's grant, not
    the payload, says who sent a chunk); or ``gather``: the summed chunks member
    ``sender`` publishes once for *every* other member of its stage (the topic names
    no receiver, so ``member`` must be 0).

    Member 0 (every one-device stage) has the stage's own topics. ``sender`` is
    required on ``reduce`` and ``gather`` and refused elsewhere."""
    if (channel in _BY_SENDER) != (sender is not None):
        raise ValueError(f"a {channel} topic {'needs' if sender is None else 'has no'} sender")
    if channel == "gather" and member != 0:
        raise ValueError("a gather topic names no receiving member")
    at = f"{stage}" if member == 0 else f"{stage}/member/{member}"
    tail = "" if sender is None else f"/{sender}"
    return f"{TOPIC_ROOT}/jobs/{job}/stage/{at}/{channel}{tail}"


def job_events(job: str, device: str) -> str:
    """The events one device reports for a job (ready, step, done, failed)."""
    return f"{TOPIC_ROOT}/jobs/{job}/events/{device}"


def job_events_all(job: str) -> str:
    """The filter for every device's events of a job; :func:`parse_events_topic` names
    the device a message came on."""
    return f"{TOPIC_ROOT}/jobs/{job}/events/+"


def job_weights(job: str, stage: int) -> str:
    """A stage's trained weights at the end of a job (safetensors bytes)."""
    return f"{TOPIC_ROOT}/jobs/{job}/weights/{stage}"


def job_replica(job: str, stage: int) -> str:
    """Stage ``stage``'s state every ``replicate_every`` steps (QoS 1, not retained)."""
    return f"{TOPIC_ROOT}/jobs/{job}/replica/{stage}"


def job_restore(job: str, stage: int) -> str:
    """The state a restored stage ``stage`` starts from (retained, set by the coordinator)."""
    return f"{TOPIC_ROOT}/jobs/{job}/restore/{stage}"


_EVENTS_TOPIC = re.compile(rf"{TOPIC_ROOT}/jobs/({_JOB_ID.pattern})/events/({_DEVICE_ID.pattern})")
_NUMBER = "0|[1-9][0-9]*"
_STAGE_TOPIC = re.compile(
    rf"{TOPIC_ROOT}/jobs/({_JOB_ID.pattern})/stage/({_NUMBER})"
    rf"(?:(?:/member/([1-9][0-9]*))?/(?:(fwd|bwd)|reduce/({_NUMBER}))|/gather/({_NUMBER}))"
)


def parse_stage_topic(topic: str) -> tuple[str, int, str, int | None, int | None] | None:
    """``(job, stage, channel, member, sender)`` of a stage topic (:func:`stage_topic`'s
    arguments; ``sender`` is ``None`` but on ``reduce`` and ``gather``, ``member`` is
    ``None`` on ``gather``: every member but the sender), or ``None`` for any other
    topic."""
    m = _STAGE_TOPIC.fullmatch(topic)
    if m is None:
        return None
    job, stage = m.group(1), int(m.group(2))
    if m.group(6) is not None:
        return (job, stage, "gather", None, int(m.group(6)))
    member = int(m.group(3) or 0)
    if m.group(5) is None:
        return (job, stage, m.group(4), member, None)
    return (job, stage, "reduce", member, int(m.group(5)))


def parse_events_topic(topic: str) -> tuple[str, str] | None:
    """``(job, device)`` of an events topic, or ``None`` for any other topic."""
    m = _EVENTS_TOPIC.fullmatch(topic)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class StageAccess:
    """The topics the device holding one stage publishes to and reads (exact names)."""

    publish: tuple[str, ...]
    read: tuple[str, ...]


def stage_access(
    job: str,
    stage: int,
    num_stages: int,
    device: str,
    *,
    replicate: bool = False,
    member: int = 0,
    group_sizes: Sequence[int] | None = None,
    labels_local: bool = False,
) -> StageAccess:
    """What the device running ``stage`` of ``num_stages`` needs, and nothing more.

    It sends activations to the next stage, gradients to the previous one and, as
    stage 0, the labels straight to the last; it reports on its own events topic and
    publishes its weights (and with ``replicate`` its state) under its stage number.
    It reads its own frames, the state it may be restored from and, with
    ``replicate``, its predecessor's state (stage 0: the last stage's).

    In groups (``group_sizes``: members per stage, ``None`` for one each) the device
    is ``member`` of its stage: it sends to every member of its neighbour stages,
    reads its own member topics, and only member 0 publishes the stage's weights.
    With ``labels_local`` the labels stay home: stage 0 may not send the last stage
    anything ([Note: labels stay home] in :mod:`edge.runtime.stage`).
    A group's member ``m`` alone may publish on the ``reduce`` topics of sender ``m``
    (one to each other member) and on its own ``gather`` topic, and reads the
    ``reduce`` topics of every other sender to it and every other member's ``gather``.
    """
    last = num_stages - 1
    sizes = list(group_sizes) if group_sizes is not None else [1] * num_stages
    if len(sizes) != num_stages or not 0 <= member < sizes[stage]:
        raise ValueError(f"member {member} of stage {stage} is not in groups {sizes}")

    def to(s: int, channel: str) -> list[str]:
        return [stage_topic(job, s, channel, m) for m in range(sizes[s])]

    publish = [job_events(job, device)]
    if member == 0:
        publish.append(job_weights(job, stage))
    read = [stage_topic(job, stage, "fwd", member), stage_topic(job, stage, "bwd", member)]
    read.append(job_restore(job, stage))
    if sizes[stage] > 1:
        others = [m for m in range(sizes[stage]) if m != member]
        read += [stage_topic(job, stage, "reduce", member, m) for m in others]
        read += [stage_topic(job, stage, "gather", sender=m) for m in others]
        publish += [stage_topic(job, stage, "reduce", m, member) for m in others]
        publish.append(stage_topic(job, stage, "gather", sender=member))
    if stage < last:
        publish += to(stage + 1, "fwd")
    if stage > 0:
        publish += to(stage - 1, "bwd")
    if stage == 0 and last > 1 and not labels_local:
        publish += to(last, "fwd")  # the labels
    if replicate:
        publish.append(job_replica(job, stage))
        if num_stages > 1:
            read.append(job_replica(job, (stage - 1) % num_stages))
    return StageAccess(tuple(publish), tuple(read))
