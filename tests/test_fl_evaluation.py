"""Federated evaluation (issue 43, point 8): with no labelled set on the server, the clients
evaluate each round's global model on their own validation rows (held out of training by a
seeded split) and the server reports the weighted aggregate. End to end over the memory
transport (plain and under secure aggregation), in a simulation, and from TOML files
(`run_local`: the same build as ``tandem fl server|client``); the aggregate equals evaluating
the model the round sent on the union of the clients' validation rows."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fl_helpers import compressed, small_setup
from fl_process_helpers import CLIENTS, Federation, to_toml
from tandem.parties.fl import federation
from tandem.parties.fl import protocol as P
from tandem.parties.fl.client import FLClient
from tandem.parties.fl.config import FLConfigError, load_client_config, load_server_config
from tandem.parties.fl.evaluation import check_eval, combine, hold_out, latest, round_text
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.local import run_local
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.server import FLServer
from tandem.parties.fl.simulate import TablePartition, simulate

SHARE = 0.25


def held_out(data) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each client's validation rows, as `holding` splits them."""
    return [hold_out(x, y, SHARE, [0, i])[1] for i, (x, y) in enumerate(data.clients)]


def holding(t, server, x, y, trainer, seed):
    """A client that holds out ``SHARE`` of its rows (seeded by its index) to evaluate on."""
    (x, y), val = hold_out(x, y, SHARE, [0, seed])
    return FLClient(t, server, x, y, trainer, seed=seed, validation=val)


def expected(trainer, model, rows) -> tuple[int, float, float]:
    """The evaluation of ``model`` on the union of ``rows``."""
    x = np.concatenate([r[0] for r in rows])
    y = np.concatenate([r[1] for r in rows])
    ev = trainer.evaluate(model, x, y)
    return x.shape[0], ev.loss, ev.accuracy


def check_against_models(server, models, trainer, rows) -> None:
    """Round r's evaluation is of the model round r sent (the model after round r - 1)."""
    for rep in server.reports:
        ev = rep.evaluation
        n, loss, acc = expected(trainer, models[rep.round], rows)
        assert ev is not None and ev["rows"] == n and ev["clients"] == len(rows), ev
        assert ev["loss"] == pytest.approx(loss, rel=1e-5)
        assert ev["accuracy"] == pytest.approx(acc, abs=1e-9)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg"])
async def test_clients_evaluate_the_round_model_on_their_validation_rows(secure, monkeypatch):
    data, trainer = small_setup()
    extra = dict(uplink={"kind": "dense"}, secagg=SecAggConfig(stage_timeout=5.0)) if secure else {}
    cfg = compressed(3, 30.0, client_eval=True, downlink="full", **extra)
    models = [trainer.init_vec]  # models[r]: what round r sends (the model after round r - 1)
    made: list[FLServer] = []

    class Keeping(FLServer):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

        async def after_round(self, report) -> None:
            models.append(np.array(self.model, copy=True))

    monkeypatch.setattr(federation, "FLServer", Keeping)
    server = await run_memory_federation(data, trainer, cfg, client_cls=holding)
    assert made == [server]
    assert [r.accepted for r in server.reports] == [["c0", "c1", "c2", "c3"]] * 3
    check_against_models(server, models, trainer, held_out(data))


async def test_a_simulation_evaluates_on_the_sampled_clients_rows():
    data, trainer = small_setup()
    xs, ys = [x for x, _ in data.clients], [y for _, y in data.clients]
    sizes = np.cumsum([0, *(len(y) for y in ys)])
    parts = [np.arange(sizes[i], sizes[i + 1]) for i in range(len(ys))]
    source = TablePartition(np.concatenate(xs), np.concatenate(ys), parts=parts)
    cfg = compressed(2, 30.0, client_eval=True, seed=0, downlink="full")
    sim = await simulate(source, trainer, cfg, validation=SHARE)
    plain = await run_memory_federation(data, trainer, cfg, client_cls=holding)
    # the same held-out rows, so the same model and the same evaluations
    np.testing.assert_array_equal(sim.model, plain.model)
    assert [r.evaluation for r in sim.reports] == [r.evaluation for r in plain.reports]
    assert sim.reports[0].evaluation["rows"] == sum(len(v[1]) for v in held_out(data))


async def test_an_evaluation_report_out_of_bounds_refuses_the_update():
    data, trainer = small_setup()

    class Lying(FLClient):
        async def before_reply(self, rnd: int) -> None:
            send = self.transport.send

            async def lie(peer, channel, frame):
                if channel == P.UPDATE and self.seed == 1:
                    frame = dataclasses.replace(frame, meta={**frame.meta, "eval": [3, 1.0, 7.0]})
                await send(peer, channel, frame)

            self.transport.send = lie  # type: ignore[method-assign]

    def make(t, server, x, y, trainer, seed):
        (x, y), val = hold_out(x, y, SHARE, [0, seed])
        return Lying(t, server, x, y, trainer, seed=seed, validation=val)

    cfg = compressed(1, 30.0, client_eval=True)
    server = await run_memory_federation(data, trainer, cfg, client_cls=make)
    rep = server.reports[0]
    assert rep.accepted == ["c0", "c2", "c3"]
    assert "meta.eval correct count 7.0 exceeds its rows 3" in rep.rejected["c1"]
    assert rep.evaluation is not None and rep.evaluation["clients"] == 3


def test_check_eval_combine_and_hold_out():
    with pytest.raises(P.UpdateError, match=r"c: meta.eval must be \[rows, loss sum"):
        check_eval({"n": 1}, who="c", max_rows=10)
    with pytest.raises(P.UpdateError, match=r"rows must be an integer in \[0, 10\]"):
        check_eval([11, 0.0, 0.0], who="c", max_rows=10)
    with pytest.raises(P.UpdateError, match="loss sum must be a finite number"):
        check_eval([1, float("nan"), 0.0], who="c", max_rows=10)
    assert check_eval([4, 2.0, 3], who="c", max_rows=10) == (4, 2.0, 3.0)
    ev = combine({"a": (4, 2.0, 3.0), "b": (0, 0.0, 0.0), "c": (6, 1.0, 2.0)}, True)
    assert ev == {"rows": 10, "loss": 0.3, "accuracy": 0.5, "clients": 2}
    assert combine({"a": (0, 0.0, 0.0)}, True) is None
    assert combine({"a": (2, 1.0, 0.0)}, False)["accuracy"] is None
    assert round_text(ev) == ", val_accuracy 50.00%, val_loss 0.3000 (10 rows on 2 clients)"
    rep = type("R", (), {"round": 4, "evaluation": ev})()
    assert latest([rep, type("R", (), {"round": 5, "evaluation": None})()])["round"] == 5
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10)
    (xt, yt), (xv, yv) = hold_out(x, y, 0.3, [1, 2])
    assert len(yv) == 3 and len(yt) == 7 and not set(yv) & set(yt)
    assert hold_out(x, y, 0.3, [1, 2])[1][1].tolist() == yv.tolist()  # seeded
    assert hold_out(x, y, 0.0, 0)[1] is None


def test_server_evaluate_keys(tmp_path):
    fed = Federation(tmp_path, rounds=1)
    fed.write()
    assert load_server_config(fed.path("server")).evaluate == "server"  # the default
    del fed.server["data"]["label_column"]
    fed.write()
    with pytest.raises(FLConfigError, match=r'label_column is required with server.evaluate = "s'):
        load_server_config(fed.path("server"))
    fed.server["server"]["evaluate"] = "clients"
    fed.write()
    assert load_server_config(fed.path("server")).evaluate == "clients"
    (tmp_path / "bad.toml").write_text(
        to_toml({**fed.server, "server": {**fed.server["server"], "evaluate": "both"}})
    )
    with pytest.raises(FLConfigError, match="evaluate"):
        load_server_config(tmp_path / "bad.toml")


async def test_the_files_of_a_server_without_labels_evaluate_on_the_clients(tmp_path):
    fed = Federation(tmp_path, rounds=2)
    del fed.server["data"]["label_column"]  # its rows' features only (the digits unused)
    fed.server["data"]["features"] = [f"pixel_{i}" for i in range(64)]
    fed.server["server"].update(eval_every=1, evaluate="clients")
    for c in CLIENTS:
        fed.clients[c]["data"]["split"] = {"test": 0.0, "validation": 0.2, "seed": 1}
    fed.write()
    out = await run_local(
        load_server_config(fed.path("server")), [load_client_config(fed.path(c)) for c in CLIENTS]
    )
    assert out["accuracy"] is None and out["loss"] is None  # nothing labelled on the server
    evals = [r.evaluation for r in out["reports"]]
    assert all(ev is not None and ev["clients"] == 4 for ev in evals), evals
    assert evals[1]["accuracy"] > evals[0]["accuracy"]  # round 2 sends a trained model
    assert all(r.accuracy is None for r in out["reports"])


def test_cli_simulate_with_a_validation_share_reports_the_clients_evaluation(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"{i},{rng.normal():.4f},{rng.normal():.4f},{i % 3}" for i in range(90)]
    (tmp_path / "t.csv").write_text("id,a,b,label\n" + "\n".join(rows) + "\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "fl", "simulate", "--table", str(tmp_path / "t.csv"),
         "--label", "label", "--clients", "6", "--per-round", "3", "--rounds", "2",
         "--hidden", "4", "--validation", "0.3"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["accuracy"] is None  # a table: no test set
    ev = result["client_eval"]
    assert ev["round"] == 2 and ev["clients"] == 3 and 0 < ev["rows"] < 45, ev
    lines = [line for line in out.stderr.splitlines() if line.startswith("round ")]
    assert len(lines) == 2 and all("val_accuracy" in x and "val_loss" in x for x in lines), lines
