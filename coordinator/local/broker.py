"""The MQTT broker a command starts when none is given, and the one tests start.

This module owns starting and stopping a broker this process is responsible for,
bound to 127.0.0.1 only:

- **Mosquitto** when the binary exists (on PATH, else ``/usr/sbin/mosquitto``):
  its own config in a temporary directory, its output in a log file the parent
  opened (started as root it drops to the ``mosquitto`` user, so it writes no
  file itself), ready once *that* process listens on the port, ended by its own
  pid: SIGTERM, then SIGKILL after a grace period.
  With a :class:`BrokerSecurity` it listens with TLS only and loads the
  dynamic-security plugin (:mod:`coordinator.access`): no anonymous client.
- **amqtt**, embedded, otherwise: on its own asyncio event loop in a dedicated
  thread so synchronous callers can use it; no plugins that write files;
  ``stop()`` shuts it down and joins the thread. Anonymous and plain, or with a
  :class:`BrokerSecurity` TLS-only with the same accounts and rules, enforced by
  plugins of its own (:mod:`coordinator.local.amqtt_embedded`) and changed through
  :attr:`AmqttBroker.tables`.

:func:`start_broker` returns a :class:`RunningBroker`; :func:`running_broker` is
the context-manager form. ``tests/support/mosquitto.py`` wraps this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import importlib.metadata
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import psutil

from edge.errors import UserError, needs_coordinator_extras

if TYPE_CHECKING:
    from coordinator.access.certs import BrokerTls
    from coordinator.access.dynsec_tables import DynSecTables
    from coordinator.local.amqtt_embedded import EmbeddedBroker

__all__ = [
    "HOST",
    "MOSQUITTO_FALLBACK",
    "AmqttBroker",
    "BrokerKind",
    "BrokerSecurity",
    "BrokerStartError",
    "MosquittoBroker",
    "RunningBroker",
    "find_mosquitto",
    "free_port",
    "running_broker",
    "start_broker",
    "write_mosquitto_config",
]

HOST = "127.0.0.1"
MOSQUITTO_FALLBACK = Path("/usr/sbin/mosquitto")
BrokerKind = Literal["mosquitto", "amqtt"]
_ATTEMPTS = 3  # ports tried when the picked one is taken before the broker binds it


_DYNSEC_PLUGIN = "mosquitto_dynamic_security.so"
_PLUGIN_DIRS = ("/usr/lib/*", "/usr/lib", "/usr/local/lib", "/usr/lib/mosquitto", "/opt/*/lib")


class BrokerStartError(RuntimeError):
    """The broker did not start or did not listen in time; the message holds its log."""


@dataclass(frozen=True)
class BrokerSecurity:
    """How a secure broker starts: its TLS files, and the dynamic-security plugin's
    file (accounts and roles, :meth:`coordinator.access.accounts.BrokerAccounts.plugin_config`)."""

    tls: BrokerTls
    plugin_config: dict[str, Any]


def find_dynsec_plugin() -> str | None:
    """Mosquitto's dynamic-security plugin (Debian: ``/usr/lib/<arch>/``), or ``None``."""
    for pattern in _PLUGIN_DIRS:
        found = sorted(glob.glob(f"{pattern}/{_DYNSEC_PLUGIN}"))
        if found:
            return found[0]
    return None


def find_mosquitto() -> str | None:
    """The mosquitto binary: on PATH, else ``/usr/sbin/mosquitto``; ``None`` if absent."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return str(MOSQUITTO_FALLBACK) if MOSQUITTO_FALLBACK.is_file() else None


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@functools.lru_cache(maxsize=8)
def _mosquitto_version(binary: str) -> str:
    """``2.0.11`` from ``mosquitto -h`` (its first line); ``""`` if it says nothing usable."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=5).stdout
        words = (out.splitlines() or [""])[0].split()  # "mosquitto version 2.0.11"
        return words[2] if words[1:2] == ["version"] and len(words) > 2 else ""
    return ""


class RunningBroker:
    """A broker this process started and must stop; ``stop()`` is idempotent."""

    kind: ClassVar[BrokerKind]

    def __init__(
        self, name: str, port: int, pid: int, log_path: Path | None, tls: bool = False
    ) -> None:
        self.name = name  # what and which version, e.g. "mosquitto 2.0.11"
        self.host = HOST
        self.tls = tls
        self.port = port
        self.pid = pid  # the process that holds the listening socket
        self.log_path = log_path
        self._stopped = False

    @property
    def url(self) -> str:
        """``mqtt://host:port`` (``mqtts://`` with TLS), what ``--broker`` options take."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def describe(self) -> str:
        """One line naming the broker and where it listens."""
        return f"{self.name} on {self.url} (pid {self.pid})"

    def log(self) -> str:
        """What the broker has logged to its file so far (``""`` when it has none)."""
        path = self.log_path
        return path.read_text(errors="replace") if path is not None and path.exists() else ""

    def stop(self, grace_s: float = 5.0) -> None:
        """End the broker and wait for it; a second call does nothing."""
        if not self._stopped:
            self._stopped = True
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        raise NotImplementedError

    def __enter__(self) -> RunningBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MosquittoBroker(RunningBroker):
    """A ``mosquitto -c CONF`` child process; its config lives in a directory it removes."""

    kind: ClassVar[BrokerKind] = "mosquitto"

    def __init__(
        self,
        port: int,
        proc: subprocess.Popen[bytes],
        log_path: Path,
        conf_path: Path,
        name: str,
        tls: bool = False,
    ) -> None:
        super().__init__(name, port, proc.pid, log_path, tls)
        self.proc = proc
        self.conf_path = conf_path

    def _stop(self, grace_s: float) -> None:
        try:
            _stop_process(self.proc, grace_s)
        finally:
            shutil.rmtree(self.conf_path.parent, ignore_errors=True)


class AmqttBroker(RunningBroker):
    """An embedded amqtt broker on its own event loop in a background thread
    (:mod:`coordinator.local.amqtt_embedded`)."""

    kind: ClassVar[BrokerKind] = "amqtt"

    def __init__(
        self,
        port: int,
        thread: threading.Thread,
        done: asyncio.Future[None],
        tables: DynSecTables | None = None,
    ) -> None:
        version = importlib.metadata.version("amqtt")
        super().__init__(f"amqtt {version} (embedded)", port, os.getpid(), None, tables is not None)
        self.thread = thread
        self.tables = tables
        """With security: its accounts and rules, changed in place (what
        :class:`~coordinator.access.dynsec.DynSec` does over MQTT for Mosquitto)."""
        self._done = done  # set on the broker's loop to end it

    def _stop(self, grace_s: float) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._done.get_loop().call_soon_threadsafe(_set_done, self._done)
        self.thread.join(timeout=grace_s + 5.0)
        if self.thread.is_alive():
            raise RuntimeError(f"amqtt broker thread did not end within {grace_s + 5.0:g} s")


def _set_done(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


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


def _stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM to this pid only
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


MAX_PACKET = 268_435_455
"""MQTT's own ceiling on a packet (its remaining length): a broker limited to it has no
limit of its own (see [Note: the broker's packet limit])."""

# [Note: the broker's packet limit]
# A broker started here takes anything MQTT can carry: tensor frames and stage states
# are large (edge.transport.mqtt sends payloads up to MAX_PACKET less 1 KiB). One started
# for a job takes that job's largest message (coordinator.engine.spec.largest_message_bytes,
# at most MAX_PACKET; Mosquitto 2.0.11 refuses a packet whose remaining length + 1
# exceeds it). Mosquitto announces ``max_packet_size`` to MQTT v5 clients in CONNACK
# (Maximum Packet Size), and paho-mqtt 2.2 takes a value over 268,435,455 for a malformed
# packet and drops the connection ("Protocol error"), although MQTT v5 allows any
# non-zero four-byte value and the largest packet is 268,435,460 bytes. So MQTT's own
# limit is written as no ``max_packet_size`` (Mosquitto's default: no limit but MQTT's,
# nothing announced), and a job's, always below it, as itself. The embedded amqtt broker
# has no limit of its own (and speaks MQTT 3.1.1 only: coordinator.local.amqtt_embedded).


def _mosquitto_conf(
    port: int,
    password_file: Path | None,
    secure: Path | None = None,
    bind: str = HOST,
    max_packet: int = MAX_PACKET,
) -> str:
    auth = f"false\npassword_file {password_file}" if password_file else "true"
    tls = ""
    if secure is not None:  # the files _secure_files put there
        auth = "false"
        tls = (
            f"certfile {secure / 'server.pem'}\nkeyfile {secure / 'server.key'}\n"
            f"plugin {find_dynsec_plugin()}\nplugin_opt_config_file {secure / 'dynsec.json'}\n"
        )
    return (
        f"listener {port} {bind}\n"
        f"{tls}"
        f"allow_anonymous {auth}\n"
        "persistence false\n"
        # Nagle off: see [Note: no Nagle] in edge.transport.mqtt.
        "set_tcp_nodelay true\n"
        # stderr, unlike stdout, is unbuffered: the log file is current while it runs.
        "log_dest stderr\n"
        "log_type error\nlog_type warning\nlog_type notice\n"
        # Pipelines queue many QoS 1 frames per client; the default (1000) drops them.
        "max_queued_messages 10000\n"
        # See [Note: the broker's packet limit].
        + (f"max_packet_size {max_packet}\n" if max_packet < MAX_PACKET else "")
    )


def _give_to_mosquitto(tmp: Path, *files: Path) -> None:
    """Started as root, Mosquitto reads (and the plugin rewrites) its files as the
    ``mosquitto`` user: hand them over, and let it pass through ``tmp``."""
    for path in files:
        path.chmod(0o600)
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):  # no such user: mosquitto stays root
            user = pwd.getpwnam("mosquitto")
            for path in files:
                os.chown(path, user.pw_uid, user.pw_gid)
            tmp.chmod(0o711)  # its user may pass through to the copy, not list the directory


def _secure_files(security: BrokerSecurity, tmp: Path) -> Path:
    """Private copies of the TLS files and the plugin's file, for Mosquitto's user."""
    if find_dynsec_plugin() is None:
        raise UserError(
            f"mosquitto's dynamic-security plugin ({_DYNSEC_PLUGIN}) is not installed; "
            "it comes with Debian's mosquitto package"
        )
    copies = [tmp / "server.pem", tmp / "server.key", tmp / "dynsec.json"]
    try:
        shutil.copyfile(security.tls.cert, copies[0])
        shutil.copyfile(security.tls.key, copies[1])
    except OSError as exc:
        raise UserError(f"broker TLS: cannot read {exc.filename}: {exc.strerror}") from exc
    copies[2].write_text(json.dumps(security.plugin_config))
    _give_to_mosquitto(tmp, *copies)
    return tmp


def write_mosquitto_config(
    directory: Path,
    port: int,
    security: BrokerSecurity | None = None,
    *,
    bind: str = HOST,
    max_packet: int = MAX_PACKET,
) -> Path:
    """The config of a Mosquitto started elsewhere (the testbed's detached broker), written
    in ``directory`` (a new one of its own: the caller removes it once that broker ended),
    with ``security``'s files copied there for Mosquitto's user as :func:`start_broker`
    does; the config's path."""
    secure = _secure_files(security, directory) if security is not None else None
    conf = directory / "mosquitto.conf"
    conf.write_text(_mosquitto_conf(port, None, secure, bind, max_packet))
    return conf


def _readable_copy(password_file: Path, tmp: Path) -> Path:
    """A private copy Mosquitto can read: it loads the file after dropping to its user."""
    copy = tmp / "passwd"
    try:
        shutil.copyfile(password_file, copy)
    except OSError as exc:
        raise UserError(f"cannot read password file {password_file}: {exc.strerror}") from exc
    _give_to_mosquitto(tmp, copy)
    return copy


def _start_mosquitto_once(
    binary: str,
    port: int,
    tmp: Path,
    log_dir: Path,
    config: Callable[[int], str],
    timeout_s: float,
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start Mosquitto on ``port`` with the ``config(port)`` written in ``tmp``, logging into
    ``log_dir``, and wait (at most ``timeout_s``) until it listens."""
    conf = tmp / f"mosquitto-{port}.conf"
    conf.write_text(config(port))
    log_path = log_dir / f"mosquitto-{port}.log"
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [binary, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _listening(proc, HOST, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                what = (
                    f"did not listen on {HOST}:{port} within {timeout_s:g} s"
                    if proc.poll() is None
                    else f"exited with status {proc.returncode} before listening on {HOST}:{port}"
                )
                said = log_path.read_text(errors="replace")
                raise BrokerStartError(f"mosquitto {what}:\n{said}")
            # The pause between tries doubles as a check that the process is still alive.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    except BaseException:  # a failed start, or SIGTERM/Ctrl-C while waiting: no orphan
        _stop_process(proc, 5.0)
        raise
    return proc, conf, log_path


def _start_mosquitto(
    binary: str,
    port: int | None,
    log_dir: Path | None,
    pw_file: Path | None,
    timeout_s: float,
    security: BrokerSecurity | None = None,
    bind: str = HOST,
    max_packet: int = MAX_PACKET,
) -> MosquittoBroker:
    # The config (and a password copy) live in a directory of the broker's own, removed at
    # stop; the log goes to log_dir when one is given, so that it outlives the broker.
    tmp = Path(tempfile.mkdtemp(prefix="edgetrain-mosquitto-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        passwords = _readable_copy(pw_file, tmp) if pw_file is not None else None
        secure = _secure_files(security, tmp) if security is not None else None
        for attempt in range(1 if port else _ATTEMPTS):
            chosen = port or free_port(HOST)
            try:
                proc, conf, log_path = _start_mosquitto_once(
                    binary,
                    chosen,
                    tmp,
                    log_dir or tmp,
                    lambda at: _mosquitto_conf(at, passwords, secure, bind, max_packet),
                    timeout_s,
                )
                break
            except BrokerStartError as exc:
                taken = "Address already in use" in str(exc)
                if port or attempt == _ATTEMPTS - 1 or not taken:
                    raise
        version = _mosquitto_version(binary)
    except BaseException:
        if proc is not None:  # started, then interrupted (SIGTERM while asking its version)
            _stop_process(proc, 5.0)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert proc is not None  # the loop either started one or raised
    name = f"mosquitto {version}" if version else "mosquitto"
    return MosquittoBroker(chosen, proc, log_path, conf, name, tls=security is not None)


def _start_amqtt(
    port: int | None,
    timeout_s: float,
    security: BrokerSecurity | None = None,
    bind: str = HOST,
) -> AmqttBroker:
    # Imported late: only this path needs it, and a device install has no amqtt.
    with needs_coordinator_extras("with no mosquitto installed, the embedded broker"):
        from coordinator.local.amqtt_embedded import EmbeddedBroker, broker_config
    from coordinator.access.dynsec_tables import DynSecTables

    tables = DynSecTables(security.plugin_config) if security is not None else None
    config = broker_config(bind, port or 0, security, tables)
    loop = asyncio.new_event_loop()
    done: asyncio.Future[None] = loop.create_future()  # set (from any thread) to stop
    ready: Future[int] = Future()

    async def serve() -> None:
        try:
            broker = EmbeddedBroker(config, loop=loop)
            await broker.start()
            if tables is not None:
                tables.on_kick = functools.partial(_kick, broker, loop)
            server = broker._servers["default"].instance
            bound = int(next(iter(server.sockets)).getsockname()[1])
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(bound)
        try:
            await done
        finally:
            await broker.shutdown()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
            # As asyncio.run does: end what is left (a client mid-disconnect) before closing.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="edgetrain-amqtt-broker", daemon=True)
    thread.start()
    try:
        bound = ready.result(timeout=timeout_s)
    except Exception as exc:
        with contextlib.suppress(RuntimeError):  # still starting: stop once started
            loop.call_soon_threadsafe(_set_done, done)
        thread.join(timeout=5.0)
        raise BrokerStartError(f"amqtt broker did not start on {bind}:{port or 0}: {exc}") from exc
    return AmqttBroker(bound, thread, done, tables)


def _kick(broker: EmbeddedBroker, loop: asyncio.AbstractEventLoop, usernames: list[str]) -> None:
    """Disconnect ``usernames`` now (from the coordinator's threads: wait until done)."""
    kicked = asyncio.run_coroutine_threadsafe(broker.kick(usernames), loop)
    with contextlib.suppress(RuntimeError):  # asyncio.get_running_loop: none in this thread
        if asyncio.get_running_loop() is loop:
            return  # on the broker's own loop: it runs once this returns
    kicked.result(timeout=10.0)


def start_broker(
    prefer: str = "auto",
    port: int | None = None,
    log_dir: Path | None = None,
    *,
    password_file: Path | None = None,
    security: BrokerSecurity | None = None,
    bind: str = HOST,
    max_packet: int = MAX_PACKET,
    start_timeout_s: float = 10.0,
) -> RunningBroker:
    """Start a broker on ``127.0.0.1:port`` (``None``: a free port) and return it.

    ``prefer``: ``"auto"`` (Mosquitto if installed, else embedded amqtt),
    ``"mosquitto"`` or ``"amqtt"``. ``log_dir`` keeps Mosquitto's log
    (default: next to its config, in a directory ``stop()`` removes); amqtt logs via
    Python's ``logging`` (logger ``amqtt``). ``password_file`` (Mosquitto only,
    a ``mosquitto_passwd`` file) turns anonymous access off; ``security``
    makes it TLS-only with the dynamic-security plugin's accounts (amqtt: the same
    accounts and rules in its own plugins). ``bind`` (Mosquitto, or amqtt with
    ``security``) is the address it listens on (``0.0.0.0``: every interface);
    this process reaches it on 127.0.0.1 either way. ``max_packet``
    (Mosquitto only): the largest message it takes; a client that sends a larger
    one is disconnected.
    """
    if prefer not in ("auto", "mosquitto", "amqtt"):
        raise UserError(f"unknown broker {prefer!r}: expected auto, mosquitto or amqtt")
    binary = find_mosquitto() if prefer != "amqtt" else None
    if prefer == "mosquitto" and binary is None:
        raise UserError(
            f"mosquitto is not installed (looked on PATH and at {MOSQUITTO_FALLBACK}); "
            "install it or use the embedded broker (amqtt)"
        )
    if binary is not None:
        return _start_mosquitto(
            binary, port, log_dir, password_file, start_timeout_s, security, bind, max_packet
        )
    if password_file is not None:
        raise UserError(
            "a password file needs mosquitto; the embedded amqtt broker takes accounts as "
            "security (BrokerSecurity)"
        )
    return _start_amqtt(port, start_timeout_s, security, bind if security is not None else HOST)


@contextmanager
def running_broker(
    prefer: str = "auto",
    port: int | None = None,
    log_dir: Path | None = None,
    *,
    password_file: Path | None = None,
    security: BrokerSecurity | None = None,
    start_timeout_s: float = 10.0,
    grace_s: float = 5.0,
) -> Iterator[RunningBroker]:
    """:func:`start_broker` for the block; the broker is stopped when it ends."""
    broker = start_broker(
        prefer,
        port,
        log_dir,
        password_file=password_file,
        security=security,
        start_timeout_s=start_timeout_s,
    )
    try:
        yield broker
    finally:
        broker.stop(grace_s)
