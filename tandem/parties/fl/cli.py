"""``tandem fl ...``: a federated server and clients, as separate processes or in one.

    tandem fl prepare --out DIR                       # example CSVs (digits), 4 clients
    tandem fl server --config server.toml [--fresh]   # the server, over HTTP
    tandem fl client --config bank_a.toml             # one client, over HTTP
    tandem fl demo                                    # everything in one process (memory)
    tandem fl simulate --clients N --per-round K      # N virtual clients, K alive at once

Each prints progress on stderr and, at the end, one JSON line on stdout: the server its final
accuracy and loss on its evaluation data, the export and the bytes up and down; a client what
it trained; the demo its test accuracy (percent) and the exact bytes up and down. A
configuration or connection error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import orjson

from tandem.errors import TandemError
from tandem.parties.progress import emit_result


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
    prep = fl_sub.add_parser(
        "prepare", help="write example client CSVs and a held-out CSV (scikit-learn digits)"
    )
    prep.add_argument("--out", required=True, help="folder to write the CSV files into")
    prep.add_argument(
        "--clients", default="bank_a,bank_b,bank_c,bank_d", help="client names, comma separated"
    )
    prep.add_argument("--server", default="server", help="name of the held-out file")
    prep.add_argument(
        "--alpha", type=float, default=100.0, help="Dirichlet label skew (small: strong)"
    )
    prep.add_argument("--seed", type=int, default=0)
    prep.set_defaults(func=prepare_command)
    srv = fl_sub.add_parser("server", help="the federated server, over HTTP")
    srv.add_argument("--config", required=True, help="server TOML (path or fsspec URL)")
    srv.add_argument(
        "--fresh",
        action="store_true",
        help="start from round 0 even when server.checkpoint holds a checkpoint (it is "
        "overwritten)",
    )
    srv.add_argument("-v", "--verbose", action="store_true", help="log every connection")
    srv.set_defaults(func=server_command)
    cli = fl_sub.add_parser("client", help="one federated client, over HTTP")
    cli.add_argument("--config", required=True, help="client TOML (path or fsspec URL)")
    cli.add_argument("-v", "--verbose", action="store_true", help="log every reconnection")
    cli.set_defaults(func=client_command)
    from .simulate.cli import register_simulate

    register_simulate(fl_sub)


def _logging(verbose: bool) -> None:
    """Warnings on stderr; with ``verbose`` also connections, admissions and refusals."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    level = logging.INFO if verbose else logging.WARNING
    for name in ("tandem.parties.fl", "tandem.transports.http"):
        logging.getLogger(name).setLevel(level)


def _result(summary: dict[str, Any]) -> int:
    emit_result(summary)
    return 0


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    return 2


async def prepare_command(args: argparse.Namespace) -> int:
    import asyncio

    from .data import write_digits_csvs

    names = [n for n in args.clients.split(",") if n]
    try:
        paths = await asyncio.to_thread(
            write_digits_csvs, args.out, names, alpha=args.alpha, seed=args.seed, server=args.server
        )
    except TandemError as exc:
        return _fail(exc)
    return _result({"files": paths})


async def server_command(args: argparse.Namespace) -> int:
    import asyncio

    from .config import load_server_config
    from .evaluation import round_text
    from .server_process import run_server
    from .startup import enable_compilation_cache, use_system_arrow_pool

    _logging(args.verbose)
    # refusals of unknown clients are always worth a line on the server's stderr
    logging.getLogger("tandem.transports.http").setLevel(logging.INFO)
    try:
        cfg = await asyncio.to_thread(load_server_config, args.config)
        enable_compilation_cache(cfg.compile_cache)
        use_system_arrow_pool()

        def on_ready(url: str) -> None:
            print(f"{cfg.name}: listening on {url}", file=sys.stderr, flush=True)

        started = time.monotonic()

        def on_round(rep) -> None:
            acc = "" if rep.accuracy is None else f", accuracy {100 * rep.accuracy:.2f}%"
            eps = "" if rep.epsilon is None else f", epsilon {rep.epsilon:.3f}"
            if rep.epsilon_vs_server is not None:
                eps += f" (vs server {rep.epsilon_vs_server:.3f})"
            print(
                f"round {rep.round + 1}/{cfg.rounds}: {len(rep.accepted)}/{len(rep.sampled)} "
                f"clients, up {rep.up_bytes} B, down {rep.down_bytes} B{acc}"
                f"{round_text(rep.evaluation)}{eps}, "
                f"{rep.seconds:.2f} s (elapsed {time.monotonic() - started:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
            for msg in rep.rejected.values():
                print(f"  refused: {msg}", file=sys.stderr, flush=True)

        summary = await run_server(cfg, fresh=args.fresh, on_round=on_round, on_ready=on_ready)
    except TandemError as exc:
        return _fail(exc)
    return _result(summary)


async def client_command(args: argparse.Namespace) -> int:
    import asyncio

    from .client_process import run_client
    from .config import load_client_config
    from .startup import enable_compilation_cache, use_system_arrow_pool

    _logging(args.verbose)
    try:
        cfg = await asyncio.to_thread(load_client_config, args.config)
        enable_compilation_cache(cfg.compile_cache)
        use_system_arrow_pool()
        print(f"{cfg.name}: connecting to {cfg.server}", file=sys.stderr, flush=True)

        def on_round(r: int) -> None:
            print(f"{cfg.name}: trained round {r + 1}", file=sys.stderr, flush=True)

        summary = await run_client(cfg, on_round=on_round)
    except TandemError as exc:
        return _fail(exc)
    return _result(summary)


async def demo(args: argparse.Namespace) -> int:
    from tandem.parties.progress import progress_bar

    from . import presets
    from .data import load_federated_digits
    from .federation import make_trainer, run_memory_federation

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
