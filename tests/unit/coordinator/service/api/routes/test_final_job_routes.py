"""A job that has ended shows every field of a final job over REST, and keeps them.

The jobs router runs in-process (support.jobs_api: FastAPI's TestClient, no socket)
over a real store, the real device registry and the real job manager, whose control
connection is a stand-in (support.control) that nothing here publishes on. A job is created with
``POST /api/v1/jobs`` and ended as a user or the coordinator would end it:

- ``cancelled``: ``POST .../cancel`` while it is queued (behind a worker not
  started yet, as behind a busy one);
- ``failed``: the worker takes it and finds no device to plan it on;
- ``failed`` at a restart: it was left running when the worker starts (a
  coordinator starting on the data of one that stopped);
- ``completed``: through the store as the engine's run ends it (completing a job
  for real needs agents: tests/e2e/test_api.py).

Then ``GET`` of the job, of the job list and of its events must show what
:mod:`support.final_jobs` asks of a final job, a second cancel is a 409, and
nothing changes once the worker has taken every job queued.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.final_jobs import final_job_faults, unfinished_job_faults
from support.jobs_api import JobsApi, jobs_api
from support.waiting import until

from coordinator.service.store.sqlite import TERMINAL

BODY: dict[str, Any] = {"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2}


class _Api(JobsApi):
    """The jobs API of a coordinator whose job manager is started by :meth:`start`."""

    def job(self, job: str) -> dict[str, Any]:
        response = self.client.get(f"/api/v1/jobs/{job}")
        assert response.status_code == 200, response.text
        got: dict[str, Any] = response.json()
        return got

    def submit(self, **extra: Any) -> str:
        response = self.client.post("/api/v1/jobs", json={**BODY, **extra})
        assert response.status_code == 201, response.text
        created = response.json()
        if not self.started:  # else the worker may have ended it already
            assert unfinished_job_faults(created) == []
        return str(created["id"])

    def wait_ended(self, job: str) -> dict[str, Any]:
        assert until(lambda: self.job(job)["state"] in TERMINAL, 30), self.job(job)
        return self.job(job)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[_Api]:
    with jobs_api(tmp_path / "coord", _Api) as api:
        yield api


def _cancelled(api: _Api) -> str:
    job = api.submit()
    response = api.client.post(f"/api/v1/jobs/{job}/cancel")
    assert response.status_code == 200, response.text
    assert final_job_faults(response.json()) == []
    return job


def _failed(api: _Api) -> str:
    api.start()
    return api.submit()


def _failed_at_a_restart(api: _Api) -> str:
    job = api.submit()
    for state in ("planning", "running"):  # as the coordinator that stopped left it
        api.store.set_job_state(job, state)
    assert unfinished_job_faults(api.job(job)) == []
    api.start()
    return job


def _completed(api: _Api) -> str:
    job = api.submit()
    for state in ("planning", "running"):
        api.store.set_job_state(job, state)
    api.store.set_job_state(job, "completed", steps_done=2, samples_per_s=40.0)
    return job


_ENDS: list[tuple[Callable[[_Api], str], str, str | None]] = [
    (_cancelled, "cancelled", "cancelled by the user"),
    (_failed, "failed", "no device of the online devices may run this job"),
    (_failed_at_a_restart, "failed", "coordinator restarted"),
    (_completed, "completed", None),
]


@pytest.mark.parametrize(("end", "state", "reason"), _ENDS, ids=[e[0].__name__[1:] for e in _ENDS])
def test_an_ended_job_shows_every_final_field(
    api: _Api, end: Callable[[_Api], str], state: str, reason: str | None
) -> None:
    job = end(api)
    shown = api.wait_ended(job)
    assert (shown["state"], shown["reason"]) == (state, reason)
    events = api.client.get(f"/api/v1/jobs/{job}/events").json()["events"]
    assert final_job_faults(shown, events) == []
    listed = {j["id"]: j for j in api.client.get("/api/v1/jobs").json()["data"]}
    assert final_job_faults(listed[job]) == []
    assert listed[job] == {**shown, "latest": None}

    again = api.client.post(f"/api/v1/jobs/{job}/cancel")
    assert again.status_code == 409, again.text
    api.start()
    last = api.submit(devices=["nobody"])  # the worker takes it after every job before it
    assert api.wait_ended(last)["state"] == "failed"
    assert api.job(job) == shown
    assert api.client.get(f"/api/v1/jobs/{job}/events").json()["events"] == events
