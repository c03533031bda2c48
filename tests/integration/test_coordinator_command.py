"""``edgetrain coordinator`` refuses to serve an open API off loopback.

See [Note: an open API stays on loopback] in coordinator.service.settings: the
refusal comes from the settings' validation, before a broker, a store or a socket.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.coordinator import coordinator_process

from coordinator.local.broker import free_port


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7"])
def test_a_non_loopback_host_without_a_token_exits_2(tmp_path: Path, host: str) -> None:
    data = tmp_path / "coord"
    broker = "mqtt://127.0.0.1:1"  # never reached
    with coordinator_process(free_port(), broker, data, host=host, stderr=subprocess.PIPE) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.decode().splitlines() == [
        f"error: settings: host: {host} is not a loopback address and no API token is set, so "
        "anyone on the network could submit jobs; set EDGETRAIN_API_TOKEN (or serve on 127.0.0.1)"
    ]
    assert not data.exists()
