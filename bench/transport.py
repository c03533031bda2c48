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
- ``tcp``: length-prefixed ``sendall`` on one loopback socket, read with ``recv_into``.

The MQTT ways use two clients (a sender and a receiver, as two devices would)
and the same window: at most ``--window-mib`` (and 64 messages) sent but not yet
received. Each measurement sends about ``--mib`` MiB (at least 8 messages) and
stops after ``--max-s`` seconds whatever arrived. The bench starts its own
Mosquitto on a free 127.0.0.1 port and stops it by its pid. MB/s counts tensor
bytes (10^6 bytes per MB). ``x paho`` is edgetrain / paho (the target is >= 0.8),
``x +frame`` is edgetrain / paho+frame: each the median of the per-round ratios,
as the two ways of one round ran seconds apart, under the same load.

    .venv/bin/python bench/transport.py [--rounds 5] [--mib 256] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from edge.protocol import Codec, Kind, decode_frame, encode_frame
from edge.transport.mqtt import MqttSettings, MqttTransport

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
HOST = "127.0.0.1"
JOB = "bench"
MICROBATCHES = 8  # frames per step: the inbox forgets a step's keys once it is done


@contextlib.contextmanager
def mosquitto() -> Iterator[int]:
    """A Mosquitto on a free loopback port for the block; yields the port."""
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
            yield port
        finally:
            proc.terminate()  # this pid only
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _timed(
    n: int,
    size: int,
    max_s: float,
    send: Callable[[int], None],
    recv: Callable[[int], bool],
    window: int,
) -> dict[str, float]:
    """Send ``n`` messages from a thread, receive them here; at most ``window`` outstanding."""
    slots = threading.Semaphore(window)
    stop = threading.Event()
    error: list[BaseException] = []

    def sender() -> None:
        try:
            for i in range(n):
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                send(i)
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    start = time.perf_counter()
    deadline = start + max_s
    thread.start()
    got = 0
    for i in range(n):
        if not recv(i) or time.perf_counter() > deadline or error:
            break
        got += 1
        slots.release()
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join(10)
    if error:
        raise error[0]
    mb_s, frames_s = got * size / elapsed / 1e6, got / elapsed
    return {"messages": got, "seconds": elapsed, "mb_s": mb_s, "frames_s": frames_s}


def run_edgetrain(port: int, n: int, size: int, max_s: float, window: int) -> dict[str, float]:
    settings = {"url": f"mqtt://{HOST}:{port}", "max_queued": 1024}
    sender = MqttTransport(MqttSettings.model_validate(settings))
    receiver = MqttTransport(MqttSettings.model_validate(settings))
    try:
        sender.connect(10)
        receiver.connect(10)
        inbox = receiver.attach(JOB, 1)
        tensor = torch.randn(size // 4)

        def send(i: int) -> None:
            step, mb = divmod(i, MICROBATCHES)
            frame = encode_frame(Kind.ACTIVATION, JOB, step, mb, tensor, Codec.FP32)
            sender.send(JOB, 1, "fwd", frame)

        def recv(i: int) -> bool:
            step, mb = divmod(i, MICROBATCHES)
            try:
                inbox.take(Kind.ACTIVATION, step, mb, timeout=max_s)
            except TimeoutError:
                return False
            if mb == MICROBATCHES - 1:
                inbox.forget_before(step + 1)  # what the runtime does once a step is done
            return True

        return _timed(n, size, max_s, send, recv, window)
    finally:
        sender.close()
        receiver.close()


def _paho_client(port: int, name: str, inflight: int) -> mqtt.Client:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"bench-{name}-{os.getpid()}",
        protocol=mqtt.MQTTv311,
    )
    client.max_inflight_messages_set(inflight)
    client.max_queued_messages_set(1024)
    client.connect(HOST, port, 30)
    client.loop_start()
    return client


def run_paho(
    port: int, n: int, size: int, max_s: float, window: int, frames: bool = False
) -> dict[str, float]:
    """Plain paho; with ``frames`` it also encodes and decodes the edgetrain frame."""
    received: queue.Queue[Any] = queue.Queue()
    subscribed = threading.Event()
    sub = _paho_client(port, "sub", 100)
    pub = _paho_client(port, "pub", 100)
    try:
        convert = decode_frame if frames else (lambda data: data)
        sub.on_message = lambda _c, _u, msg: received.put(convert(msg.payload))
        sub.on_subscribe = lambda *_: subscribed.set()
        sub.subscribe("bench/plain", qos=1)
        if not subscribed.wait(10):
            sys.exit("plain paho: no SUBACK within 10 s")
        payload, tensor = bytes(size), torch.randn(size // 4)

        def send(i: int) -> None:
            data = payload
            if frames:
                data = encode_frame(Kind.ACTIVATION, JOB, i, 0, tensor, Codec.FP32)
            if pub.publish("bench/plain", data, qos=1).rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                raise RuntimeError("paho queue full")

        def recv(_i: int) -> bool:
            try:
                received.get(timeout=max_s)
            except queue.Empty:
                return False
            return True

        return _timed(n, size, max_s, send, recv, window)
    finally:
        for client in (pub, sub):
            client.disconnect()
            client.loop_stop()


def run_tcp(_port: int, n: int, size: int, max_s: float, window: int) -> dict[str, float]:
    with socket.create_server((HOST, 0)) as server:
        out = socket.create_connection(server.getsockname()[:2], timeout=max_s)
        conn, _ = server.accept()
    conn.settimeout(max_s)
    payload = bytes(size)
    header = size.to_bytes(8, "little")

    def send(_i: int) -> None:
        out.sendall(header)
        out.sendall(payload)

    def read_exactly(buf: memoryview) -> bool:
        while buf:
            got = conn.recv_into(buf)
            if got == 0:
                return False
            buf = buf[got:]
        return True

    def recv(_i: int) -> bool:
        head = bytearray(8)
        if not read_exactly(memoryview(head)):
            return False
        # A fresh buffer per message, as a receiver that keeps what it got.
        return read_exactly(memoryview(bytearray(int.from_bytes(head, "little"))))

    try:
        return _timed(n, size, max_s, send, recv, window)
    finally:
        out.close()
        conn.close()


def run_paho_frames(port: int, n: int, size: int, max_s: float, window: int) -> dict[str, float]:
    return run_paho(port, n, size, max_s, window, frames=True)


METHODS = {
    "edgetrain": run_edgetrain,
    "paho": run_paho,
    "paho+frame": run_paho_frames,
    "tcp": run_tcp,
}


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
    with mosquitto() as port:
        for name, size in sizes.items():
            n = max(24, int(args.mib * (1 << 20)) // size)
            window = max(2, min(64, int(args.window_mib * (1 << 20)) // size))
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            for run in METHODS.values():  # warm-up: first connections, allocations, caches
                run(port, max(8, n // 8), size, args.max_s, window)
            order = list(METHODS)
            for i in range(args.rounds):
                for method in order[i % len(order) :] + order[: i % len(order)]:
                    runs[method].append(METHODS[method](port, n, size, args.max_s, window))
            row: dict[str, Any] = {"bytes": size, "messages": n, "window": window}
            for method, got in runs.items():
                row[method] = {
                    "mb_s": statistics.median(r["mb_s"] for r in got),
                    "frames_s": statistics.median(r["frames_s"] for r in got),
                    "all_mb_s": [round(r["mb_s"], 1) for r in got],
                    "complete": all(r["messages"] == n for r in got),
                }
            for key, other in (("ratio", "paho"), ("ratio_frame", "paho+frame")):
                pairs = zip(runs["edgetrain"], runs[other], strict=True)
                row[key] = statistics.median(a["mb_s"] / b["mb_s"] for a, b in pairs)
            results[name] = row
    if args.json:
        out = {"rounds": args.rounds, "cpus": os.cpu_count(), "sizes": results}
        print(json.dumps(out, indent=2))
        return 0
    head = f"{'size':>7} {'method':>10} {'MB/s':>8} {'frames/s':>9} {'x paho':>6} {'x +frame':>8}"
    print(f"{head}  rounds (MB/s)")
    for name, row in results.items():
        for method in METHODS:
            r = row[method]
            ratios = f"{row['ratio']:>6.2f} {row['ratio_frame']:>8.2f}"
            ratios = ratios if method == "edgetrain" else " " * 15
            done = "" if r["complete"] else "  (incomplete: hit --max-s)"
            print(
                f"{name:>7} {method:>10} {r['mb_s']:>8.1f} {r['frames_s']:>9.1f} {ratios}  "
                f"{r['all_mb_s']}{done}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
