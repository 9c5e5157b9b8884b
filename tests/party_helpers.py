"""Helpers for tests of `tandem party`: tiny two-party jobs as real OS processes on loopback.

`Job` writes the data (npz), the aligned-rows CSVs and both TOML configs into a folder, with
free ports; `Job.start(role)` launches ``python -m tandem.parties.cli party --config ...`` with its
stdout/stderr in files; `Proc.finish` waits (bounded) and parses the JSON line. `Job.run_all`
runs both parties in this process instead, for a test about what they do rather than about
their processes. Nothing here
sleeps for a fixed time: `wait_until` polls a condition with a bounded deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
ROWS, TEST_ROWS, F_LEADER, F_FOLLOWER = 64, 24, 4, 3


def wait_until(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.02) -> Any:
    """Poll ``cond()`` until truthy (returned); AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def toml(table: dict[str, Any]) -> str:
    """A TOML document from a dict of scalars/lists and one level of sub-tables."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    top = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    subs = [
        f"\n[{k}]\n" + "\n".join(f"{sk} = {value(sv)}" for sk, sv in v.items())
        for k, v in table.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top) + "\n" + "\n".join(subs) + "\n"


def write_data(folder: Path, seed: int = 0) -> None:
    """Leader: 4 feature columns + labels; follower: 3 columns, its rows stored in *reverse*
    order, so only the aligned-rows CSVs (ids ``c<i>``) line the two up."""
    rng = np.random.default_rng(seed)
    n = ROWS + TEST_ROWS
    xl = rng.normal(size=(n, F_LEADER)).astype("f4")
    xf = rng.normal(size=(n, F_FOLLOWER)).astype("f4")
    y = (xl[:, 0] + xf[:, 0] > 0).astype("f4")
    np.savez(
        folder / "leader.npz",
        x_train=xl[:ROWS],
        y_train=y[:ROWS],
        x_test=xl[ROWS:],
        y_test=y[ROWS:],
    )
    np.savez(folder / "follower.npz", x_train=xf[:ROWS][::-1], x_test=xf[ROWS:])
    write_aligned(folder / "leader_aligned.csv", [(i, f"c{i}") for i in range(ROWS)])
    write_aligned(folder / "follower_aligned.csv", [(ROWS - 1 - i, f"c{i}") for i in range(ROWS)])


def write_aligned(path: Path, pairs) -> None:
    """A `tandem align --out` CSV, in the agreed (canonical) id order."""
    from tandem.parties.alignment.ecdh import canonical

    pairs = sorted(pairs, key=lambda p: canonical(p[1]))
    path.write_text("row,id\n" + "".join(f"{r},{i}\n" for r, i in pairs))


@dataclasses.dataclass
class Proc:
    popen: subprocess.Popen
    out: Path
    err: Path

    def finish(self, timeout: float = 90.0) -> tuple[int, dict | None, str]:
        """(exit code, parsed JSON line or None, stderr text); kills it after ``timeout``."""
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(
                f"party did not exit within {timeout} s; stderr:\n{self.err.read_text()[-3000:]}"
            ) from None
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        return rc, (json.loads(lines[-1]) if lines else None), self.err.read_text()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)


class Job:
    """Two party configs (leader, follower) in ``folder``; tweak ``cfg[role]`` before
    `write`/`start`."""

    def __init__(self, folder: Path, *, epochs: int = 4, every: int = 2) -> None:
        self.folder = folder
        #: extra command-line arguments of each role's ``tandem party``
        self.args: dict[str, list[str]] = {"leader": [], "follower": []}
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "leader.npz").exists():
            write_data(folder)
        ports = {"leader": free_port(), "follower": free_port()}
        self.ports = ports
        common = lambda role: {  # noqa: E731
            "role": role,
            "name": role,
            "export_dir": f"out/{role}",
            "progress": False,
            "wait": 60.0,
            "grace": 10.0,
            "listen": {"host": "127.0.0.1", "port": ports[role]},
            "security": {"secret": "s3cret", "retry_timeout": 10.0},
            "model": {"topology": "leader_follower", "cut": 4, "hidden": [8], "out": 1},
            "checkpoint": {"dir": f"ckpt/{role}", "every": every, "keep": 2},
        }
        self.cfg = {
            "leader": {
                **common("leader"),
                "peers": {"follower": self.url("follower")},
                "data": {"source": "leader.npz", "aligned": "leader_aligned.csv"},
                "schema": {"follower": F_FOLLOWER},
                "train": {
                    "batch_size": 16,
                    "epochs": epochs,
                    "groups": 2,
                    "learning_rate": 0.01,
                    "seed": 3,
                },
            },
            "follower": {
                **common("follower"),
                "peers": {"leader": self.url("leader")},
                "data": {"source": "follower.npz", "aligned": "follower_aligned.csv"},
            },
        }

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def path(self, role: str) -> Path:
        return self.folder / f"{role}.toml"

    def write(self) -> None:
        for role, table in self.cfg.items():
            self.path(role).write_text(toml(table))

    def start(
        self, role: str, tag: str = "", *, nofile: int | None = None, compile_cache: bool = True
    ) -> Proc:
        """Launch ``role``'s party; ``nofile``: its ``RLIMIT_NOFILE`` soft limit;
        ``compile_cache=False``: without the session's JAX compilation cache
        (tests/conftest.py), for a test that needs the run to last as long as it does with
        its compilations."""
        if not compile_cache:  # nor the party's own cache ([checkpoint] compile_cache)
            self.cfg[role].setdefault("checkpoint", {})["compile_cache"] = False
        self.write()
        out = self.folder / f"{role}{tag}.out"
        err = self.folder / f"{role}{tag}.err"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        if not compile_cache:
            env.pop("JAX_COMPILATION_CACHE_DIR", None)

        command = [
            sys.executable,
            "-m",
            "tandem",
            "party",
            "--config",
            str(self.path(role)),
            *self.args[role],
        ]
        if nofile is not None:  # (a shell sets it: no fork of this multithreaded process)
            command = ["/bin/sh", "-c", f'ulimit -n {int(nofile)} && exec "$0" "$@"', *command]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(command, cwd=ROOT, stdout=fo, stderr=fe, env=env)
        return Proc(popen, out, err)

    def run_both(self, tag: str = "", timeout: float = 90.0):
        """Start both, wait for both; returns ``{role: (rc, json, stderr)}``."""
        procs = {r: self.start(r, tag) for r in ("follower", "leader")}
        return {r: p.finish(timeout) for r, p in procs.items()}

    async def run_all(self) -> dict[str, Any]:
        """Both parties' `run_party` (what ``tandem party`` runs) in this process, in one
        TaskGroup, over HTTP on loopback; ``{role: result (the JSON line's object)}``. Either
        party raising fails the call (an `ExceptionGroup`), the other cancelled."""
        from tandem.parties.split.process.party_config import load_party_config
        from tandem.parties.split.process.standalone import run_party

        self.write()
        cfgs = {r: load_party_config(self.path(r)) for r in ("follower", "leader")}
        async with asyncio.TaskGroup() as tg:
            tasks = {r: tg.create_task(run_party(cfg)) for r, cfg in cfgs.items()}
        return {r: t.result() for r, t in tasks.items()}

    def checkpoints(self, role: str) -> list[int]:
        folder = self.folder / "ckpt" / role
        if not folder.is_dir():
            return []
        return sorted(
            int(n[5:14])
            for n in os.listdir(folder)
            if n.startswith("step-") and n.endswith(".safetensors")
        )

    def exported(self, role: str) -> dict[str, np.ndarray]:
        """The exported tensors of ``role`` by name."""
        from tandem.parties.export import load_stages

        loaded = load_stages(self.folder / "out" / role / f"{role}.safetensors")
        out: dict[str, np.ndarray] = {}

        def walk(node, prefix):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{prefix}/{k}")
            elif isinstance(node, (list, tuple)):
                for i, v in enumerate(node):
                    walk(v, f"{prefix}/{i}")
            else:
                out[prefix] = np.asarray(node)

        walk(loaded.stages, "")
        return out


async def run_commands(argvs: dict[str, list[str]]) -> dict[str, int]:
    """Each ``tandem`` command line of ``argvs`` (``{name: argv}``) parsed by the CLI's own
    parser and its command run (the ``func`` that ``tandem`` runs on its event loop) in this
    process, all at once in one TaskGroup; ``{name: exit code}``. Their JSON lines go to this
    process's stdout, their errors to its stderr."""
    from tandem.parties.cli import build_parser

    parsed = {name: build_parser(argv).parse_args(argv) for name, argv in argvs.items()}
    async with asyncio.TaskGroup() as tg:
        tasks = {name: tg.create_task(args.func(args)) for name, args in parsed.items()}
    return {name: task.result() for name, task in tasks.items()}


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False


def incarnation(url: str, name: str, caller: str, secret: bytes = b"s3cret") -> str:
    """The incarnation the party ``name`` at ``url`` names to its peer ``caller`` (a signed
    ``GET /healthz``): what requests to it must be signed for."""
    from tandem.transports import auth

    headers = {"X-Tandem-Sender": caller}
    auth.sign(secret, "GET", "/healthz", headers, auth.EMPTY_SHA, receiver=name)
    request = urllib.request.Request(url + "/healthz", headers=headers)
    with urllib.request.urlopen(request, timeout=5.0) as r:
        return json.loads(r.read())["incarnation"]


def metrics(url: str, name: str, caller: str, secret: bytes = b"s3cret") -> str:
    """``GET /metrics`` of party ``name`` at ``url``, signed as its peer ``caller`` (the
    metrics answer only a caller that proves a peer's identity, or holds the token)."""
    from tandem.transports import auth

    headers = {"X-Tandem-Sender": caller}
    auth.sign(secret, "GET", "/metrics", headers, auth.EMPTY_SHA, receiver=name)
    request = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=5.0) as r:
        return r.read().decode()
