"""The [privacy] defenses (tandem.parties.privacy): their noise statistics, their seeding by
row, micro-batch invariance of training with each on, and end-to-end runs from TOML alone."""

from __future__ import annotations

import asyncio
import functools
import math

import jax
import numpy as np
import pytest

from tandem import MemoryNetwork, SplitConfig, SplitParty, leader_follower, mlp_stage
from tandem.errors import ConfigError
from tandem.parties.privacy.accounting import activation_epsilon, epoch_report
from tandem.parties.privacy.config import (
    ActivationDP,
    GradientAlignment,
    GradientDP,
    LabelDP,
    NoPeek,
    Privacy,
    agreed,
)
from tandem.parties.privacy.cut import CutDefenses
from tandem.parties.privacy.feature import defend_activation, distance_correlation
from tandem.parties.privacy.label import defend_gradient, randomize_labels, rr_top_k
from tandem.parties.privacy.rows import row_norms
from tandem.parties.privacy.setup import setup

ROWS, WIDTH = 4000, 16


def _x(rows=ROWS, width=WIDTH, scale=3.0, seed=0):
    return (np.random.default_rng(seed).normal(size=(rows, width)) * scale).astype(np.float32)


def test_activation_dp_clips_every_row_and_adds_noise_of_the_stated_std():
    x = _x()
    cfg = ActivationDP(clip=1.5, noise_multiplier=0.0001)
    out = defend_activation(x, cfg, seed=1, secret=9, step=0, ids=np.arange(ROWS))
    assert row_norms(out).max() <= 1.5 + 1e-2
    cfg = ActivationDP(clip=1.5, noise_multiplier=2.0)
    zero = np.zeros_like(x)
    noisy = defend_activation(zero, cfg, seed=1, secret=9, step=0, ids=np.arange(ROWS))
    assert abs(noisy.mean()) < 0.02 * 3.0
    assert noisy.std() == pytest.approx(3.0, rel=0.02)  # noise_multiplier * clip


def test_noise_is_keyed_by_seed_step_and_row_not_by_the_batch_it_travels_in():
    x, ids = _x(64), np.arange(100, 164)
    cfg = ActivationDP(clip=1.0, noise_multiplier=1.0)
    whole = defend_activation(x, cfg, seed=3, secret=9, step=5, ids=ids)
    parts = np.concatenate(
        [
            defend_activation(x[a:b], cfg, seed=3, secret=9, step=5, ids=ids[a:b])
            for a, b in ((0, 7), (7, 64))
        ]
    )
    np.testing.assert_array_equal(whole, parts)
    assert not np.allclose(whole, defend_activation(x, cfg, seed=4, secret=9, step=5, ids=ids))
    assert not np.allclose(whole, defend_activation(x, cfg, seed=3, secret=9, step=6, ids=ids))


def test_a_peer_holding_the_negotiated_seed_cannot_regenerate_a_partys_noise():
    """Every party knows the negotiated seed, the step, the row ids and the stage names: the
    noise a party adds (and label DP's coins) must also be keyed by a secret of its own, or the
    receiver regenerates the noise and subtracts it."""
    privacy = Privacy(
        seed=7,
        gradient_dp=GradientDP(clip=0.5, noise_multiplier=5.0),
        activation_dp=ActivationDP(clip=1.0, noise_multiplier=5.0),
        label_dp=LabelDP(epsilon=0.5, prior="uniform"),
    )
    x, ids = _x(64), np.arange(64)
    sender, peer = CutDefenses(privacy, label_owner=True), CutDefenses(privacy, label_owner=True)
    for channel in ("act/bottom_follower->top", "grad/bottom_follower->top"):
        sent = sender.outgoing(channel, x, ids=ids, step=3, rows=64)
        assert not np.allclose(sent, peer.outgoing(channel, x, ids=ids, step=3, rows=64))
    y = (np.arange(400) % 2).astype("f4")
    one, two = (setup(privacy, {"train": y}, loss="binary").labels["train"] for _ in range(2))
    assert not np.array_equal(one, two)
    # a party's own noise_seed (never sent) reproduces its noise, e.g. for tests
    mine = privacy.model_copy(update={"noise_seed": 11})
    np.testing.assert_array_equal(
        CutDefenses(mine).outgoing("act/b->top", x, ids=ids, step=3, rows=64),
        CutDefenses(mine).outgoing("act/b->top", x, ids=ids, step=3, rows=64),
    )
    assert agreed(privacy.spec_fields()["privacy"] | {"noise_seed": 11}).noise_seed is None
    assert agreed(privacy.spec_fields()["privacy"], mine).noise_seed == 11


def test_gradient_dp_bounds_each_rows_gradient_of_its_own_loss():
    rows = 32
    g = _x(rows) / rows  # the cut gradient of a batch's mean loss
    out = defend_gradient(
        g,
        alignment=None,
        dp=GradientDP(clip=0.5, noise_multiplier=0.0),
        seed=0,
        secret=9,
        step=0,
        ids=np.arange(rows),
        rows=rows,
    )
    assert (row_norms(out * rows) <= 0.5 + 1e-5).all()
    noisy = defend_gradient(
        np.zeros((ROWS, WIDTH), np.float32),
        alignment=None,
        dp=GradientDP(clip=0.5, noise_multiplier=1.0),
        seed=0,
        secret=9,
        step=0,
        ids=np.arange(ROWS),
        rows=1,
    )
    assert noisy.std() == pytest.approx(0.5, rel=0.02) and abs(noisy.mean()) < 0.01


def test_norm_alignment_gives_every_row_one_norm_so_the_norm_attack_reads_nothing():
    g = _x(256) * np.random.default_rng(1).uniform(0.01, 10, size=(256, 1)).astype(np.float32)
    out = defend_gradient(
        g,
        alignment=GradientAlignment(norm=2.0, noise=0.0),
        dp=None,
        seed=0,
        secret=9,
        step=0,
        ids=np.arange(256),
        rows=1,
    )
    np.testing.assert_allclose(row_norms(out), 2.0, rtol=1e-5)
    # direction kept without noise; the noise is std noise * norm per coordinate
    cos = np.sum(out * g, 1) / row_norms(out) / row_norms(g)
    np.testing.assert_allclose(cos, 1.0, rtol=1e-5)
    noisy = defend_gradient(
        np.zeros((ROWS, WIDTH), np.float32) + 1e-3,
        alignment=GradientAlignment(norm=2.0, noise=0.5),
        dp=None,
        seed=0,
        secret=9,
        step=0,
        ids=np.arange(ROWS),
        rows=1,
    )
    assert (noisy - np.mean(noisy, 0)).std() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_rr_flip_rate_matches_epsilon(eps):
    y = np.random.default_rng(0).integers(0, 2, 20000).astype(np.float32)
    out = randomize_labels(
        y, LabelDP(epsilon=eps, prior="uniform"), loss="binary", seed=1, secret=9
    )
    flip = float(np.mean(out != y))
    want = 1 / (math.exp(eps) + 1)
    assert abs(flip - want) < 4 * math.sqrt(want * (1 - want) / len(y))
    y3 = np.random.default_rng(1).integers(0, 3, 30000)
    out3 = randomize_labels(
        y3, LabelDP(epsilon=eps, prior="uniform"), loss="softmax", seed=1, secret=9
    )
    want3 = 2 / (math.exp(eps) + 2)
    assert abs(np.mean(out3 != y3) - want3) < 4 * math.sqrt(want3 * (1 - want3) / len(y3))


def test_rr_with_prior_keeps_only_the_classes_worth_randomizing_over():
    prior = np.array([0.7, 0.25, 0.05])
    assert list(rr_top_k(prior, 0.1)) == [0]  # weak epsilon: the most likely class only
    assert list(rr_top_k(prior, 2.0)) == [0, 1]
    assert list(rr_top_k(prior, 3.0)) == [0, 1, 2]
    assert list(rr_top_k(np.full(4, 0.25), 1.0)) == [0, 1, 2, 3]  # uniform: plain RR
    y = np.random.default_rng(0).choice(3, size=20000, p=prior)
    out = randomize_labels(y, LabelDP(epsilon=2.0), loss="softmax", seed=0, secret=9)
    assert set(np.unique(out)) == {0, 1}
    keep = math.exp(2.0) / (math.exp(2.0) + 1)
    inside = y < 2
    assert np.mean(out[inside] == y[inside]) == pytest.approx(keep, abs=0.01)
    with pytest.raises(ConfigError, match="loss is 'mse'"):
        randomize_labels(y, LabelDP(epsilon=1.0), loss="mse", seed=0, secret=9)


def test_distance_correlation_is_one_for_a_similarity_and_small_for_independence():
    x = jax.numpy.asarray(_x(300, 4))
    assert float(distance_correlation(x, 2.0 * x + 1.0)) == pytest.approx(1.0, abs=1e-3)
    other = jax.numpy.asarray(_x(300, 4, seed=9))
    assert float(distance_correlation(x, other)) < 0.3  # the V-statistic's bias at 300 rows


def test_the_accountant_composes_steps_and_grows_with_them():
    one = activation_epsilon(1.0, 0.01, 100, 1e-5)
    two = activation_epsilon(1.0, 0.01, 200, 1e-5)
    assert 0 < one < two
    assert activation_epsilon(4.0, 0.01, 100, 1e-5) < one
    assert activation_epsilon(1.0, 0.01, 0, 1e-5) == 0.0


def test_the_reported_epsilon_counts_each_rows_releases_without_subsampling_amplification():
    """The leader draws the batches and receives every row's activation under its id, so which
    rows a step released is no secret (no amplification by sampling): each row is one Gaussian
    mechanism per epoch it was sent in (2.43 at these sizes was reported before, 19.05 is due)."""
    privacy = Privacy(activation_dp=ActivationDP(clip=1.0, noise_multiplier=1.0, delta=1e-5))
    rows, batch, epochs = 20_000, 256, 10
    steps = epochs * math.ceil(rows / batch)
    got = epoch_report(privacy, batch_size=batch, samples=rows, steps=steps)["privacy_epsilon"]
    assert got == pytest.approx(activation_epsilon(1.0, 1.0, epochs, 1e-5))
    assert got > 15
    more = epoch_report(privacy, batch_size=batch, samples=rows, steps=steps + 1)
    assert more["privacy_epsilon"] == pytest.approx(activation_epsilon(1.0, 1.0, epochs + 1, 1e-5))


# -- training: micro-batch invariance, composition -------------------------------------------
def _data(rows=192):
    rng = np.random.default_rng(0)
    xl, xf = rng.normal(size=(rows, 5)).astype("f4"), rng.normal(size=(rows, 4)).astype("f4")
    y = (xl[:, 0] + xf[:, 0] > 0).astype("f4")
    return xl, xf, y


def _models():
    return {
        "bottom_leader": mlp_stage([5], [8], 6),
        "bottom_follower": mlp_stage([4], [8], 6),
        "top": mlp_stage([6, 6], [8], 1, activate_last=False),
    }


def train(privacy: Privacy, *, groups: int, chunks: int = 1, compress: str = "none", epochs=2):
    """Leader and follower in one process; returns (leader params, follower params, history)."""
    xl, xf, y = _data()
    topo, models = leader_follower(), _models()

    async def run():
        net = MemoryNetwork()
        cfg = SplitConfig(
            batch_size=48,
            groups=groups,
            chunks=chunks,
            loss="binary",
            learning_rate=0.05,
            optimizer="sgd",
            compress=compress,
        )
        leader = SplitParty(
            "leader",
            topo,
            models,
            net.endpoint("leader"),
            datasets={"train": xl},
            labels={"train": y},
            config=cfg,
            privacy=privacy,
        )
        follower = SplitParty(
            "follower",
            topo,
            models,
            net.endpoint("follower"),
            datasets={"train": xf},
            config=cfg,
            privacy=privacy,
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follower.serve())
            history = await leader.fit(epochs=epochs)
            await leader.stop()
        await follower.wait_batches(leader.batches_done)
        return leader.handler.params, follower.handler.params, history

    return asyncio.run(run())


@functools.lru_cache(maxsize=1)
def _plain():
    return train(Privacy(), groups=1)


DEFENSES = {
    "gradient_alignment": Privacy(
        seed=2, noise_seed=5, gradient_alignment=GradientAlignment(norm=0.5, noise=0.3)
    ),
    "gradient_dp": Privacy(
        seed=2, noise_seed=5, gradient_dp=GradientDP(clip=0.5, noise_multiplier=0.5)
    ),
    "activation_dp": Privacy(
        seed=2, noise_seed=5, activation_dp=ActivationDP(clip=1.0, noise_multiplier=0.5)
    ),
    "nopeek": Privacy(seed=2, noise_seed=5, nopeek=NoPeek(weight=0.5)),
    "label_dp": Privacy(seed=2, noise_seed=5, label_dp=LabelDP(epsilon=1.0, prior="uniform")),
}


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(DEFENSES))
def test_each_defense_gives_the_same_parameters_for_groups_1_2_and_4(name):
    ref = train(DEFENSES[name], groups=1)
    plain = _plain()
    with pytest.raises(AssertionError):  # the defense changes training
        _close(ref[1], plain[1])
    for groups, chunks in ((2, 3), (4, 1)):
        got = train(DEFENSES[name], groups=groups, chunks=chunks)
        _close(got[0], ref[0])
        _close(got[1], ref[1])


@pytest.mark.parametrize("compress", ["int8", "topk"])
def test_a_defense_composes_with_cut_compression_for_any_micro_batching(compress):
    """Defended, then compressed (int8 scales and top-k error feedback are per row): groups 1
    and 3 (with chunks) still agree."""
    privacy = Privacy(
        seed=1,
        noise_seed=5,
        gradient_dp=GradientDP(clip=0.5, noise_multiplier=0.3),
        activation_dp=ActivationDP(clip=1.0, noise_multiplier=0.3),
    )
    ref = train(privacy, groups=1, compress=compress)
    got = train(privacy, groups=3, chunks=2, compress=compress)
    _close(got[0], ref[0])
    _close(got[1], ref[1])


def test_a_party_takes_the_privacy_table_as_a_mapping_and_checks_it():
    xl, _, y = _data()
    topo, models, net = leader_follower(), _models(), MemoryNetwork()

    def leader(privacy, loss="binary"):
        return SplitParty(
            "leader",
            topo,
            models,
            net.endpoint("leader"),
            datasets={"train": xl},
            labels={"train": y},
            config=SplitConfig(loss=loss),
            privacy=privacy,
        )

    party = leader({"seed": 3, "nopeek": {"weight": 0.5}})
    assert party.privacy == Privacy(seed=3, nopeek=NoPeek(weight=0.5))
    with pytest.raises(ConfigError, match="nopeek.weight"):
        leader({"nopeek": {"weight": -1.0}})
    with pytest.raises(ConfigError, match="loss is 'mse'"):
        leader({"label_dp": {"epsilon": 1.0}}, loss="mse")
    flipped = leader({"label_dp": {"epsilon": 0.5, "prior": "uniform"}}).labels["train"]
    assert 0 < np.mean(flipped != y) < 0.6  # the labels it trains on are randomized
