"""Micro-batching: group boundaries and the automatic group count.

`group_bounds(B, n)` cuts a batch of ``B`` rows into ``n`` contiguous groups whose sizes differ
by at most one (the first ``B % n`` groups get the extra row), so at most two shapes occur and
jitted kernels trace at most twice.

`rule_groups` is the method's closed form ``n = ceil(bytes_to_send / bandwidth / compute_time)``
clamped to ``[1, B]``. `GroupTuner` re-tunes ``n`` between batches from measurements (see
docs/design.md, "Choosing n"): it fits the per-group cost ``c0`` of the pipeline model
``W(n) = max(Tc, Tl) + min(Tc, Tl) / n + n * c0`` from the last batch's wall time ``W`` and picks
``n = sqrt(min(Tc, Tl) / c0)``, the model's optimum, using the method's rule as the starting point.
"""

from __future__ import annotations

import dataclasses
import math

from .errors import ConfigError


def group_bounds(batch: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``(start, stop)`` row ranges covering ``range(batch)``."""
    if batch < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch}")
    if not 1 <= n <= batch:
        raise ConfigError(f"n_groups must be in [1, batch={batch}], got {n}")
    base, extra = divmod(batch, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def clamp_groups(n: float, batch: int) -> int:
    return int(min(max(1, math.ceil(n)), batch))


def rule_groups(bytes_to_send: float, bandwidth: float | None, compute_time: float,
                batch: int) -> int:
    """The method's rule ``ceil(bytes_to_send / bandwidth / compute_time)``, clamped to
    ``[1, batch]``; an unmeasured or infinite bandwidth gives 1 (nothing to hide)."""
    if not bandwidth or bandwidth <= 0 or compute_time <= 0:
        return 1
    return clamp_groups(bytes_to_send / bandwidth / compute_time, batch)


@dataclasses.dataclass
class GroupTuner:
    """Chooses ``n`` for the next batch from the last batch's measurements.

    Call `observe` after each batch with the wall time, the local compute busy time, the bytes
    the busiest link direction carried and its measured bandwidth; read `n` before the next.
    """

    batch: int
    n: int = 0
    min_group_cost: float = 1e-4  # floor on c0 so n stays finite on near-ideal links
    history: list[dict] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n <= 0:
            self.n = min(4, self.batch)

    def observe(self, *, wall: float, compute: float, link_bytes: float,
                bandwidth: float | None) -> int:
        link = link_bytes / bandwidth if bandwidth else 0.0
        hi, lo = max(compute, link), min(compute, link)
        n = self.n
        if lo <= 0:
            new = 1
        else:
            c0 = max((wall - hi - lo / n) / n, self.min_group_cost)
            new = clamp_groups(math.sqrt(lo / c0), self.batch)
            if not self.history:  # first measurement: start from the method's rule as well
                new = max(new, rule_groups(link_bytes, bandwidth, compute, self.batch))
        self.history.append({"n": n, "wall": wall, "compute": compute, "link": link, "next": new})
        # move geometrically, at most x2 per batch, so one noisy batch cannot swing n far
        self.n = int(min(max(new, max(1, n // 2)), n * 2, self.batch))
        return self.n
