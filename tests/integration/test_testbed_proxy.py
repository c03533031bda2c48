"""The delay proxy: one-way latency added in each direction, order kept, throughput not capped."""

from __future__ import annotations

import asyncio
import time

from coordinator.local.broker import free_port
from coordinator.testbed.proxy import serve


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _through_proxy(delay_ms: float) -> tuple[float, float, bool]:
    """(round trip of one byte, seconds to echo 16 MiB, whether the bytes came back in order)."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = echo.sockets[0].getsockname()[:2]
    port = free_port()
    stop = asyncio.Event()
    proxy = asyncio.ensure_future(serve([(("127.0.0.1", port), target, delay_ms)], stop=stop))
    try:
        for _ in range(100):  # bounded: until the proxy listens
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        rtt = time.perf_counter() - t0
        payload = bytes(range(256)) * (16 * 4096)  # 16 MiB
        t0 = time.perf_counter()

        async def send() -> None:
            writer.write(payload)
            await writer.drain()

        sending = asyncio.ensure_future(send())
        back = await asyncio.wait_for(reader.readexactly(len(payload)), 30)
        await sending
        bulk = time.perf_counter() - t0
        writer.close()
        return rtt, bulk, back == payload
    finally:
        stop.set()
        await asyncio.wait_for(proxy, 5)
        echo.close()


def test_latency_is_added_each_way_without_capping_throughput() -> None:
    rtt, bulk, intact = asyncio.run(_through_proxy(50))
    assert intact
    assert 0.1 <= rtt < 0.3  # 50 ms each way
    # 16 MiB there and back: about one round trip of delay, not a window per round trip.
    assert bulk < 2.0, bulk


def test_zero_latency_still_forwards() -> None:
    rtt, _bulk, intact = asyncio.run(_through_proxy(0))
    assert intact and rtt < 0.05
