"""Federated rounds over the real HTTP transport on loopback (same parties, unchanged)."""

from __future__ import annotations

import pytest

from fl_helpers import compressed, small_setup
from tandem.parties.fl.federation import run_http_federation


@pytest.mark.slow
async def test_compressed_rounds_over_http_with_auth():
    data, trainer = small_setup()
    cfg = compressed(3, 20.0, lossless=True)
    server = await run_http_federation(data, trainer, cfg, secret=b"fl-test-secret")
    assert [r.accepted for r in server.reports] == [["c0", "c1", "c2", "c3"]] * 3
    assert all(r.up_bytes > 0 and r.down_bytes > 0 for r in server.reports)
    full = 4 * trainer.dim * 4
    assert all(r.down_bytes < full for r in server.reports)  # sparse deltas, never the model
    assert sum(r.up_bytes for r in server.reports) == server.bytes_up()
    assert server.planner.version == 3
