"""`tandem party` / `tandem predict` on the organisations' own tables (`[data]` through
`tandem.parties.data`): configuration, loading, the no-silent-wrong-result refusals (an id
column used as a feature, resuming on changed data, predicting with rows paired by position),
and exports that carry the preprocessing."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json

import numpy as np
import pytest

from ports import free_port
from table_helpers import TableJob, toml, write_tables
from tandem.errors import ConfigError
from tandem.parties.split.process import predict_cli
from tandem.parties.split.process.party_config import PartyConfigError, load_party_config


def _config(tmp_path, parties=("bank", "shop"), **tweak):
    job = TableJob(tmp_path, list(parties))
    for (name, *keys), value in tweak.items():
        table = job.cfg[name]
        for k in keys[:-1]:
            table = table[k]
        table[keys[-1]] = value
    job.write()
    return job


# -- configuration and loading -------------------------------------------------------------------
def test_table_data_keeps_the_id_out_of_the_features(tmp_path):
    job = _config(tmp_path)
    lead = load_party_config(job.path("bank")).load_data()
    fol = load_party_config(job.path("shop")).load_data()
    assert lead.features == 2 and fol.features == 3  # cid and label never features
    assert fol.vocab == (4,)  # oslo, paris, rome + the reserved code 0
    codes = fol.train[:, -1]
    assert set(np.unique(codes)) <= {1.0, 2.0, 3.0}
    # same ids on both sides, in other file orders: keyed by id, same split, same alignment
    assert lead.alignment == fol.alignment and lead.alignment["size"] == 240
    assert lead.samples == fol.samples and len(lead.test) == len(fol.test) > 0
    assert lead.split == fol.split == {"test": 0.25, "validation": 0.0, "seed": 7}
    assert lead.y_train.dtype == np.float32 and set(np.unique(lead.y_train)) == {0.0, 1.0}
    # the rows pair up: the leader's label follows from both parties' first columns
    again = load_party_config(job.path("bank")).load_data()
    assert again.fingerprint == lead.fingerprint and len(lead.fingerprint) == 64


def test_integer_id_column_is_never_silently_a_feature(tmp_path):
    """Trap: a table whose integer id column is not declared. Refused, naming the column."""
    job = _config(tmp_path)
    with open(tmp_path / "bank.csv", newline="") as f:
        rows = list(csv.reader(f))
    rows[0][0] = "customer_id"
    for i, row in enumerate(rows[1:]):
        row[0] = str(1000 + i)
    with open(tmp_path / "bank.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    del job.cfg["bank"]["data"]["id_column"]
    job.write()
    with pytest.raises(ConfigError, match=r"'customer_id' looks like the ids.*data\.id_column"):
        load_party_config(job.path("bank")).load_data()


def test_config_errors_name_the_key_and_the_accepted_values(tmp_path):
    job = _config(tmp_path)
    cases = [
        (("shop", "data", "label_column"), "label", "only the party owning the loss stage"),
        (("bank", "data", "scale"), "minmax", r"data.scale must be one of \['standard', 'none'\]"),
        (("bank", "data", "colour"), 1, r"unknown key\(s\) \['colour'\]"),
        (("bank", "schema", "shpo"), 3, r"\[schema\] names \['shpo'\].*accepted names are"),
        (("bank", "topology", "followers"), ["a"], r"not an argument of 'leader_follower'"),
        (("bank", "model", "bottom_follower"), {"hidden": [4]}, "belongs to 'shop'"),
        (("bank", "model", "bottm"), {"out": 4}, r"names no stage.*'bottom_follower'"),
    ]
    for (name, section, key), value, match in cases:
        saved = json.loads(json.dumps(job.cfg[name]))
        job.cfg[name].setdefault(section, {})[key] = value
        job.write()
        with pytest.raises(ConfigError, match=match):
            load_party_config(job.path(name)).load_data()
        job.cfg[name] = saved
    job.cfg["bank"]["name"] = "bnak"
    job.write()
    with pytest.raises(PartyConfigError, match=r"\(parties: \['bank', 'shop'\]\)"):
        load_party_config(job.path("bank"))


def test_http_send_window_is_a_toml_key_checked_against_its_range(tmp_path):
    job = _config(tmp_path)
    job.cfg["bank"]["http"] = {"send_window": 16}
    job.write()
    assert load_party_config(job.path("bank")).transport().send_window("shop") == 16
    assert load_party_config(job.path("shop")).transport().send_window("bank") == 8  # default
    for bad, match in [(0, r"http.send_window must be > 0"), (257, r"at most 256 messages")]:
        job.cfg["bank"]["http"]["send_window"] = bad
        job.write()
        with pytest.raises(PartyConfigError, match=match):
            load_party_config(job.path("bank"))


def test_star_with_named_followers_and_typed_arguments(tmp_path):
    parties = ["bank", "shop", "telco", "media"]
    job = TableJob(tmp_path, parties, topology={"kind": "star", "followers": parties[1:]})
    job.cfg["bank"]["topology"]["leader"] = "bank"
    for p in parties:
        job.cfg[p]["topology"]["leader"] = "bank"
    job.write()
    cfg = load_party_config(job.path("telco"))
    topo = cfg.topology()
    assert [s.name for s in topo.stages] == [
        "bottom_shop",
        "bottom_telco",
        "bottom_media",
        "top",
    ]
    assert topo.label_owner == "bank" and set(cfg.peers) == {"bank"}  # the leader only
    job.cfg["bank"]["topology"] = {"kind": "star", "followers": 3}  # a count stays an int
    job.write()
    with pytest.raises(PartyConfigError, match=r"owns no stage.*follower0"):
        load_party_config(job.path("bank"))


def test_per_stage_models_from_toml(tmp_path):
    job = _config(tmp_path)
    job.cfg["shop"]["model"]["bottom_follower"] = {
        "kind": "embedding",
        "dim": 3,
        "hidden": [6],
        "out": 5,
    }
    job.cfg["bank"]["model"]["bottom_follower"] = {"out": 5}
    job.cfg["bank"]["model"]["top"] = {"kind": "mlp", "hidden": [7, 3]}
    job.write()
    lead, fol = load_party_config(job.path("bank")), load_party_config(job.path("shop"))
    widths = lead.stage_widths({"bank": 2, "shop": 3})
    assert widths["top"] == {"in_dims": [4, 5], "out_dim": 1, "sizes": None}
    assert widths["bottom_leader"]["sizes"] == [2, 8, 4]  # no table: the uniform MLP
    model = fol.stage_model("bottom_follower", [3], (4,))
    assert model.spec["kind"] == "embedding" and model.spec["vocab"] == [4]
    assert model.out_dim == 5


# -- training, resuming, exporting ---------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    job = TableJob(tmp_path_factory.mktemp("tables"), ["bank", "shop"], epochs=4)
    results = asyncio.run(job.run_all())
    return job, results


def test_tables_train_and_the_spec_records_split_and_fingerprints(trained):
    job, results = trained
    lead, fol = results["bank"], results["shop"]
    assert not isinstance(lead, Exception), lead
    assert not isinstance(fol, Exception), fol
    assert lead["status"] == fol["status"] == "done"
    assert lead["spec_hash"] == fol["spec_hash"]
    assert lead["test_accuracy"] > 0.8
    from tandem.parties.export import read_description
    from tandem.parties.split.process.session import describe_data, leader_spec

    shop = load_party_config(job.path("shop")).load_data()
    desc = read_description(job.folder / "out" / "shop" / "shop.safetensors")
    assert desc["data"]["preprocessing"]["categorical"][0]["name"] == "city"
    assert desc["data"]["fingerprint"] == shop.fingerprint
    cfg = load_party_config(job.path("bank"))
    bank = cfg.load_data()
    spec = leader_spec(cfg, bank, {"shop": describe_data(shop)})
    assert spec.spec_hash() == lead["spec_hash"]
    assert spec.hyper["split"] == {"test": 0.25, "validation": 0.0, "seed": 7}
    assert spec.hyper["fingerprints"] == {"bank": bank.fingerprint, "shop": shop.fingerprint}
    assert spec.datasets["shop"]["features"] == 3  # described by the follower: no [schema]


def test_a_different_split_seed_is_refused_with_the_reason(trained):
    from tandem.parties.split.process.session import describe_data, follower_check, leader_spec

    job, _ = trained
    cfg = load_party_config(job.path("bank"))
    spec = leader_spec(cfg, cfg.load_data(), {"shop": {"features": 3}})
    job.cfg["shop"]["data"]["split"]["seed"] = 8
    job.write()
    try:
        shop_cfg = load_party_config(job.path("shop"))
        shop = shop_cfg.load_data()
        reasons = follower_check(shop_cfg, shop)(spec)
    finally:
        job.cfg["shop"]["data"]["split"]["seed"] = 7
        job.write()
    assert any("[data.split] differs" in r and "'seed': 8" in r for r in reasons), reasons
    assert describe_data(shop)["features"] == 3


async def test_resuming_after_the_data_changed_is_refused_naming_fresh(trained, tmp_path):
    """Trap: the data changed since the checkpoints were saved. Refused on every party, naming
    --fresh; with --fresh the parties start over."""
    import shutil

    job, _ = trained
    for item in ("bank.csv", "shop.csv", "ckpt"):
        src = job.folder / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    again = TableJob(tmp_path, ["bank", "shop"], data=False)
    with open(tmp_path / "shop.csv", newline="") as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:  # the column shifted (rows of the test split alone would not count)
        row[1] = repr(float(row[1]) + 0.5)
    with open(tmp_path / "shop.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    results = await again.run_all()
    for name in ("bank", "shop"):
        assert isinstance(results[name], Exception), results[name]
    assert "--fresh" in str(results["shop"]) and "changed since checkpoint" in str(results["shop"])
    assert "--fresh" in str(results["bank"])  # the follower's refusal reaches the leader
    again.ports = {p: free_port() for p in again.parties}
    for name in again.parties:
        again.cfg[name]["listen"]["port"] = again.ports[name]
        again.cfg[name]["peers"] = {q: again.url(q) for q in again.cfg[name]["peers"]}
    results = await again.run_all(fresh=True)
    assert results["bank"]["status"] == "done" and results["bank"]["resumed_from"] == 0


# -- prediction ----------------------------------------------------------------------------------
def _parse(argv):
    parser = argparse.ArgumentParser()
    predict_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def _predict(job, data, *, extra=(), out=None):
    argv = {
        name: ["predict", "--config", str(job.path(name)), "--data", str(data[name])]
        + list(extra)
        + (["--out", str(out), "--timeout", "60"] if name == "bank" else ["--timeout", "60"])
        for name in job.parties
    }
    args = {name: _parse(a) for name, a in argv.items()}
    async with asyncio.TaskGroup() as tg:
        tasks = {n: tg.create_task(a.func(a)) for n, a in args.items()}
    return {n: t.result() for n, t in tasks.items()}


async def test_predict_keys_rows_by_id_and_applies_the_saved_preprocessing(trained, tmp_path):
    """New rows in another order on each party, and a party holding an extra id: keyed by id
    (and refused while the ids differ), predictions match the same rows in aligned order."""
    job, _ = trained
    new = write_tables(tmp_path, ["bank", "shop"], n=50, seed=3)
    out = tmp_path / "p.csv"
    files = {n: tmp_path / f"{n}.csv" for n in job.parties}
    codes = await _predict(job, files, out=out)
    assert codes == {"bank": 0, "shop": 0}
    with open(out, newline="") as f:
        got = list(csv.DictReader(f))
    assert [r["id"] for r in got] == sorted(new["ids"].tolist())
    # the same rows re-ordered in one file give the same predictions
    with open(files["shop"], newline="") as f:
        rows = list(csv.reader(f))
    with open(files["shop"], "w", newline="") as f:
        csv.writer(f).writerows([rows[0], *rows[:0:-1]])
    out2 = tmp_path / "p2.csv"
    assert await _predict(job, files, out=out2) == {"bank": 0, "shop": 0}
    with open(out2, newline="") as f:
        again = list(csv.DictReader(f))
    assert [r["logit"] for r in again] == [r["logit"] for r in got]
    accuracy = np.mean(
        [(float(r["probability"]) > 0.5) == bool(new["y"][int(r["id"][1:])]) for r in got]
    )
    assert accuracy > 0.75


async def test_predict_refuses_positional_pairing(trained, tmp_path, capsys):
    """Trap: rows with no ids and no alignment would be paired by file position. Refused
    unless --positional."""
    job, _ = trained
    np.save(tmp_path / "bank.npy", np.zeros((4, 2)))
    args = _parse(
        ["predict", "--config", str(job.path("shop")), "--data", str(tmp_path / "x.csv")]
        + ["--id-column", "nope"]
    )
    write_tables(tmp_path, ["bank", "shop"], n=20, seed=4)
    (tmp_path / "x.csv").write_text((tmp_path / "shop.csv").read_text())
    assert await args.func(args) == 2
    assert "'nope'" in capsys.readouterr().err
    from tandem.parties.split import inference
    from tandem.parties.split.process.predict_cli import read_inputs

    model = await inference.load_model(job.folder / "out" / "bank", "bank")
    legacy = inference.PartyModel(**{**model.__dict__, "data": None})
    bare = _parse(["predict", "--config", "x", "--data", str(tmp_path / "bank.npy")])
    with pytest.raises(inference.InferenceError, match="paired .* by file position.*--positional"):
        read_inputs(legacy, bare)
    ok = _parse(["predict", "--config", "x", "--data", str(tmp_path / "bank.npy"), "--positional"])
    x, alignment, ids = read_inputs(legacy, ok)
    assert x.shape == (4, 2) and alignment is None and ids is None


def test_toml_helper_writes_nested_tables():
    text = toml({"a": 1, "data": {"source": "x.csv", "split": {"test": 0.2}}})
    import tomllib

    assert tomllib.loads(text) == {"a": 1, "data": {"source": "x.csv", "split": {"test": 0.2}}}


def test_labels_are_checked_against_the_loss(tmp_path):
    job = _config(tmp_path)
    job.cfg["bank"]["train"]["loss"] = "softmax"
    job.cfg["bank"]["model"]["out"] = 2
    job.write()
    data = load_party_config(job.path("bank")).load_data()
    assert data.y_train.dtype == np.int32  # class indices for softmax
    job.cfg["bank"]["train"]["loss"] = "binary"
    job.cfg["bank"]["data"]["label_column"] = "bank_a"  # floats, not 0/1
    job.write()
    with pytest.raises(ConfigError, match=r"label column 'bank_a' holds .* the binary loss"):
        load_party_config(job.path("bank")).load_data()


async def test_a_failing_party_prints_one_json_error_line(tmp_path, capsys):
    """Trap 1 through the command: exit 2, the reason on stderr, then one JSON line."""
    from tandem.parties.split.process.cli import party_command

    job = _config(tmp_path)
    del job.cfg["shop"]["data"]["id_column"]
    job.write()
    code = await party_command(argparse.Namespace(config=str(job.path("shop")), fresh=False))
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    line = json.loads(err.strip().splitlines()[-1])
    assert line["status"] == "error" and line["party"] == "shop" and line["exit_code"] == 2
    assert "sets no id_column" in line["reason"] and "'cid' looks like the ids" in line["reason"]
    job.cfg["shop"]["role"] = "chief"
    job.write()
    assert await party_command(argparse.Namespace(config=str(job.path("shop")))) == 2
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["status"] == "error" and "role must be 'leader' or 'follower'" in line["reason"]


async def test_predict_refuses_a_config_with_another_preprocessing(trained, tmp_path, capsys):
    job, _ = trained
    job.cfg["shop"]["data"]["scale"] = "none"
    job.write()
    try:
        args = _parse(
            ["predict", "--config", str(job.path("shop")), "--data", str(job.folder / "shop.csv")]
        )
        assert await args.func(args) == 2
    finally:
        job.cfg["shop"]["data"]["scale"] = "standard"
        job.write()
    err = capsys.readouterr().err
    assert "another preprocessing" in err and "data.scale is 'none'" in err


async def test_predict_counts_unseen_categories_and_advises_an_accepted_fix(
    trained, tmp_path, capsys
):
    """An unseen city is coded 0, counted in the JSON line and warned about once per column on
    stderr; an empty cell under the training's ``data.missing = "error"`` is refused with a fix
    predict accepts (fill it in), never "set data.missing" (which predict refuses), and once
    filled in the same command succeeds."""
    job, _ = trained
    write_tables(tmp_path, ["bank", "shop"], n=30, seed=5)
    files = {n: tmp_path / f"{n}.csv" for n in job.parties}
    with open(files["shop"], newline="") as f:
        rows = list(csv.reader(f))
    city = rows[0].index("city")
    for row in rows[1:4]:
        row[city] = "berlin"
    rows[5][rows[0].index("shop_a")] = ""
    with open(files["shop"], "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = tmp_path / "p.csv"
    alone = _parse(["predict", "--config", str(job.path("shop")), "--data", str(files["shop"])])
    capsys.readouterr()
    assert await alone.func(alone) == 2  # refused while reading its rows, before connecting
    err = capsys.readouterr().err
    assert "'shop_a' has no value at row 4" in err and "fill the value in" in err
    assert "set data.missing" not in err, err
    rows[5][rows[0].index("shop_a")] = "0.5"  # the advice, taken
    with open(files["shop"], "w", newline="") as f:
        csv.writer(f).writerows(rows)
    assert await _predict(job, files, out=out) == {"bank": 0, "shop": 0}
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines() if x.startswith("{")]
    shop = next(x for x in lines if x["party"] == "shop")
    bank = next(x for x in lines if x["party"] == "bank")
    assert shop["unseen_categories"] == {"city": 3} and shop["filled_missing"] == {}
    assert bank["unseen_categories"] == {} and bank["filled_missing"] == {}
    warnings = [x for x in captured.err.splitlines() if "not seen in training" in x]
    assert warnings == [
        "tandem predict (shop): column 'city': 3 value(s) not seen in training (code 0)"
    ]


def test_predict_help_lists_every_format_it_reads():
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        _parse(["predict", "--help"])
    flat = " ".join(text.getvalue().split())
    for fmt in (".csv", ".parquet", ".npz", ".npy", "fsspec URL"):
        assert fmt in flat, fmt
