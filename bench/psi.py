"""Benchmark of private sample alignment: two processes, HTTP on loopback.

    python -m bench.psi --json            # 100k and 1M ids per side, 50% overlap
    python -m bench.psi --sizes 20000     # quicker look, human-readable lines

For each size n, this script starts two party processes (``python -m bench.psi --party ...``):
the leader holds ids ``id0 .. id{n-1}``, the follower ``id{n/2} .. id{3n/2-1}``. Each serves an
`HttpTransport` (HMAC-authenticated) on 127.0.0.1, learns the other's URL through this parent,
waits until the parent has heard that both added each other (a party refuses a frame from a
sender it has not added), runs `tandem.parties.alignment.align` and prints one JSON line: its
wall time for the alignment (from the start of `align` to its return, pool start-up included),
the intersection size and commitment, and bytes sent. ``seconds_<n>`` is the slower party's
time; ``bytes_<n>`` the encoded frame bytes both parties sent (HTTP headers excluded). The run
fails unless both parties agree and the intersection has exactly n/2 ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time

NAMES = {"leader": "L", "follower": "F"}


def _label(n: int) -> str:
    return (
        f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)
    )


async def _party(role: str, n: int, secret: bytes, chunk: int) -> dict:
    import numpy as np  # noqa: F401  (imported here so the parent stays light)

    from tandem.parties.alignment import align
    from tandem.transports.http import HttpConfig, HttpTransport

    me, other = NAMES[role], NAMES["follower" if role == "leader" else "leader"]
    start = 0 if role == "leader" else n // 2
    ids = [f"id{i}" for i in range(start, start + n)]
    cfg = HttpConfig(
        name=me,
        host="127.0.0.1",
        port=0,
        secret=secret,
        capacity=64,
        retry_timeout=120.0,
        backpressure_wait=30.0,
    )
    async with HttpTransport(cfg) as t:
        print(json.dumps({"url": t.url}), flush=True)
        peer_url = (await asyncio.to_thread(sys.stdin.readline)).strip()
        t.add_peer(other, peer_url)
        # the other party refuses (401) a frame from a sender it has not added yet: wait
        # until the parent has heard that both know each other
        print(json.dumps({"ready": True}), flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
            raise SystemExit(f"bench.psi: the {role} got no 'go' from its parent")
        t0 = time.perf_counter()
        res = await align(t, other, ids, role=role, rng=None, chunk_size=chunk)
        seconds = time.perf_counter() - t0
        return {
            "role": role,
            "seconds": seconds,
            "size": res.size,
            "commitment": res.commitment,
            "bytes_sent": t.sent_stats(other).bytes,
        }


def _run_pair(n: int, chunk: int) -> dict:
    secret = secrets.token_hex(16)
    procs = {}
    for role in NAMES:
        procs[role] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.psi",
                "--party",
                role,
                "--n",
                str(n),
                "--secret",
                secret,
                "--chunk",
                str(chunk),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    try:
        urls = {r: json.loads(p.stdout.readline())["url"] for r, p in procs.items()}
        for role, p in procs.items():
            p.stdin.write(urls["follower" if role == "leader" else "leader"] + "\n")
            p.stdin.flush()
        for role, p in procs.items():
            if not json.loads(p.stdout.readline() or "{}").get("ready"):
                raise SystemExit(f"bench.psi: the {role} process failed (exit {p.wait()})")
        for p in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        results = {}
        for role, p in procs.items():
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise SystemExit(f"bench.psi: the {role} process failed (exit {p.returncode})")
            results[role] = json.loads(line)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdin.close()
            p.stdout.close()
    lead, foll = results["leader"], results["follower"]
    if lead["commitment"] != foll["commitment"] or lead["size"] != n // 2:
        raise SystemExit(f"bench.psi: wrong alignment for n={n}: {results}")
    return {
        "seconds": max(lead["seconds"], foll["seconds"]),
        "bytes": lead["bytes_sent"] + foll["bytes_sent"],
        "size": lead["size"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.psi", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[100_000, 1_000_000],
        help="ids per side (default: 100000 1000000)",
    )
    ap.add_argument("--chunk", type=int, default=32768, help="points per frame")
    ap.add_argument("--party", choices=list(NAMES), help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--secret", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.party:  # child process: one party
        from tandem.parties.cli import run_async

        out = run_async(lambda: _party(args.party, args.n, args.secret.encode(), args.chunk))
        print(json.dumps(out), flush=True)
        return 0
    record: dict = {
        "bench": "psi",
        "transport": "http-loopback",
        "processes": 2,
        "cpus": os.cpu_count(),
        "overlap": 0.5,
    }
    for n in args.sizes:
        if not args.json:
            print(f"aligning {n} ids per side over HTTP ...", flush=True)
        r = _run_pair(n, args.chunk)
        record[f"seconds_{_label(n)}"] = round(r["seconds"], 2)
        record[f"bytes_{_label(n)}"] = r["bytes"]
        if not args.json:
            print(
                f"  {n} ids/side: {r['seconds']:.1f} s, {r['bytes'] / 1e6:.1f} MB, "
                f"intersection {r['size']}",
                flush=True,
            )
    record["load_avg_1m"] = round(os.getloadavg()[0], 2)  # CPU-bound: other load matters
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
