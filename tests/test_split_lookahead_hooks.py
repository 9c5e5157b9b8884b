"""`SplitParty.fit(announce_ahead=True)` announces the next training batch ahead with an
``after_batch`` hook too (what `tandem party` runs): the hook still sees the state of the batch
it follows, training is exactly that of commanding each batch after the previous one, and a
stop the hook asks for lands after the batch already announced, on every party alike."""

import asyncio

import jax
import numpy as np

from tandem.engine.topology import two_party
from tandem.parties.split import SplitConfig
from tests.split_helpers import make_job
from tests.test_split_lookahead import _Recording

CFG = dict(batch_size=8, groups=2, optimizer="adam", learning_rate=0.1, threshold=2, capacity=16)
BATCHES_PER_EPOCH = 3  # 24 rows in batches of 8


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


async def _train(announce_ahead: bool | None, *, stop_at: int | None = None, epochs: int = 2):
    """Train with a hook that records, after every batch, (epoch, done, step, batches_done,
    in_batch, the leader's parameters) and asks to stop after the ``stop_at``-th batch."""
    parties, *_ = make_job(two_party("A", "B"), rows=24, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    rec = _Recording(leader.transport, [leader])
    leader.transport = rec
    seen: list[tuple] = []

    async def after_batch(epoch: int, done: int) -> bool:
        seen.append((epoch, done, leader.step, leader.batches_done, leader.in_batch, leader.params))
        await asyncio.sleep(0)  # let the follower run meanwhile, as a checkpoint write would
        return stop_at is not None and len(seen) >= stop_at

    async def drive():
        hist = await leader.fit(epochs, after_batch=after_batch, announce_ahead=announce_ahead)
        await leader.stop()
        return hist

    async with asyncio.TaskGroup() as tg:
        served = tg.create_task(follower.serve())
        hist = tg.create_task(drive())
    return hist.result(), rec.commands, seen, leader, follower, served.result()


async def test_announce_ahead_with_a_hook_sends_each_command_while_the_batch_before_runs():
    _, commands, seen, leader, follower, served = await _train(True)
    assert commands == [(0, 0)] + [(b, b - 1) for b in range(1, 6)]
    assert leader.batches_done == follower.batches_done == served == 6
    # the hook runs between two batches of the leader: batch b done, b + 1 not begun
    assert [(e, d, s, b, busy) for e, d, s, b, busy, _ in seen] == [
        (b // BATCHES_PER_EPOCH, b % BATCHES_PER_EPOCH + 1, b + 1, b + 1, False) for b in range(6)
    ]


async def test_announce_ahead_with_a_hook_trains_and_checkpoints_exactly_the_same():
    hist_a, _, seen_a, lead_a, fol_a, _ = await _train(True)
    hist_b, commands_b, seen_b, lead_b, fol_b, _ = await _train(None)
    assert commands_b == [(b, b) for b in range(6)]  # the default with a hook: not ahead
    assert [h.loss for h in hist_a] == [h.loss for h in hist_b]
    # what the hook saw (a checkpoint's parameters) after every batch, bit for bit
    for (*_, params_a), (*_, params_b) in zip(seen_a, seen_b, strict=True):
        for x, y in zip(_leaves(params_a), _leaves(params_b), strict=True):
            np.testing.assert_array_equal(x, y)
    for a, b in ((lead_a, lead_b), (fol_a, fol_b)):
        for x, y in zip(_leaves(a.params), _leaves(b.params), strict=True):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(_leaves(a.handler.opt_state), _leaves(b.handler.opt_state), strict=True):
            np.testing.assert_array_equal(x, y)


async def test_a_stop_asked_with_a_batch_announced_lands_after_that_batch():
    hist, commands, seen, leader, follower, served = await _train(True, stop_at=2)
    # batch 2 was announced when the hook asked to stop after batch 1: it runs, its hook
    # runs too, and nothing further is commanded
    assert [b for b, _ in commands] == [0, 1, 2]
    assert len(seen) == 3 and seen[-1][:4] == (0, 3, 3, 3)
    assert leader.step == follower.step == served == 3
    assert len(hist) == 1 and hist[0].batches == BATCHES_PER_EPOCH


async def test_a_stop_at_an_epoch_end_runs_the_next_epochs_announced_batch():
    hist, commands, seen, leader, follower, served = await _train(True, stop_at=3)
    assert [b for b, _ in commands] == [0, 1, 2, 3]
    assert seen[-1][:4] == (1, 1, 4, 4)
    assert leader.step == follower.step == served == 4
    assert [h.batches for h in hist] == [BATCHES_PER_EPOCH, BATCHES_PER_EPOCH]


async def test_without_announcing_ahead_a_stop_lands_at_once():
    hist, commands, seen, leader, follower, served = await _train(None, stop_at=2)
    assert commands == [(0, 0), (1, 1)]
    assert leader.step == follower.step == served == 2


async def test_announce_ahead_false_commands_each_batch_after_the_previous_one():
    parties, *_ = make_job(two_party("A", "B"), rows=24, config=SplitConfig(**CFG))
    leader, follower = parties["B"], parties["A"]
    rec = _Recording(leader.transport, [leader])
    leader.transport = rec

    async def drive():
        await leader.fit(1, announce_ahead=False)
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())
    assert rec.commands == [(b, b) for b in range(BATCHES_PER_EPOCH)]
