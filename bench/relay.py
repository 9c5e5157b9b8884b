"""The relay process of `bench.wan`: a `tandem.transports.relay.DelayRelay` of its own.

``python -m bench.relay --one-way-ms MS`` reads one JSON route per stdin line (``{"listen":
HOST, "target": [HOST, PORT]}``) and answers with one JSON line ``{"port": P}``; it ends when
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tandem.transports.relay import DelayRelay


async def serve_routes(one_way_s: float, buffer_bytes: int) -> int:
    """Add one route per stdin line (JSON ``{"listen": HOST, "target": [HOST, PORT]}``),
    answering ``{"port": P}`` on stdout; return when stdin closes."""
    async with DelayRelay(one_way_s, buffer_bytes=buffer_bytes) as relay:
        while line := await asyncio.to_thread(sys.stdin.readline):
            req = json.loads(line)
            host, port = req["target"]
            got = await relay.route(str(req["listen"]), (str(host), int(port)))
            print(json.dumps({"port": got}), flush=True)
        await relay.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n")[0])
    p.add_argument("--one-way-ms", type=float, required=True, help="delay of each direction")
    p.add_argument(
        "--buffer-bytes",
        type=int,
        default=1 << 22,
        help="most bytes held per connection and direction (4 MiB)",
    )
    args = p.parse_args(argv)
    if not args.one_way_ms >= 0 or args.buffer_bytes < 1:
        raise SystemExit("--one-way-ms must be >= 0 and --buffer-bytes >= 1")
    coro = serve_routes(args.one_way_ms / 1e3, args.buffer_bytes)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platform without uvloop
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    raise SystemExit(main())
