"""A throwaway Mosquitto broker on a free loopback port, for tests and benchmarks.

:func:`mosquitto_broker` writes its own config to a temporary directory, starts
``mosquitto -c CONF``, waits (bounded) until the port accepts connections, and at
exit ends that process by its own pid: SIGTERM, then SIGKILL after a grace period.
Started as root, Mosquitto drops to the ``mosquitto`` user, so it logs to stdout
(captured in a file the parent opened) rather than to a file of its own.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["Broker", "BrokerStartError", "find_mosquitto", "free_port", "mosquitto_broker"]

_FALLBACK = Path("/usr/sbin/mosquitto")


class BrokerStartError(RuntimeError):
    """Mosquitto did not start or did not listen in time; the message holds its log."""


@dataclass(frozen=True)
class Broker:
    host: str
    port: int
    url: str
    """``mqtt://host:port``, what ``--broker`` options take."""
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """What Mosquitto has written so far."""
        return self.log_path.read_text(errors="replace")


def find_mosquitto() -> str | None:
    """The mosquitto binary: on PATH, else ``/usr/sbin/mosquitto``; ``None`` if absent."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return str(_FALLBACK) if _FALLBACK.is_file() else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _listening(proc: subprocess.Popen[bytes], host: str, port: int) -> bool:
    """Whether ``proc`` itself listens on ``port``: another process on that port does not count."""
    try:
        conns = psutil.Process(proc.pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:  # exited (or a zombie): the caller reads its status
        return False
    except psutil.AccessDenied:  # not allowed to look: fall back to "something answers there"
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM to this pid only
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def _start(binary: str, host: str, port: int, tmp: Path, timeout_s: float) -> Broker:
    conf = tmp / f"mosquitto-{port}.conf"
    conf.write_text(
        f"listener {port} {host}\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "log_dest stdout\n"
        "log_type error\nlog_type warning\nlog_type notice\n"
    )
    log_path = tmp / f"mosquitto-{port}.log"
    with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [binary, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    broker = Broker(host, port, f"mqtt://{host}:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not _listening(proc, host, port):
        if proc.poll() is not None:
            raise BrokerStartError(
                f"mosquitto exited with status {proc.returncode} before listening "
                f"on {host}:{port}:\n{broker.log()}"
            )
        if time.monotonic() > deadline:
            _stop(proc, 5.0)
            raise BrokerStartError(
                f"mosquitto did not listen on {host}:{port} within {timeout_s:g} s:\n{broker.log()}"
            )
        # The pause between tries doubles as a check that the process is still alive.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
    return broker


@contextmanager
def mosquitto_broker(
    port: int | None = None, *, start_timeout_s: float = 10.0, grace_s: float = 5.0
) -> Iterator[Broker]:
    """Run Mosquitto on ``127.0.0.1:port`` for the block; ``None`` picks a free port.

    A picked port can be taken by another process before Mosquitto binds it (tests
    run in parallel on shared machines), so then up to three ports are tried.
    """
    binary = find_mosquitto()
    if binary is None:
        raise FileNotFoundError("mosquitto is not installed (looked on PATH and in /usr/sbin)")
    host = "127.0.0.1"
    with tempfile.TemporaryDirectory(prefix="edgetrain-mosquitto-") as tmp:
        for attempt in range(1 if port else 3):
            try:
                broker = _start(binary, host, port or free_port(host), Path(tmp), start_timeout_s)
                break
            except BrokerStartError as exc:
                if port or attempt == 2 or "Address already in use" not in str(exc):
                    raise
        try:
            yield broker
        finally:
            _stop(broker.proc, grace_s)
