"""Micro-batch groups run at bucketed row counts (`tandem.engine.microbatch.bucket_rows`): a
change of the group count compiles nothing when its groups fall into sizes already compiled
(equinox's ``test_num_traces`` pattern: each kernel counts its Python-side traces), and the
padding changes no result."""

import asyncio
import functools

import numpy as np
import pytest

from tandem.engine.microbatch import bucket_rows, group_bounds, tile_rows, tile_sizes
from tandem.engine.topology import leader_follower, two_party, u_shape
from tandem.parties.split import SplitConfig
from tests.split_helpers import make_job, train_steps
from tests.test_exactness import assert_trees_close, reference

ROWS = 64


def buckets(n: int, rows: int = ROWS) -> set[int]:
    return {bucket_rows(hi - lo, rows) for lo, hi in group_bounds(rows, n)}


def sizes(n: int, rows: int = ROWS) -> set[int]:
    return {hi - lo for lo, hi in group_bounds(rows, n)}


def config(rows: int = ROWS) -> SplitConfig:
    return SplitConfig(
        batch_size=rows, groups=1, optimizer="sgd", learning_rate=0.1, threshold=2, capacity=16
    )


@functools.cache  # [9, 3] serves both trace tests below (a fresh job each: fresh counters)
def traces_after(counts: tuple[int, ...], rows: int = ROWS) -> dict[tuple[str, str, str], int]:
    """Every kernel's trace count on every party after one batch of ``rows`` rows per count
    of ``counts``."""
    topo = leader_follower()
    parties, *_ = make_job(topo, rows=rows, config=config(rows))
    asyncio.run(train_steps(parties, topo, [np.arange(rows)] * len(counts), counts.__getitem__))
    return {
        (p, stage, name): count
        for p, party in parties.items()
        for stage, kernels in party.handler.kernels.items()
        for name, count in kernels.traces.items()
    }


def test_ladder_bounds_the_padding_and_the_sizes():
    for rows in range(1, 5000):
        size = bucket_rows(rows, 10**9)
        assert rows <= size < 1.25 * rows + 1
        assert bucket_rows(rows, rows) == rows  # never above the batch
        assert bucket_rows(rows, 10) == max(rows, min(size, 10))
    # a batch of 4096 rows cut in any count: few sizes, each on the ladder or the batch itself
    every = set().union(*(buckets(n, 4096) for n in range(1, 257)))
    assert len(every) <= 4 * 12 + 4


def test_a_new_count_within_the_compiled_sizes_never_retraces():
    # 9 groups of 64 rows are 4 and 8 rows, 3 groups 16 and 32: 5 groups (8 and 16 rows) and
    # 2 groups (32) run only at sizes those two counts compiled
    assert buckets(9) | buckets(3) == {4, 8, 16, 32}
    assert buckets(5) | buckets(2) <= buckets(9) | buckets(3)
    before = traces_after((9, 3))
    after = traces_after((9, 3, 5, 2, 9, 3))
    assert after == before, f"a count within the compiled sizes retraced: {before} -> {after}"
    # and each kernel traced once per size (updates: once per batch shape)
    per_group = len(buckets(9) | buckets(3))
    for (party, stage, name), count in before.items():
        expected = 1 if name in ("update", "zeros") else per_group
        assert count == expected, f"{party}.{stage}.{name} traced {count}, not {expected}"


def test_a_count_with_a_new_size_traces_once_more():
    # the counter catches a retrace: 6 groups run at 8 and 12 rows, and 12 is new
    assert buckets(6) - (buckets(9) | buckets(3)) == {12}
    before, after = traces_after((9, 3)), traces_after((9, 3, 6, 6))
    for key, count in after.items():
        if key[2] not in ("update", "zeros"):
            assert count == before[key] + 1, key


def assert_trains_exactly(topo, cfg: SplitConfig, counts: list[int], *, seed: int) -> None:
    """A fresh job of ``cfg.batch_size`` rows, one seeded permutation per count of ``counts``
    trained at that count, ends at the plain-JAX full-batch parameters."""
    rows = cfg.batch_size
    parties, data, labels, models = make_job(topo, rows=rows, config=cfg)
    init = {s: p for party in parties.values() for s, p in party.params.items()}
    rng = np.random.default_rng(seed)
    batches = [rng.permutation(rows) for _ in counts]
    asyncio.run(train_steps(parties, topo, batches, counts.__getitem__))
    final = {s: p for party in parties.values() for s, p in party.params.items()}
    assert_trees_close(final, reference(topo, models, init, data, labels, batches, lr=0.1))


@pytest.mark.parametrize("topo", [two_party(), leader_follower(), u_shape()], ids=str)
def test_padded_groups_train_exactly(topo):
    """A count whose groups are padded (a batch of 60 rows in 2 groups of 30, each run at 32
    rows) and counts cut on the ladder (4 groups: 10, 20, 20, 10; 7 groups: 5 and 10) give the
    plain-JAX full-batch parameters. The peers check every message's rows against the group's
    real rows (`StageHandler.receive`), so a padded row sent would fail the run."""
    rows, counts = 60, [2, 4, 7]
    assert any(bucket_rows(r, rows) != r for n in counts for r in sizes(n, rows))
    assert_trains_exactly(topo, config(rows), counts, seed=3)


def run_short_job(batches: list[np.ndarray], n: int):
    """A fresh leader-follower job trained on ``batches`` at ``n`` groups: every kernel's
    trace count, the final parameters, each party's padded sizes in the last batch, and the
    job for `reference`."""
    topo = leader_follower()
    parties, data, labels, models = make_job(topo, rows=ROWS, config=config())
    init = {s: p for party in parties.values() for s, p in party.params.items()}
    asyncio.run(train_steps(parties, topo, batches, lambda i: n))
    traced = {
        (p, stage, name): count
        for p, party in parties.items()
        for stage, kernels in party.handler.kernels.items()
        for name, count in kernels.traces.items()
    }
    final = {s: p for party in parties.values() for s, p in party.params.items()}
    padded = {p: party.handler.padded for p, party in parties.items()}
    return traced, final, padded, (topo, models, init, data, labels)


def test_a_short_batch_runs_at_sizes_full_batches_compiled_and_trains_exactly():
    """An epoch's last, shorter batch pads its groups up the ladder capped at the party's batch
    size (`StageHandler.pad_to`), not at its own rows: 57 rows in one group run at 64 (a full
    batch's one group), not at 57, a size of its own; the result is still exact."""
    assert bucket_rows(57, ROWS) == 64 and bucket_rows(57, 57) == 57
    rng = np.random.default_rng(7)
    full, short = rng.permutation(ROWS), rng.permutation(ROWS)[:57]
    traced_full, *_ = run_short_job([full], 1)
    traced_both, final, _, job = run_short_job([full, short], 1)
    assert traced_both == traced_full, "the short batch compiled a size of its own"
    assert_trees_close(final, reference(*job, [full, short], lr=0.1))


def test_a_short_batch_reuses_a_compiled_size_above_its_own_bucket():
    """A short batch's groups run at the smallest size full batches already ran at that holds
    them, even where their own ladder size is smaller: 40 rows in 2 groups of 20 run at 32 (a
    full batch's groups at 2), not at 20, which would compile every kernel again. Exact."""
    assert bucket_rows(20, ROWS) == 20 and buckets(2) == {32}
    rng = np.random.default_rng(8)
    full, short = rng.permutation(ROWS), rng.permutation(ROWS)[:40]
    traced_full, *_ = run_short_job([full], 2)
    traced_both, final, padded, job = run_short_job([full, short], 2)
    assert traced_both == traced_full, "the short batch compiled a size of its own"
    assert all(sizes == [(32,), (32,)] for sizes in padded.values()), padded
    assert_trees_close(final, reference(*job, [full, short], lr=0.1))


def compiles_during(run) -> list[str]:
    """The XLA compilations JAX logs while ``run()`` runs (every thread's)."""
    import logging

    import jax

    class Compiles(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.seen: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            if "Finished XLA compilation" in record.getMessage():
                self.seen.append(record.getMessage())

    probe, jax_log = Compiles(), logging.getLogger("jax")
    jax_log.addHandler(probe)
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)  # for every thread (the party's compute lane)
    try:
        run()
    finally:
        jax.config.update("jax_log_compiles", was)
        jax_log.removeHandler(probe)
    return probe.seen


def test_compile_ahead_leaves_the_first_batch_only_the_kernels_the_count_shapes():
    """`SplitParty.compile_ahead` compiles every stage's ``update`` and ``zeros`` (their
    shapes follow from the parameters alone), so the first batch compiles neither; a batch
    of fewer than two tiles leaves it the kernels its count shapes."""
    topo = leader_follower()
    parties, *_ = make_job(topo, rows=ROWS, config=config())
    for party in parties.values():
        party.compile_ahead()
    seen = compiles_during(
        lambda: asyncio.run(train_steps(parties, topo, [np.arange(ROWS)], lambda i: 2))
    )
    assert any("jit(forward)" in m for m in seen), seen  # the probe sees compiles
    assert not [m for m in seen if "jit(update)" in m or "jit(zeros)" in m], seen


@pytest.mark.parametrize("topo", [leader_follower(), two_party(), u_shape()], ids=str)
def test_compile_ahead_leaves_tiled_batches_nothing_to_compile(topo):
    """With a batch of whole tiles (2048 rows, tiles of 512) `SplitParty.compile_ahead` also
    compiles the tile's ``forward``, ``backward`` and loss step, for exactly the arguments a
    batch passes, and hands the leader's tuner the seconds it took: batches at any count up
    to the whole tiles then compile no training kernel, and training stays exact."""
    rows = 2048
    parties, data, labels, models = make_job(topo, rows=rows, config=config(rows))
    init = {s: p for party in parties.values() for s, p in party.params.items()}
    for party in parties.values():
        party.compile_ahead()
    compiled = parties[topo.label_owner].tuner_state.compile_s  # what rule 0 weighs
    assert compiled is not None and compiled > 0, compiled
    counts = (2, 1, 4)
    rng = np.random.default_rng(0)
    batches = [rng.permutation(rows) for _ in counts]
    seen = compiles_during(
        lambda: asyncio.run(train_steps(parties, topo, batches, counts.__getitem__))
    )
    kernels = ("forward", "backward", "loss_step", "update", "zeros")
    assert not [m for m in seen if any(f"jit({k})" in m for k in kernels)], seen
    final = {s: p for party in parties.values() for s, p in party.params.items()}
    assert_trees_close(final, reference(topo, models, init, data, labels, batches, lr=0.1))


TILED = 2048  # four tiles of 512 rows (`tile_rows`), run in calls of 1024 and 512 rows


def test_every_count_up_to_the_whole_tiles_runs_the_tile_sizes_alone():
    """A batch of 2048 rows is four tiles of 512, computed in calls of 1024 and 512 rows
    (`tile_sizes`): 3 groups (512, 1024, 512 rows) trace each training kernel once per size,
    and then 1, 2 and 4 groups (2 x 1024, 1024 each, 512 each) trace nothing more."""
    assert tile_rows(TILED) == 512 and tile_sizes(TILED) == (1024, 512)
    once = traces_after((3,), TILED)
    trained = {k: c for k, c in once.items() if k[2] in ("forward", "backward", "loss_step")}
    assert trained and all(count == 2 for count in trained.values()), once
    every = traces_after((3, 1, 2, 4, 3), TILED)
    assert every == once, f"a count within the whole tiles retraced: {once} -> {every}"


@pytest.mark.parametrize("topo", [two_party(), leader_follower(), u_shape()], ids=str)
def test_tiled_groups_train_exactly(topo):
    """Groups run in tiles (a batch of 2500 rows: 4 tiles of 512 and 452 more rows, in calls
    of 1024, 1024 and 452 rows at 1 group, 512 and 1024 at 3; 9 groups: the ladder cut, pieces
    of one call each) give the plain-JAX full-batch parameters."""
    rows, counts = 2500, [1, 3, 9]
    assert tile_rows(rows) == 512 and rows % 512 == 452
    assert_trains_exactly(topo, config(rows), counts, seed=5)


def test_tiled_groups_in_chunks_train_exactly():
    """Messages of more rows than a tile (3 chunks of a 2048-row group: 683 and 682 rows,
    which the loss party computes one message at a time, each as a tile and the rest) are
    exact."""
    import dataclasses

    cfg = dataclasses.replace(config(TILED), chunks=3)
    assert_trains_exactly(leader_follower(), cfg, [2], seed=6)


def test_tiled_groups_travel_compressed():
    """A compressed cut of a tiled group is encoded whole (the pieces' real rows joined):
    int8 cuts of one 2048-row group (2 kernel pieces of 1024 rows on each party) train close
    to the exact run."""
    import dataclasses

    topo, rows = leader_follower(), TILED
    results = {}
    for compress in ("none", "int8"):
        cfg = dataclasses.replace(config(rows), compress=compress)
        parties, *_ = make_job(topo, rows=rows, config=cfg)
        asyncio.run(train_steps(parties, topo, [np.arange(rows)] * 2, lambda i: 1))
        results[compress] = {s: p for party in parties.values() for s, p in party.params.items()}
        assert all(party.handler.padded[0] == (1024, 1024) for party in parties.values())
    assert_trees_close(results["int8"], results["none"], atol=2e-2)
