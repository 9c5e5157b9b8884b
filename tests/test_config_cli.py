"""Typed configuration: `tandem config schema ROLE` describes every party TOML under
examples/, `tandem config check F.toml` validates a file without starting anything, errors
name ``section.key``, and the split hyper-parameters come from one declaration."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from tandem.parties.cli import main
from tandem.parties.config import validate
from tandem.parties.split.process.config import PartyConfig, PartyConfigError

ROOT = Path(__file__).resolve().parents[1]
PARTY_FILES = sorted(
    p for p in ROOT.glob("examples/**/*.toml") if "role" in tomllib.loads(p.read_text())
)


def _schema(capsys, role: str) -> dict:
    assert main(["config", "schema", role]) == 0
    return json.loads(capsys.readouterr().out)


def _keys_fit(table: dict, schema: dict, defs: dict, where: str) -> None:
    """Every key of ``table`` is a property of ``schema`` (recursively through sections)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    options = [o for o in schema.get("anyOf", []) if "$ref" in o or "properties" in o]
    if options:  # a union of sections: the table fits one of them
        failures = []
        for option in options:
            try:
                return _keys_fit(table, option, defs, where)
            except AssertionError as exc:
                failures.append(str(exc))
        raise AssertionError(f"{where}: fits no option: {failures}")
    props = schema.get("properties", {})
    for key, value in table.items():
        if schema.get("additionalProperties") is False:
            assert key in props, f"{where}{key} is not in the schema"
        if isinstance(value, dict) and key in props:
            _keys_fit(value, props[key], defs, f"{where}{key}.")


def test_the_party_schema_describes_every_example(capsys, monkeypatch):
    assert len(PARTY_FILES) >= 4, PARTY_FILES
    monkeypatch.setenv("TANDEM_SECRET", "s3cret")
    schema = _schema(capsys, "party")
    assert schema["title"] == "tandem party TOML" and schema["type"] == "object"
    shared = ("listen", "peers", "security", "identities", "http", "data", "model", "log")
    assert {"role", "name", "train", "checkpoint", "schema", *shared} <= set(schema["properties"])
    assert set(schema["required"]) == {"role", "name", "data"}
    assert _schema(capsys, "predict")["properties"] == schema["properties"]
    for path in PARTY_FILES:
        raw = tomllib.loads(path.read_text())
        _keys_fit(raw, schema, schema["$defs"], "")
        cfg = validate(PartyConfig, raw, path=str(path), error=PartyConfigError)
        assert cfg.name == raw["name"]


def test_check_validates_without_starting_and_names_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_SECRET", "s3cret")
    good = ROOT / "examples" / "split" / "leader.toml"
    assert main(["config", "check", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    text = good.read_text()
    cases = [
        ("[listen]", '[listen]\nhots = "x"', "unknown key listen.hots; accepted keys in [listen]"),
        ("[listen]", "[listen]\nport = true\n[link]\nlatency = -1", "listen.port must be int"),
        ('role = "leader"', 'role = "boss"', "role must be 'leader' or 'follower', got 'boss'"),
        ("[security]", '[security]\ntls_cert = "no.pem"', "security.tls_cert = 'no.pem'"),
    ]
    for old, new, message in cases:
        bad = tmp_path / "bad.toml"
        bad.write_text(text.replace(old, new, 1))
        assert main(["config", "check", str(bad)]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and str(bad) in captured.err, captured.err
        assert captured.out == ""


def test_split_hyper_parameters_have_one_declaration():
    from tandem.parties.split.hyper import SPEC_FIELDS, SPLIT_FIELDS, Train
    from tandem.parties.split.party import SplitConfig
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.process.session import leader_spec

    fields = {f.name: f.default for f in dataclasses.fields(SplitConfig)}
    assert tuple(fields) == SPLIT_FIELDS
    assert fields == {k: Train.model_fields[k].default for k in SPLIT_FIELDS}
    cfg = load_party_config(ROOT / "examples" / "split" / "leader.toml")
    hyper = cfg.hyper()
    assert set(SPEC_FIELDS) - {"compress_topk"} <= set(hyper)
    spec = leader_spec(cfg, cfg.load_data(), {"follower": {"features": 13}})
    assert spec.to_dict()["version"] == 2
    assert {"chunks", "compress"} <= set(spec.hyper)  # recorded always, no "as before"


def test_a_checkpoint_of_an_older_spec_version_is_refused_naming_fresh(tmp_path, monkeypatch):
    import numpy as np

    from tandem.parties.split import checkpoint
    from tandem.parties.split.checkpoint import CheckpointStore
    from tandem.parties.split.process.build_data import PartyData
    from tandem.parties.split.process.standalone import stale_checkpoints

    store = CheckpointStore(tmp_path / "ck", party="leader")
    data = PartyData(np.zeros((2, 1), np.float32), fingerprint="f")
    params = {"top": {"w": np.zeros(2, np.float32)}}
    save = dict(params=params, opt_state=params, spec_hash="h", cursor={}, fingerprint="f")
    store.save(1, **save)
    assert stale_checkpoints(store, data) == []  # this version's checkpoint resumes
    monkeypatch.setattr(checkpoint, "SPEC_VERSION", 1)
    store.save(2, **save)
    (reason,) = stale_checkpoints(store, data)
    assert "version 1 task spec" in reason and "--fresh" in reason


#: Every role file under examples/ (a worker roster is a list of names, not a role's file).
ROLE_FILES = sorted(p for p in ROOT.glob("examples/**/*.toml") if p.name != "roster.toml")
KINDS = {
    "party": ("split", "two-orgs", "three-party"),
    "fl-server": ("fl",),
    "fl-client": ("fl",),
    "elastic-coordinator": ("elastic",),
    "elastic-data-server": ("elastic",),
    "elastic-worker": ("elastic",),
}


def test_each_kind_has_a_schema_that_describes_its_examples(capsys, monkeypatch):
    from tandem.parties.cli.config_cmd import ROLES, guess_role

    monkeypatch.setenv("TANDEM_SECRET", "s3cret")
    monkeypatch.setenv("TANDEM_FL_SECRET", "s3cret")
    assert set(KINDS) | {"predict"} == set(ROLES)
    seen = dict.fromkeys(KINDS, 0)
    for path in ROLE_FILES:
        role = guess_role(str(path))
        assert path.parent.name in KINDS[role], (path, role)
        schema = _schema(capsys, role)
        assert schema["title"] == f"tandem {role} TOML"
        _keys_fit(tomllib.loads(path.read_text()), schema, schema.get("$defs", {}), "")
        assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out) == {
            "file": str(path),
            "role": role,
            "status": "ok",
        }
        seen[role] += 1
    assert all(seen.values()), seen
    for role in ("fl-server", "elastic-worker"):  # the shared sections, not copies
        defs = _schema(capsys, role)["$defs"]
        assert "insecure" in defs["Security"]["properties"]


def test_check_names_the_key_for_fl_and_elastic_files(tmp_path, capsys):
    cases = [
        (
            "fl-client",
            "[client]\nname = 'a'\nserver = 'x'\n[data]\nsource = 'a.csv'\n",
            "must be a URL",
        ),
        (
            "elastic-worker",
            "name = 'w'\ncoordinator = 'http://127.0.0.1:1'\nport = -1\n",
            "'port' must be in [0, 65535]",
        ),
        (
            "elastic-coordinator",
            "name = 'c'\n[data_servers]\nds0 = 'http://h:1'\n"
            "[security]\nsecret_env = 'TANDEM_NOT_SET_Q'\n",
            "security.secret_env names $TANDEM_NOT_SET_Q",
        ),
        (
            "elastic-data-server",
            "name = 'd'\ncoordinator = 'http://127.0.0.1:1'\n",
            "give the shard as [data] + [model]",
        ),
        (
            "elastic-worker",
            "name = 'w'\ncoordinator = 'http://127.0.0.1:1'\nsecret = 'a'\n"
            "[security]\nsecret = 'b'\n",
            "the shared secret is given twice, by secret and in [security]",
        ),
    ]
    for role, text, message in cases:
        bad = tmp_path / f"{role}.toml"
        bad.write_text(text)
        assert main(["config", "check", str(bad), "--role", role]) == 2
        err = capsys.readouterr().err
        assert message in err and str(bad) in err, err


# -- a non-loopback listen address needs authentication, or insecure = true -----------------
def _role_tables(tmp_path: Path) -> dict[str, tuple[dict, tuple[str, ...], str]]:
    """role -> (a loopback file's table, the path of its listen host, its security table)."""
    (tmp_path / "t.csv").write_text("id,x,y\na,1,0\n")
    data = {"source": "t.csv", "id_column": "id", "label_column": "y"}
    return {
        "party": (
            {
                "role": "follower",
                "name": "follower",
                "peers": {"leader": "http://127.0.0.1:1"},
                "data": {"source": "t.csv", "id_column": "id"},
                "listen": {},
                "security": {},
            },
            ("listen", "host"),
            "security",
        ),
        "fl-server": (
            {
                "server": {"clients": ["a"], "rounds": 1},
                "model": {"kind": "mlp"},
                "data": data,
                "http": {},
            },
            ("server", "host"),
            "http",
        ),
        "fl-client": (
            {"client": {"name": "a", "server": "http://127.0.0.1:1"}, "data": data, "http": {}},
            ("client", "host"),
            "http",
        ),
        "elastic-coordinator": (
            {
                "name": "c",
                "data_servers": {"d": "http://127.0.0.1:1"},
                "workers": {},
                "security": {},
            },
            ("host",),
            "security",
        ),
        "elastic-data-server": (
            {
                "name": "d",
                "coordinator": "http://127.0.0.1:1",
                "model": "m.json",
                "shard": "s.npz",
                "security": {},
            },
            ("host",),
            "security",
        ),
        "elastic-worker": (
            {"name": "w", "coordinator": "http://127.0.0.1:1", "security": {}},
            ("host",),
            "security",
        ),
    }


def test_every_role_refuses_an_open_address_without_authentication(tmp_path, capsys):
    from fl_process_helpers import to_toml

    for role, (table, host_at, sec) in _role_tables(tmp_path).items():
        place = table
        for part in host_at[:-1]:
            place = place[part]
        security = table[sec]
        if role == "fl-server":
            security["secret"] = "s"  # the FL server always signs; its check is the secret's
        ok = [("127.0.0.1", {}), ("0.0.0.0", {"insecure": True}), ("::1", {})]
        if role != "fl-server":
            ok.append(("0.0.0.0", {"secret": "s"}))
        bad = [] if role == "fl-server" else [("0.0.0.0", {}), ("10.1.2.3", {})]
        for host, extra, expected in [*((h, e, 0) for h, e in ok), *((h, e, 2) for h, e in bad)]:
            place[host_at[-1]] = host
            table[sec] = {**security, **extra}
            path = tmp_path / f"{role}.toml"
            path.write_text(to_toml(table))
            rc = main(["config", "check", str(path), "--role", role])
            err = capsys.readouterr().err
            assert rc == expected, (role, host, extra, err)
            if expected:
                key = ".".join(host_at)
                assert f"{key} = {host!r} is reachable from other machines" in err, err
                assert f"{sec}.insecure = true" in err and f"{sec}.secret_env" in err, err
