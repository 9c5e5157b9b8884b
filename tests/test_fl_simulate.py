"""Federated simulation (`tandem.parties.fl.simulate`): virtual clients through the real
server and client code, at most ``per_round`` client states alive, same model as long-lived
in-memory clients for the same seed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fl_helpers import compressed, small_setup
from tandem.errors import ConfigError
from tandem.parties.fl.data import load_federated_digits
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.simulate import (
    ClientPool,
    FilePerClient,
    TablePartition,
    per_round_fraction,
    simulate,
)
from tandem.parties.fl.simulate import run as sim_run


def _source(data) -> TablePartition:
    """The clients of ``data`` as one table and its partition."""
    xs = [x for x, _ in data.clients]
    ys = [y for _, y in data.clients]
    sizes = np.cumsum([0, *(len(y) for y in ys)])
    parts = [np.arange(sizes[i], sizes[i + 1]) for i in range(len(ys))]
    return TablePartition(np.concatenate(xs), np.concatenate(ys), parts=parts)


@pytest.mark.parametrize(
    "kw",
    [
        dict(fraction=0.5),  # rand-k uplink, top-k server with residual, version downlink
        dict(fraction=0.5, downlink="full"),
        dict(fraction=1.0, secagg=SecAggConfig(stage_timeout=5.0), rule=None),
    ],
    ids=["randk-version", "full", "secagg"],
)
def test_same_model_as_long_lived_in_memory_clients(kw):
    data, trainer = small_setup()
    if kw.get("rule", 0) is None:  # secure aggregation: a plain dense mean
        kw = {k: v for k, v in kw.items() if k != "rule"}
        cfg = compressed(3, 30.0, uplink={"kind": "dense"}, **kw)
    else:
        cfg = compressed(3, 30.0, **kw)
    real = asyncio.run(run_memory_federation(data, trainer, cfg))
    sim = asyncio.run(simulate(_source(data), trainer, cfg, test_set=(data.x_test, data.y_test)))
    np.testing.assert_array_equal(sim.model, real.model)
    assert [r.accepted for r in sim.reports] == [r.accepted for r in real.reports]
    assert [r.accuracy for r in sim.reports] == [r.accuracy for r in real.reports]


def test_live_client_states_never_exceed_per_round(monkeypatch):
    data, trainer = small_setup()
    big = load_federated_digits(12, 5.0, seed=2)
    source = _source(big)
    seen: list[int] = []
    loads: list[int] = []
    original = ClientPool.admit

    async def admit(self, name):
        await original(self, name)
        seen.append(self.live)
        loads.append(self.index[name])

    monkeypatch.setattr(ClientPool, "admit", admit)
    server = asyncio.run(simulate(source, trainer, compressed(4, 30.0), per_round=3))
    assert max(seen) <= 3 and server.pool.peak == 3
    assert server.pool.live == 0  # nothing survives its round
    assert server.pool.built == 12 == len(loads)  # 4 rounds x 3 clients, each built anew
    assert all(len(r.sampled) == 3 and len(r.accepted) == 3 for r in server.reports)


def test_a_client_that_hangs_is_dropped_at_the_deadline_and_freed(monkeypatch):
    data, trainer = small_setup()

    async def hang(self, rnd):
        if self.seed == 0:
            await asyncio.sleep(3600)

    monkeypatch.setattr(sim_run.VirtualClient, "before_reply", hang)
    server = asyncio.run(simulate(_source(data), trainer, compressed(2, 1.0), per_round=4))
    assert all(r.dropped == ["c0"] for r in server.reports)
    assert server.pool.live == 0


def test_dirichlet_partition_is_seeded_and_covers_every_row():
    x = np.random.default_rng(0).normal(size=(400, 3)).astype(np.float32)
    y = np.arange(400) % 4
    a = TablePartition(x, y, 20, alpha=0.3, seed=7)
    b = TablePartition(x, y, 20, alpha=0.3, seed=7)
    assert len(a) == 20
    assert all(np.array_equal(p, q) for p, q in zip(a.parts, b.parts, strict=True))
    assert sorted(np.concatenate(a.parts).tolist()) == list(range(400))
    xa, ya = a.load(5)
    np.testing.assert_array_equal(xa, x[a.parts[5]])
    with pytest.raises(ConfigError, match="fewer clients"):
        TablePartition(x, y, 500, seed=0)


def test_per_round_and_refusals():
    for k, n in [(1, 3), (100, 1000), (10, 1000), (7, 10_000), (3, 3)]:
        f = per_round_fraction(k, n)
        assert int(np.ceil(f * n)) == k
    with pytest.raises(ConfigError, match="--per-round"):
        per_round_fraction(0, 10)
    data, trainer = small_setup()
    with pytest.raises(ConfigError, match="anchor"):
        asyncio.run(simulate(_source(data), trainer, compressed(1, 1.0, downlink="anchor")))


def test_file_per_client(tmp_path):
    for i in range(3):
        rows = ["id,a,b,label", *(f"{i}-{j},{j},{i + j},{j % 2}" for j in range(5))]
        (tmp_path / f"client_{i}.csv").write_text("\n".join(rows) + "\n")
    src = FilePerClient(str(tmp_path / "client_*.csv"), "label")
    assert len(src) == 3
    x, y = src.load(2)
    assert x.shape == (5, 2) and x.dtype == np.float32 and list(y) == [0, 1, 0, 1, 0]
    np.testing.assert_array_equal(x[:, 1], np.arange(5) + 2)
    with pytest.raises(ConfigError, match="matches no file"):
        FilePerClient(str(tmp_path / "nothing_*.csv"), "label")


def test_cli_simulate_prints_one_result_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "fl", "simulate", "--clients", "30", "--per-round",
         "5", "--rounds", "2", "--hidden", "16", "--quiet"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["clients"] == 30 and result["per_round"] == 5
    assert result["peak_live_clients"] <= 5 and result["rounds"] == 2


def test_bench_fl_sim_one_setting():
    """One setting of ``bench.fl_sim`` (its ``--one`` child) at its ``--quick`` size: 10
    clients, all 10 each round."""
    from run_helpers import run_bench

    r, _ = run_bench(
        "fl_sim", "--one", "flower_100", "--quick", "--rounds", "2", "--warmup", "1", "--seed", "0"
    )
    assert r["setting"] == "flower_100"
    assert r["peak_live"] == 10 and r["s_per_round"] > 0 and r["pss_mb"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
# Ray starts its processes with fork+exec; JAX (loaded here) warns on any fork
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_client_rounds_as_ray_tasks_give_the_same_model(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the Ray workers inherit it
    ray = pytest.importorskip("ray")
    from tandem.parties.fl.simulate.on_ray import RayTrainer, build_trainer

    data = load_federated_digits(6, 0.5, seed=1)
    spec = {"sizes": [64, 16, 10], "lr": 0.1, "epochs": 1, "batch_size": 16, "init_seed": 0,
            "loss": "softmax"}  # fmt: skip
    cfg = compressed(2, 120.0, fraction=0.5)
    local = asyncio.run(simulate(_source(data), build_trainer(spec), cfg))
    # a cluster of its own ("local"), never one another process started on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = asyncio.run(simulate(_source(data), RayTrainer(spec), cfg))
    finally:
        ray.shutdown()
    assert [r.accepted for r in remote.reports] == [r.accepted for r in local.reports]
    np.testing.assert_allclose(remote.model, local.model, rtol=0, atol=1e-6)


def test_cli_simulate_partitions_a_table_and_refuses_text_features(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"{i},{rng.normal():.4f},{rng.normal():.4f},{i % 3}" for i in range(90)]
    (tmp_path / "t.csv").write_text("id,a,b,label\n" + "\n".join(rows) + "\n")
    (tmp_path / "bad.csv").write_text("id,a,city,label\n1,0.5,north,0\n2,0.1,south,1\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = ["--label", "label", "--clients", "6", "--per-round", "2", "--rounds", "1"]
    args += ["--hidden", "4", "--quiet"]
    run = lambda table: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "tandem", "fl", "simulate", "--table", table, *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    ok = run(str(tmp_path / "t.csv"))
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["clients"] == 6 and result["params"] == 2 * 4 + 4 + 4 * 3 + 3
    bad = run(str(tmp_path / "bad.csv"))
    assert bad.returncode == 2 and "not numeric" in bad.stderr and bad.stdout == ""
