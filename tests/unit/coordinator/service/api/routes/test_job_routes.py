"""The routes of a job that need no broker: per-step metrics (``?since_step=``), the
step's anatomy as stored, the ONNX download without the ``export`` extra, what the
links what-if refuses, and the
checks a job passes before it is queued (a refused one never reaches the job
manager, which is absent here).

The jobs router runs in-process (FastAPI's TestClient, no socket) over a real store;
registry and manager are not started, as these routes only read the store.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.service.api.deps import Services
from coordinator.service.api.routes import jobs
from coordinator.service.events import EventBus
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from edge.models.zoo import get_model
from edge.wire.messages import StepReport

SPEC = {"model": "mlp", "steps": 5, "batch_size": 8, "microbatches": 2}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "coord") as s:
        yield s


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    app = FastAPI()
    app.include_router(jobs.router, prefix="/api/v1")
    bus = EventBus()
    settings = Settings(data_dir=tmp_path / "coord")
    app.state.services = Services(settings, store, bus, None, None)  # type: ignore[arg-type]
    with TestClient(app) as c:
        yield c
    bus.close()


def _report(step: int, stage: int) -> StepReport:
    loss = 2.0 - step / 10 if stage == 1 else None
    return StepReport(
        job="j1", step=step, stage=stage, device=f"dev{stage}", ts=1.0, step_s=0.5, loss=loss
    )


def test_since_step_returns_only_the_later_steps(store: Store, client: TestClient) -> None:
    store.create_job("j1", SPEC)
    for step in range(5):
        for stage in (0, 1):
            store.add_step("j1", _report(step, stage))

    def steps(query: str = "") -> list[int]:
        response = client.get(f"/api/v1/jobs/j1/metrics{query}")
        assert response.status_code == 200, response.text
        return [s["step"] for s in response.json()["steps"]]

    assert steps() == [0, 1, 2, 3, 4]
    assert steps("?since_step=0") == [1, 2, 3, 4]
    assert steps("?since_step=2") == [3, 4]
    assert steps("?since_step=4") == []
    assert steps("?since_step=99") == []
    later = client.get("/api/v1/jobs/j1/metrics?since_step=3").json()["steps"]
    assert later == [
        {
            "step": 4,
            "loss": pytest.approx(1.6),
            "samples_per_s": 16.0,
            "stages": [
                {
                    "stage": stage,
                    "device": f"dev{stage}",
                    "compute_s": 0.0,
                    "wait_s": 0.0,
                    "send_s": 0.0,
                    "step_s": 0.5,
                    "bytes_sent": 0,
                    "bytes_received": 0,
                }
                for stage in (0, 1)
            ],
        }
    ]


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "", str(2**63)])
def test_a_bad_since_step_is_a_422_naming_it(store: Store, client: TestClient, value: str) -> None:
    store.create_job("j1", SPEC)
    response = client.get(f"/api/v1/jobs/j1/metrics?since_step={value}")
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["query", "since_step"]


def test_anatomy_gives_the_plans_predicted_parts_and_the_stored_measured_ones(
    store: Store, client: TestClient
) -> None:
    store.create_job("j1", SPEC)
    assert client.get("/api/v1/jobs/j1/anatomy").json() == {
        "job": "j1",
        "predicted": None,
        "measured": None,
    }
    predicted = {"step_time_s": 1.0, "members": [{"stage": 0, "device": "dev0"}]}
    store.set_job_plan("j1", {"stages": [], "anatomy": predicted})
    store.set_job_anatomy("j1", {"step_time_s": 1.2, "steps": 3})
    got = client.get("/api/v1/jobs/j1/anatomy")
    assert got.status_code == 200, got.text
    assert got.json() == {
        "job": "j1",
        "predicted": predicted,
        "measured": {"step_time_s": 1.2, "steps": 3},
    }
    assert client.get("/api/v1/jobs/j9/anatomy").status_code == 404


def test_links_of_an_unknown_job_is_a_404_and_bad_rates_a_422_naming_them(
    store: Store, client: TestClient
) -> None:
    """The planning itself needs the manager (tests/e2e/test_demo_links.py); what is
    refused before it is asked is refused here."""
    assert client.post("/api/v1/jobs/j9/links").status_code == 404
    store.create_job("j1", SPEC)
    for body in ({"mbps": [0]}, {"mbps": [-5]}, {"mbps": []}, {"mbps": [1.0] * 17}, {"x": 1}):
        got = client.post("/api/v1/jobs/j1/links", json=body)
        assert got.status_code == 422, (body, got.text)
        assert "mbps" in got.text or "x" in got.text


def test_metrics_of_an_unknown_job_is_a_404(client: TestClient) -> None:
    assert client.get("/api/v1/jobs/nope/metrics?since_step=1").status_code == 404


def test_onnx_without_the_export_extra_is_a_501_naming_it(
    store: Store, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.create_job("j1", SPEC)
    for state in ("planning", "running"):
        store.set_job_state("j1", state)
    store.set_job_state("j1", "completed", steps_done=5)
    path = store.model_path("j1")
    path.parent.mkdir(parents=True)
    safetensors.torch.save_file(get_model("mlp").build().state_dict(), path)
    assert client.get("/api/v1/jobs/j1/model.onnx").status_code == 200
    monkeypatch.setitem(sys.modules, "onnx", None)  # as on a coordinator without [export]
    response = client.get("/api/v1/jobs/j1/model.onnx")
    assert response.status_code == 501
    assert response.json() == {
        "detail": "ONNX export needs the export extras (no module 'onnx' here): "
        "pip install 'edgetrain[export]'"
    }
    assert client.get("/api/v1/jobs/j1/model").status_code == 200  # the weights still are


@pytest.mark.parametrize(
    ("extra", "loc", "message"),
    [
        ({"dataset": "nope"}, "dataset", "unknown dataset 'nope'"),
        ({"dataset": "digitz"}, "dataset", "unknown dataset 'digitz'; did you mean 'digits'?"),
        ({"dataset": "nope", "dataset_options": {"size": 3}}, "dataset", "unknown dataset 'nope'"),
        (
            {"dataset": "synthetic-images", "dataset_options": {"size": 10**12}},
            "dataset_options",
            "dataset 'synthetic-images': size must be <= 2147483648 (got 1000000000000)",
        ),
        (
            {"model_options": {"depth": 10**9}},
            "model_options",
            "model mlp: depth must be an integer from 2 to 1024 (got 1000000000)",
        ),
        ({"model": "nope"}, "model", "model: unknown model 'nope'"),
        ({"model_options": {"seed": 1}}, "model_options", "model mlp: model_options may not set"),
        ({"model_options": {"name": "x"}}, "model_options", "model mlp: model_options may not"),
        ({"model_options": {"allow_code": 1}}, "model_options", "model mlp: model_options may"),
        ({"model_options": {"hidden": "8"}}, "model_options", "model mlp: option hidden: input"),
        (
            {"dataset_options": {"split": "test"}},
            "dataset_options",
            "model mlp's dataset: dataset_options may not set 'split'",
        ),
        (
            {"dataset": "synthetic-images", "dataset_options": {"allow_code": ["os"]}},
            "dataset_options",
            "dataset 'synthetic-images': dataset_options may not set 'allow_code'",
        ),
    ],
)
def test_model_and_dataset_are_checked_before_a_job_is_queued(
    client: TestClient, extra: dict[str, object], loc: str, message: str
) -> None:
    response = client.post("/api/v1/jobs", json={**SPEC, **extra})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", loc] and detail["msg"].startswith(message), detail


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"group_sizes": [2, 1]}, "group_sizes needs partition even"),
        (
            {"partition": "even", "group_sizes": [2, 1], "stages": 3},
            "stages=3, but group_sizes has 2 stages",
        ),
        (
            {"partition": "even", "group_sizes": [1, 1, 1, 1]},
            "group_sizes has 4 stages, more than the 3 units of mlp",
        ),
        (
            {"partition": "even", "group_sizes": [2, 1], "devices": ["a", "b", "c", "d"]},
            "group_sizes adds up to 3 devices, but the job allows 4",
        ),
    ],
)
def test_group_sizes_the_job_cannot_run_on_are_a_422_naming_them(
    client: TestClient, extra: dict[str, object], message: str
) -> None:
    response = client.post("/api/v1/jobs", json={**SPEC, **extra})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "group_sizes"] and detail["msg"].startswith(message), detail


@pytest.mark.parametrize("sizes", [[], [2, 0], [-1]])
def test_group_sizes_must_be_positive_counts(client: TestClient, sizes: list[int]) -> None:
    body = {**SPEC, "partition": "even", "group_sizes": sizes}
    response = client.post("/api/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][:2] == ["body", "group_sizes"]


@pytest.mark.parametrize(
    ("extra", "loc"),
    [({"objective": "speed"}, "objective"), ({"max_step_time_s": 0}, "max_step_time_s")],
)
def test_a_bad_objective_or_deadline_is_a_422_naming_it(
    client: TestClient, extra: dict[str, object], loc: str
) -> None:
    response = client.post("/api/v1/jobs", json={**SPEC, **extra})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", loc]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"partition": "even"}, "local data needs partition plan"),
        ({"pin_first": "a"}, "local data places stage 0 on its holders"),
        ({"steps": None, "epochs": 1.0}, "local data needs steps, not epochs"),
        ({"data": {"name": "digits", "min_local_units": 4}}, "min_local_units 4 is more than"),
    ],
)
def test_local_data_the_job_cannot_run_with_is_a_422_naming_it(
    client: TestClient, extra: dict[str, object], message: str
) -> None:
    body = {**SPEC, "data": {"name": "digits", "placement": "local"}, **extra}
    response = client.post("/api/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "data"] and detail["msg"].startswith(message), detail


@pytest.mark.parametrize(
    ("body", "loc", "message"),
    [
        (
            {"data": {"name": "digits", "labels": "local"}, "replicate_every": 2},
            ["body", "data", "labels"],
            'labels "local" cannot be combined with fault tolerance yet',
        ),
        (
            {"data": {"name": "digits", "labels": "local"}, "faults": ["kill:1@2"]},
            ["body", "data", "labels"],
            'labels "local" cannot be combined with fault tolerance yet',
        ),
        (
            {"data": {"name": "digits", "labels": "home"}},
            ["body", "data", "labels"],
            "Input should be 'central' or 'local'",
        ),
        ({"labels": "local"}, ["body", "labels"], "Extra inputs are not permitted"),
    ],
)
def test_labels_local_where_they_cannot_be_is_a_422_naming_labels(
    client: TestClient, body: dict[str, object], loc: list[str], message: str
) -> None:
    """Labels stay home only with local data (they live inside ``data``), and not yet with
    fault tolerance."""
    response = client.post("/api/v1/jobs", json={**SPEC, **body})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == loc and detail["msg"].startswith(message), detail


def test_a_local_dataset_name_is_a_plain_name(client: TestClient) -> None:
    bad = client.post("/api/v1/jobs", json={**SPEC, "data": {"name": "../etc"}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:3] == ["body", "data", "name"]
