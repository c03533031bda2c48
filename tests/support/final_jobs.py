"""What a job must carry once it has ended, as one check the store and REST tests share.

A job reaches a final state (:data:`~coordinator.service.store.schema.TERMINAL`:
``completed``, ``failed``, ``cancelled``) by many paths: the worker's finish, a
failed plan, a user's cancel, a restarted coordinator's ``mark_interrupted``.
Whatever the path, the job then has

- ``finished`` set, not before ``created`` nor before ``started``;
- a reason when it failed or was cancelled, and none when it completed;
- results (``samples_per_s``) when it completed, and none otherwise; a
  completed job also has ``started`` (it ran);
- one ``state`` event into its final state, the last of its state events,
  saying the state and reason the job shows.

A job that has not ended has no ``finished``. Each check takes a job as the
REST API shows it (JSON) or as the store returns it (``record.model_dump()``)
and returns what is wrong with it, so that one assertion lists every fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.service.store.schema import TERMINAL

__all__ = ["final_job_faults", "unfinished_job_faults"]


def final_job_faults(
    job: Mapping[str, Any], events: Sequence[Mapping[str, Any]] | None = None
) -> list[str]:
    """What ``job`` lacks as a job in a final state (empty when nothing); ``events``,
    its events (``kind`` and ``detail`` each), when given, are checked too."""
    state, reason = job["state"], job["reason"]
    finished, started, created = job["finished"], job["started"], job["created"]
    faults = []
    if state not in TERMINAL:
        faults.append(f"state {state!r} is not final")
    if finished is None:
        faults.append(f"a {state} job has no finished")
    else:
        if finished < created:
            faults.append(f"finished {finished} is before created {created}")
        if started is not None and finished < started:
            faults.append(f"finished {finished} is before started {started}")
    if state == "completed":
        if reason is not None:
            faults.append(f"a completed job has a reason: {reason!r}")
        if started is None:
            faults.append("a completed job has no started")
        rate = job["samples_per_s"]
        if not (isinstance(rate, int | float) and rate > 0):
            faults.append(f"a completed job has samples_per_s {rate!r}")
    else:
        if not (isinstance(reason, str) and reason.strip()):
            faults.append(f"a {state} job has no reason: {reason!r}")
        if job["samples_per_s"] is not None:
            faults.append(f"a {state} job has samples_per_s {job['samples_per_s']!r}")
    if events is not None:
        moves = [e["detail"] or {} for e in events if e["kind"] == "state"]
        into_final = [m for m in moves if m.get("to") in TERMINAL]
        if len(into_final) != 1:
            faults.append(f"{len(into_final)} state events into a final state: {into_final}")
        if not moves or moves[-1].get("to") != state or moves[-1].get("reason") != reason:
            last = moves[-1] if moves else None
            faults.append(f"the last state event {last} is not to {state} for {reason!r}")
    return faults


def unfinished_job_faults(job: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``job`` as a job that has not ended (empty when nothing)."""
    faults = []
    if job["state"] in TERMINAL:
        faults.append(f"state {job['state']!r} is final")
    if job["finished"] is not None:
        faults.append(f"a {job['state']} job has finished {job['finished']}")
    return faults
