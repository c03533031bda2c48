"""Whether a run has fault tolerance, and how often it replicates: the engine's one answer
(:meth:`JobEngine.replication_asked`, :meth:`JobEngine.fault_tolerant`), from the spec and
what the run is told (:class:`Tolerance`)."""

from __future__ import annotations

from coordinator.engine.engine import JobEngine
from coordinator.engine.faults import parse_fault
from coordinator.engine.options import Tolerance
from coordinator.engine.spec import JobSpec

SPEC = JobSpec(model="mlp", steps=20, batch_size=8, microbatches=2)
KILL = (parse_fault("kill:1@3"),)


def test_a_run_replicates_as_it_is_told_else_as_its_spec_says() -> None:
    asked = JobEngine.replication_asked
    assert asked(SPEC) == 0 and not JobEngine.fault_tolerant(SPEC)
    every4 = SPEC.model_copy(update={"replicate_every": 4})
    assert asked(every4) == 4 and JobEngine.fault_tolerant(every4)
    assert asked(every4, Tolerance(replicate_every=0)) == 0  # told: off
    assert asked(SPEC, Tolerance(replicate_every=-1)) == -1  # told: from the plan's costs


def test_faults_ask_for_fault_tolerance_unless_the_run_is_told_otherwise() -> None:
    asked = JobEngine.replication_asked
    assert asked(SPEC, Tolerance(faults=KILL)) == -1
    assert asked(SPEC.model_copy(update={"faults": ("kill:1@3",)})) == -1
    assert asked(SPEC.model_copy(update={"faults": ("kill:1@3",)}), Tolerance(faults=())) == 0
    assert asked(SPEC, Tolerance(replicate_every=0, faults=KILL)) == 0
    assert asked(SPEC.model_copy(update={"replicate_every": 2}), Tolerance(faults=KILL)) == 2
