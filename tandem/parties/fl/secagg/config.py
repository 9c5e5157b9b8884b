"""`SecAggConfig`: the settings of secure aggregation, and the numbers derived from them."""

from __future__ import annotations

import dataclasses
import math

from tandem.errors import ConfigError

from .graph import harary_parameters, threshold_for
from .masking import check_overflow

NOISE_TAIL = 6.0
"""A client's noise share is cut at this many of its standard deviations (a ring bound)."""


@dataclasses.dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation of a federated server (``[secagg]`` in its TOML).

    * ``max_dropout``: the share of a round's sampled clients that may drop out after they
      start (at any stage) with the round still completing (always with the complete graph,
      whose Shamir threshold is ``t = n - floor(max_dropout * n)`` of the ``n`` sampled and
      must exceed ``n / 2``, so ``max_dropout < 0.5``; with SecAgg+'s sparse graph except
      with probability below ``2**-20``);
    * ``neighbours``: who shares with whom (`tandem.parties.fl.secagg.graph`): ``"auto"``
      (SecAgg+, Bell et al. 2020: the smallest even degree that meets the guarantees for the
      round's size, ``corrupt_share`` and ``max_dropout``; the complete graph when none
      smaller does), ``"all"`` (SecAgg's complete graph), or an even degree ``k`` (refused
      when too small to meet the guarantees);
    * ``corrupt_share``: the share of a round's clients assumed to collude with the server
      (sizes the sparse graph; with the complete graph, ``t`` exceeds it by construction);
    * ``scale``: fixed-point scale of the ring Z_2^32 (a coordinate ``x`` travels as
      ``round(x * scale)``);
    * ``clip``: each payload coordinate is clipped to ``[-clip, clip]`` before encoding;
    * ``stage_timeout``: seconds the server waits for each stage after the clients' training;
    * ``noise_std``: the distributed-DP hook: the standard deviation of Gaussian noise in the
      *sum*; each of the ``n`` sampled clients adds a share ``N(0, noise_std**2 / n)`` to its
      clipped payload inside the secure sum (cut at `NOISE_TAIL` of its deviations). 0: none.

    Invariant (checked per round by `bound`/`check`): ``n * bound * scale < 2**31``, so the
    ring sum cannot overflow.
    """

    max_dropout: float = 0.3
    scale: float = float(2**20)
    clip: float = 1.0
    stage_timeout: float = 30.0
    noise_std: float = 0.0
    neighbours: int | str = "auto"
    corrupt_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_dropout < 0.5:
            raise ConfigError(
                f"secagg.max_dropout must be in [0, 0.5) (the threshold must exceed half the "
                f"round's clients), got {self.max_dropout}"
            )
        for key in ("scale", "clip", "stage_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"secagg.{key} must be > 0, got {getattr(self, key)}")
        if not 0.0 <= self.corrupt_share < 0.5:
            raise ConfigError(f"secagg.corrupt_share must be in [0, 0.5), got {self.corrupt_share}")
        k = self.neighbours
        if isinstance(k, bool) or not (
            k in ("auto", "all") or (isinstance(k, int) and k >= 2 and k % 2 == 0)
        ):
            raise ConfigError(
                f'secagg.neighbours must be "auto", "all" or an even degree >= 2, got {k!r}'
            )
        if not self.noise_std >= 0:
            raise ConfigError(f"secagg.noise_std must be >= 0, got {self.noise_std}")

    def threshold(self, n: int) -> int:
        """Shares needed to rebuild a secret in a round of ``n`` sampled clients."""
        return max(n // 2 + 1, n - math.floor(self.max_dropout * n))

    def layout(self, n: int, sampled: int | None = None) -> tuple[int, int]:
        """``(k, t)`` for a round whose key list names ``n`` of its ``sampled`` clients (all by
        default): the degree (``n - 1``: the complete graph) and the shares needed to rebuild
        a secret (with the complete graph, of all ``n``; else of a client's ``k`` neighbours).
        Raises `ConfigError` for an explicit degree too small for ``n``."""
        complete = (n - 1, self.threshold(n if sampled is None else sampled))
        if self.neighbours == "all":
            return complete
        if self.neighbours == "auto":
            found = harary_parameters(n, self.corrupt_share, self.max_dropout)
            return complete if found is None else found
        k = int(self.neighbours)
        if k >= n - 1:
            return complete
        t = threshold_for(n, k, self.corrupt_share, self.max_dropout)
        if t is None:
            auto = harary_parameters(n, self.corrupt_share, self.max_dropout)
            best = "the complete graph" if auto is None else f"{auto[0]}"
            raise ConfigError(
                f"secagg.neighbours = {k} is too few for a round of {n} clients with "
                f"secagg.corrupt_share {self.corrupt_share} and secagg.max_dropout "
                f"{self.max_dropout}: the smallest degree that keeps the guarantees is {best} "
                '(or set secagg.neighbours = "auto")'
            )
        return k, t

    def client_noise(self, n: int) -> float:
        """Each client's noise standard deviation in a round of ``n`` sampled clients."""
        return self.noise_std / math.sqrt(n)

    def bound(self, n: int) -> float:
        """The largest magnitude a client's encoded coordinate can have (clip + noise cut)."""
        return self.clip + NOISE_TAIL * self.client_noise(n)

    def check(self, n: int) -> None:
        """Refuse a round of ``n`` clients whose ring sum could overflow, or whose explicit
        ``neighbours`` degree is too small."""
        check_overflow(n, self.bound(n), self.scale)
        self.layout(n)
