"""Benchmark: federated simulation (`tandem.parties.fl.simulate`) of thousands of clients.

    python -m bench.fl_sim --json        # one JSON line

Every setting runs in its own process (so peak RSS is that setting's), dense FedAvg, full
downlink, no evaluation; each client's rows are generated from ``(seed, client)`` when it is
sampled (MNIST-sized: 784 features, 10 classes, 60 rows for the Flower setting; 64 features
and 32 rows, one SGD step of batch 32 for the 1M model), so the data itself does not grow
with the number of clients and what is measured is the simulator's own per-client cost.

* ``rounds_per_s_1m``, ``peak_rss_1m_mb``: 1,000 clients, 100 per round, MLP 64-1000-936-10
  (1,011,306 parameters).
* Flower's setting (its simulation engine on Ray measured 0.79-0.81 s/round and 1.06 GB PSS
  on the reference machine): 1,000 clients, 10 per round, MLP 784-1384-10 (1,100,290
  parameters), one epoch of batch 32: ``s_per_round_1k`` (target <= 0.4) and ``pss_1k_mb``
  (proportional set size of the process tree, from /proc/*/smaps_rollup; target <= 530).
* ``rss_10k_vs_100``: the Flower setting's peak RSS at 10,000 clients / at 100 (target <= 1.2).

Seconds per round are the mean over the timed rounds after ``--warmup`` rounds (compilation).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time

import numpy as np
import optax
import orjson

SETTINGS = {
    # name: (clients, per round, features, hidden, rows, epochs)
    "1m": (1000, 100, 64, [1000, 936], 32, 1),
    "flower": (1000, 10, 784, [1384], 60, 1),
    "flower_100": (100, 10, 784, [1384], 60, 1),
    "flower_10k": (10_000, 10, 784, [1384], 60, 1),
}


class SyntheticClients:
    """``n`` clients of ``rows`` rows each, generated from ``(seed, i)`` on demand."""

    def __init__(self, n: int, rows: int, features: int, classes: int, seed: int) -> None:
        self.n, self.rows, self.features, self.classes, self.seed = n, rows, features, classes, seed

    def __len__(self) -> int:
        return self.n

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, i])
        y = rng.integers(0, self.classes, self.rows).astype(np.int32)
        x = rng.normal(size=(self.rows, self.features)).astype(np.float32)
        x[:, : self.classes] += 2.0 * np.eye(self.classes, dtype=np.float32)[y]
        return x, y


def tree_pss_mb(root: int) -> float:
    """Proportional set size (MiB) of ``root`` and its descendants (/proc/*/smaps_rollup)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    kb = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kb += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            continue
    return kb / 1024


def run_one(name: str, rounds: int, warmup: int, seed: int) -> dict:
    from tandem.parties.fl.server import FLConfig
    from tandem.parties.fl.simulate import simulate
    from tandem.parties.fl.train import LocalTrainer

    n, k, features, hidden, rows, epochs = SETTINGS[name]
    trainer = LocalTrainer(
        [features, *hidden, 10], optax.sgd(0.05), epochs=epochs, batch_size=32, init_seed=seed
    )
    cfg = FLConfig(rounds=warmup + rounds, seed=seed, downlink="full", round_timeout=600.0)
    stamps: list[float] = []
    server = asyncio.run(
        simulate(
            SyntheticClients(n, rows, features, 10, seed),
            trainer,
            cfg,
            per_round=k,
            on_round=lambda rep: stamps.append(time.perf_counter()),
        )
    )
    assert all(len(r.accepted) == k for r in server.reports), "a client was left out"
    timed = np.diff(stamps[warmup - 1 :]) if warmup else np.diff([stamps[0], *stamps])
    return {
        "setting": name,
        "params": trainer.dim,
        "s_per_round": float(np.mean(timed)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pss_mb": tree_pss_mb(os.getpid()),
        "peak_live": server.pool.peak,
    }


def in_child(name: str, rounds: int, warmup: int, seed: int, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.fl_sim", "--one", name, "--rounds", str(rounds)]
    cmd += ["--warmup", str(warmup), "--seed", str(seed)] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench.fl_sim {name} failed:\n{out.stderr[-3000:]}")
    return orjson.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per setting")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = p.parse_args(argv)
    if args.quick:  # here and in each child (--one) alike
        SETTINGS.update(
            {k: (v[0] // 10, v[1], v[2], [32], v[4], v[5]) for k, v in SETTINGS.items()}
        )
    if args.one:
        print(orjson.dumps(run_one(args.one, args.rounds, args.warmup, args.seed)).decode())
        return 0
    r = {n: in_child(n, args.rounds, args.warmup, args.seed, args.quick) for n in SETTINGS}
    out = {
        "bench": "fl_sim",
        "params_1m": r["1m"]["params"],
        "rounds_per_s_1m": round(1 / r["1m"]["s_per_round"], 3),
        "peak_rss_1m_mb": round(r["1m"]["peak_rss_mb"], 1),
        "params_flower": r["flower"]["params"],
        "s_per_round_1k": round(r["flower"]["s_per_round"], 4),
        "pss_1k_mb": round(r["flower"]["pss_mb"], 1),
        "peak_rss_100_mb": round(r["flower_100"]["peak_rss_mb"], 1),
        "peak_rss_10k_mb": round(r["flower_10k"]["peak_rss_mb"], 1),
        "rss_10k_vs_100": round(r["flower_10k"]["peak_rss_mb"] / r["flower_100"]["peak_rss_mb"], 3),
        "peak_live_max": max(v["peak_live"] for v in r.values()),
        "rounds": args.rounds,
        "warmup": args.warmup,
    }
    print(
        orjson.dumps(out).decode() if args.json else "\n".join(f"{k}: {v}" for k, v in out.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
