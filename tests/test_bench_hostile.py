"""Smoke test of ``python -m bench.hostile`` at a tiny size: one attack class against a
one-epoch job; the JSON line has every key, and the attack is refused without changing what
the parties train."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_hostile_bench_smoke():
    done = subprocess.run(
        [sys.executable, "-m", "bench.hostile", "--json", "--attacks", "replay"]
        + ["--epochs", "1", "--seconds", "3", "--budget-mib", "64"],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    for key in (
        "attacks",
        "failed",
        "max_rss_mb",
        "rss_budget_mb",
        "healthz_p99_ms_under_attack",
        "per_attack",
        "load",
    ):
        assert key in result, key
    assert result["attacks"] == 1 and set(result["per_attack"]) == {"replay"}
    assert result["failed"] == [], result["per_attack"]
    assert 0 < result["max_rss_mb"] <= result["rss_budget_mb"]
    assert result["per_attack"]["replay"]["statuses"].keys() >= {"421"}


@pytest.mark.slow
def test_hostile_bench_covers_the_elastic_and_fl_roles():
    """The role attacks (`tandem.testing.hostile_roles`) run under ``bench.hostile`` with their
    verdicts and figures in the JSON line: one elastic and one FL attack here (each attack
    itself is tested in test_elastic_hostile.py and test_fl_bounds.py)."""
    attacks = "done_without_gradients,oversized_update"
    done = subprocess.run(
        [sys.executable, "-m", "bench.hostile", "--json", "--attacks", attacks]
        + ["--epochs", "1", "--seconds", "3", "--budget-mib", "64"],
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result["failed"] == [], result["per_attack"]
    assert set(result["per_attack"]) == set(attacks.split(","))
    assert result["per_attack"]["done_without_gradients"]["fenced"] == ["w1"]
    assert result["per_attack"]["oversized_update"]["bytes_from_c3"] < 1 << 20
