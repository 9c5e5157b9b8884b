"""`SplitParty.fit` announces the next training batch while the current one drains: the command
leaves once the leader's compute for the batch has run, before the batch's last messages are
through (so it travels beside the last gradients instead of a round trip after them), and
training is exactly what it is without announcing ahead."""

import asyncio

import jax
import numpy as np

from tandem.engine.lanes import ThreadLane
from tandem.engine.plan import Kind
from tandem.engine.runtime import BatchStats, PartyRuntime
from tandem.engine.topology import two_party
from tandem.parties.split import SplitConfig
from tandem.parties.split.party import CTL
from tests.split_helpers import make_job

CFG = dict(batch_size=8, groups=2, optimizer="sgd", learning_rate=0.1, threshold=2, capacity=16)


class _Recording:
    """A transport wrapper noting, for each batch command the leader sends, how many batches
    the leader had finished when the send began."""

    def __init__(self, inner, party_ref: list) -> None:
        self.inner, self.party_ref, self.commands = inner, party_ref, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def send(self, peer, channel, frame):
        if channel == CTL and frame.meta.get("cmd") == "batch":
            self.commands.append((frame.meta["b"], self.party_ref[0].batches_done))
        await self.inner.send(peer, channel, frame)


async def _train(announce: bool, epochs: int = 2):
    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=24, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    rec = _Recording(leader.transport, [leader])
    leader.transport = rec

    async def keep_going(epoch: int, done: int) -> bool:
        return False  # a hook: the next command waits for it, so nothing is announced ahead

    async def drive():
        hist = await leader.fit(epochs, after_batch=None if announce else keep_going)
        await leader.stop()
        return hist

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        hist = tg.create_task(drive())
    return hist.result(), rec.commands, leader, follower


async def test_fit_announces_the_next_batch_before_the_current_one_returns():
    _, commands, leader, follower = await _train(True)
    assert [b for b, _ in commands] == list(range(6))  # 2 epochs of 3 batches, in order
    # batch 0 is commanded before it runs; each later one while the batch before it still
    # runs (the leader has not counted it yet), across the epoch boundary too
    assert commands == [(0, 0)] + [(b, b - 1) for b in range(1, 6)]
    assert leader.batches_done == follower.batches_done == 6


async def test_fit_with_after_batch_commands_each_batch_after_the_previous_one():
    _, commands, *_ = await _train(False)
    assert commands == [(b, b) for b in range(6)]


async def test_announcing_ahead_trains_exactly_the_same():
    hist_a, _, lead_a, fol_a = await _train(True)
    hist_b, _, lead_b, fol_b = await _train(False)
    assert [h.loss for h in hist_a] == [h.loss for h in hist_b]
    for a, b in ((lead_a, lead_b), (fol_a, fol_b)):
        for x, y in zip(
            jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


async def test_runtime_calls_computed_after_the_last_compute_op_before_returning():
    """The hook sees every compute op done (the update included) and runs before `run`
    returns; an exception from it fails the batch."""
    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    seen: list[tuple[int, int]] = []
    n_compute = sum(
        op.kind is not Kind.SEND and op.kind is not Kind.RECV
        for op in follower.plan(2, "train").ops
    )

    async def lead():
        await leader.run_batch(np.arange(8), n=2)
        await leader.run_batch(np.arange(8), n=2)
        await leader.stop()

    class Boom(Exception):
        pass

    async def follow():
        from tandem.engine.data import BatchRows
        from tandem.engine.microbatch import group_bounds

        async with ThreadLane("t") as lane:
            runtime = PartyRuntime(follower.transport, lane)

            async def hook(stats: BatchStats) -> None:
                seen.append((sum(runtime.counters.values()), follower.batches_done))

            for b in range(2):
                await follower.transport.recv("B", CTL)
                follower.handler.begin(
                    BatchRows(follower.datasets["train"], np.arange(8)),
                    None,
                    group_bounds(8, 2),
                    train=True,
                )
                if b == 0:
                    await runtime.run(follower.plan(2, "train"), follower.handler, 0, computed=hook)
                else:

                    async def boom(stats: BatchStats) -> None:
                        raise Boom("from the hook")

                    try:
                        await runtime.run(
                            follower.plan(2, "train"), follower.handler, 1, computed=boom
                        )
                    except* Boom:
                        seen.append((-1, -1))

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follow())
        tg.create_task(lead())
    assert seen == [(n_compute, 0), (-1, -1)]
