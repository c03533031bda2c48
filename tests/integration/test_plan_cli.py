"""``edgetrain plan``: the spec's JSON, exit 2 on malformed problems, exit 3 when nothing fits.

Run as the real command; the refusals (exit 2 or 3, one line) run in this process
through its entry point (support.cli), one of them also as a real process. Building a
problem from a model and a fleet is tests/unit/coordinator/planner/test_build.py's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cli import edgetrain
from support.paths import ROOT

from coordinator.planner.score import Plan, Stage, score_plan
from edge.errors import UserError
from edge.problem import load_problem, parse_problem

PROBLEM: dict[str, Any] = {
    "version": 1,
    "batch_size": 32,
    "microbatches": 4,
    "optimizer_state_factor": 4,
    "pin_first": "cam-01",
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e7 * (i + 1), "param_bytes": 4e5, "out_bytes": 2e5}
        for i in range(8)
    ],
    "devices": [
        {"id": "cam-01", "gflops": 6, "memory_bytes": 2e9, "bandwidth_mbps": 50, "latency_ms": 2},
        {"id": "jet", "gflops": 60, "memory_bytes": 4e9, "bandwidth_mbps": 900, "latency_ms": 0.2},
        {"id": "pc", "gflops": 200, "memory_bytes": 8e9, "bandwidth_mbps": 900, "latency_ms": 0.2},
    ],
}


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    """``edgetrain plan ARGS`` in this process (support.cli), for the refusals."""
    return edgetrain("plan", *args)


def write(tmp_path: Path, data: Any, name: str = "problem.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_plan_json_is_exactly_the_spec_object(tmp_path: Path) -> None:
    done = run_plan("--problem", str(write(tmp_path, PROBLEM)), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"stages", "step_time_s", "bottleneck_s", "throughput_sps", "feasible"}
    assert out["feasible"] is True
    assert out["stages"][0]["device"] == "cam-01"
    plan = Plan(tuple(Stage(s["device"], *s["layers"]) for s in out["stages"]))
    score = score_plan(parse_problem(PROBLEM), plan)
    assert score.step_time_s == pytest.approx(out["step_time_s"], rel=1e-12)
    assert out["throughput_sps"] == pytest.approx(32 / out["step_time_s"])


def _mutations() -> list[tuple[str, Any, str]]:
    def m(fn: Any) -> dict[str, Any]:
        data = copy.deepcopy(PROBLEM)
        fn(data)
        return data

    return [
        ("missing", m(lambda d: d["devices"][1].pop("gflops")), "devices[1].gflops"),
        ("zero speed", m(lambda d: d["devices"][0].update(gflops=0)), "devices[0].gflops"),
        ("negative bw", m(lambda d: d["devices"][2].update(bandwidth_mbps=-5)), "bandwidth_mbps"),
        ("string", m(lambda d: d["layers"][3].update(fwd_flops="1e7")), "layers[3].fwd_flops"),
        ("bad pin", m(lambda d: d.update(pin_first="nobody")), "pin_first"),
        ("version", m(lambda d: d.update(version=3)), "version"),
        ("groups in v1", m(lambda d: d.update(groups=True)), "groups: only in version 2"),
        (
            "watts in v1",
            m(lambda d: d["devices"][0].update(watts_busy=5.0)),
            "devices.0.watts_busy",
        ),
        ("no layers", m(lambda d: d.update(layers=[])), "layers"),
        ("unknown", m(lambda d: d.update(microbatch=3)), "microbatch"),
        ("dup ids", m(lambda d: d["devices"][1].update(id="pc")), "duplicate"),
        ("nan", json.dumps(PROBLEM).replace('"gflops": 60', '"gflops": NaN'), "NaN"),
        ("inf", json.dumps(PROBLEM).replace('"gflops": 60', '"gflops": Infinity'), "Infinity"),
        ("not json", "{not json", "not valid JSON"),
    ]


@pytest.mark.parametrize(("case", "data", "names"), _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_problems_exit_2_with_one_line_naming_the_field(
    tmp_path: Path, case: str, data: Any, names: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(UserError, match=names.replace("[", r"\[").replace("]", r"\]")):
        load_problem(path)
    if case in ("missing", "nan", "bad pin"):  # and through the command, end to end
        run = run_plan if case == "missing" else plan  # one as a real process
        done = run("--problem", str(path), "--json")
        assert done.returncode == 2
        assert done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1
        assert names in done.stderr


def test_no_feasible_plan_exits_3_with_the_reason(tmp_path: Path) -> None:
    data = copy.deepcopy(PROBLEM)
    for d in data["devices"]:
        d["memory_bytes"] = 1e5  # less than one unit's parameters
    done = plan("--problem", str(write(tmp_path, data)), "--json")
    assert done.returncode == 3
    out = json.loads(done.stdout)
    assert out["feasible"] is False
    assert "memory" in out["reason"]


def test_model_and_fleet_build_the_problem_and_report_baselines(tmp_path: Path) -> None:
    emitted = tmp_path / "p.json"
    trace = tmp_path / "trace.json"
    done = run_plan(
        "--model",
        "cnn-digits",
        "--devices",
        "rpi4-4gb:2,jetson-nano",
        "--batch-size",
        "16",
        "--microbatches",
        "4",
        "--emit-problem",
        str(emitted),
        "--timeline",
        str(trace),
    )
    assert done.returncode == 0, done.stderr
    for word in ("stage", "bottleneck", "samples/s", "pipedream", "ftpipehd", "even", "single"):
        assert word in done.stdout
    problem = load_problem(emitted)
    assert [d.id for d in problem.devices] == ["rpi4-4gb-1", "rpi4-4gb-2", "jetson-nano"]
    assert [unit.name for unit in problem.layers] == ["conv1", "conv2", "fc1", "out"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


def test_bad_command_lines_exit_2() -> None:
    assert plan("--json").returncode == 2  # neither --problem nor --model
    done = plan("--model", "vgg11", "--devices", "rpi9")
    assert done.returncode == 2
    assert "rpi9" in done.stderr
    # A model option past its bound (see [Note: bounded zoo options]): one line, nothing built.
    done = plan("--model", "mlp", "--devices", "laptop", "-o", "depth=1000000000")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: model mlp: depth must be an integer from 2 to 1024 (got 1000000000)"
    ]


V2: dict[str, Any] = {
    "version": 2,
    "batch_size": 32,
    "microbatches": 4,
    "layers": [
        {"name": "conv1", "fwd_flops": 5e8, "param_bytes": 4e3, "out_bytes": 1e5},
        {"name": "conv2", "fwd_flops": 5e8, "param_bytes": 4e4, "out_bytes": 5e4},
        {"name": "fc", "fwd_flops": 1e6, "param_bytes": 4e6, "out_bytes": 40},
    ],
    "devices": [
        {
            "id": f"pi-{c}",
            "gflops": 7,
            "memory_bytes": 3e9,
            "bandwidth_mbps": 940,
            "latency_ms": 0.15,
            "watts_busy": 6.4,
            "watts_idle": 2.7,
        }
        for c in "abc"
    ]
    + [
        {
            "id": "nano",
            "gflops": 20,
            "memory_bytes": 3e9,
            "bandwidth_mbps": 940,
            "latency_ms": 0.15,
            "watts_busy": 10,
            "watts_idle": 1.5,
        }
    ],
}


def test_version_2_plan_json_carries_groups_shares_and_energy(tmp_path: Path) -> None:
    """Convolutions with few parameters on four devices: one group of all four, each
    member's share its speed's; the JSON scores as printed."""
    done = run_plan("--problem", str(write(tmp_path, V2)), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    (stage,) = out["stages"]
    assert sorted(stage["devices"]) == ["nano", "pi-a", "pi-b", "pi-c"]
    assert "device" not in stage  # a group's stage has no single device
    assert sum(stage["shares"]) == pytest.approx(1.0)
    speed = {d["id"]: d["gflops"] for d in V2["devices"]}
    for d, w in zip(stage["devices"], stage["shares"], strict=True):
        assert w == pytest.approx(speed[d] / 41)
    plan = Plan((Stage.group(stage["devices"], *stage["layers"]),))
    score = score_plan(parse_problem(V2), plan)
    assert score.step_time_s == pytest.approx(out["step_time_s"], rel=1e-12)
    assert out["energy_j_per_step"] == pytest.approx(score.energy_j_per_step, rel=1e-12)
    assert out["energy_j_per_sample"] == pytest.approx(out["energy_j_per_step"] / 32)
    assert out["allreduce_s"] > 0


def test_objective_energy_and_deadline_options(tmp_path: Path) -> None:
    path = str(write(tmp_path, V2))
    fast = json.loads(run_plan("--problem", path, "--json").stdout)
    frugal_run = run_plan("--problem", path, "--json", "--objective", "energy")
    assert frugal_run.returncode == 0, frugal_run.stderr
    frugal = json.loads(frugal_run.stdout)
    assert frugal["energy_j_per_step"] < fast["energy_j_per_step"]
    assert frugal["step_time_s"] > fast["step_time_s"]
    # A deadline between the two: the least energy among plans that meet it.
    middle = (fast["step_time_s"] + frugal["step_time_s"]) / 2
    bound = json.loads(
        run_plan(
            "--problem", path, "--json", "--objective", "energy", "--deadline", str(middle)
        ).stdout
    )
    assert bound["step_time_s"] <= middle
    assert frugal["energy_j_per_step"] <= bound["energy_j_per_step"] <= fast["energy_j_per_step"]
    late = plan("--problem", path, "--json", "--deadline", str(fast["step_time_s"] * 0.9))
    assert late.returncode == 3
    assert json.loads(late.stdout)["feasible"] is False
    bad = plan("--problem", path, "--objective", "speed")
    assert bad.returncode == 2 and "--objective" in bad.stderr


def test_version_2_report_shows_groups_energy_and_both_baselines(tmp_path: Path) -> None:
    done = run_plan("--problem", str(write(tmp_path, V2)))
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "J/sample" in text and "prediction" in text
    assert "data-parallel" in text and "pipeline-only" in text
