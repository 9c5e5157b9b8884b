"""Robust aggregation (`tandem.parties.fl.robust`): Krum and Multi-Krum pick the honest updates
under x1000 and sign-flip attackers, norm bounding caps each update, the rules are chosen by
the server TOML's ``[aggregation]``, secure aggregation refuses them, and a federation with an
attacking client keeps its accuracy under Multi-Krum where the mean collapses."""

from __future__ import annotations

import numpy as np
import pytest

from fl_helpers import small_setup
from tandem.errors import ConfigError
from tandem.parties.fl.aggregator import coordinate_median, trimmed_mean, weighted_mean
from tandem.parties.fl.client import FLClient
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.private_config import AggregationTable
from tandem.parties.fl.robust import build_rule, krum, krum_scores, multi_krum, norm_bound
from tandem.parties.fl.secagg import SecAggConfig
from tandem.parties.fl.server import FLConfig


def honest_and_attackers(attack: str, honest: int = 8, bad: int = 2, d: int = 50):
    rng = np.random.default_rng(4)
    center = rng.normal(0, 1, d).astype(np.float32)
    good = [center + rng.normal(0, 0.1, d).astype(np.float32) for _ in range(honest)]
    if attack == "scale":
        evil = [1000 * g for g in good[:bad]]
    else:
        evil = [-g for g in good[:bad]]
    return center, good, evil


@pytest.mark.parametrize("attack", ["scale", "sign"])
def test_krum_picks_an_honest_update_under_attack(attack):
    center, good, evil = honest_and_attackers(attack)
    updates = evil + good  # attackers first: the choice does not follow the order
    chosen, state = krum(2).aggregate((), updates, [1] * len(updates))
    assert state == () and chosen.dtype == np.float32
    assert any(chosen.tobytes() == g.tobytes() for g in good)
    scores = krum_scores(np.stack(updates), 2)
    assert scores[:2].min() > scores[2:].max()
    mean, _ = multi_krum(2).aggregate((), updates, [1] * len(updates))
    np.testing.assert_allclose(mean, np.mean(good, axis=0), rtol=1e-5)  # the n - f best
    three, _ = multi_krum(2, 3).aggregate((), updates, [1] * len(updates))
    assert np.linalg.norm(three - center) < 0.6  # 3 honest: noise 0.1 * sqrt(50 / 3)
    plain, _ = weighted_mean().aggregate((), updates, [1] * len(updates))
    assert np.linalg.norm(plain - center) > 5 * np.linalg.norm(three - center)


def test_norm_bounding_caps_each_update_then_averages_by_weight():
    u = [np.array([3.0, 4.0], np.float32), np.array([0.3, 0.4], np.float32)]
    out, _ = norm_bound(1.0).aggregate((), u, [1, 3])
    np.testing.assert_allclose(out, (np.array([0.6, 0.8]) + 3 * np.array([0.3, 0.4])) / 4)
    assert not norm_bound(1.0).linear and not krum(1).linear
    with pytest.raises(ConfigError, match=r"aggregation.norm must be > 0"):
        norm_bound(0.0)
    with pytest.raises(ConfigError, match=r"aggregation.byzantine must be >= 0"):
        krum(-1)


def test_the_aggregation_table_builds_every_rule_and_names_a_wrong_one():
    assert AggregationTable().build().linear  # the mean by default
    for rule, kind in (("median", coordinate_median()), ("trimmed_mean", trimmed_mean(0.1))):
        assert AggregationTable.model_validate({"rule": rule}).build().linear == kind.linear
    v = [np.array([1.0, 1.0], np.float32)] * 4 + [np.array([1e6, -1e6], np.float32)]
    for rule in ("krum", "multi_krum", "median", "trimmed_mean"):
        table = AggregationTable.model_validate({"rule": rule, "byzantine": 1, "trim": 0.2})
        out, _ = table.build().aggregate((), v, [1] * 5)
        np.testing.assert_allclose(out, [1.0, 1.0])
    with pytest.raises(ValueError, match=r"must be one of \['mean', 'median'"):
        AggregationTable.model_validate({"rule": "bulyan"})
    with pytest.raises(ConfigError, match="aggregation.rule must be one of"):
        build_rule("bulyan")


@pytest.mark.parametrize("rule", [krum(1), multi_krum(1), norm_bound(1.0)])
def test_secure_aggregation_refuses_the_robust_rules_with_the_reason(rule):
    with pytest.raises(ConfigError, match="needs each client's update; secure aggregation"):
        FLConfig(secagg=SecAggConfig(), aggregator=rule)


class _Flipped:
    """A trainer whose update is ``factor`` times the honest one (an attacker)."""

    def __init__(self, inner, factor: float) -> None:
        self.inner, self.factor = inner, factor

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def train(self, *args):
        return self.factor * self.inner.train(*args)


class Attacker(FLClient):
    """Client ``c0`` sends its update scaled by -1000."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        if self.transport.name == "c0":
            self.trainer = _Flipped(self.trainer, -1000.0)


async def test_multi_krum_keeps_accuracy_where_the_mean_collapses():
    data, trainer = small_setup()
    base = dict(rounds=3, fraction=1.0, round_timeout=20.0, seed=3)
    clean = await run_memory_federation(data, trainer, FLConfig(**base))
    runs = {
        name: await run_memory_federation(
            data, trainer, FLConfig(**base, aggregator=rule), client_cls=Attacker
        )
        for name, rule in (("mean", weighted_mean()), ("multi_krum", multi_krum(1)))
    }
    acc = {k: v.reports[-1].accuracy for k, v in runs.items()}
    ref = clean.reports[-1].accuracy
    assert acc["multi_krum"] >= ref - 0.05 and acc["mean"] < ref - 0.3, (acc, ref)


def test_the_server_toml_selects_a_rule_and_refuses_it_under_secure_aggregation(tmp_path):
    from fl_process_helpers import Federation
    from tandem.parties.fl.config import load_server_config
    from tandem.parties.fl.server_process import build_fl_config

    fed = Federation(tmp_path, rounds=1)
    fed.server["aggregation"] = {"rule": "multi_krum", "byzantine": 1}
    fed.write()
    cfg = load_server_config(fed.path("server"))
    built = build_fl_config(cfg, 100)
    assert not built.aggregator.linear and cfg.identity()["aggregation"]["rule"] == "multi_krum"
    v = [np.ones(3, np.float32)] * 3 + [np.full(3, 1e6, np.float32)]
    np.testing.assert_allclose(built.aggregator.aggregate((), v, [1] * 4)[0], np.ones(3))
    fed.server["secagg"] = {"max_dropout": 0.2}
    fed.write()
    with pytest.raises(ConfigError, match=r"server.toml: secure aggregation cannot run a non-line"):
        build_fl_config(load_server_config(fed.path("server")), 100)
    fed.server.pop("secagg")
    fed.server["aggregation"] = {"rule": "median"}
    fed.server["dp"] = {"noise_multiplier": 1.0}
    fed.write()
    with pytest.raises(ConfigError, match=r"\[dp\] needs the mean aggregation rule"):
        build_fl_config(load_server_config(fed.path("server")), 100)
