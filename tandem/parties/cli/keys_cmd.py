"""``tandem keys generate NAME``: a party's Ed25519 key pair for per-party request signing
(`tandem.transports.keys`). Writes ``NAME.key`` (0600, never overwritten) and ``NAME.pub``
into ``--out`` (default: the current folder); prints one JSON line naming both files. The
private key stays with its party; the public key goes into every party's
``[security.public_keys]`` roster (docs/security.md)."""

from __future__ import annotations

import argparse
import json
import sys

from tandem.errors import ConfigError


async def generate_command(args: argparse.Namespace) -> int:
    from tandem._extras import needs

    try:
        with needs("keys", "tandem keys generate"):
            from tandem.transports.keys import SigningKey, generate
        key, pub = generate(args.name, args.out)
    except (ConfigError, OSError) as exc:
        print(f"tandem keys generate: {exc}", file=sys.stderr)
        return 2
    key_id = SigningKey.from_file(key).key_id
    print(
        json.dumps(
            {"name": args.name, "private_key": str(key), "public_key": str(pub), "key_id": key_id}
        )
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser("keys", help="per-party signing keys (Ed25519)")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    g = verbs.add_parser("generate", help="write NAME.key (0600) and NAME.pub")
    g.add_argument("name", metavar="NAME", help="the party's name (the files' stem)")
    g.add_argument("--out", default=".", help="folder to write into (default: .)")
    g.set_defaults(func=generate_command)


__all__ = ["register"]
