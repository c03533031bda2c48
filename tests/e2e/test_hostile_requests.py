"""Issue 31's reproduction against a coordinator process: every request is a 4xx.

An outside attack on a running coordinator sent option names that clash with the
builders' own arguments, ``allow_code`` inside options, ``NaN`` where a number or a
string belongs, and a ``synthetic-images`` job of 2^31 samples (a 16 GiB sample order on
every stage-0 device) to a fleet of 4 GB Pis. Each got a 500 or a 201. Here each is a
4xx naming what is wrong, no job is stored, ``/healthz`` answers afterwards, and the
coordinator's log (its standard error) holds no traceback. A job of the same dataset at
a size the Pi can hold is accepted: the bound is the fleet's, not a blanket refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support.coordinator import coordinator_process
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.local.broker import free_port
from coordinator.local.fleet import AgentRoles, LocalFleet

pytestmark = needs_mosquitto
TOKEN = "hostile-requests-token-0123"
JOB = {"model": "cnn-digits", "steps": 2, "batch_size": 8, "microbatches": 2}
PI = "rpi4-4gb"
HUGE = {"shape": [1, 8, 8], "num_classes": 10, "size": 2**31}

REPRODUCTION: list[tuple[str, str, str | dict[str, object], list[str], str]] = [
    (
        "model_options seed",
        "jobs",
        {**JOB, "model_options": {"seed": 1}},
        ["model_options"],
        "seed",
    ),
    (
        "model_options name",
        "jobs",
        {**JOB, "model_options": {"name": "x"}},
        ["model_options"],
        "name",
    ),
    (
        "dataset_options split",
        "jobs",
        {**JOB, "dataset_options": {"split": "test"}},
        ["dataset_options"],
        "split",
    ),
    (
        "plans model_options name",
        "plans",
        {"model": "cnn-digits", "model_options": {"name": "x"}, "devices": [f"{PI}:2"]},
        ["model_options"],
        "name",
    ),
    (
        "optimizer lr NaN",
        "jobs",
        '{"model": "cnn-digits", "steps": 2, "batch_size": 8, "optimizer": {"lr": NaN}}',
        ["optimizer", "lr"],
        "finite",
    ),
    ("enrol device_id NaN", "devices/enroll", '{"device_id": NaN}', ["device_id"], "string"),
    (
        "model_options allow_code",
        "jobs",
        {**JOB, "model_options": {"allow_code": True}},
        ["model_options"],
        "allow_code",
    ),
    (
        "dataset_options allow_code",
        "jobs",
        {**JOB, "dataset": "digits", "dataset_options": {"allow_code": ["os"]}},
        ["dataset_options"],
        "allow_code",
    ),
    (
        "synthetic-images of 2^31",
        "jobs",
        {**JOB, "dataset": "synthetic-images", "dataset_options": HUGE},
        ["dataset_options"],
        "the order of 2,147,483,648 samples at 8 bytes each",
    ),
]


def _strict_json(text: str) -> object:
    """``text`` parsed as JSON proper: NaN or Infinity in it fails."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"the response holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_the_reproduction_is_refused_and_the_coordinator_stays_clean(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "coordinator.log"
    with (
        mosquitto_broker() as broker,
        LocalFleet(1, broker.url, threads=1, roles=AgentRoles(profiles=[PI])) as fleet,
        log.open("wb") as stderr,
        coordinator_process(port, broker.url, tmp_path / "coord", token=TOKEN, stderr=stderr),
        httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            timeout=30,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        ) as api,
    ):

        def online() -> bool:
            try:
                devices = api.get("/api/v1/devices").json()["data"]
            except httpx.TransportError:
                return False
            return [(d["id"], d["state"]) for d in devices] == [(fleet.ids[0], "online")]

        assert until(online, 90), log.read_text()[-3000:]
        (pi,) = api.get("/api/v1/devices").json()["data"]
        pi_memory = int(pi["profile"]["memory_bytes"])
        assert pi_memory < 8 * 2**31  # the 2^31 samples' order fits no device of this fleet
        for what, route, body, field, says in REPRODUCTION:
            content = body if isinstance(body, str) else json.dumps(body)
            response = api.post(f"/api/v1/{route}", content=content)
            assert response.status_code == 422, (what, response.status_code, response.text)
            (detail,) = _strict_json(response.text)["detail"]  # type: ignore[index]
            assert detail["loc"] == ["body", *field], (what, detail)
            assert says in detail["msg"] and "\n" not in detail["msg"], (what, detail)
        memory = f"more than the {pi_memory:,} bytes any device that may run its stage 0"
        assert memory in detail["msg"], detail

        assert api.get("/healthz").json()["status"] == "ok"
        assert api.get("/api/v1/jobs").json()["count"] == 0  # nothing refused was stored
        fits = {**HUGE, "size": 1 << 20}  # 8 MiB of sample order: a Pi holds it
        job = {**JOB, "dataset": "synthetic-images", "dataset_options": fits}
        accepted = api.post("/api/v1/jobs", json=job)
        assert accepted.status_code == 201, accepted.text
        job_id = accepted.json()["id"]

        def ended() -> bool:
            return api.get(f"/api/v1/jobs/{job_id}").json()["state"] in ("completed", "failed")

        assert until(ended, 120), api.get(f"/api/v1/jobs/{job_id}").text
        assert api.get(f"/api/v1/jobs/{job_id}").json()["state"] == "completed"
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
