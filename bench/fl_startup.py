"""Start-up of a federation as processes: launch to the end of round one, and client peak RSS.

The work of issue 43's comparison with Flower: scikit-learn digits, 10 clients by Dirichlet
0.5, an MLP 64-1024-1000-10 (1,101,570 parameters), FedAvg (server SGD, learning rate 1),
dense, one local epoch. `first_round` writes the CSVs and TOML files into a folder, starts
``python -m tandem fl server`` and 10 ``python -m tandem fl client`` processes at once, and
returns the seconds from that launch until the server prints its round-one line, and the
largest peak resident set size of the clients (``ru_maxrss`` of each process, from
``os.wait4``), and the CPU seconds (user + system) each client used, from launch to exit (with
one round, that is its start-up plus one local epoch): a figure that, unlike the wall time,
barely moves with the load of a shared machine. Each run uses the compilation cache folder
given (`tandem.parties.fl.startup`): the first run on a fresh folder compiles (``cold``), the
next finds the executables (``warm``, what a machine that has run a federation before sees).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = [1024, 1000]
CLIENTS = [f"client_{i}" for i in range(10)]


def _value(v: Any) -> str:
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _toml(table: dict[str, Any]) -> str:
    lines = []
    for name, section in table.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in section.items()]
    return "\n".join(lines) + "\n"


def write_federation(folder: Path, cache: str) -> None:
    from tandem.parties.fl.data import write_digits_csvs
    from tandem.transports.ports import free_ports

    write_digits_csvs(folder / "data", CLIENTS, alpha=0.5, seed=0)
    ports = free_ports(len(CLIENTS) + 1)
    data = lambda n: {"source": f"data/{n}.csv", "id_column": "id", "label_column": "digit"}  # noqa: E731
    server = {
        "server": {
            "port": ports[0],
            "clients": CLIENTS,
            "rounds": 1,
            "eval_every": 1,
            "wait": 120.0,
            "compile_cache": cache,
        },
        "optimizer": {"name": "sgd", "learning_rate": 1.0},
        "compression": {"preset": "dense"},
        "model": {"kind": "mlp", "hidden": HIDDEN, "out_dim": 10},
        "data": {**data("server"), "scale": "none"},
        "http": {"secret": "bench-secret"},
    }
    (folder / "server.toml").write_text(_toml(server))
    for c, port in zip(CLIENTS, ports[1:], strict=True):
        client = {
            "client": {
                "name": c,
                "server": f"http://127.0.0.1:{ports[0]}",
                "port": port,
                "compile_cache": cache,
            },
            "train": {"epochs": 1, "batch_size": 32},
            "optimizer": {"name": "sgd", "learning_rate": 0.1},
            "data": {**data(c), "scale": "none", "split": {"test": 0.0}},
            "http": {"secret": "bench-secret"},
        }
        (folder / f"{c}.toml").write_text(_toml(client))


def first_round(folder: Path, cache: str, timeout: float = 300.0) -> dict[str, float]:
    """``{first_round_s, client_peak_rss_mb, client_cpu_s, client_cpu_max_s, accuracy}`` of
    one launch (module docstring): ``client_cpu_s`` is the clients' mean CPU seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    write_federation(folder, cache)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = {}
    start = time.monotonic()
    for name in ["server", *CLIENTS]:
        role = "server" if name == "server" else "client"
        err = open(folder / f"{name}.err", "wb")  # noqa: SIM115 (closed below)
        procs[name] = (
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem",
                    "fl",
                    role,
                    "--config",
                    str(folder / f"{name}.toml"),
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE if name == "server" else subprocess.DEVNULL,
                stderr=err,
                env=env,
            ),
            err,
        )
    done = None
    while done is None and time.monotonic() - start < timeout:
        text = (folder / "server.err").read_text(errors="replace")
        if re.search(r"^round 1/1", text, re.M):
            done = time.monotonic() - start
        else:
            time.sleep(0.02)
    if done is None:
        for p, _ in procs.values():
            p.kill()
    rss, cpu = [], []
    for name, (p, err) in procs.items():
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must know it
        err.close()
        if name != "server":
            rss.append(usage.ru_maxrss / 1024)  # KiB on Linux
            cpu.append(usage.ru_utime + usage.ru_stime)
        elif status != 0 and done is not None:
            raise RuntimeError(f"server failed: {(folder / 'server.err').read_text()[-2000:]}")
    if done is None:
        raise RuntimeError(f"no round one within {timeout} s; see {folder}")
    summary = json.loads(procs["server"][0].stdout.read().decode().strip().splitlines()[-1])
    procs["server"][0].stdout.close()
    return {
        "first_round_s": round(done, 2),
        "client_peak_rss_mb": round(max(rss), 1),
        "client_cpu_s": round(sum(cpu) / len(cpu), 2),
        "client_cpu_max_s": round(max(cpu), 2),
        "accuracy": summary["accuracy"],
    }


def startup(folder: Path) -> dict[str, Any]:
    """A cold run (fresh cache folder) then a warm one (the same folder)."""
    cache = str(folder / "jax-cache")
    cold = first_round(folder / "cold", cache)
    warm = first_round(folder / "warm", cache)
    return {
        "first_round_s": warm["first_round_s"],
        "client_peak_rss_mb": warm["client_peak_rss_mb"],
        "client_cpu_s": warm["client_cpu_s"],
        "client_cpu_max_s": warm["client_cpu_max_s"],
        "first_round_cold_s": cold["first_round_s"],
        "client_peak_rss_cold_mb": cold["client_peak_rss_mb"],
        "client_cpu_cold_s": cold["client_cpu_s"],
        "first_round_accuracy": warm["accuracy"],
        "startup_params": 1_101_570,
    }


__all__ = ["first_round", "startup", "write_federation"]
