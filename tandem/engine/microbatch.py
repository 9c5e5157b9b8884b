"""Micro-batching: group boundaries and the automatic group count.

`group_bounds(B, n)` cuts a batch of ``B`` rows into ``n`` contiguous groups: the middle ones
differ by at most one row, the first and last are half as large (a shorter pipeline fill and
drain), so at most four shapes occur and jitted kernels trace at most four times per ``n``.

`rule_groups` is the method's rule ``n = ceil(bytes_to_send / bandwidth / compute_time)``
clamped to ``[1, B]``. `GroupTuner` re-tunes ``n`` between batches (docs/design.md, "Choosing
n"): it starts from the rule, then hill-climbs on the measured wall time per batch, each count
judged by the `trimmed_mean` of a few batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tandem.errors import ConfigError


def group_bounds(batch: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``(start, stop)`` row ranges covering ``range(batch)``.

    For ``n >= 3`` the first and last groups are *tapered*: about half the size of the middle
    groups, whose sizes differ by at most one (a batch too small to halve its end groups gets
    even groups). A batch's pipeline cannot run faster than its fill and drain allow: the
    gradient link idles until the first group went forward, across the link and through the
    loss, and the last group's backward waits until every gradient has arrived. Both waits
    scale with the end groups' size, so halving those shortens the batch by about one middle
    group's transfer and compute while costing no extra op. At most four shapes occur (ends
    and middles, each possibly one row apart), so jitted kernels trace at most four times
    per ``n``.
    """
    if batch < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch}")
    if not 1 <= n <= batch:
        raise ConfigError(f"n_groups must be in [1, batch={batch}], got {n}")
    end = batch // (2 * n - 2) if n >= 3 else 0  # an end group: half a middle group
    if end < 1:
        return _even(0, batch, n)
    return [(0, end), *_even(end, batch - end, n - 2), (batch - end, batch)]


def _even(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """``range(start, stop)`` in ``n`` contiguous groups whose sizes differ by at most one."""
    base, extra = divmod(stop - start, n)
    bounds = []
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


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
    batch whose leftover work a fast one makes up), while one machine hiccup no longer moves
    the estimate by its whole excess. Requires ``xs`` non-empty and ``0 <= trim < 0.5``."""
    if not xs:
        raise ValueError("trimmed_mean of no values")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim is the share cut at each end and must be in [0, 0.5), got {trim!r}")
    cut = int(trim * len(xs))
    kept = sorted(xs)[cut : len(xs) - cut]
    return sum(kept) / len(kept)


@dataclasses.dataclass
class _Trial:
    """A re-check's win of ``k`` over the settled ``base``, being measured again
    (`GroupTuner._start_trial`): ``blocks`` of (count, samples) in order, and the walls each
    count has sampled in them. ``settle``: ``k`` is a midpoint, so a win settles there."""

    k: int
    base: int
    settle: bool
    blocks: tuple[tuple[int, int], ...]
    tie: bool = False
    walls: dict[int, list[float]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.walls = {self.k: [], self.base: []}


@dataclasses.dataclass
class GroupTuner:
    """Chooses ``n`` for the next batch from measurements; re-tuned between batches.

    1. The first full batch runs at ``n0`` (4 by default) and measures the compute time and
       each link direction's bytes and bandwidth; the method's rule then gives the starting
       point ``n = ceil(bytes / bandwidth / compute_time)`` for the busiest direction. The
       compute time is the larger of the leader's own and the batch's wall time less that
       direction's transfer time: the leader cannot see a follower's compute, which is the
       larger one when a big bottom model feeds a small top (taking the leader's alone gave
       ``bench.wan`` a start at n = 56 where 8 was best).
    2. Hill-climbing on the measured wall time per batch (the interquartile mean of
       ``samples`` batches; "mean" below):
       from the base ``n`` try ``2n`` and ``n/2`` (each compared with the base, not with each
       other), and ``4n`` too when ``2n`` came out level with ``n`` (within ``tolerance``: a
       plateau, or noise, can hide a slope further up); move the base to the fastest while it
       is faster. When none is, try once each geometric midpoint between the base and its
       neighbours (4 and 8 around 6), and settle on the fastest of the base and these (but
       see 3.). Every ``recheck`` batches the neighbours are tried again, so ``n`` follows a
       link or load that changes; from then on a move needs a gain of more than
       ``tolerance``, so that noise does not flap a settled ``n``, and such a gain is measured
       again, the two counts in alternating blocks, before ``n`` moves (`_holds`,
       `_start_trial`). The first search has no such
       margin: its start is the rule's guess, and a margin there kept lucky starts
       (``bench.pipeline`` settled on 3, 2.7% behind 4 in the tuner's samples and 13% behind 8
       in the timed runs; ``python -m bench.tuner_noise``, 10% noise per batch: with
       the margin 7.0% of runs end more than 10% behind the best n, without it 4.2%).

    3. Ties go to the larger ``n`` (``prefer_larger``): the first search settles on the largest
       count measured in it whose mean is within ``tolerance`` of the fastest, and a re-check
       that finds no clear gain moves to the largest count above the settled one whose mean is
       within ``tolerance`` of it, once alternating blocks have measured that tie again
       (`_level_above`). A spell during one probe of the first search can put a count about 40%
       behind that the timed runs find level (``bench.pipeline``, fifteenth pass: 8 behind 4,
       then level with it at the re-check, which kept 4 for want of a 3% gain). Four
       samples of batches that scatter by about 10% cannot rank two counts 3% apart, and
       near the optimum the larger has the shorter fill and drain (smaller end groups, a
       smaller last part on the gradient link), which is what a batch the link binds waits
       for. Measured: of 86 recorded ``bench.pipeline`` runs the tuner settled on 6 in 26, and
       in 23 of those the timed sweep was faster at another n (8 in 21, 16 in one; median
       4%); in ``python -m bench.tuner_noise`` the share of runs settling more than 5% behind
       the best ``n`` falls from 14% to 10%.
    4. A close call is measured again (``confirm``): when the tie rule's pick is not the
       fastest count, or a count larger than the pick is within three tolerances of the
       fastest, every count that near is run for another ``samples`` batches, each as often,
       and the rule is applied again to the pooled means; at most ``confirm`` (2) such rounds
       per search. The search no longer moves once it re-measures (a base that moved on the
       new means sent one ``bench.pipeline`` search through 81 batches), and a one-sided
       re-run would be biased: stopping as soon as the larger count catches up lets its luck
       decide. The three ``bench.pipeline`` misses of the ninth pass had 8 behind 6 by 4-7% in the
       tuner's four batches and 1.4-4.2% ahead in the timed runs; and with the pick taken
       among every count measured, 12 won a tie against 8 on four lucky batches and ran 9%
       slower than 8 in the timed runs. In ``bench.tuner_noise`` (6.7% noise, the spread
       measured with one-call tuning; five starting counts) the mean best / settled time rises
       from 0.993 to 0.997 for about eight more batches; eight samples for every probe reach
       0.996 with 22 more (at 10% noise: 0.986 to 0.992; eight samples, 0.993).

    The first batch after ``n`` changes is not a sample of the new ``n``: it compiles the new
    group shape, and it starts while the peers still drain the previous batch (the leader's
    batch ends before a follower's last backward and update), so its wall time mixes two
    values of ``n`` and is easily the fastest of a probe's batches when it follows a quickly
    drained one. Where the new ``n`` never ran before, the second batch is no sample either:
    the follower compiles its backward for the new shapes at the end of the first batch, after
    the leader's part of it ended, so that compile lands in the second batch's wall
    (``bench.pipeline`` measured second batches of 210-456 ms against 95-136 ms for the
    batches after them). The estimate is the interquartile mean (`trimmed_mean`, ``trim`` =
    0.25 cut at each end), not the fastest, of the next ``samples`` batches (4: batches on
    the shared benchmark machine scatter by about 10%, and in the same simulation 4 samples
    leave 2.6% of runs 10% behind, against 4.2% with 3). Not the fastest: the follower's work
    left over from one batch lands in the next one's wall time, so the walls of consecutive
    batches trade time with each other (measured: +-30% per batch at n = 16, +-5% at n = 8,
    their sums steady), and the fastest of several rewards the ``n`` whose walls scatter most
    rather than the one whose batches finish soonest; cutting both ends alike keeps such
    walls' centre. Not the plain mean: the walls have a long right tail (of 2006 sampled in
    56 ``bench.pipeline`` runs, half lie within 3.7% of their median but 1% are 33% or more
    over it, the shared machine's hiccups), and one hiccup among four samples moved a
    count's mean by 8% and decided ties (in the tenth pass's one efficiency miss, one 148 ms
    batch among 8's twelve of about 119 ms kept 6; the same walls replayed through the
    interquartile mean settle on 8). Drawing the noise from those walls,
    ``bench.tuner_noise`` puts 3.8% of runs more than 2% behind the best ``n`` with the
    interquartile mean, against 9.6% with the plain mean, in slightly fewer batches.

    Invariant: ``1 <= n <= batch``.
    """

    batch: int
    n: int = 0
    samples: int = 4
    tolerance: float = 0.03
    trim: float = 0.25
    prefer_larger: bool = True
    confirm: int = 2
    recheck: int = 50
    verify: bool = True  # a re-check's win is measured again, alternating, before n moves
    history: list[dict] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.trim < 0.5:
            raise ConfigError(
                f"GroupTuner.trim is the share of samples cut at each end before "
                f"averaging and must be in [0, 0.5), got {self.trim!r}"
            )
        if self.n <= 0:
            self.n = min(4, self.batch)
        self._walls: dict[int, list[float]] = {}
        self._started = False
        self._last_n = self.n  # the n of the batch before the one being observed
        self._skip = 0  # batches still to pass before the current n's walls are samples
        self._settled_once = False
        self._settled_at: int | None = None
        self._base = self.n  # the n whose neighbours are being probed
        self._confirm_to = 0  # samples each of a close call's counts is to reach (0: none)
        self._confirmed = 0  # re-measuring rounds the first search has taken
        self._trial: _Trial | None = None  # a re-check's win being measured again (`_holds`)
        self._refuted: set[int] = set()  # counts whose win did not hold in this re-check

    @property
    def settled(self) -> bool:
        """Whether the search has settled (until the next re-check)."""
        return self._settled_at is not None

    @property
    def best(self) -> int:
        """The fastest ``n`` known so far: the settled one, or while the tuner still probes,
        the base whose neighbours it is trying (``n`` itself may be a probe on trial)."""
        return self.n if self.settled else self._base

    def _mean(self, n: int) -> float | None:
        """The wall time of ``n``: the trimmed mean (`trimmed_mean`, ``trim`` cut at each end)
        of its samples in this search (``samples`` of them, or up to ``(1 + confirm) *
        samples`` after a close call was measured again), once it has ``samples`` (the first
        batch after a change is never one; see the class docstring)."""
        w = self._walls.get(n, [])
        return trimmed_mean(w, self.trim) if len(w) >= self.samples else None

    def observe(
        self, *, wall: float, compute: float, links: Sequence[tuple[float, float | None]] = ()
    ) -> int:
        self.history.append({"n": self.n, "wall": wall, "compute": compute})
        measured = [(b, bw) for b, bw in links if bw]
        if not self._started:
            self._started = True
            first = self.n
            if not measured:
                self.n = 1  # no link time to hide: pipelining only adds overhead
            else:
                b, bw = max(measured, key=lambda x: x[0] / x[1])
                # the batch's compute: the leader sees only its own, while a follower's may be
                # the larger (a bottom model under a small top); the part of the wall time the
                # busiest link does not explain stands in for it
                self.n = rule_groups(b, bw, max(compute, wall - b / bw, 1e-6), self.batch)
            self._walls.clear()
            self._base = self.n
            self._skip = int(self.n == first)  # the first batch's compile spills into the next
            return self.n
        if self._last_n != self.n:  # see the class docstring: a change's first batch, and
            # the second too where this n is new (its first compiled), are no samples
            ran = any(h["n"] == self.n for h in self.history[:-1])  # its shapes compiled
            self._skip = 1 if ran else 2
        self._last_n = self.n
        sample = not self._skip
        self._skip = max(self._skip - 1, 0)
        if self._trial is not None:
            if sample:
                self._trial.walls[self.n].append(wall)
            return self._trial_step()
        if sample:
            self._walls.setdefault(self.n, []).append(wall)
        if self._settled_at is not None:
            if len(self.history) - self._settled_at < self.recheck:
                return self.n
            self._settled_at, self._walls = None, {self.n: self._walls[self.n][-self.samples :]}
            self._base = self.n
            self._refuted = set()
        return self._step()

    def _step(self) -> int:
        if self._mean(self.n) is None:
            return self.n  # keep sampling the current n (the base or a probe)
        if self._confirm_to:  # measuring a close call again: the search no longer moves
            return self._settle_first_search()
        base = self._base
        # probe the base's neighbours one at a time; every probe is judged from the base
        for cand in (min(base * 2, self.batch), max(base // 2, 1)):
            if cand != base and self._mean(cand) is None:
                self.n = cand
                return self.n
        here = self._mean(base)
        up, far = min(base * 2, self.batch), min(base * 4, self.batch)
        if far != up and self._mean(far) is None and self._mean(up) < here * (1 + self.tolerance):
            self.n = far  # 2n about level with n: a plateau may hide a slope further up
            return self.n
        # the first search takes any faster n; once settled, only one faster by `tolerance`
        margin = self.tolerance if self._settled_once else 0.0
        best = min(
            (m, k)
            for k in ({base, up, far, base // 2} & set(self._walls)) - self._refuted
            if (m := self._mean(k)) is not None
        )[1]
        if best != base and self._mean(best) < here * (1 - margin):
            if self._holds(best, base):
                self._base = self.n = best  # move, then probe the new base's neighbours
            return self.n  # (or a re-check's win is measured again before n moves)
        mids = self._midpoints(base)
        for mid in mids:
            if self._mean(mid) is None:
                self.n = mid  # refine on both sides of the base, the faster side first
                return self.n
        if mids and self._settled_once:  # a re-check: only a clear gain moves a settled n
            mid = min((m for m in mids if m not in self._refuted), key=self._mean, default=base)
            if mid != base and self._mean(mid) < here * (1 - margin):
                if not self._holds(mid, base):
                    return self.n  # measured again first; `_end_trial` settles
                base = self._base = mid
            elif self.prefer_larger and (up := self._level_above(base)) is not None:
                if not self._holds(up, base, tie=True):
                    return self.n
                base = self._base = up
        elif mids:  # the first search: ties go to the larger n (class docstring, 3. and 4.)
            return self._settle_first_search()
        return self._settle(base)

    def _level_above(self, base: int) -> int | None:
        """The largest count above ``base`` measured in this re-check (and not refuted) whose
        mean is within ``tolerance`` of ``base``'s, or None: a re-check's tie, which goes to
        the larger count as the first search's does (class docstring, 3.)."""
        here = self._mean(base)
        level = [
            k
            for k in self._walls
            if k > base
            and k not in self._refuted
            and (m := self._mean(k)) is not None
            and m <= here * (1 + self.tolerance)
        ]
        return max(level, default=None)

    def _holds(self, k: int, base: int, *, tie: bool = False) -> bool:
        """Whether a move from ``base`` to ``k`` may be taken now: True in the first search
        (its start is a guess; class docstring, 2.) and with ``verify`` off. A re-check's win
        (``k`` beat the settled ``base`` by more than ``tolerance`` on ``samples`` batches
        each) is measured again first: this starts that trial (`_start_trial`) and returns
        False, and `_end_trial` takes the move if the win holds (``tie``: a larger count
        level with ``base``, `_level_above`; it must stay level).

        A settled ``n`` is left on one comparison's noise otherwise, and found again only at
        a later re-check that the noise happens to favour: in ``bench.tuner_noise``'s model
        (the midpoint 6 2.8% behind 8), one re-check without this took the runs more than 2%
        behind the best ``n`` from 3.8% (after the first search) to 14.3% (docs/pipeline-bench.md,
        "Thirteenth pass")."""
        if not (self._settled_once and self.verify):
            return True
        self._start_trial(k, base, tie=tie)
        return False

    def _start_trial(self, k: int, base: int, *, tie: bool = False) -> None:
        """Measure ``k`` and ``base`` again, afresh, in alternating blocks that mirror each
        other: ``a(m) b(2m) a(2m) b(2m) a(m)`` with ``m = samples // 2`` (at least 1) and
        ``a`` the running count (``base`` if neither runs), so each has ``4m`` samples (8 by
        default), taken at about the same mean time. A slow or fast spell of the machine (a
        drift in its speed) then weighs on both alike, and a drift linear over the trial all
        but cancels. The first batch after each switch is no sample (class docstring), so the
        trial takes ``8m + 4`` batches (one more when it starts with a switch).

        Measuring the two in turn instead (the running count to ``2 * samples``, then the
        other) let a spell decide: in ``bench.tuner_noise --rechecks 1 --drift 0.1`` (a 10%
        drift of the machine's speed, correlating over 20 batches) 7.1% of runs ended more
        than 5% behind the best ``n``; alternating, 2.5% (docs/pipeline-bench.md, "Fourteenth
        pass")."""
        a, b = (k, base) if self.n == k else (base, k)
        m = max(self.samples // 2, 1)
        self._trial = _Trial(
            k,
            base,
            settle=tie or k in self._midpoints(base),
            tie=tie,
            blocks=((a, m), (b, 2 * m), (a, 2 * m), (b, 2 * m), (a, m)),
        )
        self.n = a

    def _trial_step(self) -> int:
        """Point ``n`` at the trial's current block, or end the trial once every block has
        its samples."""
        t = self._trial
        due = {c: 0 for c in t.walls}
        for c, m in t.blocks:
            due[c] += m
            if len(t.walls[c]) < due[c]:
                self.n = c
                return self.n
        return self._end_trial()

    def _end_trial(self) -> int:
        """Judge the trial on its own samples (the trimmed means): ``k`` must still beat
        ``base`` by more than ``tolerance``, or for a tie (``tie``: a larger count level with
        the settled one, `_level_above`) be no more than ``tolerance`` behind it. A win moves
        the base to ``k`` (and settles there when ``k`` is a midpoint or a tie, as a
        first-hand win would); a loss keeps ``base``, and the re-check goes on without ``k``.
        Either way the trial's samples replace the two counts' older ones."""
        t, self._trial = self._trial, None
        k, base = t.k, t.base
        self._walls.update(t.walls)
        bar = 1 + self.tolerance if t.tie else 1 - self.tolerance
        if self._mean(k) < self._mean(base) * bar:
            self._base = self.n = k
            return self._settle(k) if t.settle else self._step()
        self._refuted.add(k)
        self._base = self.n = base
        return self._step()

    def _settle(self, n: int) -> int:
        self._base = self.n = n
        self._confirm_to = 0
        self._settled_at = len(self.history)
        self._settled_once = True
        return self.n

    def _settle_first_search(self) -> int:
        """Settle by the tie rule, or keep ``n`` on a close call's count being measured again."""
        choice = self._break_tie()
        return self.n if choice is None else self._settle(choice)

    def _break_tie(self) -> int | None:
        """The count the first search settles on, or None after pointing ``n`` at a close
        call's count that is to be measured again (class docstring, 3. and 4.)."""
        while True:
            means = {k: m for k in self._walls if (m := self._mean(k)) is not None}
            fastest = min(means.values())
            if not self.prefer_larger:
                return min(means, key=means.__getitem__)
            near = [k for k, m in means.items() if m <= fastest * (1 + 3 * self.tolerance)]
            if self._confirm_to:  # a round of measuring again: each near count as often
                for k in sorted(near, key=lambda k: k != self.n):  # the running n first
                    if len(self._walls[k]) < self._confirm_to:
                        self.n = k
                        return None
            pick = max(k for k in near if means[k] <= fastest * (1 + self.tolerance))
            if (means[pick] == fastest and pick == max(near)) or self._confirmed >= self.confirm:
                return pick
            # a close call: the pick is not the fastest (did the larger count win the tie by
            # its luck?) or a larger count lost by less than three tolerances (by its bad luck
            # or the fastest's good luck?). Measure every near count again, each as often.
            self._confirmed += 1
            self._confirm_to = max(len(self._walls[k]) for k in near) + self.samples

    def _midpoints(self, base: int) -> list[int]:
        """The geometric midpoints between ``base`` and each measured neighbour (``2n`` and
        ``n/2``) that are counts of their own, the one towards the faster neighbour first.

        The doubling search only sees powers of two times the rule's start, and a neighbour
        that is slower on one side says little about the midpoint on the other: from a start
        of 3 the search sees 3, 6 and 12, and when 3 beat 12 the midpoint towards it (4) was
        the only one tried while 8, the sweep's fastest in 10 of 12 ``bench.pipeline`` runs,
        was never measured (docs/pipeline-bench.md, "Fifth pass")."""
        near = sorted(
            (m, k)
            for k in (min(base * 2, self.batch), max(base // 2, 1))
            if k != base and (m := self._mean(k)) is not None
        )
        mids = [round(math.sqrt(base * k)) for _, k in near]
        return [m for i, m in enumerate(mids) if m not in (base, near[i][1]) and m not in mids[:i]]
