"""``edgetrain submit``, ``jobs`` and ``fleet`` as subprocesses against a live coordinator.

The coordinator is uvicorn on a free loopback port in a thread, over a real
Mosquitto, with two real agents; the commands run as ``python -m edgetrain.cli``, but
for refusals that one real process per command already shows: those run in this process
through the command's entry point (support.cli).
The job file is examples/job.toml with its ``stages = 2`` line switched on, so
the job is a 2-stage pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from support.cli import edgetrain
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.local.broker import free_port
from coordinator.local.fleet import LocalFleet
from coordinator.service.serve import serve_in_thread
from coordinator.service.settings import Settings

pytestmark = [pytest.mark.slow, *needs_mosquitto]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "client-test-token-0123456789"


def _cli(
    *args: str, token: str | None = TOKEN, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGETRAIN_")}
    if token is not None:
        env["EDGETRAIN_API_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _cli_here(*args: str) -> subprocess.CompletedProcess[str]:
    """:func:`_cli` in this process (support.cli), with the token and no other
    ``EDGETRAIN_`` variable."""
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("EDGETRAIN_")}
    return edgetrain(*args, env={**unset, "EDGETRAIN_API_TOKEN": TOKEN})


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LocalFleet]]:
    """The coordinator's URL, with two agents online."""
    data = tmp_path_factory.mktemp("coord")
    with mosquitto_broker() as broker:
        settings = Settings(
            broker_url=broker.url, data_dir=data, api_token=SecretStr(TOKEN), port=free_port()
        )
        with serve_in_thread(settings) as url, LocalFleet(2, broker.url, threads=1) as fleet:

            def online() -> bool:
                devices = httpx.get(f"{url}/api/v1/devices", timeout=10).json()["data"]
                return {d["id"] for d in devices if d["state"] == "online"} == set(fleet.ids)

            assert until(online, 90, 0.2), "the agents never came online"
            yield url, fleet


def _job_file(tmp_path: Path) -> Path:
    """examples/job.toml, shortened to a few steps, with two stages."""
    text = (ROOT / "examples" / "job.toml").read_text()
    assert "steps = 200" in text and "\n# stages = 2 " in text
    path = tmp_path / "job.toml"
    path.write_text(
        text.replace("steps = 200", "steps = 4")
        .replace("batch_size = 32", "batch_size = 16")
        .replace("\n# stages = 2 ", "\nstages = 2 ")
    )
    return path


def test_submit_wait_then_jobs_and_fleet(
    coordinator: tuple[str, LocalFleet], tmp_path: Path
) -> None:
    url, fleet = coordinator
    job_file = _job_file(tmp_path)

    refused = _cli("submit", str(job_file), "--coordinator", url, token=None)
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "401" in refused.stderr

    done = _cli("submit", str(job_file), "--coordinator", url, "--wait", "--json")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["state"] == "completed" and job["steps_done"] == 4
    assert job["spec"]["model"] == "cnn-digits" and job["spec"]["optimizer"]["lr"] == 0.05
    assert job["spec"]["stages"] == 2 and job["spec"]["partition"] == "plan"
    assert {st["device"] for st in job["plan"]["stages"]} == set(fleet.ids)
    assert len(job["plan"]["stages"]) == 2

    listed = _cli("jobs", "--coordinator", url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert job["id"] in [j["id"] for j in json.loads(listed.stdout)["data"]]
    one = _cli("jobs", job["id"], "--coordinator", url, "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["state"] == "completed"
    table = _cli("jobs", "--coordinator", url)
    assert table.returncode == 0 and job["id"] in table.stdout
    missing = _cli("jobs", "nosuchjob", "--coordinator", url)
    assert missing.returncode == 2 and "404" in missing.stderr

    devices = _cli("fleet", "--coordinator", url, "--json")
    assert devices.returncode == 0, devices.stderr
    assert fleet.ids[0] in [d["id"] for d in json.loads(devices.stdout)["data"]]
    table = _cli("fleet", "--coordinator", url)
    assert table.returncode == 0 and fleet.ids[0] in table.stdout


def test_unreachable_coordinator_and_bad_toml_exit_2_with_one_line(tmp_path: Path) -> None:
    """No job runs (nothing listens, or the file is refused): no plan, no stages to count."""
    port = free_port()  # nothing listens on it
    job_file = tmp_path / "job.toml"
    job_file.write_text('model = "cnn-digits"\nsteps = 4\n')
    for args in (("submit", str(job_file)), ("jobs",), ("fleet",)):
        where = (*args, "--coordinator", f"http://127.0.0.1:{port}")
        # fleet as a real process (submit's and jobs' are in the test above)
        out = _cli(*where, timeout=60) if args == ("fleet",) else _cli_here(*where)
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1 and "cannot reach" in out.stderr

    bad = tmp_path / "bad.toml"
    bad.write_text('model = "cnn-digits\nsteps = = 4\n')
    out = _cli_here("submit", str(bad), "--coordinator", f"http://127.0.0.1:{port}")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "TOML" in out.stderr
