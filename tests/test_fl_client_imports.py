"""What a federated client's process loads to start: ``tandem fl client`` imports only the
``fl`` command's module, and the client's modules (the command, its configuration, the HTTP
transport, the data summary) none of the heavy modules it never uses. Each check runs in a
fresh interpreter, since ``sys.modules`` of the test process holds everything."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

from tandem.parties.cli.commands import COMMAND_MODULES, COMMANDS, build_parser, command_modules

#: Loaded by nothing an FL client runs: other systems, the FL server and simulator, and
#: libraries of the demo, the progress bars, the extras and the other model adapters.
NOT_FOR_A_CLIENT = (
    "tandem.parties.split",
    "tandem.parties.elastic",
    "tandem.parties.alignment",
    "tandem.parties.privacy",
    "tandem.parties.fl.server",
    "tandem.parties.fl.server_process",
    "tandem.parties.fl.aggregate",
    "tandem.parties.fl.simulate.run",
    "tandem.parties.fl.federation",
    "tandem.parties.fl.data",
    "sklearn",
    "scipy",
    "pandas",
    "rich",
    "ray",
    "flax",
    "equinox",
    "tensorboardX",
    "matplotlib",
    "dp_accounting",
)

CLIENT_START = """
import json, sys
from tandem.parties.cli.commands import build_parser
build_parser(["fl", "client", "--config", "client.toml"])
import tandem.parties.fl.client_process, tandem.parties.fl.config, tandem.parties.fl.startup
import tandem.transports.factory, tandem.transports.http, tandem.parties.data.summary
print(json.dumps(sorted(sys.modules)))
"""


def loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout))


def heavy(modules: set[str]) -> list[str]:
    return sorted(
        m for m in modules if any(m == h or m.startswith(f"{h}.") for h in NOT_FOR_A_CLIENT)
    )


def test_a_client_loads_nothing_it_does_not_use():
    modules = loaded(CLIENT_START)
    assert heavy(modules) == []
    assert {"jax", "optax", "aiohttp"} <= modules  # what it does use: the check is live


def test_the_command_line_of_a_client_loads_only_the_fl_command():
    modules = loaded(
        "import json, sys\n"
        "from tandem.parties.cli.commands import build_parser\n"
        "build_parser(['fl', 'client', '--config', 'c.toml'])\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    assert "tandem.parties.fl.cli" in modules
    assert heavy(modules) == [] and "jax" not in modules


def test_the_command_table_names_what_each_module_registers():
    registered = {}
    for name in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert registered == COMMANDS


def test_without_a_command_every_command_is_registered():
    assert command_modules([]) == COMMAND_MODULES
    assert command_modules(["--help"]) == COMMAND_MODULES
    assert command_modules(["no-such-command"]) == COMMAND_MODULES
    assert command_modules(["-v", "fl", "client"]) == ["tandem.parties.fl.cli"]
    parser = build_parser(["no-such-command"])
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(choices.choices) == set(COMMANDS)
