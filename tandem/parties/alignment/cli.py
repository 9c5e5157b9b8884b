"""``tandem align``: private sample alignment of two parties over HTTP, ids from a CSV column.

Run one command per party (each serves on its own port and knows the other's URL)::

    TANDEM_SECRET=... tandem align --name A --role leader   --port 8601 \
        --peer B=http://127.0.0.1:8602 --ids a.csv --column customer_id --out a_aligned.csv
    TANDEM_SECRET=... tandem align --name B --role follower --port 8602 \
        --peer A=http://127.0.0.1:8601 --ids b.csv --column customer_id --out b_aligned.csv

Each writes ``row,id`` lines (row = 0-based data row of the CSV, header excluded) in the agreed
order, and prints one JSON summary line with the intersection size and commitment for the task
spec. The shared HMAC secret comes from the environment variable named by ``--secret-env``
(default ``TANDEM_SECRET``), never from the command line; without it, requests are unsigned.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
import time

from .aligned_file import write_aligned
from .errors import AlignmentError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "align",
        help="privately intersect sample ids with one peer (ECDH-PSI)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--name", required=True, help="this party's name")
    p.add_argument(
        "--role",
        required=True,
        choices=("leader", "follower"),
        help="the two parties must take different roles",
    )
    p.add_argument("--peer", required=True, metavar="NAME=URL", help="the other party")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0 = any free port)")
    p.add_argument("--ids", required=True, help="CSV file with a header row")
    p.add_argument("--column", default=None, help="id column name (default: the first)")
    p.add_argument("--out", required=True, help="CSV to write the aligned rows to")
    p.add_argument(
        "--secret-env",
        default="TANDEM_SECRET",
        help="environment variable holding the shared HMAC secret",
    )
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the peer")
    p.add_argument("--chunk", type=int, default=32768, help="points per frame")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="give up if the alignment has not finished after this many seconds",
    )
    p.set_defaults(func=run)


def read_ids(path: str, column: str | None) -> list[str]:
    """The values of ``column`` (default: the first) of the CSV at ``path``."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise AlignmentError(f"{path!r} is empty: expected a header row, then one id per row")
        if column is None:
            idx = 0
        elif column in header:
            idx = header.index(column)
        else:
            raise AlignmentError(f"{path!r} has no column {column!r}; its columns are {header}")
        ids = []
        for line_no, row in enumerate(reader, start=2):
            if len(row) <= idx:
                raise AlignmentError(f"{path!r} line {line_no} has no value in column {idx}")
            ids.append(row[idx])
        return ids


async def run(args: argparse.Namespace) -> int:
    from tandem.errors import TandemError
    from tandem.transports.http import HttpConfig, HttpTransport

    from .psi import align

    peer, sep, url = args.peer.partition("=")
    if not sep or not peer or not url.startswith(("http://", "https://")):
        print(
            f"tandem align: --peer must be NAME=URL (e.g. B=http://127.0.0.1:8602), got "
            f"{args.peer!r}",
            file=sys.stderr,
        )
        return 2
    secret = os.environ.get(args.secret_env)
    try:
        ids = await asyncio.to_thread(read_ids, args.ids, args.column)
        cfg = HttpConfig(
            name=args.name,
            host=args.host,
            port=args.port,
            peers={peer: url},
            secret=secret.encode() if secret else None,
            retry_timeout=args.wait,
        )
        async with HttpTransport(cfg) as t:
            print(
                f"tandem align: {args.name} serving on {t.url}, {len(ids)} ids, waiting for "
                f"{peer} at {url}",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            async with asyncio.timeout(args.timeout):
                res = await align(t, peer, ids, role=args.role, rng=None, chunk_size=args.chunk)
            seconds = time.perf_counter() - t0
        await asyncio.to_thread(_write, args.out, res)
    except TimeoutError:
        print(
            f"tandem align: no result from {peer} after {args.timeout} s; is it running "
            f"`tandem align` with --peer {args.name}=<this URL>?",
            file=sys.stderr,
        )
        return 1
    except (TandemError, OSError) as exc:
        print(f"tandem align: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "party": args.name,
                "intersection_size": res.size,
                "intersection_commitment": res.commitment,
                "local_ids": res.local_count,
                "peer_ids": res.peer_count,
                "duplicates": res.duplicates,
                "seconds": round(seconds, 3),
                "out": args.out,
            }
        ),
        flush=True,
    )
    return 0


def _write(path: str, res) -> None:
    write_aligned(path, res.rows.tolist(), res.ids)
