"""Benchmark: does the FL count sketch's robust estimate hold the heavy coordinates?

    python -m bench.fl_sketch --json            # one JSON line, about 10 s at d = 1M
    python -m bench.fl_sketch --json --d 10000000 --seeds 1   # keys sketch_recall_10m...

Workload, per seed: a vector of ``d`` coordinates, ``N(0, 1e-3)`` noise plus ``h`` heavy ones
of magnitude uniform in [0.5, 1] and a random sign, at random places; ``h = cols // 20``, the
heavy count docs/federated.md sizes the preset for (166 at d = 1M). It is sketched with the
preset's shape (`presets.sketch_shape`, 5 x 3,333 at d = 1M: the payload of rand-k) and
estimated with the seed's hashes. Recall = share of the ``h`` heaviest coordinates among the
``h`` largest of the estimate (`compression.heavy_recall`).

Keys: ``sketch_recall_1m`` (the robust estimate, `sketch_estimate`'s default; median over
seeds; target >= 0.95), ``sketch_recall_1m_min``, ``sketch_recall_1m_row_median`` (the plain
row median, for comparison), ``d``, ``rows``, ``cols``, ``h``, ``seeds``, ``sketch_floats``
(floats a client sends), ``bench_s``; at another ``--d`` the suffix names it (``_300k``,
``_10m``). `recall_keys(seeds)` is importable, so another benchmark (``bench.fl_private``) can
report the same keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import orjson

from tandem.parties.fl import compression as C
from tandem.parties.fl import presets


def heavy_vector(d: int, h: int, seed: int) -> np.ndarray:
    """``N(0, 1e-3)`` noise with ``h`` coordinates of magnitude in [0.5, 1], random signs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1e-3, d).astype(np.float32)
    heavy = rng.choice(d, h, replace=False)
    x[heavy] = (rng.choice([-1.0, 1.0], h) * rng.uniform(0.5, 1.0, h)).astype(np.float32)
    return x


def _row_median(table, seed: int, d: int) -> np.ndarray:
    """The plain row median of the sketch's row estimates (what the robust estimate fixes)."""
    return np.asarray(_row_median_kernel(table, jnp.uint32(seed), d))


@partial(jax.jit, static_argnums=(2,))  # one fused kernel: op by op, d = 10M took seconds
def _row_median_kernel(table, seed, d: int):
    rows, cols = table.shape
    buckets, signs = C._hashes(seed, d, rows, cols)
    per_row = jax.vmap(lambda t, b, s: t[b] * s)(table, buckets, signs)
    return C._median_of_rows(per_row)


def sketch_recall(d: int = 1_000_000, seeds: int = 3) -> dict:
    """Recall of the preset sketch at ``d`` over ``seeds`` draws (keys of the module doc,
    without the ``_1m`` suffix)."""
    rows, cols = presets.sketch_shape(d)
    h = max(1, cols // 20)
    robust, median = [], []
    for seed in range(seeds):
        x = heavy_vector(d, h, seed)
        table = C.sketch_compress(x, seed, rows, cols)
        robust.append(C.heavy_recall(x, C.sketch_estimate(table, seed, d), h))
        median.append(C.heavy_recall(x, _row_median(table, seed, d), h))
    return {
        "recall": statistics.median(robust),
        "recall_min": min(robust),
        "recall_row_median": statistics.median(median),
        "d": d,
        "rows": rows,
        "cols": cols,
        "h": h,
        "seeds": seeds,
        "sketch_floats": rows * cols,
    }


def size_label(d: int) -> str:
    """``d`` as the keys name it: 1_000_000 -> "1m", 300_000 -> "300k", 1234 -> "1234"."""
    for unit, name in ((1_000_000, "m"), (1_000, "k")):
        if d % unit == 0:
            return f"{d // unit}{name}"
    return str(d)


def recall_keys(seeds: int = 3, d: int = 1_000_000) -> dict:
    """The JSON keys of the module docstring (at d = 1M: also `bench.fl_private`'s ``sketch``
    metric), ``bench_s`` included."""
    t0 = time.perf_counter()
    r = sketch_recall(d, seeds)
    at = size_label(d)
    return {
        f"sketch_recall_{at}": r["recall"],
        f"sketch_recall_{at}_min": r["recall_min"],
        f"sketch_recall_{at}_row_median": r["recall_row_median"],
        **{k: r[k] for k in ("d", "rows", "cols", "h", "seeds", "sketch_floats")},
        "bench_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fl_sketch", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d", type=int, default=1_000_000, help="coordinates of the vector")
    args = ap.parse_args(argv)
    out = recall_keys(args.seeds, args.d)
    if args.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    else:
        for k, v in out.items():
            print(f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
