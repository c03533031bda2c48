"""``edgetrain agent --data NAME=SPEC`` as a real process on a real Mosquitto.

The agent holds a shard of ``digits``, a directory of ``.npz`` files and a CSV file.
Its retained profile lists each by name, sample count and shapes; a client that
subscribed to every topic (``#``) before the agent started sees, until the agent
has stopped, no payload that carries a sample: neither the inputs' raw bytes nor
the numbers written out. A bad SPEC ends the agent with status 2 and one line
before it connects. tests/unit/edge/models/test_local_data.py registers SPECs
in-process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support.catalog import DEVICE
from support.mosquitto import Broker
from support.waiting import until

from edge.models.datasets import DigitsDataset, shard_indices
from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.topics import device_profile

CSV_VALUES = (-9876.125, -5432.375, -1357.8125, -2468.0625)
"""Features in the CSV file whose text, or float32 bytes, in a payload would be a leak
(negative: no timestamp or figure of a profile has a minus sign)."""


def _agent(broker: str, tmp: Path, *args: str) -> subprocess.Popen[str]:
    profile = tmp / "device.json"
    profile.write_text(json.dumps(DEVICE))
    cmd = [sys.executable, "-m", "edgetrain.cli", "agent", "--broker", broker]
    cmd += ["--data-dir", str(tmp / "agent"), "--heartbeat-s", "0.1", "--threads", "1"]
    cmd += ["--insecure", "--profile", str(profile), *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )


@pytest.fixture
def wire(mosquitto: Broker) -> Iterator[list[tuple[str, bytes]]]:
    """Every message on the broker from now on, as (topic, payload)."""
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def keep(topic: str, payload: bytes) -> None:
        with lock:
            seen.append((topic, payload))

    transport = MqttTransport(MqttSettings(url=mosquitto.url))
    transport.connect(timeout=10)
    transport.subscribe("#", keep)
    yield seen
    transport.close()


def _holdings(tmp: Path) -> tuple[Path, Path, list[bytes], list[str]]:
    """An .npz directory and a CSV file, with the byte strings and texts of their samples."""
    npz = tmp / "camera"
    npz.mkdir()
    rng = np.random.RandomState(7)
    x1 = (1000 + rng.random_sample((4, 3, 5))).astype(np.float32)
    x2 = (2000 + rng.random_sample((2, 3, 5))).astype(np.float32)
    np.savez(npz / "day1.npz", x=x1, y=np.array([0, 1, 2, 1]))
    np.savez(npz / "day2.npz", x=x2, y=np.array([2, 0]))
    csv = tmp / "sensor.csv"
    rows = ["a,b,target,c"] + [f"{v},{v + 1},{i % 2},{v + 2}" for i, v in enumerate(CSV_VALUES)]
    csv.write_text("\n".join(rows) + "\n")
    raw = [x.tobytes() for x in (*x1, *x2)]  # each sample's inputs
    raw += [np.array([v, v + 1, v + 2], dtype=np.float32).tobytes() for v in CSV_VALUES]
    texts = [str(v + k) for v in CSV_VALUES for k in (0, 1, 2)]
    digits = DigitsDataset("train")
    for row in shard_indices("digits", 1437, 2, 3)[:20]:
        raw.append(digits.images[int(row)].numpy().tobytes())
    return npz, csv, raw, texts


def test_the_profile_lists_the_datasets_and_no_sample_crosses_the_wire(
    mosquitto: Broker, wire: list[tuple[str, bytes]], tmp_path: Path
) -> None:
    npz, csv, raw, texts = _holdings(tmp_path)
    data = ["--data", "mine=digits:shard=2/3", "--data", f"cam={npz}"]
    data += ["--data", f"sensor={csv}:label=target"]
    proc = _agent(mosquitto.url, tmp_path, "--device-id", "holder-1", *data)
    topic = device_profile("holder-1")
    try:
        assert until(lambda: any(t == topic for t, _ in wire) or proc.poll() is not None, 60), (
            "no profile"
        )
        # A few heartbeats more, then the agent's goodbye, all on the wire too.
        assert until(lambda: sum(t.endswith("/heartbeat") for t, _ in wire) >= 5, 30)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    (payload,) = [p for t, p in wire if t == topic]
    spec = DeviceSpec.model_validate_json(payload)
    assert spec.id == "holder-1" and spec.details is not None
    assert spec.details["emulated"] is True
    assert spec.details["datasets"] == {
        "mine": {
            "kind": "zoo",
            "samples": 479,
            "input_shape": [1, 8, 8],
            "input_dtype": "float32",
            "label_shape": [],
            "label_dtype": "int64",
            "num_classes": 10,
            "source": "digits:shard=2/3",
        },
        "cam": {
            "kind": "npz",
            "samples": 6,
            "input_shape": [3, 5],
            "input_dtype": "float32",
            "label_shape": [],
            "label_dtype": "int64",
            "num_classes": 3,
            "source": None,
        },
        "sensor": {
            "kind": "csv",
            "samples": 4,
            "input_shape": [3],
            "input_dtype": "float32",
            "label_shape": [],
            "label_dtype": "int64",
            "num_classes": 2,
            "source": None,
        },
    }
    assert "holds local dataset cam: 6 samples of shape [3, 5] (npz)" in out
    assert any(t.endswith("/status") and b'"offline"' in p for t, p in wire)
    for t, p in wire:
        for sample in raw:
            assert sample not in p, f"a sample's bytes on {t}"
        for text in texts:
            assert text.encode() not in p, f"{text} on {t}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--data", "a=digits:shard=4/3"],
            "--data a=digits:shard=4/3: shard 4/3: K must be 1 to N",
        ),
        (
            ["--data", "a=os:getcwd"],
            "--data a=os:getcwd: dataset 'os:getcwd': module 'os' is not allowed here (this "
            "agent runs zoo models and built-in datasets only); its owner may allow it with "
            "--allow-code os",
        ),
    ],
)
def test_a_bad_spec_stops_the_agent_with_one_line_before_connecting(
    tmp_path: Path, args: list[str], message: str
) -> None:
    # No broker listens there: the SPEC is checked before connecting.
    proc = _agent("mqtt://127.0.0.1:9", tmp_path, "--device-id", "holder-2", *args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines() == [f"error: {message}"]
