"""A follower's cut that the leader's TOML cannot describe (a factory bottom emitting
bfloat16 [rows, 4, 8]): the follower describes each of its stages' outputs (shape after the
rows, dtype) in negotiation, the leader's spec carries it, two `tandem party` processes train
over HTTP, and `tandem predict` (both parties' commands run in this process) serves what the
exported models compute. A
leader whose top cannot read the described cut refuses to start, naming the party, the shape,
the dtype and the fix."""

from __future__ import annotations

import argparse
import csv

import jax
import numpy as np
import pytest

from party_helpers import run_commands
from table_helpers import TableJob, write_tables
from tandem.parties.split import inference
from tandem.parties.split.process.party_config import PartyConfigError, load_party_config
from tandem.parties.split.process.session import (
    describe_data,
    described_cuts,
    follower_check,
    leader_spec,
)

SHAPE, DTYPE = [4, 8], "bfloat16"
#: the follower's bottom: a factory by import path (3 columns: two numbers and the city code)
BOTTOM = {
    "factory": "tests.cut_models:bottom",
    "kwargs": {"features": 3, "shape": SHAPE, "dtype": DTYPE},
}
#: the leader's top: flattens its own bottom's float32 [rows, 4] and the follower's cut
TOP = {
    "factory": "tests.cut_models:flat_top",
    "kwargs": {"inputs": [[[4], "float32"], [SHAPE, DTYPE]]},
}


def make_job(folder, *, top=TOP) -> TableJob:
    job = TableJob(folder, ["bank", "shop"], epochs=2)
    job.cfg["shop"]["model"]["bottom_follower"] = BOTTOM
    job.cfg["bank"]["model"]["bottom_follower"] = {"out": 32}  # the width; shape, dtype described
    if top is not None:
        job.cfg["bank"]["model"]["top"] = top
    job.write()
    return job


def configs(job):
    return load_party_config(job.path("bank")), load_party_config(job.path("shop"))


def test_the_spec_carries_the_described_cut_and_the_follower_accepts_it(tmp_path):
    job = make_job(tmp_path)
    bank, shop = configs(job)
    shop_data = shop.load_data()
    told = describe_data(shop_data, shop)
    assert told["cuts"] == {"bottom_follower": {"shape": SHAPE, "dtype": DTYPE}}
    spec = leader_spec(bank, bank.load_data(), {"shop": told})
    assert spec.stages["bottom_follower"]["out_shape"] == SHAPE
    assert spec.stages["bottom_follower"]["out_dtype"] == DTYPE
    assert spec.channel_shapes()["act/bottom_follower->top"] == (DTYPE, (4, 8))
    assert spec.channel_shapes()["grad/bottom_follower->top"] == (DTYPE, (4, 8))
    assert follower_check(shop, shop_data)(spec) == []
    # the described cut is part of the negotiated spec: without it the leader proposes a
    # float32 matrix (another hash), which the follower refuses naming the shape and dtype
    blind = leader_spec(bank, bank.load_data(), {"shop": describe_data(shop_data)})
    assert blind.spec_hash() != spec.spec_hash()
    reasons = follower_check(shop, shop_data)(blind)
    assert any("out_shape [4, 8] but the spec says [32]" in r for r in reasons), reasons
    assert any("out_dtype bfloat16 but the spec says float32" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("cuts", "match"),
    [
        ({"top": {"shape": [1], "dtype": "float32"}}, r"stage 'top', which belongs to 'bank'"),
        ({"nope": {"shape": [1], "dtype": "float32"}}, "'nope', which is not in the topology"),
        ({"bottom_follower": {"shape": [4, 0], "dtype": DTYPE}}, r"positive sizes"),
        ({"bottom_follower": {"shape": [32], "dtype": "int8"}}, r"dtype: one of \['float32'"),
        ({"bottom_follower": [32]}, "a cut is {shape"),
        ([1, 2], "expected a table of stage"),
    ],
)
def test_a_malformed_description_is_refused_naming_the_party(tmp_path, cuts, match):
    job = make_job(tmp_path)
    bank, _ = configs(job)
    with pytest.raises(PartyConfigError, match=match) as info:
        described_cuts(bank, {"shop": {"features": 3, "cuts": cuts}})
    assert str(info.value).startswith("'shop' described")


async def test_a_top_that_cannot_read_the_described_cut_is_refused(tmp_path):
    """The leader's top is the uniform MLP: it concatenates its inputs, which a rank-3 cut
    cannot join. The leader does not start and tells the follower why."""
    job = make_job(tmp_path, top=None)
    results = await job.run_all()
    lead, fol = results["bank"], results["shop"]
    assert isinstance(lead, PartyConfigError), lead
    msg = str(lead)
    assert "stage 'top' of 'bank' cannot read the cut of stage 'bottom_follower' of 'shop', " in msg
    assert "bfloat16[rows, 4, 8]" in msg and "Cannot concatenate" in msg, msg
    assert "a factory can flatten and cast it" in msg and "docs/models.md#cut-tensors" in msg
    assert "the leader cannot start the training" in str(fol) and msg in str(fol)
    assert not list((job.folder / "ckpt").glob("*/step-*"))


async def _predict(job, folder, out):
    """``tandem predict`` of both parties, their command lines run in this process
    (`party_helpers.run_commands`; the training is what runs as processes); their exit
    codes."""
    argvs = {}
    for name in job.parties:
        argv = ["predict", "--config", str(job.path(name)), "--data", str(folder / f"{name}.csv")]
        argvs[name] = argv + (["--out", str(out)] if name == "bank" else []) + ["--timeout", "60"]
    return await run_commands(argvs)


def _features(job, name, folder):
    """The party's new rows as its export's preprocessing makes them, sorted by id."""
    from tandem.parties.split.process.predict_cli import read_inputs

    model = inference.load_model_sync(job.folder / "out" / name, name)
    args = argparse.Namespace(data=str(folder / f"{name}.csv"), id_column=None, aligned=None)
    x, _, ids = read_inputs(model, args)
    return model, x, ids


@pytest.mark.slow
async def test_a_bfloat16_rank3_cut_trains_over_http_processes_and_predicts(tmp_path):
    job = make_job(tmp_path / "job")
    procs = {name: job.start(name) for name in ("shop", "bank")}
    done = {name: p.finish(180) for name, p in procs.items()}
    for name, (rc, out, err) in done.items():
        assert rc == 0 and out is not None and out["status"] == "done", (name, err[-3000:])
    assert done["bank"][1]["spec_hash"] == done["shop"][1]["spec_hash"]
    assert done["bank"][1]["test_accuracy"] > 0.6

    new = tmp_path / "new"
    new.mkdir()
    write_tables(new, ["bank", "shop"], n=37, seed=9)
    out = tmp_path / "p.csv"
    for name, rc in (await _predict(job, new, out)).items():
        assert rc == 0, name  # (its error is in the captured stderr)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))

    lead, xl, ids = _features(job, "bank", new)
    fol, xf, ids_f = _features(job, "shop", new)
    assert ids == ids_f == [r["id"] for r in rows]
    bottom = fol.models["bottom_follower"]
    assert (bottom.out_shape, bottom.out_dtype) == (tuple(SHAPE), DTYPE)
    assert bottom.spec["factory"] == BOTTOM["factory"]
    hl = lead.models["bottom_leader"].apply(lead.params["bottom_leader"], xl)
    hf = jax.jit(bottom.apply)(fol.params["bottom_follower"], xf)
    assert hf.dtype.name == DTYPE and hf.shape == (37, *SHAPE)
    want = np.asarray(jax.jit(lead.models["top"].apply)(lead.params["top"], hl, hf))[:, 0]
    got = np.array([float(r["logit"]) for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
