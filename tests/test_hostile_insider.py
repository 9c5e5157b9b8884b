"""Insiders with per-party keys (`tandem.transports.keys`): a roster member holds a key, but
only its own, so it cannot sign as another party. Two attacks that worked with the shared
secret (issue 39) are refused from their heads (403), and the job trains to the parameters
of a run nobody attacked; strangers read nothing from ``/metrics``."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from hostile_helpers import assert_done, assert_same_params, make_job, run_pair, wait_healthy
from tandem.testing.hostile_insider import (
    forged_control_round,
    metrics_stranger_round,
    stalled_partial_round,
    use_keys,
)


def keyed_job(tmp_path):
    return make_job(tmp_path, lambda job: use_keys(job.cfg, job.folder))


async def repeat(finished: asyncio.Event, one, rounds: int = 12, pause: float = 0.2):
    """``one(round)`` until ``rounds`` rounds or the job finished; every status."""
    out: list[int] = []
    for r in range(rounds):
        if finished.is_set():
            break
        try:
            out += await one(r)
        except (OSError, aiohttp.ClientConnectionError):  # the follower finished, closed
            break
        await asyncio.sleep(pause)
    return out


@pytest.mark.slow
async def test_a_roster_members_stalled_partial_as_the_leader_is_refused(
    tmp_path, hostile_reference
):
    job = keyed_job(tmp_path)

    async def attack(job, finished):
        await wait_healthy(job.url("follower"))
        return await repeat(
            finished, lambda r: stalled_partial_round(job.folder, job.url("follower"), r * 64)
        )

    results, statuses = await run_pair(job, attack)
    assert_done(results)
    assert statuses and set(statuses) <= {403, 503}, statuses  # 503: the follower closing
    assert statuses.count(403) >= 64
    assert_same_params(job, hostile_reference)


@pytest.mark.slow
async def test_a_stop_signed_with_the_followers_key_as_the_leader_is_refused(
    tmp_path, hostile_reference
):
    job = keyed_job(tmp_path)
    strangers: list[tuple[list[int], int]] = []

    async def attack(job, finished):
        await wait_healthy(job.url("follower"))
        await wait_healthy(job.url("leader"))
        strangers.append(await metrics_stranger_round([job.url("leader"), job.url("follower")]))
        return await repeat(
            finished, lambda r: forged_control_round(job.folder, job.url("follower"), r * 8)
        )

    results, statuses = await run_pair(job, attack)
    assert_done(results)
    assert statuses and set(statuses) <= {403, 503}, statuses
    assert statuses.count(403) >= 8
    assert_same_params(job, hostile_reference)
    [(metric_statuses, leaked)] = strangers
    assert set(metric_statuses) == {401} and leaked == 0
