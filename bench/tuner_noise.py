"""How often `GroupTuner` settles far from the best n when batch times are noisy.

``python -m bench.tuner_noise`` prints ONE JSON line. Pure Python, seeded, a few seconds per
hundred runs.

The wall time per batch follows a measured curve (``bench.pipeline``'s fixed-n sweep on the
2-core machine, ms per batch: n = 1: 173, 2: 138, 4: 110, 8: 103, 16: 130, 32: 183,
interpolated in log n), times a noise factor per batch (``--noise-model``):

* ``measured`` (the default): drawn from the distribution of 2006 per-batch walls the tuner
  sampled in 56 ``bench.pipeline`` runs (each relative to the median wall of its n in its run;
  `MEASURED_PERCENTILES`). Its middle is narrow (half the batches within 3.7%) and its right
  tail long (5% of batches 17% or more over their median, 1% over 33%: the shared machine's
  hiccups), which the normal model's symmetric scatter does not show.
* ``normal``: ``1 + noise * N(0, 1)``, and 5% of batches 30% slower (a load spike).

``--noise-draws N`` prints ``N`` seeded draws of the chosen model (factor - 1) beside
`MEASURED_PERCENTILES` instead, and runs no tuner: the noise model, to check or plot.

``--drift SIGMA`` multiplies every batch by the machine's speed as well, ``exp(x)`` with ``x``
an AR(1) process over batches (stationary std ``SIGMA``, correlation time ``--drift-batches``,
20 by default): a shared machine's slow and fast spells, which shift whole probes of one n
against another (``bench.pipeline`` measured its compute per batch at medians of 76 to 102 ms
in consecutive spells of ten batches). 0 (the default) is no drift.

The tuner starts where the method's rule put it in recorded runs (``--starts``: 3, 4, 6, 8 and
12; each gets ``runs`` seeded runs, reported together). `SETTINGS` lists the tuner settings
compared, the default one last: samples per n; whether the first search already demands the
``tolerance`` margin (``first_search_margin``); whether ties go to the larger n
(``GroupTuner.prefer_larger``); rounds of measuring a close call again
(``GroupTuner.confirm``); the share ``GroupTuner.trim`` cut at each end of an n's samples
before averaging. For each, the runs report: the fraction settling more than 2%, 5% and 10%
behind the best n, the mean of best / settled time, the batches until settling (mean and
``batches_min``) and ``settled_n`` (settled n -> runs).
``--rechecks K`` reports the n each run holds after ``K`` re-checks instead (`GroupTuner`
re-probes a settled n's neighbours, ``recheck`` batches after settling and ever more rarely
while they keep it), and the batches until then;
``--no-verify`` lets a re-check move on one comparison (``GroupTuner.verify`` off; a margin in
the first search never verifies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np

from tandem.engine.microbatch import GroupTuner

CURVE_MS = {1: 173.0, 2: 138.0, 4: 110.0, 8: 103.0, 16: 130.0, 32: 183.0}

# Percentiles 0, 1, ..., 100 of (wall / median wall of its n in its run - 1) over the 2006
# batches that `GroupTuner` took as samples (n >= 4) in 56 `bench.pipeline --json` runs.
MEASURED_PERCENTILES = (
    -0.462,
    -0.197,
    -0.157,
    -0.134,
    -0.124,
    -0.115,
    -0.106,
    -0.097,
    -0.090,
    -0.085,
    -0.081,
    -0.077,
    -0.072,
    -0.067,
    -0.063,
    -0.060,
    -0.056,
    -0.054,
    -0.051,
    -0.049,
    -0.047,
    -0.045,
    -0.043,
    -0.039,
    -0.037,
    -0.035,
    -0.033,
    -0.031,
    -0.029,
    -0.027,
    -0.025,
    -0.024,
    -0.022,
    -0.020,
    -0.018,
    -0.017,
    -0.016,
    -0.014,
    -0.013,
    -0.012,
    -0.010,
    -0.009,
    -0.008,
    -0.007,
    -0.006,
    -0.004,
    -0.003,
    -0.002,
    -0.001,
    0.000,
    0.000,
    0.000,
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.006,
    0.007,
    0.008,
    0.010,
    0.011,
    0.013,
    0.014,
    0.016,
    0.018,
    0.019,
    0.021,
    0.023,
    0.025,
    0.026,
    0.029,
    0.030,
    0.033,
    0.035,
    0.037,
    0.041,
    0.044,
    0.047,
    0.049,
    0.053,
    0.059,
    0.063,
    0.067,
    0.071,
    0.078,
    0.082,
    0.085,
    0.089,
    0.096,
    0.105,
    0.115,
    0.128,
    0.138,
    0.154,
    0.169,
    0.194,
    0.223,
    0.253,
    0.328,
    0.597,
)


_LOG_N = [math.log(k) for k in sorted(CURVE_MS)]
_CURVE = [CURVE_MS[k] for k in sorted(CURVE_MS)]
_PERCENTS = np.arange(len(MEASURED_PERCENTILES))


def curve(n: int) -> float:
    return float(np.interp(math.log(n), _LOG_N, _CURVE))


def noise_factor(rng: np.random.Generator, model: str, noise: float) -> float:
    """One batch's wall / its n's curve value under ``model`` (module docstring)."""
    if model == "measured":  # inverse-CDF draw, linear between the stored percentiles
        return 1.0 + float(np.interp(rng.random() * 100, _PERCENTS, MEASURED_PERCENTILES))
    spike = 1.3 if rng.random() < 0.05 else 1.0
    return (1.0 + noise * rng.standard_normal()) * spike


def settle(
    seed: int,
    *,
    samples: int,
    first_margin: bool,
    noise: float,
    start: int = 3,
    limit: int = 400,
    prefer_larger: bool = True,
    confirm: int = 2,
    trim: float = 0.25,
    model: str = "measured",
    drift: float = 0.0,
    drift_batches: float = 20.0,
    rechecks: int = 0,
    verify: bool = True,
) -> tuple[int, int]:
    """(settled n, batches observed) of one seeded run: the n it settles on after the first
    search and ``rechecks`` re-checks (`GroupTuner.recheck` batches after settling, then
    twice as many after each that kept n, up to `GroupTuner.recheck_max`)."""
    rng = np.random.default_rng(seed)
    phi = math.exp(-1.0 / drift_batches)
    # the drift's state, drawn from its stationary law; no draws without drift, so runs
    # without it keep the random stream (and the figures) they had before drift existed
    x = drift * rng.standard_normal() if drift else 0.0
    tuner = GroupTuner(
        batch=2048,
        samples=samples,
        prefer_larger=prefer_larger,
        confirm=confirm,
        trim=trim,
        verify=verify,
    )
    # the rule's start is given, so `observe` goes straight to climbing; with
    # ``first_margin`` the first search already needs the margin a re-check needs
    state = dataclasses.replace(tuner.init(start), started=True, settled_once=first_margin)
    settles = 0
    waits = sum(min(tuner.recheck << i, tuner.recheck_max) for i in range(rechecks))  # rule 5
    for _ in range(limit + rechecks * limit + waits):
        if drift:
            x = phi * x + drift * math.sqrt(1 - phi * phi) * rng.standard_normal()
        was = state.settled
        _, state = tuner.observe(
            state, curve(state.n) * noise_factor(rng, model, noise) * math.exp(x) / 1e3
        )
        settles += state.settled and not was
        if settles > rechecks:
            break
    return state.n, state.batches


# (samples, first search margin, ties to the larger n, confirm rounds, trim); the last is the
# default `GroupTuner`
SETTINGS = (
    (3, True, False, 0, 0.0),
    (3, False, False, 0, 0.0),
    (4, False, False, 0, 0.0),
    (5, False, False, 0, 0.0),
    (8, False, False, 0, 0.0),
    (4, False, True, 0, 0.0),
    (8, False, True, 0, 0.0),
    (4, False, True, 2, 0.0),
    (4, False, True, 2, 0.25),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tuner_noise", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument(
        "--noise-model",
        choices=("measured", "normal"),
        default="measured",
        help="per-batch noise: drawn from measured walls, or normal with spikes",
    )
    ap.add_argument(
        "--noise",
        type=float,
        default=0.10,
        help="relative std of a batch's time (the normal model only)",
    )
    ap.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="std of the machine's slow drift in log speed (0: none)",
    )
    ap.add_argument(
        "--drift-batches",
        type=float,
        default=20.0,
        help="correlation time of the drift, in batches",
    )
    ap.add_argument("--starts", default="3,4,6,8,12", help="the rule's starting n, comma-separated")
    ap.add_argument(
        "--rechecks",
        type=int,
        default=0,
        help="report the n each run holds after this many re-checks (0: after the first search)",
    )
    ap.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="a re-check moves n on one comparison's win (GroupTuner.verify = False)",
    )
    ap.add_argument(
        "--noise-draws",
        type=int,
        metavar="N",
        help="print N seeded draws of the noise model (factor - 1) and the stored "
        "MEASURED_PERCENTILES, and exit: what the tuner's batches are scaled by",
    )
    args = ap.parse_args(argv)
    if args.noise_draws is not None:
        rng = np.random.default_rng(0)
        draws = [
            noise_factor(rng, args.noise_model, args.noise) - 1 for _ in range(args.noise_draws)
        ]
        print(
            json.dumps(
                {
                    "noise_model": args.noise_model,
                    "noise": args.noise if args.noise_model == "normal" else None,
                    "measured_percentiles": list(MEASURED_PERCENTILES),
                    "draws": draws,
                }
            )
        )
        return 0
    starts = [int(x) for x in args.starts.split(",")]
    best = min(curve(n) for n in range(1, 65))
    out: dict = {
        "runs": args.runs,
        "noise_model": args.noise_model,
        "noise": args.noise if args.noise_model == "normal" else None,
        "drift": args.drift,
        "drift_batches": args.drift_batches,
        "rechecks": args.rechecks,
        "verify": args.verify,
        "starts": starts,
        "settings": [],
    }
    for samples, first_margin, larger, confirm, trim in SETTINGS:
        results = [
            settle(
                s,
                samples=samples,
                first_margin=first_margin,
                noise=args.noise,
                start=start,
                prefer_larger=larger,
                confirm=confirm,
                trim=trim,
                model=args.noise_model,
                drift=args.drift,
                drift_batches=args.drift_batches,
                rechecks=args.rechecks,
                verify=args.verify and not first_margin,
            )
            for start in starts
            for s in range(args.runs)
        ]
        ratio = np.array([best / curve(n) for n, _ in results])
        out["settings"].append(
            {
                "samples": samples,
                "first_search_margin": first_margin,
                "prefer_larger": larger,
                "confirm": confirm,
                "trim": trim,
                "behind_2pct": round(float((ratio < 1 / 1.02).mean()), 4),
                "behind_5pct": round(float((ratio < 1 / 1.05).mean()), 4),
                "behind_10pct": round(float((ratio < 1 / 1.10).mean()), 4),
                "mean_best_over_settled": round(float(ratio.mean()), 4),
                "batches": round(float(np.mean([b for _, b in results])), 1),
                "batches_min": min(b for _, b in results),
                "settled_n": {
                    str(n): sum(m == n for m, _ in results) for n in sorted({m for m, _ in results})
                },
            }
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
