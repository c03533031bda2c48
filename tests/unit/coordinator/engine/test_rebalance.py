"""When to migrate, how often to replicate, and fault specs (rebalance.py, faults.py)."""

from __future__ import annotations

import pytest

from coordinator.engine.faults import Fault, FaultInjector, check_fault_stages, parse_fault
from coordinator.engine.rebalance import Rebalancer, replication_interval
from coordinator.planner.build import build_problem
from coordinator.planner.score import Plan, score_plan
from coordinator.planner.solve import plan_problem
from edge.errors import UserError
from edge.problem import DeviceSpec, PlanningProblem
from edge.wire.messages import StepReport

DEVICES = [
    DeviceSpec(id=f"d{i}", gflops=50.0, memory_bytes=8 << 30, bandwidth_mbps=1000.0, latency_ms=0.5)
    for i in range(3)
]
EVEN = Plan.of(("d0", 0, 2), ("d1", 2, 4), ("d2", 4, 6))


def problem_for(alive: list[str], model: str = "gpt-mini") -> PlanningProblem:
    devices = [d for d in DEVICES if d.id in alive]
    return build_problem(model, devices, batch_size=16, microbatches=4, pin_first=alive[0])


def measured(slow: dict[str, float]) -> dict[str, float]:
    """Compute seconds per step as the plan predicts, times a slowness per device."""
    score = score_plan(problem_for(["d0", "d1", "d2"]), EVEN)
    return {
        st.device: score.compute_s[s] * 4 * slow.get(st.device, 1.0)
        for s, st in enumerate(EVEN.stages)
    }


def test_a_device_four_times_slower_is_moved_off() -> None:
    rebalance = Rebalancer(problem_for, replicate_every=2, restart_s=0.0)
    plan = rebalance(EVEN, ["d0", "d1", "d2"], measured({"d1": 4.0}), steps_left=100)
    assert plan is not None
    before = sum(st.end - st.start for st in EVEN.stages if st.device == "d1")
    after = sum(st.end - st.start for st in plan.stages if st.device == "d1")
    assert after < before
    assert rebalance.decisions[-1]["gain"] > 0.10


def test_no_move_when_the_measurements_agree_with_the_plan() -> None:
    """Measured times exactly as the planner's own best plan predicts: nothing to gain, so
    no move, however cheap moving is and however many steps are left."""
    best = plan_problem(problem_for(["d0", "d1", "d2"])).plan
    assert best is not None and len(best.stages) >= 2  # a pipeline, so stages can be misread
    predicted = score_plan(problem_for(["d0", "d1", "d2"]), best)
    compute = {st.device: predicted.compute_s[s] * 4 for s, st in enumerate(best.stages)}
    rebalance = Rebalancer(problem_for, replicate_every=2, restart_s=0.0)
    assert rebalance(best, ["d0", "d1", "d2"], compute, steps_left=100_000) is None
    decision = rebalance.decisions[-1]
    assert decision["gain"] == pytest.approx(0.0, abs=1e-9)
    assert decision["new_s"] == pytest.approx(decision["now_s"], rel=1e-9)
    assert rebalance.factors(problem_for(["d0", "d1", "d2"]), best, compute) == pytest.approx(
        {"d0": 1.0, "d1": 1.0, "d2": 1.0}
    )


def test_no_move_when_too_few_steps_are_left_to_pay_for_it() -> None:
    rebalance = Rebalancer(problem_for, replicate_every=2, restart_s=5.0)
    assert rebalance(EVEN, ["d0", "d1", "d2"], measured({"d1": 4.0}), steps_left=1) is None
    assert rebalance.decisions[-1]["saved_s"] < rebalance.decisions[-1]["cost_s"]


def test_replication_interval_follows_the_cost() -> None:
    problem = problem_for(["d0", "d1", "d2"])
    score = score_plan(problem, EVEN)
    worst = max(
        2
        * sum(unit.param_bytes for unit in problem.layers[st.start : st.end])
        * (1 / 1e9 + 8 / 1000e6)
        for st in EVEN.stages
    )
    r = replication_interval(problem, EVEN)
    assert worst <= r * 0.05 * score.step_time_s  # within the budget...
    assert r == 1 or worst > (r - 1) * 0.05 * score.step_time_s  # ...and no more often
    slow_link = problem.model_copy(
        update={"devices": [d.model_copy(update={"bandwidth_mbps": 1.0}) for d in problem.devices]}
    )
    fast, slow = replication_interval(problem, EVEN), replication_interval(slow_link, EVEN)
    assert slow > fast >= 1
    assert replication_interval(problem, EVEN, budget=0.5) <= fast


def test_fault_specs() -> None:
    assert parse_fault("kill:2@7") == Fault("kill", 2, 7)
    assert parse_fault("slow:0@4:2.5") == Fault("slow", 0, 4, 2.5)
    assert str(parse_fault("slow:0@4:4")) == "slow:0@4:4"
    assert parse_fault("kill:1.2@3") == Fault("kill", 1, 3, member=2)
    assert (
        str(parse_fault("kill:1.2@3")) == "kill:1.2@3"
        and str(parse_fault("kill:1.0@3")) == "kill:1@3"
    )
    for bad in ["slow:0@4", "kill:0@4:2", "slow:0@4:0.5", "stop:1@2", "kill:1.@3", "kill:.1@3"]:
        with pytest.raises(UserError):
            parse_fault(bad)


def test_bad_fault_specs_are_refused() -> None:
    for text in ["kill:1", "kill:x@2", "melt:1@2", ""]:
        with pytest.raises(UserError, match=r"kill:STAGE\[\.MEMBER\]@STEP, slow"):
            parse_fault(text)


def test_faults_of_one_step_fire_together_on_the_current_plan() -> None:
    fired: list[tuple[str, str]] = []
    injector = FaultInjector(
        [parse_fault("kill:1@5"), parse_fault("kill:2@5")], lambda f, d: fired.append((str(f), d))
    )
    injector.use_plan(["a", "b", "c"])
    report = StepReport(job="j1", stage=0, device="a", step=4)
    injector.on_step(report)
    assert fired == []
    injector.on_step(report.model_copy(update={"step": 5}))
    assert sorted(fired) == [("kill:1@5", "b"), ("kill:2@5", "c")]
    injector.on_step(report.model_copy(update={"step": 6}))
    assert len(fired) == 2 and injector.pending == []


def test_a_fault_names_a_member_of_a_group() -> None:
    fired: list[tuple[str, str]] = []
    faults = [parse_fault("kill:0.1@2"), parse_fault("kill:1.1@2")]
    injector = FaultInjector(faults, lambda f, d: fired.append((str(f), d)))
    injector.use_plan([("a", "b"), "c"])
    injector.on_step(StepReport(job="j1", stage=0, device="a", step=2))
    assert fired == [("kill:0.1@2", "b")]  # stage 1 has no member 1 (yet): it waits
    assert injector.pending == [faults[1]]
    check_fault_stages(faults, [2, 2])
    refusal = r"^--fault kill:1.1@2: stage 1 runs on 1 device, no member 1$"
    with pytest.raises(UserError, match=refusal):
        check_fault_stages(faults, [2, 1])


def test_replication_interval_can_be_capped() -> None:
    problem = problem_for(["d0", "d1", "d2"])
    slow_link = problem.model_copy(
        update={"devices": [d.model_copy(update={"bandwidth_mbps": 1.0}) for d in problem.devices]}
    )
    assert replication_interval(slow_link, EVEN) > 3
    assert replication_interval(slow_link, EVEN, most=3) == 3


def test_moving_is_priced_with_the_steps_it_would_redo() -> None:
    """The steps a move runs again are those since the newest complete replica, as the
    caller counts them; without a count, the most there can be (``replicate_every``)."""
    rebalance = Rebalancer(problem_for, replicate_every=4, restart_s=0.5)
    slow = measured({"d1": 4.0})
    rebalance(EVEN, ["d0", "d1", "d2"], slow, 100, 1)
    rebalance(EVEN, ["d0", "d1", "d2"], slow, 100)
    one, most = rebalance.decisions
    assert most["cost_s"] - one["cost_s"] == pytest.approx(3 * one["now_s"], rel=1e-9)
