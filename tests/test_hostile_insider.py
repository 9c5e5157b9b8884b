"""Insiders with per-party keys (`tandem.transports.keys`): a roster member holds a key, but
only its own, so it cannot sign as another party. Two attacks that worked with the shared
secret (issue 39) are refused from their heads (403), and the job trains to the parameters
of a run nobody attacked; strangers read nothing from ``/metrics``.

The attacks are `bench.hostile_insider`'s, run as a user runs them: ``python -m bench.hostile
--attacks stalled_partial,forged_control,metrics_stranger``, each against a two-party job in a
process of its own, after a reference run nobody attacks (``same_params``: the attacked job
exported exactly its parameters)."""

from __future__ import annotations

import pytest

from run_helpers import run_bench

# one worker runs the module, so its benchmark fixture runs once (`--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_hostile_insider")

ATTACKS = ("stalled_partial", "forged_control", "metrics_stranger")


@pytest.fixture(scope="module")
def attacked() -> dict:
    out, _ = run_bench(
        "hostile", "--json", "--attacks", ",".join(ATTACKS), "--epochs", "2", "--seconds", "20",
        timeout=280,
    )  # fmt: skip
    assert set(out["per_attack"]) == set(ATTACKS), out
    return out["per_attack"]


def statuses(detail: dict) -> dict[int, int]:
    return {int(k): n for k, n in detail["statuses"].items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_roster_members_stalled_partial_as_the_leader_is_refused(attacked):
    out = attacked["stalled_partial"]
    assert out["done"] and out["same_params"], out
    got = statuses(out)
    assert got and set(got) <= {403, 503}, got  # 503: the follower closing
    assert got.get(403, 0) >= 64


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_signed_with_the_followers_key_as_the_leader_is_refused(attacked):
    out = attacked["forged_control"]
    assert out["done"] and out["same_params"], out
    got = statuses(out)
    assert got and set(got) <= {403, 503}, got
    assert got.get(403, 0) >= 8
    strangers = attacked["metrics_stranger"]
    assert set(statuses(strangers)) == {401} and strangers["bytes_leaked"] == 0, strangers
