"""``tandem align``: private sample alignment over HTTP, ids from a column of a CSV or Parquet
table.

Run one command per party (each serves on its own port). The leader names every follower
(``--peer`` once per follower), each follower names the leader only::

    TANDEM_SECRET=... tandem align --name A --role leader   --port 8601 \
        --peer B=http://127.0.0.1:8602 --ids a.csv --column customer_id --out a_aligned.csv
    TANDEM_SECRET=... tandem align --name B --role follower --port 8602 \
        --peer A=http://127.0.0.1:8601 --ids b.csv --column customer_id --out b_aligned.csv

With K followers the leader runs the PSI with each and sends each follower its positions of
the ids they all share (`tandem.parties.alignment.multi`). Each party writes ``row,id`` lines
(row = 0-based data row of the table, a CSV's header excluded) in the agreed order, and prints
one JSON summary line with the intersection size and commitment for the task spec. The shared HMAC
secret comes from the environment variable named by ``--secret-env``
(default ``TANDEM_SECRET``), never from the command line; without it, requests are unsigned,
which a non-loopback ``--host`` refuses unless ``--insecure`` says so. ``tandem align`` takes
flags only (no TOML file: its few settings differ per run).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import sys
import time

from tandem.parties.data.aligned_file import write_aligned
from tandem.parties.progress import emit_result

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
    p.add_argument(
        "--peer",
        required=True,
        action="append",
        metavar="NAME=URL",
        help="a follower names the leader; the leader names every follower (repeat --peer)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0 = any free port)")
    p.add_argument(
        "--ids",
        required=True,
        help="the table holding the ids: a CSV file with a header row, or .parquet / .npz",
    )
    p.add_argument("--column", default=None, help="id column name (default: the first)")
    p.add_argument("--out", required=True, help="CSV to write the aligned rows to")
    p.add_argument(
        "--secret-env",
        default="TANDEM_SECRET",
        help="environment variable holding the shared HMAC secret",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve unsigned on a non-loopback --host (anyone reaching it may take part)",
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
    """The values of ``column`` (default: the first) of the table at ``path``: a CSV read
    here cell by cell as text, with the party's rules (`_csv_ids`); a ``.parquet`` or
    ``.npz`` file through the shared reader (`tandem.parties.data.read_table`, the id column
    read as text exactly as `tandem party` reads it)."""
    if path.lower().endswith((".parquet", ".npz")):
        return _table_ids(path, column)
    try:
        return _csv_ids(path, column)
    except UnicodeDecodeError:
        raise AlignmentError(f"{path!r} is not UTF-8 text; save the CSV as UTF-8") from None
    except csv.Error as exc:  # e.g. a cell beyond the csv module's field limit
        raise AlignmentError(f"{path!r} is not a well-formed CSV: {exc}") from None


def _csv_ids(path: str, column: str | None) -> list[str]:
    """The ids of a CSV read as `tandem party` reads it: a byte-order mark is no part of the
    header, a blank line is no row (so row numbers are the party's), and a missing cell
    (`MISSING_TEXT`, which the party refuses as an id) is refused here, before the PSI."""
    from tandem.parties.data.table import MISSING_TEXT

    with open(path, newline="", encoding="utf-8-sig") as f:
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
        ids: list[str] = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) <= idx:
                raise AlignmentError(f"{path!r} line {line_no} has no value in column {idx}")
            if row[idx] in MISSING_TEXT:
                raise AlignmentError(
                    f"{path!r}: id column {header[idx]!r} has no value at row {len(ids)} "
                    f"(0-based data row; {row[idx]!r} is a missing cell); every row needs an id"
                )
            ids.append(row[idx])
        return ids


def _table_ids(path: str, column: str | None) -> list[str]:
    from tandem.parties.data import DataError, read_table

    try:
        if column is None:
            available = read_table(path, []).available
            if not available:
                raise AlignmentError(f"{path!r} has no columns: expected a column of ids")
            column = available[0]
        ids = read_table(path, [column], text=[column])[column]
    except DataError as exc:
        raise AlignmentError(f"--ids: {exc}") from None
    row = ids.first_missing()
    if row is not None:
        raise AlignmentError(
            f"{path!r}: id column {column!r} has no value at row {row} (0-based data row); "
            "every row needs an id"
        )
    return ids.values.tolist()


async def run(args: argparse.Namespace) -> int:
    from tandem.errors import TandemError
    from tandem.transports.factory import addressing, common_scheme, make_transport, started

    from . import psi  # noqa: F401  (the psi extra is required before anything starts)
    from .multi import align_follower, align_leader

    secret = os.environ.get(args.secret_env)
    try:  # bad flags or a bad ids file: exit 2 before connecting
        peers = _peers(args, secret)
        ids = await asyncio.to_thread(read_ids, args.ids, args.column)
    except (AlignmentError, OSError) as exc:
        print(f"tandem align: {exc}", file=sys.stderr)
        return 2
    try:
        built = make_transport(
            common_scheme(peers.values()),
            name=args.name,
            host=args.host,
            port=args.port,
            peers=peers,
            secret=secret.encode() if secret else None,
            retry_timeout=args.wait,
        )
        async with started(built) as t:
            here = addressing(t, "tandem align").address()
            print(
                f"tandem align: {args.name} serving on {here}, {len(ids)} ids, waiting for "
                + ", ".join(f"{p} at {u}" for p, u in peers.items()),
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            options = {"rng": None, "chunk_size": args.chunk}
            async with asyncio.timeout(args.timeout):
                if args.role == "leader":
                    res = await align_leader(t, list(peers), ids, **options)
                else:
                    res = await align_follower(t, next(iter(peers)), ids, **options)
            seconds = time.perf_counter() - t0
        await asyncio.to_thread(_write, args.out, res)
    except TimeoutError:
        print(
            f"tandem align: no result from {', '.join(peers)} after {args.timeout} s; is each "
            f"running `tandem align` with --peer {args.name}=<this URL>?",
            file=sys.stderr,
        )
        return 1
    except (TandemError, OSError, ExceptionGroup) as exc:
        print(f"tandem align: {_reason(exc)}", file=sys.stderr)
        return 1
    emit_result(_summary(args, peers, res, seconds))
    return 0


def _reason(exc: BaseException) -> BaseException:
    """``exc``, or the first leaf of an exception group (the pairwise PSIs, and the streams
    of one PSI, run in task groups), re-raised when it is no Tandem or OS error (a bug)."""
    from tandem.errors import TandemError

    err = exc
    while isinstance(err, BaseExceptionGroup):
        err = err.exceptions[0]
    if not isinstance(err, (TandemError, OSError)):
        raise exc
    return err


def _peers(args: argparse.Namespace, secret: str | None) -> dict[str, str]:
    """The ``--peer NAME=URL`` flags as a mapping; `AlignmentError` when one is malformed, a
    follower names more than the leader, or a non-loopback ``--host`` would serve unsigned."""
    from tandem.parties.config.sections import is_loopback
    from tandem.transports.factory import is_transport_url, url_hint

    peers: dict[str, str] = {}
    for given in args.peer:
        peer, sep, url = given.partition("=")
        if not sep or not peer or not is_transport_url(url):
            raise AlignmentError(
                f"--peer must be NAME=URL with URL {url_hint()} (e.g. "
                f"B=http://127.0.0.1:8602), got {given!r}"
            )
        peers[peer] = url
    if args.role == "follower" and len(peers) != 1:
        raise AlignmentError(
            f"a follower aligns through the leader only: give one --peer "
            f"(the leader), got {sorted(peers)}"
        )
    if not (secret or args.insecure or is_loopback(args.host)):
        raise AlignmentError(
            f"--host {args.host} is reachable from other machines and "
            f"${args.secret_env} holds no shared secret; export it (every party the same), "
            "or serve on 127.0.0.1, or pass --insecure to serve unsigned on purpose"
        )
    return peers


def _summary(args: argparse.Namespace, peers: dict[str, str], res, seconds: float) -> dict:
    """The JSON line of a finished alignment."""
    summary = {
        "party": args.name,
        "intersection_size": res.size,
        "intersection_commitment": res.commitment,
        "local_ids": res.local_count,
        "peer_ids": res.peer_counts[next(iter(peers))]
        if len(peers) == 1
        else dict(res.peer_counts),
        "duplicates": res.duplicates,
        "seconds": round(seconds, 3),
        "out": args.out,
    }
    if len(peers) > 1:
        summary["pairwise"] = dict(res.pairwise)
    return summary


def _write(path: str, res) -> None:
    write_aligned(path, res.rows.tolist(), res.ids)
