"""The FL server's `Aggregator` seam: the built-in rules against hand-computed values, a server
running rounds end to end with a custom aggregator, a non-linear one given decoded updates
(a linear one the compressed payloads), and an aggregator's state in the server checkpoint."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fl_helpers import compressed, small_setup
from tandem.errors import ConfigError
from tandem.parties.fl import checkpoint as ckpt
from tandem.parties.fl.aggregator import (
    Aggregator,
    coordinate_median,
    trimmed_mean,
    weighted_mean,
)
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.server import FLServer
from tandem.transports.memory import MemoryNetwork

SKETCH = {"kind": "sketch", "rows": 3, "cols": 200}
U = [np.array([1.0, -4.0, 0.0], np.float32), np.array([3.0, 2.0, 9.0], np.float32)]
V = [*U, np.array([100.0, 2.5, -1.0], np.float32)]


@pytest.fixture(scope="module")
def setup():
    return small_setup()


def test_builtin_rules_against_hand_computed_values():
    mean, state = weighted_mean().aggregate((), U, [1, 3])
    assert state == () and mean.dtype == np.float32
    np.testing.assert_allclose(mean, [2.5, 0.5, 6.75])
    median, _ = coordinate_median().aggregate((), V, [1, 1, 50])  # weights do not count
    np.testing.assert_array_equal(median, [3.0, 2.0, 0.0])
    trimmed, _ = trimmed_mean(0.34).aggregate((), V, [1, 1, 1])  # drops one at each end
    np.testing.assert_array_equal(trimmed, [3.0, 2.0, 0.0])
    plain, _ = trimmed_mean(0.0).aggregate((), V, [5, 1, 1])
    np.testing.assert_allclose(plain, np.mean(V, axis=0))
    assert weighted_mean().linear and not coordinate_median().linear
    assert not trimmed_mean(0.1).linear


def test_rule_errors_name_the_problem():
    with pytest.raises(ConfigError, match=r"fraction must be in \[0, 0.5\).*got 0.5"):
        trimmed_mean(0.5)
    with pytest.raises(ConfigError, match="zero updates"):
        weighted_mean().aggregate((), [], [])
    with pytest.raises(ConfigError, match="different shapes"):
        coordinate_median().aggregate((), [U[0], np.zeros(4, np.float32)], [1, 1])
    with pytest.raises(ConfigError, match="sum to > 0"):
        weighted_mean().aggregate((), U, [0, 0])


def recording(rule: Aggregator, seen: list) -> Aggregator:
    """``rule``, counting its rounds in its state and noting each input's shape in ``seen``."""

    def init(like):
        return {"inner": rule.init(like), "rounds": np.zeros((), np.int64)}

    def aggregate(state, updates, weights):
        seen.append([np.shape(u) for u in updates])
        out, inner = rule.aggregate(state["inner"], updates, weights)
        return out, {"inner": inner, "rounds": state["rounds"] + 1}

    return Aggregator(init, aggregate, rule.linear)


@pytest.mark.parametrize("rule", [coordinate_median(), weighted_mean()], ids=["median", "mean"])
async def test_server_decodes_before_a_non_linear_aggregator(setup, rule):
    data, trainer = setup
    seen: list = []
    cfg = compressed(3, 20.0, uplink=SKETCH, aggregator=recording(rule, seen))
    server = await run_memory_federation(data, trainer, cfg)
    assert [r.accepted for r in server.reports] == [["c0", "c1", "c2", "c3"]] * 3
    want = (3, 200) if rule.linear else (trainer.dim,)  # payloads, or decoded updates
    assert seen == [[want] * 4] * 3
    assert int(server.agg_state["rounds"]) == 3
    assert np.all(np.isfinite(server.model)) and np.any(server.model != trainer.init_vec)


async def test_a_custom_aggregator_runs_rounds_end_to_end(setup):
    """With one client per round, the median of one decoded update is that update: the model
    is the weighted mean's (which combines the compressed payload and decodes it) bit for bit."""
    data, trainer = setup
    runs = [
        await run_memory_federation(data, trainer, compressed(4, 20.0, fraction=0.25, **kw))
        for kw in ({}, {"aggregator": coordinate_median()})
    ]
    assert [len(r.accepted) for r in runs[1].reports] == [1] * 4
    assert runs[0].model.tobytes() == runs[1].model.tobytes()
    assert runs[1].reports[-1].accuracy is not None


def test_aggregator_state_is_checkpointed(setup, tmp_path):
    data, trainer = setup
    cfg = compressed(2, 20.0, aggregator=recording(trimmed_mean(0.25), []))
    server = asyncio.run(run_memory_federation(data, trainer, cfg))
    location = str(tmp_path / "server.ckpt")
    ckpt.save(location, server, {})
    restored = FLServer(MemoryNetwork().endpoint("server"), ["c0", "c1", "c2", "c3"], trainer, cfg)
    ckpt.restore(restored, ckpt.load(location), {})
    assert int(restored.agg_state["rounds"]) == 2
    plain = FLServer(
        MemoryNetwork().endpoint("server"), ["c0"], trainer, compressed(2, 20.0)
    )  # the default weighted mean keeps no state
    with pytest.raises(ckpt.CheckpointError, match="aggregator has another structure.*--fresh"):
        ckpt.restore(plain, ckpt.load(location), {})
