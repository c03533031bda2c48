"""The delay proxy: adds a link's one-way latency to TCP in both directions.

This kernel has no netem, so latency is added in user space. One process
(asyncio) serves every agent of a testbed: for each ``--route LISTEN TO MS`` it
listens on ``LISTEN`` (the host end of the agent's veth) and forwards each
connection to ``TO`` (the broker on 127.0.0.1), holding every chunk it reads
for ``MS`` milliseconds before writing it on, in each direction.

It delays without capping throughput: a reader stamps each chunk with the time
it is due and queues it; a writer writes chunks in order once due. Order is
kept (one FIFO per direction, due times never decrease). Buffering is bounded:
a direction holds at most :data:`QUEUE_CHUNKS` chunks of at most :data:`CHUNK`
bytes (16 MiB, a bandwidth-delay product of 1 Gbit/s x 130 ms); when full, the
reader stops reading and TCP's flow control pushes back on the sender.
With 0 ms the proxy still forwards, unchanged: an agent in a namespace reaches
the broker (bound to 127.0.0.1 only) through it whatever its latency.

Run as ``python -m coordinator.testbed.proxy --route 10.1.2.1:1883 127.0.0.1:41000 5
[--route ...] --ready-file PATH``; it creates ``PATH`` once every route listens
and runs until SIGTERM or SIGINT.

Tested in tests/integration/test_testbed_proxy.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

__all__ = ["CHUNK", "QUEUE_CHUNKS", "main", "serve"]

CHUNK = 64 * 1024
QUEUE_CHUNKS = 256


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{addr!r}: expected HOST:PORT")
    return host, int(port)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def read() -> None:
        data = b"x"
        try:
            while data:
                data = await reader.read(CHUNK)
                await queue.put((loop.time() + delay_s, data))  # b"": end of stream
        except (ConnectionError, OSError):
            await queue.put((loop.time(), b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


async def _connection(
    target: tuple[str, int], delay_s: float, cr: asyncio.StreamReader, cw: asyncio.StreamWriter
) -> None:
    try:
        br, bw = await asyncio.wait_for(asyncio.open_connection(*target), timeout=10)
    except (OSError, TimeoutError):
        cw.close()
        return
    try:
        await asyncio.gather(_pump(cr, bw, delay_s), _pump(br, cw, delay_s))
    except (ConnectionError, OSError):
        pass
    finally:
        for w in (cw, bw):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


async def serve(
    routes: list[tuple[tuple[str, int], tuple[str, int], float]],
    ready_file: Path | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ``(listen, target, delay_ms)`` routes until ``stop`` is set (default: SIGTERM/INT)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    servers = []
    for listen, target, delay_ms in routes:

        async def handle(
            r: asyncio.StreamReader,
            w: asyncio.StreamWriter,
            target: tuple[str, int] = target,
            delay: float = delay_ms / 1000,
        ) -> None:
            await _connection(target, delay, r, w)

        servers.append(await asyncio.start_server(handle, *listen, reuse_address=True))
    if ready_file is not None:
        ready_file.write_text("ready\n")
    print(f"delay proxy: {len(servers)} routes", file=sys.stderr, flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.testbed.proxy",
        description="TCP forwarder adding one-way latency.",
    )
    parser.add_argument(
        "--route",
        nargs=3,
        action="append",
        required=True,
        metavar=("LISTEN", "TO", "MS"),
        help="listen on HOST:PORT, forward to HOST:PORT, delay MS each way",
    )
    parser.add_argument("--ready-file", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        routes = [(_split(a), _split(b), float(ms)) for a, b, ms in args.route]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    asyncio.run(serve(routes, args.ready_file))


if __name__ == "__main__":
    main()
