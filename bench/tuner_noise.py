"""How often `GroupTuner` settles far from the best n when batch times are noisy.

``python -m bench.tuner_noise`` prints ONE JSON line. Pure Python, seeded, a few seconds.

The wall time per batch follows a measured curve (``bench.pipeline``'s fixed-n sweep on the
2-core machine, ms per batch: n = 1: 173, 2: 138, 4: 110, 8: 103, 16: 130, 32: 183,
interpolated in log n), times ``1 + noise * N(0, 1)``, and 5% of batches are 30% slower (a
load spike). The tuner starts where the method's rule put it in recorded runs (``--starts``:
3, 4, 6, 8 and 12; each gets ``runs`` seeded runs, reported together). For each setting
(samples per n; whether the first search already demands the ``tolerance`` margin, as before it
was dropped; whether ties go to the larger n, ``GroupTuner.prefer_larger``, the default since the
ninth pass; how many rounds of measuring a close call again, ``GroupTuner.confirm``, the
default since the tenth) the runs report: the fraction settling more than 2%, 5% and 10% behind
the best n, the mean of best / settled time, and the batches until settling.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from engine.microbatch import GroupTuner

CURVE_MS = {1: 173.0, 2: 138.0, 4: 110.0, 8: 103.0, 16: 130.0, 32: 183.0}


def curve(n: int) -> float:
    xs = [math.log(k) for k in sorted(CURVE_MS)]
    return float(np.interp(math.log(n), xs, [CURVE_MS[k] for k in sorted(CURVE_MS)]))


def settle(seed: int, *, samples: int, first_margin: bool, noise: float,
           start: int = 3, limit: int = 400, prefer_larger: bool = True,
           confirm: int = 2) -> tuple[int, int]:
    """(settled n, batches observed) of one seeded run."""
    rng = np.random.default_rng(seed)
    tuner = GroupTuner(batch=2048, n=start, samples=samples, prefer_larger=prefer_larger,
                       confirm=confirm)
    tuner._started = True  # the rule's start is given; `observe` goes straight to climbing
    tuner._settled_once = first_margin  # True: the first search already needs the margin
    for _ in range(limit):
        spike = 1.3 if rng.random() < 0.05 else 1.0
        tuner.observe(wall=curve(tuner.n) * (1 + noise * rng.standard_normal()) * spike / 1e3,
                      compute=0.0)
        if tuner.settled:
            break
    return tuner.n, len(tuner.history)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tuner_noise", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--noise", type=float, default=0.10, help="relative std of a batch's time")
    ap.add_argument("--starts", default="3,4,6,8,12", help="the rule's starting n, comma-separated")
    args = ap.parse_args(argv)
    starts = [int(x) for x in args.starts.split(",")]
    best = min(curve(n) for n in range(1, 65))
    out: dict = {"runs": args.runs, "noise": args.noise, "starts": starts, "settings": []}
    for samples, first_margin, larger, confirm in (
            (3, True, False, 0), (3, False, False, 0), (4, False, False, 0), (5, False, False, 0),
            (8, False, False, 0), (4, False, True, 0), (8, False, True, 0), (4, False, True, 2)):
        results = [settle(s, samples=samples, first_margin=first_margin, noise=args.noise,
                          start=start, prefer_larger=larger, confirm=confirm)
                   for start in starts for s in range(args.runs)]
        ratio = np.array([best / curve(n) for n, _ in results])
        out["settings"].append({
            "samples": samples, "first_search_margin": first_margin, "prefer_larger": larger,
            "confirm": confirm,
            "behind_2pct": round(float((ratio < 1 / 1.02).mean()), 4),
            "behind_5pct": round(float((ratio < 1 / 1.05).mean()), 4),
            "behind_10pct": round(float((ratio < 1 / 1.10).mean()), 4),
            "mean_best_over_settled": round(float(ratio.mean()), 4),
            "batches": round(float(np.mean([b for _, b in results])), 1)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
