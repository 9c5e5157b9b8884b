"""Compare the curve work of the two candidate PSI backends on one core (why X25519 was chosen).

    python -m bench.psi_backends --json [--n 100000]

Both do the same work for two sets of n ids with 50% overlap, in one process, no network:
each set hashed to the curve and blinded once, the other party's blinded set blinded again
(4n scalar multiplications in all), then the intersection found.

* ``x25519``: this package's `tandem.parties.alignment.ecdh` (cryptography's X25519 +
  hash-to-curve).
* ``openmined_psi``: ``openmined-psi`` (P-256, C++), client/server API: server setup (n),
  client request (n), server response (n), client intersection (n). Measured only when the
  package is importable (it is not a Tandem dependency: ``pip install openmined-psi``).

Prints one JSON line: seconds per backend (null when unavailable).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run_x25519(a: list[str], b: list[str]) -> tuple[float, int]:
    from tandem.parties.alignment import ecdh

    t0 = time.perf_counter()
    ka, kb = [x.encode() for x in a], [x.encode() for x in b]
    sa, sb = os.urandom(32), os.urandom(32)
    ma, mb = ecdh.hash_and_blind(sa, ka), ecdh.hash_and_blind(sb, kb)
    da, db = ecdh.blind_points(sb, ma, 16), ecdh.blind_points(sa, mb, 16)
    hits = ecdh.match(da, db, 16)
    return time.perf_counter() - t0, len(hits)


def run_openmined(a: list[str], b: list[str]) -> tuple[float, int] | None:
    try:
        import private_set_intersection.python as psi
    except ImportError:
        return None
    t0 = time.perf_counter()
    client = psi.client.CreateWithNewKey(True)
    server = psi.server.CreateWithNewKey(True)
    setup = server.CreateSetupMessage(0.0, len(a), b, psi.DataStructure.RAW)
    request = client.CreateRequest(a)
    response = server.ProcessRequest(request)
    hits = client.GetIntersection(setup, response)
    return time.perf_counter() - t0, len(hits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.psi_backends")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n = args.n
    a = [f"id{i}" for i in range(n)]
    b = [f"id{i}" for i in range(n // 2, n + n // 2)]
    record: dict = {"bench": "psi_backends", "n": n, "cores": 1}
    for name, fn in (("x25519", run_x25519), ("openmined_psi", run_openmined)):
        out = fn(a, b)
        if out is not None and out[1] != n // 2:
            raise SystemExit(f"{name} found {out[1]} common ids, expected {n // 2}")
        record[f"seconds_{name}"] = None if out is None else round(out[0], 2)
        if not args.json:
            print(f"{name}: {'not installed' if out is None else f'{out[0]:.1f} s'}", flush=True)
    record["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
