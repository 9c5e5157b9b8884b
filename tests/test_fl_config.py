"""The TOML files of ``tandem fl server`` / ``tandem fl client``: what they accept, and errors
that name the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_process_helpers import to_toml
from tandem.errors import ConfigError
from tandem.parties.fl.config import FLConfigError, load_client_config, load_server_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "fl"


def server_table() -> dict:
    return {
        "server": {"clients": ["a", "b"], "rounds": 3},
        "model": {"kind": "mlp", "hidden": [8], "out_dim": 10},
        "data": {"source": "eval.csv", "label_column": "y"},
        "http": {"secret": "s"},
    }


def client_table() -> dict:
    return {
        "client": {"name": "a", "server": "http://127.0.0.1:8780"},
        "data": {"source": "a.csv", "label_column": "y"},
        "http": {"secret": "s"},
    }


def write(tmp_path: Path, table: dict, name: str = "f.toml") -> Path:
    path = tmp_path / name
    path.write_text(to_toml(table))
    return path


def test_the_examples_parse(monkeypatch):
    monkeypatch.setenv("TANDEM_FL_SECRET", "example")
    server = load_server_config(EXAMPLES / "server.toml")
    assert server.clients == ("bank_a", "bank_b", "bank_c", "bank_d")
    assert server.optimizer.describe() == {"name": "sgd", "learning_rate": 1.0}
    assert server.checkpoint is not None and server.checkpoint.endswith("state/server.ckpt")
    for c in server.clients:
        cfg = load_client_config(EXAMPLES / f"{c}.toml")
        assert cfg.name == c and cfg.server == "http://127.0.0.1:8780"
        assert cfg.security.secret == b"example"


def test_defaults(tmp_path):
    s = load_server_config(write(tmp_path, server_table()))
    assert (s.name, s.min_clients, s.fraction, s.loss) == ("server", 2, 1.0, "softmax")
    assert s.compression.preset == "dense" and s.compression.downlink == "full"
    assert s.model["activate_last"] is False  # the output layer gives logits
    assert s.data.source == str(tmp_path / "eval.csv")  # relative to the TOML file
    c = load_client_config(write(tmp_path, client_table()))
    assert (c.epochs, c.batch_size, c.server_name) == (1, 16, "server")
    assert c.optimizer.describe() == {"name": "sgd", "learning_rate": 0.05}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t["server"].update(colour="red"), r"unknown key server\.colour"),
        (lambda t: t.update(extra={"a": 1}), r"unknown table or key 'extra'"),
        (lambda t: t.pop("model"), r"the table \[model\] is missing"),
        (lambda t: t["server"].pop("rounds"), r"\[server\] needs `rounds`"),
        (lambda t: t["server"].update(rounds="many"), r"server\.rounds must be int"),
        (lambda t: t["server"].update(clients=[]), r"server\.clients must list"),
        (lambda t: t["server"].update(clients=["a", "a"]), "names a client twice"),
        (lambda t: t["server"].update(min_clients=3), r"min_clients = 3 but server\.clients"),
        (lambda t: t["server"].update(fraction=0), r"fraction must be in \(0, 1\]"),
        (lambda t: t["server"].update(loss="hinge"), r"server\.loss must be one of"),
        (lambda t: t.update(http={}), r"\[http\] needs a shared secret"),
        (lambda t: t["http"].update(secret_env="TANDEM_NOT_SET_ANYWHERE"), "only one of"),
        (lambda t: t.update(http={"secret_env": "TANDEM_NOT_SET_X"}), "which is not set"),
        (lambda t: t["http"].update(colour=1), r"unknown key http\.colour"),
        (lambda t: t.update(optimizer={"name": "nope"}), "not an optax optimizer"),
        (lambda t: t.update(optimizer={"learning_rate": 1.0}), r"\[optimizer\] needs `name`"),
        (
            lambda t: t.update(optimizer={"name": "adam", "learning_rat": 0.1}),
            r"optax\.adam does not take these arguments",
        ),
        (lambda t: t.update(compression={"preset": "tiny"}), "compression.preset must be one"),
        (
            lambda t: t.update(compression={"uplink_ratio": 10}),
            'apply to preset = "compressed" only',
        ),
        (lambda t: t.update(compression={"downlink": "fax"}), "compression.downlink must be"),
        (lambda t: t.update(model={"hidden": [8]}), r"\[model\] needs `kind`"),
        (lambda t: t["data"].pop("label_column"), "data.label_column is required"),
        (lambda t: t["data"].update(colour=1), r"unknown key\(s\) \['colour'\]"),
    ],
)
def test_server_errors_name_the_file_the_key_and_the_fix(tmp_path, edit, message):
    table = server_table()
    edit(table)
    path = write(tmp_path, table)
    with pytest.raises(ConfigError, match=message) as e:  # FLConfigError, or DataError
        load_server_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t["client"].pop("server"), r"\[client\] needs `server`"),
        (lambda t: t["client"].update(server="127.0.0.1:8780"), "must be a URL like"),
        (lambda t: t["client"].update(port=70000), r"client\.port must be in \[0, 65535\]"),
        (lambda t: t.update(train={"epochs": 0}), r"train\.epochs must be >= 1"),
        (lambda t: t.update(train={"lr": 0.1}), r"unknown key train\.lr"),
        (lambda t: t.update(model={"kind": "mlp"}), "unknown table or key 'model'"),
        (lambda t: t["client"].update(reconnect_timeout=0), "reconnect_timeout must be > 0"),
    ],
)
def test_client_errors_name_the_file_the_key_and_the_fix(tmp_path, edit, message):
    table = client_table()
    edit(table)
    path = write(tmp_path, table)
    with pytest.raises(FLConfigError, match=message) as e:
        load_client_config(path)
    assert str(path) in str(e.value)


def test_a_missing_or_broken_file(tmp_path):
    with pytest.raises(FLConfigError, match="not found; pass --config"):
        load_server_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(FLConfigError, match="not valid TOML"):
        load_client_config(bad)


def test_fedavg_fedadam_fedyogi_are_configurations(tmp_path):
    for name, kwargs in (("sgd", {"learning_rate": 1.0}), ("adam", {}), ("yogi", {})):
        table = server_table()
        table["optimizer"] = {"name": name, "learning_rate": 0.01, **kwargs}
        opt = load_server_config(write(tmp_path, table)).optimizer
        assert opt.name == name
        assert opt.build() is not None
