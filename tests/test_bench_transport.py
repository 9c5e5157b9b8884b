"""Smoke test of `bench.transport` on a tiny size: two processes, raw socket and HTTP, one JSON
line with every key (the ratio target is the benchmark's business, not a test's)."""

import math

import pytest

from run_helpers import run_bench


@pytest.mark.slow
def test_bench_transport_tiny():
    r, lines = run_bench(
        "transport", "--json", "--mib", "1", "--repeats", "2", "--rounds", "2", "--small", "5"
    )
    assert len(lines) == 1
    for key in (
        "raw_MBps",
        "http_MBps",
        "ratio_vs_raw",
        "http_hmac_MBps",
        "ratio_signed_vs_raw",
        "small_frame_us",
        "small_frame_hmac_us",
        "small_frame_windowed_us",
    ):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert all(len(v) == 2 for v in r["runs"].values())
    assert len(r["load"]["loadavg_start"]) == 3
    assert r["http_requests"]["bulk"] > 0  # the 1 MiB frames took the bulk path
