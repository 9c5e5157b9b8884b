"""The declared transport surface: `make_transport` picks a builder by URL scheme, a user's own
transport plugs in with `register_transport` and then runs a real two-party job through the
standard construction path (`load_party_config` + `run_party`, as ``tandem party`` does), and
the optional capabilities are found with ``isinstance`` against the Protocols of `base`."""

from __future__ import annotations

import collections

import pytest

from hostile_helpers import assert_done, assert_same_params, make_job, run_pair
from tandem.errors import ConfigError, PeersUnreachableError, UnknownTransportError
from tandem.transports import (
    AddressingTransport,
    AdmittingTransport,
    MemoryNetwork,
    MemoryTransport,
    MetricsTransport,
    PeerWaitingTransport,
    Transport,
    TransportRequest,
    WindowedTransport,
    make_transport,
    register_transport,
    registered_schemes,
    unregister_transport,
)
from tandem.transports.factory import common_scheme, is_transport_url, scheme_of, started
from tandem.transports.http import HttpTransport

SCHEME = "test+http"
CAPABILITIES = (
    WindowedTransport,
    AdmittingTransport,
    PeerWaitingTransport,
    AddressingTransport,
    MetricsTransport,
)


class CountingHttp(HttpTransport):
    """An HTTP transport that counts the frames it sends per channel (the user's own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent_frames: collections.Counter[str] = collections.Counter()

    async def send(self, peer, channel, frame) -> None:
        await super().send(peer, channel, frame)
        self.sent_frames[channel] += 1


@pytest.fixture
def test_scheme():
    """``test+http://host:port`` peers are reached by a `CountingHttp`; yields those built."""
    from tandem.transports.http import HttpConfig

    built: list[CountingHttp] = []

    def build(request: TransportRequest) -> Transport:
        assert request.scheme == SCHEME
        peers = {p: u.replace(SCHEME + "://", "http://", 1) for p, u in request.peers.items()}
        t = CountingHttp(HttpConfig(name=request.name, peers=peers, **request.settings))
        built.append(t)
        return t

    register_transport(SCHEME, build)
    try:
        yield built
    finally:
        unregister_transport(SCHEME)


async def test_a_registered_transport_runs_a_two_party_job(
    tmp_path, test_scheme, hostile_reference
):
    def by_scheme(job) -> None:
        for role, peer in (("leader", "follower"), ("follower", "leader")):
            job.cfg[role]["peers"] = {peer: job.url(peer).replace("http://", SCHEME + "://")}

    job = make_job(tmp_path, by_scheme)
    results, _ = await run_pair(job)
    assert_done(results)
    assert sorted(t.name for t in test_scheme) == ["follower", "leader"]
    for t in test_scheme:  # every frame of the job went through the user's transport
        assert t.closed and sum(t.sent_frames.values()) > 0
        assert any(ch.startswith(("act/", "grad/")) for ch in t.sent_frames), t.sent_frames
    assert_same_params(job, hostile_reference)  # the same training as over plain HTTP


def test_an_unregistered_scheme_is_refused_naming_the_registered_ones(tmp_path):
    from tandem.parties.split.process.party_config import PartyConfigError, load_party_config

    job = make_job(tmp_path, lambda j: j.cfg["leader"].update(peers={"follower": "nope://x:1"}))
    with pytest.raises(PartyConfigError, match=r"peers\.follower must be a URL like") as err:
        load_party_config(job.path("leader"))
    assert "http, https, memory" in str(err.value)
    with pytest.raises(UnknownTransportError, match=r"scheme 'nope' is not one of"):
        make_transport("nope://x:1", name="a")


def test_registry():
    assert {"http", "https", "memory"} <= set(registered_schemes())
    assert scheme_of("HTTPS://h:1") == "https" and scheme_of("memory") == "memory"
    assert is_transport_url("http://h:1") and not is_transport_url("http://")
    assert not is_transport_url("h:1") and not is_transport_url(None)
    with pytest.raises(ValueError, match="already registered"):
        register_transport("http", lambda r: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="lower case"):
        register_transport("My Proto", lambda r: None)  # type: ignore[arg-type,return-value]
    assert common_scheme(["http://a:1", "https://b:2"]) == "http"  # one transport reaches both
    assert common_scheme([]) == "http"
    register_transport("other", lambda r: MemoryNetwork().endpoint(r.name))
    try:
        with pytest.raises(UnknownTransportError, match="need different transports"):
            common_scheme(["http://a:1", "other://b"])
    finally:
        unregister_transport("other")
    assert "other" not in registered_schemes()


async def test_memory_scheme_and_capabilities():
    net = MemoryNetwork()
    a = make_transport("memory", name="a", network=net)
    b = make_transport("memory", name="b", network=net)
    assert isinstance(a, MemoryTransport) and isinstance(a, Transport)
    assert not any(isinstance(a, cap) for cap in CAPABILITIES)  # none of the optional ones
    async with started(a), started(b):
        assert a.peers == ("b",)
    with pytest.raises(ConfigError, match="network=<MemoryNetwork>"):
        make_transport("memory", name="c")
    h = make_transport("http", name="h", peers={"p": "http://127.0.0.1:1"})
    assert isinstance(h, HttpTransport)  # unstarted: every check reads the class only
    assert all(isinstance(h, cap) for cap in CAPABILITIES)


async def test_wait_for_peers_names_the_silent_peer():
    async with started(make_transport("http", name="a")) as alone:
        peer = make_transport("http", name="b", peers={"a": alone.address()})
        async with started(peer) as b:
            await b.wait_for_peers(5.0)  # `a` answers
            b.add_peer("c", "http://127.0.0.1:9")  # nobody there
            with pytest.raises(PeersUnreachableError, match=r"'b': peers not reachable") as err:
                await b.wait_for_peers(0.3)
            assert set(err.value.pending) == {"c"}
            assert err.value.pending["c"][0] == "http://127.0.0.1:9"
