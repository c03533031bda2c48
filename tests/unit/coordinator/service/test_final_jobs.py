"""Every way a job ends leaves it with every field a final job must have, for good.

Two tiers, both on a real SQLite store in a temporary folder and without a socket:

- the store's own API: every move into a final state that
  :data:`~coordinator.service.store.schema.TRANSITIONS` allows, from every state
  on the way, and the failing of jobs in flight when a coordinator restarts
  (:meth:`~coordinator.service.store.sqlite.Store.mark_interrupted`);
- the job manager's paths to an end that need no agent: a plan that cannot be
  made, a fault on a stage the plan lacks, a stored spec that no longer
  validates, a restart, a user's cancel of a queued job. Its control connection
  is a stand-in (support.control) that nothing here publishes on; the device
  registry is real, fed through it.

What "every field" means is :mod:`support.final_jobs`; a job that has ended
must also refuse every further change of state and keep its fields.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.control import HandDelivered
from support.final_jobs import final_job_faults, unfinished_job_faults
from support.waiting import until

from coordinator.engine.spec import JobSpec
from coordinator.service.events import EventBus
from coordinator.service.manager import JobManager
from coordinator.service.registry import DeviceRegistry
from coordinator.service.store.sqlite import TERMINAL, TRANSITIONS, JobState, Store
from edge.problem import DeviceSpec
from edge.wire.messages import DeviceStatus
from edge.wire.topics import device_profile, device_status

SPEC = JobSpec(model="mlp", steps=2, batch_size=8, microbatches=2)
STATES: tuple[JobState, ...] = typing.get_args(JobState)
ON_THE_WAY: tuple[JobState, ...] = ("pending", "planning", "running")
"""The states a job passes in order, each entered by the move from the one before."""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path) as s:
        yield s


def _faults(store: Store, job: str) -> list[str]:
    record = store.get_job(job)
    assert record is not None
    events = [e.model_dump() for e in store.job_events(job)]
    return final_job_faults(record.model_dump(), events)


def _assert_ended_for_good(store: Store, job: str) -> None:
    """No state, not even the one it is in, changes the job or its events any more."""
    before, events = store.get_job(job), store.job_events(job)
    for state in STATES:
        with pytest.raises(ValueError, match="cannot go from"):
            store.set_job_state(job, state, "again", steps_done=9, samples_per_s=1.0)
    assert job not in store.mark_interrupted()
    assert (store.get_job(job), store.job_events(job)) == (before, events)


# ---- the store ----------------------------------------------------------------------------

_STORE_ENDS = [
    pytest.param(old, new, "set", id=f"{old}-{new}")
    for old in ON_THE_WAY
    for new in sorted(TRANSITIONS[old] & TERMINAL)
] + [pytest.param(old, "failed", "restart", id=f"{old}-restart") for old in ("planning", "running")]


def test_every_end_the_machine_allows_is_covered() -> None:
    ends = {(p.values[0], p.values[1]) for p in _STORE_ENDS}
    allowed = {(old, new) for old, news in TRANSITIONS.items() for new in news if new in TERMINAL}
    assert ends == allowed and {new for _, new in ends} == TERMINAL


@pytest.mark.parametrize(("old", "new", "how"), _STORE_ENDS)
def test_a_job_the_store_ends_has_every_final_field(
    store: Store, old: JobState, new: JobState, how: str
) -> None:
    """Through pending, planning and running as far as ``old``, each entered with a
    reason (as a resumed job is) and unfinished at every step (progress too), then
    ended: ``set`` by :meth:`Store.set_job_state` with a reason where it failed or was
    cancelled and results where it completed, neither ``finished`` given; ``restart``
    by :meth:`Store.mark_interrupted`."""
    store.create_job("j1", SPEC)
    for state in ON_THE_WAY[: ON_THE_WAY.index(old) + 1]:
        if state != "pending":
            store.set_job_state("j1", state, f"on to {state}")
        store.set_job_state("j1", state, steps_done=1)  # progress: no change of state
        record = store.get_job("j1")
        assert record is not None and unfinished_job_faults(record.model_dump()) == []
    reason = None if new == "completed" else f"why {new}"
    if how == "restart":
        assert store.mark_interrupted() == ["j1"]
        reason = "coordinator restarted"
    else:
        samples = 12.5 if new == "completed" else None
        store.set_job_state("j1", new, reason, samples_per_s=samples)
    record = store.get_job("j1")
    assert record is not None and (record.state, record.reason) == (new, reason)
    assert _faults(store, "j1") == []
    _assert_ended_for_good(store, "j1")


# ---- the job manager ----------------------------------------------------------------------


class _Coordinator:
    """A job manager over ``store`` as a coordinator holds one; :meth:`start` starts it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.bus = EventBus()
        self.control = HandDelivered()
        self.registry = DeviceRegistry(store, self.bus, self.control)  # type: ignore[arg-type]
        self.registry.start()
        self.manager = JobManager(store, self.bus, self.registry, self.control)  # type: ignore[arg-type]
        self.started = False

    def start(self) -> None:
        self.manager.start()
        self.started = True

    def announce(self, device: str) -> None:
        """``device`` online with a profile, as its agent would say over the broker."""
        spec = DeviceSpec(id=device, gflops=5, memory_bytes=4e9, bandwidth_mbps=100, latency_ms=2)
        self.control.publish(device_profile(device), spec.model_dump_json().encode())
        status = DeviceStatus(device=device, state="online")
        self.control.publish(device_status(device), status.model_dump_json().encode())

    def ended(self, job: str) -> bool:
        record = self.store.get_job(job)
        return record is not None and record.state in TERMINAL

    def drain(self) -> None:
        """Wait until the worker has taken every job queued so far: one queued after them
        (on a device nobody has, so it fails at once) has ended."""
        last = self.manager.submit(SPEC, ["nobody"])
        assert until(lambda: self.ended(last), 30), self.store.get_job(last)

    def close(self) -> None:
        if self.started:
            self.manager.stop()
        self.registry.stop()
        self.bus.close()


@pytest.fixture
def coordinator(store: Store) -> Iterator[_Coordinator]:
    c = _Coordinator(store)
    try:
        yield c
    finally:
        c.close()


def _no_device(c: _Coordinator) -> str:
    c.start()
    return c.manager.submit(SPEC)


def _fault_the_plan_lacks(c: _Coordinator) -> str:
    c.announce("pi-1")
    c.start()
    update = {"stages": 1, "faults": ("slow:1@1:2",), "replicate_every": 1}
    return c.manager.submit(SPEC.model_copy(update=update))


def _stored_spec_no_longer_valid(c: _Coordinator) -> str:
    c.store.create_job("old1", {**SPEC.model_dump(mode="json"), "steps": -1})
    c.start()  # queues the pending job; its spec fails validation when the worker takes it
    return "old1"


def _restarted(c: _Coordinator) -> str:
    c.store.create_job("old1", SPEC.model_dump(mode="json"))
    for state in ("planning", "running"):  # as a coordinator that stopped left it
        c.store.set_job_state("old1", state)
    c.start()
    return "old1"


def _cancelled_queued(c: _Coordinator) -> str:
    # Queued behind a busy worker, as here behind one not started yet.
    job = c.manager.submit(SPEC)
    assert c.manager.cancel(job)
    c.start()
    return job


_MANAGER_ENDS: list[tuple[Callable[[_Coordinator], str], JobState, str]] = [
    (_no_device, "failed", "no device of the online devices may run this job"),
    (_fault_the_plan_lacks, "failed", "fault slow:1@1:2: the plan has 1 stage"),
    (_stored_spec_no_longer_valid, "failed", "ValidationError: "),
    (_restarted, "failed", "coordinator restarted"),
    (_cancelled_queued, "cancelled", "cancelled by the user"),
]


@pytest.mark.parametrize(
    ("end", "state", "reason"), _MANAGER_ENDS, ids=[e[0].__name__[1:] for e in _MANAGER_ENDS]
)
def test_a_job_the_manager_ends_has_every_final_field(
    store: Store,
    coordinator: _Coordinator,
    end: Callable[[_Coordinator], str],
    state: JobState,
    reason: str,
) -> None:
    job = end(coordinator)
    assert until(lambda: coordinator.ended(job), 30), store.get_job(job)
    record = store.get_job(job)
    assert record is not None and record.state == state
    assert record.reason is not None and record.reason.startswith(reason), record.reason
    assert _faults(store, job) == []
    coordinator.drain()
    assert coordinator.manager.cancel(job) is False
    assert store.get_job(job) == record
    _assert_ended_for_good(store, job)
