"""`tandem.parties.split.command_rows`: how a batch command names its rows (a draw of the
seeded shuffle, a range, or a narrow list), what a receiver refuses, and that the form changes
nothing the parties compute."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from tandem.engine.data import epoch_batches
from tandem.engine.topology import leader_follower
from tandem.errors import AdmissionError, FrameError
from tandem.parties.split import SplitConfig
from tandem.parties.split import party as party_module
from tandem.parties.split.command_rows import (
    Draw,
    RowsDecoder,
    digest,
    encode_rows,
    index_dtype,
    row_count,
)
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryTransport
from tests.split_helpers import make_job


@pytest.mark.parametrize(
    ("top", "dtype"),
    [
        (0, np.uint8),
        (255, np.uint8),
        (256, np.uint16),
        (65_535, np.uint16),
        (65_536, np.uint32),
        (2**32 - 1, np.uint32),
        (2**32, np.uint64),
        (2**64 - 1, np.uint64),
    ],
)
def test_index_dtype_is_the_narrowest_unsigned_holding_the_largest_index(top, dtype):
    assert index_dtype(top) == np.dtype(dtype)


def test_index_dtype_refuses_what_no_unsigned_dtype_holds():
    with pytest.raises(ValueError, match="non-negative"):
        index_dtype(-1)
    with pytest.raises(ValueError, match="64 bits"):
        index_dtype(2**64)


def _round_trip(idx, draw=None, limit=None):
    meta, arrays = encode_rows(idx, draw)
    out = RowsDecoder().decode(meta, arrays, limit)
    assert out.dtype == np.int64
    assert row_count(meta, arrays) == len(out)
    return meta, arrays, out


def test_a_shuffled_list_travels_narrow_and_comes_back_as_int64():
    idx = np.random.default_rng(0).permutation(1000)[:300]
    meta, arrays, out = _round_trip(idx)
    assert meta == {} and arrays[0].dtype == np.uint16 and arrays[0].nbytes == 600
    np.testing.assert_array_equal(out, idx)


def test_rows_past_2_32_travel_as_uint64_and_below_as_uint32():
    below = np.array([7, 2**32 - 1, 3], np.int64)
    past = np.array([7, 2**32, 3], np.int64)
    _, arrays, out = _round_trip(below)
    assert arrays[0].dtype == np.uint32
    np.testing.assert_array_equal(out, below)
    _, arrays, out = _round_trip(past)
    assert arrays[0].dtype == np.uint64
    np.testing.assert_array_equal(out, past)


def test_consecutive_rows_travel_as_a_range_without_an_array():
    meta, arrays, out = _round_trip(np.arange(4096, 8192))
    assert meta == {"rows": {"range": [4096, 8192]}} and arrays == ()
    np.testing.assert_array_equal(out, np.arange(4096, 8192))


def test_a_batch_of_the_shuffle_travels_as_its_draw_and_the_follower_repeats_it():
    n_rows, bs, seed = 1000, 64, 3
    for epoch in (0, 1):
        batches = epoch_batches(n_rows, bs, epoch, seed)
        for i in (0, 7, len(batches) - 1):  # the last batch is short (1000 = 15 * 64 + 40)
            meta, arrays, out = _round_trip(batches[i], Draw(n_rows, bs, seed, epoch, i))
            assert arrays == () and meta["rows"]["draw"] == [n_rows, bs, seed, epoch, i]
            np.testing.assert_array_equal(out, batches[i])
    assert len(out) == 40


def test_the_decoder_keeps_two_epochs_orders_narrow():
    dec = RowsDecoder()
    for epoch in range(4):
        idx = epoch_batches(300, 32, epoch, 0)[2]
        meta, arrays = encode_rows(idx, Draw(300, 32, 0, epoch, 2))
        np.testing.assert_array_equal(dec.decode(meta, arrays), idx)
    assert [k[3] for k in dec._orders] == [2, 3]
    assert all(order.dtype == np.uint16 for order, _ in dec._orders.values())


def test_a_draw_that_differs_from_the_leaders_is_refused_naming_the_fix():
    idx = epoch_batches(100, 10, 0, 0)[1]
    meta, arrays = encode_rows(idx, Draw(100, 10, 0, 0, 1))
    meta["rows"]["digest"] = digest(idx[::-1])  # the leader ran these rows in another order
    with pytest.raises(AdmissionError, match="same numpy version") as info:
        RowsDecoder().decode(meta, arrays)
    assert info.value.field == "idx"
    # rows that are not the draw the leader names (another seed) are refused the same way
    meta, arrays = encode_rows(idx, Draw(100, 10, 1, 0, 1))
    with pytest.raises(AdmissionError, match="not the leader's"):
        RowsDecoder().decode(meta, arrays)


def test_ranges_and_draws_past_the_dataset_are_refused_before_anything_is_allocated():
    dec = RowsDecoder()
    with pytest.raises(AdmissionError, match="has 100 rows"):
        dec.decode({"rows": {"range": [0, 10**15]}}, (), limit=100)
    huge = {"rows": {"draw": [10**15, 10, 0, 0, 0], "digest": "00" * 8}}
    with pytest.raises(AdmissionError, match="has 100 rows"):
        dec.decode(huge, (), limit=100)
    assert row_count(huge, ()) == 10  # counted without drawing
    np.testing.assert_array_equal(
        dec.decode({"rows": {"range": [90, 100]}}, (), limit=100), np.arange(90, 100)
    )


@pytest.mark.parametrize(
    ("meta", "arrays", "match"),
    [
        ({}, (), "one row-index array"),
        ({}, (np.zeros(3, np.float32),), "float32"),
        ({}, (np.zeros(3, np.int32),), "int32"),
        ({}, (np.zeros((2, 2), np.uint8),), r"uint8\[2, 2\]"),
        ({}, (np.zeros(0, np.uint8),), r"rows >= 1"),
        ({}, (np.array([2**63], np.uint64),), "past any dataset"),
        ({"rows": {"range": [5, 5]}}, (), "0 <= start < stop"),
        ({"rows": {"range": [-1, 5]}}, (), "0 <= start < stop"),
        ({"rows": {"range": [0, True]}}, (), "0 <= start < stop"),
        ({"rows": {"range": [0, 5]}}, (np.arange(5, dtype=np.uint8),), "carries no array"),
        ({"rows": [0, 5]}, (), "not a table"),
        ({"rows": {"all": 1}}, (), "'range' or 'draw'"),
        ({"rows": {"draw": [100, 10, 0, 0]}}, (), r"n_rows, batch_size, seed, epoch, i"),
        ({"rows": {"draw": [100, 10, 0, 0, 10], "digest": "x"}}, (), "not one of"),
        ({"rows": {"draw": [100, 0, 0, 0, 0], "digest": "x"}}, (), "not one of"),
        ({"rows": {"draw": [100, 10, -1, 0, 0], "digest": "x"}}, (), "negative"),
        ({"rows": {"draw": [100, 10, 0, 0, 0]}}, (), "without its digest"),
    ],
)
def test_malformed_rows_are_refused_with_the_field(meta, arrays, match):
    with pytest.raises(AdmissionError, match=match) as info:
        RowsDecoder().decode(meta, arrays)
    assert info.value.field == "idx"


def test_the_spec_validator_bounds_the_rows_of_every_form():
    from tandem.parties.split.negotiate import spec_validator
    from tests.test_cut_compress import _two_party_spec

    spec = _two_party_spec()
    check = spec_validator(spec, leader="B")
    most = spec.max_rows

    def ctl(meta, arrays=(), sender="B"):
        return Frame(meta={"cmd": "batch", **meta}, arrays=arrays, channel="ctl", sender=sender)

    check(ctl(*encode_rows(np.arange(most))))
    check(ctl(*encode_rows(np.arange(most)[::-1])))
    check(ctl(*encode_rows(np.arange(most), Draw(4 * most, most, 0, 0, 3))))
    with pytest.raises(FrameError, match=f"allows 1..{most}"):
        check(ctl(*encode_rows(np.arange(most + 1))))
    with pytest.raises(FrameError, match=f"allows 1..{most}"):
        check(ctl(*encode_rows(np.arange(most + 1)[::-1])))
    with pytest.raises(FrameError, match=f"allows 1..{most}"):
        check(ctl(*encode_rows(np.arange(most + 1), Draw(10 * most, most + 1, 0, 0, 0))))
    with pytest.raises(FrameError, match="only the leader's commands name rows"):
        check(ctl(*encode_rows(np.arange(3)), sender="A"))
    check(ctl({}, sender="A"))  # a reply naming no rows


def test_the_spec_validator_runs_on_the_transports_loop():
    """It is an `InlineValidator`, so the HTTP transport judges each cut message on the loop
    instead of handing it to a worker thread."""
    from tandem.parties.split.negotiate import spec_validator
    from tandem.transports.base import InlineValidator
    from tests.test_cut_compress import _two_party_spec

    check = spec_validator(_two_party_spec(), leader="B")
    assert isinstance(check, InlineValidator) and check.inline is True


def test_a_followers_admission_takes_every_form_and_bounds_it_by_its_dataset():
    parties, *_ = make_job(leader_follower(), rows=40, config=SplitConfig(batch_size=16, seed=0))
    follower = parties["follower"]
    adm = follower.admission

    def cmd(b, idx, draw=None):
        rows, arrays = encode_rows(idx, draw)
        meta = {"cmd": "batch", "b": b, "n": 1, "c": 1, "mode": "train", "data": "train", **rows}
        return Frame(sender="leader", channel="ctl", meta=meta, arrays=arrays)

    with pytest.raises(AdmissionError, match="has 40 rows") as info:
        adm(cmd(0, np.arange(30, 46)))  # a range past the dataset's 40 rows
    assert info.value.field == "idx"
    with pytest.raises(AdmissionError, match="has 40 rows"):
        adm(cmd(0, np.arange(16), Draw(50, 16, 0, 0, 0)))  # a draw over 50 rows
    adm(cmd(0, np.arange(24, 40)))
    adm(cmd(1, epoch_batches(40, 16, 0, 0)[2], Draw(40, 16, 0, 0, 2)))
    adm(cmd(2, np.array([39, 0, 5])))
    assert [adm.batches[b].rows for b in (0, 1, 2)] == [16, 8, 3]


def _fit_and_evaluate(monkeypatch, *, int64_lists: bool):
    """A leader and a follower train 2 epochs with `fit` (shuffled, last batch short), then
    evaluate in order and on shuffled rows; the commands' frames and every result."""
    if int64_lists:  # what every command carried before: its rows as one int64 array
        monkeypatch.setattr(
            party_module, "encode_rows", lambda idx, draw=None: ({}, (np.asarray(idx, np.int64),))
        )
    sent: list[Frame] = []
    send = MemoryTransport.send

    async def recording_send(self, peer, channel, frame):
        if channel == "ctl" and frame.meta.get("cmd") == "batch":
            sent.append(frame)
        await send(self, peer, channel, frame)

    monkeypatch.setattr(MemoryTransport, "send", recording_send)
    cfg = SplitConfig(batch_size=16, groups=2, optimizer="adam", learning_rate=0.01, seed=5)
    topo = leader_follower()
    parties, *_ = make_job(topo, rows=40, seed=5, config=cfg)
    leader, follower = parties["leader"], parties["follower"]
    out = {}

    async def drive():
        out["history"] = [h.loss for h in await leader.fit(2)]
        out["in_order"] = (await leader.evaluate("train", batch_size=16))["loss"]
        shuffled = np.random.default_rng(1).permutation(40)
        out["shuffled"] = (await leader.evaluate("train", rows=shuffled, batch_size=16))["loss"]
        out["predictions"] = leader.predictions
        await leader.stop()

    async def run():
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follower.serve())
            tg.create_task(drive())

    asyncio.run(run())
    params = {**leader.params, **follower.params}
    monkeypatch.undo()
    return sent, out, params


def test_commands_name_rows_without_index_arrays_and_train_bit_for_bit_as_int64_lists(
    monkeypatch,
):
    sent, out, params = _fit_and_evaluate(monkeypatch, int64_lists=False)
    forms = [next(iter(f.meta["rows"])) if "rows" in f.meta else "list" for f in sent]
    # 2 epochs of 3 training batches, 3 evaluation batches in order, 3 on shuffled rows
    assert forms == ["draw"] * 6 + ["range"] * 3 + ["list"] * 3
    assert all(f.arrays == () for f in sent[:9])
    assert all(f.arrays[0].dtype == np.uint8 for f in sent[9:])
    old_sent, old_out, old_params = _fit_and_evaluate(monkeypatch, int64_lists=True)
    assert all(f.arrays[0].dtype == np.int64 for f in old_sent)
    assert out["history"] == old_out["history"]
    assert out["in_order"] == old_out["in_order"] and out["shuffled"] == old_out["shuffled"]
    np.testing.assert_array_equal(out["predictions"], old_out["predictions"])
    leaves = jax.tree_util.tree_leaves(params)
    old_leaves = jax.tree_util.tree_leaves(old_params)
    assert len(leaves) == len(old_leaves)
    for a, b in zip(leaves, old_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
