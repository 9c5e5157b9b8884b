"""Smoke tests of ``bench.fl`` and ``bench.elastic`` on tiny configurations: each prints or
returns every key with a sane value, and the invariants that hold at any size hold (no batch
lost or applied twice; compressed traffic smaller than dense). The targets are the
benchmarks' business, measured by running them, not by tests."""

import math

import pytest

from run_helpers import run_bench


@pytest.mark.slow
def test_bench_fl_tiny():
    out, lines = run_bench(
        "fl",
        *("--rounds", "3", "--rounds-1m", "1", "--skip-http", "--skip-startup", "--json"),
    )
    assert len(lines) == 1, lines
    assert out["rounds"] == 3 and out["params"] >= 10_000
    for key in ("acc_dense", "acc_compressed"):
        assert 0.0 <= out[key] <= 100.0, out
    # compression must actually cut traffic both ways, even after three rounds
    assert out["uplink_ratio"] > 1.0 and out["downlink_ratio"] > 1.0, out
    assert out["bytes_up_compressed"] < out["bytes_up_dense"]
    assert out["total_ratio"] == pytest.approx(
        (out["bytes_up_dense"] + out["bytes_down_dense"])
        / (out["bytes_up_compressed"] + out["bytes_down_compressed"]),
        rel=1e-2,
    )
    # the 1M-parameter model, dense and compressed on the same data and rounds
    assert out["params_1m"] >= 1_000_000 and out["rounds_1m"] == 1, out
    for key in ("acc_dense_1m", "acc_compressed_1m"):
        assert 0.0 <= out[key] <= 100.0, out
    assert out["uplink_ratio_1m"] > 1.0 and out["downlink_ratio_1m"] > 1.0, out


@pytest.fixture(scope="module")
def elastic_run():
    """One tiny ``bench.elastic`` run for both tests below: the churn-window run goes through
    every phase of the plain one first (steady 1/2/4 workers, one kill, churn of two kill
    periods, 4 again), then one churn window each in one process and with workers as HTTP
    processes (a few T long)."""
    out, _ = run_bench(
        "elastic", "--json", "--interval", "0.1", "--seconds", "0.5", "--rows", "512",
        "--churn-periods", "2", "--churn-windows", "1", "--window", "4", "--http-windows", "1",
    )  # fmt: skip
    return out


@pytest.mark.slow
def test_bench_elastic_tiny(elastic_run):
    out = elastic_run
    assert set(out["throughput"]) == {"1", "2", "4"}
    assert all(v > 0 for v in out["throughput"].values()), out
    assert out["detect_heartbeats"] > 0, out  # a removal can only follow the kill
    # under heavy load a short interval may commit little during churn: finite, not a target
    assert out["recover_heartbeats"] is None or out["recover_heartbeats"] >= 0, out
    for key in ("churn_efficiency", "churn_throughput", "steady_4_after_churn"):
        assert math.isfinite(out[key]) and out[key] >= 0, (key, out)
    assert out["churn_kills"] >= 1
    # exactly-once holds whatever the timing
    assert out["lost_batches"] == 0 and out["duplicated_batches"] == 0, out


@pytest.mark.slow
def test_bench_elastic_churn_windows_tiny(elastic_run):
    """The churn-window keys, in one process and with workers as HTTP processes: one churn
    window each, a few T long."""
    out = elastic_run
    for prefix in ("", "http_"):
        for mode in ("rollback", "keep"):
            key = f"{prefix}churn_efficiency_{mode}"
            assert out[key] is None or (math.isfinite(out[key]) and out[key] >= 0), (key, out)
            assert len(out[f"{prefix}churn_windows_{mode}"]["steady_rates"]) == 2, out
    assert out["http_throughput_4"] > 0, out
    assert out["lost_batches"] == 0 and out["duplicated_batches"] == 0, out
