"""Smoke test of `bench.data_load` on a tiny size: the table is written, loaded in a child
process, and one JSON line reports every key (the memory ratio at millions of rows is the
benchmark's business, not a test's)."""

import json
import math

import pytest

from bench import data_load

pytest.importorskip("pyarrow")


@pytest.mark.slow
def test_bench_data_load_tiny(capsys):
    data_load.main(["--json", "--rows", "3000"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["rows"] == [3000]
    for key in ("seconds", "cpu_seconds", "baseline_mb", "peak_mb", "rss_vs_data"):
        assert math.isfinite(r[f"{key}_3000"]) and r[f"{key}_3000"] > 0, key
    # float32 features (13 dense + 13 codes) and float32 labels, 4 bytes each per row
    assert r["data_mb_3000"] == round(
        3000 * (data_load.DENSE + data_load.CATEGORICAL + 1) * 4 / 2**20, 1
    )
    assert r["peak_mb_3000"] >= r["baseline_mb_3000"]
