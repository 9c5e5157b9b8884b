"""The process entry point, `tandem.parties.cli.entry` (the ``tandem`` script and
``python -m tandem``): `main`, then the heap frozen (`gc.freeze`) so that the interpreter's
exit skips its full garbage collection; `main` itself, which tests and applications call in
a running process, freezes nothing."""

from __future__ import annotations

import gc
import subprocess
import sys
import tomllib

from party_helpers import ROOT
from tandem.parties.cli import main


def test_python_dash_m_tandem_exits_through_the_entry_point_with_the_heap_frozen():
    probe = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
        "sys.argv = ['tandem', 'config', 'schema', 'party']\n"
        "runpy.run_module('tandem', run_name='__main__', alter_sys=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("{")  # the command ran: the schema on stdout
    (count,) = [int(x.split()[1]) for x in run.stderr.splitlines() if x.startswith("frozen ")]
    assert count > 1000, run.stderr[-2000:]


def test_the_script_is_the_entry_point_and_main_freezes_nothing(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tandem"] == "tandem.parties.cli:entry"
    before = gc.get_freeze_count()
    assert main(["config", "schema", "party"]) == 0
    assert gc.get_freeze_count() == before
