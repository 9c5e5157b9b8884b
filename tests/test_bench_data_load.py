"""Smoke test of `bench.data_load` on a tiny size: the table is written, loaded in a child
process, and one JSON line reports every key (the memory ratio at millions of rows is the
benchmark's business, not a test's)."""

import math

import pytest

from run_helpers import run_bench

pytest.importorskip("pyarrow")

DENSE = CATEGORICAL = 13  # the leader's columns of the click-through table (`bench.ctr`)


@pytest.mark.slow
def test_bench_data_load_tiny():
    r, lines = run_bench("data_load", "--json", "--rows", "3000")
    assert len(lines) == 1
    assert r["rows"] == [3000]
    for key in ("seconds", "cpu_seconds", "baseline_mb", "peak_mb", "rss_vs_data"):
        assert math.isfinite(r[f"{key}_3000"]) and r[f"{key}_3000"] > 0, key
    # float32 features (13 dense + 13 codes) and float32 labels, 4 bytes each per row
    assert r["data_mb_3000"] == round(3000 * (DENSE + CATEGORICAL + 1) * 4 / 2**20, 1)
    assert r["peak_mb_3000"] >= r["baseline_mb_3000"]
