"""The leakage audit (`tandem.parties.privacy.attacks`, `.audit`): the attacks against known
leaky and known safe inputs, the bounded seeded sample, and a two-party run whose history,
summary and TensorBoard carry the audit keys, with nothing captured when the audit is off."""

from __future__ import annotations

import asyncio
import json

import jax
import numpy as np
import pytest

from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower, star
from tandem.errors import ConfigError
from tandem.parties.privacy import audit as audit_mod
from tandem.parties.privacy.attacks import attack_auc, cosine_scores, decoder_r2, norm_scores
from tandem.parties.privacy.audit import AuditSettings, PartyAudit, Reservoir
from tandem.parties.rank import auc
from tandem.parties.split import SplitConfig, SplitParty
from tandem.parties.split.reporting import ReportConfig, Reporter, Validation
from tandem.transports.memory import MemoryNetwork


def _labels(rng, n, rate=0.1):
    return (rng.random(n) < rate).astype(np.float32)


# -- attacks -----------------------------------------------------------------------------------
def test_norm_attack_reads_a_label_dependent_norm_and_not_noise():
    rng = np.random.default_rng(0)
    y = _labels(rng, 5000)
    direction = rng.normal(size=(5000, 8))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    leaky = direction * np.where(y > 0.5, 0.9, 0.1)[:, None] * rng.uniform(0.8, 1.2, (5000, 1))
    assert attack_auc(norm_scores(leaky), y > 0.5) > 0.99
    noise = rng.normal(size=(5000, 8))
    assert attack_auc(norm_scores(noise), y > 0.5) == pytest.approx(0.5, abs=0.04)
    # max(AUC, 1 - AUC): a norm that is *smaller* for positives leaks as much
    assert attack_auc(-norm_scores(leaky), y > 0.5) > 0.99


def test_cosine_attack_reads_the_gradients_direction_and_not_noise():
    rng = np.random.default_rng(1)
    y = _labels(rng, 4000, 0.3)
    w = rng.normal(size=16)
    # a binary logistic loss: g = (sigmoid(z) - y) * w, positive rows point against w
    leaky = np.where(y > 0.5, -1.0, 1.0)[:, None] * w + 0.3 * rng.normal(size=(4000, 16))
    known = int(np.flatnonzero(y > 0.5)[0])
    assert attack_auc(cosine_scores(leaky, known), y > 0.5) > 0.99
    noise = rng.normal(size=(4000, 16))
    assert attack_auc(cosine_scores(noise, known), y > 0.5) == pytest.approx(0.5, abs=0.04)
    with pytest.raises(ConfigError, match="outside"):
        cosine_scores(noise, 4000)


def test_attack_auc_is_undefined_with_one_class():
    assert attack_auc(np.arange(5.0), np.zeros(5, bool)) is None


def test_rank_auc_at_millions_of_rows_is_exact():
    rng = np.random.default_rng(2)
    n = 3_000_000
    positive = rng.random(n) < 0.5
    scores = positive + rng.normal(size=n)  # AUC = Phi(1 / sqrt(2)) = 0.7602...
    assert auc(scores, positive) == pytest.approx(0.76025, abs=2e-3)
    # every score tied: exactly one half, whatever the counts
    assert auc(np.zeros(n), positive) == 0.5


def test_decoder_recovers_features_from_a_linear_activation_and_not_from_noise():
    rng = np.random.default_rng(3)
    feats = rng.normal(size=(20_000, 6))
    acts = feats @ rng.normal(size=(6, 16)) + 0.01 * rng.normal(size=(20_000, 16))
    assert decoder_r2(acts, feats, 0.01, np.random.default_rng(0)) > 0.99
    noise = rng.normal(size=(20_000, 16))
    assert decoder_r2(noise, feats, 0.01, np.random.default_rng(0)) == pytest.approx(0, abs=0.1)
    with pytest.raises(ConfigError, match="share"):
        decoder_r2(acts, feats, 1.5, rng)
    assert decoder_r2(acts[:3], feats[:3], 0.01, rng) is None  # nothing held out


# -- the sample ----------------------------------------------------------------------------------
def test_reservoir_is_bounded_uniform_and_seeded():
    def fill(seed):
        res = Reservoir(1000, np.random.default_rng(seed))
        for start in range(0, 100_000, 777):
            rows = np.arange(start, min(start + 777, 100_000))
            res.add(rows, rows * 2.0)
        return res

    res = fill(0)
    idx, doubled = res.sample()
    assert len(idx) == 1000 and res.seen == 100_000
    assert np.array_equal(doubled, idx * 2.0)  # columns stay side by side
    assert len(np.unique(idx)) == 1000
    assert np.mean(idx) == pytest.approx(50_000, rel=0.06)  # uniform over all rows
    assert np.mean(idx < 50_000) == pytest.approx(0.5, abs=0.06)
    assert np.array_equal(fill(0).sample()[0], idx)
    assert not np.array_equal(fill(1).sample()[0], idx)


def test_settings_name_what_is_wrong():
    with pytest.raises(ConfigError, match="privacy.audit_share"):
        AuditSettings(True, share=0.0)
    with pytest.raises(ConfigError, match="100 rows"):
        AuditSettings(True, rows=10)


def test_party_audit_scores_batches_and_bounds_its_memory():
    rng = np.random.default_rng(4)
    audit = PartyAudit(AuditSettings(True, rows=500, seed=1), "binary")
    for epoch in range(2):
        for _ in range(20):
            audit.new_batch()
            y = _labels(rng, 64, 0.2)
            g = np.where(y > 0.5, 1.0, -0.1)[:, None] * rng.normal(1, 0.05, (64, 4))
            for lo in range(0, 64, 16):  # messages of a batch, as micro-batches send them
                audit.sent("grad/b->top", g[lo : lo + 16], y[lo : lo + 16], lambda: None)
            assert sum(len(p[0]) for p in audit._batch["grad/b->top"]) == 64
        record = audit.end_epoch(epoch)
        assert record["epoch"] == epoch and record["audit_rows"] == 20 * 64
        assert record["audit_norm_auc"] > 0.99 and record["audit_cosine_auc"] > 0.99
        assert len(audit._grads) == 0  # a fresh sample per epoch
    assert [r["epoch"] for r in audit.history] == [0, 1]
    assert audit.summary().keys() == {
        "audit_norm_auc",
        "audit_cosine_auc",
        "audit_rows",
    }


def test_softmax_labels_are_skipped_with_a_reason():
    audit = PartyAudit(AuditSettings(True), "softmax")
    audit.sent("grad/b->top", np.ones((4, 2)), np.arange(4), lambda: None)
    record = audit.end_epoch(0)
    assert "binary labels" in record["audit_label_skipped"]
    assert "audit_norm_auc" not in record


# -- two parties ---------------------------------------------------------------------------------
ROWS, VAL = 2000, 400


def _job(audit: AuditSettings | None, rows: int = ROWS, privacy=None):
    """Leader (labels, 3 columns) and follower (4 columns), an imbalanced binary label."""
    rng = np.random.default_rng(5)
    n = rows + VAL
    xl, xf = rng.normal(size=(n, 3)).astype("f4"), rng.normal(size=(n, 4)).astype("f4")
    y = (xl[:, 0] + xf[:, 1] + 0.5 * rng.normal(size=n) > 1.8).astype("f4")  # ~10 % positive
    topo = leader_follower()
    models = {
        "bottom_leader": mlp_stage([3], [8], 4),
        "bottom_follower": mlp_stage([4], [8], 4),
        "top": mlp_stage([4, 4], [8], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=100, groups=2, chunks=2, learning_rate=0.01, seed=2)
    net = MemoryNetwork()

    def split(x):
        return {"train": x[:rows], "test": x[rows:]}

    common = {"config": cfg, "audit": audit, "privacy": privacy}
    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets=split(xl),
        labels=split(y),
        **common,
    )
    follower = SplitParty(
        "follower", topo, models, net.endpoint("follower"), datasets=split(xf), **common
    )
    return leader, follower


async def _train(leader, follower, config: ReportConfig, epochs: int = 2):
    reporter = Reporter(leader, config, Validation("test"))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        async with reporter.opened(0):
            await leader.fit(epochs, after_epoch=reporter.after_epoch)
            summary = await reporter.finish()
        await leader.stop()
    return summary


async def test_a_two_party_run_reports_the_audit_per_epoch(tmp_path):
    leader, follower = _job(AuditSettings(True, share=0.05, seed=3))
    history = tmp_path / "history.jsonl"
    tb = tmp_path / "tb"
    summary = await _train(
        leader, follower, ReportConfig(history=str(history), tensorboard=str(tb))
    )
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    for r in records:
        # the undefended cut gradients of an imbalanced label leak it (Li et al.)
        assert r["audit_norm_auc"] > 0.6 and r["audit_cosine_auc"] > 0.6
        assert r["audit_rows"] == ROWS
    assert summary["audit_norm_auc"] == records[-1]["audit_norm_auc"]
    assert summary["audit_cosine_auc"] == records[-1]["audit_cosine_auc"]
    # the follower audits its own activations, on its own data: per epoch, in its summary
    fol = follower.audit.history
    assert [r["epoch"] for r in fol] == [0, 1]
    assert all(0 <= r["audit_feature_r2"] <= 1 for r in fol)
    assert follower.audit.summary()["audit_feature_r2"] == fol[-1]["audit_feature_r2"]
    assert "audit_norm_auc" not in fol[-1]  # the follower has no labels
    # TensorBoard got the leader's audit scalars
    assert any(b"audit/norm_auc" in p.read_bytes() for p in tb.iterdir())


async def test_under_label_dp_the_audit_scores_against_the_true_labels(monkeypatch):
    """Label DP trains on randomized labels; the audit scores the gradients against the true
    ones (the secret), so strong label DP reads as near chance, and the labels it is handed
    are the true labels of every training row, not the randomized copy."""
    handed: list[np.ndarray] = []
    sent = audit_mod.PartyAudit.sent

    def spy(self, channel, tensor, labels, features):
        if labels is not None:
            handed.append(np.asarray(labels).reshape(-1))
        return sent(self, channel, tensor, labels, features)

    monkeypatch.setattr(audit_mod.PartyAudit, "sent", spy)
    privacy = {"label_dp": {"epsilon": 0.1, "prior": "uniform"}}
    leader, follower = _job(AuditSettings(True, share=0.05, seed=3), privacy=privacy)
    await _train(leader, follower, ReportConfig(), epochs=1)
    true = leader.private.secret["train"]
    trained = leader.labels["train"]
    assert np.mean(true != trained) > 0.3  # eps 0.1: about 47 % of the labels flipped
    assert len(np.concatenate(handed)) == ROWS  # one epoch: every training row once
    assert np.sort(np.concatenate(handed)).tolist() == np.sort(true).tolist()
    record = leader.audit.history[-1]
    # the gradients follow the randomized labels: against the true ones the attacks are blind
    assert record["audit_norm_auc"] < 0.62 and record["audit_cosine_auc"] < 0.62


async def test_nothing_is_captured_when_the_audit_is_off(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the audit captured a tensor while off")

    monkeypatch.setattr(audit_mod.PartyAudit, "sent", refuse)
    monkeypatch.setattr(audit_mod.PartyAudit, "new_batch", refuse)
    for settings in (None, AuditSettings(False)):
        leader, follower = _job(settings, rows=400)
        assert leader.audit is None and leader.handler.audit is None
        assert follower.audit is None and follower.handler.audit is None
        history = tmp_path / "off.jsonl"
        summary = await _train(leader, follower, ReportConfig(history=str(history)), epochs=1)
        (record,) = [json.loads(line) for line in history.read_text().splitlines()]
        assert not [k for k in (*record, *summary) if k.startswith("audit_")]


async def test_each_follower_audits_itself_and_the_leader_reports_the_worst_channel():
    """Star of 2 followers: the leader scores each follower's gradient channel and reports the
    larger AUC; follower0 sends its features through a linear bottom (R^2 near 1), follower1
    through a bottom that ignores them (R^2 near 0)."""
    rng = np.random.default_rng(6)
    n = 1200
    xs = [rng.normal(size=(n, 3)).astype("f4") for _ in range(2)]
    y = (xs[0][:, 0] + xs[1][:, 0] > 1.5).astype("f4")
    topo = star(2)
    zero = mlp_stage([3], [], 4)  # weights set to zero below: its output is the bias only
    models = {
        "bottom_0": mlp_stage(
            [3], [], 4, activate_last=False
        ),  # linear: reveals its three features
        "bottom_1": zero,
        "top": mlp_stage([4, 4], [8], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=100, groups=2, learning_rate=1e-9, optimizer="sgd", seed=0)
    net = MemoryNetwork()
    audit = AuditSettings(True, share=0.05)
    leader = SplitParty(
        "leader", topo, models, net.endpoint("leader"), labels={"train": y}, config=cfg, audit=audit
    )
    params = {"bottom_1": jax.tree_util.tree_map(np.zeros_like, zero.init(jax.random.PRNGKey(0)))}
    followers = [
        SplitParty(
            f"follower{i}",
            topo,
            models,
            net.endpoint(f"follower{i}"),
            datasets={"train": xs[i]},
            config=cfg,
            audit=audit,
            params=params if i == 1 else None,
        )
        for i in range(2)
    ]
    async with asyncio.TaskGroup() as tg:
        for f in followers:
            tg.create_task(f.serve())
        await leader.fit(1)
        await leader.stop()
    (record,) = leader.audit.history
    assert record["audit_rows"] == 2 * n  # both channels scored
    assert record["audit_norm_auc"] is not None and record["audit_cosine_auc"] > 0.6
    r2 = [f.audit.history[-1]["audit_feature_r2"] for f in followers]
    assert r2[0] > 0.99 and r2[1] == pytest.approx(0, abs=0.05)
