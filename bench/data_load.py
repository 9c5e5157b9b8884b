"""Benchmark of loading one party's table: peak memory and time against the arrays' bytes.

    python -m bench.data_load --json              # 1M and 4M rows
    python -m bench.data_load --rows 200000       # a quicker look, human-readable lines

For each size n, the parent writes a click-through-style party table as Parquet (seeded): a
string id column, a 0/1 label, 13 dense float columns and 13 categorical columns (integer and
text in turn, Zipf-like frequencies, vocabularies from 10**3 to 10**5), in row groups of 128k
rows. A child process (``--child``) imports the split party's loader, tunes the C allocator
as the ``tandem`` command does (`tandem.parties.cli.allocator.tune_allocator`), notes its RSS
(``baseline_mb``: interpreter and libraries), loads the table as the split party does
(`tandem.parties.split.process.party_data.load_table_data`: ids, split, fit, transform, labels,
fingerprint, final layout) and reports its peak RSS (VmHWM), wall and CPU seconds, and the
bytes of the arrays it returns (``data_mb``: float32 features and labels).
``rss_vs_data_<n>`` is peak RSS / those bytes, the interpreter included; ``added_vs_data_<n>``
is (peak RSS - baseline) / those bytes, what loading itself adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DENSE = 13
CATEGORICAL = 13
ROW_GROUP = 1 << 17


def write_party_table(path: str, n: int, seed: int) -> None:
    """The table described in the module docstring, as Parquet at ``path``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)

    def text(prefix: str, numbers: np.ndarray) -> pa.Array:
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(numbers), pa.string()), "")

    columns = {
        "id": text("u", rng.permutation(n) * 7 + 1_000_003),
        "label": pa.array(rng.integers(0, 2, n)),
    }
    for j in range(DENSE):
        columns[f"d{j}"] = pa.array(rng.standard_normal(n) * (j + 1) + j)
    for j in range(CATEGORICAL):
        vocabulary = int(10 ** (3 + 2 * j / (CATEGORICAL - 1)))
        codes = (rng.zipf(1.3, n) - 1) % vocabulary
        columns[f"c{j}"] = text("v", codes) if j % 2 else pa.array(codes)
    pq.write_table(pa.table(columns), path, row_group_size=ROW_GROUP)


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(path: str) -> dict:
    import resource

    from tandem.parties.cli.allocator import tune_allocator
    from tandem.parties.data import parse_data_config
    from tandem.parties.split.process.party_data import load_table_data

    tune_allocator()  # as the tandem command does before a party loads its data
    baseline = _status_mb("VmRSS")
    cfg = parse_data_config(
        {
            "source": path,
            "id_column": "id",
            "label_column": "label",
            "categorical": [f"c{j}" for j in range(CATEGORICAL)],
            "scale": "standard",
            "missing": "mean",
        }
    )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    t0 = time.perf_counter()
    fields = load_table_data(cfg, labels=True, loss="binary", out=1)
    seconds = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    arrays = ("train", "validation", "test", "y_train", "y_validation", "y_test")
    data = sum(fields[k].nbytes for k in arrays) / 2**20
    peak = _status_mb("VmHWM")
    return {
        "rows": sum(len(fields[k]) for k in ("train", "validation", "test")),
        "seconds": round(seconds, 3),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime - cpu0, 3),
        "baseline_mb": round(baseline, 1),
        "peak_mb": round(peak, 1),
        "data_mb": round(data, 1),
        "rss_vs_data": round(peak / data, 3),
        "added_vs_data": round((peak - baseline) / data, 3),
    }


def measure(n: int, seed: int, folder: str) -> dict:
    """Write the table of ``n`` rows and load it in a child process; its report."""
    path = os.path.join(folder, f"party_{n}.parquet")
    write_party_table(path, n, seed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "bench.data_load", "--child", path],
        check=True,
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    ).stdout
    os.remove(path)
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    parser.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    result: dict = {"rows": args.rows}
    with tempfile.TemporaryDirectory(prefix="tandem-data-load-") as folder:
        for n in args.rows:
            report = measure(n, args.seed, folder)
            for key, value in report.items():
                if key != "rows":
                    result[f"{key}_{n}"] = value
            if not args.json:
                print(f"{n} rows: " + ", ".join(f"{k} {v}" for k, v in report.items()))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
