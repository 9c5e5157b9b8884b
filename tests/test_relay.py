"""`tandem.transports.relay.DelayRelay` on loopback: bytes arrive whole and in order, never
before their delay, the end of stream is passed on, the buffer stays bounded, and a missing
target is a reset. Only lower bounds on time are checked (a loaded machine only ever adds time)."""

import asyncio
import os
import time

import pytest

from tandem.transports.relay import READ_BYTES, DelayRelay, buffer_for


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    finally:
        writer.close()


async def _with_relay(one_way_s: float, body, **kw):
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = ("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        async with DelayRelay(one_way_s, **kw) as relay:
            port = await relay.route("127.0.0.1", target)
            return await body(relay, port)
    finally:
        server.close()
        await server.wait_closed()


def test_relay_bytes_whole_in_order_with_bounded_buffer():
    payload = os.urandom(3 << 20)

    async def body(relay, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def send():
            for i in range(0, len(payload), 100_000):
                writer.write(payload[i : i + 100_000])
                await writer.drain()
            writer.write_eof()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(send())
            got = await reader.read(-1)  # to the end of stream: the EOF came back through
        writer.close()
        return got, relay.peak_held

    got, peak = asyncio.run(_with_relay(0.002, body, buffer_bytes=1 << 16))
    assert got == payload
    assert 0 < peak <= (1 << 16) + READ_BYTES


def test_relay_delays_handshake_and_each_direction():
    one_way = 0.03

    async def body(relay, port):
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        first = time.perf_counter() - t0  # handshake round trip, then there and back
        t1 = time.perf_counter()
        writer.write(b"y")
        assert await reader.readexactly(1) == b"y"
        second = time.perf_counter() - t1
        writer.close()
        return first, second, relay.connections

    first, second, conns = asyncio.run(_with_relay(one_way, body))
    assert first >= 4 * one_way
    assert second >= 2 * one_way
    assert conns == 1


def test_relay_missing_target_resets_the_client():
    async def body():
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        async with DelayRelay(0.0) as relay:
            port = await relay.route("127.0.0.1", ("127.0.0.1", dead_port))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await reader.read(10)
            except ConnectionError:
                return b""
            finally:
                writer.close()

    assert asyncio.run(body()) == b""


def test_relay_rejects_bad_settings():
    with pytest.raises(ValueError, match="one_way_s"):
        DelayRelay(-1.0)
    with pytest.raises(ValueError, match="buffer_bytes"):
        DelayRelay(0.01, buffer_bytes=0)
    assert buffer_for(12.5e6, 0.05) == int(2 * 12.5e6 * 0.05)
    assert buffer_for(1.0, 0.001) == 1 << 20


def test_relay_close_ends_open_connections():
    async def body(relay, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        return reader, writer  # left open: leaving the relay's block must end it

    async def run():
        reader, writer = await _with_relay(0.001, body)
        try:
            return await asyncio.wait_for(reader.read(10), 5)
        except ConnectionError:
            return b""
        finally:
            writer.close()

    assert asyncio.run(run()) == b""
