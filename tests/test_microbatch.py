"""Micro-batching: group bounds, the method's rule, and the automatic group-count tuner.

The tuner is driven by a simulated pipeline whose batch time follows the model in
`tandem.engine.microbatch` (``W(n) = max T + (sum T - max T) / n + n * c0``), with seeded noise that
only ever adds time (other load on a machine never makes a batch faster), a compile cost on the
first batch at each new ``n``, and the follower's drain of the previous batch carried into the
next one (the leader's batch ends before the follower's last backward).
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.engine.microbatch import (
    MIN_TILE,
    TILE_DOUBLINGS,
    TILES_PER_BATCH,
    GroupTuner,
    TunerState,
    bucket_rows,
    group_bounds,
    kernel_pieces,
    rule_groups,
    shared_shape_counts,
    tile_rows,
    tile_sizes,
)
from tandem.errors import ConfigError


def _padding(sizes, batch):
    """Rows the kernels compute beyond the batch's own for groups of ``sizes`` rows."""
    return sum(bucket_rows(s, batch) - s for s in sizes)


def _even_middled(batch, n):
    """The plain tapered cut: ends half a middle group, middles within one row."""
    end = batch // (2 * n - 2) if n >= 3 else 0
    if end < 1:
        return [batch // n + (i < batch % n) for i in range(n)]
    inner = batch - 2 * end
    return [end, *(inner // (n - 2) + (i < inner % (n - 2)) for i in range(n - 2)), end]


@given(batch=st.integers(1, 600), data=st.data())
def test_group_bounds_cover_the_batch_with_tapered_ends(batch, data):
    n = data.draw(st.integers(1, min(batch, 24)) | st.integers(1, batch))
    bounds = group_bounds(batch, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert group_bounds(batch, n) == bounds  # every party cuts the same
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 1 and len(set(sizes)) <= 4
    # never more padding rows than the even-middled cut, whose groups the ladder rounds up
    assert _padding(sizes, batch) <= _padding(_even_middled(batch, n), batch)
    if n >= 3 and batch >= 2 * n - 2:  # ends at most three quarters of a middle group
        middle = sizes[1:-1]
        assert max(sizes[0], sizes[-1]) <= 0.75 * sum(middle) / len(middle)
        assert max(middle) <= max(min(middle) + 1, 1.25 * min(middle))  # adjacent sizes
    else:
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("batch", [64, 256, 1024, 2048, 4096, 8192])
def test_a_power_of_two_batch_is_cut_without_padding(batch):
    for n in range(1, 65):
        sizes = [hi - lo for lo, hi in group_bounds(batch, n)]
        assert _padding(sizes, batch) == 0, (n, sizes)
        assert len({*sizes}) <= 3, (n, sizes)


def test_tapered_ends_are_about_half_a_middle_group():
    def sizes(batch, n):
        return [hi - lo for lo, hi in group_bounds(batch, n)]

    assert sizes(2048, 9) == [128] + [256] * 7 + [128]  # the even-middled cut is on the ladder
    assert sizes(2048, 6) == [256] + [384] * 4 + [256]  # 204 + 4 * 409 + 204 would pad to 448s
    assert sizes(4096, 4) == [512, 1536, 1536, 512]  # whole tiles of 512 (below)
    assert sizes(4096, 9) == [256] + [512] * 7 + [256]  # more groups than tiles: the ladder cut
    assert sizes(1000, 4) == [112, 384, 384, 120]  # no cut on the ladder: the last group pads 8
    assert sizes(10, 2) == [5, 5]
    assert sizes(8, 8) == [1] * 8  # too small to taper


def test_tile_rows_is_an_eighth_of_the_batch_on_the_ladder_but_never_small():
    assert tile_rows(1) == tile_rows(4096) == MIN_TILE == 512
    assert tile_rows(5000) == 512 and tile_rows(8192) == 1024 and tile_rows(10_000) == 1024
    assert tile_rows(65_536) == 8192 and tile_rows(100_000) == 12_288
    for batch in range(1, 200_000, 997):
        tile = tile_rows(batch)
        assert bucket_rows(tile, 10**9) == tile  # on the ladder
        assert tile == MIN_TILE or tile <= batch / TILES_PER_BATCH < 1.25 * tile


@given(batch=st.integers(2 * MIN_TILE, 300_000), data=st.data())
def test_a_batch_of_whole_tiles_is_cut_on_tile_boundaries(batch, data):
    """Every count up to the batch's whole tiles cuts groups of whole tiles, the rest of the
    rows in the last group: so their kernel pieces all run at the tile's size (and the rest's)."""
    tile = tile_rows(batch)
    tiles = batch // tile
    n = data.draw(st.integers(1, tiles))
    bounds = group_bounds(batch, n)
    sizes = [hi - lo for lo, hi in bounds]
    assert len(sizes) == n and sum(sizes) == batch and bounds[0][0] == 0
    assert all(s % tile == 0 and s >= tile for s in sizes[:-1])
    assert sizes[-1] % tile == batch % tile and sizes[-1] >= tile
    if n >= 3:  # ends no larger than the middles, which differ by at most a tile
        whole = [s // tile for s in sizes]
        middle = whole[1:-1]
        assert max(whole[0], whole[-1]) <= min(middle) and max(middle) - min(middle) <= 1
    tiles = tile_sizes(batch)
    pieces = [p for lo, hi in bounds for p in kernel_pieces(lo, hi, tiles)]
    assert pieces[0][0] == 0 and pieces[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert {b - a for a, b in pieces} <= {*tiles, batch % tile}


def test_kernel_pieces_are_whole_tiles_then_the_rest():
    assert kernel_pieces(0, 512, (512,)) == [(0, 512)]
    assert kernel_pieces(100, 300, (512,)) == [(100, 300)]
    assert kernel_pieces(512, 1792, (512,)) == [(512, 1024), (1024, 1536), (1536, 1792)]
    # several sizes: the largest that fits the rows left, each time
    sizes = (2048, 1024, 512)
    assert kernel_pieces(0, 4096, sizes) == [(0, 2048), (2048, 4096)]
    assert kernel_pieces(512, 2048, sizes) == [(512, 1536), (1536, 2048)]
    assert kernel_pieces(0, 2500, sizes) == [(0, 2048), (2048, 2500)]
    assert kernel_pieces(0, 300, sizes) == [(0, 300)]


def test_tile_sizes_double_the_tile_up_to_half_the_whole_tiles():
    assert tile_sizes(4096) == (2048, 1024, 512)
    assert tile_sizes(2048) == (1024, 512) and tile_sizes(1024) == tile_sizes(100) == (512,)
    assert tile_sizes(65_536) == (32_768, 16_384, 8192)
    for batch in range(1, 200_000, 997):
        tile, sizes = tile_rows(batch), tile_sizes(batch)
        assert sizes[-1] == tile and len(sizes) <= TILE_DOUBLINGS + 1
        assert all(a == 2 * b for a, b in zip(sizes, sizes[1:], strict=False))
        assert sizes[0] == tile or 2 * sizes[0] <= batch  # at most half the batch


@pytest.mark.parametrize("batch,n", [(0, 1), (8, 0), (8, 9)])
def test_group_bounds_refuses_impossible_counts(batch, n):
    with pytest.raises(ConfigError):
        group_bounds(batch, n)


def test_rule_is_bytes_over_bandwidth_over_compute_clamped():
    assert rule_groups(8e6, 1e6, 2.0, 64) == 4
    assert rule_groups(8e6, 1e6, 0.001, 64) == 64  # clamped to the batch
    assert rule_groups(1.0, 1e9, 2.0, 64) == 1
    assert rule_groups(8e6, None, 2.0, 64) == 1  # nothing measured: nothing to hide


class Pipeline:
    """Batch wall times as the leader measures them, for a given per-group cost ``c0``."""

    def __init__(
        self,
        seed: int,
        *,
        compute=1.0,
        link=1.0,
        c0=0.004,
        noise=0.05,
        compile_s=0.3,
        drain=0.5,
        shift=0.3,
    ):
        self.rng = np.random.default_rng(seed)
        self.compute, self.link, self.c0 = compute, link, c0
        self.noise, self.compile_s, self.drain, self.shift = noise, compile_s, drain, shift
        self.seen: set[int] = set()
        self.leftover = 0.0

    def ideal(self, n: int) -> float:
        big, small = max(self.compute, self.link), min(self.compute, self.link)
        return big + small / n + n * self.c0

    def batch(self, n: int) -> float:
        # the follower's work after the leader's batch ended, counted in the next batch: its
        # last group, plus a random share that grows with n (measured: per-batch walls at
        # n = 16 spread over +-30% where n = 8 spread over +-5%, their sums steady)
        tail = self.drain * self.ideal(n) / n
        tail += self.rng.uniform(0, self.shift * min(1.0, n / 32)) * self.ideal(n)
        wall = self.ideal(n) - tail + self.leftover
        self.leftover = tail
        if n not in self.seen:  # the follower's backward compiles after the leader's first
            self.seen.add(n)  # batch at n ended, so half the compile lands in the second
            wall += self.compile_s / 2
            self.leftover += self.compile_s / 2
        return wall * (1 + self.noise * self.rng.exponential())


def settle(tuner: GroupTuner, pipe: Pipeline, batches: int = 200) -> int:
    state, path = tuner.init(), []
    for _ in range(batches):
        path.append(state.n)
        links = [(pipe.link * 1e6, 1e6)]
        _, state = tuner.observe(state, pipe.batch(state.n), compute=pipe.compute, links=links)
        if state.settled:
            return state.n
    raise AssertionError(f"tuner did not settle: {path}")


def counts_tried(
    tuner: GroupTuner, pipe: Pipeline, batches: int = 400, compiled: float | None = None
) -> tuple[set[int], int]:
    """Every count ``tuner`` ran over ``batches`` batches of ``pipe`` (the first search and
    the re-checks after it), and the count it ended at; ``compiled``: the seconds the party
    compiled ahead (`GroupTuner.compiled`), None when it did not."""
    state, seen = tuner.init(), set()
    if compiled is not None:
        state = tuner.compiled(state, compiled)
    for _ in range(batches):
        seen.add(state.n)
        links = [(pipe.link * 1e6, 1e6)]
        _, state = tuner.observe(state, pipe.batch(state.n), compute=1.0, links=links)
    return seen, state.n


def test_where_compiling_is_dear_the_search_never_leaves_max_n():
    """With ``max_n`` (a party's `shared_shape_counts`: counts beyond it compile new shapes)
    and a first batch that took 15 batch walls more than the others (its compilations), the
    tuner neither starts nor probes above ``max_n``, even where a larger count would be
    faster (c0 = 0.001 puts the best count near 32)."""
    assert shared_shape_counts(4096) == 8 and shared_shape_counts(1000) == 0
    assert GroupTuner(batch=4096, max_n=8).top == 8 and GroupTuner(batch=4).top == 4
    for seed in range(20):
        pipe = Pipeline(seed, c0=0.001, compile_s=30.0)
        seen, n = counts_tried(GroupTuner(batch=4096, max_n=8), pipe)
        assert max(seen) == 8 and n >= 4, (seed, sorted(seen), n)
    with pytest.raises(ConfigError, match="max_n"):
        GroupTuner(batch=64, max_n=-1)


def test_where_compiling_is_cheap_the_search_goes_past_max_n():
    """A first batch within ``compile_budget`` batch walls of the others opens every count:
    the same pipelines with a compile of 0.3 batch walls settle past ``max_n`` near 32."""
    ends = []
    for seed in range(20):
        seen, n = counts_tried(GroupTuner(batch=4096, max_n=8), Pipeline(seed, c0=0.001))
        assert max(seen) > 8, (seed, sorted(seen))
        ends.append(n)
    assert np.median(ends) >= 16, ends


def test_compiling_ahead_tells_the_search_what_compiling_costs():
    """A party that compiled ahead has a cheap first batch; the seconds it compiled decide
    rule 0 instead: 30 batch walls keep the search within ``max_n``, 0.3 open every count."""
    for seed in range(10):
        tuner = GroupTuner(batch=4096, max_n=8)
        seen, _ = counts_tried(tuner, Pipeline(seed, c0=0.001), compiled=30.0)
        assert max(seen) == 8, (seed, sorted(seen))
        seen, _ = counts_tried(tuner, Pipeline(seed, c0=0.001), compiled=0.3)
        assert max(seen) > 8, (seed, sorted(seen))


@pytest.mark.parametrize("c0", [0.001, 0.004, 0.016])
def test_tuner_settles_near_the_best_power_of_two(c0):
    """Over 100 seeded noisy runs: within 10% of the best power of two in at least 95 of
    them, and never worse than 20% (noise is 5% per batch on average, with a long tail)."""
    ratios = []
    for seed in range(100):
        pipe = Pipeline(seed, c0=c0)
        n = settle(GroupTuner(batch=1024), pipe)
        best = min((2**k for k in range(11)), key=pipe.ideal)
        ratios.append(pipe.ideal(n) / pipe.ideal(best))
    ratios = np.array(ratios)
    assert (ratios <= 1.10).mean() >= 0.95 and ratios.max() <= 1.20, np.sort(ratios)[-10:]


def test_observe_is_pure():
    """``observe`` returns a new state and leaves the one it was given as it was: the same
    state and wall give the same count however often they are observed."""
    tuner = GroupTuner(batch=64, samples=1)
    start = tuner.init(4)
    n, s = tuner.observe(start, 1.0, compute=1.0, links=[(2e6, 1e6)])  # rule: n = 2
    assert (start.n, start.batches, start.started) == (4, 0, False) and (n, s.n) == (2, 2)
    for wall in (9.0, 9.0, 1.0):
        _, s = tuner.observe(s, wall)
    before = s
    first = tuner.observe(s, 0.5)
    assert tuner.observe(s, 0.5) == first and s == before and dict(s.walls) == {2: (1.0,)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n = 3


def test_first_batch_after_a_change_is_not_a_sample():
    tuner = GroupTuner(batch=64, samples=2)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=0.5, links=[(4e6, 8e6)])
    assert n == 1  # rule: ceil(0.5 / 0.5) = 1
    _, s = tuner.observe(s, 0.01)  # the change's first batch: absurdly fast, ignored
    _, s = tuner.observe(s, 3.0)  # a new n's second: the follower's compile, ignored
    assert 1 not in s.walls
    _, s = tuner.observe(s, 2.0)
    _, s = tuner.observe(s, 2.0)
    assert s.walls[1] == (2.0, 2.0) and s.n == 2  # probing 2n, judged on real samples


def test_two_batches_of_a_new_n_are_no_samples_one_of_a_known_n():
    """The follower compiles a new n's backward after the leader's first batch at it ended, so
    a new n's first two batches are no samples; going back to an n that ran before (its shapes
    compiled), only the first is skipped."""
    tuner = GroupTuner(batch=64, samples=1)
    _, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(2e6, 1e6)])  # rule: 2
    walls = []
    for wall in (9.0, 5.0, 1.0):  # at 2: the change's batch, the compile's spill, a sample
        walls.append(s.n)
        _, s = tuner.observe(s, wall)
    assert s.walls == {2: (1.0,)} and s.n == 4  # probing 2n = 4 ...
    _, s = tuner.observe(s, 9.0)  # ... which ran first (compiled): one batch skipped
    _, s = tuner.observe(s, 0.9)
    assert s.walls[4] == (0.9,) and walls == [2, 2, 2]


def test_the_first_batch_compile_is_skipped_when_the_rule_keeps_n():
    tuner = GroupTuner(batch=64, samples=1)
    n, s = tuner.observe(tuner.init(2), 1.0, compute=1.0, links=[(2e6, 1e6)])
    assert n == 2  # rule keeps n = 2
    _, s = tuner.observe(s, 5.0)  # the first batch's spill
    assert 2 not in s.walls
    _, s = tuner.observe(s, 1.0)
    assert s.walls[2] == (1.0,)


def test_rule_start_counts_compute_the_leader_cannot_see():
    """Leader computes 0.01 s of a 1.5 s batch whose busiest link takes 0.5 s: the rest, not
    the leader's 0.01 s, is the compute the link must hide behind (n = 1, not 50)."""
    tuner = GroupTuner(batch=1024)
    assert tuner.observe(tuner.init(4), 1.5, compute=0.01, links=[(5e6, 1e7)])[0] == 1


def test_a_level_step_up_is_followed_by_one_more():
    """n = 2 is level with n = 1 (a plateau), n = 4 is clearly faster: the tuner looks at 4."""
    tuner = GroupTuner(batch=64, samples=2)
    _, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(1e6, 1e6)])  # rule: n = 1
    walls = {1: 1.0, 2: 0.99, 4: 0.7, 8: 0.75}
    for _ in range(40):
        _, s = tuner.observe(s, walls.get(s.n, 1.0))
        if s.settled:
            break
    assert s.n == 4 and s.settled


def test_a_scattering_n_does_not_win_on_its_luckiest_batch():
    """Walls of n = 2 trade time batch to batch (mean 1.0); n = 1 is steady at 0.95."""
    tuner = GroupTuner(batch=64, samples=3)
    _, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(1e6, 1e6)])  # rule: 1
    for wall in (5.0, 5.0, 0.95, 0.95, 0.95):  # 5.0: a new n's first two batches, ignored
        _, s = tuner.observe(s, wall)
    assert s.n == 2
    for wall in (5.0, 5.0, 0.6, 1.4, 1.0):
        _, s = tuner.observe(s, wall)
    assert s.base == 1  # not moved to 2 (its fastest batch, 0.6, is luck)


def _settle_on(
    tuner: GroupTuner, state: TunerState, walls: dict[int, float]
) -> tuple[TunerState, list[int]]:
    """Settle with every batch of each n taking that n's wall."""
    return _settle_on_sequence(tuner, state, {n: [w] for n, w in walls.items()})


@pytest.mark.parametrize(
    "wall4, wall8, settles_on",
    [
        (0.90, 0.70, 8),
        (0.90, 0.79, 8),
        (0.90, 0.81, 8),
        (0.90, 0.83, 6),
        (0.70, 0.79, 4),
        (0.75, 0.70, 8),
        (0.79, 0.90, 6),
        (0.81, 0.815, 8),
    ],
)
def test_refines_on_both_sides_of_the_base(wall4, wall8, settles_on):
    """The doubling search from a rule start of 3 sees 3, 6, 12: once 6 is the base, both
    midpoints (4 and 8) are tried once, and the search settles on the largest of 4, 6 and 8
    within the 3% tolerance of the fastest (8 at 0.81 ties with 6 at 0.80 and is taken; at
    0.83 it is slower; 4 at 0.79 is faster than 6 but within the tolerance, so 6 stays)."""
    tuner = GroupTuner(batch=64, samples=2)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(3e6, 1e6)])
    assert n == 3  # rule: ceil(3/1)
    walls = {1: 1.5, 3: 1.0, 6: 0.8, 12: 0.85, 24: 1.0, 4: wall4, 8: wall8}
    s, _ = _settle_on(tuner, s, walls)
    assert s.n == settles_on
    assert {4, 8} <= set(s.walls)  # both midpoints were measured either way


def test_finds_the_midpoint_on_the_side_of_the_slower_neighbour():
    """3 beats 12, so the midpoint towards the faster neighbour is 4, yet 8 is the fastest.
    The tuner measures 8 too and settles there."""
    tuner = GroupTuner(batch=2048, samples=2)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(3e6, 1e6)])
    assert n == 3
    walls = {1: 1.4, 3: 0.84, 6: 0.80, 12: 0.86, 4: 0.81, 8: 0.74}
    s, path = _settle_on(tuner, s, walls)
    assert s.n == 8
    assert path.index(4) < path.index(8)  # the faster side's midpoint first


def _settle_on_sequence(
    tuner: GroupTuner, state: TunerState, walls: dict[int, list[float]]
) -> tuple[TunerState, list[int]]:
    """Settle with each n's batches taking the next wall of its list (the last one repeats);
    the settled state and the n of every batch run."""
    runs: dict[int, int] = {}
    path: list[int] = []
    for _ in range(120):
        n = state.n
        path.append(n)
        seq = walls[n]
        _, state = tuner.observe(state, seq[min(runs.get(n, 0), len(seq) - 1)])
        runs[n] = runs.get(n, 0) + 1
        if state.settled:
            return state, path
    raise AssertionError(f"tuner did not settle: {path}")


def _unlucky_eight() -> dict[int, list[float]]:
    """From a rule start of 3 the base becomes 6 (midpoints 4 and 8). 8's first batches are
    unlucky (0.84, 5% behind 6 at 0.80: outside the 3% tie), its later ones show it faster
    (0.76). 6 and 4 are steady; 3, 12 and 24 are clearly slower."""
    walls = {1: [1.5], 3: [1.0], 6: [0.8], 12: [0.9], 24: [1.0], 4: [0.83]}
    walls[8] = [0.84] * 6 + [0.76]  # the first two are no samples (a new n's compile)
    return walls


def _start_at_three(tuner: GroupTuner) -> TunerState:
    """The state after a first batch whose rule gives n = ceil(3 / 1) = 3."""
    n, state = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(3e6, 1e6)])
    assert n == 3
    return state


def test_a_close_call_is_measured_again_before_the_first_search_settles():
    """8 lost to 6 by less than three tolerances, so every count that near (6, 8, and 4 at
    0.83) is measured again, each as often, and the pooled means decide: 8 (0.80 against
    0.80 for 6, a tie that goes to the larger). Without the re-measuring 6 is kept."""
    tuner = GroupTuner(batch=2048, samples=4, recheck=10, recheck_max=10)
    s, _ = _settle_on_sequence(tuner, _start_at_three(tuner), _unlucky_eight())
    assert s.n == 8
    assert [len(s.walls[k]) for k in (4, 6, 8)] == [8, 8, 8]  # one round: 8 won it
    assert s.walls[8][-4:] == (0.76,) * 4
    for _ in range(10):  # settled until the re-check, which probes 8's neighbours again
        _, s = tuner.observe(s, 0.76)
    assert not s.settled and s.n == 16

    once = GroupTuner(batch=2048, samples=4, confirm=0)
    s, _ = _settle_on_sequence(once, _start_at_three(once), _unlucky_eight())
    assert s.n == 6
    assert len(s.walls[8]) == 4


def test_a_larger_count_that_won_the_tie_by_luck_is_measured_again():
    """12 (the base 6's 2n) has four lucky batches (0.81, within 3% of 8 at 0.79) and is slow
    after them (0.90): measured again, it drops out of the tie and the search settles on 8.
    Without the re-measuring the tie goes to 12."""
    walls = {1: [1.5], 3: [1.0], 6: [0.8], 4: [0.83], 24: [1.0], 8: [0.79], 12: [0.81] * 6 + [0.9]}
    tuner = GroupTuner(batch=2048, samples=4)
    s, _ = _settle_on_sequence(tuner, _start_at_three(tuner), walls)
    assert s.n == 8
    assert len(s.walls[12]) >= 8

    once = GroupTuner(batch=2048, samples=4, confirm=0)
    s, _ = _settle_on_sequence(once, _start_at_three(once), walls)
    assert s.n == 12


def test_measuring_again_is_bounded_and_skipped_when_the_larger_count_won():
    """A larger count that stays behind (8 at a steady 0.84) is measured again at most
    ``confirm`` times; one that won the first time (8 at 0.79) is not measured again."""
    walls = _unlucky_eight()
    walls[8] = [0.84]
    tuner = GroupTuner(batch=2048, samples=4, confirm=2)
    s, _ = _settle_on_sequence(tuner, _start_at_three(tuner), walls)
    assert s.n == 6
    assert [len(s.walls[k]) for k in (4, 6, 8)] == [12, 12, 12]

    walls[8] = [0.79]
    s, _ = _settle_on_sequence(tuner, _start_at_three(tuner), walls)
    assert s.n == 8
    assert [len(s.walls[k]) for k in (4, 6, 8)] == [4, 4, 4]


def test_trimmed_mean_cuts_both_ends_alike():
    from tandem.engine.microbatch import trimmed_mean

    assert trimmed_mean([0.79, 0.79, 1.10, 0.79]) == pytest.approx(0.79)  # a hiccup is cut
    assert trimmed_mean([1.0, 3.0, 1.0, 3.0]) == 2.0  # walls trading time keep their centre
    assert trimmed_mean([1.0, 2.0, 9.0], trim=0.0) == 4.0  # 0: the plain mean
    assert trimmed_mean([5.0, 1.0, 3.0]) == 3.0  # fewer than 4 values: nothing cut
    assert trimmed_mean(list(range(12))) == 5.5  # 3 cut at each end of 12
    with pytest.raises(ValueError, match="no values"):
        trimmed_mean([])
    with pytest.raises(ValueError, match=r"must be in \[0, 0.5\)"):
        trimmed_mean([1.0, 2.0], trim=0.5)
    with pytest.raises(ConfigError, match=r"trim .* must be in \[0, 0.5\)"):
        GroupTuner(batch=64, trim=0.5)


def test_one_hiccup_among_a_counts_batches_does_not_decide_the_tie():
    """8 is as fast as 6 but one of its four samples is a machine hiccup (1.10 against 0.79).
    The plain mean puts 8 8.4% behind 6, so without re-measuring the search keeps 6; the
    interquartile mean cuts the hiccup, and 8 wins the tie without a second round."""

    def walls():
        w = _unlucky_eight()
        w[8] = [0.84, 0.84, 0.79, 1.10, 0.79]  # two compile batches, then the samples
        return w

    plain = GroupTuner(batch=2048, samples=4, confirm=0, trim=0.0)
    s, _ = _settle_on_sequence(plain, _start_at_three(plain), walls())
    assert s.n == 6

    tuner = GroupTuner(batch=2048, samples=4)
    s, _ = _settle_on_sequence(tuner, _start_at_three(tuner), walls())
    assert s.n == 8
    assert len(s.walls[8]) == 4  # decided on the first four: no close call


@given(batch=st.integers(1, 300), n=st.integers(1, 20), chunks=st.integers(1, 9))
def test_chunk_bounds_cut_every_group_into_contiguous_parts(batch, n, chunks):
    from tandem.engine.microbatch import chunk_bounds, fit_chunks

    n = min(n, batch)
    groups = group_bounds(batch, n)
    c = fit_chunks(batch, n, chunks)
    assert 1 <= c <= chunks and (c == chunks or c == min(hi - lo for lo, hi in groups))
    parts = chunk_bounds(groups, c)
    assert len(parts) == n * c
    assert parts[0][0] == 0 and parts[-1][1] == batch
    # contiguous, in row order
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    for k, (lo, hi) in enumerate(groups):  # group k is exactly its c parts
        mine = parts[k * c : (k + 1) * c]
        assert mine[0][0] == lo and mine[-1][1] == hi
        sizes = [b - a for a, b in mine]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_chunk_bounds_refuse_a_group_smaller_than_its_chunks():
    from tandem.engine.microbatch import chunk_bounds

    with pytest.raises(ConfigError, match="cannot travel in 4 chunks"):
        chunk_bounds([(0, 3), (3, 10)], 4)


@given(
    idx=st.lists(st.integers(0, 19), min_size=1, max_size=30),
    lo=st.integers(0, 30),
    hi=st.integers(0, 30),
)
def test_batch_rows_gather_exactly_the_rows_asked(idx, lo, hi):
    from tandem.engine.data import BatchRows

    data = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    rows = BatchRows(data, np.array(idx))
    assert len(rows) == len(idx)
    np.testing.assert_array_equal(rows[lo:hi], data[np.array(idx)][lo:hi])


def test_batch_rows_of_consecutive_indices_are_a_view():
    from tandem.engine.data import BatchRows

    data = np.zeros((10, 2), np.float32)
    part = BatchRows(data, np.arange(2, 9))[1:4]
    assert np.shares_memory(part, data) and part.shape == (3, 2)
    with pytest.raises(TypeError, match="slice"):
        BatchRows(data, np.arange(3))[0]


def _run_until_settled(
    tuner: GroupTuner, state: TunerState, walls: dict[int, float], batches: int
) -> tuple[TunerState, list[int]]:
    """Run each n at its wall (1.3 for one not listed) until the tuner settles; the settled
    state and the counts run while a trial measured a tie or a win again."""
    trial: list[int] = []
    path: list[int] = []
    for _ in range(batches):
        if state.trial is not None:
            trial.append(state.n)
        path.append(state.n)
        _, state = tuner.observe(state, walls.get(state.n, 1.3))
        if state.settled:
            return state, trial
    raise AssertionError(path)


def test_the_first_search_takes_any_faster_n_a_settled_one_only_beyond_the_tolerance():
    """The rule's start is a guess, so the first search moves to any faster mean (a margin
    there keeps a lucky start). Once settled, a re-check moves only for more than
    ``tolerance``: noise does not flap n."""
    tuner = GroupTuner(batch=64, samples=1, recheck=6, recheck_max=6)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(2e6, 1e6)])
    assert n == 2  # rule: n = 2
    walls = {1: 1.1, 2: 1.0, 4: 0.99, 8: 1.2}

    s, _ = _run_until_settled(tuner, s, walls, 40)
    assert s.n == 4  # 1% faster than 2: taken by the first search
    walls[2] = 0.975  # 2 now 1.5% faster than 4: within the tolerance
    for _ in range(6):  # the re-check interval passes, then 4's neighbours are probed again
        _, s = tuner.observe(s, walls[4])
    s, _ = _run_until_settled(tuner, s, walls, 40)
    assert s.n == 4 and tuner.mean(s, 2) == 0.975  # re-measured, not taken
    walls[2] = 0.9  # 9% faster: beyond the tolerance
    for _ in range(6):
        _, s = tuner.observe(s, walls[4])
    s, _ = _run_until_settled(tuner, s, walls, 40)
    assert s.n == 2


@pytest.mark.parametrize("eight, settles_on", [(1.0, 8), (0.98, 8), (1.03, 4)])
def test_a_recheck_gives_a_tie_to_the_larger_count_as_the_first_search_does(eight, settles_on):
    """A re-check whose probes find a larger count level with the settled one (within the
    tolerance either way) moves there, once alternating blocks have measured the tie again:
    the first search's rule (ties to the larger n, shorter fill and drain), which a first
    search misled by a spell could not apply. A larger count further behind leaves n alone,
    and so does a smaller one that is level (the margin: noise does not flap n)."""
    tuner = GroupTuner(batch=64, samples=1, recheck=6, recheck_max=6)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(2e6, 1e6)])
    assert n == 2  # rule: n = 2
    walls = {1: 1.1, 2: 1.0, 4: 0.99, 8: 1.2}

    s, trial = _run_until_settled(tuner, s, walls, 60)
    assert s.n == 4  # 8 was 21% behind in the first search
    walls.update({8: eight, 2: 0.985})  # 8 level (or 4% behind); 2 level, 0.5% ahead
    for _ in range(6):
        _, s = tuner.observe(s, walls[4])
    s, recheck_trial = _run_until_settled(tuner, s, walls, 60)
    trial += recheck_trial
    assert s.n == settles_on
    blocks = [n for i, n in enumerate(trial) if i == 0 or trial[i - 1] != n]
    if settles_on == 8:  # the tie measured again in alternating blocks before the move
        assert len(blocks) == 5 and set(blocks) == {4, 8}
    else:
        assert trial == []


def test_recheck_ties_do_not_chain_away_from_the_fastest_count():
    """A tie is measured from the fastest count, in a re-check as in the first search: with 2
    fastest, 3 within the tolerance of it and 4 within the tolerance of 3 but 5% behind 2, the
    search settles on 3 and its re-checks keep it there (from 3, 4 looked level)."""
    tuner = GroupTuner(batch=64, samples=1, recheck=6, recheck_max=6)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(2e6, 1e6)])
    assert n == 2  # rule: n = 2
    walls = {1: 1.1, 2: 1.0, 3: 1.025, 4: 1.05, 6: 1.1, 8: 1.2}
    s, _ = _run_until_settled(tuner, s, walls, 60)
    assert s.n == 3  # the largest count within 3% of the fastest
    for _ in range(5):  # five re-checks, each after the interval
        for _ in range(6):
            _, s = tuner.observe(s, walls[s.n])
        s, _ = _run_until_settled(tuner, s, walls, 80)
        assert s.n == 3, s.n


@pytest.mark.parametrize("two, settles_on", [(1.02, 2), (0.995, 2), (1.05, 1)])
def test_one_and_two_groups_level_settle_on_two_as_any_tie_does(two, settles_on):
    """1 has no midpoint towards 2, and the tie rules apply all the same: with 2 level with 1
    (within the tolerance either way) the first search settles on 2, and with 2 further
    behind on 1. Seen in `bench.scale` at 1M rows: 1 and 2 groups 2 to 3 % apart, 2 the
    faster in every re-check, and the search held 1 for the whole run."""
    tuner = GroupTuner(batch=4096, max_n=8, samples=1, recheck=6, recheck_max=6)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[])
    assert n == 1  # no link time to hide: the rule starts at 1
    walls = {1: 1.0, 2: two, 4: 1.12}
    s, _ = _run_until_settled(tuner, s, walls, 60)
    assert s.n == settles_on
    if settles_on == 1:  # and a re-check finding 2 level again moves there
        walls[2] = 1.01
        for _ in range(6):
            _, s = tuner.observe(s, walls[1])
        s, trial = _run_until_settled(tuner, s, walls, 60)
        assert s.n == 2 and set(trial) == {1, 2}


def _recheck_of_eight(tuner: GroupTuner, six_after: list[float]) -> TunerState:
    """A tuner settled on 8 (its neighbours and midpoints clearly slower), then run through
    its first re-check, where 6's first four batches are lucky (0.76 against 8's steady 0.80:
    5% faster, beyond the 3% tolerance) and its later ones take their walls from
    ``six_after``. Each n's batches take the next wall of its list; the last one repeats."""
    n, state = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(8e6, 1e6)])
    assert n == 8  # rule: ceil(8/1)
    walls = {
        8: [0.80],
        16: [0.95],
        4: [0.95],
        11: [0.95],
        6: [0.90] * 6 + [0.76] * 5 + six_after,
    }  # first search; re-check; then after
    runs: dict[int, int] = {}
    path: list[int] = []
    settles = 0
    for _ in range(200):
        n, was = state.n, state.settled
        path.append(n)
        seq = walls[n]
        _, state = tuner.observe(state, seq[min(runs.get(n, 0), len(seq) - 1)])
        runs[n] = runs.get(n, 0) + 1
        settles += state.settled and not was
        if settles == 2:
            return state
    raise AssertionError(f"no second settle: {path}")


def test_a_recheck_measures_a_win_again_before_leaving_the_settled_n():
    """One comparison's luck does not move a settled n: 6's four lucky batches at the re-check
    are followed by more of 6 (0.84), and once its pooled mean no longer beats 8 by the
    tolerance, 8 stays. A win that holds when measured again, both counts to eight batches,
    still moves n (the tuner follows a real change)."""
    tuner = GroupTuner(batch=2048, samples=4, recheck=10, recheck_max=10)
    s = _recheck_of_eight(tuner, [0.84])
    assert s.n == 8
    assert len(s.walls[6]) > 4 and tuner.mean(s, 6) > 0.80 * (1 - tuner.tolerance)

    s = _recheck_of_eight(tuner, [0.76])
    assert s.n == 6
    assert len(s.walls[6]) == 8 and len(s.walls[8]) == 8


def test_best_is_the_base_while_a_neighbour_is_on_trial():
    tuner = GroupTuner(batch=64, samples=1)
    _, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(2e6, 1e6)])  # rule: 2
    for wall in (9.0, 9.0, 1.0):  # 2's compile batches, then its sample
        _, s = tuner.observe(s, wall)
    assert s.n == 4 and s.best == 2  # 4 is on trial; 2 is the fastest known
    for wall in (9.0, 0.8):  # 4 ran first (compiled): one batch skipped, then faster
        _, s = tuner.observe(s, wall)
    assert s.n == 1 and s.best == 2  # both neighbours are measured before a move
    for wall in (9.0, 9.0, 1.2):
        _, s = tuner.observe(s, wall)
    assert s.n == 8 and s.best == 2  # 4n on trial too (2n was not slower)
    for wall in (9.0, 9.0, 0.9):
        _, s = tuner.observe(s, wall)
    assert s.best == s.n == 4  # moved to the fastest, 4


def test_a_recheck_measures_a_win_again_in_alternating_blocks_so_a_spell_does_not_decide():
    """The machine speeds up through the re-check (its walls fall 1% a batch: a slow spell
    ending), so each count measured later looks faster, and 6, truly 1% slower than 8, comes
    out ahead of the 8 measured before it. The trial alternates the two in mirrored blocks
    (8, 6, 8, 6, 8: the midpoint 11 ran when it began), so the spell weighs on both alike and
    8 stays. Measuring them in turn (each to eight batches, pooled) moved n to 6."""
    tuner = GroupTuner(batch=2048, samples=4, recheck=10, recheck_max=10)
    n, s = tuner.observe(tuner.init(4), 1.0, compute=1.0, links=[(8e6, 1e6)])
    assert n == 8  # rule: ceil(8/1)
    curve = {8: 0.80, 6: 0.808, 16: 0.95, 4: 0.95, 11: 0.95}
    settles, spell_from, trial, path = 0, None, [], []
    for _ in range(300):
        t = s.batches
        if s.settled and spell_from is None and settles == 1:
            spell_from = t  # the first settle: the spell starts with the re-check
        speed = 1.0 if spell_from is None else max(1.0 - 0.01 * (t - spell_from - 10), 0.6)
        n, was = s.n, s.settled
        path.append(n)
        if s.trial is not None:
            trial.append(n)
        _, s = tuner.observe(s, curve[n] * min(speed, 1.0))
        settles += s.settled and not was
        if settles == 2:
            break
    assert settles == 2, path
    assert s.n == 8
    blocks = [n for i, n in enumerate(trial) if i == 0 or trial[i - 1] != n]
    assert len(blocks) == 5 and blocks[0] == blocks[2] == blocks[4] != blocks[1] == blocks[3]
    # eight samples each, and a skipped batch at each switch (three into 8, from 11 and 6)
    assert (trial.count(8), trial.count(6)) == (8 + 3, 8 + 2)


def _recheck_starts(tuner: GroupTuner, state: TunerState, walls: dict[int, float], batches: int):
    """The batch numbers at which re-checks start over ``batches`` batches at ``walls``."""
    starts = []
    for _ in range(batches):
        was = state.settled
        _, state = tuner.observe(state, walls.get(state.n, 1.3))
        if was and not state.settled:
            starts.append(state.batches)
    return state, starts


def test_each_recheck_that_keeps_n_doubles_the_wait_before_the_next_up_to_recheck_max():
    """Rule 5's backoff: a settled n the re-checks keep confirming is probed ever more rarely
    (the probes run slower counts), and a move sets the wait back to ``recheck``."""
    tuner = GroupTuner(batch=64, samples=1, recheck=10, recheck_max=40)
    walls = {1: 1.2, 2: 1.1, 4: 1.0, 8: 1.1, 3: 1.05, 6: 1.05, 16: 1.2}
    s = tuner.resume(4)
    s, starts = _recheck_starts(tuner, s, walls, 400)
    assert s.n == 4
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    waits = [min(10 * 2 ** (i + 1), 40) for i in range(len(gaps))]
    # each gap is the wait plus the re-check's own probes (a few batches)
    assert all(w < g <= w + 12 for g, w in zip(gaps, waits, strict=True)), (starts, gaps)
    assert starts[0] <= 11 and gaps[-1] > 40  # the first after `recheck`, the last at the cap
    walls[8] = 0.5  # the link changed: 8 is now far faster
    s, _ = _run_until_settled(tuner, dataclasses.replace(s, settled_at=s.batches - 40), walls, 60)
    assert s.n == 8 and s.interval == 10  # a move: the next re-check comes `recheck` in


def test_resume_starts_settled_at_the_given_count_and_first_rechecks_after_recheck():
    tuner = GroupTuner(batch=64, samples=2, recheck=10)
    s = tuner.resume(6)
    assert s.n == 6 and s.settled and s.started and s.best == 6
    for _ in range(9):
        n, s = tuner.observe(s, 1.0)
        assert n == 6  # no search: the first `recheck` batches run the remembered count
    assert len(s.walls[6]) == 8  # the first batch (it loads the kernels) is no sample
    n, s = tuner.observe(s, 1.0)
    assert not s.settled and n in (3, 12)  # then the neighbours are probed again
    short = GroupTuner(batch=64, samples=2, recheck=1)  # a re-check before any sample
    n, s = short.observe(short.resume(4), 1.0)
    assert n == 4 and not s.settled  # it samples the count first, then probes
    with pytest.raises(ConfigError, match="batch=64"):
        tuner.resume(65)
    with pytest.raises(ConfigError, match="recheck_max"):
        GroupTuner(batch=64, recheck=10, recheck_max=5)


def test_a_resumed_count_with_an_earlier_runs_wait_and_wall_rechecks_after_twice_that_wait():
    """Rule 6: a run that starts where an earlier one settled, with the earlier wait and
    wall, counts as one more re-check that kept n: no probe before twice that wait."""
    tuner = GroupTuner(batch=64, samples=2, recheck=10, recheck_max=100)
    walls = {3: 1.1, 12: 1.1, 6: 1.0}
    s = tuner.resume(6, interval=40, wall=1.0)
    assert s.interval == 80 and s.expect == 1.0
    s, starts = _recheck_starts(tuner, s, walls, 81)
    assert starts == [80] and s.expect is None  # compared once, in range: kept
    capped = tuner.resume(6, interval=80, wall=1.0)
    assert capped.interval == 100  # at most recheck_max
    for interval, wall in ((40, None), (0, 1.0)):  # without both: `recheck`, no comparison
        s = tuner.resume(6, interval=interval, wall=wall)
        assert s.interval == 0 and s.expect is None
        _, starts = _recheck_starts(tuner, s, walls, 11)
        assert starts == [10]


@pytest.mark.parametrize("now", [1.3, 0.7])
def test_a_resumed_count_whose_wall_drifted_from_the_earlier_runs_is_rechecked_at_once(now):
    """Rule 6: slower or faster by more than ``drift`` than the earlier run measured (another
    machine, another link), the neighbours are probed as soon as the drift is seen: after
    the loading batch and ``2 * samples`` samples, not after the inherited wait."""
    tuner = GroupTuner(batch=64, samples=2, recheck=10, recheck_max=400)
    s = tuner.resume(6, interval=200, wall=1.0)
    s, starts = _recheck_starts(tuner, s, {6: now, 3: 0.5}, 60)
    assert starts[0] == 1 + 2 * 2  # the loading batch, then 2 * samples
    assert s.best == 3  # and the faster count wins
    near = tuner.resume(6, interval=200, wall=1.0)  # within drift (0.1): no early re-check
    _, starts = _recheck_starts(tuner, near, {6: 1.08}, 30)
    assert starts == []
    with pytest.raises(ConfigError, match="drift"):
        GroupTuner(batch=64, drift=0)


def test_settled_n_is_the_last_settled_count_during_a_recheck_and_none_before_any_settle():
    """What a run that ends now leaves for the next (`TunerState.settled_n`): a run may end in
    the middle of a re-check, probing a slower count; the count it settled on still holds."""
    tuner = GroupTuner(batch=64, samples=1, recheck=5)
    walls = {1: 1.2, 2: 1.1, 4: 1.0, 8: 1.1, 3: 1.05, 6: 1.05, 16: 1.2}
    s = tuner.init()
    _, s = tuner.observe(s, 1.0)
    assert not s.settled and s.settled_n is None  # searching: nothing settled yet
    s, _ = _run_until_settled(tuner, s, walls, 60)
    assert s.settled and s.settled_n == s.n == 4
    while s.settled:
        _, s = tuner.observe(s, walls[s.n])
    assert s.settled_n == 4  # re-checking from 4
    while s.n == 4:
        _, s = tuner.observe(s, walls[s.n])
    assert s.n != 4 and s.settled_n == 4  # probing a neighbour: 4 still holds
