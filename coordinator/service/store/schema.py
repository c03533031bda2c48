"""The store's schema: SQLAlchemy tables, the job state machine and the records it returns.

:mod:`coordinator.service.store.sqlite` owns reading and writing; this module only says what
is stored (``SCHEMA_VERSION`` and the migrations live there too, with the code
that applies them).

Tested in tests/unit/coordinator/service/test_store.py (the transitions and records) and
tests/unit/coordinator/service/test_final_jobs.py (every final state).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict
from sqlalchemy import JSON, ForeignKey
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "DeviceRecord",
    "DeviceState",
    "JobEventRecord",
    "JobRecord",
    "JobState",
]

DeviceState = Literal["online", "offline", "busy"]
JobState = Literal["pending", "planning", "running", "completed", "failed", "cancelled"]
TERMINAL: frozenset[JobState] = frozenset({"completed", "failed", "cancelled"})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    "pending": frozenset({"planning", "failed", "cancelled"}),
    "planning": frozenset({"running", "failed", "cancelled"}),
    "running": frozenset({"planning", "completed", "failed", "cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}
# ---- schema -------------------------------------------------------------------------------


class _Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[str]: JSON}


class _SchemaVersion(_Base):
    __tablename__ = "schema_version"
    version: Mapped[int] = mapped_column(primary_key=True)


class _Device(_Base):
    __tablename__ = "devices"
    id: Mapped[str] = mapped_column(primary_key=True)
    state: Mapped[str]
    last_seen: Mapped[float]
    first_seen: Mapped[float]
    profile: Mapped[dict[str, Any] | None]
    job: Mapped[str | None]
    stage: Mapped[int | None]


class _Job(_Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(primary_key=True)
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(index=True)
    reason: Mapped[str | None]
    plan: Mapped[dict[str, Any] | None]
    created: Mapped[float] = mapped_column(index=True)
    started: Mapped[float | None]
    finished: Mapped[float | None]
    steps_done: Mapped[int] = mapped_column(default=0)
    samples_per_s: Mapped[float | None]
    devices_allowed: Mapped[list[str] | None]


class _JobStep(_Base):
    __tablename__ = "job_steps"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    stage: Mapped[int] = mapped_column(primary_key=True)
    device: Mapped[str]
    loss: Mapped[float | None]  # SQLite stores NaN as NULL: a diverged loss reads back as None
    compute_s: Mapped[float]
    wait_s: Mapped[float]
    send_s: Mapped[float]
    step_s: Mapped[float]
    bytes_sent: Mapped[int]
    bytes_received: Mapped[int]
    frames_dropped: Mapped[int] = mapped_column(default=0)
    ts: Mapped[float]


class _JobAnatomy(_Base):
    """A running job's measured anatomy (:class:`~coordinator.planner.anatomy.AnatomyMeter`):
    one row a job, replaced as steps are measured."""

    __tablename__ = "job_anatomy"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    detail: Mapped[dict[str, Any]]


class _JobEvent(_Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    ts: Mapped[float]
    kind: Mapped[str]
    detail: Mapped[dict[str, Any] | None]


# ---- records ------------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)


class DeviceRecord(_Record):
    id: str
    state: DeviceState
    last_seen: float
    first_seen: float
    profile: dict[str, Any] | None
    """The device's last published profile (a :class:`~edge.problem.DeviceSpec` as JSON)."""
    job: str | None
    stage: int | None


class JobRecord(_Record):
    id: str
    spec: dict[str, Any]
    state: JobState
    reason: str | None
    plan: dict[str, Any] | None
    created: float
    started: float | None
    finished: float | None
    steps_done: int
    samples_per_s: float | None
    devices_allowed: list[str] | None


class JobEventRecord(_Record):
    id: int
    job_id: str
    ts: float
    kind: str
    detail: dict[str, Any] | None
