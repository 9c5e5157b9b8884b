"""Split-learning sub-commands: ``tandem demo``, ``tandem predict``."""

from __future__ import annotations


def register(sub) -> None:
    from . import predict_cli
    from .demo import demo_command

    p = sub.add_parser("demo", help="train leader + follower in one process on the "
                       "breast-cancer data split by columns; prints one JSON line")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--groups", default="auto", help="micro-batches per batch: an int or 'auto'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", type=float, default=1e6, help="shaped link, bytes/s each way")
    p.add_argument("--latency", type=float, default=0.002, help="shaped link latency, seconds")
    p.add_argument("--trace", metavar="DIR", help="write Chrome traces and a Gantt PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=demo_command)
    predict_cli.register(sub)
