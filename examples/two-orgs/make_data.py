"""Write the two organisations' tables of the worked example (docs/two-orgs.md).

scikit-learn's bundled breast-cancer data (569 patients, 30 measurements, the diagnosis),
split by columns between two organisations that share some of their patients:

* ``clinic.csv``: ``customer_id``, the first 15 measurements and ``malignant`` (the labels);
* ``lab.csv``: ``customer_id`` and the other 15 measurements.

Each holds a random 92% of the patients (so about 84% of all patients are in both), under
string ids like ``P00123``, in its own shuffled row order. Deterministic (``--seed``).

    python make_data.py [--out DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import os

import numpy as np
from sklearn.datasets import load_breast_cancer

HOLD = 0.92  # fraction of the patients each organisation holds


def write(path: str, header: list[str], rows: list[list[object]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = load_breast_cancer()
    x, y = data.data, 1 - data.target  # sklearn's target 0 is malignant: make it the 1 class
    names = [n.replace(" ", "_") for n in data.feature_names]
    rng = np.random.default_rng(args.seed)
    ids = np.array([f"P{i:05d}" for i in rng.permutation(100000)[: len(y)]])
    half = x.shape[1] // 2
    for org, cols, labels in (("clinic", slice(0, half), True), ("lab", slice(half, None), False)):
        held = rng.permutation(len(y))[: round(HOLD * len(y))]  # shuffled: its own row order
        header = ["customer_id", *names[cols]] + (["malignant"] if labels else [])
        rows = [
            [ids[i], *(repr(float(v)) for v in x[i, cols])] + ([int(y[i])] if labels else [])
            for i in held
        ]
        write(os.path.join(args.out, f"{org}.csv"), header, rows)
        print(f"{org}.csv: {len(rows)} patients, {len(header)} columns")


if __name__ == "__main__":
    main()
