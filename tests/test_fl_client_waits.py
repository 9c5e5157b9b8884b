"""A federated client's waits and refusals (issue 43, point 8), fast, over the memory
transport: its wait for a server that is not there (at start, and after losing it) ends after
``client.reconnect_timeout`` with an error naming that key, and a refused update is told on
its stderr at once (a warning), before it stops at ``client.max_refusals``."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from fl_helpers import small_setup
from fl_process_helpers import Federation
from tandem.parties.fl.client import FLClient, UpdateRefusedError
from tandem.parties.fl.client_process import Connection, ServerLostError, connect
from tandem.parties.fl.config import load_client_config
from tandem.transports.memory import MemoryNetwork


async def gone_server(tmp_path) -> Connection:
    """A client's link to a server whose endpoint has closed (a process that is gone)."""
    fed = Federation(tmp_path, rounds=1)
    fed.write()
    cfg = dataclasses.replace(load_client_config(fed.path("bank_a")), reconnect_timeout=0.3)
    net = MemoryNetwork()
    await net.endpoint("server").aclose()
    return Connection(net.endpoint("bank_a"), cfg, "http://127.0.0.1:1")


async def test_waiting_for_a_server_that_never_answers_ends_naming_the_key(tmp_path):
    link = await gone_server(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ServerLostError, match=r"within client.reconnect_timeout = 0.3 s"):
        await connect(link)
    assert time.monotonic() - t0 < 5


async def test_a_lost_server_is_waited_for_reconnect_timeout_then_named(tmp_path):
    link = await gone_server(tmp_path)
    with pytest.raises(ServerLostError, match=r"client.reconnect_timeout = 0.3 s"):
        await link.next_frame(3)
    assert link.reconnects == 1


def test_a_refused_update_is_told_on_stderr_at_once(caplog):
    data, trainer = small_setup()
    x, y = data.clients[0]
    client = FLClient(MemoryNetwork().endpoint("c0"), "server", x, y, trainer, max_refusals=2)
    with caplog.at_level(logging.WARNING, logger="tandem.parties.fl.client"):
        client.refused({"round": 0, "reason": "update contains NaN or Inf"})
    told = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1 and "round 0: the server refused this update" in told[0].getMessage()
    assert "NaN or Inf" in told[0].getMessage() and client.refused_updates == 1
    with pytest.raises(UpdateRefusedError, match="client.max_refusals = 2"):
        client.refused({"round": 1, "reason": "update contains NaN or Inf"})
