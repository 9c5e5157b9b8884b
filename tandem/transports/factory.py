"""`make_transport`: the one place a system builds a transport, chosen by URL scheme.

Every system (split parties, FL server and clients, elastic roles, alignment) asks this module
for its transport; none constructs one itself. The scheme of a URL (``http`` in
``http://127.0.0.1:8712``), or a bare scheme, picks a builder from a registry::

    t = make_transport("http", name="leader", host="0.0.0.0", port=8711,
                       peers={"follower": "http://10.0.0.2:8712"}, secret=b"...")

Built in: ``http`` and ``https`` (`tandem.transports.http.HttpTransport`; ``settings`` are
`HttpConfig`'s fields) and ``memory`` (an endpoint of the `MemoryNetwork` given as the
``network`` setting). A user plugs in a transport of their own with `register_transport`;
from then on a peer URL of that scheme in any configuration builds it (docs/transports.md).

Contract: builders are called with a `TransportRequest` and return an unstarted object that
implements `tandem.transports.base.Transport` (and whichever optional capabilities of
`tandem.transports.base` it has). The registry is process-wide and is changed only by
`register_transport` / `unregister_transport`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TypeVar

from tandem.errors import ConfigError, UnknownTransportError

from .base import AddressingTransport, Transport

TransportT = TypeVar("TransportT", bound=Transport)

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclasses.dataclass(frozen=True)
class TransportRequest:
    """What a system asks of a builder.

    Attributes:
      scheme: the scheme that picked the builder (lower case).
      name: this party's name.
      peers: peer name -> address (a URL of the builder's scheme, for URL-addressed ones).
      settings: the transport's own settings (for HTTP, `HttpConfig`'s fields).
    """

    scheme: str
    name: str
    peers: Mapping[str, str]
    settings: Mapping[str, Any]


TransportBuilder = Callable[[TransportRequest], Transport]


def _http(request: TransportRequest) -> Transport:
    from .http import HttpConfig, HttpTransport

    return HttpTransport(
        HttpConfig(name=request.name, peers=dict(request.peers), **dict(request.settings))
    )


def _memory(request: TransportRequest) -> Transport:
    from .memory import MemoryNetwork

    settings = dict(request.settings)
    network = settings.pop("network", None)
    if not isinstance(network, MemoryNetwork):
        raise ConfigError(
            "a memory transport needs the setting network=<MemoryNetwork> (the parties of one "
            f"process share one), got {network!r}"
        )
    if settings or request.peers:
        raise ConfigError(
            f"a memory transport takes only `network`; got settings {sorted(settings)} and "
            f"peers {sorted(request.peers)} (every party of the network is a peer)"
        )
    return network.endpoint(request.name)


_BUILDERS: dict[str, TransportBuilder] = {"http": _http, "https": _http, "memory": _memory}


def register_transport(scheme: str, builder: TransportBuilder, *, replace: bool = False) -> None:
    """Build transports for URLs of ``scheme`` with ``builder`` from now on (process-wide).

    ``scheme``: lower case, as in RFC 3986 (a letter, then letters, digits, ``+ - .``).
    Registering a scheme that has a builder raises `ValueError` unless ``replace``."""
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise ValueError(
            f"transport scheme must be lower case letters, digits and '+-.', starting with a "
            f"letter (e.g. 'myproto'), got {scheme!r}"
        )
    if not callable(builder):
        raise TypeError(f"builder for {scheme!r} must be callable, got {builder!r}")
    if scheme in _BUILDERS and not replace:
        raise ValueError(
            f"a transport is already registered for {scheme!r}; pass replace=True to replace it"
        )
    _BUILDERS[scheme] = builder


def unregister_transport(scheme: str) -> None:
    """Forget ``scheme``'s builder (a no-op when it has none)."""
    _BUILDERS.pop(scheme, None)


def registered_schemes() -> tuple[str, ...]:
    """The schemes `make_transport` can build, sorted."""
    return tuple(sorted(_BUILDERS))


def scheme_of(url_or_scheme: str) -> str:
    """The scheme of a URL (``"http"`` of ``"http://host:port"``), or a bare scheme, lower
    case; `UnknownTransportError` when no transport is registered for it."""
    scheme = url_or_scheme.partition("://")[0].strip().lower() if url_or_scheme else ""
    if scheme not in _BUILDERS:
        raise UnknownTransportError(
            f"no transport for {url_or_scheme!r}: its scheme {scheme!r} is not one of "
            f"{list(registered_schemes())}; use a URL like 'http://host:port', or register "
            "the transport with tandem.transports.register_transport"
        )
    return scheme


def is_transport_url(url: object) -> bool:
    """Whether ``url`` is ``scheme://address`` with a registered ``scheme``."""
    if not isinstance(url, str) or "://" not in url or not url.partition("://")[2]:
        return False
    return url.partition("://")[0].lower() in _BUILDERS


def url_hint(example: str = "http://127.0.0.1:8712") -> str:
    """How a peer URL must look, for error messages."""
    return (
        f"a URL like {example!r} (scheme://host:port, the scheme one of "
        f"{', '.join(registered_schemes())})"
    )


def common_scheme(urls: Iterable[str], default: str = "http") -> str:
    """The scheme that builds a transport reaching every URL of ``urls`` (``default`` when
    there is none); `UnknownTransportError` when they need different transports (``http``
    and ``https`` share one)."""
    builders: dict[TransportBuilder, str] = {}
    for url in urls:
        scheme = scheme_of(url)
        builders.setdefault(_BUILDERS[scheme], scheme)
    if len(builders) > 1:
        raise UnknownTransportError(
            f"peer URLs need different transports ({sorted(builders.values())}); one party "
            "reaches all its peers through one transport: give them one scheme"
        )
    return next(iter(builders.values()), scheme_of(default))


def make_transport(
    url_or_scheme: str,
    *,
    name: str,
    peers: Mapping[str, str] | None = None,
    **settings: Any,
) -> Transport:
    """An unstarted transport for party ``name``, built by the builder registered for the
    scheme of ``url_or_scheme`` (only the scheme is read). ``peers``: name -> address;
    ``settings``: the transport's own (for HTTP, `HttpConfig`'s fields: ``host``, ``port``,
    ``secret``, ...). Raises `UnknownTransportError` for an unregistered scheme, and what the
    builder raises for bad settings."""
    scheme = scheme_of(url_or_scheme)
    request = TransportRequest(scheme, name, dict(peers or {}), settings)
    return _BUILDERS[scheme](request)


@contextlib.asynccontextmanager
async def started(transport: TransportT) -> AsyncIterator[TransportT]:
    """``async with started(make_transport(...)) as t``: ``t`` started, closed on exit (also
    when the block fails)."""
    await transport.start()
    try:
        yield transport
    finally:
        await transport.aclose()


def addressing(transport: object, needed_for: str) -> AddressingTransport:
    """``transport`` as an `AddressingTransport` (it has an address and learns peers'
    addresses); `UnknownTransportError` naming what needs it when it has no addresses."""
    if not isinstance(transport, AddressingTransport):
        raise UnknownTransportError(
            f"{needed_for} needs a transport with addresses (AddressingTransport in "
            f"tandem.transports.base: address, add_peer); {type(transport).__name__} has none: use "
            "an http(s) URL, or register a transport that implements it"
        )
    return transport


__all__ = [
    "TransportBuilder",
    "TransportRequest",
    "common_scheme",
    "is_transport_url",
    "make_transport",
    "register_transport",
    "registered_schemes",
    "addressing",
    "started",
    "scheme_of",
    "unregister_transport",
    "url_hint",
]
