"""Client-level differential privacy of federated rounds (DP-FedAvg), pure functions only.

Each sampled client's payload (the vector that is summed: the dense delta, or its rand-k /
sketch payload, which the server decodes linearly afterwards) is clipped to L2 norm ``C``;
the sum of the clipped payloads gets Gaussian noise of standard deviation ``z * C`` on every
coordinate; the sum is divided by the round's count of contributions. Decoding is
post-processing, so the guarantee holds for the model too. Two places to add the noise:

* ``central``: the server clips each update and adds ``N(0, (z C)^2)`` to the sum. With secure
  aggregation the clients clip (the server never sees an update) and the server adds the noise
  to the secure sum;
* ``distributed``: under secure aggregation only; each of the round's ``m`` sampled clients adds
  a share ``N(0, (z C)^2 / t)`` inside the secure sum, ``t`` being the secure sum's Shamir
  threshold (the fewest survivors a round completes with). Any ``s >= t`` survivors' shares add
  to variance ``s / t * (z C)^2 >= (z C)^2``: the stated guarantee holds with up to
  ``m - t`` clients dropped, and noise grows (accuracy falls) as fewer drop.

Adaptive clipping (Andrew et al., NeurIPS 2021, "Differentially Private Learning with Adaptive
Clipping"): each client also reports the bit ``||p|| <= C``; the server sums the bits with
``N(0, count_std^2)`` noise and moves ``C <- C * exp(-clip_lr * (frac - quantile))`` so ``C``
tracks the ``quantile`` of update norms. The payload noise multiplier is then ``z_delta =
(z^-2 - (2 count_std)^-2)^-1/2`` so that the two releases together cost what one Gaussian of
multiplier ``z`` costs (their Theorem 1); the accountant charges ``z``.

The accountant is dp-accounting's RDP accountant (the ``privacy`` extra): each round is a
Gaussian of multiplier ``z`` sampled at ``q = m / N``, as Poisson sampling (``sampling =
"poisson"``, the usual analysis of DP-FedAvg) or as fixed-size sampling without replacement
(``"fixed"``, replace-one neighbours: one client's payload replaced moves the sum by up to
``2 C``, so the accountant's multiplier is ``z / 2``). Noise comes from the operating
system's entropy, never from the configured seed (a seed an attacker knows would let it
subtract the noise).

Against whom: amplification by sampling holds only against an observer who does not know
which clients a round sampled. The server samples them, so against the server (the adversary
of ``distributed``) each round a client took part in is a plain Gaussian of multiplier ``z``:
`unamplified_epsilon` composes the rounds of the client that took part in the most.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.errors import ConfigError

MODES = ("central", "distributed")
SAMPLINGS = ("poisson", "fixed")
ORDERS = (*range(2, 65), 80, 96, 112, 128, 160, 192, 224, 256)
"""Integer RDP orders (fractional ones make dp-accounting warn and add little): every order
to 64, where the best order of any epsilon above about 0.5 lies, then a sparse tail. The cost of
sampling without replacement grows with the sum of the orders (this set: a tenth of 2..255)."""


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """The DP settings of a federated server (``[dp]`` in its TOML; docs/federated.md).

    * ``mode``: "central" or "distributed" (see the module docstring);
    * ``clip``: the L2 clip norm ``C`` of a client's payload (the initial one when adaptive);
    * ``noise_multiplier``: ``z``; the noise on the sum has standard deviation ``z * C``;
    * ``delta``: the delta of the reported epsilon;
    * ``adaptive``, ``quantile``, ``clip_lr``, ``count_std``: adaptive clipping (Andrew et
      al.); ``count_std`` is the noise on the summed clipped bits (their advice: m / 20);
    * ``sampling``: how the accountant models the round's sampling ("poisson" or "fixed").
    """

    clip: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    mode: str = "central"
    adaptive: bool = False
    quantile: float = 0.5
    clip_lr: float = 0.2
    count_std: float = 1.0
    sampling: str = "poisson"

    def __post_init__(self) -> None:
        for key in ("clip", "noise_multiplier", "clip_lr", "count_std"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"dp.{key} must be > 0, got {getattr(self, key)}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"dp.delta must be in (0, 1), got {self.delta}")
        if not 0 < self.quantile < 1:
            raise ConfigError(f"dp.quantile must be in (0, 1), got {self.quantile}")
        if self.mode not in MODES:
            raise ConfigError(f"dp.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.sampling not in SAMPLINGS:
            raise ConfigError(
                f"dp.sampling must be one of {list(SAMPLINGS)}, got {self.sampling!r}"
            )
        if self.adaptive and 2 * self.count_std <= self.noise_multiplier:
            raise ConfigError(
                f"dp.count_std = {self.count_std} is too small for dp.noise_multiplier = "
                f"{self.noise_multiplier}: adaptive clipping needs 2 * count_std > "
                "noise_multiplier (the bits' share of the privacy budget); raise count_std "
                "(Andrew et al. suggest clients per round / 20)"
            )

    def payload_multiplier(self) -> float:
        """The multiplier of the payload noise: ``z``, or ``z_delta`` when adaptive."""
        z = self.noise_multiplier
        if not self.adaptive:
            return z
        return (z**-2 - (2 * self.count_std) ** -2) ** -0.5


def clip_l2(x: np.ndarray, clip: float) -> tuple[np.ndarray, bool]:
    """``x`` scaled to L2 norm at most ``clip`` (float32), and whether it was within it."""
    x = np.asarray(x, np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    if norm <= clip:
        return x, True
    return (x * np.float32(clip / norm)).astype(np.float32), False


def noisy_sum(
    payloads: Sequence[np.ndarray], clip: float, std: float, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """The sum of the payloads each clipped to ``clip``, plus ``N(0, std^2)`` per coordinate;
    and the count of payloads that were within ``clip``."""
    if not payloads:
        raise ConfigError("cannot sum zero updates")
    total = np.zeros(np.shape(payloads[0]), np.float64)
    within = 0
    for p in payloads:
        c, ok = clip_l2(p, clip)
        total += c
        within += ok
    if std > 0:
        total += rng.normal(0.0, std, total.shape)
    return total.astype(np.float32), within


def next_clip(
    cfg: DPConfig, clip: float, within: int, count: int, rng: np.random.Generator
) -> float:
    """Adaptive clipping's next clip norm after a round where ``within`` of ``count`` clients'
    payloads had norm at most ``clip`` (the count is released with ``N(0, count_std^2)``)."""
    if not cfg.adaptive or count <= 0:
        return clip
    frac = (within + rng.normal(0.0, cfg.count_std)) / count
    return float(clip * math.exp(-cfg.clip_lr * (frac - cfg.quantile)))


def _accountant(sampling: str) -> Any:
    from tandem._extras import needs

    with needs("privacy", "the differential-privacy accountant ([dp])"):
        import dp_accounting
        from dp_accounting import rdp
    relation = dp_accounting.NeighboringRelation
    if sampling == "fixed":
        return dp_accounting, rdp.RdpAccountant(ORDERS, relation.REPLACE_ONE)
    return dp_accounting, rdp.RdpAccountant(ORDERS)


def epsilon(
    z: float, *, rounds: int, sampled: int, clients: int, delta: float, sampling: str = "poisson"
) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds of the Gaussian mechanism of multiplier
    ``z`` with ``sampled`` of ``clients`` clients per round (dp-accounting, RDP)."""
    if rounds <= 0:
        return 0.0
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    one = np.asarray(_one_round_rdp(float(z), sampled, clients, sampling))
    return float(compute_epsilon(ORDERS, rounds * one, delta)[0])


def unamplified_epsilon(z: float, *, rounds: int, delta: float, sampling: str = "poisson") -> float:
    """Epsilon at ``delta`` of ``rounds`` Gaussian mechanisms of multiplier ``z`` without
    amplification by sampling (the same RDP accountant, `ORDERS` and neighbouring relation
    as `epsilon` with ``sampling``): the guarantee against an observer who knows which
    rounds a client took part in (the server), ``rounds`` being the most rounds any one
    client took part in."""
    return epsilon(z, rounds=rounds, sampled=1, clients=1, delta=delta, sampling=sampling)


@functools.lru_cache(maxsize=1024)
def _one_round_rdp(z: float, sampled: int, clients: int, sampling: str) -> tuple[float, ...]:
    """The RDP of one round at each of `ORDERS`; ``r`` rounds compose to ``r`` times it, as
    dp-accounting's ``compose(event, r)`` computes it. Cached: a server reports epsilon every
    round for the same round event."""
    dpa, acc = _accountant(sampling)
    # dp-accounting's multiplier is the noise's deviation over the L2 sensitivity: a sum of
    # payloads clipped to C changes by up to C when one client is added or removed
    # ("poisson"), by up to 2 C when one is replaced ("fixed"), so there it is z / 2 (with
    # adaptive clipping too: the count's sensitivity stays 1, and Theorem 1's combination of
    # the two releases then gives z / 2 as well)
    event = dpa.GaussianDpEvent(z / 2 if sampling == "fixed" else z)
    if sampled < clients:
        if sampling == "fixed":
            event = dpa.SampledWithoutReplacementDpEvent(clients, sampled, event)
        else:
            event = dpa.PoissonSampledDpEvent(sampled / clients, event)
    acc.compose(event, 1)
    return tuple(float(v) for v in acc.rdp)


def noise_for_epsilon(
    target: float,
    *,
    rounds: int,
    sampled: int,
    clients: int,
    delta: float,
    sampling: str = "poisson",
) -> float:
    """The smallest noise multiplier (to 0.1%) whose `epsilon` is at most ``target``."""
    if not target > 0:
        raise ConfigError(f"dp.target_epsilon must be > 0, got {target}")

    def eps(z: float) -> float:
        return epsilon(
            z, rounds=rounds, sampled=sampled, clients=clients, delta=delta, sampling=sampling
        )

    lo, hi = 0.05, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ConfigError(f"dp.target_epsilon = {target} is out of reach (noise > 1e4)")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    return hi


__all__ = [
    "DPConfig",
    "clip_l2",
    "epsilon",
    "next_clip",
    "noise_for_epsilon",
    "noisy_sum",
    "unamplified_epsilon",
]
