"""``edgetrain models list`` and ``models profile``: the zoo as the models are, and each
unit's costs as the ``layers`` of a planning problem.

The commands run in this process through their entry point (support.cli);
tests/integration/test_command_imports.py runs ``models list`` on a device install.
"""

from __future__ import annotations

import json

import pytest
from support.cli import edgetrain

from edge.models.zoo import get_model, list_models
from edge.problem import parse_problem

DEVICE = {"id": "pi", "gflops": 6, "memory_bytes": 2e9, "bandwidth_mbps": 50, "latency_ms": 2}


def test_list_shows_every_zoo_model_as_it_is() -> None:
    done = edgetrain("models", "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert list(rows) == list_models()
    for name, row in rows.items():
        spec = get_model(name)
        assert (row["units"], row["input_shape"], row["dataset"]) == (
            spec.num_units,
            list(spec.input_shape),
            spec.dataset,
        )
    mlp = get_model("mlp").build()
    assert rows["mlp"]["parameters"] == sum(p.numel() for p in mlp.parameters())

    table = edgetrain("models", "list")
    assert table.returncode == 0, table.stderr
    assert all(name in table.stdout for name in list_models())


def test_profile_json_gives_the_layers_of_a_planning_problem() -> None:
    done = edgetrain(
        "models", "profile", "mlp", "--json", "--no-timing", "-b", "8", "-o", "hidden=16"
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["model"], out["batch_size"]) == ("mlp", 8)

    # The option reached the model: its parameters are those of the 16-wide MLP, in fp32.
    spec = get_model("mlp", hidden=16)
    layers = out["layers"]
    assert [layer["name"] for layer in layers] == spec.unit_names
    params = sum(p.numel() for p in spec.build().parameters())
    assert sum(layer["param_bytes"] for layer in layers) == 4 * params
    assert all(unit["fwd_time_s"] is None for unit in out["units"])  # --no-timing

    problem = {"version": 1, "batch_size": 8, "microbatches": 2, "devices": [DEVICE]}
    assert [unit.name for unit in parse_problem({**problem, "layers": layers}).layers] == (
        spec.unit_names
    )


def test_profile_prints_a_table_of_the_timed_units() -> None:
    done = edgetrain("models", "profile", "mlp", "-b", "4", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in get_model("mlp").unit_names)
    assert "training GFLOP per sample: " in done.stdout


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["nope"], "error: model: unknown model 'nope' (known: "),
        (["mlp", "-o", "width=16"], "error: model mlp: unknown option 'width'"),
    ],
)
def test_an_unknown_model_or_option_exits_2_with_one_line(args: list[str], line: str) -> None:
    done = edgetrain("models", "profile", *args)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(line) and len(done.stderr.strip().splitlines()) == 1
