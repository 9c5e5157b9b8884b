"""Federated updates bounded by the plan, end to end over HTTP in one process (issue 39,
point 4): an update larger than the negotiated model's encoded size is refused from its head
(before its body), a sample count above the client's declared data size is refused, and a
refused update (non-finite included) ends the round's wait for its client at once. The jobs are
`tandem.testing.hostile_roles.run_fl` (four clients, ``c3`` hostile)."""

from __future__ import annotations

import pytest

from tandem.testing import hostile_roles as H

HONEST = [["c0", "c1", "c2"]] * 3


@pytest.mark.slow
async def test_an_oversized_update_is_refused_from_its_head():
    out = await H.run_fl("oversized", seconds=110)
    assert out["accepted"] == HONEST, out
    assert all("from its head" in r for r in out["rejected_c3"]), out
    assert out["client_refusals"] == ["PayloadTooLargeError"] * 3
    assert out["refused_heads"].get("too_large") == 3
    assert out["bytes_from_c3"] < 1 << 20  # none of the 64 MiB bodies was read
    assert out["max_round_s"] < H.ROUND_TIMEOUT / 4


@pytest.mark.slow
@pytest.mark.parametrize("declared", ["roster", "first_report"])
async def test_a_sample_count_above_the_declared_data_size_is_refused(declared):
    roster = declared == "roster"
    out = await H.run_fl("count", sizes=roster, honest_rounds=0 if roster else 1, seconds=110)
    expect = HONEST if roster else [["c0", "c1", "c2", "c3"]] + HONEST[1:]
    assert out["accepted"] == expect, out
    tampered = out["rejected_c3"] if roster else out["rejected_c3"][1:]
    assert tampered and all("meta.n=2147483648 exceeds" in r for r in tampered), out
    assert out["max_round_s"] < H.ROUND_TIMEOUT / 4


@pytest.mark.slow
async def test_a_nonfinite_update_does_not_hold_the_round_until_its_deadline():
    out = await H.run_fl("nonfinite", seconds=110)
    assert out["accepted"] == HONEST, out
    assert all("NaN" in r for r in out["rejected_c3"]), out
    assert out["max_round_s"] < H.ROUND_TIMEOUT / 4, out  # far from the 30 s deadline
