"""[privacy] in the task spec: recorded (so hashed) when on, the leader's choice binds, a party
stating otherwise refuses naming both values; and `tandem party` runs with defenses from the
TOML alone (two parties, and a star of three), reporting the accounted epsilon."""

from __future__ import annotations

import json

import pytest

from tandem.parties.privacy.config import Privacy, agreed, mismatch_reasons
from tandem.parties.split.spec import SpecError, TaskSpec
from tests.test_cut_compress import _two_party_spec

GRADIENT_DP = {"gradient_dp": {"clip": 0.5, "noise_multiplier": 0.5}}


def _spec(privacy=None):
    return _two_party_spec(**({} if privacy is None else {"privacy": privacy}))


def test_the_spec_records_privacy_only_when_on_and_it_changes_the_hash():
    off, on = _spec(), _spec(GRADIENT_DP)
    assert "privacy" not in off.hyper
    assert _spec({}).spec_hash() == off.spec_hash()  # all off hashes as before
    assert on.hyper["privacy"] == {"seed": 0, **GRADIENT_DP}
    assert on.spec_hash() != off.spec_hash()
    other = _spec({"gradient_dp": {"clip": 0.5, "noise_multiplier": 0.6}})
    assert other.spec_hash() != on.spec_hash()
    assert TaskSpec.from_json(on.canonical()).spec_hash() == on.spec_hash()
    assert _spec({"seed": 3}).hyper["privacy"] == {"seed": 3}


def test_a_party_stating_other_privacy_is_refused_naming_both_values():
    spec = _spec(GRADIENT_DP)
    stated = Privacy.model_validate({"gradient_dp": {"clip": 1.0}}).stated()
    reasons = spec.check_local("A", features=3, samples=16, privacy=stated)
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith("privacy.gradient_dp: leader says {'clip': 0.5,")
    assert "this party says {'clip': 1.0," in reasons[0]
    off = _spec().check_local("A", features=3, samples=16, privacy=stated)
    mine = stated["gradient_dp"]
    assert off == [
        f"privacy.gradient_dp: leader says off, this party says {mine!r}; state the leader's "
        "value in [privacy] (or remove gradient_dp: a party adopts the leader's)"
    ]
    # what a party does not state it adopts; the same statement agrees
    assert spec.check_local("A", features=3, samples=16, privacy={}) == []
    same = Privacy.model_validate(GRADIENT_DP).stated()
    assert spec.check_local("A", features=3, samples=16, privacy=same) == []
    seed = mismatch_reasons({"seed": 1}, {"seed": 2})
    assert seed and seed[0].startswith("privacy.seed: leader says 1, this party says 2")


def test_audit_keys_are_each_partys_own_and_a_malformed_spec_is_refused():
    mine = Privacy(audit=True, audit_share=0.05)
    got = agreed({"seed": 4, **GRADIENT_DP}, mine)
    assert got.audit and got.audit_share == 0.05 and got.seed == 4
    assert got.gradient_dp is not None and got.gradient_dp.clip == 0.5
    assert "audit" not in mine.stated() and "audit" not in (mine.spec_fields() or {})
    body = _spec(GRADIENT_DP).to_dict()
    body["hyper"]["privacy"] = {"gradient_dp": {"clip": -1}}
    with pytest.raises(SpecError, match="hyper.privacy"):
        TaskSpec.from_dict(body)


def test_party_config_checks_privacy_keys(tmp_path):
    from tandem.parties.split.process.party_config import PartyConfigError, load_party_config
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=1)
    job.cfg["bank"]["privacy"] = {"gradient_dp": {"clip": 0.0}}
    job.write()
    with pytest.raises(PartyConfigError, match=r"privacy\.gradient_dp\.clip"):
        load_party_config(job.path("bank"))
    job.cfg["bank"]["privacy"] = {"label_dp": {"epsilon": 1.0, "prior": "flat"}}
    job.write()
    with pytest.raises(PartyConfigError, match=r"privacy\.label_dp\.prior"):
        load_party_config(job.path("bank"))


def _finish(procs):
    out = {}
    for name, proc in procs.items():
        rc, line, err = proc.finish(180)
        assert rc == 0 and line is not None, err[-3000:]
        out[name] = line
    return out


@pytest.mark.slow
def test_two_tandem_party_processes_train_with_defenses_from_toml_alone(tmp_path):
    """bank (labels) clips and noises its cut gradients; shop noises its activations (stated
    in its own TOML too, agreeing) and regularises its bottom with NoPeek; both audit what
    they send (``audit = true``: each party's own key), into the history and final lines."""
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=3)
    privacy = {
        "seed": 5,
        "audit": True,
        **GRADIENT_DP,
        "activation_dp": {"clip": 1.0, "noise_multiplier": 0.3, "delta": 1e-5},
        "nopeek": {"weight": 0.2},
    }
    job.cfg["bank"]["privacy"] = privacy
    job.cfg["bank"]["log"] = {"history": "history.jsonl"}
    job.cfg["shop"]["privacy"] = {"activation_dp": privacy["activation_dp"], "audit": True}
    lines = _finish({p: job.start(p) for p in ("bank", "shop")})
    lead, fol = lines["bank"], lines["shop"]
    assert lead["status"] == fol["status"] == "done"
    assert lead["spec_hash"] == fol["spec_hash"]
    assert 0 < lead["privacy_epsilon"] < 1e3 and lead["privacy_delta"] == 1e-5
    history = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    eps = [h["privacy_epsilon"] for h in history]
    assert len(eps) == 3 and eps == sorted(eps) and eps[0] < eps[-1] == lead["privacy_epsilon"]
    assert lead["test_accuracy"] > 0.6
    _assert_audited(history, lead, fol)
    for party in ("bank", "shop"):  # each keeps its own noise key beside its checkpoints
        assert (tmp_path / "ckpt" / party / f"{party}.noise-key").stat().st_mode & 0o777 == 0o600


def _assert_audited(history, lead, followers):
    """The leader's audit keys in every epoch's history record and its final line; each
    auditing follower's feature R^2 in its own final line."""
    for key in ("audit_norm_auc", "audit_cosine_auc"):
        assert all(0.5 <= h[key] <= 1 for h in history), history
        assert lead[key] == history[-1][key]
    for fol in followers if isinstance(followers, list) else [followers]:
        assert 0 <= fol["audit_feature_r2"] <= 1 and "audit_norm_auc" not in fol


@pytest.mark.slow
def test_a_follower_stating_other_defenses_refuses_the_spec(tmp_path):
    from tests.table_helpers import TableJob

    job = TableJob(tmp_path, ["bank", "shop"], epochs=1)
    job.cfg["bank"]["privacy"] = {"activation_dp": {"clip": 1.0, "noise_multiplier": 0.3}}
    job.cfg["shop"]["privacy"] = {"activation_dp": {"clip": 2.0, "noise_multiplier": 0.3}}
    procs = {p: job.start(p) for p in ("bank", "shop")}
    text = ""
    for proc in procs.values():
        rc, line, err = proc.finish(120)
        assert rc != 0 or (line or {}).get("status") != "done"
        text += err + json.dumps(line)
    assert "privacy.activation_dp: leader says {'clip': 1.0" in text, text[-3000:]
    assert "this party says {'clip': 2.0" in text


@pytest.mark.slow
def test_three_tandem_party_processes_in_a_star_train_with_defenses(tmp_path):
    """bank leads shop and telco (a star): RR-with-prior labels and norm alignment on bank,
    activation DP on both followers, each from its TOML alone; bank and shop audit what they
    send, telco does not (the audit is each party's own)."""
    from tests.table_helpers import TableJob

    parties = ["bank", "shop", "telco"]
    job = TableJob(
        tmp_path,
        parties,
        epochs=2,
        topology={"kind": "star", "leader": "bank", "followers": parties[1:]},
    )
    job.cfg["bank"]["privacy"] = {
        "label_dp": {"epsilon": 3.0, "prior": "uniform"},
        "gradient_alignment": {"norm": 0.5, "noise": 0.2},
        "activation_dp": {"clip": 1.0, "noise_multiplier": 0.3},
        "audit": True,
    }
    job.cfg["bank"]["log"] = {"history": "history.jsonl"}
    job.cfg["shop"]["privacy"] = {"audit": True}
    lines = _finish({p: job.start(p) for p in parties})
    assert {x["status"] for x in lines.values()} == {"done"}
    assert len({x["spec_hash"] for x in lines.values()}) == 1
    assert lines["bank"]["privacy_epsilon"] > 0
    history = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2
    _assert_audited(history, lines["bank"], [lines["shop"]])
    assert not [k for k in lines["telco"] if k.startswith("audit_")]
