"""Split-learning sub-commands: ``tandem demo``, ``tandem party --config F.toml`` and
``tandem predict --config F.toml`` (`tandem.parties.split.process.predict_cli`)."""

from __future__ import annotations

import asyncio
import signal
import sys

from tandem.parties.progress import emit_result


def register(sub) -> None:
    from . import predict_cli
    from .demo import demo_command

    p = sub.add_parser(
        "demo",
        help="train leader + follower in one process on the "
        "breast-cancer data split by columns; prints one JSON line",
    )
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--groups", default="auto", help="micro-batches per batch: an int or 'auto'")
    p.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="messages per micro-batch each way; the loss party computes per message",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", type=float, default=1e6, help="shaped link, bytes/s each way")
    p.add_argument("--latency", type=float, default=0.002, help="shaped link latency, seconds")
    p.add_argument("--trace", metavar="DIR", help="write Chrome traces and a Gantt PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=demo_command, colocate_threads=True)

    p = sub.add_parser(
        "party",
        help="run one split-learning party (leader or follower) over "
        "HTTP from a TOML config; prints one JSON line (docs/parties.md)",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="F.toml",
        help="the party's configuration (see examples/split/leader.toml)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="write this party's Chrome trace and Gantt PNG of a few training batches here",
    )
    p.add_argument(
        "--trace-batches",
        type=int,
        default=8,
        metavar="N",
        help="training batches to trace, after the first (default 8)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete this party's checkpoints and start over (needed after its data changed)",
    )
    p.set_defaults(func=party_command, colocate_threads=True)
    predict_cli.register(sub)


async def party_command(args) -> int:
    """Exit codes: 0 done or stopped cleanly (SIGINT/SIGTERM, see the JSON ``status``),
    1 the run failed (refused spec, wrong secret, unreachable or lost peer, changed data),
    2 bad config. A failure is reported on stderr as one readable line, then one JSON line
    ``{"status": "error", "reason", "exit_code", "party"}`` (stdout keeps results only)."""
    from tandem.errors import ConfigError, TandemError
    from tandem.parties.compile_cache import compile_cache_folder, enable_compile_cache

    from .build import load_party_config
    from .cli_report import report_error, report_error_json
    from .party_trace import DEFAULT_BATCHES, BatchTrace
    from .standalone import run_party

    trace_dir = getattr(args, "trace", None)
    trace_batches = getattr(args, "trace_batches", DEFAULT_BATCHES)
    try:
        if trace_dir:  # fail before training, not after it
            BatchTrace.check()
            if trace_batches < 1:
                raise ConfigError(f"--trace-batches must be >= 1, got {trace_batches}")
        cfg = await asyncio.to_thread(load_party_config, args.config)
        enable_compile_cache(
            compile_cache_folder(cfg.checkpoint.compile_cache, cfg.checkpoint.dir, cfg.export_dir)
        )
    except ConfigError as exc:
        print(f"tandem party: {exc}", file=sys.stderr)
        report_error_json(exc, 2, party=None)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        result = await run_party(
            cfg,
            stop=stop,
            trace_dir=trace_dir,
            trace_batches=trace_batches,
            fresh=bool(getattr(args, "fresh", False)),
        )
    except (TandemError, OSError, ExceptionGroup) as exc:
        code = report_error(f"tandem party ({cfg.name}): error", exc)
        report_error_json(exc, code, party=cfg.name)
        return code
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    emit_result(result)
    return 0
