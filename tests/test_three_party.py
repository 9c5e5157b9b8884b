"""The star example of examples/three-party/README.md, run exactly as written there (the shell
block between its markers, only the ports and the folder changed): three organisations align
through the leader and train as three `tandem party` processes over HTTP on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from party_helpers import ROOT
from ports import free_port

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "three-party"
PORTS = ("8621", "8622", "8623", "8721", "8722", "8723")
PARTIES = ("bank", "shop", "telco")


def _commands() -> str:
    text = (EXAMPLE / "README.md").read_text()
    block = re.search(
        r"<!-- three-party:begin -->\s*```bash\n(.*?)```\s*<!-- three-party:end -->", text, re.S
    )
    assert block, "examples/three-party/README.md lost its marked shell block"
    return block.group(1)


def test_three_organisations_in_a_star_from_the_readme(tmp_path):
    folder = tmp_path / "three-party"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("out", "*.csv", "__pycache__"))
    script = _commands()
    assert script.startswith("cd examples/three-party\n")
    script = script.replace("cd examples/three-party", f"cd {folder}", 1)
    for port in PORTS:
        new = str(free_port())
        script = script.replace(port, new)
        for name in PARTIES:
            path = folder / f"{name}.toml"
            path.write_text(path.read_text().replace(port, new))
    prelude = f'set -e\ntandem() {{ "{sys.executable}" -m tandem "$@"; }}\n'
    prelude += f'python() {{ "{sys.executable}" "$@"; }}\n'
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        ["bash", "-c", prelude + script], capture_output=True, text=True, env=env, timeout=150
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    aligned = [x for x in lines if "intersection_size" in x]
    trained = {x["party"]: x for x in lines if "status" in x}
    assert len(aligned) == 3 and set(trained) == set(PARTIES), run.stdout
    assert all(x["status"] == "done" for x in trained.values()), run.stdout
    assert len({x["intersection_commitment"] for x in aligned}) == 1
    lead = trained["bank"]
    assert lead["alignment"]["size"] == aligned[0]["intersection_size"]
    assert {x["spec_hash"] for x in trained.values()} == {lead["spec_hash"]}
    assert set(lead["bytes_sent"]) == {"shop", "telco"}
    for follower in ("shop", "telco"):  # a follower of a star talks to the leader only
        assert set(trained[follower]["bytes_sent"]) == {"bank"}
        assert (folder / "out" / follower / f"{follower}.safetensors").is_file()
    assert lead["test_accuracy"] > 0.7, lead
