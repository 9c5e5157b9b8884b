"""Scaffolding shared by the HTTP transport tests: a pair of live transports on loopback.

`open_pair` is the one way the tests make two parties that know each other: both listen on
port 0 and the URLs the system picked are read back (`HttpTransport.url`), so no port is ever
guessed, released and reused. Async tests use the `http_pair` fixture (tests/conftest.py),
which closes what it opened; scenarios that run their own event loop call `open_pair` and close
the transports themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tandem.transports.http import HttpConfig, HttpTransport


async def open_pair(
    config: Callable[..., HttpConfig] = HttpConfig,
    a_kw: Mapping[str, Any] | None = None,
    b_kw: Mapping[str, Any] | None = None,
    *,
    names: tuple[str, str] = ("a", "b"),
) -> tuple[HttpTransport, HttpTransport]:
    """Two started transports ``names``, each a peer of the other: the first made with
    ``config(names[0], **a_kw)``, the second with ``config(names[1], peers={names[0]: url},
    **b_kw)``. The first is closed again if the second cannot start."""
    first, second = names
    a = await HttpTransport(config(first, **(a_kw or {}))).start()
    try:
        b = await HttpTransport(config(second, peers={first: a.url}, **(b_kw or {}))).start()
    except BaseException:
        await a.aclose()
        raise
    a.add_peer(second, b.url)
    return a, b
