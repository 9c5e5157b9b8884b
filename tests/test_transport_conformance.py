"""Runs the shared conformance suite against the memory and the HTTP transports."""

from __future__ import annotations

import pytest

from transport_conformance import TransportConformance
from transports.http import HttpConfig, HttpTransport
from transports.memory import MemoryNetwork

CAPACITY = 4


class MemoryHarness:
    capacity = CAPACITY

    def __init__(self) -> None:
        self.net = MemoryNetwork(capacity=CAPACITY)
        self.made = []

    async def pair(self):
        a, b = self.net.endpoint("a"), self.net.endpoint("b")
        self.made += [a, b]
        return a, b

    async def restart(self, name):
        t = self.net.endpoint(name)
        self.made.append(t)
        return t

    async def close(self):
        for t in self.made:
            await t.aclose()


class HttpHarness:
    """Two HTTP parties on loopback; small chunks so that every test also exercises chunking."""

    capacity = CAPACITY

    def __init__(self) -> None:
        self.made: list[HttpTransport] = []
        self.urls: dict[str, str] = {}

    def _config(self, name: str, port: int = 0, peers=None) -> HttpConfig:
        return HttpConfig(name=name, port=port, peers=peers or {}, secret=b"conformance",
                          capacity=CAPACITY, chunk_bytes=256 << 10, retry_timeout=0.5,
                          backpressure_wait=0.2, backoff_base=0.005, backoff_max=0.05)

    async def pair(self):
        a = await HttpTransport(self._config("a")).start()
        b = await HttpTransport(self._config("b", peers={"a": a.url})).start()
        a.add_peer("b", b.url)
        self.made += [a, b]
        self.urls = {"a": a.url, "b": b.url}
        return a, b

    async def restart(self, name):
        other = "a" if name == "b" else "b"
        port = int(self.urls[name].rsplit(":", 1)[1])
        t = await HttpTransport(
            self._config(name, port=port, peers={other: self.urls[other]})).start()
        self.made.append(t)
        return t

    async def close(self):
        for t in self.made:
            await t.aclose()


class TestMemoryTransport(TransportConformance):
    @pytest.fixture
    async def harness(self):
        h = MemoryHarness()
        yield h
        await h.close()


class TestHttpTransport(TransportConformance):
    @pytest.fixture
    async def harness(self):
        h = HttpHarness()
        yield h
        await h.close()
