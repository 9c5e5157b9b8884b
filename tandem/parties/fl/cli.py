"""``tandem fl demo``: a server and N clients in one process over the memory transport.

Prints progress (rich) on stderr and, at the end, one JSON line on stdout with the test
accuracy (percent) and the exact bytes up and down.
"""

from __future__ import annotations

import argparse

import orjson

from . import presets
from .data import load_federated_digits
from .federation import make_trainer, run_memory_federation


def register(sub) -> None:
    fl = sub.add_parser("fl", help="horizontal federated learning")
    fl_sub = fl.add_subparsers(dest="fl_command", metavar="SUBCOMMAND", required=True)
    p = fl_sub.add_parser("demo", help="server + clients in one process (memory transport)")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.5, help="clients sampled per round")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", default="128,64", help="hidden layer sizes, comma separated")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05, help="client SGD learning rate")
    p.add_argument(
        "--mode",
        choices=["dense", "randk", "sketch"],
        default="randk",
        help="dense FedAvg, rand-k uplink, or count-sketch uplink",
    )
    p.add_argument("--uplink-ratio", type=int, default=60, help="d / k kept on the uplink")
    p.add_argument("--topk-ratio", type=int, default=50, help="d / k applied by the server")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--server-lr", type=float, default=0.1)
    p.add_argument(
        "--downlink", choices=["full", "initial", "version", "anchor"], default="version"
    )
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--lossless", action="store_true", help="zlib the frames' arrays")
    p.add_argument("--timeout", type=float, default=30.0, help="per-round deadline (s)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=demo)


async def demo(args: argparse.Namespace) -> int:
    from tandem.parties.progress import progress_bar

    data = load_federated_digits(args.clients, args.alpha, args.seed)
    hidden = [int(h) for h in args.hidden.split(",") if h]
    trainer = make_trainer(data, hidden, lr=args.lr, epochs=args.epochs, init_seed=args.seed)
    common = dict(
        rounds=args.rounds,
        fraction=args.fraction,
        seed=args.seed,
        round_timeout=args.timeout,
        lossless=args.lossless,
        anchor_every=args.anchor_every,
    )
    if args.mode == "dense":
        cfg = presets.dense(**common)
    else:
        cfg = presets.compressed(
            trainer.dim,
            uplink_ratio=args.uplink_ratio,
            topk_ratio=args.topk_ratio,
            momentum=args.momentum,
            server_lr=args.server_lr,
            downlink=args.downlink,
            sketch=args.mode == "sketch",
            **common,
        )
    with progress_bar(enabled=not args.quiet) as progress:
        task = progress.add_task(f"FL {args.mode}, {trainer.dim} params", total=args.rounds)

        def on_round(rep) -> None:
            acc = "" if rep.accuracy is None else f" acc {100 * rep.accuracy:.1f}%"
            progress.update(
                task,
                advance=1,
                description=(
                    f"round {rep.round + 1}: {len(rep.accepted)}/{len(rep.sampled)} clients,"
                    f" up {rep.up_bytes} B, down {rep.down_bytes} B{acc}"
                ),
            )
            if rep.rejected:
                for msg in rep.rejected.values():
                    progress.console.print(f"[yellow]{msg}")

        server = await run_memory_federation(data, trainer, cfg, on_round=on_round)
    last = server.reports[-1].accuracy if server.reports else None
    print(
        orjson.dumps(
            {
                "mode": args.mode,
                "params": trainer.dim,
                "rounds": args.rounds,
                "accuracy": None if last is None else round(100 * last, 2),
                "bytes_up": server.bytes_up(),
                "bytes_down": server.bytes_down(),
            }
        ).decode(),
        flush=True,
    )
    return 0
