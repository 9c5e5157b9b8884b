"""`bench.privacy`, run as a user runs it: a quick undefended run prints one JSON line with the
audit's figures, and the summary picks the best defenses of a table by the issue's rule
(attacks, then the AUC budget; ``--from`` summarizes given figures without training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_helpers import bench_refuses, run_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run() -> str:
    """The stdout of one ``--quick`` run of the undefended case, the secure sum measured, for
    the two tests below (``--no-secure-sum``: the defended case's test)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.privacy",
            *("--quick", "--json", "--tasks", "imbalanced", "--defenses", "none"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_quick_run_prints_the_undefended_figures(quick_run):
    (line,) = quick_run.splitlines()  # stdout carries the result only
    result = json.loads(line)
    case = result["tasks"]["imbalanced"]["none"]
    assert case.keys() == {
        "auc",
        "auc_delta",
        "norm_attack_auc",
        "cosine_attack_auc",
        "feature_r2",
        "rows_per_second",
    }
    assert case["auc_delta"] == 0.0 and case["rows_per_second"] > 0
    # undefended gradients of an imbalanced label leak it to the follower
    assert result["undefended_norm_attack_auc"] == case["norm_attack_auc"] > 0.6
    assert result["undefended_cosine_attack_auc"] == case["cosine_attack_auc"] > 0.6
    assert 0 <= case["feature_r2"] <= 1
    assert result["best_label_defense"] is None
    assert result["rows"] == {"imbalanced": 2000, "ctr": None}


def test_the_run_measures_the_secure_sum_against_the_plain_sum(quick_run):
    assert json.loads(quick_run)["secure_sum_vs_plain"] > 0


def _case(auc, norm, cos, r2):
    return {
        "auc": auc,
        "norm_attack_auc": norm,
        "cosine_attack_auc": cos,
        "feature_r2": r2,
        "rows_per_second": 1.0,
    }


def _refused(*args: str) -> str:
    """``python -m bench.privacy *args`` fails before training: its stderr."""
    return bench_refuses("privacy", *args)


def test_the_summary_prefers_defenses_within_the_auc_budget(tmp_path):
    cases = {
        "none": _case(0.90, 0.95, 1.00, 0.8),
        "strong": _case(0.80, 0.50, 0.50, 0.0),  # safest, but costs 0.10 AUC
        "mild": _case(0.895, 0.58, 0.60, 0.05),  # within 0.01 of the AUC
        "weak": _case(0.90, 0.90, 0.95, 0.7),
    }
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"tasks": {"imbalanced": cases}}))
    out, _ = run_bench("privacy", "--from", str(saved), "--json")
    assert out["undefended_norm_attack_auc"] == 0.95
    assert out["best_label_defense"] == {
        "name": "mild",
        "norm_attack_auc": 0.58,
        "cosine_attack_auc": 0.60,
        "auc_delta": pytest.approx(0.005),
    }
    assert out["best_feature_defense"]["name"] == "mild"
    # none within budget: the safest overall is reported, with its cost
    costly = {"none": cases["none"], "strong": cases["strong"]}
    saved.write_text(json.dumps({"tasks": {"imbalanced": costly}}))
    best = run_bench("privacy", "--from", str(saved), "--json")[0]["best_label_defense"]
    assert best["name"] == "strong" and best["auc_delta"] == pytest.approx(0.10)


def test_unknown_tasks_are_refused():
    assert "--tasks" in _refused("--tasks", "imbalanced,mnist")


def test_plot_draws_the_tradeoff(tmp_path):
    pytest.importorskip("matplotlib")
    cases = {"none": _case(0.9, 0.95, 1.0, 0.8), "mild": _case(0.895, 0.58, 0.6, 0.05)}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"tasks": {"imbalanced": cases}}))
    path = tmp_path / "tradeoff.png"
    run_bench("privacy", "--from", str(saved), "--plot", str(path), "--json")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_every_defense_enters_at_three_strengths_and_each_case_is_a_valid_privacy_table():
    from tandem.parties.privacy.config import DEFENSES as KEYS
    from tandem.parties.privacy.config import privacy_from

    defenses, _ = run_bench("privacy", "--list-defenses")
    assert defenses["none"] == {}
    for key in KEYS:
        cases = [name for name, table in defenses.items() if set(table) == {key}]
        assert len(cases) == 3, (key, cases)
    for table in defenses.values():
        assert privacy_from(table).defended == bool(table)


def test_unknown_defense_cases_are_refused():
    assert "--defenses names unknown cases ['mixup']" in _refused("--defenses", "mixup")


def test_a_defended_case_trains_with_its_privacy_table_and_fills_the_summary():
    """Gradient DP blinds both label attacks, NoPeek is a feature defense: the summary names
    each (a tiny run: the figures are the bench's, not this test's)."""
    out, _ = run_bench(
        "privacy", "--json", "--tasks", "imbalanced", "--rows", "1500", "--seed", "1",
        "--epochs", "1", "--batch-size", "128", "--defenses", "gradient_dp_nm2,nopeek_w0.2",
        "--no-secure-sum",
    )  # fmt: skip
    assert out["secure_sum_vs_plain"] is None  # not measured with --no-secure-sum
    cases = out["tasks"]["imbalanced"]
    assert list(cases) == ["none", "gradient_dp_nm2", "nopeek_w0.2"]
    assert cases["none"]["norm_attack_auc"] > 0.7
    assert cases["gradient_dp_nm2"]["norm_attack_auc"] < 0.65
    assert cases["gradient_dp_nm2"]["cosine_attack_auc"] < 0.65
    assert out["best_label_defense"]["name"] == "gradient_dp_nm2"
    assert out["best_feature_defense"]["name"] in ("gradient_dp_nm2", "nopeek_w0.2")
