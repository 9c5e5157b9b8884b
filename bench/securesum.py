"""Secure sum of the followers' cuts against the plain sum: training rows per second.

``python -m bench.securesum --json`` prints ONE JSON line (progress on stderr); `measure` returns
the same dict for ``bench.privacy``. One leader and ``k`` followers train in one process over
the memory transport (no link shaping), on the ``star`` topology with ``model.aggregate`` =
``"sum"`` (the followers' cuts added in the clear) and ``"secure_sum"`` (fixed point in
``Z_2^32`` at scale ``2^-16``, pairwise AES-CTR masks from X25519 seeds), with the same seed,
data and batches. Each mode runs one warm-up batch (compilation), then ``batches`` timed ones;
the modes alternate ``repeats`` times and each keeps its best time.

**Data** (seeded, synthetic): ``features`` normal columns per follower, labels a Bernoulli draw
of a logistic function of the sum of a linear term per follower.

**Model**: bottoms ``features -> 32 -> cut`` (tanh last layer, so ``|x| <= 1 <= sum_bound``),
top ``cut -> 16 -> 1``; SGD, 2 micro-batches per batch.

**Reported**: ``plain_rows_per_s``, ``secure_rows_per_s``, ``secure_sum_vs_plain`` (their
ratio, target >= 0.9), and the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np


def _job(kind: str, *, k: int, rows: int, features: int, cut: int, seed: int):
    import jax.numpy as jnp
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tandem.engine.kernels import StageModel, mlp_stage
    from tandem.engine.topology import star
    from tandem.parties.privacy.masks import KeyShare
    from tandem.parties.privacy.securesum import CutSum
    from tandem.parties.split import SplitConfig, SplitParty
    from tandem.transports.keys import Roster, SigningKey
    from tandem.transports.memory import MemoryNetwork

    topo = star(k)
    inner = mlp_stage([features], [32], cut)
    bottom = StageModel(
        inner.init, lambda p, x: jnp.tanh(inner.apply(p, x)), inner.in_dims, inner.out_dim
    )
    models: dict[str, Any] = {f"bottom_{i}": bottom for i in range(k)}
    models["top"] = mlp_stage([cut], [16], 1, activate_last=False)
    names = [p for p in topo.parties if p != "leader"]
    seeds: dict[str, dict[str, bytes]] = {n: {} for n in names}
    if kind == "secure_sum":
        signers = {n: SigningKey(Ed25519PrivateKey.generate()) for n in names}
        roster = Roster({n: [s.public] for n, s in signers.items()})
        shares = {n: KeyShare() for n in names}
        offers = [shares[n].offer(n, signers[n], "bench") for n in names]
        seeds = {n: shares[n].agree(n, offers, roster, "bench") for n in names}
    rng = np.random.default_rng(seed)
    data = {p: rng.normal(size=(rows, features)).astype(np.float32) for p in topo.parties}
    logit = sum(data[n] @ rng.normal(size=features) for n in names)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    cfg = SplitConfig(batch_size=1024, groups=2, optimizer="sgd", learning_rate=0.05, seed=seed)
    base = CutSum(kind, "top")
    net = MemoryNetwork()
    return {
        p: SplitParty(
            p,
            topo,
            models,
            net.endpoint(p),
            datasets={"train": data[p]},
            labels={"train": labels} if p == "leader" else None,
            config=cfg,
            cut_sum=base if p == "leader" else base.for_follower(p, seeds[p]),
        )
        for p in topo.parties
    }


async def _timed(parties, batches: list[np.ndarray]) -> float:
    leader = parties["leader"]
    seconds = 0.0

    async def drive() -> None:
        nonlocal seconds
        await leader.run_batch(batches[0], n=2)  # warm-up: compilation
        t0 = time.perf_counter()
        for idx in batches[1:]:
            await leader.run_batch(idx, n=2)
        seconds = time.perf_counter() - t0
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        for p, party in parties.items():
            if p != "leader":
                tg.create_task(party.serve())
        tg.create_task(drive())
    return seconds


def measure(
    *,
    k: int = 3,
    rows: int = 16384,
    features: int = 8,
    cut: int = 16,
    batches: int = 12,
    repeats: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Rows per second of plain and secure sum training (same data and batches)."""
    rng = np.random.default_rng(seed + 1)
    idx = [rng.choice(rows, 1024, replace=False) for _ in range(batches + 1)]
    best = {"sum": float("inf"), "secure_sum": float("inf")}
    for r in range(repeats):
        for kind in ("sum", "secure_sum"):
            parties = _job(kind, k=k, rows=rows, features=features, cut=cut, seed=seed)
            best[kind] = min(best[kind], asyncio.run(_timed(parties, idx)))
            print(f"repeat {r} {kind}: {best[kind]:.3f} s", file=sys.stderr)
    timed_rows = 1024 * batches
    plain, secure = timed_rows / best["sum"], timed_rows / best["secure_sum"]
    return {
        "bench": "securesum",
        "followers": k,
        "cut": cut,
        "batch_size": 1024,
        "timed_rows": timed_rows,
        "ring": "Z_2^32, scale 2^-16",
        "plain_rows_per_s": round(plain, 1),
        "secure_rows_per_s": round(secure, 1),
        "secure_sum_vs_plain": round(secure / plain, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.securesum", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.add_argument("--followers", type=int, default=3)
    p.add_argument("--batches", type=int, default=12)
    args = p.parse_args(argv)
    result = measure(k=args.followers, batches=args.batches)
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
