"""Benchmark: compressed FL against dense on a user-like non-IID tabular task (issue 43, point 5).

    python -m bench.fl_compressed --json                 # one JSON line on stdout
    python -m bench.fl_compressed --plot docs/img/fl_compressed_curve.png
    python -m bench.fl_compressed --json --uplink-bits 4 --lossless   # quantized uplink

**Task**: `tandem.parties.fl.synthetic.make_task` (seeded, synthetic): six non-IID clients
("branches"), each a table of 20 numeric columns and one string categorical column, one-hot
encoded into 28 inputs; a held-out test set mixing every client's distribution.

**Runs** (`tandem.parties.fl.federation.run_memory_federation`, memory transport, byte counters
of the server's transport): every client each round, local SGD, the server FedAdam
(``optax.adam(0.01, eps=1e-3)``, the docs' configuration); dense (dense uplink, full downlink)
against `presets.compressed` with its defaults (rand-k with the warm-up), or with
``--uplink-bits`` its quantized uplink (`tandem.parties.fl.quantize`; ``--lossless`` deflates
the compressed run's frames), same seeds and rounds. Default model: MLP
28-1024-1000-2 (1,056,698 parameters), 20 rounds.

Keys: ``compressed_acc_gap`` (dense minus compressed final accuracy, points; target <= 0.5),
``compressed_early_deficit`` (the largest dense-minus-compressed gap over the rounds, points;
target <= 0.5: no early round below dense's), ``compressed_uplink_ratio`` and
``compressed_downlink_ratio`` (dense bytes / compressed bytes over the run),
``compressed_curve``: round -> [dense, compressed] accuracy (%), and ``compressed_up_bytes``:
round -> [dense, compressed] uplink bytes. ``--warmup-rounds 0 --ramp-rounds 0``: compressed
from round one (no warm-up, as the TOML's 0 and 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

import numpy as np
import optax
import orjson

from tandem.parties.fl import presets
from tandem.parties.fl.data import FederatedData
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.server import FLConfig
from tandem.parties.fl.synthetic import make_task
from tandem.parties.fl.train import LocalTrainer
from tandem.parties.fl.warmup import Warmup

HIDDEN_1M = [1024, 1000]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _trainer(data: FederatedData, hidden: list[int], seed: int) -> LocalTrainer:
    sizes = [data.num_features, *hidden, data.num_classes]
    return LocalTrainer(sizes, optax.sgd(0.05), epochs=1, batch_size=32, init_seed=seed)


def configs(
    d: int, rounds: int, seed: int, warmup: Warmup | None, bits: int = 0, lossless: bool = False
) -> dict[str, FLConfig]:
    """Dense and compressed FedAdam (``optax.adam(0.01, eps=1e-3)``) with every client each
    round; compressed is `presets.compressed` with ``warmup`` (the TOML default: ``Warmup()``),
    ``uplink_bits=bits`` (0: rand-k) and, with ``lossless``, its frames deflated (dense's
    never are: the ratios compare against plain float32)."""
    common = dict(rounds=rounds, fraction=1.0, seed=seed, eval_every=1, round_timeout=600.0)
    adam = optax.adam(0.01, eps=1e-3)
    return {
        "dense": presets.dense(optimizer=adam, **common),
        "compressed": presets.compressed(
            d,
            momentum=0.0,
            server_lr=1.0,
            optimizer=adam,
            warmup=warmup,
            uplink_bits=bits,
            **common,
            lossless=lossless,
        ),
    }


@dataclasses.dataclass(frozen=True)
class Federated:
    """One federation's figures: accuracy (%) and uplink bytes per round, bytes up and down."""

    curve: list[float]
    up_rounds: list[int]
    up: int
    down: int


def run(
    data: FederatedData,
    hidden: list[int],
    rounds: int,
    seed: int,
    warmup: Warmup | None,
    bits: int = 0,
    lossless: bool = False,
    dense_run: Federated | None = None,
) -> tuple[dict, Federated]:
    """Both federations on ``data``; returns the bench keys (see the module) and the dense
    federation's figures. ``dense_run``: those figures from an earlier call on the same data,
    hidden sizes, rounds and seed (the same seeded run: not run again)."""
    trainer = _trainer(data, hidden, seed)
    runs: dict[str, Federated] = {}
    for name, cfg in configs(trainer.dim, rounds, seed, warmup, bits, lossless).items():
        if name == "dense" and dense_run is not None:
            runs[name] = dense_run
            continue
        t0 = time.perf_counter()
        server = asyncio.run(run_memory_federation(data, trainer, cfg))
        runs[name] = Federated(
            [round(100 * float(r.accuracy or 0.0), 2) for r in server.reports],
            [r.up_bytes for r in server.reports],
            server.bytes_up(),
            server.bytes_down(),
        )
        log(f"{name} ({trainer.dim} params, {time.perf_counter() - t0:.1f} s): {runs[name].curve}")
    curves = {name: r.curve for name, r in runs.items()}
    up_rounds = {name: r.up_rounds for name, r in runs.items()}
    up = {name: r.up for name, r in runs.items()}
    down = {name: r.down for name, r in runs.items()}
    dense, comp = curves["dense"], curves["compressed"]
    keys = {
        "compressed_params": trainer.dim,
        "compressed_rounds": rounds,
        "compressed_warmup": None if warmup is None else dataclasses.asdict(warmup),
        "compressed_uplink_bits": bits,
        "compressed_lossless": lossless,
        "compressed_acc_dense": dense[-1],
        "compressed_acc": comp[-1],
        "compressed_acc_gap": round(dense[-1] - comp[-1], 2),
        "compressed_early_deficit": round(max(a - b for a, b in zip(dense, comp, strict=True)), 2),
        "compressed_majority": round(100 * majority(data), 2),
        "compressed_uplink_ratio": round(up["dense"] / up["compressed"], 2),
        "compressed_downlink_ratio": round(down["dense"] / down["compressed"], 2),
        "compressed_curve": {
            str(r): [a, b] for r, (a, b) in enumerate(zip(dense, comp, strict=True))
        },
        "compressed_up_bytes": {
            str(r): [a, b]
            for r, (a, b) in enumerate(
                zip(up_rounds["dense"], up_rounds["compressed"], strict=True)
            )
        },
    }
    return keys, runs["dense"]


def majority(data: FederatedData) -> float:
    """Share of the test set's most frequent label (what a constant model scores)."""
    return float(np.bincount(data.y_test).max() / data.y_test.size)


def plot(path: str, out: dict) -> None:
    """Accuracy per round of both runs (needs the ``plot`` extra)."""
    from tandem._extras import needs

    with needs("plot", "bench.fl_compressed --plot"):
        from matplotlib.figure import Figure

    curve = out["compressed_curve"]
    rounds = [int(r) + 1 for r in curve]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    w = out["compressed_warmup"]
    label = (
        "compressed, no warm-up"
        if w is None
        else (f"compressed, {w['dense_rounds']} dense + {w['ramp_rounds']} ramp rounds")
    )
    if out.get("compressed_uplink_bits"):
        label = f"compressed, {out['compressed_uplink_bits']}-bit uplink with error feedback"
        label += ", deflated" if out.get("compressed_lossless") else ""
    ax.plot(rounds, [curve[str(r - 1)][0] for r in rounds], marker="o", label="dense")
    ax.plot(rounds, [curve[str(r - 1)][1] for r in rounds], marker="s", label=label)
    for extra in out.get("compressed_baselines", []):
        ax.plot(rounds, extra["curve"], linestyle="--", label=extra["label"])
    ax.axhline(out["compressed_majority"], color="grey", linewidth=0.8, label="majority class")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        f"6 non-IID clients, 20 numeric + 1 categorical, {out['compressed_params']:,} params, "
        "FedAdam",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def compressed_gap(args: argparse.Namespace) -> dict:
    """The bench keys for ``args`` (also `bench.fl_private`'s ``compressed`` metric)."""
    data = make_task(rows=args.rows, test_rows=args.test_rows, seed=args.seed)
    warmup = Warmup(args.warmup_rounds, args.ramp_rounds)
    if not (args.warmup_rounds or args.ramp_rounds):  # as the TOML's 0 and 0: no warm-up
        warmup = None
    bits, lossless = getattr(args, "uplink_bits", 0), getattr(args, "lossless", False)
    out, dense = run(data, list(args.hidden), args.rounds, args.seed, warmup, bits, lossless)
    if getattr(args, "baseline", False):  # the same task compressed from round one
        base, _ = run(data, list(args.hidden), args.rounds, args.seed, None, dense_run=dense)
        out["compressed_baselines"] = [
            {
                "label": "compressed, no warm-up",
                "curve": [v[1] for v in base["compressed_curve"].values()],
            }
        ]
        out["compressed_acc_gap_no_warmup"] = base["compressed_acc_gap"]
    return out


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The knobs of `compressed_gap`, named ``--<prefix>rows`` ... (`bench.fl_private` uses
    the prefix ``compressed-``)."""
    w = Warmup()
    p.add_argument(f"--{prefix}rows", dest="rows", type=int, default=4000, help="rows per client")
    p.add_argument(
        f"--{prefix}test-rows", dest="test_rows", type=int, default=3000, help="held-out rows"
    )
    p.add_argument(f"--{prefix}hidden", dest="hidden", type=int, nargs="+", default=HIDDEN_1M)
    p.add_argument(f"--{prefix}rounds", dest="rounds", type=int, default=20)
    p.add_argument(
        f"--{prefix}warmup-rounds", dest="warmup_rounds", type=int, default=w.dense_rounds
    )
    p.add_argument(f"--{prefix}ramp-rounds", dest="ramp_rounds", type=int, default=w.ramp_rounds)
    p.add_argument(
        f"--{prefix}uplink-bits",
        dest="uplink_bits",
        type=int,
        default=0,
        choices=(0, 2, 4, 8),
        help="quantized uplink with error feedback (presets.compressed uplink_bits); 0: rand-k",
    )
    p.add_argument(
        f"--{prefix}lossless",
        dest="lossless",
        action="store_true",
        help="deflate the compressed run's frames ([compression] lossless)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--plot", metavar="PNG", help="draw both accuracy curves (plot extra)")
    p.add_argument("--baseline", action="store_true", help="also run compressed without warm-up")
    p.add_argument("--seed", type=int, default=0)
    add_arguments(p)
    args = p.parse_args(argv)
    out = {"bench": "fl_compressed", **compressed_gap(args)}
    if args.plot:
        plot(args.plot, out)
    print(orjson.dumps(out).decode() if args.json else out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
