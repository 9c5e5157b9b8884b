"""Benchmark: dense FedAvg vs compressed FL on digits, and seconds per round for a 1M-parameter
model over HTTP on loopback.

    python -m bench.fl --json                       # one JSON line
    python -m bench.fl --plot docs/img/fl_accuracy_vs_bytes.png
    python -m bench.fl --json --startup-only        # launch to end of round one (bench.fl_startup)

Accuracy run (memory transport, exact byte counters): 20 clients, half sampled per round,
Dirichlet alpha 0.5, MLP 64-128-64-10 (17,226 parameters), the same seeds and rounds for both.
Ratios are dense bytes / compressed bytes over the whole run, as the server's transport
counted them (headers included).

The same accuracy run at 1M parameters (MLP 64-1000-936-10, 1,011,306 parameters): same data,
clients, seeds and client optimizer, dense and compressed for ``--rounds-1m`` rounds each
(``acc_dense_1m``, ``acc_compressed_1m``, and the byte ratios with the ``_1m`` suffix).

Timing run (HttpTransport, three parties in one process on 127.0.0.1): 2 clients, MLP
64-1000-936-10 (1,011,306 parameters); each client does one SGD step on 32 local samples per
round; seconds per round are the mean over the timed rounds after warm-up rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import orjson

from tandem.parties.fl import presets
from tandem.parties.fl.data import FederatedData, load_federated_digits
from tandem.parties.fl.federation import make_trainer, run_http_federation, run_memory_federation

HIDDEN = [128, 64]
HIDDEN_1M = [1000, 936]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def accuracy_runs(rounds: int, seed: int, hidden: list[int] = HIDDEN, eval_every: int = 1) -> dict:
    """Dense and compressed federations of the MLP ``hidden`` on the same data and seeds."""
    data = load_federated_digits(20, 0.5, seed)
    trainer = make_trainer(data, hidden, lr=0.05, epochs=2, init_seed=seed)
    common = dict(rounds=rounds, fraction=0.5, seed=seed, eval_every=eval_every)
    runs = {}
    for name, cfg in (
        ("dense", presets.dense(**common)),
        ("compressed", presets.compressed(trainer.dim, **common)),
    ):
        t0 = time.perf_counter()
        server = asyncio.run(run_memory_federation(data, trainer, cfg))
        runs[name] = server
        log(
            f"{name} ({trainer.dim} params): acc {100 * server.reports[-1].accuracy:.2f}% "
            f"up {server.bytes_up()} B "
            f"down {server.bytes_down()} B ({time.perf_counter() - t0:.1f} s)"
        )
    return {"params": trainer.dim, "runs": runs}


def http_seconds_per_round(mode: str, rounds: int, warmup: int, seed: int) -> float:
    data = load_federated_digits(2, 0.5, seed)
    data = FederatedData(tuple((x[:32], y[:32]) for x, y in data.clients), data.x_test, data.y_test)
    trainer = make_trainer(data, HIDDEN_1M, lr=0.01, epochs=1, batch_size=32, init_seed=seed)
    common = dict(rounds=warmup + rounds, fraction=1.0, seed=seed, eval_every=0)
    cfg = presets.dense(**common) if mode == "dense" else presets.compressed(trainer.dim, **common)
    server = asyncio.run(run_http_federation(data, trainer, cfg, evaluate=False))
    timed = server.reports[warmup:]
    assert all(len(r.accepted) == 2 for r in timed), "a timed round lost a client"
    s = sum(r.seconds for r in timed) / len(timed)
    log(f"HTTP 1M {mode}: {s * 1000:.1f} ms/round, d={trainer.dim}")
    return s


def plot(path: str, result: dict) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for name, server in result["runs"].items():
        cum, xs, ys = 0, [], []
        for r in server.reports:
            cum += r.up_bytes + r.down_bytes
            if r.accuracy is not None:
                xs.append(cum / 1e6)
                ys.append(100 * r.accuracy)
        ax.plot(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes on the wire, up + down (MB, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"digits, 20 clients (10 per round), Dirichlet 0.5, {result['params']} params")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def startup_figures() -> dict:
    """`bench.fl_startup.startup` in a fresh temporary folder (its own compilation cache)."""
    import tempfile
    from pathlib import Path

    from .fl_startup import startup

    with tempfile.TemporaryDirectory(prefix="tandem-fl-startup-") as folder:
        return startup(Path(folder))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--plot", metavar="PNG", help="write accuracy vs cumulative bytes")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds-1m",
        type=int,
        default=40,
        help="rounds of the 1M-parameter accuracy runs (0 skips them)",
    )
    p.add_argument("--http-rounds", type=int, default=20)
    p.add_argument("--skip-http", action="store_true", help="accuracy runs only")
    p.add_argument(
        "--startup-only",
        action="store_true",
        help="only first_round_s and client_peak_rss_mb: 11 processes (bench.fl_startup)",
    )
    p.add_argument("--skip-startup", action="store_true", help="leave the process start-up out")
    args = p.parse_args(argv)
    if args.startup_only:
        print(orjson.dumps({"bench": "fl", **startup_figures()}).decode(), flush=True)
        return 0

    result = accuracy_runs(args.rounds, args.seed)
    dense, comp = result["runs"]["dense"], result["runs"]["compressed"]
    out = {
        "bench": "fl",
        "params": result["params"],
        "rounds": args.rounds,
        "clients": 20,
        "per_round": 10,
        "alpha": 0.5,
        "acc_dense": round(100 * dense.reports[-1].accuracy, 2),
        "acc_compressed": round(100 * comp.reports[-1].accuracy, 2),
        "uplink_ratio": round(dense.bytes_up() / comp.bytes_up(), 2),
        "downlink_ratio": round(dense.bytes_down() / comp.bytes_down(), 2),
        "total_ratio": round(
            (dense.bytes_up() + dense.bytes_down()) / (comp.bytes_up() + comp.bytes_down()), 2
        ),
        "bytes_up_dense": dense.bytes_up(),
        "bytes_up_compressed": comp.bytes_up(),
        "bytes_down_dense": dense.bytes_down(),
        "bytes_down_compressed": comp.bytes_down(),
    }
    if args.plot:
        plot(args.plot, result)
    if args.rounds_1m:
        big = accuracy_runs(args.rounds_1m, args.seed, HIDDEN_1M, eval_every=0)
        dense_1m, comp_1m = big["runs"]["dense"], big["runs"]["compressed"]
        out.update(
            params_1m=big["params"],
            rounds_1m=args.rounds_1m,
            acc_dense_1m=round(100 * dense_1m.reports[-1].accuracy, 2),
            acc_compressed_1m=round(100 * comp_1m.reports[-1].accuracy, 2),
            uplink_ratio_1m=round(dense_1m.bytes_up() / comp_1m.bytes_up(), 2),
            downlink_ratio_1m=round(dense_1m.bytes_down() / comp_1m.bytes_down(), 2),
        )
    if not args.skip_http:
        out["s_per_round_1m_dense"] = round(
            http_seconds_per_round("dense", args.http_rounds, 3, args.seed), 4
        )
        out["s_per_round_1m_compressed"] = round(
            http_seconds_per_round("compressed", args.http_rounds, 3, args.seed), 4
        )
    if not args.skip_startup:
        out.update(startup_figures())
    print(
        orjson.dumps(out).decode()
        if args.json
        else orjson.dumps(out, option=orjson.OPT_INDENT_2).decode(),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
