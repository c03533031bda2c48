"""Data that stays home, over MQTT: the holders' samples never leave them, and the run is
single-device training on the union of their data.

``edgetrain train --holders 3`` on four agent processes and a real Mosquitto: three
emulated Raspberry Pi 4s each hold a third of ``digits`` (``agent --data
digits=digits:shard=i/3``) and a laptop helps. A client subscribed to every topic
for the whole run decodes every frame it sees: none carries a tensor of the
dataset's input shape, while activations after the holders' units do cross to the
helper (so the check is not vacuous). The trained model equals a plain PyTorch loop
on the union of the shards, in the order the holders read them, within 1e-5.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from support.reference import assert_matches, train_on_batches, union_batches

from edge.models.datasets import build_dataset
from edge.models.local_data import register
from edge.models.user_code import ZOO_ONLY
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.frames import Codec, FrameError, Kind, encode_frame, read_header
from edge.wire.groups import split_samples

pytestmark = pytest.mark.slow

HOLDERS = 3
OPTIONS: dict[str, Any] = {"width": 64}
STEPS, BATCH, MICRO = 4, 96, 4


def _train(broker: str, *extra: str) -> dict[str, Any]:
    """``edgetrain train --holders 3`` on three emulated Pi 4s and a laptop; its JSON."""
    cmd = [
        sys.executable,
        "-m",
        "edgetrain.cli",
        "train",
        "--model",
        "cnn-digits",
        "--option",
        "width=64",
        "--devices",
        "rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop",
        "--holders",
        str(HOLDERS),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--microbatches",
        str(MICRO),
        "--broker",
        broker,
        "--threads",
        "1",
        "--json",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stderr[-2000:]
    got: dict[str, Any] = json.loads(out.stdout)
    return got


def _train_watched(broker: str, *extra: str) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """:func:`_train` while subscribed to every topic (``#``) with the coordinator's
    account; its JSON and every message seen meanwhile, as (topic, payload)."""
    seen: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def sniff(topic: str, payload: bytes) -> None:
        with lock:
            seen.append((topic, payload))

    sniffer = MqttTransport(MqttSettings(url=broker))
    sniffer.connect(timeout=10)
    sniffer.subscribe("#", sniff)
    try:
        got = _train(broker, *extra)
    finally:
        sniffer.close()
    with lock:
        return got, list(seen)


def test_samples_stay_on_their_holders_and_training_is_the_unions(
    module_broker: str, tmp_path: Path
) -> None:
    weights = tmp_path / "w.safetensors"
    got, frames = _train_watched(module_broker, "--save-weights", str(weights))

    # The plan: the three holders are stage 0 (a third of every microbatch each), and a
    # helper runs the rest.
    stages = got["plan"]["stages"]
    holders = stages[0]["devices"]
    assert len(holders) == HOLDERS and len(stages) >= 2
    assert all(
        holder not in st.get("devices", [st.get("device")])
        for st in stages[1:]
        for holder in holders
    )

    # What the job says leaves each device: activations after the holders' units, never
    # the samples; and it compares itself only with what its constraints allow.
    first = got["egress"][0]
    assert first["from"] == holders and first["what"].startswith("activations after unit")
    assert all("sample" not in row["what"] for row in got["egress"])
    alternatives = got["alternatives"]
    assert "holders alone" in alternatives and "forbidden" not in alternatives["holders alone"]
    assert all(f"{h} alone, its own data" in alternatives for h in holders)
    assert alternatives["single"]["forbidden"].startswith("the data may not leave")

    # On the wire: no frame carries the dataset's inputs; activations after the holders'
    # units do cross.
    spec = get_model("cnn-digits", **OPTIONS)
    sample = tuple(build_dataset(spec.dataset, "train", **spec.dataset_options)[0][0].shape)
    kinds: Counter[tuple[Kind, tuple[int, ...]]] = Counter()
    for _topic, payload in frames:
        try:
            header = read_header(payload)
        except FrameError:
            continue  # JSON events and commands, weights: not frames
        kinds[(header.kind, header.shape[1:])] += 1
        assert not (header.kind is not Kind.LABELS and header.shape[1:] == sample), header
    crossed = [shape for (kind, shape) in kinds if kind is Kind.ACTIVATION]
    assert crossed and all(shape != sample for shape in crossed)

    # The run is one device's on the union of the shards, holder after holder.
    shards = [
        register([f"digits=digits:shard={i + 1}/{HOLDERS}"], ZOO_ONLY) for i in range(HOLDERS)
    ]
    counts = split_samples(BATCH // MICRO, stages[0]["shares"])
    reference = train_on_batches(
        "cnn-digits",
        union_batches(shards, "digits", counts, MICRO, 0),
        steps=STEPS,
        seed=0,
        model_options=OPTIONS,
        microbatches=MICRO,
    )
    trained = safetensors.torch.load_file(str(weights))
    assert_matches(got["losses"], trained, reference)


def _label_patterns(
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], counts: list[int]
) -> list[bytes]:
    """Every form a microbatch's labels could cross the wire in, for every step of the job:
    each holder's own rows and the whole microbatch's, as raw int64 (a frame's payload)
    and as JSON."""
    patterns = []
    for step in range(STEPS):
        for mb in batches(step)[1].chunk(MICRO):
            rows, at = [mb], 0
            for n in counts:
                rows.append(mb[at : at + n])
                at += n
            for labels in rows:
                patterns.append(labels.numpy().tobytes())
                patterns.append(json.dumps(labels.tolist()).encode())
    return patterns


def _carries(payload: bytes, patterns: list[bytes]) -> bool:
    return any(p in payload for p in patterns)


def test_with_labels_local_no_message_carries_labels_and_training_is_the_unions(
    module_broker: str, tmp_path: Path
) -> None:
    """``--labels local``: the holders run the first and the last units, a helper the
    middle; no message on any topic carries a label of any microbatch (raw or as JSON) nor
    a sample, and the run still equals one device on the union of the shards. (GPipe here;
    both schedules' parity with labels local is in ``test_local_data_parity.py``.)"""
    schedule = "gpipe"
    weights = tmp_path / "w.safetensors"
    extra = ["--labels", "local", "--schedule", schedule, "--save-weights", str(weights)]
    got, messages = _train_watched(module_broker, *extra)

    # A U: the holders, then helpers that hold no data, then the same holders again.
    stages = got["plan"]["stages"]
    holders = stages[0]["devices"]
    assert got["plan"]["u_shaped"] is True
    assert len(holders) == HOLDERS and len(stages) >= 3
    assert stages[-1]["devices"] == holders and stages[-1]["shares"] == stages[0]["shares"]
    middle = {d for st in stages[1:-1] for d in st["devices"]}
    assert middle and not middle & set(holders)
    assert stages[-1]["layers"][1] == get_model("cnn-digits", **OPTIONS).num_units
    # What leaves the devices: activations both ways round the U, never labels.
    egress = got["egress"]
    assert not [row for row in egress if row["what"] == "labels"]
    back = [row["what"].split(" (")[0] for row in egress if row["to"] == holders]
    tail = stages[-1]["layers"][0]
    assert f"activations after unit {tail - 1}" in back  # the helpers' output, to the tail

    counts = split_samples(BATCH // MICRO, stages[0]["shares"])
    shards = [
        register([f"digits=digits:shard={i + 1}/{HOLDERS}"], ZOO_ONLY) for i in range(HOLDERS)
    ]
    batches = union_batches(shards, "digits", counts, MICRO, 0)
    patterns = _label_patterns(batches, counts)
    # The check can fail: the labels frame stage 0 sends when they do not stay home.
    labels = batches(1)[1].chunk(MICRO)[2][counts[0] : counts[0] + counts[1]]
    assert _carries(encode_frame(Kind.LABELS, "j", 1, 2, labels, Codec.RAW), patterns)

    spec = get_model("cnn-digits", **OPTIONS)
    sample = tuple(build_dataset(spec.dataset, "train", **spec.dataset_options)[0][0].shape)
    crossed: Counter[tuple[str, Kind]] = Counter()
    for topic, payload in messages:
        assert not _carries(payload, patterns), topic
        try:
            header = read_header(payload)
        except FrameError:
            continue  # JSON events and commands, weights: not frames
        assert header.kind is not Kind.LABELS, topic
        assert header.shape[1:] != sample, topic
        if "/stage/" in topic:  # not an agent's transport probe (devices/{id}/probe)
            crossed[(topic.split("/stage/")[1].split("/")[0], header.kind)] += 1
    # Activations did reach the holders' last stage, and gradients came back from it.
    last = str(len(stages) - 1)
    assert crossed[(last, Kind.ACTIVATION)] > 0
    assert crossed[(str(len(stages) - 2), Kind.GRADIENT)] > 0

    reference = train_on_batches(
        "cnn-digits", batches, steps=STEPS, seed=0, model_options=OPTIONS, microbatches=MICRO
    )
    trained = safetensors.torch.load_file(str(weights))
    assert_matches(got["losses"], trained, reference)


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--labels", "local"], "error: --labels local needs --holders (data that stays home)"),
        (
            ["--labels", "local", "--holders", "3", "--fault", "kill:1@2"],
            "error: --labels local cannot be combined with --fault or --replicate-every yet",
        ),
    ],
)
def test_labels_local_where_it_cannot_be_exits_2_naming_labels(extra: list[str], line: str) -> None:
    """Refused before anything starts: no broker, no agents."""
    cmd = [sys.executable, "-m", "edgetrain.cli", "train", "--devices", "4", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr.strip(), out.stdout) == (2, line, "")


def test_labels_other_than_central_or_local_exit_2_naming_both() -> None:
    """``--labels`` is a choice: the parser refuses any other value, naming the option and
    its choices, before anything starts."""
    cmd = [sys.executable, "-m", "edgetrain.cli", "train", "--devices", "4"]
    out = subprocess.run(
        [*cmd, "--labels", "home", "--holders", "3"], capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert "Invalid value for '--labels'" in out.stderr
    assert "'home' is not one of 'central', 'local'" in out.stderr


def _events(got: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in got["events"] if e["type"] == kind]


def test_a_holder_that_dies_takes_its_data_and_the_others_go_on(module_broker: str) -> None:
    """``kill:0.1@2``: holder 1 dies; its co-holders hand over (nothing rolls back) and the
    job trains on the other two holders' data from then on, and says so."""
    got = _train(module_broker, "--fault", "kill:0.1@2", "--steps", "6")
    first, second = _events(got, "attempt")
    killed = first["plan"][0]["devices"][1]
    (recovery,) = _events(got, "recovery")
    assert recovery["handed_over"] is True and got["rolled_back_steps"] == 0
    assert recovery["data_left_with"] == [killed]
    assert recovery["holders"] == [d for d in first["plan"][0]["devices"] if d != killed]
    assert second["plan"][0]["devices"] == recovery["holders"]
    assert got["steps_completed"] == 6 and all(math.isfinite(x) for x in got["losses"])


def test_a_helper_that_dies_leaves_the_holders_training(module_broker: str) -> None:
    """``kill:1@2``: the laptop (the only helper) dies; the re-plan keeps every holder,
    now training every unit themselves."""
    got = _train(module_broker, "--fault", "kill:1@2", "--steps", "6")
    first, second = _events(got, "attempt")
    helper = first["plan"][1]["device"]
    (recovery,) = _events(got, "recovery")
    assert recovery["data_left_with"] == [] and helper not in recovery["holders"]
    assert second["plan"][0]["devices"] == first["plan"][0]["devices"]
    assert len(second["plan"]) == 1  # no helper left: the holders alone
    assert got["steps_completed"] == 6 and all(math.isfinite(x) for x in got["losses"])
