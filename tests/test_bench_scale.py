"""Smoke test of `bench.scale` at a tiny size through the real path: `bench.ctr` writes the
Parquet tables, `tandem align` and `tandem party` run as OS processes over HTTP, and the
centralized reference trains in this process. Checks the keys and that the joint model beats
the leader alone (the throughput targets are the benchmark's business, not a test's)."""

import json
import math

import pytest

from bench.scale import (
    ONE_THREAD_XLA_FLAGS,
    auto_figures,
    parse_size,
    party_launch,
)
from run_helpers import run_bench

pytestmark = pytest.mark.slow

ENTRY_KEYS = {
    "rows",
    "train_rows",
    "aligned_by",
    "align_s",
    "rows_per_s",
    "epoch_s",
    "load_s",
    "rss_mb",
    "data_mb",
    "state_mb",
    "rss_vs_data",
    "params",
    "params_by_stage",
    "auc_joint",
    "auc_centralized",
    "auc_leader_only",
    "centralized_rows_per_s",
    "vs_centralized",
    "link_bytes",
    "first_epoch_vs_steady",
    "auto_vs_best_fixed",
    "breakdown",
}
TOP_KEYS = {
    "vs_centralized",
    "rows_per_s_4m_vs_100k",
    "rss_vs_data",
    "auc_joint",
    "auc_leader_only",
    "auc_vs_centralized",
    "params",
    "sizes",
    "loadavg",
    "auto_vs_best_fixed",
    "first_epoch_vs_steady",
}


def test_parse_size():
    assert [parse_size(s) for s in ("100k", "1M", "4m", "3000", "2.5k")] == [
        100_000,
        1_000_000,
        4_000_000,
        3000,
        2500,
    ]


def test_auto_figures_compare_every_epoch_with_the_best_fixed_count():
    out = auto_figures([3.0, 2.0, 2.0], 1000, {1: 400.0, 2: 500.0, 4: 450.0})
    assert out["first_epoch_vs_steady"] == 1.5
    assert out["rows_per_s_all_epochs"] == round(3000 / 7, 1)
    assert out["best_fixed"] == 2 and out["auto_vs_best_fixed"] == round(3000 / 7 / 500, 3)
    none = auto_figures([1.0], 10, {})
    assert none["best_fixed"] is None and none["auto_vs_best_fixed"] is None


def test_party_launch_confines_each_party_to_one_cpu(monkeypatch):
    monkeypatch.setattr("tandem.parties.cli.affinity.thread_cpus", lambda: {2, 5})
    monkeypatch.setattr("shutil.which", lambda name: f"/bin/{name}")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "X": "1"}
    assert party_launch(env, 0, "shared") == (env, [])
    (first, pin), *rest = (party_launch(env, i, "one") for i in range(3))
    assert first["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=1 {ONE_THREAD_XLA_FLAGS}"
    assert [pin, *(p for _, p in rest)] == [["/bin/taskset", "-c", c] for c in ("2", "5", "2")]
    assert first["X"] == "1" and env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SystemExit, match="--party-threads shared"):
        party_launch(env, 0, "one")


@pytest.mark.timeout(600)  # four processes importing JAX, and compiles, on a loaded 2-core machine
def test_bench_scale_tiny(tmp_path):
    pytest.importorskip("pyarrow")
    out, lines = run_bench(
        "scale", "--json", "--sizes", "6000", "--batch-size", "1000", "--epochs", "2",
        "--groups", "1", "--learning-rate", "0.01", "--vocab-min", "10", "--vocab-max", "100",
        "--timeout", "240",
        "--no-breakdown",  # its two processes would double the test's time (next test)
        "--work-dir", str(tmp_path),
        timeout=580,
    )  # fmt: skip
    assert len(lines) == 1
    entry = out["sizes"]["6000"]
    assert ENTRY_KEYS <= set(entry)
    assert TOP_KEYS <= set(out)
    assert entry["aligned_by"] == "tandem align" and entry["align_s"] > 0
    assert set(entry["rss_mb"]) == {"leader", "follower"}
    assert all(v > 0 for v in entry["rss_mb"].values())
    assert entry["rows_per_s"] > 0 and entry["centralized_rows_per_s"] > 0
    assert len(entry["epoch_s"]) == 2
    assert entry["auto_vs_best_fixed"] is None  # a fixed count: no comparison runs
    assert entry["breakdown"] is None  # timed apart: test_the_breakdown_times_every_kernel
    # one micro-batch per batch: the pipelined run is the centralized one up to float order
    assert out["auc_vs_centralized"] < 0.01
    assert out["auc_joint"] > out["auc_leader_only"]
    assert math.isfinite(out["rss_vs_data"]) and out["params"] == entry["params"]
    # every embedding table has one row per declared category (+ code 0), seen or not: the
    # two bottoms differ by exactly their tables' difference (their MLPs are alike)
    [workload] = tmp_path.glob("6000-*/workload.json")  # bench.ctr's manifest of the run's data
    manifest = json.loads(workload.read_text())
    vocab = manifest["workload"]["vocab"]
    assert vocab[0] == 10 and vocab[-1] == 100
    tables = {
        p: 16 * sum(vocab[int(name[1:]) - 1] + 1 for name in columns["categorical"])
        for p, columns in manifest["parties"].items()
    }
    by_stage = entry["params_by_stage"]
    assert (
        by_stage["bottom_leader"] - tables["leader"]
        == by_stage["bottom_follower"] - tables["follower"]
        > 0
    )


@pytest.mark.timeout(300)
def test_the_breakdown_times_every_kernel(tmp_path):
    """``python -m bench.scale_kernels`` on a tiny workload (``python -m bench.ctr``): every
    kernel of the parties (at 4 groups of 1000 rows: padded past the ladder) and of the
    centralized step is timed by both clocks."""
    pytest.importorskip("pyarrow")
    run_bench("ctr", "--rows", "3000", "--vocab", "10", "100", "--out", str(tmp_path))
    common = ("--parties", "leader,follower", "--batch-size", "1000", "--batches", "1")
    common += ("--learning-rate", "0.01", "--cut", "64")  # bench.ctr's cut
    pipe, _ = run_bench("scale_kernels", str(tmp_path), "--which", "pipelined", "--groups", "4",
                        *common)  # fmt: skip
    central, _ = run_bench("scale_kernels", str(tmp_path), "--which", "centralized", *common)
    for clock in ("wall_ms", "cpu_ms"):
        kernels = {"forward", "loss", "backward", "update", "zeros", "d2h", "h2d", "encode"}
        assert kernels | {"decode"} <= set(pipe[clock])
        assert {"step", "forward", "value_and_grad", "update"} <= set(central[clock])
        assert all(v >= 0 for v in pipe[clock].values())
    assert set(pipe["by_party_wall_ms"]) == {"leader", "follower"}
    assert pipe["groups"] == 4 and pipe["padded_rows"] > 1.0
