"""Write the three organisations' tables of the three-party example (README.md here).

A synthetic credit task: 600 customers, each described by three organisations, each in its
own CSV with a string id column (``customer_id``) and its own row order:

* ``bank.csv``: ``income``, ``debt``, ``late_payments`` and ``default`` (the labels, 0/1);
* ``shop.csv``: ``monthly_spend``, ``returns``;
* ``telco.csv``: ``minutes``, ``data_gb``, ``contract_months``.

Whether a customer defaults depends on columns of all three, so the star beats the bank
alone. Each organisation holds a random 95% of the customers. Deterministic (``--seed``);
numpy only.

    python make_data.py [--out DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import os

import numpy as np

CUSTOMERS = 600
HOLD = 0.95  # fraction of the customers each organisation holds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    n = CUSTOMERS
    ids = np.array([f"C{i:05d}" for i in rng.permutation(100000)[:n]])
    z = rng.normal(size=(n, 8))
    columns = {
        "bank": {
            "income": 50 + 15 * z[:, 0],
            "debt": 20 + 8 * z[:, 1],
            "late_payments": np.round(np.clip(1.5 + z[:, 2], 0, None)),
        },
        "shop": {"monthly_spend": 300 + 90 * z[:, 3], "returns": np.round(2 + z[:, 4] ** 2)},
        "telco": {
            "minutes": 400 + 120 * z[:, 5],
            "data_gb": 8 + 3 * z[:, 6],
            "contract_months": np.round(np.clip(12 + 6 * z[:, 7], 1, None)),
        },
    }
    score = -z[:, 0] + z[:, 1] + 0.8 * z[:, 2] + 0.9 * z[:, 3] - 0.9 * z[:, 7] - 0.3
    default = (score + 0.5 * rng.normal(size=n) > 0).astype(int)
    for org, cols in columns.items():
        held = rng.permutation(n)[: round(HOLD * n)]  # shuffled: its own row order
        header = ["customer_id", *cols] + (["default"] if org == "bank" else [])
        with open(os.path.join(args.out, f"{org}.csv"), "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for i in held:
                row = [ids[i], *(f"{float(v[i]):.4g}" for v in cols.values())]
                w.writerow(row + ([int(default[i])] if org == "bank" else []))
        print(f"{org}.csv: {len(held)} customers, {len(header)} columns")


if __name__ == "__main__":
    main()
