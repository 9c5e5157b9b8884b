"""Helpers for tests of `tandem party` / `tandem predict` on `[data]` tables.

`write_tables` writes one CSV per party (a string id column, the rows shuffled per party, the
leader's with labels); `TableJob` writes a TOML per party (leader + followers, free ports) and
runs them in this process (`run_all`, every party's `run_party` in one TaskGroup over HTTP on
loopback) or as OS processes (`start`). `toml` writes nested tables ([data.split]).
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from party_helpers import ROOT, Proc
from ports import free_port


def toml(table: dict[str, Any], prefix: str = "") -> str:
    """A TOML document from nested dicts of scalars and lists (inline tables for dicts inside
    lists are not needed here)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + "\n"
    for k, v in table.items():
        if isinstance(v, dict) and not v.get("__inline__"):
            name = f"{prefix}{k}"
            out += f"\n[{name}]\n" + toml(v, prefix=f"{name}.")
    return out


def write_tables(
    folder: Path,
    parties: list[str],
    *,
    n: int = 240,
    seed: int = 0,
    drop: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """One CSV per party (``<name>.csv``): ``cid`` (string ids ``c0000``...), two numeric
    columns each, a categorical ``city`` on the second party, labels (``label``, 0/1 from
    every party's columns) on the first (the leader); each file's rows in its own order.
    ``drop[name]`` lists sample indices that party does not hold. Returns the samples."""
    rng = np.random.default_rng(seed)
    ids = np.array([f"c{i:04d}" for i in range(n)])
    x = {p: rng.normal(size=(n, 2)) for p in parties}
    city = rng.choice(["oslo", "paris", "rome"], n)
    score = sum(x[p][:, 0] for p in parties) + (city == "rome") - 0.3
    y = (score > 0).astype(int)
    for j, p in enumerate(parties):
        keep = np.setdiff1d(np.arange(n), (drop or {}).get(p, []))
        order = rng.permutation(keep)
        with open(folder / f"{p}.csv", "w", newline="") as f:
            w = csv.writer(f)
            header = ["cid", f"{p}_a", f"{p}_b"] + (["city"] if j == 1 else [])
            w.writerow(header + (["label"] if j == 0 else []))
            for i in order:
                row = [ids[i], repr(float(x[p][i, 0])), repr(float(x[p][i, 1]))]
                row += [city[i]] if j == 1 else []
                w.writerow(row + ([int(y[i])] if j == 0 else []))
    return {"ids": ids, "x": x, "city": city, "y": y}


class TableJob:
    """A leader (``parties[0]``) and followers on `write_tables` data; ``cfg[name]`` is the
    TOML table of each party, to tweak before `write`."""

    def __init__(
        self,
        folder: Path,
        parties: list[str],
        *,
        epochs: int = 2,
        topology: dict[str, Any] | None = None,
        data: bool = True,
        drop: dict[str, list[int]] | None = None,
        n: int = 240,
    ) -> None:
        self.folder, self.parties = folder, parties
        folder.mkdir(parents=True, exist_ok=True)
        if data:
            self.samples = write_tables(folder, parties, drop=drop, n=n)
        self.ports = {p: free_port() for p in parties}
        leader = parties[0]
        if topology is None:
            topology = {"kind": "leader_follower", "leader": leader, "follower": parties[1]}
        self.cfg: dict[str, dict[str, Any]] = {}
        for j, p in enumerate(parties):
            peers = [q for q in parties if q != p] if j == 0 else [leader]
            table: dict[str, Any] = {
                "role": "leader" if j == 0 else "follower",
                "name": p,
                "export_dir": f"out/{p}",
                "progress": False,
                "wait": 60.0,
                "listen": {"host": "127.0.0.1", "port": self.ports[p]},
                "peers": {q: self.url(q) for q in peers},
                "security": {"secret": "s3cret"},
                "topology": dict(topology),
                "model": {"cut": 4, "hidden": [8]},
                "checkpoint": {"dir": f"ckpt/{p}", "every": 4, "keep": 2},
                "data": {
                    "source": f"{p}.csv",
                    "id_column": "cid",
                    **({"label_column": "label"} if j == 0 else {}),
                    **({"categorical": ["city"]} if j == 1 else {}),
                    "split": {"test": 0.25, "seed": 7},
                },
            }
            if j == 0:
                table["train"] = {
                    "batch_size": 32,
                    "epochs": epochs,
                    "groups": 2,
                    "learning_rate": 0.02,
                    "seed": 1,
                }
            self.cfg[p] = table

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.toml"

    def write(self) -> None:
        for name, table in self.cfg.items():
            self.path(name).write_text(toml(table))

    async def run_all(self, *, fresh: bool = False) -> dict[str, Any]:
        """Every party's `run_party` in this process; ``{name: result or exception}``."""
        from tandem.parties.split.process.party_config import load_party_config
        from tandem.parties.split.process.standalone import run_party

        self.write()

        async def one(name: str) -> Any:
            try:
                cfg = await asyncio.to_thread(load_party_config, self.path(name))
                return await run_party(cfg, fresh=fresh)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                return exc

        async with asyncio.TaskGroup() as tg:
            tasks = {p: tg.create_task(one(p)) for p in self.parties}
        return {p: t.result() for p, t in tasks.items()}

    def start(self, name: str, *args: str, tag: str = "") -> Proc:
        """``tandem party --config <name>.toml`` as an OS process."""
        self.write()
        return self.launch(["party", "--config", str(self.path(name)), *args], f"{name}{tag}")

    def launch(self, argv: list[str], tag: str) -> Proc:
        out, err = self.folder / f"{tag}.out", self.folder / f"{tag}.err"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(
                [sys.executable, "-m", "tandem", *argv], cwd=ROOT, stdout=fo, stderr=fe, env=env
            )
        return Proc(popen, out, err)
