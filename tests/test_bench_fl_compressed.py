"""`bench.fl_compressed`: a tiny run prints one JSON line with the gap, the ratios and the
per-round curve of both runs, and draws the curve when asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_tiny_run_prints_the_keys_and_draws_the_curve(tmp_path):
    png = tmp_path / "curve.png"
    args = ("--json", "--hidden", "16", "--rows", "200", "--rounds", "3", "--plot", str(png))
    out = subprocess.run(
        [sys.executable, "-m", "bench.fl_compressed", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1  # stdout carries the result only
    res = json.loads(lines[0])
    assert res["bench"] == "fl_compressed" and res["compressed_rounds"] == 3
    assert res["compressed_warmup"] == {"dense_rounds": 2, "ramp_rounds": 4}
    curve = res["compressed_curve"]
    assert sorted(curve) == ["0", "1", "2"]
    assert curve["0"][0] == curve["0"][1] and curve["1"][0] == curve["1"][1]  # dense rounds
    gap = res["compressed_acc_dense"] - res["compressed_acc"]
    assert abs(res["compressed_acc_gap"] - gap) < 0.011
    assert res["compressed_uplink_ratio"] > 1 and res["compressed_downlink_ratio"] > 1
    assert png.stat().st_size > 0
