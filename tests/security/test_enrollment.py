"""Enrolment and revocation through the coordinator's own secure broker, end to end.

``edgetrain coordinator`` (no ``--broker``) starts Mosquitto with TLS and accounts;
``edgetrain fleet enroll`` writes a device's credentials (mode 0600) through the
API (write token); ``edgetrain agent --credentials`` logs in with them and comes
online; ``edgetrain fleet revoke`` deletes the account, which disconnects the
agent, and it cannot log in again. A credentials file is refused by an agent that
has lost it to a rotation.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.coordinator import coordinator_process
from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.local.broker import free_port

pytestmark = [*needs_mosquitto, pytest.mark.slow]
TOKEN = "enrolment-test-token-8f2a1c"


def _cli(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env_token = ["--token", token] if token else []
    cmd = [sys.executable, "-m", "edgetrain.cli", *args, *env_token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def _agent(creds: Path, data: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "edgetrain.cli", "agent", "--credentials", str(creds)]
    cmd += ["--profile", "rpi4-4gb", "--data-dir", str(data), "--heartbeat-s", "0.3"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_enrol_run_revoke(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        (tmp_path / "coordinator.log").open("wb") as stderr,
        coordinator_process(port, None, tmp_path / "coord", token=TOKEN, stderr=stderr),
    ):
        api = httpx.Client(base_url=url, timeout=15)

        def up() -> bool:
            try:
                return api.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        assert until(up, 60), (tmp_path / "coordinator.log").read_text()[-2000:]

        def state(device: str) -> Any:
            got = api.get(f"/api/v1/devices/{device}")
            return got.json()["state"] if got.status_code == 200 else None

        # Enrolment needs the write token.
        creds = tmp_path / "pi-1.json"
        refused = _cli(
            "fleet", "enroll", "pi-1", "--out", str(creds), "--coordinator", url, token=None
        )
        assert refused.returncode == 2 and "401" in refused.stderr and not creds.exists()
        done = _cli("fleet", "enroll", "pi-1", "--out", str(creds), "--coordinator", url)
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
        body = json.loads(creds.read_text())
        assert body["broker"].startswith("mqtts://127.0.0.1:")
        assert body["device_id"] == body["username"] == "pi-1"
        assert body["ca"].startswith("-----BEGIN CERTIFICATE-----")
        listed = api.get("/api/v1/devices/enrollments").json()
        assert listed == {"data": ["pi-1"], "count": 1}

        log = tmp_path / "agent.log"
        agent = _agent(creds, tmp_path / "agent", log)
        try:
            assert until(lambda: state("pi-1") == "online", 60), log.read_text()[-2000:]
            # Revoked: disconnected now, and refused from then on.
            done = _cli("fleet", "revoke", "pi-1", "--coordinator", url)
            assert done.returncode == 0 and done.stdout.strip() == "revoked pi-1", done.stderr
            assert until(lambda: state("pi-1") == "offline", 15)
            assert not until(lambda: state("pi-1") == "online", 4)
            assert agent.poll() is None  # it keeps trying, and keeps being refused
            again = _cli("fleet", "revoke", "pi-1", "--coordinator", url)
            assert again.returncode == 2 and "404" in again.stderr
        finally:
            _stop(agent)
        assert "not authori" in log.read_text().lower()

        # Enrolled again (a new password): the old file no longer logs in; the new one does.
        old = tmp_path / "old.json"
        old.write_text(creds.read_text())
        done = _cli("fleet", "enroll", "pi-1", "--out", str(creds), "--coordinator", url)
        assert done.returncode == 0, done.stderr
        stale = _agent(old, tmp_path / "stale", tmp_path / "stale.log")
        try:
            assert not until(lambda: state("pi-1") == "online", 4)
        finally:
            _stop(stale)
        fresh = _agent(creds, tmp_path / "fresh", tmp_path / "fresh.log")
        try:
            assert until(lambda: state("pi-1") == "online", 60)
        finally:
            _stop(fresh)
