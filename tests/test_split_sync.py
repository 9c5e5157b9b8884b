"""`SplitParty.wait_batches`: timing that ends when every party finished the batch."""

import asyncio

import numpy as np

from tandem.engine.topology import two_party
from tests.split_helpers import make_job


async def test_wait_batches_returns_once_the_follower_finished_the_leaders_batches():
    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    leader, follower = parties["B"], parties["A"]
    seen = []

    async def drive():
        for _ in range(3):
            await leader.run_batch(np.arange(8), n=4)
            await follower.wait_batches(leader.batches_done)
            seen.append((leader.batches_done, follower.batches_done, follower.in_batch))
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())
    assert seen == [(1, 1, False), (2, 2, False), (3, 3, False)]


async def test_cancelled_wait_leaves_no_waiter_and_a_reached_count_returns_at_once():
    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    follower = parties["A"]
    task = asyncio.create_task(follower.wait_batches(1))
    await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and follower._batch_waiters == []
    await asyncio.wait_for(follower.wait_batches(0), 1)


async def test_arrays_handed_in_or_out_survive_the_donating_update():
    """The update donates the engine's parameter buffers (tandem.engine.kernels, "Donation"): a
    snapshot from `SplitParty.params` and the arrays given to `restore` stay readable after
    training steps, and the party trains from the restored values."""
    import jax

    from tests.split_helpers import train_steps

    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    follower = parties["A"]
    given = jax.tree_util.tree_map(lambda x: x + 1.0, follower.params)
    follower.restore(given, follower.handler.opt_state, 0)
    snapshot = follower.params
    await train_steps(parties, topo, [np.arange(8)] * 2, lambda i: 2)
    for g, s in zip(
        jax.tree_util.tree_leaves(given), jax.tree_util.tree_leaves(snapshot), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s))  # both still readable
    assert not all(
        np.array_equal(np.asarray(s), np.asarray(n))
        for s, n in zip(
            jax.tree_util.tree_leaves(snapshot),
            jax.tree_util.tree_leaves(follower.params),
            strict=True,
        )
    )


async def test_a_call_after_a_cancelled_batch_refuses_instead_of_running_out_of_step():
    """A leader whose batch was cancelled (here: its follower never answers) may hold part of
    that batch's updates while its followers hold another part: its next call says so instead
    of starting a batch that mixes frames of the two."""
    import pytest

    from tandem.errors import EngineError

    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    leader = parties["B"]
    task = asyncio.create_task(leader.run_batch(np.arange(8), n=2))
    while not leader.in_batch:
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and leader.batches_done == 0
    with pytest.raises(EngineError, match=r"batch 0 \(train\) did not finish.*restart every"):
        await leader.fit(epochs=1)
    leader.restore(leader.params, leader.handler.opt_state, 0)  # every party, the same step
    assert leader.interrupted is None


async def test_a_second_concurrent_fit_refuses_at_once():
    """Two fit() calls at once on one leader would interleave their batches' commands and
    hang; the second refuses before sending anything and the first trains on."""
    import pytest

    from tandem.errors import ConfigError

    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    leader, follower = parties["B"], parties["A"]
    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        first = tg.create_task(leader.fit(epochs=1))
        await asyncio.sleep(0)
        with pytest.raises(ConfigError, match="while its fit"):
            await leader.fit(epochs=1)
        await first
        await leader.stop()
    assert leader.batches_done == follower.batches_done == 1


async def test_other_calls_from_another_task_while_fit_runs_refuse_but_fits_hooks_may_call():
    """evaluate() from another task while fit() runs would interleave its batches with fit's;
    it refuses before sending anything. fit's own hooks run in fit's task and may evaluate."""
    import pytest

    from tandem.errors import ConfigError

    topo = two_party("A", "B")
    parties, *_ = make_job(topo, rows=8)
    leader, follower = parties["B"], parties["A"]
    evaluated = []

    async def after_epoch(result):
        evaluated.append(await leader.evaluate("train"))

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        first = tg.create_task(leader.fit(epochs=1, after_epoch=after_epoch))
        await asyncio.sleep(0)
        for call in (leader.evaluate("train"), leader.predict("train", 8)):
            with pytest.raises(ConfigError, match="from another task while its fit"):
                await call
        await first
        await leader.stop()
    assert len(evaluated) == 1 and leader.batches_done == follower.batches_done
