"""The server TOML's ``[dp]`` and ``[aggregation]`` sections (typed, checked once; built into
`dp.DPConfig` and an `aggregator.Aggregator` by the server process).

    [dp]              # client-level differential privacy (its presence turns it on)
    mode = "central"  # or "distributed" (needs [secagg]: the clients add the noise shares)
    clip = 1.0        # L2 clip norm of a client's update (the initial one when adaptive)
    noise_multiplier = 1.0   # or target_epsilon = 8.0 (the multiplier is then solved for)
    delta = 1e-5      # default 1 / (number of clients)
    adaptive = false  # adaptive clipping (Andrew et al. 2021): quantile, clip_lr, count_std
    sampling = "poisson"     # or "fixed": how the accountant models the round's sampling

    [aggregation]
    rule = "mean"     # "median" | "trimmed_mean" | "krum" | "multi_krum" | "norm_bound"
    byzantine = 1     # Krum's f;  multi = 3: Multi-Krum's m;  trim = 0.1;  norm = 1.0
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tandem.parties.config import Section
from tandem.parties.config.base import Invalid

from .dp import MODES, SAMPLINGS, DPConfig, noise_for_epsilon
from .robust import RULES, build_rule


class DPTable(Section):
    """``[dp]``: see `tandem.parties.fl.dp.DPConfig` for each key."""

    mode: str = "central"
    clip: float = Field(default=1.0, gt=0)
    noise_multiplier: float | None = Field(default=None, gt=0)
    target_epsilon: float | None = Field(default=None, gt=0)
    delta: float | None = Field(default=None, gt=0, lt=1)
    adaptive: bool = False
    quantile: float = Field(default=0.5, gt=0, lt=1)
    clip_lr: float = Field(default=0.2, gt=0)
    count_std: float | None = Field(default=None, gt=0)
    sampling: str = "poisson"

    @model_validator(mode="after")
    def _choices(self) -> DPTable:
        if self.mode not in MODES:
            raise Invalid("mode", f"must be one of {list(MODES)}, got {self.mode!r}")
        if self.sampling not in SAMPLINGS:
            raise Invalid("sampling", f"must be one of {list(SAMPLINGS)}, got {self.sampling!r}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise Invalid(
                "",
                "[dp] needs exactly one of noise_multiplier (e.g. 1.0) and target_epsilon "
                "(e.g. 8.0, the multiplier is then solved for the configured rounds)",
            )
        return self

    def build(self, *, rounds: int, sampled: int, clients: int) -> DPConfig:
        """The `DPConfig` for ``rounds`` rounds of ``sampled`` of ``clients`` clients."""
        delta = self.delta if self.delta is not None else 1.0 / clients
        z = self.noise_multiplier
        if z is None:
            assert self.target_epsilon is not None  # Invariant: checked by _choices
            z = noise_for_epsilon(
                self.target_epsilon,
                rounds=rounds,
                sampled=sampled,
                clients=clients,
                delta=delta,
                sampling=self.sampling,
            )
        count_std = self.count_std
        if count_std is None:  # Andrew et al.: m / 20, kept above the z / 2 floor
            count_std = max(sampled / 20, z)
        return DPConfig(
            clip=self.clip,
            noise_multiplier=z,
            delta=delta,
            mode=self.mode,
            adaptive=self.adaptive,
            quantile=self.quantile,
            clip_lr=self.clip_lr,
            count_std=count_std,
            sampling=self.sampling,
        )


class AggregationTable(Section):
    """``[aggregation]``: how the server combines a round's updates (`robust.build_rule`)."""

    rule: str = "mean"
    byzantine: int = Field(default=0, ge=0, description="Krum's f, the attackers tolerated")
    multi: int | None = Field(default=None, ge=1, description="Multi-Krum's m (default n - f)")
    trim: float = Field(default=0.1, ge=0, lt=0.5, description="trimmed_mean's share per end")
    norm: float = Field(default=1.0, gt=0, description="norm_bound's L2 bound")

    @model_validator(mode="after")
    def _rule(self) -> AggregationTable:
        if self.rule not in RULES:
            raise Invalid("rule", f"must be one of {list(RULES)}, got {self.rule!r}")
        return self

    def build(self) -> Any:
        return build_rule(
            self.rule, byzantine=self.byzantine, multi=self.multi, trim=self.trim, norm=self.norm
        )


__all__ = ["AggregationTable", "DPTable"]
