"""Persistence: devices, jobs, per-step metrics and job events in one SQLite file.

The database is ``data_dir / "edgetrain.db"``; trained weights stay out of it,
in :meth:`Store.model_path`. The schema is created on open and versioned: the
``schema_version`` table holds one integer, a newer one than
:data:`SCHEMA_VERSION` is refused, an older one is upgraded by
:data:`MIGRATIONS` (``MIGRATIONS[v]`` takes version ``v`` to ``v + 1``) in one
transaction. Methods return frozen pydantic records, never ORM objects, so no
session outlives a call.

[Note: store threads] One :class:`Store` is shared by the API's threadpool,
the MQTT network thread and job worker threads. Every write runs under one
in-process lock and begins with ``BEGIN IMMEDIATE``, so a read-then-write
transaction never fails to upgrade its lock ("database is locked") and a
second process waits for its turn; reads take no lock and, in WAL mode, see
the last committed state while a write is going on.

Job states (:data:`TRANSITIONS`)::

    pending --> planning --> running --> completed
       |           |  ^         |
       |           |  +---------+  (re-plan: a device died or drifted)
       +-----------+------------+--> failed | cancelled

completed, failed and cancelled are final. A call naming the current state of
a job that is not final only updates its fields (progress) and logs nothing.

Tested in tests/unit/coordinator/service/test_store.py (versions, migrations, concurrent
writers, transitions) and tests/unit/coordinator/service/test_final_jobs.py.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import EllipsisType
from typing import Any, cast

from pydantic import BaseModel
from sqlalchemy import (
    Connection,
    create_engine,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from coordinator.service.store.schema import (
    TERMINAL,
    TRANSITIONS,
    DeviceRecord,
    DeviceState,
    JobEventRecord,
    JobRecord,
    JobState,
    _Base,
    _Device,
    _Job,
    _JobAnatomy,
    _JobEvent,
    _JobStep,
    _SchemaVersion,
)
from edge.wire.messages import StepReport

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "TERMINAL",
    "TRANSITIONS",
    "DeviceRecord",
    "DeviceState",
    "JobEventRecord",
    "JobRecord",
    "JobState",
    "Migration",
    "NotFoundError",
    "Store",
    "StoreError",
]

SCHEMA_VERSION = 1
Migration = Callable[[Connection], None]
MIGRATIONS: dict[int, Migration] = {}
"""``MIGRATIONS[v]`` upgrades a version ``v`` database to ``v + 1``; none yet."""

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,16}$")  # as edge.wire.messages.JobId: safe in a path


class StoreError(RuntimeError):
    """The database cannot be used: newer schema, failed migration, foreign file."""


class NotFoundError(LookupError):
    """No job (or device) with that id."""


# ---- the store ----------------------------------------------------------------------------


class Store:
    """The coordinator's database under ``data_dir``; safe to share between threads."""

    def __init__(self, data_dir: Path, *, migrations: Mapping[int, Migration] = MIGRATIONS) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.data_dir / "edgetrain.db"
        self._engine = create_engine(
            f"sqlite:///{self.path}", connect_args={"check_same_thread": False}
        )
        event.listen(self._engine, "connect", _on_connect)
        event.listen(self._engine, "begin", _on_begin)
        self._sessions = sessionmaker(self._engine)
        # BEGIN IMMEDIATE: a write takes SQLite's write lock first, so another
        # process (or Store) on the same file waits out busy_timeout instead of failing.
        self._writer = self._engine.execution_options(begin="BEGIN IMMEDIATE")
        self._write_sessions = sessionmaker(self._writer)
        self._lock = threading.Lock()  # [Note: store threads]
        try:
            self._prepare(migrations)
        except BaseException:
            self._engine.dispose()
            raise

    def _prepare(self, migrations: Mapping[int, Migration]) -> None:
        with self._lock, self._writer.begin() as conn:
            tables = set(inspect(conn).get_table_names())
            if "schema_version" not in tables:
                if tables:
                    raise StoreError(f"{self.path}: not an edgetrain database (no schema_version)")
                _Base.metadata.create_all(conn)
                conn.execute(insert(_SchemaVersion).values(version=SCHEMA_VERSION))
                return
            found = conn.execute(select(_SchemaVersion.version)).scalar_one()
            if found > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: database schema version {found} is newer than this "
                    f"edgetrain supports ({SCHEMA_VERSION}); upgrade edgetrain or use "
                    "another data directory"
                )
            for version in range(found, SCHEMA_VERSION):
                if version not in migrations:
                    raise StoreError(f"{self.path}: no migration from schema version {version}")
                migrations[version](conn)
                conn.execute(update(_SchemaVersion).values(version=version + 1))
            # Tables added since without data to move need no migration of their own.
            _Base.metadata.create_all(conn)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._lock, self._write_sessions.begin() as session:
            yield session

    def model_path(self, job_id: str) -> Path:
        """Where the trained weights of ``job_id`` live; the folder may not exist yet."""
        _check_job_id(job_id)
        return self.data_dir / "jobs" / job_id / "model.safetensors"

    # ---- devices ----

    def upsert_device(
        self,
        device_id: str,
        *,
        state: DeviceState | None = None,
        last_seen: float | None = None,
        profile: BaseModel | Mapping[str, Any] | None = None,
        job: str | EllipsisType | None = ...,
        stage: int | EllipsisType | None = ...,
    ) -> DeviceRecord:
        """Record what was heard from a device; a field left ``None`` is kept.

        ``job`` and ``stage`` are kept when left ``...`` and cleared by ``None``.
        ``last_seen`` never goes back, so a late retained message cannot age a
        device. A new device starts ``offline`` unless ``state`` says otherwise.
        """
        now = time.time()
        with self._write() as s:
            row = s.get(_Device, device_id)
            if row is None:
                seen = now if last_seen is None else last_seen
                row = _Device(id=device_id, state="offline", last_seen=seen, first_seen=seen)
                s.add(row)
            if state is not None:
                row.state = state
            if last_seen is not None:
                row.last_seen = max(row.last_seen, last_seen)
            if profile is not None:
                row.profile = _as_json(profile)
            if job is not ...:
                row.job = job
            if stage is not ...:
                row.stage = stage
            s.flush()
            return DeviceRecord.model_validate(row)

    def get_device(self, device_id: str) -> DeviceRecord | None:
        with self._sessions() as s:
            row = s.get(_Device, device_id)
            return None if row is None else DeviceRecord.model_validate(row)

    def list_devices(self) -> list[DeviceRecord]:
        with self._sessions() as s:
            rows = s.scalars(select(_Device).order_by(_Device.id))
            return [DeviceRecord.model_validate(r) for r in rows]

    # ---- jobs ----

    def create_job(
        self,
        job_id: str,
        spec: BaseModel | Mapping[str, Any],
        devices_allowed: Sequence[str] | None = None,
        *,
        created: float | None = None,
    ) -> JobRecord:
        """A new ``pending`` job; ``ValueError`` if the id is taken or unusable."""
        _check_job_id(job_id)
        row = _Job(
            id=job_id,
            spec=_as_json(spec),
            state="pending",
            created=time.time() if created is None else created,
            steps_done=0,
            devices_allowed=None if devices_allowed is None else list(devices_allowed),
        )
        try:
            with self._write() as s:
                s.add(row)
                s.flush()
                return JobRecord.model_validate(row)
        except IntegrityError:
            raise ValueError(f"job {job_id} already exists") from None

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._sessions() as s:
            row = s.get(_Job, job_id)
            return None if row is None else JobRecord.model_validate(row)

    def list_jobs(
        self, limit: int = 100, offset: int = 0, state: JobState | None = None
    ) -> list[JobRecord]:
        """Newest first."""
        query = select(_Job).order_by(_Job.created.desc(), _Job.id.desc())
        if state is not None:
            query = query.where(_Job.state == state)
        with self._sessions() as s:
            rows = s.scalars(query.limit(limit).offset(offset))
            return [JobRecord.model_validate(r) for r in rows]

    def count_jobs(self, state: JobState | None = None) -> int:
        query = select(func.count()).select_from(_Job)
        if state is not None:
            query = query.where(_Job.state == state)
        with self._sessions() as s:
            return s.execute(query).scalar_one()

    def set_job_state(
        self,
        job_id: str,
        state: JobState,
        reason: str | None = None,
        *,
        started: float | None = None,
        finished: float | None = None,
        steps_done: int | None = None,
        samples_per_s: float | None = None,
    ) -> JobRecord:
        """Move a job to ``state`` (see the module's state machine) and set the fields given.

        ``ValueError`` for a transition the machine does not allow, e.g.
        ``completed -> running``. Entering ``running`` stamps ``started`` and a
        final state stamps ``finished`` unless given; every change of state is
        also a ``state`` event in :meth:`job_events`.
        """
        fields = {
            "started": started,
            "finished": finished,
            "steps_done": steps_done,
            "samples_per_s": samples_per_s,
        }
        with self._write() as s:
            row = _get_job(s, job_id)
            _transition(s, row, state, reason, time.time())
            for name, value in fields.items():
                if value is not None:
                    setattr(row, name, value)
            s.flush()
            return JobRecord.model_validate(row)

    def set_job_plan(self, job_id: str, plan: Mapping[str, Any]) -> JobRecord:
        """Store the job's plan: ``PlanScore.to_json()`` and whatever else goes with it."""
        with self._write() as s:
            row = _get_job(s, job_id)
            row.plan = dict(plan)
            s.flush()
            return JobRecord.model_validate(row)

    def mark_interrupted(
        self, reason: str = "coordinator restarted", keep: Collection[str] = ()
    ) -> list[str]:
        """Fail every job left ``planning`` or ``running``, but those in ``keep`` (jobs
        that will be resumed); their ids, oldest first.

        Called once on start, before any job worker runs: those jobs had no one
        driving them. ``pending`` jobs are left to be picked up again.
        """
        query = (
            select(_Job)
            .where(_Job.state.in_(("planning", "running")))
            .order_by(_Job.created, _Job.id)
        )
        now = time.time()
        with self._write() as s:
            rows = [row for row in s.scalars(query) if row.id not in keep]
            for row in rows:
                _transition(s, row, "failed", reason, now)
            return [row.id for row in rows]

    # ---- per-step metrics and events ----

    def add_step(self, job_id: str, report: StepReport) -> None:
        """Store one stage's report of one step; a repeated report replaces the first."""
        if report.job != job_id:
            raise ValueError(f"a report of job {report.job} given for job {job_id}")
        values = {
            "job_id": job_id,
            "step": report.step,
            "stage": report.stage,
            "device": report.device,
            # A diverged loss (NaN, or infinite) is stored as none: JSON has no such number.
            "loss": report.loss if report.loss is None or math.isfinite(report.loss) else None,
            "compute_s": report.compute_s,
            "wait_s": report.wait_s,
            "send_s": report.send_s,
            "step_s": report.step_s,
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "frames_dropped": report.frames_dropped,
            "ts": report.ts,
        }
        keys = ("job_id", "step", "stage")
        stmt = insert(_JobStep).values(values)
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys),
            set_={k: stmt.excluded[k] for k in values if k not in keys},
        )
        try:
            with self._write() as s:
                s.execute(stmt)
        except IntegrityError:
            raise NotFoundError(f"no job {job_id}") from None

    def job_steps(self, job_id: str, *, from_step: int = 0) -> list[StepReport]:
        """The stored reports of ``job_id`` from step ``from_step`` on (it included), by step
        then stage."""
        query = (
            select(_JobStep)
            .where(_JobStep.job_id == job_id, _JobStep.step >= from_step)
            .order_by(_JobStep.step, _JobStep.stage)
        )
        with self._sessions() as s:
            return [_step_report(r) for r in s.scalars(query)]

    def set_job_anatomy(self, job_id: str, anatomy: Mapping[str, Any]) -> None:
        """Store the job's measured anatomy (its JSON), in place of the one before."""
        with self._write() as s:
            _get_job(s, job_id)
            row = s.get(_JobAnatomy, job_id)
            if row is None:
                s.add(_JobAnatomy(job_id=job_id, detail=dict(anatomy)))
            else:
                row.detail = dict(anatomy)

    def job_anatomy(self, job_id: str) -> dict[str, Any] | None:
        """The job's measured anatomy as stored, or ``None`` before a step was measured."""
        with self._sessions() as s:
            row = s.get(_JobAnatomy, job_id)
            return None if row is None else dict(row.detail)

    def add_job_event(
        self, job_id: str, kind: str, detail: Mapping[str, Any] | None = None
    ) -> JobEventRecord:
        """Log something that happened to a job: a stage failure, a re-plan, a cancel request."""
        with self._write() as s:
            _get_job(s, job_id)
            row = _JobEvent(
                job_id=job_id,
                ts=time.time(),
                kind=kind,
                detail=None if detail is None else dict(detail),
            )
            s.add(row)
            s.flush()
            return JobEventRecord.model_validate(row)

    def job_events(self, job_id: str) -> list[JobEventRecord]:
        """The job's events in the order they were logged."""
        query = select(_JobEvent).where(_JobEvent.job_id == job_id).order_by(_JobEvent.id)
        with self._sessions() as s:
            return [JobEventRecord.model_validate(r) for r in s.scalars(query)]


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    # pysqlite's own BEGIN handling skips DDL, so a migration would not be atomic:
    # it is switched off here and _on_begin emits BEGIN (SQLAlchemy's documented recipe).
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        "foreign_keys=ON",
        "busy_timeout=10000",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _on_begin(conn: Connection) -> None:
    conn.exec_driver_sql(conn.get_execution_options().get("begin", "BEGIN"))


def _transition(
    session: Session, row: _Job, state: JobState, reason: str | None, now: float
) -> None:
    """Apply one step of the state machine to ``row``, or ``ValueError``."""
    old = cast(JobState, row.state)
    if old in TERMINAL or (state != old and state not in TRANSITIONS[old]):
        raise ValueError(f"job {row.id}: cannot go from {old} to {state}")
    if state == old:
        if reason is not None:
            row.reason = reason
        return
    row.state = state
    row.reason = reason
    if state == "running" and row.started is None:
        row.started = now
    if state in TERMINAL:
        row.finished = now
    detail = {"from": old, "to": state, "reason": reason}
    session.add(_JobEvent(job_id=row.id, ts=now, kind="state", detail=detail))


def _get_job(session: Session, job_id: str) -> _Job:
    row = session.get(_Job, job_id)
    if row is None:
        raise NotFoundError(f"no job {job_id}")
    return row


def _check_job_id(job_id: str) -> None:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r}: 1 to 16 of A-Z a-z 0-9 _ -")


def _step_report(row: _JobStep) -> StepReport:
    fields = {c.key: getattr(row, c.key) for c in _JobStep.__table__.columns}
    return StepReport(job=fields.pop("job_id"), **fields)


def _as_json(value: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return dict(value)
