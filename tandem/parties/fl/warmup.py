"""The compression ramp of a compressed federation: dense first, then sparser each round.

A cold model moves in every coordinate at once: FedAdam's first steps are about
``lr * sign(g)`` on each of them, and a local update from random weights has no few large
entries for top-k to find. A round that carries 1/60 of the coordinates up (rand-k) and
applies 1/50 of them (the server's top-k) then moves the model by a small share of what a
dense round moves it: on a non-IID tabular task (``bench.fl_compressed``) compressed FL
starts below the majority class and ends points below dense. Once the model is near a good
region, its updates are small corrections that sparse rounds carry well.

`Warmup` says how round ``r`` compresses, as a share of coordinates (its `density`):

* rounds ``0 .. dense_rounds - 1``: dense both ways (dense uplink, every coordinate applied,
  so the downlink delta is the whole model);
* the next ``ramp_rounds`` rounds: the share falls geometrically from 1 towards the configured
  one, ``density = floor ** (j / (ramp_rounds + 1))`` for ramp round ``j = 1 ..``;
* then the configured compression (``floor``) for good.

`round_compression` turns that share into the round's uplink (rand-k ``k``, sketch columns)
and server top-k. It is a pure function of the round, so a restored server, a simulation and
a long-lived one agree on every round's setting. Invariant: the round's setting is never
sparser than the configured one, and dense (``{"kind": "dense"}``, top-k None) exactly when
the share reaches every coordinate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tandem.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Warmup:
    """``dense_rounds`` dense rounds, then ``ramp_rounds`` rounds of geometrically falling
    density, then the configured compression (see the module). ``Warmup(0, 0)`` is off."""

    dense_rounds: int = 2
    ramp_rounds: int = 4

    def __post_init__(self) -> None:
        if self.dense_rounds < 0 or self.ramp_rounds < 0:
            raise ConfigError(
                "compression.warmup_rounds and compression.ramp_rounds must be >= 0, got "
                f"{self.dense_rounds} and {self.ramp_rounds}"
            )

    def density(self, r: int, floor: float) -> float:
        """Share of coordinates round ``r`` carries when the configured share is ``floor``."""
        if r < self.dense_rounds:
            return 1.0
        j = r - self.dense_rounds + 1
        if j > self.ramp_rounds:
            return floor
        return max(floor, floor ** (j / (self.ramp_rounds + 1)))


def _share(k: int, d: int, density: float) -> int:
    """``max(k, ceil(d * density))``, at most ``d``."""
    return min(d, max(k, math.ceil(d * density)))


def round_compression(
    warmup: Warmup | None, r: int, uplink: Mapping[str, Any], topk: int | None, d: int
) -> tuple[dict[str, Any], int | None]:
    """Round ``r``'s ``(uplink, topk)`` from the configured ones (`Warmup`; None: as
    configured). Each part ramps from its own configured share: rand-k ``k / d``, a sketch's
    ``rows * cols / d``, top-k ``topk / d``."""
    uplink = dict(uplink)
    if warmup is None or d < 1:
        return uplink, topk
    kind = uplink["kind"]
    if kind == "randk":
        k = _share(int(uplink["k"]), d, warmup.density(r, int(uplink["k"]) / d))
        uplink = {"kind": "dense"} if k >= d else {**uplink, "k": k}
    elif kind == "sketch":
        rows, cols = int(uplink["rows"]), int(uplink["cols"])
        share = warmup.density(r, rows * cols / d)
        cols = max(cols, math.ceil(d * share / rows))
        uplink = {"kind": "dense"} if rows * cols >= d else {**uplink, "cols": cols}
    if topk is not None:
        topk = _share(topk, d, warmup.density(r, topk / d))
        topk = None if topk >= d else topk
    return uplink, topk


__all__ = ["Warmup", "round_compression"]
