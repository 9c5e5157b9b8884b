"""Smoke test of `bench.psi` on a tiny size: two real processes over HTTP agree (the speed
target is the benchmark's business, not a test's)."""

import pytest

from run_helpers import run_bench


@pytest.mark.slow
def test_bench_psi_tiny():
    record, _ = run_bench("psi", "--json", "--sizes", "400", "--chunk", "64")
    assert record["bench"] == "psi" and record["transport"] == "http-loopback"
    assert record["seconds_400"] > 0
    # 2 x 400 blinded points of 32 bytes + 2 x 400 truncated doubles of 16 bytes, plus headers
    assert 38_400 < record["bytes_400"] < 38_400 + 20_000
