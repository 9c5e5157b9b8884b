"""Smoke test of the pipeline benchmark's core on a tiny configuration: every key is present
and every number is finite (the targets are the benchmark's business, not a test's)."""

import functools
import importlib
import math
import statistics

import pytest

from run_helpers import bench_refuses, run_bench
from tandem.engine.batch_time import PARTS, batch_parts
from tandem.errors import ConfigError

KEYS = (
    "sequential_s",
    "pipelined_s",
    "bound_s",
    "speedup",
    "efficiency",
    "n_groups",
    "auto_vs_best",
    "auto_vs_best_of_medians",
    "sweep",
    "bound_terms",
    "overhead_us_per_op",
    "overhead_us_per_compute_op",
    "overhead_cpu_us_per_op",
    "handoff_us_per_compute_op",
    "link",
    "workload",
    "loadavg",
    "schedule_s",
    "schedule_efficiency",
    "engine_efficiency",
    "chunks",
    "unchunked_s",
    "unchunked_efficiency",
    "tuner_first_n",
    "tune_rechecks",
)


@pytest.mark.slow
def test_pipeline_benchmark_tiny(tmp_path):
    """``python -m bench.pipeline --quick``: batches of 16 rows, 2 rounds, the sweep n = 1 and
    4, one re-calibration per round, the default link ratio (1) and chunks (4)."""
    plot = tmp_path / "gantt.png"
    result, lines = run_bench("pipeline", "--quick", "--json", "--plot", str(plot))
    assert len(lines) == 1
    batch_size, repeats, link_ratio, chunks = 16, 2, 1.0, 4
    for key in KEYS:
        assert key in result, key
    for key in (
        "sequential_s",
        "pipelined_s",
        "bound_s",
        "speedup",
        "efficiency",
        "auto_vs_best",
        "overhead_us_per_op",
    ):
        assert math.isfinite(result[key]) and result[key] > 0 or key == "overhead_us_per_op", key
        assert math.isfinite(result[key]), key
    assert set(result["sweep"]) == {"1", "4"}
    # auto against the best fixed n within each round (paired), and as a ratio of medians
    best = result["runs"][f"n={result['best_fixed_n']}"]
    assert result["sweep"][str(result["best_fixed_n"])] == min(result["sweep"].values())
    assert result["auto_vs_best"] == pytest.approx(
        statistics.median(f / a for f, a in zip(best, result["runs"]["pipelined_s"], strict=True))
    )
    assert result["auto_vs_best_of_medians"] == pytest.approx(
        min(result["sweep"].values()) / result["pipelined_s"]
    )
    assert all(math.isfinite(t) and t > 0 for t in result["sweep"].values())
    assert 1 <= result["n_groups"] <= batch_size
    terms = {k: v for k, v in result["bound_terms"].items() if k != "definition"}
    assert set(terms) == {"compute[A]", "compute[B]", "link[A->B]", "link[B->A]"}
    assert result["bound_s"] == pytest.approx(max(terms.values()))
    assert result["efficiency"] == pytest.approx(result["bound_s"] / result["pipelined_s"])
    assert result["speedup"] == pytest.approx(result["sequential_s"] / result["pipelined_s"])
    assert plot.stat().st_size > 0
    # chunked pipelined runs (the default), with whole groups timed beside them
    assert result["chunks"] == chunks > 1 and result["workload"]["chunks"] == chunks
    assert math.isfinite(result["unchunked_s"]) and result["unchunked_s"] > 0
    assert 0 < result["unchunked_efficiency"] and len(result["runs"]["unchunked_s"]) == 2
    # timed after the tuner's first search and one re-check: it settled twice
    assert result["tune_rechecks"] == 1 and result["tuner_settled"]
    path = [n for n, _ in result["tuner_path"]]
    assert 1 <= result["tuner_first_n"] <= batch_size
    assert len(path) > 50 + 2 * 4  # two searches of >= 4 samples, 50 batches apart
    # the link is re-shaped from the compute measured before each round
    cal = result["calibration"]
    assert cal["recalibrate"] == 1
    for key in ("compute_s", "link_s", "sequential_compute_s"):
        assert len(cal[key]) == repeats and all(v > 0 for v in cal[key]), key
    assert cal["link_s"] == pytest.approx([c * link_ratio for c in cal["compute_s"]])
    assert result["link_vs_compute"] == pytest.approx(
        statistics.median(
            link / c for link, c in zip(cal["link_s"], cal["sequential_compute_s"], strict=True)
        )
    )
    # the zero-cost schedule at the tuner's n: never shorter than a link's transfer time
    if result["schedule_s"] is not None:
        links = max(v for k, v in terms.items() if k.startswith("link"))
        assert result["schedule_s"] >= links * (1 - 1e-9)
        assert result["engine_efficiency"] == pytest.approx(
            result["schedule_s"] / result["pipelined_s"]
        )
        assert result["schedule_efficiency"] == pytest.approx(
            result["bound_s"] / result["schedule_s"]
        )


def test_each_round_times_auto_next_to_the_fixed_run_of_its_n_on_alternating_sides():
    """``python -m bench.pipeline --print-plan``: each timed round's runs, for every count the
    tuner may settle on, without running them."""
    out, lines = run_bench(
        "pipeline",
        "--print-plan",
        "--batch-size",
        "64",
        "--repeats",
        "4",
        "--sweep",
        "1,2,4,8,16,32",
    )
    assert len(lines) == 1
    ns = [1, 2, 4, 8, 16, 32]
    assert out["sweep"] == ns and out["repeats"] == 4 and len(out["round_orders"]) == 64

    def round_order(n_auto: int, r: int) -> list[int | None]:
        return [None if n == "auto" else n for n in out["round_orders"][str(n_auto)][r]]

    assert round_order(8, 0) == [1, 2, 4, 8, None, 16, 32]
    assert round_order(8, 1) == [1, 2, 4, None, 8, 16, 32]
    for r in (0, 1):  # a count the sweep lacks: between its neighbours
        assert round_order(6, r) == [1, 2, 4, None, 8, 16, 32]
    assert round_order(1, 1) == [None, 1, 2, 4, 8, 16, 32]
    assert round_order(64, 1) == [*ns, None]
    for n_auto in (1, 3, 8, 40):
        for r in range(4):
            order = round_order(n_auto, r)
            assert sorted(n for n in order if n is not None) == ns and order.count(None) == 1
    # the sweep is capped at the batch size, as the timed rounds run it
    out, _ = run_bench("pipeline", "--print-plan", "--batch-size", "16", "--repeats", "1")
    assert out["sweep"] == [1, 2, 4, 8, 16] and out["round_orders"]["16"] == [
        [1, 2, 4, 8, 16, "auto"]
    ]


def test_tuner_noise_benchmark_prints_one_line_per_setting():
    out, lines = run_bench("tuner_noise", "--runs", "10", "--starts", "3,8")
    assert len(lines) == 1
    assert out["starts"] == [3, 8]
    assert out["noise_model"] == "measured" and out["noise"] is None
    assert [
        (s["samples"], s["first_search_margin"], s["prefer_larger"], s["confirm"], s["trim"])
        for s in out["settings"]
    ] == [
        (3, True, False, 0, 0.0),
        (3, False, False, 0, 0.0),
        (4, False, False, 0, 0.0),
        (5, False, False, 0, 0.0),
        (8, False, False, 0, 0.0),
        (4, False, True, 0, 0.0),
        (8, False, True, 0, 0.0),
        (4, False, True, 2, 0.0),
        (4, False, True, 2, 0.25),
    ]
    assert out["drift"] == 0.0
    for s in out["settings"]:
        assert 0 <= s["behind_10pct"] <= s["behind_5pct"] <= s["behind_2pct"] <= 1
        assert 0 < s["mean_best_over_settled"] <= 1 and s["batches"] > 0
    out, _ = run_bench(
        "tuner_noise", "--runs", "3", "--starts", "8", "--noise-model", "normal", "--noise", "0.05"
    )
    assert out["noise_model"] == "normal" and out["noise"] == 0.05 and len(out["settings"]) == 9


def test_drift_moves_whole_spells_of_batches_alike():
    """``--drift``: the tuner sees the machine's slow spells on top of the per-batch noise, and
    a seeded run is reproducible (the default tuner: the last setting)."""
    calm = run_bench("tuner_noise", "--runs", "2", "--starts", "3")[0]
    assert run_bench("tuner_noise", "--runs", "2", "--starts", "3")[0] == calm
    drift = ("tuner_noise", "--runs", "20", "--starts", "3", "--drift", "0.2")
    drifting = run_bench(*drift)[0]
    assert drifting["drift"] == 0.2 and run_bench(*drift)[0] == drifting
    assert len(drifting["settings"][-1]["settled_n"]) > 1  # some runs sent elsewhere


def test_rechecks_keep_a_settled_n_when_their_wins_are_measured_again():
    """``--rechecks``: a run goes on through re-checks; with a re-check's win measured again
    (``GroupTuner.verify``) fewer runs drift off the best n (8 on the curve) than when one
    comparison moves n."""

    def off_eight(verify: bool) -> int:
        args = ("--runs", "60", "--starts", "8", "--rechecks", "2")
        out, _ = run_bench("tuner_noise", *args, *(() if verify else ("--no-verify",)))
        assert out["rechecks"] == 2 and out["verify"] == verify
        default = out["settings"][-1]  # the default tuner
        assert default["batches_min"] > 2 * 50  # both re-checks ran
        return sum(k for n, k in default["settled_n"].items() if n != "8")

    assert off_eight(True) < off_eight(False)


def test_the_measured_noise_model_draws_the_stored_distribution():
    """``python -m bench.tuner_noise --noise-draws N``: the measured model's draws follow its
    stored percentiles, the long right tail included."""
    import numpy as np

    out, lines = run_bench("tuner_noise", "--noise-draws", "20000")
    assert len(lines) == 1 and out["noise_model"] == "measured" and out["noise"] is None
    percentiles = out["measured_percentiles"]
    assert len(percentiles) == 101
    draws = np.array(out["draws"])
    assert len(draws) == 20000
    assert draws.min() >= percentiles[0] and draws.max() <= percentiles[-1]
    for q in (5, 50, 95):
        assert np.percentile(draws, q) == pytest.approx(percentiles[q], abs=0.01)
    assert (draws > percentiles[99]).mean() == pytest.approx(0.01, abs=0.003)  # the tail


def test_balance_splits_each_batch_into_parts_that_add_up():
    """`tandem.engine.batch_time.batch_parts` (`bench.balance`'s parts) on a hand-made trace of
    two batches: each batch starts where the previous update on A ended, and its parts sum to
    its length."""
    from tandem.engine.trace import Trace, TraceEvent

    ms = 1e-3
    tr = Trace()
    for t0 in (0.0, 12 * ms):  # two identical 12 ms batches
        for party, lane, name, start, end in [
            ("A", "compute", "F(bottom,0)", 0, 1),
            ("A", "send->B", "S(act,0)", 1, 3),
            ("A", "send->B", "S(act,1)", 3, 5),
            ("B", "compute", "L(top,0)", 4, 4.5),
            ("B", "send->A", "S(grad,0)", 5, 7),
            ("B", "send->A", "S(grad,1)", 8, 9),
            ("A", "compute", "B(bottom,0)", 10, 11),
            ("A", "compute", "U(bottom)", 11, 12),
        ]:
            tr.add(TraceEvent(party, lane, name, 0, t0 + start * ms, t0 + end * ms))
    parts = batch_parts(tr, "A", "B")
    assert len(parts) == 2
    for p in parts:
        assert p == pytest.approx(
            {
                "fill_ms": 1,
                "grad_start_ms": 4,
                "grad_link_ms": 3,
                "grad_gaps_ms": 1,
                "drain_ms": 3,
                "batch_ms": 12,
            }
        )
        assert sum(p[k] for k in PARTS) == pytest.approx(p["batch_ms"])
    with pytest.raises(ValueError, match="no update on A"):
        batch_parts(Trace(), "A", "B")


@pytest.mark.slow
def test_balance_benchmark_tiny(tmp_path):
    """``python -m bench.balance --quick`` end to end on a tiny model (ratios 1 and 2, 4 groups
    of 2 chunks, 2 runs each): a row per ratio, finite efficiencies, and the medians of the
    parts close to the median batch."""
    plot = tmp_path / "balance.png"
    result, _ = run_bench("balance", "--quick", "--json", "--plot", str(plot))
    repeats = 2
    assert set(result["ratios"]) == {"1", "2"}
    assert result["n_groups"] == 4 and result["chunks"] == 2
    for row in result["ratios"].values():
        assert math.isfinite(row["efficiency"]) and row["efficiency"] > 0
        assert len(row["efficiency_runs"]) == repeats
        assert all(row[k] >= 0 for k in PARTS) and row["batch_ms"] > 0
    slow, fast = result["ratios"]["2"], result["ratios"]["1"]
    assert slow["link_per_batch_ms"] == pytest.approx(2 * fast["link_per_batch_ms"])
    assert plot.stat().st_size > 0


def _refused(module: str, *args: str) -> str:
    """``python -m bench.<module> *args`` stops on its config (a `ConfigError`) before any
    run: the error's line."""
    return bench_refuses(module, *args).strip().splitlines()[-1]


def _refused_here(capsys, module: str, *args: str) -> str:
    """``bench.<module>.main(args)`` in this process raises its `ConfigError` before printing
    anything: the line `_refused` reads (the same check, without an interpreter of its own)."""
    main = importlib.import_module(f"bench.{module}").main
    with pytest.raises(ConfigError) as info:
        main(list(args))
    assert capsys.readouterr().out == ""
    return f"ConfigError: {info.value}"


def test_balance_rejects_a_bad_config(capsys):
    """As a process (the command line's path) once, then in this process."""
    assert "ConfigError: ratios" in _refused("balance", "--ratios", "1,0")
    assert "ConfigError: n_groups" in _refused_here(
        capsys, "balance", "--batch-size", "4", "--n-groups", "5"
    )


def test_pipeline_benchmark_rejects_a_bad_link_ratio(capsys):
    """As a process (the command line's path) once, then in this process."""
    assert "ConfigError: link_ratio" in _refused("pipeline", "--link-ratio", "0")
    refused = functools.partial(_refused_here, capsys, "pipeline")
    # (one check refuses every non-positive or non-finite ratio)
    assert "ConfigError: link_ratio" in refused("--link-ratio", "nan")
    assert "recalibrate" in refused("--recalibrate", "-1")
    assert "ConfigError: tune_rechecks" in refused("--tune-rechecks", "-1")
    assert "ConfigError: warmup" in refused("--warmup", "0")
    assert "ConfigError: sweep" in refused("--sweep", "4,0", "--print-plan")
