"""Elastic training on the user's own data and model: the ``[data]``/``[model]``/``[train]``
tables of the shared contract, and the trained model exported in split learning's format,
rebuilt by `tandem.parties.export.model.load_model` and used on new rows with the saved
preprocessing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from ports import free_ports
from tandem.parties.data import Preprocessing, load_new_data, parse_data_config
from tandem.parties.elastic import kernels as K
from tandem.parties.elastic.data_server import DataServer
from tandem.parties.elastic.errors import ConfigError
from tandem.parties.elastic.party_data import STAGE, export_model, load_party_shard
from tandem.parties.export.model import load_model_sync
from tandem.transports.memory import MemoryNetwork
from test_elastic_http import _toml


def _table(path, rows: int, seed: int) -> None:
    """A CSV with two numeric columns on very different scales, a categorical column and a
    binary label that depends on all three."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, rows)
    b = rng.normal(1000, 300, rows)
    city = rng.choice(["north", "south", "east"], rows)
    score = a + (b - 1000) / 300 + np.where(city == "north", 1.5, -0.5)
    label = (score > 0).astype(int)
    lines = ["id,a,b,city,label"]
    lines += [f"r{seed}_{i},{a[i]:.5f},{b[i]:.3f},{city[i]},{label[i]}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def _config(tmp_path, file: str, seed: int, **extra) -> dict:
    name = file
    _table(tmp_path / f"{name}.csv", 384, seed)
    text = (
        "\n".join(f"{k} = {json.dumps(v)}" for k, v in extra.items())
        + f'\n[data]\nsource = "{name}.csv"\nid_column = "id"\nlabel_column = "label"\n'
        'categorical = ["city"]\n[data.split]\ntest = 0.25\nseed = 1\n'
        '[model]\nkind = "embedding"\nvocab = [4]\ndim = 4\nhidden = [16]\n'
        '[train]\nloss = "binary"\nlr = 0.02\nbatch_size = 32\n'
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return {"path": str(path), **tomllib.loads(text)}


def test_a_data_server_reads_the_shared_data_and_model_tables(tmp_path):
    cfg = _config(tmp_path, "ds0", seed=0)
    party = load_party_shard(cfg, path=cfg["path"])
    assert party.spec.loss == "binary" and party.spec.model["kind"] == "embedding"
    # numeric features standardised on the training rows, then the category codes
    assert party.train.x.shape[1] == 3 and set(np.unique(party.train.x[:, 2])) <= {1, 2, 3}
    assert abs(float(party.train.x[:, 1].mean())) < 1e-3
    assert party.test is not None and len(party.test.y) + len(party.train.y) == 384
    assert party.train.y.dtype == np.float32
    net = K.net_for(party.spec)
    loss, grads = net.loss_and_grad(net.init_leaves(0), party.train.x[:32], party.train.y[:32])
    assert np.isfinite(loss) and [g.shape for g in grads] == net.shapes


def test_contract_mistakes_are_refused_with_the_fix(tmp_path):
    cfg = _config(tmp_path, "ds0", seed=0)
    with pytest.raises(ConfigError, match="train.classes is required"):
        load_party_shard({**cfg, "train": {"loss": "softmax"}}, path=cfg["path"])
    with pytest.raises(ConfigError, match=r"\[train\] has unknown keys \['epochs'\]"):
        load_party_shard({**cfg, "train": {"epochs": 3}}, path=cfg["path"])
    with pytest.raises(ConfigError, match="needs both"):
        load_party_shard({"data": cfg["data"]}, path=cfg["path"])


def test_the_export_is_split_learnings_format_with_the_preprocessing(tmp_path):
    cfg = _config(tmp_path, "ds0", seed=0)
    party = load_party_shard(cfg, path=cfg["path"])
    net = K.net_for(party.spec)
    leaves = net.init_leaves(3)
    path = tmp_path / "out" / "model.safetensors"
    export_model(
        path,
        party.spec,
        leaves,
        party="ds0",
        training="run-1",
        preprocessing=party.preprocessing,
    )
    model = load_model_sync(path)
    assert model.party == "ds0" and model.training == "run-1" and model.loss == "binary"
    # new rows prepared with the saved state give the outputs of the trained parameters
    data_cfg = parse_data_config(cfg["data"], path=cfg["path"])
    state = Preprocessing.from_json(model_description(path)["data"]["preprocessing"])
    new = load_new_data(data_cfg, state)
    x = np.concatenate([new.features.numeric, new.features.categorical.astype(np.float32)], 1)
    stage = model.models[STAGE]
    got = np.asarray(stage.apply(model.params[STAGE], x))
    want = np.asarray(net._forward(leaves, x))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def model_description(path) -> dict:
    from tandem.parties.export import read_description

    return read_description(path)


async def test_a_data_server_evaluates_its_test_rows_and_exports(tmp_path):
    from tandem.parties.elastic import protocol as P
    from tandem.transports.base import Frame

    cfg = _config(tmp_path, "ds0", seed=0)
    party = load_party_shard(cfg, path=cfg["path"])
    net = MemoryNetwork()
    coord = net.endpoint("coordinator")
    ds = DataServer(
        net.endpoint("ds0"),
        coordinator="coordinator",
        spec=party.spec,
        shard=party.train,
        test=party.test,
        export=str(tmp_path / "ds0.safetensors"),
        preprocessing=party.preprocessing,
        fingerprint=party.fingerprint,
    )

    async def call(op, **meta):
        await coord.send("ds0", P.CTL, Frame(meta={"op": op, "req": 1, **meta}))
        return (await coord.recv("ds0", P.REPLY)).meta

    async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
        server = tg.create_task(ds.run())
        await call("hello", index=0)
        test = await call("test")
        assert test["rows"] == len(party.test.y) and 0.0 <= test["accuracy"] <= 1.0
        assert (await call("export", training="t"))["path"] == str(tmp_path / "ds0.safetensors")
        await call("stop")
        await server
    assert load_model_sync(tmp_path / "ds0.safetensors").training == "t"


@pytest.mark.slow
def test_elastic_training_over_http_on_csv_tables_exports_a_usable_model(tmp_path):
    pc, p0, p1, pw0, pw1 = free_ports(5)
    url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
    common = dict(host="127.0.0.1", secret="s", coordinator=url(pc))
    export = tmp_path / "out" / "model.safetensors"
    cfg = {
        "ds0": _config(tmp_path, "ds0", 0, name="ds0", port=p0, export=str(export), **common),
        "ds1": _config(tmp_path, "ds1", 1, name="ds1", port=p1, **common),
    }
    paths = {name: c["path"] for name, c in cfg.items()}
    for name, port in (("w0", pw0), ("w1", pw1)):
        paths[name] = _toml(tmp_path / f"{name}.toml", name=name, port=port, **common)
    paths["coordinator"] = _toml(
        tmp_path / "coordinator.toml",
        name="coordinator",
        port=pc,
        secret="s",
        interval=0.3,
        epochs=6,
        min_workers=2,
        on_change="keep",
        workers={"w0": url(pw0), "w1": url(pw1)},
        data_servers={"ds0": url(p0), "ds1": url(p1)},
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = {}
    try:
        for name in ("ds0", "ds1", "w0", "w1", "coordinator"):
            role = {"c": "coordinator", "d": "data-server", "w": "worker"}[name[0]]
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tandem", "elastic", role, "--config", paths[name]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        out, err = procs["coordinator"].communicate(timeout=120)
        assert procs["coordinator"].returncode == 0, err
        for name in ("ds0", "ds1", "w0", "w1"):
            procs[name].communicate(timeout=30)
            assert procs[name].returncode == 0, name
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["exports"] == {"ds0": str(export)}
    assert result["test_accuracy"] >= 0.85, result
    model = load_model_sync(export)
    assert model.loss == "binary" and model.models[STAGE].spec["kind"] == "embedding"
