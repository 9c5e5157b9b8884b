"""Federated preprocessing: the merge of parties' summaries equals `fit` on the union of their
rows; malformed or mismatched summaries are refused naming the party; and end to end over
HTTP, clients holding a string categorical column and shifted numeric data train one model
under the global statistics, which the export stores (`per_client` warns on stderr)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from fl_process_helpers import SECRET, to_toml
from ports import free_port
from tandem.parties.data import DataError, parse_data_config, read_table
from tandem.parties.data.preprocess import fit
from tandem.parties.data.summary import merge, summarize
from tandem.parties.export.stages import read_description
from tandem.parties.fl.client_process import run_client
from tandem.parties.fl.config import load_client_config, load_server_config
from tandem.parties.fl.server_process import run_server
from tandem.parties.fl.task import Task

CITIES = ["lyon", "oslo", "rome", "kyiv"]


def write_party(path: Path, n: int, shift: float, seed: int, cities: list[str]) -> None:
    """``id, a, b, city, y``: ``a`` shifted by ``shift``, some ``a`` cells missing; the label
    depends on ``a - shift`` and on the city."""
    rng = np.random.default_rng(seed)
    lines = ["id,a,b,city,y"]
    for i in range(n):
        a = rng.normal(shift, 2.0)
        city = cities[int(rng.integers(len(cities)))]
        label = int((a - shift) + (2.0 if city in ("lyon", "rome") else -2.0) > 0)
        cell = "" if i % 11 == 0 else f"{a:.6f}"
        lines.append(f"{path.stem}-{i},{cell},{rng.normal():.6f},{city},{label}")
    path.write_text("\n".join(lines) + "\n")


def data_cfg(path: Path, missing: str = "mean"):
    return parse_data_config(
        {
            "source": str(path),
            "id_column": "id",
            "label_column": "y",
            "categorical": ["city"],
            "missing": missing,
            "scale": "standard",
        }
    )


@pytest.mark.parametrize("missing", ["mean", "zero"])
def test_merged_summaries_equal_fit_on_the_union(tmp_path, missing):
    write_party(tmp_path / "pa.csv", 60, 0.0, 1, CITIES[:2])
    write_party(tmp_path / "pb.csv", 90, 6.0, 2, CITIES)
    union = tmp_path / "pu.csv"
    a, b = (tmp_path / "pa.csv").read_text(), (tmp_path / "pb.csv").read_text()
    union.write_text(a + "".join(b.splitlines(keepends=True)[1:]))
    summaries = {}
    for name in ("pa", "pb"):
        table = read_table(str(tmp_path / f"{name}.csv"))
        summaries[name] = summarize(
            table, data_cfg(tmp_path / f"{name}.csv", missing), np.arange(table.num_rows)
        )
    table = read_table(str(union))
    merged = merge(summaries, data_cfg(union, missing), table)
    fitted = fit(table, data_cfg(union, missing), np.arange(table.num_rows))
    np.testing.assert_allclose(merged.fill, fitted.fill, rtol=1e-12)
    np.testing.assert_allclose(merged.mean, fitted.mean, rtol=1e-12)
    np.testing.assert_allclose(merged.std, fitted.std, rtol=1e-9)
    assert merged.vocabularies == fitted.vocabularies
    assert merged.to_json()["categorical"] == fitted.to_json()["categorical"]
    # a value seen on too few rows over all parties stays out of the vocabulary
    counts = {
        c: sum(r.split(",")[3] == c for r in union.read_text().splitlines()[1:]) for c in CITIES
    }
    rare = sorted(CITIES, key=counts.__getitem__)[0]
    limited = merge(summaries, data_cfg(union, missing), table, min_count=counts[rare] + 1)
    assert rare not in limited.vocabularies[0].values


def test_bad_summaries_are_refused_naming_the_party(tmp_path):
    write_party(tmp_path / "pa.csv", 30, 0.0, 1, CITIES)
    cfg = data_cfg(tmp_path / "pa.csv")
    table = read_table(cfg.source)
    good = summarize(table, cfg, np.arange(table.num_rows))
    with pytest.raises(DataError, match="summary of party 'eve' is malformed"):
        merge({"eve": {**good, "numeric": [{"name": "a"}, {"name": "b"}]}}, cfg, table)
    other = {**good, "numeric": good["numeric"][:1]}
    with pytest.raises(DataError, match="party 'bob' summarised the numeric columns"):
        merge({"bob": other}, cfg, table)
    flipped = {**good, "categorical": [{**good["categorical"][0], "kind": "int"}]}
    with pytest.raises(DataError, match="summary of party 'eve' is malformed|holds int values"):
        merge({"ok": good, "eve": flipped}, cfg, table)


def write_federation(tmp_path: Path, mode: str) -> tuple[Path, list[Path], list[str]]:
    """A server and three clients over HTTP; client ``i`` holds ``a`` shifted by ``4 i``."""
    clients = ["bank_a", "bank_b", "bank_c"]
    for i, c in enumerate(clients):
        write_party(tmp_path / f"{c}.csv", 120, 4.0 * i, 10 + i, CITIES if i else CITIES[:2])
    write_party(tmp_path / "server.csv", 80, 4.0, 20, CITIES)
    port = free_port()
    data = lambda name: {  # noqa: E731
        "source": f"{name}.csv",
        "id_column": "id",
        "label_column": "y",
        "categorical": ["city"],
        "missing": "mean",
        "scale": "standard",
    }
    server = {
        "server": {
            "port": port,
            "clients": clients,
            "rounds": 3,
            "wait": 60.0,
            "round_timeout": 60.0,
            "loss": "binary",
            "export": "out/global.safetensors",
        },
        "preprocessing": {"mode": mode, "min_count": 1},
        "optimizer": {"name": "adam", "learning_rate": 0.05},
        "model": {"kind": "mlp", "hidden": [8], "out_dim": 1},
        "data": data("server"),
        "http": {"secret": SECRET},
    }
    (tmp_path / "server.toml").write_text(to_toml(server))
    paths = []
    for c in clients:
        table = {
            "client": {"name": c, "server": f"http://127.0.0.1:{port}", "port": free_port()},
            "train": {"epochs": 1, "batch_size": 16},
            "optimizer": {"name": "sgd", "learning_rate": 0.1},
            "data": {**data(c), "split": {"test": 0.0}},
            "http": {"secret": SECRET},
        }
        (tmp_path / f"{c}.toml").write_text(to_toml(table))
        paths.append(tmp_path / f"{c}.toml")
    return tmp_path / "server.toml", paths, clients


async def run_federation(server_toml: Path, client_tomls: list[Path]):
    scfg = load_server_config(server_toml)
    ccfgs = [load_client_config(p) for p in client_tomls]
    async with asyncio.timeout(240):
        server = asyncio.create_task(run_server(scfg, fresh=True))
        results = await asyncio.gather(*(run_client(c) for c in ccfgs))
        return await server, results, ccfgs


@pytest.mark.timeout(300)
def test_string_categorical_clients_train_under_global_statistics(tmp_path):
    server_toml, client_tomls, clients = write_federation(tmp_path, "global")
    summary, results, ccfgs = asyncio.run(run_federation(server_toml, client_tomls))
    assert summary["rounds"] == 3 and summary["accuracy"] is not None
    assert all(r["rounds_trained"] == 3 for r in results)
    state = read_description(tmp_path / "out" / "global.safetensors")["data"]["preprocessing"]
    # the statistics of every client's rows together, not of any one client's nor the server's
    values, cities = [], set()
    for c in clients:
        rows = [r.split(",") for r in (tmp_path / f"{c}.csv").read_text().splitlines()[1:]]
        values += [float(r[1]) for r in rows if r[1]]
        cities |= {r[3] for r in rows}
    a = state["numeric"][0]
    assert a["name"] == "a" and a["fill"] == pytest.approx(np.mean(values), rel=1e-9)
    assert a["mean"] == pytest.approx(np.mean(values), rel=1e-9)
    assert state["categorical"] == [
        {"name": "city", "kind": "string", "vocabulary": sorted(cities)}
    ]
    # a shifted client reads its rows under those statistics: its own mean is far from 0
    task = Task.from_meta(
        {
            "model": {"kind": "mlp", "in_dims": [3], "hidden": [8], "out_dim": 1},
            "loss": "binary",
            "init_seed": 0,
            "dim": 0,
            "identity": "x",
            "preprocessing": state,
        }
    )
    _, x, _ = prepare_client_features(ccfgs[2], task)
    assert x[:, 0].mean() > 0.8  # bank_c's ``a`` sits 8 above bank_a's, ~1.4 global stds
    assert set(np.unique(x[:, 2])) <= set(range(1, len(cities) + 1))


def prepare_client_features(cfg, task):
    from tandem.parties.fl.task import load_rows

    return load_rows(cfg.data, loss=task.loss, out=None, state=task.state())


@pytest.mark.timeout(300)
def test_per_client_preprocessing_warns_on_stderr(tmp_path, caplog):
    server_toml, client_tomls, _ = write_federation(tmp_path, "per_client")
    with caplog.at_level(logging.WARNING):
        summary, results, _ = asyncio.run(run_federation(server_toml, client_tomls))
    assert summary["rounds"] == 3
    warned = [r for r in caplog.records if "per-client preprocessing" in r.getMessage()]
    assert len(warned) == 3  # one per client
    assert any('mode = "per_client"' in r.getMessage() for r in caplog.records)
    state = read_description(tmp_path / "out" / "global.safetensors")["data"]["preprocessing"]
    server_rows = [r.split(",") for r in (tmp_path / "server.csv").read_text().splitlines()[1:]]
    own = np.mean([float(r[1]) for r in server_rows if r[1]])
    # the server's own fit (on its split's training rows), as before federated preprocessing
    assert state["numeric"][0]["mean"] == pytest.approx(own, rel=0.05)
