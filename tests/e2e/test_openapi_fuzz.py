"""schemathesis against the coordinator's ``/openapi.json``: no 5xx, every response as documented.

A real coordinator (uvicorn on a free loopback port, a real Mosquitto, no agents)
is fuzzed operation by operation with a bounded number of examples each. The
event stream (``/api/v1/events``) never ends, so it is the one operation left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker

pytestmark = [
    *needs_mosquitto,
]

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from coordinator.local.broker import free_port  # noqa: E402
from coordinator.service.serve import serve_in_thread  # noqa: E402
from coordinator.service.settings import Settings  # noqa: E402

TOKEN = "fuzzing-token-0123456789"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data: Path = tmp_path_factory.mktemp("coord")
    with mosquitto_broker() as broker:
        cfg = Settings(
            broker_url=broker.url, data_dir=data, api_token=SecretStr(TOKEN), port=free_port()
        )
        with serve_in_thread(cfg) as url:
            yield url


def test_no_server_errors_and_responses_match_the_schema(base_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema = schema.exclude(path="/api/v1/events")
    failures: dict[str, str] = {}
    labels = []
    calls: list[object] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        strategy = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        )

        @given(case=strategy)
        @settings(
            max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case: Any) -> None:
            calls.append(case)
            case.call_and_validate(
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=30,
                checks=[not_a_server_error, response_schema_conformance],
            )

        try:
            check()
        except Exception as exc:  # every operation is tried; all failures are told
            failures[operation.label] = f"{type(exc).__name__}: {exc}"
    assert "POST /api/v1/jobs" in labels and "GET /api/v1/events" not in labels
    assert len(calls) >= 5 * len(labels), "too few cases were generated"
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def test_user_model_references_are_refused_over_http(base_url: str) -> None:
    """``package.module:function`` would import and call code a client chose."""
    import httpx

    auth = {"Authorization": f"Bearer {TOKEN}"}
    plan = {"model": "os:system", "model_options": {"command": "true"}, "devices": ["laptop"]}
    job = {"model": "os:system", "steps": 1}
    for path, body in (("/api/v1/plans", plan), ("/api/v1/jobs", job)):
        response = httpx.post(f"{base_url}{path}", json=body, headers=auth, timeout=30)
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", "model"]
