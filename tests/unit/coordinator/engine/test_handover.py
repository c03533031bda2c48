"""Which deaths a hand-over covers, and whose ``held`` answers count ([Note: a group
member dies]); the hand-over itself runs against real agents in
tests/e2e/test_group_faults.py."""

from __future__ import annotations

from coordinator.engine.handover import Handover
from coordinator.engine.replicas import ReplicaStore
from coordinator.planner.score import Plan, Stage
from edge.wire.messages import StageHeld

PLAN = Plan(
    (Stage.group(["a", "b"], 0, 1), Stage.group(["c"], 1, 2), Stage.group(["d", "e"], 2, 3))
)


def _handover(dead: list[str]) -> Handover:
    return Handover("j1", PLAN, lambda: list(dead), ReplicaStore(["u0", "u1", "u2"]))


def test_only_deaths_that_co_members_survive_are_handed_over() -> None:
    assert _handover(["b"]).wanted()
    assert _handover(["a", "e"]).wanted()  # one member of each of two groups
    assert not _handover([]).wanted()  # nothing died: a migration or a lost broker
    assert not _handover(["c"]).wanted()  # a stage of one device took its units along
    assert not _handover(["d", "e"]).wanted()  # the whole group is gone
    assert not _handover(["b", "c"]).wanted()


def test_held_answers_count_only_from_the_device_holding_that_member() -> None:
    h = _handover(["b"])
    held = StageHeld(job="j1", stage=0, member=0, device="a", finished=4)
    h.on_held(held, "a")
    h.on_held(held.model_copy(update={"stage": 2, "member": 1, "device": "a"}), "a")  # not a's
    h.on_held(held.model_copy(update={"stage": 1, "device": "x"}), "c")  # says it is another
    assert h.held == {(0, 0): 4}
    assert not h._answered()  # c, d and e have not answered; b is dead and is not awaited
    for stage, member, device in [(1, 0, "c"), (2, 0, "d"), (2, 1, "e")]:
        h.on_held(
            StageHeld(job="j1", stage=stage, member=member, device=device, finished=5), device
        )
    assert h._answered()
