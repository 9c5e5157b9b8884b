"""A federation written to a folder: the digits CSVs of 4 clients and a held-out set, the
server's and clients' TOML files (free ports, a shared secret), and a way to start each party
as ``python -m tandem fl server|client --config ...`` with its stdout and stderr in files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from party_helpers import ROOT, Proc
from ports import free_port
from tandem.parties.fl.data import write_digits_csvs

CLIENTS = ("bank_a", "bank_b", "bank_c", "bank_d")
SECRET = "fl-test-secret"


def to_toml(table: dict[str, Any], prefix: str = "") -> str:
    """A TOML document from nested dicts of scalars and lists."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            name = f"{prefix}{k}"
            lines.append(f"\n[{name}]")
            lines.append(to_toml(v, prefix=name + ".").rstrip("\n"))
    return "\n".join(lines) + "\n"


class Federation:
    """Configs in ``folder``; edit ``server``/``clients`` before `write`."""

    def __init__(self, folder: Path, *, rounds: int = 12) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        write_digits_csvs(folder / "data", CLIENTS, alpha=100.0, seed=0)
        self.port = free_port()
        data = lambda name: {  # noqa: E731
            "source": f"data/{name}.csv",
            "id_column": "id",
            "label_column": "digit",
            "scale": "none",
        }
        http = {"secret": SECRET, "retry_timeout": 60.0}
        self.server: dict[str, Any] = {
            "server": {
                "name": "server",
                "port": self.port,
                "clients": list(CLIENTS),
                "rounds": rounds,
                "round_timeout": 60.0,
                "wait": 60.0,
                "seed": 0,
                "eval_every": 0,
                "checkpoint": "state/server.ckpt",
                "export": "out/global.safetensors",
            },
            "optimizer": {"name": "sgd", "learning_rate": 1.0, "momentum": 0.5},  # FedAvgM
            "compression": {"preset": "dense", "downlink": "version"},
            "model": {"kind": "mlp", "hidden": [16], "out_dim": 10},
            "data": data("server"),
            "http": http,
        }
        self.clients: dict[str, dict[str, Any]] = {
            c: {
                "client": {
                    "name": c,
                    "server": f"http://127.0.0.1:{self.port}",
                    "port": free_port(),
                    "reconnect_timeout": 60.0,
                },
                "train": {"epochs": 1, "batch_size": 16},
                "optimizer": {"name": "sgd", "learning_rate": 0.1},
                "data": {**data(c), "split": {"test": 0.0}},
                "http": {**http, "peer_timeout": 20.0},
            }
            for c in CLIENTS
        }

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.toml"

    def write(self) -> None:
        self.path("server").write_text(to_toml(self.server))
        for c, table in self.clients.items():
            self.path(c).write_text(to_toml(table))

    def start(self, name: str, tag: str = "", *extra: str) -> Proc:
        role = "server" if name == "server" else "client"
        out, err = self.folder / f"{name}{tag}.out", self.folder / f"{name}{tag}.err"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem",
                    "fl",
                    role,
                    "--config",
                    str(self.path(name)),
                    *extra,
                ],
                cwd=ROOT,
                stdout=fo,
                stderr=fe,
                env=env,
            )
        return Proc(popen, out, err)


def compression_server(tmp_path: Path, compression: dict[str, Any]):
    """A small server TOML whose ``[compression]`` table is ``compression``, loaded
    (`load_server_config`)."""
    from tandem.parties.fl.config import load_server_config

    table = {
        "server": {"clients": ["a", "b"], "rounds": 3},
        "model": {"kind": "mlp", "hidden": [8], "out_dim": 2},
        "data": {"source": "eval.csv", "label_column": "y"},
        "http": {"secret": "s"},
        "compression": compression,
    }
    path = tmp_path / "server.toml"
    path.write_text(to_toml(table))
    return load_server_config(path)
