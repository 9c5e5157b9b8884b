"""`PartyRuntime.run`'s ``produced`` hook fires once the batch's last compute op whose result
is sent has run, while its local-only ops (here the leader's update) may still be running; and
a leader's `SplitParty.fit`, with a fixed ``groups`` or ``"auto"``, announces the next batch
there, before its own update of the current one is done, training exactly as before; its tuner
learns only from batches that ran at the count it asked for."""

import asyncio
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from tandem.engine.lanes import ThreadLane
from tandem.engine.microbatch import GroupTuner
from tandem.engine.plan import Kind
from tandem.engine.runtime import BatchStats
from tandem.engine.topology import two_party
from tandem.parties.split import SplitConfig
from tandem.parties.split.party import CTL
from tandem.parties.split.training import retune
from tests.split_helpers import make_job

CFG = dict(batch_size=8, groups=2, optimizer="adam", learning_rate=0.1, threshold=2, capacity=16)
#: how long a held update waits for what should release it before the test fails
WAIT_S = 30.0


class _HeldUpdates:
    """Wraps a party's handler: each update op waits (on the lane thread) until ``release``
    is set, and notes whether it was set in time."""

    def __init__(self, handler) -> None:
        self.inner, self.release, self.in_time = handler, threading.Event(), []
        self.ran_at: list[int] = []  # each update's batch: its group count

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def compute(self, op):
        if op.kind is Kind.UPDATE:
            self.in_time.append(self.release.wait(WAIT_S))
            self.ran_at.append(len(self.inner.bounds))
        return self.inner.compute(op)


async def _one_batch(leader, follower, mode: str, produced) -> None:
    """The leader runs one ``mode`` batch of 8 rows in 2 groups with the ``produced`` hook,
    while the follower serves; both stop after it."""

    async def lead():
        idx = np.arange(8)
        n, c = await leader._start_batch(idx, 2, mode, "train")
        async with ThreadLane("lead") as lane:
            await leader._run_batch(
                leader._runtime(lane), idx, n, mode, "train", c, produced=produced
            )
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(lead())


async def test_produced_fires_before_the_local_only_ops_are_done():
    parties, *_ = make_job(two_party("A", "B"), rows=8, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    held = _HeldUpdates(leader.handler)
    leader.handler = held  # the leader's ops: 2 losses (send gradients), then the update
    seen: list[tuple[int, bool]] = []

    async def produced(stats: BatchStats) -> None:
        loss_ops = leader.op_counts[Kind.LOSS.value]
        seen.append((loss_ops, leader.op_counts[Kind.UPDATE.value] > 0))
        held.release.set()

    await _one_batch(leader, follower, "train", produced)
    assert seen == [(2, False)]  # both losses ran, the update had not
    assert held.in_time == [True]


async def test_produced_fires_at_once_for_a_batch_that_sends_nothing():
    parties, *_ = make_job(two_party("A", "B"), rows=8, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    fired: list[BatchStats] = []

    async def produced(stats: BatchStats) -> None:
        fired.append(stats)

    await _one_batch(leader, follower, "eval", produced)  # eval: the leader sends none
    assert len(fired) == 1


class _CommandsRelease:
    """A transport wrapper that, when the leader sends batch ``b``'s command while it runs
    batch ``b - 1``, releases the leader's held update of batch ``b - 1``."""

    def __init__(self, inner, held: _HeldUpdates, leader) -> None:
        self.inner, self.held, self.leader = inner, held, leader

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def send(self, peer, channel, frame):
        if channel == CTL and frame.meta.get("b") == self.leader.batches_done + 1:
            self.held.release.set()
        await self.inner.send(peer, channel, frame)


async def _fit(groups, hold: bool):
    parties, *_ = make_job(
        two_party("A", "B"), rows=24, config=SplitConfig(**{**CFG, "groups": groups})
    )
    leader, follower = parties["B"], parties["A"]
    held = _HeldUpdates(leader.handler)
    if hold:
        leader.handler = held
        leader.transport = _CommandsRelease(leader.transport, held, leader)

    async def drive():
        async def last_batch_free(epoch: int, done: int) -> bool:
            if leader.batches_done < 5:
                held.release.clear()  # the next update waits for the next command
            else:
                held.release.set()  # the last batch has no next command
            return False

        hist = await leader.fit(2, after_batch=last_batch_free, announce_ahead=True)
        await leader.stop()
        return hist

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        hist = tg.create_task(drive())
    leader.handler = held.inner
    return hist.result(), held, leader, follower


@pytest.mark.parametrize("groups", [2, "auto"])
async def test_fit_announces_before_its_own_update(groups):
    # every update but the last waits for the next batch's command: with the announcement
    # after the update (``computed``) each would wait WAIT_S and note False
    _, held, leader, follower = await _fit(groups, hold=True)
    assert held.in_time == [True] * 6
    assert leader.batches_done == follower.batches_done == 6
    if groups == "auto":  # the tuner observed batches only at the count each ran at
        observed = iter(held.ran_at)
        assert all(n in observed for n, _ in leader.tuner_path)  # a subsequence
        assert leader.tuner_path[0][0] == held.ran_at[0]


def test_the_tuner_learns_only_from_batches_at_the_count_it_asked_for():
    party = SimpleNamespace(
        config=SplitConfig(**{**CFG, "groups": "auto"}),
        followers=(),
        tuner=GroupTuner(8),
        tuner_path=[],
        _tune_mark=(0.0, {}),
    )
    party.tuner_state = party.tuner.init()
    party.n_groups = party.tuner_state.n
    retune(party, 0.1, 8, party.n_groups)  # rule 1: no link measured, so n = 1
    assert party.n_groups == party.tuner_state.n == 1
    state = party.tuner_state
    retune(party, 0.1, 8, 4)  # a batch run at a count it did not ask for: no sample
    assert party.tuner_state is state and party.n_groups == 1
    assert [n for n, _ in party.tuner_path] == [4]  # rule 1's batch only
    retune(party, 0.1, 8, 1)
    assert party.tuner_state.batches == 2
    assert [n for n, _ in party.tuner_path] == [4, 1]


async def test_announcing_before_the_update_trains_exactly_the_same():
    hist_a, _, lead_a, fol_a = await _fit(2, hold=True)
    hist_b, _, lead_b, fol_b = await _fit(2, hold=False)
    assert [h.loss for h in hist_a] == [h.loss for h in hist_b]
    for a, b in ((lead_a, lead_b), (fol_a, fol_b)):
        for x, y in zip(
            jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
