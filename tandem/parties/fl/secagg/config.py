"""`SecAggConfig`: the settings of secure aggregation, and the numbers derived from them."""

from __future__ import annotations

import dataclasses
import math

from tandem.errors import ConfigError

from .masking import check_overflow

NOISE_TAIL = 6.0
"""A client's noise share is cut at this many of its standard deviations (a ring bound)."""


@dataclasses.dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation of a federated server (``[secagg]`` in its TOML).

    * ``max_dropout``: the share of a round's sampled clients that may drop out after they
      start (at any stage) with the round still completing; the Shamir threshold is
      ``t = n - floor(max_dropout * n)`` of the ``n`` sampled, and must exceed ``n / 2``
      (so ``max_dropout < 0.5``);
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_dropout < 0.5:
            raise ConfigError(
                f"secagg.max_dropout must be in [0, 0.5) (the threshold must exceed half the "
                f"round's clients), got {self.max_dropout}"
            )
        for key in ("scale", "clip", "stage_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"secagg.{key} must be > 0, got {getattr(self, key)}")
        if not self.noise_std >= 0:
            raise ConfigError(f"secagg.noise_std must be >= 0, got {self.noise_std}")

    def threshold(self, n: int) -> int:
        """Shares needed to rebuild a secret in a round of ``n`` sampled clients."""
        return max(n // 2 + 1, n - math.floor(self.max_dropout * n))

    def client_noise(self, n: int) -> float:
        """Each client's noise standard deviation in a round of ``n`` sampled clients."""
        return self.noise_std / math.sqrt(n)

    def bound(self, n: int) -> float:
        """The largest magnitude a client's encoded coordinate can have (clip + noise cut)."""
        return self.clip + NOISE_TAIL * self.client_noise(n)

    def check(self, n: int) -> None:
        """Refuse a round of ``n`` clients whose ring sum could overflow."""
        check_overflow(n, self.bound(n), self.scale)
