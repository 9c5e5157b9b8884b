"""Cut-layer compression curve: bytes at the cut against final loss and AUC, per compressor.

``python -m bench.compress --json [--runs none bfloat16 int8 topk:0.25 ...]`` prints ONE JSON line
(progress on stderr). A leader and a
follower train in one process over the memory transport (no link shaping: this measures what
compression does to the model and to the bytes, not to time; ``bench.wan --compress`` measures
time), once exactly and once per compressor, with the same seed, data, batches and epochs.

**Data** (seeded, synthetic): ``rows`` samples; the leader holds ``features`` columns and the
labels, the follower ``features`` other columns; the label is a Bernoulli draw of a logistic
function of a linear term and a pairwise product over both parties' columns, so the joint model
needs both. 75 % train, 25 % test.

**Model**: ``leader_follower`` topology; bottoms ``features -> 32 -> cut`` on each party, top
``2 cut -> 16 -> 1``; Adam, learning rate 3e-3, 2 micro-batches per batch.

**Reported** per run (``runs``): ``compress``, ``fraction`` (top-k), ``cut_bytes`` (the
activations and gradients both parties sent: the arrays of each message, no frame headers),
``frame_bytes`` (the transport's counters: whole frames, commands included),
``bytes_ratio = exact cut_bytes / cut_bytes``, ``train_loss`` (last epoch), ``test_loss``,
``test_auc``, and ``d_auc`` / ``d_loss``: the difference to the exact run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import numpy as np

#: (compress, compress_topk) of the default curve
DEFAULT_RUNS = (
    ("none", 0.1),
    ("bfloat16", 0.1),
    ("int8", 0.1),
    ("topk", 0.25),
    ("topk", 0.1),
    ("topk", 0.05),
)


def make_data(rows: int, features: int, seed: int) -> dict[str, Any]:
    """Leader and follower columns, labels, and a 75/25 train/test split (seeded)."""
    rng = np.random.default_rng(seed)
    xl = rng.normal(size=(rows, features)).astype(np.float32)
    xf = rng.normal(size=(rows, features)).astype(np.float32)
    wl, wf = rng.normal(size=features), rng.normal(size=features)
    logit = 1.5 * (xl @ wl + xf @ wf) / np.sqrt(2 * features) + 2.0 * xl[:, 0] * xf[:, 0]
    y = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    cut = int(rows * 0.75)
    return {
        "leader": {"train": xl[:cut], "test": xl[cut:]},
        "follower": {"train": xf[:cut], "test": xf[cut:]},
        "labels": {"train": y[:cut], "test": y[cut:]},
    }


async def train_once(
    data: dict[str, Any],
    *,
    compress: str,
    fraction: float,
    epochs: int,
    batch_size: int,
    cut: int,
    seed: int,
) -> dict[str, Any]:
    """One run of ``leader_follower`` on ``data`` with the given compression."""
    from tandem.engine.kernels import mlp_stage
    from tandem.engine.topology import leader_follower
    from tandem.parties.split import SplitConfig, SplitParty
    from tandem.transports.memory import MemoryNetwork

    topo = leader_follower()
    d = data["leader"]["train"].shape[1]
    models = {
        "bottom_leader": mlp_stage([d], [32], cut),
        "bottom_follower": mlp_stage([d], [32], cut),
        "top": mlp_stage([cut, cut], [16], 1, activate_last=False),
    }
    cfg = SplitConfig(
        batch_size=batch_size,
        epochs=epochs,
        groups=2,
        learning_rate=3e-3,
        seed=seed,
        compress=compress,
        compress_topk=fraction,
    )
    net = MemoryNetwork()
    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets=data["leader"],
        labels=data["labels"],
        config=cfg,
    )
    follower = SplitParty(
        "follower", topo, models, net.endpoint("follower"), datasets=data["follower"], config=cfg
    )
    out: dict[str, Any] = {}

    async def drive() -> None:
        history = await leader.fit(epochs)
        metrics = await leader.evaluate("test")
        out.update(train_loss=history[-1].loss, test_loss=metrics["loss"], test_auc=metrics["auc"])
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())
    t_lead, t_fol = net.endpoint("leader"), net.endpoint("follower")
    out["cut_bytes"] = int(leader.cut_bytes["follower"] + follower.cut_bytes["leader"])
    out["frame_bytes"] = int(t_lead.sent_stats("follower").bytes + t_fol.sent_stats("leader").bytes)
    return out


async def curve(
    runs=DEFAULT_RUNS,
    *,
    rows: int = 4000,
    features: int = 8,
    epochs: int = 6,
    batch_size: int = 128,
    cut: int = 32,
    seed: int = 0,
    log=None,
) -> dict[str, Any]:
    """Every run of ``runs`` on the same data; the first must be ``"none"`` (the reference)."""
    if runs[0][0] != "none":
        raise ValueError("the first run must be the exact one ('none'): the others compare to it")
    data = make_data(rows, features, seed)
    results: list[dict[str, Any]] = []
    for compress, fraction in runs:
        r = await train_once(
            data,
            compress=compress,
            fraction=fraction,
            epochs=epochs,
            batch_size=batch_size,
            cut=cut,
            seed=seed,
        )
        r = {"compress": compress, "fraction": fraction if compress == "topk" else None, **r}
        ref = results[0] if results else r
        r["bytes_ratio"] = ref["cut_bytes"] / r["cut_bytes"]
        r["d_auc"] = r["test_auc"] - ref["test_auc"]
        r["d_loss"] = r["test_loss"] - ref["test_loss"]
        results.append(r)
        if log is not None:
            log(
                f"{compress:>8} {r['fraction'] or '':>5}: bytes / {r['bytes_ratio']:.2f}, "
                f"auc {r['test_auc']:.4f} ({r['d_auc']:+.4f}), loss {r['test_loss']:.4f}"
            )
    return {
        "rows": rows,
        "features": features,
        "epochs": epochs,
        "batch_size": batch_size,
        "cut": cut,
        "seed": seed,
        "runs": results,
    }


def parse_run(text: str) -> tuple[str, float]:
    """``KIND`` or ``topk:FRACTION`` -> (compress, compress_topk) of one run of `curve`."""
    kind, _, fraction = text.partition(":")
    try:
        return kind, float(fraction) if fraction else 0.1
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write KIND or topk:FRACTION") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compress", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--features", type=int, default=8, help="columns per party")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--cut", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--runs",
        nargs="+",
        type=parse_run,
        default=DEFAULT_RUNS,
        metavar="RUN",
        help="the runs, exact ('none') first: KIND or topk:FRACTION (default: the whole curve)",
    )
    args = p.parse_args(argv)
    result = asyncio.run(
        curve(
            tuple(args.runs),
            rows=args.rows,
            features=args.features,
            epochs=args.epochs,
            batch_size=args.batch_size,
            cut=args.cut,
            seed=args.seed,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    )
    if args.json:
        from tandem.parties.progress import emit_result

        emit_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
