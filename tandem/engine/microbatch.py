"""Micro-batching: group boundaries and the automatic group count.

`group_bounds(B, n)` cuts a batch of ``B`` rows into ``n`` contiguous groups, the first and last
about half as large as the middle ones (a shorter pipeline fill and drain), every group a size
of the `bucket_rows` ladder where such a cut exists, so that no kernel computes padding rows.

`rule_groups` is the method's rule ``n = ceil(bytes_to_send / bandwidth / compute_time)``
clamped to ``[1, B]``. `GroupTuner` re-tunes ``n`` between batches (docs/design.md,
"Micro-batching and choosing n"): a pure ``init`` / ``observe`` pair over an immutable
`TunerState`. It starts from the rule, then hill-climbs on the measured wall time per batch,
each count judged by the `trimmed_mean` of a few batches.

`bucket_rows` maps a group's row count to the compiled shape it runs at: a geometric ladder of
four sizes per octave, so the counts the tuner tries share a small set of kernel shapes
(docs/design.md, "Bounded kernel shapes").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping, Sequence

from tandem.errors import ConfigError


def group_bounds(batch: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``(start, stop)`` row ranges covering ``range(batch)``.

    **Whole tiles.** A batch of at least two `tile_rows` tiles cut into no more groups than it
    has whole tiles is cut on tile boundaries (`_tile_cut`): every group is a whole number of
    tiles, the batch's rows beyond its whole tiles (if any) going to the last group. A party
    computes a group larger than a tile in calls of the `tile_sizes` (`kernel_pieces`), so
    every such count runs the same kernel shapes and a change of count compiles nothing. The
    rest of this docstring describes the cut of smaller batches, and of counts above the
    tiles.

    For ``n >= 3`` the first and last groups are *tapered*: about half the size of the middle
    groups (a batch too small to halve its end groups gets even groups). A batch's pipeline
    cannot run faster than its fill and drain allow: the gradient link idles until the first
    group went forward, across the link and through the loss, and the last group's backward
    waits until every gradient has arrived. Both waits scale with the end groups' size, so
    halving those shortens the batch by about one middle group's transfer and compute while
    costing no extra op.

    The kernels run each group at its `bucket_rows` size, padding it up to the next size of
    the ladder, and a padded row costs as much compute as a real one (a cut of 2048 rows into
    6 even-middled groups of 204 and 409 rows computes 2240). So where the tapered cut pads,
    the groups are cut *on the ladder* instead (`_ladder_cut`: 256, 384, 384, 384, 384, 256):
    middles of one ladder size or two adjacent ones, ends each a quarter to three quarters of
    a middle, every group on the ladder but possibly the last, and the fewest distinct sizes
    (each is a compilation). A cut with fewer padded rows wins; ``n <= 2`` splits evenly.
    Either way at most four sizes occur, every group has at least one row, and the same
    ``(batch, n)`` always gives the same groups (every party computes them on its own).
    """
    if batch < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch}")
    if not 1 <= n <= batch:
        raise ConfigError(f"n_groups must be in [1, batch={batch}], got {n}")
    return list(_cut(batch, n))


@functools.lru_cache(maxsize=1024)
def _cut(batch: int, n: int) -> tuple[tuple[int, int], ...]:
    """`group_bounds` of a valid ``(batch, n)``, cached: a party cuts every batch."""
    tile = tile_rows(batch)
    if 2 <= batch // tile and n <= batch // tile:
        return _bounds(_tile_cut(batch, n, tile))
    sizes = _tapered(batch, n)
    padded = _padding(sizes, batch)
    if n >= 3 and padded:
        ladder = _ladder_cut(batch, n)
        if ladder is not None and _padding(ladder, batch) < padded:
            sizes = ladder
    return _bounds(sizes)


def _bounds(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous ``(start, stop)`` ranges of ``sizes`` rows from row 0."""
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return tuple(bounds)


#: The fewest rows of a kernel tile: below about this many rows a CPU kernel's fixed cost per
#: call (dispatch, a few tens of microseconds) shows in its time per row.
MIN_TILE = 512
#: A batch's whole tiles at most (`tile_rows`): the counts up to this share the `tile_sizes`.
TILES_PER_BATCH = 8
#: Kernel calls of a group of whole tiles run at the tile and up to ``2**TILE_DOUBLINGS``
#: tiles (`tile_sizes`).
TILE_DOUBLINGS = 2


def tile_rows(batch: int) -> int:
    """The rows of a kernel tile for batches of ``batch`` rows: the largest size of the
    `bucket_rows` ladder at most ``batch / TILES_PER_BATCH``, and at least `MIN_TILE`.

    A compute op whose group has more rows than a tile runs it in calls of `tile_sizes`
    (`kernel_pieces`), so a batch of ``B >= 2 * MIN_TILE`` rows cut into up to
    ``B // tile_rows(B)`` groups (`group_bounds` cuts those on whole tiles) compiles each
    kernel at those few sizes, plus one for the rows beyond the whole tiles when ``B`` is not
    a multiple of the tile, whatever count the tuner tries."""
    if batch < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch}")
    return max(MIN_TILE, _ladder_floor(batch // TILES_PER_BATCH))


def _ladder_floor(rows: int) -> int:
    """The largest size of the `bucket_rows` ladder that is ``<= rows`` (0 below 1)."""
    if rows < 8:
        return max(rows, 0)
    e = rows.bit_length() - 3  # rows in [4 * 2**e, 8 * 2**e)
    return max(m << e for m in LADDER_STEPS if m << e <= rows)


def _tile_cut(batch: int, n: int, tile: int) -> list[int]:
    """Sizes of ``n`` groups of whole tiles (``n <= batch // tile``), the rows beyond the whole
    tiles added to the last: even for ``n <= 2``, else the first and last about half a middle
    group (at least one tile each), the middles within one tile of each other."""
    tiles = batch // tile
    if n <= 2:
        counts = [tiles // n + (i < tiles % n) for i in range(n)]
    else:
        end = min(max(1, round(tiles / (2 * n - 2))), (tiles - n + 2) // 2)
        inner = tiles - 2 * end
        counts = [end, *(inner // (n - 2) + (i < inner % (n - 2)) for i in range(n - 2)), end]
    sizes = [c * tile for c in counts]
    sizes[-1] += batch - tiles * tile
    return sizes


def shared_shape_counts(batch: int) -> int:
    """The largest count whose groups of a ``batch``-row batch are whole `tile_rows` tiles
    (every count up to it runs the same kernel shapes, those of `tile_sizes`: `group_bounds`),
    or 0 when the batch holds fewer than two tiles (then every count has sizes of its own)."""
    tiles = batch // tile_rows(batch)
    return tiles if tiles >= 2 else 0


def tile_sizes(batch: int) -> tuple[int, ...]:
    """The sizes, largest first, of the kernel calls a group of whole tiles of a ``batch``-row
    batch runs in: ``tile_rows(batch) * 2**k`` for ``k`` up to `TILE_DOUBLINGS`, of at most half
    the batch's whole tiles each (the tile alone when the batch holds fewer than four).

    A group computes as few calls as these sizes allow (`kernel_pieces`): each call has a fixed
    cost (its dispatch, its arguments and outputs), so 2048 rows in one call cost a CPU less
    than in four calls of 512. Every count up to `shared_shape_counts` still runs these sizes
    alone, so the tuner moves between counts without compiling."""
    tile = tile_rows(batch)
    half = max(1, batch // tile // 2)
    return tuple(tile << k for k in range(TILE_DOUBLINGS, -1, -1) if 1 << k <= half)


def kernel_pieces(lo: int, hi: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The row ranges the kernels run a compute op over rows ``lo:hi`` in. ``sizes``: the call
    sizes, largest first (`tile_sizes`). The whole range when it fits in the smallest size;
    else consecutive calls, each of the largest size that fits the rows left, and the rest
    (fewer rows than the smallest size) last. Each piece is one kernel call, padded to its own
    compiled size by the caller."""
    if hi - lo <= sizes[-1]:
        return [(lo, hi)]
    pieces, a = [], lo
    while a < hi:
        size = next((s for s in sizes if s <= hi - a), hi - a)
        pieces.append((a, a + size))
        a += size
    return pieces


def _padding(sizes: Sequence[int], batch: int) -> int:
    """The padding rows the kernels compute for groups of ``sizes`` rows of a ``batch``."""
    return sum(bucket_rows(s, batch) - s for s in sizes)


def _tapered(batch: int, n: int) -> list[int]:
    """Group sizes: ends half a middle (``n >= 3``), the middles within one row of each other."""
    end = batch // (2 * n - 2) if n >= 3 else 0  # an end group: half a middle group
    if end < 1:
        return [hi - lo for lo, hi in _even(0, batch, n)]
    return [end, *(hi - lo for lo, hi in _even(end, batch - end, n - 2)), end]


def _ladder_sizes(lo: float, hi: float) -> list[int]:
    """The ladder's sizes in ``[lo, hi]``, ascending."""
    out, size = [], max(1, math.ceil(lo))
    while size <= hi:
        size = bucket_rows(size, 2 * size)
        if size <= hi:
            out.append(size)
        size += 1
    return out


#: the ends' share of a middle group a ladder cut aims at, and the most it may stray from it
_TAPER, _TAPER_SLACK = 0.5, 0.25


def _ladder_cut(batch: int, n: int) -> list[int] | None:
    """Sizes of ``n >= 3`` groups summing to ``batch``: ``k`` middles of a ladder size ``m``
    and ``n - 2 - k`` of the next ladder size ``m2`` (those first), a first group on the
    ladder and a last one that takes the rest, each end within `_TAPER_SLACK` of `_TAPER`
    times the middles' mean. Of those, the one whose last group pads the fewest rows (none:
    every group on the ladder), then with the fewest kernel shapes, then with the ends'
    shares nearest the aim; None when there is none."""
    middles = n - 2
    ideal = batch / (n - 1)  # a middle group when the ends are half of one
    best: tuple[tuple[int, int, float], list[int]] | None = None
    for m in _ladder_sizes(ideal / 1.5, ideal * 1.5):
        m2 = _ladder_sizes(m + 1, 2 * m + 2)[0]
        for big in range(middles + 1):
            rest = batch - (middles - big) * m - big * m2
            if rest < 2:
                break
            middle = (batch - rest) / middles
            lo, hi = (_TAPER - _TAPER_SLACK) * middle, (_TAPER + _TAPER_SLACK) * middle
            for first in _ladder_sizes(max(lo, rest - hi), min(hi, rest - lo)):
                last = rest - first
                shape = bucket_rows(last, batch)
                sizes = [first, *[m2] * big, *[m] * (middles - big), last]
                shapes = {first, shape, *([m2] if big else []), *([m] if big < middles else [])}
                taper = max(abs(e / middle - _TAPER) for e in (first, last))
                score = (shape - last, len(shapes), taper)
                if best is None or score < best[0]:
                    best = (score, sizes)
    return None if best is None else best[1]


def _even(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """``range(start, stop)`` in ``n`` contiguous groups whose sizes differ by at most one."""
    base, extra = divmod(stop - start, n)
    bounds = []
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


#: The ladder's mantissas: sizes ``m * 2**e`` with ``m`` in this tuple (plus 1, 2 and 3), so
#: consecutive sizes are at most 25 % apart.
LADDER_STEPS = (4, 5, 6, 7)


def bucket_rows(rows: int, cap: int) -> int:
    """The row count a group of ``rows`` rows is padded to: the smallest size of the ladder
    ``{1, 2, 3} | {m * 2**e : m in LADDER_STEPS}`` that is ``>= rows``, but never above
    ``cap`` (the batch's rows: a batch's groups never need more, and ``cap`` itself is then the
    one size off the ladder).

    Invariant: ``rows <= bucket_rows(rows, cap) <= max(rows, cap)`` and, for ``rows <= cap``,
    fewer than ``1.25 * rows + 1`` rows. However many counts ``n`` a batch of ``B`` rows is cut
    into, its groups run at one of at most ``4 * log2(B) + 4`` sizes, so a jitted kernel traces
    at most that many times per input shape: a count whose groups fall into sizes already
    compiled compiles nothing.
    """
    if rows < 1:
        raise ConfigError(f"a group needs at least 1 row, got {rows}")
    if rows <= 7:
        size = rows
    else:
        e = rows.bit_length() - 3  # rows in [4 * 2**e, 8 * 2**e)
        size = next(m << e for m in (*LADDER_STEPS, 8) if m << e >= rows)
    return max(rows, min(size, cap))


def chunk_bounds(bounds: Sequence[tuple[int, int]], chunks: int) -> list[tuple[int, int]]:
    """Each group of ``bounds`` cut into ``chunks`` contiguous parts whose sizes differ by at
    most one row: the row ranges of a batch's messages (`tandem.engine.plan`, "chunks"). Raises
    `ConfigError` if a group has fewer rows than ``chunks`` (see `fit_chunks`)."""
    if chunks == 1:
        return list(bounds)
    if not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks must be a positive int, got {chunks!r}")
    out: list[tuple[int, int]] = []
    for lo, hi in bounds:
        if hi - lo < chunks:
            raise ConfigError(
                f"a group of {hi - lo} rows cannot travel in {chunks} chunks; "
                f"use at most {hi - lo} chunks (fit_chunks) or fewer groups"
            )
        out += _even(lo, hi, chunks)
    return out


def fit_chunks(batch: int, n: int, chunks: int) -> int:
    """``chunks`` lowered to the smallest group's rows of `group_bounds(batch, n)` (>= 1)."""
    smallest = min(hi - lo for lo, hi in group_bounds(batch, n))
    return max(1, min(chunks, smallest))


def clamp_groups(n: float, batch: int) -> int:
    return int(min(max(1, math.ceil(n)), batch))


def rule_groups(
    bytes_to_send: float, bandwidth: float | None, compute_time: float, batch: int
) -> int:
    """The method's rule ``ceil(bytes_to_send / bandwidth / compute_time)``, clamped to
    ``[1, batch]``; an unmeasured or infinite bandwidth gives 1 (nothing to hide)."""
    if not bandwidth or bandwidth <= 0 or compute_time <= 0:
        return 1
    return clamp_groups(bytes_to_send / bandwidth / compute_time, batch)


def trimmed_mean(xs: Sequence[float], trim: float = 0.25) -> float:
    """The mean of ``xs`` once ``floor(trim * len(xs))`` of the smallest and as many of the
    largest values are cut (``trim = 0.25``: the interquartile mean; 0: the plain mean).

    Cutting both ends alike keeps the centre of walls that trade time batch to batch (a slow
    batch whose leftover work a fast one makes up), while one machine hiccup does not move
    the estimate by its whole excess. Requires ``xs`` non-empty and ``0 <= trim < 0.5``."""
    if not xs:
        raise ValueError("trimmed_mean of no values")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim is the share cut at each end and must be in [0, 0.5), got {trim!r}")
    cut = int(trim * len(xs))
    kept = sorted(xs)[cut : len(xs) - cut]
    return sum(kept) / len(kept)


@dataclasses.dataclass(frozen=True)
class Trial:
    """A re-check's win of ``k`` over the settled ``base``, being measured again: ``blocks`` of
    (count, samples) in the order they run, and the walls each count has sampled in them.
    ``settle``: a win settles at ``k`` (a midpoint or a tie). ``tie``: ``k`` is a larger count
    level with ``base`` and must stay level, rather than beat ``base``."""

    k: int
    base: int
    settle: bool
    tie: bool
    blocks: tuple[tuple[int, int], ...]
    walls: Mapping[int, tuple[float, ...]]


def _frozen(walls: Mapping[int, Sequence[float]]) -> Mapping[int, tuple[float, ...]]:
    return types.MappingProxyType({k: tuple(v) for k, v in walls.items()})


@dataclasses.dataclass(frozen=True)
class TunerState:
    """What `GroupTuner` knows between batches. Never changed in place: `GroupTuner.observe`
    returns a new state.

    ``n``: the count for the next batch. ``base``: the count whose neighbours are probed.
    ``walls``: each count's samples in the current search, in the order the counts were first
    sampled. ``batches``: batches observed. ``ran``: counts that ran a batch (their shapes are
    compiled). ``last_n``: the previous batch's count. ``skip``: batches still to pass before
    walls are samples. ``settled_at``: ``batches`` when the search settled (None while it
    probes). ``settled_once``: a search has settled before, so a move needs a gain beyond the
    tolerance. ``confirm_to``: samples each count of a close call is to reach (0: none).
    ``confirmed``: re-measuring rounds this search has taken. ``trial``: a re-check's win
    being measured again. ``refuted``: counts whose win did not hold in this re-check.
    ``interval``: batches from settling to the next re-check (0: ``recheck``).
    ``recheck_from``: the settled count the running re-check started from (0: none yet).
    ``expect``: the wall an earlier run measured at a resumed ``n`` (`GroupTuner.resume`);
    None once this run's own mean at ``n`` was compared with it, or without one.
    ``first_wall``: the wall of the first batch (its compilations included), None before it
    or in a resumed search. ``compile_s``: the seconds the party took to compile its kernels
    ahead of the first batch (`GroupTuner.compiled`), None when it did not.

    Invariant: ``1 <= n <= batch`` once a batch was observed; ``best`` is a count that has
    samples in ``walls`` once the first search has probed a neighbour.
    """

    n: int
    base: int
    last_n: int
    batches: int = 0
    started: bool = False
    ran: frozenset[int] = frozenset()
    skip: int = 0
    walls: Mapping[int, tuple[float, ...]] = dataclasses.field(default_factory=lambda: _frozen({}))
    settled_at: int | None = None
    settled_once: bool = False
    confirm_to: int = 0
    confirmed: int = 0
    trial: Trial | None = None
    refuted: frozenset[int] = frozenset()
    interval: int = 0
    recheck_from: int = 0
    expect: float | None = None
    first_wall: float | None = None
    compile_s: float | None = None

    @property
    def settled(self) -> bool:
        """Whether the search has settled (until the next re-check)."""
        return self.settled_at is not None

    @property
    def settled_n(self) -> int | None:
        """The count the tuner last settled on: ``n`` while settled, during a re-check the
        count it started from, None before the first settle (what a later run may resume
        at: `GroupTuner.resume`)."""
        if self.settled:
            return self.n
        return self.recheck_from if self.settled_once and self.recheck_from else None

    @property
    def best(self) -> int:
        """The fastest ``n`` known so far: the settled one, or while the tuner still probes,
        the base whose neighbours it is trying (``n`` itself may be a probe)."""
        return self.n if self.settled else self.base


@dataclasses.dataclass(frozen=True)
class GroupTuner:
    """Chooses ``n`` for the next batch from each batch's wall time; pure, optax style::

        tuner = GroupTuner(batch=256)
        state = tuner.init()                  # n0 = 4
        n, state = tuner.observe(state, wall, compute=c, links=[(bytes, bandwidth), ...])

    The rules (walls are seconds per full batch):

    0. Range: the search tries counts up to ``max_n`` (0, the default: the batch). A party
       passes `shared_shape_counts` of its batch: above it a count's groups are smaller than
       a kernel tile, and trying one compiles every kernel at new sizes (seconds each for an
       embedding stage on a CPU, more than the probe could gain back in an epoch). Where
       compiling proves cheap, every count up to the batch is open again: it took at most
       ``compile_budget`` times the fastest count's mean wall, by the seconds the party
       compiled ahead of the first batch (`compiled`) or else by the first batch's wall
       beyond that mean (the first batch compiled the kernels).
    1. Start: the first batch runs at ``n0``; `rule_groups` on its busiest link direction gives
       the start (at most ``max_n``), with compute = max(reported compute, wall - that link's
       transfer time); no measured link gives 1.
    2. Samples: a count's first batch after a change is no sample (compile, previous batch's
       drain), nor its second when the count never ran before; a count's wall is the
       `trimmed_mean` (``trim``) of its ``samples`` or more samples.
    3. Climb: from the base try ``2n`` and ``n/2``, and ``4n`` when ``2n`` is within
       ``tolerance`` of ``n``; move to the fastest while it is faster; then try the geometric
       midpoints towards each neighbour, the faster side first.
    4. Settle: on the largest count within ``tolerance`` of the fastest (``prefer_larger``).
       When that pick is not the fastest or a larger count is within ``3 * tolerance``, every
       count that near gets ``samples`` more batches and the rule is applied again (at most
       ``confirm`` rounds).
    5. Re-check: ``recheck`` batches after settling the neighbours are probed again; each
       re-check that settles on the count it started from doubles the wait before the next
       (up to ``recheck_max``), a move sets it back to ``recheck``. A move now needs a
       gain beyond ``tolerance`` (or, for a larger count, staying within it of the fastest
       count the re-check measured), and with ``verify`` it is measured again in alternating
       blocks ``a(m) b(2m) a(2m) b(2m) a(m)``, ``m = samples // 2``, before ``n`` moves; a
       refuted count sits out the re-check.
    6. Resume: a run that starts settled where an earlier one settled (`resume`) counts as one
       more re-check that kept ``n``: its wait is twice the earlier run's. Once this run has
       ``2 * samples`` samples at ``n``, their mean is compared with the earlier run's wall
       at ``n``; off by more than ``drift`` (the machine, the link or the data changed), the
       re-check starts at once.

    Invariant: ``1 <= n <= batch`` once a batch was observed. ``observe`` never changes the
    state it is given: the same states and walls give the same counts.
    """

    batch: int
    max_n: int = 0
    compile_budget: float = 10.0
    samples: int = 4
    tolerance: float = 0.03
    trim: float = 0.25
    prefer_larger: bool = True
    confirm: int = 2
    recheck: int = 50
    recheck_max: int = 800
    verify: bool = True
    drift: float = 0.1

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"GroupTuner.batch must be >= 1, got {self.batch!r}")
        if self.max_n < 0:
            raise ConfigError(
                f"GroupTuner.max_n is the largest count the search tries (0: the batch) and "
                f"must be >= 0, got {self.max_n!r}"
            )
        if self.samples < 1:
            raise ConfigError(
                f"GroupTuner.samples is the batches averaged per count and must be >= 1, "
                f"got {self.samples!r}"
            )
        if not 1 <= self.recheck <= self.recheck_max:
            raise ConfigError(
                f"GroupTuner needs 1 <= recheck <= recheck_max (batches between re-checks), "
                f"got recheck={self.recheck!r}, recheck_max={self.recheck_max!r}"
            )
        if not self.drift > 0:
            raise ConfigError(
                f"GroupTuner.drift is the share by which a resumed count's wall may differ "
                f"from the earlier run's before a re-check and must be > 0, got {self.drift!r}"
            )
        if not 0 <= self.trim < 0.5:
            raise ConfigError(
                f"GroupTuner.trim is the share of samples cut at each end before "
                f"averaging and must be in [0, 0.5), got {self.trim!r}"
            )

    @property
    def top(self) -> int:
        """The largest count the search tries or starts at: ``max_n``, at most the batch."""
        return min(self.max_n or self.batch, self.batch)

    def init(self, n: int = 0) -> TunerState:
        """The state before the first batch, which runs at ``n`` (``<= 0``: ``min(4, batch)``)."""
        n = n if n > 0 else min(4, self.top)
        return TunerState(n=n, base=n, last_n=n)

    def compiled(self, state: TunerState, seconds: float) -> TunerState:
        """``state`` knowing that the party compiled the kernels its counts share ahead of the
        first batch in ``seconds`` (what a count of new shapes would cost again): rule 0 weighs
        those seconds, since the first batch no longer pays them."""
        return dataclasses.replace(state, compile_s=float(seconds))

    def resume(self, n: int, *, interval: int = 0, wall: float | None = None) -> TunerState:
        """The state of a search that settled on ``n`` before (a checkpoint's count, or the
        count an earlier run of the same job settled on): no search, and the first batch is
        no sample (it loads or compiles the kernels). ``interval``: that run's wait between
        re-checks (`TunerState.interval`) and ``wall``: its wall at ``n`` (`mean`); with
        both, the first re-check comes after twice that wait (at most ``recheck_max``) unless
        this run's wall drifts from ``wall`` (rule 6), else ``recheck`` batches in."""
        if not 1 <= n <= self.batch:
            raise ConfigError(f"a resumed group count must be in [1, batch={self.batch}], got {n}")
        trusted = interval > 0 and wall is not None and wall > 0
        return TunerState(
            n=n,
            base=n,
            last_n=n,
            started=True,
            ran=frozenset({n}),
            skip=1,
            settled_at=0,
            settled_once=True,
            interval=min(2 * max(interval, self.recheck), self.recheck_max) if trusted else 0,
            expect=wall if trusted else None,
        )

    def observe(
        self,
        state: TunerState,
        wall: float,
        *,
        compute: float = 0.0,
        links: Sequence[tuple[float, float | None]] = (),
    ) -> tuple[int, TunerState]:
        """The count for the next batch and the new state, after a full batch that ran at
        ``state.n`` and took ``wall`` seconds. ``compute`` (seconds of this party's compute)
        and ``links`` (bytes and measured bandwidth per link direction, None if unmeasured)
        are read on the first batch only (rule 1)."""
        search = _Search(self, state)
        n = search.observe(wall, compute, links)
        return n, search.freeze()

    def mean(self, state: TunerState, n: int) -> float | None:
        """Count ``n``'s wall in ``state``: the `trimmed_mean` of its samples, or None while it
        has fewer than ``samples``."""
        w = state.walls.get(n, ())
        return trimmed_mean(w, self.trim) if len(w) >= self.samples else None


class _Search:
    """A mutable working copy of a `TunerState` for one `GroupTuner.observe` call: the rules
    read and write it, and `freeze` returns the new state. It never outlives that call."""

    def __init__(self, cfg: GroupTuner, s: TunerState) -> None:
        self.cfg = cfg
        self.n, self.base, self.last_n = s.n, s.base, s.last_n
        self.batches, self.started, self.ran, self.skip = s.batches, s.started, s.ran, s.skip
        self.walls: dict[int, list[float]] = {k: list(v) for k, v in s.walls.items()}
        self.settled_at, self.settled_once = s.settled_at, s.settled_once
        self.confirm_to, self.confirmed = s.confirm_to, s.confirmed
        self.trial = s.trial
        self.trial_walls: dict[int, list[float]] = (
            {} if s.trial is None else {k: list(v) for k, v in s.trial.walls.items()}
        )
        self.refuted = set(s.refuted)
        self.interval, self.recheck_from = s.interval, s.recheck_from
        self.expect = s.expect
        self.first_wall, self.compile_s = s.first_wall, s.compile_s

    def freeze(self) -> TunerState:
        trial = self.trial
        if trial is not None:
            trial = dataclasses.replace(trial, walls=_frozen(self.trial_walls))
        return TunerState(
            n=self.n,
            base=self.base,
            last_n=self.last_n,
            batches=self.batches,
            started=self.started,
            ran=self.ran,
            skip=self.skip,
            walls=_frozen(self.walls),
            settled_at=self.settled_at,
            settled_once=self.settled_once,
            confirm_to=self.confirm_to,
            confirmed=self.confirmed,
            trial=trial,
            refuted=frozenset(self.refuted),
            interval=self.interval,
            recheck_from=self.recheck_from,
            expect=self.expect,
            first_wall=self.first_wall,
            compile_s=self.compile_s,
        )

    def _mean(self, n: int) -> float | None:
        w = self.walls.get(n, [])
        return trimmed_mean(w, self.cfg.trim) if len(w) >= self.cfg.samples else None

    def observe(
        self, wall: float, compute: float, links: Sequence[tuple[float, float | None]]
    ) -> int:
        cfg = self.cfg
        ran_before, self.ran = self.ran, self.ran | {self.n}
        self.batches += 1
        measured = [(b, bw) for b, bw in links if bw]
        if not self.started:  # rule 1
            self.started = True
            self.first_wall = wall
            first = self.n
            if not measured:
                self.n = 1  # no link time to hide: pipelining only adds overhead
            else:
                b, bw = max(measured, key=lambda x: x[0] / x[1])
                # the leader sees only its own compute, while a follower's may be the larger
                # (a bottom model under a small top): the wall the busiest link does not
                # explain stands in for it
                self.n = rule_groups(b, bw, max(compute, wall - b / bw, 1e-6), cfg.top)
            self.walls.clear()
            self.base = self.n
            self.skip = int(self.n == first)  # the first batch's compile spills into the next
            return self.n
        if self.last_n != self.n:  # rule 2: a change's first batch is no sample, nor the
            self.skip = 1 if self.n in ran_before else 2  # second where n is new (compiles)
        self.last_n = self.n
        sample = not self.skip
        self.skip = max(self.skip - 1, 0)
        if self.trial is not None:
            if sample:
                self.trial_walls[self.n].append(wall)
            return self._trial_step()
        if sample:
            self.walls.setdefault(self.n, []).append(wall)
        if self.settled_at is not None:
            if self.expect is not None and len(self.walls.get(self.n, ())) >= 2 * cfg.samples:
                here = trimmed_mean(self.walls[self.n], cfg.trim)
                if abs(here / self.expect - 1) > cfg.drift:  # rule 6: re-check now
                    self.interval, self.settled_at = cfg.recheck, self.batches - cfg.recheck
                self.expect = None
            if self.batches - self.settled_at < (self.interval or cfg.recheck):
                return self.n
            self.settled_at, self.walls = None, {self.n: self.walls.get(self.n, [])[-cfg.samples :]}
            self.base = self.recheck_from = self.n
            self.refuted = set()
        return self._step()

    def _step(self) -> int:
        cfg = self.cfg
        if self._mean(self.n) is None:
            return self.n  # keep sampling the current n (the base or a probe)
        if self.confirm_to:  # measuring a close call again: the search does not move
            return self._settle_first_search()
        base = self.base
        # rule 3: probe the base's neighbours one at a time; each is judged from the base
        top = self._top()
        for cand in (min(base * 2, top), max(base // 2, 1)):
            if cand != base and self._mean(cand) is None:
                self.n = cand
                return self.n
        here = self._mean(base)
        assert here is not None  # the base has samples: it ran before its probes
        up, far = min(base * 2, top), min(base * 4, top)
        up_mean = self._mean(up)
        if (
            far != up
            and self._mean(far) is None
            and up_mean is not None
            and up_mean < here * (1 + cfg.tolerance)
        ):
            self.n = far  # 2n about level with n: a plateau may hide a slope further up
            return self.n
        # the first search takes any faster n; once settled, only one faster by `tolerance`
        margin = cfg.tolerance if self.settled_once else 0.0
        best_mean, best = min(
            (m, k)
            for k in ({base, up, far, base // 2} & set(self.walls)) - self.refuted
            if (m := self._mean(k)) is not None
        )
        if best != base and best_mean < here * (1 - margin):
            if self._holds(best, base):
                self.base = self.n = best  # move, then probe the new base's neighbours
            return self.n  # (or a re-check's win is measured again before n moves)
        mids = self._midpoints(base)
        for mid in mids:
            if self._mean(mid) is None:
                self.n = mid  # refine on both sides of the base, the faster side first
                return self.n
        # (a base without midpoints, 1 beside 2, is settled by the same tie rules)
        if not self.settled_once:  # rule 4: the first search settles by the tie rule
            return self._settle_first_search()
        # rule 5: only a clear gain moves a settled n
        mid = min((m for m in mids if m not in self.refuted), key=self._key, default=base)
        mid_mean = self._mean(mid)
        if mid != base and mid_mean is not None and mid_mean < here * (1 - margin):
            if not self._holds(mid, base):
                return self.n  # measured again first; `_end_trial` settles
            base = self.base = mid
        elif cfg.prefer_larger and (level := self._level_above(base)) is not None:
            if not self._holds(level, base, tie=True):
                return self.n
            base = self.base = level
        return self._settle(base)

    def _top(self) -> int:
        """The largest count the search may try now (rule 0): ``max_n``, or the batch once
        compiling is known to be cheap: it took at most ``compile_budget`` of the fastest mean
        so far (the seconds compiled ahead, else the first batch's wall beyond that mean)."""
        cfg = self.cfg
        if cfg.top == cfg.batch or self.first_wall is None:
            return cfg.top
        means = [m for k in self.walls if (m := self._mean(k)) is not None]
        if not means:
            return cfg.top
        cost = self.first_wall - min(means) if self.compile_s is None else self.compile_s
        return cfg.batch if cost <= cfg.compile_budget * min(means) else cfg.top

    def _key(self, n: int) -> float:
        """``n``'s mean for ordering counts that all have one."""
        m = self._mean(n)
        assert m is not None  # only counts the search measured are compared
        return m

    def _level_above(self, base: int) -> int | None:
        """The largest count above ``base`` measured in this re-check (and not refuted) whose
        mean is within ``tolerance`` of the fastest mean this re-check measured (``base``'s or
        a smaller count's that did not win by the margin), or None: a re-check's tie (rule 5).
        Measured from the fastest, as the first search's tie rule is: ties measured from the
        base would chain, each re-check moving up one more count that is level with the last
        but no longer with the fastest."""
        means = {
            k: m for k in self.walls if k not in self.refuted and (m := self._mean(k)) is not None
        }
        fastest = min(self._key(base), *means.values())
        level = [
            k for k, m in means.items() if k > base and m <= fastest * (1 + self.cfg.tolerance)
        ]
        return max(level, default=None)

    def _holds(self, k: int, base: int, *, tie: bool = False) -> bool:
        """Whether a move from ``base`` to ``k`` may be taken now: always in the first search
        and with ``verify`` off. Otherwise (a re-check's win, or with ``tie`` a larger count
        level with ``base``) this starts a trial that measures the two again and returns
        False; `_end_trial` takes the move if the win holds."""
        if not (self.settled_once and self.cfg.verify):
            return True
        self._start_trial(k, base, tie=tie)
        return False

    def _start_trial(self, k: int, base: int, *, tie: bool = False) -> None:
        """Measure ``k`` and ``base`` again, afresh, in mirrored alternating blocks
        ``a(m) b(2m) a(2m) b(2m) a(m)``, ``m = samples // 2`` (at least 1), ``a`` the running
        count (``base`` if neither runs): each gets ``4m`` samples at about the same mean time,
        so a drift of the machine's speed that is linear over the trial cancels."""
        a, b = (k, base) if self.n == k else (base, k)
        m = max(self.cfg.samples // 2, 1)
        self.trial = Trial(
            k,
            base,
            settle=tie or k in self._midpoints(base),
            tie=tie,
            blocks=((a, m), (b, 2 * m), (a, 2 * m), (b, 2 * m), (a, m)),
            walls=_frozen({}),
        )
        self.trial_walls = {k: [], base: []}
        self.n = a

    def _trial_step(self) -> int:
        """Point ``n`` at the trial's current block, or end the trial once every block has
        its samples."""
        assert self.trial is not None  # called only while a trial runs
        due = dict.fromkeys(self.trial_walls, 0)
        for c, m in self.trial.blocks:
            due[c] += m
            if len(self.trial_walls[c]) < due[c]:
                self.n = c
                return self.n
        return self._end_trial()

    def _end_trial(self) -> int:
        """Judge the trial on its own samples: ``k`` must still beat ``base`` by more than
        ``tolerance`` (a tie: be no more than ``tolerance`` behind it). A win moves the base to
        ``k`` (and settles there when ``settle``); a loss keeps ``base`` and refutes ``k`` for
        this re-check. Either way the trial's samples replace the two counts' older ones."""
        t, self.trial = self.trial, None
        assert t is not None  # called only while a trial runs
        self.walls.update(self.trial_walls)
        self.trial_walls = {}
        bar = 1 + self.cfg.tolerance if t.tie else 1 - self.cfg.tolerance
        if self._key(t.k) < self._key(t.base) * bar:
            self.base = self.n = t.k
            return self._settle(t.k) if t.settle else self._step()
        self.refuted.add(t.k)
        self.base = self.n = t.base
        return self._step()

    def _settle(self, n: int) -> int:
        cfg = self.cfg
        if self.settled_once and n == self.recheck_from:  # rule 5: a re-check kept n
            self.interval = min(2 * (self.interval or cfg.recheck), cfg.recheck_max)
        else:
            self.interval = cfg.recheck
        self.base = self.n = n
        self.confirm_to = 0
        self.settled_at = self.batches
        self.settled_once = True
        return self.n

    def _settle_first_search(self) -> int:
        """Settle by the tie rule, or keep ``n`` on a close call's count being measured again."""
        choice = self._break_tie()
        return self.n if choice is None else self._settle(choice)

    def _break_tie(self) -> int | None:
        """The count the first search settles on (rule 4), or None after pointing ``n`` at a
        close call's count that is to be measured again."""
        cfg = self.cfg
        while True:
            means = {k: m for k in self.walls if (m := self._mean(k)) is not None}
            fastest = min(means.values())
            if not cfg.prefer_larger:
                return min(means, key=means.__getitem__)
            near = [k for k, m in means.items() if m <= fastest * (1 + 3 * cfg.tolerance)]
            if self.confirm_to:  # a round of measuring again: each near count as often
                for k in sorted(near, key=lambda k: k != self.n):  # the running n first
                    if len(self.walls[k]) < self.confirm_to:
                        self.n = k
                        return None
            pick = max(k for k in near if means[k] <= fastest * (1 + cfg.tolerance))
            if (means[pick] == fastest and pick == max(near)) or self.confirmed >= cfg.confirm:
                return pick
            # a close call: the pick is not the fastest, or a larger count is within three
            # tolerances of it; measure every near count again, each as often
            self.confirmed += 1
            self.confirm_to = max(len(self.walls[k]) for k in near) + cfg.samples

    def _midpoints(self, base: int) -> list[int]:
        """The geometric midpoints between ``base`` and each measured neighbour (``2n`` and
        ``n/2``) that are counts of their own, the one towards the faster neighbour first. Both
        sides are tried: a slower neighbour on one side says little about the midpoint there."""
        batch = self._top()
        near = sorted(
            (m, k)
            for k in (min(base * 2, batch), max(base // 2, 1))
            if k != base and (m := self._mean(k)) is not None
        )
        mids = [round(math.sqrt(base * k)) for _, k in near]
        return [m for i, m in enumerate(mids) if m not in (base, near[i][1]) and m not in mids[:i]]
