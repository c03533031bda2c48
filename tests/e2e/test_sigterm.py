"""SIGTERM to a command (or a bench) that started a broker and agents ends them all, as
Ctrl-C does.

Each test starts the command as a process of its own and waits until the processes
it started exist, found as its children with psutil (Mosquitto and the agents), and,
for the commands that train, until an agent has reported a step: a line in the
agent's log, which :class:`~coordinator.local.fleet.LocalFleet` keeps beside the
agent's data directory. Then it sends SIGTERM to the command alone and checks that
the command exits with 143 and that every one of those children is gone within a
bounded time. Only processes a test started are ever signalled, by their pids.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.local.broker import free_port
from edgetrain.cli.signals import TERMINATED

pytestmark = needs_mosquitto

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--steps", "100000"]  # still training when the signal comes


@dataclass
class Command:
    """A command this test started, the file of its standard error, and the children it
    was seen with."""

    proc: subprocess.Popen[bytes]
    stderr: Path
    children: list[psutil.Process] = field(default_factory=list)

    def tail(self, chars: int = 3000) -> str:
        return self.stderr.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def _command(tmp_path: Path, *args: str, script: str | None = None) -> Iterator[Command]:
    """``edgetrain ARGS`` (or ``python SCRIPT ARGS``); whatever of it and of its children a
    failed test left running is killed, by pid."""
    stderr = tmp_path / "stderr"
    program = [str(ROOT / script)] if script is not None else ["-m", "edgetrain.cli"]
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *program, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    cmd = Command(proc, stderr)
    try:
        yield cmd
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for child in cmd.children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _kind(p: psutil.Process) -> str:
    try:
        cmdline = p.cmdline()
    except psutil.NoSuchProcess:
        return "gone"
    if not cmdline:  # a zombie: a broker that failed to bind a port, before it is reaped
        return "gone"
    if Path(cmdline[0]).name == "mosquitto":
        return "mosquitto"
    return "agent" if cmdline[3:4] == ["agent"] else "other"


def _started(cmd: Command, agents: int) -> list[psutil.Process]:
    """The command's agents, once its children are one Mosquitto and ``agents`` agents."""
    parent = psutil.Process(cmd.proc.pid)
    want = sorted(["mosquitto"] + ["agent"] * agents)

    def started() -> bool:
        cmd.children = parent.children(recursive=True)
        return sorted(_kind(p) for p in cmd.children) == want

    assert until(started, 120, 0.2), cmd.tail()
    return [p for p in cmd.children if _kind(p) == "agent"]


def _stepped(agent: psutil.Process) -> bool:
    cmdline = agent.cmdline()
    log = Path(cmdline[cmdline.index("--data-dir") + 1] + ".log")
    return log.exists() and "step done" in log.read_text(errors="replace")


def _terminate(cmd: Command) -> None:
    """SIGTERM the command: none of its children is left running, and it exits 143."""
    cmd.proc.send_signal(signal.SIGTERM)
    try:
        status = cmd.proc.wait(90)
    except subprocess.TimeoutExpired:  # its threads' stacks are on stderr by now (signals.py)
        pytest.fail(f"no exit within 90 s of SIGTERM:\n{cmd.tail(30_000)}")
    _gone, alive = psutil.wait_procs(cmd.children, timeout=15)
    assert alive == [], [(p.pid, _kind(p)) for p in alive]
    assert status == TERMINATED, cmd.tail()


@pytest.mark.slow
def test_sigterm_to_train_stops_its_broker_and_agents(tmp_path: Path) -> None:
    args = ["train", "--model", "mlp", *STEPS, "--batch-size", "16", "--microbatches", "4"]
    args += ["--threads", "1", "--devices", "2", "--partition", "even", "--json"]
    with _command(tmp_path, *args) as cmd:
        agents = _started(cmd, 2)
        assert until(lambda: all(_stepped(a) for a in agents), 120), cmd.tail()
        _terminate(cmd)


@pytest.mark.slow
def test_sigterm_to_demo_stops_its_broker_and_agents(tmp_path: Path) -> None:
    fleet = "rpi5-8gb,rpi5-8gb,rpi5-8gb,laptop"  # three data holders and a helper
    args = ["demo", "--fleet", fleet, *STEPS, "--port", str(free_port())]
    with _command(tmp_path, *args) as cmd:
        agents = _started(cmd, 4)
        assert until(lambda: any(_stepped(a) for a in agents), 120), cmd.tail()
        _terminate(cmd)


def test_sigterm_to_coordinator_stops_its_broker(tmp_path: Path) -> None:
    args = ["coordinator", "--port", str(free_port()), "--data-dir", str(tmp_path / "data")]
    with _command(tmp_path, *args) as cmd:
        _started(cmd, 0)
        assert until(lambda: "Application startup complete" in cmd.stderr.read_text(), 60)
        _terminate(cmd)


def test_sigterm_to_a_bench_stops_its_broker(tmp_path: Path) -> None:
    """A bench that starts a Mosquitto (here the group sum's, run for far more steps than
    the test waits) ends it on SIGTERM: the benches install the same handler."""
    with _command(tmp_path, "--steps", "100000", script="bench/group_reduce.py") as cmd:
        _started(cmd, 0)
        _terminate(cmd)
