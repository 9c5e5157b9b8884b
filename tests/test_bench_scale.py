"""Smoke test of `bench.scale` at a tiny size through the real path: `bench.ctr` writes the
Parquet tables, `tandem align` and `tandem party` run as OS processes over HTTP, and the
centralized reference trains in this process. Checks the keys and that the joint model beats
the leader alone (the throughput targets are the benchmark's business, not a test's)."""

import importlib
import json
import math
import os

import pytest

from run_helpers import FAST_COMPILE_XLA_FLAGS, bench_refuses, run_bench

pytestmark = pytest.mark.slow
#: bench.scale's flag for one-thread kernels in each party (`--party-threads one`)
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
#: the runs below: one CPU device, and XLA's code generation without LLVM's optimization
#: passes and without the fusion emitters (`run_helpers.FAST_COMPILE_XLA_FLAGS`). This
#: workload's kernels (26 embedding tables) compile for seconds each, in every process; at
#: level 0 they compile in about half the CPU time, without the fusion emitters in about half
#: of that again, and run somewhat slower; these tests read keys, launch flags and AUC
#: relations (every side compiled alike), never a speed
TEST_XLA_FLAGS = " ".join(
    f
    for f in (
        "--xla_force_host_platform_device_count=1",
        "--xla_backend_optimization_level=0",
        FAST_COMPILE_XLA_FLAGS,
    )
    if f
)

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


def test_bench_scale_refuses_a_bad_size_and_a_missing_taskset_before_any_run(tmp_path):
    """Sizes take k/M suffixes (the tiny run below uses them) and anything else is refused;
    ``--party-threads one`` (the default) needs ``taskset`` and says so before any work."""
    run = lambda *args, env=None: bench_refuses(  # noqa: E731
        "scale", "--json", "--work-dir", str(tmp_path), *args, env=env
    )
    assert "2.5x" in run("--sizes", "2.5x")
    no_taskset = run("--sizes", "6k", env={**os.environ, "PATH": str(tmp_path / "empty")})
    assert "--party-threads shared" in no_taskset
    assert list(tmp_path.iterdir()) == []  # nothing generated


def test_each_party_starts_on_a_cpu_of_its_own_with_one_thread_kernels():
    """``--party-threads one`` (the default): party i is confined to CPU i mod the CPUs this
    process may use, its kernels on one thread, the caller's XLA flags kept; ``shared``
    changes neither (``--print-launch`` shows it without running anything)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    flags = env["XLA_FLAGS"]
    one, _ = run_bench("scale", "--print-launch", "--followers", "2", env=env, timeout=60)
    cpus = sorted(os.sched_getaffinity(0))
    assert one["launched"] == {
        p: {"cpu": str(cpus[i % len(cpus)]), "xla_flags": f"{flags} {ONE_THREAD_XLA_FLAGS}"}
        for i, p in enumerate(("leader", "follower1", "follower2"))
    }
    shared, _ = run_bench(
        "scale", "--print-launch", "--party-threads", "shared", env=env, timeout=60
    )
    assert shared["launched"] == {
        p: {"cpu": None, "xla_flags": flags} for p in ("leader", "follower")
    }


@pytest.mark.timeout(600)  # six processes importing JAX, and compiles, on a loaded 2-core machine
def test_bench_scale_tiny(tmp_path):
    pytest.importorskip("pyarrow")
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    # 1363 rows a batch: the 5452 training rows of this workload in 4 whole batches. A short
    # last batch costs the centralized reference (this test's longest part) one more compile
    # of its step for each of its two models
    out, lines = run_bench(
        "scale", "--json", "--sizes", "6k", "--batch-size", "1363", "--epochs", "2",
        "--groups", "1", "--align-max", "12.5k", "--reference-max", "4m",
        "--learning-rate", "0.01", "--vocab-min", "10", "--vocab-max", "100",
        "--timeout", "240",
        # pinned to one CPU each, the parties would queue behind the other tests' processes
        # (the pinning: test_each_party_starts_on_a_cpu_of_its_own_with_one_thread_kernels)
        "--party-threads", "shared",
        "--no-breakdown",  # its two processes would double the test's time (next test)
        "--work-dir", str(tmp_path),
        timeout=580,
        env=env,
    )  # fmt: skip
    assert len(lines) == 1
    assert out["settings"]["align_max"] == 12_500 and out["settings"]["reference_max"] == 4_000_000
    entry = out["sizes"]["6000"]
    assert ENTRY_KEYS <= set(entry)
    assert TOP_KEYS <= set(out)
    assert entry["aligned_by"] == "tandem align" and entry["align_s"] > 0
    assert set(entry["rss_mb"]) == {"leader", "follower"}
    assert all(v > 0 for v in entry["rss_mb"].values())
    assert entry["rows_per_s"] > 0 and entry["centralized_rows_per_s"] > 0
    assert len(entry["epoch_s"]) == 2
    assert entry["breakdown"] is None  # timed apart: test_the_breakdown_times_every_kernel
    # shared: no CPU of their own, the caller's XLA flags as they are
    flags = TEST_XLA_FLAGS
    assert entry["launched"] == {
        p: {"cpu": None, "xla_flags": flags} for p in ("leader", "follower")
    }
    # a fixed count: no comparison runs and no repeated run (the repeated run's mechanism,
    # the remembered count: tests/test_party_cli.py); the first epoch against the last
    epochs, rows = entry["epoch_s"], entry["train_rows"]
    assert entry["first_epoch_vs_steady"] == pytest.approx(
        epochs[0] / epochs[-1], rel=0.01, abs=1e-3
    )
    all_epochs = len(epochs) * rows / sum(epochs)
    assert entry["rows_per_s_all_epochs"] == pytest.approx(all_epochs, rel=0.01)
    assert entry["auto_vs_best_fixed"] is None and "warm" not in entry
    assert out["auto_vs_best_fixed_warm"] is None and out["first_epoch_vs_steady_warm"] is None
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
    """``python -m bench.scale_kernels --which both`` on a tiny workload (``python -m
    bench.ctr``): every kernel of the parties (at 4 groups of 1000 rows: padded past the
    ladder) and of the centralized step is timed by both clocks, in one process (as
    ``bench.scale --party-threads shared`` runs it)."""
    pytest.importorskip("pyarrow")
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    run_bench("ctr", "--rows", "3000", "--vocab", "10", "100", "--out", str(tmp_path))
    common = ("--parties", "leader,follower", "--batch-size", "1000", "--batches", "1")
    common += ("--learning-rate", "0.01", "--cut", "64")  # bench.ctr's cut
    both, lines = run_bench("scale_kernels", str(tmp_path), "--which", "both", "--groups", "4",
                            *common, env=env)  # fmt: skip
    assert len(lines) == 1 and set(both) == {"pipelined", "centralized"}
    pipe, central = both["pipelined"], both["centralized"]
    for clock in ("wall_ms", "cpu_ms"):
        kernels = {"forward", "loss", "backward", "update", "zeros", "d2h", "h2d", "encode"}
        assert kernels | {"decode"} <= set(pipe[clock])
        assert {"step", "forward", "value_and_grad", "update"} <= set(central[clock])
        assert all(v >= 0 for v in pipe[clock].values())
    assert set(pipe["by_party_wall_ms"]) == {"leader", "follower"}
    assert pipe["groups"] == 4 and pipe["padded_rows"] > 1.0


def test_the_automatic_counts_figures_against_the_fixed_counts():
    """`auto_figures` from epoch seconds alone: the first epoch against the last, every epoch
    against the best fixed count's last epoch, and like for like (every epoch of both, each
    compiling from scratch), where a fixed count that is best in its last epoch need not be
    best over every epoch."""
    auto_figures = importlib.import_module("bench.scale").auto_figures  # as test_bench_smoke

    fixed = {1: [12.0, 10.0], 2: [10.0, 8.0], 4: [9.0, 8.5]}  # seconds per epoch of 100 rows
    got = auto_figures([14.0, 8.0], 100, fixed)
    assert got["first_epoch_vs_steady"] == 1.75
    assert got["rows_per_s_all_epochs"] == pytest.approx(200 / 22, abs=0.05)
    assert got["best_fixed"] == 2 and got["fixed_rows_per_s"]["2"] == 12.5
    assert got["auto_vs_best_fixed"] == round((200 / 22) / 12.5, 3)
    assert got["fixed_first_epoch_vs_steady"] == {"1": 1.2, "2": 1.25, "4": 1.059}
    # best over every epoch: 4 (17.5 s in all, against 2's 18 s)
    assert got["auto_vs_best_fixed_all_epochs"] == round(17.5 / 22, 3)
    alone = auto_figures([14.0, 8.0], 100, {})
    assert alone["auto_vs_best_fixed"] is None and alone["best_fixed"] is None
    assert alone["auto_vs_best_fixed_all_epochs"] is None
    assert alone["fixed_first_epoch_vs_steady"] == {}
