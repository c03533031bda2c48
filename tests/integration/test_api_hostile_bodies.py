"""Hostile JSON sent to every write route of the coordinator: a 4xx that is JSON, never a
5xx, and a refusal changes nothing.

The app runs in process (FastAPI's TestClient) with everything it starts itself: the
store and its own broker, Mosquitto with accounts, so enrolment works. One app serves
the whole module. The write routes are read from the app's OpenAPI document and must
be exactly :data:`WRITE_ROUTES`, so a new one fails here until it is covered.

- ``NaN``, ``Infinity`` and ``-Infinity`` are JSON to Python's parser, though no JSON
  response can carry them: sent (as raw text) in each route's number and string
  fields and deep in its free-form objects, each is a 422 whose body is strict JSON,
  and nothing is stored. So is a lone surrogate (``"\\ud800"``: JSON to Python's
  parser too, not UTF-8) in the same places.
- A property test (Hypothesis, derandomized) posts arbitrary JSON to every write
  route: the routes' field names mixed with random ones, huge integers, non-finite
  numbers, lone surrogates, nulls and nested lists. No response is a 5xx; after a
  refusal the store (jobs, their events, devices) and the enrolments are as before;
  after a success the GET routes still read everything back.
  tests/e2e/test_openapi_fuzz.py fuzzes a coordinator process from its schema with
  schemathesis; this one is in process and watches the store.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from httpx import Response
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.service.api.deps import Services
from coordinator.service.app import create_app
from coordinator.service.settings import Settings
from coordinator.service.store.schema import TERMINAL
from edge.models.datasets import DATASETS
from edge.models.zoo import MODELS

pytestmark = needs_mosquitto  # the app starts its own broker (Mosquitto: accounts, enrolment)

TOKEN = "hostile-bodies-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON_HEADERS = {**AUTH, "Content-Type": "application/json"}
WRITE_METHODS = frozenset({"post", "put", "patch", "delete"})

JOBS = ("POST", "/api/v1/jobs")
PLANS = ("POST", "/api/v1/plans")
ENROLL = ("POST", "/api/v1/devices/enroll")
CANCEL = ("POST", "/api/v1/jobs/{job_id}/cancel")
LINKS = ("POST", "/api/v1/jobs/{job_id}/links")
REVOKE = ("DELETE", "/api/v1/devices/{device_id}/enrollment")
BODY_ROUTES = frozenset({JOBS, PLANS, ENROLL, LINKS})
WRITE_ROUTES = BODY_ROUTES | {CANCEL, REVOKE}
"""Every route that writes, as (method, path); those of :data:`BODY_ROUTES` take a JSON body."""

JOB = '{"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2'
PLAN = '{"model": "mlp", "batch_size": 8, "microbatches": 2'
BOX = '"id": "box", "gflops": 50, "memory_bytes": 8e9, "bandwidth_mbps": 100, "latency_ms": 1'


@dataclass
class Coordinator:
    client: TestClient
    services: Services


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("coord"),
        api_token=SecretStr(TOKEN),
        allowed_hosts=["testserver"],  # the TestClient's Host
    )
    app = create_app(settings)
    with TestClient(app) as client:
        services: Services = app.state.services
        assert services.accounts is not None, "the app's own broker runs no accounts"
        yield Coordinator(client, services)


def strict_json(response: Response) -> Any:
    """The body as JSON that any parser reads: UTF-8, and no NaN or Infinity."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(response.content.decode("utf-8"), parse_constant=refuse)


def state_of(services: Services) -> dict[str, Any]:
    """What a write route may change: the jobs and their events, the devices, the enrolments."""
    store = services.store
    jobs = store.list_jobs(limit=1_000_000, offset=0)
    assert services.accounts is not None
    return {
        "jobs": [job.model_dump(mode="json") for job in jobs],
        "events": {j.id: [e.model_dump(mode="json") for e in store.job_events(j.id)] for j in jobs},
        "devices": [device.model_dump(mode="json") for device in store.list_devices()],
        "enrolments": copy.deepcopy(services.accounts.record["devices"]),
    }


def settled(services: Services) -> dict[str, Any]:
    """The state once every job has ended (with no agents, the manager fails each at once)."""
    jobs = services.store.list_jobs
    ended = until(lambda: all(j.state in TERMINAL for j in jobs(limit=1_000_000)), 30, 0.02)
    assert ended, [(j.id, j.state) for j in jobs(limit=1_000_000) if j.state not in TERMINAL]
    return state_of(services)


# -- NaN and Infinity, field by field -------------------------------------------------------------

NON_FINITE_CASES: dict[tuple[str, str], dict[str, str]] = {
    JOBS: {
        "whole body": "{X}",
        "steps": JOB.replace('"steps": 2', '"steps": {X}') + "}",
        "epochs": JOB.replace('"steps": 2', '"epochs": {X}') + "}",
        "batch_size": JOB.replace('"batch_size": 8', '"batch_size": {X}') + "}",
        "seed": JOB + ', "seed": {X}}',
        "stages": JOB + ', "stages": {X}}',
        "group_sizes": JOB + ', "partition": "even", "group_sizes": [{X}]}',
        "replicate_every": JOB + ', "replicate_every": {X}}',
        "max_step_time_s": JOB + ', "max_step_time_s": {X}}',
        "optimizer.lr": JOB + ', "optimizer": {"lr": {X}}}',
        "optimizer.betas": JOB + ', "optimizer": {"betas": [0.9, {X}]}}',
        "data.min_local_units": JOB + ', "data": {"name": "digits", "min_local_units": {X}}}',
        "model (a string)": JOB.replace('"mlp"', "{X}") + "}",
        "pin_first (a string)": JOB + ', "pin_first": {X}}',
        "devices (strings)": JOB + ', "devices": ["a", {X}]}',
        "faults (strings)": JOB + ', "faults": [{X}]}',
        "codec (a string)": JOB + ', "codec": {X}}',
        "model_options": JOB + ', "model_options": {"hidden": {X}}}',
        "model_options, unknown": JOB + ', "model_options": {"x": [1, {"y": {X}}]}}',
        "dataset_options, own dataset": JOB + ', "dataset_options": {"x": {"y": [{X}]}}}',
        "dataset_options, digits": JOB + ', "dataset": "digits", "dataset_options": {"n": {X}}}',
        "dataset_options, synthetic": JOB
        + ', "dataset": "synthetic-images", "dataset_options": {"shape": [1, {X}, 8]}}',
        "unknown field": JOB + ', "x": {X}}',
    },
    PLANS: {
        "whole body": "[{X}]",
        "batch_size": PLAN.replace('"batch_size": 8', '"batch_size": {X}')
        + ', "devices": ["laptop"]}',
        "microbatches": PLAN.replace('"microbatches": 2', '"microbatches": {X}')
        + ', "devices": ["laptop"]}',
        "device.gflops": PLAN + ', "devices": [{' + BOX.replace("50", "{X}") + "}]}",
        "device.latency_ms": PLAN
        + ', "devices": [{'
        + BOX.replace('"latency_ms": 1', '"latency_ms": {X}')
        + "}]}",
        "device.watts_busy": PLAN + ', "devices": [{' + BOX + ', "watts_busy": {X}}]}',
        "device.details": PLAN + ', "devices": [{' + BOX + ', "details": {"temp": {X}}}]}',
        "device.details, nested": PLAN
        + ', "devices": [{'
        + BOX
        + ', "details": {"cpu": [{"mhz": [1, {X}]}]}}]}',
        "devices (strings)": PLAN + ', "devices": ["laptop", {X}]}',
        "model (a string)": PLAN.replace('"mlp"', "{X}") + ', "devices": ["laptop"]}',
        "pin_first (a string)": PLAN + ', "devices": ["laptop"], "pin_first": {X}}',
        "model_options": PLAN + ', "devices": ["laptop"], "model_options": {"depth": {X}}}',
        "model_options, unknown": PLAN + ', "devices": ["laptop"], "model_options": {"x": [{X}]}}',
    },
    ENROLL: {
        "whole body": "{X}",
        "device_id (a string)": '{"device_id": {X}}',
        "device_id in a list": '{"device_id": [{X}]}',
        "unknown field": '{"device_id": "pi-1", "x": {"y": {X}}}',
    },
    LINKS: {
        "whole body": "{X}",
        "mbps": '{"mbps": [100, {X}]}',
        "mbps (a list)": '{"mbps": {X}}',
        "unknown field": '{"mbps": [10], "x": [{X}]}',
    },
}
"""Per write route with a body: bodies with ``{X}`` where NaN or Infinity goes, by what it is."""


def test_the_write_routes_are_the_ones_covered(coordinator: Coordinator) -> None:
    """Every route of the app that writes (its OpenAPI document lists them all) is tested here;
    those that take a body are the ones given NaN and Infinity."""
    paths = coordinator.client.app.openapi()["paths"]  # type: ignore[attr-defined]
    found = {
        (method.upper(), path): "requestBody" in operation
        for path, operations in paths.items()
        for method, operation in operations.items()
        if method in WRITE_METHODS
    }
    assert set(found) == WRITE_ROUTES
    assert {route for route, body in found.items() if body} == BODY_ROUTES == set(NON_FINITE_CASES)


@pytest.mark.parametrize(
    ("route", "field"),
    [(route, field) for route, cases in NON_FINITE_CASES.items() for field in cases],
    ids=lambda part: part[1] if isinstance(part, tuple) else part,
)
def test_nan_and_infinity_are_refused_as_json(
    coordinator: Coordinator, route: tuple[str, str], field: str
) -> None:
    method, path = route
    before = settled(coordinator.services)
    for constant in ("NaN", "Infinity", "-Infinity"):
        body = NON_FINITE_CASES[route][field].replace("{X}", constant)
        response = coordinator.client.request(method, path, content=body, headers=JSON_HEADERS)
        assert response.status_code == 422, (body, response.status_code, response.text)
        detail = strict_json(response)["detail"]
        assert detail and all(item["loc"][0] == "body" for item in detail), detail
    assert settled(coordinator.services) == before  # nothing stored, nothing enrolled


@pytest.mark.parametrize(
    ("route", "field"),
    [(r, f) for r, cases in NON_FINITE_CASES.items() for f in cases if "details" not in f],
    ids=lambda part: part[1] if isinstance(part, tuple) else part,
)
def test_lone_surrogates_are_refused_as_json(
    coordinator: Coordinator, route: tuple[str, str], field: str
) -> None:
    """``"\\ud800"`` is JSON to Python's parser but no UTF-8: in the same places, a 422
    (naming the field, never echoing it) and nothing stored. (A device's free-form
    ``details`` in a plan may hold one: they are neither stored nor answered.)"""
    before = settled(coordinator.services)
    for text in ('"\\ud800"', '"pi-1\\udfff"', '{"\\udc00": 1}'):
        body = NON_FINITE_CASES[route][field].replace("{X}", text)
        response = coordinator.client.request(*route, content=body, headers=JSON_HEADERS)
        assert response.status_code == 422, (body, response.status_code, response.text)
        assert strict_json(response)["detail"], body
    assert settled(coordinator.services) == before


def test_a_valid_body_of_each_case_is_taken(coordinator: Coordinator) -> None:
    """The bodies above are refused for their NaN, not for something else: with a finite
    number (or a string where one belongs) most of them go through."""
    taken = {
        JOBS: ("steps", "seed", "optimizer.lr", "model_options", "dataset_options, synthetic"),
        PLANS: ("batch_size", "device.gflops", "device.details", "device.details, nested"),
        ENROLL: ("device_id (a string)",),
    }
    for route, fields in taken.items():
        for field in fields:
            value = '"pi-9"' if "string" in field else "4"
            body = NON_FINITE_CASES[route][field].replace("{X}", value)
            response = coordinator.client.request(*route, content=body, headers=JSON_HEADERS)
            assert response.status_code in (200, 201), (body, response.text)
            strict_json(response)
    settled(coordinator.services)


# -- arbitrary JSON: the property -----------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text sent as it is (a number Python's ``json.dumps`` would not write)."""

    text: str


def dump(value: Any) -> str:
    """``value`` as JSON text the way a hostile client writes it: NaN and Infinity bare, lone
    surrogates as ``\\ud800`` escapes, :class:`Raw` as given."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump(v) for v in value) + "]"
    return json.dumps(value)


JOB_BODY: dict[str, Any] = {"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2}
PLAN_BODY: dict[str, Any] = {"model": "mlp", "devices": ["laptop"], "batch_size": 8}
ENROLL_BODY: dict[str, Any] = {"device_id": "pi-1"}
LINKS_BODY: dict[str, Any] = {"mbps": [100, 10]}
BASES = {JOBS: JOB_BODY, PLANS: PLAN_BODY, ENROLL: ENROLL_BODY, LINKS: LINKS_BODY}
"""A body each route takes, for the property to change a few fields of."""

WORDS = [
    *MODELS,
    *DATASETS,
    *("plan", "even", "time", "energy", "1f1b", "gpipe", "fp32", "fp16", "bf16", "int8", "auto"),
    *("sgd", "adamw", "local", "kill:0@1", "kill:1.0@1", "slow:0@1:2", "join:laptop@1"),
    *("laptop", "rpi4-4gb:2", "laptop:300", "jetson-nano", "laptop:²", "pi-1", "coordinator"),
    *("os:system", "a.json", "../x", "", " ", "0", "1e3", "NaN", "a" * 200),
]
"""Strings that mean something to some route."""
RAW_NUMBERS = [
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "9" * 5000,
    "-" + "9" * 5000,
    "1" + "0" * 400 + ".5",
    "0." + "0" * 400 + "1",
]
"""Numbers Python's ``json.dumps`` does not write: overflowing floats, ints of over 4300
digits (Python's ``int`` refuses to parse those by default)."""
HUGE_INTS = [2**31, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**30, 10**4000]

ODD_TEXTS = ["\ud800", "mlp\udfff", "\udc00laptop", "a\x00b", "\u2028", "\ufeff", "é", "😀"]
"""Text that is not UTF-8 (lone surrogates), or is but trips the careless."""
odd_words = st.one_of(
    st.sampled_from(ODD_TEXTS),
    st.tuples(st.sampled_from(WORDS), st.sampled_from(ODD_TEXTS)).map("".join),
)
texts = st.one_of(st.text(st.characters(exclude_categories=()), max_size=12), odd_words)
"""Any text, lone surrogates included (rarely, unless odd)."""
numbers = st.one_of(
    st.integers(min_value=-3, max_value=300),
    st.integers(),
    st.sampled_from(HUGE_INTS),
    st.floats(),  # NaN, Infinity, -Infinity, -0.0, subnormals
    st.sampled_from(RAW_NUMBERS).map(Raw),
)


def json_values(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), numbers, texts, st.sampled_from(WORDS))
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)
        ),
        max_leaves=12,
    )


def field_names(schema: dict[str, Any], route: tuple[str, str] | None = None) -> list[str]:
    """The property names of ``route``'s body in the OpenAPI document ``schema``, or of
    every schema in it (the fields of every body and what they hold)."""
    components = schema.get("components", {}).get("schemas", {})
    if route is None:
        return sorted({name for c in components.values() for name in c.get("properties", {})})
    method, path = route
    body = schema["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]
    return sorted(components[body["schema"]["$ref"].rsplit("/", 1)[-1]]["properties"])


def bodies(route: tuple[str, str], schema: dict[str, Any]) -> st.SearchStrategy[str]:
    """Raw JSON text for ``route``: anything at all, an object of its fields and random
    keys, or (most often) a body it takes with a few fields changed or dropped, each to
    a value that means something or to anything."""
    keys = st.one_of(st.sampled_from(field_names(schema)), texts)
    values = json_values(keys)
    anything = values.map(dump)
    objects = st.dictionaries(keys, values, max_size=8).map(dump)
    base = BASES.get(route)
    if base is None:
        return st.one_of(st.just(""), anything)
    own = st.sampled_from(field_names(schema, route))
    words = st.one_of(st.sampled_from(WORDS), odd_words)
    small = st.one_of(st.integers(min_value=-1, max_value=40), st.sampled_from([0.5, 1e-3, 1e9]))
    meaningful = st.one_of(
        words,
        small,
        st.lists(words, min_size=1, max_size=3),
        st.lists(small, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(field_names(schema)), st.one_of(words, small), max_size=3),
    )
    changed = st.builds(
        lambda change, drop: {k: v for k, v in {**base, **change}.items() if k not in drop},
        st.dictionaries(st.one_of(own, own, keys), st.one_of(meaningful, values), max_size=2),
        st.sets(st.sampled_from(sorted(base)), max_size=1),
    ).map(dump)
    return st.one_of(anything, objects, changed, changed, changed)


def path_param(services: Services, pick: str | int) -> str:
    """A job or device id for a path, percent-encoded (a lone surrogate as the bytes of
    its encoding): ``pick`` itself, or for a number one of the ids that exist now (drawn
    as a number so that what is drawn does not depend on the store)."""
    if isinstance(pick, int):
        assert services.accounts is not None
        known = [j.id for j in services.store.list_jobs(limit=50)] + services.accounts.devices()
        pick = known[pick % len(known)] if known else "none"
    return quote(pick.encode("utf-8", "surrogatepass"), safe="")


EXAMPLES = 150
"""Requests per write route: the module takes about 25 s on this 2-core machine (18 s of
CPU, imports included); 1,000 per route, derandomized or not, found nothing more."""
CONTENT_TYPES = ["application/json"] * 6 + ["application/ld+json", "text/plain", ""]


def read_back(client: TestClient) -> None:
    """Every GET over what a write stores still answers in JSON (a stored NaN would not)."""
    jobs = client.get("/api/v1/jobs?limit=1000", headers=AUTH)
    assert jobs.status_code == 200, jobs.text
    for job in strict_json(jobs)["data"]:
        for tail in ("", "/metrics"):
            got = client.get(f"/api/v1/jobs/{job['id']}{tail}", headers=AUTH)
            assert got.status_code == 200, got.text
            strict_json(got)
    for path in ("/api/v1/devices", "/api/v1/devices/enrollments", "/healthz"):
        got = client.get(path, headers=AUTH)
        assert got.status_code == 200, got.text
        strict_json(got)


@pytest.mark.parametrize("route", sorted(WRITE_ROUTES), ids=" ".join)
def test_no_json_makes_a_server_error_or_a_change_when_refused(
    coordinator: Coordinator, route: tuple[str, str]
) -> None:
    client, services = coordinator.client, coordinator.services
    schema = client.app.openapi()  # type: ignore[attr-defined]
    method, template = route
    state = {"before": settled(services)}

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same examples on every run: CI is reproducible
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        path = template
        for param in ("{job_id}", "{device_id}"):
            if param in path:
                pick = data.draw(st.one_of(st.sampled_from(WORDS), texts, st.integers(0, 99)))
                path = path.replace(param, path_param(services, pick))
        body = data.draw(bodies(route, schema), label="body")
        kind = data.draw(st.sampled_from(CONTENT_TYPES), label="content-type")
        headers = {**AUTH, "Content-Type": kind} if kind else AUTH
        response = client.request(method, path, content=body.encode(), headers=headers)
        assert response.status_code < 500, (path, body, response.status_code, response.text)
        if response.status_code != 204:
            strict_json(response)
        if response.status_code >= 400:
            assert state_of(services) == state["before"], (path, body, response.text)
        else:
            state["before"] = settled(services)
            read_back(client)

    check()


def test_the_dump_writes_what_a_hostile_client_sends() -> None:
    """The property's bodies hold what Python's parser reads and JSON does not allow."""
    text = dump({"a": [math.nan, math.inf, -math.inf], "b": "\ud800", "c": Raw("1e400")})
    assert text == '{"a": [NaN, Infinity, -Infinity], "b": "\\ud800", "c": 1e400}'
    parsed = json.loads(text)
    assert math.isnan(parsed["a"][0]) and parsed["b"] == "\ud800" and parsed["c"] == math.inf
