"""The coordinator's store and settings, on a real SQLite file in a temporary folder."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import Connection

from coordinator.planner.score import Plan, PlanScore
from coordinator.service.settings import Settings, get_settings
from coordinator.service.store.sqlite import (
    SCHEMA_VERSION,
    TRANSITIONS,
    JobState,
    NotFoundError,
    Store,
    StoreError,
)
from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.wire.messages import StepReport

SPEC = {"model": "cnn-digits", "steps": 3, "batch_size": 32, "microbatches": 4}
GOOD_TOKEN = "x7Qm2vLr9TzKpW4nB8sD"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path) as s:
        yield s


def report(job: str, step: int, stage: int, loss: float | None = None) -> StepReport:
    return StepReport(
        job=job,
        step=step,
        stage=stage,
        device=f"dev{stage}",
        ts=100.0 + step,
        compute_s=0.5,
        wait_s=0.1,
        send_s=0.05,
        step_s=0.7,
        bytes_sent=1000,
        bytes_received=2000,
        loss=loss,
    )


def db_version(path: Path) -> int:
    with sqlite3.connect(path / "edgetrain.db") as conn:
        return int(conn.execute("SELECT version FROM schema_version").fetchone()[0])


# ---- schema and restart -------------------------------------------------------------------


def test_fresh_database_is_versioned_and_in_wal_mode(tmp_path: Path) -> None:
    Store(tmp_path).close()
    assert db_version(tmp_path) == SCHEMA_VERSION
    with sqlite3.connect(tmp_path / "edgetrain.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"schema_version", "devices", "jobs", "job_steps", "job_events", "job_anatomy"} <= tables


def test_everything_survives_a_restart(tmp_path: Path) -> None:
    profile = DeviceSpec(
        id="pi4",
        gflops=8.0,
        memory_bytes=4e9,
        bandwidth_mbps=100,
        latency_ms=2.0,
        details={"cpu": "cortex-a72"},
    )
    score = PlanScore(
        Plan.of(("pi4", 0, 3), ("jetson", 3, 7)),
        [0.1, 0.2],
        [0.01],
        [1e6, 2e6],
        [4e9, 8e9],
        0.2,
        0.9,
        35.5,
        True,
    )
    with Store(tmp_path) as s:
        s.upsert_device("pi4", state="busy", last_seen=50.0, profile=profile, job="j1", stage=0)
        s.create_job("j1", SPEC, ["pi4", "jetson"], created=10.0)
        s.set_job_state("j1", "planning")
        s.set_job_plan("j1", {**score.to_json(), "codec": "fp16"})
        s.set_job_state("j1", "running")
        for step in range(3):
            s.add_step("j1", report("j1", step, 0))
            s.add_step("j1", report("j1", step, 1, loss=2.0 - step))
        s.add_job_event("j1", "stage_failed", {"stage": 1, "error": "boom"})
        s.set_job_state("j1", "completed", steps_done=3, samples_per_s=12.5)
        before = (s.list_devices(), s.list_jobs(), s.job_steps("j1"), s.job_events("j1"))
    with Store(tmp_path) as s:
        after = (s.list_devices(), s.list_jobs(), s.job_steps("j1"), s.job_events("j1"))
        job = s.get_job("j1")
        device = s.get_device("pi4")
    assert after == before
    assert job is not None and device is not None
    assert (job.state, job.steps_done, job.samples_per_s) == ("completed", 3, 12.5)
    assert job.plan == {**score.to_json(), "codec": "fp16"}
    assert job.spec == SPEC and job.devices_allowed == ["pi4", "jetson"]
    assert DeviceSpec.model_validate(device.profile) == profile
    assert (device.state, device.job, device.stage, device.last_seen) == ("busy", "j1", 0, 50.0)
    steps = after[2]
    assert [(r.step, r.stage) for r in steps] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert steps[1] == report("j1", 0, 1, loss=2.0)
    assert [e.kind for e in after[3]] == ["state", "state", "stage_failed", "state"]


def test_newer_schema_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    Store(tmp_path).close()
    with sqlite3.connect(tmp_path / "edgetrain.db") as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=rf"version {SCHEMA_VERSION + 1} is newer .*upgrade"):
        Store(tmp_path)


def _make_v0(path: Path) -> None:
    """A database as an imaginary version 0 left it: devices without profile or job."""
    with sqlite3.connect(path / "edgetrain.db") as conn:
        conn.executescript("""
            CREATE TABLE schema_version (version INTEGER PRIMARY KEY);
            INSERT INTO schema_version VALUES (0);
            CREATE TABLE devices (id VARCHAR PRIMARY KEY, state VARCHAR NOT NULL,
                                  last_seen FLOAT NOT NULL);
            INSERT INTO devices VALUES ('old-pi', 'offline', 42.0);
        """)


def _v0_to_v1(conn: Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE devices ADD COLUMN first_seen FLOAT NOT NULL DEFAULT 0")
    conn.exec_driver_sql("UPDATE devices SET first_seen = last_seen")
    for column in ("profile JSON", "job VARCHAR", "stage INTEGER"):
        conn.exec_driver_sql(f"ALTER TABLE devices ADD COLUMN {column}")


def test_an_older_schema_is_migrated(tmp_path: Path) -> None:
    _make_v0(tmp_path)
    with Store(tmp_path, migrations={0: _v0_to_v1}) as s:
        device = s.get_device("old-pi")
        assert device is not None
        assert (device.state, device.first_seen, device.job) == ("offline", 42.0, None)
        s.create_job("j1", SPEC)  # tables new in version 1 were created
    assert db_version(tmp_path) == SCHEMA_VERSION


def test_a_missing_or_failing_migration_changes_nothing(tmp_path: Path) -> None:
    _make_v0(tmp_path)
    with pytest.raises(StoreError, match="no migration from schema version 0"):
        Store(tmp_path, migrations={})

    def half_done(conn: Connection) -> None:
        _v0_to_v1(conn)
        raise RuntimeError("migration bug")

    with pytest.raises(RuntimeError, match="migration bug"):
        Store(tmp_path, migrations={0: half_done})
    assert db_version(tmp_path) == 0
    with sqlite3.connect(tmp_path / "edgetrain.db") as conn:
        columns = [r[1] for r in conn.execute("PRAGMA table_info(devices)")]
    assert columns == ["id", "state", "last_seen"]  # the ALTERs were rolled back too


def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "edgetrain.db") as conn:
        conn.execute("CREATE TABLE something (x INTEGER)")
    with pytest.raises(StoreError, match="not an edgetrain database"):
        Store(tmp_path)


# ---- threads ------------------------------------------------------------------------------


def test_concurrent_writers_lose_nothing(store: Store) -> None:
    store.create_job("j1", SPEC)
    threads, steps = 4, 200
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def write(stage: int) -> None:
        try:
            barrier.wait()
            for step in range(steps):
                store.add_step("j1", report("j1", step, stage, loss=float(step)))
                if step % 50 == 0:
                    store.upsert_device(f"dev{stage}", state="busy", last_seen=float(step))
                    store.add_job_event("j1", "progress", {"stage": stage, "step": step})
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:  # as the API would, between requests
        barrier.wait()
        while any(t.is_alive() for t in workers):
            store.job_steps("j1")
            store.list_devices()
            time.sleep(0.002)

    workers = [threading.Thread(target=write, args=(s,)) for s in range(threads)]
    reader = threading.Thread(target=read)
    for t in [*workers, reader]:
        t.start()
    for t in [*workers, reader]:
        t.join(timeout=60)
    assert not errors
    assert len(store.job_steps("j1")) == threads * steps
    assert len(store.job_steps("j1", from_step=150)) == threads * 50
    assert len(store.job_events("j1")) == threads * 4
    assert [d.last_seen for d in store.list_devices()] == [150.0] * threads


def test_two_stores_on_one_file_wait_for_each_other(tmp_path: Path) -> None:
    # As two processes would: each Store has its own lock, so SQLite's locks decide.
    with Store(tmp_path) as a, Store(tmp_path) as b:
        a.create_job("j1", SPEC)

        def write(st: Store, stage: int) -> None:
            for step in range(100):  # read-then-write transactions, the kind that deadlock
                st.upsert_device(f"dev{stage}", last_seen=float(step))
                st.add_job_event("j1", "progress", {"stage": stage})

        threads = [threading.Thread(target=write, args=(st, i)) for i, st in enumerate([a, b] * 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(b.job_events("j1")) == 400
        assert [d.last_seen for d in a.list_devices()] == [99.0] * 4


# ---- jobs ---------------------------------------------------------------------------------


def test_a_repeated_step_report_updates_the_row(store: Store) -> None:
    store.create_job("j1", SPEC)
    store.add_step("j1", report("j1", 0, 1, loss=3.0))
    store.add_step("j1", report("j1", 0, 1, loss=2.5))
    assert [r.loss for r in store.job_steps("j1")] == [2.5]
    with pytest.raises(NotFoundError):
        store.add_step("nope", report("nope", 0, 0))
    with pytest.raises(ValueError, match="given for job j1"):
        store.add_step("j1", report("j2", 0, 0))


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_diverged_loss_reads_back_as_none(store: Store, loss: float) -> None:
    store.create_job("j1", SPEC)
    store.add_step("j1", report("j1", 0, 1, loss=loss))
    assert [r.loss for r in store.job_steps("j1")] == [None]


def test_a_jobs_measured_anatomy_is_replaced_and_survives_a_restart(tmp_path: Path) -> None:
    with Store(tmp_path) as s:
        s.create_job("j1", SPEC)
        assert s.job_anatomy("j1") is None
        s.set_job_anatomy("j1", {"step_time_s": 1.0, "steps": 1})
        s.set_job_anatomy("j1", {"step_time_s": 0.9, "steps": 2})
        with pytest.raises(NotFoundError):
            s.set_job_anatomy("nope", {"steps": 1})
    with Store(tmp_path) as s:
        assert s.job_anatomy("j1") == {"step_time_s": 0.9, "steps": 2}
        assert s.job_anatomy("nope") is None


def test_the_happy_path_stamps_times_and_logs_each_change(store: Store) -> None:
    job = store.create_job("j1", SPEC)
    assert (job.state, job.started, job.finished, job.steps_done) == ("pending", None, None, 0)
    store.set_job_state("j1", "planning")
    running = store.set_job_state("j1", "running")
    assert running.started is not None and running.finished is None
    progress = store.set_job_state("j1", "running", steps_done=2)  # progress: same state
    assert (progress.steps_done, progress.started) == (2, running.started)
    done = store.set_job_state("j1", "completed", steps_done=3, samples_per_s=40.0)
    assert done.finished is not None and done.finished >= running.started
    states = [(e.detail or {})["to"] for e in store.job_events("j1")]
    assert states == ["planning", "running", "completed"]


def test_a_running_job_can_be_replanned(store: Store) -> None:
    store.create_job("j1", SPEC)
    path: list[JobState] = ["planning", "running", "planning", "running"]
    for state in path:
        store.set_job_state("j1", state)
    events = store.job_events("j1")
    assert [(e.detail or {})["from"] for e in events] == [
        "pending",
        "planning",
        "running",
        "planning",
    ]


ILLEGAL = [(a, b) for a in TRANSITIONS for b in TRANSITIONS if b not in TRANSITIONS[a] and a != b]


@pytest.mark.parametrize(("old", "new"), [*ILLEGAL, ("completed", "completed")])
def test_illegal_transitions_are_refused(store: Store, old: JobState, new: JobState) -> None:
    path: dict[JobState, list[JobState]] = {
        "pending": [],
        "planning": ["planning"],
        "running": ["planning", "running"],
        "completed": ["planning", "running", "completed"],
        "failed": ["failed"],
        "cancelled": ["cancelled"],
    }
    store.create_job("j1", SPEC)
    for state in path[old]:
        store.set_job_state("j1", state)
    with pytest.raises(ValueError, match=f"cannot go from {old} to {new}"):
        store.set_job_state("j1", new)
    job = store.get_job("j1")
    assert job is not None and job.state == old


def test_terminal_states_refuse_everything(store: Store) -> None:
    assert ("completed", "running") in ILLEGAL
    assert all(not TRANSITIONS[s] for s in ("completed", "failed", "cancelled"))


def test_unknown_and_bad_job_ids(store: Store) -> None:
    assert store.get_job("nope") is None
    with pytest.raises(NotFoundError):
        store.set_job_state("nope", "planning")
    with pytest.raises(NotFoundError):
        store.add_job_event("nope", "x")
    store.create_job("j1", SPEC)
    with pytest.raises(ValueError, match="already exists"):
        store.create_job("j1", SPEC)
    for bad in ("../etc", "", "a" * 17, "a b"):
        with pytest.raises(ValueError, match="job id"):
            store.create_job(bad, SPEC)
        with pytest.raises(ValueError, match="job id"):
            store.model_path(bad)
    assert store.model_path("j1") == store.data_dir / "jobs" / "j1" / "model.safetensors"


def test_list_jobs_pages_newest_first_and_filters(store: Store) -> None:
    for i in range(5):
        store.create_job(f"j{i}", SPEC, created=float(i))
    store.set_job_state("j1", "cancelled", "user asked")
    assert [j.id for j in store.list_jobs()] == ["j4", "j3", "j2", "j1", "j0"]
    assert [j.id for j in store.list_jobs(limit=2, offset=1)] == ["j3", "j2"]
    cancelled = store.list_jobs(state="cancelled")
    assert [(j.id, j.reason) for j in cancelled] == [("j1", "user asked")]
    assert (store.count_jobs(), store.count_jobs("pending")) == (5, 4)


def test_mark_interrupted_fails_only_jobs_in_flight(tmp_path: Path) -> None:
    with Store(tmp_path) as s:
        paths: list[list[JobState]] = [
            [],
            ["planning"],
            ["planning", "running"],
            ["planning", "running", "completed"],
            ["cancelled"],
        ]
        for i, path in enumerate(paths):
            s.create_job(f"j{i}", SPEC, created=float(i))
            for state in path:
                s.set_job_state(f"j{i}", state)
    with Store(tmp_path) as s:  # the coordinator restarts
        assert s.mark_interrupted() == ["j1", "j2"]
        assert s.mark_interrupted() == []
        states = {j.id: (j.state, j.reason) for j in s.list_jobs()}
        last = s.job_events("j2")[-1]
    assert states == {
        "j0": ("pending", None),
        "j1": ("failed", "coordinator restarted"),
        "j2": ("failed", "coordinator restarted"),
        "j3": ("completed", None),
        "j4": ("cancelled", None),
    }
    assert last.detail == {"from": "running", "to": "failed", "reason": "coordinator restarted"}


# ---- devices ------------------------------------------------------------------------------


def test_upsert_device_keeps_what_it_is_not_told(store: Store) -> None:
    new = store.upsert_device("pi", last_seen=10.0)
    assert (new.state, new.first_seen, new.profile, new.job) == ("offline", 10.0, None, None)
    store.upsert_device("pi", state="busy", job="j1", stage=2, profile={"id": "pi"})
    late = store.upsert_device("pi", last_seen=5.0)  # a late retained message
    assert (late.state, late.job, late.stage, late.last_seen) == ("busy", "j1", 2, 10.0)
    assert late.profile == {"id": "pi"}
    idle = store.upsert_device("pi", state="online", job=None, stage=None, last_seen=11.0)
    assert (idle.state, idle.job, idle.stage, idle.last_seen) == ("online", None, None, 11.0)
    assert store.get_device("other") is None
    assert [d.id for d in store.list_devices()] == ["pi"]


# ---- settings -----------------------------------------------------------------------------


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No ``EDGETRAIN_*`` variable from the caller's shell, and a private home."""
    import os

    for name in list(os.environ):
        if name.startswith("EDGETRAIN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def test_settings_defaults(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s = Settings()
    assert (s.host, s.port, s.broker_url, s.api_token, s.api_read_auth) == (
        "127.0.0.1",
        8000,
        None,
        None,
        False,
    )
    assert (s.heartbeat_timeout_s, s.environment, s.token) == (3.0, "development", None)
    assert s.data_dir == tmp_path / ".edgetrain" / "coordinator"
    assert s.db_path == s.data_dir / "edgetrain.db"
    assert all(f.description for f in Settings.model_fields.values())  # help for every field


def test_settings_from_the_environment(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("EDGETRAIN_HOST", "0.0.0.0")
    env.setenv("EDGETRAIN_PORT", "9001")
    env.setenv("EDGETRAIN_BROKER_URL", "mqtt://broker:1883")
    env.setenv("EDGETRAIN_DATA_DIR", "~/data")
    env.setenv("EDGETRAIN_API_TOKEN", GOOD_TOKEN)
    env.setenv("EDGETRAIN_API_READ_AUTH", "1")
    env.setenv("EDGETRAIN_HEARTBEAT_TIMEOUT_S", "1.5")
    env.setenv("EDGETRAIN_ENVIRONMENT", "production")
    s = Settings()
    assert (s.host, s.port, s.broker_url, s.heartbeat_timeout_s) == (
        "0.0.0.0",
        9001,
        "mqtt://broker:1883",
        1.5,
    )
    assert (s.data_dir, s.token, s.api_read_auth) == (tmp_path / "data", GOOD_TOKEN, True)
    assert GOOD_TOKEN not in repr(s)
    env.setenv("EDGETRAIN_API_READ_AUTH", "true")
    assert Settings().api_read_auth
    env.setenv("EDGETRAIN_API_READ_AUTH", "0")
    assert not Settings().api_read_auth
    env.setenv("EDGETRAIN_HOST", "127.0.0.1")  # an open API serves on loopback only
    env.setenv("EDGETRAIN_API_TOKEN", "")  # empty counts as unset
    assert Settings().api_token is None


@pytest.mark.parametrize(
    "token",
    ["changethis", "changeme", "secret", "short-random", "changethis-changethis-changethis"],
)
def test_placeholder_token_is_refused_in_production(env: pytest.MonkeyPatch, token: str) -> None:
    env.setenv("EDGETRAIN_ENVIRONMENT", "production")
    env.setenv("EDGETRAIN_API_TOKEN", token)
    with pytest.raises(ValidationError, match="api_token: EDGETRAIN_API_TOKEN") as info:
        Settings()
    assert repr(token) not in str(info.value) and "input_value" not in str(info.value)
    with pytest.raises(UserError, match=r"^settings: api_token: .*production") as user:
        get_settings()
    assert "\n" not in user.value.message


def test_placeholder_token_is_only_warned_about_in_development(env: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="api_token"):
        s = Settings(api_token="changethis")  # type: ignore[arg-type]
    assert s.token == "changethis"


def test_get_settings_reads_anew_and_drops_unset_overrides(env: pytest.MonkeyPatch) -> None:
    env.setenv("EDGETRAIN_PORT", "9001")
    assert get_settings(port=None, broker_url=None).port == 9001
    assert get_settings(port=7000).port == 7000
    env.setenv("EDGETRAIN_PORT", "9002")
    assert get_settings().port == 9002
    with pytest.raises(UserError, match="port"):
        get_settings(port=70000)


def test_broker_accounts_name_a_record_of_a_broker_at_a_url(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    record = tmp_path / "record"
    record.mkdir()
    env.setenv("EDGETRAIN_BROKER_ACCOUNTS", "~/record")
    needs_url = r"^settings: broker_accounts: .*needs EDGETRAIN_BROKER_URL"
    with pytest.raises(UserError, match=needs_url):
        get_settings()
    env.setenv("EDGETRAIN_BROKER_URL", "mqtts://127.0.0.1:8883")
    no_record = rf"^settings: broker_accounts: no accounts.json in {record}$"
    with pytest.raises(UserError, match=no_record):
        get_settings()
    (record / "accounts.json").write_text("{}")
    assert get_settings().broker_accounts == record


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "coordinator.example"])
def test_an_open_api_is_refused_off_loopback(env: pytest.MonkeyPatch, host: str) -> None:
    with pytest.raises(UserError) as refused:
        get_settings(host=host)
    assert refused.value.message == (
        f"settings: host: {host} is not a loopback address and no API token is set, so anyone "
        "on the network could submit jobs; set EDGETRAIN_API_TOKEN (or serve on 127.0.0.1)"
    )
    assert refused.value.exit_code == 2
    env.setenv("EDGETRAIN_API_TOKEN", GOOD_TOKEN)
    assert get_settings(host=host).host == host


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost"]
)
def test_an_open_api_may_serve_on_loopback(env: pytest.MonkeyPatch, host: str) -> None:
    assert get_settings(host=host).token is None


def test_trusted_hosts_are_loopback_host_and_allowed_hosts(env: pytest.MonkeyPatch) -> None:
    assert Settings().trusted_hosts == ["localhost", "127.0.0.1", "[::1]"]
    env.setenv("EDGETRAIN_API_TOKEN", GOOD_TOKEN)
    assert Settings(host="10.1.2.3").trusted_hosts == [
        "localhost",
        "127.0.0.1",
        "[::1]",
        "10.1.2.3",
    ]
    assert Settings(host="fe80::1").trusted_hosts[-1] == "[fe80::1]"
    env.setenv("EDGETRAIN_ALLOWED_HOSTS", " Pi.Example , *.lab.example,fd00::2")
    assert Settings().allowed_hosts == ["pi.example", "*.lab.example", "fd00::2"]
    assert Settings().trusted_hosts[3:] == ["pi.example", "*.lab.example", "[fd00::2]"]
    env.setenv("EDGETRAIN_ALLOWED_HOSTS", '["a.example", "*"]')
    assert Settings().allowed_hosts == ["a.example", "*"]
    for bad, named in (("a*.example", "a*.example"), ("*example", "*example"), ("a,,*b", "*b")):
        env.setenv("EDGETRAIN_ALLOWED_HOSTS", bad)
        with pytest.raises(UserError) as refused:
            get_settings()
        assert refused.value.message == (
            f"settings: allowed_hosts: {named!r} is not a host name, an address, '*' or "
            f"'*.domain' (got {bad!r})"
        )


def test_max_body_bytes_is_a_mebibyte_unless_set(env: pytest.MonkeyPatch) -> None:
    assert Settings().max_body_bytes == 1 << 20
    env.setenv("EDGETRAIN_MAX_BODY_BYTES", "4096")
    assert Settings().max_body_bytes == 4096
    env.setenv("EDGETRAIN_MAX_BODY_BYTES", "0")
    with pytest.raises(UserError, match=r"^settings: max_body_bytes: "):
        get_settings()
