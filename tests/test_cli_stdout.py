"""stdout carries only the result: each demo, run with its progress display on and stdout piped,
prints exactly one line on stdout, a JSON object, while its progress goes to stderr (so
``tandem demo | jq`` works)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,key",
    [
        (["demo", "--epochs", "1", "--batch-size", "256", "--groups", "2"], "test_accuracy"),
        (["elastic", "demo", "--epochs", "1", "--rows", "64", "--workers", "1"], "exactly_once"),
    ],
    ids=["demo", "elastic-demo"],
)
def test_stdout_is_one_json_line_and_progress_goes_to_stderr(argv, key):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", *argv],
        env=env,
        capture_output=True,  # stdout is a pipe, not a terminal
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert key in json.loads(lines[0])
    assert "batches" in proc.stderr  # the progress bar's final state
