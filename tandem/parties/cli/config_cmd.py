"""``tandem config schema ROLE`` and ``tandem config check F.toml``.

``schema`` prints the JSON Schema of one file kind (for editors: completion and checks of
keys); ``check`` validates a file as its command would, without starting anything: exit 0,
or exit 2 with the located error (``file: section.key what was wrong; the fix``) on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Callable
from typing import Any

from tandem.errors import ConfigError


def _party_model() -> Any:
    from tandem.parties.split.process.config import PartyConfig

    return PartyConfig


def _party_check(path: str) -> None:
    from tandem.parties.split.process.build import load_party_config

    load_party_config(path)


def _fl_server(path: str) -> None:
    from tandem.parties.fl.config import load_server_config

    load_server_config(path)


def _fl_client(path: str) -> None:
    from tandem.parties.fl.config import load_client_config

    load_client_config(path)


#: role -> (the model whose JSON Schema describes the file, or None; the file's checker).
#: ``predict`` reads the party's own TOML (`tandem predict --config`), so shares its schema.
ROLES: dict[str, tuple[Callable[[], Any] | None, Callable[[str], None]]] = {
    "party": (_party_model, _party_check),
    "predict": (_party_model, _party_check),
    "fl-server": (None, _fl_server),
    "fl-client": (None, _fl_client),
}


def schema(role: str) -> dict[str, Any]:
    """The JSON Schema of the files of ``role`` (a key of `ROLES` that has a model)."""
    model = ROLES[role][0]
    if model is None:
        raise ConfigError(
            f"{role!r} files have no schema yet (only a checker: `tandem config check`); "
            f"schemas: {[r for r, (m, _) in ROLES.items() if m is not None]}"
        )
    out = model().model_json_schema(by_alias=True)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = f"tandem {role} TOML"
    return out


def guess_role(path: str) -> str:
    """The role a file's keys say: ``role`` (a party), ``[server]`` or ``[client]`` (FL)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return "party"  # the party's loader words the error
    if "server" in raw:
        return "fl-server"
    if "client" in raw:
        return "fl-client"
    return "party"


async def schema_command(args: argparse.Namespace) -> int:
    try:
        text = json.dumps(schema(args.role), indent=2)
    except ConfigError as exc:
        print(f"tandem config schema: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


async def check_command(args: argparse.Namespace) -> int:
    role = args.role or guess_role(args.file)
    try:
        ROLES[role][1](args.file)
    except (ConfigError, OSError) as exc:
        print(f"tandem config check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"file": args.file, "role": role, "status": "ok"}))
    return 0


def register(sub) -> None:
    p = sub.add_parser("config", help="JSON Schemas of the TOML files; check a file")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    s = verbs.add_parser("schema", help="print the JSON Schema of one file kind")
    s.add_argument("role", choices=[r for r, (m, _) in ROLES.items() if m is not None])
    s.set_defaults(func=schema_command)
    c = verbs.add_parser("check", help="validate a TOML file without starting anything")
    c.add_argument("file", metavar="F.toml")
    c.add_argument("--role", choices=sorted(ROLES), help="the file's kind (default: guessed)")
    c.set_defaults(func=check_command)


__all__ = ["ROLES", "guess_role", "register", "schema"]
