"""Fixed-point encoding of cut activations in the ring Z_2^k, for the secure sum. Pure numpy.

A real ``x`` is encoded as ``round(x * 2^frac) mod 2^k`` (two's complement in a ``uint<k>``
word); numpy's unsigned arithmetic wraps, so adding words is addition mod ``2^k``. Decoding
reads the word as signed and divides by ``2^frac``: exact for any sum whose true value lies in
``(-2^(k-1), 2^(k-1))`` ring units.

Overflow is impossible by construction: every summand is checked against ``bound``
(`Ring.encode` refuses a larger value) and `Ring.check_parties` refuses a ring in which ``K``
summands of ``bound`` could reach ``2^(k-1)``. The rounding error of a sum of ``K`` values is at
most ``K * 2^-(frac+1)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tandem.errors import ConfigError

#: ring sizes a secure sum may use, and the unsigned/signed words of each
RING_BITS = {32: (np.uint32, np.int32), 64: (np.uint64, np.int64)}


class SumOverflowError(ConfigError):
    """A value, or a sum of values, would not fit the ring of the secure sum."""


@dataclasses.dataclass(frozen=True)
class Ring:
    """``Z_2^bits`` with scale ``2^-frac``; summands must satisfy ``|x| <= bound``.

    Invariant: ``bound * 2^frac < 2^(bits-1)`` (one summand fits); `check_parties` extends it
    to ``K`` summands."""

    bits: int = 32
    frac: int = 16
    bound: float = 64.0

    def __post_init__(self) -> None:
        if self.bits not in RING_BITS:
            raise ConfigError(
                f"model.sum_ring_bits must be one of {sorted(RING_BITS)}, got {self.bits!r}"
            )
        if not 0 <= self.frac < self.bits - 1:
            raise ConfigError(
                f"model.sum_frac_bits must be in [0, {self.bits - 2}] for a {self.bits}-bit "
                f"ring, got {self.frac!r}"
            )
        if not self.bound > 0:
            raise ConfigError(f"model.sum_bound must be > 0, got {self.bound!r}")
        self.check_parties(1)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(RING_BITS[self.bits][0])

    @property
    def scale(self) -> float:
        return float(2**self.frac)

    def check_parties(self, k: int) -> None:
        """Refuse a ring in which ``k`` summands of ``|x| <= bound`` could overflow."""
        if k * self.bound * self.scale >= 2 ** (self.bits - 1):
            top = (2 ** (self.bits - 1)) / (k * self.scale)
            raise SumOverflowError(
                f"a secure sum of {k} cuts with |x| <= {self.bound} (model.sum_bound) at scale "
                f"2^-{self.frac} (model.sum_frac_bits) can overflow the {self.bits}-bit ring: "
                f"need {k} * bound * 2^{self.frac} < 2^{self.bits - 1}. Lower model.sum_bound "
                f"below {top:g}, lower model.sum_frac_bits, or set model.sum_ring_bits = 64"
            )

    def encode(self, x: np.ndarray, *, where: str = "the cut") -> np.ndarray:
        """``x`` as ring words; `SumOverflowError` if some ``|x| > bound`` (or is not finite)."""
        x = np.asarray(x, dtype=np.float64)
        peak = float(np.max(np.abs(x))) if x.size else 0.0
        if not peak <= self.bound:  # also catches nan
            raise SumOverflowError(
                f"{where} holds |x| = {peak:g} > model.sum_bound = {self.bound}: the secure sum "
                "refuses a value it cannot add without overflow. Raise model.sum_bound (all "
                "parties, same value), or bound the bottom model's output (e.g. a tanh last "
                "layer)"
            )
        signed = RING_BITS[self.bits][1]
        return np.rint(x * self.scale).astype(signed).view(self.dtype)

    def decode(self, words: np.ndarray) -> np.ndarray:
        """Ring words (a sum of encodings) back to float32."""
        signed = RING_BITS[self.bits][1]
        w = np.asarray(words, dtype=self.dtype).view(signed)
        return (w.astype(np.float64) / self.scale).astype(np.float32)

    def to_dict(self) -> dict:
        return {"bits": int(self.bits), "frac": int(self.frac), "bound": float(self.bound)}
