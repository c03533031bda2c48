"""The emulation testbed end to end: real cgroups, namespaces, tc, processes; nothing mocked.

The kernel-method tests need root, cgroup cpu and memory controllers, ``ip netns``
and ``tc tbf``; they are skipped with the reason ``detect`` gives otherwise. Every
test downs its testbed in a fixture, so nothing is left behind even when it fails,
and then checks that nothing was. The jobs that run are 3-stage pipelines: an
explicit plan on the kernel testbed, ``stages=3`` through the coordinator. The
testbed's broker is secure by default: TLS, no anonymous client, an account per
agent (credentials files of mode 0600), and rights that follow the job's plan;
its coordinator's write routes (enrolment among them) need the API token ``up``
prints.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.access.dynsec import DynSec
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from coordinator.testbed import limits, netns
from coordinator.testbed.state import State, find_marked, proc_alive
from coordinator.testbed.testbed import StartOptions, Testbed, down
from edge.errors import UserError
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import DeviceStatus, Throttle
from edge.wire.topics import TOPIC_ROOT, device_cmd, device_status, stage_topic

pytestmark = [
    pytest.mark.slow,
    *needs_mosquitto,
]

GIB = 2**30
CLI = [sys.executable, "-m", "edgetrain.cli", "testbed"]


@pytest.fixture(scope="module")
def kernel() -> limits.Detection:
    detection = limits.detect("auto")
    if detection.method != "kernel":
        pytest.skip(f"kernel method unavailable here: {detection.reason}")
    return detection


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose testbed is downed (and checked clean) after the test."""
    where = tmp_path / "testbed"
    yield where
    state = State.load(where)
    down(where)
    if state is not None:
        assert leftovers(state) == []


def leftovers(state: State) -> list[str]:
    """Whatever of ``state``'s testbed still exists: processes, cgroups, namespaces, veths."""
    left = [f"process {p.name}" for p in state.processes if proc_alive(p.pid, p.start)]
    left += [f"unrecorded process {p.pid}" for p in find_marked(state.token)]
    for root in ("cpu", "memory", "unified"):
        parent = Path("/sys/fs/cgroup") / root / f"edgetrain-testbed-{state.id}"
        if parent.exists():
            left.append(f"cgroup {parent}")
    left += [f"namespace {n}" for n in netns.list_namespaces() if n.startswith(f"et-{state.id}-")]
    left += [f"link {n}" for n in netns.list_links() if n.startswith(f"et{state.id}")]
    return left


def device(id: str, gflops: float, mbps: float = 500.0, latency_ms: float = 2.0) -> DeviceSpec:
    return DeviceSpec(
        id=id, gflops=gflops, memory_bytes=2 * GIB, bandwidth_mbps=mbps, latency_ms=latency_ms
    )


def linear_macs(model: str, options: dict[str, Any], start: int, end: int) -> int:
    """Multiply-accumulates per sample of the linear layers in units ``[start, end)``."""
    segment = get_model(model, **options).build_segment(start, end)
    return sum(
        m.in_features * m.out_features for m in segment.modules() if isinstance(m, torch.nn.Linear)
    )


def api_of(bed: Testbed) -> httpx.Client:
    """A client of the testbed's coordinator that sends its API token."""
    assert bed.coordinator_url is not None and bed.api_token is not None
    auth = {"Authorization": f"Bearer {bed.api_token}"}
    return httpx.Client(base_url=bed.coordinator_url, timeout=30, headers=auth)


def control_for(login: MqttSettings) -> MqttTransport:
    control = MqttTransport(login)
    control.connect(timeout=10)
    return control


MARK = "MALLORY-5c1d"  # in every payload the intruder publishes


def assert_only_the_plan_gets_through(bed: Testbed, api: httpx.Client, job: str) -> None:
    """Anonymous clients are refused; a device enrolled through the coordinator's API but
    holding no stage ("mallory") cannot command a device of the job nor feed its stages:
    a spy on the coordinator's account, which may read everything, receives only what
    mallory may send (its own status); the agents' rights for the job were taken back."""
    login = bed.login()
    anonymous = MqttTransport(MqttSettings(url=bed.broker_url, tls_ca_pem=login.tls_ca_pem))
    with pytest.raises(UserError, match="refused the connection"):
        anonymous.connect(timeout=10)
    enrolled = api.post("/api/v1/devices/enroll", json={"device_id": "mallory"})
    assert enrolled.status_code == 201, enrolled.text
    creds = Credentials(**enrolled.json())
    assert creds.broker == bed.broker_url
    spy = control_for(login)
    got: queue.Queue[tuple[str, bytes]] = queue.Queue()
    spy.subscribe(f"{TOPIC_ROOT}/#", lambda topic, payload: got.put((topic, payload)))
    mallory = control_for(creds.settings())
    try:
        throttle = Throttle(slowdown=999.0).model_dump_json()
        mallory.publish(device_cmd("a"), throttle.replace("}", f',"x":"{MARK}"}}'))
        mallory.publish(stage_topic(job, 1, "fwd"), MARK.encode())
        mallory.publish(stage_topic(job, 0, "bwd"), MARK.encode())
        own = DeviceStatus(device="mallory", state="online", version=MARK)
        mallory.publish(device_status("mallory"), own.model_dump_json())
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while device_status("mallory") not in seen:  # after the others: they are in order
            topic, payload = got.get(timeout=max(0.01, deadline - time.monotonic()))
            if MARK.encode() in payload:
                seen.append(topic)
        assert seen == [device_status("mallory")]
        dynsec = DynSec(spy)
        for device in ("a", "b", "c"):
            role = dynsec.call({"command": "getRole", "rolename": f"device-{device}"})[0]
            topics = [acl["topic"] for acl in role["data"]["role"]["acls"]]
            assert not [t for t in topics if f"/{job}/" in t], (device, topics)
    finally:
        mallory.close()
        spy.close()


@pytest.mark.serial  # compares the agents' measured compute times
def test_kernel_testbed_slows_each_agent_to_its_profile(
    kernel: limits.Detection, state_dir: Path
) -> None:
    # Compute spans 4x; scale 1 gives the fastest device one core (1 + 0.5 + 0.25 of 2),
    # so the fastest agent is never throttled and the slowest is the pipeline's bottleneck.
    fleet = [device("fast", 40), device("mid", 20), device("slow", 10)]
    options = {"hidden": 2048, "depth": 8}  # units: fc1, six 2048x2048 layers, out
    plan = Plan.of(("fast", 0, 3), ("mid", 3, 5), ("slow", 5, 8))
    # Bursts of compute well over the 5 ms quota (see [Note: CFS period]): 128-sample microbatches.
    spec = JobSpec(model="mlp", model_options=options, steps=5, batch_size=256, microbatches=2)
    start = StartOptions(method="kernel", coordinator=False, measure_s=0.5)
    with Testbed.up(fleet, scale=1.0, state_dir=state_dir, start=start) as bed:
        assert bed.method == "kernel"
        assert [d.cpus for d in bed.devices] == [1.0, 0.5, 0.25]
        state = State.load(state_dir)
        assert state is not None and len(state.namespaces) == 3
        cpu = Path(state.devices[2]["cgroups"][0])
        quota = int((cpu / "cpu.cfs_quota_us").read_text())
        assert quota / int((cpu / "cpu.cfs_period_us").read_text()) == 0.25
        control = control_for(bed.login())
        try:
            assert bed.accounts is not None  # a secure broker: stages get their topics by grant
            result = run_on_agents(
                spec, plan, control, options=RunOptions(timeout_s=180, access=bed.accounts)
            )
        finally:
            control.close()
    assert leftovers(state) == []
    assert len(result.plan.stages) == 3
    assert {(r.stage, r.device) for r in result.reports} == {(0, "fast"), (1, "mid"), (2, "slow")}
    # Seconds of compute per multiply-accumulate, per device, after the first (warm-up) step.
    per_mac = {}
    for stage, st in enumerate(plan.stages):
        compute = sum(r.compute_s for r in result.reports if r.stage == stage and r.step > 0)
        macs = linear_macs("mlp", options, st.start, st.end) * spec.batch_size * (spec.steps - 1)
        per_mac[st.device] = compute / macs
    ratios = {d: per_mac[d] / per_mac["fast"] for d in per_mac}
    print(f"\ncompute s/MAC relative to 'fast' (profile: mid 2, slow 4): {ratios}")
    # The quota's exact value is asserted above; how close the timed slowdown comes to it
    # is a figure for the benchmarks (bench/hybrid.py prices stages by these quotas), not
    # for a timed assertion on a shared host. What must hold: the quotas took effect, in
    # the profile's order, and the slowest device is clearly throttled (an unthrottled
    # agent reads about 1x).
    assert ratios["slow"] > ratios["mid"] > 1.2, ratios
    assert 2.0 <= ratios["slow"] <= 8.0, ratios


@pytest.fixture(scope="module")
def scalar() -> limits.Detection:
    detection = limits.detect("scalar")
    if detection.method != "scalar":
        pytest.skip(f"scalar method unavailable here: {detection.reason}")
    return detection


@pytest.mark.serial  # compares the agents' measured compute times
def test_scalar_testbed_runs_code_at_the_scalar_share_and_compute_at_the_flop_share(
    scalar: limits.Detection, state_dir: Path
) -> None:
    """[Note: two speeds of a device]: a device 10x slower in FLOPs and 2x slower on scalar
    code gets a CPU quota of half the fast one's (its scalar share), and its agent
    throttles its compute blocks on to a tenth (``--slowdown 10``): compute per MAC comes
    out near 10x the fast one's, where the quota alone would give 2x."""
    fleet = [
        device("fast", 40).model_copy(update={"details": {"scalar_score": 1000.0}}),
        device("slow", 4).model_copy(update={"details": {"scalar_score": 500.0}}),
    ]
    options = {"hidden": 512, "depth": 6}
    plan = Plan.of(("fast", 0, 3), ("slow", 3, 6))
    spec = JobSpec(model="mlp", model_options=options, steps=4, batch_size=128, microbatches=2)
    start = StartOptions(method="scalar", coordinator=False, measure_s=0.5)
    with Testbed.up(fleet, scale=1.0, state_dir=state_dir, start=start) as bed:
        assert bed.method == "scalar"
        assert [(d.cpus, d.scalar_cpus) for d in bed.devices] == [(1.0, 1.0), (0.1, 0.5)]
        state = State.load(state_dir)
        assert state is not None
        cpu = Path(state.devices[1]["cgroups"][0])
        quota = int((cpu / "cpu.cfs_quota_us").read_text())
        assert quota / int((cpu / "cpu.cfs_period_us").read_text()) == 0.5  # scalar share
        slow = next(p for p in state.processes if p.name == "agent:slow")
        cmdline = Path(f"/proc/{slow.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--slowdown") + 1] == b"10"  # compute on to 0.1
        assert bed.announced["slow"].details is not None
        assert bed.announced["slow"].details["cpu_quota"] == 0.5
        control = control_for(bed.login())
        try:
            result = run_on_agents(
                spec, plan, control, options=RunOptions(timeout_s=180, access=bed.accounts)
            )
        finally:
            control.close()
    assert leftovers(state) == []
    per_mac = {}
    for stage, st in enumerate(plan.stages):
        compute = sum(r.compute_s for r in result.reports if r.stage == stage and r.step > 0)
        macs = linear_macs("mlp", options, st.start, st.end) * spec.batch_size * (spec.steps - 1)
        per_mac[st.device] = compute / macs
    ratio = per_mac["slow"] / per_mac["fast"]
    print(f"\ncompute s/MAC of 'slow' over 'fast' (FLOPs: 10, scalar: 2): {ratio:.2f}")
    assert 5.0 <= ratio <= 20.0, ratio


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_down_after_a_crashed_up_removes_everything(state_dir: Path) -> None:
    """``up`` SIGKILLed while it waits for its agents: ``down`` works from the state alone."""
    up = subprocess.Popen(
        [
            *CLI,
            "up",
            "--devices",
            "rpi4-4gb,jetson-nano,laptop",
            "--state-dir",
            str(state_dir),
            "--no-coordinator",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def agents_started() -> bool:
            state = State.load(state_dir)
            return (
                state is not None and sum(p.name.startswith("agent:") for p in state.processes) >= 2
            )

        assert until(agents_started, 60), "up never started its agents"
    finally:
        up.kill()
        up.wait(10)
    assert up.stdout is not None
    up.stdout.close()
    state = State.load(state_dir)
    assert state is not None and state.phase == "starting"
    assert any(proc_alive(p.pid, p.start) for p in state.processes)
    second = _cli("up", "--devices", "laptop", "--state-dir", str(state_dir))
    assert second.returncode == 2 and "testbed down" in second.stderr
    gone = _cli("down", "--state-dir", str(state_dir))
    assert gone.returncode == 0, gone.stderr
    assert "removed process broker" in gone.stdout
    assert leftovers(state) == []
    again = _cli("down", "--state-dir", str(state_dir))
    assert again.returncode == 0 and "no testbed left" in again.stdout


def test_down_after_killed_agents_and_proxy(state_dir: Path) -> None:
    """A testbed up through the CLI, then SIGKILLs: status says so, down cleans up."""
    up = _cli(
        "up",
        "--devices",
        "rpi4-4gb,jetson-nano,laptop",
        "--state-dir",
        str(state_dir),
        "--no-coordinator",
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "limits: " in up.stdout and "testbed down" in up.stdout
    assert f"broker accounts: {state_dir / 'broker'} (CA tls/ca.pem)" in up.stdout
    status = _cli("status", "--state-dir", str(state_dir), "--json")
    report = json.loads(status.stdout)
    assert status.returncode == 0 and report["up"], report
    assert [d["state"] for d in report["devices"]] == ["online"] * 3
    state = State.load(state_dir)
    assert state is not None
    # The proxy exists under the kernel method only.
    victims = [p for p in state.processes if p.name in ("proxy", "agent:jetson-nano")]
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    assert until(lambda: not any(proc_alive(p.pid, p.start) for p in victims), 10)
    status = _cli("status", "--state-dir", str(state_dir), "--json")
    assert status.returncode == 1 and not json.loads(status.stdout)["up"]
    gone = _cli("down", "--state-dir", str(state_dir))
    assert gone.returncode == 0, gone.stderr
    assert leftovers(state) == []
    assert _cli("down", "--state-dir", str(state_dir)).returncode == 0


def test_up_prints_the_api_token_that_enrolment_needs(state_dir: Path, tmp_path: Path) -> None:
    """Issue 31: another local process re-enrolled a testbed device through an open API,
    locking its agent out. The coordinator of ``testbed up`` refuses a write without the
    token ``up`` printed; the client commands take it as ``EDGETRAIN_API_TOKEN``."""
    up = _cli("up", "--devices", "laptop", "--method", "software", "--state-dir", str(state_dir))
    assert up.returncode == 0, up.stdout + up.stderr
    printed = re.search(r"^API token: (\S+) ", up.stdout, re.MULTILINE)
    assert printed is not None, up.stdout
    token = printed.group(1)
    assert f"export EDGETRAIN_API_TOKEN={token}\n" in up.stdout
    state = State.load(state_dir)
    assert state is not None and state.api_token == token and state.coordinator_url
    assert stat.S_IMODE(state.path.stat().st_mode) == 0o600
    coordinator = next(p for p in state.processes if p.name == "coordinator")
    # Not on its command line, which any user may read.
    assert token not in Path(f"/proc/{coordinator.pid}/cmdline").read_text()
    laptop = state.devices[0]["id"]
    enrol = "/api/v1/devices/enroll"
    with httpx.Client(base_url=state.coordinator_url, timeout=30) as api:
        for auth in ({}, {"Authorization": f"Bearer {token[:-1]}x"}):
            refused = api.post(enrol, json={"device_id": laptop}, headers=auth)
            assert refused.status_code == 401, refused.text
        auth = {"Authorization": f"Bearer {token}"}
        enrolled = api.post(enrol, json={"device_id": "newcomer"}, headers=auth)
        assert enrolled.status_code == 201, enrolled.text
        assert Credentials(**enrolled.json()).broker == state.broker_url
    status = _cli("status", "--state-dir", str(state_dir), "--json")
    assert [d["state"] for d in json.loads(status.stdout)["devices"]] == ["online"]

    client = [sys.executable, "-m", "edgetrain.cli", "fleet", "enroll", "other", "--out"]
    client += [str(tmp_path / "other.json"), "--coordinator", state.coordinator_url]
    env = {k: v for k, v in os.environ.items() if k != "EDGETRAIN_API_TOKEN"}
    anonymous = subprocess.run(client, capture_output=True, text=True, env=env, timeout=60)
    assert anonymous.returncode == 2 and ": 401: " in anonymous.stderr, anonymous.stderr
    env["EDGETRAIN_API_TOKEN"] = token
    done = subprocess.run(client, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr

    gone = _cli("down", "--state-dir", str(state_dir))
    assert gone.returncode == 0, gone.stderr
    assert leftovers(state) == []
    left = [f for f in state_dir.rglob("*") if f.is_file() and token in f.read_text("latin-1")]
    assert left == []  # down forgets it (the logs stay, without it)


def test_software_method_trains_through_the_coordinator(state_dir: Path) -> None:
    fleet = [device("a", 40, mbps=200), device("b", 20, mbps=100, latency_ms=5), device("c", 20)]
    start = StartOptions(method="software", measure_s=0.3)
    with Testbed.up(fleet, state_dir=state_dir, start=start) as bed:
        assert bed.method == "software"
        assert bed.method_line.startswith("software (duty-cycled compute, token bucket")
        assert "requested" in bed.method_line
        state = State.load(state_dir)
        assert state is not None and not state.cgroups and not state.namespaces
        b = next(p for p in state.processes if p.name == "agent:b")
        argv = Path(f"/proc/{b.pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index("--link-mbps") + 1] == "100"
        assert argv[argv.index("--link-latency-ms") + 1] == "5"
        assert float(argv[argv.index("--slowdown") + 1]) > 1
        credentials = state_dir / "credentials" / "b.json"
        assert argv[argv.index("--credentials") + 1] == str(credentials)
        assert "--insecure" not in argv
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        with api_of(bed) as api:
            body = {
                "model": "mlp",
                "steps": 3,
                "batch_size": 32,
                "microbatches": 2,
                "pin_first": "a",
                "stages": 3,
            }
            created = api.post("/api/v1/jobs", json=body)
            assert created.status_code < 300, created.text
            job = created.json()["id"]
            deadline = time.monotonic() + 90
            while (record := api.get(f"/api/v1/jobs/{job}").json())["state"] not in (
                "completed",
                "failed",
                "cancelled",
            ):
                assert time.monotonic() < deadline, record
                time.sleep(0.3)
        assert record["state"] == "completed", record
        assert record["steps_done"] == 3
        stages = record["plan"]["stages"]
        assert len(stages) == 3 and stages[0]["device"] == "a", stages
        assert {st["device"] for st in stages} == {"a", "b", "c"}
        with api_of(bed) as api:
            assert_only_the_plan_gets_through(bed, api, job)
    assert leftovers(state) == []
