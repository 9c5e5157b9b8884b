"""Smoke test of `bench.scale` at a tiny size through the real path: `bench.ctr` writes the
Parquet tables, `tandem align` and `tandem party` run as OS processes over HTTP, and the
centralized reference trains in this process. Checks the keys and that the joint model beats
the leader alone (the throughput targets are the benchmark's business, not a test's)."""

import math

import pytest

from bench import ctr
from bench.scale import (
    ONE_THREAD_XLA_FLAGS,
    Settings,
    auto_figures,
    parse_size,
    party_launch,
    run_size,
    summarize,
)

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
    import bench.scale

    monkeypatch.setattr("tandem.parties.cli.affinity.thread_cpus", lambda: {2, 5})
    monkeypatch.setattr("shutil.which", lambda name: f"/bin/{name}")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "X": "1"}
    assert bench.scale.party_launch(env, 0, "shared") == (env, [])
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
    settings = Settings(
        batch_size=1000,
        epochs=2,
        groups=1,
        learning_rate=0.01,
        vocab=tuple(ctr.vocab_sizes(10, 100)),
        timeout=240.0,
        breakdown=False,  # its two processes would double the test's time (next test)
    )
    entry = run_size(6000, settings, tmp_path)
    out = summarize({6000: entry}, settings)
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
    work = ctr.Workload(6000, 1, 0, vocab=settings.vocab)
    tables = {
        p: 16 * sum(settings.vocab[j] + 1 for j in work.columns()[p][1]) for p in work.parties
    }
    by_stage = entry["params_by_stage"]
    assert (
        by_stage["bottom_leader"] - tables["leader"]
        == by_stage["bottom_follower"] - tables["follower"]
        > 0
    )


@pytest.mark.timeout(300)
def test_the_breakdown_times_every_kernel(tmp_path):
    """`bench.scale_kernels` on a tiny workload, in this process: every kernel of the parties
    (at 4 groups of 1000 rows: padded past the ladder) and of the centralized step is timed
    by both clocks."""
    pytest.importorskip("pyarrow")
    from bench import scale_kernels

    work = ctr.Workload(3000, 1, 0, vocab=tuple(ctr.vocab_sizes(10, 100)))
    ctr.generate(work, tmp_path)
    urls = {p: "http://127.0.0.1:1" for p in work.parties}
    ctr.write_configs(work, tmp_path, urls=urls, train={"batch_size": 1000}, aligned=False)
    loaded = scale_kernels.load(tmp_path, work.parties, ctr.CUT)
    pipe = scale_kernels.pipelined(loaded, 4, 1000, 1, 0.01)
    central = scale_kernels.centralized(loaded, 1000, 1, 0.01)
    for clock in ("wall_ms", "cpu_ms"):
        kernels = {"forward", "loss", "backward", "update", "zeros", "d2h", "h2d", "encode"}
        assert kernels | {"decode"} <= set(pipe[clock])
        assert {"step", "forward", "value_and_grad", "update"} <= set(central[clock])
        assert all(v >= 0 for v in pipe[clock].values())
    assert set(pipe["by_party_wall_ms"]) == {"leader", "follower"}
    assert pipe["groups"] == 4 and pipe["padded_rows"] > 1.0
