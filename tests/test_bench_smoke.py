"""Smoke test of the pipeline benchmark's core on a tiny configuration: every key is present
and every number is finite (the targets are the benchmark's business, not a test's)."""

import math

import pytest

from bench.pipeline import BenchConfig, run_benchmark

KEYS = ("sequential_s", "pipelined_s", "bound_s", "speedup", "efficiency", "n_groups",
        "auto_vs_best", "sweep", "bound_terms", "overhead_us_per_op",
        "overhead_us_per_compute_op", "overhead_cpu_us_per_op", "handoff_us_per_compute_op",
        "link", "workload", "loadavg")


@pytest.mark.slow
async def test_pipeline_benchmark_tiny(tmp_path):
    cfg = BenchConfig(batch_size=16, batches=2, repeats=1, d_in=8, hidden=(16,), cut=8,
                      top_hidden=(4,), warmup=1, sweep=(1, 4), tune_epochs=2,
                      overhead_batch=8, overhead_groups=8, overhead_batches=2)
    plot = tmp_path / "gantt.png"
    result = await run_benchmark(cfg, plot=str(plot), log=lambda msg: None)
    for key in KEYS:
        assert key in result, key
    for key in ("sequential_s", "pipelined_s", "bound_s", "speedup", "efficiency",
                "auto_vs_best", "overhead_us_per_op"):
        assert math.isfinite(result[key]) and result[key] > 0 or key == "overhead_us_per_op", key
        assert math.isfinite(result[key]), key
    assert set(result["sweep"]) == {"1", "4"}
    assert all(math.isfinite(t) and t > 0 for t in result["sweep"].values())
    assert 1 <= result["n_groups"] <= cfg.batch_size
    terms = {k: v for k, v in result["bound_terms"].items() if k != "definition"}
    assert set(terms) == {"compute[A]", "compute[B]", "link[A->B]", "link[B->A]"}
    assert result["bound_s"] == pytest.approx(max(terms.values()))
    assert result["efficiency"] == pytest.approx(result["bound_s"] / result["pipelined_s"])
    assert result["speedup"] == pytest.approx(result["sequential_s"] / result["pipelined_s"])
    assert plot.stat().st_size > 0
