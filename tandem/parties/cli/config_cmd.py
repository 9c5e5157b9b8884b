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


def _fl_model(kind: str) -> Callable[[], Any]:
    def model() -> Any:
        from tandem.parties.fl.config import ClientFile, ServerFile

        return ServerFile if kind == "server" else ClientFile

    return model


def _fl_check(kind: str) -> Callable[[str], None]:
    def check(path: str) -> None:
        from tandem.parties.fl.config import load_client_config, load_server_config

        (load_server_config if kind == "server" else load_client_config)(path)

    return check


def _elastic_model(role: str) -> Callable[[], Any]:
    def model() -> Any:
        from tandem.parties.elastic.config import ROLE_FILES

        return ROLE_FILES[role]

    return model


def _elastic_check(role: str) -> Callable[[str], None]:
    def check(path: str) -> None:
        from tandem.parties.elastic.config import ROLE_FILES, load_role

        load_role(ROLE_FILES[role], path)

    return check


#: role -> (the model whose JSON Schema describes the file; the file's checker).
#: ``predict`` reads the party's own TOML (`tandem predict --config`), so shares its schema.
#: `tandem align` takes flags, not a file (docs/alignment.md).
ROLES: dict[str, tuple[Callable[[], Any], Callable[[str], None]]] = {
    "party": (_party_model, _party_check),
    "predict": (_party_model, _party_check),
    "fl-server": (_fl_model("server"), _fl_check("server")),
    "fl-client": (_fl_model("client"), _fl_check("client")),
    **{
        role: (_elastic_model(role), _elastic_check(role))
        for role in ("elastic-coordinator", "elastic-data-server", "elastic-worker")
    },
}


def schema(role: str) -> dict[str, Any]:
    """The JSON Schema of the files of ``role`` (a key of `ROLES`)."""
    out = ROLES[role][0]().model_json_schema(by_alias=True)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = f"tandem {role} TOML"
    return out


def guess_role(path: str) -> str:
    """The role a file's keys say: ``role`` (a party), ``[server]`` or ``[client]`` (FL),
    ``[data_servers]`` (an elastic coordinator), ``coordinator`` with a shard (``shard``,
    ``[data]`` or ``model``: an elastic data server) or without (an elastic worker)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return "party"  # the party's loader words the error
    if "role" in raw:
        return "party"
    if "server" in raw:
        return "fl-server"
    if "client" in raw:
        return "fl-client"
    if "data_servers" in raw:
        return "elastic-coordinator"
    if "coordinator" in raw:
        shard = any(k in raw for k in ("shard", "data", "model"))
        return "elastic-data-server" if shard else "elastic-worker"
    return "party"


async def schema_command(args: argparse.Namespace) -> int:
    print(json.dumps(schema(args.role), indent=2))
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
    s.add_argument("role", choices=list(ROLES))
    s.set_defaults(func=schema_command)
    c = verbs.add_parser("check", help="validate a TOML file without starting anything")
    c.add_argument("file", metavar="F.toml")
    c.add_argument("--role", choices=sorted(ROLES), help="the file's kind (default: guessed)")
    c.set_defaults(func=check_command)


__all__ = ["ROLES", "guess_role", "register", "schema"]
