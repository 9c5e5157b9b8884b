"""The worked example of docs/two-orgs.md, run exactly as written there (the shell block between
its markers, only the ports and the folder changed), as separate processes: align, train,
predict. Its test accuracy must be within one point of a centralized scikit-learn model on
the same split, and the predictions file must reproduce the accuracy training reported."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from party_helpers import ROOT
from ports import free_port

pytestmark = pytest.mark.slow
PORTS = ("8601", "8602", "8711", "8712")


def _commands() -> str:
    text = (ROOT / "docs" / "two-orgs.md").read_text()
    block = re.search(
        r"<!-- two-orgs:begin -->\s*```bash\n(.*?)```\s*<!-- two-orgs:end -->", text, re.S
    )
    assert block, "docs/two-orgs.md lost its marked shell block"
    return block.group(1)


def test_two_organisations_from_the_docs(tmp_path):
    folder = tmp_path / "two-orgs"
    shutil.copytree(
        ROOT / "examples" / "two-orgs",
        folder,
        ignore=shutil.ignore_patterns("out", "*.csv", "__pycache__"),
    )
    script = _commands()
    assert script.startswith("cd examples/two-orgs\n")
    script = script.replace("cd examples/two-orgs", f"cd {folder}", 1)
    for port in PORTS:
        new = str(free_port())
        script = script.replace(port, new)
        for name in ("clinic.toml", "lab.toml"):
            path = folder / name
            path.write_text(path.read_text().replace(port, new))
    prelude = f'set -e\ntandem() {{ "{sys.executable}" -m tandem "$@"; }}\n'
    prelude += f'python() {{ "{sys.executable}" "$@"; }}\n'
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        ["bash", "-c", prelude + script], capture_output=True, text=True, env=env, timeout=110
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    aligned = [x for x in lines if "intersection_size" in x]
    trained = {x["party"]: x for x in lines if x.get("status") == "done"}
    predicted = [x for x in lines if x.get("command") == "predict"]
    assert len(aligned) == 2 and len(trained) == 2 and len(predicted) == 2, run.stdout
    assert aligned[0]["intersection_commitment"] == aligned[1]["intersection_commitment"]
    size = aligned[0]["intersection_size"]
    assert 0.8 < size / 569 < 0.9  # about 84% of the patients are in both tables
    lead = trained["clinic"]
    assert lead["alignment"]["size"] == size

    # the split both parties used, from the aligned ids and the agreed seed
    from tandem.parties.data import SplitConfig, assign_split

    with open(folder / "predictions.csv", newline="") as f:
        predictions = {r["id"]: float(r["probability"]) for r in csv.DictReader(f)}
    ids = np.array(sorted(predictions), dtype=object)
    split = assign_split(ids, SplitConfig(test=0.25, seed=7))
    tables = {}
    for org in ("clinic", "lab"):
        with open(folder / f"{org}.csv", newline="") as f:
            rows = list(csv.reader(f))
        tables[org] = {r[0]: r[1:] for r in rows[1:]}
    x = np.array([tables["clinic"][i][:-1] + tables["lab"][i] for i in ids], float)
    y = np.array([int(tables["clinic"][i][-1]) for i in ids])
    test = split.test
    ours = np.mean((np.array([predictions[i] for i in ids[test]]) > 0.5) == y[test])
    assert ours == pytest.approx(lead["test_accuracy"], abs=1e-9)

    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    central = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    central.fit(x[split.train], y[split.train])
    baseline = central.score(x[test], y[test])
    assert abs(ours - baseline) <= 0.01, (ours, baseline)
