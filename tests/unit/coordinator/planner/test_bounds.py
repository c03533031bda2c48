"""The lower bound on a plan's step with groups (:mod:`coordinator.planner.bounds`), and the
certificate every plan carries.

- on small version 2 problems, brute force over every plan (groups, any order, any
  cuts, memory ignored) finds none below the bound, and on the seeds where a group
  is the optimum the version 1 bound alone would have been above it;
- the bound is reached where nothing but compute costs: equal devices, free links, no
  parameters, where the group of all is optimal (gap 0);
- ``edgetrain plan --json`` gives every plan of a model its ``lower_bound_step_s`` and
  ``gap`` (a problem file's with ``--explain``: its plain object is the spec's,
  tests/integration/test_plan_cli.py), and the text report the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.planning import all_group_plans, make_problem, random_problem
from typer.testing import CliRunner

from coordinator.planner.bounds import _pipeline_bound, certificate, lower_bound
from coordinator.planner.score import Plan, Stage, score_plan
from edge.problem import PlanningProblem
from edgetrain.cli import app

REL = 1e-12


def _best(problem: PlanningProblem) -> tuple[float, Plan]:
    """The least step over every plan of the problem, feasible or not (the bound ignores
    memory), and a plan that takes it."""
    scored = [(score_plan(problem, plan).step_time_s, plan) for plan in all_group_plans(problem)]
    return min(scored, key=lambda item: item[0])


@pytest.mark.parametrize("seed", range(10))
def test_no_plan_beats_the_bound_on_small_problems(seed: int) -> None:
    problem = random_problem(seed, 4, 4, pinned=seed % 3 == 0).as_version(2)
    best, _ = _best(problem)
    assert lower_bound(problem) <= best * (1 + REL)
    assert lower_bound(problem) > 0


def test_a_group_beats_the_pipelines_bound_and_not_the_bound() -> None:
    """Four equal devices on fast links, units with few parameters: the group of all four is
    the optimum, below what any pipeline can reach, and still at or above the bound."""
    unit = {"fwd_flops": 1e9, "param_bytes": 1e3, "out_bytes": 1e5}
    devices = [
        {
            "id": f"d{i}",
            "gflops": 10.0,
            "memory_bytes": 1e12,
            "bandwidth_mbps": 1e4,
            "latency_ms": 0.1,
        }
        for i in range(4)
    ]
    problem = make_problem([unit] * 3, devices, batch_size=32, microbatches=4).as_version(2)
    best, plan = _best(problem)
    assert [len(st.devices) for st in plan.stages] == [4]
    assert best < _pipeline_bound(problem)  # the version 1 bound does not hold with groups
    assert lower_bound(problem) <= best * (1 + REL)
    assert certificate(problem, best)["gap"] < 0.01  # and it is close: one step's latency


def test_the_bound_is_reached_where_only_compute_costs() -> None:
    unit = {"fwd_flops": 1e9, "param_bytes": 0.0, "out_bytes": 1e5}
    devices = [
        {
            "id": f"d{i}",
            "gflops": 10.0,
            "memory_bytes": 1e12,
            "bandwidth_mbps": 1e4,
            "latency_ms": 0.0,
        }
        for i in range(3)
    ]
    problem = make_problem([unit] * 2, devices, batch_size=30, microbatches=2).as_version(2)
    everyone = Plan((Stage("d0", 0, 2, ("d1", "d2")),))
    step = score_plan(problem, everyone).step_time_s
    assert step == pytest.approx(lower_bound(problem), rel=REL)
    assert certificate(problem, step) == {"lower_bound_step_s": pytest.approx(step), "gap": 0.0}


def test_without_groups_the_bound_is_version_1s() -> None:
    problem = random_problem(4, 4, 5)
    assert lower_bound(problem) == _pipeline_bound(problem)
    no_groups = problem.as_version(2).model_copy(update={"groups": False})
    assert lower_bound(no_groups) == _pipeline_bound(problem)


@pytest.mark.parametrize("groups", ["--groups", "--no-groups"])
def test_plan_json_certifies_every_plan(groups: str) -> None:
    args = ["plan", "--model", "cnn-digits", "--devices", "rpi4-4gb:2,laptop", groups]
    done = CliRunner().invoke(app, [*args, "--json"])
    assert done.exit_code == 0, done.output
    got = json.loads(done.output)
    assert 0 < got["lower_bound_step_s"] <= got["step_time_s"]
    assert got["gap"] == pytest.approx(got["step_time_s"] / got["lower_bound_step_s"] - 1)
    shown = CliRunner().invoke(app, args)
    said = " ".join(shown.output.split())
    assert f"lower bound {got['lower_bound_step_s'] * 1e3:.1f} ms" in said, said


def test_a_problem_files_object_gains_the_certificate_only_when_explained(
    tmp_path: Path,
) -> None:
    problem = random_problem(2, 3, 4).as_version(2)
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(problem.to_json()))
    plain = CliRunner().invoke(app, ["plan", "--problem", str(path), "--json"])
    assert plain.exit_code == 0, plain.output
    assert "gap" not in json.loads(plain.output)
    explained = CliRunner().invoke(app, ["plan", "--problem", str(path), "--json", "--explain"])
    got = json.loads(explained.output)
    assert got["lower_bound_step_s"] == pytest.approx(lower_bound(problem), rel=REL)
    assert got["gap"] == pytest.approx(got["step_time_s"] / got["lower_bound_step_s"] - 1)
