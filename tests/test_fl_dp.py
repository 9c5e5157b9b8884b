"""Client-level differential privacy (`tandem.parties.fl.dp`): clipping bounds, the noise's
deviation, the accountant against a direct dp-accounting computation, adaptive clipping
converging to its quantile, the refused combinations, and rounds run end to end (central,
and distributed under secure aggregation) with epsilon in every round's report, and the epsilon
against the server (no amplification by sampling) under distributed DP."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from fl_helpers import small_setup
from tandem.errors import ConfigError
from tandem.parties.fl.aggregator import coordinate_median
from tandem.parties.fl.dp import (
    ORDERS,
    DPConfig,
    clip_l2,
    epsilon,
    next_clip,
    noise_for_epsilon,
    noisy_sum,
    unamplified_epsilon,
)
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.private_config import DPTable
from tandem.parties.fl.robust import krum
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.server import FLConfig


@pytest.fixture(scope="module")
def setup():
    return small_setup()


def test_clipping_bounds_every_update_and_leaves_small_ones_alone():
    rng = np.random.default_rng(0)
    big = rng.normal(0, 10, 1000).astype(np.float32)
    clipped, within = clip_l2(big, 2.5)
    assert not within and clipped.dtype == np.float32
    assert np.linalg.norm(clipped) == pytest.approx(2.5, rel=1e-5)
    np.testing.assert_allclose(clipped / 2.5, big / np.linalg.norm(big), rtol=1e-5)
    small = np.full(4, 0.1, np.float32)
    same, within = clip_l2(small, 2.5)
    assert within and same.tobytes() == small.tobytes()
    ups = [rng.normal(0, s, 500).astype(np.float32) for s in (0.01, 1.0, 100.0)]
    total, within = noisy_sum(ups, 1.0, 0.0, rng)
    assert within == 1 and np.linalg.norm(total) <= 3.0 + 1e-5


def test_the_noise_has_the_configured_deviation():
    zeros = [np.zeros(200_000, np.float32)] * 3
    total, _ = noisy_sum(zeros, 1.0, 0.7, np.random.default_rng(1))
    assert float(np.std(total)) == pytest.approx(0.7, rel=0.01)
    assert abs(float(np.mean(total))) < 0.01


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_the_accountant_matches_a_direct_dp_accounting_computation(sampling):
    z, rounds, m, n, delta = 1.1, 40, 10, 100, 1e-5
    if sampling == "poisson":
        acc = rdp.RdpAccountant(ORDERS)
        event = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
    else:
        # replace-one: one client replaced moves the clipped sum by up to 2 C, so the
        # multiplier dp-accounting takes (noise over sensitivity) is z / 2
        acc = rdp.RdpAccountant(ORDERS, dp_accounting.NeighboringRelation.REPLACE_ONE)
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            n, m, dp_accounting.GaussianDpEvent(z / 2)
        )
    acc.compose(event, rounds)
    got = epsilon(z, rounds=rounds, sampled=m, clients=n, delta=delta, sampling=sampling)
    assert got == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert epsilon(z, rounds=0, sampled=m, clients=n, delta=delta) == 0.0
    fewer = epsilon(z, rounds=rounds // 2, sampled=m, clients=n, delta=delta, sampling=sampling)
    assert 0 < fewer < got  # composition: epsilon grows with the rounds


def test_the_epsilon_against_the_server_is_unamplified_gaussian_composition():
    """Against the server, which knows who was sampled: k plain Gaussians of multiplier z
    (dp-accounting directly), larger than the amplified epsilon of the same rounds."""
    z, k, delta = 1.0, 10, 1e-5
    acc = rdp.RdpAccountant(ORDERS)
    acc.compose(dp_accounting.GaussianDpEvent(z), k)
    got = unamplified_epsilon(z, rounds=k, delta=delta)
    assert got == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert got == pytest.approx(19.8017, abs=1e-3)  # the figure docs/federated.md quotes
    assert unamplified_epsilon(z, rounds=0, delta=delta) == 0.0
    for sampling in ("poisson", "fixed"):
        amplified = epsilon(z, rounds=k, sampled=10, clients=100, delta=delta, sampling=sampling)
        assert amplified < unamplified_epsilon(z, rounds=k, delta=delta, sampling=sampling)
    replaced = unamplified_epsilon(z, rounds=k, delta=delta, sampling="fixed")
    assert replaced == pytest.approx(unamplified_epsilon(z / 2, rounds=k, delta=delta))
    assert epsilon(z, rounds=k, sampled=100, clients=100, delta=delta) == pytest.approx(got)


def test_the_noise_solved_for_a_target_epsilon_meets_it_tightly():
    kw = dict(rounds=20, sampled=10, clients=10, delta=0.1)
    for target in (8.0, 1.0):
        z = noise_for_epsilon(target, **kw)
        assert epsilon(z, **kw) <= target < epsilon(z * 0.99, **kw)


def test_adaptive_clipping_converges_to_the_target_quantile():
    rng = np.random.default_rng(2)
    cfg = DPConfig(clip=0.05, adaptive=True, quantile=0.7, clip_lr=0.2, count_std=5.0)
    draw = lambda: rng.lognormal(0.0, 0.5, 100)  # noqa: E731 - the clients' update norms
    truth = float(np.quantile(rng.lognormal(0.0, 0.5, 1_000_000), 0.7))
    clip, seen = cfg.clip, []
    for _ in range(400):
        norms = draw()
        clip = next_clip(cfg, clip, int((norms <= clip).sum()), norms.size, rng)
        seen.append(clip)
    assert float(np.mean(seen[-100:])) == pytest.approx(truth, rel=0.05)
    # Andrew et al., Theorem 1: both releases together cost one Gaussian of multiplier z
    z_delta = cfg.payload_multiplier()
    assert z_delta**-2 + (2 * cfg.count_std) ** -2 == pytest.approx(cfg.noise_multiplier**-2)


def test_refused_combinations_name_the_reason():
    dp = DPConfig()
    with pytest.raises(ConfigError, match="needs the mean aggregation rule"):
        FLConfig(dp=dp, aggregator=coordinate_median())
    with pytest.raises(ConfigError, match="needs the mean aggregation rule"):
        FLConfig(dp=dp, aggregator=krum(1))
    with pytest.raises(ConfigError, match='"distributed" needs secure aggregation'):
        FLConfig(dp=DPConfig(mode="distributed"))
    with pytest.raises(ConfigError, match="clipped-or-not bits"):
        FLConfig(dp=DPConfig(adaptive=True, count_std=5.0), secagg=SecAggConfig())
    with pytest.raises(ConfigError, match="both add noise"):
        FLConfig(dp=dp, secagg=SecAggConfig(noise_std=0.1))
    with pytest.raises(ConfigError, match=r"count_std = 0.1 is too small"):
        DPConfig(adaptive=True, count_std=0.1)
    with pytest.raises(ConfigError, match=r"dp.mode must be one of"):
        DPConfig(mode="local")
    FLConfig(dp=dp, secagg=SecAggConfig())  # central noise added to the secure sum: fine


def test_the_dp_table_solves_the_noise_and_defaults_delta():
    table = DPTable.model_validate({"target_epsilon": 8.0, "clip": 0.5})
    built = table.build(rounds=10, sampled=5, clients=20)
    assert built.delta == pytest.approx(1 / 20) and built.clip == 0.5
    assert epsilon(built.noise_multiplier, rounds=10, sampled=5, clients=20, delta=0.05) <= 8.0
    adaptive = DPTable.model_validate({"target_epsilon": 1.0, "adaptive": True})
    strict = adaptive.build(rounds=30, sampled=20, clients=100)  # a large z: count_std follows
    assert strict.noise_multiplier > 1 and strict.payload_multiplier() > strict.noise_multiplier
    for bad in ({}, {"target_epsilon": 1.0, "noise_multiplier": 1.0}):
        with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
            DPTable.model_validate(bad)


def _moved(server, trainer) -> float:
    return float(np.linalg.norm(server.model - trainer.init_vec))


@pytest.mark.parametrize("secure", [False, True], ids=["central", "distributed"])
async def test_private_rounds_run_end_to_end_and_report_epsilon(setup, secure):
    """FedAvg at server lr 1 moves the model by the mean of clipped updates plus noise: with
    tiny noise the step is at most the clip norm, and the clipped run moves less than a
    plain one. Epsilon grows each round as the accountant says."""
    data, trainer = setup
    base = dict(rounds=2, fraction=1.0, round_timeout=20.0, seed=3)
    plain = await run_memory_federation(data, trainer, FLConfig(**base))
    clip = 0.05
    mode = "distributed" if secure else "central"
    dp = DPConfig(clip=clip, noise_multiplier=1e-4, delta=1e-3, mode=mode)
    sec = SecAggConfig(clip=1.0, stage_timeout=5.0) if secure else None
    server = await run_memory_federation(data, trainer, FLConfig(**base, dp=dp, secagg=sec))
    assert [r.accepted for r in server.reports] == [["c0", "c1", "c2", "c3"]] * 2
    assert _moved(server, trainer) <= 2 * clip * 1.01 < _moved(plain, trainer)
    eps = [r.epsilon for r in server.reports]
    want = [epsilon(1e-4, rounds=k, sampled=4, clients=4, delta=1e-3) for k in (1, 2)]
    assert eps == pytest.approx(want) and eps[0] < eps[1]
    assert [r.clip for r in server.reports] == [clip, clip]
    assert server.participation == {c: 2 for c in ("c0", "c1", "c2", "c3")}
    vs_server = [r.epsilon_vs_server for r in server.reports]
    if secure:  # every client took part in each round: sampling amplified nothing
        assert vs_server == pytest.approx(
            [unamplified_epsilon(1e-4, rounds=k, delta=1e-3) for k in (1, 2)]
        )
        assert vs_server == pytest.approx(eps)
    else:  # the trusted server of central DP: no epsilon bounds what it sees
        assert vs_server == [None, None]
    if secure:  # shares sized for the fewest survivors the secure sum completes with
        thr = sec.threshold(4)
        assert server.secagg.noise_std == pytest.approx(1e-4 * clip * math.sqrt(4 / thr))


async def test_sampled_distributed_rounds_report_a_larger_epsilon_against_the_server(setup):
    """3 of 4 clients a round for 3 rounds: the amplified epsilon is for those who do not know
    who was sampled; the server knows, and its figure composes the busiest client's rounds
    unamplified: larger, for the same run."""
    data, trainer = setup
    dp = DPConfig(clip=0.05, noise_multiplier=1.0, delta=1e-3, mode="distributed")
    cfg = FLConfig(
        rounds=3, fraction=0.75, round_timeout=20.0, seed=3, dp=dp,
        secagg=SecAggConfig(clip=1.0, stage_timeout=5.0),
    )  # fmt: skip
    server = await run_memory_federation(data, trainer, cfg)
    counts: dict[str, int] = {}
    for r in server.reports:
        assert len(r.accepted) == 3, r
        for c in r.accepted:
            counts[c] = counts.get(c, 0) + 1
    assert server.participation == counts and max(counts.values()) == 3
    last = server.reports[-1]
    assert last.epsilon == pytest.approx(epsilon(1.0, rounds=3, sampled=3, clients=4, delta=1e-3))
    assert last.epsilon_vs_server == pytest.approx(unamplified_epsilon(1.0, rounds=3, delta=1e-3))
    assert last.epsilon_vs_server > last.epsilon


def test_under_dp_the_sampling_is_secret_from_whoever_knows_the_seed(setup):
    """The amplified epsilon assumes that no one but the server knows who each round sampled;
    `server.seed` (0 by default) is no secret, so under [dp] the sampling is keyed by the
    server process's own fresh bits as well; without [dp] the seed alone decides it."""
    from tandem.parties.fl.server import FLServer
    from tandem.transports.memory import MemoryNetwork

    _, trainer = setup
    clients = [f"c{i}" for i in range(40)]

    def picks(cfg: FLConfig) -> list[list[str]]:
        server = FLServer(MemoryNetwork().endpoint("server"), clients, trainer, cfg)
        return [server.sample(r)[0] for r in range(5)]

    plain = FLConfig(rounds=5, fraction=0.25, seed=3)
    assert picks(plain) == picks(plain)
    private = FLConfig(rounds=5, fraction=0.25, seed=3, dp=DPConfig(clip=1.0, noise_multiplier=1.0))
    assert picks(private) != picks(private)
