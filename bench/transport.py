"""Throughput of the edgetrain MQTT transport beside plain paho and a raw TCP socket.

For each tensor size (64 KiB, 1 MiB, 16 MiB of fp32) four ways of moving the
same bytes over loopback are timed, in one run, alternating for ``--rounds``
rounds after one untimed warm-up round; each round runs the ways in a rotated
order, so none always follows another (the median is reported):

- ``edgetrain``: ``encode_frame`` (fp32) + ``MqttTransport.send`` -> Mosquitto ->
  the receiver's ``Inbox.deliver`` (decode, checksum) -> ``Inbox.take``;
- ``paho``: a plain paho-mqtt publish of pre-built bytes at QoS 1 -> Mosquitto ->
  a subscriber that queues ``msg.payload``;
- ``paho+frame``: the same, plus ``encode_frame`` before the publish and
  ``decode_frame`` in the subscriber: what the frame format costs without the
  transport, so ``edgetrain`` / ``paho+frame`` is the transport's own overhead;
- ``tcp``: length-prefixed ``sendall`` on one loopback socket, read with ``recv_into``;
- ``edgetrain+tls``: ``edgetrain`` through a second Mosquitto, the one a coordinator
  starts by default (:mod:`coordinator.local.owned`: TLS, an account per device,
  the dynamic-security plugin checking every publish and delivery against ACLs),
  sender and receiver logged in as two enrolled devices granted the topics of
  stages 0 and 1 of a job, as a job's plan grants them. ``x plain`` is
  edgetrain+tls / edgetrain (the target is >= 0.85 at 1 MiB).

For ``edgetrain`` and ``edgetrain+tls`` the bench also counts the CPU time
(user + system) that the sender, the receiver and the broker spent per MiB, and
how many cores they kept busy together. It times AES-256-GCM (the cipher the
brokers negotiate) on 16 KiB records, as TLS seals them, and prints the ceiling
of ``x plain`` on this machine: when the three parties already keep every core
busy without TLS, TLS costs at least four AES-GCM passes per byte (the sender
seals, the broker opens and seals again, the receiver opens), so the ratio
cannot exceed ``plain CPU / (plain CPU + 4 passes)``.

Sender and receiver run in two processes, as on two devices: the receiver in a
child process the bench starts once, the sender in the bench's own. The MQTT
ways use two clients and the same window: at most ``--window-mib`` (and 64
messages) sent but not yet received. Each measurement sends about ``--mib`` MiB
(at least 8 messages) and stops after ``--max-s`` seconds whatever arrived. The
bench starts its own Mosquitto on a free 127.0.0.1 port and stops it by its pid.
MB/s counts tensor bytes (10^6 bytes per MB). ``x paho`` is edgetrain / paho
(the target is >= 0.8), ``x +frame`` is edgetrain / paho+frame: each the median
of the per-round ratios, as the two ways of one round ran seconds apart, under
the same load.

    .venv/bin/python bench/transport.py [--rounds 5] [--mib 256] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from coordinator.local.owned import start_owned_broker
from edge.runtime.allocator import tune_malloc
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.frames import Codec, Kind, decode_frame, encode_frame
from edge.wire.messages import StageAssignment
from edgetrain.cli.signals import exit_on_sigterm

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
HOST = "127.0.0.1"
JOB = "bench"
MICROBATCHES = 8  # frames per step


@contextlib.contextmanager
def mosquitto() -> Iterator[tuple[int, int]]:
    """A Mosquitto on a free loopback port for the block; yields its port and pid."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not os.path.exists(binary):
        sys.exit("mosquitto is not installed (looked on PATH and in /usr/sbin)")
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="edgetrain-bench-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(
            f"listener {port} {HOST}\nallow_anonymous true\npersistence false\n"
            "log_dest stderr\nlog_type error\nmax_queued_messages 10000\n"
            "set_tcp_nodelay true\n"  # as coordinator.local.broker starts it
        )
        with (Path(tmp) / "log").open("wb") as log:
            proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 10
            while True:  # bounded wait until it accepts connections
                with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"mosquitto did not start on port {port}")
                with contextlib.suppress(subprocess.TimeoutExpired):  # the pause checks it lives
                    proc.wait(timeout=0.05)
            yield port, proc.pid
        finally:
            proc.terminate()  # this pid only
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@dataclass
class Receiver:
    """The receiving end of one way, in the receiver process."""

    recv: Callable[[int], bool]  # wait for message i; False when it did not come in time
    close: Callable[[], None]


@dataclass
class Sender:
    """The sending end of one way, in the bench's own process."""

    send: Callable[[int], None]
    close: Callable[[], None]
    ready: Callable[[], None] = lambda: None  # after the receiver is set up
    port: int | None = None  # where the receiver connects, when not to the broker


TLS_LOGINS = "EDGETRAIN_BENCH_TLS_LOGINS"  # env: {"sender": creds, "receiver": creds}


def _edgetrain_settings(port: int, tls: str | None = None) -> MqttSettings:
    if tls is not None:  # a device's credentials, from the bench process's environment
        creds = Credentials.model_validate(json.loads(os.environ[TLS_LOGINS])[tls])
        return creds.settings(max_queued=1024)
    return MqttSettings.model_validate({"url": f"mqtt://{HOST}:{port}", "max_queued": 1024})


@contextlib.contextmanager
def secure_broker() -> Iterator[tuple[int, int]]:
    """The coordinator's default broker for the block (TLS, accounts, ACLs), with a sender
    and a receiver device enrolled and granted stages 0 and 1 of job ``bench``; their
    credentials go to the environment (:data:`TLS_LOGINS`). Yields its port and pid."""
    with tempfile.TemporaryDirectory(prefix="edgetrain-bench-tls-") as tmp:
        owned = start_owned_broker(Path(tmp) / "broker", prefer="mosquitto")
        try:
            assert owned.accounts is not None
            logins = {
                name: owned.accounts.enroll(f"bench-{name}") for name in ("sender", "receiver")
            }
            stages = [
                StageAssignment(
                    job=JOB,
                    stage=s,
                    num_stages=2,
                    start=s,
                    end=s + 1,
                    model="mlp",
                    dataset="digits",
                    steps=1,
                    batch_size=8,
                    microbatches=1,
                )
                for s in range(2)
            ]
            owned.accounts.grant(
                JOB, [(f"bench-{name}", a) for name, a in zip(logins, stages, strict=True)]
            )
            os.environ[TLS_LOGINS] = json.dumps(
                {k: json.loads(c.to_json()) for k, c in logins.items()}
            )
            yield owned.broker.port, owned.broker.pid
        finally:
            owned.stop()


def _edgetrain_receiver(port: int, _size: int, max_s: float, tls: str | None = None) -> Receiver:
    receiver = MqttTransport(_edgetrain_settings(port, tls))
    receiver.connect(10)
    inbox = receiver.attach(JOB, 1)

    def recv(i: int) -> bool:
        step, mb = divmod(i, MICROBATCHES)
        try:
            inbox.take(Kind.ACTIVATION, step, mb, timeout=max_s)
        except TimeoutError:
            return False
        # No forget_before once a step is done, as the runtime does: that would close
        # the inbox to all but two steps, and the bench sends up to 8 steps ahead,
        # which a pipeline never does ([Note: bounded inboxes] in edge.transport.inbox).
        return True

    return Receiver(recv, receiver.close)


def _edgetrain_sender(port: int, size: int, tls: str | None = None) -> Sender:
    sender = MqttTransport(_edgetrain_settings(port, tls))
    sender.connect(10)
    tensor = torch.randn(size // 4)

    def send(i: int) -> None:
        step, mb = divmod(i, MICROBATCHES)
        sender.send(JOB, 1, "fwd", encode_frame(Kind.ACTIVATION, JOB, step, mb, tensor, Codec.FP32))

    return Sender(send, sender.close)


def _paho_client(port: int, name: str) -> mqtt.Client:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"bench-{name}-{os.getpid()}",
        protocol=mqtt.MQTTv311,
    )
    client.max_inflight_messages_set(100)  # as MqttSettings.max_inflight
    client.max_queued_messages_set(1024)
    client.connect(HOST, port, 30)
    client.loop_start()
    return client


def _stop_paho(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def _paho_receiver(port: int, _size: int, max_s: float, frames: bool = False) -> Receiver:
    """Plain paho; with ``frames`` it also decodes the edgetrain frame."""
    received: queue.Queue[Any] = queue.Queue()
    subscribed = threading.Event()
    sub = _paho_client(port, "sub")
    convert = decode_frame if frames else (lambda data: data)
    sub.on_message = lambda _c, _u, msg: received.put(convert(msg.payload))
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.subscribe("bench/plain", qos=1)
    if not subscribed.wait(10):
        raise RuntimeError("plain paho: no SUBACK within 10 s")

    def recv(_i: int) -> bool:
        try:
            received.get(timeout=max_s)
        except queue.Empty:
            return False
        return True

    return Receiver(recv, lambda: _stop_paho(sub))


def _paho_sender(port: int, size: int, frames: bool = False) -> Sender:
    """Plain paho of pre-built bytes; with ``frames`` it encodes a frame per message."""
    pub = _paho_client(port, "pub")
    payload, tensor = bytes(size), torch.randn(size // 4)

    def send(i: int) -> None:
        data = payload
        if frames:
            data = encode_frame(Kind.ACTIVATION, JOB, i, 0, tensor, Codec.FP32)
        if pub.publish("bench/plain", data, qos=1).rc == mqtt.MQTT_ERR_QUEUE_SIZE:
            raise RuntimeError("paho queue full")

    return Sender(send, lambda: _stop_paho(pub))


def _read_exactly(conn: socket.socket, buf: memoryview) -> bool:
    while buf:
        got = conn.recv_into(buf)
        if got == 0:
            return False
        buf = buf[got:]
    return True


def _tcp_receiver(port: int, _size: int, max_s: float) -> Receiver:
    conn = socket.create_connection((HOST, port), timeout=max_s)  # the sender listens

    def recv(_i: int) -> bool:
        head = bytearray(8)
        if not _read_exactly(conn, memoryview(head)):
            return False
        # A fresh buffer per message, as a receiver that keeps what it got.
        return _read_exactly(conn, memoryview(bytearray(int.from_bytes(head, "little"))))

    return Receiver(recv, conn.close)


def _tcp_sender(_port: int, size: int) -> Sender:
    server = socket.create_server((HOST, 0))
    payload, header = bytes(size), size.to_bytes(8, "little")
    conns: list[socket.socket] = []

    def ready() -> None:
        conn, _ = server.accept()
        conns.append(conn)

    def send(_i: int) -> None:
        conns[0].sendall(header)
        conns[0].sendall(payload)

    def close() -> None:
        for conn in conns:
            conn.close()
        server.close()

    return Sender(send, close, ready, int(server.getsockname()[1]))


SENDERS: dict[str, Callable[[int, int], Sender]] = {
    "edgetrain": _edgetrain_sender,
    "paho": _paho_sender,
    "paho+frame": lambda port, size: _paho_sender(port, size, frames=True),
    "tcp": _tcp_sender,
    "edgetrain+tls": lambda port, size: _edgetrain_sender(port, size, tls="sender"),
}
RECEIVERS: dict[str, Callable[[int, int, float], Receiver]] = {
    "edgetrain": _edgetrain_receiver,
    "paho": _paho_receiver,
    "paho+frame": lambda port, size, max_s: _paho_receiver(port, size, max_s, frames=True),
    "tcp": _tcp_receiver,
    "edgetrain+tls": lambda port, size, max_s: _edgetrain_receiver(port, size, max_s, "receiver"),
}


def _receiver_process(conn: Connection, slots: Any) -> None:
    """Serve receive requests from the bench until it sends ``None``.

    Each request ``(method, port, n, size, max_s, window)``: set the receiver up,
    answer ``"ready"``, open the window (release ``window`` slots), then release a
    slot per message received; answer the count and the ``perf_counter`` time of
    the last one (CLOCK_MONOTONIC: the same clock in both processes).
    """
    tune_malloc()  # as an agent process does
    while (request := conn.recv()) is not None:
        method, port, n, size, max_s, window = request
        receiver = RECEIVERS[method](port, size, max_s)
        got, end = 0, time.perf_counter()
        try:
            conn.send("ready")
            deadline = time.perf_counter() + max_s + 5
            for _ in range(window):
                slots.release()
            for i in range(n):
                if not receiver.recv(i) or time.perf_counter() > deadline:
                    break
                got, end = got + 1, time.perf_counter()
                slots.release()
        finally:
            receiver.close()
        conn.send({"messages": got, "end": end})


class Bench:
    """The bench's side: a receiver process, and one measurement at a time."""

    def __init__(self) -> None:
        tune_malloc()  # as an agent process does (edge/runtime/allocator.py)
        ctx = multiprocessing.get_context("spawn")  # no paho threads copied by fork
        self.slots = ctx.Semaphore(0)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_process, args=(child, self.slots), daemon=True)
        self.proc.start()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()  # the child we started

    def measure(
        self,
        method: str,
        port: int,
        n: int,
        size: int,
        max_s: float,
        window: int,
        broker_pid: int | None = None,
    ) -> dict[str, float]:
        """Send ``n`` messages of ``size`` bytes, at most ``window`` not yet received; with
        ``broker_pid``, also the CPU milliseconds per MiB of each party (``cpu_sender``,
        ``cpu_receiver``, ``cpu_broker``)."""
        sender = SENDERS[method](port, size)
        parties = {"sender": os.getpid(), "receiver": self.proc.pid}
        if broker_pid is not None:
            parties["broker"] = broker_pid
        cpu = {name: psutil.Process(pid) for name, pid in parties.items()}
        try:
            self.conn.send((method, sender.port or port, n, size, max_s, window))
            if not self.conn.poll(30) or self.conn.recv() != "ready":
                raise RuntimeError(f"{method}: the receiver did not get ready in 30 s")
            sender.ready()
            cpu_start = {name: _cpu_s(proc) for name, proc in cpu.items()}
            start = time.perf_counter()
            deadline = start + max_s
            for i in range(n):
                while not self.slots.acquire(timeout=0.1):
                    if time.perf_counter() > deadline:
                        break
                else:
                    sender.send(i)
                    continue
                break
            if not self.conn.poll(max_s + 30):
                raise RuntimeError(f"{method}: the receiver did not answer")
            result = self.conn.recv()
            cpu_used = {name: _cpu_s(proc) - cpu_start[name] for name, proc in cpu.items()}
        finally:
            sender.close()
        while self.slots.acquire(block=False):  # the window left open, for the next measurement
            pass
        got, elapsed = result["messages"], max(1e-9, result["end"] - start)
        out = {
            "messages": got,
            "seconds": elapsed,
            "mb_s": got * size / elapsed / 1e6,
            "frames_s": got / elapsed,
        }
        if broker_pid is not None:
            mib = max(1, got) * size / (1 << 20)
            out |= {f"cpu_{name}": used * 1e3 / mib for name, used in cpu_used.items()}
        return out


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system) ``proc`` has used, its threads included."""
    times = proc.cpu_times()
    return times.user + times.system


def aes_gcm_ms_per_mib(mib: int = 64) -> float:
    """Milliseconds of one core to seal 1 MiB with AES-256-GCM in 16 KiB records (TLS's
    largest), through OpenSSL as ``cryptography`` links it: one TLS pass over the bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, record, nonce = AESGCM(os.urandom(32)), os.urandom(16 << 10), os.urandom(12)
    records = mib * 64
    best = float("inf")
    for _ in range(3):  # the best of three: the least disturbed by other processes
        start = time.process_time()
        for _ in range(records):
            aead.encrypt(nonce, record, None)
        best = min(best, time.process_time() - start)
    return best * 1e3 / mib


CPU_WAYS = ("edgetrain", "edgetrain+tls")  # the ways whose CPU per party is counted
PARTIES = ("sender", "receiver", "broker")


METHODS = list(RECEIVERS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rotating rounds; median wins")
    parser.add_argument("--mib", type=float, default=256, help="MiB per measurement")
    parser.add_argument("--max-s", type=float, default=10.0, help="cap on one measurement")
    parser.add_argument("--window-mib", type=float, default=64, help="MiB sent, not yet received")
    parser.add_argument("--sizes", default=",".join(SIZES), help="subset of: " + ", ".join(SIZES))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    sizes = {name: SIZES[name.strip()] for name in args.sizes.split(",")}
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        brokers = {"plain": stack.enter_context(mosquitto())}
        brokers["tls"] = stack.enter_context(secure_broker())  # before the receiver's spawn
        aes_ms = aes_gcm_ms_per_mib()
        bench = Bench()
        stack.callback(bench.close)
        for name, size in sizes.items():
            n = max(24, int(args.mib * (1 << 20)) // size)
            window = max(2, min(64, int(args.window_mib * (1 << 20)) // size))
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            for method in METHODS:  # warm-up: first connections, allocations, caches
                port, _pid = brokers["tls" if method.endswith("+tls") else "plain"]
                bench.measure(method, port, max(8, n // 8), size, args.max_s, window)
            order = list(METHODS)
            for i in range(args.rounds):
                for method in order[i % len(order) :] + order[: i % len(order)]:
                    port, pid = brokers["tls" if method.endswith("+tls") else "plain"]
                    watch = pid if method in CPU_WAYS else None
                    runs[method].append(
                        bench.measure(method, port, n, size, args.max_s, window, watch)
                    )
            row: dict[str, Any] = {"bytes": size, "messages": n, "window": window}
            for method, got in runs.items():
                row[method] = {
                    "mb_s": statistics.median(r["mb_s"] for r in got),
                    "frames_s": statistics.median(r["frames_s"] for r in got),
                    "all_mb_s": [round(r["mb_s"], 1) for r in got],
                    "complete": all(r["messages"] == n for r in got),
                }
            for way in CPU_WAYS:
                ms = {p: statistics.median(r[f"cpu_{p}"] for r in runs[way]) for p in PARTIES}
                total = sum(ms.values())
                cores = statistics.median(
                    sum(r[f"cpu_{p}"] for p in PARTIES) * r["mb_s"] * 1.048576e-3 for r in runs[way]
                )
                row[way]["cpu_ms_per_mib"] = {**ms, "total": total, "cores_busy": cores}
            plain_cpu = row["edgetrain"]["cpu_ms_per_mib"]["total"]
            row["tls_ceiling"] = plain_cpu / (plain_cpu + 4 * aes_ms)
            for key, way, other in (
                ("ratio", "edgetrain", "paho"),
                ("ratio_frame", "edgetrain", "paho+frame"),
                ("ratio_tls", "edgetrain+tls", "edgetrain"),
            ):
                pairs = zip(runs[way], runs[other], strict=True)
                row[key] = statistics.median(a["mb_s"] / b["mb_s"] for a, b in pairs)
            results[name] = row
    if args.json:
        out = {
            "rounds": args.rounds,
            "cpus": os.cpu_count(),
            "aes_256_gcm_ms_per_mib": aes_ms,
            "sizes": results,
        }
        print(json.dumps(out, indent=2))
        return 0
    head = f"{'size':>7} {'method':>13} {'MB/s':>8} {'frames/s':>9} {'x paho':>6} {'x +frame':>8}"
    print(f"{head}  rounds (MB/s)")
    for name, row in results.items():
        for method in METHODS:
            r = row[method]
            ratios = f"{row['ratio']:>6.2f} {row['ratio_frame']:>8.2f}"
            if method == "edgetrain+tls":
                ratios = f"{'x plain':>6} {row['ratio_tls']:>8.2f}"
            ratios = ratios if method in ("edgetrain", "edgetrain+tls") else " " * 15
            done = "" if r["complete"] else "  (incomplete: hit --max-s)"
            print(
                f"{name:>7} {method:>13} {r['mb_s']:>8.1f} {r['frames_s']:>9.1f} {ratios}  "
                f"{r['all_mb_s']}{done}"
            )
    print(f"\nCPU ms per MiB (user + system); AES-256-GCM: {aes_ms:.2f} ms per MiB per pass")
    print(
        f"{'size':>7} {'method':>13} {'sender':>7} {'receiver':>8} {'broker':>7} {'total':>6} cores"
    )
    for name, row in results.items():
        for method in CPU_WAYS:
            c = row[method]["cpu_ms_per_mib"]
            print(
                f"{name:>7} {method:>13} {c['sender']:>7.2f} {c['receiver']:>8.2f} "
                f"{c['broker']:>7.2f} {c['total']:>6.2f} {c['cores_busy']:>5.2f}"
            )
        print(
            f"{'':>7} {'x plain':>13} at most {row['tls_ceiling']:.2f} with {os.cpu_count()} cores "
            f"busy: plain's CPU over plain's + 4 AES passes (measured {row['ratio_tls']:.2f})"
        )
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
