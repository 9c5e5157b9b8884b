"""Per-stage models in a party's TOML (`[model.<stage>]`): Flax (linen, nnx), Equinox and plain
JAX factories named by import path are trained by `tandem party`, exported, and served by
`tandem predict`, whose predictions equal the exported models applied in this process; a
config naming another model than its export holds is refused."""

from __future__ import annotations

import argparse
import asyncio
import csv

import jax
import numpy as np
import pytest

from table_helpers import TableJob, write_tables
from tandem.parties.split import inference
from tandem.parties.split.process import predict_cli

pytestmark = pytest.mark.slow
FIXTURE = "tests.models_fixture"
MODELS = {
    "flax-linen+equinox": {
        "bank": ("linen_bottom", {"in_dim": 2, "hidden": 6, "out": 4}),
        "shop": ("equinox_bottom", {"in_dim": 3, "hidden": 5, "out": 4, "seed": 2}),
    },
    "flax-nnx+functions": {
        "bank": ("nnx_bottom", {"in_dim": 2, "hidden": 6, "out": 4, "seed": 1}),
        "shop": ("functions_bottom", {"in_dim": 3, "out": 4}),
    },
}
STAGE = {"bank": "bottom_leader", "shop": "bottom_follower"}


def _job(folder, models) -> TableJob:
    job = TableJob(folder, ["bank", "shop"], epochs=2)
    for name, (factory, kwargs) in models.items():
        job.cfg[name]["model"][STAGE[name]] = {"factory": f"{FIXTURE}:{factory}", "kwargs": kwargs}
    job.cfg["bank"]["model"]["top"] = {"kind": "mlp", "hidden": [6]}
    return job


def _parse(argv):
    parser = argparse.ArgumentParser()
    predict_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def _predict(job, folder, out):
    args = {
        name: _parse(
            ["predict", "--config", str(job.path(name)), "--data", str(folder / f"{name}.csv")]
            + (["--out", str(out)] if name == "bank" else [])
            + ["--timeout", "60"]
        )
        for name in job.parties
    }
    async with asyncio.TaskGroup() as tg:
        tasks = {n: tg.create_task(a.func(a)) for n, a in args.items()}
    return {n: t.result() for n, t in tasks.items()}


def _features(job, name, folder):
    """The party's new rows as its export's preprocessing makes them, sorted by id."""
    from tandem.parties.split.process.predict_cli import read_inputs

    model = inference.load_model_sync(job.folder / "out" / name, name)
    args = argparse.Namespace(data=str(folder / f"{name}.csv"), id_column=None, aligned=None)
    x, _, ids = read_inputs(model, args)
    return model, x, ids


@pytest.mark.parametrize("kinds", sorted(MODELS))
async def test_factory_models_train_export_and_predict(tmp_path, kinds):
    job = _job(tmp_path / "job", MODELS[kinds])
    results = await job.run_all()
    for name, result in results.items():
        assert not isinstance(result, Exception), (name, result)
        assert result["status"] == "done"
    assert results["bank"]["test_accuracy"] > 0.6
    new = tmp_path / "new"
    new.mkdir()
    write_tables(new, ["bank", "shop"], n=37, seed=9)
    out = tmp_path / "p.csv"
    assert await _predict(job, new, out) == {"bank": 0, "shop": 0}
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    # the exports applied here, in one process, to the same rows
    lead, xl, ids = _features(job, "bank", new)
    fol, xf, ids_f = _features(job, "shop", new)
    assert ids == ids_f == [r["id"] for r in rows]
    for model, (factory, _) in ((lead, MODELS[kinds]["bank"]), (fol, MODELS[kinds]["shop"])):
        stage = STAGE[model.party]
        assert model.models[stage].spec["factory"] == f"{FIXTURE}:{factory}"
    hl = lead.models["bottom_leader"].apply(lead.params["bottom_leader"], xl)
    hf = fol.models["bottom_follower"].apply(fol.params["bottom_follower"], xf)
    want = np.asarray(jax.jit(lead.models["top"].apply)(lead.params["top"], hl, hf))[:, 0]
    got = np.array([float(r["logit"]) for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


async def test_predict_refuses_a_config_describing_another_model(tmp_path, capsys):
    job = _job(tmp_path / "job", MODELS["flax-nnx+functions"])
    results = await job.run_all()
    assert all(not isinstance(r, Exception) for r in results.values()), results
    job.cfg["shop"]["model"]["bottom_follower"]["kwargs"]["out"] = 5
    job.write()
    args = _parse(
        ["predict", "--config", str(job.path("shop")), "--data", str(job.folder / "shop.csv")]
    )
    assert await args.func(args) == 2
    err = capsys.readouterr().err
    assert "does not hold the model" in err and "'out': 5" in err and "'out': 4" in err
